//! Where an instance's model runs: the single place the CPU or CUDA path is chosen for a KIND_GPU
//! instance. Pure Rust (no Triton calls), so the GPU bundle's device test builds an instance's
//! model exactly as the backend does, outside the server.

use std::sync::Arc;

use recsys_engine::{BatchRecommender, Engine};

use crate::error::{BackendError, Result};

/// The model of KIND_GPU instance `instance` on GPU `device`: encoder and fused score + top-k on
/// the device, after the load-time self-check against the CPU engine; requests are still
/// prepared (id mapping, truncation, exclusions) on the CPU as for every instance. Returns the
/// recommender and the device's name for the log.
#[cfg(feature = "gpu")]
pub fn gpu_recommender(
    instance: &str,
    device: i32,
    engine: &Arc<Engine>,
    max_k: usize,
) -> Result<(Arc<dyn BatchRecommender>, String)> {
    if max_k > recsys_gpu::MAX_K {
        return Err(BackendError::InvalidConfig(format!(
            "instance {instance}: max_k {max_k} is more than the GPU path serves ({})",
            recsys_gpu::MAX_K
        )));
    }
    let ordinal = usize::try_from(device).map_err(|_| {
        BackendError::InvalidConfig(format!("instance {instance}: GPU device id {device}"))
    })?;
    let on_device = recsys_gpu::cuda::GpuModel::new(ordinal, engine).map_err(|e| {
        BackendError::Unsupported(format!(
            "instance {instance}: KIND_GPU device {device}: {e}"
        ))
    })?;
    let name = on_device.device_name().to_string();
    Ok((Arc::new(on_device), name))
}

/// Without the GPU path, a KIND_GPU instance is refused with what to do instead.
#[cfg(not(feature = "gpu"))]
pub fn gpu_recommender(
    instance: &str,
    device: i32,
    _engine: &Arc<Engine>,
    _max_k: usize,
) -> Result<(Arc<dyn BatchRecommender>, String)> {
    Err(BackendError::Unsupported(format!(
        "instance {instance}: KIND_GPU (device {device}) needs a recsys backend built with CUDA \
         support (scripts/build-release.sh --cuda, as docker/Dockerfile does); this build runs on \
         the CPU only, so use instance_group [ {{ kind: KIND_CPU }} ]"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use recsys_engine::ModelKind;

    #[cfg(feature = "gpu")]
    mod on_a_gpu {
        //! A KIND_GPU instance's model built as the backend builds it (the engine loaded from its
        //! version directory, the whole model uploaded, the load-time self-check), answering a
        //! ragged batch of the trained fixtures like the CPU engine. tritonserver cannot travel
        //! to a bare GPU machine; this test does, in the GPU bundle (scripts/gpu-bundle.sh), so
        //! the backend's GPU glue runs on a real GPU. `#[ignore]`d: it needs one.
        use super::*;
        use recsys_engine::metrics::read_test_set;
        use recsys_engine::{ExternalIds, InternalRequest};

        /// Largest |score difference| of a top-k entry between the GPU and the CPU engine
        /// (fp32): different summation orders, and the GPU fuses multiply-adds; the device model
        /// tests measure a few 1e-6 on these fixtures.
        const SCORE_ABS_TOL: f32 = 2e-4;

        /// 150 test histories of every length (one empty, one longer than BERT4Rec's window),
        /// k of 1, 10 and 100, some with the history excluded and some with extra exclusions.
        fn ragged_batch(engine: &Engine) -> Vec<InternalRequest> {
            let cases =
                read_test_set(&recsys_engine::fixtures::dir().join("test_set.tsv")).unwrap();
            let mut batch: Vec<InternalRequest> = cases
                .iter()
                .take(150)
                .enumerate()
                .map(|(i, case)| {
                    let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
                    InternalRequest {
                        history: engine.ids.map(ExternalIds::Str(&ids)).indices,
                        exclude: if i % 5 == 0 {
                            vec![1, 2, 3, 50]
                        } else {
                            vec![]
                        },
                        k: [10, 1, 100][i % 3],
                        exclude_seen: i % 4 != 3,
                        candidates: None,
                        embedding: false,
                        ..Default::default()
                    }
                })
                .collect();
            for history in [vec![], (1..=300).collect()] {
                batch.push(InternalRequest {
                    history,
                    exclude: vec![],
                    k: 10,
                    exclude_seen: true,
                    candidates: None,
                    embedding: false,
                    ..Default::default()
                });
            }
            batch
        }

        #[test]
        #[ignore = "needs a GPU: the GPU bundle runs it"]
        fn a_kind_gpu_instance_answers_a_ragged_batch_like_the_cpu_engine() {
            for (kind, dir) in [
                (ModelKind::Bert4rec, "bert4rec"),
                (ModelKind::Vaecf, "multivae"),
            ] {
                let (converted, tmp) = crate::test_support::fixture_engine(dir, kind);
                drop(converted);
                let engine = Arc::new(Engine::load(&tmp.path().join("engine")).unwrap());
                let (gpu, device_name) = gpu_recommender(&format!("{dir}_0"), 0, &engine, 100)
                    .unwrap_or_else(|e| panic!("{e}"));
                let batch = ragged_batch(&engine);
                let on_gpu = gpu.recommend_batch(&batch).unwrap();
                let on_cpu = engine.recommend_batch(&batch).unwrap();
                assert_eq!(on_gpu.len(), batch.len());
                let (mut same, mut entries, mut worst) = (0usize, 0usize, 0f32);
                for (r, ((g, gn, _), (c, cn, _))) in on_gpu.iter().zip(&on_cpu).enumerate() {
                    assert_eq!(gn, cn, "{dir} row {r}: history notes");
                    assert_eq!(g.len(), c.len(), "{dir} row {r}: answer lengths");
                    for (pos, (x, y)) in c.iter().zip(g).enumerate() {
                        let diff = (x.score - y.score).abs();
                        worst = worst.max(diff);
                        assert!(
                            diff <= SCORE_ABS_TOL,
                            "{dir} row {r} rank {pos}: cpu {x:?} gpu {y:?}"
                        );
                        entries += 1;
                        if x.index == y.index {
                            same += 1;
                        } else {
                            // Only a near-tie may swap: the GPU's item holds a CPU score this close.
                            assert!(
                                c.iter().any(|o| o.index == y.index
                                    && (o.score - x.score).abs() <= 2.0 * SCORE_ABS_TOL),
                                "{dir} row {r} rank {pos}: cpu {x:?} gpu {y:?}"
                            );
                        }
                    }
                }
                println!(
                    "{dir} on {device_name}: {} requests, same item at {same}/{entries} ranks, \
                     max |score diff| {worst:.2e}",
                    batch.len()
                );
                assert!(same * 1000 >= entries * 999, "{dir}: {same}/{entries}");
            }
        }
    }

    #[test]
    fn a_kind_gpu_instance_is_refused_with_the_reason_when_it_cannot_run() {
        let (engine, _dir) = crate::test_support::fixture_engine("multivae", ModelKind::Vaecf);
        let engine = Arc::new(engine);
        let err = match gpu_recommender("vaecf_0", 0, &engine, 100) {
            Err(err) => err,
            // Only a build with the GPU path, on a machine with a working GPU, gets a model.
            Ok(_) if cfg!(feature = "gpu") => return,
            Ok(_) => panic!("a build without the GPU path served a KIND_GPU instance"),
        };
        let message = err.to_string();
        assert!(
            message.starts_with("instance vaecf_0: KIND_GPU"),
            "{message}"
        );
        if cfg!(feature = "gpu") {
            assert!(message.contains("no usable GPU"), "{message}");
            let too_many = gpu_recommender("vaecf_0", 0, &engine, 5000).err().unwrap();
            assert!(too_many.to_string().contains("max_k 5000"), "{too_many}");
        } else {
            assert!(message.contains("KIND_CPU"), "{message}");
        }
    }
}
