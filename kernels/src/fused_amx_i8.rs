//! An int8 layer's scan on AMX-INT8 tiles (an int8 or W8A8 engine's output layer, or the exact
//! screen's int8 copy of one): each 16-row by 32-item block of int16 x int8 sums leaves the tile
//! accumulators
//! ([`amx::for_each_block_i8`]), gets the SIMD kernels' f32 epilogue, is compared with each row's
//! bar 16 items at a time, and only the items that beat it reach the [`Sink`], as in
//! [`crate::fused`]: no score vector of the catalogue is ever written.
//!
//! The sums are exact (the activations' low and high bytes multiplied apart, see
//! [`amx::SplitI16Rows`]), and the epilogue is the SIMD kernels' own, operation for operation
//! (`dot as f32 * (item scale * row scale) + bias`, no fused multiply-add), so every score is the
//! SIMD scan's to the bit: a screen's certified bound holds unchanged, and an int8 or W8A8
//! output layer's top-k ([`top_k`]) is the SIMD scan's answer. Filters and exclusions
//! are left to the sink; unlike the SIMD scan, blocks no row of a group may receive are scored
//! all the same.

use crate::amx::{self, AmxI8Weights, I8Block, SplitI16Rows, BLOCK_OUTPUTS, I8_BLOCK_ROWS};
use crate::fused::{merge_ranges, over_panel_ranges, RowQuery, Selection, Sink};
use crate::packed::{PackedOutput, PanelData, QuantizedActivations};
use crate::topk::Scored;

/// An int8 layer in AMX tiles, beside its [`PackedOutput`]: the same int8 values, per-item
/// scales and bias.
#[derive(Clone, Debug)]
pub struct AmxI8Layer {
    /// Items (with PAD), as the packed layer's `n`.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    weights: AmxI8Weights,
    /// One per output of every block, 0 past `n`.
    scales: Vec<f32>,
    /// One per output of every block, -inf past `n`: a padding item never beats a bar.
    bias: Vec<f32>,
}

impl AmxI8Layer {
    /// The tiles of an int8 layer ([`PanelData::I8`]); `None` for any other precision.
    pub fn from_packed(out: &PackedOutput) -> Option<Self> {
        let PanelData::I8 { q, scales } = &out.data else {
            return None;
        };
        let pairs = out.d.div_ceil(2);
        // Per panel of 8 items and feature pair, 16 values: each item's (even, odd) side by side.
        let weights = AmxI8Weights::pack_values(out.n, out.d, |j, i| {
            q[(j / 8 * pairs + i / 2) * 16 + 2 * (j % 8) + i % 2]
        });
        let padded = weights.output_blocks() * BLOCK_OUTPUTS;
        let mut bias = vec![f32::NEG_INFINITY; padded];
        bias[..out.n].copy_from_slice(&out.bias[..out.n]);
        let mut item_scales = vec![0f32; padded];
        item_scales[..out.n].copy_from_slice(&scales[..out.n]);
        Some(AmxI8Layer {
            n: out.n,
            d: out.d,
            weights,
            scales: item_scales,
            bias,
        })
    }

    /// Bytes the tiles, scales and bias take (beside the packed layer's).
    pub fn bytes(&self) -> usize {
        self.weights.bytes() + (self.scales.len() + self.bias.len()) * 4
    }

    /// Blocks of 32 items: the unit a scan's range counts.
    pub fn blocks(&self) -> usize {
        self.weights.output_blocks()
    }

    /// A batch's int16 activations (as [`crate::fused`] prepares them for an int8 layer: rows
    /// `d` rounded up to even) split into the bytes the tiles multiply.
    pub(crate) fn split(&self, prepared: &QuantizedActivations, rows: usize) -> SplitI16Rows {
        let width = self.d.div_ceil(2) * 2;
        SplitI16Rows::new(
            &prepared.values[..rows * width],
            rows,
            width,
            self.weights.padded_k(),
        )
    }
}

/// Scores blocks `range` of `layer` for every row of `x` (row `r` at activation scale
/// `row_scales[r]`) and hands the items that beat each row's bar to `sink`, in increasing item
/// order per row. Errors before any item reaches the sink where this CPU or process cannot run
/// tiles or the shapes disagree, so a caller may fall back to the SIMD scan with the same sink.
pub(crate) fn scan(
    layer: &AmxI8Layer,
    x: &SplitI16Rows,
    row_scales: &[f32],
    range: std::ops::Range<usize>,
    sink: &mut impl Sink,
) -> Result<(), String> {
    if row_scales.len() != x.m {
        return Err(format!(
            "{} activation scales for {} rows",
            row_scales.len(),
            x.m
        ));
    }
    let wide = avx512_epilogue();
    // Each block's weights are read once for the whole batch (every row group multiplies them
    // from L1): from memory when the table is larger than the cache, so requested ahead.
    let block_bytes = BLOCK_OUTPUTS * layer.weights.padded_k();
    let prefetch = crate::prefetch::distance(layer.weights.bytes(), block_bytes);
    let mut scores = [0f32; I8_BLOCK_ROWS * BLOCK_OUTPUTS];
    amx::for_each_block_i8(x, &layer.weights, range, prefetch, |b, g, block| {
        let rows = g * I8_BLOCK_ROWS..((g + 1) * I8_BLOCK_ROWS).min(x.m);
        let items = b * BLOCK_OUTPUTS..(b + 1) * BLOCK_OUTPUTS;
        let epilogue = BlockEpilogue {
            block,
            rows: rows.len(),
            item_scales: layer.scales[items.clone()].try_into().expect("32 scales"),
            bias: layer.bias[items].try_into().expect("32 biases"),
            row_scales: &row_scales[rows.clone()],
            bars: std::array::from_fn(|r| {
                if r < rows.len() {
                    sink.bar(rows.start + r)
                } else {
                    f32::INFINITY
                }
            }),
        };
        let flags = epilogue.run(&mut scores, wide);
        for (r, &row_flags) in flags[..rows.len()].iter().enumerate() {
            let mut row_flags = row_flags;
            while row_flags != 0 {
                let c = row_flags.trailing_zeros() as usize;
                row_flags &= row_flags - 1;
                let item = (b * BLOCK_OUTPUTS + c) as u32;
                sink.take(rows.start + r, item, scores[r * BLOCK_OUTPUTS + c]);
            }
        }
    })
}

/// The best `k` items of each row of `hidden` (`[B, d]`), best first, from the int8 layer `out`
/// scored on its tiles `layer` (made from `out`), on up to `threads` pool threads: the SIMD
/// scan's answer, ids and scores, since every score is its score (an int8 or W8A8 engine's
/// output layer). Errors where this CPU or process cannot run tiles or the shapes disagree.
pub fn top_k(
    layer: &AmxI8Layer,
    out: &PackedOutput,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
) -> Result<Vec<Vec<Scored>>, String> {
    amx::availability().clone()?;
    if (layer.n, layer.d) != (out.n, out.d) {
        return Err(format!(
            "tiles of {} x {} for a layer of {} x {}",
            layer.n, layer.d, out.n, out.d
        ));
    }
    crate::fused::check_hidden(hidden, queries.len(), out.d)?;
    if queries.is_empty() {
        return Ok(Vec::new());
    }
    let input = crate::fused::prepared(out, hidden);
    let x = layer.split(&input, queries.len());
    let macs_per_block = queries.len() * BLOCK_OUTPUTS * out.d;
    let per_thread = over_panel_ranges(layer.blocks(), macs_per_block, threads, |range| {
        let mut selections: Vec<Selection<'_>> = queries.iter().map(Selection::new).collect();
        scan(layer, &x, &input.scales, range, &mut selections)?;
        Ok(selections.into_iter().map(|s| s.buffer).collect::<Vec<_>>())
    });
    let per_thread = per_thread.into_iter().collect::<Result<Vec<_>, String>>()?;
    Ok(merge_ranges(queries, &per_thread))
}

/// One block from sums to flagged scores, every row of it.
struct BlockEpilogue<'a> {
    block: &'a I8Block,
    /// Live rows of the block.
    rows: usize,
    item_scales: &'a [f32; BLOCK_OUTPUTS],
    bias: &'a [f32; BLOCK_OUTPUTS],
    row_scales: &'a [f32],
    /// Each live row's bar (+inf past them).
    bars: [f32; I8_BLOCK_ROWS],
}

impl BlockEpilogue<'_> {
    /// Writes the live rows' scores (`[row][32]`) and returns per row bit `c` set where score
    /// `c` is strictly above its bar (never for NaN).
    fn run(
        &self,
        scores: &mut [f32; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
        wide: bool,
    ) -> [u32; I8_BLOCK_ROWS] {
        assert_eq!(self.row_scales.len(), self.rows);
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` comes from `avx512_epilogue`: this CPU has AVX-512F.
            return unsafe { self.run_avx512(scores) };
        }
        let _ = wide;
        self.run_portable(scores)
    }

    fn run_portable(
        &self,
        scores: &mut [f32; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
    ) -> [u32; I8_BLOCK_ROWS] {
        let mut flags = [0u32; I8_BLOCK_ROWS];
        for (r, row_flags) in flags.iter_mut().enumerate().take(self.rows) {
            for c in 0..BLOCK_OUTPUTS {
                let at = r * BLOCK_OUTPUTS + c;
                let dot = self.block.high[at]
                    .wrapping_mul(256)
                    .wrapping_add(self.block.low[at]);
                // The SIMD kernels' epilogue: scale first, then one multiply and one add.
                let scale = self.item_scales[c] * self.row_scales[r];
                scores[at] = dot as f32 * scale + self.bias[c];
                *row_flags |= u32::from(scores[at] > self.bars[r]) << c;
            }
        }
        flags
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(
        &self,
        scores: &mut [f32; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
    ) -> [u32; I8_BLOCK_ROWS] {
        use std::arch::x86_64::*;
        let mut flags = [0u32; I8_BLOCK_ROWS];
        // Every load and store below touches 16 values at offset 0 or 16 of a 32-value array,
        // or of row `r` (< rows <= 16) of the [16][32] block and score arrays.
        // SAFETY: see above.
        let (scales, bias) = unsafe {
            (
                [
                    _mm512_loadu_ps(self.item_scales.as_ptr()),
                    _mm512_loadu_ps(self.item_scales.as_ptr().add(16)),
                ],
                [
                    _mm512_loadu_ps(self.bias.as_ptr()),
                    _mm512_loadu_ps(self.bias.as_ptr().add(16)),
                ],
            )
        };
        for (r, row_flags) in flags.iter_mut().enumerate().take(self.rows) {
            let (row_scale, bar) = (
                _mm512_set1_ps(self.row_scales[r]),
                _mm512_set1_ps(self.bars[r]),
            );
            for half in 0..2 {
                let at = r * BLOCK_OUTPUTS + 16 * half;
                // SAFETY: see above.
                unsafe {
                    let low = _mm512_loadu_si512(self.block.low.as_ptr().add(at).cast());
                    let high = _mm512_loadu_si512(self.block.high.as_ptr().add(at).cast());
                    let dot = _mm512_add_epi32(_mm512_slli_epi32::<8>(high), low);
                    let scale = _mm512_mul_ps(scales[half], row_scale);
                    let score =
                        _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale), bias[half]);
                    _mm512_storeu_ps(scores.as_mut_ptr().add(at), score);
                    // Ordered, quiet greater-than: false for NaN, as the portable comparison.
                    let beat = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(score, bar);
                    *row_flags |= u32::from(beat) << (16 * half);
                }
            }
        }
        flags
    }
}

/// Whether the epilogue may use AVX-512 (every CPU with AMX has it; checked all the same).
fn avx512_epilogue() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg;
    use crate::packed::quantize_int8_per_row;

    fn layer(n: usize, d: usize, seed: u64) -> (PackedOutput, Vec<i8>) {
        let mut next = lcg(seed);
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let (q, scales) = quantize_int8_per_row(&w, d);
        (PackedOutput::from_i8(&q, &scales, &bias, d), q)
    }

    #[test]
    fn tiles_hold_the_packed_layers_values() {
        for &(n, d) in &[(1, 1), (9, 3), (40, 65), (70, 64)] {
            let (packed, q) = layer(n, d, 3);
            let tiles = AmxI8Layer::from_packed(&packed).expect("an int8 layer");
            assert_eq!(tiles.weights, AmxI8Weights::pack(&q, n, d), "n {n} d {d}");
            let k_blocks = d.div_ceil(64);
            assert_eq!(
                tiles.weights.bytes(),
                n.div_ceil(32) * 2 * k_blocks * 1024,
                "whole pairs of 16-output blocks"
            );
            assert_eq!(tiles.blocks(), n.div_ceil(32));
            assert!(tiles.bias[n..].iter().all(|&b| b == f32::NEG_INFINITY));
            assert!(tiles.scales[n..].iter().all(|&s| s == 0.0));
        }
    }

    #[test]
    fn other_precisions_have_no_int8_tiles() {
        let w = vec![0.5f32; 40];
        assert!(AmxI8Layer::from_packed(&PackedOutput::from_f32(&w, &[0.0; 10], 4)).is_none());
    }

    #[test]
    fn both_epilogues_give_the_same_scores_and_flags() {
        let mut next = lcg(5);
        for round in 0..100 {
            let block = I8Block {
                low: std::array::from_fn(|_| (next() * 4e6) as i32),
                high: std::array::from_fn(|_| (next() * 1e6) as i32),
            };
            let item_scales: [f32; 32] = std::array::from_fn(|_| next().abs() * 1e-3);
            let mut bias: [f32; 32] = std::array::from_fn(|_| next());
            bias[31] = f32::NEG_INFINITY;
            let rows = 1 + round % I8_BLOCK_ROWS;
            let row_scales: Vec<f32> = (0..rows).map(|_| next().abs() * 1e-4).collect();
            let epilogue = BlockEpilogue {
                block: &block,
                rows,
                item_scales: &item_scales,
                bias: &bias,
                row_scales: &row_scales,
                bars: std::array::from_fn(|r| {
                    if r >= rows {
                        f32::INFINITY
                    } else if (round + r) % 7 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        next() * 1e3
                    }
                }),
            };
            let (mut portable, mut wide) = ([0f32; 512], [0f32; 512]);
            let flags = epilogue.run_portable(&mut portable);
            assert_eq!(epilogue.run(&mut wide, avx512_epilogue()), flags);
            assert_eq!(
                portable[..32 * rows]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                wide[..32 * rows]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            );
            assert!(
                flags.iter().all(|f| f >> 31 == 0),
                "padding never beats a bar"
            );
            assert!(
                flags[rows..].iter().all(|&f| f == 0),
                "rows past the block flag nothing"
            );
            assert!(flags.iter().any(|&f| f != 0) || round % 7 != 0);
        }
    }
}
