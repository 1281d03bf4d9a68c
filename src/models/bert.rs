//! A trainable BERT-family encoder ([`Family`]): BERT, MiniLM and other `BertModel`
//! checkpoints; the RoBERTa family (RoBERTa, XLM-RoBERTa, CamemBERT), whose layers are
//! BERT's and whose positions start past the padding index; and MPNet, BERT's layers under
//! other names with a relative position bias on the attention scores. ModernBERT's layers
//! (`super::modernbert`) and the decoder embedders' (`super::decoder`: Qwen3, Qwen2,
//! Llama, Mistral, Gemma3) replace BERT's in the same stack, so every family shares the
//! tower, its recompute policies, pooling and `Dense` head.
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

pub use super::bert_config::{
    Activation, BertConfig, DecoderKind, DecoderSettings, Family, RotaryKind, RotarySettings,
    TaskAdapters, SUPPORTED_FAMILIES,
};
use super::classifier::ClassifierHead;
pub use super::classifier::ClassifierSpec;
use super::deberta::{Disentangled, RelativeAux};
use super::decoder::{Decoder, DecoderAux};
use super::dense::Dense;
pub use super::dense::{DenseActivation, DenseSpec};
use super::modernbert::{ModernAux, ModernBert};
pub use super::pooling::Pooling;
use super::rotary_encoder::{RotaryAux, RotaryEncoder};
use super::sparse::MlmHead;
pub use super::sparse::{SparseSpec, SpladeActivation, SpladeStrategy};

mod build;
pub use build::{
    check_classifier, check_mlm_head, create_classifier, create_dense, create_mlm_head,
    load_pretrained, with_model_weights,
};

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
    /// sentence-transformers `Dense` modules after the pooling, in order, trained with the
    /// encoder (the normalisation, if any, comes after them).
    pub dense: Vec<DenseSpec>,
    /// LoRA adapters on the attention and feed-forward projections (the store freezes the
    /// rest: [`crate::params::Freeze::all_but_adapters`]).
    pub lora: Option<crate::nn::lora::LoraSpec>,
    /// A multi-vector (ColBERT) head: a token vector per kept token instead of a pooled
    /// vector; its batches must be multi-vector ones ([`crate::batch::TokenVectors`]).
    pub multi_vector: bool,
    /// A sparse (SPLADE) head: the masked-language model's logits pooled into one
    /// vocabulary-wide vector instead of the pooling, `Dense` modules and normalisation.
    pub sparse: Option<SparseSpec>,
    /// A cross-encoder's classification head ([`ClassifierHead`]): the family's
    /// `*ForSequenceClassification` head over the pair's hidden states, `[n, labels]`
    /// logits instead of the pooling, `Dense` modules and normalisation.
    pub classifier: Option<ClassifierSpec>,
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

/// The sites of a decoder layer that selective recompute can recompute: the attention
/// probabilities (the same index as BERT's).
pub const DECODER_SITES: [&str; 1] = ["attention.probs"];
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
    /// Absolute positions (none in DeBERTa-v3: `position_biased_input: false`).
    positions: Option<Embedding>,
    /// BERT and RoBERTa have token types; MPNet has none.
    token_types: Option<Embedding>,
    norm: LayerNorm,
}

/// MPNet's relative position bias: `buckets` learned values per head
/// (`encoder.relative_attention_bias`, `[buckets, heads]`), shared by every layer.
struct RelativeBias {
    table: Embedding,
    buckets: usize,
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
    /// BERT's embeddings (`None` for ModernBERT, whose layers hold their own).
    embeddings: Option<Embeddings>,
    layers: Vec<Layer>,
    /// ModernBERT's embeddings and layers, which then replace BERT's.
    modern: Option<Box<ModernBert>>,
    /// A decoder's embeddings and layers, which then replace BERT's.
    decoder: Option<Box<Decoder>>,
    /// NomicBERT's, GTE's or Jina v3's embeddings and layers, which then replace BERT's.
    rotary: Option<Box<RotaryEncoder>>,
    relative_bias: Option<RelativeBias>,
    /// DeBERTa's disentangled attention (relative embeddings shared by every layer).
    disentangled: Option<Disentangled>,
    heads: usize,
    /// The position of the first token (see [`BertConfig::first_position`]).
    first_position: usize,
    max_positions: usize,
    activation: Activation,
    hidden_dropout: Dropout,
    attention_dropout: Dropout,
    /// Dropout on the attention's output projection: the hidden dropout, none in
    /// DistilBERT.
    attention_output_dropout: Dropout,
    options: BertOptions,
    /// The `Dense` modules after the pooling.
    dense: Vec<Dense>,
    /// A sparse model's MLM head (then the pooling, `Dense` and normalisation are not).
    sparse: Option<MlmHead>,
    /// A cross-encoder's classification head (then the pooling, `Dense` and normalisation
    /// are not).
    classifier: Option<ClassifierHead>,
}

/// Per-chunk data every layer reads: the additive attention bias `[n, 1, 1, s]` and the
/// pooling's token mask `[n, s]` as floats (the real tokens, less a prompt left out of the
/// pooling).
pub struct BertAux {
    bias: Tensor,
    mask: Tensor,
    /// ModernBERT's rotary tables.
    modern: Option<ModernAux>,
    /// A decoder's positions and rotary tables.
    decoder: Option<DecoderAux>,
    /// The rotary tables of NomicBERT, GTE or Jina v3.
    rotary: Option<RotaryAux>,
    /// Only the pooled token's output of the last layer is read (a decoder under
    /// last-token pooling, on the way to the head; never for [`Bert::hidden_states`]).
    last_token_only: bool,
    /// Each sequence's first real token (where the pooling's positions count from).
    first: Vec<usize>,
    /// Each sequence's first and last pooled position (`(0, 0)` for none), from the
    /// batch's host mask.
    kept: Vec<(usize, usize)>,
    /// MPNet's relative position bucket of every (query, key) pair `[s s]`.
    buckets: Option<Tensor>,
    /// DeBERTa's relative embedding row of every (query, key) pair.
    relative: Option<RelativeAux>,
    /// A multi-vector batch: the kept tokens `[n, s]` (in the head's dtype) and the token
    /// vectors each row's output is padded to.
    vectors: Option<(Tensor, usize)>,
}

impl Bert {
    /// The last hidden state `[n, s, hidden]` (no pooling).
    pub fn hidden_states(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        let mut aux = self.aux(input)?;
        // Every token's state is the result here, not the pooled one's alone.
        aux.last_token_only = false;
        let mut x = self.embed(input, &aux, ctx)?;
        for i in 0..self.num_layers() {
            x = self.layer(i, &x, &aux, ctx)?;
        }
        self.final_norm(&x)
    }

    /// The final norm of the pre-norm families (ModernBERT, the decoders); BERT's layers
    /// end normalised.
    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.modern, &self.decoder) {
            (Some(m), _) => m.final_norm(x),
            (_, Some(d)) => d.final_norm(x),
            _ => Ok(x.clone()),
        }
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
            window: None,
        };
        let at = |l: &Linear, p: u32| l.at(ctx.mask_seed(layer_id(i), crate::nn::lora::site(p)));
        let (q, k, v) = (at(&layer.query, 0), at(&layer.key, 1), at(&layer.value, 2));
        let projections = [&q, &k, &v];
        if let (Some(d), Some(relative)) = (&self.disentangled, &aux.relative) {
            let spec = crate::nn::AttentionSpec {
                scale: d.scale(head_dim),
                ..spec
            };
            return crate::nn::self_attention_scored(
                x,
                projections,
                self.heads,
                &spec,
                |qh, kh| d.score_bias((i, layer_id(i)), (qh, kh), (&q, &k), relative, ctx),
            );
        }
        match (&self.relative_bias, &aux.buckets) {
            (Some(relative), Some(buckets)) => {
                let bias = relative.scores_bias(buckets, x.dim(1)?)?;
                crate::nn::self_attention_biased(x, projections, self.heads, &spec, &bias)
            }
            _ => crate::nn::self_attention(x, projections, self.heads, &spec),
        }
    }
}

impl Bert {
    /// A multi-vector (ColBERT) head: every token's state through the `Dense` modules,
    /// L2-normalised per token (with `normalize`), the tokens `keep` `[n, s]` drops set to
    /// zero vectors, padded with zero vectors to `width` tokens and flattened to `[n,
    /// width * dim]` (the layout [`crate::loss::MaxSim`] scores).
    fn token_vectors(&self, x: &Tensor, keep: &Tensor, width: usize) -> Result<Tensor> {
        let mut y = x.clone();
        for dense in &self.dense {
            y = dense.forward(&y)?;
        }
        if self.options.normalize {
            y = crate::nn::l2_normalize_rows(&y)?;
        }
        let y = y.broadcast_mul(&keep.unsqueeze(2)?)?;
        let (n, s, d) = y.dims3()?;
        let y = match width.checked_sub(s) {
            Some(0) => y,
            Some(pad) => Tensor::cat(
                &[&y, &Tensor::zeros((n, pad, d), y.dtype(), y.device())?],
                1,
            )?,
            None => {
                return Err(Error::SequenceTooLong { len: s, max: width });
            }
        };
        Ok(y.reshape((n, width * d))?)
    }

    /// Layer `i` as one node with its backward written out
    /// ([`crate::nn::cpu::encoder_layer`]), where the fused kernels run: the same arithmetic as
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
        // The projections with their adapters' masks of this forward: each adapter's
        // low-rank branch runs inside the node, beside its frozen base weight.
        let projections = [
            &layer.query,
            &layer.key,
            &layer.value,
            &layer.attention_output,
            &layer.intermediate,
            &layer.output,
        ];
        let lora = std::array::from_fn(|p| {
            projections[p]
                .at(ctx.mask_seed(id, crate::nn::lora::site(p as u32)))
                .lora_input()
        });
        let [q, k, v, o, up, down] = projections;
        let weights = crate::nn::cpu::encoder_layer::LayerWeights {
            qkv: [q.base_weight(), k.base_weight(), v.base_weight()],
            qkv_bias: [bq, bk, bv],
            attention_output: (o.base_weight(), bo),
            attention_norm: (layer.attention_norm.weight(), layer.attention_norm.bias()),
            intermediate: (up.base_weight(), bi),
            output: (down.base_weight(), bd),
            output_norm: (layer.output_norm.weight(), layer.output_norm.bias()),
            lora,
        };
        let spec = crate::nn::cpu::encoder_layer::LayerSpec {
            heads: self.heads,
            act: self.activation.fused(),
            eps: layer.attention_norm.eps(),
            attention: crate::nn::AttentionSpec {
                bias: aux.bias.clone(),
                scale: match &self.disentangled {
                    Some(d) => d.scale(head_dim),
                    None => 1.0 / (head_dim as f64).sqrt(),
                },
                dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS),
                recompute: recompute(SITE_ATTENTION_PROBS),
                window: None,
            },
            attention_output_dropout: self.attention_output_dropout.mask(
                ctx,
                id,
                site::ATTENTION_OUTPUT,
            ),
            output_dropout: self.hidden_dropout.mask(ctx, id, site::FEED_FORWARD_OUTPUT),
            recompute_attention_norm: recompute(SITE_ATTENTION_NORM),
            recompute_intermediate: recompute(SITE_INTERMEDIATE),
            recompute_output_norm: recompute(SITE_OUTPUT_NORM),
            score_bias: match (&self.relative_bias, &aux.buckets) {
                (Some(relative), Some(buckets)) => Some(relative.scores_bias(buckets, x.dim(1)?)?),
                _ => None,
            },
            relative: match (&self.disentangled, &aux.relative) {
                (Some(d), Some(relative)) => {
                    let at = |l: &Linear, p: u32| l.at(ctx.mask_seed(id, crate::nn::lora::site(p)));
                    let (query, key) = (at(&layer.query, 0), at(&layer.key, 1));
                    let (key, query) =
                        d.positions((i, id), (&query, &key), (x.dtype(), relative), ctx)?;
                    Some(crate::nn::cpu::encoder_layer::RelativeSpec {
                        key,
                        query,
                        index: Disentangled::index_rows(relative),
                    })
                }
                _ => None,
            },
        };
        if layer.output_norm.eps() != spec.eps {
            return Ok(None);
        }
        crate::nn::encoder_layer(x, &weights, &spec)
    }
}

impl RelativeBias {
    /// The bucket of every (query, key) pair of a sequence of `s` tokens, `[s s]` (one per
    /// chunk: every layer reads it).
    fn buckets(&self, s: usize) -> Result<Tensor> {
        let buckets: Vec<u32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| (i, j)))
            .map(|(i, j)| relative_bucket(j as i64 - i as i64, self.buckets, 128) as u32)
            .collect();
        Ok(Tensor::from_vec(
            buckets,
            s * s,
            self.table.embeddings().device(),
        )?)
    }

    /// The bias the attention scores get, `[1, heads, s, s]`: the learned value of the
    /// bucket of each (query, key) distance (`buckets` from [`Self::buckets`]). Looked up
    /// in every layer, so each layer's use of the table is in its own graph.
    fn scores_bias(&self, buckets: &Tensor, s: usize) -> Result<Tensor> {
        let values = self.table.forward(buckets)?; // [s s, heads]
        let heads = values.dim(1)?;
        Ok(values.t()?.reshape((1, heads, s, s))?)
    }
}

/// MPNet's (and T5's) bucket of a relative position `key - query`: half the buckets for
/// keys before the query, half for keys after; within each, exact distances below a
/// quarter of the buckets, then logarithmically wider buckets up to `max_distance`. The
/// arithmetic of `MPNetEncoder.relative_position_bucket`, in f32 as PyTorch runs it.
pub fn relative_bucket(relative: i64, buckets: usize, max_distance: usize) -> usize {
    let half = buckets / 2;
    let n = -relative;
    let mut bucket = if n < 0 { half } else { 0 };
    let n = n.unsigned_abs() as usize;
    let max_exact = half / 2;
    bucket += if n < max_exact {
        n
    } else {
        let ratio = (n as f32 / max_exact as f32).ln()
            / ((max_distance as f64 / max_exact as f64).ln() as f32);
        let large = max_exact + (ratio * (half - max_exact) as f32) as usize;
        large.min(half - 1)
    };
    bucket
}

/// Dropout layer ids: 0 for the embeddings, `i + 1` for transformer layer `i`.
fn layer_id(i: usize) -> u32 {
    i as u32 + 1
}

impl LayerStack for Bert {
    type Input = TokenBatch;
    type Aux = BertAux;

    fn aux(&self, input: &TokenBatch) -> Result<BertAux> {
        let dtype = match (&self.modern, &self.decoder, &self.embeddings, &self.rotary) {
            (Some(m), _, _, _) => m.dtype(),
            (_, Some(d), _, _) => d.dtype(),
            (_, _, Some(e), _) => e.norm.dtype(),
            (_, _, _, Some(r)) => r.dtype(),
            _ => candle_core::DType::F32,
        };
        let mask = input.attention_mask.to_dtype(dtype)?;
        // -10000 for padding, 0 for real tokens: finite in f16, bf16 and f32, and exp()
        // of it underflows to exactly 0 next to any real score.
        let unattended = (mask.ones_like()? - &mask)?;
        let mut bias = (&unattended * crate::nn::MASKED_BIAS)?;
        let vectors = match &input.vectors {
            Some(v) => {
                let keep = v.keep.to_dtype(dtype)?;
                // A kept token no one attends to (query expansion): a key bias that
                // still underflows to an exact 0 weight, above the padding's, so its row
                // is computed (see `crate::nn::UNATTENDED_BIAS`).
                let lift = crate::nn::UNATTENDED_BIAS - crate::nn::MASKED_BIAS;
                bias = (bias + ((&keep * &unattended)? * lift)?)?;
                Some((keep, v.width))
            }
            None => None,
        };
        let bias = bias.unsqueeze(1)?.unsqueeze(1)?;
        let modern = match &self.modern {
            Some(m) => Some(m.aux(&bias)?),
            None => None,
        };
        let layers = match self.options.precision {
            Precision::F32 => dtype,
            half => half.dtype(),
        };
        let decoder = match &self.decoder {
            Some(d) => Some(d.aux(input, layers)?),
            None => None,
        };
        let rotary = match &self.rotary {
            Some(r) => Some(r.aux(input, layers)?),
            None => None,
        };
        // The pooling's mask: the prompt (with the special token before it) left out when
        // the batch says so, counted from each sequence's first real token (the padding
        // may be on the left); the attention still sees every real token.
        let rows = input.mask_rows()?;
        let first: Vec<usize> = rows
            .iter()
            .map(|r| r.iter().position(|&m| m != 0).unwrap_or(0))
            .collect();
        let kept: Vec<(usize, usize)> = rows
            .iter()
            .zip(&first)
            .map(|(r, &f)| {
                let pooled = |t: usize| r[t] != 0 && t >= f + input.pool_from;
                let first = (0..r.len()).find(|&t| pooled(t));
                let last = (0..r.len()).rev().find(|&t| pooled(t));
                (first.unwrap_or(0), last.unwrap_or(0))
            })
            .collect();
        let mask = if input.pool_from > 0 {
            let s = mask.dim(1)?;
            let keep: Vec<f32> = first
                .iter()
                .flat_map(|&f| (0..s).map(move |t| f32::from(u8::from(t >= f + input.pool_from))))
                .collect();
            let keep = Tensor::from_vec(keep, (rows.len(), s), mask.device())?.to_dtype(dtype)?;
            (mask * keep)?
        } else {
            mask
        };
        let buckets = match &self.relative_bias {
            Some(relative) => Some(relative.buckets(mask.dim(1)?)?),
            None => None,
        };
        let relative = self
            .disentangled
            .as_ref()
            .map(|d| d.aux(input.input_ids.dims2().map_or(0, |(_, s)| s)));
        Ok(BertAux {
            relative,
            bias,
            mask,
            last_token_only: decoder.is_some()
                && self.options.pooling == Pooling::LastToken
                && vectors.is_none(),
            modern,
            decoder,
            rotary,
            first,
            kept,
            buckets,
            vectors,
        })
    }

    fn embed(&self, input: &TokenBatch, _: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        let s = input.input_ids.dim(1)?;
        if s > self.max_positions {
            return Err(Error::SequenceTooLong {
                len: s,
                max: self.max_positions,
            });
        }
        if let Some(r) = &self.rotary {
            return r.embed(input, self.options.precision, ctx);
        }
        let e = match (&self.modern, &self.decoder, &self.embeddings) {
            (Some(m), _, _) => return m.embed(input, self.options.precision, ctx),
            (_, Some(d), _) => return d.embed(input, self.options.precision),
            (_, _, Some(e)) => e,
            _ => {
                return Err(Error::InvalidArgument {
                    what: "model",
                    value: "no embeddings".into(),
                    reason: "a BERT has embeddings, ModernBERT or decoder layers",
                })
            }
        };
        let dropout = self.hidden_dropout.mask(ctx, 0, site::EMBEDDINGS);
        if let (Precision::F32, Some(types), Some(positions)) =
            (self.options.precision, &e.token_types, &e.positions)
        {
            let fused = crate::nn::embeddings(
                [&input.input_ids, &input.token_type_ids],
                [
                    e.words.embeddings(),
                    types.embeddings(),
                    positions.embeddings(),
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
        let words = e.words.forward(&input.input_ids)?;
        let words = match &e.token_types {
            Some(types) => words.add(&types.forward(&input.token_type_ids)?)?,
            None => words,
        };
        let x = match &e.positions {
            Some(table) => words.broadcast_add(&table.forward(&positions)?)?,
            None => words,
        };
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
        match (&self.modern, &self.decoder, &self.rotary) {
            (Some(m), _, _) => m.num_layers(),
            (_, Some(d), _) => d.num_layers(),
            (_, _, Some(r)) => r.num_layers(),
            _ => self.layers.len(),
        }
    }

    fn layer(&self, i: usize, x: &Tensor, aux: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        if let (Some(d), Some(decoder_aux)) = (&self.decoder, &aux.decoder) {
            let probs = ctx.recompute.recomputes(SITE_ATTENTION_PROBS);
            let last = aux.last_token_only && i + 1 == d.num_layers();
            return d.layer(i, x, &aux.bias, decoder_aux, (probs, last), ctx);
        }
        if let (Some(r), Some(rotary_aux)) = (&self.rotary, &aux.rotary) {
            return r.layer(i, x, &aux.bias, rotary_aux, ctx);
        }
        if let (Some(m), Some(modern_aux)) = (&self.modern, &aux.modern) {
            let probs = ctx.recompute.recomputes(SITE_ATTENTION_PROBS);
            return m.layer(i, x, &aux.bias, modern_aux, probs, ctx);
        }
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
        let at = |l: &Linear, p: u32| l.at(ctx.mask_seed(id, crate::nn::lora::site(p)));
        let attended =
            at(&layer.attention_output, 3).forward(&self.self_attention(i, x, aux, ctx)?)?;
        let x = add_norm(
            &attended,
            x,
            &layer.attention_norm,
            self.attention_output_dropout
                .mask(ctx, id, site::ATTENTION_OUTPUT),
            SITE_ATTENTION_NORM,
        )?;
        let out = crate::nn::feed_forward(
            &x,
            &at(&layer.intermediate, 4),
            self.activation.fused(),
            &at(&layer.output, 5),
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
        match (&self.decoder, &self.rotary) {
            (Some(_), _) => &DECODER_SITES,
            (_, Some(r)) => r.sites(),
            _ => &SITES,
        }
    }

    fn head(&self, x: &Tensor, aux: &BertAux, ctx: &Ctx) -> Result<Tensor> {
        let x = &x.to_dtype(aux.mask.dtype())?;
        let x = &self.final_norm(x)?;
        match (&aux.vectors, self.options.multi_vector) {
            (Some((keep, width)), true) => return self.token_vectors(x, keep, *width),
            (None, false) => {}
            (vectors, _) => {
                return Err(Error::InvalidArgument {
                    what: "token batch",
                    value: format!("multi-vector rows: {}", vectors.is_some()),
                    reason: "a multi-vector (ColBERT) model takes multi-vector batches (a \
                             tokenizer with_vectors) and a pooled model plain ones",
                })
            }
        }
        if let Some(head) = &self.sparse {
            return head.pool(x, &aux.mask);
        }
        if let Some(head) = &self.classifier {
            return head.forward(x, &aux.mask, (&aux.first, &aux.kept), ctx);
        }
        let pooling = self.options.pooling;
        if self.dense.is_empty() {
            return pooling.pool(x, &aux.mask, &aux.first, &aux.kept, self.options.normalize);
        }
        let mut y = pooling.pool(x, &aux.mask, &aux.first, &aux.kept, false)?;
        for dense in &self.dense {
            y = dense.forward(&y)?;
        }
        if self.options.normalize {
            y = crate::nn::l2_normalize(&y)?;
        }
        Ok(y)
    }
}

/// A BERT model as a gradient-cache tower, with its checkpointing policy.
pub type BertEncoder = Recomputed<Bert>;
