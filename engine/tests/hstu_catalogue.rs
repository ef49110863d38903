//! A live catalogue on HSTU: items cut out of the official checkpoint and given back as a delta
//! (their normalised output rows and their input rows, as `recsys export-items --with-input-rows`
//! writes them) answer the official test users as the engine converted from the whole
//! checkpoint, at every precision and with the exact screen; retired items are never returned;
//! and a swap keeps the prefix-cache states (keyed by items and timestamps) whose items' rows did
//! not change.

mod common;

use common::cut::cut_checkpoint;
use common::{config_json, model_dir, Precision};
use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::engine_dir::Screen;
use recsys_engine::idmap::{ExternalId, ExternalIds};
use recsys_engine::prefix_cache::PrefixCache;
use recsys_engine::request::{Request, RequestTimes, ServeOptions};
use recsys_engine::{Engine, ModelKind};

const KIND: ModelKind = ModelKind::Hstu;

fn convert(
    checkpoint: &std::path::Path,
    config: &serde_json::Map<String, serde_json::Value>,
    item_map: &std::path::Path,
    out: &std::path::Path,
    precision: Precision,
    screen: Screen,
) -> Engine {
    common::cut::convert_from(KIND, checkpoint, config, item_map, out, precision, screen)
}

/// A delta of `op` rows for `ids` with their rows in `source` as export-items writes them: the
/// normalised output row with a 0 bias, and the input row (the embedding as trained).
fn delta_from(source: &Engine, ids: &[ExternalId], op: ItemOp, with_rows: bool) -> CatalogueDelta {
    let d = source.model.output().input_size();
    CatalogueDelta {
        version: 1,
        rows: ids
            .iter()
            .map(|id| {
                let ExternalId::Int(i) = id else {
                    unreachable!("the fixture's ids are integers")
                };
                let index = source.ids.index_of_int(*i).unwrap() as usize;
                let mut vector = vec![0f32; d + 1];
                source
                    .model
                    .output()
                    .weight
                    .add_row_into(index, &mut vector[..d]);
                let mut input = vec![0f32; d];
                source.model.input_rows().add_row_into(index, &mut input);
                ItemRow {
                    id: id.clone(),
                    op,
                    vector: with_rows.then_some(vector),
                    input_vector: with_rows.then_some(input),
                }
            })
            .collect(),
    }
}

/// The first test users (ids, their timestamps, the target's time as the query time).
fn users(count: usize) -> Vec<(Vec<i64>, Vec<i64>, i64)> {
    let path = model_dir(KIND).join("test_set.tsv.gz");
    recsys_engine::metrics::read_test_set(&path)
        .unwrap()
        .into_iter()
        .take(count)
        .map(|c| {
            let times = c.times.unwrap();
            (
                c.history.iter().map(|x| x.parse().unwrap()).collect(),
                times.events,
                times.target,
            )
        })
        .collect()
}

fn answers(engine: &Engine, users: &[(Vec<i64>, Vec<i64>, i64)]) -> Vec<Vec<(ExternalId, u32)>> {
    let requests: Vec<Request<'_>> = users
        .iter()
        .map(|(ids, times, query)| Request {
            history: ExternalIds::Int(ids),
            k: Some(20),
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: Some(RequestTimes {
                events: times,
                query: Some(*query),
            }),
        })
        .collect();
    engine
        .recommend(&requests, &ServeOptions::default())
        .into_iter()
        .map(|a| {
            a.unwrap()
                .items
                .iter()
                .map(|s| (engine.external_id(s.index).unwrap(), s.score.to_bits()))
                .collect()
        })
        .collect()
}

#[test]
fn cut_items_given_back_as_a_delta_answer_as_the_converted_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let cut: Vec<usize> = (1..=2000).step_by(37).chain([2000]).collect();
    let (checkpoint, config, item_map) = cut_checkpoint(KIND, &cut, &tmp.path().join("cut"));
    let full_checkpoint = model_dir(KIND).join("model.safetensors");
    let full_map = model_dir(KIND).join("item_id_map.tsv");
    let users = users(300);
    let fp32 = convert(
        &full_checkpoint,
        &config_json(KIND),
        &full_map,
        &tmp.path().join("full-fp32"),
        Precision::Fp32,
        Screen::None,
    );
    let cut_ids: Vec<ExternalId> = cut
        .iter()
        .map(|&i| fp32.external_id(i as u32).unwrap())
        .collect();
    let delta = delta_from(&fp32, &cut_ids, ItemOp::Upsert, true);
    for (variant, precision, screen) in [
        ("fp32", Precision::Fp32, Screen::None),
        ("fp16", Precision::Fp16, Screen::None),
        ("bf16", Precision::Bf16, Screen::None),
        ("int8", Precision::Int8, Screen::None),
        ("fp32-screen", Precision::Fp32, Screen::Int8),
    ] {
        let full = convert(
            &full_checkpoint,
            &config_json(KIND),
            &full_map,
            &tmp.path().join(format!("full-{variant}")),
            precision,
            screen,
        );
        let cut_engine = convert(
            &checkpoint,
            &config,
            &item_map,
            &tmp.path().join(format!("cut-{variant}")),
            precision,
            screen,
        );
        assert_eq!(cut_engine.n_items(), 2000 - cut.len());
        let live = cut_engine.with_catalogue(&delta).unwrap();
        assert_eq!(live.n_items(), 2000, "{variant}");
        // Bit for bit: the delta's rows are stored by the engine's own rules, as conversion
        // stored them, and every item's score is its own row's.
        assert_eq!(answers(&live, &users), answers(&full, &users), "{variant}");
        assert_ne!(
            answers(&cut_engine, &users),
            answers(&full, &users),
            "{variant}: the cut engine alone answers differently"
        );
    }
}

#[test]
fn retired_items_leave_every_answer_and_the_cache_keeps_unchanged_sessions() {
    let tmp = tempfile::tempdir().unwrap();
    let mut engine = common::convert_fixture(KIND, "model.safetensors", &tmp.path().join("e"));
    engine
        .set_prefix_cache(Some(PrefixCache::new(64 << 20, None)))
        .unwrap();
    let users = users(200);
    let before = answers(&engine, &users);
    let retired: Vec<ExternalId> = before
        .iter()
        .flat_map(|a| a.iter().take(2).map(|(id, _)| id.clone()))
        .take(6)
        .collect();
    let live = engine
        .with_catalogue(&delta_from(&engine, &retired, ItemOp::Retire, false))
        .unwrap();
    let kept = live.prefix_cache().unwrap().stats().entries;
    assert_eq!(
        kept,
        engine.prefix_cache().unwrap().stats().entries,
        "a retirement changes no input row: every session's state is kept"
    );
    for (row, (got, all)) in answers(&live, &users).iter().zip(&before).enumerate() {
        assert!(
            got.iter().all(|(id, _)| !retired.contains(id)),
            "history {row}"
        );
        let want: Vec<_> = all
            .iter()
            .filter(|(id, _)| !retired.contains(id))
            .take(got.len())
            .cloned()
            .collect();
        assert_eq!(got[..want.len()], want[..], "history {row}");
    }
    // A changed input row drops exactly the states of the sessions that read it.
    let (ids, _, _) = &users[0];
    let changed = ExternalId::Int(ids[0]);
    let mut upsert = delta_from(
        &engine,
        std::slice::from_ref(&changed),
        ItemOp::Upsert,
        true,
    );
    for v in upsert.rows[0].input_vector.as_mut().unwrap() {
        *v *= 1.5;
    }
    let swapped = engine.with_catalogue(&upsert).unwrap();
    let readers = users
        .iter()
        .filter(|(h, _, _)| h.len() > 1 && h.len() <= 200 && h.contains(&ids[0]))
        .count() as u64;
    assert!(readers >= 1);
    assert_eq!(
        swapped.prefix_cache().unwrap().stats().entries,
        kept - readers
    );
    // ... and the kept states answer as a fresh engine with the same rows.
    let mut fresh = engine.with_catalogue(&upsert).unwrap();
    fresh.set_prefix_cache(None).unwrap();
    assert_eq!(answers(&swapped, &users), answers(&fresh, &users));
}
