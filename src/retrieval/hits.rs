//! What a search returns and how it is asked: a retrieved document with its score, the
//! ranking order every search path shares, and the depth and blocks of a search.

use std::cmp::Ordering;

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
pub(super) fn better(a: &Hit, b: &Hit) -> Ordering {
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

impl SearchOptions {
    /// Refuses a depth or block of 0.
    pub(super) fn check(&self) -> Result<()> {
        if self.top_k == 0 || self.corpus_block == 0 || self.query_block == 0 {
            return Err(Error::InvalidArgument {
                what: "search option",
                value: format!("{self:?}"),
                reason: "top_k, corpus_block and query_block must be at least 1",
            });
        }
        Ok(())
    }
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
