//! The bf16 kernel plan changes time, never answers: on a CPU with AVX512-BF16 a bf16 engine
//! pinned to `vdpbf16ps`, pinned to the widened path, and planned per batch size (native for
//! some batch sizes, widened for others) gives the same items and score bits at every batch
//! size; each call runs the table its batch size was given; the measured plan times both on
//! whole calls and is read from its file on the next load; engines that are not bf16, and CPUs
//! without AVX512-BF16, have nothing to choose.

mod common;

use common::*;
use recsys_engine::kernels::Isa;
use recsys_engine::plan::{self, Bf16Path, PlanSource, Timing};
use recsys_engine::{Engine, InternalRequest, ModelKind};

/// Top-20 of `batch` histories of 9 items, every third row ranking 40 candidates instead of the
/// whole catalogue (the candidate path runs the call's kernels too).
fn answers(engine: &Engine, batch: usize) -> Vec<Vec<(u32, u32)>> {
    let n = engine.n_items() as u32;
    let requests: Vec<InternalRequest> = (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..9).map(|j| (b * 53 + j * 97) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            candidates: (b % 3 == 2).then(|| {
                let mut c: Vec<u32> = (0..40).map(|j| (b * 31 + j * 7) % n + 1).collect();
                c.sort_unstable();
                c.dedup();
                c
            }),
            ..Default::default()
        })
        .collect();
    ranked_bits(engine, &requests)
}

const BATCHES: [usize; 5] = [1, 7, 8, 19, 64];

#[test]
fn the_bf16_path_is_planned_per_batch_size_and_never_changes_an_answer() {
    let dir = tempfile::tempdir().unwrap();
    let plans = dir.path().join("plans");
    std::env::set_var("RECSYS_PLAN_DIR", &plans);
    // Kept whatever else runs beside the tests (CI builds the Python environment meanwhile).
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    let has_bf16 = Isa::available().contains(&Isa::Avx512Bf16);
    for kind in [ModelKind::Vaecf, ModelKind::Sasrec] {
        let at = |name: &str| dir.path().join(format!("{kind}-{name}"));
        let mut fp32 = convert_fixture_at(kind, "model.safetensors", &at("fp32"), Precision::Fp32);
        assert!(
            fp32.plan_bf16_path(Bf16Path::Auto).is_none(),
            "{kind}: an fp32 engine has no bf16 path to choose"
        );
        let mut native = convert_fixture_at(kind, "model.safetensors", &at("a"), Precision::Bf16);
        if !has_bf16 {
            assert!(native.plan_bf16_path(Bf16Path::Auto).is_none());
            eprintln!("this CPU has no AVX512-BF16: only the refusal was checked");
            continue;
        }
        let plan = native.plan_bf16_path(Bf16Path::Native).unwrap();
        assert!(plan.by_batch == [(1, true)] && plan.source == PlanSource::Pinned("native".into()));
        let mut widened = convert_fixture_at(kind, "model.safetensors", &at("b"), Precision::Bf16);
        assert_eq!(
            widened.plan_bf16_path(Bf16Path::Widened).unwrap().by_batch,
            [(1, false)]
        );
        // The engine's kernels stay the native table (the plans' key); calls pick theirs.
        assert_eq!(widened.scorer.kernels.isa, Isa::Avx512Bf16);
        for batch in BATCHES {
            assert_eq!(native.kernels_for(batch).isa, Isa::Avx512Bf16);
            assert_eq!(widened.kernels_for(batch).isa, Isa::Avx512);
            assert_eq!(
                answers(&native, batch),
                answers(&widened, batch),
                "{kind} batch {batch}: the two paths must give the same bits"
            );
        }

        // A plan that runs native below 8 histories and widened from 8 (written as this CPU's
        // cached plan for the engine): each call runs its batch size's table, same bits.
        let mut mixed = convert_fixture_at(kind, "model.safetensors", &at("m"), Precision::Bf16);
        let timing = |batch, native_ms: f64, widened_ms: f64| Timing {
            batch,
            candidate_s: native_ms / 1e3,
            fallback_s: widened_ms / 1e3,
        };
        let key = mixed.plan_key("bf16-path");
        let path = plan::write_cached(
            &plans,
            &key,
            &[
                timing(1, 0.1, 0.2),
                timing(8, 0.9, 0.8),
                timing(64, 6.0, 5.0),
            ],
        )
        .unwrap();
        let plan = mixed.plan_bf16_path(Bf16Path::Auto).unwrap().clone();
        assert_eq!(plan.source, PlanSource::Cached(path.clone()));
        assert_eq!(plan.by_batch, [(1, true), (8, false), (64, false)]);
        for batch in BATCHES {
            let expected = if batch < 8 {
                Isa::Avx512Bf16
            } else {
                Isa::Avx512
            };
            assert_eq!(
                mixed.kernels_for(batch).isa,
                expected,
                "{kind} batch {batch}"
            );
            assert_eq!(
                answers(&mixed, batch),
                answers(&native, batch),
                "{kind} batch {batch}: a mixed plan must give the native path's bits"
            );
        }
        // The forced kernels of a test or bench run every call: the plan is dropped with them.
        mixed.set_kernels(recsys_engine::kernels::KernelTable::for_isa(
            Isa::Avx512Bf16,
        ));
        assert!(mixed.bf16_path_plan().is_none());
        assert_eq!(mixed.kernels_for(64).isa, Isa::Avx512Bf16);
        std::fs::remove_file(&path).unwrap();

        // Measured once, then read from its file by the next engine of the same weights.
        let mut first = convert_fixture_at(kind, "model.safetensors", &at("c"), Precision::Bf16);
        let plan = first.plan_bf16_path(Bf16Path::Auto).unwrap().clone();
        let PlanSource::Measured {
            path: Some(path),
            ignored: None,
            not_kept: None,
        } = &plan.source
        else {
            panic!("{kind}: a first plan is measured and kept: {plan:?}");
        };
        assert!(path.exists(), "{}", path.display());
        assert_eq!(plan.timings.len(), 3);
        assert!(plan
            .timings
            .iter()
            .all(|t| t.candidate_s > 0.0 && t.fallback_s > 0.0));
        for batch in BATCHES {
            let expected = if plan.native_for(batch) {
                Isa::Avx512Bf16
            } else {
                Isa::Avx512
            };
            assert_eq!(first.kernels_for(batch).isa, expected);
        }
        assert_eq!(answers(&first, 8), answers(&native, 8));
        eprintln!("{kind}: {}", plan.describe());
        let mut again = convert_fixture_at(kind, "model.safetensors", &at("c2"), Precision::Bf16);
        let cached = again.plan_bf16_path(Bf16Path::Auto).unwrap();
        assert_eq!(cached.source, PlanSource::Cached(path.clone()));
        assert_eq!(
            (&cached.by_batch, &cached.timings),
            (&plan.by_batch, &plan.timings)
        );
        // Pinning after a plan replaces it.
        assert_eq!(
            again.plan_bf16_path(Bf16Path::Native).unwrap().by_batch,
            [(1, true)]
        );
        assert_eq!(again.kernels_for(64).isa, Isa::Avx512Bf16);
    }
    std::env::remove_var("RECSYS_PLAN_DIR");
    std::env::remove_var("RECSYS_PLAN_BUSY_CORES");
}
