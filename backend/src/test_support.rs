//! Test helpers shared by the backend's unit tests.

use recsys_engine::{Engine, ModelKind};

/// The trained fixtures: `RECSYS_FIXTURES` (the GPU bundle's run.sh sets it: its test binaries run
/// far from the source tree), else the repository's tests/fixtures.
pub fn fixtures() -> std::path::PathBuf {
    std::env::var_os("RECSYS_FIXTURES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
        })
}

/// Converts a fixture model (`tests/fixtures/<dir>`) into a temporary engine directory and loads it;
/// the directory lives as long as the returned guard.
pub fn fixture_engine(dir: &str, kind: ModelKind) -> (Engine, tempfile::TempDir) {
    let dir = fixtures().join(dir);
    let config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let engine = recsys_engine::convert(&recsys_engine::ConvertRequest {
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
