//! Learned sparse (SPLADE) representations: a masked-language-model head over the
//! encoder's last hidden states ([`MlmHead`]: a transform, its activation and LayerNorm,
//! then the decoder tied to the word embeddings plus its bias) and sentence-transformers'
//! `SpladePooling` over the real tokens of `log(1 + relu(logit))` ([`SparseSpec`]): one
//! vector as wide as the vocabulary per text, most of it exactly zero.

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

use super::bert_config::{BertConfig, Family};
use crate::nn::{LayerNorm, Linear};
use crate::{Error, Result};

/// How token weights become the text's vector (sentence-transformers' `pooling_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpladeStrategy {
    /// The largest weight of each vocabulary entry over the tokens (SPLADE v2 and later).
    #[default]
    Max,
    /// The sum over the tokens (the first SPLADE).
    Sum,
}

/// The activation under the `log(1 + .)` (sentence-transformers' `activation_function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpladeActivation {
    /// `log(1 + relu(x))`, every SPLADE model's.
    #[default]
    Relu,
    /// `log(1 + log(1 + relu(x)))`, OpenSearch's inference-free models'.
    Log1pRelu,
}

/// A sparse head: the MLM head and the SPLADE pooling's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseSpec {
    /// `max` or `sum` over the tokens.
    pub strategy: SpladeStrategy,
    /// `relu` or `log1p_relu`.
    pub activation: SpladeActivation,
}

impl SpladeStrategy {
    /// The name sentence-transformers' `SpladePooling` config gives it.
    pub fn name(self) -> &'static str {
        match self {
            SpladeStrategy::Max => "max",
            SpladeStrategy::Sum => "sum",
        }
    }

    /// The strategy a `SpladePooling` config names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "max" => Some(SpladeStrategy::Max),
            "sum" => Some(SpladeStrategy::Sum),
            _ => None,
        }
    }
}

impl SpladeActivation {
    /// The name sentence-transformers' `SpladePooling` config gives it.
    pub fn name(self) -> &'static str {
        match self {
            SpladeActivation::Relu => "relu",
            SpladeActivation::Log1pRelu => "log1p_relu",
        }
    }

    /// The activation a `SpladePooling` config names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "relu" => Some(SpladeActivation::Relu),
            "log1p_relu" => Some(SpladeActivation::Log1pRelu),
            _ => None,
        }
    }
}

/// Where a family's `*ForMaskedLM` keeps its head (Hugging Face names, outside the base
/// model's prefix): the transform, its LayerNorm and the decoder's bias.
pub struct MlmNames {
    /// The modules the head's weights live under, each read from the model's file by
    /// its own name.
    pub modules: &'static [&'static str],
    transform: &'static str,
    norm: &'static str,
    bias: &'static str,
}

impl MlmNames {
    /// The head of `family`'s masked-language model; `None` for a family whose head this
    /// crate does not build.
    pub fn of(family: Family) -> Option<Self> {
        match family {
            Family::Bert => Some(Self {
                modules: &["cls"],
                transform: "cls.predictions.transform.dense",
                norm: "cls.predictions.transform.LayerNorm",
                bias: "cls.predictions",
            }),
            Family::DistilBert => Some(Self {
                modules: &["vocab_transform", "vocab_layer_norm", "vocab_projector"],
                transform: "vocab_transform",
                norm: "vocab_layer_norm",
                bias: "vocab_projector",
            }),
            _ => None,
        }
    }
}

impl MlmNames {
    /// The decoder bias's name in the family's `*ForMaskedLM` file (present when the
    /// file holds the head).
    pub fn bias_name(&self) -> String {
        format!("{}.bias", self.bias)
    }
}

/// The families with a sparse head, for errors.
pub const SPARSE_FAMILIES: &str = "bert (BertForMaskedLM), distilbert (DistilBertForMaskedLM)";

/// A masked-language-model head: `logits = LayerNorm(act(x W_t^T + b_t)) E^T + b`, with
/// `E` the word embeddings.
pub struct MlmHead {
    transform: Linear,
    act: crate::nn::Act,
    norm: LayerNorm,
    /// The word embeddings `[vocab, hidden]` (the decoder's weight, tied).
    table: Tensor,
    /// The decoder's bias `[vocab]`.
    bias: Tensor,
    spec: SparseSpec,
}

impl MlmHead {
    /// The head of `cfg`'s family under `vb` (its names as the family's `*ForMaskedLM`
    /// keeps them), tied to the word embeddings `table`. Fresh weights as transformers
    /// initialises them: normal(0, `initializer_range`) transform, LayerNorm ones and
    /// zeros, a zero bias.
    pub fn new(cfg: &BertConfig, spec: SparseSpec, table: Tensor, vb: &VarBuilder) -> Result<Self> {
        let path = std::path::Path::new("config");
        let family = cfg.family(path)?;
        let names = MlmNames::of(family).ok_or_else(|| Error::InvalidArgument {
            what: "sparse model",
            value: cfg.model_type.clone().unwrap_or_else(|| "bert".into()),
            reason: "a sparse (SPLADE) head is built for bert (BertForMaskedLM) and \
                     distilbert (DistilBertForMaskedLM) models",
        })?;
        let at = |name: &str| name.split('.').fold(vb.clone(), |vb, part| vb.pp(part));
        let h = cfg.hidden_size;
        let transform = Linear::normal(h, h, cfg.initializer_range, at(names.transform))?;
        let norm = LayerNorm::new(h, cfg.layer_norm_eps, at(names.norm))?;
        let bias =
            at(names.bias).get_with_hints(cfg.vocab_size, "bias", candle_nn::Init::Const(0.0))?;
        Ok(Self {
            transform,
            act: cfg.activation(path)?.fused(),
            norm,
            table,
            bias,
            spec,
        })
    }

    /// The transform before the decoder: `LayerNorm(act(x W_t^T + b_t))`.
    fn transformed(&self, x: &Tensor) -> Result<Tensor> {
        let t = self.transform.forward_activated(x, self.act)?;
        self.norm.forward(&t)
    }

    /// The sparse vectors `[n, vocab]` of hidden states `[n, s, hidden]` whose pooled
    /// tokens `mask` `[n, s]` (1 kept, 0 not) marks: `log(1 + relu(logit))` (once more
    /// `log(1 + .)` for `log1p_relu`), the largest or the sum over the kept tokens (a
    /// token left out counts as 0, as sentence-transformers masks the logits).
    pub fn pool(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let twice = self.spec.activation == SpladeActivation::Log1pRelu;
        let t = self.transformed(x)?;
        // Max pooling as one node on the CPU ([`crate::nn::cpu::splade`]): the logits a
        // block of rows at a time, the backward through each entry's winning token only.
        if self.spec.strategy == SpladeStrategy::Max
            && crate::nn::fused_ok(&[&t, &self.table, &self.bias])
        {
            return Ok(crate::nn::cpu::splade::max_pool(
                &t,
                &self.table,
                &self.bias,
                mask,
                twice,
            )?);
        }
        let logits = crate::nn::linear(&t, &self.table, Some(&self.bias))?;
        let masked = logits.broadcast_mul(&mask.to_dtype(logits.dtype())?.unsqueeze(D::Minus1)?)?;
        let mut w = (masked.relu()? + 1.0)?.log()?;
        if twice {
            w = (w + 1.0)?.log()?;
        }
        Ok(match self.spec.strategy {
            SpladeStrategy::Max => w.max(1)?,
            SpladeStrategy::Sum => w.sum(1)?,
        })
    }
}
