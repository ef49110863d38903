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

use super::{ActivationObserver, DenseLayer, HistoryNote, OutputLayer};
use crate::config::{ModelKind, TransformerConfig};
use crate::error::Result;
use crate::import::Checkpoint;
use crate::kernels::packed::{self, LayerRef, PackedOutput, PanelRef, QuantizedActivations};
use crate::kernels::{dense, KernelTable};
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

#[derive(Clone, Debug)]
struct Dense(DenseLayer);

impl Dense {
    fn load(t: &Weights, prefix: &str, out_dim: usize, in_dim: usize) -> Result<Dense> {
        Ok(Dense(DenseLayer::new(
            prefix,
            &t.matrix(&format!("{prefix}.weight"), [out_dim, in_dim])?,
            &t.tensor(&format!("{prefix}.bias"), &[out_dim])?,
        )))
    }
}

#[derive(Clone, Debug)]
struct LayerNorm {
    gamma: Tensor,
    beta: Tensor,
}

impl LayerNorm {
    fn load(t: &Weights, prefix: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            gamma: t.tensor(&format!("{prefix}.weight"), &[width])?,
            beta: t.tensor(&format!("{prefix}.bias"), &[width])?,
        })
    }

    fn apply(&self, kernels: &KernelTable, x: &mut [f32], eps: f64) {
        (kernels.elementwise.layer_norm)(
            x,
            self.gamma.len(),
            self.gamma.as_slice(),
            self.beta.as_slice(),
            eps,
        );
    }
}

/// A layer's key, value and query projections packed side by side as one layer (keys, values,
/// then queries, each padded to whole panels): one kernel pass over a block of tokens computes
/// all three, reading the tokens once instead of three times. The panels are each projection's
/// own, so every output has the bits of its own layer.
#[derive(Clone, Debug)]
struct Projections {
    packed: PackedOutput,
    /// Lanes per projection: the hidden size rounded up to a whole panel.
    width: usize,
    /// W8A8: the static scale the keys' and values' input is quantized at (they read the same
    /// rows, so calibration gives them the same scale), and the queries'. The queries of the last
    /// layer read only the [MASK] rows, so theirs may differ.
    kv_scale: Option<f32>,
    q_scale: Option<f32>,
}

impl Projections {
    fn new(key: &DenseLayer, value: &DenseLayer, query: &DenseLayer) -> Result<Projections> {
        let packed = PackedOutput::side_by_side(&[&key.packed, &value.packed, &query.packed])
            .ok_or_else(|| {
                crate::error::EngineError::Config(format!(
                    "{}, {} and {} differ in shape or precision",
                    key.name(),
                    value.name(),
                    query.name()
                ))
            })?;
        let (kv_scale, q_scale) = (
            key.static_activation_scale(),
            query.static_activation_scale(),
        );
        if value.static_activation_scale() != kv_scale {
            return Err(crate::error::EngineError::Config(format!(
                "{} and {} read the same input but have different static activation scales",
                key.name(),
                value.name()
            )));
        }
        Ok(Projections {
            width: key.packed.panels() * 8,
            packed,
            kv_scale,
            q_scale,
        })
    }

    /// Keys, values and queries of the same rows in one call: when their input is quantized alike.
    fn all(&self) -> Option<LayerRef<'_>> {
        (self.kv_scale == self.q_scale).then(|| LayerRef {
            activation_scale: self.kv_scale,
            ..self.packed.view()
        })
    }

    /// Keys and values (`[rows, 2 x width]`).
    fn keys_values(&self) -> LayerRef<'_> {
        LayerRef {
            activation_scale: self.kv_scale,
            ..self.packed.view().outputs(0..2 * self.width)
        }
    }

    /// Queries (`[rows, width]`).
    fn queries(&self) -> LayerRef<'_> {
        LayerRef {
            activation_scale: self.q_scale,
            ..self.packed.view().outputs(2 * self.width..3 * self.width)
        }
    }
}

/// One projection (keys, values or queries) in a row-major matrix whose rows are `stride` long:
/// the projection's columns start at `offset`.
#[derive(Clone, Copy, Debug)]
struct Columns<'a> {
    data: &'a [f32],
    stride: usize,
    offset: usize,
}

impl<'a> Columns<'a> {
    /// Rows `rows` only (row 0 of the result is row `rows.start`).
    fn rows(self, rows: std::ops::Range<usize>) -> Columns<'a> {
        Columns {
            data: &self.data[rows.start * self.stride..rows.end * self.stride],
            ..self
        }
    }

    /// Row `r`'s columns `cols` of the projection.
    fn row(&self, r: usize, cols: std::ops::Range<usize>) -> &'a [f32] {
        let start = r * self.stride + self.offset;
        &self.data[start + cols.start..start + cols.end]
    }
}

/// `x @ W^T + b` of a borrowed layer into `y` (resized to `[rows, n]`), accounted as dense work.
fn project(
    kernels: &KernelTable,
    layer: LayerRef<'_>,
    x: &[f32],
    y: &mut Vec<f32>,
    quantized: &mut QuantizedActivations,
    threads: usize,
) {
    y.resize(x.len() / layer.d * layer.n, 0.0);
    dense::linear_into_threads(
        kernels,
        layer,
        x,
        y,
        quantized,
        threads,
        crate::profile::Work::Dense,
    );
}

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
                + l.projections.packed.weight_bytes()
                + 4 * l.projections.packed.bias.len()
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
    /// (on one thread).
    pub fn encode_into(
        &self,
        histories: &[&[u32]],
        scratch: &mut TransformerScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let h = self.config.hidden_size;
        let eps = self.config.layer_norm_eps;
        let k = self.kernels;
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
            self.transformer_layer(layer, s, threads, observe);
            std::mem::swap(&mut s.x, &mut s.out);
        }
        debug_assert_eq!(
            s.x.len(),
            histories.len() * h,
            "one row per sequence after the last layer"
        );

        match &self.head {
            Some(head) => {
                head.dense.0.forward_into(
                    self.kernels,
                    &s.x,
                    hidden,
                    &mut s.quantized,
                    threads,
                    observe,
                );
                (self.kernels.elementwise.gelu)(hidden);
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
        layer: &TransformerLayer,
        s: &mut TransformerScratch,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let h = self.config.hidden_size;
        let k = self.kernels;
        let pieces = self.row_pieces(s.x.len() / h, s.query_rows.len(), threads);
        if pieces != (1, 1) {
            return self.transformer_layer_split(layer, s, pieces);
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
        let (keys, values, queries) = match p.all().filter(|_| every_row) {
            Some(all) => {
                project(k, all, &s.x, &mut s.projected, &mut s.quantized, threads);
                let at = |offset| Columns {
                    data: &s.projected,
                    stride: 3 * w,
                    offset,
                };
                (at(0), at(w), at(2 * w))
            }
            None => {
                let kv = p.keys_values();
                project(k, kv, &s.x, &mut s.projected, &mut s.quantized, threads);
                project(
                    k,
                    p.queries(),
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
            keys,
            values,
            queries,
            &s.spans,
            &s.query_rows,
            &mut s.context,
            &mut s.attention,
            threads,
        );

        s.out.resize(s.query_rows.len() * h, 0.0);
        self.finish_rows(
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
        let k = self.kernels;
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

    /// Pieces each step of a layer over `tokens` rows with `queries` query rows is split into on
    /// `threads` threads ([`Transformer::transformer_layer_split`]): the projections to keys, values
    /// and queries, then the rest of the layer. A step gets one piece per thread while each
    /// piece has at least [`dense::MIN_MACS_PER_DENSE_PIECE`] multiply-adds and 8 rows.
    fn row_pieces(&self, tokens: usize, queries: usize, threads: usize) -> (usize, usize) {
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
    fn transformer_layer_split(
        &self,
        layer: &TransformerLayer,
        s: &mut TransformerScratch,
        (projection_pieces, rest_pieces): (usize, usize),
    ) {
        let h = self.config.hidden_size;
        let k = self.kernels;
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
        let all = p.all().filter(|_| every_row);
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
                crate::profile::account(crate::profile::Work::Dense, || match all {
                    Some(all) => {
                        dense::linear_into(k, all, x_rows, token_rows, &mut piece.quantized)
                    }
                    None => {
                        let kv = p.keys_values();
                        dense::linear_into(k, kv, x_rows, token_rows, &mut piece.quantized);
                        let xq_rows = &x_q[q.start * h..q.end * h];
                        let queries = p.queries();
                        dense::linear_into(k, queries, xq_rows, query_rows, &mut piece.quantized);
                    }
                })
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
                keys,
                values,
                queries.rows(q.clone()),
                spans,
                &all_query_rows[q.clone()],
                &mut p.context,
                &mut p.attention,
                1,
            );
            self.finish_rows(
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

    /// Attention per sequence and head as two small GEMMs on the packed kernels: scores =
    /// Q_h K_h^T (the keys packed as "items"), then context = P V_h (V_h^T packed), into
    /// `context` (`[query rows, hidden]`). The query rows of one sequence are contiguous in
    /// `query_rows` (all its rows, or just the MASK row). The heads are split over up to `threads`
    /// pieces (each with its own buffers in `pieces`) when there is enough work for more than one.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        keys: Columns<'_>,
        values: Columns<'_>,
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
                    self.attention_head(head, keys, values, queries, spans, query_rows, slot, a);
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
    fn attention_head(
        &self,
        head: usize,
        keys: Columns<'_>,
        values: Columns<'_>,
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
            // Keys and values are packed straight from the layer outputs (no per-head copy).
            let key_cols = keys.offset + cols.start..keys.offset + cols.end;
            packed::pack_columns_into(&mut a.keys, keys.data, keys.stride, span.clone(), key_cols);
            let keys_h = dense_panels(&a.keys, t, d, &a.zeros);
            a.q_h.clear();
            for qi in first_query..first_query + n_queries {
                a.q_h.extend_from_slice(queries.row(qi, cols.clone()));
            }
            a.scores.resize(n_queries * t, 0.0);
            dense::linear_into(self.kernels, keys_h, &a.q_h, &mut a.scores, &mut a.unused);
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
                (self.kernels.elementwise.softmax)(visible);
                later.fill(0.0);
            }
            packed::pack_columns_transposed_into(
                &mut a.values,
                values.data,
                values.stride,
                span.clone(),
                values.offset + cols.start..values.offset + cols.end,
            );
            let values_h = dense_panels(&a.values, d, t, &a.zeros);
            let out = &mut a.out[block + first_query * d..block + (first_query + n_queries) * d];
            dense::linear_into(self.kernels, values_h, &a.scores, out, &mut a.unused);
            first_query += n_queries;
        }
    }
}

/// Query rows the post-attention part of a layer runs at a time ([`Transformer::finish_rows`]): a
/// block's feed-forward activations (`rows x inner`, 64 KiB at 64 x 256) stay in L2 beside the
/// three layers' weights.
const FINISH_BLOCK_ROWS: usize = 64;

/// `n` items of width `d` packed in `panels` (f32), with no bias, as the kernels take them.
fn dense_panels<'a>(panels: &'a [f32], n: usize, d: usize, zeros: &'a [f32]) -> LayerRef<'a> {
    LayerRef {
        n,
        d,
        data: PanelRef::F32(panels),
        bias: &zeros[..n.div_ceil(8) * 8],
        activation_scale: None,
    }
}

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

/// The buffers of one row piece of [`Transformer::transformer_layer_split`]: its query rows'
/// context, attention output and feed-forward activations.
#[derive(Debug, Default)]
struct RowPiece {
    context: Vec<f32>,
    attended: Vec<f32>,
    inner: Vec<f32>,
    quantized: QuantizedActivations,
    attention: Vec<AttentionScratch>,
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

/// One attention piece's packed keys and values of a head, its queries and scores, and the
/// context of each of its heads (`out`, head after head, `[query rows, head width]` each).
#[derive(Debug, Default)]
struct AttentionScratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    q_h: Vec<f32>,
    scores: Vec<f32>,
    out: Vec<f32>,
    zeros: Vec<f32>,
    /// Attention runs in f32: nothing is quantized here.
    unused: QuantizedActivations,
}

#[cfg(test)]
mod tests {
    use crate::config::ModelKind;
    use crate::engine_dir::Precision;
    use crate::kernels::dense;
    use crate::kernels::packed::{LayerRef, QuantizedActivations};
    use crate::models::Model;

    /// Each layer's keys, values and queries computed as one packed layer carry the bits of the
    /// three layers run apart, at every precision and with W8A8 static scales, whether the
    /// queries share the keys' scale (one call) or not (two).
    #[test]
    fn projections_packed_as_one_layer_keep_each_layers_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let mut models = Vec::new();
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Int8] {
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
                let run = |view: LayerRef<'_>| {
                    let mut y = vec![0f32; rows * view.n];
                    dense::linear_into(k, view, &x, &mut y, &mut QuantizedActivations::default());
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
                let kv = run(p.keys_values());
                assert!(same(&kv, 2 * w, 0, &want[0]) && same(&kv, 2 * w, w, &want[1]));
                assert!(same(&run(p.queries()), w, 0, &want[2]));
                if let Some(all) = p.all() {
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
        // fp32, fp16, int8: every layer in one call; W8A8: layer 1 only.
        assert_eq!(fused_calls, 3 * 2 + 1);
    }

    /// Long sequences split the heads over threads: every bit as on one thread, for the full
    /// layer (every row a query) and the last (one query row per sequence).
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
            let run = |threads: usize| {
                let (mut context, mut pieces) = (Vec::new(), Vec::new());
                let columns = |data| super::Columns {
                    data,
                    stride: h,
                    offset: 0,
                };
                model.attention(
                    columns(&keys),
                    columns(&values),
                    columns(&queries),
                    &spans,
                    &query_rows,
                    &mut context,
                    &mut pieces,
                    threads,
                );
                (context, pieces.len())
            };
            let (one, pieces_one) = run(1);
            assert_eq!(pieces_one, 1);
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
