//! The rotary post-norm encoders: NomicBERT (`nomic_bert`: nomic-embed-text), GTE (`gte`,
//! the "new" architecture: gte-base-en-v1.5, gte-multilingual-base, arctic-embed-m-v2.0)
//! and Jina v3 (`jina_embeddings_v3`), one layer in transformers 5 (its
//! `JinaEmbeddingsV3Layer`) that differs only in its biases and feed-forward:
//!
//! ```text
//! x = LN(words[ids] + types[type_ids])                  (GTE without types: words alone)
//! per layer:
//!   q, k, v = x Wqkv^T (+ b)                            (one product, rows q | k | v)
//!   q, k    = rotary(q), rotary(k)                      (Llama's rotate-half, positions 0..s)
//!   x       = LN(x + dropout(attention(q, k, v) Wo^T (+ b)))     (bidirectional)
//!   m       = down(act(gate(x)) * up(x))                (NomicBERT: SwiGLU, no biases;
//!                                                        GTE: GeGLU, dropout on the product,
//!                                                        a bias on down)
//!           | fc2(act(fc1(x)))                          (Jina v3, biased)
//!   x       = LN(x + dropout(m))
//! no final norm.
//! ```
//!
//! The weights are read under the names the published checkpoints have (and transformers 5
//! writes back on save): NomicBERT's `emb_ln`, `encoder.layers.{i}.attn.Wqkv`, `attn.out_proj`,
//! `mlp.fc11` (up) / `mlp.fc12` (gate) / `mlp.fc2`, `norm1`, `norm2`; GTE's
//! `embeddings.LayerNorm`, `encoder.layer.{i}.attention.qkv_proj`, `attention.o_proj`,
//! `attn_ln`, `mlp.up_gate_proj` (rows up | gate), `mlp.down_proj`, `mlp_ln`; Jina v3's
//! `emb_ln`, `encoder.layers.{i}.mixer.Wqkv`, `mixer.out_proj`, `mlp.fc1`, `mlp.fc2`, `norm1`,
//! `norm2`. [`Bert`](super::bert::Bert) runs the stack as its layers, so the gradient
//! cache, recompute policies, dtypes, export and the distributed backends are those of
//! every family. Each op runs as the crate's fused node where the fused kernels run
//! (projections, rotary, attention, the residual LayerNorm, the gated unit).

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
use crate::nn::lora::LoraSpec;
use crate::nn::{AttentionSpec, LayerNorm, Linear};
use crate::precision::Precision;
use crate::Result;

use super::bert_config::BertConfig;
pub use super::rotary_config::{RotaryKind, RotarySettings};
use super::task_adapters::TaskSet;

/// Dropout sites of a layer (the `site` of a mask seed), as BERT's.
mod site {
    pub const EMBEDDINGS: u32 = 0;
    pub const ATTENTION_PROBS: u32 = 1;
    pub const ATTENTION_OUTPUT: u32 = 2;
    pub const FEED_FORWARD_OUTPUT: u32 = 3;
    /// GTE's dropout on the gated product.
    pub const GATED: u32 = 4;
}

/// The sites selective recompute can recompute (indices as BERT's): the attention
/// probabilities, the residual sums under the two LayerNorms, and (Jina v3's plain
/// feed-forward) the activation.
pub const ROTARY_SITES: [&str; 4] = [
    "attention.probs",
    "post_attention_layernorm",
    "mlp.activation",
    "post_mlp_layernorm",
];
const SITE_ATTENTION_PROBS: usize = 0;
const SITE_ATTENTION_NORM: usize = 1;
const SITE_ACTIVATION: usize = 2;
const SITE_MLP_NORM: usize = 3;

/// The builder of the module at dotted `name` under `vb`.
fn at<'a>(vb: &VarBuilder<'a>, name: &str) -> VarBuilder<'a> {
    name.split('.').fold(vb.clone(), |v, p| v.pp(p))
}

/// A layer's feed-forward.
enum Mlp {
    /// NomicBERT: `fc2(act(fc12(x)) * fc11(x))`.
    Split {
        up: Linear,
        gate: Linear,
        down: Linear,
    },
    /// GTE: `down(dropout(act(gate) * up))` with `[up, gate] = x up_gate^T`.
    Fused { up_gate: Linear, down: Linear },
    /// Jina v3: `fc2(act(fc1(x)))`.
    Plain { fc1: Linear, fc2: Linear },
}

struct Layer {
    qkv: Linear,
    out: Linear,
    attention_norm: LayerNorm,
    mlp: Mlp,
    mlp_norm: LayerNorm,
}

/// The embeddings and layers of a rotary post-norm encoder.
pub(super) struct RotaryEncoder {
    words: Tensor,
    types: Option<Tensor>,
    norm: LayerNorm,
    layers: Vec<Layer>,
    s: RotarySettings,
    heads: usize,
    hidden_dropout: Dropout,
    attention_dropout: Dropout,
    /// The token row PyTorch's `padding_idx` leaves untrained.
    padding_idx: Option<u32>,
    /// Jina v3's task adapters, one set per task (empty: none).
    tasks: Vec<TaskSet>,
}

/// Per-chunk data of the layers: the rotary tables `(cos, sin)` `[s, head_dim]` in the
/// layers' dtype.
pub(super) struct RotaryAux {
    tables: (Tensor, Tensor),
    /// The chunk's task adapter (by index), if any.
    task: Option<usize>,
}

impl RotaryEncoder {
    /// Builds the layers under `vb`. Fresh weights: normal(0, `initializer_range`), norms
    /// ones and zeros, biases zero.
    pub(super) fn new(
        cfg: &BertConfig,
        s: RotarySettings,
        lora: Option<&LoraSpec>,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (h, std, eps) = (cfg.hidden_size, cfg.initializer_range, cfg.layer_norm_eps);
        let inter = cfg.intermediate_size;
        let init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let e = vb.pp("embeddings");
        let words = e
            .pp("word_embeddings")
            .get_with_hints((cfg.vocab_size, h), "weight", init)?;
        let types = (cfg.type_vocab_size > 0)
            .then(|| {
                e.pp("token_type_embeddings").get_with_hints(
                    (cfg.type_vocab_size, h),
                    "weight",
                    init,
                )
            })
            .transpose()?;
        let kind = s.kind;
        let bias = kind != RotaryKind::Nomic;
        let (list, qkv, out, norm1, norm2) = kind.names();
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = at(&vb, &format!("{list}.{i}"));
                let m = l.pp("mlp");
                let proj = |shape, vb| Linear::projection(shape, std, lora, vb);
                let mlp = match kind {
                    RotaryKind::Nomic => Mlp::Split {
                        up: proj((h, inter, false), m.pp("fc11"))?,
                        gate: proj((h, inter, false), m.pp("fc12"))?,
                        down: proj((inter, h, false), m.pp("fc2"))?,
                    },
                    RotaryKind::Gte => Mlp::Fused {
                        up_gate: proj((h, 2 * inter, false), m.pp("up_gate_proj"))?,
                        down: proj((inter, h, true), m.pp("down_proj"))?,
                    },
                    RotaryKind::Jina => Mlp::Plain {
                        fc1: proj((h, inter, true), m.pp("fc1"))?,
                        fc2: proj((inter, h, true), m.pp("fc2"))?,
                    },
                };
                Ok(Layer {
                    qkv: proj((h, 3 * h, bias), at(&l, qkv))?,
                    out: proj((h, h, bias), at(&l, out))?,
                    attention_norm: LayerNorm::new(h, eps, l.pp(norm1))?,
                    mlp,
                    mlp_norm: LayerNorm::new(h, eps, l.pp(norm2))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let tasks = match &s.tasks {
            Some(t) if lora.is_some() => {
                return Err(crate::Error::InvalidConfig {
                    field: "model.lora",
                    value: format!("with task adapters ({})", t.names.join(", ")),
                    reason: "the model carries Jina v3's task adapters: train them (model.task, \
                             model.query_task, model.passage_task) rather than new LoRA \
                             adapters beside them",
                })
            }
            Some(t) => {
                let projections: Vec<[(VarBuilder, &Linear); 4]> = layers
                    .iter()
                    .enumerate()
                    .map(|(i, layer)| {
                        let l = at(&vb, &format!("{list}.{i}"));
                        // Jina v3's feed-forward (the config refuses another family's).
                        let Mlp::Plain { fc1, fc2 } = &layer.mlp else {
                            return Err(crate::Error::InvalidArgument {
                                what: "task adapters",
                                value: t.names.join(", "),
                                reason: "are Jina v3's, on its plain feed-forward",
                            });
                        };
                        Ok([
                            (at(&l, qkv), &layer.qkv),
                            (at(&l, out), &layer.out),
                            (l.pp("mlp").pp("fc1"), fc1),
                            (l.pp("mlp").pp("fc2"), fc2),
                        ])
                    })
                    .collect::<Result<_>>()?;
                let type_shape = types.as_ref().map(|t| t.dims2()).transpose()?;
                let (word_vb, type_vb) = (e.pp("word_embeddings"), e.pp("token_type_embeddings"));
                (0..t.names.len())
                    .map(|task| {
                        TaskSet::new(
                            task,
                            t,
                            (&word_vb, words.dims2()?),
                            type_shape.map(|shape| (&type_vb, shape)),
                            &projections,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => Vec::new(),
        };
        Ok(Self {
            words,
            types,
            norm: LayerNorm::new(h, eps, at(&vb, kind.embedding_norm()))?,
            layers,
            s,
            heads: cfg.num_attention_heads,
            hidden_dropout: Dropout::new(cfg.hidden_dropout_prob as f32)?,
            attention_dropout: Dropout::new(cfg.attention_probs_dropout_prob as f32)?,
            padding_idx: cfg.padding_idx(),
            tasks,
        })
    }

    pub(super) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub(super) fn dtype(&self) -> DType {
        self.norm.dtype()
    }

    /// The sub-layer sites selective recompute can recompute.
    pub(super) fn sites(&self) -> &'static [&'static str] {
        &ROTARY_SITES
    }

    /// The chunk's rotary tables for positions `0..s` (the texts are padded on the right,
    /// as these tokenizers pad).
    pub(super) fn aux(&self, input: &TokenBatch, dtype: DType) -> Result<RotaryAux> {
        let s = input.seq_len();
        let device = input.input_ids.device();
        let d = self.s.head_dim;
        let (cos, sin) = self.s.rope.tables(s);
        Ok(RotaryAux {
            tables: (
                Tensor::from_vec(cos, (s, d), device)?.to_dtype(dtype)?,
                Tensor::from_vec(sin, (s, d), device)?.to_dtype(dtype)?,
            ),
            task: self.task_of(input)?,
        })
    }

    /// The task adapter `input` is encoded with: checked to be one the model has.
    fn task_of(&self, input: &TokenBatch) -> Result<Option<usize>> {
        match input.task {
            Some(t) if t >= self.tasks.len() => Err(crate::Error::InvalidArgument {
                what: "task adapter",
                value: t.to_string(),
                reason: if self.tasks.is_empty() {
                    "asked of a model without task adapters (no lora_adaptations in its \
                     config.json)"
                } else {
                    "is not one of the model's task adapters"
                },
            }),
            t => Ok(t),
        }
    }

    /// Layer `i`'s projection `l` (the `p`-th of [`crate::nn::lora::site`]'s order) for
    /// one forward of a chunk: with the chunk's task adapter, its dropout mask of `seed`.
    fn projection(
        &self,
        l: &Linear,
        (i, p): (usize, u32),
        aux: &RotaryAux,
        seed: Option<u64>,
    ) -> Linear {
        let slot = match p {
            0 => Some(0),
            1 => Some(1),
            2 => Some(2),
            4 => Some(3),
            _ => None,
        };
        match (aux.task, slot) {
            (Some(t), Some(k)) => l.with_adapter(&self.tasks[t].layers[i][k]).at(seed),
            _ => l.at(seed),
        }
    }

    /// `dropout(LN(words[ids] + types[type_ids]))`, in the layers' dtype. The padding
    /// index's row gets no gradient, as in PyTorch.
    pub(super) fn embed(
        &self,
        input: &TokenBatch,
        precision: Precision,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let ids = &input.input_ids;
        let (n, s) = ids.dims2()?;
        let h = self.norm.weight().dim(0)?;
        let words = match crate::nn::token_embeddings(ids, &self.words, None, self.padding_idx)? {
            Some(x) => x,
            None => {
                let flat = ids.flatten_all()?;
                let x = self.words.index_select(&flat, 0)?;
                let x = match self.padding_idx {
                    Some(pad) => {
                        let frozen = self.words.detach().index_select(&flat, 0)?;
                        let is_pad = flat.eq(pad)?.unsqueeze(1)?.broadcast_as(x.shape())?;
                        is_pad.where_cond(&frozen, &x)?
                    }
                    None => x,
                };
                x.reshape((n, s, h))?
            }
        };
        let task = self.task_of(input)?.map(|t| &self.tasks[t]);
        let words = match task {
            Some(set) => {
                let flat = ids.flatten_all()?;
                let update = set.words.rows(&flat, self.padding_idx, words.dtype())?;
                (words + update.reshape((n, s, h))?)?
            }
            None => words,
        };
        let x = match &self.types {
            Some(types) => {
                let flat = input.token_type_ids.flatten_all()?;
                let mut rows = types.index_select(&flat, 0)?;
                if let Some(update) = task.and_then(|set| set.types.as_ref()) {
                    rows = (rows + update.rows(&flat, None, types.dtype())?)?;
                }
                (words + rows.reshape((n, s, h))?)?
            }
            None => words,
        };
        let x = self.norm.forward(&x)?;
        let x = match precision {
            Precision::F32 => x,
            half => x.to_dtype(half.dtype())?,
        };
        self.hidden_dropout.forward(&x, ctx, 0, site::EMBEDDINGS)
    }

    /// Layer `i` on `x` `[n, s, h]`, op by op (each op a fused node where they run).
    pub(super) fn layer(
        &self,
        i: usize,
        x: &Tensor,
        key_bias: &Tensor,
        aux: &RotaryAux,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        if let Some(y) = self.whole_layer(i, x, key_bias, aux, ctx)? {
            return Ok(y);
        }
        let layer = &self.layers[i];
        let id = i as u32 + 1;
        let (n, s, h) = x.dims3()?;
        let d = self.s.head_dim;
        let recompute = |site: usize| ctx.recompute.recomputes(site);
        let at = |l: &Linear, p: u32| {
            self.projection(l, (i, p), aux, ctx.mask_seed(id, crate::nn::lora::site(p)))
        };
        let qkv = at(&layer.qkv, 0)
            .forward(x)?
            .reshape((n, s, 3, self.heads, d))?;
        let part = |k: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, k, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let (cos, sin) = &aux.tables;
        let (q, k) = (
            crate::nn::rotary(&q, cos, sin)?,
            crate::nn::rotary(&k, cos, sin)?,
        );
        let spec = AttentionSpec {
            bias: key_bias.clone(),
            scale: 1.0 / (d as f64).sqrt(),
            dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS),
            recompute: recompute(SITE_ATTENTION_PROBS),
            window: None,
        };
        let attended = crate::nn::attention(&q, &k, &v, &spec)?
            .transpose(1, 2)?
            .reshape((n, s, h))?;
        let out = at(&layer.out, 1).forward(&attended)?;
        let add_norm = |y: &Tensor, residual: &Tensor, norm: &LayerNorm, site: u32, r: usize| {
            let mask = self.hidden_dropout.mask(ctx, id, site);
            if recompute(r) {
                crate::nn::add_norm_recomputed(y, residual, norm, mask)
            } else {
                crate::nn::add_norm(y, residual, norm, mask)
            }
        };
        let x = add_norm(
            &out,
            x,
            &layer.attention_norm,
            site::ATTENTION_OUTPUT,
            SITE_ATTENTION_NORM,
        )?;
        let act = self.s.activation.fused();
        let activation = recompute(SITE_ACTIVATION);
        let m = match &layer.mlp {
            Mlp::Split { up, gate, down } => {
                let (up, gate) = (at(up, 2).forward(&x)?, at(gate, 3).forward(&x)?);
                let pre = Tensor::cat(&[&gate, &up], D::Minus1)?;
                gated_down(&pre, &at(down, 4), act, None, activation)?
            }
            Mlp::Fused { up_gate, down } => {
                let both = at(up_gate, 2).forward(&x)?;
                let w = both.dim(D::Minus1)? / 2;
                let (up, gate) = (both.narrow(D::Minus1, 0, w)?, both.narrow(D::Minus1, w, w)?);
                let pre = Tensor::cat(&[&gate, &up], D::Minus1)?;
                let dropout = self.hidden_dropout.mask(ctx, id, site::GATED);
                gated_down(&pre, &at(down, 4), act, dropout, activation)?
            }
            Mlp::Plain { fc1, fc2 } => {
                crate::nn::feed_forward(&x, &at(fc1, 2), act, &at(fc2, 4), activation)?
            }
        };
        add_norm(
            &m,
            &x,
            &layer.mlp_norm,
            site::FEED_FORWARD_OUTPUT,
            SITE_MLP_NORM,
        )
    }
}

impl RotaryEncoder {
    /// Layer `i` as one node with its backward written out
    /// ([`crate::nn::cpu::rotary_layer`]) where the fused kernels run: the arithmetic of
    /// [`Self::layer`]'s ops on the packed real tokens. `None` elsewhere, and for a gated
    /// unit whose two projections carry adapters (the node takes one up projection).
    fn whole_layer(
        &self,
        i: usize,
        x: &Tensor,
        key_bias: &Tensor,
        aux: &RotaryAux,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        use crate::nn::cpu::rotary_layer::{RotarySpec, RotaryWeights};
        if !crate::nn::fused_kernels() || !x.device().is_cpu() {
            return Ok(None);
        }
        let layer = &self.layers[i];
        let id = i as u32 + 1;
        let at = |l: &Linear, p: u32| {
            self.projection(l, (i, p), aux, ctx.mask_seed(id, crate::nn::lora::site(p)))
        };
        let (qkv, out) = (at(&layer.qkv, 0), at(&layer.out, 1));
        // The up projection as the node takes it: GTE's fused one (its gate second),
        // NomicBERT's gate then input as two weights, Jina v3's plain one.
        let (up, second, down, gated, gate_second) = match &layer.mlp {
            Mlp::Split { up, gate, down } => {
                if up.lora_input().is_some() || gate.lora_input().is_some() {
                    return Ok(None);
                }
                (
                    gate.clone(),
                    Some(up.base_weight()),
                    at(down, 4),
                    true,
                    false,
                )
            }
            Mlp::Fused { up_gate, down } => (at(up_gate, 2), None, at(down, 4), true, true),
            Mlp::Plain { fc1, fc2 } => (at(fc1, 2), None, at(fc2, 4), false, false),
        };
        let projections = [&qkv, &out, &up, &down];
        fn affine(l: &Linear) -> (&Tensor, Option<&Tensor>) {
            (l.base_weight(), l.bias())
        }
        let weights = RotaryWeights {
            qkv: affine(&qkv),
            attention_output: affine(&out),
            attention_norm: (layer.attention_norm.weight(), layer.attention_norm.bias()),
            up: affine(&up),
            up_second: second,
            down: affine(&down),
            mlp_norm: (layer.mlp_norm.weight(), layer.mlp_norm.bias()),
            lora: std::array::from_fn(|p| projections[p].lora_input()),
        };
        let recompute = |site: usize| ctx.recompute.recomputes(site);
        let d = self.s.head_dim;
        let (cos, sin) = &aux.tables;
        let spec = RotarySpec {
            heads: self.heads,
            act: self.s.activation.fused(),
            gated,
            gate_second,
            eps: layer.attention_norm.eps(),
            attention: AttentionSpec {
                bias: key_bias.clone(),
                scale: 1.0 / (d as f64).sqrt(),
                dropout: self.attention_dropout.mask(ctx, id, site::ATTENTION_PROBS),
                recompute: recompute(SITE_ATTENTION_PROBS),
                window: None,
            },
            rotary: (cos.clone(), sin.clone()),
            attention_output_dropout: self.hidden_dropout.mask(ctx, id, site::ATTENTION_OUTPUT),
            gated_dropout: match layer.mlp {
                Mlp::Fused { .. } => self.hidden_dropout.mask(ctx, id, site::GATED),
                _ => None,
            },
            output_dropout: self.hidden_dropout.mask(ctx, id, site::FEED_FORWARD_OUTPUT),
            recompute_attention_norm: recompute(SITE_ATTENTION_NORM),
            recompute_activation: recompute(SITE_ACTIVATION),
            recompute_mlp_norm: recompute(SITE_MLP_NORM),
        };
        if layer.mlp_norm.eps() != spec.eps {
            return Ok(None);
        }
        crate::nn::rotary_post_norm_layer(x, &weights, &spec)
    }
}

/// `down(dropout(act(gate) * up))` over `pre = [gate, up]`; with `recompute` one node
/// keeping `pre` alone (the gated product, `[.., width]`, is recomputed in the backward
/// pass, bit for bit), where `down` has a merged weight.
fn gated_down(
    pre: &Tensor,
    down: &Linear,
    act: crate::nn::Act,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> Result<Tensor> {
    let unit = move |pre: &Tensor| -> Result<Tensor> {
        let gated = crate::nn::glu(pre, act)?;
        match dropout {
            Some((seed, p)) => crate::nn::dropout(&gated, seed, p),
            None => Ok(gated),
        }
    };
    if !recompute || !down.merges() {
        return down.forward(&unit(pre)?);
    }
    let weight = down.weight()?;
    let mut inputs = vec![pre, &weight];
    inputs.extend(down.bias());
    crate::nn::recomputed("gradcache-gated-down-recomputed", &inputs, move |t| {
        crate::nn::linear(&unit(&t[0])?, &t[1], t.get(2))
    })
}
