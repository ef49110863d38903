//! A live catalogue against engines converted with the same rows: items cut out of each fixture
//! checkpoint (all four families) and given back as a catalogue delta must answer as the engine
//! converted from the whole checkpoint, plain, quantized and screened; retired items are never
//! returned and every other answer stays the full engine's.

mod common;

use common::cut::{
    answers, convert_from as convert, cut_checkpoint, delta_from, ids_at, popular_items, rows_of,
    whole_engine,
};
use common::{config_json, model_dir, Precision};
use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::engine_dir::Screen;
use recsys_engine::idmap::ExternalId;
use recsys_engine::{Engine, ModelKind};

const KINDS: [ModelKind; 4] = [
    ModelKind::Bert4rec,
    ModelKind::Vaecf,
    ModelKind::Sasrec,
    ModelKind::Gru4rec,
];

/// Largest relative difference between a score of the engine with a delta and the converted
/// engine's where the two do not add in the same order: Mult-VAE sums a history's input rows in
/// index order (blocked by index, for the cache), and a new item's index is after every
/// converted item. Float engines: f32 rounding of a 600-wide sum of a few rows (measured up to
/// 6.1e-7).
const VAECF_REL_TOL: f32 = 1e-6;
/// The same for an int8 Mult-VAE, whose dense layers quantize their input per row at run time:
/// a last-bit change of one activation can move its int8 level (measured up to 1.2e-5).
const VAECF_INT8_REL_TOL: f32 = 5e-5;

/// Items of the 2,000 cut out of each checkpoint: spread over the catalogue, first and last
/// included.
fn cut_indices() -> Vec<usize> {
    let mut cut: Vec<usize> = (1..=2000).step_by(37).collect();
    cut.push(2000);
    cut
}

/// Asserts two answers are the same ranking: the same ids in the same order, except that items
/// whose scores are within the tolerance (exact: equal bits) may come in either order, with
/// scores within `rel_tol` relative (`None`: equal bits). Returns the largest relative score
/// difference seen.
fn assert_same_answers(
    what: &str,
    got: &[Vec<(ExternalId, f32)>],
    want: &[Vec<(ExternalId, f32)>],
    rel_tol: Option<f32>,
) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut largest = 0f32;
    let close = |a: f32, b: f32| match rel_tol {
        None => a.to_bits() == b.to_bits(),
        Some(tol) => (a - b).abs() <= tol * b.abs().max(1e-3),
    };
    for (row, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: history {row}: answer lengths");
        for (rank, ((gid, gs), (wid, ws))) in g.iter().zip(w).enumerate() {
            largest = largest.max((gs - ws).abs() / ws.abs().max(1e-3));
            assert!(
                close(*gs, *ws),
                "{what}: history {row} rank {rank}: score {gs} vs {ws}"
            );
            if gid != wid {
                // Only a tie (within the tolerance) may order two items differently.
                let tied = w.iter().any(|(id, s)| id == gid && close(*s, *ws));
                assert!(
                    tied,
                    "{what}: history {row} rank {rank}: {gid} (score {gs}) where the converted \
                     engine has {wid} (score {ws})"
                );
            }
        }
    }
    largest
}

/// Engines of the cut checkpoint plus its cut rows answer as engines of the whole checkpoint, at
/// every precision and with the int8 screen.
#[test]
fn cut_items_given_back_as_a_delta_answer_as_the_converted_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let cut = cut_indices();
    for kind in KINDS {
        let (checkpoint, config, item_map) =
            cut_checkpoint(kind, &cut, &tmp.path().join(format!("{kind}-cut")));
        let full_checkpoint = model_dir(kind).join("model.safetensors");
        let full_config = config_json(kind);
        let full_map = model_dir(kind).join("item_id_map.tsv");
        let fp32_full = whole_engine(kind, &tmp.path().join(format!("{kind}-full-fp32")));
        let cut_ids = ids_at(&fp32_full, &cut);
        // The rows as the model has them (the fp32 engine's): each precision stores them by its
        // own rules, as conversion of the whole checkpoint did.
        let delta = delta_from(&fp32_full, &cut_ids, ItemOp::Upsert, true);
        for (variant, precision, screen) in [
            ("fp32", Precision::Fp32, Screen::None),
            ("fp16", Precision::Fp16, Screen::None),
            ("bf16", Precision::Bf16, Screen::None),
            ("int8", Precision::Int8, Screen::None),
            ("fp32-screen", Precision::Fp32, Screen::Int8),
        ] {
            let full = convert(
                kind,
                &full_checkpoint,
                &full_config,
                &full_map,
                &tmp.path().join(format!("{kind}-full-{variant}")),
                precision,
                screen,
            );
            let cut_engine = convert(
                kind,
                &checkpoint,
                &config,
                &item_map,
                &tmp.path().join(format!("{kind}-cut-{variant}")),
                precision,
                screen,
            );
            assert_eq!(cut_engine.n_items(), 2000 - cut.len());
            // Applied over another delta (a server's next version): the delta replaces it.
            let half = CatalogueDelta {
                version: 1,
                rows: delta.rows[..delta.rows.len() / 2].to_vec(),
            };
            let with_delta = cut_engine
                .with_catalogue(&half)
                .unwrap()
                .with_catalogue(&delta)
                .unwrap();
            assert_eq!(with_delta.n_items(), 2000, "{kind} {variant}");
            let summary = with_delta.catalogue().unwrap();
            assert_eq!(
                (summary.added, summary.replaced, summary.retired),
                (cut.len(), 0, 0)
            );
            // Mult-VAE adds a history's input rows in index order, which a new item changes.
            let tolerance = match (kind, precision) {
                (ModelKind::Vaecf, Precision::Int8) => Some(VAECF_INT8_REL_TOL),
                (ModelKind::Vaecf, _) => Some(VAECF_REL_TOL),
                _ => None,
            };
            let largest = assert_same_answers(
                &format!("{kind} {variant}"),
                &answers(&with_delta, 20),
                &answers(&full, 20),
                tolerance,
            );
            println!("{kind} {variant}: largest relative score difference {largest:e}");
            // The cut engine alone answers differently: the comparison has teeth.
            assert_ne!(
                answers(&cut_engine, 20),
                answers(&full, 20),
                "{kind} {variant}"
            );
        }
    }
}

/// Retired items leave every answer, and each other answer is the engine's own with them left
/// out; replacing an item's rows with its own rows changes nothing.
#[test]
fn retired_items_are_never_returned_and_other_answers_stay() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let engine = common::convert_fixture(
            kind,
            "model.safetensors",
            &tmp.path().join(kind.to_string()),
        );
        let before = answers(&engine, 40);
        // The items the engine recommends most: retiring them changes many answers.
        let retired = popular_items(&engine, 5);
        let delta = delta_from(&engine, &retired, ItemOp::Retire, false);
        let live = engine.with_catalogue(&delta).unwrap();
        assert_eq!(live.catalogue().unwrap().retired, retired.len());
        let after = answers(&live, 20);
        for (row, (got, all)) in after.iter().zip(&before).enumerate() {
            let want: Vec<(ExternalId, f32)> = all
                .iter()
                .filter(|(id, _)| !retired.contains(id))
                .take(20)
                .cloned()
                .collect();
            assert!(
                got.iter().all(|(id, _)| !retired.contains(id)),
                "{kind} history {row}"
            );
            assert_eq!(got, &want, "{kind} history {row}");
        }
        // Retiring an item does not take it out of histories: its input row still counts.
        let same_rows = delta_from(&engine, &retired, ItemOp::Upsert, true);
        assert_eq!(
            answers(&engine.with_catalogue(&same_rows).unwrap(), 20),
            answers(&engine, 20)
        );
    }
}

/// Rows that cannot apply are refused, naming the item and the problem.
#[test]
fn a_delta_that_cannot_apply_is_refused_naming_the_item() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = common::convert_fixture(
        ModelKind::Sasrec,
        "model.safetensors",
        &tmp.path().join("sasrec"),
    );
    let vaecf = common::convert_fixture(
        ModelKind::Vaecf,
        "model.safetensors",
        &tmp.path().join("vaecf"),
    );
    let row = |id: i64, op, vector: Option<Vec<f32>>| ItemRow {
        id: ExternalId::Int(id),
        op,
        vector,
        input_vector: None,
    };
    let refused = |engine: &Engine, rows: Vec<ItemRow>| {
        engine
            .with_catalogue(&CatalogueDelta { version: 1, rows })
            .err()
            .expect("refused")
            .to_string()
    };
    let d = engine.model.output().input_size();
    let good = vec![0.25f32; d + 1];
    let mut zero_bias = good.clone();
    zero_bias[d] = 0.0;
    for (rows, expected) in [
        (
            vec![row(1, ItemOp::Upsert, Some(vec![0.0; 3]))],
            "holds 3 values",
        ),
        (
            vec![row(1, ItemOp::Upsert, Some(good.clone()))],
            "scores without a bias",
        ),
        (
            vec![
                row(5, ItemOp::Upsert, Some(zero_bias.clone())),
                row(5, ItemOp::Retire, None),
            ],
            "appears twice",
        ),
        (vec![row(99, ItemOp::Retire, None)], "is not in the engine"),
        (
            vec![row(7, ItemOp::Upsert, Some(vec![f32::NAN; d + 1]))],
            "must be finite",
        ),
    ] {
        let message = refused(&engine, rows);
        assert!(message.contains(expected), "{message}");
    }
    let message = refused(
        &engine,
        vec![ItemRow {
            id: ExternalId::Str("not-a-number".into()),
            op: ItemOp::Upsert,
            vector: Some(zero_bias),
            input_vector: None,
        }],
    );
    assert!(message.contains("not an integer"), "{message}");
    // Mult-VAE reads a new item's input row from input_vector.
    let vd = vaecf.model.output().input_size();
    let message = refused(
        &vaecf,
        vec![row(42, ItemOp::Upsert, Some(vec![0.1; vd + 1]))],
    );
    assert!(message.contains("no input_vector"), "{message}");
    assert!(engine.catalogue().is_none());
}

/// The availability object in force stays in force across a catalogue swap, mapped onto the new
/// catalogue: a new item it marks out of stock is filtered out; a retired item stays out of a
/// filtered answer too.
#[test]
fn availability_in_force_survives_a_swap_and_covers_new_items() {
    let tmp = tempfile::tempdir().unwrap();
    let cut = cut_indices();
    let kind = ModelKind::Sasrec;
    let (checkpoint, config, item_map) = cut_checkpoint(kind, &cut, &tmp.path().join("cut"));
    let full = common::convert_fixture(kind, "model.safetensors", &tmp.path().join("full"));
    let engine = convert(
        kind,
        &checkpoint,
        &config,
        &item_map,
        &tmp.path().join("engine"),
        Precision::Fp32,
        Screen::None,
    );
    let new_ids: Vec<ExternalId> = cut
        .iter()
        .map(|&i| full.external_id(i as u32).unwrap())
        .collect();
    // Every new item out of stock, every other item in stock.
    let rows: Vec<(String, Vec<Vec<String>>)> = (1..=2000u32)
        .map(|i| {
            let id = full.external_id(i).unwrap();
            let stock = if new_ids.contains(&id) { "out" } else { "in" };
            (id.to_string(), vec![vec![stock.to_string()]])
        })
        .collect();
    let table = recsys_engine::AttributeTable {
        columns: vec!["stock".into()],
        rows,
    };
    let object = recsys_engine::AvailabilityFile::from_table(&table, 3, 0).unwrap();
    engine
        .filters
        .replace_availability(object.map(&engine.ids))
        .unwrap();
    let retired = engine.external_id(1).unwrap();
    let mut delta = delta_from(&full, &new_ids, ItemOp::Upsert, true);
    delta.rows.push(ItemRow {
        id: retired.clone(),
        op: ItemOp::Retire,
        vector: None,
        input_vector: None,
    });
    let live = engine.with_catalogue(&delta).unwrap();
    assert_eq!(live.filters.availability_version(), Some(3));
    let filter = recsys_engine::ItemFilter {
        include: vec![],
        exclude: vec!["stock=out".into()],
    };
    let kept = live.filters.resolve(&filter).unwrap();
    for id in &new_ids {
        let index = live.ids.index_of(id).unwrap();
        assert!(!kept.allows(index), "new item {id} is out of stock");
    }
    assert!(
        !kept.allows(live.ids.index_of(&retired).unwrap()),
        "retired"
    );
    assert_eq!(kept.count(), 2000 - new_ids.len() - 1);
    // Unfiltered, the new items are offered and the retired one is not.
    let offered = live.filters.view().unfiltered().unwrap();
    assert_eq!(offered.count(), 2000 - 1);
    // A later, smaller delta (three new items, nothing retired) over this one: the catalogue
    // shrinks back, and its sets and masks with it.
    let smaller = live
        .with_catalogue(&CatalogueDelta {
            version: 2,
            rows: delta.rows[..3].to_vec(),
        })
        .unwrap();
    assert_eq!(smaller.n_items(), 2000 - new_ids.len() + 3);
    assert_eq!(smaller.filters.sets().n_items(), smaller.n_items() + 1);
    let kept = smaller.filters.resolve(&filter).unwrap();
    assert_eq!(kept.count(), 2000 - new_ids.len());
    assert!(smaller.filters.view().unfiltered().is_none());
}

/// A swap keeps the prefix cache's states for histories without a changed item (and drops the
/// others), and answers with the kept states as an engine without a cache does.
#[test]
fn a_swap_keeps_the_prefix_states_no_changed_row_went_into() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [ModelKind::Sasrec, ModelKind::Gru4rec] {
        let dir = tmp.path().join(kind.to_string());
        let mut engine = common::convert_fixture(kind, "model.safetensors", &dir);
        engine
            .set_prefix_cache(Some(recsys_engine::prefix_cache::PrefixCache::new(
                64 << 20,
                None,
            )))
            .unwrap();
        answers(&engine, 20);
        let before = engine.prefix_cache().unwrap().stats();
        assert!(before.entries > 0);
        // Item 7's rows become item 8's: every cached history holding item 7 is stale.
        let changed = engine.external_id(7).unwrap();
        let (vector, _) = rows_of(&engine, 8);
        let delta = CatalogueDelta {
            version: 1,
            rows: vec![ItemRow {
                id: changed.clone(),
                op: ItemOp::Upsert,
                vector: Some(vector),
                input_vector: None,
            }],
        };
        let live = engine.with_catalogue(&delta).unwrap();
        let after = live.prefix_cache().unwrap().stats();
        assert!(
            after.entries > 0 && after.entries < before.entries,
            "{before:?} -> {after:?}"
        );
        assert_eq!((after.hits, after.misses), (before.hits, before.misses));
        let fresh = Engine::load(&dir).unwrap().with_catalogue(&delta).unwrap();
        assert_same_answers(
            &format!("{kind} cached"),
            &answers(&live, 20),
            &answers(&fresh, 20),
            None,
        );
    }
}
