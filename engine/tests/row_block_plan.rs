//! The row-block plan changes time, never answers: on AVX-512 kernels an engine pinned to row
//! groups of up to 8 rows and one pinned to up to 4 give the same items and score bits at batch
//! sizes that mix groups of 8, 4, 2 and 1 (every model kind, fp32, fp16 and bf16, 1 and 2
//! threads); the measured plan times both on whole calls, runs the faster and is read from its
//! file on the next load; a bf16 path chosen after it keeps its row block; kernels with one row
//! block (scalar, AVX2) have nothing to choose.

mod common;

use common::*;
use recsys_engine::kernels::{KernelTable, RowBlock};
use recsys_engine::plan::{Bf16Path, PlanSource, RowBlockPolicy};
use recsys_engine::{Engine, InternalRequest, ModelKind};

fn answers(engine: &Engine, batch: usize) -> Vec<Vec<(u32, u32)>> {
    let n = engine.n_items() as u32;
    let requests: Vec<InternalRequest> = (0..batch as u32)
        .map(|b| InternalRequest {
            history: (0..3 + b % 11).map(|j| (b * 53 + j * 97) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect();
    ranked_bits(engine, &requests)
}

#[test]
fn the_row_block_is_planned_by_measurement_and_never_changes_an_answer() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
    // Kept whatever else runs beside the tests (CI builds the Python environment meanwhile).
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    let kinds = [
        ModelKind::Vaecf,
        ModelKind::Bert4rec,
        ModelKind::Sasrec,
        ModelKind::Gru4rec,
    ];
    for kind in kinds {
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let at = |name: &str| dir.path().join(format!("{kind}-{precision:?}-{name}"));
            let mut four = convert_fixture_at(kind, "model.safetensors", &at("4"), precision);
            if !KernelTable::offers_row_blocks(four.scorer.kernels.isa) {
                assert!(four.plan_row_block(RowBlockPolicy::Auto).is_none());
                eprintln!("these kernels have one row block: only the refusal was checked");
                std::env::remove_var("RECSYS_PLAN_DIR");
                std::env::remove_var("RECSYS_PLAN_BUSY_CORES");
                return;
            }
            let plan = four
                .plan_row_block(RowBlockPolicy::Fixed(RowBlock::Four))
                .unwrap();
            assert_eq!(plan.source, PlanSource::Pinned("4".into()));
            assert_eq!(four.scorer.kernels.row_block(), RowBlock::Four);
            let mut eight = convert_fixture_at(kind, "model.safetensors", &at("8"), precision);
            eight.plan_row_block(RowBlockPolicy::Fixed(RowBlock::Eight));
            assert_eq!(eight.scorer.kernels.row_block(), RowBlock::Eight);
            for threads in [1, 2] {
                four.set_threads(threads);
                eight.set_threads(threads);
                for batch in [1, 7, 8, 19, 64] {
                    assert_eq!(
                        answers(&four, batch),
                        answers(&eight, batch),
                        "{kind} {precision:?} batch {batch}, {threads} threads"
                    );
                }
            }
        }

        // Measured once, then read from its file by the next engine of the same weights.
        let at = |name: &str| dir.path().join(format!("{kind}-auto-{name}"));
        let mut first = convert_fixture_at(kind, "model.safetensors", &at("a"), Precision::Fp32);
        let plan = first.plan_row_block(RowBlockPolicy::Auto).unwrap().clone();
        let PlanSource::Measured {
            path: Some(path),
            ignored: None,
            not_kept: None,
        } = &plan.source
        else {
            panic!("{kind}: a first plan is measured and kept: {plan:?}");
        };
        assert!(path.exists(), "{}", path.display());
        assert!(plan
            .timings
            .iter()
            .all(|t| t.candidate_s > 0.0 && t.fallback_s > 0.0));
        assert_eq!(first.scorer.kernels.row_block(), plan.block);
        eprintln!("{kind}: {}", plan.describe());
        let mut again = convert_fixture_at(kind, "model.safetensors", &at("b"), Precision::Fp32);
        let cached = again.plan_row_block(RowBlockPolicy::Auto).unwrap();
        assert_eq!(cached.source, PlanSource::Cached(path.clone()));
        assert_eq!((cached.block, &cached.timings), (plan.block, &plan.timings));
    }

    // A bf16 path chosen after the row block keeps it, whichever path it picks.
    let at = |name: &str| dir.path().join(format!("bf16-order-{name}"));
    for path in [Bf16Path::Native, Bf16Path::Widened] {
        let mut engine = convert_fixture_at(
            ModelKind::Vaecf,
            "model.safetensors",
            &at(&format!("{path:?}")),
            Precision::Bf16,
        );
        engine.plan_row_block(RowBlockPolicy::Fixed(RowBlock::Four));
        engine.plan_bf16_path(path);
        for batch in [1, 8, 64] {
            assert_eq!(
                engine.kernels_for(batch).row_block(),
                RowBlock::Four,
                "{path:?} batch {batch}"
            );
        }
    }
    std::env::remove_var("RECSYS_PLAN_DIR");
    std::env::remove_var("RECSYS_PLAN_BUSY_CORES");
}
