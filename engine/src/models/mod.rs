//! The recommenders. Each model turns a batch of histories (internal indices) into one hidden vector
//! per history; an [`OutputLayer`] then scores every item from it. Splitting there lets the scoring
//! and top-k step, which dominates the cost, be shared (and fused) across models.

pub mod gru4rec;
pub mod hstu;
pub mod transformer;
pub mod vaecf;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::import::Checkpoint;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

pub use gru4rec::{Gru4Rec, Gru4RecScratch};
pub use hstu::{Hstu, HstuBlockView, HstuScratch, HstuView};
pub use transformer::{CarriedScratch, Flavor, Transformer, TransformerScratch};
pub use vaecf::{VaeCf, VaeCfScratch};

/// The buffers an encoder pass works in, for any model, kept from batch to batch by whoever
/// runs batches (the engine keeps one per thread): [`Model::encode_into`] then allocates nothing
/// once they have grown to the largest batch seen.
#[derive(Debug, Default)]
pub struct EncodeScratch {
    transformer: TransformerScratch,
    carried: CarriedScratch,
    vaecf: VaeCfScratch,
    gru4rec: Gru4RecScratch,
    hstu: HstuScratch,
}

/// When a history's events happened, for the models that read time (HSTU): a unix timestamp in
/// seconds per history item (in the history's order), and the time of the event to predict (the
/// request's time, or the target's in an evaluation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventTimes<'a> {
    pub events: &'a [i64],
    pub query: i64,
}

/// Where the histories of a pass resuming from carried states start and where their states go
/// ([`Gru4Rec::encode_carried`], [`Transformer::encode_carried`], [`Hstu::encode_carried`]: the
/// prefix cache's passes).
pub struct Carry<'a> {
    /// Per history: how many items of its model input a carried state already covers, and the
    /// state after them (GRU4Rec: the layers' states, `[layers x hidden]`; SASRec: at least that
    /// many slots' keys and values; HSTU: that many rows' keys and values, never its last row);
    /// `None` starts from the beginning.
    pub starts: &'a [Option<(usize, &'a crate::prefix_cache::State)>],
    /// Filled with what each history's state after its last item adds, history after history:
    /// GRU4Rec's whole state (`layers x hidden`, which replaces the carried one); SASRec's new
    /// slots' keys and values and HSTU's new rows' but the last (appended to the carried ones,
    /// see [`Carry::appends`]).
    pub ends: &'a mut Vec<f32>,
    /// Filled with where each history's part starts in `ends`, and where the last one ends
    /// (`B + 1` offsets).
    pub ends_at: &'a mut Vec<usize>,
}

impl Carry<'_> {
    /// Whether a history's state after the pass is its carried state followed by its part of
    /// `ends` (SASRec, HSTU), rather than that part alone (GRU4Rec).
    pub fn appends(kind: crate::config::ModelKind) -> bool {
        matches!(
            kind,
            crate::config::ModelKind::Sasrec | crate::config::ModelKind::Hstu
        )
    }
}

/// `scores = hidden @ weight^T + bias` over all N+1 outputs (index 0 is PAD); the engine packs it
/// for the fused score + top-k kernels.
#[derive(Clone, Debug)]
pub struct OutputLayer {
    /// `[N+1, d]`, one row per item, at the engine's precision.
    pub weight: Matrix,
    /// `[N+1]`.
    pub bias: Tensor,
}

impl OutputLayer {
    pub fn n_outputs(&self) -> usize {
        self.weight.rows()
    }

    pub fn input_size(&self) -> usize {
        self.weight.cols()
    }
}

/// Where a model keeps its rows of each item, by stored tensor name: what a catalogue delta
/// edits ([`crate::catalogue`]). Row `i` of each table is item `i` (0 is PAD).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemTensors {
    /// The output layer's weight, `[N+1 + trailing_rows, d]`.
    pub output: String,
    /// The output layer's bias, `[N+1]`; `None` where the model scores without one (SASRec,
    /// GRU4Rec: zero).
    pub output_bias: Option<String>,
    /// The table a history reads an item's input row from, where it is not the output weight
    /// (Mult-VAE's first encoder layer by item); `None`: input and output rows are one row.
    pub input: Option<String>,
    /// Rows after the items in the output weight's table: BERT4Rec's mask token, which stays the
    /// table's last row as items are added.
    pub trailing_rows: usize,
}

/// Sees the input of every dense layer as a model runs (by the layer's weight prefix): how
/// calibration measures each layer's activations on the model as it is served.
pub type ActivationObserver<'a> = &'a mut dyn FnMut(&str, &[f32]);

/// A bf16 dense layer's values widened to f32 ([`PackedOutput::widened_bf16`]), made the first
/// time kernels without `vdpbf16ps` run the layer and kept: the fp32 kernels then compute it
/// with the bf16 kernels' bits at fp32's speed (widening in the kernels' loop cost a BERT4Rec
/// bf16 engine 8-15 % against its fp32 engine on a Zen 2). Dense layers are small beside the
/// output layer, which stays bf16: its bytes are what bf16 saves.
///
/// [`PackedOutput::widened_bf16`]: crate::kernels::packed::PackedOutput::widened_bf16
#[derive(Clone, Debug, Default)]
pub(crate) struct Widened(std::sync::OnceLock<Option<crate::kernels::packed::PackedOutput>>);

impl Widened {
    /// `packed` as `kernels` run it best: widened for a bf16 layer on kernels without native
    /// bf16, else as it is.
    pub(crate) fn view<'a>(
        &'a self,
        packed: &'a crate::kernels::packed::PackedOutput,
        kernels: &crate::kernels::KernelTable,
    ) -> crate::kernels::packed::LayerRef<'a> {
        use crate::kernels::packed::OutputPrecision;
        if packed.precision() != OutputPrecision::Bf16 || kernels.isa.has_native_bf16() {
            return packed.view();
        }
        self.0
            .get_or_init(|| packed.widened_bf16())
            .as_ref()
            .map_or_else(|| packed.view(), |wide| wide.view())
    }

    /// Bytes of the widened copy, once made.
    pub(crate) fn bytes(&self) -> usize {
        self.0
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |wide| wide.weight_bytes() + 4 * wide.bias.len())
    }
}

/// A bf16 dense layer's values in AMX tiles ([`crate::kernels::fused_amx::AmxLayer`]), made the
/// first time a tiled kernel table ([`crate::kernels::KernelTable::tiled`]) runs the layer and
/// kept; `None` inside for layers that are not bf16.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tiles(std::sync::OnceLock<Option<crate::kernels::fused_amx::AmxLayer>>);

impl Tiles {
    /// The layer's tiles when `kernels` run bf16 layers on tiles and `packed` is bf16.
    pub(crate) fn for_kernels(
        &self,
        packed: &crate::kernels::packed::PackedOutput,
        kernels: &crate::kernels::KernelTable,
    ) -> Option<&crate::kernels::fused_amx::AmxLayer> {
        if !kernels.tiles {
            return None;
        }
        self.0
            .get_or_init(|| crate::kernels::fused_amx::AmxLayer::from_packed(packed))
            .as_ref()
    }

    /// Bytes of the tiles, once made.
    pub(crate) fn bytes(&self) -> usize {
        self.0
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |tiles| tiles.bytes())
    }
}

/// A dense layer packed for the micro-kernels of [`crate::kernels::dense`] (`x @ W^T + b`).
#[derive(Clone, Debug)]
pub struct DenseLayer {
    /// The weight's prefix in the state dict (`encoder.2`, `output_ffn`, ...).
    name: String,
    packed: crate::kernels::packed::PackedOutput,
    /// A bf16 layer widened for kernels without native bf16 ([`Widened`]).
    widened: Widened,
    /// A bf16 layer in AMX tiles for tiled kernel tables ([`Tiles`]).
    tiles: Tiles,
    /// The layer as stored (shares the engine's storage), for devices that pack it their own way.
    weight: Matrix,
    bias: Tensor,
}

impl DenseLayer {
    /// From a PyTorch-layout weight `[out, in]` (any precision) and bias `[out]`, named by its
    /// state-dict prefix.
    pub fn new(name: &str, weight: &Matrix, bias: &Tensor) -> DenseLayer {
        DenseLayer {
            name: name.to_string(),
            packed: weight.pack(bias.as_slice()),
            widened: Widened::default(),
            tiles: Tiles::default(),
            weight: weight.clone(),
            bias: bias.clone(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// All-layer W8A8: the layer's input is rounded to this calibrated static int8 scale (int8
    /// weights only), as an explicit-quantization graph's QuantizeLinear/DequantizeLinear does.
    pub fn set_static_activation_scale(&mut self, scale: f32) -> Result<()> {
        if !matches!(self.weight, Matrix::I8 { .. }) {
            return Err(crate::error::EngineError::Config(format!(
                "static activation scale for {}, whose weights are not int8",
                self.name
            )));
        }
        self.packed = self.packed.clone().with_static_activation_scale(scale);
        self.widened = Widened::default();
        Ok(())
    }

    /// The static activation scale, when the layer has one.
    pub fn static_activation_scale(&self) -> Option<f32> {
        self.packed.activation_scale
    }

    /// The weight as stored, `[out, in]`.
    pub fn weight(&self) -> &Matrix {
        &self.weight
    }

    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// Bytes of the packed weights this layer holds in memory.
    pub fn packed_bytes(&self) -> usize {
        self.packed.weight_bytes()
            + 4 * self.packed.bias.len()
            + self.widened.bytes()
            + self.tiles.bytes()
    }

    /// The layer as `kernels` run it ([`Widened`]).
    fn view(&self, kernels: &crate::kernels::KernelTable) -> crate::kernels::packed::LayerRef<'_> {
        self.widened.view(&self.packed, kernels)
    }

    /// `y` from `x` on the layer's AMX tiles (rows split over up to `threads` pool threads, each
    /// piece then passed to `activation`), when `kernels` run bf16 layers on tiles and this layer
    /// has them; false (nothing written) otherwise, for the SIMD kernels to run.
    fn forward_on_tiles(
        &self,
        kernels: &crate::kernels::KernelTable,
        x: &[f32],
        y: &mut [f32],
        threads: usize,
        activation: fn(&mut [f32]),
    ) -> bool {
        self.tiles
            .for_kernels(&self.packed, kernels)
            .is_some_and(|tiles| {
                crate::kernels::dense_amx::linear_into_then(tiles, x, y, threads, activation)
                    .is_ok()
            })
    }

    pub fn forward(&self, kernels: &crate::kernels::KernelTable, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; x.len() / self.packed.d * self.packed.n];
        if self.forward_on_tiles(kernels, x, &mut y, 1, |_| {}) {
            return y;
        }
        crate::profile::account(crate::profile::Work::Dense, || {
            let layer = self.view(kernels);
            let mut quantized = crate::kernels::packed::QuantizedActivations::default();
            crate::kernels::dense::linear_into(kernels, layer, x, &mut y, &mut quantized);
            y
        })
    }

    /// [`DenseLayer::forward`] after showing the input to `observe`, into `y` (resized to `[rows, out]`; every value
    /// overwritten), quantizing an int8 layer's input into `quantized`, its rows split over up to
    /// `threads` pool threads when the layer is large enough ([`dense::dense_pieces`]): the same
    /// bits whatever the split, and with one thread and buffers kept between calls, no allocation.
    ///
    /// [`dense::dense_pieces`]: crate::kernels::dense::dense_pieces
    pub fn forward_into(
        &self,
        kernels: &crate::kernels::KernelTable,
        x: &[f32],
        y: &mut Vec<f32>,
        quantized: &mut crate::kernels::packed::QuantizedActivations,
        threads: usize,
        observe: ActivationObserver<'_>,
    ) {
        self.forward_into_then(kernels, x, y, quantized, threads, observe, |_| {})
    }

    /// [`DenseLayer::forward_into`], then the elementwise `activation` over the output, each
    /// piece's rows on the thread that computed them (see
    /// [`crate::kernels::dense::linear_into_threads_then`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into_then(
        &self,
        kernels: &crate::kernels::KernelTable,
        x: &[f32],
        y: &mut Vec<f32>,
        quantized: &mut crate::kernels::packed::QuantizedActivations,
        threads: usize,
        observe: ActivationObserver<'_>,
        activation: fn(&mut [f32]),
    ) {
        observe(&self.name, x);
        y.resize(x.len() / self.packed.d * self.packed.n, 0.0);
        if self.forward_on_tiles(kernels, x, y, threads, activation) {
            return;
        }
        crate::kernels::dense::linear_into_threads_then(
            kernels,
            self.view(kernels),
            x,
            y,
            quantized,
            threads,
            crate::profile::Work::Dense,
            activation,
        )
    }

    /// [`DenseLayer::forward_into_then`] for the outputs `outputs` only (whole panels: the range
    /// starts at a multiple of 8), into `y` (`[rows, outputs.len()]`): each output has the bits it
    /// has in the whole layer. The input is not shown to an observer (the caller shows it once).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_outputs_into_then(
        &self,
        kernels: &crate::kernels::KernelTable,
        outputs: std::ops::Range<usize>,
        x: &[f32],
        y: &mut Vec<f32>,
        quantized: &mut crate::kernels::packed::QuantizedActivations,
        threads: usize,
        activation: fn(&mut [f32]),
    ) {
        y.resize(x.len() / self.packed.d * outputs.len(), 0.0);
        crate::kernels::dense::linear_into_threads_then(
            kernels,
            self.view(kernels).outputs(outputs),
            x,
            y,
            quantized,
            threads,
            crate::profile::Work::Dense,
            activation,
        )
    }

    /// `x @ W^T + b` into `y` (`[rows, out]`) on this thread, accounted as dense work: one piece
    /// of a layer whose rows are split by the caller.
    pub(crate) fn forward_rows(
        &self,
        kernels: &crate::kernels::KernelTable,
        x: &[f32],
        y: &mut [f32],
        quantized: &mut crate::kernels::packed::QuantizedActivations,
    ) {
        if self.forward_on_tiles(kernels, x, y, 1, |_| {}) {
            return;
        }
        crate::profile::account(crate::profile::Work::Dense, || {
            crate::kernels::dense::linear_into(kernels, self.view(kernels), x, y, quantized)
        })
    }
}

/// A LayerNorm's affine parameters.
#[derive(Clone, Copy, Debug)]
pub struct NormView<'a> {
    pub gamma: &'a Tensor,
    pub beta: &'a Tensor,
}

/// One post-LN transformer layer (BERT4Rec's and SASRec's).
#[derive(Clone, Copy, Debug)]
pub struct TransformerLayerView<'a> {
    pub query: &'a DenseLayer,
    pub key: &'a DenseLayer,
    pub value: &'a DenseLayer,
    pub attn_out: &'a DenseLayer,
    pub attn_norm: NormView<'a>,
    pub ffn_in: &'a DenseLayer,
    pub ffn_out: &'a DenseLayer,
    pub ffn_norm: NormView<'a>,
}

/// BERT4Rec's output head, `LayerNorm(gelu(dense(h)))`.
#[derive(Clone, Copy, Debug)]
pub struct HeadView<'a> {
    pub dense: &'a DenseLayer,
    pub norm: NormView<'a>,
}

/// Every tensor a transformer recommender runs with, by role; [`Transformer::model_input`] gives
/// its tokens.
#[derive(Clone, Debug)]
pub struct TransformerView<'a> {
    pub model: &'a Transformer,
    /// SASRec: each slot attends to itself and the slots before it (BERT4Rec: to every slot).
    pub causal: bool,
    pub item_embedding: &'a Matrix,
    pub position_embedding: &'a Tensor,
    pub embedding_norm: NormView<'a>,
    pub layers: Vec<TransformerLayerView<'a>>,
    /// BERT4Rec only.
    pub head: Option<HeadView<'a>>,
}

/// One GRU layer: `x W_ih^T + b_ih` and `h W_hh^T + b_hh`, gates in PyTorch's order (reset,
/// update, new).
#[derive(Clone, Copy, Debug)]
pub struct GruLayerView<'a> {
    pub input: &'a DenseLayer,
    pub recurrent: &'a DenseLayer,
}

/// Every tensor GRU4Rec runs with, by role; [`Gru4Rec::model_input`] gives its items.
#[derive(Clone, Debug)]
pub struct Gru4RecView<'a> {
    pub model: &'a Gru4Rec,
    pub item_embedding: &'a Matrix,
    pub layers: Vec<GruLayerView<'a>>,
    pub dense: &'a DenseLayer,
}

/// Every tensor Mult-VAE runs with, by role; [`VaeCf::model_input`] gives its items.
#[derive(Clone, Debug)]
pub struct VaeCfView<'a> {
    pub model: &'a VaeCf,
    /// The first layer by item, `[N+1, hidden_0]`, followed by tanh.
    pub first_by_item: &'a Matrix,
    pub first_bias: &'a Tensor,
    /// The encoder's remaining layers (tanh after each but the last, which yields mu), then the
    /// decoder's hidden layers (tanh after each).
    pub encoder_rest: &'a [DenseLayer],
    pub decoder_hidden: &'a [DenseLayer],
}

#[derive(Clone, Debug)]
pub enum ModelView<'a> {
    Bert4rec(TransformerView<'a>),
    Vaecf(VaeCfView<'a>),
    Sasrec(TransformerView<'a>),
    Gru4rec(Gru4RecView<'a>),
    Hstu(HstuView<'a>),
}

pub use crate::tensor::{take, TensorMap};

/// A model ready to run.
#[derive(Clone, Debug)]
pub enum Model {
    Bert4rec(Box<Transformer>),
    Vaecf(Box<VaeCf>),
    Sasrec(Box<Transformer>),
    Gru4rec(Box<Gru4Rec>),
    Hstu(Box<Hstu>),
}

/// What a model reports about one history besides its hidden vector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistoryNote {
    /// The history was longer than the model's window and its oldest items were left out.
    pub truncated: bool,
    /// With an int8 screen (`--screen int8`), how many items survived it and were rescored for
    /// this history's whole-catalogue top k (`None`: not screened).
    pub screen_survivors: Option<u32>,
}

/// A sequential model's window on a history: its last `keep` items, and whether older ones were
/// left out.
fn most_recent(history: &[u32], keep: usize) -> (&[u32], HistoryNote) {
    let start = history.len().saturating_sub(keep);
    (
        &history[start..],
        HistoryNote {
            truncated: start > 0,
            ..Default::default()
        },
    )
}

impl Model {
    /// Picks, checks and re-lays-out the checkpoint tensors the model needs, under engine names.
    pub fn engine_tensors(
        config: &ModelConfig,
        ckpt: &Checkpoint,
    ) -> Result<Vec<(String, Tensor)>> {
        match config {
            ModelConfig::Bert4rec(c) => transformer::engine_tensors(Flavor::Bert4Rec, c, ckpt),
            ModelConfig::Sasrec(c) => transformer::engine_tensors(Flavor::SasRec, c, ckpt),
            ModelConfig::Vaecf(c) => vaecf::engine_tensors(c, ckpt),
            ModelConfig::Gru4rec(c) => gru4rec::engine_tensors(c, ckpt),
            ModelConfig::Hstu(c) => hstu::engine_tensors(c, ckpt),
        }
    }

    /// Where the model keeps its per-item rows ([`ItemTensors`]).
    pub fn item_tensors(config: &ModelConfig) -> ItemTensors {
        let tied = |output_bias: Option<&str>, trailing_rows| ItemTensors {
            output: "item_embedding.weight".into(),
            output_bias: output_bias.map(str::to_string),
            input: None,
            trailing_rows,
        };
        match config {
            ModelConfig::Bert4rec(_) => tied(Some("output_bias"), 1),
            ModelConfig::Sasrec(_) | ModelConfig::Gru4rec(_) => tied(None, 0),
            ModelConfig::Vaecf(c) => vaecf::item_tensors(c),
            ModelConfig::Hstu(_) => ItemTensors {
                output: hstu::names::OUTPUT_ROWS.into(),
                output_bias: None,
                input: Some(hstu::names::INPUT_ROWS.into()),
                trailing_rows: 0,
            },
        }
    }

    /// The 2-D weights that `--precision fp16|int8` stores at that precision.
    pub fn quantizable(config: &ModelConfig) -> Vec<String> {
        match config {
            ModelConfig::Bert4rec(c) => transformer::quantizable(Flavor::Bert4Rec, c),
            ModelConfig::Sasrec(c) => transformer::quantizable(Flavor::SasRec, c),
            ModelConfig::Vaecf(c) => vaecf::quantizable(c),
            ModelConfig::Gru4rec(c) => gru4rec::quantizable(c),
            ModelConfig::Hstu(c) => hstu::quantizable(c),
        }
    }

    pub fn from_tensors(config: &ModelConfig, tensors: &Weights) -> Result<Model> {
        Ok(match config {
            ModelConfig::Bert4rec(c) => Model::Bert4rec(Box::new(Transformer::from_tensors(
                Flavor::Bert4Rec,
                c.clone(),
                tensors,
            )?)),
            ModelConfig::Sasrec(c) => Model::Sasrec(Box::new(Transformer::from_tensors(
                Flavor::SasRec,
                c.clone(),
                tensors,
            )?)),
            ModelConfig::Vaecf(c) => {
                Model::Vaecf(Box::new(VaeCf::from_tensors(c.clone(), tensors)?))
            }
            ModelConfig::Gru4rec(c) => {
                Model::Gru4rec(Box::new(Gru4Rec::from_tensors(c.clone(), tensors)?))
            }
            ModelConfig::Hstu(c) => Model::Hstu(Box::new(Hstu::from_tensors(c.clone(), tensors)?)),
        })
    }

    /// Hidden vectors `[B, d]` for a batch of histories of internal indices (1..=N, oldest first).
    /// For the models that read time (HSTU), [`Model::encode_timed`].
    pub fn encode(&self, histories: &[&[u32]]) -> (Vec<f32>, Vec<HistoryNote>) {
        self.encode_timed(histories, &[])
    }

    /// [`Model::encode`] with each history's event times (one [`EventTimes`] per history; empty
    /// for the models that do not read time).
    pub fn encode_timed(
        &self,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        let (mut hidden, mut notes) = (Vec::new(), Vec::new());
        let mut scratch = EncodeScratch::default();
        let kernels = self.kernels();
        self.encode_in(
            kernels,
            histories,
            times,
            &mut scratch,
            &mut hidden,
            &mut notes,
            1,
            None,
        );
        (hidden, notes)
    }

    /// [`Model::encode`], showing every dense layer's input to `observe`.
    pub fn encode_observed(
        &self,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        observe: ActivationObserver<'_>,
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        let (mut hidden, mut notes) = (Vec::new(), Vec::new());
        let mut scratch = EncodeScratch::default();
        self.encode_in(
            self.kernels(),
            histories,
            times,
            &mut scratch,
            &mut hidden,
            &mut notes,
            1,
            Some(observe),
        );
        (hidden, notes)
    }

    /// [`Model::encode`] into `hidden` (`[B, d]`) and `notes` (one per history), replacing what
    /// they held, working in `scratch`: the same bits as [`Model::encode`], and no allocation once
    /// `scratch`, `hidden` and `notes` have held a batch at least as large (in histories and
    /// tokens).
    pub fn encode_into(
        &self,
        histories: &[&[u32]],
        scratch: &mut EncodeScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
    ) {
        self.encode_into_threads(histories, scratch, hidden, notes, 1)
    }

    /// [`Model::encode_into`] with the batch's larger layers (and BERT4Rec's attention heads)
    /// split over up to `threads` pool threads: how one history uses the threads a batch of one
    /// was given. The same bits for every `threads`.
    pub fn encode_into_threads(
        &self,
        histories: &[&[u32]],
        scratch: &mut EncodeScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
    ) {
        self.encode_with(
            self.kernels(),
            histories,
            &[],
            scratch,
            hidden,
            notes,
            threads,
        )
    }

    /// [`Model::encode_into_threads`] on `kernels` rather than the model's own (the same bits on
    /// every kernel table of one precision; a call's plan may pick the table by batch size), with
    /// the histories' event times for the models that read them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_with(
        &self,
        kernels: &'static crate::kernels::KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        scratch: &mut EncodeScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
    ) {
        self.encode_in(
            kernels,
            histories,
            times,
            scratch,
            hidden,
            notes,
            threads.max(1),
            None,
        )
    }

    /// The kernels the model runs when a call names none ([`Model::set_kernels`]).
    /// Makes the AMX tiles a tiled table `kernels` would otherwise make on a call's first use of
    /// them where that depends on the call (Mult-VAE's multi-hot first layer: only batches of long
    /// enough histories use it), so no request pays for packing them.
    pub fn prepare_tiles(&self, kernels: &crate::kernels::KernelTable) {
        if let Model::Vaecf(m) = self {
            m.prepare_tiles(kernels);
        }
    }

    pub fn kernels(&self) -> &'static crate::kernels::KernelTable {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.kernels(),
            Model::Vaecf(m) => m.kernels(),
            Model::Gru4rec(m) => m.kernels(),
            Model::Hstu(m) => m.kernels(),
        }
    }

    /// The encoder resuming each history from a carried state: GRU4Rec's states
    /// ([`Gru4Rec::encode_carried`]), SASRec's keys and values ([`Transformer::encode_carried`])
    /// or HSTU's ([`Hstu::encode_carried`], which reads `times`); `None` for BERT4Rec and
    /// Mult-VAE (which never carry one: see [`crate::prefix_cache`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_carried(
        &self,
        kernels: &'static crate::kernels::KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        scratch: &mut EncodeScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        carry: Carry<'_>,
    ) -> Option<()> {
        let threads = threads.max(1);
        match self {
            Model::Gru4rec(m) => m.encode_carried(
                kernels,
                histories,
                &mut scratch.gru4rec,
                hidden,
                notes,
                threads,
                false,
                &mut |_: &str, _: &[f32]| {},
                Some(carry),
            ),
            Model::Sasrec(m) => m.encode_carried(
                kernels,
                histories,
                &mut scratch.carried,
                hidden,
                notes,
                threads,
                carry,
            ),
            Model::Hstu(m) => m.encode_carried(
                kernels,
                histories,
                times,
                &mut scratch.hstu,
                hidden,
                notes,
                threads,
                carry,
            ),
            Model::Bert4rec(_) | Model::Vaecf(_) => return None,
        }
        Some(())
    }

    /// The one place a batch is dispatched to its model's encoder.
    #[allow(clippy::too_many_arguments)]
    fn encode_in(
        &self,
        kernels: &'static crate::kernels::KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        scratch: &mut EncodeScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observer: Option<ActivationObserver<'_>>,
    ) {
        let observing = observer.is_some();
        let mut unobserved = |_: &str, _: &[f32]| {};
        let observe: ActivationObserver<'_> = match observer {
            Some(observe) => observe,
            None => &mut unobserved,
        };
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.encode_into(
                kernels,
                histories,
                &mut scratch.transformer,
                hidden,
                notes,
                threads,
                observe,
            ),
            Model::Vaecf(m) => m.encode_into(
                kernels,
                histories,
                &mut scratch.vaecf,
                hidden,
                notes,
                threads,
                observe,
            ),
            Model::Gru4rec(m) => m.encode_into(
                kernels,
                histories,
                &mut scratch.gru4rec,
                hidden,
                notes,
                threads,
                observing,
                observe,
            ),
            Model::Hstu(m) => m.encode_into(
                kernels,
                histories,
                times,
                &mut scratch.hstu,
                hidden,
                notes,
                threads,
                observe,
            ),
        }
    }

    /// The dense layers (not the output layer), in the order they run.
    pub(crate) fn dense_layers_mut(&mut self) -> Vec<&mut DenseLayer> {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.dense_layers_mut(),
            Model::Vaecf(m) => m.dense_layers_mut(),
            Model::Gru4rec(m) => m.dense_layers_mut(),
            Model::Hstu(m) => m.dense_layers_mut(),
        }
    }

    /// All-layer W8A8: every dense layer's input gets its calibrated static scale (by layer
    /// name); every dense layer must have one.
    pub fn set_static_activation_scales(
        &mut self,
        scales: &std::collections::BTreeMap<String, f32>,
    ) -> Result<()> {
        let is_gru = matches!(self, Model::Gru4rec(_));
        let mut layers = self.dense_layers_mut();
        if is_gru {
            // The recurrent state stays float: an explicit-quantization graph's GRU operator has
            // no quantized form, and all-layer W8A8 computes what that graph computes.
            layers.retain(|layer| !layer.name().starts_with(gru4rec::RECURRENT_PREFIX));
        }
        for layer in layers {
            let scale = scales.get(layer.name()).copied().ok_or_else(|| {
                crate::error::EngineError::Config(format!(
                    "no static activation scale for dense layer {}",
                    layer.name()
                ))
            })?;
            layer.set_static_activation_scale(scale)?;
        }
        // A transformer runs its projections as one packed layer, which takes the scales too.
        if let Model::Bert4rec(m) | Model::Sasrec(m) = self {
            m.repack_projections()?;
        }
        Ok(())
    }

    /// Runs the dense layers on `kernels` (the engine's single dispatch point calls this at load).
    pub fn set_kernels(&mut self, kernels: &'static crate::kernels::KernelTable) {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.set_kernels(kernels),
            Model::Vaecf(m) => m.set_kernels(kernels),
            Model::Gru4rec(m) => m.set_kernels(kernels),
            Model::Hstu(m) => m.set_kernels(kernels),
        }
    }

    /// Bytes of the packed copies of the dense layers (held in memory next to the mapped file).
    pub fn packed_bytes(&self) -> usize {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.packed_bytes(),
            Model::Vaecf(m) => m.packed_bytes(),
            Model::Gru4rec(m) => m.packed_bytes(),
            Model::Hstu(m) => m.packed_bytes(),
        }
    }

    /// The model's layers by role, for a device that runs the whole model (the GPU path).
    pub fn view(&self) -> ModelView<'_> {
        match self {
            Model::Bert4rec(m) => ModelView::Bert4rec(m.view()),
            Model::Sasrec(m) => ModelView::Sasrec(m.view()),
            Model::Vaecf(m) => ModelView::Vaecf(m.view()),
            Model::Gru4rec(m) => ModelView::Gru4rec(m.view()),
            Model::Hstu(m) => ModelView::Hstu(m.view()),
        }
    }

    /// The table of the items' input rows, `[N+1(+1), width]`: what a history holding an item
    /// reads (Mult-VAE's first encoder layer by item; the item embedding, which is also the output
    /// layer's weight, for the others).
    pub fn input_rows(&self) -> &Matrix {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => m.view().item_embedding,
            Model::Vaecf(m) => m.view().first_by_item,
            Model::Gru4rec(m) => m.view().item_embedding,
            Model::Hstu(m) => m.input_rows(),
        }
    }

    pub fn output(&self) -> &OutputLayer {
        match self {
            Model::Bert4rec(m) | Model::Sasrec(m) => &m.output,
            Model::Vaecf(m) => &m.output,
            Model::Gru4rec(m) => &m.output,
            Model::Hstu(m) => &m.output,
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::kernels::{Isa, KernelTable};

    /// All-layer W8A8 against an f64 reference of what an explicit-quantization graph computes:
    /// x rounded to levels of the static scale, saturated to [-128, 127], times the dequantized
    /// int8 weights, plus the bias.
    #[test]
    fn a_static_activation_scale_quantizes_the_input_as_quantize_linear_does() {
        let (rows, cols, batch) = (11, 37, 5);
        let q: Vec<i8> = (0..rows * cols)
            .map(|i| ((i * 37 + 11) % 255) as i32 - 127)
            .map(|v| v as i8)
            .collect();
        let scales: Vec<f32> = (0..rows).map(|r| 0.01 + 0.003 * r as f32).collect();
        let weight = Matrix::I8 {
            q: crate::elements::Elements::from_vec(q.clone()),
            scales: crate::elements::Elements::from_vec(scales.clone()),
            start: 0,
            rows,
            cols,
        };
        let bias = Tensor::from_vec(vec![rows], (0..rows).map(|r| r as f32 * 0.1).collect());
        // Inputs reaching past both ends of the int8 range at this scale.
        let scale = 0.02f32;
        let x: Vec<f32> = (0..batch * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 * 6.0 - 3.0)
            .collect();
        let mut layer = DenseLayer::new("layer", &weight, &bias);
        layer.set_static_activation_scale(scale).unwrap();
        assert_eq!(layer.static_activation_scale(), Some(scale));
        for isa in Isa::available() {
            let kernels = KernelTable::for_isa(isa);
            let got = layer.forward(kernels, &x);
            for b in 0..batch {
                for r in 0..rows {
                    let mut want = bias.as_slice()[r] as f64;
                    for c in 0..cols {
                        let level = (x[b * cols + c] / scale)
                            .round_ties_even()
                            .clamp(-128.0, 127.0) as f64;
                        want += level * scale as f64 * q[r * cols + c] as f64 * scales[r] as f64;
                    }
                    let diff = (got[b * rows + r] as f64 - want).abs();
                    assert!(
                        diff < 1e-4,
                        "row {b} output {r}: {} vs {want}",
                        got[b * rows + r]
                    );
                }
            }
        }
        // Saturation is reached on both sides in this case.
        assert!(x.iter().any(|v| v / scale < -128.5) && x.iter().any(|v| v / scale > 127.5));
    }

    #[test]
    fn static_activation_scales_need_int8_weights() {
        let weight = Matrix::F32(Tensor::from_vec(vec![1, 2], vec![1.0, 2.0]));
        let bias = Tensor::from_vec(vec![1], vec![0.0]);
        let mut layer = DenseLayer::new("fp32_layer", &weight, &bias);
        let err = layer.set_static_activation_scale(0.1).unwrap_err();
        assert!(err.to_string().contains("fp32_layer"), "{err}");
    }
}
