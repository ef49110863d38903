//! Every kernel compiles with NVRTC for each checked architecture, and ptxas (run on the PTX, as
//! the driver would) reports no register spills. Needs no GPU: NVRTC and ptxas come from PyPI
//! (12.6, 12.9 and 13.0, installed by scripts/python-env.sh); scripts/test.sh runs this once per
//! version with that version's libraries on the path and `RECSYS_EXPECT_NVRTC` naming it, and the
//! GPU bundle runs it with the GPU machine's toolkit.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use recsys_gpu::{cuda, CHECKED_ARCHS, MODULES};

fn ptxas() -> PathBuf {
    if let Ok(p) = std::env::var("RECSYS_PTXAS") {
        return PathBuf::from(p);
    }
    PathBuf::from("ptxas")
}

/// (function, registers, spill store bytes, spill load bytes) from `ptxas -v` output.
fn resources(log: &str) -> Vec<(String, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut spills = (0, 0);
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
        } else if line.contains("spill stores") {
            let num = |key: &str| {
                line.split(',')
                    .find(|p| p.contains(key))
                    .and_then(|p| p.split_whitespace().next()?.parse().ok())
                    .unwrap_or(u32::MAX)
            };
            spills = (num("spill stores"), num("spill loads"));
        } else if let Some(rest) = line.split("Used ").nth(1) {
            let regs = rest
                .split_whitespace()
                .next()
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            if let Some(name) = current.take() {
                out.push((name, regs, spills.0, spills.1));
            }
        }
    }
    out
}

#[test]
fn kernels_compile_for_every_checked_arch_without_spills() {
    if let Err(e) = cuda::nvrtc_check() {
        panic!("{e} (scripts/test.sh puts the venv's NVRTC on the library path)");
    }
    let (major, minor) = cuda::nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    println!("NVRTC {major}.{minor}");
    if let Ok(expected) = std::env::var("RECSYS_EXPECT_NVRTC") {
        assert_eq!(
            format!("{major}.{minor}"),
            expected,
            "the NVRTC opened is not the one this run is meant to check"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for arch in CHECKED_ARCHS {
        let ptxs = cuda::compile(arch).unwrap_or_else(|e| panic!("{e}"));
        for ((file, _, kernels), ptx) in MODULES.iter().zip(&ptxs) {
            for k in *kernels {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "{arch}: {k} missing from the PTX of {file}"
                );
            }
            let path = dir.path().join(format!("{arch}-{file}.ptx"));
            std::fs::write(&path, ptx).unwrap();
            let run = Command::new(ptxas())
                .args(["-v", &format!("--gpu-name={arch}"), "-o"])
                .arg(dir.path().join(format!("{arch}-{file}.cubin")))
                .arg(&path)
                .output()
                .unwrap_or_else(|e| {
                    panic!("cannot run ptxas ({e}); set RECSYS_PTXAS or put it on PATH")
                });
            let log = String::from_utf8_lossy(&run.stderr).into_owned()
                + &String::from_utf8_lossy(&run.stdout);
            assert!(run.status.success(), "{arch} {file}: ptxas failed:\n{log}");
            let found = resources(&log);
            assert_eq!(
                found.len(),
                kernels.len(),
                "{arch} {file}: ptxas reported {found:?}\n{log}"
            );
            for (name, regs, stores, loads) in &found {
                println!("{arch} {name}: {regs} registers, {stores} bytes spill stores, {loads} bytes spill loads");
                assert_eq!(
                    (*stores, *loads),
                    (0, 0),
                    "{arch}: {name} spills registers\n{log}"
                );
            }
        }
    }
}

/// The tiled scans of f16 and int8 weights run on the tensor cores where the architecture has
/// mma.sync m16n8k16 (sm_80 on), and compile to the FFMA tiles for older GPUs (a T4 is sm_75), so
/// one source serves both.
#[test]
fn half_precision_tiles_use_the_tensor_cores_from_sm_80_and_ffma_before() {
    if let Err(e) = cuda::nvrtc_check() {
        panic!("{e} (scripts/test.sh puts the venv's NVRTC on the library path)");
    }
    let mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
    // The PTX of one entry: from its `.entry` line to the next entry.
    let entry = |ptx: &str, name: &str| -> String {
        let start = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("{name} missing"));
        let rest = &ptx[start + 1..];
        rest[..rest.find(".entry ").unwrap_or(rest.len())].to_string()
    };
    for (arch, tensor_cores) in [("sm_75", false), ("sm_80", true), ("sm_90", true)] {
        let ptx = &cuda::compile(arch).unwrap_or_else(|e| panic!("{e}"))[0];
        for kernel in [
            "gemm_sample_f16",
            "gemm_above_f16",
            "gemm_sample_i8",
            "gemm_above_i8",
        ] {
            assert_eq!(
                entry(ptx, kernel).contains(mma),
                tensor_cores,
                "{arch} {kernel}"
            );
        }
        for kernel in ["gemm_sample_f32", "gemm_above_f32"] {
            assert!(!entry(ptx, kernel).contains("mma.sync"), "{arch} {kernel}");
        }
    }
}
