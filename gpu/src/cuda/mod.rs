//! Host side of the CUDA kernels: finding the libraries and compiling the kernels (`compile`),
//! [`CudaDevice`] (`cuda_device`: one context and stream, the typed launch of every kernel), and the two
//! things the rest of recsys uses: [`GpuModel`] (a whole engine on a GPU, what KIND_GPU instances
//! serve) and [`GpuOutputLayer`] (the output layer alone, for benchmarks).

mod compile;
mod cuda_device;

use std::sync::{Arc, Mutex};

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_engine::Engine;
use recsys_engine::InternalRequest;

pub use compile::{
    check_nvrtc_against_driver, compile, compile_source, driver_cuda_version, driver_present,
    nvrtc_check, nvrtc_present, nvrtc_version, BUILT_FOR_CUDA,
};
use cuda_device::cuda_err;
pub use cuda_device::{CudaDevice, DeviceCounts};

use crate::device::Device;
use crate::model::DeviceModel;
use crate::output_layer::{DeviceOutputLayer, ScanStrategy};
use crate::{threshold_plan, GpuError, Ranked, Result};

/// A whole engine on one GPU: what a KIND_GPU instance serves. Batches are serialised on the
/// device's one stream (Triton runs one batch at a time per instance anyway).
pub struct GpuModel {
    inner: Mutex<DeviceModel<CudaDevice>>,
    name: String,
}

impl GpuModel {
    /// Opens device `ordinal`, uploads `engine` and checks the device against the CPU engine on a
    /// few histories ([`DeviceModel::self_check`]) before it serves anything.
    pub fn new(ordinal: usize, engine: &Arc<Engine>) -> Result<GpuModel> {
        let device = CudaDevice::new(ordinal)?;
        let name = device.name.clone();
        let model = DeviceModel::new(device, Arc::clone(engine))?;
        model.self_check()?;
        Ok(GpuModel {
            inner: Mutex::new(model),
            name,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.name
    }
}

impl recsys_engine::BatchRecommender for GpuModel {
    fn recommend_batch(
        &self,
        batch: &[InternalRequest],
    ) -> recsys_engine::Result<Vec<recsys_engine::RowAnswer>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recommend_with_embeddings(batch)
            .map_err(|e| recsys_engine::EngineError::Device(e.to_string()))
    }
}

/// The output layer alone on one GPU (the benchmark of the fused kernel against torch).
pub struct GpuOutputLayer {
    device: Mutex<CudaDevice>,
    layer: DeviceOutputLayer<CudaDevice>,
    /// "NVIDIA H200 (sm_90)", for logs.
    pub device_name: String,
}

impl GpuOutputLayer {
    /// Uploads `weight` (`[n_items, dim]`, any precision) and `bias` to device `ordinal`.
    pub fn new(ordinal: usize, weight: &Matrix, bias: &Tensor) -> Result<GpuOutputLayer> {
        let device = CudaDevice::new(ordinal)?;
        let layer = DeviceOutputLayer::new(&device, weight, bias, None)?;
        Ok(GpuOutputLayer {
            device_name: device.name.clone(),
            device: Mutex::new(device),
            layer,
        })
    }

    /// How the fused top-k scans the catalogue ([`ScanStrategy`]; the tile scan by default).
    pub fn set_strategy(&mut self, strategy: ScanStrategy) {
        self.layer.strategy = strategy;
    }

    /// Tests: poison every kernel output before the kernel runs ([`CudaDevice::poison_outputs`]).
    pub fn poison_outputs(&self) {
        self.device
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .poison_outputs = true;
    }

    /// Device time of the fused score + top-k kernels, in milliseconds, for each of `reps` runs
    /// after `warmup` untimed ones: CUDA events recorded around the kernels on the stream, with
    /// the hidden vectors already on the device and no copy in the span (what torch's CUDA
    /// events measure of matmul + topk). End-to-end time, copies and host work included, is
    /// [`Self::topk`] timed on the host.
    pub fn kernel_times_ms(
        &self,
        hidden: &[f32],
        k: usize,
        exclude: &[&[u32]],
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f32>> {
        let device = self
            .device
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let on_device = device.upload_f32(hidden)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(reps);
        for rep in 0..warmup + reps {
            let start = device
                .stream
                .record_event(timing)
                .map_err(cuda_err("recording an event"))?;
            // The threshold scan's kernels where it runs (its overflow check and answers for
            // overflowing rows come after them, on the host's side, as the tile scan's download).
            let plan = threshold_plan(self.layer.n_items, k, self.layer.survivor_capacity)
                .filter(|_| self.layer.strategy != ScanStrategy::Tiles);
            match plan {
                Some(plan) => self
                    .layer
                    .launch_above_threshold(&device, &on_device, k, exclude, &plan)?,
                None => self.layer.launch_top_k(&device, &on_device, k, exclude)?,
            };
            let end = device
                .stream
                .record_event(timing)
                .map_err(cuda_err("recording an event"))?;
            end.synchronize()
                .map_err(cuda_err("waiting for the kernels"))?;
            if rep >= warmup {
                times.push(
                    start
                        .elapsed_ms(&end)
                        .map_err(cuda_err("reading the event timer"))?,
                );
            }
        }
        Ok(times)
    }

    /// Top-`k` items for each of `rows` hidden vectors (`hidden` is `[rows, dim]`, on the host),
    /// leaving out index 0 (PAD) and each row's `exclude` list.
    pub fn topk(&self, hidden: &[f32], k: usize, exclude: &[&[u32]]) -> Result<Vec<Ranked>> {
        if hidden.len() != exclude.len() * self.layer.dim {
            return Err(GpuError::Invalid(format!(
                "{} hidden values for {} rows of width {}",
                hidden.len(),
                exclude.len(),
                self.layer.dim
            )));
        }
        let device = self
            .device
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let hidden = device.stage_f32(hidden)?;
        self.layer.top_k(&device, &hidden, k, exclude)
    }
}
