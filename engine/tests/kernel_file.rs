//! Engines carry their kernels' layout (`kernels.bin`) and loading maps it: the output layer and
//! the int8 screen are views into the file, not owned copies, and answer exactly as the layout
//! packed at load (what engines written before the file existed still do); a damaged or
//! mismatched file is refused with its name.

mod common;

use common::*;
use recsys_engine::engine_dir::Screen;
use recsys_engine::kernel_file::KERNELS_FILE;
use recsys_engine::{Engine, EngineError, ExternalIds, InternalRequest, ModelKind};

fn convert(kind: ModelKind, out: &std::path::Path, precision: Precision, screen: Screen) -> Engine {
    convert_fixture_screened(kind, out, precision, screen).unwrap()
}

/// `dir` as an engine of the previous format: no kernels file, no layout in the manifest.
fn strip_kernels(dir: &std::path::Path) {
    let manifest = dir.join("manifest.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let object = json.as_object_mut().unwrap();
    object.remove("kernel_layout");
    object["files"]
        .as_object_mut()
        .unwrap()
        .remove(KERNELS_FILE);
    std::fs::write(&manifest, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    std::fs::remove_file(dir.join(KERNELS_FILE)).unwrap();
}

fn requests(engine: &Engine) -> Vec<InternalRequest> {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    cases
        .iter()
        .take(48)
        .enumerate()
        .map(|(i, case)| {
            let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
            InternalRequest {
                history: engine.ids.map(ExternalIds::Str(&ids)).indices,
                exclude: (1..engine.n_items() as u32)
                    .step_by(7)
                    .take(i % 20)
                    .collect(),
                k: [1, 10, 100, 1000][i % 4],
                exclude_seen: i % 2 == 0,
                candidates: None,
                embedding: false,
                eligible: None,
                popular: false,
                timestamps: Vec::new(),
                query_timestamp: 0,
            }
        })
        .collect()
}

#[test]
fn mapped_layouts_answer_exactly_as_layouts_packed_at_load() {
    let cases = [
        (Precision::Fp32, Screen::None),
        (Precision::Fp16, Screen::None),
        (Precision::Bf16, Screen::None),
        (Precision::Int8, Screen::None),
        (Precision::Fp32, Screen::Int8),
        (Precision::Fp16, Screen::Int8),
    ];
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        for (precision, screen) in cases {
            let tmp = tempfile::tempdir().unwrap();
            let (new_dir, old_dir) = (tmp.path().join("new"), tmp.path().join("old"));
            let mut mapped = convert(kind, &new_dir, precision, screen);
            convert(kind, &old_dir, precision, screen);
            strip_kernels(&old_dir);
            let mut packed = Engine::load(&old_dir).unwrap();
            let what = format!("{kind} {precision:?} {screen:?}");
            assert!(mapped.manifest.kernel_layout.is_some(), "{what}");
            assert!(
                mapped.scorer.packed.is_mapped(),
                "{what}: output layer not mapped"
            );
            assert!(!packed.scorer.packed.is_mapped(), "{what}");
            if screen == Screen::Int8 {
                let table = mapped.scorer.screen.as_ref().unwrap();
                assert!(table.packed.is_mapped(), "{what}: screen not mapped");
            }
            let batch = requests(&packed);
            for threads in [1, 2] {
                mapped.set_threads(threads);
                packed.set_threads(threads);
                assert_eq!(
                    mapped.recommend_internal(&batch),
                    packed.recommend_internal(&batch),
                    "{what}, {threads} thread(s)"
                );
            }
        }
    }
}

#[test]
fn a_damaged_or_mismatched_kernels_file_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("engine");
    convert(ModelKind::Vaecf, &dir, Precision::Fp32, Screen::Int8);
    let kernels = dir.join(KERNELS_FILE);
    let original = std::fs::read(&kernels).unwrap();

    let mut flipped = original.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x40;
    std::fs::write(&kernels, &flipped).unwrap();
    match Engine::load(&dir) {
        Err(EngineError::Checksum { path, .. }) => assert!(path.ends_with(KERNELS_FILE)),
        other => panic!(
            "a flipped byte must fail the checksum, got {:?}",
            other.err()
        ),
    }
    std::fs::write(&kernels, &original).unwrap();

    // A layout whose section does not fit the model (hand-edited or from another engine).
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let bytes = &mut json["kernel_layout"]["sections"]["output.f32"]["bytes"];
    *bytes = serde_json::json!(bytes.as_u64().unwrap() - 64);
    std::fs::write(&manifest, serde_json::to_string(&json).unwrap()).unwrap();
    let err = Engine::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("section output.f32") && err.contains("the model needs"),
        "{err}"
    );

    json["kernel_layout"]["layout_version"] = serde_json::json!(99);
    std::fs::write(&manifest, serde_json::to_string(&json).unwrap()).unwrap();
    let err = Engine::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("kernel layout version 99") && err.contains("re-convert"),
        "{err}"
    );

    // A manifest naming a layout without listing the file.
    json["kernel_layout"]["layout_version"] = serde_json::json!(1);
    json["files"].as_object_mut().unwrap().remove(KERNELS_FILE);
    std::fs::write(&manifest, serde_json::to_string(&json).unwrap()).unwrap();
    let err = Engine::load(&dir).err().unwrap().to_string();
    assert!(err.contains("does not list kernels.bin"), "{err}");
}

/// Rewrites a screened engine's `kernels.bin` as layout 1 wrote it: the four per-item bound terms
/// in a section each (appended at 64-byte offsets) instead of side by side in `screen.bounds`.
fn as_layout_1(dir: &std::path::Path) {
    use sha2::Digest;
    let manifest = dir.join("manifest.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let mut bytes = std::fs::read(dir.join(KERNELS_FILE)).unwrap();
    let layout = &mut json["kernel_layout"];
    let bounds = layout["sections"]
        .as_object_mut()
        .unwrap()
        .remove("screen.bounds")
        .expect("a layout-2 screen stores screen.bounds");
    let (offset, len) = (
        bounds["offset"].as_u64().unwrap() as usize,
        bounds["bytes"].as_u64().unwrap() as usize,
    );
    let records = bytes[offset..offset + len].to_vec();
    for (t, name) in ["weight_error", "scaled_q_l1", "max_weight", "abs_bias"]
        .iter()
        .enumerate()
    {
        bytes.resize(bytes.len().next_multiple_of(64), 0);
        let at = bytes.len();
        for record in records.chunks_exact(16) {
            bytes.extend_from_slice(&record[4 * t..4 * t + 4]);
        }
        layout["sections"][format!("screen.{name}")] =
            serde_json::json!({"offset": at, "bytes": records.len() / 4});
    }
    layout["layout_version"] = serde_json::json!(1);
    std::fs::write(dir.join(KERNELS_FILE), &bytes).unwrap();
    let entry = &mut json["files"][KERNELS_FILE];
    entry["bytes"] = serde_json::json!(bytes.len());
    entry["sha256"] = serde_json::json!(hex::encode(sha2::Sha256::digest(&bytes)));
    std::fs::write(&manifest, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

#[test]
fn a_screen_stored_by_the_previous_layout_loads_and_answers_the_same() {
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("engine");
        let current = convert(kind, &dir, Precision::Fp32, Screen::Int8);
        as_layout_1(&dir);
        let previous = Engine::load(&dir).unwrap();
        assert_eq!(
            previous
                .manifest
                .kernel_layout
                .as_ref()
                .unwrap()
                .layout_version,
            1
        );
        let terms = |e: &Engine| e.scorer.screen.as_ref().unwrap().bound_terms().to_vec();
        assert_eq!(
            terms(&previous),
            terms(&current),
            "{kind}: the same bound terms"
        );
        let batch = requests(&current);
        assert_eq!(
            previous.recommend_internal(&batch),
            current.recommend_internal(&batch),
            "{kind}"
        );
    }
}
