//! Checkpoint import from arbitrary bytes: the PyTorch zip + pickle reader (RecBole checkpoints
//! included) and the safetensors reader. Anything may be refused; nothing may panic, hang, run code
//! or allocate without bound.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use recsys_engine::import::Checkpoint;

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_bytes(Path::new("fuzz.pt"), data) else {
        return;
    };
    // Every tensor that parsed must convert to f32 at its own shape (or be refused cleanly).
    let shapes: Vec<(String, Vec<usize>)> = ckpt
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.shape.clone()))
        .collect();
    for (name, shape) in shapes {
        let _ = ckpt.tensor_f32(&name, &shape);
    }
});
