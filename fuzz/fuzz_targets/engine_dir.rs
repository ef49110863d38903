//! The engine-directory loader after its checksums: the manifest, the weights file (safetensors,
//! f32/f16/int8) and the id map, checked against each other and built into a model. The input is
//! the three files joined by a marker line (see fuzz/README.md); missing parts are empty.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use recsys_engine::engine_dir;
use recsys_engine::tensor::Storage;

const MARKER: &[u8] = b"\n--recsys-fuzz-part--\n";

fn split(data: &[u8]) -> [&[u8]; 3] {
    let mut parts = [&data[..0]; 3];
    let mut rest = data;
    for part in parts.iter_mut() {
        match rest.windows(MARKER.len()).position(|w| w == MARKER) {
            Some(at) => {
                *part = &rest[..at];
                rest = &rest[at + MARKER.len()..];
            }
            None => {
                *part = rest;
                rest = &rest[rest.len()..];
            }
        }
    }
    parts
}

fuzz_target!(|data: &[u8]| {
    let [manifest, ids, weights] = split(data);
    let Ok(text) = std::str::from_utf8(manifest) else {
        return;
    };
    let dir = Path::new("fuzz-engine");
    let Ok(manifest) = engine_dir::parse_manifest(dir, text) else {
        return;
    };
    let _ = engine_dir::from_parts(dir, manifest, Storage::from_bytes(weights), ids.to_vec());
});
