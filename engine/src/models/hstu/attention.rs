//! HSTU's pointwise attention within one history: `silu(q_i . k_j + rab(i, j)) / NA` for
//! `j <= i`, no softmax, where the relative bias `rab` adds a learned weight per position offset
//! and one per log-spaced time gap between the event after `i` and event `j`.

use crate::kernels::attention::{AttentionOut, PointwiseAttention};
use crate::kernels::packed;
use crate::kernels::KernelTable;

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

/// The buffers one history's attention works in, kept between calls.
#[derive(Debug, Default)]
pub(super) struct AttentionScratch {
    /// The relative bias of every (query row, key row) pair, `[queries, n]`, shared by the heads.
    bias: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    /// The kernel's weights of one tile of query rows.
    weights: Vec<f32>,
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
    /// (`[queries.len(), heads.len() x dv]`): per head, the keys and values of the whole history
    /// packed once, then the table's fused attention kernel ([`KernelTable::attention`]) with the
    /// bias of every (query, key) pair, computed once for all the heads. A row's products and their
    /// order do not depend on where its keys and values lie or on the other query rows, so a
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
        for (slot, h) in heads.enumerate() {
            let key_cols = h * self.dqk..(h + 1) * self.dqk;
            packed::pack_rows_into(&mut s.keys, n, key_cols.clone(), |j| self.keys(j));
            let value_cols = h * self.dv..(h + 1) * self.dv;
            packed::pack_rows_transposed_into(&mut s.values, n, value_cols, |j| self.values(j));
            s.queries.clear();
            for &i in queries {
                debug_assert!(i >= done, "a carried row is never a query row");
                let start = (i - done) * self.width + q_at;
                s.queries
                    .extend_from_slice(&self.uvqk[start..][key_cols.clone()]);
            }
            let attention = PointwiseAttention {
                queries: &s.queries,
                query_stride: self.dqk,
                rows: queries,
                keys: &s.keys,
                values: &s.values,
                bias: &s.bias,
                bias_stride: n,
                n,
                dqk: self.dqk,
                dv: self.dv,
                divisor: self.attention_width as f32,
            };
            let mut head_out = AttentionOut {
                values: &mut out[slot * self.dv..],
                stride: width,
            };
            (k.attention)(&attention, &mut head_out, &mut s.weights);
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
