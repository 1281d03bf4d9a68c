//! The settings of a reranker (cross-encoder) run: `[model.reranker]` makes the run train
//! one, `[loss.reranker]` picks its loss (sentence-transformers' cross-encoder losses, with
//! their defaults).

use crate::rerank::loss::{RerankLoss, RerankObjective};
use crate::rerank::ScoreActivation;
use crate::{Error, Result};

/// `[model.reranker]`: train a cross-encoder (the pair read as one text, the family's
/// classification head's one output its score).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RerankerModel {
    /// A pretrained encoder without a classification head gets a fresh one from the seed
    /// (else such a model is refused by name).
    pub new_head: bool,
    /// An instruction every pair is read with (sentence-transformers' `prompt`): a
    /// `system` message for a model with a chat template (Qwen3-Reranker's `<Instruct>`),
    /// else put before the query. The export makes it the model's default prompt.
    pub instruction: Option<String>,
}

/// Which cross-encoder loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RerankLossKind {
    /// `MultipleNegativesRankingLoss` (cached): the positive against the row's hard
    /// negatives and `num_negatives` other rows' documents.
    #[default]
    MultipleNegatives,
    /// `BinaryCrossEntropyLoss`: the positive labelled 1, the negatives 0 (or the rows'
    /// `scores` as labels, with `labels_from_scores`).
    Bce,
    /// `ListNetLoss` over each row's documents, graded by the rows' `scores`.
    Listnet,
    /// `LambdaLoss` (NDCG-Loss2++) over each row's documents, graded by the rows' `scores`.
    Lambda,
    /// `MarginMSELoss` against the rows' teacher `scores`.
    MarginMse,
    /// KL divergence from the softmax of the rows' teacher `scores`.
    Kl,
}

/// `[loss.reranker]`: the loss of a reranker run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RerankerLoss {
    /// `multiple_negatives`, `bce`, `listnet`, `lambda`, `margin_mse` or `kl`.
    pub kind: RerankLossKind,
    /// Other rows' documents drawn as extra negatives of each query
    /// (`multiple_negatives` only; theirs: 4), a pure function of the seed and the step.
    pub num_negatives: usize,
    /// The logits' factor of `multiple_negatives` (theirs: 10).
    pub scale: f64,
    /// `sigmoid`, `identity` or `tanh` before the loss (unset: the loss's default:
    /// sigmoid for `multiple_negatives`, identity for the others).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation: Option<String>,
    /// `lambda`: the weight of NDCG-Loss2 beside LambdaRank (theirs: 10).
    pub mu: f64,
    /// `lambda`: the pairwise logistic's slope (theirs: 1).
    pub sigma: f64,
    /// `lambda`: only pairs with a document in the top `k` (unset: all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k: Option<usize>,
    /// `kl`: the student's temperature.
    pub student_temperature: f64,
    /// `kl`: the teacher's temperature.
    pub teacher_temperature: f64,
}

impl Default for RerankerLoss {
    fn default() -> Self {
        Self {
            kind: RerankLossKind::MultipleNegatives,
            num_negatives: 4,
            scale: 10.0,
            activation: None,
            mu: 10.0,
            sigma: 1.0,
            k: None,
            student_temperature: 1.0,
            teacher_temperature: 1.0,
        }
    }
}

impl RerankerLoss {
    /// The loss these settings name.
    pub fn loss(&self) -> Result<RerankLoss> {
        let objective = match self.kind {
            RerankLossKind::MultipleNegatives => {
                RerankObjective::MultipleNegatives { scale: self.scale }
            }
            RerankLossKind::Bce => RerankObjective::BinaryCrossEntropy,
            RerankLossKind::Listnet => RerankObjective::ListNet,
            RerankLossKind::Lambda => RerankObjective::Lambda {
                mu: self.mu,
                sigma: self.sigma,
                k: self.k,
            },
            RerankLossKind::MarginMse => RerankObjective::MarginMse,
            RerankLossKind::Kl => RerankObjective::Kl {
                student_temperature: self.student_temperature,
                teacher_temperature: self.teacher_temperature,
            },
        };
        match &self.activation {
            None => RerankLoss::new(objective),
            Some(name) => {
                let activation = match name.as_str() {
                    "sigmoid" => ScoreActivation::Sigmoid,
                    "identity" => ScoreActivation::Identity,
                    "tanh" => ScoreActivation::Tanh,
                    _ => {
                        return Err(Error::InvalidConfig {
                            field: "loss.reranker.activation",
                            value: name.clone(),
                            reason: "one of sigmoid, identity, tanh",
                        })
                    }
                };
                RerankLoss::with_activation(objective, activation)
            }
        }
    }

    /// Whether the loss reads the rows' teacher `scores` (all but the ranking loss and
    /// binary cross-entropy).
    pub fn reads_scores(&self) -> bool {
        !matches!(
            self.kind,
            RerankLossKind::MultipleNegatives | RerankLossKind::Bce
        )
    }
}
