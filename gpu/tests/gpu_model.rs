//! Whole models on a real GPU ([`recsys_gpu::cuda::CudaDevice`]) against the CPU engine, on the
//! trained fixtures at every precision: the same checks the emulated tests run on the CPU build of
//! the kernels. Needs a GPU: `#[ignore]`d, run by scripts/gpu-check.sh with `--include-ignored`.
#![cfg(feature = "cuda")]

#[path = "common/parity.rs"]
mod parity;

use parity::compare;
use recsys_engine::engine_dir::Precision;
use recsys_engine::ModelKind;
use recsys_gpu::cuda::CudaDevice;

fn gpu() -> CudaDevice {
    let mut device = CudaDevice::new(0).unwrap_or_else(|e| panic!("{e}"));
    device.poison_outputs = true;
    device
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh"]
fn whole_models_on_the_gpu_answer_like_the_cpu_engine() {
    for (kind, name) in [
        (ModelKind::Bert4rec, "bert4rec"),
        (ModelKind::Vaecf, "vaecf"),
        (ModelKind::Sasrec, "sasrec"),
        (ModelKind::Gru4rec, "gru4rec"),
        (ModelKind::Hstu, "hstu"),
    ] {
        compare(gpu(), kind, Precision::Fp32, &format!("{name}-fp32"), 200);
        compare(gpu(), kind, Precision::Fp16, &format!("{name}-fp16"), 200);
        compare(gpu(), kind, Precision::Int8, &format!("{name}-int8"), 200);
    }
    compare(gpu(), ModelKind::Vaecf, Precision::Int8, "w8a8", 200);
}
