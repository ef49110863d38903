//! Attribute filters inside the top-k: for every model kind, at every precision, screened and
//! not, with random include/exclude filters, exclusions, seen items and candidate lists, the
//! answer is exactly a full sort of the model's whole score vector over the items the filter
//! keeps, where "keeps" is computed here from the attribute table itself (plain sets, not the
//! engine's bitmaps); an unknown set name is refused naming it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use recsys_engine::engine_dir::{Precision, Screen};
use recsys_engine::topk::{rank_order, Scored};
use recsys_engine::{
    AttributeTable, CatalogueInputs, Engine, ExternalIds, ItemFilter, ModelKind, Request,
    ServeOptions,
};

const CATEGORIES: [&str; 8] = [
    "shoes", "hats", "bags", "socks", "coats", "belts", "toys", "pens",
];
const REGIONS: [&str; 3] = ["EU", "US", "APAC"];

/// A table over the catalogue's external ids (and a few ids it does not know): a category for
/// most items, one or two regions, an `adult` flag for some.
fn attribute_table(engine: &Engine, rng: &mut Rng) -> AttributeTable {
    let mut rows = Vec::new();
    for i in 1..=engine.n_items() as u32 {
        let id = match engine.external_id(i).unwrap() {
            recsys_engine::ExternalId::Int(v) => v.to_string(),
            recsys_engine::ExternalId::Str(s) => s,
        };
        let category = if rng.below(10) == 0 {
            vec![] // no category
        } else {
            // Skewed: the first categories are common, the last ones rare (1-2 % of items).
            let c = (rng.below(64) as f64).sqrt() as usize;
            vec![CATEGORIES[c].to_string()]
        };
        let mut regions = vec![REGIONS[rng.below(3) as usize].to_string()];
        if rng.below(3) == 0 {
            regions.push(REGIONS[rng.below(3) as usize].to_string());
        }
        let adult = if rng.below(20) == 0 {
            vec!["yes".to_string()]
        } else {
            vec![]
        };
        rows.push((id, vec![category, regions, adult]));
    }
    rows.push((
        "no-such-item".into(),
        vec![vec!["shoes".into()], vec![], vec![]],
    ));
    AttributeTable {
        columns: vec!["category".into(), "region".into(), "adult".into()],
        rows,
    }
}

/// The items of `table` a filter keeps, from the table's own rows.
fn kept_by_table(engine: &Engine, table: &AttributeTable, filter: &ItemFilter) -> BTreeSet<u32> {
    let has = |values: &[Vec<String>], name: &str| {
        let (column, value) = name.split_once('=').unwrap();
        let c = table.columns.iter().position(|x| x == column).unwrap();
        values[c].iter().any(|v| v == value)
    };
    let mut by_column: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for name in &filter.include {
        by_column
            .entry(name.split_once('=').unwrap().0)
            .or_default()
            .push(name);
    }
    let mut kept = BTreeSet::new();
    for (id, values) in &table.rows {
        let Some(index) = engine.ids.index_of_str(id) else {
            continue;
        };
        let included = by_column
            .values()
            .all(|names| names.iter().any(|n| has(values, n)));
        let excluded = filter.exclude.iter().any(|n| has(values, n));
        if included && !excluded {
            kept.insert(index);
        }
    }
    // Items the table does not list carry no attribute: an include filter never keeps them, an
    // exclude-only filter does.
    if filter.include.is_empty() {
        let listed: BTreeSet<u32> = table
            .rows
            .iter()
            .filter_map(|(id, _)| engine.ids.index_of_str(id))
            .collect();
        kept.extend((1..=engine.n_items() as u32).filter(|i| !listed.contains(i)));
    }
    kept
}

fn random_filter(rng: &mut Rng) -> ItemFilter {
    let mut filter = ItemFilter::default();
    match rng.below(6) {
        0 => {}
        1 => filter.include.push(format!("category={}", CATEGORIES[7])), // ~1.5 %
        2 => {
            filter
                .include
                .push(format!("category={}", CATEGORIES[rng.below(8) as usize]));
            filter
                .include
                .push(format!("category={}", CATEGORIES[rng.below(8) as usize]));
            filter
                .include
                .push(format!("region={}", REGIONS[rng.below(3) as usize]));
        }
        3 => filter.exclude.push("adult=yes".into()),
        4 => {
            filter
                .include
                .push(format!("region={}", REGIONS[rng.below(3) as usize]));
            filter.exclude.push("adult=yes".into());
            filter.exclude.push(format!("category={}", CATEGORIES[0]));
        }
        _ => {
            filter.include.push(format!("category={}", CATEGORIES[6]));
            filter.include.push("adult=yes".into()); // often nothing at all
        }
    }
    filter
}

fn convert_with(
    kind: ModelKind,
    table: &AttributeTable,
    out: &std::path::Path,
    precision: Precision,
    screen: Screen,
) -> Engine {
    let catalogue = CatalogueInputs {
        item_attributes: Some(table),
        popularity: None,
    };
    convert_fixture_with(kind, out, precision, screen, catalogue)
        .unwrap_or_else(|e| panic!("{kind} {precision:?} {screen:?}: {e}"))
}

#[test]
fn filtered_top_k_is_the_full_sort_over_the_kept_items_for_every_kind_and_precision() {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        let plain = convert_fixture(kind, "model.safetensors", &tmp.path().join("plain"));
        let mut rng = Rng(0xF117_E125 ^ plain.n_items() as u64);
        let table = attribute_table(&plain, &mut rng);
        let variants = [
            ("fp32", Precision::Fp32, Screen::None),
            ("fp16", Precision::Fp16, Screen::None),
            ("bf16", Precision::Bf16, Screen::None),
            ("int8", Precision::Int8, Screen::None),
            ("fp32+screen", Precision::Fp32, Screen::Int8),
            ("fp16+screen", Precision::Fp16, Screen::Int8),
        ];
        for (name, precision, screen) in variants {
            let mut engine = convert_with(kind, &table, &tmp.path().join(name), precision, screen);
            let n = engine.n_items();
            // Requests in external ids, so the engine's own mapping and filter resolution run.
            let mut requests_data = Vec::new();
            for (i, case) in cases.iter().take(40).enumerate() {
                let filter = random_filter(&mut rng);
                let k = [1usize, 10, 100, 5000][i % 4];
                let exclude: Vec<String> = (0..rng.below(40))
                    .map(|_| engine_id(&engine, 1 + rng.below(n as u64) as u32))
                    .collect();
                let candidates: Option<Vec<String>> = (i % 5 == 4).then(|| {
                    (0..1 + rng.below(400))
                        .map(|_| engine_id(&engine, 1 + rng.below(n as u64) as u32))
                        .collect()
                });
                requests_data.push((case.history.clone(), k, exclude, candidates, filter));
            }
            let options = ServeOptions::default();
            for threads in [1, 2] {
                engine.set_threads(threads);
                let refs: Vec<Vec<Vec<&str>>> = requests_data
                    .iter()
                    .map(|(h, _, e, c, _)| {
                        vec![
                            h.iter().map(String::as_str).collect(),
                            e.iter().map(String::as_str).collect(),
                            c.iter().flatten().map(String::as_str).collect(),
                        ]
                    })
                    .collect();
                let requests: Vec<Request> = requests_data
                    .iter()
                    .zip(&refs)
                    .map(|((_, k, _, c, filter), r)| Request {
                        history: ExternalIds::Str(&r[0]),
                        k: Some(*k as i64),
                        exclude: Some(ExternalIds::Str(&r[1])),
                        candidates: c.as_ref().map(|_| ExternalIds::Str(&r[2])),
                        embedding: false,
                        filter: Some(filter),
                        times: None,
                    })
                    .collect();
                let answers = engine.recommend(&requests, &options);
                for (r, (answer, (history, k, exclude, candidates, filter))) in
                    answers.iter().zip(&requests_data).enumerate()
                {
                    let answer = match answer {
                        Ok(a) => a,
                        // A sequential model needs one known history item; the fixture's test
                        // set always has one.
                        Err(e) => panic!("{kind} {name} row {r}: {e}"),
                    };
                    let internal = |ids: &[String]| -> Vec<u32> {
                        ids.iter()
                            .filter_map(|i| engine.ids.index_of_str(i))
                            .collect()
                    };
                    let hist = internal(history);
                    let scores = engine.score_all(&[hist.as_slice()]);
                    let mut allowed = kept_by_table(&engine, &table, filter);
                    if let Some(c) = candidates {
                        let c: BTreeSet<u32> = internal(c).into_iter().collect();
                        allowed.retain(|i| c.contains(i));
                    }
                    for i in internal(exclude).into_iter().chain(hist.iter().copied()) {
                        allowed.remove(&i);
                    }
                    let mut want: Vec<Scored> = allowed
                        .iter()
                        .map(|&i| Scored {
                            index: i,
                            score: scores[i as usize],
                        })
                        .collect();
                    want.sort_by(rank_order);
                    want.truncate((*k).min(n));
                    assert_eq!(
                        answer.items, want,
                        "{kind} {name} row {r} threads {threads} filter {filter:?}"
                    );
                }
            }
        }
    }
}

fn engine_id(engine: &Engine, index: u32) -> String {
    match engine.external_id(index).unwrap() {
        recsys_engine::ExternalId::Int(v) => v.to_string(),
        recsys_engine::ExternalId::Str(s) => s,
    }
}

#[test]
fn unknown_columns_are_refused_naming_them_and_filters_survive_a_reload() {
    let kind = ModelKind::Vaecf;
    let tmp = tempfile::tempdir().unwrap();
    let plain = convert_fixture(kind, "model.safetensors", &tmp.path().join("plain"));
    let table = attribute_table(&plain, &mut Rng(7));
    let dir = tmp.path().join("with-sets");
    let converted = convert_with(kind, &table, &dir, Precision::Fp32, Screen::None);
    let record = converted.manifest.item_attributes.clone().unwrap();
    assert_eq!(record.columns, vec!["adult", "category", "region"]);
    assert_eq!(record.unknown_items, 1);
    let engine = Engine::load(&dir).unwrap();
    let shoes = ask(&engine, &["category=shoes"]).unwrap();
    assert_eq!(shoes.items.len(), 5);
    // A column that does not exist, or a name that is not column=value, is refused naming it; a
    // value of a known column that no item has is an empty set (nothing to recommend).
    for bad in ["colour=red", "category"] {
        let err = ask(&engine, &[bad]).unwrap_err().to_string();
        assert!(err.contains(bad), "{err}");
    }
    assert!(ask(&engine, &["category=boots"]).unwrap().items.is_empty());
    // The same filter again is one cached mask; names in another order share it.
    let before = engine.filters.cached();
    ask(&engine, &["region=EU", "category=shoes"]).unwrap();
    ask(&engine, &["category=shoes", "region=EU", "region=EU"]).unwrap();
    assert_eq!(engine.filters.cached(), before + 1);
    // An engine without attributes says so.
    let err = ask(&plain, &["category=shoes"]).unwrap_err().to_string();
    assert!(err.contains("no item attributes"), "{err}");
}

/// Five items for one Mult-VAE history, keeping `include`.
fn ask(engine: &Engine, include: &[&str]) -> recsys_engine::Result<recsys_engine::Recommendation> {
    let filter = ItemFilter {
        include: include.iter().map(|s| s.to_string()).collect(),
        exclude: vec![],
    };
    engine
        .recommend(
            &[Request {
                history: ExternalIds::Str(&["10011403"]),
                k: Some(5),
                exclude: None,
                candidates: None,
                embedding: false,
                filter: Some(&filter),
                times: None,
            }],
            &ServeOptions::default(),
        )
        .remove(0)
}
