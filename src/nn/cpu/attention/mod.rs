//! The CPU's attention: scaled dot-product attention over small heads, one task per
//! (sequence, head), forward and backward.
//!
//! - [`heads`]: the per-head kernel (scores, masked softmax, context, and the backward),
//!   the one every encoder family's layer node runs;
//! - `disentangled`: DeBERTa's content-to-position and position-to-content terms of the
//!   scores on a layer node's packed buffer, and their backward;
//! - `grouped`: grouped key-value heads under a causal or windowed pattern, on a decoder
//!   layer's packed tokens;
//! - `layout`: where the kernels read and write, which rows they compute, the key mask;
//! - `nodes`: attention as graph nodes (over `q`, `k`, `v`, and BERT's self-attention
//!   from the hidden states);
//! - `packed`: a layer node's attention on its packed query-key-value buffer, in place;
//! - `softmax`: the scaled and masked softmax of attention scores as a custom op.
//!
//! The CUDA twin: the GPU layer nodes' attention (`crate::nn::gpu`, batched products and
//! the softmax and rotary kernels of `crate::nn::cuda`'s `attention.cu`).

pub(crate) mod disentangled;
pub(crate) mod grouped;
pub mod heads;
pub(crate) mod layout;
pub(crate) mod nodes;
pub(crate) mod packed;
pub(crate) mod softmax;

// The path of the per-head kernel's public items from before the folders.
pub use heads::{
    backward, forward, softmax_row, softmax_rows, softmax_shift, Dims, HeadLayout, KeyMask, Params,
    Rows, MASKED_BIAS, UNATTENDED_BIAS,
};
