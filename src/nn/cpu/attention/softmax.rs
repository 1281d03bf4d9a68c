//! The scaled and masked softmax of attention scores, `softmax(scale * scores + bias)`,
//! with its backward `scale * p * (dy - sum(dy * p))`: it keeps the probabilities.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, WithDType};

use crate::nn::cpu::attention::heads::{softmax_row, KeyMask};
use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{contiguous, dispatch, for_blocks, Float, BLOCK_ROWS};

/// `softmax(scale * scores + bias)` over the last dimension: `CustomOp2(scores, bias)`,
/// scores `[n, heads, q, k]`, bias `[n, 1, 1, k]` (added to every head and query row of
/// sequence `n`). No gradient flows to the bias.
#[derive(Debug, Clone, Copy)]
pub struct MaskedSoftmax {
    /// Multiplies the scores before the bias is added.
    pub scale: f64,
}

wide_fn! {
pub(in crate::nn) fn softmax_fwd<T: Float>(
    x: &[T],
    bias: &[T],
    k: usize,
    rows_per_seq: usize,
    scale: f64,
) -> Vec<T> {
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

wide_fn! {
pub(in crate::nn) fn softmax_bwd<T: Float>(p: &[T], dy: &[T], k: usize, scale: f64) -> Vec<T> {
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
