//! Dense layers as single nodes: `x W^T + b` (the transposed weight read in place, no
//! transposed copies in the backward) and the transformer feed-forward block, which keeps
//! only the up projection's output ([`crate::nn::Linear`] calls them).

use candle_core::Tensor;

use crate::nn::cpu::elementwise::accumulate::{AddInPlace, SumRows};
use crate::nn::cpu::elementwise::activation::{bias_activation_backward_in_place, BiasActivation};
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::node::{node, node_n};

/// `x W^T + b` over the last dimension as one node: forward one matrix product (the
/// transposed weight read in place) and a bias add; backward `dx = dy W`, `dW = dy^T x`,
/// `db = sum(dy)`, three products and a column sum, with no transposed copies.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (out, inp) = weight.dims2()?;
    let rows = x.elem_count() / inp.max(1);
    let mut out_dims = x.dims().to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = out;
    }
    let (xd, wd) = (x.detach(), weight.detach());
    let x2 = xd.reshape((rows, inp))?;
    let y = x2.matmul(&wd.t()?)?;
    if let Some(b) = bias {
        y.inplace_op2(&b.detach(), &AddInPlace { rows: true })?;
    }
    let y = y.reshape(out_dims)?;
    let x_shape = x.shape().clone();
    let has_bias = bias.is_some();
    // Without a bias the node's third input repeats the weight and gets no gradient.
    node(
        "gradcache-linear",
        [x, weight, bias.unwrap_or(weight)],
        y,
        Box::new(move |dy| {
            let dy2 = dy.reshape((rows, out))?;
            let dx = dy2.matmul(&wd)?.reshape(x_shape.clone())?;
            let dw = dy2.t()?.matmul(&x2)?;
            let db = if has_bias {
                Some(dy2.contiguous()?.apply_op1_no_bwd(&SumRows)?)
            } else {
                None
            };
            Ok([Some(dx), Some(dw), db])
        }),
    )
}

/// A transformer's feed-forward block, `act(x W_up^T + b_up) W_down^T + b_down`, as one
/// node over `(x, W_up, b_up, W_down, b_down)` that keeps the up projection's output and
/// recomputes the activation in the backward (selective recompute of the widest
/// activation of a layer). The backward runs the products and kernels of the three nodes
/// [`linear`], [`BiasActivation`], [`linear`] in their order, one activation-sized
/// temporary at a time, and gives their gradients bit for bit.
pub fn feed_forward_recomputed(
    x: &Tensor,
    w_up: &Tensor,
    b_up: &Tensor,
    w_down: &Tensor,
    b_down: Option<&Tensor>,
    act: Act,
) -> candle_core::Result<Tensor> {
    let (width, inp) = w_up.dims2()?;
    let (out, down_inp) = w_down.dims2()?;
    if down_inp != width || b_up.dims1()? != width || x.dims().last() != Some(&inp) {
        candle_core::bail!(
            "feed-forward: input {:?}, up {:?} + {:?} and down {:?} do not fit",
            x.dims(),
            w_up.dims(),
            b_up.dims(),
            w_down.dims()
        );
    }
    let rows = x.elem_count() / inp.max(1);
    let mut out_dims = x.dims().to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = out;
    }
    let x2 = x.detach().reshape((rows, inp))?;
    let (wu, bu, wd) = (w_up.detach(), b_up.detach(), w_down.detach());
    let bd = b_down.map(Tensor::detach);
    let pre = x2.matmul(&wu.t()?)?;
    let y = {
        let hidden = pre.apply_op2_no_bwd(&bu, &BiasActivation { act })?;
        hidden.matmul(&wd.t()?)?
    };
    if let Some(b) = &bd {
        y.inplace_op2(b, &AddInPlace { rows: true })?;
    }
    let y = y.reshape(out_dims)?;
    let x_shape = x.shape().clone();
    let mut inputs = vec![x, w_up, b_up, w_down];
    inputs.extend(b_down);
    node_n(
        "gradcache-feed-forward-recomputed",
        &inputs,
        y,
        Box::new(move |dy| {
            let dy2 = dy.reshape((rows, out))?;
            // The down projection's backward, on the recomputed activation.
            let dwd = {
                let hidden = pre.apply_op2_no_bwd(&bu, &BiasActivation { act })?;
                dy2.t()?.matmul(&hidden)?
            };
            let dbd = match &bd {
                Some(_) => Some(dy2.contiguous()?.apply_op1_no_bwd(&SumRows)?),
                None => None,
            };
            // The activation's backward, in place: d hidden becomes d pre.
            let dpre = dy2.matmul(&wd)?;
            as_accumulated(&dpre)?;
            let dbu = bias_activation_backward_in_place(&dpre, &pre, &bu, act)?;
            as_accumulated(&dpre)?;
            // The up projection's backward.
            let dx = dpre.matmul(&wu)?.reshape(x_shape.clone())?;
            let dwu = dpre.t()?.matmul(&x2)?;
            let mut grads = vec![Some(dx), Some(dwu), Some(dbu), Some(dwd)];
            if dbd.is_some() {
                grads.push(dbd);
            }
            Ok(grads)
        }),
    )
}

/// Adds +0 to `g` in place, which turns -0 into +0 and leaves every other value as it is:
/// what candle's gradient accumulator (`zeros + g`) does to a gradient passed between two
/// nodes, so a node that runs their backward passes back to back gives the same bits.
fn as_accumulated(g: &Tensor) -> candle_core::Result<()> {
    let width = *g.dims().last().unwrap_or(&1);
    let zero = Tensor::zeros(width, g.dtype(), g.device())?;
    g.inplace_op2(&zero, &AddInPlace { rows: true })
}
