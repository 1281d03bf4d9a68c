//! What the config of a decoder embedder says ([`DecoderSettings`]): Qwen3, Qwen2, Llama,
//! Mistral and Gemma3, read from the `config.json` transformers writes for each (the fields
//! beyond BERT's, with transformers' defaults for the ones a file leaves out), checked
//! before anything is built.
//!
//! The attention of a layer is causal unless the config says otherwise
//! (`use_bidirectional_attention = true`, as EmbeddingGemma; `is_causal = false`, as
//! gte-Qwen2 was trained; text-embeddings-inference reads both). A sliding-window layer
//! sees the keys transformers' masks give it: `i - window < j <= i` when causal (Mistral,
//! the Qwen models' windowed layers), `|i - j| <= window / 2` for Gemma3's bidirectional
//! layers (its config halves the window). Rotary bases: `rope_theta` (transformers 4.x) or
//! `rope_parameters` (5.x), per layer type for Gemma3, with the `linear` and `llama3`
//! scalings of the inverse frequencies.

use std::path::Path;

use super::family::{Activation, Family};
use crate::{Error, Result};

/// The fields of a decoder's `config.json` that BERT's config also has (its names), and
/// the rest of the file (`extra`), as [`DecoderSettings::from_config`] reads them.
#[derive(Debug, Clone, Copy)]
pub struct DecoderFields<'a> {
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_act` (the Qwen models', Llama's and Mistral's gate activation).
    pub hidden_act: &'a str,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// Every other field of the file.
    pub extra: &'a serde_json::Map<String, serde_json::Value>,
}

/// A decoder family's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecoderKind {
    /// `qwen3`: q/k norms, an explicit `head_dim`, no biases (unless `attention_bias`).
    Qwen3,
    /// `qwen2`: biases on the query, key and value projections.
    Qwen2,
    /// `llama`: `attention_bias` and `mlp_bias` optional.
    Llama,
    /// `mistral`: Llama's layer, an optional sliding window on every layer.
    Mistral,
    /// `gemma3_text`: embeddings scaled by `sqrt(hidden)`, norms with `(1 + weight)`,
    /// four norms a layer (sandwiching attention and feed-forward), q/k norms,
    /// `query_pre_attn_scalar`, sliding and global layers with their own rotary bases.
    Gemma3,
    /// `eurobert`: Llama's layer, bidirectional whatever the config says.
    EuroBert,
}

/// The rotary inverse frequencies of one layer type, `head_dim / 2` values, computed in
/// f32 as transformers computes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// `1 / base^(2i / d)`, scaled as the config's rope type says.
    pub inv_freq: Vec<f32>,
}

/// One layer's attention pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKind {
    /// A sliding window in the attention kernel's terms: causal, keys `j` with
    /// `i - w <= j <= i`; bidirectional, `|i - j| <= w`. `None`: every key.
    pub window: Option<usize>,
    /// Which of [`DecoderSettings::ropes`] the layer rotates with.
    pub rope: usize,
}

/// Everything a decoder's layers need beyond BERT's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderSettings {
    /// The family.
    pub kind: DecoderKind,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (`num_key_value_heads`); a divisor of `heads`.
    pub kv_heads: usize,
    /// Width of a head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub eps: f64,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    pub output_bias: bool,
    /// Biases on the feed-forward projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorms on the queries and keys (`q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// Gemma's layout: norms scale by `1 + weight`, the embeddings by `sqrt(hidden)`, and
    /// norms after the attention and the feed-forward too.
    pub gemma: bool,
    /// The gate's activation (`hidden_act`, Gemma's `hidden_activation`).
    pub activation: Activation,
    /// The attention scores' scale: `head_dim^-0.5`, Gemma's `query_pre_attn_scalar^-0.5`.
    pub scale: f64,
    /// Causal attention (the default), else bidirectional.
    pub causal: bool,
    /// Each layer's pattern.
    pub layers: Vec<LayerKind>,
    /// The rotary frequencies of each layer type (one, or Gemma's global and local).
    pub ropes: Vec<Rope>,
    /// Dropout on the attention probabilities (`attention_dropout`).
    pub attention_dropout: f64,
}

/// The layer types a decoder config may name.
const LAYER_TYPES: &str = "full_attention, sliding_attention";
/// The rope types implemented.
const ROPE_TYPES: &str = "default, linear, llama3";

impl DecoderSettings {
    /// Reads and checks the decoder fields of `cfg` (from `path`, named in errors).
    pub fn from_config(cfg: &DecoderFields, kind: DecoderKind, path: &Path) -> Result<Self> {
        let x = &cfg.extra;
        let bad = |field: &str, reason: String| Error::ModelConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let uint = |key: &str| -> Result<Option<usize>> {
            match x.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|u| Some(u as usize))
                    .ok_or_else(|| bad(key, format!("= {v} is not a whole number"))),
            }
        };
        let num = |key: &str| x.get(key).and_then(|v| v.as_f64());
        let flag = |key: &str| x.get(key).and_then(|v| v.as_bool());
        let gemma = kind == DecoderKind::Gemma3;
        let heads = cfg.num_attention_heads;
        if heads == 0 {
            return Err(bad("num_attention_heads", "= 0: must be at least 1".into()));
        }
        let kv_heads = uint("num_key_value_heads")?.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!("= {kv_heads} must divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = match uint("head_dim")? {
            Some(d) => d,
            None => cfg.hidden_size / heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(
                "head_dim",
                format!("= {head_dim}: rotary embeddings need an even head width of at least 2"),
            ));
        }
        // transformers' defaults where a file leaves a field out.
        let act_key = if gemma {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        // Gemma3 names it `hidden_activation`; the others' `hidden_act` is BERT's field
        // (silu when a file leaves it out).
        let act_name = match (gemma, x.get(act_key).and_then(|v| v.as_str())) {
            (true, Some(name)) => name.to_string(),
            (true, None) => "gelu_pytorch_tanh".into(),
            (false, _) => cfg.hidden_act.to_string(),
        };
        let activation = match act_name.as_str() {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(Error::UnsupportedConfig {
                    field: if gemma {
                        "hidden_activation"
                    } else {
                        "hidden_act"
                    },
                    value: other.to_string(),
                    supported: "silu, swish, gelu_pytorch_tanh, gelu_new, gelu, relu",
                    path: path.to_path_buf(),
                })
            }
        };
        let attention_bias = flag("attention_bias").unwrap_or(false);
        let (qkv_bias, output_bias) = match kind {
            DecoderKind::Qwen2 => (true, false),
            DecoderKind::Mistral => (false, false),
            _ => (attention_bias, attention_bias),
        };
        let mlp_bias = matches!(kind, DecoderKind::Llama | DecoderKind::EuroBert)
            && flag("mlp_bias").unwrap_or(false);
        let scale = if gemma {
            let scalar = num("query_pre_attn_scalar").unwrap_or(256.0);
            if scalar <= 0.0 || !scalar.is_finite() {
                return Err(bad(
                    "query_pre_attn_scalar",
                    format!("= {scalar} must be positive"),
                ));
            }
            1.0 / scalar.sqrt()
        } else {
            1.0 / (head_dim as f64).sqrt()
        };
        if gemma {
            for key in ["attn_logit_softcapping"] {
                if x.get(key).is_some_and(|v| !v.is_null()) {
                    return Err(Error::UnsupportedConfig {
                        field: "attn_logit_softcapping",
                        value: x[key].to_string(),
                        supported: "null (Gemma2's soft-capping is not implemented)",
                        path: path.to_path_buf(),
                    });
                }
            }
        }
        let causal = kind != DecoderKind::EuroBert
            && !(flag("use_bidirectional_attention").unwrap_or(false)
                || flag("is_causal") == Some(false));
        let layers = cfg.num_hidden_layers;
        let sliding = layer_types(cfg, kind, path)?;
        let window = match uint("sliding_window")? {
            Some(0) => {
                return Err(bad(
                    "sliding_window",
                    "= 0: a window must hold at least one token".into(),
                ))
            }
            w => w,
        };
        if sliding.iter().any(|&s| s) && window.is_none() {
            return Err(bad(
                "sliding_window",
                "is null while layer_types names sliding_attention layers".into(),
            ));
        }
        let kernel_window = window.map(|w| match (gemma, causal) {
            // Gemma3's config halves a bidirectional window: |i - j| < w / 2 + 1.
            (true, false) => w / 2,
            // transformers: `kv_idx > q_idx - w` (with `|q - kv| < w` when bidirectional).
            _ => w - 1,
        });
        let ropes = ropes(cfg, kind, head_dim, path)?;
        let layers = (0..layers)
            .map(|i| LayerKind {
                window: if sliding[i] { kernel_window } else { None },
                rope: usize::from(gemma && sliding[i]),
            })
            .collect();
        let eps = num("rms_norm_eps").unwrap_or(1e-6);
        let attention_dropout = num("attention_dropout").unwrap_or(0.0);
        if !(0.0..1.0).contains(&attention_dropout) {
            return Err(bad(
                "attention_dropout",
                format!("= {attention_dropout}: a drop probability must be in [0, 1)"),
            ));
        }
        if cfg.hidden_size == 0 || cfg.intermediate_size == 0 || cfg.vocab_size == 0 {
            return Err(bad(
                "hidden_size / intermediate_size / vocab_size",
                "must be at least 1".into(),
            ));
        }
        Ok(Self {
            kind,
            heads,
            kv_heads,
            head_dim,
            eps,
            qkv_bias,
            output_bias,
            mlp_bias,
            qk_norm: matches!(kind, DecoderKind::Qwen3 | DecoderKind::Gemma3),
            gemma,
            activation,
            scale,
            causal,
            layers,
            ropes,
            attention_dropout,
        })
    }

    /// Query heads per key-value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

impl DecoderKind {
    /// The family's decoder kind, if it is a decoder.
    pub fn of(family: Family) -> Option<Self> {
        match family {
            Family::Qwen3 => Some(DecoderKind::Qwen3),
            Family::Qwen2 => Some(DecoderKind::Qwen2),
            Family::Llama => Some(DecoderKind::Llama),
            Family::Mistral => Some(DecoderKind::Mistral),
            Family::Gemma3 => Some(DecoderKind::Gemma3),
            Family::EuroBert => Some(DecoderKind::EuroBert),
            _ => None,
        }
    }

    /// `config.json`'s `architectures` entry of the base model (what `AutoModel` builds).
    pub fn architecture(self) -> &'static str {
        match self {
            DecoderKind::Qwen3 => "Qwen3Model",
            DecoderKind::Qwen2 => "Qwen2Model",
            DecoderKind::Llama => "LlamaModel",
            DecoderKind::Mistral => "MistralModel",
            DecoderKind::Gemma3 => "Gemma3TextModel",
            DecoderKind::EuroBert => "EuroBertModel",
        }
    }

    /// transformers' `max_position_embeddings` when the file leaves it out.
    pub fn default_max_positions(self) -> usize {
        match self {
            DecoderKind::Qwen3 | DecoderKind::Qwen2 => 32_768,
            DecoderKind::Llama => 2_048,
            DecoderKind::Mistral | DecoderKind::Gemma3 => 131_072,
            DecoderKind::EuroBert => 8_192,
        }
    }
}

/// Which layers attend within the sliding window: `layer_types` when the config has it,
/// else as transformers derives it (the Qwen models: layers from `max_window_layers` on
/// when `use_sliding_window`; Mistral: every layer when `sliding_window` is set; Gemma3:
/// all but every `sliding_window_pattern`-th).
fn layer_types(cfg: &DecoderFields, kind: DecoderKind, path: &Path) -> Result<Vec<bool>> {
    let x = &cfg.extra;
    let layers = cfg.num_hidden_layers;
    if let Some(types) = x.get("layer_types").filter(|v| !v.is_null()) {
        let parsed: Option<Vec<bool>> = types.as_array().and_then(|list| {
            list.iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Some(true),
                    Some("full_attention") => Some(false),
                    _ => None,
                })
                .collect()
        });
        return match parsed {
            Some(p) if p.len() == layers => Ok(p),
            Some(p) => Err(Error::ModelConfig {
                path: path.to_path_buf(),
                field: "layer_types".into(),
                reason: format!("names {} layers for num_hidden_layers = {layers}", p.len()),
            }),
            None => Err(Error::UnsupportedConfig {
                field: "layer_types",
                value: types.to_string(),
                supported: LAYER_TYPES,
                path: path.to_path_buf(),
            }),
        };
    }
    let has_window = x.get("sliding_window").is_some_and(|v| !v.is_null());
    Ok(match kind {
        DecoderKind::Qwen3 | DecoderKind::Qwen2 => {
            let on = x
                .get("use_sliding_window")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            let from = x
                .get("max_window_layers")
                .and_then(|v| v.as_u64())
                .map_or(28, |v| v as usize);
            (0..layers).map(|i| on && has_window && i >= from).collect()
        }
        DecoderKind::Mistral => vec![has_window; layers],
        DecoderKind::Llama | DecoderKind::EuroBert => vec![false; layers],
        DecoderKind::Gemma3 => {
            let every = x
                .get("sliding_window_pattern")
                .or_else(|| x.get("_sliding_window_pattern"))
                .and_then(|v| v.as_u64())
                .map_or(6, |v| v.max(1) as usize);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    })
}

/// The one set of rotary frequencies of an encoder on rotary layers (NomicBERT, GTE, Jina
/// v3): `rope_parameters`, or `rope_theta` and `rope_scaling`, with Llama's defaults.
/// `default_theta` where the file names no base (transformers' `default_theta` of the
/// family).
pub fn single_rope(
    cfg: &DecoderFields,
    dim: usize,
    default_theta: f64,
    path: &Path,
) -> Result<Rope> {
    let x = &cfg.extra;
    let p = x
        .get("rope_parameters")
        .or_else(|| x.get("rope_scaling"))
        .filter(|v| !v.is_null())
        .cloned()
        .unwrap_or(serde_json::json!({}));
    let theta = p
        .get("rope_theta")
        .and_then(|v| v.as_f64())
        .or_else(|| x.get("rope_theta").and_then(|v| v.as_f64()))
        .unwrap_or(default_theta);
    rope(&p, theta, dim, cfg, path)
}

/// The rotary frequencies: one set, or Gemma3's global (index 0) and local (index 1).
fn ropes(cfg: &DecoderFields, kind: DecoderKind, dim: usize, path: &Path) -> Result<Vec<Rope>> {
    let x = &cfg.extra;
    let params = x.get("rope_parameters").filter(|v| !v.is_null());
    if kind == DecoderKind::Gemma3 {
        let scaling = x.get("rope_scaling").filter(|v| !v.is_null());
        let global = params
            .and_then(|p| p.get("full_attention"))
            .or(scaling)
            .cloned()
            .unwrap_or(serde_json::json!({}));
        let local = params
            .and_then(|p| p.get("sliding_attention"))
            .cloned()
            .unwrap_or(serde_json::json!({}));
        let theta = |p: &serde_json::Value, old: &str, default: f64| {
            p.get("rope_theta")
                .and_then(|v| v.as_f64())
                .or_else(|| x.get(old).and_then(|v| v.as_f64()))
                .unwrap_or(default)
        };
        let g = theta(&global, "rope_theta", 1_000_000.0);
        let l = theta(&local, "rope_local_base_freq", 10_000.0);
        return Ok(vec![
            rope(&global, g, dim, cfg, path)?,
            rope(&local, l, dim, cfg, path)?,
        ]);
    }
    // transformers 5 writes `rope_parameters`; 4.x `rope_theta` and `rope_scaling`.
    let p = params
        .or_else(|| x.get("rope_scaling").filter(|v| !v.is_null()))
        .cloned()
        .unwrap_or(serde_json::json!({}));
    let theta = p
        .get("rope_theta")
        .and_then(|v| v.as_f64())
        .or_else(|| x.get("rope_theta").and_then(|v| v.as_f64()))
        .unwrap_or(10_000.0);
    Ok(vec![rope(&p, theta, dim, cfg, path)?])
}

/// One layer type's frequencies from its rope parameters.
fn rope(
    p: &serde_json::Value,
    theta: f64,
    dim: usize,
    cfg: &DecoderFields,
    path: &Path,
) -> Result<Rope> {
    let bad = |field: &str, reason: String| Error::ModelConfig {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    if theta <= 0.0 || !theta.is_finite() {
        return Err(bad("rope_theta", format!("= {theta} must be positive")));
    }
    if let Some(f) = p.get("partial_rotary_factor").and_then(|v| v.as_f64()) {
        if f != 1.0 {
            return Err(Error::UnsupportedConfig {
                field: "partial_rotary_factor",
                value: f.to_string(),
                supported: "1.0",
                path: path.to_path_buf(),
            });
        }
    }
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    // As transformers: `1 / base^(arange(0, d, 2) / d)` in f32.
    let base = theta as f32;
    let mut inv: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
        .collect();
    let factor = || -> Result<f32> {
        match p.get("factor").and_then(|v| v.as_f64()) {
            Some(f) if f > 0.0 => Ok(f as f32),
            other => Err(bad(
                "rope_parameters.factor",
                format!("= {other:?}: a `{kind}` rope needs a positive factor"),
            )),
        }
    };
    match kind {
        "default" => {}
        "linear" => {
            let f = factor()?;
            for v in &mut inv {
                *v /= f;
            }
        }
        "llama3" => {
            let f = factor()?;
            let get = |key: &str| p.get(key).and_then(|v| v.as_f64());
            let (Some(low), Some(high)) = (get("low_freq_factor"), get("high_freq_factor")) else {
                return Err(bad(
                    "rope_parameters",
                    "a `llama3` rope needs low_freq_factor and high_freq_factor".into(),
                ));
            };
            if high <= low {
                return Err(bad(
                    "rope_parameters.high_freq_factor",
                    format!("= {high} must exceed low_freq_factor = {low}"),
                ));
            }
            let old = get("original_max_position_embeddings")
                .unwrap_or(cfg.max_position_embeddings as f64) as f32;
            let (low, high) = (low as f32, high as f32);
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            for v in &mut inv {
                let wavelen = 2.0 * std::f32::consts::PI / *v;
                let scaled = if wavelen > low_wavelen { *v / f } else { *v };
                *v = if wavelen < high_wavelen || wavelen > low_wavelen {
                    scaled
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / f + smooth * scaled
                };
            }
        }
        other => {
            return Err(Error::UnsupportedConfig {
                field: "rope_parameters.rope_type",
                value: other.to_string(),
                supported: ROPE_TYPES,
                path: path.to_path_buf(),
            })
        }
    }
    Ok(Rope { inv_freq: inv })
}

impl Rope {
    /// The `(cos, sin)` tables of positions `0..len`, `[len, d]` each (each half of a row
    /// repeats the frequencies): `angle = position * inv_freq` in f32, as transformers.
    pub fn tables(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let d = 2 * half;
        let mut cos = Vec::with_capacity(len * d);
        let mut sin = Vec::with_capacity(len * d);
        for t in 0..len {
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let a = t as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        (cos, sin)
    }
}
