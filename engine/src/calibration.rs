//! Static activation scales for W8A8: run the model on calibration histories, collect the values
//! that enter the output layer, and pick the clipping threshold by one of the methods TensorRT and
//! ONNX Runtime offer: `minmax` (the largest magnitude), `percentile` (a high percentile of the
//! magnitudes, ignoring rare outliers) or `entropy` (the threshold whose 8-bit quantized histogram
//! loses the least information, measured by KL divergence).

use std::io::BufRead;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Levels on each side of zero for int8 activations.
pub const INT8_LEVELS: f32 = 127.0;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "lowercase")]
pub enum CalibrationMethod {
    MinMax,
    Percentile { percentile: f64 },
    Entropy,
}

impl CalibrationMethod {
    /// `minmax`, `percentile` (99.99) or `entropy`.
    pub fn parse(name: &str, percentile: f64) -> Result<Self, String> {
        match name {
            "minmax" => Ok(CalibrationMethod::MinMax),
            "percentile" if (50.0..=100.0).contains(&percentile) => {
                Ok(CalibrationMethod::Percentile { percentile })
            }
            "percentile" => Err(format!(
                "the calibration percentile must be in 50..100, found {percentile}"
            )),
            "entropy" => Ok(CalibrationMethod::Entropy),
            other => Err(format!(
                "unknown calibration method {other:?} (expected minmax, percentile or entropy)"
            )),
        }
    }
}

/// What calibration saw and chose; recorded in the engine manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationSummary {
    #[serde(flatten)]
    pub method: CalibrationMethod,
    pub histories: usize,
    pub values: usize,
    pub abs_max: f32,
    /// Clipping threshold: activations beyond it saturate (at -128 or 127 levels).
    pub threshold: f32,
    /// `threshold / 127`.
    pub scale: f32,
    /// Share of the calibration values beyond the threshold.
    pub clipped_fraction: f64,
}

/// Picks the clipping threshold for the magnitudes `abs` (all >= 0).
pub fn threshold(abs: &[f32], method: CalibrationMethod) -> f32 {
    let max = abs.iter().copied().fold(0f32, f32::max);
    if max == 0.0 {
        return 0.0;
    }
    match method {
        CalibrationMethod::MinMax => max,
        CalibrationMethod::Percentile { percentile } => {
            let mut sorted = abs.to_vec();
            sorted.sort_unstable_by(|a, b| a.total_cmp(b));
            let rank = ((percentile / 100.0) * (sorted.len() - 1) as f64).round() as usize;
            sorted[rank.min(sorted.len() - 1)].max(f32::MIN_POSITIVE)
        }
        CalibrationMethod::Entropy => entropy_threshold(abs, max),
    }
}

/// Number of histogram bins for the entropy method, and the levels it quantizes to.
const ENTROPY_BINS: usize = 2048;
const ENTROPY_LEVELS: usize = 128;

/// KL-divergence calibration: for each candidate threshold (bin i), fold everything beyond it into
/// the last kept bin (the reference P), merge the kept bins into 128 levels and spread each level
/// back over its non-empty bins (the quantized Q), and keep the i with the smallest KL(P || Q).
fn entropy_threshold(abs: &[f32], max: f32) -> f32 {
    let width = max / ENTROPY_BINS as f32;
    let mut hist = vec![0f64; ENTROPY_BINS];
    for &v in abs {
        let bin = ((v / width) as usize).min(ENTROPY_BINS - 1);
        hist[bin] += 1.0;
    }
    let mut best = (f64::INFINITY, ENTROPY_BINS);
    for i in ENTROPY_LEVELS..=ENTROPY_BINS {
        let mut p: Vec<f64> = hist[..i].to_vec();
        p[i - 1] += hist[i..].iter().sum::<f64>();
        let mut q = vec![0f64; i];
        for level in 0..ENTROPY_LEVELS {
            let (start, end) = (
                level * i / ENTROPY_LEVELS,
                ((level + 1) * i / ENTROPY_LEVELS).max(level * i / ENTROPY_LEVELS + 1),
            );
            let total: f64 = hist[start..end].iter().sum();
            let nonzero = hist[start..end].iter().filter(|&&c| c > 0.0).count();
            if nonzero > 0 {
                for b in start..end {
                    if hist[b] > 0.0 {
                        q[b] = total / nonzero as f64;
                    }
                }
            }
        }
        let (sp, sq) = (p.iter().sum::<f64>(), q.iter().sum::<f64>());
        if sp == 0.0 || sq == 0.0 {
            continue;
        }
        let kl: f64 = p
            .iter()
            .zip(&q)
            .filter(|(&pb, _)| pb > 0.0)
            .map(|(&pb, &qb)| {
                let (pn, qn) = (pb / sp, (qb / sq).max(1e-12));
                pn * (pn / qn).ln()
            })
            .sum();
        if kl < best.0 {
            best = (kl, i);
        }
    }
    ((best.1 as f32 + 0.5) * width).min(max)
}

/// Summarises a calibration over the collected activation values.
pub fn summarize(
    values: &[f32],
    histories: usize,
    method: CalibrationMethod,
) -> CalibrationSummary {
    let abs: Vec<f32> = values.iter().map(|v| v.abs()).collect();
    let abs_max = abs.iter().copied().fold(0f32, f32::max);
    let threshold = threshold(&abs, method);
    let clipped = abs.iter().filter(|&&v| v > threshold).count();
    CalibrationSummary {
        method,
        histories,
        values: values.len(),
        abs_max,
        threshold,
        scale: threshold / INT8_LEVELS,
        clipped_fraction: clipped as f64 / values.len().max(1) as f64,
    }
}

/// Calibration histories (ids as text) and, when the lines carry them, their event times.
pub type TimedHistories = (Vec<Vec<String>>, Option<Vec<crate::metrics::CaseTimes>>);

/// Reads calibration histories from JSON lines in the `recsys predict` input format
/// (`{"item_ids": [...]}`; other fields are ignored). Ids are returned as text.
pub fn read_histories(path: &Path) -> Result<Vec<Vec<String>>> {
    Ok(read_timed_histories(path)?.0)
}

/// [`read_histories`] with the lines' event times, for a model that reads time: `"timestamps"`
/// (unix seconds, one per id) and `"query_timestamp"` (the time of the event to predict; the
/// last event's when left out), as `recsys predict` reads them. `None` when no line has
/// timestamps; every line must have them when one does, one per id.
pub fn read_timed_histories(path: &Path) -> Result<TimedHistories> {
    let file = EngineError::open(path)?;
    let bad = |line: usize, reason: String| EngineError::TestSet {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut out = Vec::new();
    let mut times: Vec<Option<crate::metrics::CaseTimes>> = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line =
            line.map_err(|e| EngineError::io(format!("cannot read {}", path.display()), e))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| bad(n + 1, format!("invalid JSON: {e}")))?;
        let ids = value
            .get("item_ids")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad(n + 1, "missing \"item_ids\" array".into()))?;
        out.push(
            ids.iter()
                .map(|v| match v {
                    serde_json::Value::String(s) => Ok(s.clone()),
                    serde_json::Value::Number(x) if x.is_i64() => Ok(x.to_string()),
                    other => Err(bad(n + 1, format!("{other} is not an item id"))),
                })
                .collect::<Result<_>>()?,
        );
        times.push(match value.get("timestamps") {
            None | Some(serde_json::Value::Null) => None,
            Some(stamps) => {
                let events: Vec<i64> = stamps
                    .as_array()
                    .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
                    .ok_or_else(|| {
                        bad(
                            n + 1,
                            "\"timestamps\" must be a list of integer unix seconds".into(),
                        )
                    })?;
                if events.len() != ids.len() {
                    return Err(bad(
                        n + 1,
                        format!(
                            "{} timestamp(s) for {} item id(s): give one per id",
                            events.len(),
                            ids.len()
                        ),
                    ));
                }
                let target = match value.get("query_timestamp") {
                    None | Some(serde_json::Value::Null) => events.last().copied().unwrap_or(0),
                    Some(q) => q.as_i64().ok_or_else(|| {
                        bad(
                            n + 1,
                            "\"query_timestamp\" must be an integer unix time".into(),
                        )
                    })?,
                };
                Some(crate::metrics::CaseTimes { events, target })
            }
        });
    }
    if out.is_empty() {
        return Err(bad(0, "no calibration histories".into()));
    }
    let timed = times.iter().filter(|t| t.is_some()).count();
    let times = match timed {
        0 => None,
        all if all == times.len() => Some(times.into_iter().flatten().collect()),
        _ => {
            let line = times.iter().position(Option::is_none).unwrap_or(0) + 1;
            return Err(bad(
                line,
                "this history has no \"timestamps\" while others do: give every line its \
                 timestamps, or none"
                    .into(),
            ));
        }
    };
    Ok((out, times))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timestamps come with every line or none; a line's count must match its ids; the query
    /// time is the last event's unless given.
    #[test]
    fn calibration_lines_carry_their_times_all_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let plain = write(
            "plain.jsonl",
            "{\"item_ids\": [1, 2]}\n{\"item_ids\": [\"a\"]}\n",
        );
        let (histories, times) = read_timed_histories(&plain).unwrap();
        assert_eq!(histories, [vec!["1", "2"], vec!["a"]]);
        assert!(times.is_none());
        let timed = write(
            "timed.jsonl",
            "{\"item_ids\": [1, 2], \"timestamps\": [10, 20], \"query_timestamp\": 25}\n\
             {\"item_ids\": [3], \"timestamps\": [30]}\n",
        );
        let (_, times) = read_timed_histories(&timed).unwrap();
        let times = times.unwrap();
        assert_eq!(
            (times[0].events.as_slice(), times[0].target),
            (&[10, 20][..], 25)
        );
        assert_eq!(
            (times[1].events.as_slice(), times[1].target),
            (&[30][..], 30)
        );
        let mixed = write(
            "mixed.jsonl",
            "{\"item_ids\": [1], \"timestamps\": [10]}\n{\"item_ids\": [2]}\n",
        );
        let err = read_timed_histories(&mixed).unwrap_err().to_string();
        assert!(
            err.contains("line 2") && err.contains("no \"timestamps\""),
            "{err}"
        );
        let short = write(
            "short.jsonl",
            "{\"item_ids\": [1, 2], \"timestamps\": [10]}\n",
        );
        let err = read_timed_histories(&short).unwrap_err().to_string();
        assert!(err.contains("1 timestamp(s) for 2 item id(s)"), "{err}");
    }

    #[test]
    fn minmax_and_percentile() {
        let mut values: Vec<f32> = (0..10_000).map(|i| (i % 100) as f32 / 100.0).collect();
        values.push(50.0); // one outlier
        assert_eq!(threshold(&values, CalibrationMethod::MinMax), 50.0);
        let p = threshold(&values, CalibrationMethod::Percentile { percentile: 99.9 });
        assert!((0.98..=0.99).contains(&p), "{p}");
    }

    #[test]
    fn entropy_clips_rare_outliers_but_keeps_the_bulk() {
        // A Gaussian-like bulk within about +-4 plus a few far outliers.
        let mut s = 12345u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut values: Vec<f32> = (0..50_000)
            .map(|_| {
                let (u1, u2) = (next().max(1e-12), next());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()).abs() as f32
            })
            .collect();
        values.extend([40.0, 45.0, 50.0]);
        let t = threshold(&values, CalibrationMethod::Entropy);
        assert!(t > 2.5 && t < 40.0, "threshold {t}");
        let summary = summarize(&values, 10, CalibrationMethod::Entropy);
        assert!(summary.clipped_fraction < 0.01 && summary.scale == summary.threshold / 127.0);
    }

    #[test]
    fn method_names() {
        assert_eq!(
            CalibrationMethod::parse("minmax", 99.99),
            Ok(CalibrationMethod::MinMax)
        );
        assert!(CalibrationMethod::parse("percentile", 20.0).is_err());
        assert!(CalibrationMethod::parse("kl", 99.99)
            .unwrap_err()
            .contains("entropy"));
    }
}
