//! The quality gate (champion and challenger): before the repository names a candidate, the
//! canary replica answers a set of held-out histories with the candidate and then with the version
//! that serves, and the candidate is refused when its NDCG@10 on them falls more than a threshold
//! below the serving version's, or when its scores are degenerate (non-finite, or every top-k score
//! of most answers the same number, so that its ranking means nothing). Integrity and the
//! self-check cannot see the second: a model whose output bias is float32's largest value gives
//! finite scores, the same answer on every engine, and a meaningless ranking.
//!
//! The evaluation set is the `recsys eval` test set (`user_id <TAB> target <TAB> history`) given to
//! `publish --eval-set`, stored in the version's folder as [`EVAL_SET_FILE`] and checked by the
//! integrity gate like the engine's files. A version published without one is judged on the set
//! of the version that serves (the champion's own held-out histories); when neither has one, only
//! the degenerate-score check runs, on the self-check's histories, and the report says so.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::self_check::{Ranked, SelfCheck};

/// The evaluation set's name inside a version's folder.
pub const EVAL_SET_FILE: &str = "recsys-eval-set.tsv";
/// The cut-off of the gate's metric.
pub const QUALITY_K: usize = 10;
/// The largest relative drop of NDCG@10 below the serving version a candidate may have.
pub const DEFAULT_MAX_NDCG_DROP: f64 = 0.05;
/// How many histories of the evaluation set the canary sends (spread evenly over the set).
pub const DEFAULT_QUALITY_HISTORIES: usize = 500;
/// Above this share of flat answers (every top-k score the same number, or non-finite), a
/// version's scores are degenerate.
pub const DEGENERATE_SHARE: f64 = 0.5;
/// Two scores closer than this (relative to their size, at least 1) count as the same number.
const FLAT_TOLERANCE: f32 = 1e-6;

/// How an approve runs the gate.
#[derive(Clone, Debug)]
pub struct QualityOptions {
    /// Approve without the gate (recorded on the version).
    pub skip: bool,
    /// The largest relative NDCG@10 drop below the serving version ([`DEFAULT_MAX_NDCG_DROP`]).
    pub max_drop: f64,
    /// Histories sent per version ([`DEFAULT_QUALITY_HISTORIES`]).
    pub histories: usize,
}

impl Default for QualityOptions {
    fn default() -> Self {
        QualityOptions {
            skip: false,
            max_drop: DEFAULT_MAX_NDCG_DROP,
            histories: DEFAULT_QUALITY_HISTORIES,
        }
    }
}

/// `max_drop` if it is a fraction the gate can use: finite, at least 0 and below 1. Anything else
/// would disable the comparison without a word (`5` meant as 5 %, `nan`: no candidate is ever
/// below the floor) or refuse every candidate (a negative drop), so it is refused naming why.
pub fn check_max_drop(max_drop: f64) -> Result<f64, String> {
    if !max_drop.is_finite() || !(0.0..1.0).contains(&max_drop) {
        return Err(format!(
            "the largest NDCG@10 drop is a fraction from 0 up to (not including) 1, e.g. 0.05 for \
             5 %; {max_drop} {}",
            if max_drop.is_nan() {
                "is not a number".to_string()
            } else if max_drop >= 1.0 {
                format!(
                    "would let every candidate through (did you mean {}?)",
                    max_drop / 100.0
                )
            } else if max_drop < 0.0 {
                "would refuse every candidate that is not better than the serving version".into()
            } else {
                "is not finite".into()
            }
        ));
    }
    Ok(max_drop)
}

/// One held-out history and the item that came next, in catalogue ids as the request sends them.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalCase {
    pub history: Vec<Value>,
    pub target: Option<Value>,
}

/// What the canary asks of both versions.
#[derive(Clone, Debug)]
pub struct QualityCheck {
    pub cases: Vec<EvalCase>,
    /// Where the cases came from ("version 4's evaluation set").
    pub source: String,
    pub max_drop: f64,
}

/// How one version answered the evaluation set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VersionScore {
    pub version: u64,
    /// NDCG@10 over the cases with a target (`None`: the set has no targets).
    pub ndcg_at_10: Option<f64>,
    /// The share of answers whose top-k scores are flat or non-finite.
    pub degenerate_share: f64,
    pub histories: usize,
}

/// The gate's outcome, recorded on the candidate's version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QualityReport {
    pub source: String,
    pub candidate: VersionScore,
    /// The serving version on the same histories (`None`: nothing serves yet, or it could not be
    /// scored).
    pub serving: Option<VersionScore>,
    /// Why the serving version could not be scored (it no longer loads on the canary: the
    /// candidate is then judged on its own scores, as a repair of a broken version must be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_unscored: Option<String>,
    pub max_drop: f64,
    /// Why the candidate was refused.
    pub refused: Option<String>,
}

/// The typed id of `text` for a catalogue of integer (`strings` false) or string ids.
pub fn id_value(text: &str, strings: bool) -> Value {
    match (strings, text.parse::<i64>()) {
        (false, Ok(i)) => Value::from(i),
        _ => Value::from(text),
    }
}

/// `limit` cases spread evenly over `cases` (all of them when there are fewer), the empty
/// histories left out: a version answers those from popularity, not from the model.
pub fn sample(
    cases: &[recsys_engine::metrics::TestCase],
    strings: bool,
    limit: usize,
) -> Vec<EvalCase> {
    let usable: Vec<&recsys_engine::metrics::TestCase> =
        cases.iter().filter(|c| !c.history.is_empty()).collect();
    let take = usable.len().min(limit.max(1));
    (0..take)
        .map(|i| usable[i * usable.len() / take])
        .map(|c| EvalCase {
            history: c.history.iter().map(|id| id_value(id, strings)).collect(),
            target: Some(id_value(&c.target, strings)),
        })
        .collect()
}

/// Whether an answer's scores say nothing about the ranking: a non-finite score, or every score
/// of a top-k of two or more the same number.
pub fn is_flat(answer: &[Ranked]) -> bool {
    if answer.iter().any(|r| r.score.is_none()) {
        return true;
    }
    let scores: Vec<f32> = answer.iter().filter_map(|r| r.score).collect();
    if scores.len() < 2 {
        return false;
    }
    let (lo, hi) = scores
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &s| {
            (lo.min(s), hi.max(s))
        });
    hi - lo <= FLAT_TOLERANCE * hi.abs().max(lo.abs()).max(1.0)
}

/// NDCG@10 of one answer for `target` (one relevant item: 1 / log2(rank + 2) within the top 10).
pub fn ndcg_at_10(answer: &[Ranked], target: &Value) -> f64 {
    answer
        .iter()
        .take(QUALITY_K)
        .position(|r| r.id == *target)
        .map_or(0.0, |rank| 1.0 / ((rank + 2) as f64).log2())
}

/// Scores `version` on `cases` with `ask` (one request per history, the answer best first).
pub fn score(
    version: u64,
    cases: &[EvalCase],
    ask: &mut dyn FnMut(&SelfCheck) -> std::result::Result<Vec<Ranked>, String>,
) -> std::result::Result<VersionScore, String> {
    let (mut ndcg, mut with_target, mut flat) = (0.0, 0usize, 0usize);
    for case in cases {
        let answer = ask(&SelfCheck {
            history: case.history.clone(),
            k: QUALITY_K,
            expected: Vec::new(),
        })?;
        if is_flat(&answer) {
            flat += 1;
        }
        if let Some(target) = &case.target {
            ndcg += ndcg_at_10(&answer, target);
            with_target += 1;
        }
    }
    Ok(VersionScore {
        version,
        ndcg_at_10: (with_target > 0).then(|| ndcg / with_target as f64),
        degenerate_share: flat as f64 / cases.len().max(1) as f64,
        histories: cases.len(),
    })
}

/// Why `candidate` may not serve, judged against `serving` (`None`: it may).
pub fn judge(
    candidate: &VersionScore,
    serving: Option<&VersionScore>,
    max_drop: f64,
) -> Option<String> {
    if candidate.degenerate_share > DEGENERATE_SHARE {
        return Some(format!(
            "degenerate scores: {:.0}% of version {}'s answers to {} held-out histories have every \
             top-{QUALITY_K} score the same number (or a non-finite one), so its ranking means \
             nothing",
            candidate.degenerate_share * 100.0,
            candidate.version,
            candidate.histories
        ));
    }
    let (Some(challenger), Some(champion)) = (
        candidate.ndcg_at_10,
        serving.and_then(|s| s.ndcg_at_10.map(|n| (s.version, n))),
    ) else {
        return None;
    };
    let (champion_version, champion) = champion;
    // An unusable drop fails closed: the candidate is refused, never waved through.
    if let Err(why) = check_max_drop(max_drop) {
        return Some(why);
    }
    let floor = champion * (1.0 - max_drop);
    (challenger < floor).then(|| {
        format!(
            "NDCG@10 {challenger:.4} on {} held-out histories is {:.1}% below the serving version \
             {champion_version}'s {champion:.4} (the gate allows {:.1}%)",
            candidate.histories,
            (1.0 - challenger / champion) * 100.0,
            max_drop * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(ids: &[i64], scores: &[f32]) -> Vec<Ranked> {
        ids.iter()
            .zip(scores)
            .map(|(&id, &s)| Ranked {
                id: json!(id),
                score: s.is_finite().then_some(s),
            })
            .collect()
    }

    #[test]
    fn ndcg_is_one_over_log2_of_the_rank_plus_two_within_the_top_10() {
        let a = answer(&[5, 7, 9], &[3.0, 2.0, 1.0]);
        assert_eq!(ndcg_at_10(&a, &json!(5)), 1.0);
        assert!((ndcg_at_10(&a, &json!(9)) - 0.5).abs() < 1e-12);
        assert_eq!(ndcg_at_10(&a, &json!(4)), 0.0);
        let long: Vec<i64> = (0..20).collect();
        let scores: Vec<f32> = (0..20).map(|i| 20.0 - i as f32).collect();
        assert_eq!(ndcg_at_10(&answer(&long, &scores), &json!(12)), 0.0);
    }

    #[test]
    fn flat_or_non_finite_answers_are_degenerate_and_real_ones_are_not() {
        // The output bias at float32's largest value: every score rounds to it.
        assert!(is_flat(&answer(&[1, 2, 3], &[3.4e38, 3.4e38, 3.4e38])));
        assert!(is_flat(&answer(&[1, 2], &[1.0, f32::NAN])));
        assert!(!is_flat(&answer(&[1, 2, 3], &[5.1, 4.9, 4.7])));
        assert!(!is_flat(&answer(&[1], &[5.0])));
        // Near ties at a large magnitude are still a ranking.
        assert!(!is_flat(&answer(&[1, 2], &[1000.0, 999.0])));
    }

    #[test]
    fn the_judge_refuses_degenerate_scores_and_a_drop_past_the_threshold() {
        let v = |version, ndcg: Option<f64>, flat| VersionScore {
            version,
            ndcg_at_10: ndcg,
            degenerate_share: flat,
            histories: 100,
        };
        let champion = v(1, Some(0.14), 0.0);
        assert!(judge(&v(2, Some(0.135), 0.0), Some(&champion), 0.05).is_none());
        let drop = judge(&v(2, Some(0.12), 0.0), Some(&champion), 0.05).unwrap();
        assert!(
            drop.contains("14.3% below") && drop.contains("version 1's 0.1400"),
            "{drop}"
        );
        let flat = judge(&v(2, Some(0.14), 0.9), Some(&champion), 0.05).unwrap();
        assert!(flat.contains("degenerate"), "{flat}");
        // Nothing to compare with: only the degenerate check.
        assert!(judge(&v(2, Some(0.01), 0.0), None, 0.05).is_none());
        assert!(judge(&v(2, None, 0.0), Some(&champion), 0.05).is_none());
    }

    #[test]
    fn the_sample_spreads_over_the_set_and_types_the_ids() {
        let cases: Vec<recsys_engine::metrics::TestCase> = (0..10)
            .map(|i| recsys_engine::metrics::TestCase {
                user_id: i.to_string(),
                target: format!("{}", 100 + i),
                history: if i == 3 { vec![] } else { vec![format!("{i}")] },
                times: None,
            })
            .collect();
        let s = sample(&cases, false, 3);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].target, Some(json!(100)));
        assert!(s.iter().all(|c| !c.history.is_empty()));
        assert_eq!(sample(&cases, true, 100).len(), 9);
        assert_eq!(sample(&cases, true, 1)[0].history, vec![json!("0")]);
    }

    #[test]
    fn a_max_drop_outside_zero_to_one_is_refused_and_never_waves_a_candidate_through() {
        for good in [0.0, 0.05, 0.5, 0.999] {
            assert_eq!(check_max_drop(good), Ok(good));
        }
        for (bad, says) in [
            (5.0, "let every candidate through (did you mean 0.05?)"),
            (1.0, "let every candidate through"),
            (f64::NAN, "not a number"),
            (f64::INFINITY, "let every candidate through"),
            (-0.05, "refuse every candidate"),
        ] {
            let err = check_max_drop(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let score = |version: u64, ndcg: f64| VersionScore {
            version,
            ndcg_at_10: Some(ndcg),
            degenerate_share: 0.0,
            histories: 100,
        };
        // A far worse candidate is refused whatever drop the caller passed.
        for drop in [5.0, f64::NAN] {
            assert!(judge(&score(2, 0.01), Some(&score(1, 0.2)), drop).is_some());
        }
        assert!(judge(&score(2, 0.199), Some(&score(1, 0.2)), 0.05).is_none());
    }
}
