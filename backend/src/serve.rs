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
                        },
                        options,
                    )
                }),
                None => engine.prepare(
                    &Request {
                        history,
                        k: row.k,
                        exclude: None,
                    },
                    options,
                ),
            });
            match result {
                Ok((internal, n_unknown)) => {
                    unknown += n_unknown;
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

    let mut answers = engine.recommend_internal(&prepared).into_iter();
    let summary = BatchSummary {
        engine_rows: prepared.len(),
    };
    let results = plan
        .into_iter()
        .map(|entry| {
            let (_, count, unknown_ids) = entry?;
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
        let (answers, summary) = serve(&engine, &options, requests);
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
        );
        assert_eq!(alone[0].as_ref().unwrap(), first);
    }
}
