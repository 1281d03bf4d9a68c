//! The ops the newer families add to BERT's, each run as a fused node where the fused
//! kernels run and composed elsewhere: the gated linear unit (ModernBERT's GeGLU), rotary
//! position embeddings, attention under a sliding window or an additive bias of any shape
//! (MPNet's relative position bias, which is trained); the decoders' RMSNorm, token
//! embeddings, grouped-query attention under causal and windowed patterns, and their
//! whole layer.

use candle_core::{Tensor, D};

use super::cpu::elementwise::gated;
use super::cpu::prenorm_layer::{PreNormSpec, PreNormWeights};
use super::{attention_composed, cast, cpu, fused_ok, multi_head, recomputed, Act, Linear};
use crate::Result;

/// The gated linear unit `act(a) * g` over the halves `[a, g]` of `x`'s last dimension
/// (ModernBERT's GeGLU with GELU): one node keeping `x` (`gated::glu`) where the fused
/// kernels run, else composed.
pub fn glu(x: &Tensor, act: Act) -> Result<Tensor> {
    if fused_ok(&[x]) {
        return Ok(gated::glu(x, act)?);
    }
    glu_composed(x, act)
}

/// Composed `act(a) * g` (see [`glu`]).
pub fn glu_composed(x: &Tensor, act: Act) -> Result<Tensor> {
    let w = x.dim(D::Minus1)? / 2;
    let (a, g) = (x.narrow(D::Minus1, 0, w)?, x.narrow(D::Minus1, w, w)?);
    let a = match act {
        Act::GeluErf => a.gelu_erf()?,
        Act::GeluTanh => a.gelu()?,
        Act::Relu => a.relu()?,
        Act::Silu => a.silu()?,
    };
    Ok((a * g)?)
}

/// Rotary position embedding of `x` `[.., s, d]` with tables `[s, d]`: `x cos +
/// rotate_half(x) sin`, `rotate_half([u, v]) = [-v, u]` over the two halves. One node
/// keeping nothing (`gated::rotary`) where the fused kernels run, else composed.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if fused_ok(&[x]) && x.is_contiguous() {
        return Ok(gated::rotary(x, cos, sin)?);
    }
    rotary_composed(x, cos, sin)
}

/// Composed rotary embedding (see [`rotary`]).
pub fn rotary_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (u, v) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    let rotated = Tensor::cat(&[&v.neg()?, &u], D::Minus1)?;
    let cos = cos.to_dtype(x.dtype())?;
    let sin = sin.to_dtype(x.dtype())?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

/// The additive mask `[1, 1, q, k]` of a sliding window: 0 where `|i - j| <= w`, else
/// -10000 (masked). A query row with no key inside the window is left unmasked, as the
/// fused kernel leaves it.
pub fn window_bias(
    queries: usize,
    keys: usize,
    w: usize,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mut bias = vec![0f32; queries * keys];
    for (i, row) in bias.chunks_exact_mut(keys).enumerate() {
        let (lo, hi) = (i.saturating_sub(w), (i + w + 1).min(keys));
        if lo < hi {
            row[..lo].fill(-10000.0);
            row[hi..].fill(-10000.0);
        }
    }
    Ok(Tensor::from_vec(bias, (1, 1, queries, keys), device)?)
}

/// Attention whose `spec.bias` may be any additive bias that broadcasts to the scores
/// `[n, heads, q, k]` (a sliding-window mask `[n, 1, q, k]`, a trainable bias per head),
/// composed so that a trainable bias gets its gradient; with the spec's `recompute` the
/// probabilities are recomputed in the backward pass instead of kept.
pub fn attention_with_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    if !spec.recompute {
        return attention_composed(q, k, v, spec);
    }
    let spec = spec.clone();
    recomputed(
        "gradcache-biased-attention",
        &[q, k, v, &spec.bias.clone()],
        move |t| {
            let spec = cpu::AttentionSpec {
                bias: t[3].clone(),
                ..spec.clone()
            };
            attention_composed(&t[0], &t[1], &t[2], &spec)
        },
    )
}

/// Self-attention whose scores get, besides the spec's key mask, an additive bias per head
/// and (query, key) pair, `score_bias` `[1 or n, heads, s, s]`, that is itself trained
/// (MPNet's relative position bias): `softmax(scale q k^T + mask + score_bias)`. Composed
/// ops, so the bias receives its gradient; with the spec's `recompute` the probabilities
/// are recomputed in the backward pass instead of kept.
pub fn self_attention_biased(
    x: &Tensor,
    projections: [&Linear; 3],
    heads: usize,
    spec: &cpu::AttentionSpec,
    score_bias: &Tensor,
) -> Result<Tensor> {
    self_attention_scored(x, projections, heads, spec, |_, _| Ok(score_bias.clone()))
}

/// Self-attention whose scores get an additive bias computed from the heads' queries and
/// keys `[n, heads, s, d]`: `softmax(scale q k^T + mask + score_bias(q, k))` (DeBERTa's
/// disentangled terms), composed as [`self_attention_biased`].
pub fn self_attention_scored(
    x: &Tensor,
    projections: [&Linear; 3],
    heads: usize,
    spec: &cpu::AttentionSpec,
    score_bias: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    multi_head(x, projections, heads, |q, k, v| {
        let score_bias = score_bias(q, k)?;
        let bias = cast(&score_bias, q.dtype())?.broadcast_add(&cast(&spec.bias, q.dtype())?)?;
        let spec = cpu::AttentionSpec {
            bias,
            ..spec.clone()
        };
        attention_with_bias(q, k, v, &spec)
    })
}

/// A whole pre-norm layer (ModernBERT's) as one node with its backward written out where
/// one runs: the CPU's ([`super::cpu::prenorm_layer::prenorm_layer`]) where the fused
/// kernels run, the GPU's ([`super::gpu::prenorm_layer`](fn@super::gpu::prenorm_layer)) on a GPU; `None` elsewhere (the
/// caller then runs the layer op by op).
pub fn prenorm_layer(
    x: &Tensor,
    weights: &PreNormWeights,
    spec: &PreNormSpec,
) -> Result<Option<Tensor>> {
    let mut all = vec![x, &spec.attention.bias];
    let (n1, b1) = match weights.attention_norm {
        Some((g, b)) => (Some(g), b),
        None => (None, None),
    };
    all.extend(n1.into_iter().chain(b1));
    all.push(weights.mlp_norm.0);
    all.extend(weights.mlp_norm.1);
    let projections = [
        weights.qkv,
        weights.attention_output,
        weights.up,
        weights.down,
    ];
    all.extend(projections.iter().filter_map(|(_, b)| *b));
    let bases: Vec<&Tensor> = projections.iter().map(|(w, _)| *w).collect();
    if fused_ok(&all) && super::frozen_base_ok(x, &bases, &weights.lora) && x.rank() == 3 {
        return Ok(Some(super::cpu::prenorm_layer::prenorm_layer(
            x, weights, spec,
        )?));
    }
    if super::gpu_node_ok(x) {
        return Ok(Some(super::gpu::prenorm_layer(x, weights, spec)?));
    }
    Ok(None)
}

/// A whole post-norm rotary layer (NomicBERT's, GTE's, Jina v3's) as one node with its
/// backward written out ([`super::cpu::rotary_layer::rotary_layer`]) where the fused
/// kernels run; `None` elsewhere (the caller then runs the layer op by op).
pub fn rotary_post_norm_layer(
    x: &Tensor,
    weights: &super::cpu::rotary_layer::RotaryWeights,
    spec: &super::cpu::rotary_layer::RotarySpec,
) -> Result<Option<Tensor>> {
    let mut all = vec![
        x,
        &spec.attention.bias,
        weights.attention_norm.0,
        weights.attention_norm.1,
        weights.mlp_norm.0,
        weights.mlp_norm.1,
    ];
    let projections = [
        weights.qkv,
        weights.attention_output,
        weights.up,
        weights.down,
    ];
    all.extend(projections.iter().filter_map(|(_, b)| *b));
    let bases: Vec<&Tensor> = projections.iter().map(|(w, _)| *w).collect();
    if fused_ok(&all) && super::frozen_base_ok(x, &bases, &weights.lora) && x.rank() == 3 {
        return Ok(Some(super::cpu::rotary_layer::rotary_layer(
            x, weights, spec,
        )?));
    }
    Ok(None)
}

/// A whole decoder layer as one node with its backward written out where one runs: the
/// CPU's ([`super::cpu::decoder_layer::decoder_layer`]) where the fused kernels run, the
/// GPU's ([`super::gpu::decoder_layer`](fn@super::gpu::decoder_layer), each token's rotary row at `positions` `[n s]`)
/// on a GPU; `None` elsewhere (the caller then runs the layer op by op).
pub fn decoder_layer(
    x: &Tensor,
    weights: &super::cpu::decoder_layer::DecoderWeights,
    spec: &super::cpu::decoder_layer::DecoderSpec,
    positions: &Tensor,
) -> Result<Option<Tensor>> {
    let mut all = vec![
        x,
        &spec.attention.bias,
        weights.input_norm,
        weights.mlp_norm,
    ];
    let projections = [
        &weights.q,
        &weights.k,
        &weights.v,
        &weights.o,
        &weights.gate,
        &weights.up,
        &weights.down,
    ];
    all.extend(projections.iter().filter_map(|(_, b)| b.as_ref()));
    let bases: Vec<&Tensor> = projections.iter().map(|(w, _)| w).collect();
    all.extend(
        [
            weights.q_norm,
            weights.k_norm,
            weights.post_attention_norm,
            weights.post_mlp_norm,
        ]
        .into_iter()
        .flatten(),
    );
    if fused_ok(&all) && super::frozen_base_ok(x, &bases, &weights.lora) && x.rank() == 3 {
        return Ok(super::cpu::decoder_layer::decoder_layer(x, weights, spec)?);
    }
    if super::gpu_node_ok(x) {
        return Ok(Some(super::gpu::decoder_layer(
            x, weights, spec, positions,
        )?));
    }
    Ok(None)
}

/// A token embedding lookup `table[ids] * scale` (`[n, s]` ids into `[n, s, h]`; row
/// `padding_idx` untrained, as PyTorch's) as one node whose backward adds only the rows the
/// tokens touched into the gradient sink ([`super::cpu::embeddings::token_embeddings`]) where the
/// fused kernels run; `None` elsewhere.
pub fn token_embeddings(
    ids: &Tensor,
    table: &Tensor,
    scale: Option<f64>,
    padding_idx: Option<u32>,
) -> Result<Option<Tensor>> {
    if !fused_ok(&[table]) || ids.rank() != 2 {
        return Ok(None);
    }
    Ok(Some(super::cpu::embeddings::token_embeddings(
        ids,
        table,
        scale,
        padding_idx,
    )?))
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x^2) + eps) * (offset + weight)`
/// (`offset` 0 for Llama and the Qwen models, 1 for Gemma's `(1 + weight)`): a GPU node
/// on a GPU ([`super::gpu::rms_norm`]), else composed of differentiable ops; the
/// statistics in f32 for a half-precision `x`, the result in its dtype, as transformers
/// computes it.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset: f64) -> Result<Tensor> {
    if super::gpu_op_ok(x) {
        return Ok(super::gpu::rms_norm(x, weight, eps, offset)?);
    }
    let dtype = x.dtype();
    let wide_dtype = if crate::precision::is_half(dtype) {
        candle_core::DType::F32
    } else {
        dtype
    };
    let wide = cast(x, wide_dtype)?;
    let inv = (wide.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let normed = wide.broadcast_mul(&inv)?;
    let scale = cast(weight, wide_dtype)?;
    let scale = if offset != 0.0 {
        (scale + offset)?
    } else {
        scale
    };
    cast(&normed.broadcast_mul(&scale)?, dtype)
}

/// The additive mask `[1, 1, s, s]` of a decoder layer's pattern: 0 where query `i` sees
/// key `j`, -10000 elsewhere. Causal: `j <= i` (and `i - j <= w` with a window `w`);
/// bidirectional with a window: `|i - j| <= w`; `None` with neither.
pub fn pattern_bias(
    s: usize,
    causal: bool,
    window: Option<usize>,
    device: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if !causal && window.is_none() {
        return Ok(None);
    }
    let mut bias = vec![0f32; s * s];
    for (i, row) in bias.chunks_exact_mut(s).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            let seen = match (causal, window) {
                (true, w) => j <= i && w.is_none_or(|w| i - j <= w),
                (false, Some(w)) => i.abs_diff(j) <= w,
                (false, None) => true,
            };
            if !seen {
                *v = -10000.0;
            }
        }
    }
    Ok(Some(Tensor::from_vec(bias, (1, 1, s, s), device)?))
}

/// Attention with grouped key-value heads, composed: `q` `[n, heads, s, d]`, `k` and `v`
/// `[n, kv_heads, s, d]`, each key-value head serving `heads / kv_heads` consecutive query
/// heads (transformers' `repeat_kv`). The queries of a group are stacked as rows of one
/// product with their key head (`[n, kv_heads, group s, d]`), so no key or value is
/// copied per query head. `spec.bias` broadcasts to `[n, 1, s, s]` (the key mask with the
/// causal or windowed pattern); dropout masks are those of the `[n, heads, s, s]`
/// probabilities. With `spec.recompute` the probabilities are recomputed in the backward.
pub fn grouped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    if !spec.recompute {
        return grouped_attention_composed(q, k, v, spec);
    }
    let spec = spec.clone();
    recomputed("gradcache-grouped-attention", &[q, k, v], move |t| {
        grouped_attention_composed(&t[0], &t[1], &t[2], &spec)
    })
}

/// [`grouped_attention`]'s ops (probabilities kept for the backward).
pub fn grouped_attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    let (n, heads, s, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let group = heads / kv.max(1);
    let stacked = q.reshape((n, kv, group * s, d))?;
    let scores = stacked.matmul(&k.t()?)?.reshape((n, kv, group, s, s))?;
    let bias = cast(&spec.bias, scores.dtype())?.unsqueeze(1)?;
    let probs = super::masked_softmax_composed(&scores, &bias, spec.scale)?;
    let probs = match spec.dropout {
        Some((seed, p)) if p > 0.0 => super::dropout_composed(&probs, seed, p)?,
        _ => probs,
    };
    let context = probs.reshape((n, kv, group * s, s))?.matmul(v)?;
    Ok(context.reshape((n, heads, s, d))?)
}
