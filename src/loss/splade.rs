//! The loss of a sparse (SPLADE) model: a base contrastive loss on the sparse vectors
//! plus sentence-transformers' `SpladeLoss` regularisers, FLOPS (Paria et al. 2020) on
//! the queries and on the documents: `w sum_j (mean_i x_ij)^2` over the batch's rows, which
//! drives each vocabulary entry's average weight, and with it the number of active
//! entries, down. With a threshold, a row with at most that many non-zero entries is left
//! out of the sum (but still counts in the mean's denominator), as sentence-transformers'
//! `FlopsLoss(threshold=...)`.
//!
//! Under the gradient cache the loss sees every representation of the (global) batch, so
//! the means are over the whole batch, as a full-batch step computes them.

use candle_core::{DType, Tensor};

use super::{scalar, Loss, LossValue};
use crate::params::Params;
use crate::{Error, Result};

/// One FLOPS regulariser: its weight and optional threshold of active entries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flops {
    /// The regulariser's weight (`document_regularizer_weight`, `query_regularizer_weight`).
    pub weight: f64,
    /// Rows with at most this many non-zero entries are left out of the sum.
    pub threshold: Option<usize>,
}

impl Flops {
    /// A regulariser of weight `weight` (>= 0) without a threshold.
    pub fn new(weight: f64) -> Result<Self> {
        if !(weight >= 0.0 && weight.is_finite()) {
            return Err(Error::InvalidArgument {
                what: "FLOPS regulariser weight",
                value: weight.to_string(),
                reason: "must be a finite number >= 0",
            });
        }
        Ok(Self {
            weight,
            threshold: None,
        })
    }

    /// With rows of at most `threshold` active entries left out.
    pub fn with_threshold(mut self, threshold: Option<usize>) -> Self {
        self.threshold = threshold;
        self
    }

    /// The rows `[n, d]` this regulariser counts (a row left out by the threshold is
    /// zeroed), as a mask `[n, 1]` of 0 and 1.
    fn row_mask(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(threshold) = self.threshold else {
            return Ok(None);
        };
        let active = x
            .ne(0.0)?
            .to_dtype(candle_core::DType::F32)?
            .sum_keepdim(1)?;
        Ok(Some(active.gt(threshold as f64)?.to_dtype(x.dtype())?))
    }

    /// `w sum_j (mean_i m_i x_ij)^2` as a differentiable scalar.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.row_mask(&x.detach())? {
            Some(m) => x.broadcast_mul(&m)?,
            None => x.clone(),
        };
        Ok((x.mean(0)?.sqr()?.sum_all()? * self.weight)?)
    }

    /// The value and its gradient `2 w mean_j m_i / n` with respect to `x`.
    fn value_and_grad(&self, x: &Tensor) -> Result<(f32, Tensor)> {
        let (value, grad) = self.value_and_row_grad(x)?;
        let grad = match grad {
            FlopsGrad::Row(row) => row.broadcast_as(x.shape())?.contiguous()?,
            FlopsGrad::Full(g) => g,
        };
        Ok((value, grad))
    }

    /// [`Self::value_and_grad`], the gradient as the one row every row of `x` gets when
    /// no threshold leaves rows out (so that it can be added in place).
    fn value_and_row_grad(&self, x: &Tensor) -> Result<(f32, FlopsGrad)> {
        let n = x.dim(0)?;
        let mask = self.row_mask(x)?;
        let masked = match &mask {
            Some(m) => x.broadcast_mul(m)?,
            None => x.clone(),
        };
        let mean = masked.mean_keepdim(0)?;
        let value = scalar(&(mean.sqr()?.sum_all()? * self.weight)?)?;
        let row = (mean * (2.0 * self.weight / n as f64))?;
        let grad = match &mask {
            Some(m) => FlopsGrad::Full(row.broadcast_as(x.shape())?.broadcast_mul(m)?),
            None => FlopsGrad::Row(row),
        };
        Ok((value, grad))
    }
}

/// A FLOPS regulariser's gradient: one row for every row, or a full matrix.
enum FlopsGrad {
    Row(Tensor),
    Full(Tensor),
}

impl FlopsGrad {
    /// `acc + self`: in place on the CPU where the gradient is one row (the base loss's
    /// gradient, which `acc` is, is owned by the caller), else a new tensor.
    fn add_to(self, acc: Tensor) -> Result<Tensor> {
        match self {
            FlopsGrad::Row(row)
                if acc.device().is_cpu()
                    && acc.is_contiguous()
                    && matches!(acc.dtype(), DType::F32 | DType::F64)
                    && row.dtype() == acc.dtype() =>
            {
                crate::nn::cpu::add_row_in_place(&acc, &row)?;
                Ok(acc)
            }
            FlopsGrad::Row(row) => Ok(acc.broadcast_add(&row)?),
            FlopsGrad::Full(g) => Ok((acc + g)?),
        }
    }
}

/// A base loss on sparse vectors plus FLOPS regularisers on the documents (every passage:
/// positives and hard negatives) and, optionally, on the queries; or, with
/// `documents_only`, one regulariser over queries and passages together
/// (`use_document_regularizer_only`, for symmetric data).
pub struct SpladeLoss<L> {
    inner: L,
    documents: Flops,
    queries: Option<Flops>,
    documents_only: bool,
    scale: WeightScale,
}

/// The fraction of the regularisers' weights in effect (1 by default): a handle the
/// trainer keeps to warm the weights up step by step while the loss sits inside the
/// gradient cache.
#[derive(Debug, Clone)]
pub struct WeightScale(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Default for WeightScale {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightScale {
    /// A scale of 1.
    pub fn new() -> Self {
        Self(std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
            1f64.to_bits(),
        )))
    }

    /// Sets the fraction (the weights are the configured ones times it).
    pub fn set(&self, fraction: f64) {
        self.0
            .store(fraction.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// The fraction in effect.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The loss's value split into its parts (the base loss, each regulariser's weighted
/// term), for the metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpladeParts {
    /// The base loss.
    pub base: f32,
    /// The documents' weighted FLOPS term.
    pub documents: f32,
    /// The queries' weighted FLOPS term (0 without one).
    pub queries: f32,
}

impl<L: Loss> SpladeLoss<L> {
    /// `inner` plus the documents' regulariser (no query regulariser: add one with
    /// [`Self::with_queries`]).
    pub fn new(inner: L, documents: Flops) -> Self {
        Self {
            inner,
            documents,
            queries: None,
            documents_only: false,
            scale: WeightScale::new(),
        }
    }

    /// The handle that scales both regularisers' weights (a warm-up).
    pub fn weight_scale(&self) -> &WeightScale {
        &self.scale
    }

    /// Scaled by `scale`, a handle shared with other losses (a mixture's per-source
    /// losses warm up together).
    pub fn with_weight_scale(mut self, scale: WeightScale) -> Self {
        self.scale = scale;
        self
    }

    /// The documents' and queries' regularisers at the current scale.
    fn scaled(&self) -> (Flops, Option<Flops>) {
        let s = self.scale.get();
        let scale = |f: &Flops| Flops {
            weight: f.weight * s,
            ..*f
        };
        (scale(&self.documents), self.queries.as_ref().map(scale))
    }

    /// With a regulariser on the queries.
    pub fn with_queries(mut self, queries: Option<Flops>) -> Self {
        self.queries = queries;
        self
    }

    /// Every row a document: one regulariser (the documents') over queries and passages
    /// together; a query regulariser is then refused.
    pub fn with_documents_only(mut self, on: bool) -> Result<Self> {
        if on && self.queries.is_some() {
            return Err(Error::InvalidArgument {
                what: "SPLADE loss",
                value: "a query regulariser with use_document_regularizer_only".into(),
                reason: "with every row a document there is no query regulariser: leave \
                         the query weight unset",
            });
        }
        self.documents_only = on;
        Ok(self)
    }

    /// The base loss.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// The value split into the base loss and the two weighted regularisers.
    pub fn parts(&self, queries: &Tensor, passages: &Tensor) -> Result<SpladeParts> {
        let base = self.inner.value_and_grads(queries, passages)?.loss;
        let (doc, query) = self.scaled();
        let (documents, queries) = if self.documents_only {
            let all = Tensor::cat(&[queries, passages], 0)?;
            (doc.value_and_grad(&all)?.0, 0.0)
        } else {
            let q = match &query {
                Some(f) => f.value_and_grad(queries)?.0,
                None => 0.0,
            };
            (doc.value_and_grad(passages)?.0, q)
        };
        Ok(SpladeParts {
            base,
            documents,
            queries,
        })
    }
}

impl<L: Loss> Loss for SpladeLoss<L> {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let mut loss = self.inner.forward(queries, passages)?;
        let (doc, query) = self.scaled();
        if self.documents_only {
            let all = Tensor::cat(&[queries, passages], 0)?;
            return Ok((loss + doc.forward(&all)?)?);
        }
        loss = (loss + doc.forward(passages)?)?;
        if let Some(q) = &query {
            loss = (loss + q.forward(queries)?)?;
        }
        Ok(loss)
    }

    fn params(&self) -> Params {
        self.inner.params()
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let mut out = self.inner.value_and_grads(queries, passages)?;
        let (doc, query) = self.scaled();
        if self.documents_only {
            let all = Tensor::cat(&[queries, passages], 0)?;
            let (value, grad) = doc.value_and_grad(&all)?;
            let q = queries.dim(0)?;
            out.loss += value;
            out.grad_queries = (out.grad_queries + grad.narrow(0, 0, q)?)?;
            out.grad_passages = (out.grad_passages + grad.narrow(0, q, passages.dim(0)?)?)?;
            return Ok(out);
        }
        // The regularisers' gradients go into the base loss's in place: no second
        // vocabulary-wide matrix per side (the loss phase stays flat in the batch).
        let (value, grad) = doc.value_and_row_grad(passages)?;
        out.loss += value;
        out.grad_passages = grad.add_to(out.grad_passages)?;
        if let Some(f) = &query {
            let (value, grad) = f.value_and_row_grad(queries)?;
            out.loss += value;
            out.grad_queries = grad.add_to(out.grad_queries)?;
        }
        Ok(out)
    }
}

/// The number of non-zero entries of each row `[n, d]`, averaged over the rows: the
/// active dimensions of sparse vectors.
pub fn mean_active(x: &Tensor) -> Result<f64> {
    let n = x.dim(0)?.max(1);
    let active = x
        .ne(0.0)?
        .to_dtype(candle_core::DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(active as f64 / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The regulariser's gradient is the derivative of its value (autograd on `forward`).
    #[test]
    fn the_flops_gradient_is_its_derivative() {
        let x = Tensor::from_vec(
            vec![
                0.0f32, 1.5, 0.0, 2.0, 0.5, 0.0, 0.0, 0.0, 3.0, 0.25, 1.0, 0.0,
            ],
            (3, 4),
            &Device::Cpu,
        )
        .unwrap();
        for threshold in [None, Some(1), Some(2)] {
            let f = Flops::new(0.3).unwrap().with_threshold(threshold);
            let v = Var::from_tensor(&x).unwrap();
            let loss = f.forward(v.as_tensor()).unwrap();
            let want = loss.backward().unwrap().get(v.as_tensor()).unwrap().clone();
            let (value, grad) = f.value_and_grad(&x).unwrap();
            assert!((value - loss.to_scalar::<f32>().unwrap()).abs() < 1e-6);
            let diff = (grad - want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(diff < 1e-6, "{threshold:?}: {diff}");
        }
        // Threshold 1: the second row (one active entry) is left out of the sum, not of
        // the mean's denominator.
        let (value, _) = Flops::new(1.0)
            .unwrap()
            .with_threshold(Some(1))
            .value_and_grad(&x)
            .unwrap();
        let want: f32 = [0.0f32 + 3.0, 1.5 + 0.25, 0.0 + 1.0, 2.0 + 0.0]
            .iter()
            .map(|s| (s / 3.0).powi(2))
            .sum();
        assert!((value - want).abs() < 1e-6, "{value} vs {want}");
        assert!(Flops::new(-1.0).is_err());
        assert!(Flops::new(f64::NAN).is_err());
    }

    /// Every row a document leaves no query regulariser to have.
    #[test]
    fn documents_only_refuses_a_query_regulariser() {
        let base = crate::loss::InfoNce::new(1.0).unwrap();
        let loss = SpladeLoss::new(base, Flops::new(1e-3).unwrap())
            .with_queries(Some(Flops::new(1e-3).unwrap()));
        let err = loss.with_documents_only(true).err().unwrap().to_string();
        assert!(err.contains("query"), "{err}");
    }
}
