//! The screen plan changes time, never answers: a screened engine pinned to its screen and pinned
//! to its plain scan gives the same items and the same score bits at every batch size; a plan is
//! measured once per CPU, engine and thread count and then read from its file; a file made on
//! another CPU, or damaged, is ignored with the reason and measured again; `RECSYS_PLAN=off`
//! measures nothing.

mod common;

use common::*;
use recsys_engine::engine_dir::Screen;
use recsys_engine::plan::{PlanSource, ScreenPolicy};
use recsys_engine::{Engine, InternalRequest, ModelKind};

fn screened(dir: &std::path::Path) -> Engine {
    convert_fixture_screened(ModelKind::Vaecf, dir, Precision::Fp32, Screen::Int8).unwrap()
}

fn answers(engine: &Engine, batch: usize) -> Vec<Vec<(u32, u32)>> {
    let n = engine.n_items() as u32;
    let requests: Vec<InternalRequest> = (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..6).map(|j| (b * 37 + j * 101) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect();
    ranked_bits(engine, &requests)
}

#[test]
fn pinned_to_the_screen_or_to_the_plain_scan_the_answers_are_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = screened(&dir.path().join("e"));
    for batch in [1, 3, 8, 64] {
        engine.plan_screen(ScreenPolicy::Always).unwrap();
        let through_screen = answers(&engine, batch);
        let plan = engine.plan_screen(ScreenPolicy::Never).unwrap();
        assert!(!plan.screen_for(batch));
        assert_eq!(answers(&engine, batch), through_screen, "batch {batch}");
    }
    // An engine without a screen has no plan to make.
    let mut plain = convert_fixture(ModelKind::Vaecf, "model.safetensors", &dir.path().join("p"));
    assert!(plain.plan_screen(ScreenPolicy::Auto).is_none());
}

/// One test for everything the environment steers (tests run in parallel in one process).
#[test]
fn plans_are_measured_once_kept_and_ignored_when_made_elsewhere_or_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let plans = dir.path().join("plans");
    std::env::set_var("RECSYS_PLAN_DIR", &plans);
    // Kept whatever else runs beside the tests (CI builds the Python environment meanwhile).
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    std::env::remove_var("RECSYS_PLAN");
    let mut first = screened(&dir.path().join("a"));
    let plan = first.plan_screen(ScreenPolicy::Auto).unwrap().clone();
    let PlanSource::Measured {
        path: Some(path),
        ignored: None,
        not_kept: None,
    } = &plan.source
    else {
        panic!("measured and kept: {plan:?}");
    };
    assert_eq!(plan.timings.len(), 3);
    assert!(plan
        .timings
        .iter()
        .all(|t| t.candidate_s > 0.0 && t.fallback_s > 0.0));
    // The same engine loaded again (same weights, CPU and threads): read, not measured.
    let mut again = screened(&dir.path().join("b"));
    let cached = again.plan_screen(ScreenPolicy::Auto).unwrap();
    assert_eq!(cached.source, PlanSource::Cached(path.clone()));
    assert_eq!(cached.by_batch, plan.by_batch);
    // Another thread count is another plan.
    again.set_threads(3);
    assert!(matches!(
        again.plan_screen(ScreenPolicy::Auto).unwrap().source,
        PlanSource::Measured { .. }
    ));
    // A file under this name made on another CPU: ignored, saying so, and measured again.
    let text = std::fs::read_to_string(path).unwrap();
    let cpu = recsys_engine::plan::cpu_model();
    std::fs::write(
        path,
        text.replace(&format!("\"{cpu}\""), "\"Some Other CPU\""),
    )
    .unwrap();
    let mut moved = screened(&dir.path().join("c"));
    let plan = moved.plan_screen(ScreenPolicy::Auto).unwrap();
    let PlanSource::Measured {
        ignored: Some(why), ..
    } = &plan.source
    else {
        panic!("a foreign plan must be ignored: {plan:?}");
    };
    assert!(why.contains("Some Other CPU"), "{why}");
    assert!(plan.describe().contains("ignored"), "{}", plan.describe());
    // A damaged file: ignored with the reason.
    std::fs::write(path, b"{\"format\": 1, \"cpu\": ").unwrap();
    let mut damaged = screened(&dir.path().join("d"));
    let plan = damaged.plan_screen(ScreenPolicy::Auto).unwrap();
    assert!(
        matches!(&plan.source, PlanSource::Measured { ignored: Some(why), .. } if why.contains("not a plan file")),
        "{plan:?}"
    );
    // RECSYS_PLAN=off: nothing measured, the screen always runs.
    std::env::set_var("RECSYS_PLAN", "off");
    let mut skipped = screened(&dir.path().join("e"));
    let plan = skipped.plan_screen(ScreenPolicy::Auto).unwrap();
    assert_eq!(plan.source, PlanSource::Skipped);
    assert!(plan.screen_for(1) && plan.screen_for(64));
    std::env::remove_var("RECSYS_PLAN");
    std::env::remove_var("RECSYS_PLAN_DIR");
    std::env::remove_var("RECSYS_PLAN_BUSY_CORES");
}
