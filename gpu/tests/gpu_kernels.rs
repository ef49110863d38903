//! The CUDA kernels against a scalar f64 reference on fresh random inputs. The device tests need a
//! GPU and are `#[ignore]`d; scripts/gpu-check.sh runs them on a lent GPU machine with
//! `--include-ignored`. The load-error test runs everywhere.
#![cfg(feature = "cuda")]

mod common;

use common::{assert_row_matches, exclusions, matrix, reference, Rng};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::cuda::{driver_present, GpuOutputLayer};
use recsys_gpu::GpuError;

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

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh"]
fn fused_topk_matches_the_reference() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut checked = 0;
    for kind in ["f32", "f16", "i8"] {
        // N below, at and above a tile boundary, a hidden size that leaves room for 2 rows per
        // block, and a large odd catalogue.
        for &(n, d) in &[
            (2000usize, 64usize),
            (2048, 64),
            (2049, 96),
            (3001, 1000),
            (100_003, 64),
        ] {
            let w = matrix(kind, n, d, &mut rng);
            let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
            let layer = GpuOutputLayer::new(0, &w, &Tensor::from_vec(vec![n], bias.clone()))
                .unwrap_or_else(|e| panic!("{e}"));
            // An unwritten slot then holds NaN, which drops out of the results and shortens a
            // row against the reference.
            layer.poison_outputs();
            for &rows in &[1usize, 7, 64] {
                let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
                let excluded = exclusions(rows, n, 50, &mut rng);
                let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
                for &k in &[1usize, 10, 100, 1024] {
                    let got = layer.topk(&hidden, k, &refs).unwrap();
                    for r in 0..rows {
                        let want =
                            reference(&w, &bias, &hidden[r * d..(r + 1) * d], k, &excluded[r]);
                        assert_row_matches(&got[r], &want, &format!("{kind} n={n} k={k} row {r}"));
                        checked += 1;
                    }
                }
            }
        }
    }
    println!("{checked} rows checked against the f64 reference");
}
