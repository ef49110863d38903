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
//! (the reason is reported) and measured again. A plan measured while other processes took more
//! than a quarter of a core is used for that load and not kept ([`crate::plan_load`]).
//! `RECSYS_PLAN=off` skips measuring (the screen
//! always runs, as an engine without a plan); `ScreenPolicy::Always` / `Never` pin the choice.
//!
//! The second is a bf16 engine's kernels on a CPU with AVX512-BF16 ([`Bf16Path`]): `vdpbf16ps`
//! or bf16 widened to f32, the same bits either way; whole calls are timed with each, and each
//! batch size runs the faster (a call picks its kernel table by its batch size).
//!
//! Then the row block of an engine whose kernels come in two ([`RowBlockPolicy`]): batches cut
//! into row groups of up to 8 rows or of up to 4, the same bits either way; whole calls at batch 8
//! and 64 are timed with each.
//!
//! The third is how many of its threads each batch size gets ([`ThreadPlan`]): a second core pays
//! for a batch of 64 on every CPU measured, for one history on some and not on others (a handoff
//! costs 5-800 us depending on the machine and its neighbours). Whole calls are timed at 1, 2, 4 ...
//! threads up to the engine's; a batch size gets the fewest threads within [`THREAD_MARGIN`] of
//! its fastest, so a thread that does not pay is left to the other requests. Rows never depend on
//! the threads that computed them, so the plan changes time only.

use std::path::PathBuf;
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use crate::kernels::RowBlock;

/// Batch sizes a plan measures; a batch takes the decision of the largest measured size not
/// above it.
pub const PLAN_BATCHES: [usize; 3] = [1, 8, 64];
/// Runs per side and batch size (the best counts: noise only adds time).
const RUNS: usize = 3;
/// The plan file's format (2: the plan's kind in the file and its name, neutral timing names; 3:
/// thread plans measured from a forgotten handoff estimate, so files measured the old way, which
/// could time one thread under the name of two, are measured again; 4: thread plans of
/// sequential models also time single histories as long as the model reads; 5: plans measured
/// while other work took the cores are no longer kept, so files that may have been are measured
/// again).
const FORMAT: u32 = 5;

/// The decision of the largest measured batch size not above `batch` in `by_batch` (`(smallest
/// batch, decision)`, ascending), or the first one's for a batch below them all.
pub(crate) fn decision_for<T: Copy>(by_batch: &[(usize, T)], batch: usize) -> Option<T> {
    by_batch
        .iter()
        .rev()
        .find(|(from, _)| *from <= batch)
        .or(by_batch.first())
        .map(|(_, decision)| *decision)
}

/// The choices of a per-batch plan for logs: `batch B+: <yes or no>` for each measured batch size,
/// with the times behind it where measured (`(0.041 ms <candidate>, 0.112 ms <fallback>)`).
pub(crate) fn describe_choices(
    by_batch: &[(usize, bool)],
    timings: &[Timing],
    [yes, no]: [&str; 2],
    [candidate, fallback]: [&str; 2],
) -> String {
    by_batch
        .iter()
        .map(|&(batch, chosen)| {
            let timing = timings.iter().find(|t| t.batch == batch);
            format!(
                "batch {batch}+: {}{}",
                if chosen { yes } else { no },
                timing.map_or(String::new(), |t| format!(
                    " ({:.3} ms {candidate}, {:.3} ms {fallback})",
                    t.candidate_s * 1e3,
                    t.fallback_s * 1e3
                ))
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether the candidate's times over the measured batch sizes of at least `from_batch` have a
/// geometric mean no larger than the fallback's (each batch size weighs alike whatever its
/// absolute time): the rule of the plans that make one choice for every batch size.
fn candidate_at_least_as_fast(timings: &[Timing], from_batch: usize) -> bool {
    let log_ratio: f64 = timings
        .iter()
        .filter(|t| t.batch >= from_batch)
        .map(|t| (t.candidate_s / t.fallback_s).ln())
        .sum();
    log_ratio <= 0.0
}

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

/// One measured batch size: the best seconds of the two sides a plan chooses between, the
/// candidate (the int8 screen; AVX512-BF16's `vdpbf16ps`) and the fallback it must beat (the
/// plain scan; bf16 widened to f32).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub batch: usize,
    pub candidate_s: f64,
    pub fallback_s: f64,
}

/// Where a plan came from.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanSource {
    /// Measured now and written to `path`, or not kept, `not_kept` saying why (measured while
    /// other work took the cores, [`crate::plan_load`]; a cache directory that cannot be
    /// written); `ignored` says why a file that was there was not used.
    Measured {
        path: Option<PathBuf>,
        ignored: Option<String>,
        not_kept: Option<String>,
    },
    /// Read from the plan file made on this CPU for this engine.
    Cached(PathBuf),
    /// Pinned by the caller's policy (its name).
    Pinned(String),
    /// `RECSYS_PLAN=off`: nothing measured, the default runs (the screen; the native bf16 path).
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
                .map(|t| (t.batch, t.candidate_s < t.fallback_s))
                .collect(),
            timings,
            source,
        }
    }

    /// Whether a batch of `batch` histories runs the screen.
    pub fn screen_for(&self, batch: usize) -> bool {
        decision_for(&self.by_batch, batch).unwrap_or(true)
    }

    /// One line for logs: the decision per batch size and where it came from.
    pub fn describe(&self) -> String {
        let choices = describe_choices(
            &self.by_batch,
            &self.timings,
            ["int8 screen", "plain scan"],
            ["screened", "plain"],
        );
        format!("{choices} — {}", self.source.describe())
    }
}

impl PlanSource {
    /// Where the plan came from, for logs.
    pub fn describe(&self) -> String {
        match self {
            PlanSource::Measured {
                path,
                ignored,
                not_kept,
            } => format!(
                "measured on this CPU{}{}{}",
                path.as_ref()
                    .map_or(String::new(), |p| format!(", kept in {}", p.display())),
                not_kept
                    .as_ref()
                    .map_or(String::new(), |why| format!(", not kept: {why}")),
                ignored.as_ref().map_or(String::new(), |why| format!(
                    "; the plan file there was ignored: {why}"
                ))
            ),
            PlanSource::Cached(path) => format!("read from {}", path.display()),
            PlanSource::Pinned(policy) => format!("pinned ({policy})"),
            PlanSource::Skipped => "RECSYS_PLAN=off: not measured".into(),
        }
    }
}

/// How a bf16 engine on a CPU with AVX512-BF16 picks its kernels: `vdpbf16ps` (two bf16 products
/// per lane and instruction) or AVX-512 widening bf16 to f32 and using fused multiply-adds. Both
/// give the same bits (every SIMD path rounds each f32 operation alike: `tests/bf16.rs`), so only
/// time differs, and which is faster depends on the CPU: `vdpbf16ps` doubled the output layer's
/// rate on Zen 5, while a bf16 engine measured no faster than fp32 on an Emerald Rapids Xeon.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Path {
    /// By measurement on this CPU (or its cached plan).
    #[default]
    Auto,
    /// Always `vdpbf16ps` (what an engine without a plan runs on such a CPU).
    Native,
    /// Always widened to f32.
    Widened,
}

impl std::str::FromStr for Bf16Path {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Bf16Path::Auto),
            "native" | "vdpbf16ps" => Ok(Bf16Path::Native),
            "widened" => Ok(Bf16Path::Widened),
            _ => Err(format!(
                "bf16_path must be \"auto\", \"native\" or \"widened\", found {s:?}"
            )),
        }
    }
}

/// Which kernels a bf16 engine runs, per batch size: `vdpbf16ps` where it measured at least as
/// fast as the widened path, widened elsewhere. One choice for the engine was not enough: on a
/// Sapphire Rapids class Xeon `vdpbf16ps` won at batch 1 and left a Mult-VAE bf16 engine at
/// 0.90x its fp32 engine at batch 64 (it gains little from 8-row groups, widened f32 FMAs do).
#[derive(Clone, Debug, PartialEq)]
pub struct Bf16PathPlan {
    /// `(smallest batch, vdpbf16ps?)`, ascending.
    pub by_batch: Vec<(usize, bool)>,
    /// Whole calls (encoder and output layer) per batch size: candidate = native.
    pub timings: Vec<Timing>,
    pub source: PlanSource,
}

impl Bf16PathPlan {
    /// One path for every batch size.
    pub fn fixed(native: bool, source: PlanSource) -> Self {
        Bf16PathPlan {
            by_batch: vec![(1, native)],
            timings: Vec::new(),
            source,
        }
    }

    /// Per batch size, the path that measured faster; native on a tie.
    pub fn from_timings(timings: Vec<Timing>, source: PlanSource) -> Self {
        Bf16PathPlan {
            by_batch: timings
                .iter()
                .map(|t| (t.batch, t.candidate_s <= t.fallback_s))
                .collect(),
            timings,
            source,
        }
    }

    /// Whether a batch of `batch` histories runs `vdpbf16ps` (the decision of the largest
    /// measured batch size not above it).
    pub fn native_for(&self, batch: usize) -> bool {
        decision_for(&self.by_batch, batch).unwrap_or(true)
    }

    /// Whether some batch size runs `vdpbf16ps`, and whether some runs widened.
    pub fn paths(&self) -> (bool, bool) {
        (
            self.by_batch.iter().any(|&(_, native)| native),
            self.by_batch.iter().any(|&(_, native)| !native),
        )
    }

    /// One line for logs: the path per batch size, the times behind it, where it came from.
    pub fn describe(&self) -> String {
        let choices = describe_choices(
            &self.by_batch,
            &self.timings,
            ["vdpbf16ps (native)", "widened to f32"],
            ["native", "widened"],
        );
        format!("bf16 {choices} — {}", self.source.describe())
    }
}

/// How an engine whose kernels come in both row blocks (AVX-512: [`RowBlock`]) cuts its batches:
/// into row groups of up to 8 rows, or of up to 4. The same bits either way; which is faster
/// depends on the CPU: 8 rows ran a Mult-VAE output layer 1.2x (batch 64) to 1.4x (batch 8)
/// faster on a Sapphire Rapids class Xeon, where 4 rows left the loop bound by its weight loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowBlockPolicy {
    /// By measurement on this CPU (or its cached plan).
    #[default]
    Auto,
    /// Always this row block.
    Fixed(RowBlock),
}

impl std::str::FromStr for RowBlockPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(RowBlockPolicy::Auto),
            "4" => Ok(RowBlockPolicy::Fixed(RowBlock::Four)),
            "8" => Ok(RowBlockPolicy::Fixed(RowBlock::Eight)),
            _ => Err(format!(
                "row_block must be \"auto\", \"4\" or \"8\", found {s:?}"
            )),
        }
    }
}

/// The row block an engine runs: one choice for every batch size (the kernels are the engine's;
/// a batch under 8 rows never forms a group of 8), the one whose times over the measured batch
/// sizes of 8 and more have the smaller geometric mean.
#[derive(Clone, Debug, PartialEq)]
pub struct RowBlockPlan {
    pub block: RowBlock,
    /// Whole calls (encoder and output layer) per batch size: candidate = 8 rows, fallback = 4.
    pub timings: Vec<Timing>,
    pub source: PlanSource,
}

impl RowBlockPlan {
    pub fn fixed(block: RowBlock, source: PlanSource) -> Self {
        RowBlockPlan {
            block,
            timings: Vec::new(),
            source,
        }
    }

    /// 8 rows unless 4 measured faster (geometric mean over the batch sizes of at least 8 rows).
    pub fn from_timings(timings: Vec<Timing>, source: PlanSource) -> Self {
        RowBlockPlan {
            block: if candidate_at_least_as_fast(&timings, 8) {
                RowBlock::Eight
            } else {
                RowBlock::Four
            },
            timings,
            source,
        }
    }

    /// One line for logs: the row block, the times behind it and where the plan came from.
    pub fn describe(&self) -> String {
        let times: Vec<String> = self
            .timings
            .iter()
            .filter(|t| t.batch >= 8)
            .map(|t| {
                format!(
                    "batch {}: {:.3} ms with 8, {:.3} ms with 4",
                    t.batch,
                    t.candidate_s * 1e3,
                    t.fallback_s * 1e3
                )
            })
            .collect();
        format!(
            "row groups of up to {} rows{} — {}",
            self.block.rows(),
            if times.is_empty() {
                String::new()
            } else {
                format!(" ({})", times.join("; "))
            },
            self.source.describe()
        )
    }
}

/// Fewer threads are kept when within this fraction of the fastest count's time: a thread that
/// saves less is worth more to the requests beside this one.
pub const THREAD_MARGIN: f64 = 0.05;

/// How an engine gives its threads to each batch size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThreadPolicy {
    /// By measurement on this CPU (or its cached plan).
    #[default]
    Auto,
    /// Every batch gets all the engine's threads (what an engine without a plan does).
    All,
    /// Every batch gets this many (at most the engine's).
    Fixed(usize),
}

impl std::str::FromStr for ThreadPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ThreadPolicy::Auto),
            "all" => Ok(ThreadPolicy::All),
            n => match n.parse::<usize>() {
                Ok(t) if t >= 1 => Ok(ThreadPolicy::Fixed(t)),
                _ => Err(format!(
                    "thread_plan must be \"auto\", \"all\" or a thread count of at least 1, \
                     found {s:?}"
                )),
            },
        }
    }
}

/// One thread count's best time at one batch size (whole calls).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadTiming {
    pub batch: usize,
    pub threads: usize,
    pub seconds: f64,
    /// The events (items the model reads) of each history of a long-history sample; 0 for the
    /// plan's histories of session lengths ([`session_length`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub events: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Per batch size, the threads a call gets; for a sequential model, also what calls of single
/// long histories get ([`LongHistoryThreads`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadPlan {
    /// `(smallest batch, threads)`, ascending.
    pub by_batch: Vec<(usize, usize)>,
    pub long_histories: Option<LongHistoryThreads>,
    pub timings: Vec<ThreadTiming>,
    pub source: PlanSource,
}

/// The threads of a call of fewer histories than the second plan batch size whose histories are
/// long. A sequential model's work grows with the events it reads, and batch 1 is where a second
/// thread pays or not by that work: a bf16 BERT4Rec of MovieLens-1M's shape (200 events) timed
/// one history of the plan's median length (23 events) 1.2x faster on one thread than on two,
/// and so ran MovieLens-1M's own histories (median about 100 events) on one thread, 0.22 ms,
/// where two took 0.14-0.17. So such models also time batch 1 on a history as long as the model
/// reads, and calls whose histories average at least [`LongHistoryThreads::from_events`] events
/// take that count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LongHistoryThreads {
    /// The geometric mean of the two samples' lengths: a call whose histories average at least
    /// this many events is nearer the long sample.
    pub from_events: usize,
    /// The long sample's events per history.
    pub sample_events: usize,
    /// Threads for such calls: the long sample's count, never fewer than the short one's (more
    /// work never makes a thread pay less).
    pub threads: usize,
}

impl ThreadPlan {
    /// The same threads for every batch size.
    pub fn fixed(threads: usize, source: PlanSource) -> Self {
        ThreadPlan {
            by_batch: vec![(1, threads.max(1))],
            long_histories: None,
            timings: Vec::new(),
            source,
        }
    }

    /// From timings: per batch size, the fewest threads within [`THREAD_MARGIN`] of the fastest;
    /// the same for the long-history samples, if any.
    pub fn from_timings(timings: Vec<ThreadTiming>, source: PlanSource) -> Self {
        let fewest_near_best = |at: &[&ThreadTiming]| {
            let best = at.iter().map(|t| t.seconds).fold(f64::INFINITY, f64::min);
            at.iter()
                .filter(|t| t.seconds <= best * (1.0 + THREAD_MARGIN))
                .map(|t| t.threads)
                .min()
                .unwrap_or(1)
        };
        let mut batches: Vec<usize> = timings
            .iter()
            .filter(|t| t.events == 0)
            .map(|t| t.batch)
            .collect();
        batches.sort_unstable();
        batches.dedup();
        let by_batch: Vec<(usize, usize)> = batches
            .into_iter()
            .map(|batch| {
                let at: Vec<&ThreadTiming> = timings
                    .iter()
                    .filter(|t| t.batch == batch && t.events == 0)
                    .collect();
                (batch, fewest_near_best(&at))
            })
            .collect();
        let long: Vec<&ThreadTiming> = timings.iter().filter(|t| t.events > 0).collect();
        let long_histories = long.first().map(|first| {
            let sample_events = first.events;
            let short_events = session_length(0);
            LongHistoryThreads {
                from_events: ((sample_events * short_events) as f64).sqrt().ceil() as usize,
                sample_events,
                threads: fewest_near_best(&long)
                    .max(decision_for(&by_batch, first.batch).unwrap_or(1)),
            }
        });
        ThreadPlan {
            by_batch,
            long_histories,
            timings,
            source,
        }
    }

    /// The threads a batch of `batch` histories of the plan's session lengths gets (the decision
    /// of the largest measured size not above it).
    pub fn threads_for(&self, batch: usize) -> usize {
        decision_for(&self.by_batch, batch).unwrap_or(1)
    }

    /// The threads a call of `batch` histories averaging `events` events (the items the model
    /// reads of each) gets: [`ThreadPlan::threads_for`], or, for fewer histories than the second
    /// plan batch size that average at least [`LongHistoryThreads::from_events`] events, the
    /// long-history count.
    pub fn threads_for_call(&self, batch: usize, events: usize) -> usize {
        match self.long_histories {
            Some(long) if batch < PLAN_BATCHES[1] && events >= long.from_events => long.threads,
            _ => self.threads_for(batch),
        }
    }

    /// "0.048 ms on 1", ... for the timings `keep` selects.
    fn times_where(&self, keep: impl Fn(&ThreadTiming) -> bool) -> Vec<String> {
        self.timings
            .iter()
            .filter(|t| keep(t))
            .map(|t| format!("{:.3} ms on {}", t.seconds * 1e3, t.threads))
            .collect()
    }

    /// One line for logs: the threads per batch size, the times behind them, the source.
    pub fn describe(&self) -> String {
        let choices: Vec<String> = self
            .by_batch
            .iter()
            .map(|&(batch, threads)| {
                let times = self.times_where(|t| t.batch == batch && t.events == 0);
                format!(
                    "batch {batch}+: {threads} thread{}{}",
                    if threads == 1 { "" } else { "s" },
                    if times.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", times.join(", "))
                    }
                )
            })
            .collect();
        let long = self.long_histories.map(|long| {
            let times = self.times_where(|t| t.events > 0);
            format!(
                "; batch 1-{} of histories averaging {}+ events: {} thread{} ({} at {} events)",
                PLAN_BATCHES[1] - 1,
                long.from_events,
                long.threads,
                if long.threads == 1 { "" } else { "s" },
                times.join(", "),
                long.sample_events
            )
        });
        format!(
            "{}{} — {}",
            choices.join("; "),
            long.unwrap_or_default(),
            self.source.describe()
        )
    }
}

/// The length of row `row` of the histories the whole-call plans time: spread log-uniformly over
/// 4 to 128 events (median about 23, mean about 36, as in the fixtures' test users: median 24,
/// mean 32) in a low-discrepancy order, so that every batch size's rows hold short and long
/// histories alike; row 0 has the median length.
pub fn session_length(row: usize) -> usize {
    const GOLDEN: f64 = 0.618_033_988_749_894_9;
    let u = (0.5 + row as f64 * GOLDEN).fract();
    (4.0 * 32f64.powf(u)).round() as usize
}

/// The thread counts a plan times for an engine of `threads`: 1, 2, 4 ... and `threads` itself.
pub fn thread_candidates(threads: usize) -> Vec<usize> {
    let mut candidates: Vec<usize> = std::iter::successors(Some(1usize), |t| Some(t * 2))
        .take_while(|&t| t < threads)
        .collect();
    candidates.push(threads.max(1));
    candidates.dedup();
    candidates
}

/// Calls timed back to back for one thread-plan sample. A single call after a call on another
/// thread count finds the pool's workers asleep and pays their wake-up, which a server under load
/// (and a burst of calls) does not: on a 2-vCPU Zen 5, one call at a time made one thread look
/// faster at batch 8 while back to back two threads were 1.4x faster.
pub const THREAD_BURST: usize = 4;

/// How long a thread count with pool workers runs untimed before its samples: long enough for
/// the pool to reach the rhythm of a busy server. On a 2-vCPU Zen 2 VM, after the pool had idled
/// through the one-thread samples, each call's worker wake-up took 80-400 us for the next few
/// milliseconds of calls (a halted vCPU woken by the hypervisor; the handoff estimate raised by
/// them then kept steps on one thread), and a burst of 4 settling calls timed two threads 1.3x
/// slower than one at batch 8 where back to back they were 1.5x faster (3 plans of 4 wrong);
/// with this settling and [`THREAD_WARM_UP`], 6 plans of 6 matched the back-to-back times.
pub const THREAD_SETTLE: std::time::Duration = std::time::Duration::from_millis(30);

/// How long the engine runs on all its threads before a thread plan's first sample.
pub const THREAD_WARM_UP: std::time::Duration = std::time::Duration::from_millis(50);

/// Times `run(threads, batch)` for every candidate thread count at every batch size of
/// [`PLAN_BATCHES`]: per batch size, each count in turn runs a settling burst of [`THREAD_BURST`]
/// calls (and, with pool workers, for at least [`THREAD_SETTLE`]), then [`RUNS`] samples back
/// to back, each the mean of a burst of [`THREAD_BURST`] calls, each starting from a forgotten
/// handoff estimate ([`crate::kernels::parallel::forget_handoffs`]); the best sample counts.
pub fn measure_threads(candidates: &[usize], run: impl FnMut(usize, usize)) -> Vec<ThreadTiming> {
    measure_threads_at(candidates, &PLAN_BATCHES, true, 0, run)
}

/// [`measure_threads`] at `batches`, warming the machine up first when `warm_up` (a second
/// measurement straight after a first needs none), each timing marked with `events` (0: the
/// plan's session-length histories; else the events of each history `run` takes).
pub fn measure_threads_at(
    candidates: &[usize],
    batches: &[usize],
    warm_up: bool,
    events: usize,
    mut run: impl FnMut(usize, usize),
) -> Vec<ThreadTiming> {
    let mut timings = Vec::new();
    // The machine brought to a busy server's state first: every core awake and clocked up, the
    // pool's workers in their rhythm (timed straight after a load, one thread's first samples
    // ran 1.4x slower than a few hundred milliseconds later).
    let all = candidates.iter().copied().max().unwrap_or(1);
    let warm = Instant::now();
    while warm_up && warm.elapsed() < THREAD_WARM_UP {
        run(all, PLAN_BATCHES[1]);
    }
    for &batch in batches {
        for &threads in candidates {
            let settle = Instant::now();
            let mut calls = 0;
            while calls < THREAD_BURST || (threads > 1 && settle.elapsed() < THREAD_SETTLE) {
                run(threads, batch);
                calls += 1;
            }
            let mut best = f64::INFINITY;
            for _ in 0..RUNS {
                // Each sample starts from no handoff estimate: a slow handoff in one sample
                // keeps that sample on fewer threads, not every sample of this count.
                crate::kernels::parallel::forget_handoffs();
                let start = Instant::now();
                for _ in 0..THREAD_BURST {
                    run(threads, batch);
                }
                best = best.min(start.elapsed().as_secs_f64() / THREAD_BURST as f64);
            }
            timings.push(ThreadTiming {
                batch,
                threads,
                seconds: best,
                events,
            });
        }
    }
    timings
}

/// What a plan file holds; every identifying field must match for it to be used. `T`: the
/// plan's timings ([`Timing`] for the two-way choices, [`ThreadTiming`] for threads).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct PlanFile<T> {
    format: u32,
    plan: String,
    recsys: String,
    cpu: String,
    isa: String,
    threads: usize,
    engine: String,
    timings: Vec<T>,
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
    /// Which choice: "screen", "bf16-path", "row-block" or "threads".
    pub plan: String,
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
                "{FORMAT}\n{}\n{}\n{}\n{}\n{}\n{}",
                self.plan,
                env!("CARGO_PKG_VERSION"),
                self.cpu,
                self.isa,
                self.threads,
                self.engine
            )
            .as_bytes(),
        );
        format!("{}-{}.json", self.plan, &hex::encode(digest)[..24])
    }

    fn matches<T>(&self, file: &PlanFile<T>) -> Result<(), String> {
        let checks = [
            ("format", file.format.to_string(), FORMAT.to_string()),
            ("plan", file.plan.clone(), self.plan.clone()),
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

/// The cached plan's timings for `key` in `dir`, and its path: `Ok(Some)` when a valid one is
/// there, `Ok(None)` when there is none, `Err(why)` when the file there cannot be used (damaged,
/// or made for another CPU or engine under a colliding name).
pub fn read_cached<T: DeserializeOwned>(
    dir: &std::path::Path,
    key: &PlanKey,
) -> Result<Option<(Vec<T>, PathBuf)>, String> {
    let path = dir.join(key.file_name());
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let file: PlanFile<T> = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a plan file: {e}", path.display()))?;
    key.matches(&file)
        .map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(Some((file.timings, path)))
}

/// Writes a measured plan for `key` into `dir` (whole or not at all: written aside, then renamed);
/// the path, or why it could not be written.
pub fn write_cached<T: Serialize + Clone>(
    dir: &std::path::Path,
    key: &PlanKey,
    timings: &[T],
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(key.file_name());
    let file = PlanFile {
        format: FORMAT,
        plan: key.plan.clone(),
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

/// Times the candidate (`run(true, batch)`) against the fallback (`run(false, batch)`) at every
/// batch size of [`PLAN_BATCHES`]: each side in turn, the best of [`RUNS`] runs after one warm-up
/// run each.
pub fn measure(mut run: impl FnMut(bool, usize)) -> Vec<Timing> {
    PLAN_BATCHES
        .iter()
        .map(|&batch| {
            run(true, batch);
            run(false, batch);
            let (mut best_candidate, mut best_fallback) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..RUNS {
                let start = Instant::now();
                run(true, batch);
                best_candidate = best_candidate.min(start.elapsed().as_secs_f64());
                let start = Instant::now();
                run(false, batch);
                best_fallback = best_fallback.min(start.elapsed().as_secs_f64());
            }
            Timing {
                batch,
                candidate_s: best_candidate,
                fallback_s: best_fallback,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PlanKey {
        PlanKey {
            plan: "screen".into(),
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
                candidate_s: 1.0,
                fallback_s: 2.0,
            },
            Timing {
                batch: 8,
                candidate_s: 3.0,
                fallback_s: 2.0,
            },
            Timing {
                batch: 64,
                candidate_s: 1.0,
                fallback_s: 2.0,
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
            ScreenPlan::fixed(false, PlanSource::Pinned("never".into())).by_batch == [(1, false)]
        );
    }

    #[test]
    fn cached_plans_are_used_only_for_their_cpu_and_engine_and_damage_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_cached::<Timing>(dir.path(), &key()).unwrap(), None);
        let path = write_cached(dir.path(), &key(), &timings()).unwrap();
        let (cached, at) = read_cached::<Timing>(dir.path(), &key()).unwrap().unwrap();
        assert_eq!((cached, &at), (timings(), &path));
        // Another CPU, another engine, other threads, another kind of plan: another file name,
        // so no plan.
        for other in [
            PlanKey {
                plan: "bf16-path".into(),
                ..key()
            },
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
            assert_eq!(read_cached::<Timing>(dir.path(), &other).unwrap(), None);
        }
        // A file under this key's name made elsewhere (copied between machines) is refused.
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("Test CPU", "Other CPU");
        std::fs::write(&path, text).unwrap();
        let err = read_cached::<Timing>(dir.path(), &key()).unwrap_err();
        assert!(err.contains("made for cpu \"Other CPU\""), "{err}");
        std::fs::write(&path, b"{ not json").unwrap();
        let err = read_cached::<Timing>(dir.path(), &key()).unwrap_err();
        assert!(err.contains("not a plan file"), "{err}");
    }

    #[test]
    fn measuring_times_both_sides_at_every_batch() {
        let (mut s, mut p) = (Vec::new(), Vec::new());
        let t = measure(|candidate, b| if candidate { s.push(b) } else { p.push(b) });
        assert_eq!(t.iter().map(|t| t.batch).collect::<Vec<_>>(), PLAN_BATCHES);
        assert_eq!(s.len(), PLAN_BATCHES.len() * (RUNS + 1));
        assert_eq!(s, p);
    }

    #[test]
    fn the_bf16_path_is_chosen_per_batch_size() {
        // Native 2x faster at batch 1, 1.5x slower at 8 and 64: native for single histories,
        // widened from 8 on.
        let timings = vec![
            Timing {
                batch: 1,
                candidate_s: 1.0,
                fallback_s: 2.0,
            },
            Timing {
                batch: 8,
                candidate_s: 3.0,
                fallback_s: 2.0,
            },
            Timing {
                batch: 64,
                candidate_s: 3.0,
                fallback_s: 2.0,
            },
        ];
        let plan = Bf16PathPlan::from_timings(timings.clone(), PlanSource::Skipped);
        assert_eq!(plan.by_batch, [(1, true), (8, false), (64, false)]);
        let chosen: Vec<bool> = [1, 7, 8, 64, 1000]
            .iter()
            .map(|&b| plan.native_for(b))
            .collect();
        assert_eq!(chosen, [true, true, false, false, false]);
        assert_eq!(plan.paths(), (true, true));
        assert!(
            plan.describe().starts_with(
                "bf16 batch 1+: vdpbf16ps (native) (1000.000 ms native, 2000.000 ms widened), \
                 batch 8+: widened to f32 (3000.000 ms native"
            ),
            "{}",
            plan.describe()
        );
        // A tie keeps the native path.
        let mut tie = timings;
        tie[1].candidate_s = 2.0;
        let plan = Bf16PathPlan::from_timings(tie, PlanSource::Skipped);
        assert_eq!(plan.by_batch, [(1, true), (8, true), (64, false)]);
        let pinned = Bf16PathPlan::fixed(false, PlanSource::Pinned("widened".into()));
        assert!(!pinned.native_for(1) && !pinned.native_for(64));
        assert_eq!(pinned.paths(), (false, true));
        assert_eq!(
            ["auto", "native", "vdpbf16ps", "widened"].map(|s| s.parse::<Bf16Path>().unwrap()),
            [
                Bf16Path::Auto,
                Bf16Path::Native,
                Bf16Path::Native,
                Bf16Path::Widened
            ]
        );
        assert!("fast"
            .parse::<Bf16Path>()
            .unwrap_err()
            .contains("bf16_path must be"));
    }

    #[test]
    fn the_row_block_is_eight_unless_four_measured_faster_from_batch_8() {
        let t = |batch, eight: f64, four: f64| Timing {
            batch,
            candidate_s: eight / 1e3,
            fallback_s: four / 1e3,
        };
        // Batch 1 never forms a group of 8: its times do not count.
        let plan = RowBlockPlan::from_timings(
            vec![t(1, 9.0, 1.0), t(8, 0.30, 0.43), t(64, 2.1, 2.5)],
            PlanSource::Skipped,
        );
        assert_eq!(plan.block, RowBlock::Eight);
        assert!(plan.describe().starts_with(
            "row groups of up to 8 rows (batch 8: 0.300 ms with 8, 0.430 ms with 4; batch 64:"
        ));
        let plan = RowBlockPlan::from_timings(
            vec![t(1, 1.0, 9.0), t(8, 0.45, 0.43), t(64, 2.6, 2.5)],
            PlanSource::Skipped,
        );
        assert_eq!(plan.block, RowBlock::Four);
        assert_eq!(
            ["auto", "4", "8"].map(|s| s.parse::<RowBlockPolicy>().unwrap()),
            [
                RowBlockPolicy::Auto,
                RowBlockPolicy::Fixed(RowBlock::Four),
                RowBlockPolicy::Fixed(RowBlock::Eight)
            ]
        );
        assert!("16"
            .parse::<RowBlockPolicy>()
            .unwrap_err()
            .contains("row_block must be"));
    }

    #[test]
    fn calls_of_long_histories_take_the_long_sample_count() {
        let t = |batch, threads, ms: f64, events| ThreadTiming {
            batch,
            threads,
            seconds: ms / 1e3,
            events,
        };
        // Batch 1 of a median history: one thread (two lose); of 200 events: two (1.5x).
        let mut timings = vec![
            t(1, 1, 0.048, 0),
            t(1, 2, 0.059, 0),
            t(8, 1, 0.60, 0),
            t(8, 2, 0.40, 0),
            t(64, 1, 4.8, 0),
            t(64, 2, 2.6, 0),
        ];
        let short = ThreadPlan::from_timings(timings.clone(), PlanSource::Skipped);
        assert_eq!(short.long_histories, None);
        assert_eq!(
            short.threads_for_call(1, 200),
            1,
            "no long sample: by batch only"
        );
        timings.extend([t(1, 1, 0.22, 200), t(1, 2, 0.15, 200)]);
        let plan = ThreadPlan::from_timings(timings.clone(), PlanSource::Skipped);
        assert_eq!(
            plan.by_batch,
            [(1, 1), (8, 2), (64, 2)],
            "the long sample is not a batch"
        );
        // sqrt(23 * 200) = 67.8: from 68 events on a call counts as long.
        assert_eq!(
            plan.long_histories,
            Some(LongHistoryThreads {
                from_events: 68,
                sample_events: 200,
                threads: 2
            })
        );
        let chosen: Vec<usize> = [
            (1, 23),
            (1, 67),
            (1, 68),
            (7, 68),
            (7, 200),
            (8, 200),
            (8, 4),
            (64, 4),
        ]
        .iter()
        .map(|&(b, e)| plan.threads_for_call(b, e))
        .collect();
        assert_eq!(chosen, [1, 1, 2, 2, 2, 2, 2, 2]);
        assert_eq!(plan.threads_for(1), 1);
        assert!(
            plan.describe().contains(
                "batch 1-7 of histories averaging 68+ events: 2 threads (0.220 ms on 1, 0.150 ms on 2 at 200 events)"
            ),
            "{}",
            plan.describe()
        );
        // A long sample that measured fewer threads than the short one keeps the short count.
        let odd = vec![
            t(1, 1, 0.10, 0),
            t(1, 2, 0.05, 0),
            t(1, 1, 0.20, 200),
            t(1, 2, 0.30, 200),
        ];
        let plan = ThreadPlan::from_timings(odd, PlanSource::Skipped);
        assert_eq!(plan.long_histories.map(|l| l.threads), Some(2));
        // Plan files keep the field only where it is set, and read older timings as 0.
        let json = serde_json::to_string(&timings).unwrap();
        assert_eq!(json.matches("\"events\"").count(), 2, "{json}");
        let back: Vec<ThreadTiming> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, timings);
    }

    #[test]
    fn each_batch_size_gets_the_fewest_threads_within_the_margin_of_its_fastest() {
        let t = |batch, threads, ms: f64| ThreadTiming {
            batch,
            threads,
            seconds: ms / 1e3,
            events: 0,
        };
        // Batch 1: two threads 3 % faster (within the margin): one. Batch 8: two threads 20 %
        // faster: two. Batch 64: four fastest, two 10 % behind: four.
        let timings = vec![
            t(1, 1, 1.00),
            t(1, 2, 0.97),
            t(1, 4, 1.20),
            t(8, 1, 2.0),
            t(8, 2, 1.6),
            t(8, 4, 1.7),
            t(64, 1, 8.0),
            t(64, 2, 4.4),
            t(64, 4, 4.0),
        ];
        let plan = ThreadPlan::from_timings(timings.clone(), PlanSource::Skipped);
        assert_eq!(plan.by_batch, [(1, 1), (8, 2), (64, 4)]);
        let chosen: Vec<usize> = [1, 7, 8, 63, 64, 1000]
            .iter()
            .map(|&b| plan.threads_for(b))
            .collect();
        assert_eq!(chosen, [1, 1, 2, 2, 4, 4]);
        assert!(
            plan.describe()
                .starts_with("batch 1+: 1 thread (1.000 ms on 1, 0.970 ms on 2, 1.200 ms on 4)"),
            "{}",
            plan.describe()
        );
        // Plan histories: the median first, then short and long alike in every prefix.
        assert_eq!(session_length(0), 23);
        let lengths: Vec<usize> = (0..64).map(session_length).collect();
        assert!(lengths.iter().all(|l| (4..=128).contains(l)));
        let median = |rows: &[usize]| {
            let mut v = rows.to_vec();
            v.sort_unstable();
            v[v.len() / 2]
        };
        assert!((16..=32).contains(&median(&lengths[..8])), "{lengths:?}");
        assert!((16..=32).contains(&median(&lengths)), "{lengths:?}");
        assert!(lengths[..8].iter().any(|&l| l < 10) && lengths[..8].iter().any(|&l| l > 60));
        assert_eq!(thread_candidates(1), [1]);
        assert_eq!(thread_candidates(2), [1, 2]);
        assert_eq!(thread_candidates(6), [1, 2, 4, 6]);
        assert_eq!(thread_candidates(8), [1, 2, 4, 8]);
        // Calls per (threads, batch), and the order in which the pairs first came.
        let candidates = thread_candidates(3);
        let mut calls = std::collections::HashMap::<(usize, usize), usize>::new();
        let mut order = Vec::new();
        let started = Instant::now();
        let measured = measure_threads(&candidates, |threads, batch| {
            let n = calls.entry((threads, batch)).or_default();
            if *n == 0 {
                order.push((threads, batch));
            }
            *n += 1;
        });
        assert_eq!(measured.len(), PLAN_BATCHES.len() * candidates.len());
        // First the warm-up on every thread at the middle batch size, for THREAD_WARM_UP.
        assert_eq!(order[0], (3, PLAN_BATCHES[1]));
        assert!(started.elapsed() >= THREAD_WARM_UP + THREAD_SETTLE);
        // Then each batch size, each count in turn: one thread runs its settling burst and
        // RUNS timed bursts exactly; counts with workers settle for THREAD_SETTLE at least.
        let per_batch: Vec<(usize, usize)> = PLAN_BATCHES
            .iter()
            .flat_map(|&b| candidates.iter().map(move |&t| (t, b)))
            .filter(|&pair| pair != (3, PLAN_BATCHES[1]))
            .collect();
        assert_eq!(order[1..], per_batch[..]);
        for &batch in &PLAN_BATCHES {
            assert_eq!(calls[&(1, batch)], (RUNS + 1) * THREAD_BURST);
            assert!(calls[&(2, batch)] >= (RUNS + 1) * THREAD_BURST);
        }
        assert_eq!(
            ["auto", "all", "3"].map(|s| s.parse::<ThreadPolicy>().unwrap()),
            [
                ThreadPolicy::Auto,
                ThreadPolicy::All,
                ThreadPolicy::Fixed(3)
            ]
        );
        for bad in ["0", "many", ""] {
            assert!(bad
                .parse::<ThreadPolicy>()
                .unwrap_err()
                .contains("thread_plan must be"));
        }
    }
}
