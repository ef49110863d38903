//! The recommenders. Each model turns a batch of histories (internal indices) into one hidden vector
//! per history; an [`OutputLayer`] then scores every item from it. Splitting there lets the scoring
//! and top-k step, which dominates the cost, be shared (and fused) across models.

pub mod bert4rec;
pub mod vaecf;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::import::Checkpoint;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

pub use bert4rec::Bert4Rec;
pub use vaecf::VaeCf;

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

/// A dense layer packed for the micro-kernels of [`crate::kernels::fused`] (`x @ W^T + b`).
#[derive(Clone, Debug)]
pub struct DenseLayer {
    packed: crate::kernels::packed::PackedOutput,
    /// The layer as stored (shares the engine's storage), for devices that pack it their own way.
    weight: Matrix,
    bias: Tensor,
}

impl DenseLayer {
    /// From a PyTorch-layout weight `[out, in]` (any precision) and bias `[out]`.
    pub fn new(weight: &Matrix, bias: &Tensor) -> DenseLayer {
        DenseLayer {
            packed: weight.pack(bias.as_slice()),
            weight: weight.clone(),
            bias: bias.clone(),
        }
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
        self.packed.weight_bytes() + 4 * self.packed.bias.len()
    }

    pub fn forward(&self, kernels: &crate::kernels::KernelTable, x: &[f32]) -> Vec<f32> {
        crate::kernels::fused::linear(kernels, &self.packed, x)
    }
}

/// A LayerNorm's affine parameters.
#[derive(Clone, Copy, Debug)]
pub struct NormView<'a> {
    pub gamma: &'a Tensor,
    pub beta: &'a Tensor,
}

/// One post-LN transformer layer of BERT4Rec.
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

/// Every tensor BERT4Rec runs with, by role; [`Bert4Rec::model_input`] gives its tokens.
#[derive(Clone, Debug)]
pub struct Bert4RecView<'a> {
    pub model: &'a Bert4Rec,
    pub item_embedding: &'a Matrix,
    pub position_embedding: &'a Tensor,
    pub embedding_norm: NormView<'a>,
    pub layers: Vec<TransformerLayerView<'a>>,
    pub head_dense: &'a DenseLayer,
    pub head_norm: NormView<'a>,
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
    Bert4rec(Bert4RecView<'a>),
    Vaecf(VaeCfView<'a>),
}

pub use crate::tensor::{take, TensorMap};

/// A model ready to run.
#[derive(Clone, Debug)]
pub enum Model {
    Bert4rec(Box<Bert4Rec>),
    Vaecf(Box<VaeCf>),
}

/// What a model reports about one history besides its hidden vector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistoryNote {
    /// The history was longer than the model's window and its oldest items were left out.
    pub truncated: bool,
}

impl Model {
    /// Picks, checks and re-lays-out the checkpoint tensors the model needs, under engine names.
    pub fn engine_tensors(
        config: &ModelConfig,
        ckpt: &Checkpoint,
    ) -> Result<Vec<(String, Tensor)>> {
        match config {
            ModelConfig::Bert4rec(c) => bert4rec::engine_tensors(c, ckpt),
            ModelConfig::Vaecf(c) => vaecf::engine_tensors(c, ckpt),
        }
    }

    /// The 2-D weights that `--precision fp16|int8` stores at that precision.
    pub fn quantizable(config: &ModelConfig) -> Vec<String> {
        match config {
            ModelConfig::Bert4rec(c) => bert4rec::quantizable(c),
            ModelConfig::Vaecf(c) => vaecf::quantizable(c),
        }
    }

    pub fn from_tensors(config: &ModelConfig, tensors: &Weights) -> Result<Model> {
        Ok(match config {
            ModelConfig::Bert4rec(c) => {
                Model::Bert4rec(Box::new(Bert4Rec::from_tensors(c.clone(), tensors)?))
            }
            ModelConfig::Vaecf(c) => {
                Model::Vaecf(Box::new(VaeCf::from_tensors(c.clone(), tensors)?))
            }
        })
    }

    /// Hidden vectors `[B, d]` for a batch of histories of internal indices (1..=N, oldest first).
    pub fn encode(&self, histories: &[&[u32]]) -> (Vec<f32>, Vec<HistoryNote>) {
        match self {
            Model::Bert4rec(m) => m.encode(histories),
            Model::Vaecf(m) => m.encode(histories),
        }
    }

    /// Runs the dense layers on `kernels` (the engine's single dispatch point calls this at load).
    pub fn set_kernels(&mut self, kernels: &'static crate::kernels::KernelTable) {
        match self {
            Model::Bert4rec(m) => m.set_kernels(kernels),
            Model::Vaecf(m) => m.set_kernels(kernels),
        }
    }

    /// Bytes of the packed copies of the dense layers (held in memory next to the mapped file).
    pub fn packed_bytes(&self) -> usize {
        match self {
            Model::Bert4rec(m) => m.packed_bytes(),
            Model::Vaecf(m) => m.packed_bytes(),
        }
    }

    /// The model's layers by role, for a device that runs the whole model (the GPU path).
    pub fn view(&self) -> ModelView<'_> {
        match self {
            Model::Bert4rec(m) => ModelView::Bert4rec(m.view()),
            Model::Vaecf(m) => ModelView::Vaecf(m.view()),
        }
    }

    pub fn output(&self) -> &OutputLayer {
        match self {
            Model::Bert4rec(m) => &m.output,
            Model::Vaecf(m) => &m.output,
        }
    }
}
