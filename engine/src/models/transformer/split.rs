//! A transformer layer split by rows over the worker pool: how many pieces each step gets, and
//! the two-step run (projections, then the rest of the layer) that computes every row as one
//! thread would.

use crate::kernels::packed::QuantizedActivations;
use crate::kernels::{dense, KernelTable};

use super::attention::AttentionScratch;
use super::attention::KeyValues;
use super::layers::Columns;
use super::{Transformer, TransformerLayer, TransformerScratch};

impl Transformer {
    /// Pieces each step of a layer over `tokens` rows with `queries` query rows is split into on
    /// `threads` threads ([`Transformer::transformer_layer_split`]): the projections to keys, values
    /// and queries, then the rest of the layer. A step gets one piece per thread while each
    /// piece has at least [`dense::MIN_MACS_PER_DENSE_PIECE`] multiply-adds and 8 rows.
    pub(super) fn row_pieces(
        &self,
        tokens: usize,
        queries: usize,
        threads: usize,
    ) -> (usize, usize) {
        if threads <= 1 {
            return (1, 1);
        }
        let (h, inner) = (self.config.hidden_size, self.config.inner_size);
        let d_head = h / self.config.n_heads;
        let pieces = |macs: usize, rows: usize| {
            threads
                .min(macs / crate::parallel::min_macs_per_piece(dense::MIN_MACS_PER_DENSE_PIECE))
                .min(rows / 8)
                .max(1)
        };
        let projections = (2 * tokens + queries) * h * h;
        // Attention: each query row against its sequence's keys (at most all tokens), twice.
        let rest = queries * (2 * h * h + 2 * h * inner)
            + 2 * queries * tokens.min(self.config.max_len) * d_head;
        (pieces(projections, tokens), pieces(rest, queries))
    }

    /// [`Transformer::transformer_layer`] split by rows into `pieces` running on the worker pool, in
    /// two steps: every piece projects its share of the tokens to keys and values (and its share
    /// of the query rows to queries); then, once all keys and values exist, every piece runs the
    /// rest of the layer (attention over the whole sequence, the output projection, the
    /// feed-forward, both norms) for its query rows. Every row is computed by the same kernels in
    /// the same order as on one thread, so the split changes no bit. Dense layers' inputs are not
    /// shown to an observer here: calibration runs on one thread.
    pub(super) fn transformer_layer_split(
        &self,
        k: &'static KernelTable,
        layer: &TransformerLayer,
        s: &mut TransformerScratch,
        (projection_pieces, rest_pieces): (usize, usize),
    ) {
        let h = self.config.hidden_size;
        let tokens = s.x.len() / h;
        let n_queries = s.query_rows.len();
        let every_row = n_queries == tokens;
        if !every_row {
            s.x_q.clear();
            for &r in &s.query_rows {
                s.x_q.extend_from_slice(&s.x[r * h..(r + 1) * h]);
            }
        }
        let p = &layer.projections;
        let w = p.width;
        // Keys, values and queries in one layer when every row is a query and their input is
        // quantized alike; otherwise keys and values for every row, queries for the query rows.
        let all = p.all(k).filter(|_| every_row);
        let projected_width = if all.is_some() { 3 * w } else { 2 * w };
        s.projected.resize(tokens * projected_width, 0.0);
        s.queries
            .resize(if all.is_some() { 0 } else { n_queries * w }, 0.0);
        s.out.resize(n_queries * h, 0.0);
        let pieces = projection_pieces.max(rest_pieces);
        if s.row_pieces.len() < pieces {
            s.row_pieces.resize_with(pieces, RowPiece::default);
        }
        let token_ranges = even_ranges(tokens, projection_pieces);
        let projected_queries = even_ranges(n_queries, projection_pieces);
        let query_ranges = even_ranges(n_queries, rest_pieces);
        let x = &s.x[..];
        let x_q: &[f32] = if every_row { x } else { &s.x_q };

        // Step 1: keys, values and queries, by rows.
        {
            let mut parts: Vec<ProjectionPiece<'_>> = Vec::new();
            let (mut projected, mut queries) = (&mut s.projected[..], &mut s.queries[..]);
            for ((t, q), piece) in token_ranges
                .iter()
                .zip(&projected_queries)
                .zip(s.row_pieces.iter_mut())
            {
                let (token_rows, rest) =
                    std::mem::take(&mut projected).split_at_mut(t.len() * projected_width);
                let query_len = if all.is_some() { 0 } else { q.len() * w };
                let (query_rows, rest_q) = std::mem::take(&mut queries).split_at_mut(query_len);
                (projected, queries) = (rest, rest_q);
                parts.push((token_rows, query_rows, piece));
            }
            crate::parallel::for_each_mut(&mut parts, |i, (token_rows, query_rows, piece)| {
                let (t, q) = (&token_ranges[i], &projected_queries[i]);
                let x_rows = &x[t.start * h..t.end * h];
                match &all {
                    Some(all) => all.rows_into(k, x_rows, token_rows, &mut piece.quantized),
                    None => {
                        let kv = p.keys_values(k);
                        kv.rows_into(k, x_rows, token_rows, &mut piece.quantized);
                        let xq_rows = &x_q[q.start * h..q.end * h];
                        let queries = p.queries(k);
                        queries.rows_into(k, xq_rows, query_rows, &mut piece.quantized);
                    }
                }
            });
        }

        // Step 2: the rest of the layer, by query rows.
        let at = |offset| Columns {
            data: &s.projected,
            stride: projected_width,
            offset,
        };
        let (keys, values) = (at(0), at(w));
        let queries = match all {
            Some(_) => at(2 * w),
            None => Columns {
                data: &s.queries,
                stride: w,
                offset: 0,
            },
        };
        let (spans, all_query_rows) = (&s.spans[..], &s.query_rows[..]);
        let mut parts: Vec<(&mut [f32], &mut RowPiece)> = Vec::new();
        let mut out = &mut s.out[..];
        for (q, piece) in query_ranges.iter().zip(s.row_pieces.iter_mut()) {
            let (rows, rest) = std::mem::take(&mut out).split_at_mut(q.len() * h);
            out = rest;
            parts.push((rows, piece));
        }
        crate::parallel::for_each_mut(&mut parts, |i, (out, piece)| {
            let q = query_ranges[i].clone();
            let p = &mut **piece;
            self.attention(
                k,
                KeyValues::Projected { keys, values },
                queries.rows(q.clone()),
                spans,
                &all_query_rows[q.clone()],
                &mut p.context,
                &mut p.attention,
                1,
            );
            self.finish_rows(
                k,
                layer,
                &p.context,
                &x_q[q.start * h..q.end * h],
                out,
                &mut p.attended,
                &mut p.inner,
                &mut p.quantized,
                &mut |_, _| {},
            );
        });
    }
}

/// The buffers of one row piece of [`Transformer::transformer_layer_split`]: its query rows'
/// context, attention output and feed-forward activations.
#[derive(Debug, Default)]
pub(super) struct RowPiece {
    pub(super) context: Vec<f32>,
    pub(super) attended: Vec<f32>,
    pub(super) inner: Vec<f32>,
    pub(super) quantized: QuantizedActivations,
    pub(super) attention: Vec<AttentionScratch>,
}

/// One piece of a layer's projections: its token rows of the projections, its query rows'
/// queries (when computed apart), and its buffers.
type ProjectionPiece<'a> = (&'a mut [f32], &'a mut [f32], &'a mut RowPiece);

/// `0..n` in `pieces` contiguous ranges whose lengths differ by at most one.
fn even_ranges(n: usize, pieces: usize) -> Vec<std::ops::Range<usize>> {
    (0..pieces)
        .map(|i| n * i / pieces..n * (i + 1) / pieces)
        .collect()
}
