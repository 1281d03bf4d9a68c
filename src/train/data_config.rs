//! `[data]`: where a run's training and evaluation data are and how they are read (one
//! file, or a mixture of [`crate::train::sources`]; one evaluation set, or several by name).

use std::path::PathBuf;

use crate::error::invalid;
use crate::train::config::Config;
use crate::train::data::Fields;
use crate::train::sources::{Batches, Sampling, SourceConfig};
use crate::Result;

/// Data files.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Training pairs: JSONL (ours or Tevatron's), TSV/CSV with named columns, Parquet or
    /// a BEIR folder (its `train_split`); files may be gzip or zstd (see
    /// [`crate::train::formats`]). The one-source shorthand of `sources`: set one of the
    /// two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_file: Option<PathBuf>,
    /// `[[data.sources]]`: a mixture of training sets, each with its own settings (see
    /// [`crate::train::sources`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceConfig>,
    /// How often each source is drawn: `"proportional"` (by size, the default),
    /// `"round_robin"`, `"weighted"` (by each source's `weight`) or `{ temperature = T }`
    /// (size^(1/T)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<Sampling>,
    /// `"per_source"` (a step's global batch from one source; the default) or `"mixed"`
    /// (the sources' pairs shuffled together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<Batches>,
    /// `[[data.evals]]`: evaluation sets reported by name, with their mean nDCG@10 (in
    /// place of `eval_file`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evals: Vec<EvalSet>,
    /// Evaluation data: pairs in any layout of `train_file` (each query against all
    /// held-out positives), or a BEIR folder (its `eval_split`: each judged query against
    /// the whole corpus, exact top-k). When absent, `eval_pairs` pairs are held out of the
    /// training file instead.
    #[serde(default)]
    pub eval_file: Option<PathBuf>,
    /// Pairs held out of `train_file` for evaluation when there is no `eval_file`.
    #[serde(default)]
    pub eval_pairs: usize,
    /// JSON field / column names.
    #[serde(default)]
    pub fields: Fields,
    /// The qrels split a BEIR `train_file` trains on.
    #[serde(
        default = "default_train_split",
        skip_serializing_if = "is_train_split"
    )]
    pub train_split: String,
    /// The qrels split a BEIR `eval_file` evaluates on.
    #[serde(default = "default_eval_split", skip_serializing_if = "is_eval_split")]
    pub eval_split: String,
    /// A reranker run: the first stage's TREC run over `eval_file` (a BEIR folder) whose
    /// top `eval_top_k` documents per query are reranked at each evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_run_file: Option<PathBuf>,
    /// A reranker run: the first stage's documents reranked per query. Unset: 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_top_k: Option<usize>,
    /// Read the training pairs from disk as batches need them (an index of line offsets
    /// in memory, not the texts), for files larger than memory: uncompressed JSON lines
    /// only, with an `eval_file`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Joins a passage's title and text (BEIR and Tevatron passages).
    #[serde(
        default = "default_title_separator",
        skip_serializing_if = "is_title_separator"
    )]
    pub title_separator: String,
}

/// One `[[data.evals]]` table: an evaluation set reported under its name.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSet {
    /// Its name in the log and `metrics.jsonl`.
    #[serde(default)]
    pub name: String,
    /// Pairs in any layout of `data.train_file`, or a BEIR folder.
    pub path: PathBuf,
    /// The qrels split of a BEIR folder; unset: `data.eval_split`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// Put before its queries (a source's instruction); unset: the model's query prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_prompt: Option<String>,
}

fn default_train_split() -> String {
    "train".into()
}

fn is_train_split(s: &str) -> bool {
    s == "train"
}

fn default_eval_split() -> String {
    "test".into()
}

fn is_eval_split(s: &str) -> bool {
    s == "test"
}

fn default_title_separator() -> String {
    " ".into()
}

fn is_title_separator(s: &str) -> bool {
    s == " "
}

impl Config {
    /// Checks `[[data.evals]]` and `train.best_by`.
    pub(super) fn validate_evals(&self) -> Result<()> {
        let d = &self.data;
        if d.eval_file.is_none() && d.evals.is_empty() && d.eval_pairs == 0 {
            return Err(invalid(
                "data.eval_pairs",
                0,
                "set data.eval_file or [[data.evals]], or hold out at least one pair",
            ));
        }
        if d.eval_file.is_some() && !d.evals.is_empty() {
            return Err(invalid(
                "data.eval_file",
                "set",
                "[[data.evals]] name every evaluation set: put this file among them",
            ));
        }
        let mut seen: Vec<&str> = Vec::new();
        for (i, e) in d.evals.iter().enumerate() {
            if e.name.trim().is_empty() || e.name == "mean" {
                return Err(invalid(
                    "data.evals.name",
                    format!("{:?} (set {} of [[data.evals]])", e.name, i + 1),
                    "every evaluation set needs a name of its own (`mean` is their mean)",
                ));
            }
            if seen.contains(&e.name.as_str()) {
                return Err(invalid(
                    "data.evals.name",
                    format!("{:?} (set {} of [[data.evals]])", e.name, i + 1),
                    "names two evaluation sets: each name must be its own",
                ));
            }
            seen.push(&e.name);
        }
        if let Some(by) = &self.train.best_by {
            if by != "mean" && !seen.contains(&by.as_str()) {
                return Err(invalid(
                    "train.best_by",
                    format!("{by:?}"),
                    "names no [[data.evals]] set: give one of their names, or \"mean\"",
                ));
            }
        }
        Ok(())
    }
}
