//! Hard-negative mining as sentence-transformers' `mine_hard_negatives` does it: embed the
//! corpus, retrieve each query's best candidates exactly (blocked, see [`search`]), drop the
//! query's positives, keep ranks `range_min..range_max` of what is left, drop candidates
//! scoring above `max_score` or below `min_score`, or too close to the positive (an
//! absolute margin: `score > positive - margin`; a relative one: `score > positive * (1 -
//! margin)`), then take the best `num_negatives` of the rest or a seeded random sample of
//! them. A query left with fewer than `num_negatives` is dropped and counted (as the
//! n-tuple output of sentence-transformers does).

use std::ops::Range;

use candle_core::Tensor;
use rand::seq::IndexedRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::retrieval::search::{search, Hit, Scoring, SearchOptions};
use crate::rng::derive_seed;
use crate::{Error, Result};

/// How candidates are chosen among those that pass the filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    /// The highest-scoring ones.
    #[default]
    Top,
    /// A seeded random sample.
    Random,
}

/// The filters and sampling of [`mine`] (sentence-transformers' names and meanings).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MineOptions {
    /// Negatives per query.
    pub num_negatives: usize,
    /// Skip the `range_min` best candidates (after the positives are removed).
    pub range_min: usize,
    /// Consider only the `range_max` best candidates (after the positives are removed).
    pub range_max: usize,
    /// Drop candidates scoring above this.
    pub max_score: Option<f32>,
    /// Drop candidates scoring below this.
    pub min_score: Option<f32>,
    /// Drop candidates scoring above `positive - absolute_margin`.
    pub absolute_margin: Option<f32>,
    /// Drop candidates scoring above `positive * (1 - relative_margin)`.
    pub relative_margin: Option<f32>,
    /// `top` or `random`.
    pub sampling: Sampling,
    /// Seed of the random sampling.
    pub seed: u64,
    /// Write the model's scores of the positive and of each negative with every row
    /// (sentence-transformers' `output_scores`): teacher scores for distillation.
    pub output_scores: bool,
}

impl Default for MineOptions {
    fn default() -> Self {
        Self {
            num_negatives: 3,
            range_min: 0,
            range_max: 100,
            max_score: None,
            min_score: None,
            absolute_margin: None,
            relative_margin: None,
            sampling: Sampling::Top,
            seed: 42,
            output_scores: false,
        }
    }
}

impl MineOptions {
    /// Checks the values before any encoding.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, reason: &'static str| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.num_negatives == 0 {
            return bad("num_negatives", "0".into(), "must be at least 1");
        }
        if self.range_max <= self.range_min {
            return bad(
                "range_max",
                self.range_max.to_string(),
                "must be greater than range_min",
            );
        }
        if self.range_max - self.range_min < self.num_negatives {
            return bad(
                "range_max",
                self.range_max.to_string(),
                "the rank range range_min..range_max holds fewer candidates than num_negatives",
            );
        }
        for (field, v) in [
            ("max_score", self.max_score),
            ("min_score", self.min_score),
            ("absolute_margin", self.absolute_margin),
            ("relative_margin", self.relative_margin),
        ] {
            if v.is_some_and(|v| !v.is_finite()) {
                return bad(field, format!("{v:?}"), "must be a finite number");
            }
        }
        if let Some(m) = self.relative_margin {
            if !(0.0..1.0).contains(&m) {
                return bad(
                    "relative_margin",
                    m.to_string(),
                    "must be at least 0 and below 1",
                );
            }
        }
        Ok(())
    }
}

/// What [`mine`] found: for each query, its negatives (corpus indices, best first), or
/// `None` when fewer than `num_negatives` passed the filters.
#[derive(Debug, Clone, PartialEq)]
pub struct Mined {
    /// Per query.
    pub negatives: Vec<Option<Vec<usize>>>,
    /// The scores of the negatives, in the same order.
    pub negative_scores: Vec<Option<Vec<f32>>>,
    /// The score of each query with each of its positives (the margins compare with the
    /// first).
    pub positive_scores: Vec<Vec<f32>>,
    /// Candidates dropped by each filter, summed over queries: rank range, max_score,
    /// min_score, margin.
    pub dropped: DroppedCounts,
}

/// How many candidates each filter removed (summed over queries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct DroppedCounts {
    /// Positives among the retrieved candidates.
    pub positives: usize,
    /// Outside `range_min..range_max`.
    pub rank: usize,
    /// Above `max_score`.
    pub max_score: usize,
    /// Below `min_score`.
    pub min_score: usize,
    /// Within the absolute or relative margin of the positive.
    pub margin: usize,
}

/// Mines negatives for `queries` (embeddings `[Q, d]`) whose positives are
/// `positives[i]` (corpus indices, at least one each) over a corpus of `corpus_len`
/// documents embedded by `embed(range)` a block at a time (see [`search`]).
pub fn mine(
    queries: &Tensor,
    positives: &[Vec<usize>],
    corpus_len: usize,
    scoring: impl Into<Scoring>,
    options: &MineOptions,
    corpus_block: usize,
    mut embed: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<Mined> {
    options.validate()?;
    let rows = queries.dim(0)?;
    if positives.len() != rows || positives.iter().any(|p| p.is_empty()) {
        return Err(Error::InvalidArgument {
            what: "positives",
            value: positives.len().to_string(),
            reason: "need at least one positive per query",
        });
    }
    if let Some(&p) = positives.iter().flatten().find(|&&p| p >= corpus_len) {
        return Err(Error::InvalidArgument {
            what: "positive index",
            value: p.to_string(),
            reason: "is beyond the corpus",
        });
    }
    let scoring = scoring.into();
    // Every positive of each query: scored as its block goes by.
    let q = scoring.prepare(queries)?;
    let mut positive_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); corpus_len];
    for (i, p) in positives.iter().enumerate() {
        for (k, &doc) in p.iter().enumerate() {
            positive_of[doc].push((i, k));
        }
    }
    let mut positive_scores: Vec<Vec<f32>> =
        positives.iter().map(|p| vec![f32::NAN; p.len()]).collect();
    let most_positives = positives.iter().map(Vec::len).max().unwrap_or(1);
    let search_options = SearchOptions {
        top_k: options.range_max + most_positives,
        corpus_block,
        ..SearchOptions::default()
    };
    let hits = search(queries, corpus_len, scoring, search_options, |range| {
        let docs = embed(range.clone())?;
        let prepared = scoring.prepare(&docs)?;
        let (mut query_rows, mut doc_rows, mut places) = (Vec::new(), Vec::new(), Vec::new());
        for (j, doc) in range.clone().enumerate() {
            for &(i, k) in &positive_of[doc] {
                query_rows.push(i as u32);
                doc_rows.push(j as u32);
                places.push((i, k));
            }
        }
        if !query_rows.is_empty() {
            let device = prepared.device();
            let pick_q = Tensor::new(query_rows.as_slice(), device)?;
            let pick_d = Tensor::new(doc_rows.as_slice(), device)?;
            let scores = scoring
                .pair_scores(
                    &q.index_select(&pick_q, 0)?,
                    &prepared.index_select(&pick_d, 0)?,
                )?
                .to_vec1::<f32>()?;
            for (&(i, k), s) in places.iter().zip(scores) {
                positive_scores[i][k] = s;
            }
        }
        Ok(docs)
    })?;
    let mut dropped = DroppedCounts::default();
    let mut negatives = Vec::with_capacity(rows);
    let mut negative_scores = Vec::with_capacity(rows);
    for (i, candidates) in hits.into_iter().enumerate() {
        let positive = positive_scores[i][0];
        let mut kept: Vec<Hit> = Vec::new();
        let mut rank = 0;
        for hit in candidates {
            if positives[i].contains(&hit.doc) {
                dropped.positives += 1;
                continue;
            }
            rank += 1;
            if rank <= options.range_min || rank > options.range_max {
                dropped.rank += 1;
                continue;
            }
            if options.max_score.is_some_and(|m| hit.score > m) {
                dropped.max_score += 1;
                continue;
            }
            if options.min_score.is_some_and(|m| hit.score < m) {
                dropped.min_score += 1;
                continue;
            }
            let too_close = options
                .absolute_margin
                .is_some_and(|m| hit.score > positive - m)
                || options
                    .relative_margin
                    .is_some_and(|m| hit.score > positive * (1.0 - m));
            if too_close {
                dropped.margin += 1;
                continue;
            }
            kept.push(hit);
        }
        let n = options.num_negatives;
        let picked: Option<Vec<Hit>> = if kept.len() < n {
            None
        } else {
            Some(match options.sampling {
                Sampling::Top => kept[..n].to_vec(),
                Sampling::Random => {
                    let mut rng =
                        ChaCha8Rng::seed_from_u64(derive_seed(&[options.seed, i as u64, 0x313e]));
                    let mut picked: Vec<Hit> = kept.choose_multiple(&mut rng, n).copied().collect();
                    picked.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.doc.cmp(&b.doc)));
                    picked
                }
            })
        };
        negatives.push(picked.as_ref().map(|p| p.iter().map(|h| h.doc).collect()));
        negative_scores.push(picked.map(|p| p.iter().map(|h| h.score).collect()));
    }
    Ok(Mined {
        negatives,
        negative_scores,
        positive_scores,
        dropped,
    })
}

/// What mining runs over: queries, the corpus they retrieve from, and each query's
/// positives in it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MiningSet {
    /// Distinct query texts.
    pub queries: Vec<String>,
    /// Corpus indices of each query's positives.
    pub positives: Vec<Vec<usize>>,
    /// Distinct corpus texts.
    pub corpus: Vec<String>,
}

/// One mined training example: a query, one of its positives, its negatives.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MinedRow {
    /// The query.
    pub query: String,
    /// A positive.
    pub positive: String,
    /// The mined negatives, best first.
    pub negatives: Vec<String>,
    /// With scores asked for: the model's scores of the positive and of each negative,
    /// in that order (sentence-transformers' `output_scores`; what distillation reads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scores: Option<Vec<f32>>,
}

impl MiningSet {
    /// From `(query, positive)` pairs, as sentence-transformers mines a pair dataset: the
    /// corpus is the distinct positives plus `extra_corpus`; a query's positives are
    /// those of every pair with the same query text.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
        extra_corpus: impl IntoIterator<Item = String>,
    ) -> Self {
        use std::collections::HashMap;
        let mut set = Self::default();
        let mut doc_index: HashMap<String, usize> = HashMap::new();
        let mut query_index: HashMap<String, usize> = HashMap::new();
        let mut add_doc = |set: &mut Self, text: String| -> usize {
            *doc_index.entry(text).or_insert_with_key(|t| {
                set.corpus.push(t.clone());
                set.corpus.len() - 1
            })
        };
        for (query, positive) in pairs {
            let doc = add_doc(&mut set, positive.to_string());
            let q = *query_index.entry(query.to_string()).or_insert_with(|| {
                set.queries.push(query.to_string());
                set.positives.push(Vec::new());
                set.queries.len() - 1
            });
            if !set.positives[q].contains(&doc) {
                set.positives[q].push(doc);
            }
        }
        for text in extra_corpus {
            add_doc(&mut set, text);
        }
        set
    }

    /// From a BEIR split: its queries with at least one relevant document (grade >= 1),
    /// the whole corpus (title and text joined by `title_separator`).
    pub fn from_beir(set: &crate::retrieval::BeirSet, title_separator: &str) -> Self {
        let (queries, positives) = set
            .relevant()
            .into_iter()
            .map(|(q, docs)| (set.queries[q].text.clone(), docs))
            .unzip();
        Self {
            queries,
            positives,
            corpus: set
                .corpus
                .iter()
                .map(|d| d.joined(title_separator))
                .collect(),
        }
    }

    /// The training rows of a mining result: one per query and positive, with the query's
    /// negatives (and, `with_scores`, the scores of the positive and the negatives);
    /// queries left without enough negatives are left out.
    pub fn rows(&self, mined: &Mined, with_scores: bool) -> Vec<MinedRow> {
        let mut rows = Vec::new();
        for (q, negatives) in mined.negatives.iter().enumerate() {
            let Some(negatives) = negatives else { continue };
            for (k, &p) in self.positives[q].iter().enumerate() {
                let scores = with_scores.then(|| {
                    std::iter::once(mined.positive_scores[q][k])
                        .chain(mined.negative_scores[q].iter().flatten().copied())
                        .collect()
                });
                rows.push(MinedRow {
                    query: self.queries[q].clone(),
                    positive: self.corpus[p].clone(),
                    negatives: negatives.iter().map(|&n| self.corpus[n].clone()).collect(),
                    scores,
                });
            }
        }
        rows
    }
}
