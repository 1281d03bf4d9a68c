//! `[[data.sources]]`: training on a mixture of data sets, the way general-purpose
//! embedding models are trained. Each source has its own file (or shards, or a Hub data
//! set), field names, instructions, hard negatives, sampling weight and loss settings;
//! `data.sampling` says how often each source is drawn and `data.batches` whether a step's
//! whole global batch comes from one source (`per_source`, the default with several: its
//! in-batch negatives are of one task) or from all of them shuffled together (`mixed`).
//!
//! `data.train_file` is the one-source shorthand: a run with it trains exactly as before.
//! [`Config::sources`] turns either form into the [`Source`]s a run reads.

use std::path::PathBuf;

use crate::error::invalid;
use crate::loss::LossDirection;
use crate::train::config::Config;
use crate::train::data::Fields;
use crate::{Error, Result};

/// One `[[data.sources]]` table.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The source's name: in `metrics.jsonl`, the log, the summary and the export's
    /// `prompts`.
    #[serde(default)]
    pub name: String,
    /// A file or BEIR folder in any layout `data.train_file` reads; a folder of shards or
    /// a glob (`shards/*.jsonl.gz`), read in name order; or a Hub data set,
    /// `hf://datasets/<owner>/<name>[/<path in the repo>]` (fetched into the hf-hub cache
    /// and read from there; with `HF_HUB_OFFLINE=1` only the cache is read).
    pub path: String,
    /// Field / column names; unset: `data.fields`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<Fields>,
    /// The qrels split of a BEIR folder; unset: `data.train_split`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// Put before this source's queries (its instruction), over `model.query_prompt`; a
    /// row's own `prompt` field wins over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_prompt: Option<String>,
    /// Put before this source's passages, over `model.passage_prompt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passage_prompt: Option<String>,
    /// Hard negatives per query; unset: `train.hard_negatives`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hard_negatives: Option<usize>,
    /// Sampling weight under `data.sampling = "weighted"` (unset: 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// Read this source from disk as batches need it (JSON lines; see `data.stream`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Loss settings of this source's batches.
    #[serde(default, skip_serializing_if = "SourceLoss::is_default")]
    pub loss: SourceLoss,
}

/// The loss settings a source may change (under `data.batches = "per_source"`).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceLoss {
    /// Add the passage-to-query term (paraphrase data); unset: `loss.symmetric`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symmetric: Option<bool>,
    /// The softmax's interactions; unset: `loss.directions`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directions: Option<Vec<LossDirection>>,
    /// `false`: each query against its own positive and hard negatives only (no in-batch
    /// negatives: for classification or clustering sets, where they are false negatives).
    /// Unset: true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_batch: Option<bool>,
    /// Whether `[loss.distillation]` applies to this source (its rows carry teacher
    /// scores); unset: true when the section is set. `false`: InfoNCE alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distill: Option<bool>,
}

impl SourceLoss {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// How often each source is drawn (`data.sampling`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Sampling {
    /// `"proportional"` (by size), `"round_robin"` or `"weighted"` (by `weight`).
    Named(SamplingName),
    /// `{ temperature = T }`: in proportion to size^(1/T) (1: by size; higher flattens
    /// toward uniform, as multilingual mixtures sample).
    Tempered {
        /// The temperature, above 0.
        temperature: f64,
    },
}

/// The named samplings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplingName {
    /// In proportion to each source's number of pairs.
    Proportional,
    /// Each source in turn, in the order written.
    RoundRobin,
    /// In proportion to each source's `weight`.
    Weighted,
}

/// Where a step's batch comes from (`data.batches`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batches {
    /// A step's whole global batch from one source (the default with several).
    PerSource,
    /// The sources' pairs shuffled together (each drawn in proportion to its size).
    Mixed,
}

/// A source as a run reads it: [`SourceConfig`] with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    /// Its name.
    pub name: String,
    /// Where it is: a local path, or `hf://datasets/...` (resolved when read).
    pub path: String,
    /// Field names.
    pub fields: Fields,
    /// BEIR qrels split.
    pub split: String,
    /// Query prompt: the source's, else the model's (`None`: the model's own, resolved
    /// with the tokenizer).
    pub query_prompt: Option<String>,
    /// Passage prompt, as `query_prompt`.
    pub passage_prompt: Option<String>,
    /// Hard negatives per query.
    pub hard_negatives: usize,
    /// Sampling weight.
    pub weight: f64,
    /// Streamed from disk.
    pub stream: bool,
    /// Symmetric term.
    pub symmetric: bool,
    /// The softmax's interactions.
    pub directions: Vec<LossDirection>,
    /// In-batch negatives.
    pub in_batch: bool,
    /// Distilled from its rows' teacher scores.
    pub distill: bool,
}

impl Source {
    /// The local path of a source that is not on the Hub.
    pub fn local_path(&self) -> PathBuf {
        PathBuf::from(&self.path)
    }

    /// Whether its loss differs from the run's `[loss]` (the trainer then builds one loss
    /// per source).
    pub fn loss_differs(&self, cfg: &Config) -> bool {
        self.symmetric != cfg.loss.symmetric
            || self.directions != cfg.loss.directions
            || !self.in_batch
            || self.distill != cfg.loss.distillation.is_some()
    }
}

impl Config {
    /// The run's sources: `[[data.sources]]`, or the one `data.train_file` names (named by
    /// its file name).
    pub fn sources(&self) -> Vec<Source> {
        let d = &self.data;
        // A reranker's loss over its rows' scores reads them as distillation does.
        let reranker_scores = self.model.reranker.is_some()
            && self
                .loss
                .reranker
                .as_ref()
                .is_some_and(|r| r.reads_scores());
        let distill = self.loss.distillation.is_some() || reranker_scores;
        if let Some(file) = &d.train_file {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "train".into());
            return vec![Source {
                name,
                path: file.to_string_lossy().into_owned(),
                fields: d.fields.clone(),
                split: d.train_split.clone(),
                query_prompt: None,
                passage_prompt: None,
                hard_negatives: self.train.hard_negatives,
                weight: 1.0,
                stream: d.stream,
                symmetric: self.loss.symmetric,
                directions: self.loss.directions.clone(),
                in_batch: true,
                distill,
            }];
        }
        d.sources
            .iter()
            .map(|s| Source {
                name: s.name.clone(),
                path: s.path.clone(),
                fields: s.fields.clone().unwrap_or_else(|| d.fields.clone()),
                split: s.split.clone().unwrap_or_else(|| d.train_split.clone()),
                query_prompt: s.query_prompt.clone(),
                passage_prompt: s.passage_prompt.clone(),
                hard_negatives: s.hard_negatives.unwrap_or(self.train.hard_negatives),
                weight: s.weight.unwrap_or(1.0),
                stream: s.stream || d.stream,
                symmetric: s.loss.symmetric.unwrap_or(self.loss.symmetric),
                directions: s
                    .loss
                    .directions
                    .clone()
                    .unwrap_or_else(|| self.loss.directions.clone()),
                in_batch: s.loss.in_batch.unwrap_or(true),
                distill: distill && s.loss.distill.unwrap_or(true),
            })
            .collect()
    }

    /// Where a step's batches come from: per source with several sources, unless
    /// `data.batches` says otherwise.
    pub fn batches(&self) -> Batches {
        self.data.batches.unwrap_or(Batches::PerSource)
    }

    /// The hard negatives of the run's widest source (what a step's memory plan assumes).
    pub fn widest_hard_negatives(&self) -> usize {
        self.sources()
            .iter()
            .map(|s| s.hard_negatives)
            .max()
            .unwrap_or(self.train.hard_negatives)
    }

    /// Checks `[[data.sources]]`, `data.sampling` and `data.batches` (what can be checked
    /// before any file is read).
    pub(super) fn validate_sources(&self) -> Result<()> {
        let d = &self.data;
        match (&d.train_file, d.sources.is_empty()) {
            (Some(_), false) => {
                return Err(invalid(
                    "data.train_file",
                    "set",
                    "is the one-source shorthand of [[data.sources]]: set one of the two",
                ))
            }
            (None, true) => {
                return Err(invalid(
                    "data.train_file",
                    "unset",
                    "name the training data: data.train_file, or [[data.sources]] tables",
                ))
            }
            _ => {}
        }
        let mut seen: Vec<&str> = Vec::new();
        for (i, s) in d.sources.iter().enumerate() {
            let which = |what: &str| format!("{what} (source {} of [[data.sources]])", i + 1);
            if s.name.trim().is_empty() {
                return Err(invalid(
                    "data.sources.name",
                    which("unset"),
                    "every source needs a name (it names the source in the metrics, the log \
                     and the export's prompts)",
                ));
            }
            if seen.contains(&s.name.as_str()) {
                return Err(invalid(
                    "data.sources.name",
                    which(&format!("{:?}", s.name)),
                    "names two sources: each source's name must be its own",
                ));
            }
            seen.push(&s.name);
            if s.path.trim().is_empty() {
                return Err(invalid(
                    "data.sources.path",
                    format!("\"\" (source {:?})", s.name),
                    "names no file",
                ));
            }
            if let Some(w) = s.weight {
                if !(w.is_finite() && w > 0.0) {
                    return Err(invalid(
                        "data.sources.weight",
                        format!("{w} (source {:?})", s.name),
                        "must be a finite number greater than 0",
                    ));
                }
            }
        }
        if let Some(Sampling::Tempered { temperature }) = d.sampling {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(invalid(
                    "data.sampling.temperature",
                    temperature,
                    "must be a finite number greater than 0",
                ));
            }
        }
        let sources = self.sources();
        for s in &sources {
            if !s.in_batch {
                if s.hard_negatives == 0 {
                    return Err(invalid(
                        "data.sources.loss.in_batch",
                        format!("false (source {:?})", s.name),
                        "scores each query against its own positive and hard negatives only: \
                         with no hard negatives there is nothing to rank (set the source's \
                         hard_negatives)",
                    ));
                }
                if s.symmetric || s.directions != [LossDirection::QueryToDoc] {
                    return Err(invalid(
                        "data.sources.loss.in_batch",
                        format!("false (source {:?})", s.name),
                        "has no other queries or passages to score: leave symmetric and \
                         directions unset for this source",
                    ));
                }
            }
            if s.distill && s.hard_negatives == 0 {
                return Err(invalid(
                    "data.sources.hard_negatives",
                    format!("0 (source {:?})", s.name),
                    "distillation scores each query against its own passages: give the source \
                     hard negatives with teacher scores, or set its loss.distill = false",
                ));
            }
            crate::loss::InfoNce::new(1.0)?.with_directions(&s.directions)?;
            if self.model.multi_vector.is_some()
                && (!s.in_batch || s.symmetric || s.directions != self.loss.directions)
            {
                return Err(invalid(
                    "data.sources.loss",
                    format!("set (source {:?})", s.name),
                    "a multi-vector model's loss is InfoNCE over MaxSim scores (or its \
                     distillation): symmetric, directions and in_batch do not apply",
                ));
            }
        }
        if d.batches == Some(Batches::Mixed) && sources.len() > 1 {
            let first = &sources[0];
            for s in &sources[1..] {
                if s.hard_negatives != first.hard_negatives {
                    return Err(mixed("hard_negatives", s));
                }
                if s.passage_prompt != first.passage_prompt {
                    return Err(mixed("passage_prompt", s));
                }
                if s.symmetric != first.symmetric
                    || s.directions != first.directions
                    || s.in_batch != first.in_batch
                    || s.distill != first.distill
                {
                    return Err(mixed("loss", s));
                }
            }
            if d.sampling
                .is_some_and(|s| s != Sampling::Named(SamplingName::Proportional))
            {
                return Err(invalid(
                    "data.sampling",
                    "set",
                    "with data.batches = \"mixed\" the sources' pairs are shuffled together, \
                     each drawn in proportion to its size: leave data.sampling unset, or draw \
                     batches per source",
                ));
            }
        }
        if !d.sources.is_empty() && d.eval_file.is_none() && d.evals.is_empty() {
            return Err(invalid(
                "data.eval_file",
                "unset",
                "a mixture holds no pairs out of its sources: set data.eval_file or \
                 [[data.evals]]",
            ));
        }
        Ok(())
    }
}

fn mixed(key: &str, s: &Source) -> Error {
    Error::InvalidConfig {
        field: "data.batches",
        value: format!("\"mixed\" (source {:?} sets its own {key})", s.name),
        reason: "mixes every source into each batch, so the sources must share hard \
                 negatives, passage prompt and loss settings: draw batches per source \
                 (data.batches = \"per_source\") to give each its own",
    }
}

/// The source of step `step`: a pure function of the seed, the step and the sources'
/// sizes and weights, so every rank draws the same source and a resume continues the
/// sequence exactly.
#[derive(Debug, Clone, PartialEq)]
pub enum SourcePicker {
    /// Each source in turn.
    RoundRobin(usize),
    /// Drawn by a seeded generator from these cumulative probabilities.
    Drawn {
        /// The run's seed.
        seed: u64,
        /// Cumulative probabilities (the last is 1).
        cumulative: Vec<f64>,
    },
}

impl SourcePicker {
    /// The picker of `sampling` over sources of `sizes` pairs and `weights`.
    pub fn new(sampling: Option<Sampling>, sizes: &[usize], weights: &[f64], seed: u64) -> Self {
        let raw: Vec<f64> = match sampling {
            Some(Sampling::Named(SamplingName::RoundRobin)) => {
                return SourcePicker::RoundRobin(sizes.len())
            }
            Some(Sampling::Named(SamplingName::Weighted)) => weights.to_vec(),
            Some(Sampling::Named(SamplingName::Proportional)) | None => {
                sizes.iter().map(|&n| n as f64).collect()
            }
            Some(Sampling::Tempered { temperature }) => sizes
                .iter()
                .map(|&n| (n as f64).powf(1.0 / temperature))
                .collect(),
        };
        let total: f64 = raw.iter().sum();
        let mut acc = 0.0;
        let mut cumulative: Vec<f64> = raw
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        if let Some(last) = cumulative.last_mut() {
            *last = 1.0;
        }
        SourcePicker::Drawn { seed, cumulative }
    }

    /// The probability of each source (round robin: equal shares).
    pub fn probabilities(&self) -> Vec<f64> {
        match self {
            SourcePicker::RoundRobin(n) => vec![1.0 / *n as f64; *n],
            SourcePicker::Drawn { cumulative, .. } => {
                let mut prev = 0.0;
                cumulative
                    .iter()
                    .map(|&c| {
                        let p = c - prev;
                        prev = c;
                        p
                    })
                    .collect()
            }
        }
    }

    /// The source of step `step` (0-based).
    pub fn pick(&self, step: u64) -> usize {
        match self {
            SourcePicker::RoundRobin(n) => (step % *n as u64) as usize,
            SourcePicker::Drawn { seed, cumulative } => {
                // 53 random bits of a hash of (seed, step): a uniform draw in [0, 1).
                let bits = crate::rng::derive_seed(&[*seed, step, 0x50_52_43]);
                let u = (bits >> 11) as f64 / (1u64 << 53) as f64;
                cumulative
                    .iter()
                    .position(|&c| u < c)
                    .unwrap_or(cumulative.len() - 1)
            }
        }
    }
}
