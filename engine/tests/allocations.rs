//! The encoder's steady state allocates nothing: once its buffers have held a batch, a stream of
//! batches no larger (in histories and tokens) runs without one heap allocation, for both models
//! at every precision, and the answers are the bits of a fresh encoder's.
//!
//! The count is this thread's own (a thread-local counter behind the global allocator), so other
//! tests running in parallel do not disturb it.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::*;
use recsys_engine::models::EncodeScratch;
use recsys_engine::{ExternalIds, ModelKind};

struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count_one() {
    // `try_with`: the counter may already be gone while a thread is being torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only a
// const-initialised thread-local Cell, which itself never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: `ptr` came from this allocator, which is the system's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, which is the system's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Heap allocations (and reallocations) `run` makes on this thread.
fn allocations_of(run: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    run();
    ALLOCATIONS.with(Cell::get) - before
}

#[test]
fn a_warm_encoder_allocates_nothing_per_batch_at_every_precision() {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        for (variant, engine) in engines_at_every_precision(kind, tmp.path()) {
            let histories: Vec<Vec<u32>> = cases
                .iter()
                .take(64)
                .map(|case| {
                    let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
                    engine.ids.map(ExternalIds::Str(&ids)).indices
                })
                .collect();
            let all: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
            let mut scratch = EncodeScratch::default();
            let (mut hidden, mut notes) = (Vec::new(), Vec::new());
            // Warm-up: the whole batch, so every buffer reaches its largest size.
            let first = allocations_of(|| {
                engine
                    .model
                    .encode_into(&all, &mut scratch, &mut hidden, &mut notes)
            });
            assert!(
                first > 0,
                "{kind} {variant}: the first batch sizes the buffers"
            );
            // Then batches of 64, 1, 8 and 33 histories (different lengths, fewer tokens).
            for batch in [&all[..], &all[..1], &all[7..15], &all[31..]] {
                let count = allocations_of(|| {
                    engine
                        .model
                        .encode_into(batch, &mut scratch, &mut hidden, &mut notes)
                });
                assert_eq!(
                    count,
                    0,
                    "{kind} {variant}: a warm batch of {} histories allocated {count} times",
                    batch.len()
                );
                let (want_hidden, want_notes) = engine.model.encode(batch);
                assert!(
                    hidden.len() == want_hidden.len()
                        && hidden
                            .iter()
                            .zip(&want_hidden)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kind} {variant}: reused buffers changed the hidden vectors"
                );
                assert_eq!(notes, want_notes, "{kind} {variant}: notes");
            }
        }
    }
}

/// The counter sees what it should: otherwise a zero above would prove nothing.
#[test]
fn the_counter_counts() {
    let n = allocations_of(|| {
        let v: Vec<u64> = std::hint::black_box(vec![1, 2, 3]);
        drop(v);
    });
    assert_eq!(n, 1);
}
