//! Matryoshka representation learning (Kusupati et al. 2022) over one representation
//! pass: the inner loss is computed on the first `d` columns of the queries and passages
//! for each of several widths `d`, and the weighted sum is the loss, so that every prefix
//! of the embedding is itself a usable embedding (sentence-transformers' `MatryoshkaLoss`).
//!
//! The gradient cache needs only the loss's gradient with respect to the representations:
//! each width's gradient lands in its prefix columns and they add up, so one cached
//! representation pass serves every width, and the cached step stays equal to the full
//! batch. With cosine similarity each prefix is normalised on its own (as truncating and
//! then normalising does).

use candle_core::Tensor;

use crate::loss::{Loss, LossValue};
use crate::params::{Gradients, Params};
use crate::{Error, Result};

/// The loss `sum_i w_i * inner(q[:, :d_i], p[:, :d_i])`.
#[derive(Debug, Clone, PartialEq)]
pub struct Matryoshka<L> {
    inner: L,
    dims: Vec<usize>,
    weights: Vec<f64>,
}

impl<L: Loss> Matryoshka<L> {
    /// `inner` over the prefixes `dims` (each at least 1, distinct), weighted by `weights`
    /// (empty: 1 each). An empty `dims` is the inner loss alone.
    pub fn new(inner: L, dims: Vec<usize>, weights: Vec<f64>) -> Result<Self> {
        if dims.contains(&0) {
            return Err(Error::InvalidConfig {
                field: "loss.matryoshka_dims",
                value: format!("{dims:?}"),
                reason: "every width must be at least 1",
            });
        }
        let mut sorted = dims.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != dims.len() {
            return Err(Error::InvalidConfig {
                field: "loss.matryoshka_dims",
                value: format!("{dims:?}"),
                reason: "widths must be distinct",
            });
        }
        let weights = if weights.is_empty() {
            vec![1.0; dims.len()]
        } else {
            weights
        };
        if weights.len() != dims.len() || weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
            return Err(Error::InvalidConfig {
                field: "loss.matryoshka_weights",
                value: format!("{weights:?}"),
                reason: "one positive finite weight per width (or none: 1 each)",
            });
        }
        Ok(Self {
            inner,
            dims,
            weights,
        })
    }

    /// The widths (empty: the inner loss alone).
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The inner loss.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// Checks that every width fits the representations.
    fn check(&self, width: usize) -> Result<()> {
        if let Some(&d) = self.dims.iter().find(|&&d| d > width) {
            return Err(Error::InvalidConfig {
                field: "loss.matryoshka_dims",
                value: d.to_string(),
                reason: "a width is larger than the embedding",
            });
        }
        Ok(())
    }
}

/// The first `d` columns of `x`, contiguous (CUDA's matrix products take no row stride
/// other than the width).
fn prefix(x: &Tensor, d: usize) -> Result<Tensor> {
    Ok(x.narrow(1, 0, d)?.contiguous()?)
}

/// `g` `[rows, d]` placed in the first `d` columns of a `[rows, width]` zero matrix.
fn pad_columns(g: &Tensor, width: usize) -> Result<Tensor> {
    let (rows, d) = g.dims2()?;
    if d == width {
        return Ok(g.clone());
    }
    let rest = Tensor::zeros((rows, width - d), g.dtype(), g.device())?;
    Ok(Tensor::cat(&[g, &rest], 1)?)
}

impl<L: Loss> Loss for Matryoshka<L> {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        if self.dims.is_empty() {
            return self.inner.forward(queries, passages);
        }
        self.check(queries.dim(1)?)?;
        let mut total: Option<Tensor> = None;
        for (&d, &w) in self.dims.iter().zip(&self.weights) {
            let l = (self
                .inner
                .forward(&prefix(queries, d)?, &prefix(passages, d)?)?
                * w)?;
            total = Some(match total {
                Some(t) => (t + l)?,
                None => l,
            });
        }
        total.ok_or_else(|| Error::EmptyBatch {
            side: crate::Side::Query,
        })
    }

    fn params(&self) -> Params {
        self.inner.params()
    }

    /// Each width's value and gradients from the inner loss (its own blocked, closed-form
    /// path), weighted, the gradients padded back to the full width and summed.
    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        if self.dims.is_empty() {
            return self.inner.value_and_grads(queries, passages);
        }
        let width = queries.dim(1)?;
        self.check(width)?;
        let mut loss = 0f64;
        let mut grad_q = queries.zeros_like()?.detach();
        let mut grad_p = passages.zeros_like()?.detach();
        let mut params = Gradients::default();
        for (&d, &w) in self.dims.iter().zip(&self.weights) {
            let v = self
                .inner
                .value_and_grads(&prefix(queries, d)?, &prefix(passages, d)?)?;
            loss += w * f64::from(v.loss);
            grad_q = (grad_q + pad_columns(&(v.grad_queries * w)?, width)?)?;
            grad_p = (grad_p + pad_columns(&(v.grad_passages * w)?, width)?)?;
            let mut own = v.params;
            own.scale(w)?;
            params.accumulate(own)?;
        }
        Ok(LossValue {
            loss: loss as f32,
            grad_queries: grad_q,
            grad_passages: grad_p,
            params,
        })
    }
}
