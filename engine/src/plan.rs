//! Plans by measurement: which of two exact implementations an engine runs, chosen by timing both
//! on this CPU with this engine's own shapes, once, and kept in a file for the next load.
//!
//! The first choice planned is the int8 screen of a `--screen int8` engine: it reads a quarter of
//! the fp32 table's bytes and rescores a few survivors, and on some CPUs and batch sizes that pays
//! (3.8x at 1e6 items on Zen 5) while on others it does not (slower than fp32 at batch 64 on an
//! Emerald Rapids Xeon). Both paths give the same answer, so the plan changes only time: per batch
//! size, the screen runs where it measured faster and the plain scan elsewhere.
//!
//! Measured at load on hidden vectors the model itself makes from seeded random histories (the
//! screen's survivors depend on real score distributions, not on noise), each side timed in turn,
//! best of a few runs. Kept in `<cache dir>/recsys/plans/<key>.json`, the key naming the CPU model,
//! the kernels' ISA, the scoring threads, the engine's weights (their SHA-256) and this recsys: a
//! plan made on another CPU or for another engine is never read, and a damaged file is ignored
//! (the reason is reported) and measured again. `RECSYS_PLAN=off` skips measuring (the screen
//! always runs, as an engine without a plan); `ScreenPolicy::Always` / `Never` pin the choice.

use std::path::PathBuf;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Batch sizes a plan measures; a batch takes the decision of the largest measured size not
/// above it.
pub const PLAN_BATCHES: [usize; 3] = [1, 8, 64];
/// Runs per side and batch size (the best counts: noise only adds time).
const RUNS: usize = 3;
/// The plan file's format.
const FORMAT: u32 = 1;

/// How a screened engine picks between its screen and the plain scan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScreenPolicy {
    /// By measurement on this CPU (or its cached plan).
    #[default]
    Auto,
    /// Always the screen (what an engine without a plan does).
    Always,
    /// Never the screen: the plain scan of the full table.
    Never,
}

impl std::str::FromStr for ScreenPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ScreenPolicy::Auto),
            "always" | "screen" => Ok(ScreenPolicy::Always),
            "never" | "plain" => Ok(ScreenPolicy::Never),
            _ => Err(format!(
                "screen_policy must be \"auto\", \"always\" or \"never\", found {s:?}"
            )),
        }
    }
}

/// One measured batch size: the best seconds of the screened and of the plain top-k.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub batch: usize,
    pub screened_s: f64,
    pub plain_s: f64,
}

/// Where a plan came from.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanSource {
    /// Measured now (and written to `path` when the cache directory is writable); `ignored`
    /// says why a file that was there was not used.
    Measured {
        path: Option<PathBuf>,
        ignored: Option<String>,
    },
    /// Read from the plan file made on this CPU for this engine.
    Cached(PathBuf),
    /// Pinned by the caller's policy.
    Pinned(ScreenPolicy),
    /// `RECSYS_PLAN=off`: nothing measured, the screen always runs.
    Skipped,
}

/// Per batch size, whether the screen runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ScreenPlan {
    /// `(smallest batch, screen?)`, ascending.
    pub by_batch: Vec<(usize, bool)>,
    pub timings: Vec<Timing>,
    pub source: PlanSource,
}

impl ScreenPlan {
    /// One decision for every batch size.
    pub fn fixed(screen: bool, source: PlanSource) -> Self {
        ScreenPlan {
            by_batch: vec![(1, screen)],
            timings: Vec::new(),
            source,
        }
    }

    /// From timings: the screen where it measured faster.
    pub fn from_timings(timings: Vec<Timing>, source: PlanSource) -> Self {
        ScreenPlan {
            by_batch: timings
                .iter()
                .map(|t| (t.batch, t.screened_s < t.plain_s))
                .collect(),
            timings,
            source,
        }
    }

    /// Whether a batch of `batch` histories runs the screen.
    pub fn screen_for(&self, batch: usize) -> bool {
        self.by_batch
            .iter()
            .rev()
            .find(|(from, _)| *from <= batch)
            .or(self.by_batch.first())
            .is_none_or(|(_, screen)| *screen)
    }

    /// One line for logs: the decision per batch size and where it came from.
    pub fn describe(&self) -> String {
        let choices: Vec<String> = self
            .by_batch
            .iter()
            .map(|(batch, screen)| {
                let timing = self.timings.iter().find(|t| t.batch == *batch);
                format!(
                    "batch {batch}+: {}{}",
                    if *screen { "int8 screen" } else { "plain scan" },
                    timing.map_or(String::new(), |t| format!(
                        " ({:.3} ms screened, {:.3} ms plain)",
                        t.screened_s * 1e3,
                        t.plain_s * 1e3
                    ))
                )
            })
            .collect();
        let source = match &self.source {
            PlanSource::Measured { path, ignored } => format!(
                "measured on this CPU{}{}",
                path.as_ref()
                    .map_or(String::new(), |p| format!(", kept in {}", p.display())),
                ignored.as_ref().map_or(String::new(), |why| format!(
                    "; the plan file there was ignored: {why}"
                ))
            ),
            PlanSource::Cached(path) => format!("read from {}", path.display()),
            PlanSource::Pinned(policy) => format!("pinned ({policy:?})"),
            PlanSource::Skipped => "RECSYS_PLAN=off: not measured".into(),
        };
        format!("{} — {source}", choices.join(", "))
    }
}

/// What a plan file holds; every identifying field must match for it to be used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct PlanFile {
    format: u32,
    recsys: String,
    cpu: String,
    isa: String,
    threads: usize,
    engine: String,
    timings: Vec<Timing>,
}

/// The CPU's model name (`model name` of /proc/cpuinfo), or "unknown".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Where plans are kept: `$RECSYS_PLAN_DIR`, else `$XDG_CACHE_HOME/recsys/plans`, else
/// `~/.cache/recsys/plans`; `None` when none can be named.
pub fn plan_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("RECSYS_PLAN_DIR") {
        return Some(PathBuf::from(dir));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("recsys").join("plans"))
}

/// The identity a plan is made for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanKey {
    pub cpu: String,
    pub isa: String,
    pub threads: usize,
    /// The engine's weights: a digest of its files' SHA-256.
    pub engine: String,
}

impl PlanKey {
    fn file_name(&self) -> String {
        let digest = Sha256::digest(
            format!(
                "{FORMAT}\n{}\n{}\n{}\n{}\n{}",
                env!("CARGO_PKG_VERSION"),
                self.cpu,
                self.isa,
                self.threads,
                self.engine
            )
            .as_bytes(),
        );
        format!("screen-{}.json", &hex::encode(digest)[..24])
    }

    fn matches(&self, file: &PlanFile) -> Result<(), String> {
        let checks = [
            ("format", file.format.to_string(), FORMAT.to_string()),
            (
                "recsys",
                file.recsys.clone(),
                env!("CARGO_PKG_VERSION").into(),
            ),
            ("cpu", file.cpu.clone(), self.cpu.clone()),
            ("isa", file.isa.clone(), self.isa.clone()),
            (
                "threads",
                file.threads.to_string(),
                self.threads.to_string(),
            ),
            ("engine", file.engine.clone(), self.engine.clone()),
        ];
        for (what, found, want) in checks {
            if found != want {
                return Err(format!("made for {what} {found:?}, this is {want:?}"));
            }
        }
        if file.timings.is_empty() {
            return Err("it holds no timing".into());
        }
        Ok(())
    }
}

/// The cached plan for `key` in `dir`: `Ok(Some)` when a valid one is there, `Ok(None)` when
/// there is none, `Err(why)` when the file there cannot be used (damaged, or made for another
/// CPU or engine under a colliding name).
pub fn read_cached(dir: &std::path::Path, key: &PlanKey) -> Result<Option<ScreenPlan>, String> {
    let path = dir.join(key.file_name());
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let file: PlanFile = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a plan file: {e}", path.display()))?;
    key.matches(&file)
        .map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(Some(ScreenPlan::from_timings(
        file.timings,
        PlanSource::Cached(path),
    )))
}

/// Writes a measured plan for `key` into `dir` (whole or not at all: written aside, then renamed);
/// the path, or why it could not be written.
pub fn write_cached(
    dir: &std::path::Path,
    key: &PlanKey,
    timings: &[Timing],
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(key.file_name());
    let file = PlanFile {
        format: FORMAT,
        recsys: env!("CARGO_PKG_VERSION").into(),
        cpu: key.cpu.clone(),
        isa: key.isa.clone(),
        threads: key.threads,
        engine: key.engine.clone(),
        timings: timings.to_vec(),
    };
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(
        &partial,
        serde_json::to_vec_pretty(&file).expect("a plan serialises"),
    )
    .and_then(|_| std::fs::rename(&partial, &path))
    .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// Times `screened` against `plain` at every batch size of [`PLAN_BATCHES`]: each side in turn,
/// the best of [`RUNS`] runs after one warm-up run.
pub fn measure(mut screened: impl FnMut(usize), mut plain: impl FnMut(usize)) -> Vec<Timing> {
    PLAN_BATCHES
        .iter()
        .map(|&batch| {
            screened(batch);
            plain(batch);
            let (mut best_screened, mut best_plain) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..RUNS {
                let start = Instant::now();
                screened(batch);
                best_screened = best_screened.min(start.elapsed().as_secs_f64());
                let start = Instant::now();
                plain(batch);
                best_plain = best_plain.min(start.elapsed().as_secs_f64());
            }
            Timing {
                batch,
                screened_s: best_screened,
                plain_s: best_plain,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PlanKey {
        PlanKey {
            cpu: "Test CPU".into(),
            isa: "avx2".into(),
            threads: 2,
            engine: "abc".into(),
        }
    }

    fn timings() -> Vec<Timing> {
        vec![
            Timing {
                batch: 1,
                screened_s: 1.0,
                plain_s: 2.0,
            },
            Timing {
                batch: 8,
                screened_s: 3.0,
                plain_s: 2.0,
            },
            Timing {
                batch: 64,
                screened_s: 1.0,
                plain_s: 2.0,
            },
        ]
    }

    #[test]
    fn a_plan_takes_the_decision_of_the_largest_measured_batch_not_above() {
        let plan = ScreenPlan::from_timings(timings(), PlanSource::Skipped);
        let chosen: Vec<bool> = [1, 2, 7, 8, 63, 64, 500]
            .iter()
            .map(|&b| plan.screen_for(b))
            .collect();
        assert_eq!(chosen, [true, true, true, false, false, true, true]);
        assert!(plan.describe().contains("batch 8+: plain scan"));
        assert!(
            ScreenPlan::fixed(false, PlanSource::Pinned(ScreenPolicy::Never)).by_batch
                == [(1, false)]
        );
    }

    #[test]
    fn cached_plans_are_used_only_for_their_cpu_and_engine_and_damage_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_cached(dir.path(), &key()).unwrap(), None);
        let path = write_cached(dir.path(), &key(), &timings()).unwrap();
        let plan = read_cached(dir.path(), &key()).unwrap().unwrap();
        assert_eq!(plan.source, PlanSource::Cached(path.clone()));
        assert_eq!(plan.timings, timings());
        // Another CPU, another engine, other threads: another file name, so no plan.
        for other in [
            PlanKey {
                cpu: "Other CPU".into(),
                ..key()
            },
            PlanKey {
                engine: "def".into(),
                ..key()
            },
            PlanKey {
                threads: 4,
                ..key()
            },
        ] {
            assert_eq!(read_cached(dir.path(), &other).unwrap(), None);
        }
        // A file under this key's name made elsewhere (copied between machines) is refused.
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("Test CPU", "Other CPU");
        std::fs::write(&path, text).unwrap();
        let err = read_cached(dir.path(), &key()).unwrap_err();
        assert!(err.contains("made for cpu \"Other CPU\""), "{err}");
        std::fs::write(&path, b"{ not json").unwrap();
        let err = read_cached(dir.path(), &key()).unwrap_err();
        assert!(err.contains("not a plan file"), "{err}");
    }

    #[test]
    fn measuring_times_both_sides_at_every_batch() {
        let (mut s, mut p) = (Vec::new(), Vec::new());
        let t = measure(|b| s.push(b), |b| p.push(b));
        assert_eq!(t.iter().map(|t| t.batch).collect::<Vec<_>>(), PLAN_BATCHES);
        assert_eq!(s.len(), PLAN_BATCHES.len() * (RUNS + 1));
        assert_eq!(s, p);
    }
}
