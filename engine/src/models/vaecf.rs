//! Mult-VAE (RecBole's `MultiVAE`) at inference: the L2-normalised binary multi-hot history goes
//! through the encoder to mu, and the decoder turns mu into item logits. No sampling.
//!
//! The multi-hot input is never built: the first layer is the sum of the weight columns of the
//! history's distinct items, scaled by 1/sqrt(count). The engine stores that layer transposed
//! (`encoder.0.weight_by_item`, one contiguous row per item) so the gather reads whole rows.

use super::{ActivationObserver, DenseLayer, HistoryNote, OutputLayer};
use crate::config::VaeCfConfig;
use crate::error::Result;
use crate::import::Checkpoint;
use crate::kernels::KernelTable;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

/// Engine name of the transposed first encoder layer, `[N+1, hidden_0]`.
pub const FIRST_LAYER_BY_ITEM: &str = "encoder.0.weight_by_item";

#[derive(Clone, Debug)]
struct Dense {
    name: String,
    weight: Matrix,
    bias: Tensor,
}

#[derive(Clone, Debug)]
pub struct VaeCf {
    config: VaeCfConfig,
    first_by_item: Matrix,
    first_bias: Tensor,
    /// Encoder layers after the first, ending with the mu half of the last one (logvar is unused).
    encoder_rest: Vec<DenseLayer>,
    /// Decoder layers except the last, which is the output layer.
    decoder_hidden: Vec<DenseLayer>,
    pub output: OutputLayer,
    kernels: &'static KernelTable,
    /// The first layer in AMX tiles (a bf16 table in memory only), made when the engine's AMX
    /// plan chooses tiles ([`VaeCf::prepare_tiles`]) or else the first time a tiled kernel table
    /// runs a batch that multiplies it there ([`multi_hot_on_tiles`]).
    first_tiles: std::sync::OnceLock<Option<crate::kernels::fused_amx::AmxLayer>>,
}

/// Multiply-adds on AMX tiles worth one gathered weight-row value: a batch's first layer runs as
/// one multi-hot product on tiles (every item of the catalogue, for every history) rather than a
/// gather of the histories' rows when it is at most this many times the gather's adds. Measured
/// on an Emerald Rapids Xeon (2 threads): tiles multiply about 300 bf16 pairs a nanosecond, the
/// gather adds about 6 values (scattered 1.2 KB rows).
const TILE_MACS_PER_GATHERED_VALUE: usize = 32;

/// Whether a batch whose histories hold `total_items` distinct items in all runs its first layer
/// as a multi-hot product on tiles over a catalogue of `inputs` items ([`TILE_MACS_PER_GATHERED_VALUE`]).
fn multi_hot_on_tiles(batch: usize, inputs: usize, total_items: usize) -> bool {
    batch * inputs <= TILE_MACS_PER_GATHERED_VALUE * total_items
}

/// A Linear layer's state-dict prefix and `[out, in]` shape.
pub type LayerShape = (String, [usize; 2]);

/// Every Linear layer as `(prefix, [out, in])`: the encoder's (its last one yields mu and logvar),
/// then the decoder's (its last one is the output layer).
pub fn layer_shapes(c: &VaeCfConfig) -> (Vec<LayerShape>, Vec<LayerShape>) {
    let mut enc_dims = vec![c.n_items + 1];
    enc_dims.extend(&c.hidden_sizes);
    enc_dims.push(2 * c.latent_size);
    let mut dec_dims = vec![c.latent_size];
    dec_dims.extend(c.hidden_sizes.iter().rev());
    dec_dims.push(c.n_items + 1);
    let layers = |prefix: &str, dims: &[usize]| {
        dims.windows(2)
            .enumerate()
            .map(|(i, w)| (format!("{prefix}.{}", 2 * i), [w[1], w[0]]))
            .collect::<Vec<_>>()
    };
    (layers("encoder", &enc_dims), layers("decoder", &dec_dims))
}

/// The 2-D weights a reduced precision applies to: every Linear layer (the first one in its
/// by-item layout). Biases stay fp32.
pub(super) fn quantizable(c: &VaeCfConfig) -> Vec<String> {
    let (encoder, decoder) = layer_shapes(c);
    encoder
        .iter()
        .chain(&decoder)
        .enumerate()
        .map(|(i, (prefix, _))| {
            if i == 0 {
                FIRST_LAYER_BY_ITEM.to_string()
            } else {
                format!("{prefix}.weight")
            }
        })
        .collect()
}

/// The decoder's last layer scores the items; the first encoder layer, stored by item, holds
/// their input rows.
pub(super) fn item_tensors(c: &VaeCfConfig) -> super::ItemTensors {
    let (_, decoder) = layer_shapes(c);
    let (last, _) = decoder.last().expect("the decoder has an output layer");
    super::ItemTensors {
        output: format!("{last}.weight"),
        output_bias: Some(format!("{last}.bias")),
        input: Some(FIRST_LAYER_BY_ITEM.to_string()),
        trailing_rows: 0,
    }
}

pub(super) fn engine_tensors(c: &VaeCfConfig, ckpt: &Checkpoint) -> Result<Vec<(String, Tensor)>> {
    let (encoder, decoder) = layer_shapes(c);
    let mut out = Vec::new();
    for (i, (prefix, shape)) in encoder.iter().chain(&decoder).enumerate() {
        let weight = ckpt.tensor_f32(&format!("{prefix}.weight"), shape)?;
        let bias = ckpt.tensor_f32(&format!("{prefix}.bias"), &shape[..1])?;
        if i == 0 {
            out.push((FIRST_LAYER_BY_ITEM.to_string(), weight.transposed()));
        } else {
            out.push((format!("{prefix}.weight"), weight));
        }
        out.push((format!("{prefix}.bias"), bias));
    }
    Ok(out)
}

impl VaeCf {
    pub fn from_tensors(config: VaeCfConfig, t: &Weights) -> Result<VaeCf> {
        let (encoder, decoder) = layer_shapes(&config);
        let load = |prefix: &str, shape: &[usize; 2]| -> Result<Dense> {
            Ok(Dense {
                name: prefix.to_string(),
                weight: t.matrix(&format!("{prefix}.weight"), *shape)?,
                bias: t.tensor(&format!("{prefix}.bias"), &shape[..1])?,
            })
        };
        let (first_prefix, first_shape) = &encoder[0];
        let first_by_item = t.matrix(FIRST_LAYER_BY_ITEM, [first_shape[1], first_shape[0]])?;
        let first_bias = t.tensor(&format!("{first_prefix}.bias"), &first_shape[..1])?;
        let mut encoder_rest = encoder[1..]
            .iter()
            .map(|(p, s)| load(p, s))
            .collect::<Result<Vec<_>>>()?;
        let last = encoder_rest
            .last_mut()
            .expect("config has at least one hidden layer");
        let mu = config.latent_size;
        *last = Dense {
            name: last.name.clone(),
            weight: last.weight.slice_rows(0, mu),
            bias: last.bias.rows(0, mu),
        };
        let mut decoder_layers = decoder
            .iter()
            .map(|(p, s)| load(p, s))
            .collect::<Result<Vec<_>>>()?;
        let out_layer = decoder_layers.pop().expect("decoder has an output layer");
        let pack = |layers: Vec<Dense>| {
            layers
                .iter()
                .map(|l| DenseLayer::new(&l.name, &l.weight, &l.bias))
                .collect()
        };
        Ok(VaeCf {
            config,
            first_by_item,
            first_bias,
            encoder_rest: pack(encoder_rest),
            decoder_hidden: pack(decoder_layers),
            output: OutputLayer {
                weight: out_layer.weight,
                bias: out_layer.bias,
            },
            kernels: KernelTable::detect(),
            first_tiles: Default::default(),
        })
    }

    /// Makes the first layer's tiles now when `k` is tiled ([`Model::prepare_tiles`]).
    ///
    /// [`Model::prepare_tiles`]: super::Model::prepare_tiles
    pub(crate) fn prepare_tiles(&self, k: &KernelTable) {
        self.first_layer_tiles(k);
    }

    /// The first layer's tiles when `k` is tiled and the layer is a bf16 table in memory (its
    /// bias left out: it is added after the history's scale).
    fn first_layer_tiles(&self, k: &KernelTable) -> Option<&crate::kernels::fused_amx::AmxLayer> {
        if !k.tiles {
            return None;
        }
        self.first_tiles
            .get_or_init(|| match &self.first_by_item {
                Matrix::Bf16 {
                    bits,
                    start,
                    rows,
                    cols,
                } if !bits.reads_from_file() => {
                    let (inputs, width) = (*rows, *cols);
                    let table = &bits[start * width..(start + inputs) * width];
                    Some(crate::kernels::fused_amx::AmxLayer::from_bits(
                        width,
                        inputs,
                        |j, i| table[i * width + j],
                        &vec![0.0; width],
                    ))
                }
                _ => None,
            })
            .as_ref()
    }

    pub fn config(&self) -> &VaeCfConfig {
        &self.config
    }

    /// Bytes of the packed copies the kernels read: the dense layers' and the first layer's
    /// tiles, once made.
    pub(crate) fn packed_bytes(&self) -> usize {
        let first_tiles = self
            .first_tiles
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |t| t.bytes());
        self.encoder_rest
            .iter()
            .chain(&self.decoder_hidden)
            .map(DenseLayer::packed_bytes)
            .sum::<usize>()
            + first_tiles
    }

    pub(crate) fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.kernels = kernels;
    }

    /// The kernels the model runs when a call names none.
    pub(crate) fn kernels(&self) -> &'static KernelTable {
        self.kernels
    }

    /// The layers by role, for a device that runs the whole model.
    pub fn view(&self) -> super::VaeCfView<'_> {
        super::VaeCfView {
            model: self,
            first_by_item: &self.first_by_item,
            first_bias: &self.first_bias,
            encoder_rest: &self.encoder_rest,
            decoder_hidden: &self.decoder_hidden,
        }
    }

    /// The model's input for one history: its distinct items, sorted (the binary multi-hot:
    /// duplicates collapse; PAD (0) and indices past the catalogue are never inputs).
    pub fn model_input_into(&self, history: &[u32], items: &mut Vec<u32>) {
        items.clear();
        items.extend(
            history
                .iter()
                .copied()
                .filter(|&i| i != 0 && (i as usize) <= self.config.n_items),
        );
        crate::kernels::indices::sort_distinct(items);
    }

    /// The dense layers after the first (a gather-sum), in the order they run.
    pub(crate) fn dense_layers_mut(&mut self) -> Vec<&mut DenseLayer> {
        self.encoder_rest
            .iter_mut()
            .chain(self.decoder_hidden.iter_mut())
            .collect()
    }

    /// The hidden vectors of `histories` into `hidden` and `notes` (replacing what they held), working in
    /// `scratch`, the dense layers' rows split over up to `threads` threads: once the buffers have
    /// grown to a batch's size, batches no larger allocate nothing (on one thread). On kernels `k`
    /// (the call's table; every table of one precision gives the same bits).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_into(
        &self,
        k: &KernelTable,
        histories: &[&[u32]],
        scratch: &mut VaeCfScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        let width = self.first_bias.len();
        let s = scratch;
        // Every history's distinct items, sorted, one after the other.
        s.items.clear();
        s.item_ends.clear();
        for history in histories {
            self.model_input_into(history, &mut s.one);
            s.items.extend_from_slice(&s.one);
            s.item_ends.push(s.items.len());
        }
        s.x.clear();
        s.x.resize(histories.len() * width, 0.0);
        // The first dense layer: a gather-sum of each history's weight rows, or one multi-hot
        // product on tiles where the batch's histories list enough of the catalogue.
        let tiles = self
            .first_layer_tiles(k)
            .filter(|t| multi_hot_on_tiles(histories.len(), t.d, s.items.len()));
        let on_tiles = tiles.is_some_and(|tiles| {
            let mut start = 0;
            let hot: Vec<&[u32]> = s
                .item_ends
                .iter()
                .map(|&end| {
                    let items = &s.items[start..end];
                    start = end;
                    items
                })
                .collect();
            crate::kernels::dense_amx::multi_hot_into(tiles, &hot, &mut s.x, threads).is_ok()
        });
        if !on_tiles {
            if tiles.is_some() {
                // The tiles refused part-way: the gather adds into zeros again.
                s.x.fill(0.0);
            }
            self.gather_first_layer(k, s, threads);
        }
        for (h, acc) in s.x.chunks_exact_mut(width).enumerate() {
            let count = s.item_ends[h] - if h == 0 { 0 } else { s.item_ends[h - 1] };
            // F.normalize: x / max(||x||_2, 1e-12); the norm of a binary vector is sqrt(count).
            let scale = 1.0 / (count as f32).sqrt().max(1e-12);
            for (a, b) in acc.iter_mut().zip(self.first_bias.as_slice()) {
                *a = *a * scale + b;
            }
            (k.elementwise.tanh)(acc);
        }
        // The encoder's layers after the first (tanh after each but the last, which yields mu),
        // then the decoder's hidden layers (tanh after each); the last one writes `hidden`.
        let n_rest = self.encoder_rest.len();
        let n_all = n_rest + self.decoder_hidden.len();
        let all = self.encoder_rest.iter().chain(&self.decoder_hidden);
        for (i, layer) in all.enumerate() {
            let last = i + 1 == n_all;
            let y = if last { &mut *hidden } else { &mut s.next };
            layer.forward_into(k, &s.x, y, &mut s.quantized, threads, observe);
            if i + 1 != n_rest {
                (k.elementwise.tanh)(y);
            }
            if !last {
                std::mem::swap(&mut s.x, &mut s.next);
            }
        }
        // Give each buffer back its role, so the next batch finds them as this one did (each
        // grown to the size its role needs) whatever the number of layers.
        if n_all.is_multiple_of(2) {
            std::mem::swap(&mut s.x, &mut s.next);
        }
        if n_all == 0 {
            hidden.clear();
            hidden.extend_from_slice(&s.x);
        }
        notes.clear();
        notes.resize(histories.len(), HistoryNote::default());
    }
}

impl VaeCf {
    /// Adds each history's first-layer rows (`s.items`, ranges ending at `s.item_ends`) into its
    /// row of `s.x`, the histories split over up to `threads` threads by the work they hold (a
    /// history is summed by one thread alone, so the split changes no bit).
    fn gather_first_layer(&self, k: &KernelTable, s: &mut VaeCfScratch, threads: usize) {
        let width = self.first_bias.len();
        let histories = s.item_ends.len();
        s.cursors.clear();
        let mut start = 0;
        for &end in &s.item_ends {
            s.cursors.push(start);
            start = end;
        }
        let adds_per_history = s.items.len() * width / histories.max(1);
        let pieces = crate::kernels::dense::dense_pieces(histories, adds_per_history, threads);
        let (items, ends) = (&s.items, &s.item_ends);
        if pieces <= 1 {
            // One thread: no piece list (a warm batch allocates nothing).
            return crate::profile::account(crate::profile::Work::Dense, || {
                self.gather_histories(k, items, ends, &mut s.cursors, &mut s.x)
            });
        }
        let per_piece = histories.div_ceil(pieces);
        let mut parts: Vec<(&mut [f32], &mut [usize])> =
            s.x.chunks_mut(per_piece * width)
                .zip(s.cursors.chunks_mut(per_piece))
                .collect();
        crate::parallel::for_each_mut(&mut parts, |i, (x, cursors)| {
            let ends = &ends[i * per_piece..i * per_piece + cursors.len()];
            crate::profile::account(crate::profile::Work::Dense, || {
                self.gather_histories(k, items, ends, cursors, x)
            })
        });
    }

    /// The gather for a run of histories (their rows `x`, each history's items from its cursor up
    /// to its end in `ends`), walking the catalogue in blocks of rows that stay in L2 while every
    /// history adds the ones it holds. A batch of long histories reads the table about once
    /// instead of once per history (Mult-VAE on MovieLens-1M's histories, ~165 items each, read
    /// 25 MB per batch of 64 from an 8 MB table, a quarter of its time). Each history still adds
    /// its rows in increasing item order, so the sums keep their bits.
    fn gather_histories(
        &self,
        k: &KernelTable,
        items: &[u32],
        ends: &[usize],
        cursors: &mut [usize],
        x: &mut [f32],
    ) {
        let width = self.first_bias.len();
        // About 256 KiB of weight rows per block (fp32; fewer bytes at lower precisions).
        let block_items = (256 * 1024 / (4 * width).max(1)).max(1) as u32;
        let last_item = cursors
            .iter()
            .zip(ends)
            .filter(|(c, e)| c < e)
            .map(|(_, &e)| items[e - 1])
            .max();
        let Some(last_item) = last_item else {
            return;
        };
        // An fp32 or bf16 table in memory is summed by the ISA's kernel (the rows' columns held
        // in registers; bf16 widened exactly); fp16, int8 and tables read from the file row by
        // row through the matrix.
        enum Table<'a> {
            F32(&'a [f32]),
            Bf16(&'a [u16]),
        }
        let in_memory = match &self.first_by_item {
            Matrix::F32(t) if !t.reads_rows_from_file() => Some(Table::F32(t.as_slice())),
            Matrix::Bf16 { bits, start, .. } if !bits.reads_from_file() => {
                Some(Table::Bf16(&bits[start * width..]))
            }
            _ => None,
        };
        let mut block_end = 0u32;
        while block_end <= last_item {
            block_end = block_end.saturating_add(block_items);
            for ((acc, cursor), &end) in x.chunks_exact_mut(width).zip(cursors.iter_mut()).zip(ends)
            {
                let first = *cursor;
                while *cursor < end && items[*cursor] < block_end {
                    *cursor += 1;
                }
                let rows = &items[first..*cursor];
                match in_memory {
                    Some(Table::F32(table)) => (k.elementwise.add_rows)(table, width, rows, acc),
                    Some(Table::Bf16(table)) => {
                        (k.elementwise.add_rows_bf16)(table, width, rows, acc)
                    }
                    None => {
                        for &row in rows {
                            self.first_by_item.add_row_into(row as usize, acc);
                        }
                    }
                }
            }
        }
    }
}

/// The buffers one Mult-VAE pass works in (see [`VaeCf::encode_into`]).
#[derive(Debug, Default)]
pub struct VaeCfScratch {
    /// One history's distinct items.
    one: Vec<u32>,
    /// Every history's distinct items, one history after the other, and where each one ends.
    items: Vec<u32>,
    item_ends: Vec<usize>,
    /// Per history: its next item to add in the blocked gather.
    cursors: Vec<usize>,
    /// A layer's input, `[B, width]`; its output goes to `next` and the two swap.
    x: Vec<f32>,
    next: Vec<f32>,
    /// An int8 layer's input, quantized.
    quantized: crate::kernels::packed::QuantizedActivations,
}

#[cfg(test)]
mod tests {
    use super::multi_hot_on_tiles;

    #[test]
    fn the_first_layer_goes_on_tiles_only_where_histories_list_enough_of_the_catalogue() {
        // MovieLens-1M's catalogue and histories (~165 items) at batch 64: on tiles.
        assert!(multi_hot_on_tiles(64, 3417, 64 * 165));
        // MovieLens-20M's catalogue, the same histories: the gather reads less.
        assert!(!multi_hot_on_tiles(64, 20109, 64 * 165));
        // One short history: the gather.
        assert!(!multi_hot_on_tiles(1, 3417, 9));
    }
}
