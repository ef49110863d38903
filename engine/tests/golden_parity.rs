//! The engine against PyTorch: logits and top-100 of BERT4Rec and Mult-VAE, and the test-set
//! metrics of all four fixture models (SASRec's and GRU4Rec's top-100: `sequential_parity.rs`).

mod common;

use common::*;
use recsys_engine::metrics::{evaluate, read_test_set};
use recsys_engine::{ExternalIds, ModelKind, Request, ServeOptions};

fn check_logits_and_topk(kind: ModelKind) {
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
    let golden = golden(kind);
    let mut max_diff = 0f32;
    let mut swapped_ties = 0;
    for (case_no, case) in golden.cases.iter().enumerate() {
        // Logits on the effective history.
        let history = u32s(&case["effective_history_internal"]);
        let scores = engine.score_all(&[history.as_slice()]);
        let want = &golden.logits_f32[case_no * golden.n_outputs..(case_no + 1) * golden.n_outputs];
        assert_eq!(scores.len(), want.len());
        for (g, w) in scores.iter().zip(want) {
            max_diff = max_diff.max((g - w).abs());
        }

        // Top-100 from the raw request (unknown ids included, so the id map is exercised too).
        let raw = i64s(&case["history_ext"]);
        let options = ServeOptions {
            default_k: 100,
            ..ServeOptions::default()
        };
        let answer = engine
            .recommend(
                &[Request {
                    history: ExternalIds::Int(&raw),
                    k: None,
                    exclude: None,
                    candidates: None,
                    embedding: false,
                    filter: None,
                    times: None,
                }],
                &options,
            )
            .remove(0)
            .unwrap();
        assert_eq!(
            answer.unknown_ids,
            case["unknown_ext"].as_array().unwrap().len(),
            "case {case_no}"
        );
        let want_top = case["topk"].as_array().unwrap();
        assert_eq!(answer.items.len(), want_top.len(), "case {case_no}");
        for (pos, (got, want)) in answer.items.iter().zip(want_top).enumerate() {
            let want_index = want["internal"].as_u64().unwrap() as u32;
            if got.index != want_index {
                // Only acceptable where PyTorch's own scores are tied within the tolerance.
                let want_score = want["score"].as_f64().unwrap() as f32;
                let ours_in_torch = want_top
                    .iter()
                    .find(|w| w["internal"].as_u64().unwrap() as u32 == got.index)
                    .map(|w| w["score"].as_f64().unwrap() as f32)
                    .unwrap_or_else(|| {
                        golden.logits_f32[case_no * golden.n_outputs + got.index as usize]
                    });
                assert!(
                    (ours_in_torch - want_score).abs() <= LOGIT_ABS_TOL,
                    "case {case_no} position {pos}: got item {} want {want_index} (scores {ours_in_torch} vs {want_score})",
                    got.index
                );
                swapped_ties += 1;
            }
            assert_eq!(
                engine
                    .external_id(got.index)
                    .expect("an index in the catalogue")
                    .to_string(),
                if got.index == want_index {
                    want["external"].to_string()
                } else {
                    engine
                        .external_id(got.index)
                        .expect("an index in the catalogue")
                        .to_string()
                }
            );
        }
    }
    eprintln!("{kind}: max |logit diff| = {max_diff:e}, top-100 positions differing at exact ties: {swapped_ties}");
    assert!(
        max_diff <= LOGIT_ABS_TOL,
        "{kind}: max |logit diff| {max_diff} > {LOGIT_ABS_TOL}"
    );
}

#[test]
fn bert4rec_logits_and_top100_match_pytorch() {
    check_logits_and_topk(ModelKind::Bert4rec);
}

#[test]
fn vaecf_logits_and_top100_match_pytorch() {
    check_logits_and_topk(ModelKind::Vaecf);
}

fn check_metrics(kind: ModelKind) {
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
    let cases = read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let report = evaluate(&engine, &cases, &[10, 20, 100], 256, |_| {}).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir(kind).join("metrics.json")).unwrap(),
    )
    .unwrap();
    let expected = &expected["test_float64"];
    for key in [
        "ndcg@10",
        "recall@10",
        "ndcg@20",
        "recall@20",
        "ndcg@100",
        "recall@100",
        "mrr",
    ] {
        let (got, want) = (report.metrics[key], expected[key].as_f64().unwrap());
        assert!(
            (got - want).abs() <= 1e-6,
            "{kind} {key}: {got} vs PyTorch {want}"
        );
    }
    assert_eq!(
        report.metrics["n_users"],
        expected["n_users"].as_f64().unwrap()
    );

    // Rank by rank against PyTorch: equal to its float64 rank, or, where PyTorch's own float32 and
    // float64 ranks disagree (a near-tie that f32 cannot resolve), to its float32 rank.
    let ranks_text = std::fs::read_to_string(model_dir(kind).join("test_ranks.tsv")).unwrap();
    let mut differing = 0;
    let mut f32_ties = 0;
    let mut near_ties = 0;
    for (line, ours) in ranks_text.lines().skip(1).zip(&report.ranks) {
        let fields: Vec<&str> = line.split('\t').collect();
        let f64_rank: usize = fields[2].parse().unwrap();
        let f32_rank: usize = fields[3].parse().unwrap();
        if *ours == Some(f64_rank) {
            continue;
        }
        if f32_rank != f64_rank && *ours == Some(f32_rank) {
            f32_ties += 1;
            continue;
        }
        // Otherwise only an off-by-one at a near-tie that f32 accumulation order decides, and rarely.
        let off_by_one = ours.is_some_and(|r| r.abs_diff(f64_rank) == 1);
        eprintln!("{kind}: {line}: ours {ours:?}");
        if off_by_one {
            near_ties += 1;
        } else {
            differing += 1;
        }
    }
    eprintln!(
        "{kind}: {f32_ties} users at PyTorch's own f32/f64 near-ties took its f32 rank; {near_ties} off by one at other near-ties"
    );
    // At most 0.1 % of users (5 of 5000) may sit at such a near-tie.
    assert!(
        near_ties * 1000 <= report.ranks.len(),
        "{kind}: {near_ties} ranks off by one"
    );
    assert_eq!(
        differing, 0,
        "{kind}: {differing} users' target ranks differ from PyTorch float64"
    );
}

#[test]
fn bert4rec_eval_reproduces_pytorch_metrics() {
    check_metrics(ModelKind::Bert4rec);
}

#[test]
fn vaecf_eval_reproduces_pytorch_metrics() {
    check_metrics(ModelKind::Vaecf);
}

#[test]
fn sasrec_eval_reproduces_recbole_metrics() {
    check_metrics(ModelKind::Sasrec);
}

#[test]
fn gru4rec_eval_reproduces_recbole_metrics() {
    check_metrics(ModelKind::Gru4rec);
}

#[test]
fn batched_ragged_histories_equal_one_by_one() {
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let golden = golden(kind);
        let histories: Vec<Vec<u32>> = golden
            .cases
            .iter()
            .map(|c| u32s(&c["effective_history_internal"]))
            .collect();
        let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let batched = engine.score_all(&refs);
        let n = engine.model.output().n_outputs();
        for (i, h) in refs.iter().enumerate() {
            let single = engine.score_all(&[h]);
            assert_eq!(
                &batched[i * n..(i + 1) * n],
                &single[..],
                "{kind}: history {i} differs in a batch"
            );
        }
    }
}
