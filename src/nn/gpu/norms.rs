//! LayerNorm and RMSNorm on their own as GPU nodes (the embeddings' norm, a model's final
//! norm): one kernel forward, one backward and one for the weights' sums, on the layer
//! nodes' kernels. Each keeps its input and a row statistic (and LayerNorm its f32 sum,
//! which is the input in the norms' dtype), where composed ops keep a dozen intermediates.

use candle_core::Tensor;

use crate::nn::kernels::{self as k, acc};
use crate::nn::node::node;

/// `LayerNorm(x)` over the last dimension with scale `weight` and shift `bias`.
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let width = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / width.max(1);
    let a = acc(x.dtype());
    let (g, b) = (weight.detach().to_dtype(a)?, bias.detach().to_dtype(a)?);
    let x2 = x.detach().contiguous()?.reshape((rows, width))?;
    let tracked = [x, weight, bias].iter().any(|t| t.track_op());
    let dt = x.dtype();
    let (y, sum, stats) = k::add_norm_forward(&x2, None, None, &g, &b, eps, None, tracked)?;
    let y = y.reshape(dims.as_slice())?;
    drop(x2);
    if !tracked {
        return Ok(y);
    }
    let sum = sum.expect("kept");
    let (wd, bd) = (weight.dtype(), bias.dtype());
    node(
        "gradcache-gpu-layer-norm",
        [x, weight, bias],
        y,
        Box::new(move |dy| {
            let dy = dy.to_dtype(dt)?.reshape((rows, width))?;
            let (dx, _) = k::add_norm_backward(&dy, &sum, &stats, &g, None)?;
            let (dg, db) = k::norm_param_grads(&dy, &sum, &stats)?;
            Ok([
                Some(dx.reshape(dims.as_slice())?),
                Some(dg.to_dtype(wd)?),
                Some(db.to_dtype(bd)?),
            ])
        }),
    )
}

/// `RMSNorm(x) (offset + weight)` over the last dimension.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset: f64) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let width = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / width.max(1);
    let w = weight.detach().to_dtype(acc(x.dtype()))?;
    let x2 = x.detach().contiguous()?.reshape((rows, width))?;
    let (y, rstd) = k::rms_forward(&x2, &w, eps, offset)?;
    let y = y.reshape(dims.as_slice())?;
    if !(x.track_op() || weight.track_op()) {
        return Ok(y);
    }
    let wd = weight.dtype();
    node(
        "gradcache-gpu-rms-norm",
        [x, weight, weight],
        y,
        Box::new(move |dy| {
            let dy = dy.to_dtype(x2.dtype())?.reshape((rows, width))?;
            let dx = k::rms_backward(&dy, &x2, &rstd, &w, offset)?;
            let dw = k::rms_param_grads(&dy, &x2, &rstd)?;
            Ok([
                Some(dx.reshape(dims.as_slice())?),
                Some(dw.to_dtype(wd)?),
                None,
            ])
        }),
    )
}
