//! The AMX plan of a bf16 engine's output layer and of a screened engine's int8 screen: other
//! engines and the `off` policy have nothing to run on tiles; a CPU or process without AMX is refused with the reason and
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

/// Where this CPU runs AMX tiles: a fresh plan directory, set for the engines the test loads
/// (plans timed as on an idle machine); elsewhere `None`, said on stderr.
fn tiles_and_plans_dir() -> Option<tempfile::TempDir> {
    if amx::availability().is_err() {
        eprintln!("this CPU runs no AMX tiles: nothing to check");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    Some(dir)
}

/// `rows` requests for the top 20 of histories of `length` distinct items, spread over the
/// catalogue, the history excluded.
fn long_histories(engine: &Engine, rows: u32, length: u32) -> Vec<InternalRequest> {
    let n = engine.n_items() as u32;
    (0..rows)
        .map(|b| InternalRequest {
            history: (0..length).map(|j| (b * 31 + j * 17) % n + 1).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect()
}

/// Answers on tiles against the SIMD tables' (items with their score bits): the same items but
/// where bf16 sums within rounding of each other swap (at least 18 of 20 shared), and each row's
/// best score within `relative` of the other's.
fn assert_same_within_rounding(
    tiles: &[Vec<(u32, u32)>],
    simd: &[Vec<(u32, u32)>],
    relative: f32,
    context: &str,
) {
    for (row, (got, want)) in tiles.iter().zip(simd).enumerate() {
        let same = got
            .iter()
            .filter(|g| want.iter().any(|w| w.0 == g.0))
            .count();
        assert!(same >= 18, "{context} row {row}: {same} of 20 items shared");
        let (top_got, top_want) = (f32::from_bits(got[0].1), f32::from_bits(want[0].1));
        assert!(
            (top_got - top_want).abs() <= relative * top_want.abs().max(1.0),
            "{context} row {row}: best {top_got} vs {top_want}"
        );
    }
}

#[test]
fn tiles_run_for_bf16_engines_where_the_cpu_has_them() {
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
                assert_same_within_rounding(&tiles, &before[i], 1e-3, &format!("batch {b}"));
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

/// A screened engine's int8 screen on tiles: its answers are the SIMD screen's and the plain
/// exact engine's, bit for bit, at every batch size (the tile sums are exact and the epilogue
/// the SIMD kernels'), and the plan names the screen; without AMX the refusal and unchanged
/// answers.
#[test]
fn a_screened_engine_screens_on_tiles_with_the_exact_answers() {
    use recsys_engine::engine_dir::Screen;
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    for (kind, precision) in [
        (ModelKind::Vaecf, Precision::Fp32),
        (ModelKind::Bert4rec, Precision::Fp32),
        (ModelKind::Vaecf, Precision::Fp16),
    ] {
        let name = format!("{kind:?}-{precision:?}");
        let plain = convert_fixture_at(
            kind,
            "model.safetensors",
            &dir.path().join(&name),
            precision,
        );
        let mut screened = convert_fixture_screened(
            kind,
            &dir.path().join(format!("{name}-screen")),
            precision,
            Screen::Int8,
        )
        .unwrap();
        let batches = [1, 8, 37, 64];
        let exact: Vec<_> = batches
            .iter()
            .map(|&b| ranked_bits(&plain, &requests(&plain, b)))
            .collect();
        for (i, &b) in batches.iter().enumerate() {
            assert_eq!(
                ranked_bits(&screened, &requests(&screened, b)),
                exact[i],
                "{name}: SIMD screen, batch {b}"
            );
        }
        assert_eq!(screened.plan_amx(AmxPolicy::Off), Ok(None));
        assert!(!screened.scorer.screen.as_ref().unwrap().has_tiles());
        match amx::availability() {
            Err(why) => {
                assert_eq!(screened.plan_amx(AmxPolicy::On), Err(why.clone()));
                assert!(!screened.scorer.screen.as_ref().unwrap().has_tiles());
                for (i, &b) in batches.iter().enumerate() {
                    assert_eq!(
                        ranked_bits(&screened, &requests(&screened, b)),
                        exact[i],
                        "{name}: batch {b}"
                    );
                }
                eprintln!("this CPU runs no AMX tiles ({why}): only the refusal was checked");
            }
            Ok(()) => {
                let plan = screened.plan_amx(AmxPolicy::On).unwrap().unwrap();
                assert!(plan.tiles_for(1) && plan.tiles_for(64));
                assert!(
                    plan.describe().starts_with("int8 screen "),
                    "{}",
                    plan.describe()
                );
                assert!(screened.scorer.screen.as_ref().unwrap().has_tiles());
                assert!(screened.kernels_for(64).tiles);
                for (i, &b) in batches.iter().enumerate() {
                    assert_eq!(
                        ranked_bits(&screened, &requests(&screened, b)),
                        exact[i],
                        "{name}: screen on tiles, batch {b}"
                    );
                }
                // A catalogue delta's new screen gets tiles too, with the same exact answers.
                let unchanged = recsys_engine::catalogue::CatalogueDelta {
                    version: 1,
                    rows: vec![],
                };
                let live = screened.with_catalogue(&unchanged).unwrap();
                assert!(live.scorer.screen.as_ref().unwrap().has_tiles(), "{name}");
                assert_eq!(
                    ranked_bits(&live, &requests(&live, 64)),
                    exact[3],
                    "{name}: delta"
                );
                let measured = screened.plan_amx(AmxPolicy::Auto).unwrap().unwrap().clone();
                assert!(!measured.timings.is_empty(), "{measured:?}");
                assert_eq!(
                    screened.scorer.screen.as_ref().unwrap().has_tiles(),
                    measured.uses_tiles(),
                    "{name}: tiles kept only where a batch size uses them"
                );
                eprintln!("{name}: {}", measured.describe());
            }
        }
    }
}

/// An int8 weight-only and a W8A8 engine's output layer on AMX-INT8 tiles: the answers of the
/// SIMD scan, bit for bit, at every batch size; the plan names the int8 output layer; without
/// AMX the refusal and unchanged answers.
#[test]
fn int8_engines_score_their_output_layer_on_tiles_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RECSYS_PLAN_DIR", dir.path().join("plans"));
    std::env::set_var("RECSYS_PLAN_BUSY_CORES", "inf");
    for kind in [ModelKind::Vaecf, ModelKind::Bert4rec] {
        let engines = engines_at_every_precision(kind, &dir.path().join(format!("{kind:?}")));
        for (variant, mut engine) in engines
            .into_iter()
            .filter(|(v, _)| *v == "int8" || *v == "w8a8")
        {
            let name = format!("{kind:?} {variant}");
            let batches = [1, 8, 37, 64];
            let before: Vec<_> = batches
                .iter()
                .map(|&b| ranked_bits(&engine, &requests(&engine, b)))
                .collect();
            match amx::availability() {
                Err(why) => {
                    assert_eq!(engine.plan_amx(AmxPolicy::On), Err(why.clone()), "{name}");
                    assert!(engine.scorer.amx_int8.is_none());
                    eprintln!("this CPU runs no AMX tiles ({why}): only the refusal was checked");
                }
                Ok(()) => {
                    let plan = engine.plan_amx(AmxPolicy::On).unwrap().unwrap();
                    assert!(
                        plan.describe().starts_with("int8 output layer "),
                        "{}",
                        plan.describe()
                    );
                    assert!(engine.scorer.amx_int8.is_some() && engine.kernels_for(8).tiles);
                }
            }
            for (i, &b) in batches.iter().enumerate() {
                assert_eq!(
                    ranked_bits(&engine, &requests(&engine, b)),
                    before[i],
                    "{name}: batch {b}"
                );
            }
            assert_eq!(engine.plan_amx(AmxPolicy::Off), Ok(None));
            assert!(
                engine.scorer.amx_int8.is_none(),
                "{name}: off drops the tiles"
            );
        }
    }
}

/// A bf16 Mult-VAE whose batch of long histories lists much of the catalogue runs its first layer
/// as one multi-hot product on tiles: the answers share the gather's items within the tiles'
/// rounding, and the best score agrees to 1e-3.
#[test]
fn a_bf16_mult_vae_runs_its_first_layer_on_tiles_for_long_histories() {
    let Some(dir) = tiles_and_plans_dir() else {
        return;
    };
    let mut bf16 = convert_fixture_at(
        ModelKind::Vaecf,
        "model.safetensors",
        &dir.path().join("bf16"),
        Precision::Bf16,
    );
    // 64 histories of 120 distinct items: 7,680 listed against 64 x 2,001 inputs, which the
    // rule puts on tiles (at most 32 multiply-adds per listed item's row value).
    let long = long_histories(&bf16, 64, 120);
    bf16.plan_amx(AmxPolicy::Off).unwrap();
    let gathered = ranked_bits(&bf16, &long);
    let before = bf16.memory_bytes();
    bf16.plan_amx(AmxPolicy::On).unwrap();
    // The output layer's tiles and the first layer's (made by the plan, not by a request): two
    // bf16 copies of 2,001 x 600.
    let tile_bytes = 2 * (2 * 2001 * 600);
    assert!(
        bf16.memory_bytes() >= before + tile_bytes,
        "{} bytes with tiles, {before} without",
        bf16.memory_bytes()
    );
    let on_tiles = ranked_bits(&bf16, &long);
    assert_same_within_rounding(&on_tiles, &gathered, 1e-3, "multi-hot");
}

/// A bf16 transformer's encoder on tiles: the key, value and query projections (one side-by-side
/// layer), the attention output and the feed-forward run there (their tiles are made by the
/// first batch), on one thread and with the layer's rows split over two, and the answers hold
/// the SIMD tables' items within the tiles' rounding.
#[test]
fn bf16_transformers_run_their_encoder_layers_on_tiles() {
    let Some(dir) = tiles_and_plans_dir() else {
        return;
    };
    for kind in [ModelKind::Bert4rec, ModelKind::Sasrec] {
        let mut bf16 = convert_fixture_at(
            kind,
            "model.safetensors",
            &dir.path().join(format!("{kind:?}")),
            Precision::Bf16,
        );
        let long = long_histories(&bf16, 16, 60);
        for threads in [1, 2] {
            bf16.set_threads(threads);
            bf16.plan_amx(AmxPolicy::Off).unwrap();
            let simd = ranked_bits(&bf16, &long);
            let before = bf16.memory_bytes();
            bf16.plan_amx(AmxPolicy::On).unwrap();
            let on_tiles = ranked_bits(&bf16, &long);
            if threads == 1 {
                // Hidden 64, inner 256, two layers: per layer the three projections, the
                // attention output and the two feed-forward layers in bf16 tiles, beside the
                // output layer's (2,001 items in blocks of 32, 64 wide).
                let encoder = 2 * 2 * (3 * 64 * 64 + 64 * 64 + 2 * 64 * 256);
                let output = 2016 * 64 * 2;
                assert!(
                    bf16.memory_bytes() >= before + encoder + output,
                    "{kind:?}: {} bytes with tiles, {before} without",
                    bf16.memory_bytes()
                );
            }
            let context = format!("{kind:?} threads {threads}");
            assert_same_within_rounding(&on_tiles, &simd, 1e-3, &context);
        }
    }
}
