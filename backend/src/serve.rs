//! Running the decoded requests of one Execute call as a single engine batch.

use crate::decode::DecodedRequest;
use crate::error::{BackendError, Result};
use recsys_engine::topk::Scored;
use recsys_engine::{Engine, Request, ServeOptions};

/// The answer to one request: one ranked list per history, plus what the metrics count.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    pub rows: Vec<Vec<Scored>>,
    pub unknown_ids: usize,
    pub truncated: usize,
}

/// What one batch did, for statistics and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// Histories that went through the model together.
    pub engine_rows: usize,
}

/// Answers every decodable request; all their histories run as one engine batch. A request whose
/// decoding failed, or one of whose histories the engine refuses, gets its own error; the others
/// are unaffected.
pub fn serve(
    engine: &Engine,
    options: &ServeOptions,
    requests: Vec<Result<DecodedRequest>>,
    recommender: &dyn recsys_engine::BatchRecommender,
) -> (Vec<Result<Answer>>, BatchSummary) {
    let mut prepared = Vec::new();
    // For each request: where its rows start in `prepared` and how many, or its error.
    let mut plan: Vec<Result<(usize, usize, usize)>> = Vec::with_capacity(requests.len());
    for request in requests {
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                plan.push(Err(e));
                continue;
            }
        };
        let start = prepared.len();
        let mut unknown = 0;
        let mut failure = None;
        for (row_no, row) in request.rows.iter().enumerate() {
            let result = row.history.with_external(|history| match &row.exclude {
                Some(exclude) => exclude.with_external(|exclude| {
                    engine.prepare(
                        &Request {
                            history,
                            k: row.k,
                            exclude: Some(exclude),
                            candidates: None,
                        },
                        options,
                    )
                }),
                None => engine.prepare(
                    &Request {
                        history,
                        k: row.k,
                        exclude: None,
                        candidates: None,
                    },
                    options,
                ),
            });
            match result {
                Ok((internal, n_unknown)) => {
                    unknown += n_unknown.history;
                    prepared.push(internal);
                }
                Err(e) => {
                    failure = Some(if request.rows.len() > 1 {
                        BackendError::InvalidInput(format!("history {row_no}: {e}"))
                    } else {
                        BackendError::Engine(e)
                    });
                    break;
                }
            }
        }
        match failure {
            Some(e) => {
                prepared.truncate(start);
                plan.push(Err(e));
            }
            None => plan.push(Ok((start, prepared.len() - start, unknown))),
        }
    }

    let (mut answers, device_error) = match recommender.recommend_batch(&prepared) {
        Ok(answers) => (answers.into_iter(), None),
        Err(e) => (Vec::new().into_iter(), Some(e.to_string())),
    };
    let summary = BatchSummary {
        engine_rows: prepared.len(),
    };
    let results = plan
        .into_iter()
        .map(|entry| {
            let (_, count, unknown_ids) = entry?;
            if let Some(message) = &device_error {
                return Err(BackendError::Internal(message.clone()));
            }
            let mut rows = Vec::with_capacity(count);
            let mut truncated = 0;
            for (items, note) in answers.by_ref().take(count) {
                truncated += usize::from(note.truncated);
                rows.push(items);
            }
            Ok(Answer {
                rows,
                unknown_ids,
                truncated,
            })
        })
        .collect();
    (results, summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{OwnedIds, RowRequest};

    fn engine() -> (Engine, tempfile::TempDir) {
        crate::test_support::fixture_engine("multivae", recsys_engine::ModelKind::Vaecf)
    }

    fn row(ids: &[i64], k: Option<i64>) -> RowRequest {
        RowRequest {
            history: OwnedIds::Int(ids.to_vec()),
            k,
            exclude: None,
        }
    }

    #[test]
    fn a_bad_request_does_not_disturb_its_batch() {
        let (engine, _tmp) = engine();
        let options = ServeOptions {
            unknown_items: recsys_engine::UnknownItemPolicy::Error,
            ..ServeOptions::default()
        };
        let requests = vec![
            Ok(DecodedRequest {
                rows: vec![row(&[10011403, 10011207], Some(3))],
            }),
            Err(BackendError::InvalidInput("ITEM_IDS is broken".into())),
            Ok(DecodedRequest {
                rows: vec![row(&[10011403, 42], None)],
            }),
            Ok(DecodedRequest {
                rows: vec![row(&[10011403], Some(2)), row(&[], Some(4))],
            }),
        ];
        let (answers, summary) = serve(&engine, &options, requests, &engine);
        assert_eq!(summary.engine_rows, 3);
        let first = answers[0].as_ref().unwrap();
        assert_eq!(first.rows[0].len(), 3);
        assert!(answers[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("broken"));
        assert!(answers[2]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("unknown"));
        let last = answers[3].as_ref().unwrap();
        assert_eq!((last.rows[0].len(), last.rows[1].len()), (2, 4));

        // Each history's answer equals the one it gets alone.
        let (alone, _) = serve(
            &engine,
            &options,
            vec![Ok(DecodedRequest {
                rows: vec![row(&[10011403, 10011207], Some(3))],
            })],
            &engine,
        );
        assert_eq!(alone[0].as_ref().unwrap(), first);
    }

    /// A device standing in for the GPU path: the engine's encoder, then the output layer computed
    /// the slow way (f64 dot products over every item): what any recommender must answer.
    struct ReferenceDevice<'a>(&'a Engine);

    impl recsys_engine::BatchRecommender for ReferenceDevice<'_> {
        fn recommend_batch(
            &self,
            batch: &[recsys_engine::InternalRequest],
        ) -> recsys_engine::Result<Vec<(Vec<Scored>, recsys_engine::models::HistoryNote)>> {
            let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
            let (hidden, notes) = self.0.model.encode(&histories);
            let out = self.0.model.output();
            let d = out.input_size();
            Ok(batch
                .iter()
                .enumerate()
                .map(|(r, request)| {
                    let excluded = recsys_engine::excluded_items(request);
                    let h = &hidden[r * d..(r + 1) * d];
                    let mut scored: Vec<Scored> = (1..out.n_outputs())
                        .filter(|i| !excluded.contains(&(*i as u32)))
                        .map(|i| {
                            let mut w = vec![0f32; d];
                            out.weight.add_row_into(i, &mut w);
                            let dot: f64 =
                                w.iter().zip(h).map(|(a, b)| *a as f64 * *b as f64).sum();
                            Scored {
                                index: i as u32,
                                score: (dot + out.bias.as_slice()[i] as f64) as f32,
                            }
                        })
                        .collect();
                    scored.sort_by(recsys_engine::topk::rank_order);
                    scored.truncate(request.k);
                    scored
                })
                .zip(notes)
                .collect())
        }
    }

    struct BrokenDevice;

    impl recsys_engine::BatchRecommender for BrokenDevice {
        fn recommend_batch(
            &self,
            _: &[recsys_engine::InternalRequest],
        ) -> recsys_engine::Result<Vec<(Vec<Scored>, recsys_engine::models::HistoryNote)>> {
            Err(recsys_engine::EngineError::Device(
                "the device fell off the bus".into(),
            ))
        }
    }

    #[test]
    fn another_recommender_answers_like_the_cpu_engine() {
        let (engine, _tmp) = engine();
        let options = ServeOptions::default();
        let requests = || {
            vec![
                Ok(DecodedRequest {
                    rows: vec![
                        row(&[10011403, 10011207], Some(5)),
                        row(&[10011739], Some(20)),
                    ],
                }),
                Ok(DecodedRequest {
                    rows: vec![row(&[10011788, 10011403], None)],
                }),
            ]
        };
        let (cpu, _) = serve(&engine, &options, requests(), &engine);
        let (dev, _) = serve(&engine, &options, requests(), &ReferenceDevice(&engine));
        for (a, b) in cpu.iter().zip(&dev) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            for (ra, rb) in a.rows.iter().zip(&b.rows) {
                assert_eq!(ra.len(), rb.len());
                for (x, y) in ra.iter().zip(rb) {
                    assert_eq!(x.index, y.index);
                    assert!((x.score - y.score).abs() < 1e-4, "{x:?} vs {y:?}");
                }
            }
        }
    }

    #[test]
    fn a_failing_device_fails_its_batch_with_the_reason_and_keeps_request_errors() {
        let (engine, _tmp) = engine();
        let options = ServeOptions::default();
        let requests = vec![
            Ok(DecodedRequest {
                rows: vec![row(&[10011403], Some(5))],
            }),
            Err(BackendError::InvalidInput("broken".into())),
        ];
        let (answers, _) = serve(&engine, &options, requests, &BrokenDevice);
        let first = answers[0].as_ref().unwrap_err().to_string();
        assert!(first.contains("the device fell off the bus"), "{first}");
        assert!(answers[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("broken"));
    }
}
