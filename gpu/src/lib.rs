//! The GPU path of recsys: the fused score + top-k CUDA kernels of `kernels/fused_topk.cu` and,
//! behind the `cuda` feature, their host side through cudarc (NVRTC at model load, driver API
//! launches). Without the feature this crate only carries the sources and their compile settings,
//! which the NVRTC compile check uses.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod model;
pub mod output_layer;
pub mod upload;
pub mod workspace;

use sha2::{Digest, Sha256};

/// The CUDA C++ source of the fused score + top-k kernels.
pub const SOURCE: &str = include_str!("../kernels/fused_topk.cu");
/// The CUDA C++ source of the encoder kernels.
pub const ENCODER_SOURCE: &str = include_str!("../kernels/encoders.cu");

/// The kernel sources, each compiled into its own module: (file name, source, kernels launched
/// from it by their `extern "C"` names).
pub const MODULES: &[(&str, &str, &[&str])] = &[
    ("fused_topk.cu", SOURCE, KERNELS),
    ("encoders.cu", ENCODER_SOURCE, ENCODER_KERNELS),
];

/// Fused score + top-k kernels the host launches.
pub const KERNELS: &[&str] = &[
    "score_tile_topk_f32",
    "score_tile_topk_f16",
    "score_tile_topk_i8",
    "merge_topk",
    "sample_tile_topk_f32",
    "sample_tile_topk_f16",
    "sample_tile_topk_i8",
    "score_above_f32",
    "score_above_f16",
    "score_above_i8",
    "reset_survivors",
    "finalize_survivors",
    "sample_threshold",
    "gemv_sample_f32",
    "gemv_sample_f16",
    "gemv_sample_i8",
    "gemv_above_f32",
    "gemv_above_f16",
    "gemv_above_i8",
    "gemm_sample_f32",
    "gemm_sample_f16",
    "gemm_sample_i8",
    "gemm_above_f32",
    "gemm_above_f16",
    "gemm_above_i8",
];

/// Encoder kernels the host launches.
pub const ENCODER_KERNELS: &[&str] = &[
    "linear_f32",
    "add_layer_norm",
    "embed_tokens_f32",
    "embed_tokens_f16",
    "embed_tokens_i8",
    "attention",
    "gru_gates",
    "gather_rows",
    "embedding_bag_f32",
    "embedding_bag_f16",
    "embedding_bag_i8",
    "hstu_attention",
    "hstu_gate",
    "add_rows",
    "l2_normalize_rows",
];

/// Items per stage-1 block and candidates per merge block (`TILE` in the source).
pub const TILE: usize = 2048;
/// Threads per block (`THREADS` in the source).
pub const THREADS: u32 = 256;
/// Most batch rows one stage-1 block scores against its tile (`MAX_ROWS` in the source).
pub const MAX_ROWS: usize = 4;
/// Dynamic shared memory a stage-1 block may use for its group's hidden vectors: with the static
/// 40 KiB of scores and indices, a block stays within the 48 KiB every architecture grants without
/// opting in.
pub const MAX_GROUP_HIDDEN_BYTES: usize = 8 * 1024;
/// Threads per block of the encoder kernels (`ENC_THREADS` in kernels/encoders.cu).
pub const ENC_THREADS: u32 = 256;
/// Square tile of the dense-layer kernel (`LINEAR_TILE`); its blocks have LINEAR_TILE^2 threads.
pub const LINEAR_TILE: u32 = 16;
/// Largest grid y dimension CUDA launches take (catalogue tiles in stage 1, batch rows in the merge
/// passes, row tiles of the dense layers).
pub const MAX_GRID_Y: usize = 65_535;
/// Widest hidden vector the kernels take (one row must fit the group's shared memory).
pub const MAX_DIM: usize = MAX_GROUP_HIDDEN_BYTES / 4;

// A stage-1 block's shared memory: scores (MAX_ROWS x TILE f32), indices (TILE u32) and the
// group's hidden rows must fit the 48 KiB granted without an opt-in attribute.
const _: () = assert!((MAX_ROWS * TILE + TILE) * 4 + MAX_GROUP_HIDDEN_BYTES <= 48 * 1024);
// The coalesced scans keep the whole batch's hidden rows in shared memory.
const _: () = assert!(MAX_ROWS * MAX_DIM * 4 <= 48 * 1024);
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
pub fn cache_key(source: &str, arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
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

/// Survivor slots per batch row of the threshold scan. The sample is sized so that about a
/// quarter of them fill on average; a row whose survivors overflow them (ties at its threshold, a
/// sample unlike the catalogue) is answered by the tile scan instead.
pub const SURVIVOR_CAPACITY: usize = 4 * TILE;
/// Items per sampled item, at least: below it the sample would cost more than the selection the
/// threshold scan saves.
pub const MIN_SAMPLE_STRIDE: usize = 8;

/// The threshold scan's sample for one call: every `stride`-th item (`positions` of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThresholdPlan {
    pub stride: usize,
    pub positions: usize,
    /// Survivor slots per row.
    pub capacity: usize,
}

/// The sample of a threshold scan of `n_items` items for the top `k`, with `capacity` survivor
/// slots per row, or `None` where it does not pay (a small catalogue, or a k so large that the
/// sample would be a large part of the catalogue). The sample's k-th best score stands at about
/// the k / S quantile of the scores, so about k x N / S items reach it; S = 4 k N / capacity keeps
/// them at a quarter of the slots, i.e. one item in capacity / (4 k).
pub fn threshold_plan(n_items: usize, k: usize, capacity: usize) -> Option<ThresholdPlan> {
    let stride = capacity / (4 * k.max(1));
    if stride < MIN_SAMPLE_STRIDE || n_items < MIN_SAMPLE_STRIDE * TILE {
        return None;
    }
    Some(ThresholdPlan {
        stride,
        positions: n_items.div_ceil(stride),
        capacity,
    })
}

/// Batch rows and positions of one block of the tiled scans (`GEMM_ROWS`, `GEMM_ITEMS` in the
/// source): the grid is (positions / GEMM_ITEMS, rows / GEMM_ROWS), rounded up.
pub const GEMM_ROWS: usize = 64;
pub const GEMM_ITEMS: usize = 128;

/// The tiled scans' grid for `positions` positions and `rows` batch rows: (item tiles, row groups).
pub fn gemm_grid(positions: u32, rows: u32) -> (u32, u32) {
    (
        positions.div_ceil(GEMM_ITEMS as u32),
        rows.div_ceil(GEMM_ROWS as u32),
    )
}

/// How the coalesced (GEMV) scans are launched for one batch of at most [`MAX_ROWS`] rows: `lanes`
/// lanes read each item's row together (`gemv_*` in kernels/fused_topk.cu), over a grid of
/// `blocks` blocks of [`THREADS`] threads with the batch's hidden rows in `shared_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvLaunch {
    pub lanes: u32,
    pub blocks: u32,
    pub shared_bytes: u32,
}

/// The coalesced scans' launch for `rows` hidden vectors against rows of `pitch` elements of
/// `element_bytes`, on a device that keeps `resident_blocks` of them running at once (the grid
/// strides over the catalogue, so more blocks would only wait). Lanes per item: enough that each
/// lane reads about one 16-byte chunk of the row, a power of two up to the warp (d = 64: 16 lanes
/// for f32, 8 for f16, 4 for int8; d = 600: the whole warp). `None` for a batch the scans do not
/// take (more than [`MAX_ROWS`] rows).
pub fn gemv_launch(
    pitch: usize,
    element_bytes: usize,
    rows: usize,
    resident_blocks: u32,
) -> Option<GemvLaunch> {
    if rows == 0 || rows > MAX_ROWS {
        return None;
    }
    let chunks = (pitch * element_bytes).div_ceil(16).max(1);
    Some(GemvLaunch {
        lanes: chunks.next_power_of_two().min(32) as u32,
        blocks: resident_blocks.max(1),
        shared_bytes: (4 * pitch * rows) as u32,
    })
}

/// How stage 1 is launched for one batch: grid [`Stage1Launch::grid`] of `THREADS` threads, each
/// block scoring one tile for `rows_per_block` rows and keeping `keep` candidates per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stage1Launch {
    /// Elements per stored weight row (and per hidden row in shared memory): see [`row_pitch`].
    pub pitch: u32,
    pub tiles: u32,
    pub groups: u32,
    pub rows_per_block: u32,
    pub keep: u32,
    pub shared_bytes: u32,
}

impl Stage1Launch {
    /// The grid: groups on x, tiles on y. Blocks start in x-major order, so the groups of one tile
    /// run together and read its weights from HBM once (the rest hit L2); tiles on x would make
    /// every group stream the whole table.
    pub fn grid(&self) -> (u32, u32) {
        (self.groups, self.tiles)
    }
}

/// Elements per stored row of an output-layer table of width `dim` whose elements take
/// `element_bytes`: `dim` rounded up to a multiple of 16 bytes. The rows are padded with zeros, so
/// each starts 16-byte aligned and the scoring kernel reads it 16 bytes at a time whatever `dim`
/// is (d = 600 int8 rows are 600 bytes, which would otherwise force one-byte loads).
pub fn row_pitch(dim: usize, element_bytes: usize) -> usize {
    let per_16_bytes = 16 / element_bytes;
    dim.div_ceil(per_16_bytes) * per_16_bytes
}

/// The stage-1 launch for `rows` hidden vectors of width `dim` against `n_items` items stored at
/// `pitch` elements a row, at `k`.
pub fn stage1_launch(
    n_items: usize,
    dim: usize,
    pitch: usize,
    rows: usize,
    k: usize,
) -> Result<Stage1Launch> {
    if dim == 0 || pitch < dim || !pitch.is_multiple_of(4) || pitch > MAX_DIM {
        return Err(GpuError::Invalid(format!(
            "hidden size {dim}: the GPU kernels take 1..={MAX_DIM}"
        )));
    }
    if k == 0 || k > MAX_K {
        return Err(GpuError::Invalid(format!(
            "k = {k}: the GPU path serves 1..={MAX_K}"
        )));
    }
    if rows > MAX_GRID_Y {
        return Err(GpuError::Invalid(format!(
            "a batch of {rows} rows: the GPU path takes at most {MAX_GRID_Y} per launch"
        )));
    }
    if n_items > MAX_GRID_Y * TILE {
        return Err(GpuError::Invalid(format!(
            "{n_items} items: the GPU path scores at most {} (one tile of {TILE} per grid row)",
            MAX_GRID_Y * TILE
        )));
    }
    if rows == 0 || n_items == 0 {
        return Err(GpuError::Invalid(format!(
            "{rows} rows against {n_items} items: nothing to score or too many items"
        )));
    }
    let rows_per_block = MAX_ROWS.min(MAX_GROUP_HIDDEN_BYTES / (4 * pitch)).max(1);
    Ok(Stage1Launch {
        pitch: pitch as u32,
        tiles: n_items.div_ceil(TILE) as u32,
        groups: rows.div_ceil(rows_per_block) as u32,
        rows_per_block: rows_per_block as u32,
        keep: keep_per_tile(k) as u32,
        shared_bytes: (4 * pitch * rows_per_block) as u32,
    })
}

/// Each row's exclusions as CSR (`offsets[rows + 1]` into `ids`), every row sorted and without
/// duplicates, so the kernels can binary-search them.
pub fn exclusion_csr(exclude: &[&[u32]]) -> (Vec<u32>, Vec<u32>) {
    let mut offsets = Vec::with_capacity(exclude.len() + 1);
    let mut ids = Vec::new();
    offsets.push(0u32);
    for list in exclude {
        let mut sorted = list.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        ids.extend(sorted);
        offsets.push(ids.len() as u32);
    }
    (offsets, ids)
}

/// One row's answer: (internal index, score), best first; fewer than k when fewer items qualify.
pub type Ranked = Vec<(u32, f32)>;

/// The rows' answers from the last merge pass's output (`rows x plan.last()` candidates, sorted
/// within each row), dropping the padding that stands for excluded or missing items.
pub fn ranked_rows(
    scores: &[f32],
    index: &[u32],
    plan: &[usize],
    rows: usize,
    k: usize,
) -> Vec<Ranked> {
    let width = *plan.last().expect("plan is never empty");
    (0..rows)
        .map(|r| {
            index[r * width..(r + 1) * width]
                .iter()
                .zip(&scores[r * width..(r + 1) * width])
                .take(k)
                .filter(|(i, s)| **i != u32::MAX && s.is_finite())
                .map(|(i, s)| (*i, *s))
                .collect()
        })
        .collect()
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
    /// The device's answers disagree with the CPU engine's on the load-time self-check.
    #[error(
        "the GPU failed its self-check against the CPU engine: {0}; refusing to serve from it"
    )]
    SelfCheck(String),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_launched_kernel_is_in_the_source() {
        for (name, source, kernels) in MODULES {
            for k in *kernels {
                // Written out (`... name(`) or declared by a macro of the source (`MACRO(name, `).
                assert!(
                    source.contains(&format!(" {k}(\n")) || source.contains(&format!("({k}, ")),
                    "{k} not defined in {name}"
                );
            }
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
    fn stage1_groups_rows_within_the_shared_memory_budget() {
        let l = stage1_launch(1_000_000, 64, 64, 64, 100).unwrap();
        assert_eq!(
            (l.tiles, l.groups, l.rows_per_block, l.keep),
            (489, 16, 4, 100)
        );
        assert_eq!(l.shared_bytes, 1024);
        assert_eq!(l.grid(), (16, 489));
        let wide = stage1_launch(5000, 1024, 1024, 7, 10).unwrap();
        assert_eq!((wide.rows_per_block, wide.groups), (2, 4));
        let widest = stage1_launch(5000, MAX_DIM, MAX_DIM, 3, 10).unwrap();
        assert_eq!(widest.rows_per_block, 1);
        assert!(widest.shared_bytes as usize <= MAX_GROUP_HIDDEN_BYTES);
        for bad in [
            stage1_launch(5000, 64, 64, MAX_GRID_Y + 1, 10),
            stage1_launch(5000, MAX_DIM + 1, MAX_DIM + 1, 1, 10),
            stage1_launch(5000, 600, 600 - 4, 1, 10),
            stage1_launch(5000, 64, 64, 1, MAX_K + 1),
            stage1_launch(5000, 64, 64, 1, 0),
            stage1_launch(5000, 64, 64, 0, 10),
            stage1_launch(MAX_GRID_Y * TILE + 1, 64, 64, 1, 10),
        ] {
            assert!(matches!(bad, Err(GpuError::Invalid(_))), "{bad:?}");
        }
    }

    #[test]
    fn the_shared_memory_budget_matches_the_source() {
        assert!(SOURCE.contains(&format!("#define MAX_ROWS {MAX_ROWS}")));
        assert!(ENCODER_SOURCE.contains(&format!("#define ENC_THREADS {ENC_THREADS}")));
        assert!(ENCODER_SOURCE.contains(&format!("#define LINEAR_TILE {LINEAR_TILE}")));
        assert_eq!(LINEAR_TILE * LINEAR_TILE, ENC_THREADS);
        let head = model::MAX_HEAD_DIM;
        assert!(ENCODER_SOURCE.contains(&format!("#define MAX_HEAD_DIM {head}")));
    }

    #[test]
    fn rows_are_padded_to_16_bytes() {
        assert_eq!(row_pitch(600, 1), 608);
        assert_eq!(row_pitch(600, 2), 600);
        assert_eq!(row_pitch(64, 1), 64);
        assert_eq!(row_pitch(3, 4), 4);
        assert_eq!(row_pitch(1, 2), 8);
        let l = stage1_launch(5000, 600, 608, 3, 10).unwrap();
        assert_eq!(
            (l.pitch, l.rows_per_block, l.shared_bytes),
            (608, 3, 3 * 608 * 4)
        );
    }

    #[test]
    fn cache_keys_differ_by_arch() {
        assert_ne!(cache_key(SOURCE, "sm_80"), cache_key(SOURCE, "sm_90"));
        assert_eq!(cache_key(SOURCE, "sm_90"), cache_key(SOURCE, "sm_90"));
        assert_ne!(
            cache_key(SOURCE, "sm_90"),
            cache_key(ENCODER_SOURCE, "sm_90")
        );
    }
}
