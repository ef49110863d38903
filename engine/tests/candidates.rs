//! Ranking a retrieval stage's candidates instead of the catalogue: the answer is exactly the
//! whole-catalogue scan restricted to the candidates (same ids in the same order, same f32 scores),
//! at every precision, for every k and with exclusions; and the scores are PyTorch's logits.

mod common;

use common::*;
use recsys_engine::topk::{rank_order, Scored};
use recsys_engine::{ExternalIds, InternalRequest, ModelKind, Request, ServeOptions};

/// The reference: the whole-catalogue scores of the candidates, minus exclusions, in the engine's
/// order (score descending, ties to the lower index), cut to k.
fn reference(all: &[f32], candidates: &[u32], excluded: &[u32], k: usize) -> Vec<Scored> {
    let mut kept: Vec<Scored> = candidates
        .iter()
        .filter(|c| !excluded.contains(c))
        .map(|&c| Scored {
            index: c,
            score: all[c as usize],
        })
        .collect();
    kept.sort_by(rank_order);
    kept.truncate(k);
    kept
}

fn check_exact(kind: ModelKind, engine: &mut recsys_engine::Engine, variant: &str) {
    let n = engine.n_items() as u64;
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let mut rng = Rng(0x5EED_CA4D ^ n);
    let mut batch = Vec::new();
    for (i, case) in cases.iter().take(48).enumerate() {
        let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
        let history = engine.ids.map(ExternalIds::Str(&ids)).indices;
        // 1..=600 candidates, some from the history (left out by exclude_seen), some excluded,
        // the last request's all the same item repeated (deduplicated by prepare).
        let size = 1 + rng.below(600) as usize;
        let mut candidates: Vec<u32> = (0..size).map(|_| 1 + rng.below(n) as u32).collect();
        candidates.extend(history.iter().take(3));
        candidates.sort_unstable();
        candidates.dedup();
        // Every third request re-ranks the previous one's pool (shared candidate lists are
        // scanned once for all their rows).
        if i % 3 == 2 {
            let previous: &InternalRequest = batch.last().expect("i > 0");
            candidates = previous.candidates.clone().expect("candidate row");
        }
        let exclude: Vec<u32> = candidates.iter().step_by(5).copied().collect();
        batch.push(InternalRequest {
            history,
            exclude,
            k: [1, 10, 100, 1000][i % 4],
            exclude_seen: i % 3 != 0,
            candidates: Some(candidates),
            embedding: false,
            eligible: None,
            popular: false,
            timestamps: Vec::new(),
            query_timestamp: 0,
        });
    }
    // Whole-catalogue rows in the same batch keep their answers.
    batch.push(InternalRequest {
        history: batch[0].history.clone(),
        exclude: vec![],
        k: 10,
        exclude_seen: true,
        candidates: None,
        embedding: false,
        eligible: None,
        popular: false,
        timestamps: Vec::new(),
        query_timestamp: 0,
    });
    let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
    let all = engine.score_all(&histories);
    let width = engine.n_items() + 1;
    let mut checked = 0;
    // One thread, and two (the distinct lists then run in parallel): the same answers.
    for threads in [1, 2] {
        engine.set_threads(threads);
        let answers = engine.recommend_internal(&batch);
        for (r, (request, (got, _, _))) in batch.iter().zip(&answers).enumerate() {
            let scores = &all[r * width..(r + 1) * width];
            let excluded = recsys_engine::excluded_items(request);
            let want = match &request.candidates {
                Some(c) => reference(scores, c, &excluded, request.k),
                None => {
                    let everything: Vec<u32> = (1..width as u32).collect();
                    reference(scores, &everything, &excluded, request.k)
                }
            };
            assert_eq!(got, &want, "{kind} {variant} row {r}, {threads} thread(s)");
            checked += got.len();
        }
    }
    engine.set_threads(1);
    eprintln!("{kind} {variant}: {checked} ranked candidates identical to the whole scan");
}

#[test]
fn candidates_rank_exactly_as_the_whole_catalogue_at_every_precision() {
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        // W8A8 among them: its static activation scale travels with the candidates' packed rows.
        for (variant, mut engine) in engines_at_every_precision(kind, tmp.path()) {
            check_exact(kind, &mut engine, variant);
        }
    }
}

#[test]
fn candidate_scores_are_pytorchs_logits_and_unknown_candidates_follow_the_policy() {
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let golden = golden(kind);
        for (case_no, case) in golden.cases.iter().enumerate().take(16) {
            let history = i64s(&case["history_ext"]);
            // Every 7th item of the catalogue by external id, and one id the model does not know.
            let mut candidates: Vec<i64> = (1..=engine.n_items() as u32)
                .step_by(7)
                .map(|i| match engine.external_id(i).unwrap() {
                    recsys_engine::ExternalId::Int(id) => id,
                    recsys_engine::ExternalId::Str(_) => unreachable!("int catalogue"),
                })
                .collect();
            candidates.push(-42);
            let request = Request {
                history: ExternalIds::Int(&history),
                k: Some(50),
                exclude: None,
                candidates: Some(ExternalIds::Int(&candidates)),
                embedding: false,
                filter: None,
                times: None,
            };
            let answer = engine
                .recommend(&[request], &ServeOptions::default())
                .remove(0)
                .unwrap();
            assert_eq!(answer.unknown_candidates, 1);
            assert_eq!(answer.items.len(), 50);
            let logits =
                &golden.logits_f32[case_no * golden.n_outputs..(case_no + 1) * golden.n_outputs];
            for item in &answer.items {
                assert_eq!((item.index - 1) % 7, 0, "only candidates are ranked");
                let want = logits[item.index as usize];
                assert!(
                    (item.score - want).abs() <= LOGIT_ABS_TOL,
                    "{kind} case {case_no} item {}: {} vs PyTorch {want}",
                    item.index,
                    item.score
                );
            }
            // Under unknown_item_policy "error" the unknown candidate refuses the request.
            let strict = ServeOptions {
                unknown_items: recsys_engine::UnknownItemPolicy::Error,
                ..ServeOptions::default()
            };
            let refused = engine.recommend(&[request], &strict).remove(0).unwrap_err();
            assert!(
                refused.to_string().contains("CANDIDATE_ITEM_IDS"),
                "{refused}"
            );
        }
    }
}
