//! Rounding to bfloat16, shared by the packing of weights, the activations a bf16 layer reads
//! and the ISA kernels that compile the same loops for their own instruction set (so every ISA
//! computes with the same numbers).

/// `f32` rounded to the nearest bfloat16 (ties to even), as bits, the way the AVX512-BF16
/// conversions round: NaN stays a (quiet) NaN, and values below the smallest normal (f32
/// subnormals, which `vdpbf16ps` reads as zero) become a zero of their sign, so every ISA computes
/// with the same numbers.
#[inline]
pub fn round_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    if bits & 0x7f80_0000 == 0 {
        return ((bits >> 16) & 0x8000) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even (a carry into the
    // exponent is the right result, up to infinity for the largest values).
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// bfloat16 bits as the `f32` they denote (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Every weight rounded to bfloat16 ([`round_to_bf16`]), as bits.
pub fn to_bf16_bits(weight: &[f32]) -> Vec<u16> {
    weight.iter().map(|&w| round_to_bf16(w)).collect()
}

/// The rows of `hidden` (`[rows, d]`) rounded to bfloat16 into `bits` and widened back to f32
/// into `wide`, both `[rows, d rounded up to even]` (already sized; every value written, an odd
/// row's padding with zero), each
/// pair in `wide` odd value first: the order the kernels add them in. Written as loops that
/// vectorise: rounding without branches, then each pair widened from its two halves of a u32.
#[inline(always)]
pub(crate) fn round_rows_to_bf16_both(
    hidden: &[f32],
    d: usize,
    bits: &mut [u16],
    wide: &mut [f32],
) {
    let width = d.div_ceil(2) * 2;
    for ((bits, wide), row) in bits
        .chunks_exact_mut(width.max(1))
        .zip(wide.chunks_exact_mut(width.max(1)))
        .zip(hidden.chunks_exact(d.max(1)))
    {
        for (b, &h) in bits.iter_mut().zip(row) {
            *b = round_to_bf16_branch_free(h);
        }
        if let Some(pad) = bits.get_mut(d) {
            *pad = 0;
        }
        for (pair, out) in bits.chunks_exact(2).zip(wide.chunks_exact_mut(2)) {
            let both = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
            out[0] = f32::from_bits(both & 0xffff_0000);
            out[1] = f32::from_bits(both << 16);
        }
    }
}

/// The rows of `x` (`[rows, k]`) rounded to bfloat16 ([`round_to_bf16`]) into `out`, rows of
/// `padded_k` values whose padding is left as it is (zero in a fresh buffer): AMX tiles' input.
/// A loop that vectorises, compiled by callers for their instruction set.
#[inline(always)]
pub(crate) fn round_rows_padded(x: &[f32], k: usize, padded_k: usize, out: &mut [u16]) {
    for (row, src) in out
        .chunks_exact_mut(padded_k.max(1))
        .zip(x.chunks_exact(k.max(1)))
    {
        for (d, &s) in row.iter_mut().zip(src) {
            *d = round_to_bf16_branch_free(s);
        }
    }
}

/// [`round_to_bf16`] without branches (selects instead), so loops over it vectorise: the same
/// bits for every input (tested).
#[inline(always)]
pub(crate) fn round_to_bf16_branch_free(x: f32) -> u16 {
    let bits = x.to_bits();
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let subnormal = bits & 0x7f80_0000 == 0;
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x0040;
    let signed_zero = (bits >> 16) & 0x8000;
    let value = if subnormal { signed_zero } else { rounded };
    (if nan { quiet_nan } else { value }) as u16
}
