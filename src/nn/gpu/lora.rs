//! A LoRA adapter inside the GPU layer nodes: the low-rank branch of one projection,
//!
//! ```text
//! y  += s t B^T              t = dropout(x) A^T   [rows, r]
//! dB  = s dy^T t             dt = s dy B           [rows, r]
//! dA  = dt^T dropout(x)      dx += dropout(dt A)   (the same mask)
//! ```
//!
//! as the CPU nodes run it (`crate::nn::cpu::products::lora_branch`): the mask of each element that
//! of its place in the projection's padded `[n s, in]` input, nothing kept (the backward
//! draws the mask again and recomputes `t`, a product of rank `r`), and the frozen base
//! weight's own gradient, the largest product of a projection's backward, never computed.

use candle_core::Tensor;

use crate::nn::kernels as k;
use crate::nn::lora::LoraInput;

/// An adapter as a GPU node holds it (detached: the node hands `A` and `B` their
/// gradients).
pub(super) struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: Option<(u64, f32)>,
}

/// What [`Adapter::backward`] gives: the gradients of `A` and `B` (in their dtypes) and the
/// branch's part of the input's gradient.
pub(super) struct AdapterGrads {
    pub(super) a: Tensor,
    pub(super) b: Tensor,
    pub(super) x: Tensor,
}

impl Adapter {
    pub(super) fn new(l: &LoraInput) -> Self {
        Self {
            a: l.a.detach(),
            b: l.b.detach(),
            scale: l.scale,
            dropout: l.dropout.filter(|&(_, p)| p > 0.0),
        }
    }

    fn dropped(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.dropout {
            Some((seed, p)) => k::dropout(x, seed, p),
            None => Ok(x.clone()),
        }
    }

    /// `s dropout(x) A^T B^T` for `x` `[rows, in]` in `x`'s dtype: what the branch adds to
    /// the projection.
    pub(super) fn delta(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let t = self.dropped(x)?.matmul(&self.a.to_dtype(dtype)?.t()?)?;
        (t.matmul(&self.b.to_dtype(dtype)?.t()?)? * self.scale)?.to_dtype(dtype)
    }

    /// The branch's gradients from the projection output's gradient `dy` `[rows, out]` and
    /// its input `x` `[rows, in]`.
    pub(super) fn backward(&self, dy: &Tensor, x: &Tensor) -> candle_core::Result<AdapterGrads> {
        let dtype = x.dtype();
        let (a, b) = (self.a.to_dtype(dtype)?, self.b.to_dtype(dtype)?);
        let dy = dy.contiguous()?;
        let xd = self.dropped(x)?;
        let t = xd.matmul(&a.t()?)?;
        let db = (dy.t()?.matmul(&t)? * self.scale)?;
        let dt = (dy.matmul(&b)? * self.scale)?;
        let da = dt.t()?.matmul(&xd)?;
        let dx = self.dropped(&dt.matmul(&a)?)?;
        Ok(AdapterGrads {
            a: da.to_dtype(self.a.dtype())?,
            b: db.to_dtype(self.b.dtype())?,
            x: dx,
        })
    }
}

/// The adapters of a stacked product (`projections` side by side in its output columns):
/// their deltas as one `[rows, sum of widths]` tensor, zeros under a projection without
/// one; `None` when none has one.
pub(super) fn stacked_delta(
    adapters: &[(Option<&Adapter>, usize)],
    x: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    if adapters.iter().all(|(a, _)| a.is_none()) {
        return Ok(None);
    }
    let rows = x.dim(0)?;
    let parts = adapters
        .iter()
        .map(|&(a, width)| match a {
            Some(a) => a.delta(x),
            None => Tensor::zeros((rows, width), x.dtype(), x.device()),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Some(Tensor::cat(&parts, 1)?))
}

/// The adapters of a stacked product backward: each adapter's gradients from its columns
/// `first .. first + width` of the product's gradient `dy`, and the sum of their parts of
/// the input's gradient (`None` without adapters).
#[allow(clippy::type_complexity)]
pub(super) fn stacked_backward(
    adapters: &[(Option<&Adapter>, usize)],
    dy: &Tensor,
    x: &Tensor,
) -> candle_core::Result<(Vec<Option<AdapterGrads>>, Option<Tensor>)> {
    let mut first = 0;
    let mut grads = Vec::with_capacity(adapters.len());
    let mut dx: Option<Tensor> = None;
    for &(adapter, width) in adapters {
        match adapter {
            Some(a) => {
                let g = a.backward(&dy.narrow(1, first, width)?, x)?;
                dx = Some(match dx {
                    Some(d) => (d + &g.x)?,
                    None => g.x.clone(),
                });
                grads.push(Some(g));
            }
            None => grads.push(None),
        }
        first += width;
    }
    Ok((grads, dx))
}

/// `dx` plus the adapters' part, when there is one.
pub(super) fn plus(dx: Tensor, part: Option<Tensor>) -> candle_core::Result<Tensor> {
    match part {
        Some(p) => {
            let p = p.to_dtype(dx.dtype())?;
            dx + p
        }
        None => Ok(dx),
    }
}
