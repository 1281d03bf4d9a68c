//! The standard retrieval measures over a ranked run and graded judgements, with
//! trec_eval's definitions (what pytrec_eval and BEIR report):
//!
//! - a document is relevant when its grade is at least 1; unjudged documents are not;
//! - each query's ranking is ordered as trec_eval orders a run file: by score, higher
//!   first, and equal scores by document id in *decreasing* byte order;
//! - nDCG@k: gain = grade, discount `log2(rank + 1)`, over the ideal ordering of the
//!   query's judged grades (`ndcg_cut_k`);
//! - recall@k (1, 5, 10, 100): relevant documents in the top k over all relevant documents (`recall_k`);
//! - MAP@k: the precision at each relevant document's rank within the top k, summed and
//!   divided by the number of relevant documents (`map_cut_k`);
//! - MRR@k: the reciprocal rank of the first relevant document within the top k, else 0
//!   (BEIR's and sentence-transformers' `MRR@k`).
//!
//! Means are over the judged queries (a query with no relevant document scores 0).

use std::collections::BTreeMap;

use crate::retrieval::beir::Qrels;

/// Mean retrieval measures over the judged queries of a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CorpusMetrics {
    /// Judged queries averaged over.
    pub queries: usize,
    /// nDCG@10 (`ndcg_cut_10`).
    pub ndcg_at_10: f64,
    /// MRR@10.
    pub mrr_at_10: f64,
    /// Recall@1 (`recall_1`).
    pub recall_at_1: f64,
    /// Recall@5 (`recall_5`).
    pub recall_at_5: f64,
    /// Recall@10 (`recall_10`).
    pub recall_at_10: f64,
    /// Recall@100 (`recall_100`).
    pub recall_at_100: f64,
    /// MAP@100 (`map_cut_100`).
    pub map_at_100: f64,
}

/// One query's ranking: `(document id, score)`, in any order.
pub type Ranking = Vec<(String, f32)>;

/// Puts a ranking in trec_eval's order: score descending, ties by document id descending.
pub fn trec_order(ranking: &mut Ranking) {
    ranking.sort_by(|a, b| {
        b.1.partial_cmp(&a.1)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| b.0.cmp(&a.0))
    });
}

/// The measures of one query: `ranking` in trec_eval's order, `judged` its grades.
fn query_measures(ranking: &Ranking, judged: &BTreeMap<String, i64>) -> [f64; 7] {
    let grade = |doc: &str| judged.get(doc).copied().unwrap_or(0);
    let relevant = judged.values().filter(|&&g| g >= 1).count();
    if relevant == 0 {
        return [0.0; 7];
    }
    let discount = |rank: usize| 1.0 / ((rank + 1) as f64).log2();
    let dcg: f64 = ranking
        .iter()
        .take(10)
        .enumerate()
        .map(|(i, (d, _))| grade(d).max(0) as f64 * discount(i + 1))
        .sum();
    let mut ideal: Vec<i64> = judged.values().copied().filter(|&g| g > 0).collect();
    ideal.sort_unstable_by(|a, b| b.cmp(a));
    let idcg: f64 = ideal
        .iter()
        .take(10)
        .enumerate()
        .map(|(i, &g)| g as f64 * discount(i + 1))
        .sum();
    let ndcg = if idcg > 0.0 { dcg / idcg } else { 0.0 };
    let recall = |k: usize| {
        ranking
            .iter()
            .take(k)
            .filter(|(d, _)| grade(d) >= 1)
            .count() as f64
            / relevant as f64
    };
    let mrr = ranking
        .iter()
        .take(10)
        .position(|(d, _)| grade(d) >= 1)
        .map_or(0.0, |i| 1.0 / (i + 1) as f64);
    let mut found = 0;
    let mut precision_sum = 0.0;
    for (i, (d, _)) in ranking.iter().take(100).enumerate() {
        if grade(d) >= 1 {
            found += 1;
            precision_sum += found as f64 / (i + 1) as f64;
        }
    }
    let map = precision_sum / relevant as f64;
    [
        ndcg,
        mrr,
        recall(1),
        recall(5),
        recall(10),
        recall(100),
        map,
    ]
}

/// The measures of `run` (query id -> ranking, each in trec_eval's order, see
/// [`trec_order`]) against `qrels`, averaged over the judged queries. A judged query
/// missing from the run scores 0.
pub fn corpus_metrics(run: &BTreeMap<String, Ranking>, qrels: &Qrels) -> CorpusMetrics {
    let mut sums = [0f64; 7];
    let empty = Ranking::new();
    for (query, judged) in qrels {
        let ranking = run.get(query).unwrap_or(&empty);
        for (s, m) in sums.iter_mut().zip(query_measures(ranking, judged)) {
            *s += m;
        }
    }
    let n = qrels.len().max(1) as f64;
    CorpusMetrics {
        queries: qrels.len(),
        ndcg_at_10: sums[0] / n,
        mrr_at_10: sums[1] / n,
        recall_at_1: sums[2] / n,
        recall_at_5: sums[3] / n,
        recall_at_10: sums[4] / n,
        recall_at_100: sums[5] / n,
        map_at_100: sums[6] / n,
    }
}

/// A run in TREC format, one line per retrieved document: `qid Q0 docid rank score tag`
/// (rank from 1, in the ranking's order).
pub fn trec_run(run: &BTreeMap<String, Ranking>, tag: &str) -> String {
    let mut out = String::new();
    for (query, ranking) in run {
        for (i, (doc, score)) in ranking.iter().enumerate() {
            out.push_str(&format!("{query} Q0 {doc} {} {score} {tag}\n", i + 1));
        }
    }
    out
}

/// Reads a TREC run (`qid Q0 docid rank score tag`) back into rankings in trec_eval's
/// order; `None` for a malformed line's number (1-based).
pub fn parse_trec_run(text: &str) -> std::result::Result<BTreeMap<String, Ranking>, usize> {
    let mut run: BTreeMap<String, Ranking> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 5 {
            return Err(i + 1);
        }
        let score: f32 = cols[4].parse().map_err(|_| i + 1)?;
        run.entry(cols[0].to_string())
            .or_default()
            .push((cols[2].to_string(), score));
    }
    for ranking in run.values_mut() {
        trec_order(ranking);
    }
    Ok(run)
}
