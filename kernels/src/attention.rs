//! HSTU's pointwise attention for one head of one history, fused: `silu(q_i . k_j + bias_ij)`
//! weighted over the values `v_j` for `j <= i`, no softmax, over the constant NA.
//!
//! Tiles of up to 4 query rows: the scores of a tile against the keys up to its last row (4 rows x
//! 16 keys per register block, the keys packed as the dense kernels' panels), then the bias, SiLU
//! and causal mask over that small tile while it is in L1, then the weights times the values (the
//! values packed once per head, transposed into panels of 8 value columns). Against two dense
//! calls per 32 query rows (the scores of the whole chunk, the weights written out, the values
//! packed again for each chunk), the tile reaches at most 3 keys past its rows, touches nothing
//! outside L1, and packs the values once. The official code divides each weight by NA; here each
//! output is divided instead (`dv` divisions a row rather than one per key: with the SiLU's own,
//! the divisions were most of the attention's elementwise time), the same value up to rounding.
//!
//! Each output is one sequence of operations whatever tile its row falls in and however far that
//! tile reaches, so cached and uncached passes, and any split of the rows, agree bit for bit: a
//! score is the multiply-adds over the features in order from zero (fused on the SIMD tables,
//! rounded twice on the portable one, as each table's dense kernels do), plus the bias, then the
//! SiLU; an output is the multiply-adds over the keys in order from zero, plus 0, over NA. Keys
//! past a row weigh exactly 0 and add nothing (tested against the dense kernels composed the same
//! way on every table).

/// One head's attention over one history, as [`crate::KernelTable::attention`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct PointwiseAttention<'a> {
    /// The query rows' vectors, `dqk` floats each, `query_stride` apart.
    pub queries: &'a [f32],
    pub query_stride: usize,
    /// Each query's position in the history: it attends to keys `0..=row`. Ascending, below `n`.
    pub rows: &'a [usize],
    /// The history's keys packed as items ([`crate::packed::pack_rows_into`]): panels of 8 keys,
    /// `[n / 8 rounded up][dqk][8]`, zeros past `n`.
    pub keys: &'a [f32],
    /// The history's values packed transposed ([`crate::packed::pack_rows_transposed_into`] with
    /// `d = n`): panels of 8 value columns, `[dv / 8 rounded up][n][8]`, zeros past `dv`.
    pub values: &'a [f32],
    /// Query `q`'s bias against key `j <= rows[q]` at `q * bias_stride + j`.
    pub bias: &'a [f32],
    pub bias_stride: usize,
    pub n: usize,
    pub dqk: usize,
    pub dv: usize,
    /// NA, which every weight is divided by after its SiLU.
    pub divisor: f32,
}

/// Where the attention's outputs go: query `q`'s `dv` values at `q * stride`.
#[derive(Debug)]
pub struct AttentionOut<'a> {
    pub values: &'a mut [f32],
    pub stride: usize,
}

/// The signature of every table's attention kernel: the attention, its outputs, and a scratch
/// buffer for the weights of a tile (kept between calls). Each kernel applies its own table's SiLU.
pub type AttentionKernel = fn(&PointwiseAttention<'_>, &mut AttentionOut<'_>, &mut Vec<f32>);

/// Eight f32 lanes as the ISA a kernel is compiled for holds them. Every method is `unsafe`: the
/// SIMD implementations need their CPU features, and pointers must have 8 readable or writable
/// floats.
pub(crate) trait Lanes: Copy {
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// `a * b + acc`, rounded as the table's dense kernels round it.
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn div(a: Self, b: Self) -> Self;
    unsafe fn store(self, p: *mut f32);
}

/// The portable lanes: a product and a sum each rounded, as the scalar dense kernels do.
#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; 8]);

impl Lanes for Portable {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats at `p`.
        Portable(unsafe { p.cast::<[f32; 8]>().read_unaligned() })
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; 8])
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
        Portable(std::array::from_fn(|l| acc.0[l] + a.0[l] * b.0[l]))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] + b.0[l]))
    }
    #[inline(always)]
    unsafe fn div(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] / b.0[l]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats at `p`.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(self.0) }
    }
}

/// The portable kernel (the scalar table's).
pub(crate) fn portable(a: &PointwiseAttention<'_>, out: &mut AttentionOut<'_>, w: &mut Vec<f32>) {
    // SAFETY: the portable lanes need no CPU feature.
    unsafe { run::<Portable>(a, out, w, crate::portable::silu_inplace) }
}

/// Query rows per tile: 4 rows x 2 panels of keys (or of value columns) are 8 accumulators, what
/// covers the multiply-add latency on two ports with AVX2's 16 registers.
const TILE_ROWS: usize = 4;

/// The whole attention, tile by tile (4 rows, then 2 and 1 for the rest).
///
/// # Safety
/// `L`'s CPU features must be present. Bounds are asserted here.
#[inline(always)]
pub(crate) unsafe fn run<L: Lanes>(
    a: &PointwiseAttention<'_>,
    out: &mut AttentionOut<'_>,
    weights: &mut Vec<f32>,
    silu: fn(&mut [f32]),
) {
    let rows = a.rows.len();
    if rows == 0 {
        return;
    }
    let last = a.rows[rows - 1];
    assert!(
        a.rows.windows(2).all(|w| w[0] < w[1]) && last < a.n,
        "query rows ascend and lie in the history"
    );
    assert!(a.dqk > 0 && a.dv > 0 && a.query_stride >= a.dqk && out.stride >= a.dv);
    assert!(a.queries.len() >= (rows - 1) * a.query_stride + a.dqk);
    assert!(a.keys.len() >= a.n.div_ceil(8) * a.dqk * 8);
    assert!(a.values.len() >= a.dv.div_ceil(8) * a.n * 8);
    assert!(a.bias_stride > last && a.bias.len() > (rows - 1) * a.bias_stride + last);
    assert!(out.values.len() >= (rows - 1) * out.stride + a.dv);
    let mut q = 0;
    while q < rows {
        let left = rows - q;
        // SAFETY: `L`'s features are present (this function's contract); every access of a tile
        // of queries q.. lies within the bounds asserted above.
        q += unsafe {
            if left >= TILE_ROWS {
                tile::<L, TILE_ROWS>(a, q, out, weights, silu)
            } else if left >= 2 {
                tile::<L, 2>(a, q, out, weights, silu)
            } else {
                tile::<L, 1>(a, q, out, weights, silu)
            }
        };
    }
}

/// Queries `first..first + R` (at most `rows.len()`): their weights into `weights` (`[R][reach
/// rounded up to 16]`), then their outputs. Returns `R`.
///
/// # Safety
/// As for [`run`], whose assertions bound every access here.
#[inline(always)]
unsafe fn tile<L: Lanes, const R: usize>(
    a: &PointwiseAttention<'_>,
    first: usize,
    out: &mut AttentionOut<'_>,
    weights: &mut Vec<f32>,
    silu: fn(&mut [f32]),
) -> usize {
    let rows: [usize; R] = std::array::from_fn(|r| a.rows[first + r]);
    let reach = rows[R - 1] + 1;
    let key_panels = reach.div_ceil(8);
    let stride = key_panels.next_multiple_of(2) * 8;
    weights.resize(R * stride, 0.0);
    // The scores, 2 panels of 8 keys at a time (1 for an odd last panel), each row's into its
    // `stride` slots.
    for p in (0..key_panels).step_by(2) {
        // SAFETY: queries first..first + R exist, panels p and p + 1 (when < key_panels) lie
        // below n / 8 rounded up, and a row's slots reach (p + 2) * 8 <= stride.
        unsafe {
            if p + 1 < key_panels {
                scores::<L, R, 2>(a, first, p, weights, stride);
            } else {
                scores::<L, R, 1>(a, first, p, weights, stride);
            }
        }
    }
    // Bias and SiLU over each row's keys up to its own position (to a whole vector, so the SiLU
    // has no scalar tail; the keys past the row are then set to 0).
    for (r, (row, &i)) in weights.chunks_exact_mut(stride).zip(&rows).enumerate() {
        let bias = &a.bias[(first + r) * a.bias_stride..][..=i];
        for (x, b) in row.iter_mut().zip(bias) {
            *x += b;
        }
        let end = (i + 1).next_multiple_of(8);
        silu(&mut row[..end]);
        row[i + 1..].fill(0.0);
    }
    // The weights times the values, 2 panels of 8 value columns at a time.
    let value_panels = a.dv.div_ceil(8);
    for c in (0..value_panels).step_by(2) {
        // SAFETY: value panels c and c + 1 (when < value_panels) lie below dv / 8 rounded up,
        // keys below reach <= n, each row's weights below stride, outputs queries first.. + R.
        unsafe {
            if c + 1 < value_panels {
                weighted_values::<L, R, 2>(a, first, c, reach, weights, stride, out);
            } else {
                weighted_values::<L, R, 1>(a, first, c, reach, weights, stride, out);
            }
        }
    }
    R
}

/// The register block both products share: `R` rows of `depth` values (`row_stride` apart) times
/// `P` panels of `depth` runs of 8 (`panel_stride` apart), each sum the multiply-adds in order
/// from zero.
///
/// # Safety
/// `L`'s features; `rows` has `R` rows of `depth` readable floats and `panels` `P` panels of
/// `depth x 8`, at those strides.
#[inline(always)]
unsafe fn block<L: Lanes, const R: usize, const P: usize>(
    rows: *const f32,
    row_stride: usize,
    panels: *const f32,
    panel_stride: usize,
    depth: usize,
) -> [[L; P]; R] {
    // SAFETY: the function's contract: `L`'s features are present.
    let mut acc = [[unsafe { L::zero() }; P]; R];
    for t in 0..depth {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: row r's value t and panel k's run t lie within the contract's bounds.
            unsafe {
                let h = L::splat(*rows.add(r * row_stride + t));
                for (k, acc) in acc_r.iter_mut().enumerate() {
                    *acc = L::mul_add(h, L::load(panels.add(k * panel_stride + t * 8)), *acc);
                }
            }
        }
    }
    acc
}

/// The scores of queries `first..first + R` against the `8 P` keys from panel `p` into
/// their rows of `weights` (`stride` apart) at `8 p`.
///
/// # Safety
/// `L`'s features; queries `first..first + R` and key panels `p..p + P` exist; `weights` holds
/// `R` rows of `stride >= 8 (p + P)`.
#[inline(always)]
unsafe fn scores<L: Lanes, const R: usize, const P: usize>(
    a: &PointwiseAttention<'_>,
    first: usize,
    p: usize,
    weights: &mut [f32],
    stride: usize,
) {
    let queries = a.queries[first * a.query_stride..].as_ptr();
    let keys = a.keys[p * a.dqk * 8..].as_ptr();
    let w = weights.as_mut_ptr();
    // SAFETY: queries first.. + R have dqk floats each, query_stride apart; panels p.. + P of
    // the keys have dqk runs of 8 each (contract).
    let acc = unsafe { block::<L, R, P>(queries, a.query_stride, keys, a.dqk * 8, a.dqk) };
    for (r, acc_r) in acc.iter().enumerate() {
        for (k, acc) in acc_r.iter().enumerate() {
            // SAFETY: row r's slots 8 (p + k) .. + 8 lie within its stride (contract).
            unsafe { acc.store(w.add(r * stride + (p + k) * 8)) };
        }
    }
}

/// Outputs of queries `first..first + R` for the `8 P` value columns from panel `c`: their
/// weights (rows of `weights`, `stride` apart) times the values of keys `0..reach`, plus 0 (a
/// sum of only zeros is then +0 whichever keys past the row a tile reached), over the divisor.
///
/// # Safety
/// `L`'s features; value panels `c..c + P` exist; `reach <= n` and `reach <= stride`; queries
/// `first..first + R` have outputs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_values<L: Lanes, const R: usize, const P: usize>(
    a: &PointwiseAttention<'_>,
    first: usize,
    c: usize,
    reach: usize,
    weights: &[f32],
    stride: usize,
    out: &mut AttentionOut<'_>,
) {
    let values = a.values[c * a.n * 8..].as_ptr();
    // SAFETY: the R rows of weights have reach <= stride floats each, stride apart; panels c..
    // + P of the values have reach <= n runs of 8 each (contract).
    let acc = unsafe { block::<L, R, P>(weights.as_ptr(), stride, values, a.n * 8, reach) };
    // SAFETY: the function's contract: `L`'s features are present.
    let (zero, divisor) = unsafe { (L::zero(), L::splat(a.divisor)) };
    for (r, acc_r) in acc.iter().enumerate() {
        let row = &mut out.values[(first + r) * out.stride..][..a.dv];
        for (k, acc) in acc_r.iter().enumerate() {
            let column = (c + k) * 8;
            let lanes = (a.dv - column).min(8);
            let mut lane_values = [0f32; 8];
            // SAFETY: `L`'s features; the 8 floats written are `lane_values`.
            unsafe { L::div(L::add(*acc, zero), divisor).store(lane_values.as_mut_ptr()) };
            row[column..column + lanes].copy_from_slice(&lane_values[..lanes]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::{self, LayerRef, PanelRef, QuantizedActivations};
    use crate::{dense, Isa, KernelTable};

    /// Uniform values in [-1, 1) from a fixed seed.
    fn values(count: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..count)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// One history's inputs: rows of `q|k|v` and a bias per (query, key) pair.
    struct Case {
        n: usize,
        dqk: usize,
        dv: usize,
        rows: Vec<usize>,
        qkv: Vec<f32>,
        bias: Vec<f32>,
        divisor: f32,
    }

    impl Case {
        fn new(n: usize, dqk: usize, dv: usize, rows: Vec<usize>, seed: u64) -> Case {
            let width = 2 * dqk + dv;
            // Scores large enough that the SiLU's negative branch and its cut-off are reached.
            let qkv = values(n * width, seed).iter().map(|v| v * 1.7).collect();
            let bias = values(rows.len() * n, seed + 1)
                .iter()
                .map(|v| v * 3.0)
                .collect();
            Case {
                n,
                dqk,
                dv,
                rows,
                qkv,
                bias,
                divisor: 211.0,
            }
        }
        fn width(&self) -> usize {
            2 * self.dqk + self.dv
        }
        fn row(&self, j: usize) -> &[f32] {
            &self.qkv[j * self.width()..(j + 1) * self.width()]
        }

        /// The fused kernel of `table`.
        fn fused(&self, table: &KernelTable) -> Vec<f32> {
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            let (dqk, dv) = (self.dqk, self.dv);
            packed::pack_rows_into(&mut keys, self.n, dqk..2 * dqk, |j| self.row(j));
            packed::pack_rows_transposed_into(&mut values, self.n, 2 * dqk..2 * dqk + dv, |j| {
                self.row(j)
            });
            let queries: Vec<f32> = self
                .rows
                .iter()
                .flat_map(|&i| self.row(i)[..dqk].to_vec())
                .collect();
            // Outputs at a stride wider than dv, as a head's columns among several.
            let stride = dv + 3;
            let mut out = vec![f32::NAN; self.rows.len() * stride];
            let attention = PointwiseAttention {
                queries: &queries,
                query_stride: dqk,
                rows: &self.rows,
                keys: &keys,
                values: &values,
                bias: &self.bias,
                bias_stride: self.n,
                n: self.n,
                dqk,
                dv,
                divisor: self.divisor,
            };
            let mut scratch = Vec::new();
            (table.attention)(
                &attention,
                &mut AttentionOut {
                    values: &mut out,
                    stride,
                },
                &mut scratch,
            );
            out.chunks_exact(stride)
                .flat_map(|row| row[..dv].to_vec())
                .collect()
        }

        /// The unfused path on `table`'s dense kernels, one query row at a time: the scores as a
        /// dense layer of the row's keys, bias and SiLU, then the weights times the values as a
        /// dense layer of the values' columns over those keys, over the divisor.
        fn unfused(&self, table: &KernelTable) -> Vec<f32> {
            let (dqk, dv) = (self.dqk, self.dv);
            let zeros = vec![0f32; (self.n.max(dv) + 8).next_multiple_of(8)];
            let mut unused = QuantizedActivations::default();
            // `n` items of width `d` packed in `panels`, with a zero bias.
            fn layer<'a>(panels: &'a [f32], n: usize, d: usize, zeros: &'a [f32]) -> LayerRef<'a> {
                LayerRef {
                    n,
                    d,
                    data: PanelRef::F32(panels),
                    bias: &zeros[..n.div_ceil(8) * 8],
                    activation_scale: None,
                }
            }
            let mut out = Vec::new();
            for (q, &i) in self.rows.iter().enumerate() {
                let reach = i + 1;
                let mut keys = Vec::new();
                packed::pack_rows_into(&mut keys, reach, dqk..2 * dqk, |j| self.row(j));
                let keys = layer(&keys, reach, dqk, &zeros);
                let mut weights = vec![0f32; reach];
                dense::linear_into(table, keys, &self.row(i)[..dqk], &mut weights, &mut unused);
                for (w, b) in weights.iter_mut().zip(&self.bias[q * self.n..]) {
                    *w += b;
                }
                (table.elementwise.silu)(&mut weights);
                let mut values = Vec::new();
                packed::pack_rows_transposed_into(&mut values, reach, 2 * dqk..2 * dqk + dv, |j| {
                    self.row(j)
                });
                let values = layer(&values, dv, reach, &zeros);
                let mut row = vec![0f32; dv];
                dense::linear_into(table, values, &weights, &mut row, &mut unused);
                out.extend(row.iter().map(|v| v / self.divisor));
            }
            out
        }

        /// The attention in f64 from its formula, SiLU included, with each output's sum of the
        /// magnitudes of its terms (what the f32 rounding scales with).
        fn reference(&self) -> Vec<(f64, f64)> {
            let (dqk, dv) = (self.dqk, self.dv);
            let mut out = Vec::new();
            for (q, &i) in self.rows.iter().enumerate() {
                let mut row = vec![(0f64, 0f64); dv];
                for j in 0..=i {
                    let terms =
                        (0..dqk).map(|d| self.row(i)[d] as f64 * self.row(j)[dqk + d] as f64);
                    let bias = self.bias[q * self.n + j] as f64;
                    let score = terms.clone().sum::<f64>() + bias;
                    // How far the score's own rounding can move the weight (SiLU's slope is
                    // below 1.1).
                    let score_scale = (terms.map(f64::abs).sum::<f64>() + bias.abs()) * 1.1;
                    let divisor = self.divisor as f64;
                    let weight = score / (1.0 + (-score).exp()) / divisor;
                    for (o, v) in row.iter_mut().zip(&self.row(j)[2 * dqk..]) {
                        let v = *v as f64;
                        o.0 += weight * v;
                        o.1 += (weight * v).abs() + score_scale / divisor * v.abs();
                    }
                }
                out.extend(row);
            }
            out
        }
    }

    /// Histories and query sets the engine produces: every row, one row (the last block, a
    /// session's new event), a sparse resumed set; widths of HSTU's configs (25 and 32) and
    /// narrower ones, so tiles of 4, 2 and 1 rows and odd key and value panels all occur.
    fn cases() -> Vec<Case> {
        let mut out = Vec::new();
        let mut seed = 7;
        for &(n, dqk, dv) in &[
            (1, 8, 8),
            (5, 25, 25),
            (9, 32, 32),
            (40, 25, 25),
            (70, 32, 32),
            (33, 4, 12),
            (200, 32, 32),
        ] {
            for rows in [
                (0..n).collect::<Vec<_>>(),
                vec![n - 1],
                (n / 2..n).step_by(3).collect(),
            ] {
                seed += 2;
                out.push(Case::new(n, dqk, dv, rows, seed));
            }
        }
        out
    }

    /// Every table's fused kernel gives the bits of its own dense kernels composed as the engine
    /// composed them before the fusion.
    #[test]
    fn fused_attention_has_the_unfused_bits_on_every_table() {
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            for case in cases() {
                let (fused, unfused) = (case.fused(table), case.unfused(table));
                assert_eq!(fused.len(), unfused.len());
                for (k, (f, u)) in fused.iter().zip(&unfused).enumerate() {
                    assert_eq!(
                        f.to_bits(),
                        u.to_bits(),
                        "{} n {} dqk {} dv {} rows {:?}: output {k}: {f} against {u}",
                        isa.name(),
                        case.n,
                        case.dqk,
                        case.dv,
                        case.rows
                    );
                }
            }
        }
    }

    /// Within f32 rounding of the formula in f64, relative to the magnitudes the rounding scales
    /// with (outputs and scores may cancel): the terms' and the scores' sums of magnitudes, for
    /// the SiLU's approximation (2e-7 relative), the scores' rounding over up to 32 features and
    /// the sums' over up to 200 keys.
    const F64_TOLERANCE: f64 = 2e-6;

    #[test]
    fn fused_attention_matches_the_formula_in_f64() {
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            for case in cases() {
                let got = case.fused(table);
                for (k, (got, (want, scale))) in got.iter().zip(case.reference()).enumerate() {
                    assert!(
                        (*got as f64 - want).abs() <= F64_TOLERANCE * scale,
                        "{} n {} rows {:?}: output {k}: {got} against {want}",
                        isa.name(),
                        case.n,
                        case.rows
                    );
                }
            }
        }
    }
}
