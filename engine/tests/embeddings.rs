//! The user embedding a request can ask for: `[hidden, 1]` from the same encoder pass as its
//! recommendation, whose inner product with an item's `[embedding, bias]` row is PyTorch's logit for
//! that item; with `k = 0` the embedding alone, and `k = 0` refused without it.

mod common;

use common::*;
use recsys_engine::{ExternalIds, ModelKind, Request, ServeOptions};

/// f32 dot products in another order than the kernels: the same score to this.
const DOT_ABS_TOL: f32 = 1e-4;

fn request(history: &[i64], k: Option<i64>, embedding: bool) -> Request<'_> {
    Request {
        history: ExternalIds::Int(history),
        k,
        exclude: None,
        candidates: None,
        embedding,
        filter: None,
        times: None,
    }
}

#[test]
fn embeddings_give_pytorchs_logits_with_or_without_items() {
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        let engine = convert_fixture(kind, "model.safetensors", &tmp.path().join("engine"));
        let golden = golden(kind);
        let out = engine.model.output();
        let width = out.input_size() + 1;
        let histories: Vec<Vec<i64>> = golden
            .cases
            .iter()
            .take(12)
            .map(|c| i64s(&c["history_ext"]))
            .collect();
        // One batch: the embedding with the top 20, the embedding alone, neither.
        let mut requests = Vec::new();
        for h in &histories {
            requests.push(request(h, Some(20), true));
            requests.push(request(h, Some(0), true));
            requests.push(request(h, Some(20), false));
        }
        let answers = engine.recommend(&requests, &ServeOptions::default());
        for (case_no, answer) in answers.chunks(3).enumerate() {
            let [with_items, alone, plain] = answer else {
                unreachable!()
            };
            let (with_items, alone, plain) = (
                with_items.as_ref().unwrap(),
                alone.as_ref().unwrap(),
                plain.as_ref().unwrap(),
            );
            assert_eq!(with_items.embedding.len(), width, "{kind} case {case_no}");
            assert_eq!(with_items.embedding[width - 1], 1.0);
            assert_eq!(alone.embedding, with_items.embedding, "same encoder pass");
            assert!(alone.items.is_empty() && plain.embedding.is_empty());
            assert_eq!(
                with_items.items, plain.items,
                "asking for it changes no item"
            );
            let logits =
                &golden.logits_f32[case_no * golden.n_outputs..(case_no + 1) * golden.n_outputs];
            // [h, 1] . [w_i, b_i] over every item of the catalogue: PyTorch's logit.
            let mut row = vec![0f32; width - 1];
            for (item, &logit) in logits.iter().enumerate().skip(1) {
                row.iter_mut().for_each(|v| *v = 0.0);
                out.weight.add_row_into(item, &mut row);
                let dot: f32 = row
                    .iter()
                    .zip(&with_items.embedding)
                    .map(|(w, h)| w * h)
                    .sum::<f32>()
                    + out.bias.as_slice()[item];
                assert!(
                    (dot - logit).abs() <= DOT_ABS_TOL + LOGIT_ABS_TOL,
                    "{kind} case {case_no} item {item}: {dot} vs PyTorch {logit}"
                );
            }
        }
        // K = 0 without the embedding asks for nothing: refused, naming why.
        let refused = engine
            .recommend(
                &[request(&histories[0], Some(0), false)],
                &ServeOptions::default(),
            )
            .remove(0)
            .unwrap_err();
        assert!(
            refused.to_string().contains(
                "K = 0 asks for no items: it is allowed only together with the user embedding"
            ),
            "{refused}"
        );
    }
}
