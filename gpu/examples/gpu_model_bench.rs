//! Times whole models on the GPU (encoder and fused score + top-k, `DeviceModel` on CUDA) against
//! the CPU engine in the same process, on the trained fixtures (fp32, fp16 and int8 engines), for
//! batches of 1 and 64 test histories with top-10 and the history excluded (HSTU's with their
//! event times, asked at the target's time); checks that both
//! return the same top-10; and for each cell what one call asks of the device (kernel launches,
//! copies each way, allocations), the encoder's time alone, and the round trip of one value (the
//! floor of any call that waits for the GPU). Prints one JSON object. The GPU bundle's run.sh runs it;
//! `--dry-run` checks that it starts and finds the fixtures, and exits 0 without a GPU.

use std::sync::Arc;

#[path = "common/timing.rs"]
mod timing;

use recsys_engine::engine_dir::Precision;
use recsys_engine::metrics::read_test_set;
use recsys_engine::models::EventTimes;
use recsys_engine::{convert, ConvertRequest, Engine, ExternalIds, InternalRequest, ModelKind};
use recsys_gpu::cuda::CudaDevice;
use recsys_gpu::device::Device;
use recsys_gpu::model::DeviceModel;

fn main() {
    let dry_run = std::env::args().nth(1).as_deref() == Some("--dry-run");
    // RECSYS_FIXTURES: where the GPU bundle's run.sh put them.
    let fixtures = recsys_engine::fixtures::dir();
    let cases = read_test_set(&fixtures.join("test_set.tsv")).expect("fixture test set");
    let timed_cases =
        read_test_set(&fixtures.join("hstu").join("test_set.tsv.gz")).expect("HSTU's test set");
    if dry_run {
        for dir in ["bert4rec", "multivae", "sasrec", "gru4rec", "hstu"] {
            for file in ["config.json", "item_id_map.tsv", "model.safetensors"] {
                let path = fixtures.join(dir).join(file);
                assert!(path.is_file(), "fixture {} missing", path.display());
            }
        }
        println!(
            "gpu_model_bench: starts; {} test histories and the five fixtures found; CUDA driver {}",
            cases.len(),
            if recsys_gpu::cuda::driver_present() {
                "present"
            } else {
                "absent"
            }
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for (kind, name, dir) in [
        (ModelKind::Bert4rec, "bert4rec", "bert4rec"),
        (ModelKind::Vaecf, "vaecf", "multivae"),
        (ModelKind::Sasrec, "sasrec", "sasrec"),
        (ModelKind::Gru4rec, "gru4rec", "gru4rec"),
        (ModelKind::Hstu, "hstu", "hstu"),
    ] {
        let timed = kind.reads_timestamps();
        let model = fixtures.join(dir);
        let config: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap())
                .unwrap();
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Int8] {
            let out = tmp.path().join(format!("{name}-{precision:?}"));
            let engine = Arc::new(
                convert(&ConvertRequest {
                    kind: Some(kind),
                    checkpoint: &model.join("model.safetensors"),
                    config: Some(&config),
                    item_map: recsys_engine::ItemMapSource::Tsv(&model.join("item_id_map.tsv")),
                    out: &out,
                    precision,
                    calibration: None,
                    calibration_times: None,
                    screen: Default::default(),
                    w8a8_layers: Default::default(),
                    catalogue: Default::default(),
                })
                .expect("converting the fixture"),
            );
            let gpu = DeviceModel::new(CudaDevice::new(0).expect("GPU"), Arc::clone(&engine))
                .expect("uploading the model");
            for batch in [1usize, 64] {
                let requests: Vec<InternalRequest> = (if timed { &timed_cases } else { &cases })
                    .iter()
                    .take(batch)
                    .map(|c| {
                        let ids: Vec<&str> = c.history.iter().map(String::as_str).collect();
                        // Every id of HSTU's own test set is in its catalogue, so the times stay
                        // aligned with the mapped history.
                        let (timestamps, query_timestamp) = match (&c.times, timed) {
                            (Some(t), true) => (t.events.clone(), t.target),
                            _ => (Vec::new(), 0),
                        };
                        InternalRequest {
                            history: engine.ids.map(ExternalIds::Str(&ids)).indices,
                            exclude: vec![],
                            k: 10,
                            exclude_seen: true,
                            candidates: None,
                            embedding: false,
                            timestamps,
                            query_timestamp,
                            ..Default::default()
                        }
                    })
                    .collect();
                let same = same_top10(&engine, &gpu, &requests);
                let cpu_ms = timing::median_ms(5, 30, || {
                    engine.recommend_internal(&requests);
                });
                let gpu_ms = timing::median_ms(5, 30, || {
                    gpu.recommend(&requests).unwrap();
                });
                // Where a call's time goes besides its kernels: what one call asks of the device,
                // and the encoder alone (to the end of its kernels, without the top-k).
                let before = gpu.device.counts();
                gpu.recommend(&requests).unwrap();
                let per_call = gpu.device.counts() - before;
                let histories: Vec<&[u32]> =
                    requests.iter().map(|r| r.history.as_slice()).collect();
                let times: Vec<EventTimes<'_>> = if timed {
                    requests.iter().map(InternalRequest::event_times).collect()
                } else {
                    Vec::new()
                };
                let encode_ms = timing::median_ms(5, 30, || {
                    let (hidden, _) = gpu.encode_timed(&histories, &times).unwrap();
                    gpu.device.synchronize().unwrap();
                    drop(hidden);
                });
                rows.push(format!(
                    "{{\"model\": \"{name}\", \"precision\": \"{precision:?}\", \"batch\": {batch}, \
                     \"cpu_ms\": {cpu_ms:.4}, \"gpu_ms\": {gpu_ms:.4}, \"gpu_encode_ms\": {encode_ms:.4}, \
                     \"launches\": {}, \"copies_in\": {}, \"copies_out\": {}, \"allocations\": {}, \
                     \"identical_top10\": {same}}}",
                    per_call.launches, per_call.copies_in, per_call.copies_out, per_call.allocations
                ));
            }
        }
    }
    // The floor of any call that waits for the GPU: one value up, one back.
    let device = CudaDevice::new(0).expect("GPU");
    let round_trip_ms = timing::median_ms(5, 30, || {
        let one = device.upload_u32(&[1]).unwrap();
        device.download_u32(&one, 1).unwrap();
    });
    println!(
        "{{\"device\": \"{}\", \"round_trip_ms\": {round_trip_ms:.4}, \"models\": [{}]}}",
        device.name,
        rows.join(", ")
    );
}

/// The fraction of requests whose top-10 ids are identical on both paths.
fn same_top10(engine: &Engine, gpu: &DeviceModel<CudaDevice>, requests: &[InternalRequest]) -> f64 {
    let cpu = engine.recommend_internal(requests);
    let dev = gpu.recommend(requests).unwrap();
    let same = cpu
        .iter()
        .zip(&dev)
        .filter(|((a, _, _), (b, _))| a.iter().map(|s| s.index).eq(b.iter().map(|s| s.index)))
        .count();
    same as f64 / requests.len() as f64
}
