//! How busy the machine was while a plan was measured: the CPU time that other processes (and
//! the hypervisor's other guests, as steal time) took from this machine's cores during the
//! measurement, in cores.
//!
//! A plan is kept for every later load, so a plan timed while something else ran stays wrong
//! after that something has finished: timed beside a compiler, two threads look no faster than
//! one, and a MovieLens-20M HSTU engine kept such a plan, which ran its 23-67-event histories on
//! one thread (10.6 ms) where two take 7.0 ms, on every load after. A plan measured while other
//! work took more than [`busy_cores_limit`] cores is therefore used for that load only and
//! measured again at the next.
//!
//! Linux's `/proc/stat` (every core's busy and steal ticks) less `/proc/self/stat` (this
//! process's own ticks, all its threads). Elsewhere nothing is known, and plans are kept as
//! before. Work of other threads of this process (another model's instance in the same server)
//! counts as this process's own and is not seen.

use std::time::Duration;

/// Other work above this many cores while a plan was measured keeps it out of the plan cache.
/// A 2-vCPU server at rest measured 0.00-0.02 (one-second windows); one busy process takes a
/// whole core.
pub const BUSY_CORES: f64 = 0.25;

/// Windows shorter than this say too little (the counters tick every 10 ms): no verdict.
const SHORTEST_WINDOW: Duration = Duration::from_millis(100);

/// The limit in force: `$RECSYS_PLAN_BUSY_CORES` when it is a number (`inf` keeps every plan),
/// else [`BUSY_CORES`].
pub fn busy_cores_limit() -> f64 {
    std::env::var("RECSYS_PLAN_BUSY_CORES")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| *v >= 0.0)
        .unwrap_or(BUSY_CORES)
}

/// The machine's and this process's CPU counters at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuTicks {
    /// Every core's ticks in any state (idle included): the window's length times the cores.
    pub all: u64,
    /// Every core's ticks running something (user, nice, system, irq, softirq) or taken by the
    /// hypervisor (steal).
    pub busy: u64,
    /// The cores counted.
    pub cores: usize,
    /// This process's user and system ticks, all its threads.
    pub own: u64,
}

impl CpuTicks {
    /// Now, or `None` where the counters cannot be read.
    pub fn now() -> Option<CpuTicks> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        CpuTicks::parse(&stat, &own)
    }

    /// From the texts of `/proc/stat` and `/proc/self/stat`.
    pub fn parse(stat: &str, own_stat: &str) -> Option<CpuTicks> {
        let total = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = total
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        let all = (0..8).map(field).sum();
        let busy = [0, 1, 2, 5, 6, 7].into_iter().map(field).sum();
        let cores = stat
            .lines()
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count()
            .max(1);
        // The command name (field 2) is in parentheses and may hold spaces: count from its end.
        let after_name = &own_stat[own_stat.rfind(')')? + 1..];
        let own: Vec<u64> = after_name
            .split_whitespace()
            .skip(11) // state (field 3) ... cmajflt (field 13)
            .take(2) // utime, stime
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        Some(CpuTicks {
            all,
            busy,
            cores,
            own: own.iter().sum(),
        })
    }

    /// The cores that other work took on average from `self` to `later`: `None` for a window
    /// too short to say ([`SHORTEST_WINDOW`] on every core).
    pub fn others_cores_until(&self, later: &CpuTicks, ticks_per_second: u64) -> Option<f64> {
        let all = later.all.saturating_sub(self.all);
        let shortest = SHORTEST_WINDOW.as_secs_f64() * ticks_per_second as f64 * self.cores as f64;
        if (all as f64) < shortest {
            return None;
        }
        let others = later
            .busy
            .saturating_sub(self.busy)
            .saturating_sub(later.own.saturating_sub(self.own));
        Some(others as f64 / all as f64 * self.cores as f64)
    }
}

/// The kernel's clock ticks per second for these counters (`USER_HZ`: 100 on every Linux
/// architecture this runs on; the ratio above only uses it to size the shortest window).
const TICKS_PER_SECOND: u64 = 100;

/// Runs `measure` and says how many cores other work took meanwhile (`None`: unknown).
pub fn others_cores_during<T>(measure: impl FnOnce() -> T) -> (T, Option<f64>) {
    let before = CpuTicks::now();
    let value = measure();
    let others = before.and_then(|b| {
        CpuTicks::now().and_then(|after| b.others_cores_until(&after, TICKS_PER_SECOND))
    });
    (value, others)
}

/// Why a plan measured while other work took `others` cores is not kept (`None`: it is), by
/// `limit` ([`busy_cores_limit`]).
pub fn busy_verdict(others: Option<f64>, limit: f64) -> Option<String> {
    let others = others?;
    (others > limit).then(|| {
        format!(
            "other processes took {others:.2} cores while it was measured (more than \
             {limit:.2}; RECSYS_PLAN_BUSY_CORES): used for this load only, measured again at the \
             next"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 10 50 1000 5 0 5 20 0 0\n\
                        cpu0 50 5 25 500 2 0 2 10 0 0\n\
                        cpu1 50 5 25 500 3 0 3 10 0 0\n\
                        intr 12345\n";

    #[test]
    fn counters_are_read_from_procs_text_even_with_spaces_in_the_name() {
        let own = "4242 (my (odd) name) R 1 2 3 4 5 6 7 8 9 10 30 12 0 0 20 0 4 0 99";
        let ticks = CpuTicks::parse(STAT, own).unwrap();
        assert_eq!(
            ticks,
            CpuTicks {
                all: 1190,
                busy: 185,
                cores: 2,
                own: 42
            }
        );
        assert_eq!(CpuTicks::parse("intr 1\n", own), None);
        assert_eq!(CpuTicks::parse(STAT, "no name here"), None);
    }

    #[test]
    fn others_are_the_busy_ticks_less_this_processs_own() {
        let before = CpuTicks {
            all: 0,
            busy: 0,
            cores: 2,
            own: 0,
        };
        // One second on two cores: 200 ticks; 150 busy, 100 of them ours: half a core others'.
        let after = CpuTicks {
            all: 200,
            busy: 150,
            cores: 2,
            own: 100,
        };
        let others = before.others_cores_until(&after, 100).unwrap();
        assert!((others - 0.5).abs() < 1e-12, "{others}");
        assert!(busy_verdict(Some(others), BUSY_CORES)
            .unwrap()
            .contains("0.50 cores"));
        assert_eq!(busy_verdict(Some(others), 0.6), None);
        assert_eq!(busy_verdict(None, 0.0), None);
        // 50 ms on two cores is too short to say.
        let short = CpuTicks { all: 10, ..after };
        assert_eq!(before.others_cores_until(&short, 100), None);
    }

    #[test]
    fn a_spinning_process_beside_the_measurement_is_seen() {
        if CpuTicks::now().is_none() {
            eprintln!("skipped: no /proc/stat on this system");
            return;
        }
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs");
        std::thread::sleep(Duration::from_millis(50));
        let ((), others) = others_cores_during(|| std::thread::sleep(Duration::from_millis(400)));
        spinner.kill().unwrap();
        spinner.wait().unwrap();
        let others = others.expect("a 400 ms window is long enough");
        // The spinner had a core to itself while this process slept.
        assert!(others > 0.6, "{others}");
        assert!(busy_verdict(Some(others), BUSY_CORES).is_some());
    }
}
