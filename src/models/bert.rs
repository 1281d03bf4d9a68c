//! A trainable BERT-family encoder: BERT, MiniLM and other `BertModel` checkpoints, and
//! the RoBERTa family (RoBERTa, XLM-RoBERTa, CamemBERT), whose layers are BERT's and whose
//! positions start past the padding index ([`Family`]).
//!
//! candle-transformers' `BertModel` is inference-only: its fused LayerNorm cuts the graph,
//! its dropout is a no-op and its `f32::MIN` attention mask turns into NaN in f16/bf16. This
//! one is built for training: composed (differentiable) LayerNorm and softmax, dropout
//! through the crate's explicit-seed [`Dropout`], an attention mask bias of -10000 that is
//! finite in every dtype (as in the original BERT), and Hugging Face weight names so that
//! `model.safetensors` files load as they are (with or without the `bert.` prefix).
//!
//! The model is a [`LayerStack`] (embeddings, `num_hidden_layers` transformer layers,
//! pooling), so [`Recomputed`] gives it activation checkpointing; [`BertEncoder`] is that
//! pairing, an [`Encoder`](crate::Encoder) over [`TokenBatch`] inputs.

use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::{Embedding, Init, Module, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
use crate::encoder::Tower;
use crate::hub::files::ModelFiles;
use crate::nn::{LayerNorm, Linear};
use crate::params::{ParamStore, WeightFile};
use crate::precision::Precision;
use crate::recompute::{LayerStack, Recompute, Recomputed};
use crate::{Error, Result};

/// The fields of a Hugging Face BERT `config.json` this encoder reads (others are ignored).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Number of transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Feed-forward activation: `gelu` (erf), `gelu_new` / `gelu_pytorch_tanh` (tanh
    /// approximation) or `relu`.
    #[serde(default = "defaults::hidden_act")]
    pub hidden_act: String,
    /// Dropout after embeddings, attention output and feed-forward output.
    #[serde(default = "defaults::dropout")]
    pub hidden_dropout_prob: f64,
    /// Dropout on attention probabilities.
    #[serde(default = "defaults::dropout")]
    pub attention_probs_dropout_prob: f64,
    /// Longest sequence the position embeddings cover.
    #[serde(default = "defaults::max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    #[serde(default = "defaults::type_vocab_size")]
    pub type_vocab_size: usize,
    /// Standard deviation of the normal initialisation of fresh weights.
    #[serde(default = "defaults::initializer_range")]
    pub initializer_range: f64,
    /// LayerNorm epsilon.
    #[serde(default = "defaults::layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// Only `absolute` is supported.
    #[serde(default = "defaults::position_embedding_type")]
    pub position_embedding_type: String,
    /// Padding token id.
    #[serde(default)]
    pub pad_token_id: usize,
    /// `bert` for BERT checkpoints.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Every other field of the file, kept so that an exported config says what the
    /// loaded one said.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

mod defaults {
    pub fn hidden_act() -> String {
        "gelu".into()
    }
    pub fn dropout() -> f64 {
        0.1
    }
    pub fn max_position_embeddings() -> usize {
        512
    }
    pub fn type_vocab_size() -> usize {
        2
    }
    pub fn initializer_range() -> f64 {
        0.02
    }
    pub fn layer_norm_eps() -> f64 {
        1e-12
    }
    pub fn position_embedding_type() -> String {
        "absolute".into()
    }
}

/// The model families this encoder loads, by `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `bert` (or no `model_type`): BERT, MiniLM, bge, e5, gte-small, ...: absolute
    /// positions counted from 0.
    Bert,
    /// `roberta`, `xlm-roberta`, `camembert`: BERT's layers with absolute positions that
    /// start past the padding index (`pad_token_id + 1`), one token type, `<s> .. </s>`.
    Roberta,
}

/// The `model_type`s [`Family`] accepts, for errors.
pub const SUPPORTED_FAMILIES: &str = "bert, roberta, xlm-roberta, camembert";

/// Feed-forward activations of BERT-family configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU (`gelu`).
    Gelu,
    /// Tanh approximation of GELU (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `relu`.
    Relu,
}

impl Activation {
    /// The activation as [`crate::nn::bias_activation`] names it.
    pub fn fused(self) -> crate::nn::Act {
        match self {
            Activation::Gelu => crate::nn::Act::GeluErf,
            Activation::GeluTanh => crate::nn::Act::GeluTanh,
            Activation::Relu => crate::nn::Act::Relu,
        }
    }
}

impl BertConfig {
    /// A BERT of the given size with Hugging Face's defaults for everything else (GELU,
    /// dropout 0.1, two token types, initializer range 0.02, LayerNorm epsilon 1e-12).
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        intermediate_size: usize,
        max_position_embeddings: usize,
    ) -> Self {
        Self {
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            intermediate_size,
            hidden_act: defaults::hidden_act(),
            hidden_dropout_prob: defaults::dropout(),
            attention_probs_dropout_prob: defaults::dropout(),
            max_position_embeddings,
            type_vocab_size: defaults::type_vocab_size(),
            initializer_range: defaults::initializer_range(),
            layer_norm_eps: defaults::layer_norm_eps(),
            position_embedding_type: defaults::position_embedding_type(),
            pad_token_id: 0,
            model_type: Some("bert".into()),
            extra: Default::default(),
        }
    }

    /// Matrix-product FLOPs of one forward pass over `rows` sequences of `len` tokens
    /// (multiply and add counted as two): per layer and token, the Q, K, V and output
    /// projections (`8 h^2`), the feed-forward (`4 h I`), and the attention scores and
    /// their product with the values (`4 len h`). Element-wise work is not counted; it is
    /// what the achieved GFLOP/s of a step is set against.
    pub fn forward_flops(&self, rows: usize, len: usize) -> f64 {
        let (h, i, s) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            len as f64,
        );
        let per_token = 8.0 * h * h + 4.0 * h * i + 4.0 * s * h;
        per_token * s * rows as f64 * self.num_hidden_layers as f64
    }

    /// Reads and checks a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::MissingFile {
                path: path.to_path_buf(),
                what: "model config",
            },
            _ => Error::ModelFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
        })?;
        let cfg: BertConfig = serde_json::from_str(&text).map_err(|e| Error::ModelFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The family of `model_type`; another type is refused with the supported ones named.
    pub fn family(&self, path: &Path) -> Result<Family> {
        match self.model_type.as_deref() {
            None | Some("bert") => Ok(Family::Bert),
            Some("roberta" | "xlm-roberta" | "camembert") => Ok(Family::Roberta),
            Some(other) => Err(Error::UnsupportedConfig {
                field: "model_type",
                value: other.to_string(),
                supported: SUPPORTED_FAMILIES,
                path: path.to_path_buf(),
            }),
        }
    }

    /// The position of the first token: 0 for BERT, `pad_token_id + 1` for the RoBERTa
    /// family (whose positions count from past the padding index).
    pub fn first_position(&self) -> usize {
        match self.family(Path::new("config")) {
            Ok(Family::Roberta) => self.pad_token_id + 1,
            _ => 0,
        }
    }

    /// The longest sequence the position embeddings cover, in tokens (special tokens
    /// included).
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings
            .saturating_sub(self.first_position())
    }

    /// Checks the values a BERT encoder depends on; `path` names the config in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.family(path)?;
        self.activation(path)?;
        if self.position_embedding_type != "absolute" {
            return Err(Error::UnsupportedConfig {
                field: "position_embedding_type",
                value: self.position_embedding_type.clone(),
                supported: "absolute",
                path: path.to_path_buf(),
            });
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ];
        if self.max_tokens() == 0 {
            return Err(Error::InvalidConfig {
                field: "max_position_embeddings",
                value: self.max_position_embeddings.to_string(),
                reason: "must leave room past the padding index (pad_token_id + 1)",
            });
        }
        for (field, value) in positive {
            if value == 0 {
                return Err(Error::InvalidConfig {
                    field,
                    value: "0".into(),
                    reason: "must be at least 1",
                });
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(Error::InvalidConfig {
                field: "num_attention_heads",
                value: self.num_attention_heads.to_string(),
                reason: "must divide hidden_size",
            });
        }
        for (field, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(Error::InvalidConfig {
                    field,
                    value: p.to_string(),
                    reason: "a drop probability must be in [0, 1)",
                });
            }
        }
        Ok(())
    }

    /// The feed-forward activation named by `hidden_act`.
    pub fn activation(&self, path: &Path) -> Result<Activation> {
        match self.hidden_act.as_str() {
            "gelu" => Ok(Activation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            "relu" => Ok(Activation::Relu),
            other => Err(Error::UnsupportedConfig {
                field: "hidden_act",
                value: other.to_string(),
                supported: "gelu, gelu_new, gelu_pytorch_tanh, relu",
                path: path.to_path_buf(),
            }),
        }
    }
}

/// How token states become one vector per sequence: the pooling modes of
/// sentence-transformers, with its names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The first token's state (`[CLS]`), as DPR.
    Cls,
    /// The mean over real (unmasked) tokens, as sentence-transformers.
    #[default]
    Mean,
    /// The maximum of each dimension over the real tokens.
    Max,
    /// The sum over the real tokens divided by the square root of their number.
    #[serde(rename = "mean_sqrt_len_tokens", alias = "mean_sqrt_len")]
    MeanSqrtLen,
    /// The mean over real tokens weighted by position (the first token 1, the second 2,
    /// ...), as SGPT.
    #[serde(rename = "weightedmean")]
    WeightedMean,
    /// The last real token's state (decoder-style embedding models).
    #[serde(rename = "lasttoken")]
    LastToken,
}

impl Pooling {
    /// Every mode, in the order sentence-transformers lists them.
    pub const ALL: [Pooling; 6] = [
        Pooling::Cls,
        Pooling::Max,
        Pooling::Mean,
        Pooling::MeanSqrtLen,
        Pooling::WeightedMean,
        Pooling::LastToken,
    ];

    /// The name used in configs and by sentence-transformers' `pooling_mode`.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len_tokens",
            Pooling::WeightedMean => "weightedmean",
            Pooling::LastToken => "lasttoken",
        }
    }

    /// The mode named `name` ([`Self::name`], or `mean_sqrt_len`).
    pub fn from_name(name: &str) -> Option<Self> {
        if name == "mean_sqrt_len" {
            return Some(Pooling::MeanSqrtLen);
        }
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The key of the mode among the booleans of sentence-transformers' older
    /// `1_Pooling/config.json` (`pooling_mode_mean_tokens`, ...).
    pub fn legacy_key(self) -> &'static str {
        match self {
            Pooling::Cls => "pooling_mode_cls_token",
            Pooling::Mean => "pooling_mode_mean_tokens",
            Pooling::Max => "pooling_mode_max_tokens",
            Pooling::MeanSqrtLen => "pooling_mode_mean_sqrt_len_tokens",
            Pooling::WeightedMean => "pooling_mode_weightedmean_tokens",
            Pooling::LastToken => "pooling_mode_lasttoken",
        }
    }

    /// Pools token states `x` `[n, s, h]` over the real tokens of `mask` `[n, s]` (1 for a
    /// real token, 0 for padding; padding on the right), as sentence-transformers does.
    /// Mean pooling runs as one node (see [`crate::nn::mean_pool`]); the others are
    /// composed of differentiable ops. Normalises the result with `normalize`.
    pub fn pool(self, x: &Tensor, mask: &Tensor, normalize: bool) -> Result<Tensor> {
        let (n, s, h) = x.dims3()?;
        let pooled = match self {
            Pooling::Mean => return crate::nn::mean_pool(x, mask, normalize),
            Pooling::Cls => x.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Max => {
                let keep = mask.unsqueeze(2)?.broadcast_as((n, s, h))?.ne(0.0)?;
                let floor =
                    Tensor::full(f32::NEG_INFINITY, (n, s, h), x.device())?.to_dtype(x.dtype())?;
                keep.where_cond(x, &floor)?.max(1)?
            }
            Pooling::MeanSqrtLen => {
                let sum = x.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
                let count = mask.sum_keepdim(1)?.clamp(1e-9, f64::MAX)?;
                sum.broadcast_div(&count.sqrt()?)?
            }
            Pooling::WeightedMean => {
                let positions = Tensor::arange(1u32, s as u32 + 1, x.device())?
                    .to_dtype(mask.dtype())?
                    .unsqueeze(0)?;
                let weights = mask.broadcast_mul(&positions)?;
                let sum = x.broadcast_mul(&weights.unsqueeze(2)?)?.sum(1)?;
                let total = weights.sum_keepdim(1)?.clamp(1e-9, f64::MAX)?;
                sum.broadcast_div(&total)?
            }
            Pooling::LastToken => {
                let counts: Vec<f32> = mask.to_dtype(candle_core::DType::F32)?.sum(1)?.to_vec1()?;
                let rows: Vec<u32> = counts
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| (i * s + (c as usize).max(1).min(s) - 1) as u32)
                    .collect();
                let rows = Tensor::new(rows.as_slice(), x.device())?;
                let masked = x.broadcast_mul(&mask.unsqueeze(2)?)?;
                masked.reshape((n * s, h))?.index_select(&rows, 0)?
            }
        };
        if normalize {
            crate::nn::l2_normalize(&pooled)
        } else {
            Ok(pooled)
        }
    }
}

/// Encoder options that are not part of the Hugging Face config.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BertOptions {
    /// Pooling.
    pub pooling: Pooling,
    /// L2-normalise the pooled vector.
    pub normalize: bool,
    /// Activation checkpointing policy.
    pub recompute: Recompute,
    /// The dtype of the transformer layers: `F32` runs them in the weights' dtype; `Bf16`
    /// and `F16` cast f32 weights where they are used (the embeddings' LayerNorm, the
    /// pooling and the output stay in the weights' dtype).
    pub precision: Precision,
}

/// The sites of BERT that selective recompute can recompute instead of keeping (Hugging
/// Face module names): in every layer the attention probabilities (scores, softmax and
/// dropout), the residual sum under each LayerNorm and the feed-forward activation (the
/// output of `intermediate`, four times the hidden width); below the layers the
/// embeddings' lookups and their sum under `embeddings.LayerNorm` (on the fused CPU
/// kernels; elsewhere the embeddings are kept).
pub const SITES: [&str; 5] = [
    "attention.probs",
    "attention.output.LayerNorm",
    "intermediate",
    "output.LayerNorm",
    "embeddings.LayerNorm",
];
const SITE_ATTENTION_PROBS: usize = 0;
const SITE_ATTENTION_NORM: usize = 1;
const SITE_INTERMEDIATE: usize = 2;
const SITE_OUTPUT_NORM: usize = 3;
const SITE_EMBEDDINGS: usize = 4;

/// Dropout sites inside a layer (the `site` of a mask seed).
mod site {
    pub const EMBEDDINGS: u32 = 0;
    pub const ATTENTION_PROBS: u32 = 1;
    pub const ATTENTION_OUTPUT: u32 = 2;
    pub const FEED_FORWARD_OUTPUT: u32 = 3;
}

struct Embeddings {
    words: Embedding,
    positions: Embedding,
    token_types: Embedding,
    norm: LayerNorm,
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

/// The BERT model: embeddings, transformer layers, pooling.
pub struct Bert {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    heads: usize,
    /// The position of the first token (see [`BertConfig::first_position`]).
    first_position: usize,
    max_positions: usize,
    activation: Activation,
    hidden_dropout: Dropout,
    attention_dropout: Dropout,
    options: BertOptions,
}

/// Per-chunk data every layer reads: the additive attention bias `[n, 1, 1, s]` and the
/// token mask `[n, s]` as floats (for mean pooling).
pub struct BertAux {
    bias: Tensor,
    mask: Tensor,
}

fn embedding(rows: usize, width: usize, std: f64, vb: VarBuilder) -> Result<Embedding> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: std,
    };
    Ok(Embedding::new(
        vb.get_with_hints((rows, width), "weight", init)?,
        width,
    ))
}

impl Bert {
    /// Builds the model under `vb` with Hugging Face names (`embeddings.*`,
    /// `encoder.layer.{i}.*`). Fresh weights: normal(0, `initializer_range`), LayerNorm
    /// ones and zeros, biases zero, as Hugging Face initialises BERT.
    pub fn new(cfg: &BertConfig, options: &BertOptions, vb: VarBuilder) -> Result<Self> {
        let path = Path::new("config");
        cfg.validate(path)?;
        let (h, std, eps) = (cfg.hidden_size, cfg.initializer_range, cfg.layer_norm_eps);
        let linear = |i: usize, o: usize, vb: VarBuilder| Linear::normal(i, o, std, vb);
        let e = vb.pp("embeddings");
        let embeddings = Embeddings {
            words: embedding(cfg.vocab_size, h, std, e.pp("word_embeddings"))?,
            positions: embedding(
                cfg.max_position_embeddings,
                h,
                std,
                e.pp("position_embeddings"),
            )?,
            token_types: embedding(cfg.type_vocab_size, h, std, e.pp("token_type_embeddings"))?,
            norm: LayerNorm::new(h, eps, e.pp("LayerNorm"))?,
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("encoder.layer.{i}"));
                let (a, s) = (l.pp("attention"), l.pp("attention").pp("self"));
                Ok(Layer {
                    query: linear(h, h, s.pp("query"))?,
                    key: linear(h, h, s.pp("key"))?,
                    value: linear(h, h, s.pp("value"))?,
                    attention_output: linear(h, h, a.pp("output").pp("dense"))?,
                    attention_norm: LayerNorm::new(h, eps, a.pp("output").pp("LayerNorm"))?,
                    intermediate: linear(
                        h,
                        cfg.intermediate_size,
                        l.pp("intermediate").pp("dense"),
                    )?,
                    output: linear(cfg.intermediate_size, h, l.pp("output").pp("dense"))?,
                    output_norm: LayerNorm::new(h, eps, l.pp("output").pp("LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings,
            layers,
            heads: cfg.num_attention_heads,
            first_position: cfg.first_position(),
            max_positions: cfg.max_tokens(),
            activation: cfg.activation(path)?,
            hidden_dropout: Dropout::new(cfg.hidden_dropout_prob as f32)?,
            attention_dropout: Dropout::new(cfg.attention_probs_dropout_prob as f32)?,
            options: options.clone(),
        })
    }

    /// The last hidden state `[n, s, hidden]` (no pooling).
    pub fn hidden_states(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        let aux = self.aux(input)?;
        let mut x = self.embed(input, &aux, ctx)?;
        for i in 0..self.layers.len() {
            x = self.layer(i, &x, &aux, ctx)?;
        }
        Ok(x)
    }

    /// The pooling options.
    pub fn options(&self) -> &BertOptions {
        &self.options
    }

    /// Self-attention of layer `i` (without the output projection).
    fn self_attention(&self, i: usize, x: &Tensor, aux: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        let layer = &self.layers[i];
        let head_dim = x.dim(2)? / self.heads;
        let spec = crate::nn::AttentionSpec {
            bias: aux.bias.clone(),
            scale: 1.0 / (head_dim as f64).sqrt(),
            dropout: self
                .attention_dropout
                .mask(ctx, layer_id(i), site::ATTENTION_PROBS),
            recompute: ctx.recompute.recomputes(SITE_ATTENTION_PROBS),
        };
        crate::nn::self_attention(
            x,
            [&layer.query, &layer.key, &layer.value],
            self.heads,
            &spec,
        )
    }
}

impl Bert {
    /// Layer `i` as one node with its backward written out
    /// ([`crate::nn::encoder_layer`]), where the fused kernels run: the same arithmetic as
    /// the op-by-op layer, without an autograd graph inside it. `None` elsewhere.
    fn whole_layer(
        &self,
        i: usize,
        x: &Tensor,
        aux: &BertAux,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let layer = &self.layers[i];
        let (Some(bq), Some(bk), Some(bv), Some(bo), Some(bi), Some(bd)) = (
            layer.query.bias(),
            layer.key.bias(),
            layer.value.bias(),
            layer.attention_output.bias(),
            layer.intermediate.bias(),
            layer.output.bias(),
        ) else {
            return Ok(None);
        };
        let id = layer_id(i);
        let head_dim = x.dim(2)? / self.heads;
        let recompute = |site: usize| ctx.recompute.recomputes(site);
        let weights = crate::nn::encoder_layer::LayerWeights {
            qkv: [
                layer.query.weight(),
                layer.key.weight(),
                layer.value.weight(),
            ],
            qkv_bias: [bq, bk, bv],
            attention_output: (layer.attention_output.weight(), bo),
            attention_norm: (layer.attention_norm.weight(), layer.attention_norm.bias()),
            intermediate: (layer.intermediate.weight(), bi),
            output: (layer.output.weight(), bd),
            output_norm: (layer.output_norm.weight(), layer.output_norm.bias()),
        };
        let spec = crate::nn::encoder_layer::LayerSpec {
            heads: self.heads,
            act: self.activation.fused(),
            eps: layer.attention_norm.eps(),
            attention: crate::nn::AttentionSpec {
                bias: aux.bias.clone(),
                scale: 1.0 / (head_dim as f64).sqrt(),
                dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS),
                recompute: recompute(SITE_ATTENTION_PROBS),
            },
            attention_output_dropout: self.hidden_dropout.mask(ctx, id, site::ATTENTION_OUTPUT),
            output_dropout: self.hidden_dropout.mask(ctx, id, site::FEED_FORWARD_OUTPUT),
            recompute_attention_norm: recompute(SITE_ATTENTION_NORM),
            recompute_intermediate: recompute(SITE_INTERMEDIATE),
            recompute_output_norm: recompute(SITE_OUTPUT_NORM),
        };
        if layer.output_norm.eps() != spec.eps {
            return Ok(None);
        }
        crate::nn::encoder_layer(x, &weights, &spec)
    }
}

/// Dropout layer ids: 0 for the embeddings, `i + 1` for transformer layer `i`.
fn layer_id(i: usize) -> u32 {
    i as u32 + 1
}

impl LayerStack for Bert {
    type Input = TokenBatch;
    type Aux = BertAux;

    fn aux(&self, input: &TokenBatch) -> Result<BertAux> {
        let dtype = self.embeddings.norm.dtype();
        let mask = input.attention_mask.to_dtype(dtype)?;
        // -10000 for padding, 0 for real tokens: finite in f16, bf16 and f32, and exp()
        // of it underflows to exactly 0 next to any real score.
        let bias = ((mask.ones_like()? - &mask)? * -10000.0)?
            .unsqueeze(1)?
            .unsqueeze(1)?;
        Ok(BertAux { bias, mask })
    }

    fn embed(&self, input: &TokenBatch, _: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        let e = &self.embeddings;
        let s = input.input_ids.dim(1)?;
        if s > self.max_positions {
            return Err(Error::SequenceTooLong {
                len: s,
                max: self.max_positions,
            });
        }
        let dropout = self.hidden_dropout.mask(ctx, 0, site::EMBEDDINGS);
        if self.options.precision == Precision::F32 {
            let fused = crate::nn::embeddings(
                [&input.input_ids, &input.token_type_ids],
                [
                    e.words.embeddings(),
                    e.token_types.embeddings(),
                    e.positions.embeddings(),
                ],
                self.first_position,
                &e.norm,
                dropout,
                ctx.recompute.recomputes(SITE_EMBEDDINGS),
            )?;
            if let Some(x) = fused {
                return Ok(x);
            }
        }
        let first = self.first_position as u32;
        let positions = Tensor::arange(first, first + s as u32, input.input_ids.device())?;
        let x = e
            .words
            .forward(&input.input_ids)?
            .add(&e.token_types.forward(&input.token_type_ids)?)?
            .broadcast_add(&e.positions.forward(&positions)?)?;
        let x = e.norm.forward(&x)?;
        // Mixed precision: the layers run in the half dtype (`F32` keeps the weights' own
        // dtype, so a model stored in half precision runs in it).
        let x = match self.options.precision {
            Precision::F32 => x,
            half => x.to_dtype(half.dtype())?,
        };
        self.hidden_dropout.forward(&x, ctx, 0, site::EMBEDDINGS)
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer(&self, i: usize, x: &Tensor, aux: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        if let Some(y) = self.whole_layer(i, x, aux, ctx)? {
            return Ok(y);
        }
        let layer = &self.layers[i];
        let id = layer_id(i);
        let recompute = |site: usize| ctx.recompute.recomputes(site);
        let add_norm = |x: &Tensor, residual: &Tensor, norm: &LayerNorm, mask, site: usize| {
            if recompute(site) {
                crate::nn::add_norm_recomputed(x, residual, norm, mask)
            } else {
                crate::nn::add_norm(x, residual, norm, mask)
            }
        };
        let attended = layer
            .attention_output
            .forward(&self.self_attention(i, x, aux, ctx)?)?;
        let x = add_norm(
            &attended,
            x,
            &layer.attention_norm,
            self.hidden_dropout.mask(ctx, id, site::ATTENTION_OUTPUT),
            SITE_ATTENTION_NORM,
        )?;
        let out = crate::nn::feed_forward(
            &x,
            &layer.intermediate,
            self.activation.fused(),
            &layer.output,
            recompute(SITE_INTERMEDIATE),
        )?;
        add_norm(
            &out,
            &x,
            &layer.output_norm,
            self.hidden_dropout.mask(ctx, id, site::FEED_FORWARD_OUTPUT),
            SITE_OUTPUT_NORM,
        )
    }

    fn sites(&self) -> &'static [&'static str] {
        &SITES
    }

    fn head(&self, x: &Tensor, aux: &BertAux, _: &Ctx) -> Result<Tensor> {
        let x = &x.to_dtype(aux.mask.dtype())?;
        self.options
            .pooling
            .pool(x, &aux.mask, self.options.normalize)
    }
}

/// A BERT model as a gradient-cache tower, with its checkpointing policy.
pub type BertEncoder = Recomputed<Bert>;

impl Recomputed<Bert> {
    /// Builds a BERT tower over `store` (names under `prefix`, `""` for a shared tower):
    /// variables the store serves from a weights file are loaded, others are initialised
    /// from the store's seed.
    pub fn build(
        store: &ParamStore,
        prefix: &str,
        cfg: &BertConfig,
        options: &BertOptions,
    ) -> Result<Self> {
        let tower = Tower::build(store, prefix, |vb| Bert::new(cfg, options, vb))?;
        Recomputed::new(tower, options.recompute.clone())
    }
}

/// Loads a pretrained BERT tower from a model's files into `store` under `prefix` (`""`
/// for a shared tower). Weight names may carry the `bert.` prefix of Hugging Face
/// `BertFor...` checkpoints or not. Returns the encoder, its config, and the store (which
/// now reads those names from the weights file).
pub fn load_pretrained(
    files: &ModelFiles,
    prefix: &str,
    options: &BertOptions,
    store: ParamStore,
) -> Result<(BertEncoder, BertConfig, ParamStore)> {
    let cfg = BertConfig::from_file(&files.config)?;
    let probe = WeightFile::open(&files.weights, "")?;
    // `BertFor...` / `RobertaFor...` checkpoints keep the encoder under its base name.
    let file_prefix = ["bert.", "roberta."]
        .into_iter()
        .find(|p| probe.contains(&format!("{p}embeddings.word_embeddings.weight")))
        .unwrap_or("");
    let file = Arc::new(WeightFile::open(&files.weights, file_prefix)?);
    let store = store.with_weights(prefix, file);
    let encoder = BertEncoder::build(&store, prefix, &cfg, options)?;
    Ok((encoder, cfg, store))
}
