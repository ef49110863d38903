//! A batch split over threads answers exactly what one thread answers: the encoder's runs and the
//! output layer's slices change no bit of any id, score or embedding, at every precision, and a
//! history's answer does not depend on the histories batched beside it.

mod common;

use common::*;
use recsys_engine::{Engine, ExternalIds, InternalRequest, ModelKind};

fn batch_of(engine: &Engine, rows: usize) -> Vec<InternalRequest> {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    cases
        .iter()
        .take(rows)
        .enumerate()
        .map(|(i, case)| {
            let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
            let mut history = engine.ids.map(ExternalIds::Str(&ids)).indices;
            // Lengths from one item to the whole history, so the runs carry unequal work.
            history.truncate(1 + (i * 7) % history.len().max(1));
            InternalRequest {
                history,
                exclude: vec![],
                k: [1, 10, 100][i % 3],
                exclude_seen: i % 2 == 0,
                candidates: None,
                embedding: true,
                eligible: None,
                popular: false,
                timestamps: Vec::new(),
                query_timestamp: 0,
            }
        })
        .collect()
}

fn check(kind: ModelKind, engine: &mut Engine, variant: &str) {
    let batch = batch_of(engine, 61);
    let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
    engine.set_threads(1);
    let want = engine.recommend_internal(&batch);
    let want_scores = engine.score_all(&histories);
    // Each history alone: the batch around it changes nothing.
    for (r, request) in batch.iter().enumerate().step_by(6) {
        let alone = engine.recommend_internal(std::slice::from_ref(request));
        assert_eq!(alone[0], want[r], "{kind} {variant}: row {r} alone");
    }
    for threads in [2, 3, 5, 64] {
        engine.set_threads(threads);
        // A history alone gets every thread for its own layers and attention heads.
        for (r, request) in batch.iter().enumerate().step_by(6) {
            let alone = engine.recommend_internal(std::slice::from_ref(request));
            assert_eq!(
                alone[0], want[r],
                "{kind} {variant}: row {r} alone at {threads} threads"
            );
        }
        // Several histories in one piece of work whose layers split by rows across sequences.
        let (mut hidden, mut notes) = (Vec::new(), Vec::new());
        let mut scratch = recsys_engine::models::EncodeScratch::default();
        let some = &histories[..9];
        engine
            .model
            .encode_into_threads(some, &mut scratch, &mut hidden, &mut notes, threads);
        let (want_hidden, want_notes) = engine.model.encode(some);
        assert!(
            hidden.len() == want_hidden.len()
                && hidden
                    .iter()
                    .zip(&want_hidden)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                && notes == want_notes,
            "{kind} {variant}: 9 histories' layers split over {threads} threads"
        );
        let got = engine.recommend_internal(&batch);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{kind} {variant}: row {r} at {threads} threads");
        }
        let scores = engine.score_all(&histories);
        assert!(
            scores
                .iter()
                .zip(&want_scores)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{kind} {variant}: score_all at {threads} threads"
        );
    }
    engine.set_threads(1);
}

#[test]
fn threads_change_no_bit_of_any_answer_at_every_precision() {
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        for (variant, mut engine) in engines_at_every_precision(kind, tmp.path()) {
            check(kind, &mut engine, variant);
        }
    }
}
