//! `[model.sparse]`: a sparse (SPLADE) run, the masked-language model's logits pooled into
//! one vocabulary-wide vector per text; settings left unset are the pretrained
//! `SparseEncoder`'s own, else SPLADE v2's (`max` of `relu`). `[loss.splade]`: its FLOPS
//! regularisers, with sentence-transformers' `SpladeLoss` names and the quadratic warm-up
//! of `SpladeRegularizerWeightSchedulerCallback`.

use crate::models::bert::{SparseSpec, SpladeActivation, SpladeStrategy};
use crate::{Error, Result};

/// `[model.sparse]`.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SparseSettings {
    /// `max` or `sum` over the tokens. Unset: the pretrained model's, else `max`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooling: Option<String>,
    /// `relu` or `log1p_relu`. Unset: the pretrained model's, else `relu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation: Option<String>,
    /// Inference-free: queries are not encoded but given a learned weight per vocabulary
    /// entry on their tokens (sentence-transformers' `SparseStaticEmbedding` on a
    /// `Router`'s query route); documents go through the model. Unset: the pretrained
    /// model's (true for a `Router` model), else false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference_free: Option<bool>,
    /// Inference-free: keep the query weights as they are (`frozen`). Unset: the
    /// pretrained model's, else false (trained).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub freeze_query_weights: Option<bool>,
    /// A pretrained model whose file holds no masked-language-model head (a `BertModel`,
    /// a sentence-transformers model): create the head from the seed (transformers'
    /// initialisation; its decoder is the word embeddings, as always). Unset: refused by
    /// name.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub new_head: bool,
    /// Inference-free: the query weights' learning rate, on the run's schedule
    /// (sentence-transformers' `learning_rate_mapping` for `SparseStaticEmbedding`, whose
    /// examples give it 1e-3 beside the model's 2e-5). Unset: `optim.lr`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_lr: Option<f64>,
}

impl SparseSettings {
    /// The head over the pretrained model's own (`own`, when it is a `SparseEncoder`).
    pub fn resolve(&self, own: Option<SparseSpec>) -> Result<SparseSpec> {
        let own = own.unwrap_or_default();
        let strategy = match &self.pooling {
            None => own.strategy,
            Some(name) => SpladeStrategy::from_name(name).ok_or_else(|| Error::InvalidConfig {
                field: "model.sparse.pooling",
                value: name.clone(),
                reason: "max or sum",
            })?,
        };
        let activation = match &self.activation {
            None => own.activation,
            Some(name) => {
                SpladeActivation::from_name(name).ok_or_else(|| Error::InvalidConfig {
                    field: "model.sparse.activation",
                    value: name.clone(),
                    reason: "relu or log1p_relu",
                })?
            }
        };
        Ok(SparseSpec {
            strategy,
            activation,
        })
    }

    /// Whether the run is inference-free, over the pretrained model's own (`own`: it is a
    /// `Router` model): refused set false on one (its queries have no other encoder), and
    /// the query-weight settings refused on a run that is not.
    pub fn resolve_inference_free(&self, own: bool) -> Result<bool> {
        if own && self.inference_free == Some(false) {
            return Err(Error::InvalidConfig {
                field: "model.sparse.inference_free",
                value: "false".into(),
                reason: "the pretrained model is inference-free (its queries are static \
                         weights, it has no query encoder): leave it unset",
            });
        }
        let free = self.inference_free.unwrap_or(own);
        if !free {
            for (field, set) in [
                (
                    "model.sparse.freeze_query_weights",
                    self.freeze_query_weights.is_some(),
                ),
                ("model.sparse.query_lr", self.query_lr.is_some()),
            ] {
                if set {
                    return Err(Error::InvalidConfig {
                        field,
                        value: "set".into(),
                        reason: "sets the static query weights of an inference-free model: \
                                 set model.sparse.inference_free = true",
                    });
                }
            }
        }
        Ok(free)
    }

    /// Refuses a query learning rate that is not a finite number > 0.
    fn validate(&self) -> Result<()> {
        if let Some(lr) = self.query_lr.filter(|lr| !(*lr > 0.0 && lr.is_finite())) {
            return Err(Error::InvalidConfig {
                field: "model.sparse.query_lr",
                value: lr.to_string(),
                reason: "a learning rate is a finite number > 0",
            });
        }
        Ok(())
    }
}

/// sentence-transformers' documented documents' weight.
pub const DEFAULT_DOCUMENT_WEIGHT: f64 = 3e-5;
/// sentence-transformers' documented queries' weight.
pub const DEFAULT_QUERY_WEIGHT: f64 = 5e-5;

/// `[loss.splade]`: the FLOPS regularisers of a sparse run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpladeConfig {
    /// The documents' regulariser weight (every passage: positives and hard negatives;
    /// `document_regularizer_weight`, SPLADE's lambda_d).
    pub document_weight: f64,
    /// The queries' (`query_regularizer_weight`, lambda_q). Unset: 5e-5, or none with
    /// `documents_only` or on an inference-free run; 0: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_weight: Option<f64>,
    /// Documents with at most this many active entries are left out of the sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_threshold: Option<usize>,
    /// Queries with at most this many active entries are left out of the sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_threshold: Option<usize>,
    /// Every text a document: one regulariser over queries and passages together
    /// (`use_document_regularizer_only`, for symmetric data); no query weight then.
    pub documents_only: bool,
    /// The weights grow from 0 over this fraction of the run's steps, as the square of
    /// the fraction done (sentence-transformers' quadratic schedule, 1/3 by default);
    /// 0: full weights from the first step.
    pub warmup_ratio: f64,
}

impl Default for SpladeConfig {
    /// sentence-transformers' documented weights (3e-5 documents, 5e-5 queries) and
    /// warm-up (a third of the run).
    fn default() -> Self {
        Self {
            document_weight: DEFAULT_DOCUMENT_WEIGHT,
            query_weight: None,
            document_threshold: None,
            query_threshold: None,
            documents_only: false,
            warmup_ratio: 1.0 / 3.0,
        }
    }
}

impl SpladeConfig {
    /// Refuses a negative or non-finite weight, a query weight with `documents_only`, a
    /// warm-up outside `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        for (field, w) in [
            ("loss.splade.document_weight", Some(self.document_weight)),
            ("loss.splade.query_weight", self.query_weight),
        ] {
            if let Some(w) = w.filter(|w| !(*w >= 0.0 && w.is_finite())) {
                return Err(Error::InvalidConfig {
                    field,
                    value: w.to_string(),
                    reason: "a FLOPS weight is a finite number >= 0",
                });
            }
        }
        if self.documents_only && self.query_weight.is_some() {
            return Err(Error::InvalidConfig {
                field: "loss.splade.query_weight",
                value: format!("{:?}", self.query_weight),
                reason: "documents_only regularises every text as a document: leave the \
                         query weight unset",
            });
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(Error::InvalidConfig {
                field: "loss.splade.warmup_ratio",
                value: self.warmup_ratio.to_string(),
                reason: "a fraction of the run in [0, 1]",
            });
        }
        Ok(())
    }

    /// The queries' weight: the one set, else 5e-5 (none for an `inference_free` run, as
    /// sentence-transformers leaves static query weights unregularised); none with
    /// `documents_only`.
    pub fn effective_query_weight(&self, inference_free: bool) -> Option<f64> {
        match (self.documents_only, self.query_weight) {
            (true, _) => None,
            (false, None) if inference_free => None,
            (false, w) => Some(w.unwrap_or(DEFAULT_QUERY_WEIGHT)),
        }
    }

    /// The fraction of the full weights at `step` (updates done) of a run of `steps`:
    /// `(step / W)^2` before `W = max(1, floor(steps * warmup_ratio))`, 1 after.
    pub fn weight_scale(&self, step: u64, steps: u64) -> f64 {
        if self.warmup_ratio == 0.0 {
            return 1.0;
        }
        let warmup = ((steps as f64 * self.warmup_ratio) as u64).max(1);
        if step >= warmup {
            1.0
        } else {
            (step as f64 / warmup as f64).powi(2)
        }
    }
}

impl super::config::Config {
    /// What the run's vectors are scored by: `loss.similarity`, but dot products for a
    /// sparse model (as its loss, its export and an inverted index score them).
    pub fn similarity(&self) -> crate::loss::Similarity {
        match self.model.sparse {
            Some(_) => crate::loss::Similarity::Dot,
            None => self.loss.similarity,
        }
    }

    /// A sparse run's settings: its vector is the MLM head's pooled logits, scored by dot
    /// products whatever `loss.similarity` says, so the single-vector head settings,
    /// Matryoshka widths, a multi-vector head, LoRA and a memory budget are refused by
    /// name; `[loss.splade]` without `[model.sparse]` too.
    pub(super) fn validate_sparse(&self) -> Result<()> {
        let (m, l) = (&self.model, &self.loss);
        if m.sparse.is_none() {
            if l.splade.is_some() {
                return Err(Error::InvalidConfig {
                    field: "loss.splade",
                    value: "set".into(),
                    reason: "regularises a sparse model's vectors: set [model.sparse]",
                });
            }
            return Ok(());
        }
        if let Some(s) = &l.splade {
            s.validate()?;
        }
        if let Some(sparse) = &m.sparse {
            sparse.resolve(None)?;
            sparse.validate()?;
            if sparse.inference_free == Some(true) && !m.shared {
                return Err(Error::InvalidConfig {
                    field: "model.shared",
                    value: "false".into(),
                    reason: "an inference-free model has one model, for documents; its \
                             queries are static weights: leave model.shared true",
                });
            }
        }
        let refused = [
            ("model.multi_vector", m.multi_vector.is_some()),
            ("model.pooling", m.pooling.is_some()),
            ("model.normalize", m.normalize.is_some()),
            ("model.lora", m.lora.is_some()),
            ("loss.matryoshka_dims", !l.matryoshka_dims.is_empty()),
            ("loss.distillation", l.distillation.is_some()),
            ("train.memory_budget", self.train.memory_budget.is_some()),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
            return Err(Error::InvalidConfig {
                field,
                value: "set".into(),
                reason: "not on a sparse (SPLADE) model, whose vector is its MLM head's \
                         pooled logits scored by dot products (no pooling, normalisation or \
                         Matryoshka widths; LoRA and the memory budget are not supported \
                         for it yet)",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sentence-transformers' quadratic schedule: `(step / W)^2` up to `W`, then 1.
    #[test]
    fn the_weights_warm_up_quadratically() {
        let c = SpladeConfig {
            warmup_ratio: 0.25,
            ..Default::default()
        };
        let scales: Vec<f64> = (0..6).map(|s| c.weight_scale(s, 16)).collect();
        assert_eq!(scales, [0.0, 1.0 / 16.0, 0.25, 9.0 / 16.0, 1.0, 1.0]);
        let none = SpladeConfig {
            warmup_ratio: 0.0,
            ..Default::default()
        };
        assert_eq!(none.weight_scale(0, 16), 1.0);
        // A run shorter than the ratio's one step still warms up over one step.
        assert_eq!(c.weight_scale(0, 2), 0.0);
        assert_eq!(c.weight_scale(1, 2), 1.0);
        assert_eq!(c.effective_query_weight(false), Some(DEFAULT_QUERY_WEIGHT));
        assert_eq!(c.effective_query_weight(true), None);
        let documents_only = SpladeConfig {
            documents_only: true,
            ..Default::default()
        };
        assert_eq!(documents_only.effective_query_weight(false), None);
    }
}
