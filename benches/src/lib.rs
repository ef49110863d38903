//! Shared set-up for the benches: engines converted from the fixture checkpoints, and request
//! histories drawn from the fixture test set (real users, real length distribution).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use recsys_engine::metrics::read_test_set;
use recsys_engine::{convert, ConvertRequest, Engine, ExternalIds, ModelKind};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// Converts a fixture model into a temporary directory (kept alive by the returned guard).
pub fn fixture_engine(kind: ModelKind) -> (Engine, tempfile::TempDir) {
    let dir = fixtures().join(match kind {
        ModelKind::Bert4rec => "bert4rec",
        ModelKind::Vaecf => "multivae",
    });
    let config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert(&ConvertRequest {
        kind,
        checkpoint: &dir.join("model.safetensors"),
        config: Some(&config),
        item_map: &dir.join("item_id_map.tsv"),
        out: &tmp.path().join("engine"),
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
    })
    .unwrap();
    (engine, tmp)
}

/// The first `n` test-set histories as internal indices.
pub fn test_histories(engine: &Engine, n: usize) -> Vec<Vec<u32>> {
    read_test_set(&fixtures().join("test_set.tsv"))
        .unwrap()
        .iter()
        .take(n)
        .map(|case| {
            let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
            engine.ids.map(ExternalIds::Str(&ids)).indices
        })
        .collect()
}
