//! The kernels of `kernels/*.cu` as one typed interface, so the code that sequences them (the
//! top-k merge plan, the encoders in [`crate::model`]) is written once and runs on a CUDA device
//! ([`crate::cuda::CudaDevice`]) or, in the tests, on the CPU build of the very same kernel source.
//!
//! Every launch method names the kernel it runs; its buffers must hold what the kernel's comment
//! in the source says (implementations check nothing beyond that: the callers in this crate size
//! every buffer from the same shapes they pass).

use crate::{GemvLaunch, Result, Stage1Launch};

/// The activation a dense layer's epilogue applies (`ACTIVATION_*` in kernels/encoders.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Activation {
    None = 0,
    /// The exact GELU, `x/2 (1 + erf(x/sqrt 2))`.
    Gelu = 1,
    Tanh = 2,
    /// `x sigmoid(x)` (HSTU's projections).
    Silu = 3,
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
    /// A batch's input copied into `dst`, a kept buffer at least `values.len()` long (staged
    /// like [`Device::upload_u32`]).
    fn upload_u32_into(&self, values: &[u32], dst: &mut Self::U32) -> Result<()>;
    /// Waits for the stream and copies the buffer's first `len` values back (kept buffers may be
    /// longer than a batch's answers).
    fn download_f32(&self, buffer: &Self::F32, len: usize) -> Result<Vec<f32>>;
    fn download_u32(&self, buffer: &Self::U32, len: usize) -> Result<Vec<u32>>;

    /// `score_tile_topk_{f32,f16,i8}`: stage 1 of the fused score + top-k.
    fn score_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `sample_tile_topk_{f32,f16,i8}`: stage 1 over every `stride`-th item (`a.n_items` is the
    /// catalogue's size; the launch's tiles cover the sample's positions).
    fn sample_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `reset_survivors`: each of `rows` rows' count to 0 and its slots to padding.
    fn reset_survivors(&self, rows: u32, survivors: SurvivorsMut<'_, Self>) -> Result<()>;

    /// `score_above_{f32,f16,i8}`: the full scan keeping each row's scores at or above its
    /// threshold (`a.launch.keep` is not read).
    fn score_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()>;

    /// Blocks of the coalesced scans (`gemv_*`) for `weights`' precision with `shared_bytes` of
    /// shared memory each that the device runs at once: the grid they stride over the catalogue
    /// with.
    fn gemv_resident_blocks(&self, weights: &DeviceMatrix<Self>, shared_bytes: u32) -> Result<u32>;

    /// `gemv_sample_{f32,f16,i8}`: for a batch of at most `MAX_ROWS` rows, the score of every
    /// `stride`-th item (`positions` of them) into `out` (`batch x positions`, in position order;
    /// -inf and `u32::MAX` for PAD and exclusions). `a.launch` gives the pitch only.
    fn gemv_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `gemv_above_{f32,f16,i8}`: [`Device::score_above`] for a batch of at most `MAX_ROWS` rows
    /// through the coalesced scan, whose scores have the bits `gemv_sample` gives the same items.
    fn gemv_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()>;

    /// `gemm_sample_{f32,f16,i8}`: [`Device::gemv_sample`] for a batch of any size, through the
    /// tiled scan (blocks of `GEMM_ROWS` rows x `GEMM_ITEMS` positions).
    fn gemm_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `gemm_above_{f32,f16,i8}`: [`Device::score_above`] through the tiled scan, whose scores
    /// have the bits `gemm_sample` gives the same items.
    fn gemm_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()>;

    /// `sample_threshold`: each of `rows` rows' threshold, the `k`-th best of its `count`
    /// sampled scores (`sample` is `rows x count`; -inf where fewer than k are finite), into
    /// `thresholds` (`rows`), and its survivors emptied as [`Device::reset_survivors`] does.
    fn sample_threshold(
        &self,
        rows: u32,
        sample: &Self::F32,
        count: u32,
        k: u32,
        thresholds: &mut Self::F32,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()>;

    /// `finalize_survivors`: each of `rows` rows' top-`k` from its survivors (`capacity` slots a
    /// row, `counts` of them filled), sorted, into `out` (`rows x k`); a row whose ties at its
    /// k-th best exceed the tile gets a count past the capacity instead.
    fn finalize_survivors(
        &self,
        rows: u32,
        counts: &mut Self::U32,
        survivors: Candidates<'_, Self>,
        capacity: u32,
        k: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `merge_topk`: one merge pass over `rows` rows of `count` candidates, keeping `keep` per
    /// block of the tile size.
    fn merge_topk(
        &self,
        rows: u32,
        input: Candidates<'_, Self>,
        count: u32,
        keep: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()>;

    /// `linear_f32`: `y[m, n] = act(x[m, k] w[n, k]^T + bias)`.
    fn linear(&self, x: &Self::F32, layer: &DenseArgs<'_, Self>, y: &mut Self::F32) -> Result<()>;

    /// `add_layer_norm`: `y = LayerNorm(x + residual)`.
    fn add_layer_norm(
        &self,
        x: &Self::F32,
        residual: Option<&Self::F32>,
        norm: &NormArgs<'_, Self>,
        y: &mut Self::F32,
    ) -> Result<()>;

    /// `embed_tokens_{f32,f16,i8}`: `x[t] = positions_table[positions[t]] + table[items[t]]`.
    fn embed_tokens(
        &self,
        table: &DeviceMatrix<Self>,
        tokens: &TokenArgs<'_, Self>,
        x: &mut Self::F32,
    ) -> Result<()>;

    /// `attention`: per sequence and head, `softmax(q k^T / sqrt(head_dim)) v` (over the keys up
    /// to each query's slot when causal).
    fn attention(&self, a: &AttentionArgs<'_, Self>, out: &mut Self::F32) -> Result<()>;

    /// `gru_gates`: one GRU step of the running rows of `state`, the new state also into
    /// `outputs` at the step's token rows.
    fn gru_gates(
        &self,
        a: &GruGatesArgs<'_, Self>,
        state: &mut Self::F32,
        outputs: &mut Self::F32,
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
    fn embedding_bag(
        &self,
        table: &DeviceMatrix<Self>,
        bag: &BagArgs<'_, Self>,
        y: &mut Self::F32,
    ) -> Result<()>;

    /// `hstu_attention`: HSTU's biased pointwise attention within each history, per head.
    fn hstu_attention(&self, a: &HstuAttentionArgs<'_, Self>, out: &mut Self::F32) -> Result<()>;

    /// `hstu_gate`: `gated = u * normed` over `rows` rows, `u` the first `values` columns of each
    /// `width`-wide row of `uvqk`.
    fn hstu_gate(
        &self,
        uvqk: &Self::F32,
        normed: &Self::F32,
        gated: &mut Self::F32,
        rows: u32,
        values: u32,
        width: u32,
    ) -> Result<()>;

    /// `add_rows`: `y += x` over `rows` rows of `width`.
    fn add_rows(&self, y: &mut Self::F32, x: &Self::F32, rows: u32, width: u32) -> Result<()>;

    /// `l2_normalize_rows`: each of `rows` rows divided by `max(its L2 norm, eps)`.
    fn l2_normalize_rows(&self, x: &mut Self::F32, rows: u32, width: u32, eps: f32) -> Result<()>;
}

/// A pair of device buffers of (score, item index) candidates, `rows x count` each.
pub struct Candidates<'a, D: Device + ?Sized> {
    pub scores: &'a D::F32,
    pub index: &'a D::U32,
}

/// Candidate buffers a kernel writes.
pub struct CandidatesMut<'a, D: Device + ?Sized> {
    pub scores: &'a mut D::F32,
    pub index: &'a mut D::U32,
}

/// Each row's threshold: `scores[row x pitch + at]` (the sample's merged top-k, its k-th best).
pub struct Thresholds<'a, D: Device + ?Sized> {
    pub scores: &'a D::F32,
    pub pitch: u32,
    pub at: u32,
}

/// The threshold scan's output: per row a count and `capacity` (score, index) slots.
pub struct SurvivorsMut<'a, D: Device + ?Sized> {
    pub counts: &'a mut D::U32,
    pub scores: &'a mut D::F32,
    pub index: &'a mut D::U32,
    pub capacity: u32,
}

/// What stage 1 of the fused score + top-k reads: the batch's hidden vectors (`batch x dim`), the
/// output layer (`n_items` rows at `launch.pitch`), its bias and each row's exclusions (CSR).
pub struct Stage1Inputs<'a, D: Device + ?Sized> {
    pub launch: &'a Stage1Launch,
    pub hidden: &'a D::F32,
    pub weights: &'a DeviceMatrix<D>,
    /// W8A8 engines' static activation scale; 0 for the others.
    pub activation_scale: f32,
    pub bias: &'a D::F32,
    pub exclude_offsets: &'a D::U32,
    pub exclude_ids: &'a D::U32,
    pub batch: u32,
    pub n_items: u32,
    pub dim: u32,
}

/// A dense layer applied to `m` rows: `weight` is `n x k`, `bias` `n`.
pub struct DenseArgs<'a, D: Device + ?Sized> {
    pub weight: &'a D::F32,
    pub bias: &'a D::F32,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub activation: Activation,
}

/// A LayerNorm over `rows` rows of `width`.
pub struct NormArgs<'a, D: Device + ?Sized> {
    pub gamma: &'a D::F32,
    pub beta: &'a D::F32,
    pub rows: u32,
    pub width: u32,
    pub eps: f64,
}

/// BERT4Rec's token inputs: `tokens` (item, position) pairs and the position table.
pub struct TokenArgs<'a, D: Device + ?Sized> {
    pub items: &'a D::U32,
    pub positions: &'a D::U32,
    pub position_table: &'a D::F32,
    pub tokens: u32,
    pub width: u32,
}

/// Attention over `sequences` sequences (token ranges `seq_offsets`) of `heads` heads.
pub struct AttentionArgs<'a, D: Device + ?Sized> {
    pub q: &'a D::F32,
    pub k: &'a D::F32,
    pub v: &'a D::F32,
    pub seq_offsets: &'a D::U32,
    pub sequences: u32,
    pub heads: u32,
    pub head_dim: u32,
    /// SASRec: each query sees its own and earlier slots only.
    pub causal: bool,
}

/// One GRU step: `rows` running histories, whose input-side gates are the rows of `input_gates`
/// from `first_token` on and whose state-side gates are `state_gates` (`[rows, 3 x hidden]`).
pub struct GruGatesArgs<'a, D: Device + ?Sized> {
    pub input_gates: &'a D::F32,
    pub state_gates: &'a D::F32,
    pub rows: u32,
    pub first_token: u32,
    pub hidden: u32,
}

/// Mult-VAE's first layer over `rows` histories: their distinct items as CSR, and the bias.
pub struct BagArgs<'a, D: Device + ?Sized> {
    pub items: &'a D::U32,
    pub offsets: &'a D::U32,
    pub bias: &'a D::F32,
    pub rows: u32,
    pub width: u32,
}

/// HSTU's attention over `sequences` histories (token ranges `seq_offsets`, oldest first) of
/// `heads` heads: every token's `u|v|q|k` after the SiLU (`2 heads (dv + dqk)` wide), each
/// history's time-gap buckets (`[n, n]` at `bucket_offsets[s]`, row `i` against keys `0..=i`),
/// and the block's bias tables (`[2 attention_width - 1]` by position offset, one weight per
/// bucket).
pub struct HstuAttentionArgs<'a, D: Device + ?Sized> {
    pub uvqk: &'a D::F32,
    pub seq_offsets: &'a D::U32,
    pub buckets: &'a D::U16,
    pub bucket_offsets: &'a D::U32,
    pub position_bias: &'a D::F32,
    pub time_bias: &'a D::F32,
    pub sequences: u32,
    pub heads: u32,
    pub dqk: u32,
    pub dv: u32,
    pub attention_width: u32,
}

impl<D: Device + ?Sized> HstuAttentionArgs<'_, D> {
    /// Columns of a `uvqk` row.
    pub fn width(&self) -> u32 {
        2 * self.heads * (self.dv + self.dqk)
    }
}

// The argument structs hold references and numbers only, so they copy like the arguments they
// replace (derive would ask for `D: Copy`).
macro_rules! copy_args {
    ($($name:ident),*) => {
        $(
            impl<D: Device + ?Sized> Clone for $name<'_, D> {
                fn clone(&self) -> Self {
                    *self
                }
            }
            impl<D: Device + ?Sized> Copy for $name<'_, D> {}
        )*
    };
}
copy_args!(
    Candidates,
    Thresholds,
    Stage1Inputs,
    DenseArgs,
    NormArgs,
    TokenArgs,
    AttentionArgs,
    GruGatesArgs,
    BagArgs,
    HstuAttentionArgs
);
