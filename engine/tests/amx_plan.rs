//! The AMX plan of a bf16 engine's output layer: engines that are not bf16 and the `off` policy
//! have nothing to run on tiles; a CPU or process without AMX is refused with the reason and
//! keeps answering on the SIMD tables, bit for bit as before; where tiles run (an AMX Xeon), the
//! pinned plan runs them at every batch size, its answers hold the same items as the SIMD
//! tables' within the tiles' rounding, the measured plan is kept and read back, and a thread plan
//! timed with tiles is kept apart from one timed without.
//! (The tiles' own answers are checked against f64 in `kernels/tests/amx.rs`, on an emulated
//! Sapphire Rapids where the CPU has no AMX.)

mod common;

use common::*;
use recsys_engine::kernels::amx;
use recsys_engine::plan::{PlanSource, ThreadPolicy};
use recsys_engine::plan_amx::AmxPolicy;
use recsys_engine::{Engine, InternalRequest, ModelKind};

fn requests(engine: &Engine, batch: usize) -> Vec<InternalRequest> {
    let n = engine.n_items() as u32;
    (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..9).map(|j| (b * 53 + j * 97) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect()
}

#[test]
fn tiles_run_only_for_bf16_engines_where_the_cpu_has_them() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    let kind = ModelKind::Vaecf;
    let at = |name: &str| dir.path().join(name);
    let mut fp32 = convert_fixture_at(kind, "model.safetensors", &at("fp32"), Precision::Fp32);
    for policy in [AmxPolicy::Auto, AmxPolicy::On] {
        assert_eq!(
            fp32.plan_amx(policy),
            Ok(None),
            "an fp32 engine has no tiles"
        );
    }
    let mut bf16 = convert_fixture_at(kind, "model.safetensors", &at("bf16"), Precision::Bf16);
    let before: Vec<_> = [1, 8, 64]
        .iter()
        .map(|&b| ranked_bits(&bf16, &requests(&bf16, b)))
        .collect();
    assert_eq!(bf16.plan_amx(AmxPolicy::Off), Ok(None));
    assert!(bf16.amx_plan().is_none() && bf16.scorer.amx.is_none());
    match amx::availability() {
        Err(why) => {
            for policy in [AmxPolicy::Auto, AmxPolicy::On] {
                assert_eq!(bf16.plan_amx(policy), Err(why.clone()));
            }
            assert!(why.contains("no AMX") || why.contains("refused"), "{why}");
            assert!(bf16.amx_plan().is_none() && bf16.scorer.amx.is_none());
            for (i, &b) in [1, 8, 64].iter().enumerate() {
                assert_eq!(
                    ranked_bits(&bf16, &requests(&bf16, b)),
                    before[i],
                    "batch {b}"
                );
            }
            eprintln!("this CPU runs no AMX tiles ({why}): only the refusal was checked");
        }
        Ok(()) => {
            let plan = bf16.plan_amx(AmxPolicy::On).unwrap().unwrap();
            assert_eq!(plan.source, PlanSource::Pinned("on".into()));
            assert!(plan.tiles_for(1) && plan.tiles_for(64));
            for (i, &b) in [1, 8, 64].iter().enumerate() {
                let tiles = ranked_bits(&bf16, &requests(&bf16, b));
                for (row, (got, want)) in tiles.iter().zip(&before[i]).enumerate() {
                    // The same items but where bf16 sums within rounding of each other swap.
                    let same = got
                        .iter()
                        .filter(|g| want.iter().any(|w| w.0 == g.0))
                        .count();
                    assert!(same >= 18, "batch {b} row {row}: {same} of 20 items shared");
                    let score = |bits: u32| f32::from_bits(bits);
                    let (top_got, top_want) = (score(got[0].1), score(want[0].1));
                    assert!(
                        (top_got - top_want).abs() <= 1e-3 * top_want.abs().max(1.0),
                        "batch {b} row {row}: best {top_got} vs {top_want}"
                    );
                }
            }
            let measured = bf16.plan_amx(AmxPolicy::Auto).unwrap().unwrap().clone();
            assert!(
                matches!(measured.source, PlanSource::Measured { path: Some(_), .. }),
                "{measured:?}"
            );
            assert!(!measured.timings.is_empty());
            let again = bf16.plan_amx(AmxPolicy::Auto).unwrap().unwrap();
            assert!(matches!(again.source, PlanSource::Cached(_)), "{again:?}");
            assert_eq!(again.by_batch, measured.by_batch);
            // The thread plan timed with tiles is kept apart from the one timed without.
            bf16.set_threads(2);
            let plan_file = |engine: &mut Engine| {
                let plan = engine.plan_threads(ThreadPolicy::Auto).unwrap();
                match &plan.source {
                    PlanSource::Measured {
                        path: Some(path), ..
                    }
                    | PlanSource::Cached(path) => {
                        path.file_name().unwrap().to_string_lossy().into_owned()
                    }
                    other => panic!("a kept thread plan, not {other:?}"),
                }
            };
            bf16.plan_amx(AmxPolicy::On).unwrap();
            assert!(plan_file(&mut bf16).starts_with("threads-amx-"));
            bf16.plan_amx(AmxPolicy::Off).unwrap();
            let without = plan_file(&mut bf16);
            assert!(without.starts_with("threads-") && !without.starts_with("threads-amx"));
        }
    }
}
