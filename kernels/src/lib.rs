//! recsys's numeric kernels, the one place that picks them, and what they run on: the bounded
//! top-k selection ([`topk`]), the worker pool and its split rules ([`parallel`]) and the opt-in
//! per-stage profiler ([`profile`]). The crate knows nothing of models, checkpoints or engines;
//! every SIMD `unsafe` of recsys is here.
//!
//! `portable` holds the portable kernels used by the models' dense layers. The output layer (scoring every
//! item, the dominant cost) runs through `fused`: packed weight panels (`packed`), a micro-kernel per
//! precision chosen from a [`KernelTable`] at engine load, and a bounded top-k selection that never
//! materialises the batch x items score matrix. The table is portable scalar code, overlaid by the
//! AVX2 + FMA + F16C kernels of `avx2` when the CPU has them, by the AVX-512 (F, BW, VNNI) kernels
//! of `avx512` on top of those when it has that too, and by `avx512bf16`'s `vdpbf16ps` kernel
//! for bfloat16 layers where the CPU has AVX512-BF16;
//! `RECSYS_FORCE_ISA=scalar|avx2|avx512|avx512bf16` forces a path so every path can be tested.
//!
//! bfloat16 layers compute one function on every path: weights and activations rounded to
//! bfloat16 ([`packed::round_to_bf16`]), and per item, for each feature pair in increasing order,
//! the odd feature's product then the even one's added to an f32 sum, each addition rounded once
//! (the products of two bfloat16 values are exact in f32). That is what `vdpbf16ps` does, so the
//! paths without it (which widen to f32 and use two fused multiply-adds) give its bits.

pub mod amx;
pub mod attention;
mod bf16;
pub mod dense;
pub mod dense_amx;
pub mod fused;
pub mod fused_amx;
pub mod fused_amx_i8;
pub mod indices;
pub mod item_mask;
pub mod packed;
pub mod parallel;
pub mod portable;
pub mod prefetch;
pub mod profile;
pub mod screen;
pub mod shared;
pub mod topk;

/// Builds a [`KernelTable`] from four generic micro-kernels `kernel::<ROWS, PANELS>`, one per
/// precision, instantiated for rows {1, 2, 4, 8} x panels {1, 2, 4, 8}.
macro_rules! kernel_table {
    ($isa:expr, $f32:ident, $f16:ident, $bf16:ident, $i8:ident, $elementwise:expr, $attention:expr) => {
        $crate::KernelTable {
            isa: $isa,
            f32: kernel_table!(@rows $f32, $crate::PanelF32),
            f16: kernel_table!(@rows $f16, $crate::PanelF16),
            bf16: kernel_table!(@rows $bf16, $crate::PanelBf16),
            i8: kernel_table!(@rows $i8, $crate::PanelI8),
            panels_per_call: $crate::PanelsPerCall::EIGHT_ACCUMULATORS,
            elementwise: $elementwise,
            attention: $attention,
            tiles: false,
        }
    };
    (@rows $kernel:ident, $ty:ty) => {
        [
            kernel_table!(@panels $kernel, $ty, 1),
            kernel_table!(@panels $kernel, $ty, 2),
            kernel_table!(@panels $kernel, $ty, 4),
            kernel_table!(@panels $kernel, $ty, 8),
        ]
    };
    (@panels $kernel:ident, $ty:ty, $r:literal) => {
        [
            $kernel::<$r, 1> as $ty,
            $kernel::<$r, 2> as $ty,
            $kernel::<$r, 4> as $ty,
            $kernel::<$r, 8> as $ty,
        ]
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod scalar;

/// Measures one core's FMA throughput (FLOP/s) with the widest vectors the kernels use (AVX-512
/// where available: two 512-bit FMA units double AVX2's rate on some CPUs, not on others), for
/// the benchmarks' compute floor; `None` without AVX2/FMA.
pub fn fma_peak_flops(iterations: u64) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if Isa::available().contains(&Isa::Avx512) {
        return Some(avx512::fma_peak_flops(iterations));
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::available().contains(&Isa::Avx2) {
        return Some(avx2::fma_peak_flops(iterations));
    }
    let _ = iterations;
    None
}

/// Instruction-set paths the kernels exist for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 with FMA and F16C (x86-64).
    Avx2,
    /// AVX2's kernels with AVX-512 (F, BW, VL, VNNI) int8, fp32, fp16 and bf16 kernels (x86-64).
    Avx512,
    /// AVX-512's kernels with bfloat16 layers on `vdpbf16ps` (AVX512-BF16, x86-64).
    Avx512Bf16,
}

impl Isa {
    /// What this CPU can run.
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            out.push(Isa::Avx2);
            // Exactly the features `avx512::panels_i8` enables. VL lets the 256-bit halves the
            // kernels hand to AVX2's epilogue live in all 32 registers: without it, every
            // accumulator that reaches a 256-bit instruction is confined to the first 16, and a
            // 4 x 8 call's 16 accumulators spilled to the stack.
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                out.push(Isa::Avx512);
                // Exactly what `avx512bf16::panels_dpbf16` adds.
                if is_x86_feature_detected!("avx512bf16") {
                    out.push(Isa::Avx512Bf16);
                }
            }
        }
        out
    }

    /// The best available path, unless `RECSYS_FORCE_ISA` names one. Forcing a path the CPU lacks
    /// falls back to scalar with a warning on stderr rather than crashing on an illegal instruction.
    pub fn detect() -> Isa {
        let available = Isa::available();
        match std::env::var("RECSYS_FORCE_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") if available.contains(&Isa::Avx2) => Isa::Avx2,
            Some("avx512") if available.contains(&Isa::Avx512) => Isa::Avx512,
            Some("avx512bf16") if available.contains(&Isa::Avx512Bf16) => Isa::Avx512Bf16,
            Some(other) => {
                eprintln!("recsys: RECSYS_FORCE_ISA={other} is not available on this CPU (have {available:?}); using scalar");
                Isa::Scalar
            }
            None => *available.last().expect("scalar is always available"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Whether bfloat16 layers run on the CPU's own bfloat16 dot product (`vdpbf16ps`) rather
    /// than widened to f32 (the same bits, without bfloat16's doubled multiply-add rate).
    pub fn has_native_bf16(self) -> bool {
        self == Isa::Avx512Bf16
    }
}

/// What a micro-kernel does with its dot products: add the bias (after scaling, for int8) and flag
/// the items whose score beats each row's bar, so the caller only looks at the few that might enter
/// a top-k instead of every item.
pub struct Epilogue<'a> {
    /// Bias of the P x 8 items of the call. Padding items carry -inf so they are never flagged.
    pub bias: &'a [f32],
    /// Per-item scales (int8 weights), as long as `bias`; empty when the weights need none.
    pub scales: &'a [f32],
    /// Per row: a score must be strictly greater to be flagged (-inf flags every real item).
    pub bars: [f32; MAX_GROUP_ROWS],
    /// Per row: the scale of its int16-quantized activations (int8 kernels only; 1 otherwise).
    pub row_scales: [f32; MAX_GROUP_ROWS],
    /// Bytes past the start of this call's panels from which the panels of a later call are
    /// requested while this one computes ([`prefetch::distance`]); 0: none. Never changes a score.
    pub prefetch: usize,
}

/// Scores of up to [`MAX_GROUP_ROWS`] hidden rows against `P` consecutive packed panels of 8 items.
///
/// Arguments: `hidden` (rows x d, row-major), `d`, the panels (P x d x 8 elements), the epilogue,
/// the scores out (rows x P x 8, by row then item), and one flag byte per (row, panel) whose bit l
/// says item l beat the row's bar. Every implementation accumulates each item's dot product over `d`
/// in increasing order, so a score never depends on how many rows or panels are computed together.
pub type PanelF32 = fn(&[f32], usize, &[f32], &Epilogue<'_>, &mut [f32], &mut [u8]);
pub type PanelF16 = fn(&[f32], usize, &[u16], &Epilogue<'_>, &mut [f32], &mut [u8]);
/// int8 weights take activations quantized to int16 (`hidden` as i16, `d` rounded up to even) and
/// accumulate exactly in i32: 16 multiply-adds per instruction, and bit-identical on every ISA.
pub type PanelI8 = fn(&[i16], usize, &[i8], &Epilogue<'_>, &mut [f32], &mut [u8]);
/// bfloat16 weights (feature pairs, [`packed::PanelData::Bf16`]) take activations rounded to
/// bfloat16 (rows padded to an even width, [`Bf16Rows`]) and compute the function of the crate
/// documentation: bit-identical on every ISA.
pub type PanelBf16 = fn(Bf16Rows<'_>, usize, &[u16], &Epilogue<'_>, &mut [f32], &mut [u8]);

/// The activations of a bf16 kernel call, rounded to bfloat16, in the two forms kernels read:
/// the bits (what `vdpbf16ps` multiplies, two features to a 32-bit lane) and the same values
/// widened to f32 (what the widening kernels broadcast: widened once per batch rather than once
/// per pair, row and call inside the kernel, where the two widening operations competed with the
/// fused multiply-adds for the vector ports). Both hold the call's rows, each `d` rounded up to
/// even wide; `wide` holds each pair odd value first (feature 2j + 1, then 2j), the order the
/// kernels add their products in, so that a [`packed::PanelData::Bf16Wide`] layer runs on the
/// fp32 kernels with these rows as they are.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Rows<'a> {
    pub bits: &'a [u16],
    pub wide: &'a [f32],
}

/// The bounds every SIMD kernel over feature pairs (int8 and bf16) relies on, asserted once per
/// call (their `// SAFETY:` comments cite them): `R` rows of activations `width` wide, `P` panels
/// of `pairs` feature pairs of 8 items (16 values each), and the epilogue's per-item data (with
/// per-item scales when `scaled`) and outputs for `P * 8` items. Returns `(pairs, width)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn assert_pair_call<const R: usize, const P: usize, A, W>(
    hidden: &[A],
    d: usize,
    w: &[W],
    epilogue: &Epilogue<'_>,
    out: &[f32],
    masks: &[u8],
    scaled: bool,
) -> (usize, usize) {
    let pairs = d.div_ceil(2);
    let width = pairs * 2;
    assert!(
        hidden.len() >= R * width
            && w.len() >= P * pairs * 16
            && out.len() >= R * P * 8
            && masks.len() >= R * P
    );
    assert!(epilogue.bias.len() >= P * 8);
    if scaled {
        assert!(epilogue.scales.len() >= P * 8);
    }
    (pairs, width)
}

/// The activations of the encoders over a slice, in place: `portable`'s code, compiled once
/// more per ISA (the arithmetic is the same plain f32 code, never contracted into FMAs, so every
/// ISA gives the same bits; tested).
pub struct Elementwise {
    /// The exact-erf GELU ([`portable::gelu_erf_inplace`]).
    pub gelu: fn(&mut [f32]),
    /// [`portable::tanh_inplace`].
    pub tanh: fn(&mut [f32]),
    /// SiLU: [`portable::silu_inplace`] on the portable table; the SIMD tables' own, with fused
    /// multiply-adds (the same function up to 3e-7 relative; tested).
    pub silu: fn(&mut [f32]),
    /// A numerically stable softmax ([`portable::softmax`]).
    pub softmax: fn(&mut [f32]),
    /// LayerNorm of every row of a matrix ([`portable::layer_norm_rows`]: rows `width` wide, gamma,
    /// beta, eps).
    pub layer_norm: fn(&mut [f32], usize, &[f32], &[f32], f64),
    /// Rows of a table summed into one row ([`portable::add_rows`]: table, width, rows, accumulator).
    pub add_rows: fn(&[f32], usize, &[u32], &mut [f32]),
    /// The same for a table of bfloat16 bits ([`portable::add_rows_bf16`]).
    pub add_rows_bf16: fn(&[u16], usize, &[u32], &mut [f32]),
}

/// The micro-kernels of one ISA, indexed by `[log2(rows)][log2(panels)]` for rows in {1, 2, 4, 8}
/// (3 rows run as 2 + 1) and panels in {1, 2, 4, 8}.
pub struct KernelTable {
    pub isa: Isa,
    pub f32: [[PanelF32; 4]; 4],
    pub f16: [[PanelF16; 4]; 4],
    pub bf16: [[PanelBf16; 4]; 4],
    pub i8: [[PanelI8; 4]; 4],
    /// Panels per call for each precision's row groups.
    pub panels_per_call: PanelsPerCall,
    pub elementwise: Elementwise,
    /// HSTU's pointwise attention of one head over one history ([`attention`]).
    pub attention: attention::AttentionKernel,
    /// Whether bf16 layers that have AMX tiles run on them ([`fused_amx`], [`dense_amx`]) rather
    /// than on this table's bf16 kernels: set only in the tables [`KernelTable::tiled`] gives.
    pub tiles: bool,
}

/// Panels per micro-kernel call for row groups of 1, 2, 4 and 8 rows, per precision: what keeps
/// enough independent accumulators in flight to cover the multiply-add latency on two ports.
/// 0 for 8 rows: batches are cut into groups of at most 4 rows.
#[derive(Clone, Copy, Debug)]
pub struct PanelsPerCall {
    pub f32: [usize; 4],
    pub f16: [usize; 4],
    pub bf16: [usize; 4],
    pub i8: [usize; 4],
}

impl PanelsPerCall {
    /// The row groups' panels per call for the kernels of `precision`.
    pub fn of(&self, precision: packed::OutputPrecision) -> [usize; 4] {
        match precision {
            packed::OutputPrecision::F32 => self.f32,
            packed::OutputPrecision::F16 => self.f16,
            packed::OutputPrecision::Bf16 => self.bf16,
            packed::OutputPrecision::Int8 => self.i8,
        }
    }

    /// The same with no row group of 8 rows: a batch is cut into groups of at most 4.
    pub const fn at_most_four_rows(self) -> PanelsPerCall {
        let mut out = self;
        out.f32[3] = 0;
        out.f16[3] = 0;
        out.bf16[3] = 0;
        out.i8[3] = 0;
        out
    }

    /// Whether some precision cuts batches into groups of 8 rows.
    pub const fn has_eight_row_groups(&self) -> bool {
        self.f32[3] != 0 || self.f16[3] != 0 || self.bf16[3] != 0 || self.i8[3] != 0
    }

    /// 1x8, 2x4 and 4x2 panels: 8 accumulators of 8 items, AVX2's 16 registers' worth.
    pub const EIGHT_ACCUMULATORS: PanelsPerCall = PanelsPerCall {
        f32: [8, 4, 2, 0],
        f16: [8, 4, 2, 0],
        bf16: [8, 4, 2, 0],
        i8: [8, 4, 2, 0],
    };
}

/// The largest row group a table cuts a batch into. Rows share each weight vector a kernel loads,
/// so 8 rows read the weights half as often per multiply-add as 4: on an Intel Xeon (Sapphire
/// Rapids class) the 8 x 4-panel fp32 call ran a 3,417 x 600 output layer at batch 64 1.18x
/// faster than 4 x 8 panels, the same 16 accumulators. Where it pays is measured, not assumed
/// (the engine's row-block plan); answers never depend on it, since every item's sum is the same
/// sequence of operations whichever rows share a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowBlock {
    Four,
    Eight,
}

impl RowBlock {
    pub fn rows(self) -> usize {
        match self {
            RowBlock::Four => 4,
            RowBlock::Eight => 8,
        }
    }
}

impl std::fmt::Debug for KernelTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tiles = if self.tiles { " + AMX tiles" } else { "" };
        write!(f, "KernelTable({}{tiles})", self.isa.name())
    }
}

impl KernelTable {
    pub fn for_isa(isa: Isa) -> &'static KernelTable {
        match isa {
            Isa::Scalar => &scalar::TABLE,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                assert!(
                    Isa::available().contains(&Isa::Avx2),
                    "AVX2 kernels requested on a CPU without AVX2/FMA/F16C"
                );
                &avx2::TABLE
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                assert!(
                    Isa::available().contains(&Isa::Avx512),
                    "AVX-512 kernels requested on a CPU without AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI"
                );
                &avx512::TABLE
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                assert!(
                    Isa::available().contains(&Isa::Avx512Bf16),
                    "AVX512-BF16 kernels requested on a CPU without AVX-512 F/BW/VL/VNNI/BF16"
                );
                &avx512bf16::TABLE
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => &scalar::TABLE,
        }
    }

    pub fn detect() -> &'static KernelTable {
        Self::for_isa(Isa::detect())
    }

    /// The kernels of `isa` cutting batches into row groups of at most `block` rows: the same
    /// table as [`KernelTable::for_isa`] where the ISA has no 8-row groups (scalar, AVX2).
    pub fn for_isa_rows(isa: Isa, block: RowBlock) -> &'static KernelTable {
        let table = Self::for_isa(isa);
        match (isa, block) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, RowBlock::Four) => &avx512::TABLE_FOUR_ROWS,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Bf16, RowBlock::Four) => &avx512bf16::TABLE_FOUR_ROWS,
            _ => table,
        }
    }

    /// This table with bf16 layers on AMX tiles (the same kernels otherwise): for the AVX-512
    /// tables (every CPU with AMX has AVX-512), `None` for others. Whether tiles can run is the
    /// caller's to check ([`amx::availability`]); a layer without tiles runs the table's kernels.
    pub fn tiled(&self) -> Option<&'static KernelTable> {
        match (self.isa, self.row_block()) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, RowBlock::Eight) => Some(&avx512::TABLE_TILES),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, RowBlock::Four) => Some(&avx512::TABLE_FOUR_ROWS_TILES),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Bf16, RowBlock::Eight) => Some(&avx512bf16::TABLE_TILES),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Bf16, RowBlock::Four) => Some(&avx512bf16::TABLE_FOUR_ROWS_TILES),
            _ => None,
        }
    }

    /// The largest row group this table cuts a batch into.
    pub fn row_block(&self) -> RowBlock {
        if self.panels_per_call.has_eight_row_groups() {
            RowBlock::Eight
        } else {
            RowBlock::Four
        }
    }

    /// Whether the kernels of `isa` come in both row blocks (a choice for the engine to measure).
    pub fn offers_row_blocks(isa: Isa) -> bool {
        Self::for_isa_rows(isa, RowBlock::Eight).row_block() == RowBlock::Eight
    }
}

/// Rows computed together by one micro-kernel call when `left` rows remain, and the panels per
/// call for that row count (`panels_per_call`, by row group of 1, 2, 4 and 8 rows: the table's;
/// no group of 8 where it says 0).
pub(crate) fn row_group_at(left: usize, panels_per_call: [usize; 4]) -> (usize, usize) {
    let size = if left >= 8 && panels_per_call[3] != 0 {
        8
    } else if left >= 4 {
        4
    } else if left >= 2 {
        2
    } else {
        1
    };
    (size, panels_per_call[rows_slot(size)])
}

/// Rows of the largest row group a table can have.
pub const MAX_GROUP_ROWS: usize = 8;
/// Scores and flag bytes of the largest call a table can make: 8 rows x 8 panels of 8 items.
pub(crate) const MAX_CALL_SCORES: usize = MAX_GROUP_ROWS * 8 * 8;
pub(crate) const MAX_CALL_PANELS: usize = MAX_GROUP_ROWS * 8;

/// Row-group index into the tables: 1 -> 0, 2 -> 1, 4 -> 2, 8 -> 3.
pub(crate) fn rows_slot(rows: usize) -> usize {
    match rows {
        1 => 0,
        2 => 1,
        4 => 2,
        8 => 3,
        _ => unreachable!("row groups are 1, 2, 4 or 8"),
    }
}

/// Panel-count index: 1 -> 0, 2 -> 1, 4 -> 2, 8 -> 3.
pub(crate) fn panels_slot(panels: usize) -> usize {
    match panels {
        1 => 0,
        2 => 1,
        4 => 2,
        8 => 3,
        _ => unreachable!("panel groups are 1, 2, 4 or 8"),
    }
}

#[cfg(test)]
mod elementwise_tests {
    use super::{Isa, KernelTable};

    /// Within this of the formula in f64, relative: the exp's polynomial (2e-8), its reduction
    /// (|x| times ln 2's f32 rounding, 3e-9 |x|) and the roundings of the evaluation.
    const SILU_RELATIVE: f64 = 3e-7;

    /// Every table's SiLU against `x / (1 + e^-x)` in f64 over the range HSTU's projections and
    /// attention scores reach and the extremes: 0 below -87 (where the exp stops) down to
    /// f32::MIN, NaN stays NaN, and every element the same function of its value wherever it lies
    /// in the slice (the SIMD tables take a slice's tail through a padded copy).
    #[test]
    fn every_isa_gives_silu_within_its_bound() {
        let xs: Vec<f32> = (-34_800..=40_000)
            .map(|i| i as f32 / 400.0)
            .chain([0.0, -0.0, 1e-30, -1e-30, 1e30, f32::MAX])
            .collect();
        for isa in Isa::available() {
            let silu = KernelTable::for_isa(isa).elementwise.silu;
            let mut got = xs.clone();
            silu(&mut got);
            for (&x, &y) in xs.iter().zip(&got) {
                let x64 = x as f64;
                let want = x64 / (1.0 + (-x64).exp());
                // The portable SiLU reduces in f32 without FMA: its own, looser bound.
                let bound = if isa == Isa::Scalar {
                    (2e-7 + 1e-7 * x64.abs()) * want.abs()
                } else {
                    (SILU_RELATIVE + 3e-9 * x64.abs()) * want.abs()
                };
                assert!(
                    (y as f64 - want).abs() <= bound,
                    "silu({x}) = {y} on {isa:?}, want {want}"
                );
            }
            for len in [1, 7, 31, 33, 70] {
                let mut part = xs[1000..1000 + len].to_vec();
                silu(&mut part);
                assert_eq!(part, got[1000..1000 + len], "a slice of {len} on {isa:?}");
            }
            let mut extremes = [-87.5f32, -100.0, -1e4, -1e30, f32::MIN, f32::NAN];
            silu(&mut extremes);
            assert_eq!(extremes[..5], [0.0; 5], "below -87 on {isa:?}");
            assert!(extremes[5].is_nan(), "NaN on {isa:?}");
        }
    }

    #[test]
    fn every_isa_gives_the_portable_bits() {
        let xs: Vec<f32> = (-30_000..30_000)
            .map(|i| i as f32 / 1000.0)
            .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, f32::MAX, f32::MIN])
            .collect();
        let scalar = &KernelTable::for_isa(Isa::Scalar).elementwise;
        for isa in Isa::available() {
            let e = &KernelTable::for_isa(isa).elementwise;
            for (f, g, name) in [(scalar.gelu, e.gelu, "gelu"), (scalar.tanh, e.tanh, "tanh")] {
                let (mut want, mut got) = (xs.clone(), xs.clone());
                f(&mut want);
                g(&mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name} on {isa:?}");
            }
            // Softmax over rows of the lengths attention uses.
            for len in [1, 7, 8, 50, 200, 333] {
                let row: Vec<f32> = xs
                    .iter()
                    .step_by(97)
                    .take(len)
                    .copied()
                    .map(|x| x / 500.0)
                    .collect();
                let (mut want, mut got) = (row.clone(), row.clone());
                (scalar.softmax)(&mut want);
                (e.softmax)(&mut got);
                assert_eq!(got, want, "softmax of {len} on {isa:?}");
            }
            // LayerNorm over rows of the widths the encoders use (and an odd one).
            for width in [7, 64, 256] {
                let rows: Vec<f32> = xs.iter().step_by(13).take(width * 9).copied().collect();
                let gamma: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 / 100.0).collect();
                let beta: Vec<f32> = (0..width).map(|i| i as f32 / 300.0 - 0.2).collect();
                let (mut want, mut got) = (rows.clone(), rows.clone());
                (scalar.layer_norm)(&mut want, width, &gamma, &beta, 1e-12);
                (e.layer_norm)(&mut got, width, &gamma, &beta, 1e-12);
                assert_eq!(got, want, "layer norm of width {width} on {isa:?}");
            }
            // Rows of a table summed (Mult-VAE's first layer), at widths around the vector sizes,
            // against an f32 loop written here, and within 1e-5 of an f64 sum.
            for width in [1, 7, 64, 65, 600] {
                let table: Vec<f32> = xs
                    .iter()
                    .cycle()
                    .step_by(3)
                    .take(width * 40)
                    .copied()
                    .collect();
                let rows: Vec<u32> = vec![0, 3, 3, 17, 39, 5];
                let mut got = vec![0.25f32; width];
                (e.add_rows)(&table, width, &rows, &mut got);
                for (c, &value) in got.iter().enumerate() {
                    let mut want = 0.25f32;
                    let mut exact = 0.25f64;
                    for &r in &rows {
                        want += table[r as usize * width + c];
                        exact += f64::from(table[r as usize * width + c]);
                    }
                    assert_eq!(
                        value.to_bits(),
                        want.to_bits(),
                        "add_rows width {width} on {isa:?}"
                    );
                    assert!((f64::from(value) - exact).abs() <= 1e-5 * exact.abs().max(1.0));
                }
                // A bf16 table sums to the bits of its widened f32 copy.
                let bits = crate::packed::to_bf16_bits(&table);
                let widened: Vec<f32> = bits
                    .iter()
                    .map(|&b| crate::packed::bf16_to_f32(b))
                    .collect();
                let (mut want, mut got) = (vec![0.25f32; width], vec![0.25f32; width]);
                (scalar.add_rows)(&widened, width, &rows, &mut want);
                (e.add_rows_bf16)(&bits, width, &rows, &mut got);
                assert_eq!(got, want, "add_rows_bf16 width {width} on {isa:?}");
            }
        }
    }
}

#[cfg(test)]
mod prefetch_tests {
    use super::packed::{quantize_activations, quantize_int8_per_row};
    use super::{lcg, Epilogue, Isa, KernelTable, MAX_GROUP_ROWS};

    /// A call's prefetch distance only requests lines (and, in the AVX-512 int8 kernel, makes a
    /// one-row call read its panels in address order rather than side by side): every call shape
    /// of every ISA gives the same scores and flags with and without it, and the int8 kernels
    /// give the scalar kernel's bits either way. The widths cover odd feature pairs and several
    /// runs of activation registers (`d` past 64 and 128).
    #[test]
    fn a_call_gives_the_same_bits_whatever_its_prefetch_distance() {
        let scalar = KernelTable::for_isa(Isa::Scalar);
        for d in [1usize, 2, 3, 8, 63, 64, 65, 130, 131, 200, 257] {
            let pairs = d.div_ceil(2);
            let mut next = lcg(d as u64);
            let items = 8 * 8;
            let weights: Vec<f32> = (0..items * d).map(|_| next()).collect();
            let (q, scales) = quantize_int8_per_row(&weights, d);
            let bias: Vec<f32> = (0..items).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..MAX_GROUP_ROWS * d).map(|_| next()).collect();
            let (hq, row_scales_all) = quantize_activations(&hidden, d);
            // Feature-pair panels (any values: each call's sums are exact in i32) and f32 panels.
            let q_panels: Vec<i8> = (0..8 * pairs * 16).map(|i| q[i % q.len()]).collect();
            let f_panels: Vec<f32> = (0..8 * d * 8).map(|i| weights[i % weights.len()]).collect();
            for rows in [1, 2, 4, 8] {
                let mut row_scales = [1f32; MAX_GROUP_ROWS];
                row_scales[..rows].copy_from_slice(&row_scales_all[..rows]);
                let mut bars = [f32::INFINITY; MAX_GROUP_ROWS];
                bars[..rows].fill(0.0);
                for (ps, panels) in [1, 2, 4, 8].into_iter().enumerate() {
                    let rs = super::rows_slot(rows);
                    let call_bytes = panels * pairs * 16;
                    let run = |table: &KernelTable, prefetch: usize, int8: bool| {
                        let epilogue = Epilogue {
                            bias: &bias[..panels * 8],
                            scales: if int8 { &scales[..panels * 8] } else { &[] },
                            bars,
                            row_scales: if int8 {
                                row_scales
                            } else {
                                [1.0; MAX_GROUP_ROWS]
                            },
                            prefetch,
                        };
                        let mut out = vec![0f32; rows * panels * 8];
                        let mut masks = vec![0u8; rows * panels];
                        if int8 {
                            (table.i8[rs][ps])(
                                &hq[..rows * pairs * 2],
                                d,
                                &q_panels[..panels * pairs * 16],
                                &epilogue,
                                &mut out,
                                &mut masks,
                            );
                        } else {
                            (table.f32[rs][ps])(
                                &hidden[..rows * d],
                                d,
                                &f_panels[..panels * d * 8],
                                &epilogue,
                                &mut out,
                                &mut masks,
                            );
                        }
                        let bits: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                        (bits, masks)
                    };
                    let int8_reference = run(scalar, 0, true);
                    for isa in Isa::available() {
                        let table = KernelTable::for_isa(isa);
                        let label = format!("{isa:?} d {d} rows {rows} panels {panels}");
                        let f32_near = run(table, 0, false);
                        for distance in [call_bytes, 64 * 1024] {
                            assert_eq!(run(table, distance, true), int8_reference, "int8 {label}");
                            assert_eq!(run(table, distance, false), f32_near, "f32 {label}");
                        }
                        assert_eq!(run(table, 0, true), int8_reference, "int8 {label}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod require_isa {
    /// The kernel tests run on every ISA `Isa::available()` reports; on a CPU without AVX2 they
    /// would pass on the scalar path alone. CI sets REQUIRE_AVX2=1, so that cannot happen there
    /// unnoticed.
    #[test]
    fn avx2_is_present_where_it_is_required() {
        if std::env::var("REQUIRE_AVX2").as_deref() == Ok("1") {
            assert!(
                super::Isa::available().contains(&super::Isa::Avx2),
                "REQUIRE_AVX2=1 but this CPU lacks AVX2/FMA/F16C: the AVX2 kernels would go untested"
            );
        }
    }

    /// Where the CPU reports AVX-512 F, BW and VNNI (Linux's /proc/cpuinfo, read independently of
    /// the runtime detection), the AVX-512 kernel must be among the paths the tests run.
    #[test]
    fn avx512_is_available_where_the_cpu_reports_it() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else {
            return;
        };
        let flags: Vec<&str> = flags.split_whitespace().collect();
        if [
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_vnni",
        ]
        .iter()
        .all(|f| flags.contains(f))
        {
            assert!(
                super::Isa::available().contains(&super::Isa::Avx512),
                "the CPU reports AVX-512 F/BW/VL/VNNI but the AVX-512 kernel is not available"
            );
            if flags.contains(&"avx512_bf16") {
                assert!(
                    super::Isa::available().contains(&super::Isa::Avx512Bf16),
                    "the CPU reports AVX512-BF16 but the vdpbf16ps kernel is not available"
                );
            }
        }
    }
}

/// Deterministic test values in [-1, 1) from `seed` (a linear congruential generator), for the
/// kernels' tests (unit and integration).
#[doc(hidden)]
pub fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
