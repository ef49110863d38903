//! Visitors without history: under `empty_history_policy` the popularity list (counted by convert
//! from an interaction log) answers histories that are empty or hold no known item, for every
//! model kind including SASRec and GRU4Rec, filtered like any answer; `model` keeps the model's
//! own answer where it has one; `error` refuses. The reference counts the log here, by hand.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use recsys_engine::engine_dir::{Precision, Screen};
use recsys_engine::popularity::Popularity;
use recsys_engine::{
    CatalogueInputs, EmptyHistoryPolicy, Engine, ExternalIds, ItemFilter, ModelKind, Request,
    ServeOptions,
};

/// The fixtures' histories as an interaction log (RecBole's atomic format).
fn interaction_log(dir: &std::path::Path) -> (std::path::PathBuf, BTreeMap<String, u64>) {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let mut text = String::from("user_id:token\titem_id:token\n");
    let mut counts = BTreeMap::new();
    for (u, case) in cases.iter().enumerate() {
        for item in &case.history {
            text.push_str(&format!("{u}\t{item}\n"));
            *counts.entry(item.clone()).or_insert(0) += 1;
        }
    }
    text.push_str("0\tnot-in-the-catalogue\n");
    let path = dir.join("log.inter");
    std::fs::write(&path, text).unwrap();
    (path, counts)
}

fn convert_with_popularity(
    kind: ModelKind,
    dir: &std::path::Path,
    log: &std::path::Path,
) -> Engine {
    let item_map = model_dir(kind).join("item_id_map.tsv");
    let ids = recsys_engine::ItemMapSource::Tsv(&item_map)
        .read(u64::MAX)
        .unwrap();
    let counted = Popularity::count_file(log, None, &ids).unwrap();
    assert_eq!(counted.1.unknown_items, 1);
    let catalogue = CatalogueInputs {
        item_attributes: None,
        popularity: Some(&counted),
    };
    convert_fixture_with(
        kind,
        &dir.join(kind.as_str()),
        Precision::Fp32,
        Screen::None,
        catalogue,
    )
    .unwrap()
}

fn ask(
    engine: &Engine,
    history: &[&str],
    k: i64,
    exclude: &[&str],
    policy: EmptyHistoryPolicy,
    embedding: bool,
) -> recsys_engine::Result<recsys_engine::Recommendation> {
    engine
        .recommend(
            &[Request {
                history: ExternalIds::Str(history),
                k: Some(k),
                exclude: Some(ExternalIds::Str(exclude)),
                candidates: None,
                embedding,
                filter: None::<&ItemFilter>,
                times: None,
            }],
            &ServeOptions {
                empty_history: policy,
                ..ServeOptions::default()
            },
        )
        .remove(0)
}

#[test]
fn empty_histories_get_the_policy_s_answer_on_every_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let (log, counts) = interaction_log(tmp.path());
    for kind in ModelKind::RECBOLE {
        let engine = convert_with_popularity(kind, tmp.path(), &log);
        let record = engine.manifest.popularity.clone().unwrap();
        assert_eq!(record.column, "item_id:token");
        // The reference: the log's counts, most first, ties to the lower internal index.
        let mut want: Vec<(u64, u32, String)> = counts
            .iter()
            .filter_map(|(id, &c)| engine.ids.index_of_str(id).map(|i| (c, i, id.clone())))
            .collect();
        want.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let total: u64 = want.iter().map(|w| w.0).sum();
        let exclude: Vec<&str> = vec![want[1].2.as_str()];
        for history in [vec![], vec!["no-such-item", "nor-this"]] {
            for policy in [EmptyHistoryPolicy::Auto, EmptyHistoryPolicy::Popular] {
                let answer = ask(&engine, &history, 20, &exclude, policy, false).unwrap();
                assert!(answer.popular, "{kind} {policy:?}");
                let expected: Vec<u32> = want
                    .iter()
                    .filter(|w| w.2 != want[1].2)
                    .take(20)
                    .map(|w| w.1)
                    .collect();
                let got: Vec<u32> = answer.items.iter().map(|s| s.index).collect();
                assert_eq!(got, expected, "{kind} {policy:?}");
                assert_eq!(
                    answer.items[0].score,
                    (want[0].0 as f64 / total as f64) as f32
                );
            }
            let refused = ask(&engine, &history, 5, &[], EmptyHistoryPolicy::Error, false);
            assert!(refused
                .unwrap_err()
                .to_string()
                .contains("empty_history_policy is \"error\""));
            let model = ask(&engine, &history, 5, &[], EmptyHistoryPolicy::Model, false);
            if kind.needs_history() {
                let err = model.unwrap_err().to_string();
                assert!(err.contains("needs at least one"), "{kind}: {err}");
            } else {
                let answer = model.unwrap();
                assert!(!answer.popular && answer.items.len() == 5, "{kind}");
            }
            let err =
                ask(&engine, &history, 5, &[], EmptyHistoryPolicy::Popular, true).unwrap_err();
            assert!(
                err.to_string().contains("no user embedding"),
                "{kind}: {err}"
            );
        }
        // A history with a known item is the model's, whatever the policy.
        let known = engine.external_id(want[0].1).unwrap();
        let known = match known {
            recsys_engine::ExternalId::Int(i) => i.to_string(),
            recsys_engine::ExternalId::Str(s) => s,
        };
        let answer = ask(
            &engine,
            &[known.as_str()],
            5,
            &[],
            EmptyHistoryPolicy::Popular,
            false,
        )
        .unwrap();
        assert!(!answer.popular, "{kind}");
    }
    // Without a popularity list, `popular` is refused naming the fix; `auto` is the model's.
    let plain = convert_fixture(
        ModelKind::Vaecf,
        "model.safetensors",
        &tmp.path().join("plain"),
    );
    let err = ask(&plain, &[], 5, &[], EmptyHistoryPolicy::Popular, false).unwrap_err();
    assert!(err.to_string().contains("--interactions"), "{err}");
    assert!(
        !ask(&plain, &[], 5, &[], EmptyHistoryPolicy::Auto, false)
            .unwrap()
            .popular
    );
}

#[test]
fn popular_answers_honour_filters_and_candidates_and_reload() {
    let tmp = tempfile::tempdir().unwrap();
    let (log, _) = interaction_log(tmp.path());
    let engine = convert_with_popularity(ModelKind::Sasrec, tmp.path(), &log);
    let engine = Engine::load(engine.path.as_ref().unwrap()).unwrap();
    let popularity = engine.popularity.as_ref().unwrap();
    // Candidates: every third item; a filter keeping the even ones among them.
    let candidates: Vec<String> = (1..=engine.n_items() as u32)
        .step_by(3)
        .map(|i| match engine.external_id(i).unwrap() {
            recsys_engine::ExternalId::Int(v) => v.to_string(),
            recsys_engine::ExternalId::Str(s) => s,
        })
        .collect();
    let refs: Vec<&str> = candidates.iter().map(String::as_str).collect();
    let answer = engine
        .recommend(
            &[Request {
                history: ExternalIds::Str(&[]),
                k: Some(15),
                exclude: None,
                candidates: Some(ExternalIds::Str(&refs)),
                embedding: false,
                filter: None,
                times: None,
            }],
            &ServeOptions::default(),
        )
        .remove(0)
        .unwrap();
    let allowed: BTreeSet<u32> = (1..=engine.n_items() as u32).step_by(3).collect();
    let want = popularity.top_k(15, |i| allowed.contains(&i));
    assert_eq!(answer.items, want);
    assert!(answer.popular && answer.items.len() == 15);
}
