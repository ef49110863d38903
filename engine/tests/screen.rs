//! The int8 screen on the trained fixtures: for every k in {1, 10, 100, 1000} and batches of 1 to
//! 64 histories, screened answers are the fp32 engine's, ids and scores bit for bit, and only a
//! small share of the catalogue is rescored.

mod common;

use common::*;
use recsys_engine::kernels::fused::{Exclusions, RowQuery};
use recsys_engine::kernels::screen::{top_k_from_f32, ScreenTable};
use recsys_engine::{ExternalIds, InternalRequest, ModelKind};

#[test]
fn screened_answers_are_the_fp32_engines_on_the_trained_fixtures() {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("fp32"));
        let out = engine.model.output();
        let (n, d) = (out.n_outputs(), out.input_size());
        let mut weights = vec![0f32; n * d];
        for (i, row) in weights.chunks_exact_mut(d).enumerate() {
            out.weight.add_row_into(i, row);
        }
        let bias = out.bias.as_slice().to_vec();
        let screen = ScreenTable::new(&weights, &bias, d);
        for batch in [1usize, 7, 64] {
            let requests: Vec<InternalRequest> = cases
                .iter()
                .take(batch)
                .map(|case| {
                    let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
                    InternalRequest {
                        history: engine.ids.map(ExternalIds::Str(&ids)).indices,
                        exclude: vec![],
                        k: 10,
                        exclude_seen: true,
                        candidates: None,
                        embedding: false,
                    }
                })
                .collect();
            let histories: Vec<&[u32]> = requests.iter().map(|r| r.history.as_slice()).collect();
            let (hidden, _) = engine.encode(&histories);
            let exclusions: Vec<Exclusions> = requests
                .iter()
                .map(|r| {
                    let mut e = recsys_engine::excluded_items(r);
                    e.push(0); // PAD
                    Exclusions::new(e)
                })
                .collect();
            for k in [1usize, 10, 100, 1000] {
                let queries: Vec<RowQuery<'_>> = exclusions
                    .iter()
                    .map(|e| RowQuery { k, excluded: e })
                    .collect();
                // The engine's own dense path (it adds PAD to each row's exclusions itself).
                let dense = engine.scorer.top_k(
                    &hidden,
                    &vec![k; batch],
                    requests.iter().map(recsys_engine::excluded_items).collect(),
                );
                let (got, kept) = top_k_from_f32(
                    engine.scorer.kernels,
                    &screen,
                    &weights,
                    &bias,
                    &hidden,
                    &queries,
                    2,
                );
                assert_eq!(got, dense, "{kind} batch {batch} k {k}");
                let mut sorted = kept.clone();
                sorted.sort_unstable();
                let median = sorted[sorted.len() / 2];
                eprintln!("{kind} batch {batch} k {k}: median {median} survivors of {n}");
                if k <= 100 {
                    assert!(
                        median < n / 4,
                        "{kind} k {k}: median {median} survivors of {n}"
                    );
                }
            }
        }
    }
}
