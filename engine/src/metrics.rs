//! Leave-one-out ranking metrics over the full catalogue.
//!
//! For each user, `rank0` is the number of eligible items (not PAD, not in the input history) that
//! score strictly higher than the held-out target; a target in the history scores -inf and so ranks
//! after every eligible item. NDCG@k = 1/log2(rank0 + 2) if rank0 < k else 0, Recall@k = HR@k =
//! [rank0 < k], MRR = 1/(rank0 + 1); all averaged over users.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{EngineError, Result};
use crate::topk::ExclusionSet;

/// 0-based rank of `target` among the items not in `excluded`.
pub fn target_rank(scores: &[f32], target: u32, excluded: &ExclusionSet) -> usize {
    let target_score = if excluded.contains(target) {
        f32::NEG_INFINITY
    } else {
        scores[target as usize]
    };
    scores
        .iter()
        .enumerate()
        .filter(|&(i, &s)| s > target_score && !excluded.contains(i as u32))
        .count()
}

/// Accumulates ranks and reports the averages.
#[derive(Clone, Debug)]
pub struct RankingMetrics {
    ks: Vec<usize>,
    ndcg: Vec<f64>,
    hits: Vec<u64>,
    reciprocal_rank: f64,
    users: u64,
}

impl RankingMetrics {
    pub fn new(ks: &[usize]) -> Self {
        RankingMetrics {
            ks: ks.to_vec(),
            ndcg: vec![0.0; ks.len()],
            hits: vec![0; ks.len()],
            reciprocal_rank: 0.0,
            users: 0,
        }
    }

    /// Adds one user; `None` is a target the model cannot rank (not in its catalogue): a miss.
    pub fn add(&mut self, rank0: Option<usize>) {
        self.users += 1;
        let Some(rank0) = rank0 else { return };
        for (j, &k) in self.ks.iter().enumerate() {
            if rank0 < k {
                self.hits[j] += 1;
                self.ndcg[j] += 1.0 / ((rank0 + 2) as f64).log2();
            }
        }
        self.reciprocal_rank += 1.0 / (rank0 + 1) as f64;
    }

    pub fn users(&self) -> u64 {
        self.users
    }

    /// `ndcg@k`, `recall@k` for each k, then `mrr` and `n_users`, named as in the fixtures' metrics.json.
    pub fn summary(&self) -> BTreeMap<String, f64> {
        let n = self.users.max(1) as f64;
        let mut out = BTreeMap::new();
        for (j, &k) in self.ks.iter().enumerate() {
            out.insert(format!("ndcg@{k}"), self.ndcg[j] / n);
            out.insert(format!("recall@{k}"), self.hits[j] as f64 / n);
        }
        out.insert("mrr".into(), self.reciprocal_rank / n);
        out.insert("n_users".into(), self.users as f64);
        out
    }
}

/// One leave-one-out test case: external ids as text, so int and string catalogues share the reader.
#[derive(Clone, Debug, PartialEq)]
pub struct TestCase {
    pub user_id: String,
    pub target: String,
    pub history: Vec<String>,
    /// When the history's events and the target happened, from a test file with timestamp
    /// columns (what the models that read time need); `None` otherwise.
    pub times: Option<CaseTimes>,
}

/// A test case's timestamps (unix seconds): one per history id, and the target's (the query
/// time of the official HSTU protocol).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaseTimes {
    pub events: Vec<i64>,
    pub target: i64,
}

/// Reads `user_id <TAB> target_item_id <TAB> space-separated history` (header line optional),
/// or, under a header naming `target_timestamp`, `user_id <TAB> target_item_id <TAB>
/// target_timestamp <TAB> history <TAB> history timestamps` (space-separated, one per id).
/// A gzip-compressed file (its first bytes say so) is read decompressed.
pub fn read_test_set(path: &Path) -> Result<Vec<TestCase>> {
    let bytes = std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            EngineError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            EngineError::io(format!("cannot read {}", path.display()), e)
        }
    })?;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut plain)
            .map_err(|e| EngineError::io(format!("cannot decompress {}", path.display()), e))?;
        plain
    } else {
        bytes
    };
    let text = String::from_utf8(bytes).map_err(|_| EngineError::TestSet {
        path: path.to_path_buf(),
        line: 0,
        reason: "the file is not UTF-8 text".into(),
    })?;
    parse_test_set(&text, path)
}

/// [`read_test_set`] on text already read (from object storage, say); `source` names it in
/// errors.
pub fn parse_test_set(text: &str, source: &Path) -> Result<Vec<TestCase>> {
    let path = source;
    let mut cases = Vec::new();
    let mut timed = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if n == 0 && line.starts_with("user_id") {
            timed = line.split('\t').any(|column| column == "target_timestamp");
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let bad = |reason: String| EngineError::TestSet {
            path: path.to_path_buf(),
            line: n + 1,
            reason,
        };
        let mut fields = line.split('\t');
        let (Some(user), Some(target)) = (fields.next(), fields.next()) else {
            return Err(bad(if timed {
                "expected user_id<TAB>target_item_id<TAB>target_timestamp<TAB>history<TAB>\
                 history_timestamps"
                    .into()
            } else {
                "expected user_id<TAB>target_item_id<TAB>history".into()
            }));
        };
        let target_time = if timed {
            let field = fields.next().unwrap_or("").trim();
            Some(field.parse::<i64>().map_err(|_| {
                bad(format!(
                    "target_timestamp {field:?} is not an integer (unix seconds)"
                ))
            })?)
        } else {
            None
        };
        let history: Vec<String> = fields
            .next()
            .unwrap_or("")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let times = match target_time {
            None => None,
            Some(target) => {
                let events = fields
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .map(|t| {
                        t.parse::<i64>()
                            .map_err(|_| bad(format!("history timestamp {t:?} is not an integer")))
                    })
                    .collect::<Result<Vec<i64>>>()?;
                if events.len() != history.len() {
                    return Err(bad(format!(
                        "{} history timestamps for {} history ids: one per id",
                        events.len(),
                        history.len()
                    )));
                }
                Some(CaseTimes { events, target })
            }
        };
        cases.push(TestCase {
            user_id: user.to_owned(),
            target: target.trim().to_owned(),
            history,
            times,
        });
    }
    Ok(cases)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_counts_strictly_better_eligible_items() {
        let scores = [9.0, 1.0, 5.0, 5.0, 7.0];
        let mut ex = ExclusionSet::new(5);
        ex.insert(0);
        assert_eq!(target_rank(&scores, 2, &ex), 1); // 7.0 beats it, the tie at 3 does not
        ex.insert(4);
        assert_eq!(target_rank(&scores, 2, &ex), 0);
        ex.insert(2); // target in history: after every eligible item
        assert_eq!(target_rank(&scores, 2, &ex), 2);
    }

    #[test]
    fn summary_formulas() {
        let mut m = RankingMetrics::new(&[1, 10]);
        m.add(Some(0));
        m.add(Some(2));
        m.add(None);
        let s = m.summary();
        assert!((s["ndcg@1"] - 1.0 / 3.0).abs() < 1e-15);
        assert!((s["ndcg@10"] - (1.0 + 0.5) / 3.0).abs() < 1e-15);
        assert!((s["recall@10"] - 2.0 / 3.0).abs() < 1e-15);
        assert!((s["mrr"] - (1.0 + 1.0 / 3.0) / 3.0).abs() < 1e-15);
    }
}

/// The outcome of [`evaluate`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct EvalReport {
    /// `ndcg@k`, `recall@k`, `mrr`, `n_users`.
    pub metrics: BTreeMap<String, f64>,
    /// 0-based rank of each user's target, in test-file order (`None`: target not in the catalogue).
    #[serde(skip)]
    pub ranks: Vec<Option<usize>>,
    /// History ids unknown to the model, dropped as in serving.
    pub unknown_history_ids: usize,
    /// Users whose target is not in the catalogue (counted as misses).
    pub unknown_targets: usize,
    /// With an item filter: users whose target the filter leaves out (not counted: the filtered
    /// page could never show it).
    pub targets_outside_filter: usize,
}

/// Scores every test user over the full catalogue, `batch` users at a time, calling `progress` with
/// the number of users done.
pub fn evaluate(
    engine: &crate::Engine,
    cases: &[TestCase],
    ks: &[usize],
    batch: usize,
    progress: impl FnMut(usize),
) -> Result<EvalReport> {
    evaluate_filtered(engine, cases, ks, batch, None, progress)
}

/// [`evaluate`] as a filtered page would rank: only the items `eligible` keeps compete (an item
/// the filter leaves out never ranks above the target), and a user whose target the filter leaves
/// out is not counted (`targets_outside_filter`), since such a page could never show it.
pub fn evaluate_filtered(
    engine: &crate::Engine,
    cases: &[TestCase],
    ks: &[usize],
    batch: usize,
    eligible: Option<&crate::kernels::item_mask::ItemMask>,
    mut progress: impl FnMut(usize),
) -> Result<EvalReport> {
    let timed = engine.kind().reads_timestamps();
    if timed {
        if let Some(case) = cases.iter().find(|c| c.times.is_none()) {
            return Err(EngineError::Config(format!(
                "the test set has no timestamps (user {}): {} reads when each event happened; \
                 give a test file whose header names target_timestamp and history_timestamps \
                 columns",
                case.user_id,
                engine.kind()
            )));
        }
    }
    // The official HSTU protocol leaves out the items of the history the model read (its
    // window); RecBole's full-sort evaluation, every item of the history.
    let window = if timed {
        engine.manifest.model.history_window()
    } else {
        None
    };
    let mut metrics = RankingMetrics::new(ks);
    let mut ranks = Vec::with_capacity(cases.len());
    let (mut unknown_history_ids, mut unknown_targets, mut outside) = (0, 0, 0);
    let n_out = engine.scorer.packed.n;
    let mut excluded = ExclusionSet::new(n_out);
    for chunk in cases.chunks(batch.max(1)) {
        let (mapped, kept): (Vec<_>, Vec<_>) = chunk
            .iter()
            .map(|case| {
                let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
                engine.ids.map_with_positions(crate::ExternalIds::Str(&ids))
            })
            .unzip();
        let histories: Vec<&[u32]> = mapped.iter().map(|m| m.indices.as_slice()).collect();
        // A timed model's known events keep their timestamps; the target's is the query time.
        let known_times: Vec<Vec<i64>> = if timed {
            chunk
                .iter()
                .zip(&kept)
                .map(|(case, kept)| {
                    let times = case.times.as_ref().expect("checked above");
                    kept.iter().map(|&i| times.events[i]).collect()
                })
                .collect()
        } else {
            Vec::new()
        };
        let times: Vec<crate::models::EventTimes<'_>> = known_times
            .iter()
            .zip(chunk)
            .map(|(events, case)| crate::models::EventTimes {
                events,
                query: case.times.as_ref().expect("checked above").target,
            })
            .collect();
        let mut scores = engine.score_all_timed(&histories, &times);
        if let Some(mask) = eligible {
            for row in scores.chunks_exact_mut(n_out) {
                for (i, s) in row.iter_mut().enumerate() {
                    if !mask.allows(i as u32) {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
        }
        for (row, (case, history)) in chunk.iter().zip(&mapped).enumerate() {
            unknown_history_ids += history.unknown;
            let rank = match engine.ids.index_of_str(&case.target) {
                None => {
                    unknown_targets += 1;
                    None
                }
                Some(target) if eligible.is_some_and(|m| !m.allows(target)) => {
                    outside += 1;
                    continue;
                }
                Some(target) => {
                    excluded.clear();
                    excluded.insert(0);
                    let seen = &history.indices;
                    let from = window.map_or(0, |w| seen.len().saturating_sub(w));
                    seen[from..].iter().for_each(|&i| excluded.insert(i));
                    Some(target_rank(
                        &scores[row * n_out..(row + 1) * n_out],
                        target,
                        &excluded,
                    ))
                }
            };
            metrics.add(rank);
            ranks.push(rank);
        }
        progress(chunk.len());
    }
    Ok(EvalReport {
        metrics: metrics.summary(),
        ranks,
        unknown_history_ids,
        unknown_targets,
        targets_outside_filter: outside,
    })
}
