//! Late interaction (ColBERT): InfoNCE over MaxSim scores of token matrices.
//!
//! A multi-vector representation is a row `[tokens * dim]`: `tokens` vectors of `dim`
//! values, one per kept token, padded with zero vectors (the layout a multi-vector head
//! writes, see [`crate::batch::TokenVectors`]). A zero vector is a token that is not
//! there: padding, a skiplisted document token. The score of query `i` and passage `j` is
//! `sum_s max_t <q_is, p_jt>` over the query's kept tokens `s` and the passage's kept
//! tokens `t` (a masked passage token takes no part in the max, as sentence-transformers'
//! `maxsim`; a passage without a kept token scores 0). The loss is the cross-entropy of
//! `scores / temperature` with the positive of query `i` at passage `i * group` (in-batch
//! and hard negatives), as PyLate's `Contrastive` and sentence-transformers'
//! `MultiVectorMultipleNegativesRankingLoss` (temperature 1 by default, `scale = 1 /
//! temperature`).
//!
//! The token-to-token similarities are computed a block of queries by a block of
//! passages at a time and never held whole: a first pass over the blocks gives the scores,
//! a second recomputes each block's similarities and sends each score's gradient to the
//! pair of tokens its max chose.

use candle_core::{DType, Tensor, D};

use super::{group_size, Loss, LossValue};
use crate::{Error, Result};

/// The most token-to-token similarities one block holds when no size is set (2^22, 16
/// MiB of f32); a block's temporaries are a few times that, whatever the batch.
pub const BLOCK_SIMILARITIES: usize = 1 << 22;

/// A passage token that is not there: far below any similarity of real tokens, so the
/// max never picks it while a passage has a kept token.
const ABSENT: f64 = -1e30;

/// InfoNCE over MaxSim scores of token matrices (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct MaxSim {
    dim: usize,
    temperature: f64,
    block_similarities: usize,
}

impl MaxSim {
    /// MaxSim InfoNCE over token vectors of `dim` values, temperature 1.
    pub fn new(dim: usize) -> Result<Self> {
        if dim == 0 {
            return Err(Error::InvalidConfig {
                field: "model.multi_vector.dim",
                value: "0".into(),
                reason: "token vectors need at least one value",
            });
        }
        Ok(Self {
            dim,
            temperature: 1.0,
            block_similarities: BLOCK_SIMILARITIES,
        })
    }

    /// The scores are divided by `temperature` (> 0) before the cross-entropy (PyLate's
    /// `temperature`; sentence-transformers' `scale` is its inverse).
    pub fn with_temperature(mut self, temperature: f64) -> Result<Self> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::InvalidConfig {
                field: "temperature",
                value: temperature.to_string(),
                reason: "the temperature must be a finite number greater than 0",
            });
        }
        self.temperature = temperature;
        Ok(self)
    }

    /// The most token-to-token similarities a block holds (at least one query by one
    /// passage whatever the value).
    pub fn with_block_similarities(mut self, similarities: usize) -> Self {
        self.block_similarities = similarities.max(1);
        self
    }

    /// The token vectors' width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The temperature.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    /// `[rows, tokens * dim]` as `[rows, tokens, dim]`, with the check that it is one.
    fn tokens(&self, x: &Tensor, side: crate::Side) -> Result<Tensor> {
        let (rows, width) = x.dims2()?;
        if width % self.dim != 0 {
            return Err(Error::InvalidArgument {
                what: "multi-vector representation",
                value: format!("{side:?} width {width}"),
                reason: "a row holds whole token vectors of the loss's `dim` values",
            });
        }
        Ok(x.reshape((rows, width / self.dim, self.dim))?)
    }

    /// MaxSim scores `[Q, P]` of every query against every passage (the graph is kept
    /// when the inputs record one).
    pub fn scores(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        self.pair_scores(queries, passages, Pairs::All)
    }

    /// The MaxSim scores `pairs` names, `[Q, pairs.width(P)]` (the graph is kept when
    /// the inputs record one).
    pub(super) fn pair_scores(
        &self,
        queries: &Tensor,
        passages: &Tensor,
        pairs: Pairs,
    ) -> Result<Tensor> {
        let q = self.tokens(queries, crate::Side::Query)?;
        let p = self.tokens(passages, crate::Side::Passage)?;
        let (nq, np) = (q.dim(0)?, p.dim(0)?);
        let width = pairs.width(np);
        let spans = self.spans(&q, &p, pairs)?;
        if self.on_kernels(&[queries, passages]) {
            let kernel = Kernel::new(self, &q, &p)?;
            let scores = kernel.scores(&spans, width)?;
            return Ok(Tensor::from_vec(scores, (nq, width), queries.device())?);
        }
        // Spans come a row of queries at a time, their passages in order.
        let mut rows = Vec::new();
        let mut cols = Vec::new();
        for (k, s) in spans.iter().enumerate() {
            let block = Block::new(&q.narrow(0, s.qs, s.ql)?, &p.narrow(0, s.ps, s.pl)?)?;
            cols.push(block.scores()?);
            if spans.get(k + 1).is_none_or(|n| n.qs != s.qs) {
                rows.push(Tensor::cat(&std::mem::take(&mut cols), 1)?);
            }
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// The gradients of the token vectors `[Q, width]`, `[P, width]` from the gradient
    /// `g` of the scores `pairs` names (detached; each block's max chosen again).
    pub(super) fn pair_grads(
        &self,
        queries: &Tensor,
        passages: &Tensor,
        pairs: Pairs,
        g: &[f32],
    ) -> Result<(Tensor, Tensor)> {
        let (queries, passages) = (queries.detach(), passages.detach());
        let q = self.tokens(&queries, crate::Side::Query)?;
        let p = self.tokens(&passages, crate::Side::Passage)?;
        let (nq, lq, d) = q.dims3()?;
        let (np, lp, _) = p.dims3()?;
        let width = pairs.width(np);
        let spans = self.spans(&q, &p, pairs)?;
        if self.on_kernels(&[&queries, &passages]) {
            let (dq, dp) = Kernel::new(self, &q, &p)?.grads(&spans, width, g)?;
            return Ok((
                Tensor::from_vec(dq, queries.dims(), q.device())?,
                Tensor::from_vec(dp, passages.dims(), p.device())?,
            ));
        }
        let g = Tensor::from_slice(g, (nq, width), q.device())?.to_dtype(q.dtype())?;
        let mut grad_q = std::collections::BTreeMap::new();
        let mut grad_p = std::collections::BTreeMap::new();
        for s in &spans {
            let qb = q.narrow(0, s.qs, s.ql)?;
            let pb = p.narrow(0, s.ps, s.pl)?;
            let q_flat = qb.reshape((s.ql * lq, d))?;
            let w = Block::new(&qb, &pb)?
                .pair_weights(&g.narrow(0, s.qs, s.ql)?.narrow(1, s.col, s.pl)?)?;
            add_to(&mut grad_q, s.qs, w.matmul(&pb.reshape((s.pl * lp, d))?)?)?;
            add_to(&mut grad_p, s.ps, w.t()?.matmul(&q_flat)?)?;
        }
        let whole = |parts: std::collections::BTreeMap<usize, Tensor>,
                     rows: usize,
                     len: usize|
         -> Result<Tensor> {
            // Every row has a span in both pairings; a row without one gets zeros.
            let mut out = Vec::new();
            let mut at = 0;
            for (start, t) in parts {
                if start > at {
                    out.push(Tensor::zeros((start - at, len * d), q.dtype(), q.device())?);
                }
                let n = t.dim(0)? / len;
                out.push(t.reshape((n, len * d))?);
                at = start + n;
            }
            if rows > at {
                out.push(Tensor::zeros((rows - at, len * d), q.dtype(), q.device())?);
            }
            Ok(Tensor::cat(&out, 0)?)
        };
        Ok((whole(grad_q, nq, lq)?, whole(grad_p, np, lp)?))
    }

    /// The blocks `pairs` needs: with [`Pairs::All`], all queries' tokens by as many
    /// passages as fit [`Self::with_block_similarities`] (fewer queries where one passage
    /// does not fit); with [`Pairs::Own`], each query by its own group.
    fn spans(&self, q: &Tensor, p: &Tensor, pairs: Pairs) -> Result<Vec<Span>> {
        let (nq, np) = (q.dim(0)?, p.dim(0)?);
        Ok(match pairs {
            Pairs::All => {
                let (q_block, p_block) = self.blocks(q, p)?;
                spans(nq, q_block)
                    .flat_map(|(qs, ql)| {
                        spans(np, p_block).map(move |(ps, pl)| Span {
                            qs,
                            ql,
                            ps,
                            pl,
                            col: ps,
                        })
                    })
                    .collect()
            }
            Pairs::Own(group) => (0..nq)
                .map(|i| Span {
                    qs: i,
                    ql: 1,
                    ps: i * group,
                    pl: group,
                    col: 0,
                })
                .collect(),
        })
    }

    /// Queries and passages per block: all queries' tokens by as many passages as fit
    /// [`Self::with_block_similarities`], fewer queries where one passage does not fit.
    fn blocks(&self, q: &Tensor, p: &Tensor) -> Result<(usize, usize)> {
        let (nq, lq, _) = q.dims3()?;
        let (np, lp, _) = p.dims3()?;
        let per_pair = (lq * lp).max(1);
        let q_block = (self.block_similarities / per_pair).clamp(1, nq.max(1));
        let p_block = (self.block_similarities / (per_pair * q_block)).clamp(1, np.max(1));
        Ok((q_block, p_block))
    }

    /// The cross-entropy of `scores / temperature` (targets `i * group`, the mean over
    /// queries) on the scores `[Q, P]` in `values` (`np` per row, in f64 a row at a
    /// time), which become their gradients.
    fn score_grads_in_place(&self, values: &mut [f32], np: usize, group: usize) -> f32 {
        let nq = values.len() / np.max(1);
        let t = self.temperature;
        let mut total = 0f64;
        for (i, row) in values.chunks_mut(np.max(1)).enumerate() {
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64 / t));
            let sum: f64 = row.iter().map(|&v| (v as f64 / t - max).exp()).sum();
            let log_sum = sum.ln();
            total -= row[i * group] as f64 / t - max - log_sum;
            for (j, v) in row.iter_mut().enumerate() {
                let p = (*v as f64 / t - max - log_sum).exp();
                let target = if j == i * group { 1.0 } else { 0.0 };
                *v = ((p - target) / (nq as f64 * t)) as f32;
            }
        }
        (total / nq as f64) as f32
    }
}

impl MaxSim {
    /// Whether the CPU kernels run: f32 on the CPU, no graph to keep, kernels on.
    fn on_kernels(&self, ts: &[&Tensor]) -> bool {
        ts.iter().all(|t| !t.track_op() && t.dtype() == DType::F32) && crate::nn::fused_ok(ts)
    }
}

/// The CPU path: every block's similarities by one matrix product, the max and the
/// gradient by [`crate::nn::cpu::losses::maxsim`]'s kernels.
struct Kernel {
    q: Tensor,
    p: Tensor,
    q_kept: Vec<bool>,
    p_kept: Vec<bool>,
}

impl Kernel {
    fn new(loss: &MaxSim, q: &Tensor, p: &Tensor) -> Result<Self> {
        let (q, p) = (q.contiguous()?, p.contiguous()?);
        Ok(Self {
            q_kept: crate::nn::cpu::losses::maxsim::kept(&q, loss.dim)?,
            p_kept: crate::nn::cpu::losses::maxsim::kept(&p, loss.dim)?,
            q,
            p,
        })
    }

    /// One block's similarities and what its max chose.
    fn choose(
        &self,
        s: &Span,
    ) -> Result<(
        crate::nn::cpu::losses::maxsim::BlockShape,
        crate::nn::cpu::losses::maxsim::Chosen,
    )> {
        let (_, lq, d) = self.q.dims3()?;
        let (_, lp, _) = self.p.dims3()?;
        let shape = crate::nn::cpu::losses::maxsim::BlockShape {
            nq: s.ql,
            lq,
            np: s.pl,
            lp,
        };
        let qb = self.q.narrow(0, s.qs, s.ql)?.reshape((s.ql * lq, d))?;
        let pb = self.p.narrow(0, s.ps, s.pl)?.reshape((s.pl * lp, d))?;
        let sims = qb.matmul(&pb.t()?)?.contiguous()?;
        let chosen = crate::nn::cpu::losses::maxsim::choose(
            &sims,
            &self.p_kept[s.ps * lp..(s.ps + s.pl) * lp],
            shape,
        )?;
        Ok((shape, chosen))
    }

    /// The scores of the spans, `[Q, width]`.
    fn scores(&self, spans: &[Span], width: usize) -> Result<Vec<f32>> {
        let (nq, lq, _) = self.q.dims3()?;
        let mut out = vec![0f32; nq * width];
        for s in spans {
            let (shape, chosen) = self.choose(s)?;
            let b = crate::nn::cpu::losses::maxsim::scores(
                &chosen,
                &self.q_kept[s.qs * lq..(s.qs + s.ql) * lq],
                shape,
            );
            for i in 0..s.ql {
                out[(s.qs + i) * width + s.col..][..s.pl]
                    .copy_from_slice(&b[i * s.pl..(i + 1) * s.pl]);
            }
        }
        Ok(out)
    }

    /// The gradients of the token vectors from the spans' scores' `g` `[Q * width]`,
    /// each block's max chosen again.
    fn grads(&self, spans: &[Span], width: usize, g: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let (nq, lq, d) = self.q.dims3()?;
        let (np, lp, _) = self.p.dims3()?;
        let mut dq = vec![0f32; nq * lq * d];
        let mut dp = vec![0f32; np * lp * d];
        for s in spans {
            let (shape, chosen) = self.choose(s)?;
            let gb: Vec<f32> = (0..s.ql)
                .flat_map(|i| g[(s.qs + i) * width + s.col..][..s.pl].iter().copied())
                .collect();
            let (q_rows, p_rows) = (s.qs * lq..(s.qs + s.ql) * lq, s.ps * lp..(s.ps + s.pl) * lp);
            let (qr, pr) = (
                q_rows.start * d..q_rows.end * d,
                p_rows.start * d..p_rows.end * d,
            );
            crate::nn::cpu::losses::maxsim::scatter_block(
                &chosen,
                &self.q_kept[q_rows.clone()],
                (&self.q, q_rows),
                (&self.p, p_rows),
                &gb,
                (&mut dq[qr], &mut dp[pr]),
                shape,
                d,
            )?;
        }
        Ok((dq, dp))
    }
}

/// Which query-passage scores a loss needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pairs {
    /// Every query against every passage: `[Q, P]`.
    All,
    /// Each query against its own `group` passages (`i * group ..`): `[Q, group]`.
    Own(usize),
}

impl Pairs {
    /// Scores per query for `np` passages.
    fn width(self, np: usize) -> usize {
        match self {
            Pairs::All => np,
            Pairs::Own(group) => group,
        }
    }
}

/// A block of queries `qs..qs + ql` by passages `ps..ps + pl`, whose scores go to columns
/// `col..col + pl` of the score rows.
#[derive(Debug, Clone, Copy)]
struct Span {
    qs: usize,
    ql: usize,
    ps: usize,
    pl: usize,
    col: usize,
}

/// Adds `t` to the part of `parts` that starts at `start`.
fn add_to(
    parts: &mut std::collections::BTreeMap<usize, Tensor>,
    start: usize,
    t: Tensor,
) -> Result<()> {
    let sum = match parts.remove(&start) {
        Some(sum) => (sum + t)?,
        None => t,
    };
    parts.insert(start, sum);
    Ok(())
}

/// `(start, len)` of consecutive spans of at most `size` over `0..n`.
fn spans(n: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(size.max(1))
        .map(move |s| (s, size.max(1).min(n - s)))
}

/// One block of queries by passages: their token similarities with the absent passage
/// tokens pushed out of the max.
struct Block {
    /// `[nq, lq, np, lp]`.
    sims: Tensor,
    /// The kept query tokens, `[nq, lq, 1]`.
    q_kept: Tensor,
    /// Passages with a kept token, `[1, 1, np]`.
    p_any: Tensor,
}

impl Block {
    fn new(q: &Tensor, p: &Tensor) -> Result<Self> {
        let (nq, lq, d) = q.dims3()?;
        let (np, lp, _) = p.dims3()?;
        let kept = |x: &Tensor| -> Result<Tensor> {
            Ok(x.abs()?.max(D::Minus1)?.gt(0.0)?.to_dtype(x.dtype())?)
        };
        let p_kept = kept(p)?; // [np, lp]
        let sims = q
            .reshape((nq * lq, d))?
            .matmul(&p.reshape((np * lp, d))?.t()?)?
            .reshape((nq, lq, np, lp))?;
        let absent = ((p_kept.ones_like()? - &p_kept)? * ABSENT)?
            .reshape((1, 1, np, lp))?
            .detach();
        Ok(Self {
            sims: sims.broadcast_add(&absent)?,
            q_kept: kept(q)?.unsqueeze(2)?.detach(),
            p_any: p_kept.max(1)?.reshape((1, 1, np))?.detach(),
        })
    }

    /// `[nq, np]`: each kept query token's best passage token, summed.
    fn scores(&self) -> Result<Tensor> {
        let best = self.sims.max(3)?; // [nq, lq, np]
        let best = best
            .broadcast_mul(&self.q_kept)?
            .broadcast_mul(&self.p_any)?;
        Ok(best.sum(1)?)
    }

    /// The weight each score's gradient `g` `[nq, np]` puts on every (query token,
    /// passage token) pair, `[nq * lq, np * lp]`: `g` at the pair the max chose, 0 elsewhere.
    fn pair_weights(&self, g: &Tensor) -> Result<Tensor> {
        let (nq, lq, np, lp) = self.sims.dims4()?;
        let chosen = self.sims.argmax_keepdim(3)?; // [nq, lq, np, 1]
        let positions = Tensor::arange(0u32, lp as u32, g.device())?.reshape((1, 1, 1, lp))?;
        let at = chosen.broadcast_eq(&positions)?.to_dtype(g.dtype())?;
        let scale = g
            .reshape((nq, 1, np, 1))?
            .broadcast_mul(&self.q_kept.unsqueeze(3)?)?
            .broadcast_mul(&self.p_any.unsqueeze(3)?)?;
        Ok(at.broadcast_mul(&scale)?.reshape((nq * lq, np * lp))?)
    }
}

impl Loss for MaxSim {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let group = group_size(queries.dim(0)?, passages.dim(0)?)?;
        let scores = self.scores(queries, passages)?;
        let nq = scores.dim(0)?;
        let logits = (scores / self.temperature)?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let targets: Vec<u32> = (0..nq).map(|i| (i * group) as u32).collect();
        let targets = Tensor::new(targets.as_slice(), queries.device())?;
        let picked = log_probs.gather(&targets.unsqueeze(1)?, 1)?;
        Ok((picked.sum_all()? / -(nq as f64))?)
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let group = group_size(queries.dim(0)?, passages.dim(0)?)?;
        // The scores become their gradients in place: one score-sized buffer.
        let scores = self.scores(&queries.detach(), &passages.detach())?;
        let np = scores.dim(1)?;
        let mut g = scores
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        drop(scores);
        let loss = self.score_grads_in_place(&mut g, np, group);
        let (grad_queries, grad_passages) = self.pair_grads(queries, passages, Pairs::All, &g)?;
        Ok(LossValue {
            loss,
            grad_queries,
            grad_passages,
            params: Default::default(),
        })
    }

    fn requires_equal_widths(&self) -> bool {
        false
    }
}
