//! Shared set-up for the benches: engines converted from the fixture checkpoints, and request
//! histories drawn from the fixture test set (real users, real length distribution).
#![forbid(unsafe_code)]

use recsys_engine::metrics::read_test_set;
use recsys_engine::{Engine, ExternalIds, ModelKind};

pub use recsys_engine::fixtures::dir as fixtures;

/// Converts a fixture model into a temporary directory (kept alive by the returned guard).
pub fn fixture_engine(kind: ModelKind) -> (Engine, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let engine = recsys_engine::fixtures::convert(
        kind,
        "model.safetensors",
        &tmp.path().join("engine"),
        recsys_engine::engine_dir::Precision::Fp32,
    )
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
