//! Test helpers shared by the backend's unit tests.

use recsys_engine::{Engine, ModelKind};

/// Converts a fixture model (`tests/fixtures/<dir>`) into a temporary engine directory and loads it;
/// the directory lives as long as the returned guard.
pub fn fixture_engine(dir: &str, kind: ModelKind) -> (Engine, tempfile::TempDir) {
    assert!(
        recsys_engine::fixtures::model_dir(kind).ends_with(dir),
        "{dir} is not {kind:?}'s fixture"
    );
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
