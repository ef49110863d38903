//! AVX2 + FMA + F16C micro-kernels. Each register holds 8 items of one panel; each hidden value is
//! broadcast and fused-multiply-added into R x P independent accumulators (8 for the shapes used:
//! 1x8, 2x4, 4x2), enough to cover the FMA latency on two ports.
//!
//! The `unsafe` is confined here: every kernel is a `#[target_feature]` function, reached only
//! through the safe wrappers in `TABLE`, which is only handed out after `Isa::available()` has seen
//! AVX2, FMA and F16C on this CPU.

use std::arch::x86_64::*;

use super::attention::{AttentionOut, Lanes, PointwiseAttention};
use super::{Epilogue, Isa, KernelTable};

/// Loads 8 weights of the panel element range starting at `offset` as f32.
pub(super) trait Load8: Copy {
    /// # Safety
    /// `ptr.add(offset)` must have 8 readable elements, and the CPU must support AVX2/FMA/F16C.
    unsafe fn load8(ptr: *const Self, offset: usize) -> __m256;
}

impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(ptr: *const f32, offset: usize) -> __m256 {
        // SAFETY: as the trait requires of the caller: 8 readable elements at the offset, AVX2.
        unsafe { _mm256_loadu_ps(ptr.add(offset)) }
    }
}

impl Load8 for u16 {
    #[inline(always)]
    unsafe fn load8(ptr: *const u16, offset: usize) -> __m256 {
        // SAFETY: as the trait requires of the caller: 8 readable halves at the offset, F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.add(offset) as *const __m128i)) }
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. Bounds are checked below with assertions, so any slice
/// lengths are safe.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panels<const R: usize, const P: usize, T: Load8>(
    hidden: &[f32],
    d: usize,
    w: &[T],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    assert!(
        hidden.len() >= R * d
            && w.len() >= P * d * 8
            && out.len() >= R * P * 8
            && masks.len() >= R * P
    );
    assert!(
        epilogue.bias.len() >= P * 8
            && (epilogue.scales.is_empty() || epilogue.scales.len() >= P * 8)
    );
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    let hp = hidden.as_ptr();
    let wp = w.as_ptr();
    // The panels of a later call, requested while this one computes (`Epilogue::prefetch`).
    // Prefetches never fault, so the address may lie past `w`.
    let ahead = (wp as *const i8).wrapping_add(epilogue.prefetch);
    let prefetch = epilogue.prefetch != 0;
    let elem = std::mem::size_of::<T>();
    for j in 0..d {
        if prefetch {
            for line in (0..P * 8 * elem).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(j * P * 8 * elem + line));
            }
        }
        let mut wv = [_mm256_setzero_ps(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            // SAFETY: in bounds: p < P, j < d, so p*d*8 + j*8 + 8 <= P*d*8 <= w.len() (asserted
            // above); this function's target features are the ones load8 needs.
            *v = unsafe { T::load8(wp, p * d * 8 + j * 8) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds: r*d + j < R*d <= hidden.len() (asserted above).
            let h = _mm256_set1_ps(unsafe { *hp.add(r * d + j) });
            for (a, v) in acc_r.iter_mut().zip(&wv) {
                *a = _mm256_fmadd_ps(h, *v, *a);
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { f32_epilogue::<R, P>(&acc, epilogue, out, masks) }
}

/// The fp32, fp16 and bf16 kernels' epilogue (shared with `avx512`): each sum times the item's scale
/// when there are scales, plus the bias; stored, and flagged against the row's bar.
///
/// # Safety
/// The CPU must support AVX2. Bounds are asserted.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f32_epilogue<const R: usize, const P: usize>(
    acc: &[[__m256; P]; R],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    assert!(out.len() >= R * P * 8 && masks.len() >= R * P);
    assert!(
        epilogue.bias.len() >= P * 8
            && (epilogue.scales.is_empty() || epilogue.scales.len() >= P * 8)
    );
    let scaled = !epilogue.scales.is_empty();
    for (r, acc_r) in acc.iter().enumerate() {
        let bar = _mm256_set1_ps(epilogue.bars[r]);
        for (p, a) in acc_r.iter().enumerate() {
            // SAFETY: in bounds: p*8 + 8 <= P*8 <= bias.len() (and scales.len() when scaled),
            // asserted above.
            let bias = unsafe { _mm256_loadu_ps(epilogue.bias.as_ptr().add(p * 8)) };
            let score = if scaled {
                // SAFETY: as for the bias.
                let scale = unsafe { _mm256_loadu_ps(epilogue.scales.as_ptr().add(p * 8)) };
                _mm256_add_ps(_mm256_mul_ps(*a, scale), bias)
            } else {
                _mm256_add_ps(*a, bias)
            };
            // SAFETY: in bounds: (r*P + p)*8 + 8 <= R*P*8 <= out.len() (asserted above).
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add((r * P + p) * 8), score) };
            let above = _mm256_cmp_ps::<_CMP_GT_OQ>(score, bar);
            masks[r * P + p] = _mm256_movemask_ps(above) as u8;
        }
    }
}

fn f32_k<const R: usize, const P: usize>(
    h: &[f32],
    d: usize,
    w: &[f32],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: TABLE is only reachable after AVX2/FMA/F16C were detected (KernelTable::for_isa).
    unsafe { panels::<R, P, f32>(h, d, w, e, out, m) }
}

fn f16_k<const R: usize, const P: usize>(
    h: &[f32],
    d: usize,
    w: &[u16],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: as above.
    unsafe { panels::<R, P, u16>(h, d, w, e, out, m) }
}

fn bf16_k<const R: usize, const P: usize>(
    h: super::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: as above.
    unsafe { panels_bf16::<R, P>(h, d, w, e, out, m) }
}

/// A 32-bit lane holding the bfloat16 pair (even, odd) of one item, widened exactly: the even
/// value is the lane shifted up 16 bits, the odd one the lane's upper half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_pair_avx2(lanes: __m256i, upper: __m256i) -> (__m256, __m256) {
    (
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lanes)),
        _mm256_castsi256_ps(_mm256_and_si256(lanes, upper)),
    )
}

/// bfloat16 activations x bfloat16 weight pairs, widened exactly to f32: each 256-bit load is 8
/// items x 2 features, split into the even and odd features' values, and each row adds the odd
/// product and then the even one with a fused multiply-add (the product is exact, so each
/// addition rounds once: `vdpbf16ps`'s arithmetic, see the crate documentation). The activations
/// come widened already ([`super::Bf16Rows::wide`]): each is one broadcast.
///
/// # Safety
/// The CPU must support AVX2 and FMA. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panels_bf16<const R: usize, const P: usize>(
    hidden: super::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    let (pairs, width) =
        super::assert_pair_call::<R, P, _, _>(hidden.wide, d, w, epilogue, out, masks, false);
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    let upper = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let hp = hidden.wide.as_ptr();
    let wp = w.as_ptr();
    // As in `panels`: a later call's panels requested ahead (never faults, may lie past `w`).
    let ahead = (wp as *const i8).wrapping_add(epilogue.prefetch);
    let prefetch = epilogue.prefetch != 0;
    for jp in 0..pairs {
        if prefetch {
            for line in (0..P * 32).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(jp * P * 32 + line));
            }
        }
        let mut even = [_mm256_setzero_ps(); P];
        let mut odd = [_mm256_setzero_ps(); P];
        for p in 0..P {
            // SAFETY: in bounds: p*pairs*16 + jp*16 + 16 <= P*pairs*16 <= w.len() (asserted).
            let lanes =
                unsafe { _mm256_loadu_si256(wp.add(p * pairs * 16 + jp * 16) as *const __m256i) };
            (even[p], odd[p]) = widen_pair_avx2(lanes, upper);
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds: r*width + 2jp + 1 < R*width <= hidden.wide.len() (asserted).
            let (h_even, h_odd) = unsafe {
                (
                    _mm256_broadcast_ss(&*hp.add(r * width + 2 * jp + 1)),
                    _mm256_broadcast_ss(&*hp.add(r * width + 2 * jp)),
                )
            };
            for (p, a) in acc_r.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(h_odd, odd[p], *a);
                *a = _mm256_fmadd_ps(h_even, even[p], *a);
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { f32_epilogue::<R, P>(&acc, epilogue, out, masks) }
}

fn i8_k<const R: usize, const P: usize>(
    h: &[i16],
    d: usize,
    w: &[i8],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: as above.
    unsafe { panels_i8::<R, P>(h, d, w, e, out, m) }
}

/// int16 activations x int8 weight pairs: each 128-bit load is 8 items x 2 features, widened to
/// 16 x i16, multiplied by the broadcast activation pair and summed pairwise into 8 x i32
/// (`madd_epi16`), exact; the epilogue converts once per item.
///
/// # Safety
/// The CPU must support AVX2. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panels_i8<const R: usize, const P: usize>(
    hidden: &[i16],
    d: usize,
    w: &[i8],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    let (pairs, width) =
        super::assert_pair_call::<R, P, _, _>(hidden, d, w, epilogue, out, masks, true);
    let mut acc = [[_mm256_setzero_si256(); P]; R];
    let hp = hidden.as_ptr() as *const i32;
    let wp = w.as_ptr();
    // As in `panels`: a later call's panels requested ahead (never faults, may lie past `w`).
    let ahead = wp.wrapping_add(epilogue.prefetch);
    let prefetch = epilogue.prefetch != 0;
    for jp in 0..pairs {
        if prefetch {
            for line in (0..P * 16).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(jp * P * 16 + line));
            }
        }
        let mut wv = [_mm256_setzero_si256(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            // SAFETY: in bounds: p*pairs*16 + jp*16 + 16 <= P*pairs*16 <= w.len() (asserted).
            *v = _mm256_cvtepi8_epi16(unsafe {
                _mm_loadu_si128(wp.add(p * pairs * 16 + jp * 16) as *const __m128i)
            });
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // The two i16 activations 2jp, 2jp+1 of row r read as one i32 (little-endian pair).
            // SAFETY: in bounds: r*width + 2jp + 2 <= R*width <= hidden.len() (asserted);
            // read_unaligned needs no alignment.
            let pair = _mm256_set1_epi32(unsafe {
                hp.cast::<u8>()
                    .add(2 * (r * width + 2 * jp))
                    .cast::<i32>()
                    .read_unaligned()
            });
            for (a, v) in acc_r.iter_mut().zip(&wv) {
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(*v, pair));
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { i8_epilogue::<R, P>(&acc, epilogue, out, masks) }
}

/// The int8 kernels' epilogue (shared with `avx512`): each exact i32 sum converted once, times
/// the item's scale and the row's activation scale, plus the bias; stored, and flagged against
/// the row's bar.
///
/// # Safety
/// The CPU must support AVX2. Bounds are asserted.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn i8_epilogue<const R: usize, const P: usize>(
    acc: &[[__m256i; P]; R],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    assert!(out.len() >= R * P * 8 && masks.len() >= R * P);
    assert!(epilogue.bias.len() >= P * 8 && epilogue.scales.len() >= P * 8);
    for (r, acc_r) in acc.iter().enumerate() {
        let bar = _mm256_set1_ps(epilogue.bars[r]);
        let row_scale = _mm256_set1_ps(epilogue.row_scales[r]);
        for (p, a) in acc_r.iter().enumerate() {
            // SAFETY: in bounds: p*8 + 8 <= P*8 <= bias.len(), scales.len() (asserted).
            let (bias, scales) = unsafe {
                (
                    _mm256_loadu_ps(epilogue.bias.as_ptr().add(p * 8)),
                    _mm256_loadu_ps(epilogue.scales.as_ptr().add(p * 8)),
                )
            };
            let scale = _mm256_mul_ps(scales, row_scale);
            let score = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(*a), scale), bias);
            // SAFETY: in bounds: (r*P + p)*8 + 8 <= R*P*8 <= out.len() (asserted).
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add((r * P + p) * 8), score) };
            masks[r * P + p] = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(score, bar)) as u8;
        }
    }
}

/// `portable`'s activations compiled for AVX2: the portable bodies are `#[inline(always)]`, so they
/// are inlined into these and vectorised 8 wide instead of SSE's 4. The same operations in the
/// same order (Rust never contracts a multiply and an add into an FMA), so the same bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(x: &mut [f32]) {
    super::portable::gelu_erf_inplace(x)
}

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn tanh_avx2(x: &mut [f32]) {
    super::portable::tanh_inplace(x)
}

/// SiLU of 4 registers at once, `x / (1 + e^-x)` with fused multiply-adds: `e^-x` as `2^k e^r`
/// (x clamped to [-87, 88], k = round(-x / ln 2) by the 1.5 x 2^23 shifter, r = -x - k ln 2 in one
/// fused step, whose error is |k| times ln 2's f32 rounding, 2e-9), e^r by a degree-6 polynomial
/// fitted to the relative error on |r| <= ln2 / 2 (2e-8), then one division; 0 below -87, as the
/// portable SiLU. Within 3e-7 relative of the formula in f64 (tested). Four independent registers
/// step by step, because one register's chain of 15 dependent operations left Zen's out-of-order
/// window half empty: on Zen 1, 1.46 ns an element one register at a time, against 0.91
/// interleaved, and 1.54 for the portable SiLU (no FMA, Estrin's series to r^7, a blend for the
/// sign).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu4(x: [__m256; 4]) -> [__m256; 4] {
    let each = |f: &dyn Fn(usize) -> __m256| -> [__m256; 4] { std::array::from_fn(f) };
    let shifter = _mm256_set1_ps(12_582_912.0 + 127.0);
    let clamped = each(&|i| {
        _mm256_max_ps(
            _mm256_min_ps(x[i], _mm256_set1_ps(88.0)),
            _mm256_set1_ps(-87.0),
        )
    });
    // -x log2(e) rounded to an integer k, with 127 added: its low bits are 2^k's exponent bits.
    let shifted = each(&|i| {
        _mm256_fnmadd_ps(
            clamped[i],
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            shifter,
        )
    });
    let k = each(&|i| _mm256_sub_ps(shifted[i], shifter));
    // r = -x - k ln 2.
    let r = each(&|i| _mm256_fnmsub_ps(k[i], _mm256_set1_ps(std::f32::consts::LN_2), clamped[i]));
    let mut p = each(&|_| _mm256_set1_ps(SILU_EXP[6]));
    for &c in SILU_EXP[..6].iter().rev() {
        p = each(&|i| _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(c)));
    }
    let two_k =
        each(&|i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_castps_si256(shifted[i]))));
    let denominator = each(&|i| _mm256_fmadd_ps(p[i], two_k[i], _mm256_set1_ps(1.0)));
    each(&|i| {
        let silu = _mm256_div_ps(x[i], denominator[i]);
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x[i], _mm256_set1_ps(-87.0));
        _mm256_andnot_ps(below, silu)
    })
}

/// e^r on |r| <= ln2 / 2: the coefficients of r^0..r^6, fitted to the relative error (1.7e-8).
const SILU_EXP: [f32; 7] = [
    1.0,
    1.0,
    0.499_999_9,
    0.166_664_2,
    0.041_668_225,
    0.008_374_816,
    0.001_383_684_6,
];

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_avx2(x: &mut [f32]) {
    let mut blocks = x.chunks_exact_mut(32);
    for block in &mut blocks {
        let p = block.as_mut_ptr();
        // SAFETY: a block holds 32 floats: registers i at 8 i.
        unsafe {
            let v = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
            for (i, s) in silu4(v).into_iter().enumerate() {
                _mm256_storeu_ps(p.add(8 * i), s);
            }
        }
    }
    // The rest through a padded copy, so that every element is the same function of its value.
    let rest = blocks.into_remainder();
    if !rest.is_empty() {
        let mut padded = [0f32; 32];
        padded[..rest.len()].copy_from_slice(rest);
        // SAFETY: as above, on the 32 floats of `padded`.
        unsafe { silu_avx2(&mut padded) };
        let len = rest.len();
        rest.copy_from_slice(&padded[..len]);
    }
}

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    super::portable::softmax(x)
}

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn layer_norm_avx2(x: &mut [f32], width: usize, gamma: &[f32], beta: &[f32], eps: f64) {
    super::portable::layer_norm_rows(x, width, gamma, beta, eps)
}

fn layer_norm(x: &mut [f32], width: usize, gamma: &[f32], beta: &[f32], eps: f64) {
    // SAFETY: as for gelu.
    unsafe { layer_norm_avx2(x, width, gamma, beta, eps) }
}

/// [`super::bf16::round_rows_to_bf16_both`] compiled for AVX2 (the same code, so the same bits).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn round_rows_to_bf16(
    hidden: &[f32],
    d: usize,
    bits: &mut [u16],
    wide: &mut [f32],
) {
    super::bf16::round_rows_to_bf16_both(hidden, d, bits, wide)
}

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn add_rows_avx2(table: &[f32], width: usize, rows: &[u32], acc: &mut [f32]) {
    super::portable::add_rows(table, width, rows, acc)
}

fn add_rows(table: &[f32], width: usize, rows: &[u32], acc: &mut [f32]) {
    // SAFETY: as for gelu.
    unsafe { add_rows_avx2(table, width, rows, acc) }
}

/// # Safety
/// As for [`gelu_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn add_rows_bf16_avx2(table: &[u16], width: usize, rows: &[u32], acc: &mut [f32]) {
    super::portable::add_rows_bf16(table, width, rows, acc)
}

fn add_rows_bf16(table: &[u16], width: usize, rows: &[u32], acc: &mut [f32]) {
    // SAFETY: as for gelu.
    unsafe { add_rows_bf16_avx2(table, width, rows, acc) }
}

fn gelu(x: &mut [f32]) {
    // SAFETY: TABLE is only reachable after AVX2/FMA/F16C were detected (KernelTable::for_isa).
    unsafe { gelu_avx2(x) }
}

fn tanh(x: &mut [f32]) {
    // SAFETY: as for gelu.
    unsafe { tanh_avx2(x) }
}

fn silu(x: &mut [f32]) {
    // SAFETY: as for gelu.
    unsafe { silu_avx2(x) }
}

fn softmax(x: &mut [f32]) {
    // SAFETY: as for gelu.
    unsafe { softmax_avx2(x) }
}

/// HSTU attention's lanes ([`super::attention`]) as an AVX2 register, multiply-adds fused (as
/// the AVX2 and AVX-512 dense kernels).
#[derive(Clone, Copy)]
pub(crate) struct AttentionLanes(__m256);

// SAFETY (every method): reached only from `attention_avx2` below, whose callers have checked AVX2
// and FMA; pointers carry the trait's 8-float guarantee.
impl Lanes for AttentionLanes {
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: AVX is present (the trait's contract).
        AttentionLanes(unsafe { _mm256_setzero_ps() })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: 8 readable floats at p and AVX (the trait's contract).
        AttentionLanes(unsafe { _mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: AVX is present (the trait's contract).
        AttentionLanes(unsafe { _mm256_set1_ps(x) })
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
        // SAFETY: FMA is present (the trait's contract).
        AttentionLanes(unsafe { _mm256_fmadd_ps(a.0, b.0, acc.0) })
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: AVX is present (the trait's contract).
        AttentionLanes(unsafe { _mm256_add_ps(a.0, b.0) })
    }
    #[inline(always)]
    unsafe fn div(a: Self, b: Self) -> Self {
        // SAFETY: AVX is present (the trait's contract).
        AttentionLanes(unsafe { _mm256_div_ps(a.0, b.0) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: 8 writable floats at p and AVX (the trait's contract).
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn attention_avx2(a: &PointwiseAttention<'_>, out: &mut AttentionOut<'_>, w: &mut Vec<f32>) {
    // SAFETY: this function's features are the lanes'; `run` asserts its bounds.
    unsafe { super::attention::run::<AttentionLanes>(a, out, w, silu) }
}

/// The AVX2 and AVX-512 tables' kernel.
fn attention(a: &PointwiseAttention<'_>, out: &mut AttentionOut<'_>, w: &mut Vec<f32>) {
    // SAFETY: the tables holding this kernel are only handed out after AVX2 and FMA were
    // detected (KernelTable::for_isa).
    unsafe { attention_avx2(a, out, w) }
}

/// This ISA's kernels as a value, from which `avx512` builds its table.
pub(super) const KERNELS: KernelTable = kernel_table!(
    Isa::Avx2,
    f32_k,
    f16_k,
    bf16_k,
    i8_k,
    super::Elementwise {
        gelu,
        tanh,
        silu,
        softmax,
        layer_norm,
        add_rows,
        add_rows_bf16,
    },
    attention
);

pub(super) static TABLE: KernelTable = KERNELS;

/// FLOPs per second of one core running independent 8-wide FMA chains: the compute ceiling the
/// benchmarks compare against. Runs `iterations` x 10 FMAs per chain.
///
/// # Panics
/// If the CPU lacks AVX2/FMA (callers check `Isa::available()` first).
pub fn fma_peak_flops(iterations: u64) -> f64 {
    assert!(
        Isa::available().contains(&Isa::Avx2),
        "the FMA probe needs AVX2/FMA"
    );
    // SAFETY: AVX2 and FMA were just checked.
    let (seconds, sink) = unsafe { fma_chains(iterations) };
    std::hint::black_box(sink);
    (iterations * 10 * 8 * 2) as f64 / seconds
}

/// # Safety
/// The CPU must support AVX2 and FMA (checked by `fma_peak_flops`). No memory is touched but locals.
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains(iterations: u64) -> (f64, f32) {
    let mut acc = [_mm256_set1_ps(0.0); 10];
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let start = std::time::Instant::now();
    for _ in 0..iterations {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut out = [0f32; 8];
    let mut total = _mm256_setzero_ps();
    for v in acc {
        total = _mm256_add_ps(total, v);
    }
    // SAFETY: `out` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), total) };
    (seconds, out.iter().sum())
}
