//! The thread plan changes time, never answers: an engine pinned to one thread, to two and to all
//! of its threads gives the same items and score bits at every batch size, for every model kind
//! (whole-catalogue rows and candidate rows alike); the measured plan times every candidate count
//! at every plan batch size (and, for a sequential model, batch 1 on a history as long as it
//! reads, whose decision calls of long histories take), is kept and read back on the next load,
//! and a damaged file is ignored with the reason; an engine of one thread has nothing to plan, `RECSYS_PLAN=off` gives
//! every batch all the threads, and a new thread count drops the plan made for the old one.

mod common;

use common::*;
use recsys_engine::plan::{thread_candidates, PlanSource, ThreadPolicy, PLAN_BATCHES};
use recsys_engine::{Engine, InternalRequest, ModelKind};

fn answers(engine: &Engine, batch: usize) -> Vec<Vec<(u32, u32)>> {
    let n = engine.n_items() as u32;
    let requests: Vec<InternalRequest> = (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..(3 + b % 11))
                .map(|j| (b * 61 + j * 89) % n + 1)
                .collect(),
            k: 20,
            exclude_seen: true,
            // Every fourth row ranks a candidate list instead of the whole catalogue.
            candidates: (b % 4 == 3).then(|| (1..=40).map(|i| (i * 7 + b) % n + 1).collect()),
            ..Default::default()
        })
        .collect();
    ranked_bits(engine, &requests)
}

#[test]
fn every_thread_count_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    for kind in [
        ModelKind::Vaecf,
        ModelKind::Bert4rec,
        ModelKind::Sasrec,
        ModelKind::Gru4rec,
    ] {
        let mut engine = convert_fixture(
            kind,
            "model.safetensors",
            &dir.path().join(kind.to_string()),
        );
        engine.set_threads(4);
        for batch in [1, 3, 8, 64] {
            let plan = engine.plan_threads(ThreadPolicy::All).unwrap();
            assert_eq!(plan.threads_for(batch), 4);
            assert_eq!(plan.source, PlanSource::Pinned("all".into()));
            let on_all = answers(&engine, batch);
            for threads in [1, 2] {
                let plan = engine.plan_threads(ThreadPolicy::Fixed(threads)).unwrap();
                assert_eq!(plan.threads_for(batch), threads);
                assert_eq!(engine.call_threads(batch), threads);
                assert_eq!(
                    answers(&engine, batch),
                    on_all,
                    "{kind}, batch {batch}, {threads} thread(s) against 4"
                );
            }
        }
        // A count above the engine's is held to the engine's.
        engine.plan_threads(ThreadPolicy::Fixed(16)).unwrap();
        assert_eq!(engine.call_threads(64), 4);
    }
}

/// One test for everything the environment steers (tests run in parallel in one process).
#[test]
fn the_plan_is_measured_kept_read_back_and_dropped_with_its_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let plans = dir.path().join("plans");
    std::env::set_var("RECSYS_PLAN_DIR", &plans);
    // Kept whatever else runs beside the tests (CI builds the Python environment meanwhile).
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    std::env::remove_var("RECSYS_PLAN");
    let load = |name: &str, threads: usize| {
        let mut engine = convert_fixture(
            ModelKind::Vaecf,
            "model.safetensors",
            &dir.path().join(name),
        );
        engine.set_threads(threads);
        engine
    };
    let mut first = load("a", 2);
    let plan = first.plan_threads(ThreadPolicy::Auto).unwrap().clone();
    let PlanSource::Measured {
        path: Some(path),
        ignored: None,
        not_kept: None,
    } = &plan.source
    else {
        panic!("measured and kept: {plan:?}");
    };
    // Every candidate count at every plan batch size, each timed.
    assert_eq!(
        plan.timings.len(),
        PLAN_BATCHES.len() * thread_candidates(2).len()
    );
    assert!(plan.timings.iter().all(|t| t.seconds > 0.0));
    assert_eq!(
        plan.by_batch.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        PLAN_BATCHES
    );
    assert!(plan.by_batch.iter().all(|(_, t)| (1..=2).contains(t)));
    assert!(plan.describe().contains("ms on 2"), "{}", plan.describe());
    // Loaded again: read, not measured, the same choices.
    let mut again = load("b", 2);
    let cached = again.plan_threads(ThreadPolicy::Auto).unwrap();
    assert_eq!(cached.source, PlanSource::Cached(path.clone()));
    assert_eq!(cached.by_batch, plan.by_batch);
    // A new thread count drops the plan made for the old one.
    again.set_threads(3);
    assert!(again.thread_plan().is_none());
    assert_eq!(again.call_threads(1), 3);
    // A damaged file: ignored with the reason, measured again.
    std::fs::write(path, b"{\"format\": 2, \"timings\": [").unwrap();
    let mut damaged = load("c", 2);
    let plan = damaged.plan_threads(ThreadPolicy::Auto).unwrap();
    assert!(
        matches!(&plan.source, PlanSource::Measured { ignored: Some(why), .. } if why.contains("not a plan file")),
        "{plan:?}"
    );
    // Mult-VAE's work does not grow with its histories: no long-history sample.
    assert_eq!(plan.long_histories, None);
    // A sequential model reading more than twice the plan's median history also times batch 1
    // on a history as long as it reads, and calls of long histories take that count.
    let mut bert = convert_fixture(
        ModelKind::Bert4rec,
        "model.safetensors",
        &dir.path().join("bert"),
    );
    bert.set_threads(2);
    let plan = bert.plan_threads(ThreadPolicy::Auto).unwrap().clone();
    let window = 49; // the fixture's L = 50, less the [MASK] that follows the history
    let long_samples: Vec<_> = plan.timings.iter().filter(|t| t.events > 0).collect();
    assert_eq!(long_samples.len(), thread_candidates(2).len(), "{plan:?}");
    assert!(long_samples
        .iter()
        .all(|t| t.batch == 1 && t.events == window && t.seconds > 0.0));
    let long = plan.long_histories.expect("a long-history decision");
    assert_eq!((long.sample_events, long.from_events), (window, 34)); // sqrt(23 * 49) = 33.6
    assert!(long.threads >= plan.threads_for(1));
    assert!(plan.describe().contains("events"), "{}", plan.describe());
    let short_history: Vec<u32> = (1..=10).collect();
    let long_history: Vec<u32> = (1..=300).collect();
    assert_eq!(
        bert.call_threads_for(&[&short_history]),
        plan.threads_for(1)
    );
    assert_eq!(bert.call_threads_for(&[&long_history]), long.threads);
    assert_eq!(
        bert.call_threads_for(&[long_history.as_slice(); 8]),
        plan.threads_for(8),
        "from the second plan batch size on, by batch size"
    );
    // A SASRec with a prefix cache computes only a history's new events: by batch size.
    let mut sasrec = convert_fixture(
        ModelKind::Sasrec,
        "model.safetensors",
        &dir.path().join("sasrec"),
    );
    sasrec.set_threads(2);
    let sasrec_plan = sasrec.plan_threads(ThreadPolicy::Auto).unwrap().clone();
    assert!(sasrec_plan.long_histories.is_some(), "{sasrec_plan:?}");
    sasrec
        .set_prefix_cache(Some(recsys_engine::prefix_cache::PrefixCache::new(
            1 << 20,
            None,
        )))
        .unwrap();
    assert_eq!(
        sasrec.call_threads_for(&[&long_history]),
        sasrec_plan.threads_for(1)
    );
    // Read back with its long-history decision.
    let mut bert_again = convert_fixture(
        ModelKind::Bert4rec,
        "model.safetensors",
        &dir.path().join("bert_again"),
    );
    bert_again.set_threads(2);
    let cached = bert_again.plan_threads(ThreadPolicy::Auto).unwrap();
    assert!(matches!(cached.source, PlanSource::Cached(_)), "{cached:?}");
    assert_eq!(cached.long_histories, Some(long));
    // One thread: nothing to choose.
    assert!(load("d", 1).plan_threads(ThreadPolicy::Auto).is_none());
    // RECSYS_PLAN=off: nothing measured, every batch gets all the threads.
    std::env::set_var("RECSYS_PLAN", "off");
    let mut skipped = load("e", 2);
    let plan = skipped.plan_threads(ThreadPolicy::Auto).unwrap();
    assert_eq!(plan.source, PlanSource::Skipped);
    assert_eq!((plan.threads_for(1), plan.threads_for(64)), (2, 2));
    std::env::remove_var("RECSYS_PLAN");
    // Measured while another process spins on a core: used, not kept, and the next load measures
    // again (the counters only exist on Linux).
    if recsys_engine::plan_load::CpuTicks::now().is_some() {
        std::env::set_var(
            "RECSYS_PLAN_BUSY_CORES",
            recsys_engine::plan_load::BUSY_CORES.to_string(),
        );
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs");
        // Three threads: a key no plan above was kept under.
        let mut busy = load("f", 3);
        let plan = busy.plan_threads(ThreadPolicy::Auto).unwrap().clone();
        spinner.kill().unwrap();
        spinner.wait().unwrap();
        let PlanSource::Measured {
            path: None,
            not_kept: Some(why),
            ..
        } = &plan.source
        else {
            panic!("measured beside a spinning process, not kept: {plan:?}");
        };
        assert!(why.contains("other processes took"), "{why}");
        assert!(plan.describe().contains("not kept"), "{}", plan.describe());
        let key = busy.plan_key("threads");
        assert!(
            recsys_engine::plan::read_cached::<recsys_engine::plan::ThreadTiming>(&plans, &key)
                .unwrap()
                .is_none(),
            "no file for these weights at three threads"
        );
    }
    std::env::remove_var("RECSYS_PLAN_DIR");
    std::env::remove_var("RECSYS_PLAN_BUSY_CORES");
}
