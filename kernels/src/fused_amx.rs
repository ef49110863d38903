//! A bf16 output layer's fused scan on AMX tiles: each 32-row by 32-item block of scores leaves
//! the tile accumulators ([`amx::for_each_block_bf16`]), is compared with each row's bar 16 items
//! at a time, and only the items that beat it reach the row's selection, as in [`crate::fused`]:
//! no score vector of the catalogue is ever written.
//!
//! The scores are those of the bf16 layer (weights and activations rounded to bf16, products
//! exact in f32), summed in the tile unit's order, so they differ from the SIMD paths' in the last
//! bits: within `(d + 1) 2^-24 sum |w x|` of the exact sum, plus the bias addition's rounding
//! (`tests/amx.rs` checks answers against f64 with that bound). Filters and exclusions are
//! applied as items reach the selection; unlike the SIMD scan, blocks no filtered row may
//! receive are scored all the same (a filter's savings on AMX are left to measurement).

use crate::amx::{self, AmxBf16Weights, Bf16Block, BLOCK_OUTPUTS, BLOCK_ROWS};
use crate::fused::{merge_ranges, over_panel_ranges, RowQuery, Selection};
use crate::packed::{PackedOutput, PanelData};
use crate::topk::Scored;

/// A bf16 layer in AMX tiles, beside its [`PackedOutput`]: the same bf16 values and bias. The
/// output layer's scan ([`top_k_bf16`]) and dense layers ([`crate::dense_amx`]) run on it.
#[derive(Clone, Debug)]
pub struct AmxLayer {
    /// Items (with PAD), as the packed layer's `n`.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    pub(crate) weights: AmxBf16Weights,
    /// One per output of every block, -inf past `n`: a padding item never beats a bar.
    pub(crate) bias: Vec<f32>,
}

impl AmxLayer {
    /// The tiles of a bf16 layer (packed as [`PanelData::Bf16`] or widened, [`PanelData::Bf16Wide`]:
    /// the same values); `None` for any other precision.
    pub fn from_packed(out: &PackedOutput) -> Option<Self> {
        let pairs = out.d.div_ceil(2);
        // Both layouts keep, per panel of 8 items and feature pair, 16 values: bf16 interleaves
        // (even, odd) per lane; the widened layer holds the 8 odd features, then the 8 even ones.
        let weights = match &out.data {
            PanelData::Bf16(bits) => AmxBf16Weights::pack_bits(out.n, out.d, |j, i| {
                let chunk = (j / 8 * pairs + i / 2) * 16;
                bits[chunk + 2 * (j % 8) + i % 2]
            }),
            PanelData::Bf16Wide(wide) => AmxBf16Weights::pack_bits(out.n, out.d, |j, i| {
                let chunk = (j / 8 * pairs + i / 2) * 16;
                let at = chunk + if i % 2 == 1 { 0 } else { 8 } + j % 8;
                // Widened exactly from bf16: the low 16 bits are zero.
                (wide[at].to_bits() >> 16) as u16
            }),
            _ => return None,
        };
        let mut bias = vec![f32::NEG_INFINITY; weights.output_blocks() * BLOCK_OUTPUTS];
        bias[..out.n].copy_from_slice(&out.bias[..out.n]);
        Some(AmxLayer {
            n: out.n,
            d: out.d,
            weights,
            bias,
        })
    }

    /// The tiles of an `[n outputs, d inputs]` bf16 layer given by its bits `value(output,
    /// input)` and its bias (`n` values): a layer stored otherwise than as packed panels
    /// (Mult-VAE's first layer, kept one row per input item).
    pub fn from_bits(
        n: usize,
        d: usize,
        value: impl Fn(usize, usize) -> u16,
        bias: &[f32],
    ) -> Self {
        assert_eq!(bias.len(), n, "one bias per output");
        let weights = AmxBf16Weights::pack_bits(n, d, value);
        let mut padded = vec![f32::NEG_INFINITY; weights.output_blocks() * BLOCK_OUTPUTS];
        padded[..n].copy_from_slice(bias);
        AmxLayer {
            n,
            d,
            weights,
            bias: padded,
        }
    }

    /// Bytes the tiles and bias take (beside the packed layer's).
    pub fn bytes(&self) -> usize {
        self.weights.bytes() + self.bias.len() * 4
    }
}

/// Blocks per stretch of the scan: about 96 KiB of weights, so a stretch stays in L2 while every
/// row group of the batch multiplies it (the SIMD scan's tile, [`crate::fused`]).
fn blocks_per_stretch(out: &AmxLayer) -> usize {
    let bytes_per_block = BLOCK_OUTPUTS * out.weights.padded_k() * 2;
    (96 * 1024 / bytes_per_block).max(1)
}

/// The best `k` items of each row of `hidden` (`[B, d]`), best first, scored on AMX tiles
/// without materialising scores, on up to `threads` pool threads. Errors where this CPU or
/// process cannot run tiles ([`amx::availability`]) or the shapes disagree.
pub fn top_k_bf16(
    out: &AmxLayer,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
) -> Result<Vec<Vec<Scored>>, String> {
    amx::availability().clone()?;
    crate::fused::check_hidden(hidden, queries.len(), out.d)?;
    if queries.is_empty() {
        return Ok(Vec::new());
    }
    let rows = queries.len();
    let padded_k = out.weights.padded_k();
    let x = amx::bf16_rows(hidden, rows, out.d, padded_k);
    let wide_compare = avx512_compare();
    let blocks = out.weights.output_blocks();
    let macs_per_block = rows * BLOCK_OUTPUTS * out.d;
    let per_thread = over_panel_ranges(blocks, macs_per_block, threads, |range| {
        let mut selections: Vec<Selection<'_>> = queries.iter().map(Selection::new).collect();
        scan(out, &x, rows, range, &mut selections, wide_compare)?;
        Ok(selections.into_iter().map(|s| s.buffer).collect::<Vec<_>>())
    });
    let per_thread = per_thread.into_iter().collect::<Result<Vec<_>, String>>()?;
    Ok(merge_ranges(queries, &per_thread))
}

/// Blocks `range` for every row: stretch by stretch, each row group of up to 32 rows.
fn scan(
    out: &AmxLayer,
    x: &[u16],
    rows: usize,
    range: std::ops::Range<usize>,
    selections: &mut [Selection<'_>],
    wide_compare: bool,
) -> Result<(), String> {
    let padded_k = out.weights.padded_k();
    let stretch = blocks_per_stretch(out);
    let mut start = range.start;
    while start < range.end {
        let end = (start + stretch).min(range.end);
        for row0 in (0..rows).step_by(BLOCK_ROWS) {
            let size = (rows - row0).min(BLOCK_ROWS);
            let group = &mut selections[row0..row0 + size];
            let x_group = &x[row0 * padded_k..(row0 + size) * padded_k];
            amx::for_each_block_bf16(x_group, size, &out.weights, start..end, |b, block| {
                select_from_block(
                    b,
                    block,
                    &out.bias[b * BLOCK_OUTPUTS..][..BLOCK_OUTPUTS],
                    group,
                    wide_compare,
                )
            })?;
        }
        start = end;
    }
    Ok(())
}

/// Offers each row's items of block `b` that beat its bar, in increasing item order.
fn select_from_block(
    b: usize,
    block: &Bf16Block,
    bias: &[f32],
    group: &mut [Selection<'_>],
    wide_compare: bool,
) {
    let bias: &[f32; BLOCK_OUTPUTS] = bias.try_into().expect("one bias per output of a block");
    for (r, selection) in group.iter_mut().enumerate() {
        let scores: &[f32; BLOCK_OUTPUTS] = block[r * BLOCK_OUTPUTS..][..BLOCK_OUTPUTS]
            .try_into()
            .expect("a block row holds 32 scores");
        let mut flags = beats(scores, bias, selection.bar, wide_compare);
        while flags != 0 {
            let c = flags.trailing_zeros() as usize;
            flags &= flags - 1;
            // The same sum as `beats` compared: the score the selection ranks.
            selection.offer((b * BLOCK_OUTPUTS + c) as u32, scores[c] + bias[c]);
        }
    }
}

/// Whether [`beats`] may use AVX-512 (every CPU with AMX has it; checked all the same).
fn avx512_compare() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Bit `c` set where `scores[c] + bias[c]` is strictly above `bar` (never for NaN).
fn beats(
    scores: &[f32; BLOCK_OUTPUTS],
    bias: &[f32; BLOCK_OUTPUTS],
    bar: f32,
    wide_compare: bool,
) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if wide_compare {
        // SAFETY: `wide_compare` comes from `avx512_compare`: this CPU has AVX-512F.
        return unsafe { beats_avx512(scores, bias, bar) };
    }
    let _ = wide_compare;
    beats_portable(scores, bias, bar)
}

fn beats_portable(scores: &[f32; BLOCK_OUTPUTS], bias: &[f32; BLOCK_OUTPUTS], bar: f32) -> u32 {
    scores
        .iter()
        .zip(bias)
        .enumerate()
        .fold(0, |flags, (c, (&s, &b))| {
            flags | (u32::from(s + b > bar) << c)
        })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn beats_avx512(
    scores: &[f32; BLOCK_OUTPUTS],
    bias: &[f32; BLOCK_OUTPUTS],
    bar: f32,
) -> u32 {
    use std::arch::x86_64::*;
    // SAFETY: each load reads 16 f32 at offset 0 or 16 of a 32-f32 array.
    let (s0, s1, b0, b1) = unsafe {
        (
            _mm512_loadu_ps(scores.as_ptr()),
            _mm512_loadu_ps(scores.as_ptr().add(16)),
            _mm512_loadu_ps(bias.as_ptr()),
            _mm512_loadu_ps(bias.as_ptr().add(16)),
        )
    };
    let bar = _mm512_set1_ps(bar);
    // Ordered, quiet greater-than: false for NaN, as the portable comparison.
    let low = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_add_ps(s0, b0), bar);
    let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_add_ps(s1, b1), bar);
    u32::from(low) | u32::from(high) << 16
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg;
    use crate::packed::round_to_bf16;

    fn layer(n: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut next = lcg(seed);
        let w = (0..n * d).map(|_| next()).collect();
        let bias = (0..n).map(|_| next() * 0.1).collect();
        (w, bias)
    }

    #[test]
    fn tiles_hold_the_packed_layers_values_in_both_layouts() {
        for &(n, d) in &[(1, 1), (9, 3), (40, 33), (70, 64)] {
            let (w, bias) = layer(n, d, 3);
            let bits: Vec<u16> = w.iter().map(|&v| round_to_bf16(v)).collect();
            let packed = PackedOutput::from_bf16_bits(&bits, &bias, d);
            let expected = AmxBf16Weights::pack(&w, n, d);
            let tiles = AmxLayer::from_packed(&packed).expect("a bf16 layer");
            assert_eq!(tiles.weights, expected, "bf16 panels, n {n} d {d}");
            let wide = packed.widened_bf16().expect("a bf16 layer");
            let from_wide = AmxLayer::from_packed(&wide).expect("a widened bf16 layer");
            assert_eq!(from_wide.weights, expected, "widened panels, n {n} d {d}");
            assert_eq!(&tiles.bias[..n], &bias[..], "the bias, n {n}");
            assert!(tiles.bias[n..].iter().all(|&b| b == f32::NEG_INFINITY));
            assert_eq!(tiles.bias.len() % BLOCK_OUTPUTS, 0);
        }
    }

    #[test]
    fn other_precisions_have_no_tiles() {
        let (w, bias) = layer(10, 4, 5);
        assert!(AmxLayer::from_packed(&PackedOutput::from_f32(&w, &bias, 4)).is_none());
    }

    #[test]
    fn both_comparisons_flag_the_same_items() {
        let mut next = lcg(11);
        for _ in 0..200 {
            let scores: [f32; BLOCK_OUTPUTS] = std::array::from_fn(|_| next());
            let mut bias: [f32; BLOCK_OUTPUTS] = std::array::from_fn(|_| next() * 0.5);
            bias[31] = f32::NEG_INFINITY;
            let bar = next();
            let expected: u32 = (0..BLOCK_OUTPUTS)
                .filter(|&c| scores[c] + bias[c] > bar)
                .map(|c| 1 << c)
                .sum();
            assert_eq!(beats_portable(&scores, &bias, bar), expected);
            assert_eq!(beats(&scores, &bias, bar, avx512_compare()), expected);
        }
        let nan = [f32::NAN; BLOCK_OUTPUTS];
        assert_eq!(
            beats(&nan, &[0.0; 32], f32::NEG_INFINITY, avx512_compare()),
            0
        );
    }

    #[test]
    fn without_tiles_the_scan_says_why() {
        let (w, bias) = layer(40, 8, 7);
        let bits: Vec<u16> = w.iter().map(|&v| round_to_bf16(v)).collect();
        let tiles = AmxLayer::from_packed(&PackedOutput::from_bf16_bits(&bits, &bias, 8)).unwrap();
        let none = crate::fused::Exclusions::new(vec![]);
        let queries = [RowQuery::new(3, &none)];
        match amx::availability() {
            Ok(()) => assert_eq!(
                top_k_bf16(&tiles, &[0.5; 8], &queries, 1).unwrap()[0].len(),
                3
            ),
            Err(why) => assert_eq!(
                &top_k_bf16(&tiles, &[0.5; 8], &queries, 1).unwrap_err(),
                why
            ),
        }
    }
}
