//! The CUDA kernels against a scalar f64 reference on fresh random inputs. The device tests need a
//! GPU and are `#[ignore]`d; scripts/gpu-check.sh runs them on a lent GPU machine with
//! `--include-ignored`. The load-error test runs everywhere.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::cuda::{driver_present, GpuOutputLayer};
use recsys_gpu::GpuError;

/// Score tolerance of the GPU (f32 accumulation in another order) against f64.
const SCORE_ABS_TOL: f32 = 1e-4;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

#[test]
fn without_a_usable_gpu_the_error_says_why() {
    let weight = Matrix::F32(Tensor::from_vec(vec![3, 2], vec![0.0; 6]));
    let bias = Tensor::from_vec(vec![3], vec![0.0; 3]);
    // With a driver, a device that does not exist; without one, the missing driver.
    let ordinal = if driver_present() { 10_000 } else { 0 };
    match GpuOutputLayer::new(ordinal, &weight, &bias) {
        Err(GpuError::Unavailable(msg)) => {
            let expected = if driver_present() {
                "cannot open CUDA device 10000"
            } else {
                "libcuda.so.1"
            };
            assert!(msg.contains(expected), "{msg}");
        }
        Err(other) => panic!("expected Unavailable, got {other}"),
        Ok(_) => panic!("device {ordinal} should not exist"),
    }
}

fn matrix(kind: &str, n: usize, d: usize, rng: &mut Rng) -> Matrix {
    let values: Vec<f32> = (0..n * d).map(|_| rng.uniform()).collect();
    match kind {
        "f32" => Matrix::F32(Tensor::from_vec(vec![n, d], values)),
        "f16" => Matrix::F16 {
            bits: Arc::new(values.iter().map(|v| half_bits(*v)).collect()),
            start: 0,
            rows: n,
            cols: d,
        },
        _ => {
            let scales: Vec<f32> = (0..n).map(|_| 0.5 + rng.uniform().abs()).collect();
            Matrix::I8 {
                q: Arc::new((0..n * d).map(|_| (rng.next() % 255) as i8).collect()),
                scales: Arc::new(scales.iter().map(|s| s / 127.0).collect()),
                start: 0,
                rows: n,
                cols: d,
            }
        }
    }
}

fn half_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Reference top-k in f64 with the engine's tie rule.
fn reference(w: &Matrix, bias: &[f32], h: &[f32], k: usize, excluded: &[u32]) -> Vec<(u32, f32)> {
    let d = w.cols();
    let mut all: Vec<(u32, f64)> = (1..w.rows())
        .filter(|i| !excluded.contains(&(*i as u32)))
        .map(|i| {
            let mut row = vec![0f32; d];
            w.add_row_into(i, &mut row);
            let dot: f64 = row.iter().zip(h).map(|(a, b)| *a as f64 * *b as f64).sum();
            (i as u32, dot + bias[i] as f64)
        })
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    all.into_iter().map(|(i, s)| (i, s as f32)).collect()
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh"]
fn fused_topk_matches_the_reference() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut checked = 0;
    for kind in ["f32", "f16", "i8"] {
        // N below, at and above a tile boundary, and a large odd catalogue.
        for &(n, d) in &[(2000usize, 64usize), (2048, 64), (2049, 96), (100_003, 64)] {
            let w = matrix(kind, n, d, &mut rng);
            let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
            let layer = GpuOutputLayer::new(0, &w, &Tensor::from_vec(vec![n], bias.clone()))
                .unwrap_or_else(|e| panic!("{e}"));
            for &rows in &[1usize, 7, 64] {
                let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
                let excluded: Vec<Vec<u32>> = (0..rows)
                    .map(|_| {
                        (0..(rng.next() % 50))
                            .map(|_| (rng.next() % n as u64) as u32)
                            .collect()
                    })
                    .collect();
                let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
                for &k in &[1usize, 10, 100, 1024] {
                    let got = layer.topk(&hidden, k, &refs).unwrap();
                    for r in 0..rows {
                        let want =
                            reference(&w, &bias, &hidden[r * d..(r + 1) * d], k, &excluded[r]);
                        assert_eq!(got[r].len(), want.len(), "{kind} n={n} k={k} row {r}");
                        for (pos, (g, e)) in got[r].iter().zip(&want).enumerate() {
                            assert!(
                                (g.1 - e.1).abs() <= SCORE_ABS_TOL,
                                "{kind} n={n} k={k} row {r} rank {pos}: {g:?} vs {e:?}"
                            );
                            // Indices may differ only where the reference itself has a near-tie.
                            if g.0 != e.0 {
                                let tie = want.iter().any(|o| {
                                    o.0 == g.0 && (o.1 - e.1).abs() <= 2.0 * SCORE_ABS_TOL
                                });
                                assert!(
                                    tie,
                                    "{kind} n={n} k={k} row {r} rank {pos}: {g:?} vs {e:?}"
                                );
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    println!("{checked} rows checked against the f64 reference");
}
