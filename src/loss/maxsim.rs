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
        let q = self.tokens(queries, crate::Side::Query)?;
        let p = self.tokens(passages, crate::Side::Passage)?;
        if self.on_kernels(&[queries, passages]) {
            let kernel = Kernel::new(self, &q, &p)?;
            let scores = kernel.scores()?;
            return Ok(Tensor::from_vec(
                scores,
                (q.dim(0)?, p.dim(0)?),
                queries.device(),
            )?);
        }
        let (q_block, p_block) = self.blocks(&q, &p)?;
        let mut rows = Vec::new();
        for (qs, ql) in spans(q.dim(0)?, q_block) {
            let qb = q.narrow(0, qs, ql)?;
            let mut cols = Vec::new();
            for (ps, pl) in spans(p.dim(0)?, p_block) {
                cols.push(Block::new(&qb, &p.narrow(0, ps, pl)?)?.scores()?);
            }
            rows.push(Tensor::cat(&cols, 1)?);
        }
        Ok(Tensor::cat(&rows, 0)?)
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
    /// queries) and its gradient with respect to the scores, a row at a time (in f64):
    /// two score-sized buffers, whatever the batch.
    fn score_grads(&self, scores: &Tensor, group: usize) -> Result<(f32, Tensor)> {
        let (nq, np) = scores.dims2()?;
        let mut values = scores
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let loss = self.score_grads_in_place(&mut values, np, group);
        let grads = Tensor::from_vec(values, (nq, np), scores.device())?;
        Ok((loss, grads.to_dtype(scores.dtype())?))
    }

    /// [`Self::score_grads`] on the scores `[Q, P]` in `values` (`np` per row), which
    /// become their gradients.
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
/// gradient by [`crate::nn::maxsim`]'s kernels.
struct Kernel<'a> {
    loss: &'a MaxSim,
    q: Tensor,
    p: Tensor,
    q_kept: Vec<bool>,
    p_kept: Vec<bool>,
}

impl<'a> Kernel<'a> {
    fn new(loss: &'a MaxSim, q: &Tensor, p: &Tensor) -> Result<Self> {
        let (q, p) = (q.contiguous()?, p.contiguous()?);
        Ok(Self {
            loss,
            q_kept: crate::nn::maxsim::kept(&q, loss.dim)?,
            p_kept: crate::nn::maxsim::kept(&p, loss.dim)?,
            q,
            p,
        })
    }

    /// The blocks: `(query start, queries, passage start, passages)`.
    fn blocks(&self) -> Result<Vec<(usize, usize, usize, usize)>> {
        let (q_block, p_block) = self.loss.blocks(&self.q, &self.p)?;
        let np = self.p.dim(0)?;
        Ok(spans(self.q.dim(0)?, q_block)
            .flat_map(|(qs, ql)| spans(np, p_block).map(move |(ps, pl)| (qs, ql, ps, pl)))
            .collect())
    }

    /// One block's similarities and what its max chose.
    fn choose(
        &self,
        (qs, ql, ps, pl): (usize, usize, usize, usize),
    ) -> Result<(crate::nn::maxsim::BlockShape, crate::nn::maxsim::Chosen)> {
        let (_, lq, d) = self.q.dims3()?;
        let (_, lp, _) = self.p.dims3()?;
        let shape = crate::nn::maxsim::BlockShape {
            nq: ql,
            lq,
            np: pl,
            lp,
        };
        let qb = self.q.narrow(0, qs, ql)?.reshape((ql * lq, d))?;
        let pb = self.p.narrow(0, ps, pl)?.reshape((pl * lp, d))?;
        let sims = qb.matmul(&pb.t()?)?.contiguous()?;
        let chosen =
            crate::nn::maxsim::choose(&sims, &self.p_kept[ps * lp..(ps + pl) * lp], shape)?;
        Ok((shape, chosen))
    }

    fn scores(&self) -> Result<Vec<f32>> {
        let (nq, lq, _) = self.q.dims3()?;
        let np = self.p.dim(0)?;
        let mut out = vec![0f32; nq * np];
        for block in self.blocks()? {
            let (qs, ql, ps, pl) = block;
            let (shape, chosen) = self.choose(block)?;
            let s =
                crate::nn::maxsim::scores(&chosen, &self.q_kept[qs * lq..(qs + ql) * lq], shape);
            for i in 0..ql {
                out[(qs + i) * np + ps..][..pl].copy_from_slice(&s[i * pl..(i + 1) * pl]);
            }
        }
        Ok(out)
    }

    /// The gradients of the token vectors from the scores' `g` `[Q * P]`, each block's
    /// max chosen again.
    fn grads(&self, g: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let (nq, lq, d) = self.q.dims3()?;
        let (np, lp, _) = self.p.dims3()?;
        let mut dq = vec![0f32; nq * lq * d];
        let mut dp = vec![0f32; np * lp * d];
        for block in self.blocks()? {
            let (qs, ql, ps, pl) = block;
            let (shape, chosen) = self.choose(block)?;
            let gb: Vec<f32> = (0..ql)
                .flat_map(|i| g[(qs + i) * np + ps..][..pl].iter().copied())
                .collect();
            let (q_rows, p_rows) = (qs * lq..(qs + ql) * lq, ps * lp..(ps + pl) * lp);
            let (qr, pr) = (
                q_rows.start * d..q_rows.end * d,
                p_rows.start * d..p_rows.end * d,
            );
            crate::nn::maxsim::scatter_block(
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
        let (queries, passages) = (queries.detach(), passages.detach());
        let q = self.tokens(&queries, crate::Side::Query)?;
        let p = self.tokens(&passages, crate::Side::Passage)?;
        if self.on_kernels(&[&queries, &passages]) {
            // The scores become their gradients in place: one score-sized buffer.
            let kernel = Kernel::new(self, &q, &p)?;
            let mut g = kernel.scores()?;
            let loss = self.score_grads_in_place(&mut g, p.dim(0)?, group);
            let (dq, dp) = kernel.grads(&g)?;
            return Ok(LossValue {
                loss,
                grad_queries: Tensor::from_vec(dq, queries.dims(), q.device())?,
                grad_passages: Tensor::from_vec(dp, passages.dims(), p.device())?,
                params: Default::default(),
            });
        }
        let (nq, lq, d) = q.dims3()?;
        let (np, lp, _) = p.dims3()?;
        let scores = self.scores(&queries, &passages)?;
        let (loss, g) = self.score_grads(&scores, group)?;
        let (q_block, p_block) = self.blocks(&q, &p)?;
        let p_spans: Vec<_> = spans(np, p_block).collect();
        let mut grad_q = Vec::new();
        let mut grad_p: Vec<Option<Tensor>> = vec![None; p_spans.len()];
        for (qs, ql) in spans(nq, q_block) {
            let qb = q.narrow(0, qs, ql)?;
            let q_flat = qb.reshape((ql * lq, d))?;
            let mut gq = q_flat.zeros_like()?;
            for (k, &(ps, pl)) in p_spans.iter().enumerate() {
                let pb = p.narrow(0, ps, pl)?;
                let block = Block::new(&qb, &pb)?;
                let w = block.pair_weights(&g.narrow(0, qs, ql)?.narrow(1, ps, pl)?)?;
                gq = (gq + w.matmul(&pb.reshape((pl * lp, d))?)?)?;
                let gp = w.t()?.matmul(&q_flat)?;
                grad_p[k] = Some(match grad_p[k].take() {
                    Some(sum) => (sum + gp)?,
                    None => gp,
                });
            }
            grad_q.push(gq.reshape((ql, lq * d))?);
        }
        let grad_p = grad_p
            .into_iter()
            .zip(&p_spans)
            .map(|(g, &(_, pl))| match g {
                Some(g) => Ok(g.reshape((pl, lp * d))?),
                None => Ok(Tensor::zeros((pl, lp * d), p.dtype(), p.device())?),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LossValue {
            loss,
            grad_queries: Tensor::cat(&grad_q, 0)?,
            grad_passages: Tensor::cat(&grad_p, 0)?,
            params: Default::default(),
        })
    }

    fn requires_equal_widths(&self) -> bool {
        false
    }
}
