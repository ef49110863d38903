//! Compaction (`recsys catalogue compact`): an engine with a delta folded into a new engine
//! directory answers exactly as the engine with the delta in force (the same items at the same
//! indices, so the same bits), for all four families, plain, quantized and screened; the items it
//! keeps retired stay out of every answer until a later delta upserts them; item sets and
//! popularity counts grow over the new items; a damaged retired list is refused at load.

mod common;

use common::cut::{
    answers, convert_from as convert, cut_checkpoint, delta_from, ids_at, popular_items, rows_of,
    whole_engine,
};
use common::{fixtures, model_dir, Precision};
use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::compact::write_compacted;
use recsys_engine::engine_dir::{Screen, RETIRED_ITEMS_FILE};
use recsys_engine::idmap::{ExternalId, ExternalIds};
use recsys_engine::popularity::Popularity;
use recsys_engine::request::{Request, ServeOptions};
use recsys_engine::{AttributeTable, CatalogueInputs, Engine, ItemFilter, ModelKind};

const KINDS: [ModelKind; 4] = [
    ModelKind::Bert4rec,
    ModelKind::Vaecf,
    ModelKind::Sasrec,
    ModelKind::Gru4rec,
];

/// Items of the 2,000 cut out of each checkpoint (the delta gives them back).
fn cut_indices() -> Vec<usize> {
    let mut cut: Vec<usize> = (3..=2000).step_by(41).collect();
    cut.push(2000);
    cut
}

/// The cut engine plus the cut items (upserts), two converted items given other rows
/// (replacements) and three popular converted items retired, folded into a new directory: the
/// compacted engine answers as the engine with the delta, bit for bit, and again once reloaded.
#[test]
fn a_compacted_engine_answers_as_the_engine_with_its_delta() {
    let tmp = tempfile::tempdir().unwrap();
    let cut = cut_indices();
    for kind in KINDS {
        let (checkpoint, config, item_map) =
            cut_checkpoint(kind, &cut, &tmp.path().join(format!("{kind}-cut")));
        let full = whole_engine(kind, &tmp.path().join(format!("{kind}-full")));
        let cut_ids = ids_at(&full, &cut);
        let retired = popular_items(&full, 3);
        assert!(retired.iter().all(|id| !cut_ids.contains(id)), "{kind}");
        let mut delta = delta_from(&full, &cut_ids, ItemOp::Upsert, true);
        delta
            .rows
            .extend(delta_from(&full, &retired, ItemOp::Retire, false).rows);
        // Items 1 and 2 take the rows of items 5 and 6.
        for (target, source) in [(1u32, 5u32), (2, 6)] {
            let (vector, input) = rows_of(&full, source);
            delta.rows.push(ItemRow {
                id: full.external_id(target).unwrap(),
                op: ItemOp::Upsert,
                vector: Some(vector),
                input_vector: input,
            });
        }
        delta.version = 7;
        for (variant, precision, screen) in [
            ("fp32", Precision::Fp32, Screen::None),
            ("int8", Precision::Int8, Screen::None),
            ("fp32-screen", Precision::Fp32, Screen::Int8),
        ] {
            let what = format!("{kind} {variant}");
            let cut_engine = convert(
                kind,
                &checkpoint,
                &config,
                &item_map,
                &tmp.path().join(format!("{kind}-cut-{variant}")),
                precision,
                screen,
            );
            let with_delta = cut_engine.with_catalogue(&delta).unwrap();
            let out = tmp.path().join(format!("{kind}-compacted-{variant}"));
            let compacted = write_compacted(&cut_engine, &delta, &out).unwrap();

            let record = compacted.manifest.catalogue.clone().unwrap();
            assert_eq!(
                record.from_engine_sha256,
                cut_engine.weights_sha256(),
                "{what}"
            );
            assert_eq!(
                (
                    record.version,
                    record.base_items,
                    record.added,
                    record.replaced,
                    record.retired
                ),
                (7, 2000 - cut.len(), cut.len(), 2, 3),
                "{what}"
            );
            assert_eq!(compacted.n_items(), 2000, "{what}");
            assert_eq!(compacted.kept_retired().len(), 3, "{what}");
            assert!(compacted.catalogue().is_none(), "{what}: no delta in force");
            assert_eq!(compacted.manifest.screen, screen, "{what}");

            let want = answers(&with_delta, 20);
            assert_eq!(answers(&compacted, 20), want, "{what}");
            assert_eq!(answers(&Engine::load(&out).unwrap(), 20), want, "{what}");
            for answer in &want {
                assert!(answer.iter().all(|(id, _)| !retired.contains(id)), "{what}");
            }
            // The comparison has teeth: without the delta the answers differ.
            assert_ne!(answers(&cut_engine, 20), want, "{what}");
        }
    }
}

/// Items a compacted engine keeps retired stay out of its answers under a later delta, and come
/// back when one upserts them; a delta on the compacted engine applies to its own tensors.
#[test]
fn kept_retirements_hold_until_a_delta_upserts_the_item() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = common::convert_fixture(
        ModelKind::Sasrec,
        "model.safetensors",
        &tmp.path().join("sasrec"),
    );
    let retired = popular_items(&engine, 4);
    let delta = delta_from(&engine, &retired, ItemOp::Retire, false);
    let compacted = write_compacted(&engine, &delta, &tmp.path().join("compacted")).unwrap();
    let without = |kept: &[ExternalId]| -> Vec<Vec<(ExternalId, f32)>> {
        let all = answers(&engine, 40);
        all.into_iter()
            .map(|answer| {
                answer
                    .into_iter()
                    .filter(|(id, _)| !retired.contains(id) || kept.contains(id))
                    .take(20)
                    .collect()
            })
            .collect()
    };
    assert_eq!(answers(&compacted, 20), without(&[]));

    // A later delta that changes nothing about them keeps them out.
    let unrelated = CatalogueDelta {
        version: 8,
        rows: delta_from(
            &engine,
            &[engine.external_id(9).unwrap()],
            ItemOp::Upsert,
            true,
        )
        .rows,
    };
    assert_eq!(
        answers(&compacted.with_catalogue(&unrelated).unwrap(), 20),
        without(&[])
    );
    // Upserting one (with its own rows) offers it again; the others stay out.
    let back = CatalogueDelta {
        version: 9,
        rows: delta_from(&engine, &retired[..1], ItemOp::Upsert, true).rows,
    };
    assert_eq!(
        answers(&compacted.with_catalogue(&back).unwrap(), 20),
        without(&retired[..1])
    );
    // Compacted again: the retired list carries over, less the item offered again.
    let again = write_compacted(&compacted, &back, &tmp.path().join("again")).unwrap();
    assert_eq!(again.kept_retired().len(), 3);
    assert_eq!(
        again
            .manifest
            .catalogue
            .as_ref()
            .unwrap()
            .from_engine_sha256,
        compacted.weights_sha256()
    );
    assert_eq!(answers(&again, 20), without(&retired[..1]));
}

/// An engine converted with item attributes and popularity counts: the compacted engine's sets
/// and counts cover the new items (in no set, no interactions), and filtered and empty-history
/// answers are those of the engine with the delta.
#[test]
fn item_sets_and_popularity_grow_over_the_new_items() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = ModelKind::Gru4rec;
    let item_map = model_dir(kind).join("item_id_map.tsv");
    let ids = recsys_engine::ItemMapSource::Tsv(&item_map)
        .read(u64::MAX)
        .unwrap();
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let mut log = String::from("user_id:token\titem_id:token\n");
    for (u, case) in cases.iter().enumerate() {
        for item in &case.history {
            log.push_str(&format!("{u}\t{item}\n"));
        }
    }
    let log_path = tmp.path().join("log.inter");
    std::fs::write(&log_path, log).unwrap();
    let counted = Popularity::count_file(&log_path, None, &ids).unwrap();
    let table = AttributeTable {
        columns: vec!["shelf".into()],
        rows: (1..=2000u32)
            .map(|i| {
                let id = match ids.external(i).unwrap() {
                    ExternalId::Int(v) => v.to_string(),
                    ExternalId::Str(s) => s,
                };
                (id, vec![vec![["a", "b", "c"][i as usize % 3].to_string()]])
            })
            .collect(),
    };
    let engine = common::convert_fixture_with(
        kind,
        &tmp.path().join("engine"),
        Precision::Fp32,
        Screen::None,
        CatalogueInputs {
            item_attributes: Some(&table),
            popularity: Some(&counted),
        },
    )
    .unwrap();
    // Five new items with the rows of the five most popular (they score as high).
    let popular = popular_items(&engine, 5);
    let mut delta = delta_from(&engine, &popular, ItemOp::Upsert, true);
    for (n, row) in delta.rows.iter_mut().enumerate() {
        row.id = ExternalId::Int(NEW_IDS + n as i64);
    }
    delta.version = 3;
    let with_delta = engine.with_catalogue(&delta).unwrap();
    let compacted = write_compacted(&engine, &delta, &tmp.path().join("compacted")).unwrap();
    assert_eq!(compacted.n_items(), 2005);
    let popularity = compacted.popularity.as_ref().unwrap();
    assert_eq!(popularity.total(), counted.0.total());
    assert_eq!(popularity.count(2001), 0);

    let filter = ItemFilter {
        include: vec!["shelf=a".into()],
        exclude: vec![],
    };
    let ask = |engine: &Engine, history: &[&str], filter: Option<&ItemFilter>| {
        let request = Request {
            history: ExternalIds::Str(history),
            k: Some(30),
            exclude: None,
            candidates: None,
            embedding: false,
            filter,
            times: None,
        };
        engine.recommend(&[request], &ServeOptions::default())[0]
            .as_ref()
            .unwrap()
            .items
            .iter()
            .map(|s| (engine.external_id(s.index).unwrap(), s.score))
            .collect::<Vec<_>>()
    };
    let history: Vec<&str> = cases[0].history.iter().map(String::as_str).collect();
    for (what, history, filter) in [
        ("plain", &history[..], None),
        ("filtered", &history[..], Some(&filter)),
        ("empty history", &[][..], None),
        ("empty history, filtered", &[][..], Some(&filter)),
    ] {
        let want = ask(&with_delta, history, filter);
        assert_eq!(ask(&compacted, history, filter), want, "{what}");
        if filter.is_none() && !history.is_empty() {
            // The new items (rows of the most popular) rank; in no set, a filter drops them.
            assert!(want.iter().any(|(id, _)| *id == ExternalId::Int(NEW_IDS)));
        }
        if filter.is_some() {
            assert!(
                want.iter()
                    .all(|(id, _)| !matches!(id, ExternalId::Int(i) if *i >= NEW_IDS)),
                "{what}: {want:?}"
            );
        }
    }
}

/// Ids of the new items: above every fixture id.
const NEW_IDS: i64 = 90_000_000;

/// The retired list is part of the engine: changed, or left out of the manifest, the engine is
/// refused at load, naming the file.
#[test]
fn a_damaged_retired_list_is_refused_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = common::convert_fixture(
        ModelKind::Bert4rec,
        "model.safetensors",
        &tmp.path().join("bert4rec"),
    );
    let retired = popular_items(&engine, 2);
    let delta = delta_from(&engine, &retired, ItemOp::Retire, false);
    let out = tmp.path().join("compacted");
    write_compacted(&engine, &delta, &out).unwrap();

    let list = out.join(RETIRED_ITEMS_FILE);
    let original = std::fs::read_to_string(&list).unwrap();
    assert_eq!(original.lines().count(), 2);
    // One item swapped for another of the same length: only the checksum tells.
    let first = original.lines().next().unwrap();
    let other = engine.external_id(1).unwrap().to_string();
    std::fs::write(
        &list,
        original.replacen(first, &format!("{other:0>width$}", width = first.len()), 1),
    )
    .unwrap();
    let e = Engine::load(&out)
        .err()
        .expect("a changed list is refused")
        .to_string();
    assert!(e.contains(RETIRED_ITEMS_FILE), "{e}");
    std::fs::write(&list, &original).unwrap();
    Engine::load(&out).unwrap();

    // The manifest no longer lists the file: its catalogue record still says two are retired.
    let manifest_path = out.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path).unwrap();
    let mut manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    manifest["files"]
        .as_object_mut()
        .unwrap()
        .remove(RETIRED_ITEMS_FILE);
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    let e = Engine::load(&out)
        .err()
        .expect("an unlisted list is refused")
        .to_string();
    assert!(
        e.contains("keeps 2 item(s) retired") && e.contains(RETIRED_ITEMS_FILE),
        "{e}"
    );
}
