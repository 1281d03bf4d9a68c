//! `act(x + b)` for GELU (erf or tanh) and ReLU, with its backward: it keeps the input
//! and recomputes the pre-activation, giving `dx` (optionally over `dy` in place) and
//! `db`.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, WithDType};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{
    check_width, contiguous, dispatch, for_blocks, for_blocks_with_partials, sum_partials, Float,
    BLOCK_ROWS,
};
use crate::nn::cpu::elementwise::math::Act;

/// `act(x + b)` over the last dimension: `CustomOp2(x, b)`.
#[derive(Debug, Clone, Copy)]
pub struct BiasActivation {
    /// The activation.
    pub act: Act,
}

wide_fn! {
pub(in crate::nn) fn bias_act_fwd<T: Float>(x: &[T], b: &[T], act: Act) -> Vec<T> {
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
                Act::Silu => each!(Act::Silu),
            }
        }
    });
    out
}
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

pub(in crate::nn) fn bias_act_bwd<T: Float>(x: &[T], b: &[T], dy: &[T], act: Act) -> Vec<T> {
    let mut dx = Vec::with_capacity(x.len() + b.len());
    dx.extend_from_slice(dy);
    let db = bias_act_bwd_in_place(x, b, &mut dx, act);
    dx.extend(db);
    dx
}

wide_fn! {
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
                Act::Silu => each!(Act::Silu),
            }
        }
    });
    sum_partials(&partials, w)
}
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
pub(in crate::nn) fn bias_activation_backward_in_place(
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
