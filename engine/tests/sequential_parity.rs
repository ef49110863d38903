//! SASRec and GRU4Rec against RecBole 1.2.1's own classes: the golden top-100 (histories shorter
//! and longer than the window, repeated items, unknown ids) from every checkpoint form, batched as
//! one by one, and the refusal of a history with no known item.

mod common;

use common::*;
use recsys_engine::{
    convert, ConvertRequest, Engine, ExternalIds, ModelKind, Request, ServeOptions,
};

const KINDS: [ModelKind; 2] = [ModelKind::Sasrec, ModelKind::Gru4rec];

/// Converts `checkpoint` of the fixture: the RecBole checkpoint with neither a kind nor a config
/// (both come from its own config), the state dicts with the fixture's config.
fn convert_form(kind: ModelKind, checkpoint: &str, out: &std::path::Path) -> Engine {
    if checkpoint.ends_with(".pth") {
        let engine = convert(&ConvertRequest {
            kind: None,
            checkpoint: &model_dir(kind).join(checkpoint),
            config: None,
            item_map: recsys_engine::ItemMapSource::Tsv(&model_dir(kind).join("item_id_map.tsv")),
            out,
            precision: Precision::Fp32,
            calibration: None,
            calibration_times: None,
            screen: Default::default(),
            w8a8_layers: Default::default(),
            catalogue: Default::default(),
        })
        .unwrap_or_else(|e| panic!("{kind} {checkpoint}: {e}"));
        assert_eq!(engine.kind(), kind, "the kind read from the checkpoint");
        engine
    } else {
        convert_fixture(kind, checkpoint, out)
    }
}

fn golden_cases(kind: ModelKind) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(model_dir(kind).join("golden.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["cases"].as_array().unwrap().clone()
}

fn request(history: &[i64]) -> Request<'_> {
    Request {
        history: ExternalIds::Int(history),
        k: None,
        exclude: None,
        candidates: None,
        embedding: false,
        filter: None,
        times: None,
    }
}

/// The engine's top-100 for every golden case equals RecBole's: the same items in the same order
/// (two items may trade places only where RecBole's own float64 scores are tied within the
/// tolerance), each score within [`LOGIT_ABS_TOL`] of RecBole's.
fn check_top100(kind: ModelKind, engine: &Engine, what: &str) {
    let options = ServeOptions {
        default_k: 100,
        ..ServeOptions::default()
    };
    let mut checked = 0;
    for case in golden_cases(kind) {
        let no = case["case"].as_u64().unwrap();
        let raw = i64s(&case["history_ext"]);
        let answer = engine.recommend(&[request(&raw)], &options).remove(0);
        if case["topk"].is_null() {
            let err = answer.expect_err("a history with no known item has no answer");
            assert!(
                err.to_string().contains("no item known"),
                "{what} case {no}: {err}"
            );
            continue;
        }
        let answer = answer.unwrap_or_else(|e| panic!("{what} case {no}: {e}"));
        assert_eq!(
            answer.unknown_ids,
            case["unknown_ext"].as_array().unwrap().len(),
            "{what} case {no}"
        );
        let want = case["topk"].as_array().unwrap();
        assert_eq!(answer.items.len(), want.len(), "{what} case {no}");
        for (pos, (got, want)) in answer.items.iter().zip(want).enumerate() {
            let want_index = want["internal"].as_u64().unwrap() as u32;
            let want_score = want["score"].as_f64().unwrap() as f32;
            assert!(
                (got.score - want_score).abs() <= LOGIT_ABS_TOL,
                "{what} case {no} position {pos}: score {} vs RecBole {want_score}",
                got.score
            );
            if got.index != want_index {
                let recbole_score_of_ours = case["topk"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|w| w["internal"].as_u64().unwrap() as u32 == got.index)
                    .map(|w| w["score"].as_f64().unwrap() as f32)
                    .unwrap_or_else(|| {
                        panic!(
                            "{what} case {no}: item {} not in RecBole's top 100",
                            got.index
                        )
                    });
                assert!(
                    (recbole_score_of_ours - want_score).abs() <= LOGIT_ABS_TOL,
                    "{what} case {no} position {pos}: item {} where RecBole has {want_index}",
                    got.index
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 62, "{what}: every case with an answer");
}

#[test]
fn top100_matches_recbole_from_every_checkpoint_form() {
    for kind in KINDS {
        for checkpoint in ["model.pt", "model.safetensors", "recbole_checkpoint.pth"] {
            let tmp = tempfile::tempdir().unwrap();
            let engine = convert_form(kind, checkpoint, &tmp.path().join("engine"));
            check_top100(kind, &engine, &format!("{kind} {checkpoint}"));
        }
    }
}

/// The golden cases reach both sides of the window, with repeated items and unknown ids: what
/// the test above covers.
#[test]
fn golden_cases_cover_the_window_repeats_and_unknown_ids() {
    for kind in KINDS {
        let max_len = config_json(kind)["max_seq_length"].as_u64().unwrap() as usize;
        let cases = golden_cases(kind);
        let lengths: Vec<usize> = cases
            .iter()
            .map(|c| c["effective_history_internal"].as_array().unwrap().len())
            .collect();
        assert!(lengths.iter().any(|&n| n > 0 && n < max_len), "{kind}");
        assert!(lengths.contains(&max_len), "{kind}");
        assert!(lengths.iter().any(|&n| n > max_len), "{kind}");
        assert!(
            cases.iter().any(|c| c["has_unknown"].as_bool().unwrap()),
            "{kind}"
        );
        assert!(
            cases.iter().any(|c| {
                let h = u32s(&c["effective_history_internal"]);
                let mut d = h.clone();
                d.sort_unstable();
                d.dedup();
                d.len() < h.len()
            }),
            "{kind}: a history with a repeated item"
        );
    }
}

#[test]
fn batched_ragged_histories_equal_one_by_one() {
    for kind in KINDS {
        let tmp = tempfile::tempdir().unwrap();
        let mut engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let histories: Vec<Vec<u32>> = golden_cases(kind)
            .iter()
            .map(|c| u32s(&c["effective_history_internal"]))
            .filter(|h| !h.is_empty())
            .collect();
        let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let n = engine.model.output().n_outputs();
        for threads in [1, 2, 3] {
            engine.set_threads(threads);
            let batched = engine.score_all(&refs);
            for (i, h) in refs.iter().enumerate() {
                let single = engine.score_all(&[h]);
                assert_eq!(
                    &batched[i * n..(i + 1) * n],
                    &single[..],
                    "{kind}: history {i} differs in a batch at {threads} threads"
                );
            }
        }
    }
}

/// The window keeps the most recent items: a history longer than it answers as its last
/// `max_len` items do, and says it was truncated.
#[test]
fn long_histories_keep_their_most_recent_items() {
    for kind in KINDS {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let max_len = config_json(kind)["max_seq_length"].as_u64().unwrap() as usize;
        let history: Vec<u32> = (0..max_len as u32 + 7)
            .map(|i| 1 + (i * 37) % 2000)
            .collect();
        let (long, notes) = engine.encode(&[history.as_slice()]);
        let (window, window_notes) = engine.encode(&[&history[7..]]);
        assert_eq!(long, window, "{kind}");
        assert!(notes[0].truncated && !window_notes[0].truncated, "{kind}");
    }
}

/// The f64 reference the other tests take every logit from agrees with RecBole's golden top 100
/// (so those tests check the engine against RecBole, not against itself).
#[test]
fn the_f64_reference_reproduces_recbole_top100_scores() {
    for kind in KINDS {
        let golden = golden(kind);
        let mut max_diff = 0f64;
        for (no, case) in golden.cases.iter().enumerate() {
            let Some(top) = case["topk"].as_array() else {
                continue;
            };
            let logits = &golden.logits_f32[no * golden.n_outputs..(no + 1) * golden.n_outputs];
            for want in top {
                let item = want["internal"].as_u64().unwrap() as usize;
                let diff = (logits[item] as f64 - want["score"].as_f64().unwrap()).abs();
                max_diff = max_diff.max(diff);
            }
        }
        eprintln!("{kind}: max |f64 reference (as f32) - RecBole| over the golden top 100: {max_diff:.2e}");
        assert!(max_diff <= 1e-5, "{kind}: {max_diff}");
    }
}

/// Every logit of every golden case (not only the top 100) within [`LOGIT_ABS_TOL`] of the f64
/// reference.
#[test]
fn every_logit_matches_the_f64_reference() {
    for kind in KINDS {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let golden = golden(kind);
        let mut max_diff = 0f32;
        for (no, case) in golden.cases.iter().enumerate() {
            let history = u32s(&case["effective_history_internal"]);
            if history.is_empty() {
                continue;
            }
            let got = engine.score_all(&[history.as_slice()]);
            let want = &golden.logits_f32[no * golden.n_outputs..(no + 1) * golden.n_outputs];
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want).skip(1) {
                max_diff = max_diff.max((g - w).abs());
            }
        }
        eprintln!("{kind}: max |engine - f64 reference| over every logit: {max_diff:.2e}");
        assert!(max_diff <= LOGIT_ABS_TOL, "{kind}: {max_diff}");
    }
}

/// GRU4Rec reads its first layer's input side from a per-item table when serving and computes it
/// per token when an observer must see the layer's input (calibration): the same bits, at every
/// precision.
#[test]
fn gru4rec_input_table_gives_the_per_token_bits_at_every_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let histories: Vec<Vec<u32>> = golden_cases(ModelKind::Gru4rec)
        .iter()
        .map(|c| u32s(&c["effective_history_internal"]))
        .filter(|h| !h.is_empty())
        .collect();
    let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
    for (variant, engine) in engines_at_every_precision(ModelKind::Gru4rec, tmp.path()) {
        let (served, _) = engine.model.encode(&refs);
        let (observed, _) = engine.model.encode_observed(&refs, &[], &mut |_, _| {});
        assert_eq!(served.len(), observed.len());
        assert!(
            served
                .iter()
                .zip(&observed)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{variant}: the input table changes the bits"
        );
    }
}
