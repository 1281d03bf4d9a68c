//! InfoNCE with in-batch and hard negatives ([`InfoNce`]): its directions, false-negative
//! margin and guide model, the composed loss in row blocks, and the CPU kernel's loss.

use std::ops::Range;

use candle_core::{DType, Tensor, Var, D};

use super::{
    auto_block_rows, group_size, l2_normalize, l2_normalize_backward, scalar, Columns, Exclude,
    Loss, LossValue, Rows, Segment, Similarity, Term, KERNEL_BLOCK_ROWS,
};
use crate::batch::Batch;
use crate::params::Gradients;
use crate::{Error, Result};

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
    /// [`AUTO_BLOCK_LOGITS`](crate::loss::AUTO_BLOCK_LOGITS), else as many rows as fit.
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
