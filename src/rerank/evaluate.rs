//! Reranking a first-stage run and measuring it, as sentence-transformers'
//! `CrossEncoderRerankingEvaluator` measures it.
//!
//! Each judged query of a BEIR split is a sample: its positives are the documents judged
//! relevant (grade >= 1), its documents the first stage's top `top_k` for it, in the run's
//! order. The base measures rank the documents as the run does; the reranked ones by the
//! cross-encoder's scores. Per sample (the evaluator's `compute_metrics`):
//!
//! - MRR@k: the reciprocal rank of the first positive in the top k, else 0;
//! - nDCG@k: binary gains, the DCG of the top k (tied scores share their positions'
//!   discounts, as scikit-learn's `dcg_score`) over the ideal DCG of `min(positives, k)`
//!   positives;
//! - MAP: scikit-learn's average precision over the ranked documents, times the share of
//!   the query's positives that are among them.
//!
//! A sample with no positive among its documents scores 0; the means are over every judged
//! query. With `always_rerank_positives` (the evaluator's default) a query's positives are
//! put among the documents to rerank even where the first stage missed them, which
//! measures the reranker and not the pipeline; off by default here.

use std::collections::{BTreeMap, HashMap};

use crate::retrieval::metrics::{trec_order, Ranking};
use crate::retrieval::BeirSet;
use crate::Result;

/// Scores (query, document) pairs, in order: a cross-encoder's `predict`.
pub type PairScorer<'a> = dyn FnMut(&[(&str, &str)]) -> Result<Vec<f32>> + 'a;

/// The evaluator's three measures, averaged over the judged queries.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RerankMetrics {
    /// Queries averaged over.
    pub queries: usize,
    /// The cutoff of MRR and nDCG.
    pub at_k: usize,
    /// Mean average precision (scaled by the positives retrieved).
    pub map: f64,
    /// MRR@k.
    pub mrr: f64,
    /// nDCG@k.
    pub ndcg: f64,
}

/// How to rerank.
#[derive(Debug, Clone)]
pub struct RerankOptions {
    /// The first stage's documents reranked per query.
    pub top_k: usize,
    /// The cutoff of MRR and nDCG (theirs: 10).
    pub at_k: usize,
    /// Put each query's positives among its documents (the evaluator's default).
    pub always_rerank_positives: bool,
    /// Between a document's title and its text.
    pub title_separator: String,
}

impl Default for RerankOptions {
    fn default() -> Self {
        Self {
            top_k: 100,
            at_k: 10,
            always_rerank_positives: false,
            title_separator: " ".into(),
        }
    }
}

/// What reranking a run gave.
#[derive(Debug, Clone)]
pub struct RerankReport {
    /// The first stage's measures.
    pub base: RerankMetrics,
    /// The reranked measures.
    pub reranked: RerankMetrics,
    /// The reranked run (each judged query's documents by the cross-encoder's score).
    pub run: BTreeMap<String, Ranking>,
    /// (query, document) pairs of the run whose document is not in the corpus: left out,
    /// counted here (first ten named).
    pub missing: (usize, Vec<(String, String)>),
    /// Judged queries the run has no documents for.
    pub queries_without_run: usize,
    /// Pairs scored.
    pub pairs: usize,
}

/// One sample's measures: `(mrr, ndcg, ap)` of documents `relevant` scored `scores`
/// (higher first), the query having `positives` positives in all.
pub fn sample_metrics(
    relevant: &[bool],
    scores: &[f64],
    positives: usize,
    at_k: usize,
) -> (f64, f64, f64) {
    let retrieved = relevant.iter().filter(|&&r| r).count();
    if retrieved == 0 {
        return (0.0, 0.0, 0.0);
    }
    let positives = positives.max(retrieved);
    // numpy's argsort of the scores, reversed: ties in reverse index order.
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(b.cmp(&a)));
    let mrr = order
        .iter()
        .take(at_k)
        .position(|&i| relevant[i])
        .map_or(0.0, |r| 1.0 / (r + 1) as f64);
    let discount = |i: usize| {
        if i < at_k {
            1.0 / ((i + 2) as f64).log2()
        } else {
            0.0
        }
    };
    let dcg = if relevant.len() == 1 {
        f64::from(u8::from(relevant[0]))
    } else {
        // Ties share the mean gain over their positions' discounts.
        let mut dcg = 0.0;
        let mut start = 0;
        while start < order.len() {
            let mut end = start + 1;
            while end < order.len() && scores[order[end]] == scores[order[start]] {
                end += 1;
            }
            let gain = order[start..end].iter().filter(|&&i| relevant[i]).count() as f64
                / (end - start) as f64;
            dcg += gain * (start..end).map(discount).sum::<f64>();
            start = end;
        }
        dcg
    };
    let ideal: f64 = (0..positives.min(at_k)).map(discount).sum();
    // Average precision over thresholds: each distinct score closes a group.
    let mut ap = 0.0;
    let (mut tp, mut seen, mut start) = (0usize, 0usize, 0usize);
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && scores[order[end]] == scores[order[start]] {
            end += 1;
        }
        let hits = order[start..end].iter().filter(|&&i| relevant[i]).count();
        tp += hits;
        seen += end - start;
        ap += (tp as f64 / seen as f64) * (hits as f64 / retrieved as f64);
        start = end;
    }
    (mrr, dcg / ideal, ap * retrieved as f64 / positives as f64)
}

/// Reranks `first_stage` on `set` with `score` (the cross-encoder's scores of (query,
/// document) pairs, in order) and measures both rankings.
pub fn rerank_beir(
    set: &BeirSet,
    first_stage: &BTreeMap<String, Ranking>,
    options: &RerankOptions,
    score: &mut PairScorer<'_>,
) -> Result<RerankReport> {
    let corpus: HashMap<&str, usize> = set
        .corpus
        .iter()
        .enumerate()
        .map(|(i, d)| (d.id.as_str(), i))
        .collect();
    let texts: Vec<String> = set
        .corpus
        .iter()
        .map(|d| d.joined(&options.title_separator))
        .collect();
    let mut missing = (0usize, Vec::new());
    let mut queries_without_run = 0;
    // Per sample: the query, its documents (corpus indices), which are positives, the
    // number of positives.
    let mut samples: Vec<(usize, Vec<usize>, Vec<bool>, usize)> = Vec::new();
    let mut base = Vec::new();
    for (q, query) in set.queries.iter().enumerate() {
        let judged = set.qrels.get(&query.id);
        let positives: Vec<usize> = judged
            .into_iter()
            .flatten()
            .filter(|(_, &g)| g >= 1)
            .filter_map(|(d, _)| corpus.get(d.as_str()).copied())
            .collect();
        let mut docs = Vec::new();
        match first_stage.get(&query.id) {
            Some(ranking) => {
                let mut ranking = ranking.clone();
                trec_order(&mut ranking);
                for (doc, _) in ranking.iter().take(options.top_k) {
                    match corpus.get(doc.as_str()) {
                        Some(&i) => docs.push(i),
                        None => {
                            missing.0 += 1;
                            if missing.1.len() < 10 {
                                missing.1.push((query.id.clone(), doc.clone()));
                            }
                        }
                    }
                }
            }
            None => queries_without_run += 1,
        }
        let relevant: Vec<bool> = docs.iter().map(|d| positives.contains(d)).collect();
        let order: Vec<f64> = (0..docs.len()).rev().map(|i| (i + 1) as f64).collect();
        base.push(sample_metrics(
            &relevant,
            &order,
            positives.len(),
            options.at_k,
        ));
        if options.always_rerank_positives {
            let rest: Vec<usize> = docs
                .into_iter()
                .filter(|d| !positives.contains(d))
                .collect();
            docs = positives.clone();
            docs.extend(rest);
        }
        let relevant = docs.iter().map(|d| positives.contains(d)).collect();
        samples.push((q, docs, relevant, positives.len()));
    }
    // Every query's documents are scored (the reranked run has them all); a sample
    // without a positive among them scores 0 either way.
    let pairs: Vec<(&str, &str)> = samples
        .iter()
        .flat_map(|(q, docs, _, _)| {
            docs.iter()
                .map(|&d| (set.queries[*q].text.as_str(), texts[d].as_str()))
        })
        .collect();
    let scores = if pairs.is_empty() {
        Vec::new()
    } else {
        score(&pairs)?
    };
    let mut offset = 0;
    let mut reranked = Vec::new();
    let mut run = BTreeMap::new();
    for (q, docs, relevant, positives) in &samples {
        let s: Vec<f64> = scores[offset..offset + docs.len()]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        offset += docs.len();
        reranked.push(sample_metrics(relevant, &s, *positives, options.at_k));
        let mut ranking: Ranking = docs
            .iter()
            .zip(&s)
            .map(|(&d, &v)| (set.corpus[d].id.clone(), v as f32))
            .collect();
        trec_order(&mut ranking);
        if !ranking.is_empty() {
            run.insert(set.queries[*q].id.clone(), ranking);
        }
    }
    let mean = |m: &[(f64, f64, f64)]| {
        let n = m.len().max(1) as f64;
        RerankMetrics {
            queries: m.len(),
            at_k: options.at_k,
            mrr: m.iter().map(|x| x.0).sum::<f64>() / n,
            ndcg: m.iter().map(|x| x.1).sum::<f64>() / n,
            map: m.iter().map(|x| x.2).sum::<f64>() / n,
        }
    };
    Ok(RerankReport {
        base: mean(&base),
        reranked: mean(&reranked),
        run,
        missing,
        queries_without_run,
        pairs: scores.len(),
    })
}
