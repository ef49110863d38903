//! The repository's trained fixtures (`tests/fixtures`: BERT4Rec and Mult-VAE checkpoints with
//! their configs, item maps, PyTorch's golden outputs and a leave-one-out test set), for the tests
//! and benches of every crate: the one place that knows where they are and how to convert them.
//! Compiled only with the `fixtures` feature, which only dev-dependencies (and the benches) enable.

use std::path::{Path, PathBuf};

use crate::config::ModelKind;
use crate::convert::{convert as convert_checkpoint, ConvertRequest};
use crate::engine::Engine;
use crate::engine_dir::Precision;
use crate::error::{EngineError, Result};

/// The fixtures folder: `RECSYS_FIXTURES` when set (the GPU bundle's test binaries run far from
/// the source tree), else the repository's `tests/fixtures`.
pub fn dir() -> PathBuf {
    std::env::var_os("RECSYS_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

/// The folder of one model's fixture.
pub fn model_dir(kind: ModelKind) -> PathBuf {
    dir().join(match kind {
        ModelKind::Bert4rec => "bert4rec",
        ModelKind::Vaecf => "multivae",
        ModelKind::Sasrec => "sasrec",
        ModelKind::Gru4rec => "gru4rec",
        ModelKind::Hstu => "hstu",
    })
}

/// The model's hyper-parameters (`config.json`).
pub fn config(kind: ModelKind) -> Result<serde_json::Map<String, serde_json::Value>> {
    let path = model_dir(kind).join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
        context: format!("cannot read {}", path.display()),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| EngineError::Config(format!("{}: {e}", path.display())))
}

/// Converts the fixture's `checkpoint` (a file of its folder, e.g. "model.safetensors") into
/// `out` at `precision` (weight-only for int8) and returns the loaded engine.
pub fn convert(
    kind: ModelKind,
    checkpoint: &str,
    out: &Path,
    precision: Precision,
) -> Result<Engine> {
    let config = config(kind)?;
    convert_checkpoint(&ConvertRequest {
        kind: Some(kind),
        checkpoint: &model_dir(kind).join(checkpoint),
        config: Some(&config),
        item_map: crate::ItemMapSource::Tsv(&model_dir(kind).join("item_id_map.tsv")),
        out,
        precision,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
}
