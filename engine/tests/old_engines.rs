//! Engines written by an earlier recsys (committed under `tests/fixtures/engines`, converted with
//! the untyped manifest of 2026-12-03) still load, and answer and describe themselves exactly as
//! the same conversion made today.

mod common;

use common::*;
use recsys_engine::calibration::{read_histories, CalibrationMethod};
use recsys_engine::engine_dir::Screen;
use recsys_engine::{convert, ConvertRequest, Engine, ModelKind, W8a8Layers};

fn fresh(kind: ModelKind, out: &std::path::Path, precision: Precision, w8a8: bool) -> Engine {
    let dir = model_dir(kind);
    let config = config_json(kind);
    let calibration = read_histories(&fixtures().join("../../examples/calibration.jsonl")).unwrap();
    convert(&ConvertRequest {
        kind: Some(kind),
        checkpoint: &dir.join("model.safetensors"),
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(&dir.join("item_id_map.tsv")),
        out,
        precision,
        calibration: w8a8.then_some((&calibration[..], CalibrationMethod::Entropy)),
        calibration_times: None,
        screen: if w8a8 { Screen::None } else { Screen::Int8 },
        w8a8_layers: W8a8Layers::Output,
        catalogue: Default::default(),
    })
    .unwrap()
}

#[test]
fn engines_written_before_the_typed_manifest_load_and_answer_as_today() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, kind, precision, w8a8) in [
        ("gru4rec_w8a8", ModelKind::Gru4rec, Precision::Int8, true),
        (
            "sasrec_fp16_screened",
            ModelKind::Sasrec,
            Precision::Fp16,
            false,
        ),
    ] {
        let old = Engine::load(&fixtures().join("engines").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let new = fresh(kind, &tmp.path().join(name), precision, w8a8);
        let (a, b) = (&old.manifest, &new.manifest);
        assert_eq!(a.model, b.model, "{name}");
        assert_eq!(a.precision, b.precision, "{name}");
        assert_eq!(a.screen, b.screen, "{name}");
        assert_eq!(a.quantization, b.quantization, "{name}");
        assert_eq!(a.calibration, b.calibration, "{name}");
        assert_eq!(a.kernel_layout, b.kernel_layout, "{name}");
        assert_eq!(a.files, b.files, "{name}: the same bytes");
        let histories: Vec<Vec<u32>> = (0..20u32)
            .map(|u| {
                (0..5 + u * 3)
                    .map(|i| 1 + (u * 97 + i * 31) % 2000)
                    .collect()
            })
            .collect();
        let requests: Vec<recsys_engine::InternalRequest> = histories
            .iter()
            .map(|h| recsys_engine::InternalRequest {
                history: h.clone(),
                k: 20,
                exclude_seen: true,
                ..Default::default()
            })
            .collect();
        assert_eq!(
            old.recommend_internal(&requests),
            new.recommend_internal(&requests),
            "{name}"
        );
    }
}
