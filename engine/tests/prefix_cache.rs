//! The prefix cache never changes an answer: the fixture's test users replayed event by event
//! through a GRU4Rec engine with the cache and one without give the same hidden vectors, bit for
//! bit, and the same top-100 with the same scores; so do the RecBole golden histories (whose
//! final answers `sequential_parity.rs` checks against RecBole); a budget smaller than the
//! working set evicts and still changes nothing; a batch mixing cached, evicted, new, empty and
//! over-long histories answers each as the uncached engine does.

mod common;

use common::*;
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

fn engines(dir: &std::path::Path, budget: usize) -> (Engine, Engine) {
    let plain = convert_fixture(ModelKind::Gru4rec, "model.safetensors", &dir.join("plain"));
    let mut cached = convert_fixture(ModelKind::Gru4rec, "model.safetensors", &dir.join("cached"));
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
    let dir = tempfile::tempdir().unwrap();
    let (plain, cached) = engines(dir.path(), 64 << 20);
    let window = 50;
    let users = test_users(&plain, 12);
    let mut expected_computed = 0u64;
    let mut expected_reused = 0u64;
    for (u, history) in users.iter().enumerate() {
        for t in 1..=history.len() {
            let prefix = &history[..t];
            assert_eq!(
                top100(&plain, &[prefix]),
                top100(&cached, &[prefix]),
                "user {u} event {t}"
            );
            // Within the window one new event is computed and the rest reused; past it the
            // window slides and the whole window is recomputed.
            if t <= window {
                expected_computed += 1;
                expected_reused += (t - 1) as u64;
            } else {
                expected_computed += window as u64;
            }
        }
        // The whole history once more: all of it reused within the window, all recomputed past it.
        same_hidden(&plain, &cached, &[history], &format!("user {u}"));
        if history.len() <= window {
            expected_reused += history.len() as u64;
        } else {
            expected_computed += window as u64;
        }
    }
    let stats = cached.prefix_cache().unwrap().stats();
    assert_eq!(
        (stats.events_computed, stats.events_reused, stats.evictions),
        (expected_computed, expected_reused, 0),
        "{stats:?}"
    );
    assert!(stats.hits > 0, "{stats:?}");
}

#[test]
fn the_golden_histories_answer_as_without_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, cached) = engines(dir.path(), 64 << 20);
    let text = std::fs::read_to_string(model_dir(ModelKind::Gru4rec).join("golden.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for case in json["cases"].as_array().unwrap() {
        let raw = i64s(&case["history_ext"]);
        let history = plain.ids.map(ExternalIds::Int(&raw)).indices;
        for t in 1..=history.len() {
            let prefix = &history[..t];
            assert_eq!(
                top100(&plain, &[prefix]),
                top100(&cached, &[prefix]),
                "golden case {} event {t}",
                case["case"]
            );
        }
    }
}

#[test]
fn a_budget_smaller_than_the_working_set_evicts_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Room for about three users' states (two 64-wide layers, up to 50 items each).
    let one = 4 * (2 * 64) + 4 * 50 + 96;
    let (plain, cached) = engines(dir.path(), 3 * one);
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
        assert_eq!(top100(&plain, &batch), top100(&cached, &batch), "event {t}");
        let stats = cached.prefix_cache().unwrap().stats();
        assert!(stats.bytes as usize <= 3 * one, "over budget: {stats:?}");
    }
    let stats = cached.prefix_cache().unwrap().stats();
    assert!(stats.evictions > 0, "{stats:?}");
}

#[test]
fn a_batch_mixes_cached_evicted_new_empty_and_over_long_histories() {
    let dir = tempfile::tempdir().unwrap();
    let one = 4 * (2 * 64) + 4 * 50 + 96;
    let (plain, cached) = engines(dir.path(), 2 * one);
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
    let batch: Vec<&[u32]> = vec![
        &a[..8],
        &b[..6],
        &users[4][..7],
        &[],
        &long,
        &a[..5],
        &c[..5],
    ];
    same_hidden(&plain, &cached, &batch, "mixed batch");
    assert_eq!(top100(&plain, &batch[..3]), top100(&cached, &batch[..3]));
    assert_eq!(top100(&plain, &batch[4..]), top100(&cached, &batch[4..]));
}

#[test]
fn models_that_cannot_carry_a_state_refuse_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    for (kind, why) in [
        (ModelKind::Bert4rec, "bidirectional"),
        (ModelKind::Vaecf, "set"),
        (ModelKind::Sasrec, "not built yet"),
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
