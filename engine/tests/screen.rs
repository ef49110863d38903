//! The int8 screen on the trained fixtures: for every k in {1, 10, 100, 1000} and batches of 1 to
//! 64 histories, screened answers are the fp32 engine's, ids and scores bit for bit, and only a
//! small share of the catalogue is rescored; engines converted with `screen: int8` (fp32 and
//! fp16) answer every request exactly as the same engine without it.

mod common;

use common::*;
use recsys_engine::engine_dir::Screen;
use recsys_engine::kernels::fused::{Exclusions, RowQuery};
use recsys_engine::kernels::screen::{top_k_from_f32, ScreenTable};
use recsys_engine::{Engine, EngineError, ExternalIds, InternalRequest, ModelKind};

/// Requests with every k, exclusions, seen items kept or not, and candidate rows among them.
fn requests(engine: &Engine, rows: usize) -> Vec<InternalRequest> {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    cases
        .iter()
        .take(rows)
        .enumerate()
        .map(|(i, case)| {
            let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
            let history = engine.ids.map(ExternalIds::Str(&ids)).indices;
            InternalRequest {
                exclude: (1..engine.n_items() as u32)
                    .step_by(3 + i % 5)
                    .take(i % 40)
                    .collect(),
                k: [1, 10, 100, 1000][i % 4],
                exclude_seen: i % 3 != 0,
                candidates: (i % 9 == 4).then(|| {
                    history
                        .iter()
                        .copied()
                        .chain(1..50)
                        .collect::<std::collections::BTreeSet<u32>>()
                        .into_iter()
                        .collect()
                }),
                embedding: i % 5 == 0,
                history,
                eligible: None,
                popular: false,
                timestamps: Vec::new(),
                query_timestamp: 0,
            }
        })
        .collect()
}

#[test]
fn screened_engines_answer_exactly_as_unscreened_ones() {
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        for precision in [Precision::Fp32, Precision::Fp16] {
            let mut plain =
                convert_fixture_screened(kind, &tmp.path().join("plain"), precision, Screen::None)
                    .unwrap();
            let mut screened = convert_fixture_screened(
                kind,
                &tmp.path().join("screened"),
                precision,
                Screen::Int8,
            )
            .unwrap();
            assert_eq!(screened.manifest.screen, Screen::Int8);
            assert!(screened.scorer.screen.is_some() && plain.scorer.screen.is_none());
            let batch = requests(&plain, 64);
            for threads in [1, 2] {
                plain.set_threads(threads);
                screened.set_threads(threads);
                for size in [1, 5, 64] {
                    let want = plain.recommend_internal(&batch[..size]);
                    let mut got = screened.recommend_internal(&batch[..size]);
                    // Each whole-catalogue row notes how many items survived its screen (at
                    // least its k, well under the catalogue); candidate rows are not screened.
                    for ((_, note, _), request) in got.iter_mut().zip(&batch[..size]) {
                        let whole = request.candidates.is_none() && request.k > 0;
                        match note.screen_survivors.take() {
                            Some(n) if whole => assert!(
                                n as usize >= request.k && (n as usize) < plain.n_items(),
                                "{kind}: {n} survivors for k = {}",
                                request.k
                            ),
                            None if !whole => {}
                            other => {
                                panic!("{kind}: survivors {other:?} on a row with whole = {whole}")
                            }
                        }
                    }
                    assert!(want
                        .iter()
                        .all(|(_, note, _)| note.screen_survivors.is_none()));
                    assert_eq!(
                        got, want,
                        "{kind} {precision:?} batch {size}, {threads} thread(s)"
                    );
                }
            }
            // An engine written before the screen existed (no "screen" in its manifest) loads
            // unscreened.
            let manifest = tmp.path().join("screened").join("manifest.json");
            let mut json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
            json.as_object_mut().unwrap().remove("screen");
            std::fs::write(&manifest, serde_json::to_string(&json).unwrap()).unwrap();
            let old = Engine::load(&tmp.path().join("screened")).unwrap();
            assert_eq!(old.manifest.screen, Screen::None);
            assert!(old.scorer.screen.is_none());
        }
        // int8 engines already read int8 weights: the screen is refused with a reason.
        let refused = convert_fixture_screened(
            kind,
            &tmp.path().join("int8"),
            Precision::Int8,
            Screen::Int8,
        );
        match refused {
            Err(EngineError::Config(reason)) => {
                assert!(reason.contains("fp32 and fp16"), "{reason}")
            }
            other => panic!("int8 + screen must be refused, got {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn screened_answers_are_the_fp32_engines_on_the_trained_fixtures() {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("fp32"));
        let out = engine.model.output();
        let (n, d) = (out.n_outputs(), out.input_size());
        let mut weights = vec![0f32; n * d];
        for (i, row) in weights.chunks_exact_mut(d).enumerate() {
            out.weight.add_row_into(i, row);
        }
        let bias = out.bias.as_slice().to_vec();
        let screen = ScreenTable::new(&weights, &bias, d);
        for batch in [1usize, 7, 64] {
            let requests: Vec<InternalRequest> = cases
                .iter()
                .take(batch)
                .map(|case| {
                    let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
                    InternalRequest {
                        history: engine.ids.map(ExternalIds::Str(&ids)).indices,
                        exclude: vec![],
                        k: 10,
                        exclude_seen: true,
                        candidates: None,
                        embedding: false,
                        eligible: None,
                        popular: false,
                        timestamps: Vec::new(),
                        query_timestamp: 0,
                    }
                })
                .collect();
            let histories: Vec<&[u32]> = requests.iter().map(|r| r.history.as_slice()).collect();
            let (hidden, _) = engine.encode(&histories);
            let exclusions: Vec<Exclusions> = requests
                .iter()
                .map(|r| {
                    let mut e = recsys_engine::excluded_items(r);
                    e.push(0); // PAD
                    Exclusions::new(e)
                })
                .collect();
            for k in [1usize, 10, 100, 1000] {
                let queries: Vec<RowQuery<'_>> =
                    exclusions.iter().map(|e| RowQuery::new(k, e)).collect();
                // The engine's own dense path: the fused scan over its packed output layer.
                let dense = recsys_engine::kernels::fused::top_k(
                    engine.scorer.kernels,
                    &engine.scorer.packed,
                    &hidden,
                    &queries,
                    engine.scorer.threads,
                );
                let (got, kept) = top_k_from_f32(
                    engine.scorer.kernels,
                    &screen,
                    &weights,
                    &bias,
                    &hidden,
                    &queries,
                    2,
                );
                assert_eq!(got, dense, "{kind} batch {batch} k {k}");
                let mut sorted = kept.clone();
                sorted.sort_unstable();
                let median = sorted[sorted.len() / 2];
                eprintln!("{kind} batch {batch} k {k}: median {median} survivors of {n}");
                if k <= 100 {
                    assert!(
                        median < n / 4,
                        "{kind} k {k}: median {median} survivors of {n}"
                    );
                }
            }
        }
    }
}

#[test]
fn rows_read_from_the_weights_file_answer_as_rows_read_through_the_mapping() {
    // Large tables read a screen's survivors and a history's rows by positioned reads of the
    // weights file (so scanning does not map the table it screens out); the fixtures are small,
    // so a threshold of 0 bytes makes every table read that way, and the answers must not change.
    // fp16 and int8 tables are views of the mapped file too (no copy), read the same way.
    use recsys_engine::weights::Matrix;
    let by_read = recsys_engine::engine_dir::LoadOptions {
        row_reads_min_bytes: 0,
        ..Default::default()
    };
    let reads_from_file = |m: &Matrix| match m {
        Matrix::F32(t) => t.reads_rows_from_file(),
        Matrix::F16 { bits, .. } | Matrix::Bf16 { bits, .. } => bits.reads_from_file(),
        Matrix::I8 { q, .. } => q.reads_from_file(),
    };
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        for (precision, screen) in [
            (Precision::Fp32, Screen::Int8),
            (Precision::Fp32, Screen::None),
            (Precision::Fp16, Screen::Int8),
            (Precision::Fp16, Screen::None),
            (Precision::Bf16, Screen::None),
            (Precision::Int8, Screen::None),
        ] {
            let name = format!("{precision:?} {screen:?}");
            let dir = tmp.path().join(name.replace(' ', "_"));
            let mut mapped = convert_fixture_screened(kind, &dir, precision, screen).unwrap();
            let mut read = Engine::load_with(&dir, &by_read).unwrap();
            assert!(
                reads_from_file(&read.model.output().weight),
                "{kind} {name}"
            );
            assert!(
                !reads_from_file(&mapped.model.output().weight),
                "{kind} {name}: the fixture is under 16 MiB"
            );
            let batch = requests(&mapped, 64);
            for threads in [1, 2] {
                mapped.set_threads(threads);
                read.set_threads(threads);
                for size in [1, 7, 64] {
                    assert_eq!(
                        read.recommend_internal(&batch[..size]),
                        mapped.recommend_internal(&batch[..size]),
                        "{kind} {name} batch {size}, {threads} thread(s)"
                    );
                }
            }
        }
    }
}
