//! Norms: LayerNorm as a candle custom op with its backward (one pass over the rows
//! each way, `dgamma` and `dbeta` summed per block in block order), and the residual
//! block's tail `LayerNorm(dropout(x) + residual)` as one node, kept or recomputed.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, WithDType};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{
    check_width, contiguous, dispatch, for_blocks, for_blocks_with_partials, sum_partials,
    zeros_with_room, Float, BLOCK_ROWS,
};
use crate::nn::cpu::elementwise::dropout::{Dropout, DropoutAdd};
use crate::nn::node::node;

/// Layer normalisation over the last dimension: `CustomOp3(x, gamma, beta)`.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    /// Added to the variance.
    pub eps: f64,
}

fn ln_row<T: Float>(x: &[T], eps: f64) -> (T, T) {
    let n = T::of(x.len() as f64);
    let mean = x.iter().copied().sum::<T>() / n;
    let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
    (mean, T::one() / (var + T::of(eps)).sqrt())
}

wide_fn! {
pub(in crate::nn) fn ln_fwd<T: Float>(x: &[T], g: &[T], b: &[T], eps: f64) -> Vec<T> {
    let h = g.len();
    let mut out = vec![T::zero(); x.len()];
    for_blocks(&mut out, h, |blk, chunk| {
        let base = blk * BLOCK_ROWS * h;
        for (r, y) in chunk.chunks_mut(h).enumerate() {
            let xr = &x[base + r * h..base + (r + 1) * h];
            let (mean, rstd) = ln_row(xr, eps);
            for j in 0..h {
                y[j] = (xr[j] - mean) * rstd * g[j] + b[j];
            }
        }
    });
    out
}
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "gradcache-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_width("layer norm", "scale", l1, l2)?;
        check_width("layer norm", "shift", l1, l3)?;
        dispatch!(s1, T => {
            let out = ln_fwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, contiguous(s3, l3)?, self.eps);
            Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let h = gamma.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let packed = x.apply_op3_no_bwd(
            gamma,
            &grad.contiguous()?,
            &LayerNormBackward { eps: self.eps },
        )?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dgamma = packed.narrow(0, rows, 1)?.reshape(h)?;
        let dbeta = packed.narrow(0, rows + 1, 1)?.reshape(h)?;
        Ok((Some(dx), Some(dgamma), Some(dbeta)))
    }
}

/// The backward of [`LayerNorm`]: `CustomOp3(x, gamma, dy)`, packed as `[rows + 2, h]`:
/// the rows of `dx`, then `dgamma`, then `dbeta`.
struct LayerNormBackward {
    eps: f64,
}

wide_fn! {
pub(in crate::nn) fn ln_bwd<T: Float>(x: &[T], g: &[T], dy: &[T], eps: f64) -> Vec<T> {
    let h = g.len();
    let mut dx = zeros_with_room(x.len(), 2 * h);
    let partials = for_blocks_with_partials(&mut dx, h, 2 * h, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * h;
        let mut xhat = vec![T::zero(); h];
        let n = T::of(h as f64);
        for (r, dxr) in chunk.chunks_mut(h).enumerate() {
            let xr = &x[base + r * h..base + (r + 1) * h];
            let dyr = &dy[base + r * h..base + (r + 1) * h];
            let (mean, rstd) = ln_row(xr, eps);
            let mut sum_d = T::zero();
            let mut sum_dx = T::zero();
            for j in 0..h {
                xhat[j] = (xr[j] - mean) * rstd;
                let d = dyr[j] * g[j];
                sum_d += d;
                sum_dx += d * xhat[j];
                acc[j] += dyr[j] * xhat[j];
                acc[h + j] += dyr[j];
            }
            let (mean_d, mean_dx) = (sum_d / n, sum_dx / n);
            for j in 0..h {
                dxr[j] = rstd * (dyr[j] * g[j] - mean_d - xhat[j] * mean_dx);
            }
        }
    });
    let sums = sum_partials(&partials, 2 * h);
    dx.extend(sums);
    dx
}
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "gradcache-layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let h = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / h.max(1);
        dispatch!(s1, T => {
            let out = ln_bwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, contiguous(s3, l3)?, self.eps);
            Ok((T::to_cpu_storage_owned(out), Shape::from((rows + 2, h))))
        })
    }
}

/// The residual block's tail, `LayerNorm(dropout(x) + residual)` with the scale and shift
/// stacked as `gamma_beta` `[2, h]`, as one node over `(x, residual, gamma_beta)`: one pass
/// for dropout and the addition, one for the normalisation; the backward runs the
/// LayerNorm backward kernel and regenerates the dropout mask. It keeps only the sum.
/// Where the composed form records three nodes (dropout, addition, LayerNorm), each with
/// its accumulator in the backward, this is one.
pub fn add_norm(
    x: &Tensor,
    residual: &Tensor,
    gamma_beta: &Tensor,
    eps: f64,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    add_norm_node(x, residual, gamma_beta, eps, dropout, false)
}

/// [`add_norm`] keeping nothing but its inputs (selective recompute): the backward
/// recomputes the sum under the LayerNorm from them, with the same kernel and mask.
pub fn add_norm_recomputed(
    x: &Tensor,
    residual: &Tensor,
    gamma_beta: &Tensor,
    eps: f64,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    add_norm_node(x, residual, gamma_beta, eps, dropout, true)
}

fn add_norm_node(
    x: &Tensor,
    residual: &Tensor,
    gamma_beta: &Tensor,
    eps: f64,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> candle_core::Result<Tensor> {
    let h = *x.dims().last().unwrap_or(&0);
    if x.shape() != residual.shape() || gamma_beta.dims2()? != (2, h) {
        candle_core::bail!(
            "add-norm: input {:?}, residual {:?} and scale/shift {:?} do not fit",
            x.dims(),
            residual.dims(),
            gamma_beta.dims()
        );
    }
    let rows = x.elem_count() / h.max(1);
    let sum_of = move |xd: &Tensor, rd: &Tensor| match dropout {
        Some((seed, p)) if p > 0.0 => xd.apply_op2_no_bwd(rd, &DropoutAdd { seed, p }),
        _ => xd + rd,
    };
    let (xd, rd) = (x.contiguous()?.detach(), residual.contiguous()?.detach());
    let sum = sum_of(&xd, &rd)?;
    let gb = gamma_beta.detach();
    let (gamma, beta) = (gb.get(0)?, gb.get(1)?);
    let out = sum.apply_op3_no_bwd(&gamma, &beta, &LayerNorm { eps })?;
    // What the backward reads: the sum, or the inputs to recompute it from.
    enum Kept {
        Sum(Tensor),
        Inputs(Tensor, Tensor),
    }
    let kept = if recompute {
        Kept::Inputs(xd, rd)
    } else {
        Kept::Sum(sum)
    };
    let shape = x.shape().clone();
    node(
        "gradcache-add-norm",
        [x, residual, gamma_beta],
        out,
        Box::new(move |dout| {
            let sum = match &kept {
                Kept::Sum(sum) => sum.clone(),
                Kept::Inputs(xd, rd) => sum_of(xd, rd)?,
            };
            let packed =
                sum.apply_op3_no_bwd(&gamma, &dout.contiguous()?, &LayerNormBackward { eps })?;
            drop(sum);
            let dsum = packed.narrow(0, 0, rows)?.reshape(&shape)?;
            let dgb = packed.narrow(0, rows, 2)?;
            let dx = match dropout {
                Some((seed, p)) if p > 0.0 => dsum.apply_op1_no_bwd(&Dropout { seed, p })?,
                _ => dsum.clone(),
            };
            Ok([Some(dx), Some(dsum), Some(dgb)])
        }),
    )
}
