//! Shared helpers for tests that use the PyTorch fixtures in `tests/fixtures`.
#![allow(dead_code)]

use std::path::Path;

pub mod cut;
pub mod reference;

pub use recsys_engine::engine_dir::Precision;
use recsys_engine::{convert, ConvertRequest, Engine, ModelKind};

/// Largest |logit - PyTorch f32 logit| accepted. The models' logits reach about 10 in magnitude;
/// f32 rounding through 2 transformer layers or a 2001-wide encoder was measured at 3e-6..7e-6.
pub const LOGIT_ABS_TOL: f32 = 5e-5;

#[allow(unused_imports)]
pub use recsys_engine::fixtures::{config, dir as fixtures, model_dir};

pub fn config_json(kind: ModelKind) -> serde_json::Map<String, serde_json::Value> {
    config(kind).unwrap()
}

/// Converts a fixture checkpoint into `out` (fp32) and loads it.
pub fn convert_fixture(kind: ModelKind, checkpoint: &str, out: &Path) -> Engine {
    convert_fixture_at(kind, checkpoint, out, Precision::Fp32)
}

/// Converts a fixture checkpoint into `out` at `precision` and loads it.
pub fn convert_fixture_at(
    kind: ModelKind,
    checkpoint: &str,
    out: &Path,
    precision: Precision,
) -> Engine {
    recsys_engine::fixtures::convert(kind, checkpoint, out, precision)
        .unwrap_or_else(|e| panic!("converting {checkpoint}: {e}"))
}

/// Converts the fixture's safetensors checkpoint into `out` at `precision` with `screen`.
pub fn convert_fixture_screened(
    kind: ModelKind,
    out: &Path,
    precision: Precision,
    screen: recsys_engine::engine_dir::Screen,
) -> recsys_engine::Result<Engine> {
    convert_fixture_with(kind, out, precision, screen, Default::default())
}

/// [`convert_fixture_screened`] with catalogue data (item attributes, popularity) stored too.
pub fn convert_fixture_with(
    kind: ModelKind,
    out: &Path,
    precision: Precision,
    screen: recsys_engine::engine_dir::Screen,
    catalogue: recsys_engine::CatalogueInputs<'_>,
) -> recsys_engine::Result<Engine> {
    let config = config_json(kind);
    let model = model_dir(kind);
    let (checkpoint, item_map) = (
        model.join("model.safetensors"),
        model.join("item_id_map.tsv"),
    );
    recsys_engine::convert(&ConvertRequest {
        screen,
        catalogue,
        ..request(kind, &checkpoint, &config, &item_map, out, precision)
    })
}

/// The conversion of `checkpoint` (with its `config` and `item_map`) into `out` at `precision`,
/// everything else at its default: what each helper here starts from.
pub fn request<'a>(
    kind: ModelKind,
    checkpoint: &'a Path,
    config: &'a serde_json::Map<String, serde_json::Value>,
    item_map: &'a Path,
    out: &'a Path,
    precision: Precision,
) -> ConvertRequest<'a> {
    ConvertRequest {
        kind: Some(kind),
        checkpoint,
        config: Some(config),
        item_map: recsys_engine::ItemMapSource::Tsv(item_map),
        out,
        precision,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    }
}

/// A small deterministic generator (the tests need no randomness crate).
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Converts the fixture's safetensors checkpoint to a W8A8 engine calibrated on `histories`.
pub fn convert_fixture_w8a8(
    kind: ModelKind,
    out: &Path,
    histories: &[Vec<String>],
    method: recsys_engine::calibration::CalibrationMethod,
) -> Engine {
    let config = config_json(kind);
    let model = model_dir(kind);
    let (checkpoint, item_map) = (
        model.join("model.safetensors"),
        model.join("item_id_map.tsv"),
    );
    convert(&ConvertRequest {
        calibration: Some((histories, method)),
        ..request(kind, &checkpoint, &config, &item_map, out, Precision::Int8)
    })
    .unwrap_or_else(|e| panic!("converting to w8a8: {e}"))
}

/// The fixture's safetensors checkpoint at every serving precision, converted under `dir`:
/// fp32, fp16, bf16, int8 weight-only and W8A8 (calibrated on the test set's first 256
/// histories).
pub fn engines_at_every_precision(kind: ModelKind, dir: &Path) -> Vec<(&'static str, Engine)> {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let calibration: Vec<Vec<String>> = cases.iter().take(256).map(|c| c.history.clone()).collect();
    let mut engines: Vec<(&'static str, Engine)> = [
        ("fp32", Precision::Fp32),
        ("fp16", Precision::Fp16),
        ("bf16", Precision::Bf16),
        ("int8", Precision::Int8),
    ]
    .into_iter()
    .map(|(variant, precision)| {
        let engine = convert_fixture_at(kind, "model.safetensors", &dir.join(variant), precision);
        (variant, engine)
    })
    .collect();
    let w8a8 = convert_fixture_w8a8(
        kind,
        &dir.join("w8a8"),
        &calibration,
        recsys_engine::calibration::CalibrationMethod::Percentile { percentile: 99.99 },
    );
    engines.push(("w8a8", w8a8));
    engines
}

pub struct Golden {
    pub cases: Vec<serde_json::Value>,
    pub logits_f32: Vec<f32>,
    pub n_outputs: usize,
}

/// The fixture's golden cases with every logit of each: PyTorch's (`golden.safetensors`) for
/// BERT4Rec and Mult-VAE; for SASRec and GRU4Rec, whose golden files hold RecBole's top 100 only,
/// the f64 reference's ([`reference`], checked against those top 100 in `sequential_parity.rs`),
/// rounded to f32. A case with no known item has logits of 0 (it has no answer).
pub fn golden(kind: ModelKind) -> Golden {
    let dir = model_dir(kind);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    if kind.needs_history() {
        let cases = json["cases"].as_array().unwrap().clone();
        let sd = reference::StateDict::read(&dir.join("model.safetensors"));
        let config = config_json(kind);
        let mut logits_f32 = Vec::new();
        let mut n_outputs = 0;
        for case in &cases {
            let history = u32s(&case["effective_history_internal"]);
            let logits = if history.is_empty() {
                vec![0.0; n_outputs.max(1)]
            } else {
                let hidden = match kind {
                    ModelKind::Sasrec => {
                        let heads = config["n_heads"].as_u64().unwrap() as usize;
                        reference::sasrec_hidden(&sd, &history, heads)
                    }
                    _ => {
                        let max_len = config["max_seq_length"].as_u64().unwrap() as usize;
                        reference::gru4rec_hidden(&sd, &history, max_len)
                    }
                };
                reference::dot_logits(&sd, &hidden)
            };
            n_outputs = logits.len();
            logits_f32.extend(logits.iter().map(|&v| v as f32));
        }
        return Golden {
            cases,
            logits_f32,
            n_outputs,
        };
    }
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits_f32").unwrap();
    let n_outputs = logits.shape()[1];
    let logits_f32 = logits
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Golden {
        cases: json["cases"].as_array().unwrap().clone(),
        logits_f32,
        n_outputs,
    }
}

pub fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn i64s(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// Each request's answer as (item, score bits) pairs, best first: what the plan tests compare
/// across kernels, row blocks, screens and thread counts, which must never change a bit.
pub fn ranked_bits(
    engine: &Engine,
    requests: &[recsys_engine::InternalRequest],
) -> Vec<Vec<(u32, u32)>> {
    engine
        .recommend_internal(requests)
        .into_iter()
        .map(|(items, _, _)| items.iter().map(|s| (s.index, s.score.to_bits())).collect())
        .collect()
}
