//! Checkpoint import: the three formats agree, and every kind of bad input gets an error that names
//! the problem.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use recsys_engine::engine_dir::{Manifest, MANIFEST_FILE, WEIGHTS_FILE};
use recsys_engine::{convert, ConvertRequest, Engine, EngineError, ModelKind};

fn manifest(dir: &Path) -> Manifest {
    serde_json::from_str(&std::fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap()).unwrap()
}

#[test]
fn pt_safetensors_and_recbole_give_identical_engines() {
    let tmp = tempfile::tempdir().unwrap();
    let mut weight_hashes = BTreeMap::new();
    for file in ["model.safetensors", "model.pt", "recbole_checkpoint.pth"] {
        let out = tmp.path().join(file);
        convert_fixture(ModelKind::Bert4rec, file, &out);
        weight_hashes.insert(file, manifest(&out).files[WEIGHTS_FILE].sha256.clone());
    }
    let distinct: std::collections::BTreeSet<_> = weight_hashes.values().collect();
    assert_eq!(distinct.len(), 1, "engines differ: {weight_hashes:?}");
}

#[test]
fn recbole_checkpoint_carries_its_own_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(ModelKind::Bert4rec);
    let engine = convert_kind(
        Some(ModelKind::Bert4rec),
        &dir.join("recbole_checkpoint.pth"),
        &tmp.path().join("e"),
    )
    .unwrap();
    let from_json = convert_fixture(ModelKind::Bert4rec, "model.pt", &tmp.path().join("f"));
    assert_eq!(engine.manifest.model, from_json.manifest.model);
    assert_eq!(
        engine.manifest.source.format,
        recsys_engine::import::CheckpointFormat::Recbole
    );
}

#[test]
fn plain_state_dict_needs_a_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(ModelKind::Bert4rec);
    let err = convert_kind(
        Some(ModelKind::Bert4rec),
        &dir.join("model.pt"),
        &tmp.path().join("e"),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("--config"), "{err}");
}

/// The fixture's BERT4Rec tensors as (dtype, shape, bytes), to be altered and re-saved.
type Raw = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn fixture_tensors() -> Raw {
    let bytes = std::fs::read(model_dir(ModelKind::Bert4rec).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn save(raw: &Raw, path: &Path) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = raw
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

fn convert_file(
    path: &Path,
    config: serde_json::Map<String, serde_json::Value>,
) -> Result<Engine, EngineError> {
    let out = path.with_extension("engine");
    convert(&ConvertRequest {
        kind: Some(ModelKind::Bert4rec),
        checkpoint: path,
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(
            &model_dir(ModelKind::Bert4rec).join("item_id_map.tsv"),
        ),
        out: &out,
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
}

fn convert_altered(alter: impl FnOnce(&mut Raw)) -> EngineError {
    let tmp = tempfile::tempdir().unwrap();
    let mut raw = fixture_tensors();
    alter(&mut raw);
    let path = tmp.path().join("altered.safetensors");
    save(&raw, &path);
    convert_file(&path, config_json(ModelKind::Bert4rec))
        .err()
        .expect("conversion must fail")
}

#[test]
fn missing_tensor_is_named() {
    let err = convert_altered(|raw| {
        raw.remove("trm_encoder.layer.1.feed_forward.dense_2.bias");
    });
    assert!(
        matches!(&err, EngineError::MissingTensor { name } if name == "trm_encoder.layer.1.feed_forward.dense_2.bias"),
        "{err}"
    );
}

#[test]
fn shape_mismatch_names_expected_and_found() {
    let err = convert_altered(|raw| {
        let t = raw.get_mut("output_ffn.weight").unwrap();
        t.1 = vec![32, 128];
    });
    let msg = err.to_string();
    assert!(matches!(err, EngineError::ShapeMismatch { .. }), "{msg}");
    assert!(
        msg.contains("output_ffn.weight") && msg.contains("[32, 128]") && msg.contains("[64, 64]"),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype_is_refused() {
    let err = convert_altered(|raw| {
        let t = raw.get_mut("output_bias").unwrap();
        t.0 = safetensors::Dtype::I32;
    });
    assert!(
        matches!(&err, EngineError::UnsupportedDtype { name, dtype } if name == "output_bias" && dtype == "I32"),
        "{err}"
    );
}

#[test]
fn half_precision_checkpoints_are_widened() {
    let tmp = tempfile::tempdir().unwrap();
    let mut raw = fixture_tensors();
    for (dtype, _, bytes) in raw.values_mut() {
        let halves: Vec<u8> = bytes
            .chunks_exact(4)
            .flat_map(|c| {
                half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
            })
            .collect();
        *dtype = safetensors::Dtype::F16;
        *bytes = halves;
    }
    let path = tmp.path().join("half.safetensors");
    save(&raw, &path);
    let engine = convert_file(&path, config_json(ModelKind::Bert4rec)).unwrap();
    let full = convert_fixture(
        ModelKind::Bert4rec,
        "model.safetensors",
        &tmp.path().join("full"),
    );
    let (a, b) = (
        engine.score_all(&[&[1, 2, 3]]),
        full.score_all(&[&[1, 2, 3]]),
    );
    let max = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(max < 0.1, "fp16 weights should stay close to fp32: {max}");
}

#[test]
fn non_finite_weight_is_located() {
    let err = convert_altered(|raw| {
        let t = raw.get_mut("position_embedding.weight").unwrap();
        t.2[4 * 7..4 * 8].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    assert!(
        matches!(&err, EngineError::NonFiniteWeight { name, index: 7 } if name == "position_embedding.weight"),
        "{err}"
    );
}

#[test]
fn config_contradicting_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = model_dir(ModelKind::Bert4rec).join("model.safetensors");
    let local = tmp.path().join("m.safetensors");
    std::fs::copy(&path, &local).unwrap();
    for (key, value, needle) in [
        ("hidden_size", serde_json::json!(128), "hidden_size = 128"),
        ("max_seq_length", serde_json::json!(200), "max_len = 200"),
        ("n_heads", serde_json::json!(3), "does not divide"),
        ("n_layers", serde_json::json!(3), "trm_encoder.layer.2"),
        ("n_real_items", serde_json::json!(10), "n_items = 10"),
        ("hidden_act", serde_json::json!("relu"), "not supported"),
    ] {
        let mut config = config_json(ModelKind::Bert4rec);
        config.insert(key.into(), value);
        let err = convert_file(&local, config).err().expect("must fail");
        assert!(err.to_string().contains(needle), "{key}: {err}");
    }
    let mut config = config_json(ModelKind::Bert4rec);
    config.remove("n_heads");
    let err = convert_file(&local, config).err().unwrap();
    assert!(err.to_string().contains("n_heads"), "{err}");
}

#[test]
fn vaecf_config_contradicting_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = config_json(ModelKind::Vaecf);
    config.insert("mlp_hidden_size".into(), serde_json::json!([300]));
    let dir = model_dir(ModelKind::Vaecf);
    let err = convert(&ConvertRequest {
        kind: Some(ModelKind::Vaecf),
        checkpoint: &dir.join("model.safetensors"),
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(&dir.join("item_id_map.tsv")),
        out: &tmp.path().join("e"),
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("mlp_hidden_size = [300]"), "{err}");
    // A BERT4Rec checkpoint handed in as VAE-CF is missing VAE-CF's first tensor.
    let err = convert(&ConvertRequest {
        kind: Some(ModelKind::Vaecf),
        checkpoint: &model_dir(ModelKind::Bert4rec).join("model.pt"),
        config: Some(&config_json(ModelKind::Bert4rec)),
        item_map: recsys_engine::ItemMapSource::Tsv(&dir.join("item_id_map.tsv")),
        out: &tmp.path().join("f"),
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
    .err()
    .unwrap();
    assert!(
        matches!(&err, EngineError::MissingTensor { name } if name == "encoder.0.weight"),
        "{err}"
    );
}

fn checkpoint_error(bytes: &[u8], name: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    let err = convert_file(&path, config_json(ModelKind::Bert4rec))
        .err()
        .expect("must fail");
    assert!(matches!(err, EngineError::Checkpoint { .. }), "{err}");
    err.to_string()
}

#[test]
fn truncated_and_corrupted_files_are_reported() {
    let dir = model_dir(ModelKind::Bert4rec);
    for file in ["model.pt", "recbole_checkpoint.pth", "model.safetensors"] {
        let bytes = std::fs::read(dir.join(file)).unwrap();
        // Cut anywhere: the header, the middle of the tensor data, just before the end.
        for cut in [20, bytes.len() / 2, bytes.len() - 30] {
            let msg = checkpoint_error(&bytes[..cut], file);
            assert!(msg.contains(file), "{msg}");
        }
        // Flip bytes in the middle (tensor data in a zip is CRC-checked; safetensors is not, but
        // flipping its header length makes it unreadable).
        let mut corrupted = bytes.clone();
        if file.ends_with(".safetensors") {
            corrupted[3] ^= 0x40;
        } else {
            let mid = corrupted.len() / 2;
            corrupted[mid] ^= 0xff;
        }
        checkpoint_error(&corrupted, file);
    }
    let msg = checkpoint_error(b"hello, this is not a model", "x.pt");
    assert!(msg.contains("not a safetensors file"), "{msg}");
    let msg = checkpoint_error(b"\x80\x02}q\x00.", "legacy.pt");
    assert!(msg.contains("legacy"), "{msg}");
}

#[test]
fn zip_without_state_dict_is_refused() {
    // A torch.save of a plain list: no tensors anywhere.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("list.pt");
    let file = std::fs::File::create(&path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("archive/data.pkl", opts).unwrap();
    std::io::Write::write_all(&mut zip, b"\x80\x02]q\x00(K\x01K\x02e.").unwrap();
    zip.finish().unwrap();
    let err = convert_file(&path, config_json(ModelKind::Bert4rec))
        .err()
        .unwrap();
    assert!(err.to_string().contains("no state dict"), "{err}");
}

#[test]
fn engine_load_verifies_checksums_and_format() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("engine");
    convert_fixture(ModelKind::Bert4rec, "model.safetensors", &out);

    // A flipped byte in the weights.
    let weights = out.join(WEIGHTS_FILE);
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, &bytes).unwrap();
    let err = Engine::load(&out).err().unwrap();
    assert!(matches!(err, EngineError::Checksum { .. }), "{err}");
    // Truncated weights.
    std::fs::write(&weights, &bytes[..100]).unwrap();
    let err = Engine::load(&out).err().unwrap();
    assert!(err.to_string().contains("truncated"), "{err}");

    // A future format version.
    convert_fixture(ModelKind::Bert4rec, "model.safetensors", &out);
    let text = std::fs::read_to_string(out.join(MANIFEST_FILE)).unwrap();
    std::fs::write(
        out.join(MANIFEST_FILE),
        text.replace("\"format_version\": 1", "\"format_version\": 99"),
    )
    .unwrap();
    let err = Engine::load(&out).err().unwrap();
    assert!(
        err.to_string()
            .contains("format version 99 is not supported"),
        "{err}"
    );

    // Missing pieces.
    convert_fixture(ModelKind::Bert4rec, "model.safetensors", &out);
    std::fs::remove_file(out.join("item_ids.tsv")).unwrap();
    assert!(matches!(
        Engine::load(&out).err().unwrap(),
        EngineError::NotFound { .. }
    ));
    assert!(matches!(
        Engine::load(&tmp.path().join("nope")).err().unwrap(),
        EngineError::NotFound { .. }
    ));
}

fn convert_kind(
    kind: Option<ModelKind>,
    checkpoint: &Path,
    out: &Path,
) -> Result<recsys_engine::Engine, EngineError> {
    let dir = model_dir(ModelKind::Bert4rec);
    convert(&ConvertRequest {
        kind,
        checkpoint,
        config: None,
        item_map: recsys_engine::ItemMapSource::Tsv(&dir.join("item_id_map.tsv")),
        out,
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
}

#[test]
fn a_recbole_checkpoint_names_its_own_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let recbole = model_dir(ModelKind::Bert4rec).join("recbole_checkpoint.pth");
    // No kind asked: the checkpoint's config says BERT4Rec.
    let inferred = convert_kind(None, &recbole, &tmp.path().join("a")).unwrap();
    let asked = convert_kind(Some(ModelKind::Bert4rec), &recbole, &tmp.path().join("b")).unwrap();
    assert_eq!(inferred.kind(), ModelKind::Bert4rec);
    assert_eq!(inferred.manifest.model, asked.manifest.model);
    // A kind contradicting the checkpoint's own is refused, naming both and the fix.
    let err = convert_kind(Some(ModelKind::Vaecf), &recbole, &tmp.path().join("c"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("RecBole BERT4Rec checkpoint") && err.contains("--kind bert4rec"),
        "{err}"
    );
    // A plain state dict says nothing of its model.
    let err = convert_kind(
        None,
        &model_dir(ModelKind::Bert4rec).join("model.pt"),
        &tmp.path().join("d"),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("pass --kind bert4rec, vaecf, sasrec, gru4rec or hstu"),
        "{err}"
    );
    // SASRec and GRU4Rec checkpoints name theirs too.
    for kind in [ModelKind::Sasrec, ModelKind::Gru4rec] {
        let recbole = model_dir(kind).join("recbole_checkpoint.pth");
        let engine = convert_kind(None, &recbole, &tmp.path().join(kind.as_str())).unwrap();
        assert_eq!(engine.kind(), kind);
    }
    // A SASRec checkpoint converted as BERT4Rec is refused before its shapes are read.
    let sasrec = model_dir(ModelKind::Sasrec).join("recbole_checkpoint.pth");
    let err = convert_kind(Some(ModelKind::Bert4rec), &sasrec, &tmp.path().join("e"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("RecBole SASRec checkpoint") && err.contains("--kind sasrec"),
        "{err}"
    );
}

/// The fixture tensors of `kind`, altered, saved and converted with its config (itself altered).
fn convert_altered_kind(
    kind: ModelKind,
    dir: &Path,
    alter: impl FnOnce(&mut Raw),
    alter_config: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<Engine, EngineError> {
    let bytes = std::fs::read(model_dir(kind).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut raw: Raw = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    alter(&mut raw);
    let path = dir.join("altered.safetensors");
    save(&raw, &path);
    let mut config = config_json(kind);
    alter_config(&mut config);
    convert(&ConvertRequest {
        kind: Some(kind),
        checkpoint: &path,
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(&model_dir(kind).join("item_id_map.tsv")),
        out: &dir.join("engine"),
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
}

fn f32_tensor(shape: Vec<usize>, seed: u32) -> (safetensors::Dtype, Vec<usize>, Vec<u8>) {
    let n: usize = shape.iter().product();
    let bytes = (0..n as u32)
        .flat_map(|i| {
            let v = ((i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) % 1000) as f32;
            (v / 1000.0 - 0.5).to_le_bytes()
        })
        .collect();
    (safetensors::Dtype::F32, shape, bytes)
}

#[test]
fn sasrec_and_gru4rec_bad_checkpoints_and_configs_are_named() {
    let fails = |kind, alter: &dyn Fn(&mut Raw), config: &dyn Fn(&mut serde_json::Map<_, _>)| {
        let tmp = tempfile::tempdir().unwrap();
        convert_altered_kind(kind, tmp.path(), alter, config)
            .err()
            .expect("conversion must fail")
            .to_string()
    };
    let keep = |_: &mut Raw| {};
    let same = |_: &mut serde_json::Map<String, serde_json::Value>| {};
    // An activation the engine does not run.
    let err = fails(ModelKind::Sasrec, &keep, &|c| {
        c.insert("hidden_act".into(), "relu".into());
    });
    assert!(err.contains("hidden_act") && err.contains("relu"), "{err}");
    // A config contradicting the weights.
    let err = fails(ModelKind::Sasrec, &keep, &|c| {
        c.insert("max_seq_length".into(), 60.into());
    });
    assert!(
        err.contains("max_len = 60") && err.contains("position_embedding.weight"),
        "{err}"
    );
    // A tensor of the wrong shape, named with both shapes.
    let err = fails(
        ModelKind::Sasrec,
        &|raw| {
            raw.insert(
                "trm_encoder.layer.1.multi_head_attention.query.weight".into(),
                f32_tensor(vec![64, 32], 1),
            );
        },
        &same,
    );
    assert!(
        err.contains("trm_encoder.layer.1.multi_head_attention.query.weight")
            && err.contains("64")
            && err.contains("32"),
        "{err}"
    );
    // A BERT4Rec's head in a SASRec checkpoint.
    let err = fails(
        ModelKind::Sasrec,
        &|raw| {
            raw.insert("output_ffn.weight".into(), f32_tensor(vec![64, 64], 2));
        },
        &same,
    );
    assert!(err.contains("BERT4Rec"), "{err}");
    // GRU layer shapes the engine does not run.
    let err = fails(
        ModelKind::Gru4rec,
        &|raw| {
            raw.insert(
                "gru_layers.weight_hh_l0".into(),
                f32_tensor(vec![128, 128], 3),
            );
        },
        &same,
    );
    assert!(
        err.contains("gru_layers.weight_hh_l0") && err.contains("3 x hidden"),
        "{err}"
    );
    let err = fails(
        ModelKind::Gru4rec,
        &|raw| {
            raw.insert(
                "gru_layers.weight_ih_l0_reverse".into(),
                f32_tensor(vec![384, 64], 4),
            );
        },
        &same,
    );
    assert!(err.contains("bidirectional"), "{err}");
    let err = fails(
        ModelKind::Gru4rec,
        &|raw| {
            raw.insert("gru_layers.bias_ih_l0".into(), f32_tensor(vec![384], 5));
        },
        &same,
    );
    assert!(err.contains("gru_layers.bias_hh_l0"), "{err}");
    let err = fails(ModelKind::Gru4rec, &keep, &|c| {
        c.remove("max_seq_length");
    });
    assert!(err.contains("MAX_ITEM_LIST_LENGTH"), "{err}");
    let err = fails(ModelKind::Gru4rec, &keep, &|c| {
        c.insert("hidden_size".into(), 64.into());
    });
    assert!(
        err.contains("hidden_size = 64") && err.contains("128"),
        "{err}"
    );
}

/// GRUs with biases (PyTorch's default, kept by implementations other than RecBole's) convert
/// and run them: every logit against the f64 reference on the same state dict.
#[test]
fn a_gru_with_biases_runs_them() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_altered_kind(
        ModelKind::Gru4rec,
        tmp.path(),
        |raw| {
            raw.insert("gru_layers.bias_ih_l0".into(), f32_tensor(vec![384], 6));
            raw.insert("gru_layers.bias_hh_l0".into(), f32_tensor(vec![384], 7));
        },
        |_| {},
    )
    .unwrap();
    let sd = reference::StateDict::read(&tmp.path().join("altered.safetensors"));
    let history: Vec<u32> = (0..30).map(|i| 1 + (i * 61) % 2000).collect();
    let want = reference::dot_logits(&sd, &reference::gru4rec_hidden(&sd, &history, 50));
    let got = engine.score_all(&[history.as_slice()]);
    let without = convert_fixture(
        ModelKind::Gru4rec,
        "model.safetensors",
        &tmp.path().join("b"),
    )
    .score_all(&[history.as_slice()]);
    let max_diff = got
        .iter()
        .zip(&want)
        .skip(1)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0f64, f64::max);
    assert!(max_diff <= LOGIT_ABS_TOL as f64, "{max_diff}");
    assert!(
        got.iter().zip(&without).any(|(a, b)| (a - b).abs() > 1e-3),
        "the biases change the answer"
    );
}
