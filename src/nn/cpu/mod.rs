//! Fused CPU kernels with hand-written backward passes, as candle custom ops.
//!
//! Each kernel replaces a chain of composed candle ops whose backward is where a training
//! step's time went (`cargo bench --bench fused_ops`, quickstart shapes, 2 cores): composed
//! LayerNorm 0.26 ms forward but 10.6 ms forward + backward, the scaled and masked softmax
//! 1.7 ms and 40 ms, GELU 25 ms forward + backward, dropout 11.5 ms. Composed, every
//! intermediate is a full-size tensor, and candle's backward adds a zero-filled
//! accumulator and an addition per graph edge. Fused, a row is read once forward and once
//! backward, and the backward of each op is one kernel.
//!
//! - [`LayerNorm`]: `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dimension;
//!   backward gives `dx`, `dgamma`, `dbeta` in one pass over the rows.
//! - [`MaskedSoftmax`]: `softmax(scale * scores + bias)` over the last dimension, with an
//!   additive key mask `bias` broadcast over heads and query rows (BERT's attention).
//! - [`Dropout`]: inverted dropout whose mask is regenerated from its seed on demand (a
//!   counter-based stream, see [`crate::rng::keep`]), so no mask is stored; backward
//!   applies the same mask.
//! - [`BiasActivation`]: `act(x + b)` for GELU (erf or tanh) and ReLU; backward recomputes
//!   the pre-activation and gives `dx` and `db`.
//!
//! Every kernel runs on contiguous f32 or f64 CPU tensors, split over rows in fixed blocks
//! on candle's CPU thread pool: reductions across rows (`dgamma`, `dbeta`, `db`) sum per-block
//! partials in block order, so results do not depend on the thread count or scheduling (exact
//! resume and bit-identical replays need that). [`crate::nn`] dispatches here on the CPU and to
//! the composed versions elsewhere (CUDA), and the tests hold the two equal forward and
//! backward.
//!
//! The kernels live in folders by what they do, one file per op family, as the GPU's
//! layer nodes ([`crate::nn::gpu`]) and CUDA kernels (`crate::nn::cuda`) are split:
//!
//! - [`attention`](mod@attention): the per-head and grouped-query kernels, their shapes and key masks,
//!   the attention nodes and the masked softmax;
//! - `products`: the matrix products (the gemm crate, a loaded BLAS, the panel kernel,
//!   transposed weight copies), the dense nodes and LoRA's low-rank branch;
//! - `layers`: each family's whole layer as one node, the embeddings, the packing of real
//!   tokens, and the pooling heads (mean, SPLADE's max);
//! - `convolution`: 2-D and 3-D convolutions, BatchNorm, VNet's unit;
//! - `losses`: InfoNCE's blocked kernel and MaxSim's;
//! - `elementwise`: rows of LayerNorm and RMSNorm, activations, dropout, additions in
//!   place, the vectorised maths.
//!
//! Beside them, `blocks` holds the thread blocks and vector copies every kernel runs on,
//! and `reference` the plain f64 forms of the CUDA kernels. This module is the one path
//! the rest of the crate reaches them by.

pub mod attention;
pub(crate) mod blocks;
pub(crate) mod convolution;
pub(crate) mod elementwise;
pub(crate) mod layers;
pub(crate) mod losses;
pub(crate) mod products;
pub(crate) mod reference;

// The public modules' paths from before the folders.
pub use layers::{
    decoder_layer, embeddings, encoder_layer, pooling, prenorm_layer, rotary_layer, splade,
};
pub use losses::infonce;
pub use products::panel_kernel;

pub use crate::nn::node::recomputed;
pub use attention::nodes::{attention, self_attention, self_attention_projections, AttentionSpec};
pub use attention::softmax::MaskedSoftmax;
pub(crate) use blocks::{for_blocks, parallel_ranges, SharedMut, BLOCK_ROWS};
pub use blocks::{serial, Float};
pub use convolution::conv2d::{batch_norm_train, conv2d};
pub use convolution::conv3d::conv3d;
pub use convolution::conv_unit::{conv_unit, Skip, UnitParams};
pub use elementwise::accumulate::{add_in_place, add_row_in_place};
pub use elementwise::activation::BiasActivation;
pub use elementwise::dropout::Dropout;
pub use elementwise::math::{exp, Act, EXP_UNDERFLOW_F32};
pub use elementwise::norm::{add_norm, add_norm_recomputed, LayerNorm};
pub use layers::embeddings::embeddings_recomputed;
pub use products::dense::{feed_forward_recomputed, linear};

#[cfg(test)]
mod tests;
