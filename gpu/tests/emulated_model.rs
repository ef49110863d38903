//! Whole models on the device path, run through the emulation (tests/emulated): the trained
//! PyTorch fixtures converted at every precision, then [`DeviceModel`] (the CUDA path's own
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
        EmulatedDevice,
        ModelKind::Bert4rec,
        Precision::Fp32,
        "bert4rec-fp32",
        6,
    );
}

#[test]
fn bert4rec_fp16_and_int8_on_the_device_path() {
    compare(
        EmulatedDevice,
        ModelKind::Bert4rec,
        Precision::Fp16,
        "bert4rec-fp16",
        3,
    );
    compare(
        EmulatedDevice,
        ModelKind::Bert4rec,
        Precision::Int8,
        "bert4rec-int8",
        3,
    );
}

#[test]
fn multvae_on_the_device_path_answers_like_the_cpu_engine_at_every_precision() {
    compare(
        EmulatedDevice,
        ModelKind::Vaecf,
        Precision::Fp32,
        "vaecf-fp32",
        12,
    );
    compare(
        EmulatedDevice,
        ModelKind::Vaecf,
        Precision::Fp16,
        "vaecf-fp16",
        6,
    );
    compare(
        EmulatedDevice,
        ModelKind::Vaecf,
        Precision::Int8,
        "vaecf-int8",
        6,
    );
    compare(EmulatedDevice, ModelKind::Vaecf, Precision::Int8, "w8a8", 6);
}
