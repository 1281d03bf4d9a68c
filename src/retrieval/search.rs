//! Exact top-k retrieval over a corpus that need not fit in memory as embeddings: the
//! corpus is embedded one block at a time, each block is scored against the queries (a
//! block of queries at a time) with one matrix product, and each query keeps its best `k`
//! candidates. Memory is the queries' embeddings, one corpus block's embeddings and one
//! `query block x corpus block` score matrix, whatever the corpus size. The products run
//! on candle's threads, the per-query merges on rayon's.

use std::cmp::Ordering;
use std::ops::Range;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::loss::Similarity;
use crate::{Error, Result};

/// One retrieved document: its index in the corpus and its score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// Index of the document in the corpus.
    pub doc: usize,
    /// Similarity to the query.
    pub score: f32,
}

/// Ranking order: higher score first; equal scores by lower corpus index first (so the
/// result does not depend on the block size).
fn better(a: &Hit, b: &Hit) -> Ordering {
    b.score
        .partial_cmp(&a.score)
        .unwrap_or(Ordering::Equal)
        .then(a.doc.cmp(&b.doc))
}

/// How the corpus is walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchOptions {
    /// Candidates kept per query.
    pub top_k: usize,
    /// Documents embedded and scored at once.
    pub corpus_block: usize,
    /// Queries scored against a corpus block at once.
    pub query_block: usize,
}

impl Default for SearchOptions {
    fn default() -> Self {
        Self {
            top_k: 100,
            corpus_block: 4096,
            query_block: 1024,
        }
    }
}

pub(crate) fn prepare(x: &Tensor, similarity: Similarity) -> Result<Tensor> {
    let x = x.detach().to_dtype(DType::F32)?;
    Ok(match similarity {
        Similarity::Dot => x,
        Similarity::Cosine => crate::loss::l2_normalize(&x)?,
    })
}

/// The best `options.top_k` documents of each query, best first. `queries` are the
/// query embeddings `[Q, d]`; `embed(range)` returns the embeddings `[range.len(), d]` of
/// corpus documents `range` (called once per block, in order). Scores are `similarity`
/// of the embeddings, in f32.
pub fn search(
    queries: &Tensor,
    corpus_len: usize,
    similarity: Similarity,
    options: SearchOptions,
    mut embed: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<Vec<Vec<Hit>>> {
    if options.top_k == 0 || options.corpus_block == 0 || options.query_block == 0 {
        return Err(Error::InvalidArgument {
            what: "search option",
            value: format!("{options:?}"),
            reason: "top_k, corpus_block and query_block must be at least 1",
        });
    }
    let q = prepare(queries, similarity)?;
    let (rows, width) = q.dims2()?;
    let k = options.top_k.min(corpus_len);
    let mut best: Vec<Vec<Hit>> = vec![Vec::with_capacity(2 * k); rows];
    for start in (0..corpus_len).step_by(options.corpus_block) {
        let range = start..(start + options.corpus_block).min(corpus_len);
        let docs = prepare(&embed(range.clone())?, similarity)?;
        if docs.dims2()? != (range.len(), width) {
            return Err(Error::InvalidArgument {
                what: "corpus block embeddings",
                value: format!("{:?}", docs.dims()),
                reason: "need one row per document, as wide as the query embeddings",
            });
        }
        let docs_t = docs.t()?.contiguous()?;
        for q_start in (0..rows).step_by(options.query_block) {
            let q_len = options.query_block.min(rows - q_start);
            let scores = q.narrow(0, q_start, q_len)?.matmul(&docs_t)?;
            let scores = scores.flatten_all()?.to_vec1::<f32>()?;
            let cols = range.len();
            best[q_start..q_start + q_len]
                .par_iter_mut()
                .zip(scores.par_chunks(cols))
                .for_each(|(kept, row)| merge(kept, row, start, k));
        }
    }
    for kept in &mut best {
        kept.sort_by(better);
        kept.truncate(k);
    }
    Ok(best)
}

/// Adds a block's scores (documents `offset..`) to one query's candidates, keeping at most
/// `2k` between compactions (amortised: a compaction is one selection, not a sort).
fn merge(kept: &mut Vec<Hit>, row: &[f32], offset: usize, k: usize) {
    // The k-th best score so far: a candidate below it cannot enter.
    let mut floor = if kept.len() >= k {
        kept.iter().map(|h| h.score).fold(f32::INFINITY, f32::min)
    } else {
        f32::NEG_INFINITY
    };
    for (j, &score) in row.iter().enumerate() {
        if kept.len() >= k && score.partial_cmp(&floor).is_none_or(|o| o.is_lt()) {
            continue;
        }
        kept.push(Hit {
            doc: offset + j,
            score,
        });
        if kept.len() >= 2 * k.max(8) {
            kept.select_nth_unstable_by(k - 1, better);
            kept.truncate(k);
            floor = kept.iter().map(|h| h.score).fold(f32::INFINITY, f32::min);
        }
    }
}
