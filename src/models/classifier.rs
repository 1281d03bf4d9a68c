//! Cross-encoder heads: each encoder family's `*ForSequenceClassification` head over the
//! last hidden states of a (query, document) pair, with the family's own weight names, so
//! a reranker saved by transformers or sentence-transformers' `CrossEncoder` loads as it
//! is.
//!
//! - BERT: the pooler (`pooler.dense`, tanh) on the first token, dropout, `classifier`;
//! - RoBERTa, XLM-R, CamemBERT and MPNet: on the first token dropout,
//!   `classifier.dense`, tanh, dropout, `classifier.out_proj`;
//! - DistilBERT: `pre_classifier` on the first token, ReLU, dropout, `classifier`;
//! - ModernBERT: the first token or the mean of the real tokens (`classifier_pooling`),
//!   `head.dense` (bias as `classifier_bias`), the `classifier_activation`, `head.norm`,
//!   dropout, `classifier`.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::bert_config::{BertConfig, Family};
use super::pooling::Pooling;
use crate::dropout::{Ctx, Dropout};
use crate::nn::{Act, LayerNorm, Linear};
use crate::{Error, Result};

/// A classification head: how many outputs (`num_labels`; a reranker has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassifierSpec {
    /// Outputs per pair (`num_labels`).
    pub labels: usize,
}

/// The families with a classification head, for errors.
pub const CLASSIFIER_FAMILIES: &str = "bert, roberta, xlm-roberta, camembert, mpnet, \
                                       distilbert, modernbert";

/// The modules a family's `*ForSequenceClassification` keeps outside its base model (read
/// from the weights file each by its own name); the BERT pooler lives inside the base
/// model (`bert.pooler`).
pub fn head_modules(family: Family) -> Option<&'static [&'static str]> {
    match family {
        Family::Bert | Family::Roberta | Family::MpNet => Some(&["classifier"]),
        Family::DistilBert => Some(&["pre_classifier", "classifier"]),
        Family::ModernBert => Some(&["head", "classifier"]),
        _ => None,
    }
}

/// The weight whose presence says a model's file holds its classification head.
pub fn head_weight(family: Family) -> &'static str {
    match family {
        Family::Roberta | Family::MpNet => "classifier.out_proj.weight",
        _ => "classifier.weight",
    }
}

enum Layout {
    /// BERT: tanh(pooler) then the classifier.
    Bert { pooler: Linear },
    /// RoBERTa / MPNet: dense, tanh, dropout, out_proj.
    Roberta { dense: Linear },
    /// DistilBERT: pre_classifier, ReLU.
    DistilBert { pre: Linear },
    /// ModernBERT: dense, activation, norm.
    ModernBert {
        dense: Linear,
        act: Act,
        norm: LayerNorm,
    },
}

/// A family's classification head.
pub struct ClassifierHead {
    layout: Layout,
    /// The last projection (`classifier`, RoBERTa's `classifier.out_proj`).
    out: Linear,
    pooling: Pooling,
    dropout: Dropout,
    /// The dropout masks' layer id (past the encoder's layers).
    layer: u32,
}

impl ClassifierHead {
    /// `cfg`'s family's head under `vb` (the model's root: the names as the family's
    /// `*ForSequenceClassification` keeps them, the base model's prefix stripped), masks
    /// drawn as layer `layer`. Fresh weights as transformers initialises them: normal(0,
    /// `initializer_range`), zero biases, LayerNorm ones.
    pub fn new(
        cfg: &BertConfig,
        spec: ClassifierSpec,
        layer: u32,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let path = std::path::Path::new("config");
        let family = cfg.family(path)?;
        if spec.labels == 0 {
            return Err(Error::InvalidArgument {
                what: "classification head",
                value: "0 labels".into(),
                reason: "a cross-encoder has at least one output (a reranker, one)",
            });
        }
        let at = |name: &str| name.split('.').fold(vb.clone(), |vb, part| vb.pp(part));
        let (h, std) = (cfg.hidden_size, cfg.initializer_range);
        let x = &cfg.extra;
        let num = |key: &str| x.get(key).and_then(|v| v.as_f64());
        let hidden_dropout = num("classifier_dropout").unwrap_or(cfg.hidden_dropout_prob);
        let (layout, out, pooling, p) = match family {
            Family::Bert => (
                Layout::Bert {
                    pooler: Linear::normal(h, h, std, at("pooler.dense"))?,
                },
                Linear::normal(h, spec.labels, std, at("classifier"))?,
                Pooling::Cls,
                hidden_dropout,
            ),
            Family::Roberta | Family::MpNet => (
                Layout::Roberta {
                    dense: Linear::normal(h, h, std, at("classifier.dense"))?,
                },
                Linear::normal(h, spec.labels, std, at("classifier.out_proj"))?,
                Pooling::Cls,
                hidden_dropout,
            ),
            Family::DistilBert => (
                Layout::DistilBert {
                    pre: Linear::normal(h, h, std, at("pre_classifier"))?,
                },
                Linear::normal(h, spec.labels, std, at("classifier"))?,
                Pooling::Cls,
                num("seq_classif_dropout").unwrap_or(0.2),
            ),
            Family::ModernBert => {
                let flag = |key: &str, default: bool| {
                    x.get(key).and_then(|v| v.as_bool()).unwrap_or(default)
                };
                let pooling = match x.get("classifier_pooling").and_then(|v| v.as_str()) {
                    None | Some("cls") => Pooling::Cls,
                    Some("mean") => Pooling::Mean,
                    Some(other) => {
                        return Err(Error::UnsupportedConfig {
                            field: "classifier_pooling",
                            value: other.to_string(),
                            supported: "cls, mean",
                            path: path.to_path_buf(),
                        })
                    }
                };
                let act = match x.get("classifier_activation").and_then(|v| v.as_str()) {
                    None | Some("gelu") => Act::GeluErf,
                    Some("gelu_new" | "gelu_pytorch_tanh") => Act::GeluTanh,
                    Some("relu") => Act::Relu,
                    Some("silu" | "swish") => Act::Silu,
                    Some(other) => {
                        return Err(Error::UnsupportedConfig {
                            field: "classifier_activation",
                            value: other.to_string(),
                            supported: "gelu, gelu_new, gelu_pytorch_tanh, relu, silu",
                            path: path.to_path_buf(),
                        })
                    }
                };
                let eps = num("norm_eps").unwrap_or(1e-5);
                let dense = if flag("classifier_bias", false) {
                    Linear::normal(h, h, std, at("head.dense"))?
                } else {
                    Linear::normal_without_bias(h, h, std, at("head.dense"))?
                };
                let norm = if flag("norm_bias", false) {
                    LayerNorm::new(h, eps, at("head.norm"))?
                } else {
                    LayerNorm::without_bias(h, eps, at("head.norm"))?
                };
                (
                    Layout::ModernBert { dense, act, norm },
                    Linear::normal(h, spec.labels, std, at("classifier"))?,
                    pooling,
                    num("classifier_dropout").unwrap_or(0.0),
                )
            }
            _ => {
                return Err(Error::UnsupportedConfig {
                    field: "model_type",
                    value: cfg.model_type.clone().unwrap_or_else(|| "bert".into()),
                    supported: CLASSIFIER_FAMILIES,
                    path: path.to_path_buf(),
                })
            }
        };
        Ok(Self {
            layout,
            out,
            pooling,
            dropout: Dropout::new(p as f32)?,
            layer,
        })
    }

    /// The logits `[n, labels]` of the last hidden states `x` `[n, s, hidden]` (`mask`,
    /// `first` and `kept` as the pooling reads them).
    pub fn forward(
        &self,
        x: &Tensor,
        mask: &Tensor,
        (first, kept): (&[usize], &[(usize, usize)]),
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let pooled = self.pooling.pool(x, mask, first, kept, false)?;
        let drop = |t: &Tensor, site: u32| self.dropout.forward(t, ctx, self.layer, site);
        let y = match &self.layout {
            Layout::Bert { pooler } => drop(&pooler.forward(&pooled)?.tanh()?, 0)?,
            Layout::Roberta { dense } => {
                let t = dense.forward(&drop(&pooled, 0)?)?.tanh()?;
                drop(&t, 1)?
            }
            Layout::DistilBert { pre } => drop(&pre.forward_activated(&pooled, Act::Relu)?, 0)?,
            Layout::ModernBert { dense, act, norm } => {
                let t = norm.forward(&dense.forward_activated(&pooled, *act)?)?;
                drop(&t, 0)?
            }
        };
        self.out.forward(&y)
    }
}
