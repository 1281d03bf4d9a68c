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
pub mod matryoshka;
pub mod maxsim;
pub mod splade;

use std::ops::Range;

use candle_core::{DType, Tensor, Var, D};

use crate::batch::Batch;
use crate::params::{Gradients, ParamStore, Params};
use crate::{Error, Result};

pub use distillation::{MaxSimDistillation, TeacherScores};
pub use matryoshka::Matryoshka;
pub use maxsim::MaxSim;
pub use splade::{Flops, SpladeLoss, WeightScale};

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
    directions: Directions,
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
            directions: Directions::default(),
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

    /// The interactions of the main term's one softmax (sentence-transformers'
    /// `directions` in its `joint` partition mode, the improved InfoNCE of GTE and
    /// Qwen3-Embedding): `query_to_doc` always; `query_to_query` adds each query's
    /// similarities to the other queries, `doc_to_query` its positive's similarities to
    /// every query, `doc_to_doc` its positive's similarities to the passages of the other
    /// queries. The false-negative mask applies to every one.
    pub fn with_directions(mut self, directions: &[LossDirection]) -> Result<Self> {
        self.directions = Directions::from_list(directions)?;
        Ok(self)
    }

    /// Computes the loss in blocks of `rows` anchor rows so that at most `rows x P` logits
    /// exist at once (the CPU kernel: `rows x` a tile); `None` chooses: the kernel blocks
    /// of [`KERNEL_BLOCK_ROWS`], the composed path one block while its logits fit in
    /// [`AUTO_BLOCK_LOGITS`], else as many rows as fit.
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

    /// The loss terms: the main one, each query against every passage (target: its
    /// positive, passage `i * group`) and the other interactions of `directions` in one
    /// softmax; and, when symmetric, each positive passage against every query (target:
    /// its query). Each term is a mean over its anchors.
    fn terms(&self) -> Vec<Term> {
        let weight = if self.symmetric { 0.5 } else { 1.0 };
        let mut main = vec![Segment {
            rows: Rows::Queries,
            columns: Columns::Passages,
            exclude: Exclude::Nothing,
        }];
        if self.directions.query_to_query {
            main.push(Segment {
                rows: Rows::Queries,
                columns: Columns::Queries,
                exclude: Exclude::Own,
            });
        }
        if self.directions.doc_to_query {
            main.push(Segment {
                rows: Rows::Positives,
                columns: Columns::Queries,
                exclude: Exclude::Nothing,
            });
        }
        if self.directions.doc_to_doc {
            main.push(Segment {
                rows: Rows::Positives,
                columns: Columns::Passages,
                exclude: Exclude::OwnGroup,
            });
        }
        let mut terms = vec![Term {
            segments: main,
            weight,
        }];
        if self.symmetric {
            terms.push(Term {
                segments: vec![Segment {
                    rows: Rows::Positives,
                    columns: Columns::Queries,
                    exclude: Exclude::Nothing,
                }],
                weight,
            });
        }
        terms
    }

    /// The guide's embeddings of the batch (normalised), when a guide judges the
    /// false-negative mask, checked to cover it.
    fn guide_embeddings(
        &self,
        queries: usize,
        passages: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(g) = &self.guide else {
            return Ok(None);
        };
        let (gq, gp) = g.get().ok_or_else(|| Error::InvalidArgument {
            what: "guide",
            value: "none".into(),
            reason: "the guide's embeddings of this batch were not set before its step",
        })?;
        if gq.rows() != queries || gp.rows() != passages {
            return Err(Error::InvalidArgument {
                what: "guide embeddings",
                value: format!("{} queries, {} passages", gq.rows(), gp.rows()),
                reason: "the guide's embeddings must cover the batch the loss sees",
            });
        }
        Ok(Some((gq, gp)))
    }

    /// The weighted cross-entropy of `term` summed over anchor rows `rows`: each
    /// segment's similarities of the rows' anchors (`anchors`: the queries' and the
    /// positives' rows) to its candidates, masked, in one softmax per row.
    fn block_loss(&self, term: &Term, rows: Range<usize>, m: &Matrices) -> Result<Tensor> {
        let start = rows.start;
        let n = rows.len();
        let first = term.segments[0];
        let stride = m.stride(first.columns);
        let targets: Vec<u32> = rows.clone().map(|r| (r * stride) as u32).collect();
        let targets = Tensor::from_vec(targets, (n, 1), m.q.device())?;
        let masking = m.guide.is_some() || self.false_negative_margin.is_some();
        // The judge of the false-negative mask: the guide's similarities or the model's
        // (detached: the mask is a constant of the step); its threshold per row is the
        // target's score minus the margin.
        let judge = |seg: &Segment, sims: &Tensor| -> Result<Option<Tensor>> {
            Ok(match (&m.guide, masking) {
                (Some(g), _) => {
                    let a = g.anchors(seg.rows).narrow(0, start, n)?;
                    Some(a.matmul(&g.columns(seg.columns).t()?)?)
                }
                (None, true) => Some(sims.detach()),
                (None, false) => None,
            })
        };
        let mut logits = Vec::with_capacity(term.segments.len());
        let mut threshold: Option<Tensor> = None;
        for (k, seg) in term.segments.iter().enumerate() {
            let anchors = m.block_anchors(seg.rows);
            let candidates = m.columns(seg.columns);
            let sims = anchors.matmul(&candidates.t()?)?;
            let cols = sims.dim(1)?;
            let columns = Tensor::arange(0u32, cols as u32, sims.device())?
                .unsqueeze(0)?
                .broadcast_as((n, cols))?;
            let row_ids = Tensor::arange(start as u32, (start + n) as u32, sims.device())?
                .unsqueeze(1)?
                .broadcast_as((n, cols))?;
            // Left out of the softmax: the excluded entries, and (masking) the candidates
            // the judge scores above the threshold, never the target.
            let mut out: Option<Tensor> = match seg.exclude {
                Exclude::Nothing => None,
                Exclude::Own => Some(columns.eq(&row_ids)?),
                Exclude::OwnGroup => {
                    let group = Tensor::full(m.group as u32, (n, cols), sims.device())?;
                    Some((columns.clone() / group)?.eq(&row_ids)?)
                }
            };
            if let Some(j) = judge(seg, &sims)? {
                if k == 0 {
                    let margin = self.false_negative_margin.unwrap_or(0.0);
                    threshold = Some((j.gather(&targets, D::Minus1)? - margin)?);
                }
                if let Some(t) = &threshold {
                    let mut above = j.broadcast_gt(t)?;
                    if k == 0 {
                        above = (above * columns.broadcast_ne(&targets)?)?;
                    }
                    // The anchor's own pair seen from its passage is the target's
                    // similarity again: never masked.
                    if seg.rows == Rows::Positives && seg.columns == Columns::Queries {
                        above = (above * columns.ne(&row_ids)?)?;
                    }
                    out = Some(match out {
                        Some(o) => o.maximum(&above)?,
                        None => above,
                    });
                }
            }
            let scaled = (sims / self.temperature)?;
            logits.push(match out {
                None => scaled,
                Some(out) => {
                    let floor = Tensor::full(f32::NEG_INFINITY, (n, cols), scaled.device())?
                        .to_dtype(scaled.dtype())?;
                    out.where_cond(&floor, &scaled)?
                }
            });
        }
        let logits = Tensor::cat(&logits, 1)?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = log_probs.gather(&targets, D::Minus1)?;
        Ok((picked.sum_all()? * (-term.weight / m.queries() as f64))?)
    }

    /// One term, `block` anchor rows at a time, on detached prepared representations:
    /// returns the term's loss and its gradients with respect to the queries and the
    /// passages. Each block back-propagates from its own logits into its own anchor rows
    /// and the candidates, and its graph is gone before the next block starts: peak memory
    /// is one block's logits (and their temporaries) plus the `[rows, d]` gradients,
    /// linear in the batch.
    fn term_value_and_grads(
        &self,
        term: &Term,
        block: usize,
        q: &Tensor,
        p: &Tensor,
        guide: Option<&GuideMatrices>,
    ) -> Result<(f64, Tensor, Tensor)> {
        let group = group_size(q.rows(), p.rows())?;
        let pos = positives(p, q.rows(), group)?;
        let (qv, pv) = (Var::from_tensor(q)?, Var::from_tensor(p)?);
        let mut grad_q = q.zeros_like()?;
        let mut grad_p = p.zeros_like()?;
        let (mut grad_rows_q, mut grad_rows_pos) = (Vec::new(), Vec::new());
        let mut loss = 0f64;
        let rows = q.rows();
        for start in (0..rows).step_by(block) {
            let len = block.min(rows - start);
            // Leaves of their own, so the block's backward does not pad a gradient of all
            // anchors with zeros.
            let aq = Var::from_tensor(&q.narrow(0, start, len)?)?;
            let apos = Var::from_tensor(&pos.narrow(0, start, len)?)?;
            let m = Matrices {
                q: qv.as_tensor(),
                p: pv.as_tensor(),
                group,
                block_queries: aq.as_tensor(),
                block_positives: apos.as_tensor(),
                guide,
            };
            let l = self.block_loss(term, start..start + len, &m)?;
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
            grad_rows_q.push(grad(&aq)?);
            grad_rows_pos.push(grad(&apos)?);
            grad_q = (grad_q + grad(&qv)?)?.detach();
            grad_p = (grad_p + grad(&pv)?)?.detach();
        }
        let grad_q = (grad_q + Tensor::cat(&grad_rows_q, 0)?)?;
        let grad_p = (grad_p + scatter_positives(&Tensor::cat(&grad_rows_pos, 0)?, group)?)?;
        Ok((loss, grad_q, grad_p))
    }
}

pub use crate::nn::l2_normalize;
pub(crate) use crate::nn::l2_normalize_backward;

pub use crate::nn::cpu::infonce::{Columns, Exclude, Rows, Segment, Term};

/// An interaction of InfoNCE's main term, as sentence-transformers'
/// `MultipleNegativesRankingLoss(directions=...)` names them (`doc` or `passage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossDirection {
    /// Each query against every passage (always there).
    #[serde(alias = "query_to_passage")]
    QueryToDoc,
    /// Each query against the other queries.
    QueryToQuery,
    /// Each query's positive against every query.
    #[serde(alias = "passage_to_query")]
    DocToQuery,
    /// Each query's positive against the passages of the other queries.
    #[serde(alias = "passage_to_passage")]
    DocToDoc,
}

/// The interactions besides `query_to_doc`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Directions {
    query_to_query: bool,
    doc_to_query: bool,
    doc_to_doc: bool,
}

impl Directions {
    fn from_list(list: &[LossDirection]) -> Result<Self> {
        if !list.contains(&LossDirection::QueryToDoc) {
            return Err(Error::InvalidConfig {
                field: "loss.directions",
                value: format!("{list:?}"),
                reason: "the query-to-passage term is the loss: list \"query_to_doc\" first",
            });
        }
        Ok(Self {
            query_to_query: list.contains(&LossDirection::QueryToQuery),
            doc_to_query: list.contains(&LossDirection::DocToQuery),
            doc_to_doc: list.contains(&LossDirection::DocToDoc),
        })
    }
}

/// The guide's embeddings as the segments read them.
struct GuideMatrices {
    q: Tensor,
    p: Tensor,
    pos: Tensor,
}

impl GuideMatrices {
    fn new(q: Tensor, p: Tensor, group: usize) -> Result<Self> {
        let pos = positives(&p, q.rows(), group)?;
        Ok(Self { q, p, pos })
    }

    fn anchors(&self, rows: Rows) -> &Tensor {
        match rows {
            Rows::Queries => &self.q,
            Rows::Positives => &self.pos,
        }
    }

    fn columns(&self, columns: Columns) -> &Tensor {
        match columns {
            Columns::Queries => &self.q,
            Columns::Passages => &self.p,
        }
    }
}

/// What a row block of the composed loss reads: the candidates, the block's anchors.
struct Matrices<'a> {
    q: &'a Tensor,
    p: &'a Tensor,
    group: usize,
    /// The block's query rows and its queries' positive passages.
    block_queries: &'a Tensor,
    block_positives: &'a Tensor,
    guide: Option<&'a GuideMatrices>,
}

impl Matrices<'_> {
    fn queries(&self) -> usize {
        self.q.dims()[0]
    }

    fn block_anchors(&self, rows: Rows) -> &Tensor {
        match rows {
            Rows::Queries => self.block_queries,
            Rows::Positives => self.block_positives,
        }
    }

    fn columns(&self, columns: Columns) -> &Tensor {
        match columns {
            Columns::Queries => self.q,
            Columns::Passages => self.p,
        }
    }

    /// A target's column stride: passage `i * group`, or query `i`.
    fn stride(&self, columns: Columns) -> usize {
        match columns {
            Columns::Queries => 1,
            Columns::Passages => self.group,
        }
    }
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
        let group = group_size(q.rows(), p.rows())?;
        let pos = positives(&p, q.rows(), group)?;
        let guide = self.guide_embeddings(q.rows(), p.rows())?;
        let guide = guide
            .map(|(gq, gp)| GuideMatrices::new(gq, gp, group))
            .transpose()?;
        let m = Matrices {
            q: &q,
            p: &p,
            group,
            block_queries: &q,
            block_positives: &pos,
            guide: guide.as_ref(),
        };
        let mut total: Option<Tensor> = None;
        for term in self.terms() {
            let l = self.block_loss(&term, 0..q.rows(), &m)?;
            total = Some(match total {
                Some(t) => (t + l)?,
                None => l,
            });
        }
        total.ok_or_else(|| Error::EmptyBatch {
            side: crate::Side::Query,
        })
    }

    /// Back-propagates one row block at a time: on the CPU in f32 or f64 as one kernel
    /// with its backward written out ([`crate::nn::cpu::infonce`]: the logits a tile of columns
    /// at a time, an online log-sum-exp, `block x tile` values alive); elsewhere with only
    /// `block_rows x P` logits (and their graph) at once. The blocks back-propagate into
    /// the normalised representations; the normalisation's backward runs once at the end.
    /// Gives the same value and gradients as the one-block form up to float summation
    /// order.
    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        // Contiguous (a Matryoshka prefix is a strided view): the kernel reads rows.
        let (q, p) = (
            queries.detach().contiguous()?,
            passages.detach().contiguous()?,
        );
        let (qn, pn) = (self.prepare(&q)?.detach(), self.prepare(&p)?.detach());
        let group = group_size(qn.rows(), pn.rows())?;
        let guide = self.guide_embeddings(qn.rows(), pn.rows())?;
        let terms = self.terms();
        // The composed path's logits per anchor row: every segment's candidates.
        let width: usize = terms[0]
            .segments
            .iter()
            .map(|s| match s.columns {
                Columns::Queries => qn.rows(),
                Columns::Passages => pn.rows(),
            })
            .sum();
        let block = self
            .block_rows
            .or_else(|| auto_block_rows(qn.rows(), width))
            .unwrap_or(qn.rows())
            .max(1);
        // The kernel's memory is a block by a tile whatever the batch.
        let kernel_block = self.block_rows.unwrap_or(KERNEL_BLOCK_ROWS);
        let cosine = self.similarity == Similarity::Cosine;
        let tiled = crate::nn::cpu::infonce::value_and_grads(&crate::nn::cpu::infonce::Plan {
            q: &qn,
            p: &pn,
            group,
            guide: guide.as_ref().map(|(a, b)| (a, b)),
            temperature: self.temperature,
            margin: match (&guide, self.false_negative_margin) {
                (Some(_), m) => Some(m.unwrap_or(0.0)),
                (None, m) => m,
            },
            block_rows: kernel_block,
            terms: &terms,
            // The normalisation's backward in place, in the kernel.
            unnormalized: cosine.then_some((&q, &p)),
        })?;
        let (loss, grad_queries, grad_passages) = match tiled {
            Some(out) => out,
            None => {
                let guide = guide
                    .map(|(gq, gp)| GuideMatrices::new(gq, gp, group))
                    .transpose()?;
                let mut loss = 0f64;
                let mut grad_qn = qn.zeros_like()?;
                let mut grad_pn = pn.zeros_like()?;
                for term in &terms {
                    let (l, gq, gp) =
                        self.term_value_and_grads(term, block, &qn, &pn, guide.as_ref())?;
                    loss += l;
                    grad_qn = (grad_qn + gq)?;
                    grad_pn = (grad_pn + gp)?;
                }
                match self.similarity {
                    Similarity::Dot => (loss, grad_qn, grad_pn),
                    // Through the normalisation, once, in closed form (no graph: autograd
                    // kept about twenty `[B, d]` temporaries alive here, the peak of a
                    // large batch).
                    Similarity::Cosine => (
                        loss,
                        l2_normalize_backward(&q, &grad_qn)?,
                        l2_normalize_backward(&p, &grad_pn)?,
                    ),
                }
            }
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
