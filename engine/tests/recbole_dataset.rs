//! The item map from the files RecBole itself saved (`save_dataset`, `save_dataloaders`), read as
//! data, against RecBole's own `field2id_token` taken from the live Dataset (the golden JSON beside
//! the files), and a conversion with it against the same conversion with the hand-made TSV.

use std::path::{Path, PathBuf};

use recsys_engine::import::recbole_dataset::read_item_tokens;
use recsys_engine::{ConvertRequest, EngineError, InternalRequest, ItemMapSource, ModelKind};

const LIMIT: u64 = 1 << 30;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn golden(name: &str) -> Vec<String> {
    let path = fixtures().join(format!("recbole_dataset/{name}.field2id_token.json"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(json["iid_field"], "item_id");
    let tokens: Vec<String> = json["field2id_token"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(tokens[0], "[PAD]");
    tokens[1..].to_vec()
}

#[test]
fn a_saved_dataset_gives_recboles_own_item_tokens() {
    let path = fixtures().join("recbole_dataset/recsys-demo-Dataset.pth");
    let tokens = read_item_tokens(&path, LIMIT).unwrap();
    assert_eq!(tokens.len(), 2000);
    assert_eq!(tokens, golden("recsys-demo"));
}

#[test]
fn saved_dataloaders_give_recboles_own_item_tokens() {
    let path = fixtures().join("recbole_dataset/recsys-demo-sample-for-MultiVAE-dataloader.pth");
    let tokens = read_item_tokens(&path, LIMIT).unwrap();
    assert_eq!(tokens.len(), 1960);
    assert_eq!(tokens, golden("recsys-demo-sample"));
}

#[test]
fn converting_with_the_saved_dataset_equals_converting_with_the_tsv() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join("sasrec");
    let convert = |items: ItemMapSource<'_>, out: &Path| {
        recsys_engine::convert(&ConvertRequest {
            kind: None,
            checkpoint: &model.join("recbole_checkpoint.pth"),
            config: None,
            item_map: items,
            out,
            precision: recsys_engine::engine_dir::Precision::Fp32,
            calibration: None,
            calibration_times: None,
            screen: Default::default(),
            w8a8_layers: Default::default(),
            catalogue: Default::default(),
        })
        .unwrap()
    };
    let saved = fixtures().join("recbole_dataset/recsys-demo-Dataset.pth");
    let from_saved = convert(
        ItemMapSource::RecboleDataset(&saved),
        &dir.path().join("saved"),
    );
    let from_tsv = convert(
        ItemMapSource::Tsv(&model.join("item_id_map.tsv")),
        &dir.path().join("tsv"),
    );
    assert_eq!(from_saved.kind(), ModelKind::Sasrec);
    // Every file of the two engines (weights, item ids, kernels) has the same bytes.
    assert_eq!(from_saved.manifest.files, from_tsv.manifest.files);
    let requests: Vec<InternalRequest> = (0..20u32)
        .map(|u| InternalRequest {
            history: (0..3 + u).map(|i| 1 + (u * 131 + i * 17) % 2000).collect(),
            k: 20,
            exclude_seen: true,
            ..Default::default()
        })
        .collect();
    assert_eq!(
        from_saved.recommend_internal(&requests),
        from_tsv.recommend_internal(&requests)
    );
}

#[test]
fn files_that_are_not_a_saved_recbole_dataset_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let saved = std::fs::read(fixtures().join("recbole_dataset/recsys-demo-Dataset.pth")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated.pth",
            saved[..saved.len() / 2].to_vec(),
            "truncated",
        ),
        (
            "checkpoint.pth",
            std::fs::read(fixtures().join("sasrec/recbole_checkpoint.pth")).unwrap(),
            "zip archive",
        ),
        (
            "items.tsv",
            std::fs::read(fixtures().join("multivae/item_id_map.tsv")).unwrap(),
            "not a pickle",
        ),
    ];
    for (name, bytes, needle) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let error = read_item_tokens(&path, LIMIT).unwrap_err();
        assert!(matches!(error, EngineError::IdMap { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains(needle) && message.contains(name),
            "{message}"
        );
    }
    let too_big = read_item_tokens(
        &fixtures().join("recbole_dataset/recsys-demo-Dataset.pth"),
        1000,
    )
    .unwrap_err()
    .to_string();
    assert!(too_big.contains("more than the limit of 1000"), "{too_big}");
}
