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
    let blocks = layer.weights.output_blocks();
    for row0 in (0..rows).step_by(BLOCK_ROWS) {
        let size = (rows - row0).min(BLOCK_ROWS);
        let group = &xb[row0 * padded_k..(row0 + size) * padded_k];
        let out = &mut y[row0 * n..(row0 + size) * n];
        amx::for_each_block_bf16(group, size, &layer.weights, 0..blocks, |b, block| {
            let first = b * BLOCK_OUTPUTS;
            let cols = (n - first).min(BLOCK_OUTPUTS);
            let bias = &layer.bias[first..first + cols];
            for r in 0..size {
                let sums = &block[r * BLOCK_OUTPUTS..][..cols];
                for ((o, &s), &b) in out[r * n + first..][..cols].iter_mut().zip(sums).zip(bias) {
                    *o = s + b;
                }
            }
        })?;
    }
    Ok(())
}
