//! Running the decoded requests of one Execute call as a single engine batch.

use crate::decode::{DecodedRequest, OwnedIds, RequestedOutputs};
use crate::error::{BackendError, Result};
use recsys_engine::topk::Scored;
use recsys_engine::{Engine, InternalRequest, Request, RowAnswer, ServeOptions, UnknownIds};

/// The answer to one request: one ranked list per history, plus what the metrics count.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    pub rows: Vec<Vec<Scored>>,
    /// Per history, its user embedding when the request asked for it (else empty).
    pub embeddings: Vec<Vec<f32>>,
    /// The outputs the request asked for.
    pub outputs: RequestedOutputs,
    pub unknown_ids: usize,
    pub truncated: usize,
    /// Candidate ids the catalogue does not know (dropped).
    pub unknown_candidates: usize,
    /// Per screened whole-catalogue history, the items its int8 screen kept and rescored.
    pub screen_survivors: Vec<u32>,
    /// Histories the popularity list answered (no known item, `empty_history_policy`).
    pub popular: usize,
    /// The version of the live availability object the batch was filtered by (`None`: none in
    /// force).
    pub availability_version: Option<u64>,
}

/// What one batch did, for statistics and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// Histories that went through the model together.
    pub engine_rows: usize,
}

/// Where one request's rows sit in the batch, and what its ids missed.
struct Planned {
    start: usize,
    count: usize,
    unknown: UnknownIds,
    outputs: RequestedOutputs,
}

/// One prepared row's answer, or the reason its recommender failed.
type RowResult = std::result::Result<RowAnswer, String>;

/// Answers every decodable request; all their histories run as one engine batch. A request whose
/// decoding failed, or one of whose histories the engine refuses, gets its own error; the others
/// are unaffected. Rows with candidates are ranked by the CPU engine (the device path scans whole
/// catalogues); the others by `recommender`.
pub fn serve(
    engine: &Engine,
    options: &ServeOptions,
    requests: Vec<Result<DecodedRequest>>,
    recommender: &dyn recsys_engine::BatchRecommender,
) -> (Vec<Result<Answer>>, BatchSummary) {
    // One view for the whole batch: a live availability update lands between batches.
    let view = engine.filters.view();
    let mut prepared: Vec<InternalRequest> = Vec::new();
    let mut plan: Vec<Result<Planned>> = Vec::with_capacity(requests.len());
    for request in requests {
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                plan.push(Err(e));
                continue;
            }
        };
        let start = prepared.len();
        let mut unknown = UnknownIds::default();
        let mut failure = None;
        for (row_no, row) in request.rows.iter().enumerate() {
            let result = row.history.with_external(|history| {
                OwnedIds::with_optional(row.exclude.as_ref(), |exclude| {
                    OwnedIds::with_optional(row.candidates.as_ref(), |candidates| {
                        engine.prepare_in(
                            &view,
                            &Request {
                                history,
                                k: row.k,
                                exclude,
                                candidates,
                                embedding: row.embedding,
                                filter: row.filter.as_ref(),
                                times: row.times(),
                            },
                            options,
                        )
                    })
                })
            });
            match result {
                Ok((internal, n_unknown)) => {
                    unknown.history += n_unknown.history;
                    unknown.candidates += n_unknown.candidates;
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
            None => plan.push(Ok(Planned {
                start,
                count: prepared.len() - start,
                unknown,
                outputs: request.outputs,
            })),
        }
    }

    let answers = answer_rows(engine, recommender, &prepared);
    let summary = BatchSummary {
        engine_rows: prepared.len(),
    };
    let results = plan
        .into_iter()
        .map(|entry| {
            let planned = entry?;
            let mut rows = Vec::with_capacity(planned.count);
            let mut embeddings = Vec::with_capacity(planned.count);
            let mut truncated = 0;
            let mut screen_survivors = Vec::new();
            let popular = prepared[planned.start..planned.start + planned.count]
                .iter()
                .filter(|r| r.popular)
                .count();
            for answer in &answers[planned.start..planned.start + planned.count] {
                let (items, note, embedding) = answer
                    .as_ref()
                    .map_err(|message| BackendError::Internal(message.clone()))?;
                truncated += usize::from(note.truncated);
                screen_survivors.extend(note.screen_survivors);
                rows.push(items.clone());
                embeddings.push(embedding.clone());
            }
            Ok(Answer {
                rows,
                embeddings,
                outputs: planned.outputs,
                unknown_ids: planned.unknown.history,
                truncated,
                unknown_candidates: planned.unknown.candidates,
                screen_survivors,
                popular,
                availability_version: view.availability_version(),
            })
        })
        .collect();
    (results, summary)
}

/// Each prepared row's answer: candidate rows from the CPU engine, the others from
/// `recommender`, each group as one batch (a failing recommender fails its group's rows).
fn answer_rows(
    engine: &Engine,
    recommender: &dyn recsys_engine::BatchRecommender,
    prepared: &[InternalRequest],
) -> Vec<RowResult> {
    let run =
        |r: &dyn recsys_engine::BatchRecommender, batch: &[InternalRequest]| -> Vec<RowResult> {
            match r.recommend_batch(batch) {
                Ok(answers) => answers.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e.to_string()); batch.len()],
            }
        };
    // The device kernels scan whole catalogues without filters: candidate and filtered rows go to
    // the CPU engine.
    let on_cpu = |r: &InternalRequest| r.candidates.is_some() || r.eligible.is_some() || r.popular;
    let with_candidates = prepared.iter().filter(|r| on_cpu(r)).count();
    if with_candidates == 0 {
        return run(recommender, prepared);
    }
    if with_candidates == prepared.len() {
        return run(engine, prepared);
    }
    let (candidate_rows, other_rows): (Vec<usize>, Vec<usize>) =
        (0..prepared.len()).partition(|&i| on_cpu(&prepared[i]));
    let pick = |rows: &[usize]| -> Vec<InternalRequest> {
        rows.iter().map(|&i| prepared[i].clone()).collect()
    };
    let mut answers: Vec<Option<RowResult>> = vec![None; prepared.len()];
    for (rows, part) in [
        (&candidate_rows, run(engine, &pick(&candidate_rows))),
        (&other_rows, run(recommender, &pick(&other_rows))),
    ] {
        for (&i, answer) in rows.iter().zip(part) {
            answers[i] = Some(answer);
        }
    }
    answers
        .into_iter()
        .map(|a| a.expect("every row is in one group"))
        .collect()
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
            candidates: None,
            embedding: false,
            filter: None,
            timestamps: None,
            query_timestamp: None,
        }
    }

    fn request(rows: Vec<RowRequest>) -> DecodedRequest {
        DecodedRequest {
            rows,
            outputs: RequestedOutputs::TOP_K,
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
            Ok(request(vec![row(&[10011403, 10011207], Some(3))])),
            Err(BackendError::InvalidInput("ITEM_IDS is broken".into())),
            Ok(request(vec![row(&[10011403, 42], None)])),
            Ok(request(vec![row(&[10011403], Some(2)), row(&[], Some(4))])),
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
            vec![Ok(request(vec![row(&[10011403, 10011207], Some(3))]))],
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
        ) -> recsys_engine::Result<Vec<RowAnswer>> {
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
                .map(|(items, note)| (items, note, Vec::new()))
                .collect())
        }
    }

    struct BrokenDevice;

    impl recsys_engine::BatchRecommender for BrokenDevice {
        fn recommend_batch(
            &self,
            _: &[recsys_engine::InternalRequest],
        ) -> recsys_engine::Result<Vec<RowAnswer>> {
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
                Ok(request(vec![
                    row(&[10011403, 10011207], Some(5)),
                    row(&[10011739], Some(20)),
                ])),
                Ok(request(vec![row(&[10011788, 10011403], None)])),
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
            Ok(request(vec![row(&[10011403], Some(5))])),
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

    #[test]
    fn candidate_rows_are_ranked_by_the_engine_beside_the_device_rows() {
        let (engine, _tmp) = engine();
        let options = ServeOptions::default();
        let mut with_candidates = row(&[10011403, 10011207], Some(3));
        // Known items, one unknown id and a history item (left out).
        with_candidates.candidates = Some(OwnedIds::Int(vec![
            10011739, 10011788, 10011403, -1, 10011550,
        ]));
        let requests = vec![
            Ok(request(vec![with_candidates])),
            Ok(request(vec![row(&[10011403], Some(5))])),
        ];
        // The device fails its rows; the candidate row does not go there.
        let (answers, _) = serve(&engine, &options, requests, &BrokenDevice);
        let ranked = answers[0].as_ref().unwrap();
        assert_eq!(ranked.unknown_candidates, 1);
        assert_eq!(ranked.rows[0].len(), 3);
        let wanted = engine
            .recommend(
                &[Request {
                    history: recsys_engine::ExternalIds::Int(&[10011403, 10011207]),
                    k: Some(3),
                    exclude: None,
                    candidates: Some(recsys_engine::ExternalIds::Int(&[
                        10011739, 10011788, 10011403, 10011550,
                    ])),
                    embedding: false,
                    filter: None,
                    times: None,
                }],
                &options,
            )
            .remove(0)
            .unwrap();
        assert_eq!(ranked.rows[0], wanted.items);
        assert!(answers[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("the device fell off the bus"));
    }

    #[test]
    fn embeddings_come_with_or_without_items_and_score_like_the_output_layer() {
        let (engine, _tmp) = engine();
        let options = ServeOptions::default();
        let with = |history: &[i64], k: Option<i64>, candidates: Option<Vec<i64>>| RowRequest {
            embedding: true,
            candidates: candidates.map(OwnedIds::Int),
            ..row(history, k)
        };
        let outputs = RequestedOutputs {
            item_ids: true,
            scores: true,
            embedding: true,
        };
        let requests = vec![
            // Embedding alone, embedding with the top 5, embedding with candidates, and a plain
            // request in the same batch.
            Ok(DecodedRequest {
                rows: vec![with(&[10011403, 10011207], Some(0), None)],
                outputs,
            }),
            Ok(DecodedRequest {
                rows: vec![with(&[10011739], Some(5), None)],
                outputs,
            }),
            Ok(DecodedRequest {
                rows: vec![with(
                    &[10011788],
                    Some(2),
                    Some(vec![10011403, 10011550, 10011739]),
                )],
                outputs,
            }),
            Ok(request(vec![row(&[10011403], Some(4))])),
        ];
        let (answers, summary) = serve(&engine, &options, requests, &engine);
        assert_eq!(summary.engine_rows, 4);
        let width = engine.model.output().input_size() + 1;
        let out = engine.model.output();
        for (i, answer) in answers.iter().take(3).enumerate() {
            let answer = answer.as_ref().unwrap();
            let user = &answer.embeddings[0];
            assert_eq!(user.len(), width, "request {i}");
            assert_eq!(user[width - 1], 1.0);
            // [h, 1] . [w_i, b_i] is the score of every item the request got back.
            for item in &answer.rows[0] {
                let mut w = vec![0f32; width - 1];
                out.weight.add_row_into(item.index as usize, &mut w);
                w.push(out.bias.as_slice()[item.index as usize]);
                let dot: f32 = w.iter().zip(user).map(|(a, b)| a * b).sum();
                assert!(
                    (dot - item.score).abs() < 1e-4,
                    "request {i}: {dot} vs {item:?}"
                );
            }
        }
        let lens: Vec<usize> = answers
            .iter()
            .map(|a| a.as_ref().unwrap().rows[0].len())
            .collect();
        assert_eq!(lens, [0, 5, 2, 4]);
        assert!(answers[3].as_ref().unwrap().embeddings[0].is_empty());
    }
}
