//! The bfloat16 kernel on AVX512-BF16's `vdpbf16ps`: one instruction multiplies 16 items' pairs
//! of bfloat16 features by the row's activation pair and adds both products to the f32 sums, 32
//! multiply-adds where an fp32 fused multiply-add does 16, from weights of half the bytes. Every
//! other kernel is AVX-512's.
//!
//! `vdpbf16ps` adds the odd feature's product and then the even one's, each addition rounded once
//! to nearest even (the products are exact), which is the function every other path computes for
//! bfloat16 layers (see the crate documentation): the same bits, tested against the scalar path.
//! It reads subnormal inputs as zero and flushes subnormal results, which `packed::round_to_bf16`
//! already does for the inputs; a sum below 2^-126 is the one place the paths may differ.
//!
//! `unsafe` is confined here as in `avx512`: the kernel is a `#[target_feature]` function reached
//! only through `TABLE`, which `KernelTable::for_isa` hands out only after `Isa::available()` has
//! seen every feature it enables.

use std::arch::x86_64::*;

use super::{avx2, avx512};
use super::{Epilogue, Isa, KernelTable};

fn dpbf16_k<const R: usize, const P: usize>(
    h: super::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    // SAFETY: TABLE is only reachable after AVX2/FMA/F16C and AVX-512 F/BW/VNNI/BF16 were detected
    // (KernelTable::for_isa).
    unsafe { panels_dpbf16::<R, P>(h, d, w, e, out, m) }
}

/// bfloat16 activations x bfloat16 weight pairs, two panels per register (lanes 0-7 panel 2q,
/// lanes 8-15 panel 2q + 1), one `vdpbf16ps` per row and register for each feature pair.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VNNI/BF16. Bounds are asserted.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn panels_dpbf16<const R: usize, const P: usize>(
    hidden: super::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    if P % 2 == 1 {
        // A call of one panel: AVX2's widened kernel, which gives the same bits.
        // SAFETY: this function has every feature AVX2's kernel needs; it asserts its bounds.
        return unsafe { avx2::panels_bf16::<R, P>(hidden, d, w, epilogue, out, masks) };
    }
    let (pairs, width) =
        super::assert_pair_call::<R, P, _, _>(hidden.bits, d, w, epilogue, out, masks, false);
    // The first P / 2 of each row's registers are used (see `avx512::MAX_PANEL_PAIRS`).
    let mut acc = [[_mm512_setzero_ps(); avx512::MAX_PANEL_PAIRS]; R];
    let hp = hidden.bits.as_ptr();
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
        let mut wv = [_mm512_setzero_si512(); avx512::MAX_PANEL_PAIRS];
        for (q, v) in wv.iter_mut().take(P / 2).enumerate() {
            // SAFETY: 2(q+1) <= P panels of pairs*16 values fit in w (asserted); jp < pairs.
            *v = unsafe { avx512::bf16_panel_pair(wp, pairs, q, jp) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // The activations 2jp, 2jp+1 of row r as one 32-bit pair, in every lane.
            // SAFETY: in bounds: r*width + 2jp + 2 <= R*width <= hidden.len() (asserted);
            // read_unaligned needs no alignment.
            let pair = unsafe { hp.add(r * width + 2 * jp).cast::<i32>().read_unaligned() };
            let act = as_bf16_pairs(_mm512_set1_epi32(pair));
            for (a, v) in acc_r.iter_mut().zip(&wv).take(P / 2) {
                *a = _mm512_dpbf16_ps(*a, act, as_bf16_pairs(*v));
            }
        }
    }
    // SAFETY: this function has the AVX2 the epilogue needs; it asserts its own bounds.
    unsafe {
        avx2::f32_epilogue::<R, P>(&avx512::split_halves::<R, P, _>(&acc), epilogue, out, masks)
    }
}

/// 32 bfloat16 values held as integers, as the type `vdpbf16ps` takes.
#[inline(always)]
fn as_bf16_pairs(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 512-bit vectors with no invalid bit patterns; this reinterprets the
    // bits and executes no instruction.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

const KERNELS: KernelTable = KernelTable {
    isa: Isa::Avx512Bf16,
    bf16: kernel_table!(@rows dpbf16_k, super::PanelBf16),
    panels_per_call: super::PanelsPerCall {
        bf16: [8, 8, 8, 4],
        ..avx512::KERNELS.panels_per_call
    },
    ..avx512::KERNELS
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
