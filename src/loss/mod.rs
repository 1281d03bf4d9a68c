//! Contrastive losses over query and passage representations.
//!
//! The gradient cache needs from a loss its value and its gradient with respect to every
//! representation ([`Loss::value_and_grads`]); a plain training step needs a
//! differentiable scalar ([`Loss::forward`]). [`InfoNce`] provides both, with in-batch and
//! hard negatives, a temperature, dot or cosine similarity, an optional symmetric term, and
//! a row-block mode in which the `B x B(k+1)` logits matrix never exists at once (as in
//! sentence-transformers' cached losses). [`FnLoss`] turns any differentiable closure into a
//! loss, like the `loss_fn` of the reference GradCache.

pub mod distillation;
mod infonce;
pub mod matryoshka;
pub mod maxsim;
pub mod scores;
pub mod splade;

use candle_core::{DType, Tensor, Var};

use crate::params::{Gradients, ParamStore, Params};
use crate::{Error, Result};

pub use distillation::{MaxSimDistillation, TeacherScores};
pub use infonce::{Guide, InfoNce, LossDirection};
pub use matryoshka::Matryoshka;
pub use maxsim::MaxSim;
pub use scores::{GroupObjective, GroupScores, Weighted};
pub use splade::{Flops, SpladeLoss, WeightScale};

pub use crate::nn::cpu::infonce::{Columns, Exclude, Rows, Segment, Term};
pub use crate::nn::l2_normalize;
pub(crate) use crate::nn::l2_normalize_backward;

/// The most logits (2^22, 16 MiB of f32) one row block of the composed loss holds when no
/// block size is set: one block up to a batch of 2,048 pairs without hard negatives, row
/// blocks beyond, so that the loss, the one piece of a cached step that grows with the
/// square of the batch, grows only linearly. A block's forward and backward hold about a
/// dozen logits-sized temporaries (measured: one block of 4,096 x 4,096 logits, 64 MiB,
/// peaked at 814 MiB), so a block peaks near 200 MiB. (The CPU kernel holds a block by a
/// tile whatever the batch.)
pub const AUTO_BLOCK_LOGITS: usize = 1 << 22;

/// The composed loss's row blocks for `rows` anchors of `candidates` logits each when no
/// size is set: one block (`None`) while their logits fit in [`AUTO_BLOCK_LOGITS`], else
/// as many rows as fit (at least one).
pub fn auto_block_rows(rows: usize, candidates: usize) -> Option<usize> {
    let candidates = candidates.max(1);
    if rows.saturating_mul(candidates) <= AUTO_BLOCK_LOGITS {
        None
    } else {
        Some((AUTO_BLOCK_LOGITS / candidates).max(1))
    }
}

/// Anchor rows per block of the CPU loss kernel when no size is set.
pub const KERNEL_BLOCK_ROWS: usize = 256;

/// A loss's value and its gradients with respect to the representations, detached.
#[derive(Debug, Clone)]
pub struct LossValue {
    /// The scalar loss.
    pub loss: f32,
    /// dL/d queries, `[queries, width]`.
    pub grad_queries: Tensor,
    /// dL/d passages, `[passages, width]`.
    pub grad_passages: Tensor,
    /// Gradients of the loss's own parameters ([`Loss::params`], e.g. a learnable
    /// temperature); empty for a loss without parameters.
    pub params: Gradients,
}

/// A contrastive loss over query representations `[Q, d]` and passage representations
/// `[P, d]`.
pub trait Loss {
    /// The loss as a differentiable scalar (the graph is kept), for plain training steps.
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor>;

    /// The loss's own trainable parameters (a learnable temperature, as CLIP's logit
    /// scale); none by default. The gradient cache adds their gradients to the step's.
    fn params(&self) -> Params {
        Params::default()
    }

    /// The loss value and its gradients with respect to both inputs (and to the loss's own
    /// parameters), detached. The default back-propagates [`Loss::forward`] once over
    /// copies of the inputs.
    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let q = Var::from_tensor(&queries.detach())?;
        let p = Var::from_tensor(&passages.detach())?;
        let loss = self.forward(q.as_tensor(), p.as_tensor())?;
        let value = scalar(&loss)?;
        let store = loss.backward()?;
        let grad = |v: &Var| -> Result<Tensor> {
            Ok(match store.get(v.as_tensor()) {
                Some(g) => g.detach(),
                None => v.as_tensor().zeros_like()?.detach(),
            })
        };
        Ok(LossValue {
            loss: value,
            grad_queries: grad(&q)?,
            grad_passages: grad(&p)?,
            params: self.params().grads_from(&store),
        })
    }

    /// Whether queries and passages must be rows of one width (single vectors); a
    /// multi-vector loss scores token matrices of different lengths.
    fn requires_equal_widths(&self) -> bool {
        true
    }
}

/// How query and passage representations are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Similarity {
    /// Inner product (DPR).
    #[default]
    Dot,
    /// Cosine: inner product of L2-normalised vectors.
    Cosine,
}

impl Similarity {
    /// The name sentence-transformers gives it (`similarity_fn_name`).
    pub fn sentence_transformers_name(self) -> &'static str {
        match self {
            Similarity::Dot => "dot",
            Similarity::Cosine => "cosine",
        }
    }

    /// Reads a sentence-transformers `similarity_fn_name` (`dot_product` is its older
    /// spelling of `dot`); `None` for the ones not implemented here.
    pub fn from_sentence_transformers_name(name: &str) -> Option<Self> {
        match name {
            "cosine" => Some(Similarity::Cosine),
            "dot" | "dot_product" => Some(Similarity::Dot),
            _ => None,
        }
    }
}

/// CLIP's loss (Radford et al. 2021): symmetric InfoNCE over L2-normalised embeddings,
/// the mean of the query-to-passage and passage-to-query cross-entropies, with a
/// *learnable* temperature: the logits are `exp(logit_scale) * cos(q, p)`, `logit_scale`
/// a trainable scalar (`logit_scale` in the store) that starts at `ln(1 / temperature)`.
/// As in CLIP and OpenCLIP, the trainer clamps it to `[0, ln(max_logit_scale)]` after
/// every optimizer update ([`ClipLoss::clamp`]), so the logits never exceed 100 times
/// the cosine by default. The terms are [`InfoNce`]'s (symmetric, over the normalised
/// queries scaled by `exp(logit_scale)`), so passages may carry hard negatives as there.
pub struct ClipLoss {
    infonce: InfoNce,
    logit_scale: Var,
    name: String,
    max_logit_scale: f64,
}

impl ClipLoss {
    /// The loss with its logit scale `name` in `store` (created at `ln(1 / temperature)`
    /// unless the store already has it).
    pub fn new(
        store: &ParamStore,
        name: &str,
        temperature: f64,
        max_logit_scale: f64,
    ) -> Result<Self> {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(Error::InvalidConfig {
                field: "loss.temperature",
                value: temperature.to_string(),
                reason: "the initial temperature must be positive",
            });
        }
        if !(max_logit_scale >= 1.0 && max_logit_scale.is_finite()) {
            return Err(Error::InvalidConfig {
                field: "loss.max_logit_scale",
                value: max_logit_scale.to_string(),
                reason: "the largest logit scale must be at least 1 (CLIP uses 100)",
            });
        }
        let init = candle_nn::Init::Const((1.0 / temperature).ln().min(max_logit_scale.ln()));
        store.var_builder().get_with_hints((), name, init)?;
        let logit_scale = store.get(name).ok_or_else(|| Error::MissingWeight {
            name: name.to_string(),
            path: "the parameter store".into(),
        })?;
        Ok(Self {
            infonce: InfoNce::new(1.0)?.with_symmetric(true),
            logit_scale,
            name: name.to_string(),
            max_logit_scale,
        })
    }

    /// The current logit scale `exp(logit_scale)` (one over the temperature).
    pub fn scale(&self) -> Result<f64> {
        Ok(f64::from(
            self.logit_scale
                .as_tensor()
                .to_dtype(DType::F32)?
                .exp()?
                .to_scalar::<f32>()?,
        ))
    }

    /// Clamps the parameter to `[0, ln(max_logit_scale)]` (after an optimizer update).
    pub fn clamp(&self) -> Result<()> {
        let t = self.logit_scale.as_tensor();
        let clamped = t.clamp(0f32, self.max_logit_scale.ln() as f32)?;
        self.logit_scale.set(&clamped)?;
        Ok(())
    }
}

impl Loss for ClipLoss {
    /// InfoNCE's symmetric terms over `exp(logit_scale) * q / |q|` and `p / |p|`: the
    /// logits `exp(logit_scale) * cos(q, p)` in both directions.
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let q = l2_normalize(&queries.to_dtype(DType::F32)?)?;
        let p = l2_normalize(&passages.to_dtype(DType::F32)?)?;
        let scaled = q.broadcast_mul(&self.logit_scale.as_tensor().exp()?)?;
        self.infonce.forward(&scaled, &p)
    }

    fn params(&self) -> Params {
        Params::new([(self.name.clone(), self.logit_scale.clone())])
    }
}

/// Any differentiable closure `(queries, passages) -> scalar` as a [`Loss`].
pub struct FnLoss<F>(pub F);

impl<F> Loss for FnLoss<F>
where
    F: Fn(&Tensor, &Tensor) -> Result<Tensor>,
{
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        (self.0)(queries, passages)
    }
}

/// `passages / queries`, the group size `k + 1`, checking that it is a whole number.
pub fn group_size(queries: usize, passages: usize) -> Result<usize> {
    if queries == 0 {
        return Err(Error::EmptyBatch {
            side: crate::Side::Query,
        });
    }
    if passages == 0 {
        return Err(Error::EmptyBatch {
            side: crate::Side::Passage,
        });
    }
    if !passages.is_multiple_of(queries) {
        return Err(Error::PassagesNotMultiple { queries, passages });
    }
    Ok(passages / queries)
}

/// A scalar tensor's value as f32.
pub(crate) fn scalar(t: &Tensor) -> Result<f32> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()?)
}
