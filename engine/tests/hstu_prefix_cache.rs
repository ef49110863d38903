//! HSTU's prefix cache never changes an answer: the fixture's test users replayed event by event
//! (each prefix queried at the next event's time, as the official protocol does) through an
//! engine with the cache and one without give the same user embedding and the same top-100 with
//! the same scores, bit for bit, at every precision, kernel path and thread count; a new query
//! time or a changed past timestamp is never answered from a state computed under other times;
//! the golden cases and a batch mixing cached, new, over-long and re-timed histories answer as
//! without the cache; and the counters say two rows per new event are computed.

mod common;

use common::*;
use recsys_engine::engine_dir::Precision;
use recsys_engine::kernels::{Isa, KernelTable};
use recsys_engine::metrics::TestCase;
use recsys_engine::prefix_cache::PrefixCache;
use recsys_engine::{Engine, ExternalIds, ModelKind, Request, RequestTimes, ServeOptions};

/// The fixture's window (`max_sequence_length`).
const WINDOW: usize = 200;

fn test_cases() -> Vec<TestCase> {
    let path = recsys_engine::fixtures::model_dir(ModelKind::Hstu).join("test_set.tsv.gz");
    recsys_engine::metrics::read_test_set(&path).unwrap()
}

/// A history as the request names it: external ids and their timestamps.
#[derive(Clone)]
struct Timed {
    ids: Vec<i64>,
    times: Vec<i64>,
}

impl Timed {
    fn of(case: &TestCase) -> (Timed, i64) {
        let times = case
            .times
            .as_ref()
            .expect("the HSTU test file has timestamps");
        let timed = Timed {
            ids: case.history.iter().map(|id| id.parse().unwrap()).collect(),
            times: times.events.clone(),
        };
        (timed, times.target)
    }

    fn prefix(&self, t: usize) -> Timed {
        Timed {
            ids: self.ids[..t].to_vec(),
            times: self.times[..t].to_vec(),
        }
    }
}

/// The first `count` test users, and the longest one (past the window).
fn users(count: usize) -> Vec<(Timed, i64)> {
    let cases = test_cases();
    let mut chosen: Vec<(Timed, i64)> = cases.iter().take(count).map(Timed::of).collect();
    let longest = cases.iter().max_by_key(|c| c.history.len()).unwrap();
    assert!(longest.history.len() > WINDOW);
    chosen.push(Timed::of(longest));
    chosen
}

/// Each answer's user embedding and top-100 (index, score) as bits.
type Bits = (Vec<u32>, Vec<(u32, u32)>);

fn answers(engine: &Engine, requests: &[(&Timed, i64)]) -> Vec<Bits> {
    let options = ServeOptions {
        default_k: 100,
        exclude_seen: false,
        ..ServeOptions::default()
    };
    let requests: Vec<Request<'_>> = requests
        .iter()
        .map(|(h, query)| Request {
            history: ExternalIds::Int(&h.ids),
            k: None,
            exclude: None,
            candidates: None,
            embedding: true,
            filter: None,
            times: Some(RequestTimes {
                events: &h.times,
                query: Some(*query),
            }),
        })
        .collect();
    engine
        .recommend(&requests, &options)
        .into_iter()
        .map(|r| {
            let r = r.unwrap();
            (
                r.embedding.iter().map(|v| v.to_bits()).collect(),
                r.items
                    .iter()
                    .map(|s| (s.index, s.score.to_bits()))
                    .collect(),
            )
        })
        .collect()
}

fn engines(dir: &std::path::Path, precision: Precision) -> (Engine, Engine) {
    let plain = convert_fixture_at(
        ModelKind::Hstu,
        "model.safetensors",
        &dir.join("plain"),
        precision,
    );
    let mut cached = convert_fixture_at(
        ModelKind::Hstu,
        "model.safetensors",
        &dir.join("cached"),
        precision,
    );
    cached
        .set_prefix_cache(Some(PrefixCache::new(64 << 20, None)))
        .unwrap();
    (plain, cached)
}

/// The query time of a user's prefix of `t` events: the next event's time, or the target's after
/// the whole history (the official protocol's query time).
fn query_after(user: &(Timed, i64), t: usize) -> i64 {
    user.0.times.get(t).copied().unwrap_or(user.1)
}

#[test]
fn replaying_users_event_by_event_changes_no_bit_and_computes_two_rows_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, cached) = engines(dir.path(), Precision::Fp32);
    let (mut computed, mut reused, mut misses) = (0u64, 0u64, 0u64);
    for (u, user) in users(10).iter().enumerate() {
        let n = user.0.ids.len();
        for t in 1..=n {
            let prefix = user.0.prefix(t);
            let query = query_after(user, t);
            assert_eq!(
                answers(&plain, &[(&prefix, query)]),
                answers(&cached, &[(&prefix, query)]),
                "user {u} event {t}"
            );
            // Within the window the previous call left every row but its last two (the one
            // whose next event just arrived, and the new one) to compute again; past it the
            // window slides and every row is recomputed (and nothing is looked up).
            match t {
                1 | 2 => {
                    computed += t as u64;
                    misses += 1;
                }
                t if t <= WINDOW => {
                    computed += 2;
                    reused += (t - 2) as u64;
                }
                _ => computed += WINDOW as u64,
            }
        }
        // The whole history again at the same query time: all but its last row reused.
        let query = query_after(user, n);
        assert_eq!(
            answers(&plain, &[(&user.0, query)]),
            answers(&cached, &[(&user.0, query)]),
            "user {u} repeated"
        );
        if n <= WINDOW {
            computed += 1;
            reused += (n - 1) as u64;
        } else {
            computed += WINDOW as u64;
        }
    }
    let stats = cached.prefix_cache().unwrap().stats();
    assert_eq!(
        (
            stats.events_computed,
            stats.events_reused,
            stats.misses,
            stats.evictions
        ),
        (computed, reused, misses, 0),
        "{stats:?}"
    );
}

#[test]
fn a_new_query_time_or_a_changed_past_timestamp_is_never_answered_from_other_times() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, cached) = engines(dir.path(), Precision::Fp32);
    let user = users(1).remove(0);
    let history = &user.0;
    let n = history.ids.len();
    assert!(n >= 8, "the first test user has a history to change");
    let first = answers(&cached, &[(history, user.1)]);
    assert_eq!(first, answers(&plain, &[(history, user.1)]));

    // The same events asked about 10^9 seconds later: the last row's bias moves, so the answer
    // does (the test could fail), and it is the plain engine's.
    let later = user.1 + 1_000_000_000;
    let moved = answers(&cached, &[(history, later)]);
    assert_ne!(moved, first, "a later query time changes the answer");
    assert_eq!(moved, answers(&plain, &[(history, later)]));

    // The same items with one earlier event re-timed. The cache keeps a session's longest state
    // only, so the prefix ending before that event is asked first (it finds no state: the full
    // history's key is not a prefix of its key). Row `changed_at - 1` reads the re-timed event's
    // time as its next one, so the re-timed history resumes from the rows before it.
    let changed_at = n / 2;
    let head = history.prefix(changed_at);
    let head_query = history.times[changed_at];
    assert_eq!(
        answers(&cached, &[(&head, head_query)]),
        answers(&plain, &[(&head, head_query)])
    );
    let before = cached.prefix_cache().unwrap().stats();
    let mut retimed = history.clone();
    retimed.times[changed_at] -= 3 * 86_400;
    let answer = answers(&cached, &[(&retimed, user.1)]);
    assert_eq!(answer, answers(&plain, &[(&retimed, user.1)]));
    assert_ne!(answer, first, "a re-timed event changes the answer");
    let after = cached.prefix_cache().unwrap().stats();
    assert_eq!(
        (
            after.events_reused - before.events_reused,
            after.events_computed - before.events_computed
        ),
        ((changed_at - 1) as u64, (n - changed_at + 1) as u64),
        "{after:?}"
    );
}

#[test]
fn the_golden_cases_answer_as_without_the_cache_alone_and_in_a_mixed_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, cached) = engines(dir.path(), Precision::Fp32);
    let text = std::fs::read_to_string(
        recsys_engine::fixtures::model_dir(ModelKind::Hstu).join("golden.json"),
    )
    .unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<(Timed, i64)> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                Timed {
                    ids: i64s(&c["history_external"]),
                    times: i64s(&c["history_timestamps"]),
                },
                c["query_timestamp"].as_i64().unwrap(),
            )
        })
        .collect();
    let requests: Vec<(&Timed, i64)> = cases.iter().map(|(h, q)| (h, *q)).collect();
    // Twice one by one (the second time from the cache), then as one batch (all from the cache).
    let want = answers(&plain, &requests);
    for round in 0..2 {
        for (n, request) in requests.iter().enumerate() {
            assert_eq!(
                answers(&cached, &[*request]),
                vec![want[n].clone()],
                "round {round} case {n}"
            );
        }
    }
    assert_eq!(answers(&cached, &requests), want, "the golden batch");

    // A batch of a cached history one event longer, a new one, one past the window, the first
    // re-timed, and the first again at another time.
    let users = users(3);
    let (longer, new, over) = (&users[0], &users[1], &users[3]);
    let short = longer.0.prefix(longer.0.ids.len() - 1);
    answers(&cached, &[(&short, query_after(longer, short.ids.len()))]);
    let mut retimed = longer.0.clone();
    retimed.times[1] += 60;
    let batch = [
        (&longer.0, longer.1),
        (&new.0, new.1),
        (&over.0, over.1),
        (&retimed, longer.1),
        (&longer.0, longer.1 + 3_600),
    ];
    assert_eq!(answers(&cached, &batch), answers(&plain, &batch));
}

#[test]
fn every_precision_kernel_path_and_thread_count_resumes_bit_for_bit() {
    // fp16, bf16 and int8 weight-only engines on every kernel path this CPU has, on one thread
    // and on two (dense rows split): each row is computed by the same kernels in the same order
    // whichever rows run beside it and wherever its keys and values lie.
    let dir = tempfile::tempdir().unwrap();
    let users = users(2);
    for (name, precision) in [
        ("fp16", Precision::Fp16),
        ("bf16", Precision::Bf16),
        ("int8", Precision::Int8),
    ] {
        let (mut plain, mut cached) = engines(&dir.path().join(name), precision);
        for isa in Isa::available() {
            for threads in [1, 2] {
                for engine in [&mut plain, &mut cached] {
                    engine.set_kernels(KernelTable::for_isa(isa));
                    engine.set_threads(threads);
                }
                cached
                    .set_prefix_cache(Some(PrefixCache::new(64 << 20, None)))
                    .unwrap();
                for (u, user) in users.iter().take(2).enumerate() {
                    for t in 1..=user.0.ids.len().min(40) {
                        let prefix = user.0.prefix(t);
                        let query = query_after(user, t);
                        assert_eq!(
                            answers(&plain, &[(&prefix, query)]),
                            answers(&cached, &[(&prefix, query)]),
                            "{name} {isa:?} threads {threads} user {u} event {t}"
                        );
                    }
                }
            }
        }
    }
}
