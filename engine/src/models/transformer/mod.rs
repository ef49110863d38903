//! The transformer recommenders as RecBole 1.2.1 runs them in eval mode: BERT4Rec and SASRec,
//! which share their post-LN layers.
//!
//! BERT4Rec: the request's last L-1 items get a [MASK] appended, every slot attends to every slot,
//! and the answer is the MASK slot's output after a head (dense, GELU, LayerNorm), scored against
//! the item embedding plus an output bias. SASRec: the last L items, each slot attends to itself
//! and the slots before it (causal), and the answer is the last slot's output, scored against the
//! item embedding with no bias.
//!
//! Sequences are run unpadded: RecBole's padded keys get -10000 before the softmax, which is
//! exactly 0 after it, so leaving them out changes nothing (SASRec's histories are left-aligned,
//! so its causal mask never reaches a padded slot either). Tokens of all histories in a batch are
//! stacked for the dense layers; attention stays within each history. Only the answer slot's
//! output is used, so the last layer computes queries, attention and the feed-forward for that
//! one row per history.

//!
//! Files by job: this one holds the model (its layers as loaded, the pass over a batch, the
//! scratch buffers), `layers` the layer primitives (dense layers, LayerNorm, the fused key/value/
//! query projections), `attention` the per-sequence, per-head attention on the packed kernels,
//! `split` how a layer's rows are split over threads without changing a bit, and `carry` SASRec's
//! pass resuming from carried keys and values (the prefix cache's).

mod attention;
mod carry;
mod layers;
mod split;

pub use carry::CarriedScratch;

use super::{ActivationObserver, DenseLayer, HistoryNote, OutputLayer, Tiles, Widened};
use crate::config::{ModelKind, TransformerConfig};
use crate::error::Result;
use crate::import::Checkpoint;
use crate::kernels::packed::QuantizedActivations;
use crate::kernels::KernelTable;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

use attention::{AttentionScratch, KeyValues};
use layers::{project, Columns, Dense, LayerNorm, Projections};
use split::RowPiece;

#[derive(Clone, Debug)]
struct TransformerLayer {
    query: Dense,
    key: Dense,
    value: Dense,
    /// `key`, `value` and `query` as one layer, which is what runs on the CPU.
    projections: Projections,
    attn_out: Dense,
    attn_ln: LayerNorm,
    ffn_in: Dense,
    ffn_out: Dense,
    ffn_ln: LayerNorm,
}

/// Which of RecBole's transformer recommenders a [`Transformer`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// Bidirectional attention over the history and a trailing [MASK]; an output head and bias.
    Bert4Rec,
    /// Causal attention over the history; the last slot's output is the answer.
    SasRec,
}

impl Flavor {
    pub fn of(kind: ModelKind) -> Flavor {
        match kind {
            ModelKind::Sasrec => Flavor::SasRec,
            _ => Flavor::Bert4Rec,
        }
    }

    /// Items kept from a history: BERT4Rec's last slot is its MASK.
    fn items_kept(self, max_len: usize) -> usize {
        match self {
            Flavor::Bert4Rec => max_len - 1,
            Flavor::SasRec => max_len,
        }
    }

    /// Rows of the item embedding beside the N items: PAD, and BERT4Rec's MASK.
    fn extra_embedding_rows(self) -> usize {
        match self {
            Flavor::Bert4Rec => 2,
            Flavor::SasRec => 1,
        }
    }
}

/// BERT4Rec's output head: `LayerNorm(gelu(dense(h)))`.
#[derive(Clone, Debug)]
struct Head {
    dense: Dense,
    norm: LayerNorm,
}

#[derive(Clone, Debug)]
pub struct Transformer {
    flavor: Flavor,
    config: TransformerConfig,
    item_embedding: Matrix,
    position_embedding: Tensor,
    embedding_ln: LayerNorm,
    layers: Vec<TransformerLayer>,
    /// BERT4Rec only.
    head: Option<Head>,
    /// Tied to `item_embedding` rows 0..=N (BERT4Rec's MASK row has no output); SASRec's bias is
    /// zero.
    pub output: OutputLayer,
    kernels: &'static KernelTable,
}

/// The 2-D weights a reduced precision applies to: the item embedding (and so the tied output
/// layer) and every dense layer. The position embedding, biases and norms stay fp32.
pub(super) fn quantizable(flavor: Flavor, c: &TransformerConfig) -> Vec<String> {
    tensor_shapes(flavor, c)
        .into_iter()
        .filter(|(name, shape)| shape.len() == 2 && name != "position_embedding.weight")
        .map(|(name, _)| name)
        .collect()
}

/// The state-dict names, with their shapes, that the model reads.
fn tensor_shapes(flavor: Flavor, c: &TransformerConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, n) = (c.hidden_size, c.inner_size, c.n_items);
    let mut shapes = vec![
        (
            "item_embedding.weight".to_string(),
            vec![n + flavor.extra_embedding_rows(), h],
        ),
        ("position_embedding.weight".into(), vec![c.max_len, h]),
        ("LayerNorm.weight".into(), vec![h]),
        ("LayerNorm.bias".into(), vec![h]),
    ];
    if flavor == Flavor::Bert4Rec {
        shapes.extend([
            ("output_bias".to_string(), vec![n + 1]),
            ("output_ffn.weight".into(), vec![h, h]),
            ("output_ffn.bias".into(), vec![h]),
            ("output_ln.weight".into(), vec![h]),
            ("output_ln.bias".into(), vec![h]),
        ]);
    }
    for l in 0..c.n_layers {
        let p = format!("trm_encoder.layer.{l}");
        for m in ["query", "key", "value", "dense"] {
            shapes.push((format!("{p}.multi_head_attention.{m}.weight"), vec![h, h]));
            shapes.push((format!("{p}.multi_head_attention.{m}.bias"), vec![h]));
        }
        for ln in ["multi_head_attention.LayerNorm", "feed_forward.LayerNorm"] {
            shapes.push((format!("{p}.{ln}.weight"), vec![h]));
            shapes.push((format!("{p}.{ln}.bias"), vec![h]));
        }
        shapes.push((format!("{p}.feed_forward.dense_1.weight"), vec![i, h]));
        shapes.push((format!("{p}.feed_forward.dense_1.bias"), vec![i]));
        shapes.push((format!("{p}.feed_forward.dense_2.weight"), vec![h, i]));
        shapes.push((format!("{p}.feed_forward.dense_2.bias"), vec![h]));
    }
    shapes
}

/// The engine tensors are the state-dict tensors under their own names.
pub(super) fn engine_tensors(
    flavor: Flavor,
    c: &TransformerConfig,
    ckpt: &Checkpoint,
) -> Result<Vec<(String, Tensor)>> {
    tensor_shapes(flavor, c)
        .into_iter()
        .map(|(name, shape)| {
            let t = ckpt.tensor_f32(&name, &shape)?;
            Ok((name, t))
        })
        .collect()
}

impl Transformer {
    pub fn from_tensors(
        flavor: Flavor,
        config: TransformerConfig,
        t: &Weights,
    ) -> Result<Transformer> {
        let (h, i, n) = (config.hidden_size, config.inner_size, config.n_items);
        let mut layers = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            let p = format!("trm_encoder.layer.{l}");
            let query = Dense::load(t, &format!("{p}.multi_head_attention.query"), h, h)?;
            let key = Dense::load(t, &format!("{p}.multi_head_attention.key"), h, h)?;
            let value = Dense::load(t, &format!("{p}.multi_head_attention.value"), h, h)?;
            layers.push(TransformerLayer {
                projections: Projections::new(&key.0, &value.0, &query.0)?,
                query,
                key,
                value,
                attn_out: Dense::load(t, &format!("{p}.multi_head_attention.dense"), h, h)?,
                attn_ln: LayerNorm::load(t, &format!("{p}.multi_head_attention.LayerNorm"), h)?,
                ffn_in: Dense::load(t, &format!("{p}.feed_forward.dense_1"), i, h)?,
                ffn_out: Dense::load(t, &format!("{p}.feed_forward.dense_2"), h, i)?,
                ffn_ln: LayerNorm::load(t, &format!("{p}.feed_forward.LayerNorm"), h)?,
            });
        }
        let item_embedding = t.matrix(
            "item_embedding.weight",
            [n + flavor.extra_embedding_rows(), h],
        )?;
        let (head, bias) = match flavor {
            Flavor::Bert4Rec => (
                Some(Head {
                    dense: Dense::load(t, "output_ffn", h, h)?,
                    norm: LayerNorm::load(t, "output_ln", h)?,
                }),
                t.tensor("output_bias", &[n + 1])?,
            ),
            Flavor::SasRec => (None, Tensor::from_vec(vec![n + 1], vec![0.0; n + 1])),
        };
        let output = OutputLayer {
            weight: item_embedding.slice_rows(0, n + 1),
            bias,
        };
        Ok(Transformer {
            flavor,
            position_embedding: t.tensor("position_embedding.weight", &[config.max_len, h])?,
            embedding_ln: LayerNorm::load(t, "LayerNorm", h)?,
            head,
            item_embedding,
            layers,
            output,
            config,
            kernels: KernelTable::detect(),
        })
    }

    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    pub(crate) fn packed_bytes(&self) -> usize {
        let layer = |l: &TransformerLayer| {
            [
                &l.query,
                &l.key,
                &l.value,
                &l.attn_out,
                &l.ffn_in,
                &l.ffn_out,
            ]
            .iter()
            .map(|d| d.0.packed_bytes())
            .sum::<usize>()
                + l.projections.packed_bytes()
        };
        self.layers.iter().map(layer).sum::<usize>()
            + self
                .head
                .as_ref()
                .map_or(0, |head| head.dense.0.packed_bytes())
    }

    pub fn flavor(&self) -> Flavor {
        self.flavor
    }

    pub(crate) fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.kernels = kernels;
    }

    /// The kernels the model runs when a call names none.
    pub(crate) fn kernels(&self) -> &'static KernelTable {
        self.kernels
    }

    /// The layers by role, for a device that runs the whole model.
    pub fn view(&self) -> super::TransformerView<'_> {
        fn norm(n: &LayerNorm) -> super::NormView<'_> {
            super::NormView {
                gamma: &n.gamma,
                beta: &n.beta,
            }
        }
        super::TransformerView {
            model: self,
            causal: self.flavor == Flavor::SasRec,
            item_embedding: &self.item_embedding,
            position_embedding: &self.position_embedding,
            embedding_norm: norm(&self.embedding_ln),
            layers: self
                .layers
                .iter()
                .map(|l| super::TransformerLayerView {
                    query: &l.query.0,
                    key: &l.key.0,
                    value: &l.value.0,
                    attn_out: &l.attn_out.0,
                    attn_norm: norm(&l.attn_ln),
                    ffn_in: &l.ffn_in.0,
                    ffn_out: &l.ffn_out.0,
                    ffn_norm: norm(&l.ffn_ln),
                })
                .collect(),
            head: self.head.as_ref().map(|head| super::HeadView {
                dense: &head.dense.0,
                norm: norm(&head.norm),
            }),
        }
    }

    fn mask_index(&self) -> u32 {
        self.config.n_items as u32 + 1
    }

    /// The model input for one history: BERT4Rec's last L-1 items, then [MASK]; SASRec's last L
    /// items (an empty history, which has no answer and which serving refuses, runs as one PAD
    /// slot so that the pass still has a row to give).
    pub fn model_input(&self, history: &[u32]) -> (Vec<u32>, HistoryNote) {
        let (kept, note) = self.kept_history(history);
        let mut tokens = kept.to_vec();
        match self.flavor {
            Flavor::Bert4Rec => tokens.push(self.mask_index()),
            Flavor::SasRec if tokens.is_empty() => tokens.push(0),
            Flavor::SasRec => {}
        }
        (tokens, note)
    }

    /// The part of `history` the model sees (BERT4Rec's last L-1 items, which [MASK] follows;
    /// SASRec's last L).
    fn kept_history<'h>(&self, history: &'h [u32]) -> (&'h [u32], HistoryNote) {
        super::most_recent(history, self.flavor.items_kept(self.config.max_len))
    }

    /// The dense layers in the order they run.
    pub(crate) fn dense_layers_mut(&mut self) -> Vec<&mut DenseLayer> {
        let mut out = Vec::new();
        for layer in &mut self.layers {
            for dense in [
                &mut layer.query,
                &mut layer.key,
                &mut layer.value,
                &mut layer.attn_out,
                &mut layer.ffn_in,
                &mut layer.ffn_out,
            ] {
                out.push(&mut dense.0);
            }
        }
        if let Some(head) = &mut self.head {
            out.push(&mut head.dense.0);
        }
        out
    }

    /// Packs each layer's projections again from its key, value and query layers: after their
    /// static activation scales change.
    pub(crate) fn repack_projections(&mut self) -> Result<()> {
        for l in &mut self.layers {
            l.projections = Projections::new(&l.key.0, &l.value.0, &l.query.0)?;
        }
        Ok(())
    }

    /// The hidden vectors of `histories` into `hidden` and `notes` (replacing what they held), working
    /// in `scratch`, the dense layers' rows and the attention heads split over up to `threads`
    /// threads: once the buffers have grown to a batch's size, batches no larger allocate nothing
    /// (on one thread). On kernels `k` (the call's table; every table of one precision gives the
    /// same bits).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_into(
        &self,
        k: &'static KernelTable,
        histories: &[&[u32]],
        scratch: &mut TransformerScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let h = self.config.hidden_size;
        let eps = self.config.layer_norm_eps;
        notes.clear();
        let s = scratch;
        // Token ranges of each sequence in the stacked matrix.
        s.spans.clear();
        s.x.clear();
        for history in histories {
            let (kept, note) = self.kept_history(history);
            notes.push(note);
            let start = s.x.len() / h;
            let last = match self.flavor {
                Flavor::Bert4Rec => Some(self.mask_index()),
                Flavor::SasRec if kept.is_empty() => Some(0),
                Flavor::SasRec => None,
            };
            let tokens = kept.iter().copied().chain(last);
            for (slot, id) in tokens.enumerate() {
                let start = s.x.len();
                s.x.extend_from_slice(self.position_embedding.row(slot));
                self.item_embedding
                    .add_row_into(id as usize, &mut s.x[start..]);
            }
            s.spans.push(start..s.x.len() / h);
        }
        self.embedding_ln.apply(k, &mut s.x, eps);

        let n_layers = self.layers.len();
        for (l, layer) in self.layers.iter().enumerate() {
            // Only the answer slot's output is used, so the last layer computes its query,
            // attention output and feed-forward for that one row per sequence.
            s.query_rows.clear();
            if l + 1 == n_layers {
                s.query_rows.extend(s.spans.iter().map(|span| span.end - 1));
            } else {
                s.query_rows.extend(0..s.x.len() / h);
            }
            self.transformer_layer(k, layer, s, threads, observe);
            std::mem::swap(&mut s.x, &mut s.out);
        }
        debug_assert_eq!(
            s.x.len(),
            histories.len() * h,
            "one row per sequence after the last layer"
        );

        match &self.head {
            Some(head) => {
                head.dense
                    .0
                    .forward_into(k, &s.x, hidden, &mut s.quantized, threads, observe);
                (k.elementwise.gelu)(hidden);
                head.norm.apply(k, hidden, eps);
            }
            None => {
                hidden.clear();
                hidden.extend_from_slice(&s.x);
            }
        }
        // Give `x` and `out` back their roles, so the next batch finds each grown to the size its
        // role needs whatever the number of layers.
        if !n_layers.is_multiple_of(2) {
            std::mem::swap(&mut s.x, &mut s.out);
        }
    }

    /// One post-LN transformer layer over `s.x`, the rows `s.query_rows` of its output into
    /// `s.out`.
    fn transformer_layer(
        &self,
        k: &'static KernelTable,
        layer: &TransformerLayer,
        s: &mut TransformerScratch,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let h = self.config.hidden_size;
        let pieces = self.row_pieces(s.x.len() / h, s.query_rows.len(), threads);
        if pieces != (1, 1) {
            return self.transformer_layer_split(k, layer, s, pieces);
        }

        // Every row is a query except in the last layer; only then are the query rows gathered.
        let every_row = s.query_rows.len() * h == s.x.len();
        if !every_row {
            s.x_q.clear();
            for &r in &s.query_rows {
                s.x_q.extend_from_slice(&s.x[r * h..(r + 1) * h]);
            }
        }
        let x_q: &[f32] = if every_row { &s.x } else { &s.x_q };
        observe(layer.key.0.name(), &s.x);
        observe(layer.value.0.name(), &s.x);
        observe(layer.query.0.name(), x_q);
        let p = &layer.projections;
        let w = p.width;
        let (keys, values, queries) = match p.all(k).filter(|_| every_row) {
            Some(all) => {
                project(k, &all, &s.x, &mut s.projected, &mut s.quantized, threads);
                let at = |offset| Columns {
                    data: &s.projected,
                    stride: 3 * w,
                    offset,
                };
                (at(0), at(w), at(2 * w))
            }
            None => {
                let kv = p.keys_values(k);
                project(k, &kv, &s.x, &mut s.projected, &mut s.quantized, threads);
                project(
                    k,
                    &p.queries(k),
                    x_q,
                    &mut s.queries,
                    &mut s.quantized,
                    threads,
                );
                let at = |offset| Columns {
                    data: &s.projected,
                    stride: 2 * w,
                    offset,
                };
                let queries = Columns {
                    data: &s.queries,
                    stride: w,
                    offset: 0,
                };
                (at(0), at(w), queries)
            }
        };

        self.attention(
            k,
            KeyValues::Projected { keys, values },
            queries,
            &s.spans,
            &s.query_rows,
            &mut s.context,
            &mut s.attention,
            threads,
        );

        s.out.resize(s.query_rows.len() * h, 0.0);
        self.finish_rows(
            k,
            layer,
            &s.context,
            x_q,
            &mut s.out,
            &mut s.attended,
            &mut s.inner,
            &mut s.quantized,
            observe,
        );
    }

    /// The rest of a transformer layer after attention, for a run of query rows: the output
    /// projection plus `residual`, its norm, the feed-forward with GELU, its residual and norm,
    /// into `out` (`[rows, hidden]`). It runs block by block of [`FINISH_BLOCK_ROWS`] rows, so
    /// that each block's feed-forward activations are made, passed through GELU and read back
    /// while they sit in cache (`[rows, inner]` of a whole batch does not fit in it); every row
    /// is computed by the same kernels as in one call, so blocking changes no bit.
    #[allow(clippy::too_many_arguments)]
    fn finish_rows(
        &self,
        k: &KernelTable,
        layer: &TransformerLayer,
        context: &[f32],
        residual: &[f32],
        out: &mut [f32],
        attended: &mut Vec<f32>,
        inner: &mut Vec<f32>,
        quantized: &mut QuantizedActivations,
        observe: ActivationObserver<'_>,
    ) {
        let (h, width) = (self.config.hidden_size, self.config.inner_size);
        let eps = self.config.layer_norm_eps;
        let block = FINISH_BLOCK_ROWS * h;
        for ((context, residual), out) in context
            .chunks(block)
            .zip(residual.chunks(block))
            .zip(out.chunks_mut(block))
        {
            let rows = context.len() / h;
            attended.resize(rows * h, 0.0);
            observe(layer.attn_out.0.name(), context);
            layer
                .attn_out
                .0
                .forward_rows(k, context, attended, quantized);
            for (a, r) in attended.iter_mut().zip(residual) {
                *a += r;
            }
            layer.attn_ln.apply(k, attended, eps);
            inner.resize(rows * width, 0.0);
            observe(layer.ffn_in.0.name(), attended);
            layer.ffn_in.0.forward_rows(k, attended, inner, quantized);
            (k.elementwise.gelu)(inner);
            observe(layer.ffn_out.0.name(), inner);
            layer.ffn_out.0.forward_rows(k, inner, out, quantized);
            for (o, r) in out.iter_mut().zip(attended.iter()) {
                *o += r;
            }
            layer.ffn_ln.apply(k, out, eps);
        }
    }
}

/// Query rows the post-attention part of a layer runs at a time ([`Transformer::finish_rows`]): a
/// block's feed-forward activations (`rows x inner`, 64 KiB at 64 x 256) stay in L2 beside the
/// three layers' weights.
const FINISH_BLOCK_ROWS: usize = 64;

/// The buffers one transformer pass works in (see [`Transformer::encode_into`]).
#[derive(Debug, Default)]
pub struct TransformerScratch {
    /// Token ranges of each sequence in the stacked activations.
    spans: Vec<std::ops::Range<usize>>,
    /// The rows whose outputs a layer computes.
    query_rows: Vec<usize>,
    /// A layer's input, `[tokens, hidden]`; its output goes to `out` and the two swap.
    x: Vec<f32>,
    out: Vec<f32>,
    /// A layer's projections by token: keys and values, and the queries too when every row is one
    /// (see [`Projections`]).
    projected: Vec<f32>,
    /// The query rows of `x` when not every row is one, and their queries.
    x_q: Vec<f32>,
    queries: Vec<f32>,
    context: Vec<f32>,
    attended: Vec<f32>,
    inner: Vec<f32>,
    /// An int8 layer's input, quantized.
    quantized: QuantizedActivations,
    /// One per attention piece (one on a single thread).
    attention: Vec<AttentionScratch>,
    /// One per row piece of a layer split over threads.
    row_pieces: Vec<RowPiece>,
}

#[cfg(test)]
mod tests {
    use crate::config::ModelKind;
    use crate::engine_dir::Precision;
    use crate::kernels::packed::QuantizedActivations;
    use crate::models::Model;

    /// Each layer's keys, values and queries computed as one packed layer carry the bits of the
    /// three layers run apart, at every precision and with W8A8 static scales, whether the
    /// queries share the keys' scale (one call) or not (two).
    #[test]
    fn projections_packed_as_one_layer_keep_each_layers_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let mut models = Vec::new();
        for precision in [
            Precision::Fp32,
            Precision::Fp16,
            Precision::Bf16,
            Precision::Int8,
        ] {
            let dir = tmp.path().join(format!("{precision:?}"));
            let engine =
                crate::fixtures::convert(ModelKind::Bert4rec, "model.safetensors", &dir, precision)
                    .unwrap();
            models.push(engine.model.clone());
            if precision == Precision::Int8 {
                // W8A8: layer 0's queries at a scale of their own, layer 1's at the keys'.
                let mut m = engine.model.clone();
                let names: Vec<String> = m
                    .dense_layers_mut()
                    .iter()
                    .map(|l| l.name().to_string())
                    .collect();
                let scales = names
                    .iter()
                    .map(|n| {
                        let own = n.contains("layer.0") && n.ends_with("query");
                        (n.clone(), if own { 0.031 } else { 0.047 })
                    })
                    .collect();
                m.set_static_activation_scales(&scales).unwrap();
                models.push(m);
            }
        }
        let mut next = 0x9e37_79b9_u32;
        let mut value = || {
            next = next.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (next >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        let mut fused_calls = 0;
        for model in &models {
            let Model::Bert4rec(model) = model else {
                unreachable!("a BERT4Rec fixture")
            };
            let (h, k) = (model.config.hidden_size, model.kernels);
            let rows = 37;
            let x: Vec<f32> = (0..rows * h).map(|_| value()).collect();
            for layer in &model.layers {
                let p = &layer.projections;
                let want = [&layer.key, &layer.value, &layer.query].map(|d| d.0.forward(k, &x));
                let run = |projection: super::layers::Projection<'_>| {
                    let mut y = vec![0f32; rows * projection.layer.n];
                    projection.rows_into(k, &x, &mut y, &mut QuantizedActivations::default());
                    y
                };
                let same = |got: &[f32], stride: usize, offset: usize, want: &[f32]| {
                    (0..rows).all(|r| {
                        got[r * stride + offset..r * stride + offset + h]
                            .iter()
                            .zip(&want[r * h..(r + 1) * h])
                            .all(|(a, b)| a.to_bits() == b.to_bits())
                    })
                };
                let w = p.width;
                let kv = run(p.keys_values(k));
                assert!(same(&kv, 2 * w, 0, &want[0]) && same(&kv, 2 * w, w, &want[1]));
                assert!(same(&run(p.queries(k)), w, 0, &want[2]));
                if let Some(all) = p.all(k) {
                    fused_calls += 1;
                    let got = run(all);
                    for (i, want) in want.iter().enumerate() {
                        assert!(same(&got, 3 * w, i * w, want), "projection {i}");
                    }
                } else {
                    assert_ne!(p.kv_scale, p.q_scale);
                }
            }
        }
        // fp32, fp16, bf16, int8: every layer in one call; W8A8: layer 1 only.
        assert_eq!(fused_calls, 4 * 2 + 1);
    }

    /// Long sequences split the heads over threads: every bit as on one thread, for the full
    /// layer (every row a query) and the last (one query row per sequence); and keys and values
    /// read through a row table (rows scattered over several buffers, as SASRec's carried and new
    /// rows are) give the same bits as read from the projections.
    #[test]
    fn attention_heads_split_over_threads_change_no_bit() {
        crate::parallel::split_by_floor_only();
        let tmp = tempfile::tempdir().unwrap();
        let engine = crate::fixtures::convert(
            ModelKind::Bert4rec,
            "model.safetensors",
            tmp.path(),
            Precision::Fp32,
        )
        .unwrap();
        let Model::Bert4rec(model) = &engine.model else {
            unreachable!("a BERT4Rec fixture")
        };
        let h = model.config.hidden_size;
        // Two sequences of 200 and 131 tokens: enough work per head for a piece each.
        let spans = vec![0..200, 200..331];
        let tokens = 331;
        let mut next = 0x2545_f491_u32;
        let mut value = || {
            next = next.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (next >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let keys: Vec<f32> = (0..tokens * h).map(|_| value()).collect();
        let values: Vec<f32> = (0..tokens * h).map(|_| value()).collect();
        for query_rows in [
            (0..tokens).collect::<Vec<usize>>(),
            spans.iter().map(|s| s.end - 1).collect(),
        ] {
            let queries: Vec<f32> = (0..query_rows.len() * h).map(|_| value()).collect();
            // The same rows in a table: each token's [key | value] in one of three buffers, in
            // turn, after some padding.
            let mut buffers = [vec![0.5f32; 7], vec![0.25f32; 3], Vec::new()];
            let mut at = Vec::with_capacity(tokens);
            for r in 0..tokens {
                let buffer = &mut buffers[r % 3];
                let key = buffer.len();
                buffer.extend_from_slice(&keys[r * h..(r + 1) * h]);
                buffer.extend_from_slice(&values[r * h..(r + 1) * h]);
                at.push(super::attention::RowAt {
                    source: r % 3,
                    key,
                    value: key + h,
                });
            }
            let sources: Vec<&[f32]> = buffers.iter().map(Vec::as_slice).collect();
            let table = super::KeyValues::Table {
                sources: &sources,
                at: &at,
            };
            let run_with = |threads: usize, kv: Option<super::KeyValues<'_>>| {
                let (mut context, mut pieces) = (Vec::new(), Vec::new());
                let columns = |data| super::Columns {
                    data,
                    stride: h,
                    offset: 0,
                };
                let projected = super::KeyValues::Projected {
                    keys: columns(&keys),
                    values: columns(&values),
                };
                model.attention(
                    model.kernels,
                    kv.unwrap_or(projected),
                    columns(&queries),
                    &spans,
                    &query_rows,
                    &mut context,
                    &mut pieces,
                    threads,
                );
                (context, pieces.len())
            };
            let run = |threads: usize| run_with(threads, None);
            let (one, pieces_one) = run(1);
            assert_eq!(pieces_one, 1);
            let (through_table, _) = run_with(1, Some(table));
            assert!(
                through_table
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} query rows through a row table",
                query_rows.len()
            );
            for threads in [2, 3, 8] {
                let (got, pieces) = run(threads);
                if query_rows.len() == tokens {
                    assert_eq!(pieces, 2, "one piece per head at {threads} threads");
                }
                assert!(
                    got.iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} query rows at {threads} threads",
                    query_rows.len()
                );
            }
        }
    }
}
