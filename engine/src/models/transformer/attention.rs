//! Attention per sequence and head on the packed kernels (scores = Q_h K_h^T, then context =
//! P V_h), its heads split over threads when there is work for more than one.

use crate::kernels::packed::{self, QuantizedActivations};
use crate::kernels::{dense, KernelTable};

use super::layers::{dense_panels, Columns};

/// Where attention reads each token's key and value rows (token `r` of the layer's row space,
/// which the sequences' spans index).
#[derive(Clone, Copy)]
pub(super) enum KeyValues<'a> {
    /// The layer's projections of every token: keys and values are columns of them.
    Projected {
        keys: Columns<'a>,
        values: Columns<'a>,
    },
    /// A row table: token `r`'s key row starts at `sources[at[r].source][at[r].key..]` and its
    /// value row at `[at[r].value..]` (SASRec resuming: carried rows lie in the cached state's
    /// runs, new ones in the layer's projections), so no row is copied to gather them.
    Table {
        sources: &'a [&'a [f32]],
        at: &'a [RowAt],
    },
}

/// Where one token's key and value rows start (see [`KeyValues::Table`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RowAt {
    pub(super) source: usize,
    pub(super) key: usize,
    pub(super) value: usize,
}

impl<'a> KeyValues<'a> {
    /// Token `r`'s key row (its first value is the key's first column).
    fn key(&self, r: usize) -> &'a [f32] {
        match *self {
            KeyValues::Projected { keys, .. } => &keys.data[r * keys.stride + keys.offset..],
            KeyValues::Table { sources, at } => &sources[at[r].source][at[r].key..],
        }
    }

    /// Token `r`'s value row.
    fn value(&self, r: usize) -> &'a [f32] {
        match *self {
            KeyValues::Projected { values, .. } => {
                &values.data[r * values.stride + values.offset..]
            }
            KeyValues::Table { sources, at } => &sources[at[r].source][at[r].value..],
        }
    }
}
use super::{Flavor, Transformer};

impl Transformer {
    /// Attention per sequence and head as two small GEMMs on the packed kernels: scores =
    /// Q_h K_h^T (the keys packed as "items"), then context = P V_h (V_h^T packed), into
    /// `context` (`[query rows, hidden]`). The query rows of one sequence are contiguous in
    /// `query_rows` (all its rows, or just the MASK row). The heads are split over up to `threads`
    /// pieces (each with its own buffers in `pieces`) when there is enough work for more than one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        k: &'static KernelTable,
        kv: KeyValues<'_>,
        queries: Columns<'_>,
        spans: &[std::ops::Range<usize>],
        query_rows: &[usize],
        context: &mut Vec<f32>,
        pieces: &mut Vec<AttentionScratch>,
        threads: usize,
    ) {
        let h = self.config.hidden_size;
        let heads = self.config.n_heads;
        let d = h / heads;
        context.resize(query_rows.len() * h, 0.0);
        // Multiply-adds of one head: scores and context over each sequence's keys.
        let head_macs: usize = {
            let mut first = 0;
            spans
                .iter()
                .map(|span| {
                    let q = query_rows[first..]
                        .iter()
                        .take_while(|&&r| span.contains(&r))
                        .count();
                    first += q;
                    2 * q * span.len() * d
                })
                .sum()
        };
        let by_work = heads * head_macs
            / crate::parallel::min_macs_per_piece(dense::MIN_MACS_PER_DENSE_PIECE);
        let n_pieces = threads.min(heads).min(by_work).max(1);
        if pieces.len() < n_pieces {
            pieces.resize_with(n_pieces, AttentionScratch::default);
        }
        let pieces = &mut pieces[..n_pieces];
        let heads_per_piece = heads.div_ceil(n_pieces);
        let run = |i: usize, a: &mut AttentionScratch| {
            crate::profile::account(crate::profile::Work::Attention, || {
                let mine = (i * heads_per_piece).min(heads)..((i + 1) * heads_per_piece).min(heads);
                a.out.resize(mine.len() * query_rows.len() * d, 0.0);
                for (slot, head) in mine.enumerate() {
                    self.attention_head(k, head, kv, queries, spans, query_rows, slot, a);
                }
            })
        };
        crate::parallel::for_each_mut(pieces, run);
        // Each piece's heads into their columns of `context`.
        let rows = query_rows.len();
        for (i, piece) in pieces.iter().enumerate() {
            for (slot, block) in piece.out.chunks_exact((rows * d).max(1)).enumerate() {
                let cols = (i * heads_per_piece + slot) * d;
                for (qi, row) in block.chunks_exact(d).enumerate() {
                    context[qi * h + cols..qi * h + cols + d].copy_from_slice(row);
                }
            }
        }
    }

    /// One head of [`Transformer::attention`] over every sequence, into block `slot` of `a.out`
    /// (`[query rows, head width]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_head(
        &self,
        k: &KernelTable,
        head: usize,
        kv: KeyValues<'_>,
        queries: Columns<'_>,
        spans: &[std::ops::Range<usize>],
        query_rows: &[usize],
        slot: usize,
        a: &mut AttentionScratch,
    ) {
        let h = self.config.hidden_size;
        let d = h / self.config.n_heads;
        let sqrt_d = (d as f32).sqrt();
        let cols = head * d..(head + 1) * d;
        // The kernels read a bias for every lane of a panel; attention has none.
        let longest = spans.iter().map(|s| s.len()).max().unwrap_or(0);
        a.zeros.resize(longest.max(d).div_ceil(8) * 8, 0.0);
        let block = slot * query_rows.len() * d;
        let mut first_query = 0;
        for span in spans {
            let n_queries = query_rows[first_query..]
                .iter()
                .take_while(|&&r| span.contains(&r))
                .count();
            let t = span.len();
            if n_queries == 0 {
                // A sequence none of whose rows this piece answers.
                continue;
            }
            // Keys and values are packed straight from where they lie (no per-head copy).
            let first = span.start;
            packed::pack_rows_into(&mut a.keys, t, cols.clone(), |i| kv.key(first + i));
            let keys_h = dense_panels(&a.keys, t, d, &a.zeros);
            a.q_h.clear();
            for qi in first_query..first_query + n_queries {
                a.q_h.extend_from_slice(queries.row(qi, cols.clone()));
            }
            a.scores.resize(n_queries * t, 0.0);
            dense::linear_into(k, keys_h, &a.q_h, &mut a.scores, &mut a.unused);
            let query_slots = &query_rows[first_query..first_query + n_queries];
            for (row, &query_row) in a.scores.chunks_exact_mut(t).zip(query_slots) {
                // SASRec: a slot sees itself and the slots before it. The later ones weigh exactly
                // 0, as RecBole's -10000 does after its softmax.
                let seen = match self.flavor {
                    Flavor::Bert4Rec => t,
                    Flavor::SasRec => query_row - span.start + 1,
                };
                let (visible, later) = row.split_at_mut(seen);
                for v in visible.iter_mut() {
                    *v /= sqrt_d;
                }
                (k.elementwise.softmax)(visible);
                later.fill(0.0);
            }
            packed::pack_rows_transposed_into(&mut a.values, t, cols.clone(), |j| {
                kv.value(first + j)
            });
            let values_h = dense_panels(&a.values, d, t, &a.zeros);
            let out = &mut a.out[block + first_query * d..block + (first_query + n_queries) * d];
            dense::linear_into(k, values_h, &a.scores, out, &mut a.unused);
            first_query += n_queries;
        }
    }
}

/// One attention piece's packed keys and values of a head, its queries and scores, and the
/// context of each of its heads (`out`, head after head, `[query rows, head width]` each).
#[derive(Debug, Default)]
pub(super) struct AttentionScratch {
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) q_h: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) out: Vec<f32>,
    pub(super) zeros: Vec<f32>,
    /// Attention runs in f32: nothing is quantized here.
    pub(super) unused: QuantizedActivations,
}
