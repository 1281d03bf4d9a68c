//! Masked mean pooling over a sequence, optionally L2-normalised (sentence-transformers'
//! `Pooling(mean)` followed by `Normalize`), as one node with its backward written out.
//!
//! ```text
//! p = sum_t mask[t] x[t] / max(sum_t mask[t], 1)
//! y = p / max(|p|, 1e-12)                       (with normalize)
//! ```
//!
//! The composed form multiplies the whole `[n, s, h]` output of the last layer by the mask
//! (a pass and a buffer), sums, divides, and normalises through five more ops; its
//! backward broadcasts the gradient back to `[n, s, h]`, multiplies it by the mask again,
//! and every op adds into a zero-filled accumulator. Here the forward reads the real
//! tokens once, and the backward writes `dx` once. It keeps the mask, the counts and the
//! `[n, h]` output (and the norms): nothing of `[n, s, h]`.

use candle_core::{DType, Tensor};

use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::layers::packing::View;
use crate::nn::node::node_n_owned;

/// Below this norm a row is divided by it instead (`torch.nn.functional.normalize`).
const MIN_NORM: f64 = 1e-12;

/// The mean of `x` `[n, s, h]` over the positions where `mask` `[n, s]` is 1 (a row
/// without any counts as one position), L2-normalised with `normalize`: `[n, h]`. One
/// node over `x` (CPU, f32 or f64); the plain forward when `x` is not tracked.
pub fn mean_pool(x: &Tensor, mask: &Tensor, normalize: bool) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    if mask.dims2()? != (n, s) {
        candle_core::bail!(
            "mean pooling: hidden states {:?} and a mask {:?} do not fit",
            x.dims(),
            mask.dims()
        );
    }
    match x.dtype() {
        DType::F32 => pool::<f32>(x, mask, (n, s, h), normalize),
        DType::F64 => pool::<f64>(x, mask, (n, s, h), normalize),
        other => candle_core::bail!("mean pooling: run in f32 or f64, not {other:?}"),
    }
}

fn pool<T: Float>(
    x: &Tensor,
    mask: &Tensor,
    (n, s, h): (usize, usize, usize),
    normalize: bool,
) -> candle_core::Result<Tensor> {
    let mask: Vec<T> = mask.to_dtype(x.dtype())?.flatten_all()?.to_vec1()?;
    // max(count, 1) per row.
    let counts: Vec<T> = mask
        .chunks_exact(s)
        .map(|m| num_traits::Float::max(m.iter().copied().sum::<T>(), T::one()))
        .collect();
    let detached = x.detach().contiguous()?;
    let mut y = vec![T::zero(); n * h];
    {
        let view = View::new(&detached)?;
        let xs = view.values::<T>()?;
        for (b, out) in y.chunks_exact_mut(h).enumerate() {
            for t in 0..s {
                let m = mask[b * s + t];
                if m == T::zero() {
                    continue;
                }
                let row = &xs[(b * s + t) * h..(b * s + t + 1) * h];
                for (o, &v) in out.iter_mut().zip(row) {
                    *o += v * m;
                }
            }
            for o in out.iter_mut() {
                *o /= counts[b];
            }
        }
    }
    // Each row's divisor: its norm (at least MIN_NORM) with normalize, else none.
    let norms: Vec<T> = if normalize {
        y.chunks_exact_mut(h)
            .map(|row| {
                let norm = row.iter().map(|&v| v * v).sum::<T>().sqrt();
                let norm = num_traits::Float::max(norm, T::of(MIN_NORM));
                for v in row.iter_mut() {
                    *v /= norm;
                }
                norm
            })
            .collect()
    } else {
        vec![]
    };
    if !x.track_op() {
        return Tensor::from_vec(y, (n, h), &candle_core::Device::Cpu);
    }
    let out = y.clone();
    node_n_owned(
        "gradcache-mean-pool",
        &[x],
        y,
        (n, h).into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let view = View::new(&dy)?;
            let dys = view.values::<T>()?;
            let mut dx = vec![T::zero(); n * s * h];
            let mut dp = vec![T::zero(); h];
            for b in 0..n {
                let g = &dys[b * h..(b + 1) * h];
                if normalize {
                    // y = p / r: dp = (g - y (y . g)) / r while r is above the floor, where
                    // the divisor is a constant: dp = g / r.
                    let yb = &out[b * h..(b + 1) * h];
                    let r = norms[b];
                    let dot = if r > T::of(MIN_NORM) {
                        yb.iter().zip(g).map(|(&a, &c)| a * c).sum::<T>()
                    } else {
                        T::zero()
                    };
                    for ((d, &gv), &yv) in dp.iter_mut().zip(g).zip(yb) {
                        *d = (gv - yv * dot) / r;
                    }
                } else {
                    dp.copy_from_slice(g);
                }
                for t in 0..s {
                    let m = mask[b * s + t];
                    if m == T::zero() {
                        continue;
                    }
                    let row = &mut dx[(b * s + t) * h..(b * s + t + 1) * h];
                    for (d, &v) in row.iter_mut().zip(&dp) {
                        *d = v / counts[b] * m;
                    }
                }
            }
            Ok(vec![Some(Tensor::from_vec(
                dx,
                (n, s, h),
                &candle_core::Device::Cpu,
            )?)])
        }),
    )
}
