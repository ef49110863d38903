//! HSTU (Zhai et al., ICML 2024) as Meta's generative-recommenders research code runs it in eval
//! mode: the most recent `max_sequence_length` items with their timestamps, each block
//! `x += o(u * LN(attention))` with `[u|v|q|k] = silu(LN(x) uvqk)` and a pointwise SiLU attention
//! biased by position offset and time gap (no softmax, divided by the padded width), the user
//! embedding the last history position's output divided by its L2 norm, and every item scored by
//! the cosine against its normalised embedding (the normalised table is the output layer, made
//! once at conversion).
//!
//! Histories run unpadded and left-aligned (position 0 is the oldest kept item): the official
//! batch pads on the right, and a causal row never reads a later, padded one, so the padding
//! changes nothing. The divisor stays the padded width NA = `max_sequence_length +
//! gr_output_length + 1`, as in the official code, whatever the history's length.
//!
//! Files by job: this one holds the model and its pass over a batch, `checkpoint` the official
//! names, the config's checks and the engine's tensors, `attention` the biased pointwise attention
//! within one history.

mod attention;
mod checkpoint;
mod config;

pub use attention::bucket_rows;
pub use checkpoint::names;
pub(crate) use checkpoint::{engine_shapes, engine_tensors, quantizable, resolve_config};

/// A tensor name only the official HSTU's state dict has: how a checkpoint says it holds one.
pub const KEY_OF_HSTU: &str = "_hstu._attention_layers.0._uvqk";

use super::{ActivationObserver, Carry, DenseLayer, EventTimes, HistoryNote, OutputLayer};
use crate::error::Result;
use crate::kernels::packed::QuantizedActivations;
use crate::kernels::KernelTable;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};
pub use config::HstuConfig;

use attention::{AttentionScratch, HistoryAttention};

#[derive(Clone, Debug)]
struct Block {
    uvqk: DenseLayer,
    output: DenseLayer,
    position_bias: Tensor,
    time_bias: Tensor,
}

/// Every tensor HSTU runs with, by role, for a device that runs the same forward pass
/// ([`Hstu::model_input`] gives a history's kept items, [`bucket_rows`] its time-gap buckets).
#[derive(Clone, Debug)]
pub struct HstuView<'a> {
    pub model: &'a Hstu,
    /// The items' rows as trained, `[N+1, D]` (each scaled by sqrt(D) as it enters).
    pub item_embedding: &'a Matrix,
    /// `[attention_width, D]`, added at each kept position (0 = the oldest kept item).
    pub position_embedding: &'a Tensor,
    pub blocks: Vec<HstuBlockView<'a>>,
}

/// One HSTU block: the `u|v|q|k` projection (SiLU after it), the output projection, and the
/// relative attention bias by position offset (`[2 NA - 1]`) and by time-gap bucket
/// (`[buckets + 1]`).
#[derive(Clone, Copy, Debug)]
pub struct HstuBlockView<'a> {
    pub uvqk: &'a DenseLayer,
    pub output: &'a DenseLayer,
    pub position_bias: &'a Tensor,
    pub time_bias: &'a Tensor,
}

#[derive(Clone, Debug)]
pub struct Hstu {
    config: HstuConfig,
    /// The items' rows as trained (what a history reads), `[N+1, D]`.
    item_embedding: Matrix,
    position_embedding: Tensor,
    blocks: Vec<Block>,
    /// The normalised item rows, no bias: scores are cosines.
    pub output: OutputLayer,
    /// LayerNorm's gamma and beta for a norm without affine parameters (ones and zeros, as wide
    /// as the widest row normalised): `x * 1 + 0` leaves the normalised bits as they are.
    ones: Vec<f32>,
    zeros: Vec<f32>,
    kernels: &'static KernelTable,
}

/// The buffers a pass works in, kept between batches.
#[derive(Debug, Default)]
pub struct HstuScratch {
    /// Stacked rows of every history, `[rows, D]`; a block's output goes to `next`.
    x: Vec<f32>,
    next: Vec<f32>,
    normalised: Vec<f32>,
    uvqk: Vec<f32>,
    /// The last block's projections of some columns or some rows, and those rows' inputs.
    projected: Vec<f32>,
    query_input: Vec<f32>,
    /// Tests: the last block projects every row whole, as where its widths are not whole panels.
    #[cfg(test)]
    whole_last_projection: bool,
    /// The gated attention rows, the output projection's input.
    gated: Vec<f32>,
    /// Per history: how many of its rows a carried state covers (their keys and values are
    /// read from it; only the rows after them are in `x`).
    done: Vec<usize>,
    /// Rows of each history in `x`.
    spans: Vec<std::ops::Range<usize>>,
    /// One history's kept times (`t_0 .. t_{n-1}`, then the query time), while its buckets are
    /// computed.
    times: Vec<i64>,
    /// Per history, the time-gap buckets of its new rows against every key
    /// ([`attention::bucket_rows`]), shared by the blocks; where each history's lie.
    buckets: Vec<u16>,
    bucket_spans: Vec<std::ops::Range<usize>>,
    /// The rows whose output the block computes (every row but in the last block), global and
    /// per history (local indices).
    query_rows: Vec<usize>,
    /// One per piece the heads' attention is split into.
    attention_pieces: Vec<AttentionPiece>,
    quantized: QuantizedActivations,
}

/// What one piece of a block's attention works in: its heads' output rows (`[query rows, its
/// heads x dv]`), the current history's query rows, and the attention's own buffers.
#[derive(Debug, Default)]
struct AttentionPiece {
    out: Vec<f32>,
    queries: Vec<usize>,
    scratch: AttentionScratch,
}

/// Pieces an elementwise step between a block's matrix products (norms, the gate) is split into
/// over `rows` rows `width` wide: as a dense layer would be, counting a row's norm as 16
/// multiply-adds an element (about its time: 0.2 us a row of 256 on a Zen core), so a batch-1
/// history of 100 events and more splits, and short ones stay on the calling thread.
fn elementwise_pieces(rows: usize, width: usize, threads: usize) -> usize {
    let work = rows.saturating_mul(width * 16);
    let floor =
        crate::parallel::min_macs_per_piece(crate::kernels::dense::MIN_MACS_PER_DENSE_PIECE);
    threads.min(work / floor).min(rows).max(1)
}

impl Hstu {
    pub fn from_tensors(config: HstuConfig, t: &Weights) -> Result<Hstu> {
        let d = config.embedding_dim;
        let n = config.n_items;
        let shapes: std::collections::BTreeMap<String, Vec<usize>> =
            engine_shapes(&config).into_iter().collect();
        let dense = |prefix: &str| -> Result<DenseLayer> {
            let weight = format!("{prefix}.weight");
            let bias = format!("{prefix}.bias");
            let shape = &shapes[&weight];
            Ok(DenseLayer::new(
                prefix,
                &t.matrix(&weight, [shape[0], shape[1]])?,
                &t.tensor(&bias, &shapes[&bias])?,
            ))
        };
        let blocks = (0..config.num_blocks)
            .map(|b| {
                Ok(Block {
                    uvqk: dense(&names::uvqk(b))?,
                    output: dense(&names::output(b))?,
                    position_bias: t
                        .tensor(&names::position_bias(b), &shapes[&names::position_bias(b)])?,
                    time_bias: t.tensor(&names::time_bias(b), &shapes[&names::time_bias(b)])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let widest = d.max(config.num_heads * config.dv);
        Ok(Hstu {
            item_embedding: t.matrix(names::INPUT_ROWS, [n + 1, d])?,
            position_embedding: t.tensor(names::POSITIONS, &[config.attention_width, d])?,
            output: OutputLayer {
                weight: t.matrix(names::OUTPUT_ROWS, [n + 1, d])?,
                bias: Tensor::from_vec(vec![n + 1], vec![0.0; n + 1]),
            },
            blocks,
            ones: vec![1.0; widest],
            zeros: vec![0.0; widest],
            config,
            kernels: KernelTable::detect(),
        })
    }

    pub fn config(&self) -> &HstuConfig {
        &self.config
    }

    pub(crate) fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.kernels = kernels;
    }

    pub(crate) fn kernels(&self) -> &'static KernelTable {
        self.kernels
    }

    pub(crate) fn packed_bytes(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.uvqk.packed_bytes() + b.output.packed_bytes())
            .sum()
    }

    /// The dense layers in the order they run.
    pub(crate) fn dense_layers_mut(&mut self) -> Vec<&mut DenseLayer> {
        self.blocks
            .iter_mut()
            .flat_map(|b| [&mut b.uvqk, &mut b.output])
            .collect()
    }

    /// The items' input rows (`[N+1, D]`, as trained).
    pub fn input_rows(&self) -> &Matrix {
        &self.item_embedding
    }

    /// The tensors by role, for a device.
    pub fn view(&self) -> HstuView<'_> {
        HstuView {
            model: self,
            item_embedding: &self.item_embedding,
            position_embedding: &self.position_embedding,
            blocks: self
                .blocks
                .iter()
                .map(|b| HstuBlockView {
                    uvqk: &b.uvqk,
                    output: &b.output,
                    position_bias: &b.position_bias,
                    time_bias: &b.time_bias,
                })
                .collect(),
        }
    }

    /// The items of `history` the model reads (its most recent `max_len`) and what was cut: the
    /// times that go with them are the history's last `kept.len()`.
    pub fn model_input<'h>(&self, history: &'h [u32]) -> (&'h [u32], HistoryNote) {
        super::most_recent(history, self.config.max_len)
    }

    /// LayerNorm without affine parameters over rows `width` wide.
    fn normalise(&self, k: &KernelTable, x: &mut [f32], width: usize) {
        (k.elementwise.layer_norm)(
            x,
            width,
            &self.ones[..width],
            &self.zeros[..width],
            HstuConfig::EPS,
        );
    }

    /// Floats a carried state holds per history row: every block's keys (`heads x dqk`) then
    /// values (`heads x dv`), block after block.
    pub fn carried_floats_per_row(&self) -> usize {
        let c = &self.config;
        self.blocks.len() * c.num_heads * (c.dqk + c.dv)
    }

    /// The user embeddings of `histories` (`[B, D]`, each of unit length) into `hidden`, with a
    /// note per history, working in `scratch`; `times[b]` holds history `b`'s event times (one
    /// per item) and its query time. Dense layers' rows are split over up to `threads` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_into(
        &self,
        k: &'static KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        s: &mut HstuScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        self.pass(
            k, histories, times, s, hidden, notes, threads, observe, None,
        );
    }

    /// [`Hstu::encode_into`] resuming each history from `carry.starts`: how many of its rows a
    /// carried state covers (at most all but the last: the last row's bias reads the query time,
    /// so from the second block on its keys and values change with it), and the state
    /// ([`Hstu::carried_floats_per_row`] floats per row). Each history's new rows but its last go
    /// to `carry.ends` (`(n - 1 - covered) x floats per row` each): its state after the pass is
    /// the carried state followed by them, covering all its rows but the last. The hidden vectors
    /// have the full pass's bits (see [`HistoryAttention::run`]).
    ///
    /// # Panics
    /// When a state covers the last row, or is shorter than the rows it claims to cover.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_carried(
        &self,
        k: &'static KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        s: &mut HstuScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        carry: Carry<'_>,
    ) {
        self.pass(
            k,
            histories,
            times,
            s,
            hidden,
            notes,
            threads,
            &mut |_: &str, _: &[f32]| {},
            Some(carry),
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        k: &'static KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        s: &mut HstuScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observe: ActivationObserver<'_>,
        mut carry: Option<Carry<'_>>,
    ) {
        assert_eq!(
            times.len(),
            histories.len(),
            "HSTU reads a timestamp per event: every history comes with its times"
        );
        let c = &self.config;
        let d = c.embedding_dim;
        let per_row = self.carried_floats_per_row();
        let scale = (d as f32).sqrt();
        notes.clear();
        s.x.clear();
        s.spans.clear();
        s.done.clear();
        s.buckets.clear();
        s.bucket_spans.clear();
        // Each history's carried rows, as slices of its state's runs (a run holds whole rows).
        let mut carried: Vec<Vec<&[f32]>> = Vec::with_capacity(histories.len());
        for (b, (history, when)) in histories.iter().zip(times).enumerate() {
            assert_eq!(
                when.events.len(),
                history.len(),
                "one timestamp per history item"
            );
            let (kept, note) = super::most_recent(history, c.max_len);
            notes.push(note);
            let start = history.len() - kept.len();
            let mut rows: Vec<&[f32]> = Vec::new();
            if let Some((done, state)) = carry.as_ref().and_then(|c| c.starts[b]) {
                assert!(
                    done < kept.len() && state.len() >= done * per_row,
                    "a carried HSTU state covers at most all but the last row of its history"
                );
                for run in state.runs() {
                    rows.extend(run.chunks_exact(per_row).take(done - rows.len()));
                }
            }
            let done = rows.len();
            carried.push(rows);
            let first_row = s.x.len() / d;
            for (p, &id) in kept.iter().enumerate().skip(done) {
                let at = s.x.len();
                s.x.resize(at + d, 0.0);
                let row = &mut s.x[at..];
                self.item_embedding.add_row_into(id as usize, row);
                for (v, pos) in row.iter_mut().zip(self.position_embedding.row(p)) {
                    *v = *v * scale + pos;
                }
            }
            s.spans.push(first_row..s.x.len() / d);
            s.done.push(done);
            s.times.clear();
            s.times.extend_from_slice(&when.events[start..]);
            s.times.push(when.query);
            let first_bucket = s.buckets.len();
            attention::bucket_rows(&s.times, done, c.time_buckets, &mut s.buckets);
            s.bucket_spans.push(first_bucket..s.buckets.len());
        }
        // The ends: each history's new rows but its last, filled block by block.
        if let Some(carry) = carry.as_mut() {
            carry.ends.clear();
            carry.ends_at.clear();
            for span in &s.spans {
                carry.ends_at.push(carry.ends.len());
                let kept_rows = span.len().saturating_sub(1);
                carry
                    .ends
                    .resize(carry.ends.len() + kept_rows * per_row, 0.0);
            }
            carry.ends_at.push(carry.ends.len());
        }

        let n_blocks = self.blocks.len();
        for b in 0..n_blocks {
            // Only the last position's output is the user embedding: the last block computes its
            // attention, gate and projection for that one row per history.
            s.query_rows.clear();
            if b + 1 == n_blocks {
                s.query_rows.extend(s.spans.iter().map(|span| span.end - 1));
            } else {
                s.query_rows.extend(0..s.x.len() / d);
            }
            let ends = carry.as_mut().map(|c| (&mut c.ends[..], &c.ends_at[..]));
            self.block(k, b, s, &carried, ends, threads, observe);
            std::mem::swap(&mut s.x, &mut s.next);
        }

        hidden.clear();
        for row in s.x.chunks_exact(d) {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            let divisor = norm.max(HstuConfig::EPS as f32);
            hidden.extend(row.iter().map(|v| v / divisor));
        }
    }

    /// One block over the new rows in `s.x` (each history's carried rows before them in
    /// `carried`): the output rows `s.query_rows` into `s.next`, and, when `ends` is given (the
    /// carried pass's ends and their offsets), the keys and values of every new row but each
    /// history's last into block `b`'s place in them.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        k: &'static KernelTable,
        b: usize,
        s: &mut HstuScratch,
        carried: &[Vec<&[f32]>],
        ends: Option<(&mut [f32], &[usize])>,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let c = &self.config;
        let d = c.embedding_dim;
        let width = c.uvqk_width();
        let values = c.num_heads * c.dv;
        let block = &self.blocks[b];

        // The rows' norms, split over the pool by rows.
        let rows = s.x.len() / d;
        s.normalised.resize(s.x.len(), 0.0);
        let per_piece = rows.div_ceil(elementwise_pieces(rows, d, threads)).max(1);
        let x = &s.x;
        let mut parts: Vec<&mut [f32]> = s.normalised.chunks_mut(per_piece * d).collect();
        crate::parallel::for_each_mut(&mut parts, |i, part| {
            part.copy_from_slice(&x[i * per_piece * d..][..part.len()]);
            self.normalise(k, part, d);
        });
        let keys = c.num_heads * c.dqk;
        let last_block = b + 1 == self.blocks.len();
        #[cfg(test)]
        let last_block = last_block && !s.whole_last_projection;
        if last_block
            && values.is_multiple_of(8)
            && keys.is_multiple_of(8)
            && s.query_rows.len() < rows
        {
            // The last block reads u and q of its query rows only (one a history), v and k of
            // every row: those two for every row, then the query rows whole (each output with
            // its bits in the whole layer), half the projection's work at a long history.
            observe(block.uvqk.name(), &s.normalised);
            s.uvqk.resize(rows * width, 0.0);
            for columns in [values..2 * values, 2 * values + keys..width] {
                block.uvqk.forward_outputs_into_then(
                    k,
                    columns.clone(),
                    &s.normalised,
                    &mut s.projected,
                    &mut s.quantized,
                    threads,
                    k.elementwise.silu,
                );
                for (row, part) in s
                    .uvqk
                    .chunks_exact_mut(width)
                    .zip(s.projected.chunks_exact(columns.len()))
                {
                    row[columns.clone()].copy_from_slice(part);
                }
            }
            s.query_input.clear();
            for &r in &s.query_rows {
                s.query_input
                    .extend_from_slice(&s.normalised[r * d..(r + 1) * d]);
            }
            block.uvqk.forward_outputs_into_then(
                k,
                0..width,
                &s.query_input,
                &mut s.projected,
                &mut s.quantized,
                threads,
                k.elementwise.silu,
            );
            for (&r, row) in s.query_rows.iter().zip(s.projected.chunks_exact(width)) {
                s.uvqk[r * width..(r + 1) * width].copy_from_slice(row);
            }
        } else {
            block.uvqk.forward_into_then(
                k,
                &s.normalised,
                &mut s.uvqk,
                &mut s.quantized,
                threads,
                observe,
                k.elementwise.silu,
            );
        }

        let at_block = b * (keys + values);
        if let Some((ends, ends_at)) = ends {
            let per_row = self.carried_floats_per_row();
            let k_at = 2 * values + keys;
            for (span, &first) in s.spans.iter().zip(ends_at) {
                for (r, row) in (span.start..span.end.saturating_sub(1)).enumerate() {
                    let to = &mut ends[first + r * per_row + at_block..][..keys + values];
                    let from = &s.uvqk[row * width..(row + 1) * width];
                    to[..keys].copy_from_slice(&from[k_at..k_at + keys]);
                    to[keys..].copy_from_slice(&from[values..2 * values]);
                }
            }
        }

        // The heads split over up to `threads` pieces when their work is worth a handoff (a
        // batch of one long history: a batch of several has its histories split instead).
        let key_reach: usize = s
            .spans
            .iter()
            .zip(&s.done)
            .map(|(span, &covered)| {
                let n = covered + span.len();
                // The last block asks for one row per history, the others for every new row.
                let rows = if b + 1 == self.blocks.len() {
                    1
                } else {
                    span.len()
                };
                rows * n
            })
            .sum();
        let head_macs = key_reach * (c.dqk + c.dv) / 2;
        let by_work = c.num_heads * head_macs
            / crate::parallel::min_macs_per_piece(crate::kernels::dense::MIN_MACS_PER_DENSE_PIECE);
        let n_pieces = threads.min(c.num_heads).min(by_work).max(1);
        if s.attention_pieces.len() < n_pieces {
            s.attention_pieces
                .resize_with(n_pieces, AttentionPiece::default);
        }
        let heads_per_piece = c.num_heads.div_ceil(n_pieces);
        let piece_heads = |i: usize| {
            (i * heads_per_piece).min(c.num_heads)..((i + 1) * heads_per_piece).min(c.num_heads)
        };
        let (spans, bucket_spans, covered, query_rows, uvqk, buckets) = (
            &s.spans,
            &s.bucket_spans,
            &s.done,
            &s.query_rows,
            &s.uvqk,
            &s.buckets,
        );
        let run = |i: usize, piece: &mut AttentionPiece| {
            crate::profile::account(crate::profile::Work::Attention, || {
                let heads = piece_heads(i);
                let piece_width = heads.len() * c.dv;
                piece.out.resize(query_rows.len() * piece_width, 0.0);
                let mut done = 0;
                for ((span, bucket_span), (rows, &covered)) in spans
                    .iter()
                    .zip(bucket_spans)
                    .zip(carried.iter().zip(covered))
                {
                    piece.queries.clear();
                    piece.queries.extend(
                        query_rows[done..]
                            .iter()
                            .take_while(|&&r| r < span.end)
                            .map(|&r| covered + r - span.start),
                    );
                    let count = piece.queries.len();
                    HistoryAttention {
                        carried: rows,
                        carried_at: at_block,
                        uvqk: &uvqk[span.start * width..span.end * width],
                        width,
                        heads: c.num_heads,
                        dqk: c.dqk,
                        dv: c.dv,
                        buckets: &buckets[bucket_span.clone()],
                        position_bias: block.position_bias.as_slice(),
                        time_bias: block.time_bias.as_slice(),
                        attention_width: c.attention_width,
                    }
                    .run(
                        k,
                        &piece.queries,
                        heads.clone(),
                        &mut piece.out[done * piece_width..(done + count) * piece_width],
                        &mut piece.scratch,
                    );
                    done += count;
                }
            })
        };
        let pieces = &mut s.attention_pieces[..n_pieces];
        crate::parallel::for_each_mut(pieces, run);
        // Each piece's heads into their columns of a query row, the row's norm, and u (the row's
        // first `values` columns) as its gate: split over the pool by rows.
        let query_count = s.query_rows.len();
        s.gated.resize(query_count * values, 0.0);
        let per_piece = query_count
            .div_ceil(elementwise_pieces(query_count, values, threads))
            .max(1);
        let (attention, uvqk, query_rows) =
            (&s.attention_pieces[..n_pieces], &s.uvqk, &s.query_rows);
        let mut parts: Vec<&mut [f32]> = s.gated.chunks_mut(per_piece * values).collect();
        crate::parallel::for_each_mut(&mut parts, |p, part| {
            let first = p * per_piece;
            for (q, row) in (first..).zip(part.chunks_exact_mut(values)) {
                for (i, piece) in attention.iter().enumerate() {
                    let heads = piece_heads(i);
                    let piece_width = heads.len() * c.dv;
                    row[heads.start * c.dv..heads.end * c.dv]
                        .copy_from_slice(&piece.out[q * piece_width..(q + 1) * piece_width]);
                }
            }
            self.normalise(k, part, values);
            for (q, row) in (first..).zip(part.chunks_exact_mut(values)) {
                let r = query_rows[q];
                let u = &uvqk[r * width..r * width + values];
                for (g, u) in row.iter_mut().zip(u) {
                    *g *= u;
                }
            }
        });
        block
            .output
            .forward_into(k, &s.gated, &mut s.next, &mut s.quantized, threads, observe);
        for (out, &r) in s.next.chunks_exact_mut(d).zip(&s.query_rows) {
            for (o, x) in out.iter_mut().zip(&s.x[r * d..(r + 1) * d]) {
                *o += x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelKind;
    use crate::engine_dir::Precision;
    use crate::models::Model;

    /// A batch of one long history splits its heads' attention over threads: every bit as on one
    /// thread, for whole histories and for the last block's single query row; and every history
    /// longer than a query chunk reads the keys up to each chunk's last row only, which the
    /// golden and resumed-pass tests hold to the full pass's answers.
    #[test]
    fn attention_heads_split_over_threads_change_no_bit() {
        crate::parallel::split_by_floor_only();
        let tmp = tempfile::tempdir().unwrap();
        let engine = crate::fixtures::convert(
            ModelKind::Hstu,
            "model.safetensors",
            tmp.path(),
            Precision::Fp32,
        )
        .unwrap();
        let Model::Hstu(model) = &engine.model else {
            unreachable!("an HSTU fixture")
        };
        let items = model.config().n_items as u32;
        for len in [1usize, 33, 200, 260] {
            let history: Vec<u32> = (0..len as u32).map(|p| 1 + (p * 7919) % items).collect();
            let events: Vec<i64> = (0..len as i64)
                .map(|p| 1_600_000_000 + 3_571 * p * p)
                .collect();
            let when = [EventTimes {
                events: &events,
                query: events[len - 1] + 60,
            }];
            let run = |threads: usize| {
                embedding_bits(model, &[&history], &when, threads, HstuScratch::default())
            };
            let one = run(1);
            assert!(
                one.iter().any(|&b| b != 0),
                "length {len}: a real embedding"
            );
            assert_eq!(run(2), one, "length {len}: two threads");
            assert_eq!(run(3), one, "length {len}: three threads");
        }
    }

    /// The user embeddings' bits of `histories` encoded on `threads` threads in `scratch`.
    fn embedding_bits(
        model: &Hstu,
        histories: &[&[u32]],
        when: &[EventTimes<'_>],
        threads: usize,
        mut scratch: HstuScratch,
    ) -> Vec<u32> {
        let (mut hidden, mut notes) = (Vec::new(), Vec::new());
        model.encode_into(
            model.kernels(),
            histories,
            when,
            &mut scratch,
            &mut hidden,
            &mut notes,
            threads,
            &mut |_: &str, _: &[f32]| {},
        );
        hidden.iter().map(|v| v.to_bits()).collect()
    }

    /// A model whose head widths are whole panels: the last block projects v and k of every row
    /// and its query rows whole, and the embeddings have the bits of the whole projection's, for
    /// a batch of histories of several lengths (one event among them) on one thread and two.
    #[test]
    fn the_last_blocks_partial_projection_changes_no_bit() {
        crate::parallel::split_by_floor_only();
        let config = HstuConfig {
            n_items: 60,
            max_len: 40,
            embedding_dim: 24,
            num_blocks: 2,
            num_heads: 2,
            dqk: 8,
            dv: 16,
            attention_width: 51,
            time_buckets: 128,
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let f32 = checkpoint::engine_shapes(&config)
            .into_iter()
            .map(|(name, shape)| {
                let values = (0..shape.iter().product()).map(|_| next()).collect();
                (name, Tensor::from_vec(shape, values))
            })
            .collect();
        let weights = Weights {
            f32,
            raw: Default::default(),
        };
        let model = Hstu::from_tensors(config, &weights).unwrap();
        let histories: Vec<Vec<u32>> = [33usize, 1, 40, 7]
            .iter()
            .map(|&len| (0..len as u32).map(|p| 1 + (p * 37) % 60).collect())
            .collect();
        let events: Vec<Vec<i64>> = histories
            .iter()
            .map(|h| {
                (0..h.len() as i64)
                    .map(|p| 1_600_000_000 + 977 * p * p)
                    .collect()
            })
            .collect();
        let when: Vec<EventTimes<'_>> = events
            .iter()
            .map(|e| EventTimes {
                events: e,
                query: e[e.len() - 1] + 60,
            })
            .collect();
        let refs: Vec<&[u32]> = histories.iter().map(|h| h.as_slice()).collect();
        let run = |threads: usize, whole: bool| {
            let scratch = HstuScratch {
                whole_last_projection: whole,
                ..HstuScratch::default()
            };
            embedding_bits(&model, &refs, &when, threads, scratch)
        };
        let whole = run(1, true);
        assert!(whole.iter().any(|&b| b != 0), "real embeddings");
        assert_eq!(run(1, false), whole, "one thread");
        assert_eq!(run(2, false), whole, "two threads");
    }
}
