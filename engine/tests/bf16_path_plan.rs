//! The bf16 kernel plan changes time, never answers: on a CPU with AVX512-BF16 a bf16 engine
//! pinned to `vdpbf16ps` and pinned to the widened path gives the same items and score bits at
//! every batch size; the measured plan times both on whole calls, keeps the faster, and is read
//! from its file on the next load; engines that are not bf16, and CPUs without AVX512-BF16, have
//! nothing to choose.

mod common;

use common::*;
use recsys_engine::kernels::Isa;
use recsys_engine::plan::{Bf16Path, PlanSource};
use recsys_engine::{Engine, InternalRequest, ModelKind};

fn answers(engine: &Engine, batch: usize) -> Vec<Vec<(u32, u32)>> {
    let n = engine.n_items() as u32;
    let requests: Vec<InternalRequest> = (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..9).map(|j| (b * 53 + j * 97) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect();
    ranked_bits(engine, &requests)
}

#[test]
fn the_bf16_path_is_planned_by_measurement_and_never_changes_an_answer() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
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
        assert!(plan.native && plan.source == PlanSource::Pinned("native".into()));
        assert_eq!(native.scorer.kernels.isa, Isa::Avx512Bf16);
        let mut widened = convert_fixture_at(kind, "model.safetensors", &at("b"), Precision::Bf16);
        assert!(!widened.plan_bf16_path(Bf16Path::Widened).unwrap().native);
        assert_eq!(widened.scorer.kernels.isa, Isa::Avx512);
        for batch in [1, 8, 64] {
            assert_eq!(
                answers(&native, batch),
                answers(&widened, batch),
                "{kind} batch {batch}: the two paths must give the same bits"
            );
        }

        // Measured once, then read from its file by the next engine of the same weights.
        let mut first = convert_fixture_at(kind, "model.safetensors", &at("c"), Precision::Bf16);
        let plan = first.plan_bf16_path(Bf16Path::Auto).unwrap().clone();
        let PlanSource::Measured {
            path: Some(path),
            ignored: None,
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
        let expected = if plan.native {
            Isa::Avx512Bf16
        } else {
            Isa::Avx512
        };
        assert_eq!(first.scorer.kernels.isa, expected);
        assert_eq!(answers(&first, 8), answers(&native, 8));
        eprintln!("{kind}: {}", plan.describe());
        let mut again = convert_fixture_at(kind, "model.safetensors", &at("c2"), Precision::Bf16);
        let cached = again.plan_bf16_path(Bf16Path::Auto).unwrap();
        assert_eq!(cached.source, PlanSource::Cached(path.clone()));
        assert_eq!(
            (cached.native, &cached.timings),
            (plan.native, &plan.timings)
        );
        // Planning again after a widened choice starts from the native path's key.
        assert!(again.plan_bf16_path(Bf16Path::Native).unwrap().native);
        assert_eq!(again.scorer.kernels.isa, Isa::Avx512Bf16);
    }
    std::env::remove_var("RECSYS_PLAN_DIR");
}
