//! Cross-encoder heads: each encoder family's `*ForSequenceClassification` head over the
//! last hidden states of a (query, document) pair, with the family's own weight names, so
//! a reranker saved by transformers or sentence-transformers' `CrossEncoder` loads as it
//! is.
//!
//! - BERT: the pooler (`pooler.dense`, tanh) on the first token, dropout, `classifier`;
//! - RoBERTa, XLM-R, CamemBERT and MPNet: on the first token dropout,
//!   `classifier.dense`, tanh, dropout, `classifier.out_proj`;
//! - DistilBERT: `pre_classifier` on the first token, ReLU, dropout, `classifier`;
//! - DeBERTa-v2/v3: on the first token dropout (`pooler_dropout`), `pooler.dense`, the
//!   `pooler_hidden_act`, dropout (`cls_dropout`, else the hidden dropout), `classifier`;
//! - ModernBERT: the first token or the mean of the real tokens (`classifier_pooling`),
//!   `head.dense` (bias as `classifier_bias`), the `classifier_activation`, `head.norm`,
//!   dropout, `classifier`;
//! - the decoders (Qwen3, Qwen2, Llama, Mistral, Gemma3): `*ForSequenceClassification`'s
//!   `score` (no bias) on the last real token; or, a causal LM read as Qwen3-Reranker is
//!   (sentence-transformers' `LogitScore`), the language-model head's logit of a "yes"
//!   token less that of a "no" token at the last real token: `lm_head`'s two rows, or the
//!   word embeddings' where the head is tied to them (`tie_word_embeddings`), Gemma's
//!   `final_logit_softcapping` applied to each logit.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::bert_config::{BertConfig, Family};
use super::pooling::Pooling;
use crate::dropout::{Ctx, Dropout};
use crate::nn::{Act, LayerNorm, Linear};
use crate::{Error, Result};

/// A classification head: how many outputs (`num_labels`; a reranker has one), and how a
/// decoder scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassifierSpec {
    /// Outputs per pair (`num_labels`).
    pub labels: usize,
    /// The head's kind.
    pub kind: HeadKind,
}

impl ClassifierSpec {
    /// A `*ForSequenceClassification` head of `labels` outputs.
    pub fn labels(labels: usize) -> Self {
        Self {
            labels,
            kind: HeadKind::Classification,
        }
    }
}

/// What a cross-encoder's score is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadKind {
    /// The family's `*ForSequenceClassification` head.
    #[default]
    Classification,
    /// A causal LM's logit of the token `yes` less that of `no` (the logit of `yes`
    /// alone without one) at the last position: sentence-transformers' `LogitScore`, the
    /// layout of Qwen3-Reranker.
    LogitScore { yes: u32, no: Option<u32> },
}

/// The families with a classification head, for errors.
pub const CLASSIFIER_FAMILIES: &str = "bert, roberta, xlm-roberta, camembert, mpnet, \
                                       distilbert, modernbert, deberta-v2, qwen3, qwen2, llama, mistral, \
                                       gemma3_text";

/// Whether a decoder's language-model head is its word embeddings
/// (`tie_word_embeddings`; Gemma's default, not the others').
pub fn ties_word_embeddings(cfg: &BertConfig, family: Family) -> bool {
    cfg.extra
        .get("tie_word_embeddings")
        .and_then(|v| v.as_bool())
        .unwrap_or(family == Family::Gemma3)
}

/// The modules a family's head keeps outside its base model (read from the weights file
/// each by its own name); the BERT pooler lives inside the base model (`bert.pooler`), a
/// tied language-model head is the word embeddings.
pub fn head_modules(cfg: &BertConfig, family: Family, kind: HeadKind) -> &'static [&'static str] {
    match (family, kind) {
        (Family::Bert | Family::Roberta | Family::MpNet, _) => &["classifier"],
        (Family::DistilBert, _) => &["pre_classifier", "classifier"],
        (Family::DebertaV2, _) => &["pooler", "classifier"],
        (Family::ModernBert, _) => &["head", "classifier"],
        (_, HeadKind::LogitScore { .. }) if ties_word_embeddings(cfg, family) => &[],
        (_, HeadKind::LogitScore { .. }) => &["lm_head"],
        (f, HeadKind::Classification) if f.is_causal_lm() => &["score"],
        _ => &[],
    }
}

/// The weight whose presence says a model's file holds its head (`None`: a tied
/// language-model head, which the base model holds).
pub fn head_weight(cfg: &BertConfig, family: Family, kind: HeadKind) -> Option<&'static str> {
    match (family, kind) {
        (Family::Roberta | Family::MpNet, _) => Some("classifier.out_proj.weight"),
        (f, HeadKind::LogitScore { .. }) if f.is_causal_lm() => {
            (!ties_word_embeddings(cfg, family)).then_some("lm_head.weight")
        }
        (f, HeadKind::Classification) if f.is_causal_lm() => Some("score.weight"),
        _ => Some("classifier.weight"),
    }
}

/// A head's activation named by the config's `key` (GELU when absent), refused by name
/// when unknown.
fn head_activation(
    x: &serde_json::Map<String, serde_json::Value>,
    key: &'static str,
    path: &std::path::Path,
) -> Result<Act> {
    match x.get(key).and_then(|v| v.as_str()) {
        None | Some("gelu") => Ok(Act::GeluErf),
        Some("gelu_new" | "gelu_pytorch_tanh") => Ok(Act::GeluTanh),
        Some("relu") => Ok(Act::Relu),
        Some("silu" | "swish") => Ok(Act::Silu),
        Some(other) => Err(Error::UnsupportedConfig {
            field: key,
            value: other.to_string(),
            supported: "gelu, gelu_new, gelu_pytorch_tanh, relu, silu",
            path: path.to_path_buf(),
        }),
    }
}

enum Layout {
    /// BERT: tanh(pooler) then the classifier.
    Bert { pooler: Linear },
    /// RoBERTa / MPNet: dense, tanh, dropout, out_proj.
    Roberta { dense: Linear },
    /// DistilBERT: pre_classifier, ReLU.
    DistilBert { pre: Linear },
    /// DeBERTa: dropout, the pooler's dense and activation.
    Deberta {
        pooler: Linear,
        act: Act,
        dropout: Dropout,
    },
    /// ModernBERT: dense, activation, norm.
    ModernBert {
        dense: Linear,
        act: Act,
        norm: LayerNorm,
    },
    /// A decoder's `score` (the `out` projection alone).
    Score,
    /// A causal LM's `yes` (and `no`) rows of its LM head `table` `[vocab, hidden]`.
    LogitScore {
        table: Tensor,
        /// `[1]` or `[2]` u32: `yes`, then `no`.
        rows: Tensor,
        /// Gemma's `final_logit_softcapping`.
        softcap: Option<f64>,
    },
}

/// A family's classification head.
pub struct ClassifierHead {
    layout: Layout,
    /// The last projection (`classifier`, RoBERTa's `classifier.out_proj`, a decoder's
    /// `score`; none for a `LogitScore`).
    out: Option<Linear>,
    pooling: Pooling,
    dropout: Dropout,
    /// The dropout masks' layer id (past the encoder's layers).
    layer: u32,
}

impl ClassifierHead {
    /// `cfg`'s family's head under `vb` (the model's root: the names as the family's
    /// `*ForSequenceClassification` keeps them, the base model's prefix stripped), masks
    /// drawn as layer `layer`; `words` is a decoder's word embeddings (a tied LM head's
    /// rows). Fresh weights as transformers initialises them: normal(0,
    /// `initializer_range`), zero biases, LayerNorm ones.
    pub fn new(
        cfg: &BertConfig,
        spec: ClassifierSpec,
        layer: u32,
        vb: &VarBuilder,
        words: Option<&Tensor>,
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
        if let HeadKind::LogitScore { yes, no } = spec.kind {
            if !family.is_causal_lm() || spec.labels != 1 {
                return Err(Error::InvalidArgument {
                    what: "LogitScore head",
                    value: format!("{family:?} with {} labels", spec.labels),
                    reason: "a yes/no logit score is a causal LM's (qwen3, qwen2, llama, \
                             mistral, gemma3_text), one score a pair",
                });
            }
            let vocab = cfg.vocab_size;
            if let Some(bad) = [Some(yes), no]
                .into_iter()
                .flatten()
                .find(|&t| t as usize >= vocab)
            {
                return Err(Error::InvalidArgument {
                    what: "LogitScore token",
                    value: bad.to_string(),
                    reason: "the yes/no token ids must be rows of the LM head (below \
                             vocab_size)",
                });
            }
            let table = match (ties_word_embeddings(cfg, family), words) {
                (true, Some(words)) => words.clone(),
                // A tied head is the base model's: a head built alone reads no weight.
                (true, None) => Tensor::zeros(1, candle_core::DType::F32, vb.device())?,
                (false, _) => vb.pp("lm_head").get_with_hints(
                    (vocab, h),
                    "weight",
                    candle_nn::Init::Randn {
                        mean: 0.0,
                        stdev: std,
                    },
                )?,
            };
            let ids: Vec<u32> = [Some(yes), no].into_iter().flatten().collect();
            let n = ids.len();
            return Ok(Self {
                layout: Layout::LogitScore {
                    table,
                    rows: Tensor::from_vec(ids, n, vb.device())?,
                    softcap: num("final_logit_softcapping"),
                },
                out: None,
                pooling: Pooling::LastToken,
                dropout: Dropout::new(0.0)?,
                layer,
            });
        }
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
            Family::DebertaV2 => {
                let act = head_activation(x, "pooler_hidden_act", path)?;
                if let Some(w) = num("pooler_hidden_size").filter(|&w| w as usize != h) {
                    return Err(Error::UnsupportedConfig {
                        field: "pooler_hidden_size",
                        value: w.to_string(),
                        supported: "the hidden size",
                        path: path.to_path_buf(),
                    });
                }
                let pooler_dropout = Dropout::new(num("pooler_dropout").unwrap_or(0.0) as f32)?;
                (
                    Layout::Deberta {
                        pooler: Linear::normal(h, h, std, at("pooler.dense"))?,
                        act,
                        dropout: pooler_dropout,
                    },
                    Linear::normal(h, spec.labels, std, at("classifier"))?,
                    Pooling::Cls,
                    num("cls_dropout").unwrap_or(cfg.hidden_dropout_prob),
                )
            }
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
                let act = head_activation(x, "classifier_activation", path)?;
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
            f if f.is_causal_lm() => (
                Layout::Score,
                Linear::normal_without_bias(h, spec.labels, std, at("score"))?,
                Pooling::LastToken,
                0.0,
            ),
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
            out: Some(out),
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
            Layout::Deberta {
                pooler,
                act,
                dropout,
            } => {
                let t = dropout.forward(&pooled, ctx, self.layer, 2)?;
                drop(&pooler.forward_activated(&t, *act)?, 1)?
            }
            Layout::ModernBert { dense, act, norm } => {
                let t = norm.forward(&dense.forward_activated(&pooled, *act)?)?;
                drop(&t, 0)?
            }
            Layout::Score => pooled,
            Layout::LogitScore {
                table,
                rows,
                softcap,
            } => {
                // [n, h] x [h, 1 or 2]: the yes (and no) logits.
                let head = table.index_select(rows, 0)?.to_dtype(pooled.dtype())?;
                let mut logits = pooled.matmul(&head.t()?)?;
                if let Some(c) = softcap {
                    logits = ((logits / *c)?.tanh()? * *c)?;
                }
                return match logits.dim(1)? {
                    1 => Ok(logits),
                    _ => Ok((logits.narrow(1, 0, 1)? - logits.narrow(1, 1, 1)?)?),
                };
            }
        };
        match &self.out {
            Some(out) => out.forward(&y),
            None => Ok(y),
        }
    }
}
