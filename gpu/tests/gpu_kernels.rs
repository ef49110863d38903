//! The CUDA kernels against a scalar f64 reference on fresh random inputs. The device tests need a
//! GPU and are `#[ignore]`d; scripts/gpu-check.sh runs them on a lent GPU machine with
//! `--include-ignored`. The load-error test runs everywhere.
#![cfg(feature = "cuda")]

mod common;

use common::{assert_top_k_matches, coalesced_exhaustive_topk, exclusions, matrix, Rng};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::cuda::{driver_present, CudaDevice, GpuOutputLayer};
use recsys_gpu::device::Device;
use recsys_gpu::output_layer::{DeviceOutputLayer, ScanStrategy};
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
                        assert_top_k_matches(
                            &got[r],
                            &w,
                            &bias,
                            &hidden[r * d..(r + 1) * d],
                            k,
                            &excluded[r],
                            &format!("{kind} n={n} k={k} row {r}"),
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    println!("{checked} rows checked against the f64 reference");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh"]
fn the_threshold_scan_matches_the_reference_on_the_gpu() {
    // The sample, the survivors' atomics and ballots, and the merges over them on the hardware;
    // k up to the largest the threshold scan takes (256), a batch of groups and a lone row; by
    // tiles and through the kernels that read rows contiguously (GEMV up to 4 rows, GEMM above).
    let mut rng = Rng(0x7F4A_7C15_9E37_79B9);
    let mut checked = 0;
    for (kind, strategy) in ["f32", "f16", "i8"].into_iter().flat_map(|kind| {
        [ScanStrategy::Threshold, ScanStrategy::CoalescedThreshold].map(|strategy| (kind, strategy))
    }) {
        let (n, d) = (100_003usize, 64usize);
        let w = matrix(kind, n, d, &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
        let mut layer = GpuOutputLayer::new(0, &w, &Tensor::from_vec(vec![n], bias.clone()))
            .unwrap_or_else(|e| panic!("{e}"));
        layer.set_strategy(strategy);
        layer.poison_outputs();
        for &rows in &[1usize, 3, 7, 64] {
            let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
            let excluded = exclusions(rows, n, 50, &mut rng);
            let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
            for &k in &[1usize, 10, 100, 256] {
                let got = layer.topk(&hidden, k, &refs).unwrap();
                for r in 0..rows {
                    assert_top_k_matches(
                        &got[r],
                        &w,
                        &bias,
                        &hidden[r * d..(r + 1) * d],
                        k,
                        &excluded[r],
                        &format!("{strategy:?} {kind} n={n} k={k} row {r}"),
                    );
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} rows checked against the f64 reference (threshold scan)");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh"]
fn the_coalesced_threshold_scan_agrees_bit_for_bit_with_its_own_exhaustive_ranking_on_the_gpu() {
    // The coalesced strategy's sample and full scan must compute every score to the same bits on
    // the hardware (fmaf in a fixed order; the same tensor-core instructions), or a sampled item
    // could miss the threshold it set and drop out: its answers must equal ranking every item's
    // score from the same sample kernel. GEMV at 1 and 3 rows, tensor cores (f16, int8) and FFMA
    // tiles (f32) at 7 and 64.
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let device = CudaDevice::new(0).unwrap_or_else(|e| panic!("{e}"));
    let (n, d, k) = (100_003usize, 64usize, 100usize);
    for kind in ["f32", "f16", "i8"] {
        let w = matrix(kind, n, d, &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
        let mut layer =
            DeviceOutputLayer::new(&device, &w, &Tensor::from_vec(vec![n], bias.clone()), None)
                .unwrap_or_else(|e| panic!("{e}"));
        layer.strategy = ScanStrategy::CoalescedThreshold;
        for &rows in &[1usize, 3, 7, 64] {
            let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
            let excluded = exclusions(rows, n, 50, &mut rng);
            let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
            let on_device = device.upload_f32(&hidden).unwrap();
            let got = layer.top_k(&device, &on_device, k, &refs).unwrap();
            let want = coalesced_exhaustive_topk(&device, &w, &bias, &hidden, k, &excluded);
            assert_eq!(got, want, "{kind} rows={rows}");
        }
    }
}

/// A libnvrtc of the other CUDA major version than this build's bindings, to open in its place:
/// `RECSYS_OTHER_NVRTC`, else the one scripts/python-env.sh installs into the venv.
fn other_nvrtc() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("RECSYS_OTHER_NVRTC") {
        return Some(path.into());
    }
    let venv = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv"));
    let candidate = if recsys_gpu::cuda::BUILT_FOR_CUDA == "13" {
        // The CUDA 12.6 NVRTC of the venv's site-packages.
        std::fs::read_dir(venv.join("lib"))
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| {
                e.path()
                    .join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
            })
            .find(|p| p.exists())?
    } else {
        venv.join("cuda-13.0/nvidia/cu13/lib/libnvrtc.so.13")
    };
    candidate.exists().then_some(candidate)
}

#[test]
fn an_nvrtc_of_the_other_cuda_version_is_used_or_refused_never_a_panic() {
    const CHILD: &str = "RECSYS_NVRTC_PROBE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        // The child: "libnvrtc.so" resolves to the other version's library. CUDA 13 removed
        // symbols that the CUDA 12 bindings load (nvrtcGetNVVM), so a CUDA 12 build must refuse a
        // CUDA 13 NVRTC, with a clear error; a CUDA 13 build finds every symbol it loads in a 12.x
        // NVRTC and may use it (its PTX loads on a newer driver). Either way, no panic.
        match recsys_gpu::cuda::nvrtc_check() {
            Err(err) => {
                let message = err.to_string();
                assert!(message.contains("no usable GPU"), "{message}");
                assert!(
                    message.contains("cannot be used by this build"),
                    "{message}"
                );
                assert!(!recsys_gpu::cuda::nvrtc_present());
                let compile =
                    recsys_gpu::cuda::compile("sm_90").expect_err("nothing to compile with");
                assert!(matches!(compile, GpuError::Unavailable(_)), "{compile}");
                println!("refused: {message}");
            }
            Ok(()) => {
                assert_eq!(
                    recsys_gpu::cuda::BUILT_FOR_CUDA,
                    "13",
                    "a CUDA 12 build accepted a CUDA 13 NVRTC"
                );
                let (major, _) = recsys_gpu::cuda::nvrtc_version().unwrap();
                assert_eq!(major, 12);
                recsys_gpu::cuda::compile("sm_90").unwrap_or_else(|e| panic!("{e}"));
                println!("accepted: NVRTC 12 compiles for the CUDA 13 build");
            }
        }
        return;
    }
    let Some(library) = other_nvrtc() else {
        println!("skipped: no NVRTC of the other CUDA major version here (scripts/python-env.sh installs one)");
        return;
    };
    // cudarc tries "libnvrtc.so" first; a folder first on the library path pins it.
    let pin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&library, pin.path().join("libnvrtc.so")).unwrap();
    let library_path = format!(
        "{}:{}:{}",
        pin.path().display(),
        library.parent().unwrap().display(),
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
    );
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "an_nvrtc_of_the_other_cuda_version_is_used_or_refused_never_a_panic",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", library_path)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&child.stdout).into_owned()
        + &String::from_utf8_lossy(&child.stderr);
    assert!(
        child.status.success(),
        "child with {}:\n{log}",
        library.display()
    );
    let verdict = log
        .lines()
        .find(|l| l.starts_with("refused") || l.starts_with("accepted"));
    println!("{}: {}", library.display(), verdict.unwrap_or("?"));
}
