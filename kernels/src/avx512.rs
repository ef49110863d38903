//! AVX-512 micro-kernels (F, BW and VNNI); tanh and GELU are `portable`'s compiled 16 wide, the other
//! activations AVX2's.
//!
//! int8: each item's sum is exact in i32, where the order of the additions cannot change a bit,
//! so a 512-bit register holds two consecutive feature pairs of one panel (8 items x 4 features,
//! widened to 32 x i16), and one `vpdpwssd` does what AVX2 does with a `vpmaddwd` and a `vpaddd`
//! on half the width: 32 multiply-adds per instruction instead of 16 per two. The two halves of
//! each accumulator (even and odd pairs) are added at the end, and an odd last pair runs at 256
//! bits.
//!
//! fp32 and fp16: each item must add its products over `d` in increasing order (the bits of
//! AVX2's kernel), so a register holds feature j of two panels (16 items) and gets one fused
//! multiply-add per row, the same operation AVX2 applies to each half; the halves go to AVX2's
//! epilogue. The table asks for calls of 8 panels for every row group: 4 registers a row, so a
//! 4-row call keeps 16 accumulators in flight and loads each weight vector once for four rows
//! (measured over a 3,416 x 600 table at batch 64: 8 panels ran 1.5x 4 panels, 140 against 90
//! GFLOP/s on one core; 6 rows x 8 panels was no faster).
//!
//! `unsafe` is confined here as in `avx2`: the kernel is a `#[target_feature]` function reached
//! only through `TABLE`, which `KernelTable::for_isa` hands out only after `Isa::available()`
//! has seen every feature it enables.

use std::arch::x86_64::*;

use super::avx2;
use super::{Epilogue, Isa, KernelTable};

fn i8_k<const R: usize, const P: usize>(
    h: &[i16],
    d: usize,
    w: &[i8],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: TABLE is only reachable after AVX2/FMA/F16C and AVX-512 F/BW/VNNI were detected
    // (KernelTable::for_isa).
    unsafe { panels_i8::<R, P>(h, d, w, e, out, m) }
}

/// int16 activations x int8 weights, two feature pairs per instruction: the 32 bytes of pairs
/// 2q and 2q+1 of a panel are widened to 32 x i16 (i32 lanes 0-7: pair 2q of items 0-7; lanes
/// 8-15: pair 2q+1), and multiplied by the row's activation pairs placed the same way (lanes 0-7
/// hold activations 4q, 4q+1; lanes 8-15 hold 4q+2, 4q+3). Sums are exact in i32 (no overflow:
/// `packed::activation_levels`), so the scores equal every other ISA's bit for bit.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VNNI. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
    let hp = hidden.as_ptr().cast::<u8>();
    let wp = w.as_ptr();
    // One row streaming its table from memory reads each panel through in address order; every
    // other call (more rows share each weight vector, or the table is cached) keeps the panels
    // side by side, which keeps the most multiply-adds in flight. Either way each item's sum is
    // the same exact i32, so the choice changes no bit.
    let acc = if R == 1 && epilogue.prefetch != 0 {
        // SAFETY: the caller's features; the bounds were asserted above.
        unsafe { quads_panel_by_panel::<R, P>(hidden, width, pairs, w, epilogue.prefetch) }
    } else {
        // SAFETY: as above.
        unsafe { quads_side_by_side::<R, P>(hidden, width, pairs, w, epilogue.prefetch) }
    };
    // Even and odd pairs' sums added, then the odd last pair (if any) at 256 bits.
    let mut folded = [[_mm256_setzero_si256(); P]; R];
    for (f_r, acc_r) in folded.iter_mut().zip(&acc) {
        for (f, a) in f_r.iter_mut().zip(acc_r) {
            *f = _mm256_add_epi32(
                _mm512_castsi512_si256(*a),
                _mm512_extracti64x4_epi64::<1>(*a),
            );
        }
    }
    if pairs % 2 == 1 {
        let jp = pairs - 1;
        let mut wv = [_mm256_setzero_si256(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            // SAFETY: in bounds: p*pairs*16 + jp*16 + 16 <= P*pairs*16 <= w.len() (asserted).
            *v = _mm256_cvtepi8_epi16(unsafe {
                _mm_loadu_si128(wp.add(p * pairs * 16 + jp * 16) as *const __m128i)
            });
        }
        for (r, f_r) in folded.iter_mut().enumerate() {
            // SAFETY: in bounds: r*width + 2jp + 2 = (r+1)*width <= hidden.len() (asserted).
            let pair = _mm256_set1_epi32(unsafe {
                hp.add(2 * (r * width + 2 * jp))
                    .cast::<i32>()
                    .read_unaligned()
            });
            for (f, v) in f_r.iter_mut().zip(&wv) {
                *f = _mm256_add_epi32(*f, _mm256_madd_epi16(*v, pair));
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { avx2::i8_epilogue::<R, P>(&folded, epilogue, out, masks) }
}

/// The four i16 activations 4q..4q+4 of row `r` as two i32 pairs spread over a register: lanes
/// 0-7 take the first pair (2q), lanes 8-15 the second (2q + 1), as the weight registers hold them.
///
/// # Safety
/// `hidden` must hold `r * width + 4 * q + 4` values; the CPU must support AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn row_quad(hidden: &[i16], width: usize, r: usize, q: usize) -> __m512i {
    // SAFETY: as the caller guarantees; the load needs no alignment.
    let two = unsafe { _mm_loadl_epi64(hidden.as_ptr().add(r * width + 4 * q) as *const __m128i) };
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(two))
}

/// The i32 sums of the whole feature quads of `R` rows x `P` panels, each quad of every panel in
/// turn: per quad one weight register per panel, reused by every row.
///
/// # Safety
/// The CPU must support AVX2 and AVX-512 F/BW/VNNI; `hidden` holds `R * width` values and `w`
/// `P * pairs * 16` (asserted by the caller, `assert_pair_call`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quads_side_by_side<const R: usize, const P: usize>(
    hidden: &[i16],
    width: usize,
    pairs: usize,
    w: &[i8],
    prefetch: usize,
) -> [[__m512i; P]; R] {
    let mut acc = [[_mm512_setzero_si512(); P]; R];
    let wp = w.as_ptr();
    // As in `avx2::panels`: a later call's panels requested ahead (never faults, may lie past `w`).
    let ahead = wp.wrapping_add(prefetch);
    for q in 0..pairs / 2 {
        if prefetch != 0 {
            for line in (0..P * 32).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(q * P * 32 + line));
            }
        }
        let mut wv = [_mm512_setzero_si512(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            // SAFETY: in bounds: pairs 2q and 2q+1 of panel p end at p*pairs*16 + (2q+2)*16 <=
            // P*pairs*16 <= w.len() (asserted), since 2q+2 <= pairs.
            *v = _mm512_cvtepi8_epi16(unsafe {
                _mm256_loadu_si256(wp.add(p * pairs * 16 + q * 32) as *const __m256i)
            });
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds: r*width + 4q + 4 <= r*width + 2*pairs = (r+1)*width <=
            // hidden.len() (asserted); AVX-512 F is enabled here.
            let act = unsafe { row_quad(hidden, width, r, q) };
            for (a, v) in acc_r.iter_mut().zip(&wv) {
                *a = _mm512_dpwssd_epi32(*a, *v, act);
            }
        }
    }
    acc
}

/// Quads per run of [`quads_panel_by_panel`]: 16 spread activation registers a row (64 features).
const QUADS_PER_RUN: usize = 16;

/// The same sums as [`quads_side_by_side`], reading each panel's quads in address order before
/// the next panel's (in runs of [`QUADS_PER_RUN`] quads, whose activations are spread once).
///
/// Why: the side-by-side order reads 8 panels as 8 interleaved 32-byte streams, and on a table
/// streaming from memory one row does too little work per byte to hide that: over a 1e6 x 64
/// int8 table (one row, one thread, Zen 4) the side-by-side order read 17-19 GB/s and this one
/// 22-26 GB/s, the fp32 scan's rate; with more rows per call, or a cached table, the side-by-side
/// order was the faster one (1.2x-2.4x), so only one-row calls on tables read from memory come
/// here.
///
/// # Safety
/// As [`quads_side_by_side`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quads_panel_by_panel<const R: usize, const P: usize>(
    hidden: &[i16],
    width: usize,
    pairs: usize,
    w: &[i8],
    prefetch: usize,
) -> [[__m512i; P]; R] {
    let mut acc = [[_mm512_setzero_si512(); P]; R];
    let wp = w.as_ptr();
    let ahead = wp.wrapping_add(prefetch);
    let quads = pairs / 2;
    let mut first = 0;
    while first < quads {
        let run = (quads - first).min(QUADS_PER_RUN);
        let mut acts = [[_mm512_setzero_si512(); QUADS_PER_RUN]; R];
        for (r, acts_r) in acts.iter_mut().enumerate() {
            for (i, act) in acts_r.iter_mut().take(run).enumerate() {
                // SAFETY: in bounds as in `quads_side_by_side`: first + i < pairs / 2.
                *act = unsafe { row_quad(hidden, width, r, first + i) };
            }
        }
        for p in 0..P {
            let start = p * pairs * 16 + first * 32;
            if prefetch != 0 {
                for line in (0..run * 32).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(start + line));
                }
            }
            for i in 0..run {
                // SAFETY: in bounds: start + 32(i+1) = p*pairs*16 + 32(q+1) <= P*pairs*16 <=
                // w.len() (asserted), since q = first + i < pairs / 2.
                let v = _mm512_cvtepi8_epi16(unsafe {
                    _mm256_loadu_si256(wp.add(start + i * 32) as *const __m256i)
                });
                for (acc_r, acts_r) in acc.iter_mut().zip(&acts) {
                    acc_r[p] = _mm512_dpwssd_epi32(acc_r[p], v, acts_r[i]);
                }
            }
        }
        first += run;
    }
    acc
}

fn f32_k<const R: usize, const P: usize>(
    h: &[f32],
    d: usize,
    w: &[f32],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: TABLE is only reachable after AVX2/FMA/F16C and AVX-512 F/BW/VNNI were detected
    // (KernelTable::for_isa).
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

/// fp32 (and fp16, widened) weights, two panels per register: feature j of panels 2q and 2q+1
/// (16 items) side by side, one fused multiply-add per row for both. Each item still adds its
/// products over `d` in increasing order with the same fused multiply-add as AVX2's kernel, so
/// the scores are AVX2's bit for bit; what changes is that one instruction does 16 items. The
/// halves are split again for AVX2's epilogue. A call of one panel is AVX2's.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn panels<const R: usize, const P: usize, T: avx2::Load8>(
    hidden: &[f32],
    d: usize,
    w: &[T],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    if P % 2 == 1 {
        // SAFETY: this function has every feature AVX2's kernel needs; it asserts its bounds.
        return unsafe { avx2::panels::<R, P, T>(hidden, d, w, epilogue, out, masks) };
    }
    assert!(hidden.len() >= R * d && w.len() >= P * d * 8);
    // The first P / 2 of each row's registers are used ([`MAX_PANEL_PAIRS`]).
    let mut acc = [[_mm512_setzero_ps(); MAX_PANEL_PAIRS]; R];
    let hp = hidden.as_ptr();
    let wp = w.as_ptr();
    // As in `avx2::panels`: a later call's panels requested ahead (never faults).
    let ahead = (wp as *const i8).wrapping_add(epilogue.prefetch);
    let prefetch = epilogue.prefetch != 0;
    let elem = std::mem::size_of::<T>();
    for j in 0..d {
        if prefetch {
            for line in (0..P * 8 * elem).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(j * P * 8 * elem + line));
            }
        }
        let mut wv = [_mm512_setzero_ps(); MAX_PANEL_PAIRS];
        for (q, v) in wv.iter_mut().take(P / 2).enumerate() {
            // SAFETY: in bounds: panels 2q, 2q+1 < P and j < d, so each 8-element load ends at
            // most at P*d*8 <= w.len() (asserted above); the features load8 needs are enabled.
            let (lo, hi) = unsafe {
                (
                    T::load8(wp, 2 * q * d * 8 + j * 8),
                    T::load8(wp, (2 * q + 1) * d * 8 + j * 8),
                )
            };
            *v = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castps_pd(_mm512_castps256_ps512(lo)),
                _mm256_castps_pd(hi),
            ));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds: r*d + j < R*d <= hidden.len() (asserted above).
            let h = _mm512_set1_ps(unsafe { *hp.add(r * d + j) });
            for (a, v) in acc_r.iter_mut().zip(&wv).take(P / 2) {
                *a = _mm512_fmadd_ps(h, *v, *a);
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { avx2::f32_epilogue::<R, P>(&split_halves::<R, P, _>(&acc), epilogue, out, masks) }
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

/// Feature pair `jp` of panels `2q` and `2q + 1` (8 items x 2 bfloat16 values each) as one
/// 512-bit register: lanes 0-7 the first panel's items, lanes 8-15 the second's.
///
/// # Safety
/// `w` must hold `2 * (q + 1) * pairs * 16` values and `jp < pairs`; the CPU must support
/// AVX-512 F.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(super) unsafe fn bf16_panel_pair(w: *const u16, pairs: usize, q: usize, jp: usize) -> __m512i {
    // SAFETY: as the caller guarantees: both 16-value runs end within 2(q+1)*pairs*16 values.
    let (lo, hi) = unsafe {
        (
            _mm256_loadu_si256(w.add(2 * q * pairs * 16 + jp * 16) as *const __m256i),
            _mm256_loadu_si256(w.add((2 * q + 1) * pairs * 16 + jp * 16) as *const __m256i),
        )
    };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// bfloat16 pairs widened exactly to f32 as in `avx2::panels_bf16` (the same fused multiply-adds
/// per item in the same order, so its bits), two panels per register as the fp32 kernel runs.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn panels_bf16<const R: usize, const P: usize>(
    hidden: super::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    if P % 2 == 1 {
        // SAFETY: this function has every feature AVX2's kernel needs; it asserts its bounds.
        return unsafe { avx2::panels_bf16::<R, P>(hidden, d, w, epilogue, out, masks) };
    }
    let (pairs, width) =
        super::assert_pair_call::<R, P, _, _>(hidden.wide, d, w, epilogue, out, masks, false);
    // The first P / 2 of each row's registers are used (P / 2 cannot size an array here, and
    // arrays sized P made the compiler keep some accumulators on the stack).
    let mut acc = [[_mm512_setzero_ps(); MAX_PANEL_PAIRS]; R];
    let upper = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let widen = |lanes: __m512i| {
        (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(lanes)),
            _mm512_castsi512_ps(_mm512_and_si512(lanes, upper)),
        )
    };
    let hp = hidden.wide.as_ptr();
    let wp = w.as_ptr();
    // As in `avx2::panels`: a later call's panels requested ahead (never faults).
    let ahead = (wp as *const i8).wrapping_add(epilogue.prefetch);
    let prefetch = epilogue.prefetch != 0;
    for jp in 0..pairs {
        if prefetch {
            for line in (0..P * 32).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(jp * P * 32 + line));
            }
        }
        let mut even = [_mm512_setzero_ps(); MAX_PANEL_PAIRS];
        let mut odd = [_mm512_setzero_ps(); MAX_PANEL_PAIRS];
        for q in 0..P / 2 {
            // SAFETY: 2(q+1) <= P panels of pairs*16 values fit in w (asserted); jp < pairs.
            (even[q], odd[q]) = widen(unsafe { bf16_panel_pair(wp, pairs, q, jp) });
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // The activations come widened ([`super::Bf16Rows::wide`]): one broadcast each.
            // SAFETY: in bounds: r*width + 2jp + 1 < R*width <= hidden.wide.len() (asserted).
            let (h_even, h_odd) = unsafe {
                (
                    _mm512_set1_ps(*hp.add(r * width + 2 * jp + 1)),
                    _mm512_set1_ps(*hp.add(r * width + 2 * jp)),
                )
            };
            for (q, a) in acc_r.iter_mut().take(P / 2).enumerate() {
                *a = _mm512_fmadd_ps(h_odd, odd[q], *a);
                *a = _mm512_fmadd_ps(h_even, even[q], *a);
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe { avx2::f32_epilogue::<R, P>(&split_halves::<R, P, _>(&acc), epilogue, out, masks) }
}

/// Registers of two panels a call holds per row: 8 panels at most. The kernels' arrays are
/// sized by it rather than by P (of which only P / 2 are used): sized by P, the 4 x 8 calls kept
/// some accumulators on the stack.
pub(super) const MAX_PANEL_PAIRS: usize = 4;

/// Each pair of panels' 512-bit sums split back into the two panels' 256-bit ones (the first
/// P / 2 of each row's `Q` registers hold them), as AVX2's epilogue takes them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(super) fn split_halves<const R: usize, const P: usize, const Q: usize>(
    acc: &[[__m512; Q]; R],
) -> [[__m256; P]; R] {
    let mut split = [[_mm256_setzero_ps(); P]; R];
    for (s_r, acc_r) in split.iter_mut().zip(acc) {
        for (q, a) in acc_r.iter().take(P / 2).enumerate() {
            s_r[2 * q] = _mm512_castps512_ps256(*a);
            s_r[2 * q + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
        }
    }
    split
}

/// `portable`'s tanh, GELU and softmax compiled for AVX-512 F: the same portable bodies, vectorised 16 wide
/// (the same operations in the same order, so AVX2's and the scalar path's bits). GRU4Rec runs
/// three gates' worth of them per token and step; a transformer's attention a softmax per query
/// row and head.
///
/// # Safety
/// The CPU must support AVX-512 F (with AVX2 and FMA).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn tanh_avx512(x: &mut [f32]) {
    super::portable::tanh_inplace(x)
}

/// # Safety
/// As for [`tanh_avx512`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn gelu_avx512(x: &mut [f32]) {
    super::portable::gelu_erf_inplace(x)
}

/// # Safety
/// As for [`tanh_avx512`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn softmax_avx512(x: &mut [f32]) {
    super::portable::softmax(x)
}

fn softmax(x: &mut [f32]) {
    // SAFETY: as for tanh.
    unsafe { softmax_avx512(x) }
}

fn tanh(x: &mut [f32]) {
    // SAFETY: TABLE is only reachable after AVX-512 F was detected (KernelTable::for_isa).
    unsafe { tanh_avx512(x) }
}

fn gelu(x: &mut [f32]) {
    // SAFETY: as for tanh.
    unsafe { gelu_avx512(x) }
}

/// This ISA's kernels as a value, from which `avx512bf16` builds its table.
pub(super) const KERNELS: KernelTable = KernelTable {
    isa: Isa::Avx512,
    f32: kernel_table!(@rows f32_k, super::PanelF32),
    f16: kernel_table!(@rows f16_k, super::PanelF16),
    bf16: kernel_table!(@rows bf16_k, super::PanelBf16),
    i8: kernel_table!(@rows i8_k, super::PanelI8),
    // 8 rows x 4 panels: the same 16 accumulators as 4 x 8, each weight vector loaded once for
    // 8 rows ([`super::RowBlock`]). int8 calls also keep 16 accumulators from two rows up (2 x 8,
    // 4 x 4, 8 x 2 panels): 1.1x-1.2x the 8-accumulator calls at 2-64 rows on a Zen 4 (an older
    // measurement that found them slower predates VL, whose absence spilled them).
    panels_per_call: super::PanelsPerCall {
        f32: [8, 8, 8, 4],
        f16: [8, 8, 4, 4],
        bf16: [8, 8, 4, 0],
        i8: [8, 8, 4, 2],
    },
    elementwise: super::Elementwise {
        tanh,
        gelu,
        softmax,
        // AVX2's (fused multiply-adds, four registers interleaved).
        ..avx2::KERNELS.elementwise
    },
    // AVX2's: the same fused multiply-adds in the same order as the AVX-512 dense kernels.
    attention: avx2::KERNELS.attention,
    tiles: false,
};

pub(super) static TABLE: KernelTable = KERNELS;

/// The same kernels cutting batches into row groups of at most 4 ([`super::RowBlock::Four`]).
pub(super) static TABLE_FOUR_ROWS: KernelTable = KernelTable {
    panels_per_call: KERNELS.panels_per_call.at_most_four_rows(),
    ..KERNELS
};

/// [`TABLE`] with bf16 layers on AMX tiles ([`super::KernelTable::tiled`]).
pub(super) static TABLE_TILES: KernelTable = KernelTable {
    tiles: true,
    ..KERNELS
};

/// [`TABLE_FOUR_ROWS`] with bf16 layers on AMX tiles.
pub(super) static TABLE_FOUR_ROWS_TILES: KernelTable = KernelTable {
    panels_per_call: KERNELS.panels_per_call.at_most_four_rows(),
    tiles: true,
    ..KERNELS
};

/// FLOPs per second of one core running independent 16-wide FMA chains (12 of them: enough to
/// cover the latency on two ports). Runs `iterations` x 12 FMAs per chain.
pub(super) fn fma_peak_flops(iterations: u64) -> f64 {
    assert!(
        Isa::available().contains(&Isa::Avx512),
        "the AVX-512 FMA probe needs AVX-512 F"
    );
    // SAFETY: AVX-512 F (with the AVX2 and FMA it implies here) was just checked.
    let (seconds, sink) = unsafe { fma_chains(iterations) };
    std::hint::black_box(sink);
    (iterations * 12 * 16 * 2) as f64 / seconds
}

/// # Safety
/// The CPU must support AVX-512 F (checked by `fma_peak_flops`). No memory is touched but locals.
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn fma_chains(iterations: u64) -> (f64, f32) {
    let mut acc = [_mm512_set1_ps(0.0); 12];
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let start = std::time::Instant::now();
    for _ in 0..iterations {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let total = acc
        .iter()
        .fold(_mm512_setzero_ps(), |t, v| _mm512_add_ps(t, *v));
    (seconds, _mm512_reduce_add_ps(total))
}
