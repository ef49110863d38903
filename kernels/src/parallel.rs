//! Where a batch's parallel pieces run: the engine's worker pool, one worker per core but one.
//!
//! Spawning threads per batch cost 50-150 us on the 2-core machine the project is measured on,
//! more than a whole batch-1 Mult-VAE of 2,000 items takes on one core, so 2 threads made batch 1
//! slower than 1. The pool's workers stay alive; handing them a piece costs a wake-up. Callers
//! still say how many pieces a batch is split into (the engine's `threads`), and every piece's
//! result is independent of the split, so answers do not depend on the pool either.
//!
//! The calling thread always runs a batch's first piece itself, so the pool holds one worker per
//! available core but one: caller and workers then fill the cores. A worker per core (rayon's
//! default) left one idle worker looking for work next to the two busy threads on 2 cores, and
//! each busy thread ran 10-40 % slower (thread-seconds of the same scan). `RAYON_NUM_THREADS`
//! sets the number of workers instead. The pool is shared by every engine in the process: several
//! model instances splitting batches at once queue on the same workers instead of oversubscribing
//! the cores. Should the pool's threads fail to start, pieces run one after the other on the
//! calling thread (same answers).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The process's worker pool (`None`: its threads could not be started).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let workers = std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .saturating_sub(1)
                    .max(1)
            });
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers)
            .thread_name(|i| format!("recsys-worker-{i}"))
            .build()
            .ok()?;
        // Every worker started before the first piece is handed out: otherwise the first
        // handoff timed is a thread's start (2.6 ms measured on a 2-core Zen 2), which made
        // [`min_macs_per_piece`] keep a batch of 64 Mult-VAE histories (131 M multiply-adds)
        // on one thread until that estimate went stale.
        pool.broadcast(|_| ());
        Some(pool)
    })
    .as_ref()
}

/// Pieces handed to the pool so far: a waiting [`prewake`] spinner returns when this moves.
static HANDED_OUT: AtomicU64 = AtomicU64::new(0);
/// Whether a [`prewake`] spinner is queued or spinning (never more than one at a time).
static SPINNER: AtomicBool = AtomicBool::new(false);
/// Batches between [`Batch::begin`] and its drop: while any runs, the pool is kept awake between
/// its split steps.
static BATCHES: AtomicUsize = AtomicUsize::new(0);

/// Longest a prewoken worker waits for the pieces it was woken for.
const SPIN_LIMIT: Duration = Duration::from_micros(300);
/// A spinner that starts later than this after its [`prewake`] was queued behind other work,
/// and so was not needed to wake the pool: it returns at once instead of spinning.
const LATE_START: Duration = Duration::from_micros(150);

/// Wakes a pool worker now, for pieces a batch is about to hand out: waking a sleeping worker
/// costs 30-55 us on the 2-core VM the project is measured on, as long as a whole batch-1 scan of
/// a few thousand items, so a batch split over 2 threads ran slower than on 1. The worker spins
/// until the next pieces are handed out, at most [`SPIN_LIMIT`], only while some [`Batch`] runs,
/// and not at all if it only gets to run late (the pool was busy, hence awake). Answers never
/// depend on it.
fn prewake() {
    let Some(pool) = pool() else {
        return;
    };
    if SPINNER.swap(true, Ordering::AcqRel) {
        return;
    }
    let (queued, seen) = (Instant::now(), HANDED_OUT.load(Ordering::Acquire));
    pool.spawn(move || {
        let started = Instant::now();
        if started.duration_since(queued) < LATE_START {
            while HANDED_OUT.load(Ordering::Acquire) == seen
                && BATCHES.load(Ordering::Acquire) > 0
                && started.elapsed() < SPIN_LIMIT
            {
                pause(started);
            }
        }
        SPINNER.store(false, Ordering::Release);
    });
}

/// One batch that splits its steps over the pool: from [`Batch::begin`] to the guard's drop, a
/// worker is woken ahead of the first step and again after each step, so a batch of several
/// split steps (BERT4Rec's layers, then the output layer) pays no wake-up between them.
pub struct Batch(());

impl Batch {
    pub fn begin() -> Batch {
        BATCHES.fetch_add(1, Ordering::AcqRel);
        prewake();
        Batch(())
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        BATCHES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How far the pool's pieces of one split step have got.
struct Progress {
    handed_out: Instant,
    started: AtomicUsize,
    finished: AtomicUsize,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            handed_out: Instant::now(),
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
        }
    }
}

/// Longest the calling thread spins for pieces that no worker has started yet: longer than a
/// sleeping worker takes to wake (30-55 us here; at 20 us batch-1 BERT4Rec lost half its gain),
/// so past it the pieces are queued behind other work (another model instance's), and spinning
/// would only take a core from whoever holds the workers.
const UNSTARTED_SPIN: Duration = Duration::from_micros(100);

impl Progress {
    /// A piece starts on a worker: the first one of the step records how long the handoff took.
    fn start(&self) {
        if self.started.fetch_add(1, Ordering::AcqRel) == 0 {
            handoff::record(self.handed_out.elapsed());
        }
    }

    /// The calling thread, its own piece done, waits for the pool's `count` pieces by spinning
    /// while they run, at most [`SPIN_LIMIT`]: the scope's own wait puts a thread that is not a
    /// pool worker to sleep, and waking it again costs what waking a worker costs (the pieces
    /// of a batch-1 layer take a few microseconds each). Past the limit, or when the pieces have
    /// not even started, the scope's blocking wait takes over.
    fn await_briefly(&self, count: usize) {
        let started = Instant::now();
        while self.finished.load(Ordering::Acquire) < count {
            let waited = started.elapsed();
            if waited >= SPIN_LIMIT
                || (waited >= UNSTARTED_SPIN && self.started.load(Ordering::Acquire) < count)
            {
                return;
            }
            pause(started);
        }
    }
}

/// Spinning without yielding is cheapest while the thread waited for runs on another core; on a
/// machine whose other core is taken (a noisy VM, other processes) it runs on the waiter's own
/// core and holds the waiter off until the time slice ends (batch-1 BERT4Rec at 0.7 ms instead of
/// 0.3 in one run of three). So: a pure spin for the first [`PURE_SPIN`], then each round yields.
fn pause(since: Instant) {
    if since.elapsed() < PURE_SPIN {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// How long [`pause`] spins before it starts yielding.
const PURE_SPIN: Duration = Duration::from_micros(20);

/// What handing a piece to the pool costs on this machine now, measured on every split step (the
/// time from handing pieces out to the first one starting on a worker), so that work too small to
/// pay for it stays on the calling thread ([`min_macs_per_piece`]). On the project's 2-core VM it
/// moves between a few microseconds and 100 or more as neighbours come and go; at the high end a
/// batch-1 BERT4Rec on 2 threads took 0.44 ms against 0.34 on one, and a Mult-VAE of 3,416 items
/// 0.24 against 0.17.
mod handoff {
    use super::{AtomicU64, Duration, Instant, OnceLock, Ordering};

    /// Moving average of the handoff, in nanoseconds (each sample weighs 1/8).
    static AVERAGE_NS: AtomicU64 = AtomicU64::new(0);
    /// When the last sample came, in nanoseconds since [`epoch`].
    static LAST_NS: AtomicU64 = AtomicU64::new(0);
    /// An average older than this is forgotten: work that stopped splitting because handoffs were
    /// slow splits again now and then, and so measures them again. Short, because a slow
    /// estimate stops the very splits that would correct it: one slow sample on a quiet pool
    /// (a worker descheduled for a moment) kept every split step of the next 500 ms on one
    /// thread when this was 500 ms; one slow split every 100 ms costs little where handoffs
    /// really are slow.
    const STALE: Duration = Duration::from_millis(100);

    fn epoch() -> Instant {
        static EPOCH: OnceLock<Instant> = OnceLock::new();
        *EPOCH.get_or_init(Instant::now)
    }

    fn now_ns() -> u64 {
        u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    pub(super) fn record(took: Duration) {
        let sample = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        let old = AVERAGE_NS.load(Ordering::Relaxed);
        let stale =
            now_ns().saturating_sub(LAST_NS.load(Ordering::Relaxed)) > STALE.as_nanos() as u64;
        let new = next_average(old, sample, stale);
        // Racing recorders may lose a sample: an estimate, not an account.
        AVERAGE_NS.store(new, Ordering::Relaxed);
        LAST_NS.store(now_ns(), Ordering::Relaxed);
    }

    /// The moving average after `sample` (taken whole when there is no recent average).
    pub(super) fn next_average(old: u64, sample: u64, stale: bool) -> u64 {
        if old == 0 || stale {
            sample
        } else {
            old - old / 8 + sample / 8
        }
    }

    /// Drops the estimate: the next split steps split by their floor and measure anew.
    pub(super) fn forget() {
        AVERAGE_NS.store(0, Ordering::Relaxed);
        LAST_NS.store(0, Ordering::Relaxed);
    }

    /// The current estimate (zero when none is recent).
    pub(super) fn estimate() -> Duration {
        let last = LAST_NS.load(Ordering::Relaxed);
        if now_ns().saturating_sub(last) > STALE.as_nanos() as u64 {
            return Duration::ZERO;
        }
        Duration::from_nanos(AVERAGE_NS.load(Ordering::Relaxed))
    }
}

/// Multiply-adds one core does in a nanosecond in the engine's dense kernels (about 100 GFLOP/s
/// measured), to turn a handoff's time into the work it must buy.
const MACS_PER_NS: u64 = 50;

/// The least work, in multiply-adds, worth a piece of its own: `floor` (the caller's own minimum)
/// or, when handing a piece to the pool costs more than that work takes, what a handoff
/// ([`handoff`]) costs in work, doubled (the caller waits for the piece as well). Answers never
/// depend on it; only how many threads a step uses does.
pub fn min_macs_per_piece(floor: usize) -> usize {
    // Tests that check a split changes no bit need the split to happen whatever the machine's
    // handoffs cost while they run (this crate's own, and callers' through
    // `split_by_floor_only`); the rule itself is tested on its own.
    if cfg!(test) || FLOOR_ONLY.load(Ordering::Relaxed) {
        return floor;
    }
    min_macs_given(floor, handoff::estimate())
}

static FLOOR_ONLY: AtomicBool = AtomicBool::new(false);

/// Forgets what handoffs have cost so far: the next split steps split by their own floor and
/// measure handoffs anew. For a measurement of what more threads buy (the engine's thread plan):
/// one slow handoff just before it (a worker's vCPU descheduled for a moment) would otherwise keep
/// every split of the next [`handoff`] window on one thread, and the plan would time one thread
/// under the name of two. On a 2-vCPU Zen 4 a Mult-VAE of 20,108 items was planned once at
/// batch 1 with two threads timed at 1.454 ms against 1.450 on one, where two take 0.48-0.80 ms;
/// the plan kept it on one thread.
pub fn forget_handoffs() {
    handoff::forget();
}

/// From now on, in this process, every split rule asks only its own floor of work per piece and
/// ignores what handoffs cost. For tests that check a split changes no bit: on a loaded machine
/// the measured handoff can make a split not happen at all. Answers never depend on it.
pub fn split_by_floor_only() {
    FLOOR_ONLY.store(true, Ordering::Relaxed);
}

/// [`min_macs_per_piece`] for a handoff of `handoff`.
fn min_macs_given(floor: usize, handoff: Duration) -> usize {
    let work = 2 * (handoff.as_nanos().min(u128::from(u32::MAX)) as u64) * MACS_PER_NS;
    floor.max(usize::try_from(work).unwrap_or(usize::MAX))
}

/// After a split step: the next step of a running batch finds a worker awake.
fn rearm() {
    if BATCHES.load(Ordering::Acquire) > 0 {
        prewake();
    }
}

/// `run(0), run(1), ..., run(pieces - 1)`, in order. Pieces after the first go to the pool while
/// the calling thread runs the first itself, so a batch waits for a worker's wake-up only when
/// that takes longer than a piece.
pub fn map_pieces<T: Send>(pieces: usize, run: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    if pieces <= 1 {
        return (0..pieces).map(run).collect();
    }
    let Some(pool) = pool() else {
        return (0..pieces).map(run).collect();
    };
    let mut results: Vec<Option<T>> = (0..pieces).map(|_| None).collect();
    let progress = Progress::default();
    pool.in_place_scope(|scope| {
        let (first, rest) = results.split_first_mut().expect("at least two pieces");
        let (run, progress) = (&run, &progress);
        HANDED_OUT.fetch_add(1, Ordering::AcqRel);
        for (i, slot) in rest.iter_mut().enumerate() {
            scope.spawn(move |_| {
                progress.start();
                *slot = Some(run(i + 1));
                progress.finished.fetch_add(1, Ordering::Release);
            });
        }
        *first = Some(run(0));
        progress.await_briefly(pieces - 1);
    });
    rearm();
    results
        .into_iter()
        .map(|r| r.expect("the scope ends after every piece has run"))
        .collect()
}

/// `run(0, &mut items[0]), run(1, &mut items[1]), ...`: each piece owns its item (a slice of the
/// output, its own buffers) while it runs; the calling thread runs the first, the pool the others.
pub fn for_each_mut<T: Send>(items: &mut [T], run: impl Fn(usize, &mut T) + Sync + Send) {
    let Some((first, rest)) = items.split_first_mut() else {
        return;
    };
    if rest.is_empty() {
        return run(0, first);
    }
    let Some(pool) = pool() else {
        run(0, first);
        for (i, item) in rest.iter_mut().enumerate() {
            run(i + 1, item);
        }
        return;
    };
    let (progress, others) = (Progress::default(), rest.len());
    pool.in_place_scope(|scope| {
        let (run, progress) = (&run, &progress);
        HANDED_OUT.fetch_add(1, Ordering::AcqRel);
        for (i, item) in rest.iter_mut().enumerate() {
            scope.spawn(move |_| {
                progress.start();
                run(i + 1, item);
                progress.finished.fetch_add(1, Ordering::Release);
            });
        }
        run(0, first);
        progress.await_briefly(others);
    });
    rearm();
}

#[cfg(test)]
mod tests {
    use super::{for_each_mut, map_pieces, prewake, Batch, SPINNER};
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    #[test]
    fn slow_handoffs_raise_the_work_a_piece_needs_and_are_forgotten() {
        use super::{handoff, min_macs_given};
        // A handoff cheaper than the floor's work changes nothing; a slow one asks for twice the
        // work a core does meanwhile.
        assert_eq!(min_macs_given(1 << 17, Duration::ZERO), 1 << 17);
        assert_eq!(min_macs_given(1 << 17, Duration::from_nanos(100)), 1 << 17);
        assert_eq!(
            min_macs_given(1 << 17, Duration::from_micros(50)),
            2 * 50_000 * 50
        );
        // The average: a first or stale one is the sample; then each sample weighs 1/8, so a
        // slow spell is followed and fades.
        assert_eq!(handoff::next_average(0, 80_000, false), 80_000);
        assert_eq!(handoff::next_average(2_000, 80_000, true), 80_000);
        assert_eq!(handoff::next_average(80_000, 80_000, false), 80_000);
        let mut average = 80_000;
        for _ in 0..32 {
            average = handoff::next_average(average, 2_000, false);
        }
        assert!(average < 4_000, "{average}");
        // Recording works (other tests record too, so only that some estimate exists).
        handoff::record(Duration::from_micros(80));
        assert!(handoff::estimate() > Duration::ZERO);
        // Forgotten: no estimate until the next handoff (other tests' handoffs may record one
        // between the two calls, so a few tries).
        assert!(
            (0..100).any(|_| {
                super::forget_handoffs();
                handoff::estimate() == Duration::ZERO
            }),
            "forget_handoffs leaves no estimate"
        );
    }

    /// Waits (at most 5 s) for the spinner to stop.
    fn spinner_stops(what: &str) {
        let start = Instant::now();
        while SPINNER.load(Ordering::Acquire) {
            assert!(start.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_prewoken_worker_stops_by_itself_and_pieces_still_run() {
        // Woken with no pieces to follow: the spinner gives up on its own.
        prewake();
        spinner_stops("the spinner never stopped");
        // Woken, then pieces: they run, in order.
        prewake();
        prewake();
        assert_eq!(map_pieces(3, |i| i * 2), vec![0, 2, 4]);
        // A batch of several steps: each runs; once the batch is over, no spinner is left.
        {
            let _batch = Batch::begin();
            assert_eq!(map_pieces(2, |i| i + 1), vec![1, 2]);
            let mut items = vec![0usize; 3];
            for_each_mut(&mut items, |i, item| *item = i);
            assert_eq!(items, vec![0, 1, 2]);
        }
        spinner_stops("a spinner outlived its batch");
    }

    #[test]
    fn each_piece_gets_its_own_item() {
        let mut items = vec![0usize; 5];
        for_each_mut(&mut items, |i, item| *item = i * i);
        assert_eq!(items, vec![0, 1, 4, 9, 16]);
        let mut none: Vec<usize> = Vec::new();
        for_each_mut(&mut none, |_, _| unreachable!("no items, no pieces"));
    }

    #[test]
    fn pieces_come_back_in_order() {
        assert_eq!(map_pieces(0, |i| i), Vec::<usize>::new());
        assert_eq!(map_pieces(1, |i| i * 10), vec![0]);
        assert_eq!(map_pieces(7, |i| i * 10), vec![0, 10, 20, 30, 40, 50, 60]);
    }

    #[test]
    fn a_panicking_piece_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| {
            map_pieces(4, |i| {
                assert!(i != 2, "piece 2 fails");
                i
            })
        });
        assert!(caught.is_err());
    }
}
