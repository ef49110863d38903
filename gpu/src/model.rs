//! A whole model on a [`Device`]: the weights uploaded once, then per batch the encoder
//! (BERT4Rec's or SASRec's transformer, GRU4Rec's GRU, Mult-VAE's MLP or HSTU's blocks) and the
//! fused score + top-k, so only ids (and HSTU's timestamps) go in and
//! only the top-k comes back. The sequencing mirrors the CPU engine's models line by line; the
//! CPU engine stays the reference (tests compare the two on the trained fixtures).

use std::sync::Arc;

use recsys_engine::models::hstu::{bucket_rows, HstuConfig};
use recsys_engine::models::{
    DenseLayer, EventTimes, Gru4Rec, Gru4RecView, HistoryNote, Hstu, HstuView, Model, ModelView,
    NormView, OutputLayer, Transformer, TransformerView, VaeCf, VaeCfView,
};
use recsys_engine::topk::Scored;
use recsys_engine::Engine;
use recsys_engine::InternalRequest;

use crate::device::{
    Activation, AttentionArgs, BagArgs, DenseArgs, Device, DeviceMatrix, GruGatesArgs,
    HstuAttentionArgs, NormArgs, TokenArgs,
};
use crate::output_layer::DeviceOutputLayer;
use crate::upload::{dequantized, upload_matrix, BF16_ON_GPU};
use crate::{GpuError, Result};

/// Widest attention head the kernel takes (`MAX_HEAD_DIM` in kernels/encoders.cu).
pub const MAX_HEAD_DIM: usize = 64;

/// A dense layer in f32 (encoder layers are small; the CPU engine reads them dequantised too).
struct DeviceDense<D: Device> {
    weight: D::F32,
    bias: D::F32,
    out: u32,
    inp: u32,
}

impl<D: Device> DeviceDense<D> {
    fn new(device: &D, layer: &DenseLayer) -> Result<Self> {
        let w = layer.weight();
        Ok(DeviceDense {
            weight: device.upload_f32(&dequantized(w))?,
            bias: device.upload_f32(layer.bias().as_slice())?,
            out: w.rows() as u32,
            inp: w.cols() as u32,
        })
    }

    fn forward(&self, device: &D, x: &D::F32, rows: u32, activation: Activation) -> Result<D::F32> {
        let mut y = device.alloc_f32(rows as usize * self.out as usize)?;
        let layer = DenseArgs {
            weight: &self.weight,
            bias: &self.bias,
            m: rows,
            n: self.out,
            k: self.inp,
            activation,
        };
        device.linear(x, &layer, &mut y)?;
        Ok(y)
    }
}

struct DeviceNorm<D: Device> {
    gamma: D::F32,
    beta: D::F32,
}

impl<D: Device> DeviceNorm<D> {
    fn new(device: &D, norm: NormView<'_>) -> Result<Self> {
        Ok(DeviceNorm {
            gamma: device.upload_f32(norm.gamma.as_slice())?,
            beta: device.upload_f32(norm.beta.as_slice())?,
        })
    }

    /// A LayerNorm without affine parameters over rows up to `widest` wide (ones and zeros).
    fn plain(device: &D, widest: usize) -> Result<Self> {
        Ok(DeviceNorm {
            gamma: device.upload_f32(&vec![1.0; widest])?,
            beta: device.upload_f32(&vec![0.0; widest])?,
        })
    }

    /// `LayerNorm(x + residual)`.
    fn apply(
        &self,
        device: &D,
        x: &D::F32,
        residual: Option<&D::F32>,
        rows: u32,
        width: u32,
        eps: f64,
    ) -> Result<D::F32> {
        let mut y = device.alloc_f32(rows as usize * width as usize)?;
        let norm = NormArgs {
            gamma: &self.gamma,
            beta: &self.beta,
            rows,
            width,
            eps,
        };
        device.add_layer_norm(x, residual, &norm, &mut y)?;
        Ok(y)
    }
}

struct DeviceTransformerLayer<D: Device> {
    query: DeviceDense<D>,
    key: DeviceDense<D>,
    value: DeviceDense<D>,
    attn_out: DeviceDense<D>,
    attn_norm: DeviceNorm<D>,
    ffn_in: DeviceDense<D>,
    ffn_out: DeviceDense<D>,
    ffn_norm: DeviceNorm<D>,
}

/// BERT4Rec's output head: `LayerNorm(gelu(dense(h)))`.
struct DeviceHead<D: Device> {
    dense: DeviceDense<D>,
    norm: DeviceNorm<D>,
}

/// BERT4Rec or SASRec.
struct DeviceTransformer<D: Device> {
    /// `[N+2, d]` (BERT4Rec) or `[N+1, d]` (SASRec); its first N+1 rows are also the output
    /// layer's weights.
    item_embedding: Arc<DeviceMatrix<D>>,
    position_embedding: D::F32,
    embedding_norm: DeviceNorm<D>,
    layers: Vec<DeviceTransformerLayer<D>>,
    /// BERT4Rec only.
    head: Option<DeviceHead<D>>,
    /// SASRec's attention.
    causal: bool,
    hidden: u32,
    heads: u32,
    eps: f64,
}

/// One GRU layer's input and recurrent projections (`[3 x hidden, in]` and `[3 x hidden, hidden]`).
struct DeviceGruLayer<D: Device> {
    input: DeviceDense<D>,
    recurrent: DeviceDense<D>,
}

struct DeviceGru4Rec<D: Device> {
    /// `[N+1, embedding]`: the input table and the output layer's weights.
    item_embedding: Arc<DeviceMatrix<D>>,
    /// One row of zeros: the position table of `embed_tokens`, which GRU4Rec has none of.
    no_positions: D::F32,
    layers: Vec<DeviceGruLayer<D>>,
    dense: DeviceDense<D>,
    embedding: u32,
    hidden: u32,
}

struct DeviceVaeCf<D: Device> {
    first_by_item: DeviceMatrix<D>,
    first_bias: D::F32,
    first_width: u32,
    encoder_rest: Vec<DeviceDense<D>>,
    decoder_hidden: Vec<DeviceDense<D>>,
}

/// One HSTU block: its projections (dequantised, as the other encoders' dense layers) and bias
/// tables.
struct DeviceHstuBlock<D: Device> {
    uvqk: DeviceDense<D>,
    output: DeviceDense<D>,
    position_bias: D::F32,
    time_bias: D::F32,
}

struct DeviceHstu<D: Device> {
    /// `[N+1, D]` in f32, each value already times sqrt(D): the product the CPU engine forms as a
    /// row enters, rounded once, so `embed_tokens_f32` then adds the position row as it does.
    scaled_items: DeviceMatrix<D>,
    position_embedding: D::F32,
    blocks: Vec<DeviceHstuBlock<D>>,
    /// HSTU's layer norms have no affine parameters.
    norm: DeviceNorm<D>,
    config: HstuConfig,
}

enum DeviceEncoder<D: Device> {
    Transformer(DeviceTransformer<D>),
    Vaecf(DeviceVaeCf<D>),
    Gru4rec(DeviceGru4Rec<D>),
    Hstu(DeviceHstu<D>),
}

/// A whole engine on a device.
pub struct DeviceModel<D: Device> {
    pub device: D,
    engine: Arc<Engine>,
    encoder: DeviceEncoder<D>,
    output: DeviceOutputLayer<D>,
}

impl<D: Device> DeviceModel<D> {
    /// Uploads every weight of `engine` to `device`. Refuses shapes the kernels do not take.
    pub fn new(device: D, engine: Arc<Engine>) -> Result<Self> {
        if engine.manifest.precision == recsys_engine::engine_dir::Precision::Bf16 {
            return Err(GpuError::Invalid(BF16_ON_GPU.into()));
        }
        if engine.manifest.static_dense_activations() {
            return Err(GpuError::Invalid(
                "this engine quantizes every dense layer's input with a static scale \
                 (--int8-mode w8a8-all), which the GPU kernels do not implement; serve it on the \
                 CPU or convert with --int8-mode w8a8"
                    .into(),
            ));
        }
        let encoder = match engine.model.view() {
            ModelView::Bert4rec(view) | ModelView::Sasrec(view) => {
                DeviceEncoder::Transformer(Self::transformer(&device, &view)?)
            }
            ModelView::Vaecf(view) => DeviceEncoder::Vaecf(Self::vaecf(&device, &view)?),
            ModelView::Gru4rec(view) => DeviceEncoder::Gru4rec(Self::gru4rec(&device, &view)?),
            ModelView::Hstu(view) => DeviceEncoder::Hstu(Self::hstu(&device, &view)?),
        };
        let OutputLayer { weight, bias } = engine.model.output();
        let activation_scale = engine
            .manifest
            .output_activation_scale()
            .map_err(GpuError::Invalid)?;
        // The sequential models' output layer is their item embedding (BERT4Rec's without the
        // [MASK] row; tied weights, the engine's output matrix is a view of the same rows): one
        // upload serves both.
        let shared = match &encoder {
            DeviceEncoder::Transformer(m) => Some(&m.item_embedding),
            DeviceEncoder::Gru4rec(m) => Some(&m.item_embedding),
            // HSTU scores against its normalised rows, not the rows a history reads.
            DeviceEncoder::Vaecf(_) | DeviceEncoder::Hstu(_) => None,
        };
        let output = match shared {
            Some(table) => DeviceOutputLayer::sharing(
                &device,
                Arc::clone(table),
                weight,
                bias,
                activation_scale,
            )?,
            None => DeviceOutputLayer::new(&device, weight, bias, activation_scale)?,
        };
        Ok(DeviceModel {
            device,
            engine,
            encoder,
            output,
        })
    }

    fn transformer(device: &D, view: &TransformerView<'_>) -> Result<DeviceTransformer<D>> {
        let config = view.model.config();
        let head_dim = config.hidden_size / config.n_heads.max(1);
        if head_dim == 0
            || head_dim > MAX_HEAD_DIM
            || head_dim * config.n_heads != config.hidden_size
        {
            return Err(GpuError::Invalid(format!(
                "a transformer with hidden size {} and {} heads: the GPU attention takes heads of 1..={MAX_HEAD_DIM}",
                config.hidden_size, config.n_heads
            )));
        }
        let dense = |l: &DenseLayer| DeviceDense::new(device, l);
        let norm = |n: NormView<'_>| DeviceNorm::new(device, n);
        Ok(DeviceTransformer {
            item_embedding: Arc::new(upload_matrix(device, view.item_embedding)?),
            position_embedding: device.upload_f32(view.position_embedding.as_slice())?,
            embedding_norm: norm(view.embedding_norm)?,
            layers: view
                .layers
                .iter()
                .map(|l| {
                    Ok(DeviceTransformerLayer {
                        query: dense(l.query)?,
                        key: dense(l.key)?,
                        value: dense(l.value)?,
                        attn_out: dense(l.attn_out)?,
                        attn_norm: norm(l.attn_norm)?,
                        ffn_in: dense(l.ffn_in)?,
                        ffn_out: dense(l.ffn_out)?,
                        ffn_norm: norm(l.ffn_norm)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            head: view
                .head
                .map(|head| {
                    Ok::<_, GpuError>(DeviceHead {
                        dense: dense(head.dense)?,
                        norm: norm(head.norm)?,
                    })
                })
                .transpose()?,
            causal: view.causal,
            hidden: config.hidden_size as u32,
            heads: config.n_heads as u32,
            eps: config.layer_norm_eps,
        })
    }

    fn gru4rec(device: &D, view: &Gru4RecView<'_>) -> Result<DeviceGru4Rec<D>> {
        let config = view.model.config();
        Ok(DeviceGru4Rec {
            item_embedding: Arc::new(upload_matrix(device, view.item_embedding)?),
            no_positions: device.upload_f32(&vec![0.0; config.embedding_size])?,
            layers: view
                .layers
                .iter()
                .map(|l| {
                    Ok(DeviceGruLayer {
                        input: DeviceDense::new(device, l.input)?,
                        recurrent: DeviceDense::new(device, l.recurrent)?,
                    })
                })
                .collect::<Result<_>>()?,
            dense: DeviceDense::new(device, view.dense)?,
            embedding: config.embedding_size as u32,
            hidden: config.hidden_size as u32,
        })
    }

    fn hstu(device: &D, view: &HstuView<'_>) -> Result<DeviceHstu<D>> {
        let config = view.model.config().clone();
        for (what, width) in [("query/key", config.dqk), ("value", config.dv)] {
            if width == 0 || width > MAX_HEAD_DIM {
                return Err(GpuError::Invalid(format!(
                    "HSTU with a {what} width of {width} per head: the GPU attention takes 1..={MAX_HEAD_DIM}"
                )));
            }
        }
        let d = config.embedding_dim;
        let scale = (d as f32).sqrt();
        let scaled: Vec<f32> = dequantized(view.item_embedding)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        let widest = d.max(config.num_heads * config.dv);
        Ok(DeviceHstu {
            scaled_items: DeviceMatrix::F32(device.upload_f32(&scaled)?),
            position_embedding: device.upload_f32(view.position_embedding.as_slice())?,
            blocks: view
                .blocks
                .iter()
                .map(|b| {
                    Ok(DeviceHstuBlock {
                        uvqk: DeviceDense::new(device, b.uvqk)?,
                        output: DeviceDense::new(device, b.output)?,
                        position_bias: device.upload_f32(b.position_bias.as_slice())?,
                        time_bias: device.upload_f32(b.time_bias.as_slice())?,
                    })
                })
                .collect::<Result<_>>()?,
            norm: DeviceNorm::plain(device, widest)?,
            config,
        })
    }

    fn vaecf(device: &D, view: &VaeCfView<'_>) -> Result<DeviceVaeCf<D>> {
        Ok(DeviceVaeCf {
            first_by_item: upload_matrix(device, view.first_by_item)?,
            first_bias: device.upload_f32(view.first_bias.as_slice())?,
            first_width: view.first_bias.len() as u32,
            encoder_rest: view
                .encoder_rest
                .iter()
                .map(|l| DeviceDense::new(device, l))
                .collect::<Result<_>>()?,
            decoder_hidden: view
                .decoder_hidden
                .iter()
                .map(|l| DeviceDense::new(device, l))
                .collect::<Result<_>>()?,
        })
    }

    /// The hidden vectors `[B, d]` the output layer scores, left on the device. HSTU reads
    /// timestamps: [`Self::encode_timed`].
    pub fn encode(&self, histories: &[&[u32]]) -> Result<(D::F32, Vec<HistoryNote>)> {
        self.encode_timed(histories, &[])
    }

    /// [`Self::encode`] with each history's event times (one [`EventTimes`] per history; the
    /// models that do not read time take an empty slice).
    pub fn encode_timed(
        &self,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
    ) -> Result<(D::F32, Vec<HistoryNote>)> {
        match (&self.encoder, &self.engine.model) {
            (DeviceEncoder::Hstu(m), Model::Hstu(model)) => {
                self.encode_hstu(m, model, histories, times)
            }
            (DeviceEncoder::Transformer(m), Model::Bert4rec(model) | Model::Sasrec(model)) => {
                self.encode_transformer(m, model, histories)
            }
            (DeviceEncoder::Vaecf(m), Model::Vaecf(model)) => {
                self.encode_vaecf(m, model, histories)
            }
            (DeviceEncoder::Gru4rec(m), Model::Gru4rec(model)) => {
                self.encode_gru4rec(m, model, histories)
            }
            _ => unreachable!("the device encoder is built from the engine's model"),
        }
    }

    fn encode_transformer(
        &self,
        m: &DeviceTransformer<D>,
        model: &Transformer,
        histories: &[&[u32]],
    ) -> Result<(D::F32, Vec<HistoryNote>)> {
        let d = &self.device;
        let mut notes = Vec::with_capacity(histories.len());
        let (mut items, mut positions) = (Vec::new(), Vec::new());
        let mut seq_offsets = vec![0u32];
        let mut mask_rows = Vec::with_capacity(histories.len());
        for history in histories {
            let (tokens, note) = model.model_input(history);
            notes.push(note);
            positions.extend(0..tokens.len() as u32);
            items.extend(tokens);
            seq_offsets.push(items.len() as u32);
            mask_rows.push(items.len() as u32 - 1);
        }
        if items.len() > crate::MAX_GRID_Y * crate::LINEAR_TILE as usize {
            return Err(GpuError::Invalid(format!(
                "{} tokens in one batch: the GPU dense layers take at most {}",
                items.len(),
                crate::MAX_GRID_Y * crate::LINEAR_TILE as usize
            )));
        }
        let (tokens, width) = (items.len() as u32, m.hidden);
        let mut x = d.alloc_f32(items.len() * width as usize)?;
        let (items_on_device, positions_on_device) =
            (d.upload_u32(&items)?, d.upload_u32(&positions)?);
        let token_args = TokenArgs {
            items: &items_on_device,
            positions: &positions_on_device,
            position_table: &m.position_embedding,
            tokens,
            width,
        };
        d.embed_tokens(&m.item_embedding, &token_args, &mut x)?;
        let mut x = m.embedding_norm.apply(d, &x, None, tokens, width, m.eps)?;
        let seq_offsets = d.upload_u32(&seq_offsets)?;
        for layer in &m.layers {
            let q = layer.query.forward(d, &x, tokens, Activation::None)?;
            let k = layer.key.forward(d, &x, tokens, Activation::None)?;
            let v = layer.value.forward(d, &x, tokens, Activation::None)?;
            let mut context = d.alloc_f32(items.len() * width as usize)?;
            let attention = AttentionArgs {
                q: &q,
                k: &k,
                v: &v,
                seq_offsets: &seq_offsets,
                sequences: histories.len() as u32,
                heads: m.heads,
                head_dim: width / m.heads,
                causal: m.causal,
            };
            d.attention(&attention, &mut context)?;
            let projected = layer
                .attn_out
                .forward(d, &context, tokens, Activation::None)?;
            let attended = layer
                .attn_norm
                .apply(d, &projected, Some(&x), tokens, width, m.eps)?;
            let inner = layer
                .ffn_in
                .forward(d, &attended, tokens, Activation::Gelu)?;
            let out = layer.ffn_out.forward(d, &inner, tokens, Activation::None)?;
            x = layer
                .ffn_norm
                .apply(d, &out, Some(&attended), tokens, width, m.eps)?;
        }
        // Each sequence's answer row: its last token ([MASK] for BERT4Rec, the last item for
        // SASRec).
        let rows = histories.len() as u32;
        let mut answers = d.alloc_f32(histories.len() * width as usize)?;
        d.gather_rows(&x, &d.upload_u32(&mask_rows)?, &mut answers, rows, width)?;
        let hidden = match &m.head {
            Some(head) => {
                let dense = head.dense.forward(d, &answers, rows, Activation::Gelu)?;
                head.norm.apply(d, &dense, None, rows, width, m.eps)?
            }
            None => answers,
        };
        Ok((hidden, notes))
    }

    /// HSTU as the CPU engine runs it (engine/src/models/hstu): each history's kept items scaled
    /// and placed, then per block `x += o(u * LN(attention))` over every token, with `[u|v|q|k] =
    /// silu(LN(x) uvqk)` and the time-gap buckets computed on the host by the engine's own
    /// function; the user embedding is each history's last row divided by its L2 norm.
    fn encode_hstu(
        &self,
        m: &DeviceHstu<D>,
        model: &Hstu,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
    ) -> Result<(D::F32, Vec<HistoryNote>)> {
        let d = &self.device;
        let c = &m.config;
        if times.len() != histories.len() {
            return Err(GpuError::Invalid(format!(
                "HSTU reads a timestamp per event: {} histories came with {} sets of times",
                histories.len(),
                times.len()
            )));
        }
        let mut notes = Vec::with_capacity(histories.len());
        let (mut items, mut positions, mut buckets) = (Vec::new(), Vec::new(), Vec::new());
        let (mut seq_offsets, mut bucket_offsets, mut last_rows) =
            (vec![0u32], Vec::new(), Vec::new());
        let mut kept_times: Vec<i64> = Vec::new();
        for (b, (history, when)) in histories.iter().zip(times).enumerate() {
            if when.events.len() != history.len() {
                return Err(GpuError::Invalid(format!(
                    "history {b}: {} items and {} timestamps",
                    history.len(),
                    when.events.len()
                )));
            }
            let (kept, note) = model.model_input(history);
            if kept.is_empty() {
                return Err(GpuError::Invalid(format!(
                    "history {b} is empty: HSTU answers from at least one event"
                )));
            }
            notes.push(note);
            let start = history.len() - kept.len();
            kept_times.clear();
            kept_times.extend_from_slice(&when.events[start..]);
            kept_times.push(when.query);
            bucket_offsets.push(buckets.len() as u32);
            bucket_rows(&kept_times, 0, c.time_buckets, &mut buckets);
            positions.extend(0..kept.len() as u32);
            items.extend_from_slice(kept);
            seq_offsets.push(items.len() as u32);
            last_rows.push(items.len() as u32 - 1);
        }
        if items.len() > crate::MAX_GRID_Y * crate::LINEAR_TILE as usize {
            return Err(GpuError::Invalid(format!(
                "{} events in one batch: the GPU dense layers take at most {}",
                items.len(),
                crate::MAX_GRID_Y * crate::LINEAR_TILE as usize
            )));
        }
        let (tokens, width) = (items.len() as u32, c.embedding_dim as u32);
        let values = (c.num_heads * c.dv) as u32;
        let uvqk_width = c.uvqk_width() as u32;
        let eps = HstuConfig::EPS;
        let mut x = d.alloc_f32(items.len() * width as usize)?;
        let (items_on_device, positions_on_device) =
            (d.upload_u32(&items)?, d.upload_u32(&positions)?);
        let token_args = TokenArgs {
            items: &items_on_device,
            positions: &positions_on_device,
            position_table: &m.position_embedding,
            tokens,
            width,
        };
        d.embed_tokens(&m.scaled_items, &token_args, &mut x)?;
        let seq_offsets = d.upload_u32(&seq_offsets)?;
        let buckets = d.upload_u16(&buckets)?;
        let bucket_offsets = d.upload_u32(&bucket_offsets)?;
        for block in &m.blocks {
            let normalised = m.norm.apply(d, &x, None, tokens, width, eps)?;
            let uvqk = block
                .uvqk
                .forward(d, &normalised, tokens, Activation::Silu)?;
            let mut attention = d.alloc_f32(items.len() * values as usize)?;
            let args = HstuAttentionArgs {
                uvqk: &uvqk,
                seq_offsets: &seq_offsets,
                buckets: &buckets,
                bucket_offsets: &bucket_offsets,
                position_bias: &block.position_bias,
                time_bias: &block.time_bias,
                sequences: histories.len() as u32,
                heads: c.num_heads as u32,
                dqk: c.dqk as u32,
                dv: c.dv as u32,
                attention_width: c.attention_width as u32,
            };
            d.hstu_attention(&args, &mut attention)?;
            let attention = m.norm.apply(d, &attention, None, tokens, values, eps)?;
            let mut gated = d.alloc_f32(items.len() * values as usize)?;
            d.hstu_gate(&uvqk, &attention, &mut gated, tokens, values, uvqk_width)?;
            let mut out = block.output.forward(d, &gated, tokens, Activation::None)?;
            d.add_rows(&mut out, &x, tokens, width)?;
            x = out;
        }
        let rows = histories.len() as u32;
        let mut hidden = d.alloc_f32(histories.len() * width as usize)?;
        d.gather_rows(&x, &d.upload_u32(&last_rows)?, &mut hidden, rows, width)?;
        d.l2_normalize_rows(&mut hidden, rows, width, eps as f32)?;
        Ok((hidden, notes))
    }

    /// GRU4Rec as the CPU engine runs it: the histories longest first, their tokens step after
    /// step, so the ones still running at step t are a prefix; each step one dense layer over
    /// those rows' states and one `gru_gates`; then the dense layer, and the rows back into the
    /// batch's order.
    fn encode_gru4rec(
        &self,
        m: &DeviceGru4Rec<D>,
        model: &Gru4Rec,
        histories: &[&[u32]],
    ) -> Result<(D::F32, Vec<HistoryNote>)> {
        let d = &self.device;
        let (e, h) = (m.embedding as usize, m.hidden as usize);
        let mut notes = Vec::with_capacity(histories.len());
        let kept: Vec<&[u32]> = histories
            .iter()
            .map(|history| {
                let (kept, note) = model.model_input(history);
                notes.push(note);
                kept
            })
            .collect();
        let mut order: Vec<usize> = (0..histories.len()).collect();
        order.sort_by_key(|&b| std::cmp::Reverse(kept[b].len()));
        let steps = order.first().map_or(0, |&b| kept[b].len());
        let (mut items, mut running, mut starts) = (Vec::new(), Vec::new(), Vec::new());
        for t in 0..steps {
            starts.push(items.len() as u32);
            let now: Vec<usize> = order
                .iter()
                .copied()
                .take_while(|&b| kept[b].len() > t)
                .collect();
            running.push(now.len() as u32);
            items.extend(now.iter().map(|&b| kept[b][t]));
        }
        let tokens = items.len();
        if tokens > crate::MAX_GRID_Y * crate::LINEAR_TILE as usize {
            return Err(GpuError::Invalid(format!(
                "{tokens} tokens in one batch: the GPU dense layers take at most {}",
                crate::MAX_GRID_Y * crate::LINEAR_TILE as usize
            )));
        }
        let batch = histories.len();
        let mut state = d.upload_f32(&vec![0.0; batch * h])?;
        if tokens > 0 {
            let mut x = d.alloc_f32(tokens * e)?;
            let (items_on_device, positions) =
                (d.upload_u32(&items)?, d.upload_u32(&vec![0; tokens])?);
            let token_args = TokenArgs {
                items: &items_on_device,
                positions: &positions,
                position_table: &m.no_positions,
                tokens: tokens as u32,
                width: m.embedding,
            };
            d.embed_tokens(&m.item_embedding, &token_args, &mut x)?;
            for (l, layer) in m.layers.iter().enumerate() {
                let input_gates = layer
                    .input
                    .forward(d, &x, tokens as u32, Activation::None)?;
                if l > 0 {
                    state = d.upload_f32(&vec![0.0; batch * h])?;
                }
                let mut outputs = d.alloc_f32(tokens * h)?;
                for (&rows, &first_token) in running.iter().zip(&starts) {
                    let state_gates = layer.recurrent.forward(d, &state, rows, Activation::None)?;
                    let step = GruGatesArgs {
                        input_gates: &input_gates,
                        state_gates: &state_gates,
                        rows,
                        first_token,
                        hidden: m.hidden,
                    };
                    d.gru_gates(&step, &mut state, &mut outputs)?;
                }
                x = outputs;
            }
        }
        let projected = m.dense.forward(d, &state, batch as u32, Activation::None)?;
        // Row i of the answer is the state of history i, at position `rank[i]` of `order`.
        let mut rank = vec![0u32; batch];
        for (position, &b) in order.iter().enumerate() {
            rank[b] = position as u32;
        }
        let mut hidden = d.alloc_f32(batch * e)?;
        d.gather_rows(
            &projected,
            &d.upload_u32(&rank)?,
            &mut hidden,
            batch as u32,
            m.embedding,
        )?;
        Ok((hidden, notes))
    }

    fn encode_vaecf(
        &self,
        m: &DeviceVaeCf<D>,
        model: &VaeCf,
        histories: &[&[u32]],
    ) -> Result<(D::F32, Vec<HistoryNote>)> {
        let d = &self.device;
        let (mut items, mut offsets, mut one) = (Vec::new(), vec![0u32], Vec::new());
        for history in histories {
            model.model_input_into(history, &mut one);
            items.extend_from_slice(&one);
            offsets.push(items.len() as u32);
        }
        let rows = histories.len() as u32;
        let mut x = d.alloc_f32(histories.len() * m.first_width as usize)?;
        let (items_on_device, offsets_on_device) = (d.upload_u32(&items)?, d.upload_u32(&offsets)?);
        let bag = BagArgs {
            items: &items_on_device,
            offsets: &offsets_on_device,
            bias: &m.first_bias,
            rows,
            width: m.first_width,
        };
        d.embedding_bag(&m.first_by_item, &bag, &mut x)?;
        let n_rest = m.encoder_rest.len();
        for (i, layer) in m.encoder_rest.iter().enumerate() {
            // tanh after every encoder layer but the one that yields mu.
            let act = if i + 1 < n_rest {
                Activation::Tanh
            } else {
                Activation::None
            };
            x = layer.forward(d, &x, rows, act)?;
        }
        for layer in &m.decoder_hidden {
            x = layer.forward(d, &x, rows, Activation::Tanh)?;
        }
        Ok((x, vec![HistoryNote::default(); histories.len()]))
    }

    /// Runs a few synthetic histories (one item, a short and a long one, one past the model's
    /// window, with and without exclusions) on the device and on the CPU engine and refuses the
    /// device when their top-10s disagree beyond the precision's rounding: a GPU that computes
    /// wrongly (a driver or hardware fault, a kernel bug the tests could not see) fails at load
    /// instead of serving wrong recommendations.
    pub fn self_check(&self) -> Result<()> {
        let real_items = self.output.n_items.saturating_sub(1).max(1) as u64;
        let item = |i: u64| (1 + (i * 7919) % real_items) as u32;
        // HSTU reads an event time per item: an hour apart, asked a minute after the last.
        let timed = self.engine.kind().reads_timestamps();
        let start = 1_700_000_000i64;
        let batch: Vec<InternalRequest> = [1u64, 5, 20, 300]
            .iter()
            .enumerate()
            .map(|(r, &len)| InternalRequest {
                history: (0..len).map(|i| item(i + 1000 * r as u64)).collect(),
                exclude: if r % 2 == 0 {
                    vec![item(1), item(2)]
                } else {
                    vec![]
                },
                k: 10,
                exclude_seen: r != 1,
                candidates: None,
                embedding: false,
                eligible: None,
                popular: false,
                timestamps: if timed {
                    (0..len as i64).map(|i| start + 3_600 * i).collect()
                } else {
                    Vec::new()
                },
                query_timestamp: if timed {
                    start + 3_600 * len as i64 + 60
                } else {
                    0
                },
            })
            .collect();
        let cpu = self.engine.recommend_internal(&batch);
        let device = self.recommend(&batch)?;
        // Widest honest difference: f32 rounding in another order (float engines); int8 engines'
        // CPU kernels quantize activations to int16 and W8A8 levels can flip (measured 1.5e-3).
        let tolerance = match self.engine.manifest.precision {
            recsys_engine::engine_dir::Precision::Int8 => 5e-2,
            _ => 1e-3,
        };
        for (row, ((want, _, _), (got, _))) in cpu.iter().zip(&device).enumerate() {
            let disagree = |rank: usize, why: &str| {
                let show = |s: Option<&Scored>| {
                    s.map_or("nothing".to_string(), |s| {
                        format!("item {} score {}", s.index, s.score)
                    })
                };
                Err(GpuError::SelfCheck(format!(
                    "history {row}, rank {rank}: the GPU gives {}, the CPU engine {} ({why})",
                    show(got.get(rank)),
                    show(want.get(rank))
                )))
            };
            if got.len() != want.len() {
                return disagree(got.len().min(want.len()), "different lengths");
            }
            for (rank, (g, w)) in got.iter().zip(want).enumerate() {
                let tol = tolerance * w.score.abs().max(1.0);
                if (g.score - w.score).abs() > tol || !g.score.is_finite() {
                    return disagree(rank, "scores differ");
                }
                // A different item only where the CPU ranks it at a near-tie score.
                let tied = g.index == w.index
                    || want
                        .iter()
                        .any(|o| o.index == g.index && (o.score - w.score).abs() <= 2.0 * tol);
                if !tied {
                    return disagree(rank, "different items");
                }
            }
        }
        Ok(())
    }

    /// Each prepared request's top-k on the device: encoder, then fused score + top-k at the
    /// batch's largest k, each row cut to its own.
    pub fn recommend(&self, batch: &[InternalRequest]) -> Result<Vec<(Vec<Scored>, HistoryNote)>> {
        Ok(self
            .recommend_with_embeddings(batch)?
            .into_iter()
            .map(|(items, note, _)| (items, note))
            .collect())
    }

    /// [`Self::recommend`], with the user embedding (`[hidden, 1]`) of each row that asks for it:
    /// the encoder's output is copied back only when some row does (d floats a row). Rows with
    /// `k = 0` are encoded and not scored; a batch of only such rows skips the output layer.
    pub fn recommend_with_embeddings(
        &self,
        batch: &[InternalRequest],
    ) -> Result<Vec<recsys_engine::RowAnswer>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // The device kernels scan the whole catalogue; candidate ranking runs on the CPU engine
        // (Engine::top_k_among). Refused rather than answered with the wrong items.
        if batch.iter().any(|r| r.candidates.is_some()) {
            return Err(GpuError::Invalid(
                "candidate ranking runs on the CPU engine, not on the GPU path".into(),
            ));
        }
        if batch.iter().any(|r| r.popular) {
            return Err(GpuError::Invalid(
                "popularity answers come from the CPU engine, not the GPU path".into(),
            ));
        }
        if batch.iter().any(|r| r.eligible.is_some()) {
            return Err(GpuError::Invalid(
                "item set filters run on the CPU engine, not on the GPU path".into(),
            ));
        }
        let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
        let times: Vec<EventTimes<'_>> = if self.engine.kind().reads_timestamps() {
            batch.iter().map(InternalRequest::event_times).collect()
        } else {
            Vec::new()
        };
        let (hidden, notes) = self.encode_timed(&histories, &times)?;
        let excluded: Vec<Vec<u32>> = batch.iter().map(recsys_engine::excluded_items).collect();
        let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
        let k = batch.iter().map(|r| r.k).max().unwrap_or(0);
        let ranked = if k == 0 {
            vec![Vec::new(); batch.len()]
        } else {
            self.output.top_k(&self.device, &hidden, k, &refs)?
        };
        let users = if batch.iter().any(|r| r.embedding) {
            self.device
                .download_f32(&hidden, batch.len() * self.output.dim)?
        } else {
            Vec::new()
        };
        let width = self.output.dim;
        Ok(ranked
            .into_iter()
            .zip(batch)
            .zip(notes)
            .enumerate()
            .map(|(r, ((row, request), note))| {
                let items = row
                    .into_iter()
                    .take(request.k)
                    .map(|(index, score)| Scored { index, score })
                    .collect();
                let embedding = if request.embedding {
                    let mut e = users[r * width..(r + 1) * width].to_vec();
                    e.push(1.0);
                    e
                } else {
                    Vec::new()
                };
                (items, note, embedding)
            })
            .collect())
    }
}
