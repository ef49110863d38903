//! Dense layers (`x @ W^T + b`) on the output layer's micro-kernels: the same packed panels and
//! calls as [`crate::fused`], with every score written out instead of selected, rows computed
//! independently (so a row's values never depend on the batch around it), and a split of the rows
//! over the worker pool that changes no bit.

use crate::packed::{LayerRef, PackedOutput, PanelRef, QuantizedActivations};
use crate::{
    panels_slot, prefetch, row_group_at, rows_slot, Epilogue, KernelTable, MAX_CALL_PANELS,
    MAX_CALL_SCORES, MAX_GROUP_ROWS,
};

/// A dense layer on the same micro-kernels: `x @ W^T + b` for `x` of `[rows, d]`, `[rows, n]` out,
/// at the layer's precision (int8 layers quantize each row of `x` to int16 with its own scale).
/// Rows are computed independently (the same accumulation order whatever the batch).
pub fn linear(table: &KernelTable, layer: &PackedOutput, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len() / layer.d * layer.n];
    linear_into(
        table,
        layer.view(),
        x,
        &mut y,
        &mut QuantizedActivations::default(),
    );
    y
}

/// [`linear`] into `y` (`[rows, n]`, every value overwritten), quantizing int8 layers' inputs
/// into `quantized`: with buffers kept between calls it allocates nothing.
pub fn linear_into(
    table: &KernelTable,
    layer: LayerRef<'_>,
    x: &[f32],
    y: &mut [f32],
    quantized: &mut QuantizedActivations,
) {
    let rows = x.len() / layer.d;
    assert_eq!(y.len(), rows * layer.n, "one output row of n per input row");
    prepare_input(layer, x, quantized);
    linear_rows(table, layer, x, quantized, 0..rows, y);
}

/// The layer's input as its kernels read it, into `quantized`: int16 levels for int8 weights (each
/// row at its own scale, or at the layer's calibrated static scale: all-layer W8A8), bfloat16 for
/// bfloat16 weights; f32 layers read `x` itself.
pub(crate) fn prepare_input(layer: LayerRef<'_>, x: &[f32], quantized: &mut QuantizedActivations) {
    match layer.data {
        PanelRef::I8 { .. } => quantized.quantize(x, layer.d, layer.activation_scale),
        PanelRef::Bf16(_) | PanelRef::Bf16Wide(_) => quantized.round_to_bf16(x, layer.d),
        PanelRef::F32(_) | PanelRef::F16(_) => {}
    }
}

/// Smallest share of a dense layer (or of a transformer layer's step) worth a piece of its own,
/// in multiply-adds: about 7 us of one core's dense work. A pool worker that has just finished a
/// piece starts the next in a few microseconds (one that has gone idle takes 30-55 us on the
/// 2-core VM the project is measured on). Measured on BERT4Rec at batch 1 on 2 threads
/// (MovieLens-1M's shape): 2^17 gave 0.49-0.51 ms, 2^18 0.49-0.60, 2^20 0.59-0.63; 2^16 no better.
pub const MIN_MACS_PER_DENSE_PIECE: usize = 1 << 17;

/// Pieces a dense layer of `rows` rows and `macs_per_row` multiply-adds per row is split into on
/// `threads` threads: whole groups of 4 rows each, and at least [`MIN_MACS_PER_DENSE_PIECE`].
pub fn dense_pieces(rows: usize, macs_per_row: usize, threads: usize) -> usize {
    let by_work = rows.saturating_mul(macs_per_row)
        / crate::parallel::min_macs_per_piece(MIN_MACS_PER_DENSE_PIECE);
    threads.min(by_work).min(rows / 4).max(1)
}

/// [`linear_into`] with the rows split into [`dense_pieces`] contiguous runs run on the worker
/// pool, each run's time accounted to `work`. Every row is computed exactly as alone, so the split
/// changes no bit; with one piece it is [`linear_into`] (and allocates nothing).
pub fn linear_into_threads(
    table: &KernelTable,
    layer: LayerRef<'_>,
    x: &[f32],
    y: &mut [f32],
    quantized: &mut QuantizedActivations,
    threads: usize,
    work: crate::profile::Work,
) {
    linear_into_threads_then(table, layer, x, y, quantized, threads, work, |_| {})
}

/// [`linear_into_threads`], then `after` over each piece's output rows on the thread that
/// computed them, while they are still in its cache: an elementwise activation split with the
/// rows rather than run over the whole output on one thread (HSTU's SiLU after each projection
/// was a tenth of a batch of one on 2 threads). `after` must act on each value alone, so the
/// split changes no bit; its time is not accounted to `work`.
#[allow(clippy::too_many_arguments)]
pub fn linear_into_threads_then(
    table: &KernelTable,
    layer: LayerRef<'_>,
    x: &[f32],
    y: &mut [f32],
    quantized: &mut QuantizedActivations,
    threads: usize,
    work: crate::profile::Work,
    after: fn(&mut [f32]),
) {
    let (rows, n) = (x.len() / layer.d, layer.n);
    let pieces = dense_pieces(rows, n * layer.d, threads);
    if pieces <= 1 {
        crate::profile::account(work, || linear_into(table, layer, x, y, quantized));
        return after(y);
    }
    assert_eq!(y.len(), rows * n, "one output row of n per input row");
    prepare_input(layer, x, quantized);
    let quantized = &*quantized;
    // Whole row groups per piece, so each piece runs the kernels a single call would.
    let rows_per_piece = rows.div_ceil(pieces).div_ceil(4) * 4;
    let mut outputs: Vec<&mut [f32]> = y.chunks_mut(rows_per_piece * n).collect();
    crate::parallel::for_each_mut(&mut outputs, |i, out| {
        let first = i * rows_per_piece;
        let rows = first..first + out.len() / n.max(1);
        crate::profile::account(work, || linear_rows(table, layer, x, quantized, rows, out));
        after(out);
    });
}

/// Rows `rows` of `x @ W^T + b` into `y` (`[rows.len(), n]`); an int8 or bf16 layer reads those
/// rows of `quantized`, already holding all of `x`.
fn linear_rows(
    table: &KernelTable,
    layer: LayerRef<'_>,
    x: &[f32],
    quantized: &QuantizedActivations,
    rows: std::ops::Range<usize>,
    y: &mut [f32],
) {
    let d = layer.d;
    let n = layer.n;
    let mut scores = [0f32; MAX_CALL_SCORES];
    let mut masks = [0u8; MAX_CALL_PANELS];
    let width_q = d.div_ceil(2) * 2;
    let pairs = d.div_ceil(2);
    let panels_per_call = layer.panels_per_call(table);
    let panels = layer.panels();
    let (table_bytes, panel_bytes) = (layer.weight_bytes(), layer.panel_bytes());
    // A call covers `per_call` panels or, at the end of a row, one: their prefetch distances,
    // worked out once per layer rather than per call.
    let prefetch_for = |count: usize| prefetch::distance(table_bytes, count * panel_bytes);
    let prefetch_by_count: [usize; 9] = std::array::from_fn(prefetch_for);
    let mut row0 = rows.start;
    while row0 < rows.end {
        let (size, per_call) = row_group_at(rows.end - row0, panels_per_call);
        let h = &x[row0 * d..(row0 + size) * d];
        let mut row_scales = [1f32; MAX_GROUP_ROWS];
        for (r, scale) in row_scales.iter_mut().enumerate().take(size) {
            if let Some(&s) = quantized.scales.get(row0 + r) {
                *scale = s;
            }
        }
        let mut p = 0;
        while p < panels {
            let count = if panels - p >= per_call { per_call } else { 1 };
            let items = p * 8..(p + count) * 8;
            let epilogue = Epilogue {
                bias: &layer.bias[items.clone()],
                scales: match layer.data {
                    PanelRef::I8 { scales, .. } => &scales[items.clone()],
                    _ => &[],
                },
                bars: [f32::INFINITY; MAX_GROUP_ROWS],
                row_scales,
                prefetch: prefetch_by_count[count],
            };
            let (rs, ps) = (rows_slot(size), panels_slot(count));
            match layer.data {
                PanelRef::F32(w) => (table.f32[rs][ps])(
                    h,
                    d,
                    &w[p * d * 8..(p + count) * d * 8],
                    &epilogue,
                    &mut scores,
                    &mut masks,
                ),
                PanelRef::F16(w) => (table.f16[rs][ps])(
                    h,
                    d,
                    &w[p * d * 8..(p + count) * d * 8],
                    &epilogue,
                    &mut scores,
                    &mut masks,
                ),
                PanelRef::Bf16(w) => (table.bf16[rs][ps])(
                    quantized.bf16_rows(row0..row0 + size, width_q),
                    d,
                    &w[p * pairs * 16..(p + count) * pairs * 16],
                    &epilogue,
                    &mut scores,
                    &mut masks,
                ),
                PanelRef::Bf16Wide(w) => (table.f32[rs][ps])(
                    &quantized.bf16_wide[row0 * width_q..(row0 + size) * width_q],
                    width_q,
                    &w[p * width_q * 8..(p + count) * width_q * 8],
                    &epilogue,
                    &mut scores,
                    &mut masks,
                ),
                PanelRef::I8 { q, .. } => (table.i8[rs][ps])(
                    &quantized.values[row0 * width_q..(row0 + size) * width_q],
                    d,
                    &q[p * pairs * 16..(p + count) * pairs * 16],
                    &epilogue,
                    &mut scores,
                    &mut masks,
                ),
            }
            // Row r's scores of the call's items are contiguous in `scores` and in `y`: one copy
            // per row (the last panel's padding lanes are left out).
            let lanes = (n - p * 8).min(count * 8);
            for r in 0..size {
                let dst = (row0 - rows.start + r) * n + p * 8;
                y[dst..dst + lanes].copy_from_slice(&scores[r * count * 8..r * count * 8 + lanes]);
            }
            p += count;
        }
        row0 += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg;
    use crate::packed::{quantize_int8_per_row, to_f16_bits, PanelData};
    use crate::Isa;

    #[test]
    fn linear_matches_f64_and_is_batch_invariant() {
        let (n, d, rows) = (37, 29, 7);
        let mut next = lcg(3);
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let b: Vec<f32> = (0..n).map(|_| next()).collect();
        let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let layer = PackedOutput::from_f32(&w, &b, d);
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            let y = linear(table, &layer, &x);
            for r in 0..rows {
                for o in 0..n {
                    let want: f64 = (0..d)
                        .map(|j| x[r * d + j] as f64 * w[o * d + j] as f64)
                        .sum::<f64>()
                        + b[o] as f64;
                    assert!((y[r * n + o] as f64 - want).abs() < 1e-5, "{isa:?}");
                }
                assert_eq!(
                    linear(table, &layer, &x[r * d..(r + 1) * d]),
                    y[r * n..(r + 1) * n].to_vec()
                );
            }
        }
    }

    #[test]
    fn a_widened_bf16_layer_gives_the_bits_of_its_bf16_layer_on_every_isa() {
        use crate::packed::to_bf16_bits;
        // Odd and even widths (an odd one pads its last pair), a partial last panel, row counts
        // that take every row group, and values spanning magnitudes (sums that round).
        for (n, d, rows) in [(37, 29, 9), (64, 64, 4), (19, 600, 3), (8, 1, 5)] {
            let mut next = lcg(n as u64 * 31 + d as u64);
            let w: Vec<f32> = (0..n * d).map(|i| next() * (1 + i % 7) as f32).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let x: Vec<f32> = (0..rows * d).map(|_| next() * 5.0).collect();
            let bf16 = PackedOutput::from_bf16_bits(&to_bf16_bits(&w), &b, d);
            let wide = bf16.widened_bf16().expect("a bf16 layer widens");
            assert!(PackedOutput::from_f32(&w, &b, d).widened_bf16().is_none());
            assert_eq!(wide.precision(), bf16.precision());
            assert_eq!(wide.weight_bytes(), 2 * bf16.weight_bytes());
            // Widening commutes with packing layers side by side (the transformer's projections).
            let (joined, wide_joined) = (
                PackedOutput::side_by_side(&[&bf16, &bf16]).unwrap(),
                PackedOutput::side_by_side(&[&wide, &wide]).unwrap(),
            );
            match (&joined.widened_bf16().unwrap().data, &wide_joined.data) {
                (PanelData::Bf16Wide(a), PanelData::Bf16Wide(b)) => assert_eq!(a[..], b[..]),
                _ => panic!("widened layers stay widened"),
            }
            // The reference: the portable kernel of the bf16 layout.
            let want = linear(KernelTable::for_isa(Isa::Scalar), &bf16, &x);
            for isa in Isa::available() {
                let table = KernelTable::for_isa(isa);
                for layer in [&bf16, &wide] {
                    let got = linear(table, layer, &x);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?}, n {n}, d {d}, widened {}",
                        std::ptr::eq(layer, &wide)
                    );
                }
                // Split over threads, and a range of outputs (keys/values packed side by side).
                let mut split = vec![0f32; rows * n];
                linear_into_threads(
                    table,
                    wide.view(),
                    &x,
                    &mut split,
                    &mut QuantizedActivations::default(),
                    3,
                    crate::profile::Work::Dense,
                );
                assert_eq!(split, want, "{isa:?} split");
                if n > 8 {
                    let part = wide.view().outputs(8..n);
                    let mut y = vec![0f32; rows * (n - 8)];
                    linear_into(
                        table,
                        part,
                        &x,
                        &mut y,
                        &mut QuantizedActivations::default(),
                    );
                    for r in 0..rows {
                        assert_eq!(
                            y[r * (n - 8)..(r + 1) * (n - 8)],
                            want[r * n + 8..(r + 1) * n]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_dense_layer_split_over_threads_changes_no_bit() {
        // 803 rows x 67 outputs x 96 inputs: 5.2 M multiply-adds, several pieces' worth; the last
        // piece is shorter and not a whole number of row groups.
        let (n, d, rows) = (67, 96, 803);
        let mut next = lcg(11);
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let b: Vec<f32> = (0..n).map(|_| next()).collect();
        let x: Vec<f32> = (0..rows * d).map(|_| next() * 3.0).collect();
        let (q, scales) = quantize_int8_per_row(&w, d);
        let layers = [
            PackedOutput::from_f32(&w, &b, d),
            PackedOutput::from_f16_bits(&to_f16_bits(&w), &b, d),
            PackedOutput::from_i8(&q, &scales, &b, d),
            PackedOutput::from_i8(&q, &scales, &b, d).with_static_activation_scale(0.02),
        ];
        assert!(dense_pieces(rows, n * d, 8) > 2);
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            for layer in &layers {
                let want = linear(table, layer, &x);
                for threads in [2, 3, 8] {
                    let mut got = vec![0f32; rows * n];
                    linear_into_threads(
                        table,
                        layer.view(),
                        &x,
                        &mut got,
                        &mut QuantizedActivations::default(),
                        threads,
                        crate::profile::Work::Dense,
                    );
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {:?} at {threads} threads",
                        layer.precision()
                    );
                }
            }
        }
    }
}
