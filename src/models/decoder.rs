//! Decoder embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral and the Llama family,
//! EmbeddingGemma) with transformers' weight names (`embed_tokens`,
//! `layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`/`k_norm`, `input_layernorm`,
//! `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm` and
//! `post_feedforward_layernorm`, `mlp.{gate,up,down}_proj`, the final `norm`):
//!
//! ```text
//! x    = embed[ids] (* sqrt(hidden) for Gemma)
//! per layer:
//!   q, k, v = RMSNorm(x) W_{q,k,v}^T (+ b)        (grouped KV heads)
//!   q, k    = rotary(RMSNorm_head(q), RMSNorm_head(k))    (q/k norms: Qwen3, Gemma3)
//!   a       = attention(q, k, v) W_o^T             (causal unless the config says not;
//!                                                    a sliding window on windowed layers)
//!   x1      = x + a                                (Gemma: x + RMSNorm(a))
//!   m       = act(n W_gate^T) * (n W_up^T) W_down^T, n = RMSNorm(x1)
//!   y       = x1 + m                               (Gemma: x1 + RMSNorm(m))
//! final RMSNorm
//! ```
//!
//! Positions count from each text's first real token, so a text's embedding is the same
//! alone and in a batch padded on either side (transformers counts them from the first
//! column: with left padding its rotary angles differ by a constant, which rotary
//! attention cancels up to rounding). [`Bert`](super::bert::Bert) runs it as its layer
//! stack for the decoder families, so the gradient cache, recompute policies, dtypes,
//! export and the distributed backends are those of every family. On the CPU in f32 a
//! layer runs as one node with its backward written out ([`crate::nn::cpu::decoder_layer`]);
//! elsewhere op by op, as here.

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
use crate::nn::cpu::decoder_layer::{DecoderSpec, DecoderWeights};
use crate::nn::lora::LoraSpec;
use crate::nn::{AttentionSpec, Linear};
use crate::precision::Precision;
use crate::Result;

use super::bert_config::{BertConfig, DecoderSettings};

/// The dropout site of the attention probabilities (the only dropout of these models).
const ATTENTION_PROBS: u32 = 1;

struct Layer {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// Gemma's norm of the attention output.
    post_attention_norm: Option<Tensor>,
    /// The norm before the feed-forward (Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`).
    mlp_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Gemma's norm of the feed-forward output.
    post_mlp_norm: Option<Tensor>,
}

/// A decoder's embeddings and layers.
pub(super) struct Decoder {
    tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    s: DecoderSettings,
    hidden: usize,
    attention_dropout: Dropout,
    /// The token row that gets no gradient (PyTorch's `padding_idx`).
    padding_idx: Option<u32>,
}

/// Per-chunk data of the layers: each token's position (counted from its text's first
/// real token), the rotary tables of every layer type for positions `0..s`, and the key
/// mask of the composed path.
pub(super) struct DecoderAux {
    /// `[n s]` u32.
    positions: Tensor,
    /// `(cos, sin)` `[s, head_dim]` per rope, in the layers' dtype.
    tables: Vec<(Tensor, Tensor)>,
}

/// A norm's weight: ones (Gemma's `(1 + w)` form: zeros) for fresh weights.
fn norm(size: usize, gemma: bool, vb: VarBuilder) -> Result<Tensor> {
    let init = if gemma {
        candle_nn::init::ZERO
    } else {
        candle_nn::init::ONE
    };
    Ok(vb.get_with_hints(size, "weight", init)?)
}

impl Decoder {
    /// The word embeddings `[vocab, hidden]` (a tied LM head's rows).
    pub(super) fn word_embeddings(&self) -> &Tensor {
        &self.tokens
    }

    /// Builds the layers under `vb`. Fresh weights: normal(0, `initializer_range`).
    pub(super) fn new(
        cfg: &BertConfig,
        s: DecoderSettings,
        lora: Option<&LoraSpec>,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (h, std) = (cfg.hidden_size, cfg.initializer_range);
        let inter = cfg.intermediate_size;
        let (q_width, kv_width) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let tokens = vb
            .pp("embed_tokens")
            .get_with_hints((cfg.vocab_size, h), "weight", init)?;
        let g = s.gemma;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("layers.{i}"));
                let a = l.pp("self_attn");
                let m = l.pp("mlp");
                Ok(Layer {
                    input_norm: norm(h, g, l.pp("input_layernorm"))?,
                    q: Linear::projection((h, q_width, s.qkv_bias), std, lora, a.pp("q_proj"))?,
                    k: Linear::projection((h, kv_width, s.qkv_bias), std, lora, a.pp("k_proj"))?,
                    v: Linear::projection((h, kv_width, s.qkv_bias), std, lora, a.pp("v_proj"))?,
                    o: Linear::projection((q_width, h, s.output_bias), std, lora, a.pp("o_proj"))?,
                    q_norm: s
                        .qk_norm
                        .then(|| norm(s.head_dim, g, a.pp("q_norm")))
                        .transpose()?,
                    k_norm: s
                        .qk_norm
                        .then(|| norm(s.head_dim, g, a.pp("k_norm")))
                        .transpose()?,
                    post_attention_norm: g
                        .then(|| norm(h, g, l.pp("post_attention_layernorm")))
                        .transpose()?,
                    mlp_norm: if g {
                        norm(h, g, l.pp("pre_feedforward_layernorm"))?
                    } else {
                        norm(h, g, l.pp("post_attention_layernorm"))?
                    },
                    gate: Linear::projection((h, inter, s.mlp_bias), std, lora, m.pp("gate_proj"))?,
                    up: Linear::projection((h, inter, s.mlp_bias), std, lora, m.pp("up_proj"))?,
                    down: Linear::projection((inter, h, s.mlp_bias), std, lora, m.pp("down_proj"))?,
                    post_mlp_norm: g
                        .then(|| norm(h, g, l.pp("post_feedforward_layernorm")))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            tokens,
            norm: norm(h, g, vb.pp("norm"))?,
            layers,
            attention_dropout: Dropout::new(s.attention_dropout as f32)?,
            s,
            hidden: h,
            padding_idx: cfg.padding_idx(),
        })
    }

    pub(super) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub(super) fn dtype(&self) -> DType {
        self.norm.dtype()
    }

    /// The norms' `(1 + w)` offset.
    fn offset(&self) -> f64 {
        if self.s.gemma {
            1.0
        } else {
            0.0
        }
    }

    /// The chunk's positions and rotary tables, from its attention mask `[n, s]`.
    pub(super) fn aux(&self, input: &TokenBatch, dtype: DType) -> Result<DecoderAux> {
        let mask = input.mask_rows()?;
        let s = input.seq_len();
        let device = input.input_ids.device();
        let mut positions = Vec::with_capacity(mask.len() * s);
        for row in mask.iter() {
            let mut seen = 0u32;
            for &m in row {
                if m != 0 {
                    positions.push(seen);
                    seen += 1;
                } else {
                    positions.push(0);
                }
            }
        }
        let positions = Tensor::from_vec(positions, mask.len() * s, device)?;
        let tables = self
            .s
            .ropes
            .iter()
            .map(|rope| {
                let (cos, sin) = rope.tables(s);
                let d = self.s.head_dim;
                Ok((
                    Tensor::from_vec(cos, (s, d), device)?.to_dtype(dtype)?,
                    Tensor::from_vec(sin, (s, d), device)?.to_dtype(dtype)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DecoderAux { positions, tables })
    }

    /// `embed[ids]` (Gemma: times `sqrt(hidden)`, rounded to the weights' dtype), in the
    /// layers' dtype. The padding index's row gets no gradient, as in PyTorch.
    pub(super) fn embed(&self, input: &TokenBatch, precision: Precision) -> Result<Tensor> {
        let scale = self
            .s
            .gemma
            .then(|| half_rounded((self.hidden as f64).sqrt(), self.tokens.dtype()));
        let ids = &input.input_ids;
        let fused = crate::nn::token_embeddings(ids, &self.tokens, scale, self.padding_idx)?;
        let x = match fused {
            Some(x) => x,
            None => {
                let (n, s) = ids.dims2()?;
                let flat = ids.flatten_all()?;
                let x = self.tokens.index_select(&flat, 0)?;
                // The padding index's rows from the detached table: no gradient.
                let x = match self.padding_idx {
                    Some(pad) => {
                        let frozen = self.tokens.detach().index_select(&flat, 0)?;
                        let is_pad = flat.eq(pad)?.unsqueeze(1)?.broadcast_as(x.shape())?;
                        is_pad.where_cond(&frozen, &x)?
                    }
                    None => x,
                };
                let x = x.reshape((n, s, self.hidden))?;
                match scale {
                    Some(c) => (x * c)?,
                    None => x,
                }
            }
        };
        Ok(match precision {
            Precision::F32 => x,
            half => x.to_dtype(half.dtype())?,
        })
    }

    /// Layer `i` on `x` `[n, s, h]`: one node where the fused kernels run, else op by op.
    /// With `last_token_only` (the last layer under last-token pooling) only each text's
    /// last real token's output is the layer's (see [`DecoderSpec::last_token_only`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer(
        &self,
        i: usize,
        x: &Tensor,
        key_bias: &Tensor,
        aux: &DecoderAux,
        (recompute_probs, last_token_only): (bool, bool),
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let layer = &self.layers[i];
        let kind = self.s.layers[i];
        let (cos, sin) = &aux.tables[kind.rope];
        let dropout = self
            .attention_dropout
            .mask(ctx, i as u32 + 1, ATTENTION_PROBS);
        let spec = DecoderSpec {
            heads: self.s.heads,
            kv_heads: self.s.kv_heads,
            act: self.s.activation.fused(),
            eps: self.s.eps,
            offset: self.offset(),
            attention: AttentionSpec {
                bias: key_bias.clone(),
                scale: self.s.scale,
                dropout,
                recompute: recompute_probs,
                window: kind.window,
            },
            causal: self.s.causal,
            rotary: (cos.clone(), sin.clone()),
            last_token_only,
        };
        // The projections with their adapters' masks of this forward: each adapter's
        // low-rank branch runs inside the node, beside its frozen base weight.
        let all = [
            &layer.q,
            &layer.k,
            &layer.v,
            &layer.o,
            &layer.gate,
            &layer.up,
            &layer.down,
        ];
        let projections: [Linear; 7] = std::array::from_fn(|p| {
            all[p].at(ctx.mask_seed(i as u32 + 1, crate::nn::lora::site(p as u32)))
        });
        let affine = |l: &Linear| (l.base_weight().clone(), l.bias().cloned());
        let [q, k, v, o, gate, up, down] = &projections;
        let weights = DecoderWeights {
            input_norm: &layer.input_norm,
            q: affine(q),
            k: affine(k),
            v: affine(v),
            o: affine(o),
            q_norm: layer.q_norm.as_ref(),
            k_norm: layer.k_norm.as_ref(),
            post_attention_norm: layer.post_attention_norm.as_ref(),
            mlp_norm: &layer.mlp_norm,
            gate: affine(gate),
            up: affine(up),
            down: affine(down),
            post_mlp_norm: layer.post_mlp_norm.as_ref(),
            lora: std::array::from_fn(|p| projections[p].lora_input()),
        };
        if let Some(y) = crate::nn::decoder_layer(x, &weights, &spec, &aux.positions)? {
            return Ok(y);
        }
        self.composed_layer(layer, &projections, x, &spec, &aux.positions)
    }

    /// The layer op by op (any device and dtype).
    fn composed_layer(
        &self,
        layer: &Layer,
        [q_proj, k_proj, v_proj, o_proj, gate, up, down]: &[Linear; 7],
        x: &Tensor,
        spec: &DecoderSpec,
        positions: &Tensor,
    ) -> Result<Tensor> {
        let (n, s, _) = x.dims3()?;
        let (eps, offset, d) = (self.s.eps, self.offset(), self.s.head_dim);
        let rms = |t: &Tensor, w: &Tensor| crate::nn::rms_norm(t, w, eps, offset);
        let normed = rms(x, &layer.input_norm)?;
        let heads = |l: &Linear, count: usize, norm: Option<&Tensor>| -> Result<Tensor> {
            let t = l.forward(&normed)?.reshape((n, s, count, d))?;
            let t = match norm {
                Some(w) => rms(&t, w)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(q_proj, self.s.heads, layer.q_norm.as_ref())?;
        let k = heads(k_proj, self.s.kv_heads, layer.k_norm.as_ref())?;
        let v = heads(v_proj, self.s.kv_heads, None)?;
        // Each token's rotary row: its position's, `[n, 1, s, d]`.
        let (cos, sin) = &spec.rotary;
        let at = |t: &Tensor| -> Result<Tensor> {
            Ok(t.index_select(positions, 0)?
                .reshape((n, 1, s, d))?
                .to_dtype(q.dtype())?)
        };
        let (cos, sin) = (at(cos)?, at(sin)?);
        let q = crate::nn::rotary_composed(&q, &cos, &sin)?;
        let k = crate::nn::rotary_composed(&k, &cos, &sin)?;
        let pattern = crate::nn::pattern_bias(s, spec.causal, spec.attention.window, x.device())?;
        let bias = match pattern {
            Some(p) => spec
                .attention
                .bias
                .to_dtype(DType::F32)?
                .broadcast_add(&p)?,
            None => spec.attention.bias.to_dtype(DType::F32)?,
        };
        let attention = AttentionSpec {
            bias,
            window: None,
            ..spec.attention.clone()
        };
        let attended = crate::nn::grouped_attention(&q, &k, &v, &attention)?;
        let attended = attended
            .transpose(1, 2)?
            .reshape((n, s, self.s.heads * d))?;
        let a = o_proj.forward(&attended)?;
        let a = match &layer.post_attention_norm {
            Some(w) => rms(&a, w)?,
            None => a,
        };
        let x1 = (x + a)?;
        let m_in = rms(&x1, &layer.mlp_norm)?;
        let up = Tensor::cat(&[gate.forward(&m_in)?, up.forward(&m_in)?], 2)?;
        let gated = crate::nn::glu_composed(&up, spec.act)?;
        let m = down.forward(&gated)?;
        let m = match &layer.post_mlp_norm {
            Some(w) => rms(&m, w)?,
            None => m,
        };
        Ok((x1 + m)?)
    }

    /// The final norm, before the pooling.
    pub(super) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        crate::nn::rms_norm(x, &self.norm, self.s.eps, self.offset())
    }
}

/// `value` rounded to `dtype` (Gemma multiplies by its embedding scale in the weights'
/// dtype).
fn half_rounded(value: f64, dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => f64::from(half::bf16::from_f64(value).to_f32()),
        DType::F16 => f64::from(half::f16::from_f64(value).to_f32()),
        DType::F32 => f64::from(value as f32),
        _ => value,
    }
}
