//! bf16 engines: one function on every kernel path (the scalar path, AVX2 and AVX-512 widening to
//! f32, and AVX512-BF16's `vdpbf16ps` where the CPU has it), so an engine answers with the same
//! bits whichever path a machine takes; and the combinations conversion refuses.

mod common;

use common::*;
use recsys_engine::engine_dir::Screen;
use recsys_engine::kernels::{Isa, KernelTable};
use recsys_engine::metrics::read_test_set;
use recsys_engine::{ExternalIds, InternalRequest, ModelKind};

/// Largest |score difference| between the scalar path and the SIMD paths on a bf16 engine (see
/// below). Measured 2026-12-03 on the fixtures: BERT4Rec 8.9e-3, SASRec 4.3e-3; Mult-VAE and
/// GRU4Rec 0 (every product of theirs is a bf16 layer's or an exact sum).
const SCALAR_PATH_ABS_TOL: f32 = 0.03;

#[test]
fn every_kernel_path_gives_a_bf16_engine_the_same_bits() {
    let cases = read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    for kind in ModelKind::RECBOLE {
        let tmp = tempfile::tempdir().unwrap();
        let mut engine = convert_fixture_at(kind, "model.safetensors", tmp.path(), Precision::Bf16);
        let histories: Vec<Vec<u32>> = cases
            .iter()
            .take(40)
            .map(|c| {
                let ids: Vec<&str> = c.history.iter().map(String::as_str).collect();
                engine.ids.map(ExternalIds::Str(&ids)).indices
            })
            .collect();
        let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let requests: Vec<InternalRequest> = histories
            .iter()
            .map(|h| InternalRequest {
                history: h.clone(),
                exclude: vec![],
                k: 20,
                exclude_seen: true,
                candidates: None,
                embedding: true,
                eligible: None,
                popular: false,
                timestamps: Vec::new(),
                query_timestamp: 0,
            })
            .collect();
        // The SIMD paths share every f32 operation's bits (fused multiply-adds in one order),
        // so their bf16 engines agree bit for bit; the scalar path's f32 layers (attention,
        // norms) round without fused multiply-adds, and an activation on either side of a bf16
        // rounding boundary moves a score by up to a bf16 step of its terms.
        let simd: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|&i| i != Isa::Scalar)
            .collect();
        let reference = simd.first().copied().unwrap_or(Isa::Scalar);
        engine.set_kernels(KernelTable::for_isa(reference));
        let want_scores = engine.score_all(&refs);
        let want = engine.recommend_internal(&requests);
        for &isa in &simd {
            engine.set_kernels(KernelTable::for_isa(isa));
            let scores = engine.score_all(&refs);
            assert!(
                scores
                    .iter()
                    .zip(&want_scores)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind} bf16 scores on {isa:?}"
            );
            assert_eq!(
                engine.recommend_internal(&requests),
                want,
                "{kind} bf16 answers on {isa:?}"
            );
        }
        engine.set_kernels(KernelTable::for_isa(Isa::Scalar));
        let scalar = engine.score_all(&refs);
        let max = scalar
            .iter()
            .zip(&want_scores)
            .filter(|(a, _)| a.is_finite())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{kind}: scalar path against {reference:?}: max |score difference| {max:.2e}");
        assert!(
            max <= SCALAR_PATH_ABS_TOL,
            "{kind}: scalar path differs by {max}"
        );
    }
}

#[test]
fn a_bf16_engine_is_not_screened() {
    let tmp = tempfile::tempdir().unwrap();
    let err = convert_fixture_screened(ModelKind::Vaecf, tmp.path(), Precision::Bf16, Screen::Int8)
        .err()
        .expect("bf16 with the int8 screen must be refused");
    let message = err.to_string();
    assert!(
        message.contains("bf16") && message.contains("screen"),
        "{message}"
    );
}
