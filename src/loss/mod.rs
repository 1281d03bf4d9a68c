//! Contrastive losses over query and passage representations.
//!
//! The gradient cache needs from a loss its value and its gradient with respect to every
//! representation ([`Loss::value_and_grads`]); a plain training step needs a
//! differentiable scalar ([`Loss::forward`]). [`InfoNce`] provides both, with in-batch and
//! hard negatives, a temperature, dot or cosine similarity, an optional symmetric term, and
//! a row-block mode in which the `B x B(k+1)` logits matrix never exists at once (as in
//! sentence-transformers' cached losses). [`FnLoss`] turns any differentiable closure into a
//! loss, like the `loss_fn` of the reference GradCache.

pub mod matryoshka;

use std::ops::Range;

use candle_core::{DType, Tensor, Var, D};

use crate::batch::Batch;
use crate::params::{Gradients, ParamStore, Params};
use crate::{Error, Result};

pub use matryoshka::Matryoshka;

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

/// InfoNCE (cross-entropy over similarities) with in-batch and hard negatives.
///
/// With `Q` queries and `P = Q * (k+1)` passages laid out as `[pos_0, neg_0_1..neg_0_k,
/// pos_1, ...]`, the target of query `i` is passage `i * (k+1)`; every other passage of the
/// batch is a negative. Logits are `sim(q, p) / temperature`. The symmetric term scores each
/// positive passage against all queries (target: its own query) and the loss becomes the
/// mean of both directions.
#[derive(Debug, Clone, PartialEq)]
pub struct InfoNce {
    temperature: f64,
    similarity: Similarity,
    symmetric: bool,
    block_rows: Option<usize>,
    false_negative_margin: Option<f64>,
    guide: Option<Guide>,
}

/// A frozen guide model's embeddings of the current batch (GISTEmbed, Solatorio 2024):
/// with a guide, [`InfoNce`]'s false-negative mask is judged on the guide's cosine
/// similarities instead of the model's own. The task that builds each batch sets the
/// guide's embeddings of it (every query and passage of the global batch, in the order the
/// loss sees them) before the step; the loss reads them. Clones share the embeddings.
#[derive(Clone, Default)]
pub struct Guide(std::sync::Arc<std::sync::Mutex<Option<(Tensor, Tensor)>>>);

impl Guide {
    /// A guide without embeddings yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the guide's embeddings of the batch the next loss is computed on: `[Q, d]`
    /// queries and `[P, d]` passages (normalised here).
    pub fn set(&self, queries: &Tensor, passages: &Tensor) -> Result<()> {
        let q = l2_normalize(&queries.detach().to_dtype(DType::F32)?)?;
        let p = l2_normalize(&passages.detach().to_dtype(DType::F32)?)?;
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((q, p));
        Ok(())
    }

    fn get(&self) -> Option<(Tensor, Tensor)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl PartialEq for Guide {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl InfoNce {
    /// Dot-product InfoNCE with the given temperature (> 0), one block, not symmetric.
    pub fn new(temperature: f64) -> Result<Self> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::InvalidConfig {
                field: "temperature",
                value: temperature.to_string(),
                reason: "the temperature must be a finite number greater than 0",
            });
        }
        Ok(Self {
            temperature,
            similarity: Similarity::Dot,
            symmetric: false,
            block_rows: None,
            false_negative_margin: None,
            guide: None,
        })
    }

    /// Judges the false-negative mask on a frozen guide's similarities (GISTEmbed): a
    /// candidate is masked when the guide scores it above the guide's score of the
    /// positive minus the margin (`false_negative_margin`, 0 when unset). The guide's
    /// embeddings of each batch are set on `guide` before its step; a step without them is
    /// an error.
    pub fn with_guide(mut self, guide: Option<Guide>) -> Self {
        self.guide = guide;
        self
    }

    /// Masks likely false negatives, judged by the model itself (as GISTEmbed's filter with
    /// the model as its own guide): for each anchor, every candidate other than its target
    /// whose similarity exceeds the target's minus `margin` is left out of the softmax
    /// (`margin = 0`: candidates scoring above the positive). The mask is a function of
    /// the representations alone, so the cached step still equals the full batch. `None`
    /// (the default) masks nothing.
    pub fn with_false_negative_margin(mut self, margin: Option<f64>) -> Result<Self> {
        if let Some(m) = margin {
            if !m.is_finite() {
                return Err(Error::InvalidConfig {
                    field: "false_negative_margin",
                    value: m.to_string(),
                    reason: "must be a finite number",
                });
            }
        }
        self.false_negative_margin = margin;
        Ok(self)
    }

    /// Sets the similarity.
    pub fn with_similarity(mut self, similarity: Similarity) -> Self {
        self.similarity = similarity;
        self
    }

    /// Adds (or removes) the passage-to-query term.
    pub fn with_symmetric(mut self, symmetric: bool) -> Self {
        self.symmetric = symmetric;
        self
    }

    /// Computes the loss in blocks of `rows` anchor rows so that at most `rows x P` logits
    /// exist at once; `None` computes it in one block.
    pub fn with_block_rows(mut self, rows: Option<usize>) -> Result<Self> {
        if rows == Some(0) {
            return Err(Error::InvalidConfig {
                field: "block_rows",
                value: "0".into(),
                reason: "a row block must hold at least one row",
            });
        }
        self.block_rows = rows;
        Ok(self)
    }

    /// The temperature.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    /// Normalises for cosine similarity, leaves as is for dot.
    fn prepare(&self, x: &Tensor) -> Result<Tensor> {
        match self.similarity {
            Similarity::Dot => Ok(x.clone()),
            Similarity::Cosine => l2_normalize(x),
        }
    }

    /// The loss terms over prepared (normalised for cosine) representations `q` and `p`:
    /// q2p, queries against all passages (target of query `i`: passage `i * group`); and,
    /// when symmetric, p2q, each query's positive passage against all queries (target
    /// `i`). Each term is a mean over its anchors.
    fn terms(&self, q: &Tensor, p: &Tensor) -> Result<Vec<Term>> {
        let queries = q.rows();
        let group = group_size(queries, p.rows())?;
        let weight = if self.symmetric { 0.5 } else { 1.0 } / queries as f64;
        let guide = match &self.guide {
            None => None,
            Some(g) => {
                let (gq, gp) = g.get().ok_or_else(|| Error::InvalidArgument {
                    what: "guide",
                    value: "none".into(),
                    reason: "the guide's embeddings of this batch were not set before its step",
                })?;
                if gq.rows() != queries || gp.rows() != p.rows() {
                    return Err(Error::InvalidArgument {
                        what: "guide embeddings",
                        value: format!("{} queries, {} passages", gq.rows(), gp.rows()),
                        reason: "the guide's embeddings must cover the batch the loss sees",
                    });
                }
                Some((gq, gp))
            }
        };
        let mut terms = vec![Term {
            direction: Direction::QueryToPassage,
            anchors: q.clone(),
            candidates: p.clone(),
            target_stride: group,
            weight,
            guide: guide.clone(),
        }];
        if self.symmetric {
            terms.push(Term {
                direction: Direction::PassageToQuery,
                anchors: positives(p, queries, group)?,
                candidates: q.clone(),
                target_stride: 1,
                weight,
                guide: match &guide {
                    Some((gq, gp)) => Some((positives(gp, queries, group)?, gq.clone())),
                    None => None,
                },
            });
        }
        Ok(terms)
    }

    /// The weighted cross-entropy summed over anchor rows `rows` (absolute row numbers of
    /// the term) whose representations are `anchors` (`rows.len()` of them).
    fn block_loss(
        &self,
        anchors: &Tensor,
        candidates: &Tensor,
        rows: Range<usize>,
        term: &Term,
    ) -> Result<Tensor> {
        let sims = anchors.matmul(&candidates.t()?)?;
        let start = rows.start;
        let targets: Vec<u32> = rows.map(|r| (r * term.target_stride) as u32).collect();
        let n = targets.len();
        let targets = Tensor::from_vec(targets, (n, 1), sims.device())?;
        let judge = match &term.guide {
            // The guide's similarities of these anchor rows.
            Some((ga, gc)) => Some(ga.narrow(0, start, n)?.matmul(&gc.t()?)?),
            None => self.false_negative_margin.map(|_| sims.detach()),
        };
        let logits = match judge {
            None => (sims / self.temperature)?,
            Some(s) => {
                // Judged on detached similarities: the mask is a constant of the step.
                let margin = self.false_negative_margin.unwrap_or(0.0);
                let threshold = (s.gather(&targets, D::Minus1)? - margin)?;
                let above = s.broadcast_gt(&threshold)?;
                let columns = Tensor::arange(0u32, s.dim(1)? as u32, s.device())?
                    .unsqueeze(0)?
                    .broadcast_as(s.shape())?;
                let other = columns.broadcast_ne(&targets)?;
                let masked = (above * other)?;
                let floor = Tensor::full(f32::NEG_INFINITY, s.shape(), s.device())?
                    .to_dtype(sims.dtype())?;
                masked.where_cond(&floor, &(sims / self.temperature)?)?
            }
        };
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = log_probs.gather(&targets, D::Minus1)?;
        Ok((picked.sum_all()? * (-term.weight))?)
    }

    /// One term, `block` anchor rows at a time, on detached values: returns the term's
    /// loss and its gradients with respect to the anchors and the candidates. Each block
    /// back-propagates from its own `block x C` logits into its own anchor rows and the
    /// candidates, and its graph is gone before the next block starts: peak memory is
    /// one block's logits (and their temporaries) plus the `[rows, d]` gradients, linear
    /// in the batch.
    fn term_value_and_grads(&self, term: &Term, block: usize) -> Result<(f64, Tensor, Tensor)> {
        let candidates = Var::from_tensor(&term.candidates)?;
        let mut grad_candidates = term.candidates.zeros_like()?;
        let mut grad_anchors = Vec::new();
        let mut loss = 0f64;
        let rows = term.anchors.rows();
        for start in (0..rows).step_by(block) {
            let len = block.min(rows - start);
            // A leaf of its own, so the block's backward does not pad a gradient of all
            // anchors with zeros.
            let anchors = Var::from_tensor(&term.anchors.narrow(0, start, len)?)?;
            let l = self.block_loss(
                anchors.as_tensor(),
                candidates.as_tensor(),
                start..start + len,
                term,
            )?;
            loss += f64::from(scalar(&l)?);
            let store = l.backward()?;
            // Gradients carry the graph that computed them: detach before keeping them, or
            // every block's logits would stay alive until the end.
            let grad = |v: &Var| -> Result<Tensor> {
                Ok(match store.get(v.as_tensor()) {
                    Some(g) => g.detach(),
                    None => v.as_tensor().zeros_like()?,
                })
            };
            grad_anchors.push(grad(&anchors)?);
            grad_candidates = (grad_candidates + grad(&candidates)?)?.detach();
        }
        Ok((loss, Tensor::cat(&grad_anchors, 0)?, grad_candidates))
    }
}

/// `x / max(||x||, 1e-12)` over the last dimension (as `torch.nn.functional.normalize`),
/// differentiable. Also `gradcache::nn::l2_normalize`.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    Ok(x.broadcast_div(&norm)?)
}

/// The gradient with respect to `x` of `sum(g * x / max(||x||, 1e-12))` (rows over the
/// last dimension): `(g - y (g . y)) / ||x||` with `y` the normalised rows, and `g / 1e-12`
/// on rows whose norm was clamped (the clamp is a constant there), as autograd through
/// [`l2_normalize`] gives it.
fn l2_normalize_backward(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    let clamped = norm.maximum(1e-12)?;
    let y = x.broadcast_div(&clamped)?;
    let live = norm.ge(1e-12)?.to_dtype(x.dtype())?;
    let along = ((g * &y)?.sum_keepdim(D::Minus1)? * live)?;
    Ok((g - y.broadcast_mul(&along)?)?.broadcast_div(&clamped)?)
}

/// Which way a loss term scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Queries are anchors, all passages candidates.
    QueryToPassage,
    /// Positive passages are anchors, all queries candidates.
    PassageToQuery,
}

struct Term {
    direction: Direction,
    anchors: Tensor,
    candidates: Tensor,
    target_stride: usize,
    weight: f64,
    /// The guide's (normalised) embeddings of the anchors and candidates, when a guide
    /// judges the false-negative mask.
    guide: Option<(Tensor, Tensor)>,
}

/// The positive passage of each of `queries` queries: rows `0, group, 2 group, ...` of `p`.
fn positives(p: &Tensor, queries: usize, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(p.clone());
    }
    let d = p.dim(1)?;
    // Contiguous: CUDA's matrix products take no row stride other than the width.
    Ok(p.reshape((queries, group, d))?
        .narrow(1, 0, 1)?
        .squeeze(1)?
        .contiguous()?)
}

/// The inverse of [`positives`] for gradients: `[queries, d]` rows placed at rows
/// `0, group, ...` of a `[queries * group, d]` zero matrix.
fn scatter_positives(g: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(g.clone());
    }
    let (queries, d) = g.dims2()?;
    let rest = Tensor::zeros((queries, group - 1, d), g.dtype(), g.device())?;
    Ok(Tensor::cat(&[&g.unsqueeze(1)?, &rest], 1)?.reshape((queries * group, d))?)
}

impl Loss for InfoNce {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let (q, p) = (self.prepare(queries)?, self.prepare(passages)?);
        let mut total: Option<Tensor> = None;
        for term in self.terms(&q, &p)? {
            let rows = term.anchors.rows();
            let l = self.block_loss(&term.anchors, &term.candidates, 0..rows, &term)?;
            total = Some(match total {
                Some(t) => (t + l)?,
                None => l,
            });
        }
        total.ok_or_else(|| Error::EmptyBatch {
            side: crate::Side::Query,
        })
    }

    /// Back-propagates one row block at a time: only `block_rows x P` logits (and their
    /// graph) exist at once, in both directions of the symmetric loss. The blocks
    /// back-propagate into the normalised representations; the normalisation's backward
    /// runs once at the end. Gives the same value and gradients as the one-block form up
    /// to float summation order.
    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let (q, p) = (queries.detach(), passages.detach());
        let (qn, pn) = (self.prepare(&q)?, self.prepare(&p)?);
        let mut loss = 0f64;
        let mut grad_qn = qn.zeros_like()?;
        let mut grad_pn = pn.zeros_like()?;
        let group = group_size(qn.rows(), pn.rows())?;
        for term in self.terms(&qn.detach(), &pn.detach())? {
            let block = self.block_rows.unwrap_or(term.anchors.rows()).max(1);
            let (l, g_anchors, g_candidates) = self.term_value_and_grads(&term, block)?;
            loss += l;
            match term.direction {
                Direction::QueryToPassage => {
                    grad_qn = (grad_qn + g_anchors)?;
                    grad_pn = (grad_pn + g_candidates)?;
                }
                Direction::PassageToQuery => {
                    grad_pn = (grad_pn + scatter_positives(&g_anchors, group)?)?;
                    grad_qn = (grad_qn + g_candidates)?;
                }
            }
        }
        let (grad_queries, grad_passages) = match self.similarity {
            Similarity::Dot => (grad_qn, grad_pn),
            // Through the normalisation, once, in closed form (no graph: autograd kept
            // about twenty `[B, d]` temporaries alive here, the peak of a large batch).
            Similarity::Cosine => (
                l2_normalize_backward(&q, &grad_qn)?,
                l2_normalize_backward(&p, &grad_pn)?,
            ),
        };
        Ok(LossValue {
            loss: loss as f32,
            grad_queries: grad_queries.detach(),
            grad_passages: grad_passages.detach(),
            params: Gradients::default(),
        })
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
    if passages % queries != 0 {
        return Err(Error::PassagesNotMultiple { queries, passages });
    }
    Ok(passages / queries)
}

/// A scalar tensor's value as f32.
pub(crate) fn scalar(t: &Tensor) -> Result<f32> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()?)
}
