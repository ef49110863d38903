//! A bf16 dense layer (`x @ W^T + b`) on AMX tiles: the layer's values in tiles
//! ([`AmxLayer`], built from its packed panels), the input rounded to bf16 as the SIMD bf16
//! kernels round it, the products summed in the tile unit's order (so outputs may differ from
//! the SIMD kernels' in the last bits, within f32 accumulation's bound: `tests/amx.rs`).
//! One thread: a batch of 64 rows through a 600 x 600 layer is 23 M multiply-adds, a few
//! microseconds of one core's tiles, less than handing pieces to the pool costs.

use crate::amx::{self, BLOCK_OUTPUTS, BLOCK_ROWS};
use crate::fused_amx::AmxLayer;

/// `y = x @ W^T + b` for `x` of `[rows, d]` into `y` (`[rows, n]`, every value overwritten).
/// Errors (nothing written) where this CPU or process cannot run tiles or the shapes disagree.
pub fn linear_into(layer: &AmxLayer, x: &[f32], y: &mut [f32]) -> Result<(), String> {
    amx::availability().clone()?;
    let (d, n) = (layer.d, layer.n);
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(format!(
            "{} inputs are not whole rows of {d} features",
            x.len()
        ));
    }
    let rows = x.len() / d;
    if y.len() != rows * n {
        return Err(format!(
            "the output holds {} values, [{rows}, {n}] needs {}",
            y.len(),
            rows * n
        ));
    }
    let padded_k = layer.weights.padded_k();
    let xb = amx::bf16_rows(x, rows, d, padded_k);
    multiply_rows(layer, &xb, rows, y, 1)
}

/// bfloat16 1.0: a multi-hot input's value.
const BF16_ONE: u16 = 0x3f80;

/// `y = m @ W^T + b` for the multi-hot rows `m` whose row `r` holds 1 at the inputs `hot[r]`
/// (distinct, each below `d`) and 0 elsewhere: each output the sum of the listed inputs' weights,
/// summed on tiles, plus the bias. A multi-hot first layer (Mult-VAE's) as one product on tiles
/// rather than a gather of weight rows: worth it where the batch's histories together list many
/// of the catalogue's items. The rows' groups of 32 are spread over up to `threads` pool threads.
/// Errors (nothing written) where this CPU or process cannot run tiles, an input is out of range,
/// or the shapes disagree.
pub fn multi_hot_into(
    layer: &AmxLayer,
    hot: &[&[u32]],
    y: &mut [f32],
    threads: usize,
) -> Result<(), String> {
    amx::availability().clone()?;
    let (d, n, rows) = (layer.d, layer.n, hot.len());
    if y.len() != rows * n {
        return Err(format!(
            "the output holds {} values, [{rows}, {n}] needs {}",
            y.len(),
            rows * n
        ));
    }
    if let Some(&i) = hot
        .iter()
        .flat_map(|r| r.iter())
        .find(|&&i| i as usize >= d)
    {
        return Err(format!("input {i} of a layer with {d} inputs"));
    }
    let padded_k = layer.weights.padded_k();
    let mut xb = vec![0u16; rows * padded_k];
    for (row, items) in xb.chunks_exact_mut(padded_k.max(1)).zip(hot) {
        for &i in items.iter() {
            row[i as usize] = BF16_ONE;
        }
    }
    multiply_rows(layer, &xb, rows, y, threads)
}

/// `y = xb @ W^T + b` for `rows` bf16 rows `xb` of the layer's padded depth, the groups of 32
/// rows spread over up to `threads` pool threads (each group's outputs its own: the split
/// changes no bit).
fn multiply_rows(
    layer: &AmxLayer,
    xb: &[u16],
    rows: usize,
    y: &mut [f32],
    threads: usize,
) -> Result<(), String> {
    let (n, padded_k) = (layer.n, layer.weights.padded_k());
    let blocks = layer.weights.output_blocks();
    let groups = rows.div_ceil(BLOCK_ROWS);
    let pieces = threads.clamp(1, groups.max(1));
    let per_piece = groups.div_ceil(pieces.max(1)) * BLOCK_ROWS;
    // Each piece's output rows and what its tiles said.
    let mut parts: Vec<(&mut [f32], Result<(), String>)> = y
        .chunks_mut((per_piece * n).max(1))
        .map(|out| (out, Ok(())))
        .collect();
    crate::parallel::for_each_mut(&mut parts, |piece, (out, result)| {
        let first_row = piece * per_piece;
        let piece_rows = out.len() / n.max(1);
        for row0 in (0..piece_rows).step_by(BLOCK_ROWS) {
            let size = (piece_rows - row0).min(BLOCK_ROWS);
            let at = (first_row + row0) * padded_k;
            let group = &xb[at..at + size * padded_k];
            let out = &mut out[row0 * n..(row0 + size) * n];
            *result =
                amx::for_each_block_bf16(group, size, &layer.weights, 0..blocks, |b, block| {
                    let first = b * BLOCK_OUTPUTS;
                    let cols = (n - first).min(BLOCK_OUTPUTS);
                    let bias = &layer.bias[first..first + cols];
                    for r in 0..size {
                        let sums = &block[r * BLOCK_OUTPUTS..][..cols];
                        for ((o, &s), &b) in
                            out[r * n + first..][..cols].iter_mut().zip(sums).zip(bias)
                        {
                            *o = s + b;
                        }
                    }
                });
            if result.is_err() {
                return;
            }
        }
    });
    parts.into_iter().try_for_each(|(_, result)| result)
}
