//! ModernBERT's layers (Warner et al. 2024), with Hugging Face `ModernBertModel` names:
//! token embeddings and a norm (no positions, no token types), pre-norm layers without
//! biases (the first layer's attention norm is the identity), a fused query-key-value
//! projection `attn.Wqkv`, rotary position embeddings on the queries and keys with a base
//! per layer type, global attention or attention within a sliding window (`|i - j| <=
//! local_attention / 2`) as the config's layer types say, a GeGLU feed-forward
//! (`mlp.Wi` gives the input and the gate, `act(input) * gate`, then `mlp.Wo`), and a
//! final norm.
//!
//! [`Bert`](super::bert::Bert) runs it as its layer stack when the config's `model_type`
//! is `modernbert`, so the gradient cache, recompute policies, dtypes, export and the
//! distributed backends are those of every family. The attention of both layer types
//! runs on the fused CPU kernel (the window is one of its parameters); the rotary product
//! and the GeGLU are fused nodes too ([`crate::nn::rotary`], [`crate::nn::glu`]).

use candle_core::{DType, Tensor};
use candle_nn::{Embedding, Init, Module, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
use crate::nn::cpu::prenorm_layer::{PreNormSpec, PreNormWeights};
use crate::nn::lora::LoraSpec;
use crate::nn::{AttentionSpec, LayerNorm, Linear};
use crate::precision::Precision;
use crate::Result;

use super::bert_config::{Activation, BertConfig, ModernSettings};

/// Dropout sites of a layer (the `site` of a mask seed), as BERT's.
mod site {
    pub const EMBEDDINGS: u32 = 0;
    pub const ATTENTION_PROBS: u32 = 1;
    pub const ATTENTION_OUTPUT: u32 = 2;
    pub const FEED_FORWARD: u32 = 3;
}

struct Layer {
    /// `None` for the first layer (the identity).
    attn_norm: Option<LayerNorm>,
    wqkv: Linear,
    wo: Linear,
    mlp_norm: LayerNorm,
    wi: Linear,
    mlp_wo: Linear,
    sliding: bool,
}

/// ModernBERT's embeddings and layers.
pub(super) struct ModernBert {
    tokens: Embedding,
    norm: LayerNorm,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    heads: usize,
    activation: Activation,
    global_theta: f64,
    local_theta: f64,
    half_window: usize,
    embedding_dropout: Dropout,
    attention_dropout: Dropout,
    mlp_dropout: Dropout,
}

/// Per-chunk data of ModernBERT's layers: the rotary tables of each layer type.
pub(super) struct ModernAux {
    /// `(cos, sin)` `[s, head_dim]` for the global layers.
    global: (Tensor, Tensor),
    /// The same for the sliding-window layers.
    local: (Tensor, Tensor),
}

fn norm(h: usize, s: &ModernSettings, vb: VarBuilder) -> Result<LayerNorm> {
    if s.norm_bias {
        LayerNorm::new(h, s.norm_eps, vb)
    } else {
        LayerNorm::without_bias(h, s.norm_eps, vb)
    }
}

impl ModernBert {
    /// Builds the layers under `vb`. Fresh weights: normal(0, `initializer_range`).
    pub(super) fn new(
        cfg: &BertConfig,
        s: &ModernSettings,
        lora: Option<&LoraSpec>,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (h, std) = (cfg.hidden_size, cfg.initializer_range);
        let inter = cfg.intermediate_size;
        let init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let e = vb.pp("embeddings");
        let tokens = Embedding::new(
            e.pp("tok_embeddings")
                .get_with_hints((cfg.vocab_size, h), "weight", init)?,
            h,
        );
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("layers.{i}"));
                Ok(Layer {
                    attn_norm: if i == 0 {
                        None
                    } else {
                        Some(norm(h, s, l.pp("attn_norm"))?)
                    },
                    wqkv: Linear::projection(
                        (h, 3 * h, s.attention_bias),
                        std,
                        lora,
                        l.pp("attn").pp("Wqkv"),
                    )?,
                    wo: Linear::projection(
                        (h, h, s.attention_bias),
                        std,
                        lora,
                        l.pp("attn").pp("Wo"),
                    )?,
                    mlp_norm: norm(h, s, l.pp("mlp_norm"))?,
                    wi: Linear::projection(
                        (h, 2 * inter, s.mlp_bias),
                        std,
                        lora,
                        l.pp("mlp").pp("Wi"),
                    )?,
                    mlp_wo: Linear::projection(
                        (inter, h, s.mlp_bias),
                        std,
                        lora,
                        l.pp("mlp").pp("Wo"),
                    )?,
                    sliding: s.sliding[i],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let [emb, attn, mlp] = s.dropout;
        Ok(Self {
            tokens,
            norm: norm(h, s, e.pp("norm"))?,
            layers,
            final_norm: norm(h, s, vb.pp("final_norm"))?,
            heads: cfg.num_attention_heads,
            activation: s.activation,
            global_theta: s.global_theta,
            local_theta: s.local_theta,
            half_window: s.half_window,
            embedding_dropout: Dropout::new(emb as f32)?,
            attention_dropout: Dropout::new(attn as f32)?,
            mlp_dropout: Dropout::new(mlp as f32)?,
        })
    }

    pub(super) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub(super) fn dtype(&self) -> DType {
        self.norm.dtype()
    }

    /// The rotary tables of a chunk whose key mask is `key_bias` `[n, 1, 1, s]`.
    pub(super) fn aux(&self, key_bias: &Tensor) -> Result<ModernAux> {
        let s = key_bias.dim(3)?;
        let dtype = key_bias.dtype();
        let device = key_bias.device();
        let head_dim = self.norm.weight().dim(0)? / self.heads;
        let rope = |theta: f64| -> Result<(Tensor, Tensor)> {
            let half = head_dim / 2;
            let mut cos = Vec::with_capacity(s * head_dim);
            let mut sin = Vec::with_capacity(s * head_dim);
            for t in 0..s {
                let angles: Vec<f32> = (0..half)
                    .map(|i| {
                        let inv = (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32;
                        t as f32 * inv
                    })
                    .collect();
                for _ in 0..2 {
                    cos.extend(angles.iter().map(|a| a.cos()));
                    sin.extend(angles.iter().map(|a| a.sin()));
                }
            }
            Ok((
                Tensor::from_vec(cos, (s, head_dim), device)?.to_dtype(dtype)?,
                Tensor::from_vec(sin, (s, head_dim), device)?.to_dtype(dtype)?,
            ))
        };
        Ok(ModernAux {
            global: rope(self.global_theta)?,
            local: rope(self.local_theta)?,
        })
    }

    /// `dropout(norm(tokens[ids]))`, in the layers' dtype.
    pub(super) fn embed(
        &self,
        input: &TokenBatch,
        precision: Precision,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let x = self.norm.forward(&self.tokens.forward(&input.input_ids)?)?;
        let x = match precision {
            Precision::F32 => x,
            half => x.to_dtype(half.dtype())?,
        };
        self.embedding_dropout.forward(&x, ctx, 0, site::EMBEDDINGS)
    }

    /// Layer `i`: `x + Wo(attention(rope(Wqkv(norm(x)))))`, then `x + mlp(norm(x))`.
    pub(super) fn layer(
        &self,
        i: usize,
        x: &Tensor,
        key_bias: &Tensor,
        aux: &ModernAux,
        recompute_probs: bool,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        if let Some(y) = self.whole_layer(i, x, key_bias, aux, recompute_probs, ctx)? {
            return Ok(y);
        }
        let layer = &self.layers[i];
        let id = i as u32 + 1;
        let (n, s, h) = x.dims3()?;
        let d = h / self.heads;
        let normed = match &layer.attn_norm {
            Some(norm) => norm.forward(x)?,
            None => x.clone(),
        };
        let [wqkv, wo, wi, mlp_wo] = self.projections(i, ctx);
        let qkv = wqkv.forward(&normed)?.reshape((n, s, 3, self.heads, d))?;
        let part = |k: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, k, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let (cos, sin) = self.rotary_tables(i, aux);
        let rotary = crate::nn::rotary;
        let (q, k) = (rotary(&q, cos, sin)?, rotary(&k, cos, sin)?);
        let spec = self.attention_spec(i, d, key_bias, recompute_probs, ctx);
        let attended = crate::nn::attention(&q, &k, &v, &spec)?;
        let attended = attended.transpose(1, 2)?.reshape((n, s, h))?;
        let out = wo.forward(&attended)?;
        let out = self
            .attention_dropout
            .forward(&out, ctx, id, site::ATTENTION_OUTPUT)?;
        let x = (x + out)?;
        let up = wi.forward(&layer.mlp_norm.forward(&x)?)?;
        let gated = crate::nn::glu(&up, self.activation.fused())?;
        let hidden = self
            .mlp_dropout
            .forward(&gated, ctx, id, site::FEED_FORWARD)?;
        Ok((x + mlp_wo.forward(&hidden)?)?)
    }

    /// Layer `i`'s projections (`Wqkv`, `Wo`, `Wi`, the feed-forward's `Wo`) with their
    /// adapters' dropout masks of this forward.
    fn projections(&self, i: usize, ctx: &Ctx) -> [Linear; 4] {
        let layer = &self.layers[i];
        let all = [&layer.wqkv, &layer.wo, &layer.wi, &layer.mlp_wo];
        std::array::from_fn(|p| {
            all[p].at(ctx.mask_seed(i as u32 + 1, crate::nn::lora::site(p as u32)))
        })
    }

    /// The rotary tables of layer `i`'s type.
    fn rotary_tables<'a>(&self, i: usize, aux: &'a ModernAux) -> &'a (Tensor, Tensor) {
        if self.layers[i].sliding {
            &aux.local
        } else {
            &aux.global
        }
    }

    /// Layer `i`'s attention over heads of `d` dimensions: the key mask, dropout on the
    /// probabilities, and the window of a local layer.
    fn attention_spec(
        &self,
        i: usize,
        d: usize,
        key_bias: &Tensor,
        recompute_probs: bool,
        ctx: &Ctx,
    ) -> AttentionSpec {
        let id = i as u32 + 1;
        AttentionSpec {
            bias: key_bias.clone(),
            scale: 1.0 / (d as f64).sqrt(),
            dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS),
            recompute: recompute_probs,
            window: self.layers[i].sliding.then_some(self.half_window),
        }
    }

    /// Layer `i` as one node with its backward written out
    /// ([`crate::nn::cpu::prenorm_layer`]) where the fused kernels run: the arithmetic of
    /// [`Self::layer`]'s ops on the packed real tokens. `None` elsewhere.
    fn whole_layer(
        &self,
        i: usize,
        x: &Tensor,
        key_bias: &Tensor,
        aux: &ModernAux,
        recompute_probs: bool,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let layer = &self.layers[i];
        let id = i as u32 + 1;
        let d = x.dim(2)? / self.heads;
        // Each adapter's low-rank branch runs inside the node, beside its frozen base.
        let projections = self.projections(i, ctx);
        let [qkv, wo, wi, mlp_wo] = &projections;
        fn affine(l: &Linear) -> (&Tensor, Option<&Tensor>) {
            (l.base_weight(), l.bias())
        }
        let weights = PreNormWeights {
            attention_norm: layer.attn_norm.as_ref().map(|n| (n.weight(), n.shift())),
            qkv: affine(qkv),
            attention_output: affine(wo),
            mlp_norm: (layer.mlp_norm.weight(), layer.mlp_norm.shift()),
            up: affine(wi),
            down: affine(mlp_wo),
            lora: std::array::from_fn(|p| projections[p].lora_input()),
        };
        let (cos, sin) = self.rotary_tables(i, aux);
        let spec = PreNormSpec {
            heads: self.heads,
            act: self.activation.fused(),
            eps: layer.mlp_norm.eps(),
            attention: self.attention_spec(i, d, key_bias, recompute_probs, ctx),
            rotary: (cos.clone(), sin.clone()),
            attention_output_dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_OUTPUT),
            mlp_dropout: self.mlp_dropout.mask(ctx, id, site::FEED_FORWARD),
        };
        crate::nn::prenorm_layer(x, &weights, &spec)
    }

    /// The final norm, before the pooling.
    pub(super) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.final_norm.forward(x)
    }
}
