//! Faults injected at exact points of a release command, for the release path's simulation
//! tests (`scripts/chaos.sh`, `tests/integration/test_chaos.py`). Compiled in only with the
//! `fault-injection` feature (a separate build of `recsys`); in every other build each hook is an
//! empty inline function and the environment is never read.
//!
//! The plan comes from `RECSYS_FAULTS`, comma-separated `name=value` pairs:
//! - `panic-before-write=N` / `panic-after-write=N`: the command panics just before (after) its
//!   N-th store write (1-based, counting create, replace, overwrite, upload and delete, the lease's
//!   own renewals included): the unwinding path of a bug.
//! - `abort-before-write=N` / `abort-after-write=N`: the process dies there without unwinding or
//!   releasing anything, as under SIGKILL, at a point a timer could only hit by chance.
//! - `lease-ttl=SECONDS`: the lease's lifetime, so expiry and takeover happen within a test.
//! - `clock-skew=SECONDS` (signed): this process's clock for lease expiry runs that far ahead
//!   (behind), as two operators' machines disagree within NTP's tolerance.
//!
//! A schedule that fails replays exactly: the write count is per process and deterministic for a
//! given repository state and command.

#[cfg(feature = "fault-injection")]
mod plan {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    #[derive(Default)]
    pub(super) struct Plan {
        pub panic_before: Option<u64>,
        pub panic_after: Option<u64>,
        pub abort_before: Option<u64>,
        pub abort_after: Option<u64>,
        pub lease_ttl: Option<u64>,
        pub clock_skew: i64,
    }

    pub(super) fn plan() -> &'static Plan {
        static PLAN: OnceLock<Plan> = OnceLock::new();
        PLAN.get_or_init(|| {
            let mut plan = Plan::default();
            let text = std::env::var("RECSYS_FAULTS").unwrap_or_default();
            for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (name, value) = pair
                    .split_once('=')
                    .unwrap_or_else(|| panic!("RECSYS_FAULTS: {pair:?} is not name=value"));
                let number = || {
                    value.parse::<u64>().unwrap_or_else(|_| {
                        panic!("RECSYS_FAULTS: {name} takes a whole number, not {value:?}")
                    })
                };
                match name {
                    "panic-before-write" => plan.panic_before = Some(number()),
                    "panic-after-write" => plan.panic_after = Some(number()),
                    "abort-before-write" => plan.abort_before = Some(number()),
                    "abort-after-write" => plan.abort_after = Some(number()),
                    "lease-ttl" => plan.lease_ttl = Some(number()),
                    "clock-skew" => {
                        plan.clock_skew = value.parse().unwrap_or_else(|_| {
                            panic!("RECSYS_FAULTS: clock-skew takes seconds, not {value:?}")
                        })
                    }
                    other => panic!("RECSYS_FAULTS: unknown fault {other:?}"),
                }
            }
            plan
        })
    }

    /// Store writes of this process so far.
    pub(super) static WRITES: AtomicU64 = AtomicU64::new(0);

    pub(super) fn fire(kind: &str, key: &str, n: u64) -> ! {
        eprintln!("recsys fault injection: {kind} at store write {n} ({key})");
        if kind.starts_with("abort") {
            std::process::abort();
        }
        panic!("fault injection: {kind} at store write {n} ({key})");
    }

    pub(super) fn next_write() -> u64 {
        WRITES.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub(super) fn current_write() -> u64 {
        WRITES.load(Ordering::SeqCst)
    }
}

/// Before a store write of `key`.
#[inline]
pub(crate) fn before_write(_key: &str) {
    #[cfg(feature = "fault-injection")]
    {
        let n = plan::next_write();
        let p = plan::plan();
        if p.abort_before == Some(n) {
            plan::fire("abort-before-write", _key, n);
        }
        if p.panic_before == Some(n) {
            plan::fire("panic-before-write", _key, n);
        }
    }
}

/// After a store write of `key` succeeded.
#[inline]
pub(crate) fn after_write(_key: &str) {
    #[cfg(feature = "fault-injection")]
    {
        let n = plan::current_write();
        let p = plan::plan();
        if p.abort_after == Some(n) {
            plan::fire("abort-after-write", _key, n);
        }
        if p.panic_after == Some(n) {
            plan::fire("panic-after-write", _key, n);
        }
    }
}

/// The lease lifetime the plan sets, if any.
#[inline]
pub(crate) fn lease_ttl() -> Option<std::time::Duration> {
    #[cfg(feature = "fault-injection")]
    {
        plan::plan().lease_ttl.map(std::time::Duration::from_secs)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        None
    }
}

/// Seconds this process's lease clock runs ahead of the real one.
#[inline]
pub(crate) fn clock_skew() -> i64 {
    #[cfg(feature = "fault-injection")]
    {
        plan::plan().clock_skew
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        0
    }
}
