//! Retrieval quality: every query against every candidate passage, with one relevant
//! passage per query (the held-out positive). Recall@1/5/10, MRR@10 and nDCG@10, as the
//! BEIR / MTEB retrieval evaluations report them for a single relevant document.

use candle_core::Tensor;

use crate::{Error, Result};

/// Retrieval metrics, each a mean over queries in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RetrievalMetrics {
    /// Number of queries evaluated.
    pub queries: usize,
    /// Share of queries whose relevant passage ranks first.
    pub recall_at_1: f64,
    /// Share of queries whose relevant passage is in the top 5.
    pub recall_at_5: f64,
    /// Share of queries whose relevant passage is in the top 10.
    pub recall_at_10: f64,
    /// Mean reciprocal rank, counting 0 beyond rank 10.
    pub mrr_at_10: f64,
    /// nDCG@10 with one relevant passage: `1 / log2(rank + 1)` within the top 10.
    pub ndcg_at_10: f64,
    /// Recall@100, in a corpus evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recall_at_100: Option<f64>,
    /// MAP@100, in a corpus evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_at_100: Option<f64>,
}

impl From<&crate::retrieval::CorpusMetrics> for RetrievalMetrics {
    /// A corpus evaluation's measures (graded, several relevant documents per query) in
    /// the trainer's record.
    fn from(m: &crate::retrieval::CorpusMetrics) -> Self {
        Self {
            queries: m.queries,
            recall_at_1: m.recall_at_1,
            recall_at_5: m.recall_at_5,
            recall_at_10: m.recall_at_10,
            mrr_at_10: m.mrr_at_10,
            ndcg_at_10: m.ndcg_at_10,
            recall_at_100: Some(m.recall_at_100),
            map_at_100: Some(m.map_at_100),
        }
    }
}

impl RetrievalMetrics {
    /// The mean of several sets' metrics, each measure averaged over the sets (as NanoBEIR
    /// reports one figure over many); the queries are summed. `None` for no sets; one set
    /// is itself.
    pub fn mean(sets: &[RetrievalMetrics]) -> Option<Self> {
        let first = *sets.first()?;
        if sets.len() == 1 {
            return Some(first);
        }
        let n = sets.len() as f64;
        let mean = |f: fn(&RetrievalMetrics) -> f64| sets.iter().map(f).sum::<f64>() / n;
        let mean_opt = |f: fn(&RetrievalMetrics) -> Option<f64>| {
            let all: Option<Vec<f64>> = sets.iter().map(f).collect();
            all.map(|v| v.iter().sum::<f64>() / n)
        };
        Some(Self {
            queries: sets.iter().map(|m| m.queries).sum(),
            recall_at_1: mean(|m| m.recall_at_1),
            recall_at_5: mean(|m| m.recall_at_5),
            recall_at_10: mean(|m| m.recall_at_10),
            mrr_at_10: mean(|m| m.mrr_at_10),
            ndcg_at_10: mean(|m| m.ndcg_at_10),
            recall_at_100: mean_opt(|m| m.recall_at_100),
            map_at_100: mean_opt(|m| m.map_at_100),
        })
    }

    /// Metrics from the 1-based rank of each query's relevant passage.
    pub fn from_ranks(ranks: &[usize]) -> Self {
        let n = ranks.len().max(1) as f64;
        let mean = |f: &dyn Fn(usize) -> f64| ranks.iter().map(|&r| f(r)).sum::<f64>() / n;
        let within = |k: usize| move |r: usize| f64::from(u8::from(r <= k));
        Self {
            queries: ranks.len(),
            recall_at_1: mean(&within(1)),
            recall_at_5: mean(&within(5)),
            recall_at_10: mean(&within(10)),
            mrr_at_10: mean(&|r| if r <= 10 { 1.0 / r as f64 } else { 0.0 }),
            ndcg_at_10: mean(&|r| {
                if r <= 10 {
                    1.0 / (r as f64 + 1.0).log2()
                } else {
                    0.0
                }
            }),
            recall_at_100: None,
            map_at_100: None,
        }
    }
}

/// The 1-based rank of passage `target` among the `scores` of one query. Ties are broken
/// against the relevant passage only by candidates that come before it, so the rank does not
/// depend on how a sort orders equal scores.
pub fn rank_of(scores: &[f32], target: usize) -> usize {
    let s = scores[target];
    1 + scores
        .iter()
        .enumerate()
        .filter(|&(j, &x)| x > s || (x == s && j < target))
        .count()
}

/// Scores every query `[Q, d]` against every passage `[P, d]` in blocks of `block_rows`
/// queries and returns the metrics; `targets[i]` is the index of query `i`'s relevant
/// passage.
pub fn evaluate(
    queries: &Tensor,
    passages: &Tensor,
    targets: &[usize],
    scoring: impl Into<crate::retrieval::Scoring>,
    block_rows: usize,
) -> Result<RetrievalMetrics> {
    let scoring = scoring.into();
    let (q_rows, p_rows) = (queries.dim(0)?, passages.dim(0)?);
    if targets.len() != q_rows {
        return Err(Error::InvalidArgument {
            what: "number of targets",
            value: targets.len().to_string(),
            reason: "need one target passage per query",
        });
    }
    if let Some(&t) = targets.iter().find(|&&t| t >= p_rows) {
        return Err(Error::InvalidArgument {
            what: "target",
            value: t.to_string(),
            reason: "a target passage index is beyond the passages",
        });
    }
    let (q, p) = (
        scoring.prepare(queries)?,
        scoring.prepare(passages)?.contiguous()?,
    );
    let mut ranks = Vec::with_capacity(q_rows);
    for start in (0..q_rows).step_by(block_rows.max(1)) {
        let rows = block_rows.max(1).min(q_rows - start);
        let scores = scoring
            .scores(&q.narrow(0, start, rows)?, &p)?
            .to_vec2::<f32>()?;
        for (i, row) in scores.iter().enumerate() {
            ranks.push(rank_of(row, targets[start + i]));
        }
    }
    Ok(RetrievalMetrics::from_ranks(&ranks))
}
