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
//! distributed backends are those of every family. The rotary product, the window mask
//! and the GeGLU run as composed ops; the global layers' attention runs on the fused CPU
//! kernel.

use candle_core::{DType, Tensor, D};
use candle_nn::{Embedding, Init, Module, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
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
    intermediate: usize,
    activation: Activation,
    global_theta: f64,
    local_theta: f64,
    half_window: usize,
    embedding_dropout: Dropout,
    attention_dropout: Dropout,
    mlp_dropout: Dropout,
}

/// Per-chunk data of ModernBERT's layers: the rotary tables of each layer type and the
/// sliding-window mask with the key mask folded in.
pub(super) struct ModernAux {
    /// `(cos, sin)` `[s, head_dim]` for the global layers.
    global: (Tensor, Tensor),
    /// The same for the sliding-window layers.
    local: (Tensor, Tensor),
    /// `[n, 1, s, s]`: -10000 outside the window or on padding keys, else 0.
    window_bias: Tensor,
}

fn linear(i: usize, o: usize, bias: bool, std: f64, vb: VarBuilder) -> Result<Linear> {
    if bias {
        Linear::normal(i, o, std, vb)
    } else {
        Linear::normal_without_bias(i, o, std, vb)
    }
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
    pub(super) fn new(cfg: &BertConfig, s: &ModernSettings, vb: VarBuilder) -> Result<Self> {
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
                    wqkv: linear(h, 3 * h, s.attention_bias, std, l.pp("attn").pp("Wqkv"))?,
                    wo: linear(h, h, s.attention_bias, std, l.pp("attn").pp("Wo"))?,
                    mlp_norm: norm(h, s, l.pp("mlp_norm"))?,
                    wi: linear(h, 2 * inter, s.mlp_bias, std, l.pp("mlp").pp("Wi"))?,
                    mlp_wo: linear(inter, h, s.mlp_bias, std, l.pp("mlp").pp("Wo"))?,
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
            intermediate: inter,
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

    /// The rotary tables and the window mask of a chunk whose key mask is `key_bias`
    /// `[n, 1, 1, s]`.
    pub(super) fn aux(&self, key_bias: &Tensor) -> Result<ModernAux> {
        let (n, _, _, s) = key_bias.dims4()?;
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
        let w = self.half_window;
        let window: Vec<f32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| if i.abs_diff(j) <= w { 0.0 } else { -10000.0 }))
            .collect();
        let window = Tensor::from_vec(window, (1, 1, s, s), device)?.to_dtype(dtype)?;
        let window_bias = window
            .broadcast_add(key_bias)?
            .clamp(-10000.0, 0.0)?
            .broadcast_as((n, 1, s, s))?
            .contiguous()?;
        Ok(ModernAux {
            global: rope(self.global_theta)?,
            local: rope(self.local_theta)?,
            window_bias,
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
        let layer = &self.layers[i];
        let id = i as u32 + 1;
        let (n, s, h) = x.dims3()?;
        let d = h / self.heads;
        let normed = match &layer.attn_norm {
            Some(norm) => norm.forward(x)?,
            None => x.clone(),
        };
        let qkv = layer
            .wqkv
            .forward(&normed)?
            .reshape((n, s, 3, self.heads, d))?;
        let part = |k: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, k, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let (cos, sin) = if layer.sliding {
            &aux.local
        } else {
            &aux.global
        };
        let (q, k) = (rotary(&q, cos, sin)?, rotary(&k, cos, sin)?);
        let dropout = self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS);
        let scale = 1.0 / (d as f64).sqrt();
        let attended = if layer.sliding {
            let spec = AttentionSpec {
                bias: aux.window_bias.clone(),
                scale,
                dropout,
                recompute: recompute_probs,
            };
            crate::nn::attention_with_bias(&q, &k, &v, &spec)?
        } else {
            let spec = AttentionSpec {
                bias: key_bias.clone(),
                scale,
                dropout,
                recompute: recompute_probs,
            };
            crate::nn::attention(&q, &k, &v, &spec)?
        };
        let attended = attended.transpose(1, 2)?.reshape((n, s, h))?;
        let out = layer.wo.forward(&attended)?;
        let out = self
            .attention_dropout
            .forward(&out, ctx, id, site::ATTENTION_OUTPUT)?;
        let x = (x + out)?;
        let up = layer.wi.forward(&layer.mlp_norm.forward(&x)?)?;
        let input = up.narrow(D::Minus1, 0, self.intermediate)?;
        let gate = up.narrow(D::Minus1, self.intermediate, self.intermediate)?;
        let act = match self.activation {
            Activation::Gelu => input.gelu_erf()?,
            Activation::GeluTanh => input.gelu()?,
            Activation::Relu => input.relu()?,
        };
        let hidden = self
            .mlp_dropout
            .forward(&(act * gate)?, ctx, id, site::FEED_FORWARD)?;
        Ok((x + layer.mlp_wo.forward(&hidden)?)?)
    }

    /// The final norm, before the pooling.
    pub(super) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.final_norm.forward(x)
    }
}

/// Rotary position embedding of `x` `[n, heads, s, d]` with tables `[s, d]`:
/// `x cos + rotate_half(x) sin`, `rotate_half([a, b]) = [-b, a]` over the two halves.
fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (a, b) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
    let cos = cos.to_dtype(x.dtype())?;
    let sin = sin.to_dtype(x.dtype())?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}
