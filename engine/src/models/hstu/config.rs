//! HSTU's hyper-parameters as the engine keeps them (resolved from the gin bindings or JSON by
//! `checkpoint::resolve_config`).

use serde::{Deserialize, Serialize};

/// HSTU as Meta's generative-recommenders research code builds it (`HSTU` with `linear_config
/// uvqk`, SiLU, the relative position and time bias, no affine layer norms), scored by the cosine
/// of the user embedding and each item's embedding. Names follow the official gin bindings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HstuConfig {
    pub n_items: usize,
    /// Most recent items kept (`max_sequence_length`).
    pub max_len: usize,
    /// `item_embedding_dim`: the width of every row the blocks carry.
    pub embedding_dim: usize,
    pub num_blocks: usize,
    pub num_heads: usize,
    /// Query and key width per head (`dqk`).
    pub dqk: usize,
    /// Value width per head (`dv`).
    pub dv: usize,
    /// The padded width of the official batch, `max_sequence_length + gr_output_length + 1`: the
    /// position embedding's rows, and the constant every attention weight is divided by.
    pub attention_width: usize,
    /// Log-spaced time-gap buckets of the relative bias (the bias table has one more row).
    pub time_buckets: usize,
}

impl HstuConfig {
    /// Epsilon of the layer norms (which have no affine parameters) and of both L2 norms, as the
    /// official code fixes them.
    pub const EPS: f64 = 1e-6;

    /// The uvqk projection's output width: `u`, `v` (heads x dv each), `q`, `k` (heads x dqk each).
    pub fn uvqk_width(&self) -> usize {
        2 * self.num_heads * (self.dv + self.dqk)
    }
}
