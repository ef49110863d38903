//! The GPU path of recsys: the fused score + top-k CUDA kernels of `kernels/fused_topk.cu` and,
//! behind the `cuda` feature, their host side through cudarc (NVRTC at model load, driver API
//! launches). Without the feature this crate only carries the sources and their compile settings,
//! which the NVRTC compile check uses.

#[cfg(feature = "cuda")]
pub mod cuda;

use sha2::{Digest, Sha256};

/// The CUDA C++ source of every kernel.
pub const SOURCE: &str = include_str!("../kernels/fused_topk.cu");

/// Kernels the host launches, by their `extern "C"` names.
pub const KERNELS: &[&str] = &[
    "score_tile_topk_f32",
    "score_tile_topk_f16",
    "score_tile_topk_i8",
    "merge_topk",
];

/// Items per stage-1 block and candidates per merge block (`TILE` in the source).
pub const TILE: usize = 2048;
/// Threads per block (`THREADS` in the source).
pub const THREADS: u32 = 256;
/// Largest k the kernels serve (a tile keeps at most `TILE` candidates; 1024 leaves merges room to
/// halve the candidate count every pass).
pub const MAX_K: usize = 1024;
/// Architectures the compile check covers (Ampere and Hopper data-centre parts).
pub const CHECKED_ARCHS: &[&str] = &["sm_80", "sm_90"];

/// NVRTC options for `arch` (e.g. "sm_90"). IEEE float arithmetic (no fast math), so scores match
/// the CPU kernels to rounding; line info for profilers.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
}

/// Cache key of a compiled module: the source's hash, the architecture and the options.
pub fn cache_key(arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(SOURCE.as_bytes());
    for o in compile_options(arch) {
        h.update(b"\0");
        h.update(o.as_bytes());
    }
    format!("{arch}-{}", &hex::encode(h.finalize())[..16])
}

/// Stage-1 candidates kept per tile for `k`.
pub fn keep_per_tile(k: usize) -> usize {
    k.min(TILE)
}

/// Candidates per row after stage 1 and after each merge pass, for `n_items` and `k`: stage 1 leaves
/// `tiles * keep`; each pass sorts blocks of `TILE` and keeps `keep` of each, until the candidates
/// come from a single block (and so are the sorted top-k).
pub fn merge_plan(n_items: usize, k: usize) -> Vec<usize> {
    let keep = keep_per_tile(k);
    let mut blocks = n_items.div_ceil(TILE).max(1);
    let mut plan = vec![blocks * keep];
    while blocks > 1 {
        blocks = plan.last().expect("non-empty").div_ceil(TILE);
        plan.push(blocks * keep);
    }
    plan
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No driver, no device, or the device cannot run the kernels.
    #[error("no usable GPU: {0}")]
    Unavailable(String),
    #[error("NVRTC could not compile the recsys kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error("CUDA error in {what}: {message}")]
    Cuda { what: &'static str, message: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_launched_kernel_is_in_the_source() {
        for k in KERNELS {
            assert!(
                SOURCE.contains(&format!("void __launch_bounds__(THREADS) {k}(")),
                "{k}"
            );
        }
        assert!(SOURCE.contains(&format!("#define TILE {TILE}")));
        assert!(SOURCE.contains(&format!("#define THREADS {THREADS}")));
    }

    #[test]
    fn merge_plan_ends_in_one_block() {
        for (n, k) in [
            (2000, 10),
            (1_000_000, 100),
            (1_000_000, 1024),
            (10_000_000, 1),
            (5, 1),
        ] {
            let plan = merge_plan(n, k);
            assert_eq!(*plan.last().unwrap(), k, "{n} {k}: {plan:?}");
            assert!(plan.windows(2).all(|w| w[1] < w[0]), "{n} {k}: {plan:?}");
        }
        assert_eq!(merge_plan(1_000_000, 100), vec![48_900, 2_400, 200, 100]);
        assert_eq!(merge_plan(2000, 10), vec![10]);
    }

    #[test]
    fn cache_keys_differ_by_arch() {
        assert_ne!(cache_key("sm_80"), cache_key("sm_90"));
        assert_eq!(cache_key("sm_90"), cache_key("sm_90"));
    }
}
