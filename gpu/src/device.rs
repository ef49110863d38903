//! The kernels of `kernels/*.cu` as one typed interface, so the code that sequences them (the
//! top-k merge plan, the encoders in [`crate::model`]) is written once and runs on a CUDA device
//! ([`crate::cuda::CudaDevice`]) or, in the tests, on the CPU build of the very same kernel source.
//!
//! Every launch method names the kernel it runs; its buffers must hold what the kernel's comment
//! in the source says (implementations check nothing beyond that: the callers in this crate size
//! every buffer from the same shapes they pass).

use crate::{Result, Stage1Launch};

/// The activation a dense layer's epilogue applies (`ACTIVATION_*` in kernels/encoders.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Activation {
    None = 0,
    /// The exact GELU, `x/2 (1 + erf(x/sqrt 2))`.
    Gelu = 1,
    Tanh = 2,
}

/// A weight matrix on a device at its stored precision.
pub enum DeviceMatrix<D: Device + ?Sized> {
    F32(D::F32),
    F16(D::U16),
    I8 { q: D::I8, scales: D::F32 },
}

/// One device: buffers, copies and the kernel launches, in stream order.
pub trait Device {
    type F32;
    type U32;
    type U16;
    type I8;

    /// Weights and biases (at load).
    fn upload_f32(&self, values: &[f32]) -> Result<Self::F32>;
    /// A batch's inputs: indices, offsets, exclusions (the CUDA device stages these through
    /// page-locked memory).
    fn upload_u32(&self, values: &[u32]) -> Result<Self::U32>;
    fn upload_u16(&self, values: &[u16]) -> Result<Self::U16>;
    fn upload_i8(&self, values: &[i8]) -> Result<Self::I8>;
    /// A buffer of `len` values whose contents the next kernel overwrites.
    fn alloc_f32(&self, len: usize) -> Result<Self::F32>;
    fn alloc_u32(&self, len: usize) -> Result<Self::U32>;
    /// Waits for the stream and copies the buffer back.
    fn download_f32(&self, buffer: &Self::F32) -> Result<Vec<f32>>;
    fn download_u32(&self, buffer: &Self::U32) -> Result<Vec<u32>>;

    /// `score_tile_topk_{f32,f16,i8}`: stage 1 of the fused score + top-k.
    #[allow(clippy::too_many_arguments)]
    fn score_tile_topk(
        &self,
        launch: &Stage1Launch,
        hidden: &Self::F32,
        weights: &DeviceMatrix<Self>,
        activation_scale: f32,
        bias: &Self::F32,
        exclude_offsets: &Self::U32,
        exclude_ids: &Self::U32,
        batch: u32,
        n_items: u32,
        dim: u32,
        out_scores: &mut Self::F32,
        out_index: &mut Self::U32,
    ) -> Result<()>;

    /// `merge_topk`: one merge pass over `rows` rows of `count` candidates.
    #[allow(clippy::too_many_arguments)]
    fn merge_topk(
        &self,
        rows: u32,
        in_scores: &Self::F32,
        in_index: &Self::U32,
        count: u32,
        keep: u32,
        out_scores: &mut Self::F32,
        out_index: &mut Self::U32,
    ) -> Result<()>;

    /// `linear_f32`: `y[m, n] = act(x[m, k] w[n, k]^T + bias)`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: &Self::F32,
        weight: &Self::F32,
        bias: &Self::F32,
        y: &mut Self::F32,
        m: u32,
        n: u32,
        k: u32,
        activation: Activation,
    ) -> Result<()>;

    /// `add_layer_norm`: `y = LayerNorm(x + residual)` over `rows` rows of `width`.
    #[allow(clippy::too_many_arguments)]
    fn add_layer_norm(
        &self,
        x: &Self::F32,
        residual: Option<&Self::F32>,
        gamma: &Self::F32,
        beta: &Self::F32,
        y: &mut Self::F32,
        rows: u32,
        width: u32,
        eps: f64,
    ) -> Result<()>;

    /// `embed_tokens_{f32,f16,i8}`: `x[t] = positions_table[positions[t]] + table[items[t]]`.
    #[allow(clippy::too_many_arguments)]
    fn embed_tokens(
        &self,
        table: &DeviceMatrix<Self>,
        items: &Self::U32,
        positions: &Self::U32,
        position_table: &Self::F32,
        x: &mut Self::F32,
        tokens: u32,
        width: u32,
    ) -> Result<()>;

    /// `attention`: per sequence and head, `softmax(q k^T / sqrt(head_dim)) v`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::F32,
        k: &Self::F32,
        v: &Self::F32,
        seq_offsets: &Self::U32,
        out: &mut Self::F32,
        sequences: u32,
        heads: u32,
        head_dim: u32,
    ) -> Result<()>;

    /// `gather_rows`: `dst[i] = src[rows[i]]`.
    fn gather_rows(
        &self,
        src: &Self::F32,
        rows: &Self::U32,
        dst: &mut Self::F32,
        count: u32,
        width: u32,
    ) -> Result<()>;

    /// `embedding_bag_{f32,f16,i8}`: Mult-VAE's first layer over each history's distinct items.
    #[allow(clippy::too_many_arguments)]
    fn embedding_bag(
        &self,
        table: &DeviceMatrix<Self>,
        items: &Self::U32,
        offsets: &Self::U32,
        bias: &Self::F32,
        y: &mut Self::F32,
        rows: u32,
        width: u32,
    ) -> Result<()>;
}
