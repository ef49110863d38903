//! `catalogue compact` on a repository: the served engine with its catalogue object becomes the
//! next version, pending, verified first; approved, it takes the old object as folded; a later
//! object for the old engine is refused by it; compacting again needs a delta for the new engine.

use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::engine_dir::Precision;
use recsys_engine::idmap::ExternalId;
use recsys_engine::{fixtures, Engine, ModelKind};
use recsys_registry::catalogue::{self, check, object_key};
use recsys_registry::compact::compact;
use recsys_registry::publish::PublishRequest;
use recsys_registry::release::{self, Fleet};
use recsys_registry::versions;
use recsys_registry::{Repository, Status};

const MODEL: &str = "shop";

/// Item `index`'s `[embedding, bias]` in `engine` (SASRec: no bias, input row tied).
fn vector_of(engine: &Engine, index: u32) -> Vec<f32> {
    let output = engine.model.output();
    let d = output.input_size();
    let mut vector = vec![0f32; d + 1];
    output.weight.add_row_into(index as usize, &mut vector[..d]);
    vector
}

fn row(id: ExternalId, op: ItemOp, vector: Option<Vec<f32>>) -> ItemRow {
    ItemRow {
        id,
        op,
        vector,
        input_vector: None,
    }
}

fn statuses(repo: &Repository) -> Vec<Status> {
    versions::list(repo, MODEL)
        .unwrap()
        .iter()
        .map(|v| v.status)
        .collect()
}

#[test]
fn a_compacted_version_is_published_pending_and_takes_the_folded_object_once_approved() {
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = tmp.path().join("engine");
    let engine = fixtures::convert(
        ModelKind::Sasrec,
        "model.safetensors",
        &engine_dir,
        Precision::Fp32,
    )
    .unwrap();
    let repo = Repository::open(tmp.path().join("repo").to_str().unwrap()).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let err = compact(&repo, MODEL, Some(1), scratch.path(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains(MODEL), "{err}");
    release::publish_and_approve(
        &repo,
        &PublishRequest {
            model: MODEL,
            engine_dir: &engine_dir,
            approve: true,
            metrics: None,
            eval_set: None,
        },
        32,
        &Fleet::none(),
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap();
    let err = compact(&repo, MODEL, None, scratch.path(), &mut |_, _| {}).unwrap_err();
    assert!(
        err.to_string().contains("no catalogue object to compact"),
        "{err}"
    );

    // A new item (item 9's rows), item 3 with item 4's rows, items 1 and 2 retired.
    let delta = CatalogueDelta {
        version: 0,
        rows: vec![
            row(
                ExternalId::Int(90_000_000),
                ItemOp::Upsert,
                Some(vector_of(&engine, 9)),
            ),
            row(
                engine.external_id(3).unwrap(),
                ItemOp::Upsert,
                Some(vector_of(&engine, 4)),
            ),
            row(engine.external_id(1).unwrap(), ItemOp::Retire, None),
            row(engine.external_id(2).unwrap(), ItemOp::Retire, None),
        ],
    };
    let served = catalogue::load_engine(&repo, MODEL, 1, scratch.path()).unwrap();
    let published = catalogue::publish(&repo, MODEL, &served, 1, delta, None).unwrap();
    assert_eq!(published.version, 1);

    let done = compact(&repo, MODEL, None, scratch.path(), &mut |_, _| {}).unwrap();
    assert_eq!(
        (
            done.from_version,
            done.catalogue_version,
            done.version,
            done.added,
            done.replaced,
            done.retired,
            done.items,
            done.verified_histories,
            done.weights_changed
        ),
        (1, 1, 2, 1, 1, 2, 2001, 64, true)
    );
    assert_eq!(statuses(&repo), [Status::Approved, Status::Pending]);
    let info = versions::list(&repo, MODEL).unwrap().pop().unwrap();
    assert_eq!(
        info.metrics.unwrap()["compacted_from"]["catalogue_version"],
        1
    );
    // Nothing serves it yet: the servers still load version 1 and apply the object.
    assert_eq!(catalogue::served_version(&repo, MODEL).unwrap(), 1);

    release::approve(&repo, MODEL, 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
    assert_eq!(catalogue::served_version(&repo, MODEL).unwrap(), 2);
    let new_engine = catalogue::load_engine(&repo, MODEL, 2, scratch.path()).unwrap();
    let object = repo.read(&object_key(MODEL)).unwrap().unwrap();
    let taken = check(&new_engine, &object.bytes).unwrap();
    assert_eq!((taken.version, taken.rows.len()), (1, 0), "taken as folded");
    // The old engine with the object and the new engine alone answer alike.
    let old_with_delta = served
        .with_catalogue(&check(&served, &object.bytes).unwrap())
        .unwrap();
    let ask = |engine: &Engine| {
        let history = [
            engine.external_id(5).unwrap(),
            engine.external_id(7).unwrap(),
        ];
        let ids: Vec<i64> = history
            .iter()
            .map(|id| match id {
                ExternalId::Int(i) => *i,
                ExternalId::Str(_) => unreachable!(),
            })
            .collect();
        let request = recsys_engine::Request {
            history: recsys_engine::ExternalIds::Int(&ids),
            k: Some(2001),
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: None,
        };
        engine.recommend(&[request], &Default::default())[0]
            .as_ref()
            .unwrap()
            .items
            .iter()
            .map(|s| (engine.external_id(s.index).unwrap(), s.score.to_bits()))
            .collect::<Vec<_>>()
    };
    let answer = ask(&new_engine);
    assert_eq!(answer, ask(&old_with_delta));
    assert_eq!(
        answer.len(),
        1997,
        "2001 items less the two retired and the two seen"
    );

    // Compacting again: the object is the one this version folded.
    let err = compact(&repo, MODEL, None, scratch.path(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("nothing to fold"), "{err}");

    // A delta published for the new version: compacted into version 3, un-retiring item 1.
    let next = CatalogueDelta {
        version: 0,
        rows: vec![row(
            engine.external_id(1).unwrap(),
            ItemOp::Upsert,
            Some(vector_of(&engine, 1)),
        )],
    };
    let published = catalogue::publish(&repo, MODEL, &new_engine, 2, next, None).unwrap();
    assert_eq!(published.version, 2);
    let again = compact(&repo, MODEL, None, scratch.path(), &mut |_, _| {}).unwrap();
    assert_eq!(
        (
            again.from_version,
            again.catalogue_version,
            again.version,
            again.retired
        ),
        (2, 2, 3, 1)
    );
    // The object for version 2 is not for version 1's engine.
    let err = compact(&repo, MODEL, Some(1), scratch.path(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("--engine-version"), "{err}");
}
