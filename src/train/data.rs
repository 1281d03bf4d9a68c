//! Training data: query/positive pairs with optional hard negatives, seeded shuffling, a
//! held-out split, and batches that can be resumed at an exact position.
//!
//! Pairs are read by [`crate::train::formats`] (`read_jsonl`, `read_pairs`: JSONL,
//! Tevatron, TSV/CSV, Parquet, BEIR folders) or served from disk by
//! [`crate::train::stream`]; the field names are configurable ([`Fields`]). When a pair
//! has fewer hard negatives than a step asks for,
//! the missing ones are filled with positives of other pairs drawn by a seeded generator
//! (never the pair's own positive); [`TextBatch::filled`] counts them so the trainer can log it.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::rng::derive_seed;
use crate::{Error, Result};

/// One training example.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Pair {
    /// The query (anchor).
    pub query: String,
    /// Its relevant passage.
    pub positive: String,
    /// Hard negatives (may be empty).
    #[serde(default)]
    pub negatives: Vec<String>,
    /// A teacher's scores of the positive and of each hard negative, in that order (what
    /// distillation learns from; empty when the data has none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scores: Vec<f32>,
    /// The row's own instruction, put before its query instead of its source's prompt
    /// (BGE's `prompt` per row); `None`: the source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
}

impl Pair {
    /// The teacher's scores of the positive and the first `k` hard negatives (what
    /// distillation learns from), or why this pair cannot give them.
    pub fn teacher_scores(&self, k: usize) -> std::result::Result<&[f32], String> {
        let passages = 1 + self.negatives.len();
        if self.scores.len() != passages {
            return Err(format!(
                "has {} teacher scores for {passages} passages (its positive and {} hard \
                 negatives): distillation needs one score per passage, the positive's first",
                self.scores.len(),
                self.negatives.len()
            ));
        }
        if self.negatives.len() < k {
            return Err(format!(
                "has {} hard negatives where train.hard_negatives is {k}: distillation cannot \
                 fill the missing ones (a filled passage has no teacher score)",
                self.negatives.len()
            ));
        }
        if let Some(bad) = self.scores.iter().find(|s| !s.is_finite()) {
            return Err(format!(
                "has a teacher score that is not a finite number ({bad})"
            ));
        }
        Ok(&self.scores[..=k])
    }
}

/// The JSON field names of a pair.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fields {
    /// Field holding the query (default `query`).
    pub query: String,
    /// Field holding the positive passage (default `positive`).
    pub positive: String,
    /// Field holding a list of hard negatives (default `negatives`; optional in the data).
    pub negatives: String,
    /// Field holding a teacher's scores of the positive and each hard negative (default
    /// `scores`; what distillation reads, optional otherwise).
    #[serde(skip_serializing_if = "Fields::is_default_scores")]
    pub scores: String,
    /// Field holding a row's own instruction for its query (default `prompt`, BGE's
    /// layout; optional in the data).
    #[serde(skip_serializing_if = "Fields::is_default_prompt")]
    pub prompt: String,
}

impl Fields {
    fn is_default_scores(name: &str) -> bool {
        name == "scores"
    }

    fn is_default_prompt(name: &str) -> bool {
        name == "prompt"
    }
}

impl Default for Fields {
    fn default() -> Self {
        Self {
            query: "query".into(),
            positive: "positive".into(),
            negatives: "negatives".into(),
            scores: "scores".into(),
            prompt: "prompt".into(),
        }
    }
}

/// Splits off `held_out` pairs (chosen by a seeded shuffle) for evaluation; the rest keep
/// their order. Any item type splits the same way (e.g. pairs with their line numbers).
pub fn split<T>(pairs: Vec<T>, held_out: usize, seed: u64) -> Result<(Vec<T>, Vec<T>)> {
    if held_out >= pairs.len() {
        return Err(Error::InvalidConfig {
            field: "data.eval_pairs",
            value: held_out.to_string(),
            reason: "must be smaller than the number of pairs",
        });
    }
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[seed, 0x5917])));
    let mut eval_ids: Vec<usize> = order[..held_out].to_vec();
    eval_ids.sort_unstable();
    let mut train = Vec::with_capacity(pairs.len() - held_out);
    let mut eval = Vec::with_capacity(held_out);
    let mut next = eval_ids.iter().peekable();
    for (i, p) in pairs.into_iter().enumerate() {
        if next.peek() == Some(&&i) {
            next.next();
            eval.push(p);
        } else {
            train.push(p);
        }
    }
    Ok((train, eval))
}

/// Training pairs by index: in memory (`Vec<Pair>`) or read from disk when served.
pub trait PairSource {
    /// Number of pairs.
    fn len(&self) -> usize;

    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pair `i` (`i < len()`).
    fn pair(&self, i: usize) -> Result<Pair>;

    /// Where pair `i` is in its file, 1-based: its line (JSONL, TSV/CSV), row (Parquet)
    /// or place among the pairs read; by default `i + 1`.
    fn origin(&self, i: usize) -> usize {
        i + 1
    }
}

impl PairSource for Vec<Pair> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn pair(&self, i: usize) -> Result<Pair> {
        Ok(self[i].clone())
    }
}

/// Pairs in memory with where each was read from ([`PairSource::origin`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NumberedPairs {
    /// The pairs.
    pub pairs: Vec<Pair>,
    /// The 1-based line (or row) of each pair in its file.
    pub lines: Vec<usize>,
}

impl PairSource for NumberedPairs {
    fn len(&self) -> usize {
        self.pairs.len()
    }

    fn pair(&self, i: usize) -> Result<Pair> {
        Ok(self.pairs[i].clone())
    }

    fn origin(&self, i: usize) -> usize {
        self.lines.get(i).copied().unwrap_or(i + 1)
    }
}

/// Where a loader is: the epoch and the number of pairs of that epoch already served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Epoch (each epoch has its own seeded order).
    pub epoch: u64,
    /// Pairs of this epoch already served.
    pub offset: usize,
}

/// One training batch: `queries[i]` with passages `passages[i*(k+1) .. (i+1)*(k+1)]`, the
/// first of which is its positive.
#[derive(Debug, Clone, PartialEq)]
pub struct TextBatch {
    /// Query texts.
    pub queries: Vec<String>,
    /// Passage texts, `k + 1` per query.
    pub passages: Vec<String>,
    /// With distillation, the teacher's score of each passage (`k + 1` per query); else
    /// empty.
    pub scores: Vec<f32>,
    /// Hard negatives that were missing and filled from other pairs' positives.
    pub filled: usize,
    /// Where each query's pair is in the training file ([`PairSource::origin`]: its
    /// 1-based line or row), in batch order.
    pub lines: Vec<usize>,
    /// Each query's own instruction ([`Pair::prompt`]), in batch order: put before it
    /// instead of its source's query prompt.
    pub prompts: Vec<Option<String>>,
    /// The source the batch was drawn from (its index among the run's sources).
    pub source: usize,
}

/// Serves fixed-size batches in a seeded order per epoch; a last incomplete batch of an
/// epoch is dropped (every step sees the same batch size).
pub struct Loader {
    pairs: Box<dyn PairSource>,
    batch_size: usize,
    hard_negatives: usize,
    seed: u64,
    position: Position,
    order: Vec<usize>,
    no_duplicates: bool,
    /// With distillation: the training file (named by errors); every pair gives its
    /// teacher's scores and no negative is filled.
    teacher_scores: Option<std::path::PathBuf>,
}

impl Loader {
    /// A loader over `pairs`, starting at the beginning of epoch 0.
    pub fn new(
        pairs: Vec<Pair>,
        batch_size: usize,
        hard_negatives: usize,
        seed: u64,
    ) -> Result<Self> {
        Self::from_source(Box::new(pairs), batch_size, hard_negatives, seed)
    }

    /// A loader over any [`PairSource`] (e.g. a [`crate::train::stream::JsonlIndex`]
    /// that reads each pair from disk when it is served): the same batches as over the
    /// same pairs in memory.
    pub fn from_source(
        pairs: Box<dyn PairSource>,
        batch_size: usize,
        hard_negatives: usize,
        seed: u64,
    ) -> Result<Self> {
        if batch_size == 0 || batch_size > pairs.len() {
            return Err(Error::InvalidConfig {
                field: "train.batch_size",
                value: batch_size.to_string(),
                reason: "must be between 1 and the number of training pairs",
            });
        }
        if hard_negatives > 0 && pairs.len() < 2 {
            return Err(Error::InvalidConfig {
                field: "train.hard_negatives",
                value: hard_negatives.to_string(),
                reason: "filling missing negatives needs at least two pairs",
            });
        }
        let mut loader = Self {
            pairs,
            batch_size,
            hard_negatives,
            seed,
            position: Position::default(),
            order: Vec::new(),
            no_duplicates: false,
            teacher_scores: None,
        };
        loader.seek(Position::default())?;
        Ok(loader)
    }

    /// Batches with no text twice (sentence-transformers' no-duplicates batch sampler): a
    /// pair whose query, positive or a hard negative is already in the batch being filled
    /// waits for the next batch; an epoch ends when no full batch can be formed. A
    /// repeated text in a batch is a false negative for the other pair that holds it.
    /// The arrangement is a pure function of the seed and the epoch, so resume stays exact.
    pub fn with_no_duplicates(mut self, no_duplicates: bool) -> Result<Self> {
        self.no_duplicates = no_duplicates;
        self.seek(Position::default())?;
        self.check_full_batch()?;
        Ok(self)
    }

    /// Batches carry each pair's teacher scores ([`Pair::teacher_scores`], for
    /// distillation), read from `file`: a pair without them, or with fewer hard negatives
    /// than a batch takes, is an error naming its line of `file` when it is served.
    pub fn with_teacher_scores(mut self, file: &std::path::Path) -> Self {
        self.teacher_scores = Some(file.to_path_buf());
        self
    }

    /// An epoch must hold at least one batch.
    fn check_full_batch(&self) -> Result<()> {
        if self.order.len() < self.batch_size {
            return Err(Error::InvalidConfig {
                field: "train.no_duplicates",
                value: "true".into(),
                reason: "the training pairs repeat texts so much that no batch of \
                         train.batch_size pairs without a repeated text can be formed; \
                         lower the batch size or turn no_duplicates off",
            });
        }
        Ok(())
    }

    /// Batches per epoch (of the current epoch, with [`Loader::with_no_duplicates`]).
    pub fn batches_per_epoch(&self) -> usize {
        self.order.len() / self.batch_size
    }

    /// The current position (what a checkpoint stores).
    pub fn position(&self) -> Position {
        self.position
    }

    /// Jumps to a position (what a resume does).
    pub fn seek(&mut self, position: Position) -> Result<()> {
        let mut order: Vec<usize> = (0..self.pairs.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[
            self.seed,
            position.epoch,
        ])));
        if self.no_duplicates {
            order = self.without_duplicates(order)?;
        }
        if position.offset > order.len() {
            return Err(Error::InvalidArgument {
                what: "data position",
                value: position.offset.to_string(),
                reason: "is beyond the training data; was the data file changed?",
            });
        }
        self.order = order;
        self.position = position;
        Ok(())
    }

    /// `order` rearranged into consecutive batches without a repeated text (pairs that
    /// cannot complete a batch are left out of the epoch).
    fn without_duplicates(&self, order: Vec<usize>) -> Result<Vec<usize>> {
        use std::collections::{HashSet, VecDeque};
        let texts = |i: usize| -> Result<Vec<u64>> {
            let p = self.pairs.pair(i)?;
            Ok([&p.query, &p.positive]
                .into_iter()
                .chain(p.negatives.iter().take(self.hard_negatives))
                .map(|t| crate::rng::hash_str(t))
                .collect())
        };
        let mut pending: VecDeque<usize> = order.into();
        let mut arranged = Vec::with_capacity(pending.len());
        while pending.len() >= self.batch_size {
            let mut seen = HashSet::new();
            let mut batch = Vec::with_capacity(self.batch_size);
            let mut deferred = Vec::new();
            while batch.len() < self.batch_size {
                let Some(i) = pending.pop_front() else { break };
                let own = texts(i)?;
                if own.iter().any(|h| seen.contains(h)) {
                    deferred.push(i);
                } else {
                    seen.extend(own);
                    batch.push(i);
                }
            }
            if batch.len() < self.batch_size {
                break;
            }
            arranged.extend(batch);
            // The pairs that waited go first into the next batch.
            for i in deferred.into_iter().rev() {
                pending.push_front(i);
            }
        }
        Ok(arranged)
    }

    /// Moves on by `batches` batches as [`Loader::next_batch`] would serve them, without
    /// reading them (what a mixture's resume does for each source).
    pub fn skip_batches(&mut self, mut batches: u64) -> Result<()> {
        while batches > 0 {
            let left =
                (self.order.len().saturating_sub(self.position.offset) / self.batch_size) as u64;
            if left == 0 {
                self.seek(Position {
                    epoch: self.position.epoch + 1,
                    offset: 0,
                })?;
                self.check_full_batch()?;
                continue;
            }
            let take = left.min(batches);
            self.position.offset += take as usize * self.batch_size;
            batches -= take;
        }
        Ok(())
    }

    /// The next batch, moving to the next epoch when this one has no full batch left.
    pub fn next_batch(&mut self) -> Result<TextBatch> {
        if self.position.offset + self.batch_size > self.order.len() {
            self.seek(Position {
                epoch: self.position.epoch + 1,
                offset: 0,
            })?;
            self.check_full_batch()?;
        }
        let Position { epoch, offset } = self.position;
        let ids = &self.order[offset..offset + self.batch_size];
        let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(&[self.seed, epoch, offset as u64, 7]));
        let mut batch = TextBatch {
            queries: Vec::with_capacity(ids.len()),
            passages: Vec::with_capacity(ids.len() * (self.hard_negatives + 1)),
            scores: Vec::new(),
            filled: 0,
            lines: ids.iter().map(|&i| self.pairs.origin(i)).collect(),
            prompts: Vec::with_capacity(ids.len()),
            source: 0,
        };
        for &i in ids {
            let pair = self.pairs.pair(i)?;
            if let Some(file) = &self.teacher_scores {
                let scores = pair
                    .teacher_scores(self.hard_negatives)
                    .map_err(|reason| Error::data(file, self.pairs.origin(i), reason))?;
                batch.scores.extend_from_slice(scores);
            }
            batch.queries.push(pair.query);
            batch.prompts.push(pair.prompt);
            batch.passages.push(pair.positive);
            for j in 0..self.hard_negatives {
                match pair.negatives.get(j) {
                    Some(n) => batch.passages.push(n.clone()),
                    None => {
                        let mut other = rng.random_range(0..self.pairs.len() - 1);
                        if other >= i {
                            other += 1;
                        }
                        batch.passages.push(self.pairs.pair(other)?.positive);
                        batch.filled += 1;
                    }
                }
            }
        }
        self.position.offset += self.batch_size;
        Ok(batch)
    }
}
