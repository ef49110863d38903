//! The prefix cache never changes an answer: the fixture's test users replayed event by event
//! through a GRU4Rec or SASRec engine with the cache and one without give the same hidden
//! vectors, bit for bit, and the same top-100 with the same scores; so do the RecBole golden
//! histories (whose final answers `sequential_parity.rs` checks against RecBole); a budget smaller
//! than the working set evicts and still changes nothing; a batch mixing cached, evicted, new,
//! empty and over-long histories answers each as the uncached engine does.

mod common;

use common::*;
use recsys_engine::kernels::{Isa, KernelTable};
use recsys_engine::prefix_cache::PrefixCache;
use recsys_engine::{Engine, ExternalIds, ModelKind, Request, ServeOptions};

/// The fixture's test users (internal indices, oldest first), as many as asked.
fn test_users(engine: &Engine, users: usize) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixtures().join("test_set.tsv")).unwrap();
    text.lines()
        .skip(1)
        .take(users)
        .map(|line| {
            let ids: Vec<i64> = line
                .split('\t')
                .nth(2)
                .unwrap()
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect();
            engine.ids.map(ExternalIds::Int(&ids)).indices
        })
        .filter(|h| !h.is_empty())
        .collect()
}

/// The models that carry a state, with the fixtures' window (50 items for both).
const CAUSAL: [ModelKind; 2] = [ModelKind::Gru4rec, ModelKind::Sasrec];
const WINDOW: usize = 50;

/// Bytes one cache entry of a history of `items` items costs when its state is one run (computed
/// in one call): its items, its state and the bookkeeping of the entry (96) and the run (32).
/// GRU4Rec's state is one 128-wide layer; SASRec's, per item, each of its two 64-wide layers' key
/// and value rows.
fn entry_bytes(kind: ModelKind, items: usize) -> usize {
    let state = match kind {
        ModelKind::Gru4rec => 4 * 128,
        _ => 4 * 2 * 2 * 64 * items,
    };
    state + 4 * items + 96 + 32
}

/// Events a history seen in full before computes again when it comes back: SASRec does not
/// carry the answer slot's output.
fn repeat_cost(kind: ModelKind) -> u64 {
    u64::from(kind == ModelKind::Sasrec)
}

fn engines(kind: ModelKind, dir: &std::path::Path, budget: usize) -> (Engine, Engine) {
    let plain = convert_fixture(kind, "model.safetensors", &dir.join("plain"));
    let mut cached = convert_fixture(kind, "model.safetensors", &dir.join("cached"));
    cached
        .set_prefix_cache(Some(PrefixCache::new(budget, None)))
        .unwrap();
    (plain, cached)
}

fn top100(engine: &Engine, histories: &[&[u32]]) -> Vec<Vec<(u32, u32)>> {
    let options = ServeOptions {
        default_k: 100,
        ..ServeOptions::default()
    };
    let external: Vec<Vec<i64>> = histories
        .iter()
        .map(|h| {
            h.iter()
                .map(|&i| engine.external_id(i).unwrap().to_string().parse().unwrap())
                .collect()
        })
        .collect();
    let requests: Vec<Request<'_>> = external
        .iter()
        .map(|h| Request {
            history: ExternalIds::Int(h),
            k: None,
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: None,
        })
        .collect();
    engine
        .recommend(&requests, &options)
        .into_iter()
        .map(|r| {
            r.unwrap()
                .items
                .iter()
                .map(|s| (s.index, s.score.to_bits()))
                .collect()
        })
        .collect()
}

fn same_hidden(plain: &Engine, cached: &Engine, histories: &[&[u32]], what: &str) {
    let (a, _) = plain.encode(histories);
    let (b, _) = cached.encode(histories);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b), "{what}: hidden vectors differ");
}

#[test]
fn replaying_users_event_by_event_changes_no_bit() {
    for kind in CAUSAL {
        let dir = tempfile::tempdir().unwrap();
        let (plain, cached) = engines(kind, dir.path(), 64 << 20);
        let users = test_users(&plain, 12);
        let mut expected_computed = 0u64;
        let mut expected_reused = 0u64;
        for (u, history) in users.iter().enumerate() {
            for t in 1..=history.len() {
                let prefix = &history[..t];
                assert_eq!(
                    top100(&plain, &[prefix]),
                    top100(&cached, &[prefix]),
                    "{kind} user {u} event {t}"
                );
                // Within the window one new event is computed and the rest reused; past it the
                // window slides and the whole window is recomputed.
                if t <= WINDOW {
                    expected_computed += 1;
                    expected_reused += (t - 1) as u64;
                } else {
                    expected_computed += WINDOW as u64;
                }
            }
            // The whole history once more: all of it reused within the window (SASRec computes
            // its last event again), all recomputed past it.
            same_hidden(&plain, &cached, &[history], &format!("{kind} user {u}"));
            if history.len() <= WINDOW {
                expected_reused += history.len() as u64;
                expected_computed += repeat_cost(kind);
            } else {
                expected_computed += WINDOW as u64;
            }
        }
        let stats = cached.prefix_cache().unwrap().stats();
        assert_eq!(
            (stats.events_computed, stats.events_reused, stats.evictions),
            (expected_computed, expected_reused, 0),
            "{kind}: {stats:?}"
        );
        assert!(stats.hits > 0, "{kind}: {stats:?}");
    }
}

#[test]
fn every_precision_kernel_path_and_thread_count_resumes_bit_for_bit() {
    // fp16, bf16, int8 weight-only and W8A8 engines on every kernel path this CPU has, on one
    // thread and on two (dense rows and attention heads split): each row is computed by the same
    // kernels in the same order whichever rows run beside it, so the cached pass keeps every bit.
    for kind in CAUSAL {
        let dir = tempfile::tempdir().unwrap();
        let plain_engines = engines_at_every_precision(kind, &dir.path().join("plain"));
        let cached_engines = engines_at_every_precision(kind, &dir.path().join("cached"));
        for ((variant, mut plain), (_, mut cached)) in plain_engines.into_iter().zip(cached_engines)
        {
            let users = test_users(&plain, 3);
            for isa in Isa::available() {
                for threads in [1, 2] {
                    for engine in [&mut plain, &mut cached] {
                        engine.set_kernels(KernelTable::for_isa(isa));
                        engine.set_threads(threads);
                    }
                    cached
                        .set_prefix_cache(Some(PrefixCache::new(64 << 20, None)))
                        .unwrap();
                    for (u, history) in users.iter().enumerate() {
                        for t in 1..=history.len().min(WINDOW + 2) {
                            let prefix = &history[..t];
                            same_hidden(
                                &plain,
                                &cached,
                                &[prefix],
                                &format!(
                                    "{kind} {variant} {isa:?} threads {threads} user {u} event {t}"
                                ),
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_golden_histories_answer_as_without_the_cache() {
    for kind in CAUSAL {
        let dir = tempfile::tempdir().unwrap();
        let (plain, cached) = engines(kind, dir.path(), 64 << 20);
        let text = std::fs::read_to_string(model_dir(kind).join("golden.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        for case in json["cases"].as_array().unwrap() {
            let raw = i64s(&case["history_ext"]);
            let history = plain.ids.map(ExternalIds::Int(&raw)).indices;
            for t in 1..=history.len() {
                let prefix = &history[..t];
                assert_eq!(
                    top100(&plain, &[prefix]),
                    top100(&cached, &[prefix]),
                    "{kind} golden case {} event {t}",
                    case["case"]
                );
            }
        }
    }
}

#[test]
fn a_budget_smaller_than_the_working_set_evicts_and_changes_nothing() {
    for kind in CAUSAL {
        let dir = tempfile::tempdir().unwrap();
        // Room for about three users' states at the window's length.
        let budget = 3 * entry_bytes(kind, WINDOW);
        let (plain, cached) = engines(kind, dir.path(), budget);
        let users = test_users(&plain, 10);
        let longest = users.iter().map(Vec::len).max().unwrap();
        // Round robin: every user's next event after all the others', so most states are evicted
        // before their user comes back.
        for t in 1..=longest.min(60) {
            let batch: Vec<&[u32]> = users
                .iter()
                .filter(|h| h.len() >= t)
                .map(|h| &h[..t])
                .collect();
            assert_eq!(
                top100(&plain, &batch),
                top100(&cached, &batch),
                "{kind} event {t}"
            );
            let stats = cached.prefix_cache().unwrap().stats();
            assert!(
                stats.bytes as usize <= budget,
                "{kind} over budget: {stats:?}"
            );
        }
        let stats = cached.prefix_cache().unwrap().stats();
        assert!(stats.evictions > 0, "{kind}: {stats:?}");
    }
}

#[test]
fn a_batch_mixes_cached_evicted_new_empty_and_over_long_histories() {
    for kind in CAUSAL {
        let dir = tempfile::tempdir().unwrap();
        // Room for two entries of five items.
        let (plain, cached) = engines(kind, dir.path(), 2 * entry_bytes(kind, 5) + 8);
        let users = test_users(&plain, 6);
        let long = users
            .iter()
            .find(|h| h.len() > 60)
            .expect("a user past the window")
            .clone();
        let (a, b, c) = (&users[0], &users[1], &users[2]);
        // a is cached at 5 events; b was cached then evicted by c and d.
        top100(&cached, &[&a[..5]]);
        top100(&cached, &[&b[..5]]);
        top100(&cached, &[&c[..5]]);
        top100(&cached, &[&users[3][..5]]);
        let stats = cached.prefix_cache().unwrap().stats();
        assert_eq!(stats.evictions, 2, "{kind}: {stats:?}");
        let batch: Vec<&[u32]> = vec![
            &a[..8],
            &b[..6],
            &users[4][..7],
            &[],
            &long,
            &a[..5],
            &c[..5],
        ];
        same_hidden(&plain, &cached, &batch, &format!("{kind} mixed batch"));
        assert_eq!(top100(&plain, &batch[..3]), top100(&cached, &batch[..3]));
        assert_eq!(top100(&plain, &batch[4..]), top100(&cached, &batch[4..]));
    }
}

#[test]
fn models_that_cannot_carry_a_state_refuse_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    for (kind, why) in [
        (ModelKind::Bert4rec, "bidirectional"),
        (ModelKind::Vaecf, "set"),
    ] {
        let mut engine = convert_fixture(
            kind,
            "model.safetensors",
            &dir.path().join(kind.to_string()),
        );
        let err = engine
            .set_prefix_cache(Some(PrefixCache::new(1 << 20, None)))
            .unwrap_err()
            .to_string();
        assert!(err.contains(why), "{kind}: {err}");
        assert!(engine.prefix_cache().is_none());
    }
}
