//! The backend's request path without Triton: arbitrary input tensors (names, types, shapes, bytes)
//! are decoded under the request limits and, when they decode, served by a real engine (the fixture
//! BERT4Rec, converted once) and encoded into output tensors. Errors are expected; panics are not.
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use triton_recsys::decode::{decode, encode, encode_embeddings, DType, InputTensor, RequestedOutputs};
use triton_recsys::settings::Limits;
use triton_recsys::serve::serve;
use triton_recsys::settings::IdTensorType;
use recsys_engine::{Engine, ServeOptions};

#[derive(Arbitrary, Debug)]
struct Tensor {
    name: u8,
    dtype: u8,
    shape: Vec<i8>,
    data: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    batched: bool,
    small_limits: bool,
    /// The outputs the request names (TOP_ITEM_IDS, TOP_SCORES, USER_EMBEDDING).
    outputs: (bool, bool, bool),
    tensors: Vec<Tensor>,
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let dir = std::env::var("RECSYS_FUZZ_ENGINE")
            .expect("set RECSYS_FUZZ_ENGINE to an engine directory (fuzz/run.sh converts one)");
        Engine::load(std::path::Path::new(&dir)).expect("the fuzz engine loads")
    })
}

fuzz_target!(|input: Input| {
    let names = [
        "ITEM_IDS",
        "K",
        "EXCLUDE_ITEM_IDS",
        "CANDIDATE_ITEM_IDS",
        "INCLUDE_ITEM_SETS",
        "EXCLUDE_ITEM_SETS",
        "OTHER",
    ];
    let dtypes = [DType::Int64, DType::Int32, DType::Bytes, DType::Other("FP32")];
    let tensors: Vec<InputTensor> = input
        .tensors
        .into_iter()
        .take(4)
        .map(|t| InputTensor {
            name: names[t.name as usize % names.len()].to_string(),
            dtype: dtypes[t.dtype as usize % dtypes.len()],
            shape: t.shape.iter().take(3).map(|&d| d as i64).collect(),
            data: t.data,
        })
        .collect();
    let limits = if input.small_limits {
        Limits {
            max_history: 8,
            max_k: 5,
            max_exclude: 4,
            max_candidates: 4,
            max_item_sets: 3,
            max_id_bytes: 6,
            max_request_bytes: 256,
        }
    } else {
        Limits::default()
    };
    let engine = engine();
    let (item_ids, scores, embedding) = input.outputs;
    let outputs = RequestedOutputs {
        item_ids,
        scores,
        embedding,
    };
    let decoded = decode(&tensors, outputs, input.batched, &limits);
    let (answers, _) = serve(engine, &ServeOptions::default(), vec![decoded], engine);
    for answer in answers.into_iter().flatten() {
        let _ = encode(&answer.rows, engine, IdTensorType::Int64, input.batched);
        let _ = encode(&answer.rows, engine, IdTensorType::String, input.batched);
        let _ = encode_embeddings(&answer.embeddings, input.batched);
    }
});
