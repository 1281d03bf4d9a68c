//! Differentiable building blocks.
//!
//! Some of candle's fused ops have no backward pass and silently cut the graph:
//! `candle_nn::LayerNorm` on contiguous input (it calls the fused `ops::layer_norm`),
//! `ops::rms_norm`, `ops::softmax_last_dim`. Nothing fails, the parameters behind them just
//! never receive a gradient. The layers here are differentiable. Each hot piece is one
//! function with two implementations side by side: a fused kernel with a hand-written
//! backward ([`cpu`]) for f32/f64 tensors on the CPU, and the composed candle ops it
//! replaces (`*_composed`), which run everywhere else (CUDA, half precision). The tests
//! hold the two equal forward and backward.
//!
//! Mixed precision ([`crate::precision`]): the activations' dtype decides. A layer casts
//! its (f32 master) weights to the dtype of its input with a tracked cast, so a bf16 or
//! f16 input runs the layer in that dtype and the weight gradient comes back in f32;
//! LayerNorm and the attention softmax widen half-precision inputs to f32 for their
//! statistics and narrow the result back.

mod attention;
mod batch_norm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod dispatch;
pub mod family_ops;
pub mod gpu;
pub(crate) mod kernels;
mod layer_norm;
mod linear_layer;
pub mod lora;
mod node;

use attention::multi_head;
pub use attention::{
    attention, attention_composed, masked_softmax, masked_softmax_composed, self_attention,
    self_attention_composed,
};
pub use batch_norm::BatchNorm;
pub(crate) use dispatch::{frozen_base_ok, fused_f32, fused_ok, gpu_node_ok, gpu_op_ok};
pub use dispatch::{fused_kernels, run_gpu_nodes_on_cpu, set_fused_kernels, set_gpu_nodes};
pub use family_ops::{
    attention_with_bias, decoder_layer, glu, glu_composed, grouped_attention,
    grouped_attention_composed, pattern_bias, prenorm_layer, rms_norm, rotary, rotary_composed,
    rotary_post_norm_layer, self_attention_biased, self_attention_scored, token_embeddings,
    window_bias,
};
pub use layer_norm::LayerNorm;
pub use linear_layer::Linear;

use candle_core::{DType, Tensor, D};

use crate::precision::is_half;
use crate::Result;

pub use cpu::attention::{MASKED_BIAS, UNATTENDED_BIAS};
pub use cpu::blocks::serial;
pub use cpu::panel_kernel::{panel_kernel_from_env, PanelKernel, PANEL_KERNEL_ENV};
pub use cpu::products::blas::{
    blas_in_use, set_blas_products, use_blas, use_blas_from_env, BlasInfo, BLAS_ENV,
};
pub use cpu::products::gemm::{packing_from_env, PackingThresholds, PACKING_ENV};
pub use cpu::products::transposed::{TransposedWeights, TRANSPOSED_BUDGET};
pub use cpu::products::weight_products::panel_product;
pub use cpu::{Act, AttentionSpec};

/// `t` in `dtype`: a tracked cast, or `t` itself when it already is.
fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(if t.dtype() == dtype {
        t.clone()
    } else {
        t.to_dtype(dtype)?
    })
}

/// The residual block's tail, `norm(dropout(x) + residual)`, `dropout` the mask seed and
/// probability ([`crate::rng::keep`]) or `None`: one node ([`cpu::add_norm`]) where the
/// fused kernels run, else composed.
pub fn add_norm(
    x: &Tensor,
    residual: &Tensor,
    norm: &LayerNorm,
    dropout: Option<(u64, f32)>,
) -> Result<Tensor> {
    if is_half(x.dtype()) {
        // The residual sum and the statistics in f32 (the dropout mask is the same).
        let f32 = DType::F32;
        let wide_norm = LayerNorm {
            weight: cast(&norm.weight, f32)?,
            bias: cast(&norm.bias, f32)?,
            eps: norm.eps,
            has_bias: norm.has_bias,
        };
        let wide = add_norm(
            &x.to_dtype(f32)?,
            &cast(residual, f32)?,
            &wide_norm,
            dropout,
        )?;
        return Ok(wide.to_dtype(x.dtype())?);
    }
    if fused_ok(&[x, residual, &norm.weight, &norm.bias]) {
        let gamma_beta = Tensor::stack(&[&norm.weight, &norm.bias], 0)?;
        return Ok(cpu::add_norm(x, residual, &gamma_beta, norm.eps, dropout)?);
    }
    add_norm_composed(x, residual, norm, dropout)
}

/// [`add_norm`] as a node that keeps only its inputs: the residual sum under the
/// LayerNorm (kept by [`add_norm`]) is recomputed in the backward pass.
pub fn add_norm_recomputed(
    x: &Tensor,
    residual: &Tensor,
    norm: &LayerNorm,
    dropout: Option<(u64, f32)>,
) -> Result<Tensor> {
    if fused_ok(&[x, residual, &norm.weight, &norm.bias]) {
        let gamma_beta = Tensor::stack(&[&norm.weight, &norm.bias], 0)?;
        return Ok(cpu::add_norm_recomputed(
            x,
            residual,
            &gamma_beta,
            norm.eps,
            dropout,
        )?);
    }
    let eps = norm.eps;
    recomputed(
        "gradcache-add-norm-recomputed",
        &[x, residual, &norm.weight, &norm.bias],
        move |t| {
            let norm = LayerNorm {
                weight: t[2].clone(),
                bias: t[3].clone(),
                eps,
                has_bias: true,
            };
            add_norm(&t[0], &t[1], &norm, dropout)
        },
    )
}

/// BERT's embeddings, `dropout(norm(words[ids] + types[type_ids] + positions[f..f+s]))`
/// with `f` the `first_position` (0 for BERT, past the padding index for RoBERTa), as
/// one node whose backward adds only the rows the tokens touched
/// ([`cpu::embeddings::embeddings`]) where the fused kernels run; `None` elsewhere (the caller
/// then runs the separate ops). With `recompute` it keeps nothing but the ids, else the
/// sum under the LayerNorm.
pub fn embeddings(
    ids: [&Tensor; 2],
    tables: [&Tensor; 3],
    first_position: usize,
    norm: &LayerNorm,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> Result<Option<Tensor>> {
    let [words, types, positions] = tables;
    if !fused_ok(&[words, types, positions, &norm.weight, &norm.bias]) {
        return Ok(None);
    }
    Ok(Some(cpu::embeddings::embeddings_from(
        ids,
        tables,
        first_position,
        [&norm.weight, &norm.bias],
        norm.eps,
        dropout,
        recompute,
    )?))
}

/// A whole post-norm encoder layer (BERT's) as one node with its backward written out
/// ([`cpu::encoder_layer::encoder_layer`]) where the fused kernels run; `None` elsewhere (the
/// caller then runs the layer op by op).
pub fn encoder_layer(
    x: &Tensor,
    weights: &cpu::encoder_layer::LayerWeights,
    spec: &cpu::encoder_layer::LayerSpec,
) -> Result<Option<Tensor>> {
    let mut all = vec![x, &spec.attention.bias];
    all.extend(weights.qkv_bias);
    for (a, b) in [weights.attention_norm, weights.output_norm] {
        all.extend([a, b]);
    }
    all.extend([
        weights.attention_output.1,
        weights.intermediate.1,
        weights.output.1,
    ]);
    let [wq, wk, wv] = weights.qkv;
    let bases = [
        wq,
        wk,
        wv,
        weights.attention_output.0,
        weights.intermediate.0,
        weights.output.0,
    ];
    if let Some(rel) = &spec.relative {
        all.extend(rel.key.iter().chain(&rel.query));
    }
    if fused_ok(&all) && frozen_base_ok(x, &bases, &weights.lora) && x.rank() == 3 {
        return Ok(Some(cpu::encoder_layer::encoder_layer(x, weights, spec)?));
    }
    // The GPU node has no disentangled attention (DeBERTa runs op by op there).
    if gpu_node_ok(x) && spec.attention.window.is_none() && spec.relative.is_none() {
        return Ok(Some(gpu::encoder_layer(x, weights, spec)?));
    }
    Ok(None)
}

/// A transformer's feed-forward block without the residual, `down(act(up(x)))`. With
/// `recompute` the activation's output (`[.., up width]`, the widest activation of the
/// layer) is not kept: the activation and `down` form one node over `up`'s output that
/// recomputes the activation in the backward pass ([`recomputed`]).
pub fn feed_forward(
    x: &Tensor,
    up: &Linear,
    act: Act,
    down: &Linear,
    recompute: bool,
) -> Result<Tensor> {
    if !recompute || !up.merges() || !down.merges() {
        // (An adapter with dropout on its input has no merged weight to recompute with.)
        return down.forward(&up.forward_activated(x, act)?);
    }
    let (up_weight, down_weight) = (up.weight()?, down.weight()?);
    let width = up_weight.dim(0)?;
    let up_bias = match up.bias() {
        Some(b) => b.clone(),
        None => Tensor::zeros(width, up_weight.dtype(), up_weight.device())?,
    };
    let mut all = vec![x, &up_weight, &up_bias, &down_weight];
    all.extend(down.bias());
    if fused_ok(&all) {
        return Ok(cpu::feed_forward_recomputed(
            x,
            &up_weight,
            &up_bias,
            &down_weight,
            down.bias(),
            act,
        )?);
    }
    let pre = linear(x, &up_weight, None)?;
    let mut inputs = vec![&pre, &up_bias, &down_weight];
    inputs.extend(down.bias());
    recomputed("gradcache-feed-forward-recomputed", &inputs, move |t| {
        let hidden = bias_activation(&t[0], &t[1], act)?;
        linear(&hidden, &t[2], t.get(3))
    })
}

/// Composed `norm(dropout(x) + residual)` (see [`add_norm`]).
pub fn add_norm_composed(
    x: &Tensor,
    residual: &Tensor,
    norm: &LayerNorm,
    dropout: Option<(u64, f32)>,
) -> Result<Tensor> {
    let x = match dropout {
        Some((seed, p)) if p > 0.0 => dropout_composed(x, seed, p)?,
        _ => x.clone(),
    };
    layer_norm_composed(&(x + residual)?, &norm.weight, &norm.bias, norm.eps)
}

/// The mean of `x` `[n, s, h]` over the positions where `mask` `[n, s]` is 1, then
/// [`l2_normalize`]d with `normalize`: the fused node ([`cpu::pooling::mean_pool`]) where it
/// runs, else the composed ops.
pub fn mean_pool(x: &Tensor, mask: &Tensor, normalize: bool) -> Result<Tensor> {
    if fused_ok(&[x, mask]) {
        return Ok(cpu::pooling::mean_pool(x, mask, normalize)?);
    }
    mean_pool_composed(x, mask, normalize)
}

/// [`mean_pool`] as composed candle ops (any device and dtype).
pub fn mean_pool_composed(x: &Tensor, mask: &Tensor, normalize: bool) -> Result<Tensor> {
    let mask = mask.unsqueeze(D::Minus1)?;
    let summed = x.broadcast_mul(&mask)?.sum(1)?;
    let counts = mask.sum(1)?.maximum(1.0)?;
    let pooled = summed.broadcast_div(&counts)?;
    if normalize {
        l2_normalize(&pooled)
    } else {
        Ok(pooled)
    }
}

/// Layer norm over the last dimension: the fused kernel where it runs (the CPU), a GPU
/// node on a GPU ([`gpu::layer_norm`]), else [`layer_norm_composed`].
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if gpu_op_ok(x) && !fused_ok(&[x, weight, bias]) {
        return Ok(gpu::layer_norm(x, weight, bias, eps)?);
    }
    if is_half(x.dtype()) {
        return widened_layer_norm(layer_norm, x, weight, bias, eps);
    }
    if fused_ok(&[x, weight, bias]) {
        return Ok(x
            .contiguous()?
            .apply_op3(weight, bias, cpu::LayerNorm { eps })?);
    }
    layer_norm_composed(x, weight, bias, eps)
}

/// Composed (differentiable) layer norm over the last dimension.
pub fn layer_norm_composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if is_half(x.dtype()) {
        return widened_layer_norm(layer_norm_composed, x, weight, bias, eps);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(normed.broadcast_mul(weight)?.broadcast_add(bias)?)
}

/// `norm` run in f32 on a half-precision `x`, the result narrowed back to `x`'s dtype.
fn widened_layer_norm(
    norm: fn(&Tensor, &Tensor, &Tensor, f64) -> Result<Tensor>,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let f32 = DType::F32;
    let y = norm(
        &x.to_dtype(f32)?,
        &cast(weight, f32)?,
        &cast(bias, f32)?,
        eps,
    )?;
    Ok(y.to_dtype(x.dtype())?)
}

/// `x W^T + b` on the flattened rows of `x`: one node with a hand-written backward
/// ([`cpu::linear`]) where the fused kernels run, else composed as `(W x^T)^T`.
///
/// The composed form is written this way round, candle's backward produces the weight gradient as
/// one contiguous `[out, in]` matmul, with no transpose node on the weight: `x.matmul(W.t())`
/// records a transpose whose backward allocates and adds a second weight-sized, strided
/// gradient. The replay of a gradient cache pays that once per chunk, so it matters.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if weight.dtype() != x.dtype() {
        let weight = weight.to_dtype(x.dtype())?;
        let bias = bias.map(|b| b.to_dtype(x.dtype())).transpose()?;
        return linear(x, &weight, bias.as_ref());
    }
    let fits = match bias {
        Some(b) => fused_ok(&[x, weight, b]),
        None => fused_ok(&[x, weight]),
    };
    if fits {
        return Ok(cpu::linear(x, weight, bias)?);
    }
    linear_composed(x, weight, bias)
}

/// Composed `x W^T + b` (see [`linear`]).
pub fn linear_composed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let input = dims[dims.len() - 1];
    let rows = x.elem_count() / input.max(1);
    let x2 = x.reshape((rows, input))?;
    let y = weight.matmul(&x2.t()?)?.t()?.contiguous()?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out_dims = dims;
    let last = out_dims.len() - 1;
    out_dims[last] = weight.dim(0)?;
    Ok(y.reshape(out_dims)?)
}

/// Inverted dropout with the mask of `seed` ([`crate::rng::keep`]): the fused kernel (no
/// mask stored, the backward regenerates it) where it runs, else [`dropout_composed`].
/// The two give the same mask bit for bit.
pub fn dropout(x: &Tensor, seed: u64, p: f32) -> Result<Tensor> {
    if fused_ok(&[x]) {
        return Ok(x.contiguous()?.apply_op1(cpu::Dropout { seed, p })?);
    }
    dropout_composed(x, seed, p)
}

/// Dropout as a product with a mask tensor.
///
/// On a GPU the mask is never built: one node whose forward and backward are the dropout
/// kernel (`kernels::dropout`, the mask of every element drawn where it is used), where
/// a mask tensor would be drawn on the host and copied to the device at every call.
pub fn dropout_composed(x: &Tensor, seed: u64, p: f32) -> Result<Tensor> {
    if x.device().is_cuda() {
        let y = kernels::dropout(&x.detach(), seed, p)?;
        return Ok(node::node(
            "gradcache-dropout",
            [x, x, x],
            y,
            Box::new(move |g| Ok([Some(kernels::dropout(g, seed, p)?), None, None])),
        )?);
    }
    let mask = crate::rng::dropout_mask(seed, p, x.shape(), x.dtype(), x.device())?;
    Ok(x.mul(&mask)?)
}

/// `act(x + bias)` over the last dimension: the fused kernel where it runs, else
/// [`bias_activation_composed`].
pub fn bias_activation(x: &Tensor, bias: &Tensor, act: Act) -> Result<Tensor> {
    let bias = &cast(bias, x.dtype())?;
    if fused_ok(&[x, bias]) {
        return Ok(x
            .contiguous()?
            .apply_op2(bias, cpu::BiasActivation { act })?);
    }
    bias_activation_composed(x, bias, act)
}

/// Composed `act(x + bias)` with candle's differentiable activations.
pub fn bias_activation_composed(x: &Tensor, bias: &Tensor, act: Act) -> Result<Tensor> {
    let pre = x.broadcast_add(&cast(bias, x.dtype())?)?;
    Ok(match act {
        Act::GeluErf => pre.gelu_erf()?,
        Act::GeluTanh => pre.gelu()?,
        Act::Relu => pre.relu()?,
        Act::Silu => pre.silu()?,
    })
}

/// A 2-D convolution without bias (`x [n, c_in, h, w]`, `weight [c_out, c_in, k, k]`,
/// zero `padding`, `stride`): one node with a faster backward ([`cpu::conv2d`]) where
/// the fused kernels run (the CPU), else candle's convolution and its backward.
pub fn conv2d(x: &Tensor, weight: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    if fused_ok(&[x, weight]) {
        return Ok(cpu::conv2d(x, weight, padding, stride)?);
    }
    Ok(x.conv2d(weight, padding, stride, 1, 1)?)
}

/// A 3-D convolution without bias (`x [n, c_in, d, h, w]`, a cubic `weight
/// [c_out, c_in, k, k, k]`, zero `padding`, `stride`) as one node with its backward
/// ([`cpu::conv3d`](fn@cpu::conv3d); candle has no 3-D convolution, so it runs whether or not the
/// fused kernels are on). f32 on the CPU only: anything else is refused by name.
pub fn conv3d(x: &Tensor, weight: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let fused_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    if !(fused_f32(x) && fused_f32(weight)) {
        return Err(crate::Error::InvalidArgument {
            what: "3-D convolution input",
            value: format!("{:?} on {:?}", x.dtype(), x.device()),
            reason: "the 3-D convolution runs on f32 tensors on the CPU",
        });
    }
    Ok(cpu::conv3d(x, weight, padding, stride)?)
}

/// `f(inputs)` as one graph node that keeps only its inputs and recomputes the rest in
/// the backward pass, bit for bit ([`cpu::recomputed`]): selective recompute of a cheap
/// piece of a layer, on any device and dtype. Every tensor `f` reads that needs a
/// gradient must be one of `inputs`.
pub fn recomputed<F>(name: &'static str, inputs: &[&Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    Ok(cpu::recomputed(name, inputs, move |t| {
        f(t).map_err(|e| match e {
            crate::Error::Candle(e) => e,
            e => candle_core::Error::Msg(e.to_string()),
        })
    })?)
}

/// `x / max(||x||, 1e-12)` over the last dimension (as `torch.nn.functional.normalize`),
/// differentiable. Also `gradcache::loss::l2_normalize`.
pub fn l2_normalize(x: &Tensor) -> crate::Result<Tensor> {
    let norm = x
        .sqr()?
        .sum_keepdim(candle_core::D::Minus1)?
        .sqrt()?
        .maximum(1e-12)?;
    Ok(x.broadcast_div(&norm)?)
}

/// The gradient with respect to `x` of `sum(g * x / max(||x||, 1e-12))` (rows over the
/// last dimension): `(g - y (g . y)) / ||x||` with `y` the normalised rows, and `g / 1e-12`
/// on rows whose norm was clamped (the clamp is a constant there), as autograd through
/// [`l2_normalize`] gives it.
pub(crate) fn l2_normalize_backward(x: &Tensor, g: &Tensor) -> crate::Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
    let clamped = norm.maximum(1e-12)?;
    let y = x.broadcast_div(&clamped)?;
    let live = norm.ge(1e-12)?.to_dtype(x.dtype())?;
    let along = ((g * &y)?.sum_keepdim(candle_core::D::Minus1)? * live)?;
    Ok((g - y.broadcast_mul(&along)?)?.broadcast_div(&clamped)?)
}

/// [`l2_normalize`] over the last dimension as one node with its backward written out
/// (as autograd through `x / max(||x||, 1e-12)` gives it): a row of zeros (a masked
/// token of a multi-vector head, a padding row the packed kernels left at 0) gets the
/// clamped gradient `g / 1e-12`, where the composed ops' `sqrt` has an infinite
/// derivative at 0 and gives NaN.
pub fn l2_normalize_rows(x: &Tensor) -> crate::Result<Tensor> {
    let xd = x.detach();
    let y = l2_normalize(&xd)?;
    Ok(node::node(
        "gradcache-l2-normalize",
        [x, x, x],
        y,
        Box::new(move |g| {
            let dx = l2_normalize_backward(&xd, g)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            Ok([Some(dx), None, None])
        }),
    )?)
}
