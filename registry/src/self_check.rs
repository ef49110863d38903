//! The self-check a canary replica must pass before a version may serve: a fixed history, and the
//! answer the publisher's own engine gave to it. The canary asks the replica the same question
//! through Triton and compares. It catches what loading alone cannot: a model whose scores
//! overflow (finite weights, infinite or NaN scores: a diverged training run), and a replica that
//! answers differently from the engine that was published (a backend or configuration that does
//! not match the engine).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use recsys_engine::{Engine, ExternalId, ExternalIds, Request, ServeOptions, UnknownItemPolicy};

use crate::error::{RegistryError, Result};

/// Items asked for by the self-check request.
pub const SELF_CHECK_K: usize = 10;
/// Items in the self-check history (spread over the catalogue).
const HISTORY_ITEMS: usize = 3;
/// How far a replica's score may be from the publisher's: the same engine on another CPU may take
/// another kernel (AVX-512, AVX2, scalar) whose sums round differently in the last bits. Far
/// looser than that, far tighter than any wrong model.
pub const SCORE_TOLERANCE: f32 = 1e-3;

/// One item of an answer: its catalogue id (a JSON number for int64 catalogues, a string
/// otherwise) and score (`None`: not a finite number).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ranked {
    pub id: Value,
    pub score: Option<f32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelfCheck {
    /// The history sent, oldest first, in catalogue ids.
    pub history: Vec<Value>,
    /// The K the request sends.
    pub k: usize,
    /// The publisher's answer with the history's own items allowed (k + history items, best
    /// first), so that a replica configured with `exclude_seen` can be checked against it too.
    /// Empty for a check made without the engine at hand (only finiteness is checked then).
    pub expected: Vec<Ranked>,
}

fn id_value(id: ExternalId) -> Value {
    match id {
        ExternalId::Int(i) => Value::from(i),
        ExternalId::Str(s) => Value::from(s),
    }
}

fn tolerance(score: f32) -> f32 {
    SCORE_TOLERANCE * score.abs().max(1.0)
}

impl SelfCheck {
    /// The self-check of `engine`: a history of items spread over the catalogue, and the
    /// engine's own answer to it.
    pub fn from_engine(engine: &Engine) -> Result<SelfCheck> {
        let n = engine.n_items();
        if n == 0 {
            return Err(RegistryError::Input(
                "the engine has an empty catalogue".into(),
            ));
        }
        let mut indices: Vec<u32> = (0..HISTORY_ITEMS)
            .map(|i| (1 + i * n / HISTORY_ITEMS) as u32)
            .collect();
        indices.dedup();
        let history: Vec<ExternalId> = indices
            .iter()
            .map(|&i| {
                engine.external_id(i).ok_or_else(|| {
                    RegistryError::Input(format!("the engine has no item at index {i}"))
                })
            })
            .collect::<Result<_>>()?;
        let ints: Vec<i64>;
        let strs: Vec<&str>;
        let ids = match &history[0] {
            ExternalId::Int(_) => {
                ints = history
                    .iter()
                    .filter_map(|id| match id {
                        ExternalId::Int(i) => Some(*i),
                        ExternalId::Str(_) => None,
                    })
                    .collect();
                ExternalIds::Int(&ints)
            }
            ExternalId::Str(_) => {
                strs = history
                    .iter()
                    .filter_map(|id| match id {
                        ExternalId::Str(s) => Some(s.as_str()),
                        ExternalId::Int(_) => None,
                    })
                    .collect();
                ExternalIds::Str(&strs)
            }
        };
        let k = SELF_CHECK_K.min(n);
        let options = ServeOptions {
            default_k: k,
            exclude_seen: false,
            unknown_items: UnknownItemPolicy::Error,
            empty_history: Default::default(),
        };
        let request = Request {
            history: ids,
            k: Some((k + history.len()).min(n) as i64),
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: None,
        };
        let answer = engine
            .recommend(&[request], &options)
            .pop()
            .expect("one answer per request")?;
        let expected = answer
            .items
            .iter()
            .map(|s| {
                let id = engine.external_id(s.index).ok_or_else(|| {
                    RegistryError::Input(format!("the engine answered unknown index {}", s.index))
                })?;
                Ok(Ranked {
                    id: id_value(id),
                    score: s.score.is_finite().then_some(s.score),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SelfCheck {
            history: history.into_iter().map(id_value).collect(),
            k,
            expected,
        })
    }

    /// Whether `answer` (a replica's top items, best first) is this check's answer: every score
    /// finite, and, when the expected answer is known, the same items with the same scores within
    /// [`SCORE_TOLERANCE`] (near-ties may come in either order), with or without the history's own
    /// items (the server's `exclude_seen`). The error says what differs.
    pub fn check(&self, answer: &[Ranked]) -> std::result::Result<(), String> {
        if let Some(rank) = self.expected.iter().position(|r| r.score.is_none()) {
            return Err(format!(
                "the published engine itself gives a non-finite score at rank {} for the \
                 self-check history (a diverged or overflowing model)",
                rank + 1
            ));
        }
        if let Some(rank) = answer.iter().position(|r| r.score.is_none()) {
            return Err(format!(
                "the replica answered a non-finite score at rank {}",
                rank + 1
            ));
        }
        if answer.is_empty() {
            return Err("the replica answered no items".into());
        }
        if self.expected.is_empty() {
            return Ok(());
        }
        let all: Vec<&Ranked> = self.expected.iter().collect();
        let unseen: Vec<&Ranked> = self
            .expected
            .iter()
            .filter(|r| !self.history.contains(&r.id))
            .collect();
        let first = self.compare(answer, &all);
        if first.is_ok() || self.compare(answer, &unseen).is_ok() {
            return Ok(());
        }
        first
    }

    fn compare(&self, answer: &[Ranked], expected: &[&Ranked]) -> std::result::Result<(), String> {
        let want = &expected[..self.k.min(expected.len())];
        if answer.len() != want.len() {
            return Err(format!(
                "the replica answered {} items where the published engine gives {}",
                answer.len(),
                want.len()
            ));
        }
        for (rank, (got, want)) in answer.iter().zip(want).enumerate() {
            let (got_score, want_score) =
                (got.score.unwrap_or(f32::NAN), want.score.unwrap_or(0.0));
            if (got_score - want_score).abs() > tolerance(want_score) {
                return Err(format!(
                    "at rank {} the replica scores {} where the published engine scores {} \
                     (tolerance {})",
                    rank + 1,
                    got_score,
                    want_score,
                    tolerance(want_score)
                ));
            }
            // Another item at this rank is fine only as a near-tie the publisher ranked nearby.
            let tied = expected.iter().any(|e| {
                e.id == got.id && (e.score.unwrap_or(0.0) - got_score).abs() <= tolerance(got_score)
            });
            if got.id != want.id && !tied {
                return Err(format!(
                    "at rank {} the replica answered item {} where the published engine answers {}",
                    rank + 1,
                    got.id,
                    want.id
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranked(items: &[(i64, f32)]) -> Vec<Ranked> {
        items
            .iter()
            .map(|&(id, score)| Ranked {
                id: Value::from(id),
                score: score.is_finite().then_some(score),
            })
            .collect()
    }

    fn check() -> SelfCheck {
        SelfCheck {
            history: vec![Value::from(7), Value::from(9)],
            k: 3,
            expected: ranked(&[(7, 5.0), (1, 4.0), (2, 3.0), (3, 2.9995), (9, 1.0)]),
        }
    }

    #[test]
    fn the_published_answer_passes_with_or_without_the_history_and_near_ties_in_any_order() {
        let c = check();
        assert_eq!(c.check(&ranked(&[(7, 5.0), (1, 4.0), (2, 3.0)])), Ok(()));
        // exclude_seen on the server: 7 is left out, the list moves up.
        assert_eq!(c.check(&ranked(&[(1, 4.0), (2, 3.0), (3, 2.9995)])), Ok(()));
        // 2 and 3 within the tolerance: either order.
        assert_eq!(c.check(&ranked(&[(1, 4.0), (3, 2.9995), (2, 3.0)])), Ok(()));
        // A few ulps off, as another kernel would give.
        assert_eq!(
            c.check(&ranked(&[(7, 5.000001), (1, 4.0), (2, 2.999999)])),
            Ok(())
        );
    }

    #[test]
    fn a_different_model_or_a_non_finite_score_fails_and_says_why() {
        let c = check();
        let err = c
            .check(&ranked(&[(7, 5.0), (1, 4.0), (5, 3.0)]))
            .unwrap_err();
        assert!(err.contains("item 5"), "{err}");
        let err = c
            .check(&ranked(&[(7, 5.0), (1, 4.5), (2, 3.0)]))
            .unwrap_err();
        assert!(err.contains("rank 2") && err.contains("4.5"), "{err}");
        let err = c
            .check(&ranked(&[(7, f32::INFINITY), (1, 4.0), (2, 3.0)]))
            .unwrap_err();
        assert!(err.contains("non-finite score at rank 1"), "{err}");
        let err = c.check(&ranked(&[(7, 5.0)])).unwrap_err();
        assert!(
            err.contains("1 items where the published engine gives 3"),
            "{err}"
        );
        assert!(c.check(&[]).is_err());
        let mut overflowing = check();
        overflowing.expected[1].score = None;
        let err = overflowing
            .check(&ranked(&[(7, 5.0), (1, 4.0), (2, 3.0)]))
            .unwrap_err();
        assert!(err.contains("published engine itself"), "{err}");
        // Without an expected answer only finiteness counts.
        let blind = SelfCheck {
            expected: Vec::new(),
            ..check()
        };
        assert_eq!(blind.check(&ranked(&[(4, 1.0)])), Ok(()));
        assert!(blind.check(&ranked(&[(4, f32::NAN)])).is_err());
    }

    #[test]
    fn the_engines_own_answer_passes_its_self_check() {
        use recsys_engine::{engine_dir::Precision, fixtures, ModelKind};
        for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("engine");
            let engine =
                fixtures::convert(kind, "model.safetensors", &out, Precision::Fp32).unwrap();
            let check = SelfCheck::from_engine(&engine).unwrap();
            assert_eq!(check.history.len(), HISTORY_ITEMS);
            assert_eq!(check.expected.len(), check.k + HISTORY_ITEMS);
            let answer: Vec<Ranked> = check.expected[..check.k].to_vec();
            assert_eq!(check.check(&answer), Ok(()), "{kind:?}");
            let round_trip: SelfCheck =
                serde_json::from_value(serde_json::to_value(&check).unwrap()).unwrap();
            assert_eq!(round_trip, check);
        }
    }
}
