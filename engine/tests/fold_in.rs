//! Fold-in on a trained model: items cut out of the GRU4Rec fixture, folded back in from their
//! training interactions (each user's events but the last two), rank their held-out interactions
//! at least half as well as the rows the model trained (the bar; measured 1.00x at HR@10,
//! docs/BENCHMARKS.md), every folded row applies as a delta, and bad settings and HSTU are
//! refused by name.

mod common;

use common::cut::{convert_from, cut_checkpoint, whole_engine};
use common::{fixtures, Precision};
use recsys_engine::catalogue::CatalogueDelta;
use recsys_engine::engine_dir::Screen;
use recsys_engine::fold_in::{fold_in, FoldInOptions, InputRowSource};
use recsys_engine::interactions::UserLog;
use recsys_engine::request::{Request, ServeOptions};
use recsys_engine::{Engine, ExternalId, ExternalIds, ModelKind};

/// Held-out (history, target) pairs whose target is one of `cut`: the validation item (before it:
/// the history less its last item) and the test item.
fn held_out(cut: &[i64]) -> (Vec<UserLog>, Vec<(Vec<i64>, i64)>) {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let mut logs = Vec::new();
    let mut held = Vec::new();
    for case in &cases {
        let history: Vec<i64> = case.history.iter().map(|i| i.parse().unwrap()).collect();
        let target: i64 = case.target.parse().unwrap();
        let train = &history[..history.len() - 1];
        logs.push(UserLog {
            user: case.user_id.clone(),
            items: train.iter().map(i64::to_string).collect(),
            times: (0..train.len() as i64)
                .map(|t| 1_600_000_000 + 3600 * t)
                .collect(),
        });
        if cut.contains(&history[history.len() - 1]) {
            held.push((train.to_vec(), history[history.len() - 1]));
        }
        if cut.contains(&target) {
            held.push((history, target));
        }
    }
    (logs, held)
}

/// HR@k of the held-out targets, each ranked against the catalogue less the other cut items.
fn hit_rate(engine: &Engine, held: &[(Vec<i64>, i64)], cut: &[i64], k: i64) -> f64 {
    let hits = held
        .iter()
        .filter(|(history, target)| {
            let others: Vec<i64> = cut.iter().copied().filter(|c| c != target).collect();
            let request = Request {
                history: ExternalIds::Int(history),
                k: Some(k),
                exclude: Some(ExternalIds::Int(&others)),
                candidates: None,
                embedding: false,
                filter: None,
                times: None,
            };
            engine.recommend(&[request], &ServeOptions::default())[0]
                .as_ref()
                .unwrap()
                .items
                .iter()
                .any(|s| engine.external_id(s.index) == Some(ExternalId::Int(*target)))
        })
        .count();
    hits as f64 / held.len() as f64
}

#[test]
fn folded_rows_rank_held_out_interactions_at_least_half_as_well_as_trained_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = ModelKind::Gru4rec;
    let cut: Vec<usize> = (40..=2000).step_by(40).collect();
    let full = whole_engine(kind, &tmp.path().join("full"));
    let cut_ids: Vec<i64> = cut
        .iter()
        .map(|&i| match full.external_id(i as u32).unwrap() {
            ExternalId::Int(v) => v,
            ExternalId::Str(_) => unreachable!(),
        })
        .collect();
    let (checkpoint, config, item_map) = cut_checkpoint(kind, &cut, &tmp.path().join("cut-ckpt"));
    let engine = convert_from(
        kind,
        &checkpoint,
        &config,
        &item_map,
        &tmp.path().join("cut"),
        Precision::Fp32,
        Screen::None,
    );
    let (logs, held) = held_out(&cut_ids);
    assert!(held.len() > 100, "{}", held.len());
    let options = FoldInOptions {
        negative_samples: 1000,
        ..Default::default()
    };
    let folded = fold_in(&engine, &logs, &options, &mut |_, _| {}).unwrap();
    assert_eq!(folded.items.len(), cut.len());
    assert!(folded.skipped.is_empty(), "{:?}", folded.skipped);
    assert!(
        (900..=1000).contains(&folded.negative_samples),
        "{}",
        folded.negative_samples
    );
    for item in &folded.items {
        assert_eq!(item.input_source, InputRowSource::Tied);
        assert!(item.examples > 0 && item.iterations < 50);
        let vector = item.row.vector.as_ref().unwrap();
        assert_eq!(
            vector[vector.len() - 1],
            0.0,
            "GRU4Rec scores without a bias"
        );
    }
    let delta = CatalogueDelta {
        version: 1,
        rows: folded.items.iter().map(|f| f.row.clone()).collect(),
    };
    let live = engine.with_catalogue(&delta).unwrap();
    assert_eq!(live.n_items(), 2000);
    let trained = hit_rate(&full, &held, &cut_ids, 10);
    let got = hit_rate(&live, &held, &cut_ids, 10);
    println!(
        "HR@10 of {} held-out interactions: trained {trained:.3}, folded {got:.3}",
        held.len()
    );
    assert!(
        got >= 0.5 * trained,
        "folded {got} against trained {trained}"
    );
    // Without the folded rows the cut items can never be returned.
    assert_eq!(hit_rate(&engine, &held, &cut_ids, 10), 0.0);

    for (options, wanted) in [
        (
            FoldInOptions {
                l2: 0.0,
                ..Default::default()
            },
            "L2 penalty must be a positive number",
        ),
        (
            FoldInOptions {
                negative_samples: 0,
                ..Default::default()
            },
            "must be at least 1",
        ),
    ] {
        let e = fold_in(&engine, &logs, &options, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains(wanted), "{e}");
    }
}

#[test]
fn hstu_is_refused_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = recsys_engine::fixtures::convert(
        ModelKind::Hstu,
        "model.safetensors",
        &tmp.path().join("hstu"),
        Precision::Fp32,
    )
    .unwrap();
    let e = fold_in(&engine, &[], &FoldInOptions::default(), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("does not fit HSTU"), "{e}");
}
