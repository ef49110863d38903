//! A bf16 dense layer (`x @ W^T + b`) on AMX tiles: the layer's values in tiles
//! ([`AmxLayer`], built from its packed panels), the input rounded to bf16 as the SIMD bf16
//! kernels round it, the products summed in the tile unit's order (so outputs may differ from
//! the SIMD kernels' in the last bits, within f32 accumulation's bound: `tests/amx.rs`).
//! A layer's rows are split over the pool only where the tiles' work pays for the handoff (a
//! batch of 64 rows through a 600 x 600 layer, 23 M multiply-adds, stays on one thread; a
//! BERT4Rec batch's 12,800 token rows do not).

use crate::amx::{self, BLOCK_OUTPUTS, BLOCK_ROWS};
use crate::fused_amx::AmxLayer;

/// `y = x @ W^T + b` for `x` of `[rows, d]` into `y` (`[rows, n]`, every value overwritten), on
/// this thread. Errors (nothing written) where this CPU or process cannot run tiles or the shapes
/// disagree.
pub fn linear_into(layer: &AmxLayer, x: &[f32], y: &mut [f32]) -> Result<(), String> {
    linear_into_then(layer, x, y, 1, |_| {})
}

/// Multiply-adds a tile does for one of an AVX-512 FMA: the pool's split of a layer on tiles
/// needs this many times a SIMD piece's multiply-adds to be worth a handoff (tiles multiply
/// about 300 bf16 pairs a nanosecond on the Emerald Rapids measured, AVX-512 FMAs about 70 f32
/// pairs a core).
const TILE_MACS_PER_FMA: usize = 4;

/// [`linear_into`] with the rows split into contiguous runs over up to `threads` pool threads
/// (as many as [`crate::dense::dense_pieces`] allows for the tiles' work), each run then passed
/// to `activation` on the thread that computed it. Every row is computed as alone, so the split
/// changes no bit.
pub fn linear_into_then(
    layer: &AmxLayer,
    x: &[f32],
    y: &mut [f32],
    threads: usize,
    activation: impl Fn(&mut [f32]) + Sync,
) -> Result<(), String> {
    linear_outputs_into_then(layer, 0..layer.n, x, y, threads, activation)
}

/// [`linear_into_then`] for the outputs `outputs` only, into `y` (`[rows, outputs.len()]`): each
/// output has the bits it has in the whole layer (a transformer's keys and values without its
/// queries, which the last layer needs for fewer rows). The range starts at a block of
/// [`BLOCK_OUTPUTS`] outputs (the blocks past its end are not multiplied); errors otherwise.
pub fn linear_outputs_into_then(
    layer: &AmxLayer,
    outputs: std::ops::Range<usize>,
    x: &[f32],
    y: &mut [f32],
    threads: usize,
    activation: impl Fn(&mut [f32]) + Sync,
) -> Result<(), String> {
    amx::availability().clone()?;
    let (d, n) = (layer.d, layer.n);
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(format!(
            "{} inputs are not whole rows of {d} features",
            x.len()
        ));
    }
    if !outputs.start.is_multiple_of(BLOCK_OUTPUTS)
        || outputs.start > outputs.end
        || outputs.end > n
    {
        return Err(format!(
            "outputs {outputs:?} of a layer of {n} on tiles: the range must start at a multiple \
             of {BLOCK_OUTPUTS} and end within the layer"
        ));
    }
    let rows = x.len() / d;
    let width = outputs.len();
    if y.len() != rows * width {
        return Err(format!(
            "the output holds {} values, [{rows}, {width}] needs {}",
            y.len(),
            rows * width
        ));
    }
    let padded_k = layer.weights.padded_k();
    let pieces = crate::dense::dense_pieces(rows, d * width / TILE_MACS_PER_FMA, threads);
    multiply_rows(
        layer,
        outputs,
        rows,
        y,
        pieces,
        |run| amx::bf16_rows(&x[run.start * d..run.end * d], run.len(), d, padded_k),
        activation,
    )
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
    let pieces = threads.clamp(1, rows.div_ceil(BLOCK_ROWS).max(1));
    let multi_hot = |run: std::ops::Range<usize>| {
        let mut xb = amx::TileBuffer::zeroed(run.len() * padded_k);
        for (row, items) in xb.chunks_exact_mut(padded_k.max(1)).zip(&hot[run]) {
            for &i in items.iter() {
                row[i as usize] = BF16_ONE;
            }
        }
        xb
    };
    multiply_rows(layer, 0..n, rows, y, pieces, multi_hot, |_| {})
}

/// `y = xb @ W^T + b` for `rows` rows split into `pieces` contiguous runs of whole groups of 32
/// rows, each run on a pool thread: its bf16 rows (`input(run)`, of the layer's padded depth)
/// multiplied by the layer's `outputs` (starting at a block), then its outputs passed to
/// `activation`. Each row's outputs are its own, so the split changes no bit.
fn multiply_rows(
    layer: &AmxLayer,
    outputs: std::ops::Range<usize>,
    rows: usize,
    y: &mut [f32],
    pieces: usize,
    input: impl Fn(std::ops::Range<usize>) -> amx::TileBuffer<u16> + Sync,
    activation: impl Fn(&mut [f32]) + Sync,
) -> Result<(), String> {
    let width = outputs.len();
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let groups = rows.div_ceil(BLOCK_ROWS);
    let per_piece = groups.div_ceil(pieces.clamp(1, groups)) * BLOCK_ROWS;
    // Each piece's output rows and what its tiles said.
    let mut parts: Vec<(&mut [f32], Result<(), String>)> = y
        .chunks_mut(per_piece * width)
        .map(|out| (out, Ok(())))
        .collect();
    let outputs = &outputs;
    crate::parallel::for_each_mut(&mut parts, |piece, (out, result)| {
        crate::profile::account(crate::profile::Work::Dense, || {
            multiply_piece(
                layer,
                outputs.clone(),
                piece * per_piece,
                out,
                result,
                &input,
                &activation,
            )
        })
    });
    parts.into_iter().try_for_each(|(_, result)| result)
}

/// One piece of [`multiply_rows`]: its rows from `first_row` into `out` (`outputs.len()` values
/// a row), then `activation`; the first error from the tiles into `result` (and nothing after it).
fn multiply_piece(
    layer: &AmxLayer,
    outputs: std::ops::Range<usize>,
    first_row: usize,
    out: &mut [f32],
    result: &mut Result<(), String>,
    input: &(impl Fn(std::ops::Range<usize>) -> amx::TileBuffer<u16> + Sync),
    activation: &(impl Fn(&mut [f32]) + Sync),
) {
    let padded_k = layer.weights.padded_k();
    let width = outputs.len();
    let blocks = outputs.start / BLOCK_OUTPUTS..outputs.end.div_ceil(BLOCK_OUTPUTS);
    let piece_rows = out.len() / width;
    let xb = input(first_row..first_row + piece_rows);
    for row0 in (0..piece_rows).step_by(BLOCK_ROWS) {
        let size = (piece_rows - row0).min(BLOCK_ROWS);
        let group = &xb[row0 * padded_k..(row0 + size) * padded_k];
        let out = &mut out[row0 * width..(row0 + size) * width];
        *result =
            amx::for_each_block_bf16(group, size, &layer.weights, blocks.clone(), |b, block| {
                let first = b * BLOCK_OUTPUTS;
                let cols = (outputs.end - first).min(BLOCK_OUTPUTS);
                let bias = &layer.bias[first..first + cols];
                let at = first - outputs.start;
                for r in 0..size {
                    let sums = &block[r * BLOCK_OUTPUTS..][..cols];
                    for ((o, &s), &b) in
                        out[r * width + at..][..cols].iter_mut().zip(sums).zip(bias)
                    {
                        *o = s + b;
                    }
                }
            });
        if result.is_err() {
            return;
        }
    }
    activation(out);
}
