//! Exact retrieval for sparse (SPLADE) vectors through an inverted index: each document's
//! non-zero entries go into one posting list per vocabulary entry, and a query is scored
//! by walking the lists of its own non-zero entries only. The scores are the dot products
//! of the vocabulary-wide vectors (the zeros add nothing): per document the products of
//! the shared entries summed in increasing vocabulary order, in f32, so they differ from a
//! dense matrix product's only by the order of the additions. The ranking and the top-k
//! are those of [`super::search`](mod@super::search)'s dense path: higher score first, equal scores by lower
//! corpus index, documents sharing no entry with the query (score 0) filling the top-k in
//! corpus order.
//!
//! Memory is the corpus's non-zero entries (8 bytes each) plus one score per document and
//! thread while queries are scored; the vocabulary-wide vectors exist a block at a time.
//! The index also counts what sentence-transformers' `SparseInformationRetrievalEvaluator`
//! reports: the mean active dimensions of queries and documents, the sparsity ratios and
//! the average FLOPS of a query-document pair.

use std::ops::Range;

use candle_core::{DType, Tensor};
use rayon::prelude::*;
use serde::Serialize;

use super::hits::{better, Hit, SearchOptions};
use crate::{Error, Result};

/// Vocabulary-wide vectors stored by their non-zero entries (rows of a CSR matrix).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseRows {
    /// Row `i`'s entries are `starts[i]..starts[i + 1]` of `indices` and `values`.
    starts: Vec<usize>,
    /// Vocabulary indices, increasing within a row.
    indices: Vec<u32>,
    values: Vec<f32>,
    /// The vectors' width (the vocabulary size).
    width: usize,
}

impl SparseRows {
    /// The non-zero entries of each row of `dense` `[rows, width]` (any float dtype).
    pub fn from_dense(dense: &Tensor) -> Result<Self> {
        let (rows, width) = dense.dims2().map_err(|_| Error::InvalidArgument {
            what: "sparse embeddings",
            value: format!("{:?}", dense.dims()),
            reason: "a sparse model's vectors are [texts, vocabulary]",
        })?;
        let values = dense
            .detach()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut out = Self {
            starts: Vec::with_capacity(rows + 1),
            width,
            ..Self::default()
        };
        out.starts.push(0);
        for row in values.chunks(width.max(1)).take(rows) {
            for (i, &v) in row.iter().enumerate() {
                if v != 0.0 {
                    out.indices.push(i as u32);
                    out.values.push(v);
                }
            }
            out.starts.push(out.indices.len());
        }
        Ok(out)
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `i`'s entries: `(vocabulary index, value)`, by increasing index.
    pub fn row(&self, i: usize) -> impl Iterator<Item = (u32, f32)> + '_ {
        let range = self.starts[i]..self.starts[i + 1];
        self.indices[range.clone()]
            .iter()
            .copied()
            .zip(self.values[range].iter().copied())
    }

    /// Appends the rows of `other` (of the same width).
    pub(crate) fn extend(&mut self, other: &SparseRows) -> Result<()> {
        if self.starts.is_empty() {
            self.starts.push(0);
            self.width = other.width;
        }
        if other.width != self.width {
            return Err(Error::InvalidArgument {
                what: "sparse embeddings",
                value: format!("width {}", other.width),
                reason: "every block of a corpus must be as wide as the first",
            });
        }
        let base = self.indices.len();
        self.indices.extend_from_slice(&other.indices);
        self.values.extend_from_slice(&other.values);
        self.starts
            .extend(other.starts.iter().skip(1).map(|s| s + base));
        Ok(())
    }

    /// How many rows have each vocabulary entry active, and the total active entries.
    fn counts(&self) -> (Vec<u64>, usize) {
        let mut counts = vec![0u64; self.width];
        for &i in &self.indices {
            counts[i as usize] += 1;
        }
        (counts, self.indices.len())
    }
}

/// What sentence-transformers' `SparseInformationRetrievalEvaluator` reports beside the
/// measures, under its names.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sparsity {
    /// Mean non-zero entries per query vector.
    pub query_active_dims: f64,
    /// `1 - query_active_dims / vocabulary`.
    pub query_sparsity_ratio: f64,
    /// Mean non-zero entries per document vector.
    pub corpus_active_dims: f64,
    /// `1 - corpus_active_dims / vocabulary`.
    pub corpus_sparsity_ratio: f64,
    /// The expected number of products per query-document pair:
    /// `sum_j P(query_j != 0) P(document_j != 0)`.
    pub avg_flops: f64,
}

impl Sparsity {
    fn of(queries: &SparseRows, corpus: &SparseRows) -> Self {
        let width = queries.width.max(corpus.width).max(1) as f64;
        let (q_counts, q_active) = queries.counts();
        let (d_counts, d_active) = corpus.counts();
        let (nq, nd) = (queries.len().max(1) as f64, corpus.len().max(1) as f64);
        let avg_flops = q_counts
            .iter()
            .zip(&d_counts)
            .map(|(&q, &d)| (q as f64 / nq) * (d as f64 / nd))
            .sum();
        let q_dims = q_active as f64 / nq;
        let d_dims = d_active as f64 / nd;
        Self {
            query_active_dims: q_dims,
            query_sparsity_ratio: 1.0 - q_dims / width,
            corpus_active_dims: d_dims,
            corpus_sparsity_ratio: 1.0 - d_dims / width,
            avg_flops,
        }
    }

    /// A line for the log.
    pub fn describe(&self) -> String {
        format!(
            "active dimensions: queries {:.1} (sparsity {:.4}), documents {:.1} (sparsity {:.4}); avg FLOPS {:.2}",
            self.query_active_dims,
            self.query_sparsity_ratio,
            self.corpus_active_dims,
            self.corpus_sparsity_ratio,
            self.avg_flops
        )
    }
}

/// Documents at most this many at a time are embedded as vocabulary-wide vectors (a block
/// of 512 at BERT's vocabulary is 62 MB in f32) before they go into the index.
pub const SPARSE_BLOCK: usize = 512;

/// The corpus as posting lists: for each vocabulary entry, the documents where it is
/// active and their weights, by increasing document.
struct InvertedIndex {
    /// Entry `j`'s postings are `starts[j]..starts[j + 1]` of `docs` and `weights`.
    starts: Vec<usize>,
    docs: Vec<u32>,
    weights: Vec<f32>,
}

impl InvertedIndex {
    fn build(corpus: &SparseRows) -> Result<Self> {
        if corpus.len() > u32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "corpus",
                value: format!("{} documents", corpus.len()),
                reason: "the inverted index numbers documents in 32 bits",
            });
        }
        let (counts, active) = corpus.counts();
        let mut starts = Vec::with_capacity(counts.len() + 1);
        starts.push(0);
        for c in &counts {
            starts.push(starts.last().copied().unwrap_or(0) + *c as usize);
        }
        let mut fill = starts.clone();
        let (mut docs, mut weights) = (vec![0u32; active], vec![0f32; active]);
        for d in 0..corpus.len() {
            for (j, w) in corpus.row(d) {
                let at = &mut fill[j as usize];
                docs[*at] = d as u32;
                weights[*at] = w;
                *at += 1;
            }
        }
        Ok(Self {
            starts,
            docs,
            weights,
        })
    }

    /// The best `k` documents of one query, best first, with `scores` (one per document,
    /// all zero on entry and on return) and `touched` as scratch.
    fn top_k(
        &self,
        query: impl Iterator<Item = (u32, f32)>,
        k: usize,
        scores: &mut [f32],
        touched: &mut Vec<u32>,
    ) -> Vec<Hit> {
        touched.clear();
        for (j, q) in query {
            let Some(range) = self
                .starts
                .get(j as usize)
                .zip(self.starts.get(j as usize + 1))
                .map(|(&a, &b)| a..b)
            else {
                continue;
            };
            for (&d, &w) in self.docs[range.clone()].iter().zip(&self.weights[range]) {
                let s = &mut scores[d as usize];
                if *s == 0.0 {
                    touched.push(d);
                }
                *s += q * w;
            }
        }
        // A document whose sum returned to exactly 0 may be listed twice; once is kept.
        touched.sort_unstable();
        touched.dedup();
        let mut hits: Vec<Hit> = touched
            .iter()
            .map(|&d| Hit {
                doc: d as usize,
                score: scores[d as usize],
            })
            .collect();
        for &d in touched.iter() {
            scores[d as usize] = 0.0;
        }
        // Documents not reached score 0: as the dense path does, the lowest-indexed of
        // them compete with the reached ones (a reached one may score below 0 only with
        // negative weights, which SPLADE's log(1 + relu) never gives, but the order holds).
        let mut zeros = (0..scores.len())
            .filter(|d| touched.binary_search(&(*d as u32)).is_err())
            .take(k)
            .map(|doc| Hit { doc, score: 0.0 });
        hits.extend(zeros.by_ref());
        if hits.len() > k {
            hits.select_nth_unstable_by(k - 1, better);
            hits.truncate(k);
        }
        hits.sort_by(better);
        hits
    }
}

/// The best `options.top_k` documents of each query through an inverted index, best
/// first, and the vectors' [`Sparsity`]. `queries` are the queries' non-zero entries;
/// `embed(range)` returns the vocabulary-wide vectors of corpus documents `range` (called
/// once per block of at most `options.corpus_block` and [`SPARSE_BLOCK`], in order).
pub fn search_sparse(
    queries: &SparseRows,
    corpus_len: usize,
    options: SearchOptions,
    mut embed: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<(Vec<Vec<Hit>>, Sparsity)> {
    options.check()?;
    let mut corpus = SparseRows::default();
    let block = options.corpus_block.min(SPARSE_BLOCK);
    for start in (0..corpus_len).step_by(block) {
        let range = start..(start + block).min(corpus_len);
        let rows = SparseRows::from_dense(&embed(range.clone())?)?;
        if rows.len() != range.len() || rows.width != queries.width {
            return Err(Error::InvalidArgument {
                what: "corpus block embeddings",
                value: format!("{} rows of width {}", rows.len(), rows.width),
                reason: "need one row per document, as wide as the query vectors",
            });
        }
        corpus.extend(&rows)?;
    }
    let index = InvertedIndex::build(&corpus)?;
    let k = options.top_k.min(corpus_len);
    let hits = if k == 0 {
        vec![Vec::new(); queries.len()]
    } else {
        (0..queries.len())
            .into_par_iter()
            .map_init(
                || (vec![0f32; corpus_len], Vec::new()),
                |(scores, touched), q| index.top_k(queries.row(q), k, scores, touched),
            )
            .collect()
    };
    Ok((hits, Sparsity::of(queries, &corpus)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rows_keep_the_non_zero_entries_in_order() {
        let dense =
            Tensor::new(&[[0f32, 1.5, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]], &Device::Cpu).unwrap();
        let rows = SparseRows::from_dense(&dense).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows.row(0).collect::<Vec<_>>(), [(1, 1.5), (3, 2.0)]);
        assert_eq!(rows.row(1).count(), 0);
        let s = Sparsity::of(&rows, &rows);
        assert_eq!(s.query_active_dims, 1.0);
        assert_eq!(s.corpus_sparsity_ratio, 0.75);
        // Entries 1 and 3 are active in half the rows each side: 2 x 0.25.
        assert_eq!(s.avg_flops, 0.5);
    }
}
