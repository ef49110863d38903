//! HSTU's pointwise attention within one history: `silu(q_i . k_j + rab(i, j)) / NA` for
//! `j <= i`, no softmax, where the relative bias `rab` adds a learned weight per position offset
//! and one per log-spaced time gap between the event after `i` and event `j`.

use crate::kernels::packed::{self, LayerRef, PanelRef, QuantizedActivations};
use crate::kernels::{dense, KernelTable};

/// The time-gap bucket of `dt` seconds: `trunc(ln(max(|dt|, 1)) / 0.301)` clamped to
/// `0..=buckets`, in f32 as the official code computes it (`torch.log` of the int64 gaps gives
/// f32, and the divisor is an f32). Out-of-order events are bucketed by `|dt|`.
pub(super) fn time_bucket(dt: i64, buckets: usize) -> usize {
    let gap = dt.unsigned_abs().max(1) as f32;
    let bucket = (gap.ln() / 0.301f32).trunc();
    // ln of at most 2^64 over 0.301 is below 148: the cast is exact.
    (bucket.max(0.0) as usize).min(buckets)
}

/// The time-gap bucket of every (row, key) pair of one history for the rows `first..n` (each
/// against keys `0..=row`; later keys get 0, never read), appended to `out` as `[n - first, n]`: row
/// `i`'s gaps are `t_{i+1} - t_j`. The same in every block, so a pass computes it once per
/// history rather than once per block (a logarithm per pair).
pub fn bucket_rows(times: &[i64], first: usize, buckets: usize, out: &mut Vec<u16>) {
    let n = times.len() - 1;
    let start = out.len();
    out.resize(start + (n - first) * n, 0);
    for (i, row) in (first..n).zip(out[start..].chunks_exact_mut(n.max(1))) {
        let next = times[i + 1];
        for (j, b) in row[..=i].iter_mut().enumerate() {
            *b = time_bucket(next - times[j], buckets) as u16;
        }
    }
}

/// One history's attention in one block, for the query rows `queries` (each `i` attends to
/// `0..=i`), into `out` (`[queries.len(), heads x dv]`). The history's first rows may be carried
/// (their keys and values kept from an earlier call by the prefix cache); the rest are new.
pub(super) struct HistoryAttention<'a> {
    /// The carried rows, oldest first: each a whole carried row (every block's keys and values),
    /// this block's keys at `carried_at` and its values right after them.
    pub carried: &'a [&'a [f32]],
    pub carried_at: usize,
    /// The new rows' `u|v|q|k` after the SiLU, `[n - carried, width]`: every query row is new.
    pub uvqk: &'a [f32],
    pub width: usize,
    pub heads: usize,
    pub dqk: usize,
    pub dv: usize,
    /// The time-gap bucket of each new row against every key ([`bucket_rows`], `[n - carried,
    /// n]`): row `i`'s at `(i - carried) * n`.
    pub buckets: &'a [u16],
    /// The block's relative position weights, `[2 NA - 1]` (offset `j - i` at `NA - 1 + j - i`).
    pub position_bias: &'a [f32],
    /// The block's time-gap weights, `[buckets + 1]`.
    pub time_bias: &'a [f32],
    /// NA, the constant the official batch's padded width divides every weight by.
    pub attention_width: usize,
}

/// Query rows one pass of a head's two GEMMs takes: each chunk reads the keys up to its own last
/// row, so a history's attention costs about the causal triangle (plus half a chunk per row)
/// rather than the whole square, for a repacking of that prefix's values per chunk.
const QUERY_CHUNK: usize = 32;

/// The buffers one history's attention works in, kept between calls.
#[derive(Debug, Default)]
pub(super) struct AttentionScratch {
    /// The relative bias of every (query row, key row) pair, `[queries, n]`, shared by the heads.
    bias: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    weights: Vec<f32>,
    head_out: Vec<f32>,
    zeros: Vec<f32>,
    /// Attention runs in f32: nothing is quantized here.
    unused: QuantizedActivations,
}

/// `n` items of width `d` packed in `panels` (f32, no bias), as the dense kernels take them.
fn panels<'a>(panels: &'a [f32], n: usize, d: usize, zeros: &'a [f32]) -> LayerRef<'a> {
    LayerRef {
        n,
        d,
        data: PanelRef::F32(panels),
        bias: &zeros[..n.div_ceil(8) * 8],
        activation_scale: None,
    }
}

impl HistoryAttention<'_> {
    /// Column offsets of `u`, `v`, `q` and `k` within a new row.
    fn offsets(&self) -> (usize, usize, usize) {
        let values = self.heads * self.dv;
        let keys = self.heads * self.dqk;
        (values, 2 * values, 2 * values + keys)
    }

    /// Row `j`'s keys of every head (`heads x dqk`), carried or new.
    fn keys(&self, j: usize) -> &[f32] {
        let keys = self.heads * self.dqk;
        match self.carried.get(j) {
            Some(row) => &row[self.carried_at..self.carried_at + keys],
            None => {
                let (_, _, k_at) = self.offsets();
                let start = (j - self.carried.len()) * self.width + k_at;
                &self.uvqk[start..start + keys]
            }
        }
    }

    /// Row `j`'s values of every head (`heads x dv`), carried or new.
    fn values(&self, j: usize) -> &[f32] {
        let values = self.heads * self.dv;
        match self.carried.get(j) {
            Some(row) => {
                let at = self.carried_at + self.heads * self.dqk;
                &row[at..at + values]
            }
            None => {
                let (v_at, _, _) = self.offsets();
                let start = (j - self.carried.len()) * self.width + v_at;
                &self.uvqk[start..start + values]
            }
        }
    }

    /// Attention outputs of rows `queries` (ascending, all new) for the heads `heads` into `out`
    /// (`[queries.len(), heads.len() x dv]`): per head and per chunk of [`QUERY_CHUNK`] query rows
    /// two small GEMMs on the packed kernels, `Q_h K_h^T` over the keys up to the chunk's last row
    /// (the keys packed as items) and then the weights times `V_h` over the same keys (`V_h^T`
    /// packed), with the bias, SiLU and divisor applied to the scores between. A row's products
    /// and their order do not depend on where its keys and values lie, on the other query rows or
    /// on how far its chunk reaches (the weights past the row are zeros, which add nothing), so a
    /// resumed pass has the full pass's bits.
    pub(super) fn run(
        &self,
        k: &KernelTable,
        queries: &[usize],
        heads: std::ops::Range<usize>,
        out: &mut [f32],
        s: &mut AttentionScratch,
    ) {
        let (_, q_at, _) = self.offsets();
        let done = self.carried.len();
        let n = done + self.uvqk.len() / self.width;
        let width = heads.len() * self.dv;
        let divisor = self.attention_width as f32;
        let na = self.attention_width;
        // The bias of each query row against every earlier row (later ones are never read).
        s.bias.clear();
        s.bias.resize(queries.len() * n, 0.0);
        for (bias, &i) in s.bias.chunks_exact_mut(n).zip(queries) {
            let buckets = &self.buckets[(i - done) * n..][..=i];
            let positions = &self.position_bias[na - 1 - i..][..=i];
            for ((b, &bucket), &position) in bias.iter_mut().zip(buckets).zip(positions) {
                *b = position + self.time_bias[usize::from(bucket)];
            }
        }
        s.zeros.resize(n.max(self.dv).div_ceil(8) * 8, 0.0);
        for (slot, h) in heads.enumerate() {
            let key_cols = h * self.dqk..(h + 1) * self.dqk;
            packed::pack_rows_into(&mut s.keys, n, key_cols.clone(), |j| self.keys(j));
            let value_cols = h * self.dv..(h + 1) * self.dv;
            for (c, chunk) in queries.chunks(QUERY_CHUNK).enumerate() {
                // The keys this chunk reads: a causal row attends to none after itself.
                let reach = chunk.last().map_or(0, |&last| last + 1);
                s.queries.clear();
                for &i in chunk {
                    debug_assert!(i >= done, "a carried row is never a query row");
                    let start = (i - done) * self.width + q_at;
                    s.queries
                        .extend_from_slice(&self.uvqk[start..][key_cols.clone()]);
                }
                // The first `reach` keys are the packing's first panels.
                let keys = panels(
                    &s.keys[..reach.div_ceil(8) * 8 * self.dqk],
                    reach,
                    self.dqk,
                    &s.zeros,
                );
                s.weights.resize(chunk.len() * reach, 0.0);
                let weights = &mut s.weights[..chunk.len() * reach];
                dense::linear_into(k, keys, &s.queries, weights, &mut s.unused);
                let biases = s.bias[c * QUERY_CHUNK * n..].chunks_exact(n);
                for ((weights, bias), &i) in weights.chunks_exact_mut(reach).zip(biases).zip(chunk)
                {
                    // Keys past the row are computed too, up to a whole vector (their bias is 0
                    // and they are zeroed after), so the SiLU runs without a scalar tail per row.
                    let end = (i + 1).next_multiple_of(8).min(reach);
                    let row = &mut weights[..end];
                    for (w, b) in row.iter_mut().zip(bias) {
                        *w += b;
                    }
                    (k.elementwise.silu)(row);
                    // The official code divides after the SiLU.
                    for w in row.iter_mut() {
                        *w /= divisor;
                    }
                    weights[i + 1..].fill(0.0);
                }
                packed::pack_rows_transposed_into(&mut s.values, reach, value_cols.clone(), |j| {
                    self.values(j)
                });
                let values = panels(&s.values, self.dv, reach, &s.zeros);
                s.head_out.resize(chunk.len() * self.dv, 0.0);
                let head_out = &mut s.head_out[..chunk.len() * self.dv];
                dense::linear_into(k, values, weights, head_out, &mut s.unused);
                let rows = out[c * QUERY_CHUNK * width..].chunks_exact_mut(width);
                for (o, head) in rows.zip(head_out.chunks_exact(self.dv)) {
                    o[slot * self.dv..(slot + 1) * self.dv].copy_from_slice(head);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buckets against the formula in f64 at the edges: 0 and 1 second share bucket 0,
    /// `|dt|` is used for negative gaps, and the largest gaps clamp to the last bucket.
    #[test]
    fn time_buckets_follow_the_log_formula_and_clamp() {
        for dt in [0i64, 1, -1] {
            assert_eq!(time_bucket(dt, 128), 0, "{dt}");
        }
        for dt in [2i64, 3, 60, 3_600, 86_400, 2_592_000, 31_536_000] {
            let want = ((dt as f64).ln() / 0.301).trunc() as usize;
            assert_eq!(time_bucket(dt, 128), want, "{dt}");
            assert_eq!(time_bucket(-dt, 128), want, "{dt}");
        }
        assert_eq!(time_bucket(i64::MAX, 128), 128);
        assert_eq!(time_bucket(i64::MIN, 128), 128);
        assert_eq!(time_bucket(1 << 40, 20), 20);
    }
}
