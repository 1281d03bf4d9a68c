//! Launchers of `attention.cu`: the masked softmax, the moves to and from heads, rotary.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::Tensor;

use super::*;

/// See [`crate::nn::kernels::softmax_forward`].
pub(crate) fn softmax_forward(
    scores: &Tensor,
    key_bias: &Tensor,
    score_bias: Option<&Tensor>,
    scale: f64,
    dropout: Option<(u64, f32)>,
    (causal, window): (bool, Option<usize>),
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let dev = device(scores)?;
    let (n, heads, s, _) = scores.dims4()?;
    let rows = n * heads * s;
    let (probs, probs_ptr) = empty(&dev, scores.dtype(), scores.shape().clone())?;
    let (seed, threshold, keep_scale) = dropout_args(dropout);
    let dropped = if threshold > 0 {
        Some(empty(&dev, scores.dtype(), scores.shape().clone())?)
    } else {
        None
    };
    if rows > 0 {
        launch!(
            function!(
                &dev,
                Module::Attention,
                &typed("softmax_fwd", scores.dtype())?
            ),
            warp_per_row(rows),
            ptr(scores)?,
            ptr(key_bias)?,
            ptr_or_null(score_bias)?,
            probs_ptr,
            dropped.as_ref().map_or(0, |d| d.1),
            i32_of(rows, "rows")?,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            scale as f32,
            seed,
            threshold,
            keep_scale,
            i32::from(causal),
            window.map_or(Ok(-1), |w| i32_of(w, "window"))?,
        );
    }
    Ok((probs, dropped.map(|d| d.0)))
}

/// See [`crate::nn::kernels::softmax_backward`].
pub(crate) fn softmax_backward(
    probs: &Tensor,
    d: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    let dev = device(probs)?;
    let s = probs.dim(candle_core::D::Minus1)?;
    let rows = probs.elem_count() / s.max(1);
    let (dz, dz_ptr) = empty(&dev, probs.dtype(), probs.shape().clone())?;
    let (seed, threshold, keep_scale) = dropout_args(dropout);
    if rows > 0 {
        launch!(
            function!(
                &dev,
                Module::Attention,
                &typed("softmax_bwd", probs.dtype())?
            ),
            warp_per_row(rows),
            ptr(probs)?,
            ptr(d)?,
            dz_ptr,
            i32_of(rows, "rows")?,
            i32_of(s, "length")?,
            seed,
            threshold,
            keep_scale,
        );
    }
    Ok(dz)
}

/// See [`crate::nn::kernels::to_heads`].
pub(crate) fn to_heads(
    src: &Tensor,
    first: usize,
    (n, heads, s, d): (usize, usize, usize, usize),
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let dev = device(src)?;
    let width = src.dim(1)?;
    let (out, out_ptr) = empty(&dev, src.dtype(), (n, heads, s, d))?;
    let total = n * heads * s * d;
    if total > 0 {
        launch!(
            function!(&dev, Module::Attention, &typed("to_heads", src.dtype())?),
            elementwise(total),
            ptr(src)?,
            ptr_or_null(bias)?,
            out_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            i32_of(width, "width")?,
            i32_of(first, "column")?,
            total,
        );
    }
    Ok(out)
}

/// See [`crate::nn::kernels::from_heads`].
pub(crate) fn from_heads(
    parts: &[(&Tensor, usize, f64)],
    width: usize,
) -> candle_core::Result<Tensor> {
    let Some((first, _, _)) = parts.first() else {
        candle_core::bail!("from_heads: no parts")
    };
    let dev = device(first)?;
    let (n, _, s, _) = first.dims4()?;
    let (out, out_ptr) = empty(&dev, first.dtype(), (n * s, width))?;
    for &(part, column, mult) in parts {
        let (_, heads, s, d) = part.dims4()?;
        let total = part.elem_count();
        if total == 0 {
            continue;
        }
        launch!(
            function!(&dev, Module::Attention, &typed("from_heads", part.dtype())?),
            elementwise(total),
            ptr(part)?,
            out_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            i32_of(width, "width")?,
            i32_of(column, "column")?,
            mult as f32,
            total,
        );
    }
    Ok(out)
}

/// See [`crate::nn::kernels::rotary_forward`].
pub(crate) fn rotary_forward(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let dev = device(x)?;
    let (_, heads, s, d) = x.dims4()?;
    let (y, y_ptr) = empty(&dev, x.dtype(), x.shape().clone())?;
    let total = x.elem_count();
    if total > 0 {
        launch!(
            function!(&dev, Module::Attention, &typed("rotary_fwd", x.dtype())?),
            elementwise(total),
            ptr(x)?,
            ptr(cos)?,
            ptr(sin)?,
            ptr(positions)?,
            y_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            total,
        );
    }
    Ok(y)
}

/// See [`crate::nn::kernels::rotary_backward`].
pub(crate) fn rotary_backward(
    dy: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    mult: f64,
) -> candle_core::Result<Tensor> {
    let dev = device(dy)?;
    let (_, heads, s, d) = dy.dims4()?;
    let (dx, dx_ptr) = empty(&dev, dy.dtype(), dy.shape().clone())?;
    let total = dy.elem_count();
    if total > 0 {
        launch!(
            function!(&dev, Module::Attention, &typed("rotary_bwd", dy.dtype())?),
            elementwise(total),
            ptr(dy)?,
            ptr(cos)?,
            ptr(sin)?,
            ptr(positions)?,
            dx_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            mult as f32,
            total,
        );
    }
    Ok(dx)
}
