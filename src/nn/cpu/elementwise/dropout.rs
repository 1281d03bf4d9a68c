//! Inverted dropout whose mask is regenerated from its seed on demand (a counter-based
//! stream, [`crate::rng::keep`]): nothing is stored, and the backward applies the same
//! mask. Also `dropout(x) + residual` in one pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor, WithDType};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{contiguous, dispatch, for_blocks, Float, BLOCK_ROWS};

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

wide_fn! {
/// `dropout(x) + residual` (the residual optional) in one pass, the elements of `x` from
/// element `start` of the masked tensor on.
pub(in crate::nn) fn dropout_add_fwd<T: Float>(
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
}

/// `dropout(x) + residual`, `CustomOp2(x, residual)`, without a backward: the forward of
/// [`add_norm`].
pub(in crate::nn) struct DropoutAdd {
    pub(in crate::nn) seed: u64,
    pub(in crate::nn) p: f32,
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
