//! The retrieval workflow around training: datasets as they are published ([`files`],
//! [`beir`]), exact top-k search over a corpus in bounded memory ([`search`](mod@search); sparse
//! vectors through an inverted index, [`inverted`]), the
//! standard measures with trec_eval's definitions ([`metrics`]), and hard-negative mining
//! ([`mine`](mod@mine)).
//!
//! Nothing here knows about a model: the caller hands in a closure that embeds texts
//! (with whatever prompts and tower it uses), so `gradcache eval`, `gradcache mine` and
//! the trainer's evaluation run the same code.

pub mod beir;
pub mod files;
mod hits;
pub mod inverted;
pub mod metrics;
pub mod mine;
pub mod search;

use std::collections::BTreeMap;

use candle_core::Tensor;

pub use beir::{BeirSet, Document, Qrels, Query};
pub use inverted::{search_sparse, SparseRows, Sparsity};
pub use metrics::{corpus_metrics, trec_order, trec_run, CorpusMetrics, Ranking};
pub use mine::{mine, MineOptions, Mined, MinedRow, MiningSet, Sampling};
pub use search::{search, Hit, Scoring, SearchOptions};

use crate::Result;

/// A corpus evaluation: the measures and the run they were computed from.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// Means over the judged queries.
    pub metrics: CorpusMetrics,
    /// Query id -> its top-k, in trec_eval's order.
    pub run: BTreeMap<String, Ranking>,
    /// A sparse model's active dimensions and FLOPS ([`Scoring::Sparse`] only).
    pub sparsity: Option<Sparsity>,
}

/// How [`evaluate_corpus`] reads the corpus and what it counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorpusEvalOptions {
    /// The exact search's depth and blocks.
    pub search: SearchOptions,
    /// Joins a document's title and text.
    pub title_separator: String,
    /// Leave out a retrieved document whose id is the query's id (BEIR's
    /// `ignore_identical_ids`, for sets such as Quora whose queries are also documents);
    /// off, as pytrec_eval and sentence-transformers count.
    pub ignore_identical_ids: bool,
}

impl Default for CorpusEvalOptions {
    fn default() -> Self {
        Self {
            search: SearchOptions::default(),
            title_separator: " ".into(),
            ignore_identical_ids: false,
        }
    }
}

/// Evaluates retrieval on `set`: every query against the whole corpus (exact top-k,
/// blocked), then the measures of [`metrics`], scored by a similarity, MaxSim or sparse
/// dot products through an inverted index ([`Scoring`]). `embed_queries` embeds query
/// texts (all at once; a sparse model's a block at a time), `embed_documents` a block of
/// document texts (title and text joined by `options.title_separator`).
pub fn evaluate_corpus(
    set: &BeirSet,
    similarity: impl Into<Scoring>,
    options: &CorpusEvalOptions,
    mut embed_queries: impl FnMut(&[&str]) -> Result<Tensor>,
    mut embed_documents: impl FnMut(&[&str]) -> Result<Tensor>,
) -> Result<Evaluation> {
    let scoring = similarity.into();
    let texts: Vec<&str> = set.queries.iter().map(|q| q.text.as_str()).collect();
    let mut search_options = options.search;
    if options.ignore_identical_ids {
        // One more, in case the query itself is among its best.
        search_options.top_k += 1;
    }
    let embed_block = |range: std::ops::Range<usize>| {
        let docs: Vec<String> = set.corpus[range]
            .iter()
            .map(|d| d.joined(&options.title_separator))
            .collect();
        let refs: Vec<&str> = docs.iter().map(String::as_str).collect();
        embed_documents(&refs)
    };
    let (hits, sparsity) = if scoring == Scoring::Sparse {
        // Vocabulary-wide query vectors a block at a time, kept by their non-zero entries.
        let mut queries = SparseRows::default();
        for block in texts.chunks(inverted::SPARSE_BLOCK) {
            queries.extend(&SparseRows::from_dense(&embed_queries(block)?)?)?;
        }
        let (hits, sparsity) =
            search_sparse(&queries, set.corpus.len(), search_options, embed_block)?;
        (hits, Some(sparsity))
    } else {
        let queries = embed_queries(&texts)?;
        let hits = search(
            &queries,
            set.corpus.len(),
            scoring,
            search_options,
            embed_block,
        )?;
        (hits, None)
    };
    let mut run = BTreeMap::new();
    for (query, hits) in set.queries.iter().zip(hits) {
        let mut ranking: Ranking = hits
            .iter()
            .map(|h| (set.corpus[h.doc].id.clone(), h.score))
            .filter(|(id, _)| !(options.ignore_identical_ids && *id == query.id))
            .collect();
        ranking.truncate(options.search.top_k);
        trec_order(&mut ranking);
        run.insert(query.id.clone(), ranking);
    }
    Ok(Evaluation {
        metrics: corpus_metrics(&run, &set.qrels),
        run,
        sparsity,
    })
}
