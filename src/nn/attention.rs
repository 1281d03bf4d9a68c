//! Attention: the masked softmax of the scores, scaled dot-product attention and BERT's
//! multi-head self-attention, each a fused node where the fused kernels run (the CPU's
//! [`crate::nn::cpu::attention`]) and composed candle ops elsewhere.

use candle_core::{DType, Tensor, D};

use super::{cast, cpu, dropout_composed, fused_ok, recomputed, window_bias, Linear};
use crate::precision::is_half;
use crate::Result;

/// `softmax(scale * scores + bias)` over the last dimension, for attention scores
/// `[n, heads, q, k]` and an additive key mask `bias` `[n, 1, 1, k]`: the fused kernel
/// where it runs, else [`masked_softmax_composed`]. No gradient flows to `bias`.
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    if is_half(scores.dtype()) {
        return widened_softmax(masked_softmax, scores, bias, scale);
    }
    if fused_ok(&[scores, bias]) && scores.rank() == 4 {
        return Ok(scores
            .contiguous()?
            .apply_op2(&bias.contiguous()?.detach(), cpu::MaskedSoftmax { scale })?);
    }
    masked_softmax_composed(scores, bias, scale)
}

/// Composed `softmax(scale * scores + bias)` (candle's differentiable `ops::softmax`).
pub fn masked_softmax_composed(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    if is_half(scores.dtype()) {
        return widened_softmax(masked_softmax_composed, scores, bias, scale);
    }
    let bias = cast(bias, scores.dtype())?;
    let x = (scores * scale)?.broadcast_add(&bias)?;
    Ok(candle_nn::ops::softmax(&x, D::Minus1)?)
}

/// `softmax` run in f32 on half-precision scores, the probabilities narrowed back.
fn widened_softmax(
    softmax: fn(&Tensor, &Tensor, f64) -> Result<Tensor>,
    scores: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let f32 = DType::F32;
    let p = softmax(&scores.to_dtype(f32)?, &cast(bias, f32)?, scale)?;
    Ok(p.to_dtype(scores.dtype())?)
}

/// Scaled dot-product attention with an additive key mask and dropout on the
/// probabilities, `dropout(softmax(scale * q k^T + bias)) v`, for `q`, `k`, `v`
/// `[n, heads, s, d]`: one node ([`cpu::attention`](fn@cpu::attention)) where the fused kernels
/// run, else [`attention_composed`]. With `spec.recompute` nothing of size `[n, heads, s, s]` is
/// kept for the backward, which recomputes the probabilities (the composed form then runs
/// inside a [`recomputed`] node).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, spec: &cpu::AttentionSpec) -> Result<Tensor> {
    if fused_ok(&[q, k, v, &spec.bias]) && q.rank() == 4 {
        return Ok(cpu::attention(q, k, v, spec)?);
    }
    if spec.recompute {
        let spec = spec.clone();
        return recomputed("gradcache-attention-recomputed", &[q, k, v], move |t| {
            attention_composed(&t[0], &t[1], &t[2], &spec)
        });
    }
    attention_composed(q, k, v, spec)
}

/// BERT's multi-head self-attention from the hidden states `x` `[n, s, h]`: the query,
/// key and value projections, the split into `heads`, [`attention()`](fn@attention), and the heads
/// merged back, `[n, s, h]` (before the output projection). Where the fused kernels run, one node
/// over the three projections ([`cpu::self_attention_projections`]); else composed.
pub fn self_attention(
    x: &Tensor,
    [query, key, value]: [&Linear; 3],
    heads: usize,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    let merged = query.merges() && key.merges() && value.merges();
    if let (Some(bq), Some(bk), Some(bv), true) = (&query.bias, &key.bias, &value.bias, merged) {
        let (wq, wk, wv) = (query.weight()?, key.weight()?, value.weight()?);
        let ts = [x, &wq, &wk, &wv, bq, bk, bv, &spec.bias];
        if fused_ok(&ts) && x.rank() == 3 {
            return Ok(cpu::self_attention_projections(
                x,
                [&wq, &wk, &wv],
                [bq, bk, bv],
                heads,
                spec,
            )?);
        }
    }
    self_attention_composed(x, [query, key, value], heads, spec)
}

/// Composed self-attention (see [`self_attention`]).
pub fn self_attention_composed(
    x: &Tensor,
    projections: [&Linear; 3],
    heads: usize,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    multi_head(x, projections, heads, |q, k, v| attention(q, k, v, spec))
}

/// Multi-head attention around `attend`: the query, key and value projections of `x`
/// `[n, s, h]` split into `heads` (`[n, heads, s, d]` each), `attend(q, k, v)`, and its
/// heads merged back, `[n, s, h]`.
pub(super) fn multi_head(
    x: &Tensor,
    [query, key, value]: [&Linear; 3],
    heads: usize,
    attend: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let split = |t: Tensor| -> Result<Tensor> {
        Ok(t.reshape((n, s, heads, h / heads))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let q = split(query.forward(x)?)?;
    let k = split(key.forward(x)?)?;
    let v = split(value.forward(x)?)?;
    let attended = attend(&q, &k, &v)?;
    Ok(attended.transpose(1, 2)?.reshape((n, s, h))?)
}

/// Composed attention (see [`attention()`](fn@attention)); keeps the probabilities for the
/// backward.
pub fn attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &cpu::AttentionSpec,
) -> Result<Tensor> {
    let bias = match spec.window {
        Some(w) => window_bias(q.dim(2)?, k.dim(2)?, w, q.device())?
            .to_dtype(spec.bias.dtype())?
            .broadcast_add(&spec.bias)?,
        None => spec.bias.clone(),
    };
    let probs = masked_softmax_composed(&q.matmul(&k.t()?)?, &bias, spec.scale)?;
    let probs = match spec.dropout {
        Some((seed, p)) if p > 0.0 => dropout_composed(&probs, seed, p)?,
        _ => probs,
    };
    Ok(probs.matmul(v)?)
}
