//! A whole decoder layer as one graph node with its backward written out (placeholder).

use candle_core::Tensor;

use super::fused::AttentionSpec;
use super::math::Act;

/// A projection's weight and bias, when it has one.
pub type Projection = (Tensor, Option<Tensor>);

/// The weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderWeights<'a> {
    /// RMSNorm before the attention `[h]`.
    pub input_norm: &'a Tensor,
    /// Query projection `[heads d, h]`.
    pub q: Projection,
    /// Key projection `[kv_heads d, h]`.
    pub k: Projection,
    /// Value projection `[kv_heads d, h]`.
    pub v: Projection,
    /// Attention output projection `[h, heads d]`.
    pub o: Projection,
    /// Per-head RMSNorm of the queries `[d]`.
    pub q_norm: Option<&'a Tensor>,
    /// Per-head RMSNorm of the keys `[d]`.
    pub k_norm: Option<&'a Tensor>,
    /// Gemma's RMSNorm of the attention output `[h]`.
    pub post_attention_norm: Option<&'a Tensor>,
    /// RMSNorm before the feed-forward `[h]`.
    pub mlp_norm: &'a Tensor,
    /// The gate projection `[I, h]`.
    pub gate: Projection,
    /// The up projection `[I, h]`.
    pub up: Projection,
    /// The down projection `[h, I]`.
    pub down: Projection,
    /// Gemma's RMSNorm of the feed-forward output `[h]`.
    pub post_mlp_norm: Option<&'a Tensor>,
}

/// Everything of a decoder layer besides its weights.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (a divisor of `heads`).
    pub kv_heads: usize,
    /// The gate's activation.
    pub act: Act,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Added to every norm's weight (Gemma's `1 + w`: 1; else 0).
    pub offset: f64,
    /// The key mask `[n, 1, 1, s]`, scale, dropout on the probabilities, their recompute,
    /// and the sliding window (see [`Self::causal`]).
    pub attention: AttentionSpec,
    /// Causal attention (`j <= i`; a window `w` then keeps `i - w <= j`), else
    /// bidirectional (a window keeps `|i - j| <= w`).
    pub causal: bool,
    /// The rotary tables `(cos, sin)` of positions `0..s`, `[s, d]` each.
    pub rotary: (Tensor, Tensor),
}

/// The layer as one node (not yet: the caller runs it op by op).
pub fn decoder_layer(
    _x: &Tensor,
    _w: &DecoderWeights,
    _spec: &DecoderSpec,
) -> candle_core::Result<Option<Tensor>> {
    Ok(None)
}
