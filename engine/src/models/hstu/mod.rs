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

pub(crate) use checkpoint::{engine_shapes, engine_tensors, names, quantizable, resolve_config};

/// A tensor name only the official HSTU's state dict has: how a checkpoint says it holds one.
pub const KEY_OF_HSTU: &str = "_hstu._attention_layers.0._uvqk";

use super::{ActivationObserver, DenseLayer, EventTimes, HistoryNote, OutputLayer};
use crate::config::HstuConfig;
use crate::error::Result;
use crate::kernels::packed::QuantizedActivations;
use crate::kernels::KernelTable;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

use attention::{silu, AttentionScratch, HistoryAttention};

#[derive(Clone, Debug)]
struct Block {
    uvqk: DenseLayer,
    output: DenseLayer,
    position_bias: Tensor,
    time_bias: Tensor,
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
    attention: Vec<f32>,
    gated: Vec<f32>,
    /// Rows of each history in `x`, and its times (`t_0 .. t_{n-1}`, then the query time).
    spans: Vec<std::ops::Range<usize>>,
    times: Vec<i64>,
    time_spans: Vec<std::ops::Range<usize>>,
    /// The rows whose output the block computes (every row but in the last block), global and
    /// per history (local indices).
    query_rows: Vec<usize>,
    local_queries: Vec<usize>,
    attention_scratch: AttentionScratch,
    quantized: QuantizedActivations,
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
        assert_eq!(
            times.len(),
            histories.len(),
            "HSTU reads a timestamp per event: every history comes with its times"
        );
        let c = &self.config;
        let d = c.embedding_dim;
        let scale = (d as f32).sqrt();
        notes.clear();
        s.x.clear();
        s.spans.clear();
        s.times.clear();
        s.time_spans.clear();
        for (history, when) in histories.iter().zip(times) {
            assert_eq!(
                when.events.len(),
                history.len(),
                "one timestamp per history item"
            );
            let (kept, note) = super::most_recent(history, c.max_len);
            notes.push(note);
            let start = history.len() - kept.len();
            let first_row = s.x.len() / d;
            for (p, &id) in kept.iter().enumerate() {
                let at = s.x.len();
                s.x.resize(at + d, 0.0);
                let row = &mut s.x[at..];
                self.item_embedding.add_row_into(id as usize, row);
                for (v, pos) in row.iter_mut().zip(self.position_embedding.row(p)) {
                    *v = *v * scale + pos;
                }
            }
            s.spans.push(first_row..s.x.len() / d);
            let first_time = s.times.len();
            s.times.extend_from_slice(&when.events[start..]);
            s.times.push(when.query);
            s.time_spans.push(first_time..s.times.len());
        }

        let n_blocks = self.blocks.len();
        for (b, block) in self.blocks.iter().enumerate() {
            // Only the last position's output is the user embedding: the last block computes its
            // attention, gate and projection for that one row per history.
            s.query_rows.clear();
            if b + 1 == n_blocks {
                s.query_rows.extend(s.spans.iter().map(|span| span.end - 1));
            } else {
                s.query_rows.extend(0..s.x.len() / d);
            }
            self.block(k, block, s, threads, observe);
            std::mem::swap(&mut s.x, &mut s.next);
        }

        hidden.clear();
        for row in s.x.chunks_exact(d) {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            let divisor = norm.max(HstuConfig::EPS as f32);
            hidden.extend(row.iter().map(|v| v / divisor));
        }
    }

    /// One block over the rows of `s.x`: the output rows `s.query_rows` into `s.next`.
    fn block(
        &self,
        k: &'static KernelTable,
        block: &Block,
        s: &mut HstuScratch,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let c = &self.config;
        let d = c.embedding_dim;
        let width = c.uvqk_width();
        let values = c.num_heads * c.dv;

        s.normalised.clear();
        s.normalised.extend_from_slice(&s.x);
        self.normalise(k, &mut s.normalised, d);
        block.uvqk.forward_into(
            k,
            &s.normalised,
            &mut s.uvqk,
            &mut s.quantized,
            threads,
            observe,
        );
        s.uvqk.iter_mut().for_each(|v| *v = silu(*v));

        s.attention.clear();
        s.attention.resize(s.query_rows.len() * values, 0.0);
        let mut done = 0;
        for (span, time_span) in s.spans.iter().zip(&s.time_spans) {
            s.local_queries.clear();
            s.local_queries.extend(
                s.query_rows[done..]
                    .iter()
                    .take_while(|&&r| r < span.end)
                    .map(|&r| r - span.start),
            );
            let count = s.local_queries.len();
            HistoryAttention {
                uvqk: &s.uvqk[span.start * width..span.end * width],
                width,
                heads: c.num_heads,
                dqk: c.dqk,
                dv: c.dv,
                times: &s.times[time_span.clone()],
                position_bias: block.position_bias.as_slice(),
                time_bias: block.time_bias.as_slice(),
                attention_width: c.attention_width,
            }
            .run(
                k,
                &s.local_queries,
                &mut s.attention[done * values..(done + count) * values],
                &mut s.attention_scratch,
            );
            done += count;
        }
        self.normalise(k, &mut s.attention, values);
        // u, the first `values` columns of each query row, gates the normalised attention.
        s.gated.clear();
        for (q, &r) in s.query_rows.iter().enumerate() {
            let u = &s.uvqk[r * width..r * width + values];
            let a = &s.attention[q * values..(q + 1) * values];
            s.gated.extend(u.iter().zip(a).map(|(u, a)| u * a));
        }
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
