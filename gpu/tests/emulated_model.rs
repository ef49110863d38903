//! Whole models on the device path, run through the emulation (tests/emulated): the trained
//! PyTorch/RecBole fixtures (all four models) and the official trainer's HSTU converted at every precision, then [`DeviceModel`] (the CUDA path's own
//! sequencing of the encoder and top-k kernels) against the CPU engine, which the golden tests
//! tie to PyTorch. Histories are the fixture test set's, batched ragged as the server batches them.
//!
//! [`DeviceModel`]: recsys_gpu::model::DeviceModel

mod emulated;
#[path = "common/parity.rs"]
mod parity;

use emulated::EmulatedDevice;
use parity::compare;
use recsys_engine::engine_dir::Precision;
use recsys_engine::ModelKind;

#[test]
fn bert4rec_on_the_device_path_answers_like_the_cpu_engine() {
    compare(
        EmulatedDevice::default(),
        ModelKind::Bert4rec,
        Precision::Fp32,
        "bert4rec-fp32",
        6,
    );
}

#[test]
fn bert4rec_fp16_and_int8_on_the_device_path() {
    compare(
        EmulatedDevice::default(),
        ModelKind::Bert4rec,
        Precision::Fp16,
        "bert4rec-fp16",
        3,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Bert4rec,
        Precision::Int8,
        "bert4rec-int8",
        3,
    );
}

#[test]
fn multvae_on_the_device_path_answers_like_the_cpu_engine_at_every_precision() {
    compare(
        EmulatedDevice::default(),
        ModelKind::Vaecf,
        Precision::Fp32,
        "vaecf-fp32",
        12,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Vaecf,
        Precision::Fp16,
        "vaecf-fp16",
        6,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Vaecf,
        Precision::Int8,
        "vaecf-int8",
        6,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Vaecf,
        Precision::Int8,
        "w8a8",
        6,
    );
}

#[test]
fn sasrec_and_gru4rec_on_the_device_path_answer_like_the_cpu_engine_at_every_precision() {
    for (kind, name) in [
        (ModelKind::Sasrec, "sasrec"),
        (ModelKind::Gru4rec, "gru4rec"),
    ] {
        compare(
            EmulatedDevice::default(),
            kind,
            Precision::Fp32,
            &format!("{name}-fp32"),
            6,
        );
        compare(
            EmulatedDevice::default(),
            kind,
            Precision::Fp16,
            &format!("{name}-fp16"),
            3,
        );
        compare(
            EmulatedDevice::default(),
            kind,
            Precision::Int8,
            &format!("{name}-int8"),
            6,
        );
    }
    compare(
        EmulatedDevice::default(),
        ModelKind::Gru4rec,
        Precision::Int8,
        "w8a8",
        3,
    );
}

#[test]
fn hstu_on_the_device_path_answers_like_the_cpu_engine() {
    // The official trainer's HSTU (tests/fixtures/hstu), with its test users' event times: the
    // biased pointwise attention, the gate, the plain layer norms and the cosine, kernel by kernel.
    compare(
        EmulatedDevice::default(),
        ModelKind::Hstu,
        Precision::Fp32,
        "hstu-fp32",
        6,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Hstu,
        Precision::Fp16,
        "hstu-fp16",
        3,
    );
    compare(
        EmulatedDevice::default(),
        ModelKind::Hstu,
        Precision::Int8,
        "hstu-int8",
        9,
    );
}

#[test]
fn a_device_that_computes_wrongly_fails_its_self_check() {
    use parity::engine;
    use recsys_gpu::model::DeviceModel;
    use recsys_gpu::GpuError;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    for (kind, error) in [
        (ModelKind::Vaecf, 0.05f32),
        (ModelKind::Bert4rec, 0.05),
        (ModelKind::Sasrec, 0.05),
        (ModelKind::Gru4rec, 0.05),
    ] {
        let engine = Arc::new(engine(
            kind,
            Precision::Fp32,
            &tmp.path().join(format!("{kind:?}")),
        ));
        let faithful = DeviceModel::new(EmulatedDevice::default(), Arc::clone(&engine)).unwrap();
        faithful.self_check().unwrap();
        let faulty = DeviceModel::new(
            EmulatedDevice {
                dense_layer_error: error,
            },
            Arc::clone(&engine),
        )
        .unwrap();
        match faulty.self_check() {
            Err(GpuError::SelfCheck(msg)) => {
                assert!(msg.contains("the GPU gives item"), "{msg}");
                let shown = GpuError::SelfCheck(msg).to_string();
                assert!(shown.contains("refusing to serve"), "{shown}");
            }
            other => panic!("{kind:?}: expected a failed self-check, got {other:?}"),
        }
    }
}

#[test]
fn engines_with_static_dense_activations_are_refused_with_the_reason() {
    use recsys_engine::calibration::CalibrationMethod;
    use recsys_engine::metrics::read_test_set;
    use recsys_engine::{ConvertRequest, W8a8Layers};
    use recsys_gpu::model::DeviceModel;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let kind = ModelKind::Vaecf;
    let model = recsys_engine::fixtures::model_dir(kind);
    let config = recsys_engine::fixtures::config(kind).unwrap();
    let cases = read_test_set(&parity::fixtures().join("test_set.tsv")).unwrap();
    let calibration: Vec<Vec<String>> = cases.iter().take(64).map(|c| c.history.clone()).collect();
    let engine = recsys_engine::convert(&ConvertRequest {
        kind: Some(kind),
        checkpoint: &model.join("model.safetensors"),
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(&model.join("item_id_map.tsv")),
        out: &tmp.path().join("w8a8-all"),
        precision: Precision::Int8,
        calibration: Some((&calibration[..], CalibrationMethod::MinMax)),
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: W8a8Layers::All,
        catalogue: Default::default(),
    })
    .unwrap();
    match DeviceModel::new(EmulatedDevice::default(), Arc::new(engine)) {
        Err(e) => assert!(e.to_string().contains("w8a8-all"), "{e}"),
        Ok(_) => panic!("a w8a8-all engine must not be served by kernels that ignore its scales"),
    }
}

#[test]
fn bf16_engines_are_refused_naming_the_precision_to_use() {
    use recsys_gpu::model::DeviceModel;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    for kind in ModelKind::RECBOLE {
        let dir = tmp.path().join(kind.to_string());
        let engine =
            recsys_engine::fixtures::convert(kind, "model.safetensors", &dir, Precision::Bf16)
                .unwrap();
        match DeviceModel::new(EmulatedDevice::default(), Arc::new(engine)) {
            Err(e) => {
                let message = e.to_string();
                assert!(
                    message.contains("bf16") && message.contains("--precision fp16"),
                    "{message}"
                );
            }
            Ok(_) => panic!("{kind}: the GPU kernels have no bf16 path"),
        }
    }
}

/// The device model behind the engine's [`recsys_engine::BatchRecommender`] interface, as the
/// serving layers hold it.
struct OnDevice(std::sync::Mutex<recsys_gpu::model::DeviceModel<EmulatedDevice>>);

impl recsys_engine::BatchRecommender for OnDevice {
    fn recommend_batch(
        &self,
        batch: &[recsys_engine::InternalRequest],
    ) -> recsys_engine::Result<Vec<recsys_engine::RowAnswer>> {
        self.0
            .lock()
            .unwrap()
            .recommend_with_embeddings(batch)
            .map_err(|e| recsys_engine::EngineError::Device(e.to_string()))
    }
}

#[test]
fn filtered_candidate_and_cold_start_rows_reach_the_cpu_engine_not_the_device() {
    use recsys_engine::{ExternalIds, ItemFilter, Request, ServeOptions};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let kind = ModelKind::Vaecf;
    let model = recsys_engine::fixtures::model_dir(kind);
    let config = recsys_engine::fixtures::config(kind).unwrap();
    // Attributes and a popularity list from the item map itself: every third item on sale, and
    // a log where item i occurs i % 7 times.
    let map = std::fs::read_to_string(model.join("item_id_map.tsv")).unwrap();
    let ids: Vec<String> = map
        .lines()
        .skip(1)
        .map(|l| l.split('\t').nth(1).unwrap().to_string())
        .collect();
    let table = recsys_engine::AttributeTable {
        columns: vec!["promo".into()],
        rows: ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                (
                    id.clone(),
                    vec![if i % 3 == 0 {
                        vec!["sale".into()]
                    } else {
                        vec![]
                    }],
                )
            })
            .collect(),
    };
    let log = tmp.path().join("log.tsv");
    let mut text = String::from("user\titem_id\n");
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..i % 7 {
            text.push_str(&format!("0\t{id}\n"));
        }
    }
    std::fs::write(&log, text).unwrap();
    let item_map = model.join("item_id_map.tsv");
    let id_map = recsys_engine::ItemMapSource::Tsv(&item_map)
        .read(u64::MAX)
        .unwrap();
    let counted = recsys_engine::popularity::Popularity::count_file(&log, None, &id_map).unwrap();
    let engine = Arc::new(
        recsys_engine::convert(&recsys_engine::ConvertRequest {
            kind: Some(kind),
            checkpoint: &model.join("model.safetensors"),
            config: Some(&config),
            item_map: recsys_engine::ItemMapSource::Tsv(&item_map),
            out: &tmp.path().join("engine"),
            precision: Precision::Fp32,
            calibration: None,
            calibration_times: None,
            screen: Default::default(),
            w8a8_layers: Default::default(),
            catalogue: recsys_engine::CatalogueInputs {
                item_attributes: Some(&table),
                popularity: Some(&counted),
            },
        })
        .unwrap(),
    );
    let device = OnDevice(std::sync::Mutex::new(
        recsys_gpu::model::DeviceModel::new(EmulatedDevice::default(), Arc::clone(&engine))
            .unwrap(),
    ));
    let sale = ItemFilter {
        include: vec!["promo=sale".into()],
        exclude: vec![],
    };
    let history = [ids[10].as_str(), ids[20].as_str()];
    let candidates: Vec<&str> = ids.iter().step_by(5).map(String::as_str).collect();
    fn request<'a>(history: &'a [&'a str]) -> Request<'a> {
        Request {
            history: ExternalIds::Str(history),
            k: Some(10),
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: None,
        }
    }
    let requests = vec![
        request(&history),
        Request {
            filter: Some(&sale),
            ..request(&history)
        },
        Request {
            candidates: Some(ExternalIds::Str(&candidates)),
            ..request(&history)
        },
        request(&[]),
        Request {
            filter: Some(&sale),
            ..request(&[])
        },
    ];
    let options = ServeOptions::default();
    let on_cpu = engine.recommend(&requests, &options);
    let mixed = engine.recommend_on(&device, &requests, &options);
    for (r, (cpu, dev)) in on_cpu.iter().zip(&mixed).enumerate() {
        let (cpu, dev) = (cpu.as_ref().unwrap(), dev.as_ref().unwrap());
        let ids =
            |a: &recsys_engine::Recommendation| a.items.iter().map(|s| s.index).collect::<Vec<_>>();
        assert_eq!(ids(cpu), ids(dev), "row {r}");
        assert_eq!(cpu.popular, dev.popular, "row {r}");
        if r > 0 {
            // Answered by the CPU engine (or the popularity list): the same scores, bit for bit.
            assert_eq!(cpu.items, dev.items, "row {r}");
        }
    }
    assert!(mixed[3].as_ref().unwrap().popular && mixed[4].as_ref().unwrap().popular);
    // The device alone refuses what it cannot rank, naming it.
    let prepared = engine.prepare(&requests[1], &options).unwrap().0;
    let err = device
        .0
        .lock()
        .unwrap()
        .recommend_with_embeddings(&[prepared])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("item set filters run on the CPU engine"),
        "{err}"
    );
}
