//! Opt-in time accounting by kind of work, for the benchmarks' roofline columns: how many
//! thread-seconds a run spent in dense layers, attention and the output layer, so that each kind's
//! achieved FLOP/s can be set against one core's measured peak.
//!
//! Off by default: then each accounted region costs one relaxed atomic load. On, it reads the
//! monotonic clock twice per region (a few hundred regions per batch), far below the work timed.
//! Times are summed over every thread that ran a region, so with 2 threads busy a wall second
//! counts twice.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The kinds of work accounted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Dense (linear) layers of the encoders, Mult-VAE's first-layer gather-sum included.
    Dense = 0,
    /// BERT4Rec's attention: scores, softmax and the weighted sum of the values.
    Attention = 1,
    /// The output layer: whole-catalogue scans (the screen included) and candidate scoring.
    Output = 2,
}

const KINDS: usize = 3;

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];

/// Starts (or stops) accounting, process-wide.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Thread-seconds accounted so far per kind (`Work as usize` indexes it), and resets them.
pub fn take() -> [f64; KINDS] {
    std::array::from_fn(|k| NANOS[k].swap(0, Ordering::Relaxed) as f64 * 1e-9)
}

/// Runs `f`, adding its duration to `kind` when accounting is on.
#[inline]
pub fn account<T>(kind: Work, f: impl FnOnce() -> T) -> T {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let nanos = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
    NANOS[kind as usize].fetch_add(nanos, Ordering::Relaxed);
    out
}
