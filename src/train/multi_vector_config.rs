//! `[model.multi_vector]`: a ColBERT (late interaction) run. Every setting left unset is
//! the pretrained multi-vector model's own (a PyLate or sentence-transformers 6
//! directory), else PyLate's default. `[loss.distillation]`: such a run learning a
//! teacher's scores given in the data.

use crate::hub::multi_vector::{MultiVectorConfig, MultiVectorHead, PUNCTUATION};
use crate::{Error, Result};

use crate::error::invalid;

/// PyLate's defaults: 128-d token vectors, queries of 32 tokens, documents of 180.
pub const DEFAULT_DIM: usize = 128;
/// PyLate's default query length (with expansion, the query vectors' count).
pub const DEFAULT_QUERY_LENGTH: usize = 32;
/// PyLate's default document length.
pub const DEFAULT_DOCUMENT_LENGTH: usize = 180;

/// `[model.multi_vector]`.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiVectorSettings {
    /// The token vectors' width: a projection without bias (PyLate's Dense) from the
    /// hidden size. Unset: the pretrained multi-vector model's, else 128.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dim: Option<usize>,
    /// Query tokens, special tokens and prefix included (with expansion, every query has
    /// this many vectors). Unset: the model's, else 32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_length: Option<usize>,
    /// The most document tokens. Unset: the model's, else 180.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_length: Option<usize>,
    /// Put before every query; one token of the vocabulary (a fresh model's tokenizer
    /// gets it). Unset: the model's, else `[Q] `.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_prefix: Option<String>,
    /// Put before every document. Unset: the model's, else `[D] `.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_prefix: Option<String>,
    /// Pad queries to `query_length` with the mask token, kept and scored. Unset: the
    /// model's, else true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_expansion: Option<bool>,
    /// Whether the other query tokens attend to the expansion tokens. Unset: the
    /// model's, else false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attend_to_expansion_tokens: Option<bool>,
    /// Document tokens left out of the scoring. Unset: the model's, else punctuation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skiplist_words: Option<Vec<String>>,
}

impl MultiVectorSettings {
    /// The run's settings over the pretrained multi-vector model `own` (if it is one).
    pub fn resolve(&self, own: Option<&MultiVectorConfig>) -> MultiVectorHead {
        MultiVectorHead {
            dim: self.dim.or(own.map(|o| o.head.dim)).unwrap_or(DEFAULT_DIM),
            query_length: self
                .query_length
                .or(own.map(|o| o.head.query_length))
                .unwrap_or(DEFAULT_QUERY_LENGTH),
            document_length: self
                .document_length
                .or(own.map(|o| o.head.document_length))
                .unwrap_or(DEFAULT_DOCUMENT_LENGTH),
            query_prefix: self
                .query_prefix
                .clone()
                .or(own.map(|o| o.head.query_prefix.clone()))
                .unwrap_or_else(|| "[Q] ".into()),
            document_prefix: self
                .document_prefix
                .clone()
                .or(own.map(|o| o.head.document_prefix.clone()))
                .unwrap_or_else(|| "[D] ".into()),
            query_expansion: self
                .query_expansion
                .or(own.map(|o| o.head.query_expansion))
                .unwrap_or(true),
            attend_to_expansion_tokens: self
                .attend_to_expansion_tokens
                .or(own.map(|o| o.head.attend_to_expansion_tokens))
                .unwrap_or(false),
            skiplist_words: self
                .skiplist_words
                .clone()
                .or(own.map(|o| o.head.skiplist_words.clone()))
                .unwrap_or_else(|| PUNCTUATION.chars().map(String::from).collect()),
        }
    }

    /// Refuses what does not fit a multi-vector run: a zero width or length, the
    /// single-vector settings of the model and the loss that are set (`(field, set)`),
    /// LoRA and a memory budget (`(lora, budget)`: whether each is set), each by name.
    pub(super) fn validate(
        &self,
        single_model: &[(&'static str, bool)],
        single_loss: &[(&'static str, bool)],
        (lora, budget): (bool, bool),
    ) -> Result<()> {
        for (field, value) in [
            ("model.multi_vector.dim", self.dim),
            ("model.multi_vector.query_length", self.query_length),
            ("model.multi_vector.document_length", self.document_length),
        ] {
            if value == Some(0) {
                return Err(invalid(field, 0, "must be at least 1"));
            }
        }
        if let Some((field, _)) = single_model.iter().find(|(_, set)| *set) {
            return Err(Error::InvalidConfig {
                field,
                value: "set".into(),
                reason: "a single-vector setting on a multi-vector model, which keeps every \
                         token (normalised) instead of pooling: set \
                         model.multi_vector.query_length / document_length / query_prefix / \
                         document_prefix instead",
            });
        }
        if let Some((field, _)) = single_loss.iter().find(|(_, set)| *set) {
            return Err(Error::InvalidConfig {
                field,
                value: "set".into(),
                reason: "a single-vector loss setting on a multi-vector model: its loss is \
                         InfoNCE over MaxSim scores with loss.temperature (PyLate's \
                         Contrastive; 1.0 there)",
            });
        }
        if lora {
            return Err(invalid(
                "model.lora",
                "set",
                "LoRA on a multi-vector model is not supported yet: train it whole",
            ));
        }
        if budget {
            return Err(invalid(
                "train.memory_budget",
                "set",
                "does not plan a multi-vector model's steps yet: set train.query_chunk and \
                 train.passage_chunk",
            ));
        }
        Ok(())
    }
}

/// `[loss.distillation]`: learn a teacher's scores given in the data (a `scores` list
/// beside each pair's positive and hard negatives, as `gradcache mine --output-scores`
/// writes them).
///
/// - A multi-vector model: the KL divergence from the teacher's scores to the model's
///   MaxSim scores of each query's own passages (PyLate's `Distillation`), instead of
///   InfoNCE over the batch.
/// - A single-vector or sparse model: `kind = "kl"` (sentence-transformers'
///   `DistillKLDivLoss`) or `"margin_mse"` (`MarginMSELoss`) on the model's similarity of
///   each query to its own passages, times `weight`, plus `infonce_weight` times InfoNCE
///   over the batch (0: distillation alone).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillationConfig {
    /// `"kl"` or `"margin_mse"` (single-vector and sparse models); unset: `kl`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<DistillKind>,
    /// Multi-vector models: min-max normalise the model's scores of each query's passages
    /// before the softmax (PyLate's `normalize_scores`, on by default).
    pub normalize_scores: bool,
    /// The teacher's scores are divided by this before their softmax: 1 (PyLate's and
    /// sentence-transformers') for a cross-encoder's logits; a bi-encoder teacher's cosine
    /// scores want the temperature it was trained with (0.05 for configs/bible-beir.toml's
    /// model).
    pub teacher_temperature: f64,
    /// `kind = "kl"`: the student's scores are divided by this before their softmax, and
    /// the loss multiplied by its square (sentence-transformers' `temperature`; 1).
    #[serde(skip_serializing_if = "is_one")]
    pub student_temperature: f64,
    /// The distillation term's weight (single-vector and sparse models).
    #[serde(skip_serializing_if = "is_one")]
    pub weight: f64,
    /// The weight of InfoNCE over the batch beside it (single-vector and sparse models; 0:
    /// distillation alone). `loss.temperature` is InfoNCE's.
    #[serde(skip_serializing_if = "is_zero")]
    pub infonce_weight: f64,
}

/// What a single-vector or sparse model's distillation computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillKind {
    /// KL divergence of the softmaxes (`DistillKLDivLoss`).
    Kl,
    /// Squared error of the score margins (`MarginMSELoss`).
    MarginMse,
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for DistillationConfig {
    fn default() -> Self {
        Self {
            kind: None,
            normalize_scores: true,
            teacher_temperature: 1.0,
            student_temperature: 1.0,
            weight: 1.0,
            infonce_weight: 0.0,
        }
    }
}

impl DistillationConfig {
    /// Refuses what distillation cannot train: no hard negatives (a query would have one
    /// passage), a temperature that takes no part (`temperature_set` on a run whose every
    /// source distils, without InfoNCE beside), weights out of range, a multi-vector model
    /// with the single-vector settings.
    pub(super) fn validate(
        &self,
        multi_vector: bool,
        hard_negatives: usize,
        temperature_set: bool,
    ) -> Result<()> {
        if hard_negatives == 0 {
            return Err(invalid(
                "train.hard_negatives",
                0,
                "distillation scores each query against its own passages: set the number of \
                 hard negatives whose teacher scores each pair gives (at least 1)",
            ));
        }
        for (field, t) in [
            (
                "loss.distillation.teacher_temperature",
                self.teacher_temperature,
            ),
            (
                "loss.distillation.student_temperature",
                self.student_temperature,
            ),
            ("loss.distillation.weight", self.weight),
        ] {
            if !(t.is_finite() && t > 0.0) {
                return Err(invalid(field, t, "must be a finite number greater than 0"));
            }
        }
        if !(self.infonce_weight.is_finite() && self.infonce_weight >= 0.0) {
            return Err(invalid(
                "loss.distillation.infonce_weight",
                self.infonce_weight,
                "must be a finite number, 0 (distillation alone) or more",
            ));
        }
        if multi_vector {
            let single = [
                ("loss.distillation.kind", self.kind.is_some()),
                (
                    "loss.distillation.student_temperature",
                    self.student_temperature != 1.0,
                ),
                ("loss.distillation.weight", self.weight != 1.0),
                (
                    "loss.distillation.infonce_weight",
                    self.infonce_weight != 0.0,
                ),
            ];
            if let Some((field, _)) = single.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    field,
                    "set",
                    "a single-vector distillation setting on a multi-vector model, whose \
                     distillation is PyLate's (KL over MaxSim scores, alone): leave it unset",
                ));
            }
        }
        if temperature_set && (multi_vector || self.infonce_weight == 0.0) {
            return Err(invalid(
                "loss.temperature",
                "set",
                "has no part in distillation alone (loss.distillation.teacher_temperature \
                 and student_temperature scale the scores; loss.temperature is InfoNCE's \
                 when loss.distillation.infonce_weight is above 0)",
            ));
        }
        Ok(())
    }
}
