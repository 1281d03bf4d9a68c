//! Exact top-k retrieval over a corpus that need not fit in memory as embeddings: the
//! corpus is embedded one block at a time, each block is scored against the queries (a
//! block of queries at a time) with one matrix product, and each query keeps its best `k`
//! candidates. Memory is the queries' embeddings, one corpus block's embeddings and one
//! `query block x corpus block` score matrix, whatever the corpus size. The products run
//! on candle's threads, the per-query merges on rayon's.

use std::ops::Range;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::loss::Similarity;
use crate::{Error, Result};

use super::hits::better;
pub use super::hits::{Hit, SearchOptions};

/// How a query and a document are scored: one vector each with a similarity, token
/// matrices by MaxSim (late interaction, ColBERT), or vocabulary-wide sparse vectors by
/// dot products through an inverted index (SPLADE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// One embedding per text `[n, d]`, compared by `similarity`.
    Vectors(Similarity),
    /// A token matrix per text `[n, tokens, d]` (absent tokens zero vectors), scored by
    /// `sum_s max_t <q_s, d_t>` ([`crate::loss::MaxSim::scores`]).
    MaxSim,
    /// A sparse model's vocabulary-wide vectors `[n, vocabulary]`, compared by dot
    /// products; a corpus is searched through an inverted index of their non-zero entries
    /// ([`super::inverted`]), the same scores as the dense products.
    Sparse,
}

impl From<Similarity> for Scoring {
    fn from(similarity: Similarity) -> Self {
        Scoring::Vectors(similarity)
    }
}

impl Scoring {
    /// The name sentence-transformers gives it (`similarity_fn_name`): `cosine`, `dot`,
    /// `MaxSim`.
    pub fn sentence_transformers_name(self) -> &'static str {
        match self {
            Scoring::Vectors(s) => s.sentence_transformers_name(),
            Scoring::MaxSim => "MaxSim",
            Scoring::Sparse => "dot",
        }
    }

    /// The embeddings as this scoring reads them, f32: normalised for cosine, token
    /// matrices checked to be `[n, tokens, d]`.
    pub(crate) fn prepare(self, x: &Tensor) -> Result<Tensor> {
        let x = x.detach().to_dtype(DType::F32)?;
        match (self, x.rank()) {
            (Scoring::Vectors(Similarity::Dot) | Scoring::Sparse, 2) => Ok(x),
            (Scoring::Vectors(Similarity::Cosine), 2) => crate::loss::l2_normalize(&x),
            (Scoring::MaxSim, 3) => Ok(x),
            _ => Err(Error::InvalidArgument {
                what: "embeddings",
                value: format!("{:?}", x.dims()),
                reason: "single and sparse vectors are [texts, width], token matrices [texts, tokens, width]",
            }),
        }
    }

    /// The scores `[n]` of row-aligned pairs of prepared queries and documents.
    pub(crate) fn pair_scores(self, queries: &Tensor, docs: &Tensor) -> Result<Tensor> {
        match self {
            Scoring::Vectors(_) | Scoring::Sparse => Ok((queries * docs)?.sum(1)?),
            Scoring::MaxSim => {
                let pairs = (0..queries.dim(0)?)
                    .map(|i| {
                        let one = |x: &Tensor| x.narrow(0, i, 1);
                        Ok(self.scores(&one(queries)?, &one(docs)?)?.flatten_all()?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&pairs, 0)?)
            }
        }
    }

    /// Scores `[q, d]` of prepared queries against prepared documents.
    pub(crate) fn scores(self, queries: &Tensor, docs: &Tensor) -> Result<Tensor> {
        match self {
            Scoring::Vectors(_) | Scoring::Sparse => Ok(queries.matmul(&docs.t()?)?),
            Scoring::MaxSim => {
                let (q, lq, d) = queries.dims3()?;
                let (n, ld, _) = docs.dims3()?;
                crate::loss::MaxSim::new(d)?
                    .scores(&queries.reshape((q, lq * d))?, &docs.reshape((n, ld * d))?)
            }
        }
    }
}

/// The best `options.top_k` documents of each query, best first. `queries` are the
/// query embeddings `[Q, d]`; `embed(range)` returns the embeddings `[range.len(), d]` of
/// corpus documents `range` (called once per block, in order). Scores are `scoring` of
/// the embeddings (a [`Similarity`], or MaxSim of token matrices `[Q, tokens, d]` and
/// `[range.len(), tokens, d]`), in f32.
pub fn search(
    queries: &Tensor,
    corpus_len: usize,
    scoring: impl Into<Scoring>,
    options: SearchOptions,
    mut embed: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<Vec<Vec<Hit>>> {
    options.check()?;
    let scoring = scoring.into();
    if scoring == Scoring::Sparse {
        let queries = super::inverted::SparseRows::from_dense(queries)?;
        return Ok(super::inverted::search_sparse(&queries, corpus_len, options, embed)?.0);
    }
    let q = scoring.prepare(queries)?;
    let (rows, width) = (q.dim(0)?, *q.dims().last().unwrap_or(&0));
    let k = options.top_k.min(corpus_len);
    let mut best: Vec<Vec<Hit>> = vec![Vec::with_capacity(2 * k); rows];
    for start in (0..corpus_len).step_by(options.corpus_block) {
        let range = start..(start + options.corpus_block).min(corpus_len);
        let docs = scoring.prepare(&embed(range.clone())?)?;
        if docs.dim(0)? != range.len() || docs.dims().last() != Some(&width) {
            return Err(Error::InvalidArgument {
                what: "corpus block embeddings",
                value: format!("{:?}", docs.dims()),
                reason: "need one row per document, as wide as the query embeddings",
            });
        }
        let docs = docs.contiguous()?;
        for q_start in (0..rows).step_by(options.query_block) {
            let q_len = options.query_block.min(rows - q_start);
            let scores = scoring.scores(&q.narrow(0, q_start, q_len)?, &docs)?;
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
