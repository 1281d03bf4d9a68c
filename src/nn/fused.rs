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
//! on candle's CPU thread pool: reductions across rows (`dgamma`, `dbeta`, `db`) sum per-block partials in
//! block order, so results do not depend on the thread count or scheduling (exact resume
//! and bit-identical replays need that). [`crate::nn`] dispatches here on the CPU and to
//! the composed versions elsewhere (CUDA), and the tests hold the two equal forward and
//! backward.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, InplaceOp2, Layout, Shape, Tensor, WithDType,
};
use num_traits::Zero as _;

use super::attention::{softmax_row, with_values, Dims, HeadLayout, KeyMask, Params, Rows};
pub(crate) use super::blocks::{
    for_blocks, for_blocks_with_partials, parallel_ranges, sum_partials, zeros_with_room,
    SharedMut, BLOCK_ROWS,
};
pub use super::blocks::{serial, Float};
pub use super::math::{exp, Act, EXP_UNDERFLOW_F32};
pub use super::node::recomputed;
use super::node::{node, node_n};

fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<T>()?[start..end]),
        None => candle_core::bail!("fused kernels need contiguous inputs"),
    }
}

/// Checks that a per-feature vector (`what`: a bias, a LayerNorm scale) has the length of
/// `x`'s last dimension; the row kernels would read out of bounds otherwise.
fn check_width(op: &str, what: &str, x: &Layout, v: &Layout) -> candle_core::Result<()> {
    let last = x.shape().dims().last().copied().unwrap_or(1);
    if v.shape().elem_count() != last {
        candle_core::bail!(
            "{op}: {what} {:?} does not fit input {:?} (last dimension {last})",
            v.shape().dims(),
            x.shape().dims()
        );
    }
    Ok(())
}

/// Calls `$body` with the element type of `$storage` bound to `$t` (f32 or f64).
macro_rules! dispatch {
    ($storage:expr, $t:ident => $body:expr) => {
        match $storage {
            CpuStorage::F32(_) => {
                type $t = f32;
                $body
            }
            CpuStorage::F64(_) => {
                type $t = f64;
                $body
            }
            other => candle_core::bail!("fused kernels run in f32 or f64, not {:?}", other.dtype()),
        }
    };
}

// ---------------------------------------------------------------------------------------
// LayerNorm

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

fn ln_fwd<T: Float>(x: &[T], g: &[T], b: &[T], eps: f64) -> Vec<T> {
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

fn ln_bwd<T: Float>(x: &[T], g: &[T], dy: &[T], eps: f64) -> Vec<T> {
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

// ---------------------------------------------------------------------------------------
// Masked softmax

/// `softmax(scale * scores + bias)` over the last dimension: `CustomOp2(scores, bias)`,
/// scores `[n, heads, q, k]`, bias `[n, 1, 1, k]` (added to every head and query row of
/// sequence `n`). No gradient flows to the bias.
#[derive(Debug, Clone, Copy)]
pub struct MaskedSoftmax {
    /// Multiplies the scores before the bias is added.
    pub scale: f64,
}

fn softmax_fwd<T: Float>(x: &[T], bias: &[T], k: usize, rows_per_seq: usize, scale: f64) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let n = bias.len() / k.max(1);
    let mask = KeyMask::new(bias, n, k);
    let scale = T::of(scale);
    for_blocks(&mut out, k, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, y) in chunk.chunks_mut(k).enumerate() {
            let row = first + r;
            let seq = row / rows_per_seq;
            // Keys past the sequence's last real one stay exactly 0, uncomputed.
            let l = mask.len(seq);
            y[..l].copy_from_slice(&x[row * k..row * k + l]);
            softmax_row(
                &mut y[..l],
                &bias[seq * k..(seq + 1) * k],
                scale,
                mask.masking(seq),
            );
        }
    });
    out
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "gradcache-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, heads, q, k) = l1.shape().dims4()?;
        if l2.shape().elem_count() != n * k {
            candle_core::bail!(
                "masked softmax: bias {:?} does not fit scores {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        dispatch!(s1, T => {
            let out = softmax_fwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, k, heads * q, self.scale);
            Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let d =
            res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBackward { scale: self.scale })?;
        Ok((Some(d), None))
    }
}

/// `scale * p * (dy - sum(dy * p))` row by row: `CustomOp2(p, dy)`.
struct SoftmaxBackward {
    scale: f64,
}

fn softmax_bwd<T: Float>(p: &[T], dy: &[T], k: usize, scale: f64) -> Vec<T> {
    let mut out = vec![T::zero(); p.len()];
    let scale = T::of(scale);
    for_blocks(&mut out, k, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, dx) in chunk.chunks_mut(k).enumerate() {
            let row = first + r;
            let pr = &p[row * k..(row + 1) * k];
            let dr = &dy[row * k..(row + 1) * k];
            let dot = pr.iter().zip(dr).map(|(&a, &b)| a * b).sum::<T>();
            for j in 0..k {
                dx[j] = scale * pr[j] * (dr[j] - dot);
            }
        }
    });
    out
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "gradcache-masked-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let k = *l1.shape().dims().last().unwrap_or(&1);
        dispatch!(s1, T => {
            let out = softmax_bwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, k, self.scale);
            Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }
}

// ---------------------------------------------------------------------------------------
// Dropout

/// Inverted dropout with the mask of `seed`: element `i` (in row-major order) is kept
/// when [`crate::rng::keep`]`(seed, i, p)`, and scaled by `1 / (1 - p)`. `CustomOp1(x)`.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    /// The mask seed.
    pub seed: u64,
    /// Drop probability, in `[0, 1)`.
    pub p: f32,
}

/// Dropout of `x`, the elements of a larger tensor from element `start` on (their masks
/// are those of their places in it).
fn dropout_fwd<T: Float>(x: &[T], seed: u64, p: f32, start: u64) -> Vec<T> {
    dropout_add_fwd(x, None, seed, p, start)
}

/// `dropout(x) + residual` (the residual optional) in one pass, the elements of `x` from
/// element `start` of the masked tensor on.
fn dropout_add_fwd<T: Float>(
    x: &[T],
    residual: Option<&[T]>,
    seed: u64,
    p: f32,
    start: u64,
) -> Vec<T> {
    const BLOCK: usize = 4096;
    let scale = T::of(1.0 / (1.0 - f64::from(p)));
    let mut out = vec![T::zero(); x.len()];
    for_blocks(&mut out, BLOCK / BLOCK_ROWS, |b, chunk| {
        let base = b * BLOCK;
        let xs = &x[base..base + chunk.len()];
        // A product with the mask value, as the composed form computes it (a dropped
        // negative entry is -0.0 there too).
        crate::rng::keep_run(seed, start + base as u64, chunk.len(), p, |j, kept| {
            chunk[j] = xs[j] * if kept { scale } else { T::zero() };
        });
        if let Some(r) = residual {
            for (y, &r) in chunk.iter_mut().zip(&r[base..base + xs.len()]) {
                *y += r;
            }
        }
    });
    out
}

/// `dropout(x) + residual`, `CustomOp2(x, residual)`, without a backward: the forward of
/// [`add_norm`].
struct DropoutAdd {
    seed: u64,
    p: f32,
}

impl CustomOp2 for DropoutAdd {
    fn name(&self) -> &'static str {
        "gradcache-dropout-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!("dropout-add: shapes {:?} and {:?}", l1.shape(), l2.shape());
        }
        dispatch!(s1, T => {
            let out = dropout_add_fwd::<T>(
                contiguous(s1, l1)?,
                Some(contiguous(s2, l2)?),
                self.seed,
                self.p,
                0,
            );
            Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "gradcache-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch!(s, T => {
            let out = dropout_fwd::<T>(contiguous(s, l)?, self.seed, self.p, 0);
            Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // The same mask and scale: d(x * m)/dx = m.
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

// ---------------------------------------------------------------------------------------
// Bias + activation

/// `act(x + b)` over the last dimension: `CustomOp2(x, b)`.
#[derive(Debug, Clone, Copy)]
pub struct BiasActivation {
    /// The activation.
    pub act: Act,
}

fn bias_act_fwd<T: Float>(x: &[T], b: &[T], act: Act) -> Vec<T> {
    let w = b.len();
    let mut out = vec![T::zero(); x.len()];
    for_blocks(&mut out, w, |blk, chunk| {
        let base = blk * BLOCK_ROWS * w;
        for (r, y) in chunk.chunks_mut(w).enumerate() {
            let xr = &x[base + r * w..base + (r + 1) * w];
            // The activation chosen outside the loop and no indexing inside it, so the
            // compiler can vectorise the element loop.
            macro_rules! each {
                ($a:expr) => {
                    for ((y, &x), &b) in y.iter_mut().zip(xr).zip(b) {
                        *y = $a.value(x + b);
                    }
                };
            }
            match act {
                Act::GeluErf => each!(Act::GeluErf),
                Act::GeluTanh => each!(Act::GeluTanh),
                Act::Relu => each!(Act::Relu),
            }
        }
    });
    out
}

impl CustomOp2 for BiasActivation {
    fn name(&self) -> &'static str {
        "gradcache-bias-activation"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_width("bias activation", "bias", l1, l2)?;
        dispatch!(s1, T => {
            let out = bias_act_fwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, self.act);
            Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let w = b.dim(0)?;
        let rows = x.elem_count() / w.max(1);
        let packed = x.apply_op3_no_bwd(
            b,
            &grad.contiguous()?,
            &BiasActivationBackward { act: self.act },
        )?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let db = packed.narrow(0, rows, 1)?.reshape(w)?;
        Ok((Some(dx), Some(db)))
    }
}

/// The backward of [`BiasActivation`]: `CustomOp3(x, b, dy)`, packed as `[rows + 1, w]`:
/// the rows of `dx`, then `db`.
struct BiasActivationBackward {
    act: Act,
}

fn bias_act_bwd<T: Float>(x: &[T], b: &[T], dy: &[T], act: Act) -> Vec<T> {
    let mut dx = Vec::with_capacity(x.len() + b.len());
    dx.extend_from_slice(dy);
    let db = bias_act_bwd_in_place(x, b, &mut dx, act);
    dx.extend(db);
    dx
}

/// The backward of `act(x + b)` with `dy` overwritten by `dx`; returns `db`.
fn bias_act_bwd_in_place<T: Float>(x: &[T], b: &[T], dy: &mut [T], act: Act) -> Vec<T> {
    let w = b.len();
    let partials = for_blocks_with_partials(dy, w, w, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * w;
        for (r, dxr) in chunk.chunks_mut(w).enumerate() {
            let off = base + r * w;
            let xr = &x[off..off + w];
            macro_rules! each {
                ($a:expr) => {
                    for (((dx, a), &x), &b) in dxr.iter_mut().zip(acc.iter_mut()).zip(xr).zip(b) {
                        let d = *dx * $a.derivative(x + b);
                        *dx = d;
                        *a += d;
                    }
                };
            }
            match act {
                Act::GeluErf => each!(Act::GeluErf),
                Act::GeluTanh => each!(Act::GeluTanh),
                Act::Relu => each!(Act::Relu),
            }
        }
    });
    sum_partials(&partials, w)
}

/// [`BiasActivationBackward`] in place: `InplaceOp3(dy, x, b)` turns `dy` into `dx` and
/// leaves `db` in `db`, so the backward holds one activation-sized tensor where the
/// packed form holds two.
struct BiasActivationBackwardInPlace {
    act: Act,
    db: Mutex<Option<CpuStorage>>,
}

impl candle_core::InplaceOp3 for BiasActivationBackwardInPlace {
    fn name(&self) -> &'static str {
        "gradcache-bias-activation-backward-in-place"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        check_width("bias activation backward", "bias", l2, l3)?;
        let Some((start, end)) = l1.contiguous_offsets() else {
            candle_core::bail!("bias activation backward: the gradient must be contiguous");
        };
        if end - start != l2.shape().elem_count() {
            candle_core::bail!(
                "bias activation backward: gradient {:?} and input {:?} differ",
                l1.shape(),
                l2.shape()
            );
        }
        let db = match s1 {
            CpuStorage::F32(dy) => CpuStorage::F32(bias_act_bwd_in_place(
                contiguous::<f32>(s2, l2)?,
                contiguous::<f32>(s3, l3)?,
                &mut dy[start..end],
                self.act,
            )),
            CpuStorage::F64(dy) => CpuStorage::F64(bias_act_bwd_in_place(
                contiguous::<f64>(s2, l2)?,
                contiguous::<f64>(s3, l3)?,
                &mut dy[start..end],
                self.act,
            )),
            _ => candle_core::bail!("bias activation backward: f32 or f64"),
        };
        *self
            .db
            .lock()
            .map_err(|_| candle_core::Error::Msg("bias activation backward: poisoned".into()))? =
            Some(db);
        Ok(())
    }
}

/// `dy` turned into the gradient of `act(x + b)`'s input in place; returns `db`.
fn bias_activation_backward_in_place(
    dy: &Tensor,
    x: &Tensor,
    b: &Tensor,
    act: Act,
) -> candle_core::Result<Tensor> {
    let op = BiasActivationBackwardInPlace {
        act,
        db: Mutex::new(None),
    };
    dy.inplace_op3(x, b, &op)?;
    let db = op
        .db
        .into_inner()
        .map_err(|_| candle_core::Error::Msg("bias activation backward: poisoned".into()))?;
    let w = b.elem_count();
    match db {
        Some(CpuStorage::F32(v)) => Tensor::from_vec(v, w, dy.device()),
        Some(CpuStorage::F64(v)) => Tensor::from_vec(v, w, dy.device()),
        _ => candle_core::bail!("bias activation backward: no bias gradient"),
    }
}

impl CustomOp3 for BiasActivationBackward {
    fn name(&self) -> &'static str {
        "gradcache-bias-activation-backward"
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
        let w = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / w.max(1);
        dispatch!(s1, T => {
            let out = bias_act_bwd::<T>(contiguous(s1, l1)?, contiguous(s2, l2)?, contiguous(s3, l3)?, self.act);
            Ok((T::to_cpu_storage_owned(out), Shape::from((rows + 1, w))))
        })
    }
}

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

/// A 2-D convolution `x [n, c_in, h, w]` * `weight [c_out, c_in, k, k]` (square kernel,
/// no bias, no dilation or groups) as one node whose backward is faster than candle's
/// rule on the CPU: for stride 1 the input gradient is a convolution of the output
/// gradient with the flipped, transposed kernel (candle's im2col path) instead of
/// candle's transposed convolution, about 3x slower at ResNet shapes; for other strides
/// it is candle's transposed convolution. The kernel gradient is candle's rule.
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    padding: usize,
    stride: usize,
) -> candle_core::Result<Tensor> {
    let (xd, wd) = (x.detach(), weight.detach());
    let y = xd.conv2d(&wd, padding, stride, 1, 1)?;
    let (_, _, k, k2) = wd.dims4()?;
    let (h, w) = (x.dim(2)?, x.dim(3)?);
    node(
        "gradcache-conv2d",
        [x, weight, weight],
        y,
        Box::new(move |dy| {
            let dx = if stride == 1 && k == k2 && padding < k {
                let reversed: Vec<u32> = (0..k as u32).rev().collect();
                let flip = Tensor::from_vec(reversed, k, wd.device())?;
                let flipped = wd
                    .transpose(0, 1)?
                    .contiguous()?
                    .index_select(&flip, 2)?
                    .index_select(&flip, 3)?;
                dy.conv2d(&flipped, k - 1 - padding, 1, 1, 1)?
            } else {
                let out_h = (dy.dim(2)? - 1) * stride + k - 2 * padding;
                let out_padding = h.saturating_sub(out_h);
                dy.conv_transpose2d(&wd, padding, out_padding, stride, 1)?
            };
            let dx = if dx.dim(2)? != h || dx.dim(3)? != w {
                dx.narrow(2, 0, h)?.narrow(3, 0, w)?
            } else {
                dx
            };
            let dw = xd
                .transpose(0, 1)?
                // Stride 1 and dilation `stride`: the output gradient's pixels sit `stride`
                // apart on the input.
                .conv2d(&dy.transpose(0, 1)?, padding, 1, stride, 1)?
                .transpose(0, 1)?;
            let dw = if dw.dim(2)? != k || dw.dim(3)? != k2 {
                dw.narrow(2, 0, k)?.narrow(3, 0, k2)?
            } else {
                dw
            };
            Ok([Some(dx), Some(dw.contiguous()?), None])
        }),
    )
}

/// BatchNorm in training over `x [n, c, ...]` (f32, contiguous), normalising each
/// channel with the batch's statistics, as one node over `(x, weight, bias)` with the
/// hand-written backward
/// `dx = w rstd / m (m dy - sum(dy) - x_hat sum(dy x_hat))`, `dw = sum(dy x_hat)`,
/// `db = sum(dy)` (sums per channel over the `m` values). The composed form records about
/// ten nodes over activation-sized tensors and back-propagates through strided reductions
/// several times slower. With `relu`, the ReLU after the normalisation is part of the node
/// (its mask recomputed in the backward). Returns the output and the batch's mean and
/// biased variance `[c]` (for the running statistics). Statistics are accumulated in f64.
pub fn batch_norm_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    relu: bool,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let dims = x.dims().to_vec();
    let (n, c) = (dims[0], dims[1]);
    let s = x.elem_count() / (n * c).max(1);
    let m = (n * s) as f64;
    let xd = x.detach().contiguous()?;
    let wv = weight.detach().to_vec1::<f32>()?;
    let bv = bias.detach().to_vec1::<f32>()?;
    // Channel `ch`'s values: `s` in a row at `(i * c + ch) * s` for every row `i`.
    let rows = move |ch: usize| (0..n).map(move |i| (i * c + ch) * s);
    let (mean, var, rstd, y) = read_f32(&xd, |xv| {
        let (mut mean, mut var, mut rstd) = (vec![0f32; c], vec![0f32; c], vec![0f32; c]);
        let mut y = vec![0f32; xv.len()];
        for ch in 0..c {
            let sum: f64 = rows(ch)
                .map(|o| xv[o..o + s].iter().map(|&v| f64::from(v)).sum::<f64>())
                .sum();
            let mu = sum / m;
            let sq: f64 = rows(ch)
                .map(|o| {
                    xv[o..o + s]
                        .iter()
                        .map(|&v| (f64::from(v) - mu).powi(2))
                        .sum::<f64>()
                })
                .sum();
            mean[ch] = mu as f32;
            var[ch] = (sq / m) as f32;
            rstd[ch] = (1.0 / (sq / m + eps).sqrt()) as f32;
            let (mu, r, w, b) = (mean[ch], rstd[ch], wv[ch], bv[ch]);
            for o in rows(ch) {
                for (yo, &xo) in y[o..o + s].iter_mut().zip(&xv[o..o + s]) {
                    let v = (xo - mu) * r * w + b;
                    *yo = if relu { v.max(0.0) } else { v };
                }
            }
        }
        (mean, var, rstd, y)
    })?;
    let device = x.device().clone();
    let y = Tensor::from_vec(y, dims.clone(), &device)?;
    let mean_t = Tensor::from_vec(mean.clone(), c, &device)?;
    let var_t = Tensor::from_vec(var, c, &device)?;
    let out = node(
        "gradcache-batch-norm",
        [x, weight, bias],
        y,
        Box::new(move |dy| {
            // The input is read in place from the node's own input (kept by the graph
            // anyway), and the output gradient in place too: no copies of either.
            let dy = dy.contiguous()?;
            let (dx, dw, db) = read_f32(&xd, |xv| {
                read_f32(&dy, |dyv| {
                    let mut dx = vec![0f32; xv.len()];
                    let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
                    for ch in 0..c {
                        let (mu, r, w, b) = (mean[ch], rstd[ch], wv[ch], bv[ch]);
                        // The ReLU passes the gradient where its input was positive.
                        let grad = |g: f32, xhat: f32| {
                            if relu && xhat * w + b <= 0.0 {
                                0.0
                            } else {
                                g
                            }
                        };
                        let (mut sum_dy, mut sum_dy_xhat) = (0f64, 0f64);
                        for o in rows(ch) {
                            for (&g, &xo) in dyv[o..o + s].iter().zip(&xv[o..o + s]) {
                                let xhat = (xo - mu) * r;
                                let g = grad(g, xhat);
                                sum_dy += f64::from(g);
                                sum_dy_xhat += f64::from(g) * f64::from(xhat);
                            }
                        }
                        dw[ch] = sum_dy_xhat as f32;
                        db[ch] = sum_dy as f32;
                        let k = w * r;
                        let (mean_dy, mean_dy_xhat) =
                            ((sum_dy / m) as f32, (sum_dy_xhat / m) as f32);
                        for o in rows(ch) {
                            for ((d, &g), &xo) in dx[o..o + s]
                                .iter_mut()
                                .zip(&dyv[o..o + s])
                                .zip(&xv[o..o + s])
                            {
                                let xhat = (xo - mu) * r;
                                *d = k * (grad(g, xhat) - mean_dy - xhat * mean_dy_xhat);
                            }
                        }
                    }
                    (dx, dw, db)
                })
            })??;
            let dx = Tensor::from_vec(dx, dims.clone(), dy.device())?;
            let dw = Tensor::from_vec(dw, c, dy.device())?;
            let db = Tensor::from_vec(db, c, dy.device())?;
            Ok([Some(dx), Some(dw), Some(db)])
        }),
    )?;
    Ok((out, mean_t, var_t))
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, read in place.
fn read_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => Ok(f(contiguous::<f32>(cpu, layout)?)),
        _ => candle_core::bail!("the BatchNorm node runs on the CPU"),
    }
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

/// BERT's embeddings as one node that keeps nothing but the ids
/// ([`super::embeddings::embeddings`] with `recompute`).
pub fn embeddings_recomputed(
    ids: [&Tensor; 2],
    tables: [&Tensor; 3],
    norm: [&Tensor; 2],
    eps: f64,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    super::embeddings::embeddings(ids, tables, norm, eps, dropout, true)
}

/// Adds +0 to `g` in place, which turns -0 into +0 and leaves every other value as it is:
/// what candle's gradient accumulator (`zeros + g`) does to a gradient passed between two
/// nodes, so a node that runs their backward passes back to back gives the same bits.
fn as_accumulated(g: &Tensor) -> candle_core::Result<()> {
    let width = *g.dims().last().unwrap_or(&1);
    let zero = Tensor::zeros(width, g.dtype(), g.device())?;
    g.inplace_op2(&zero, &AddInPlace { rows: true })
}

/// What scaled dot-product attention needs besides `q`, `k`, `v`.
#[derive(Debug, Clone)]
pub struct AttentionSpec {
    /// Additive key mask `[n, 1, 1, k]` (BERT's -10000 on padding). A key whose bias is
    /// -10000 or below is masked: probability exactly 0, and the fused kernel does not
    /// compute it ([`super::attention`](mod@super::attention)).
    pub bias: Tensor,
    /// Multiplies the scores (`1 / sqrt(head_dim)`).
    pub scale: f64,
    /// Dropout on the probabilities: `(mask seed, drop probability)`.
    pub dropout: Option<(u64, f32)>,
    /// Recompute the probabilities (scores, softmax, dropout mask) in the backward pass
    /// instead of keeping them (selective recompute): nothing of size `[n, heads, s, s]`
    /// outlives the forward, for one more `q k^T` product and softmax in the backward.
    pub recompute: bool,
}

/// The attention kernel's shape, parameters and key mask for `n` sequences of `s` tokens
/// in `heads` heads of `d`, with the spec's bias read as `[n, s]`.
fn attention_setup<T: Float>(
    spec: &AttentionSpec,
    n: usize,
    heads: usize,
    s: usize,
    d: usize,
) -> candle_core::Result<(Dims, Params, KeyMask<T>)> {
    if spec.bias.elem_count() != n * s {
        candle_core::bail!(
            "attention: key mask {:?} does not fit {n} sequences of {s} tokens",
            spec.bias.dims()
        );
    }
    let bias = spec.bias.contiguous()?;
    let mask = with_values::<T, _>(&bias, |b| Ok(KeyMask::new(b, n, s)))?;
    let params = Params {
        scale: spec.scale,
        dropout: spec.dropout,
    };
    Ok((Dims { n, heads, s, d }, params, mask))
}

/// Calls `$body` with `$t` bound to the float type of `$dtype` (f32 or f64).
macro_rules! with_float {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            other => candle_core::bail!("fused kernels run in f32 or f64, not {other:?}"),
        }
    };
}

/// The kept probabilities of the attention kernel, as a flat tensor.
fn kept_tensor<T: Float>(kept: Option<Vec<T>>) -> candle_core::Result<Option<Tensor>> {
    kept.map(|k| {
        let len = k.len();
        Tensor::from_vec(k, len, &candle_core::Device::Cpu)
    })
    .transpose()
}

/// `dropout(softmax(scale * q k^T + bias)) v` for `q`, `k`, `v` `[n, heads, s, d]`, as one
/// node ([`super::attention`](mod@super::attention): one task per sequence and head, padding keys skipped).
/// With `spec.recompute` it keeps nothing of size `[n, heads, s, s]`: the backward
/// recomputes the probabilities from `q` and `k` with the same arithmetic and regenerates
/// the dropout mask from its seed (Megatron's selective recompute of attention); without
/// it the node keeps the probabilities before dropout.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    let (n, heads, s, d) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        candle_core::bail!(
            "attention: q {:?}, k {:?} and v {:?} differ",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let (qd, kd, vd) = (
        q.contiguous()?.detach(),
        k.contiguous()?.detach(),
        v.contiguous()?.detach(),
    );
    let layout = HeadLayout::heads_first(heads, s, d);
    let rows = Rows::padded(n, s);
    let len = n * heads * s * d;
    with_float!(q.dtype(), T => {
        let (dims, params, mask) = attention_setup::<T>(spec, n, heads, s, d)?;
        let mut out = vec![T::zero(); len];
        let kept = with_values::<T, _>(&qd, |qv| {
            with_values::<T, _>(&kd, |kv| {
                with_values::<T, _>(&vd, |vv| {
                    // SAFETY: q, k, v and out are contiguous [n, heads, s, d] buffers.
                    Ok(unsafe {
                        super::attention::forward(
                            (dims, &rows),
                            &params,
                            &mask,
                            (qv.as_ptr(), layout),
                            (kv.as_ptr(), layout),
                            (vv.as_ptr(), layout),
                            (out.as_mut_ptr(), layout),
                            !spec.recompute,
                        )
                    })
                })
            })
        })?;
        let kept = kept_tensor(kept)?;
        let out = Tensor::from_vec(out, (n, heads, s, d), q.device())?;
        node(
            "gradcache-attention",
            [q, k, v],
            out,
            Box::new(move |dctx| {
                let dctx = dctx.contiguous()?;
                let mut grads = [vec![T::zero(); len], vec![T::zero(); len], vec![T::zero(); len]];
                let [gq, gk, gv] = &mut grads;
                let (gq, gk, gv) = (gq.as_mut_ptr(), gk.as_mut_ptr(), gv.as_mut_ptr());
                with_values::<T, _>(&qd, |qv| {
                    with_values::<T, _>(&kd, |kv| {
                        with_values::<T, _>(&vd, |vv| {
                            with_values::<T, _>(&dctx, |dc| {
                                let run = |kept: Option<&[T]>| {
                                    // SAFETY: every buffer is a contiguous [n, heads, s, d].
                                    unsafe {
                                        super::attention::backward(
                                            (dims, &rows),
                                            &params,
                                            &mask,
                                            (qv.as_ptr(), layout),
                                            (kv.as_ptr(), layout),
                                            (vv.as_ptr(), layout),
                                            kept,
                                            (dc.as_ptr(), layout),
                                            (gq, layout),
                                            (gk, layout),
                                            (gv, layout),
                                        )
                                    }
                                };
                                match &kept {
                                    Some(t) => with_values::<T, _>(t, |kv| {
                                        run(Some(kv));
                                        Ok(())
                                    }),
                                    None => {
                                        run(None);
                                        Ok(())
                                    }
                                }
                            })
                        })
                    })
                })?;
                let dev = candle_core::Device::Cpu;
                let [gq, gk, gv] = grads;
                Ok([
                    Some(Tensor::from_vec(gq, (n, heads, s, d), &dev)?),
                    Some(Tensor::from_vec(gk, (n, heads, s, d), &dev)?),
                    Some(Tensor::from_vec(gv, (n, heads, s, d), &dev)?),
                ])
            }),
        )
    })
}

/// BERT's self-attention from the hidden states `x` `[n, s, h]` as one node over
/// `(x, W_qkv, b_qkv)`, the query, key and value projections stacked into one `[3h, h]`
/// weight: one matrix product gives the packed `[n s, 3h]` queries, keys and values, which
/// the attention kernel ([`super::attention`](mod@super::attention)) reads where they lie, head by head, writing
/// the context with the heads merged, `[n, s, h]`: no split or merge copies. The backward
/// takes the kept probabilities or recomputes them (`spec.recompute`), writes `dq`, `dk`,
/// `dv` into one packed `[n s, 3h]` gradient and runs one product for `dx` and one for
/// `dW_qkv`. candle's autograd sees one node where three projections, the head split and
/// merge and the attention record fifteen, each with a zero-filled accumulator and an
/// addition in the backward pass.
pub fn self_attention(
    x: &Tensor,
    w_qkv: &Tensor,
    b_qkv: &Tensor,
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    self_attention_node(x, &[w_qkv], &[b_qkv], heads, spec)
}

/// [`self_attention`] over the three projections as they are stored, `[W_q, W_k, W_v]`
/// and `[b_q, b_k, b_v]`: the node stacks them for its products and hands each its block
/// of the gradient, so the graph holds no stacked copy of them.
pub fn self_attention_projections(
    x: &Tensor,
    [wq, wk, wv]: [&Tensor; 3],
    [bq, bk, bv]: [&Tensor; 3],
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    self_attention_node(x, &[wq, wk, wv], &[bq, bk, bv], heads, spec)
}

/// The node of [`self_attention`] over `x`, the `weights` and the `biases` (one stacked
/// projection, or one per query, key and value).
fn self_attention_node(
    x: &Tensor,
    weights: &[&Tensor],
    biases: &[&Tensor],
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    // The stacked projection, made again in the backward: the graph keeps no copy.
    let stack = |ts: &[Tensor]| -> candle_core::Result<Tensor> {
        match ts {
            [one] => Ok(one.clone()),
            many => Tensor::cat(many, 0),
        }
    };
    let weights_d: Vec<Tensor> = weights.iter().map(|t| t.detach()).collect();
    let biases_d: Vec<Tensor> = biases.iter().map(|t| t.detach()).collect();
    let (wd, bd) = (stack(&weights_d)?, stack(&biases_d)?);
    if heads == 0
        || h % heads != 0
        || wd.dims2()? != (3 * h, h)
        || bd.dims1()? != 3 * h
        || weights.len() != biases.len()
    {
        candle_core::bail!(
            "self-attention: hidden size {h}, {heads} heads and a {:?} projection do not fit",
            wd.dims()
        );
    }
    let d = h / heads;
    let rows = n * s;
    let xd = x.detach();
    let x2 = xd.reshape((rows, h))?;
    let qkv = x2.matmul(&wd.t()?)?;
    qkv.inplace_op2(&bd, &AddInPlace { rows: true })?;
    drop((wd, bd));
    let packed = move |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let merged = HeadLayout::in_rows(h, d, 0);
    let seqs = Rows::padded(n, s);
    with_float!(x.dtype(), T => {
        let (dims, params, mask) = attention_setup::<T>(spec, n, heads, s, d)?;
        let mut out = vec![T::zero(); rows * h];
        let kept = with_values::<T, _>(&qkv, |all| {
            let p = all.as_ptr();
            // SAFETY: qkv is a contiguous [n s, 3h] buffer, out a [n s, h] one.
            Ok(unsafe {
                super::attention::forward(
                    (dims, &seqs),
                    &params,
                    &mask,
                    (p, packed(0)),
                    (p, packed(1)),
                    (p, packed(2)),
                    (out.as_mut_ptr(), merged),
                    !spec.recompute,
                )
            })
        })?;
        let kept = kept_tensor(kept)?;
        let out = Tensor::from_vec(out, (n, s, h), x.device())?;
        let parts = weights.len();
        let mut inputs = vec![x];
        inputs.extend(weights);
        inputs.extend(biases);
        node_n(
            "gradcache-self-attention",
            &inputs,
            out,
            Box::new(move |dout| {
                let dout = dout.contiguous()?;
                let mut dqkv = vec![T::zero(); rows * 3 * h];
                with_values::<T, _>(&qkv, |all| {
                    with_values::<T, _>(&dout, |dc| {
                        let (p, g) = (all.as_ptr(), dqkv.as_mut_ptr());
                        let run = |kept: Option<&[T]>| {
                            // SAFETY: qkv and dqkv are contiguous [n s, 3h] buffers (the
                            // three gradients in disjoint columns), dout a [n s, h] one.
                            unsafe {
                                super::attention::backward(
                                    (dims, &seqs),
                                    &params,
                                    &mask,
                                    (p, packed(0)),
                                    (p, packed(1)),
                                    (p, packed(2)),
                                    kept,
                                    (dc.as_ptr(), merged),
                                    (g, packed(0)),
                                    (g, packed(1)),
                                    (g, packed(2)),
                                )
                            }
                        };
                        match &kept {
                            Some(t) => with_values::<T, _>(t, |kv| {
                                run(Some(kv));
                                Ok(())
                            }),
                            None => {
                                run(None);
                                Ok(())
                            }
                        }
                    })
                })?;
                drop(dout);
                let dqkv = Tensor::from_vec(dqkv, (rows, 3 * h), &candle_core::Device::Cpu)?;
                let dx = dqkv.matmul(&stack(&weights_d)?)?.reshape((n, s, h))?;
                let dw = dqkv.t()?.matmul(&x2)?;
                let db = dqkv.apply_op1_no_bwd(&SumRows)?;
                // Each projection its block of rows.
                let block = 3 * h / parts;
                let mut grads = vec![Some(dx)];
                for g in [dw, db] {
                    for i in 0..parts {
                        grads.push(Some(g.narrow(0, i * block, block)?));
                    }
                }
                Ok(grads)
            }),
        )
    })
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

// ---------------------------------------------------------------------------------------
// Bias rows

/// `y += b` in place (no second full-size tensor): on every row of `y` (`rows`, a bias
/// `b` of the row width) or element by element (`b` of `y`'s size).
struct AddInPlace {
    rows: bool,
}

impl InplaceOp2 for AddInPlace {
    fn name(&self) -> &'static str {
        "gradcache-add-in-place"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let Some((start, end)) = l1.contiguous_offsets() else {
            candle_core::bail!("add in place: the output must be contiguous");
        };
        match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(_)) => {
                let b = contiguous::<f32>(s2, l2)?;
                if self.rows {
                    add_rows(&mut y[start..end], b)
                } else {
                    add_elementwise(&mut y[start..end], b)
                }
                Ok(())
            }
            (CpuStorage::F64(y), CpuStorage::F64(_)) => {
                let b = contiguous::<f64>(s2, l2)?;
                if self.rows {
                    add_rows(&mut y[start..end], b)
                } else {
                    add_elementwise(&mut y[start..end], b)
                }
                Ok(())
            }
            _ => candle_core::bail!("add in place: f32 or f64 of one dtype"),
        }
    }
}

fn add_rows<T: Float>(y: &mut [T], b: &[T]) {
    for_blocks(y, b.len(), |_, rows| {
        for row in rows.chunks_mut(b.len()) {
            for (v, &bias) in row.iter_mut().zip(b) {
                *v += bias;
            }
        }
    });
}

/// `acc += g` element by element, in place, for same-shape contiguous CPU tensors in f32
/// or f64 (gradient accumulation without a new tensor per addition); the caller must own
/// `acc`'s storage. Each element is the same `acc + g` as [`Tensor::add`] computes.
pub fn add_in_place(acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    if acc.shape() != g.shape() {
        candle_core::bail!("add in place: shapes {:?} and {:?}", acc.dims(), g.dims());
    }
    acc.inplace_op2(&g.contiguous()?, &AddInPlace { rows: false })
}

fn add_elementwise<T: Float>(acc: &mut [T], g: &[T]) {
    const WIDTH: usize = 1024;
    for_blocks(acc, WIDTH, |blk, chunk| {
        let base = blk * BLOCK_ROWS * WIDTH;
        for (a, &v) in chunk.iter_mut().zip(&g[base..]) {
            *a += v;
        }
    });
}

/// The sum over rows of a `[rows, w]` matrix (a bias gradient), in fixed blocks.
struct SumRows;

impl CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "gradcache-sum-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = *l.shape().dims().last().unwrap_or(&1);
        dispatch!(s, T => {
            let x = contiguous::<T>(s, l)?;
            let blocks = x.len().div_ceil(BLOCK_ROWS * w.max(1));
            let mut partials = vec![<T as num_traits::Zero>::zero(); blocks * w];
            let shared = SharedMut(partials.as_mut_ptr());
            parallel_ranges(blocks, |range| {
                for blk in range {
                    // SAFETY: block `blk` owns partials `blk * w .. (blk + 1) * w`.
                    let acc = unsafe { std::slice::from_raw_parts_mut(shared.get().add(blk * w), w) };
                    let base = blk * BLOCK_ROWS * w;
                    for row in x[base..x.len().min(base + BLOCK_ROWS * w)].chunks(w) {
                        for (a, &v) in acc.iter_mut().zip(row) {
                            *a += v;
                        }
                    }
                }
            });
            Ok((T::to_cpu_storage_owned(sum_partials(&partials, w)), Shape::from(w)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    use crate::nn::blocks::BASELINE_ONLY;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
            })
            .collect()
    }

    /// Every kernel's outputs, as bits.
    fn run_all(width: usize) -> Vec<Vec<u32>> {
        let rows = 3 * BLOCK_ROWS + 5; // several blocks and a short last one
        let (x, dy) = (values(rows * width, 1), values(rows * width, 2));
        let (g, b) = (values(width, 3), values(width, 4));
        let mut outs = vec![
            ln_fwd(&x, &g, &b, 1e-12),
            ln_bwd(&x, &g, &dy, 1e-12),
            softmax_fwd(&x, &b, width, rows, 0.125),
            softmax_bwd(&softmax_fwd(&x, &b, width, rows, 0.125), &dy, width, 0.125),
            dropout_add_fwd(&x, Some(&dy), 11, 0.1, 0),
        ];
        for act in [Act::GeluErf, Act::GeluTanh, Act::Relu] {
            outs.push(bias_act_fwd(&x, &b, act));
            outs.push(bias_act_bwd(&x, &b, &dy, act));
        }
        let mut acc = x.clone();
        add_rows(&mut acc, &b);
        add_elementwise(&mut acc, &dy);
        outs.push(acc);
        outs.into_iter()
            .map(|v| v.iter().map(|f| f.to_bits()).collect())
            .collect()
    }

    #[test]
    fn wide_vector_kernels_give_the_baseline_bits() {
        #[cfg(target_arch = "x86_64")]
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("no AVX2 + FMA on this CPU: only the baseline copy runs");
        }
        for width in [384, 37] {
            let wide = run_all(width);
            BASELINE_ONLY.store(true, Ordering::Relaxed);
            let baseline = run_all(width);
            BASELINE_ONLY.store(false, Ordering::Relaxed);
            for (i, (a, b)) in wide.iter().zip(&baseline).enumerate() {
                assert!(
                    a == b,
                    "kernel output {i} (width {width}) differs between copies"
                );
            }
        }
    }

    fn tensor(dims: &[usize], seed: u64) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(values(n, seed), dims, &candle_core::Device::Cpu).expect("tensor")
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).expect("values");
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// The attention node that recomputes its probabilities in the backward gives the
    /// bits of the one that keeps them (dropout on, a masked key inside one sequence,
    /// trailing padding in another), and masked keys get no gradient.
    #[test]
    fn attention_recomputed_gives_the_kept_gradients_bit_for_bit() {
        let (n, heads, s, d) = (3, 2, 6, 4);
        let mut bias = vec![0f32; n * s];
        bias[2] = -10000.0; // inside sequence 0
        for v in &mut bias[s + 4..2 * s] {
            *v = -10000.0; // sequence 1: two padding keys
        }
        let grads = |recompute: bool| {
            let spec = AttentionSpec {
                bias: Tensor::from_vec(bias.clone(), (n, 1, 1, s), &candle_core::Device::Cpu)
                    .expect("bias"),
                scale: 0.5,
                dropout: Some((9, 0.25)),
                recompute,
            };
            let vars: Vec<candle_core::Var> = (1..=3)
                .map(|seed| candle_core::Var::from_tensor(&tensor(&[n, heads, s, d], seed)))
                .collect::<candle_core::Result<_>>()
                .expect("vars");
            let out = attention(&vars[0], &vars[1], &vars[2], &spec).expect("attention");
            let store = (out * tensor(&[n, heads, s, d], 4))
                .and_then(|t| t.sum_all())
                .and_then(|t| t.backward())
                .expect("backward");
            vars.iter()
                .map(|v| store.get(v).expect("a gradient").clone())
                .collect::<Vec<_>>()
        };
        let (kept, recomputed) = (grads(false), grads(true));
        for (a, b) in kept.iter().zip(&recomputed) {
            assert_eq!(bits(a), bits(b));
        }
        // Keys 4 and 5 of sequence 1 and key 2 of sequence 0: zero key and value gradients.
        for g in &kept[1..] {
            let v: Vec<f32> = g.flatten_all().and_then(|t| t.to_vec1()).expect("values");
            for h in 0..heads {
                for (b, key) in [(1, 4), (1, 5), (0, 2)] {
                    let at = ((b * heads + h) * s + key) * d;
                    assert!(v[at..at + d].iter().all(|&x| x == 0.0), "key {key} of {b}");
                }
            }
        }
    }
}
