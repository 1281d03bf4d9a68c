//! The Hugging Face `config.json` of the BERT-family encoder ([`BertConfig`]), the
//! families it names ([`Family`]: BERT, the RoBERTa family, MPNet, ModernBERT, and the
//! decoders, whose own fields [`DecoderSettings`] reads) and the feed-forward activations
//! ([`Activation`]).

use std::path::Path;

pub use super::deberta_config::DebertaSettings;
pub use super::decoder_config::{DecoderFields, DecoderKind, DecoderSettings};
pub use super::family::{Activation, Family};
pub use super::rotary_config::{RotaryKind, RotarySettings, TaskAdapters};
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
    /// Padding token id (`null`: none, as some decoders' configs say).
    #[serde(default = "defaults::pad_token_id")]
    pub pad_token_id: Option<usize>,
    /// `bert` for BERT checkpoints.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Every other field of the file, kept so that an exported config says what the
    /// loaded one said.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// The keys of the `config.json` this was read from (empty: built in code). A
    /// decoder's export writes back these alone, so the fields above that only BERT has
    /// do not appear in a Qwen or Llama config with BERT's defaults.
    #[serde(skip)]
    pub keys: Vec<String>,
}

/// DistilBERT's `config.json`, which names BERT's fields its own way (transformers'
/// `DistilBertConfig`): read under BERT's names, written back under its own.
mod distilbert {
    use serde_json::{json, Value};

    /// DistilBERT's name of a BERT field, BERT's name, and transformers' default for a
    /// file that leaves it out.
    type Name = (&'static str, &'static str, fn() -> Value);

    /// Each field DistilBERT names its own way.
    const NAMES: [Name; 7] = [
        ("dim", "hidden_size", || json!(768)),
        ("n_layers", "num_hidden_layers", || json!(6)),
        ("n_heads", "num_attention_heads", || json!(12)),
        ("hidden_dim", "intermediate_size", || json!(3072)),
        ("activation", "hidden_act", || json!("gelu")),
        ("dropout", "hidden_dropout_prob", || json!(0.1)),
        ("attention_dropout", "attention_probs_dropout_prob", || {
            json!(0.1)
        }),
    ];

    /// BERT's fields DistilBERT does not have (no token types; its LayerNorms' epsilon is
    /// fixed at 1e-12, BERT's default).
    const BERT_ONLY: [&str; 3] = [
        "type_vocab_size",
        "layer_norm_eps",
        "position_embedding_type",
    ];

    /// DistilBERT's name of the BERT field `bert` (itself where DistilBERT shares it).
    pub fn own_name(bert: &'static str) -> &'static str {
        NAMES
            .iter()
            .find(|(_, ours, _)| *ours == bert)
            .map_or(bert, |(theirs, _, _)| theirs)
    }

    fn is_distilbert(value: &Value) -> bool {
        value.get("model_type").and_then(Value::as_str) == Some("distilbert")
    }

    /// A DistilBERT config under BERT's names (one token type); any other as it is.
    pub fn to_bert_names(mut value: Value) -> Value {
        if !is_distilbert(&value) {
            return value;
        }
        if let Some(map) = value.as_object_mut() {
            for (theirs, ours, default) in NAMES {
                let v = map.remove(theirs).unwrap_or_else(default);
                map.insert(ours.into(), v);
            }
            map.insert("type_vocab_size".into(), json!(1));
        }
        value
    }

    /// A DistilBERT config (as BERT's fields serialise it) under DistilBERT's names.
    pub fn to_own_names(mut value: Value) -> Value {
        if let Some(map) = value.as_object_mut() {
            for (theirs, ours, _) in NAMES {
                if let Some(v) = map.remove(ours) {
                    map.insert(theirs.into(), v);
                }
            }
            for key in BERT_ONLY {
                map.remove(key);
            }
        }
        value
    }
}

mod defaults {
    pub fn pad_token_id() -> Option<usize> {
        Some(0)
    }

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

/// What a ModernBERT `config.json` says beyond BERT's fields (old layout, transformers 4.x:
/// `global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`; new, 5.x:
/// `layer_types`, `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModernSettings {
    /// `norm_eps` (default 1e-5).
    pub norm_eps: f64,
    /// `norm_bias` (default false).
    pub norm_bias: bool,
    /// `attention_bias` (default false): biases on `Wqkv` and `Wo`.
    pub attention_bias: bool,
    /// `mlp_bias` (default false): biases on `Wi` and `Wo`.
    pub mlp_bias: bool,
    /// `hidden_activation` (default `gelu`), the GeGLU's activation.
    pub activation: Activation,
    /// Per layer: whether it attends within the sliding window only.
    pub sliding: Vec<bool>,
    /// The rotary base of the global layers (default 160,000).
    pub global_theta: f64,
    /// The rotary base of the sliding-window layers (default 10,000).
    pub local_theta: f64,
    /// Half the local window: a token attends to tokens at most this far (default 64,
    /// `local_attention / 2`).
    pub half_window: usize,
    /// `embedding_dropout`, `attention_dropout`, `mlp_dropout` (default 0 each).
    pub dropout: [f64; 3],
}

/// The `model_type`s [`Family`] accepts, for errors.
pub const SUPPORTED_FAMILIES: &str = "bert, roberta, xlm-roberta, camembert, mpnet, distilbert, \
    modernbert, nomic_bert, gte, jina_embeddings_v3, eurobert, deberta-v2 (encoders); qwen3, qwen2, llama, mistral, gemma3_text (decoders)";

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
            pad_token_id: Some(0),
            model_type: Some("bert".into()),
            extra: Default::default(),
            keys: Vec::new(),
        }
    }

    /// Matrix-product FLOPs of one forward pass over `rows` sequences of `len` tokens
    /// (multiply and add counted as two): per layer and token, the Q, K, V and output
    /// projections (`8 h^2`), the feed-forward (`4 h I`; ModernBERT's GeGLU `6 h I`), and the attention scores and
    /// their product with the values (`4 len h`). Element-wise work is not counted; it is
    /// what the achieved GFLOP/s of a step is set against.
    pub fn forward_flops(&self, rows: usize, len: usize) -> f64 {
        let (h, i, s) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            len as f64,
        );
        if let Ok(d) = self.decoder(Path::new("config")) {
            // Q and O of `heads * d`, K and V of `kv_heads * d`, the gated feed-forward
            // (three products of `h I`), scores and context over the keys (half of them
            // for causal attention).
            let (q, kv) = (
                (d.heads * d.head_dim) as f64,
                (d.kv_heads * d.head_dim) as f64,
            );
            let keys = if d.causal { s / 2.0 } else { s };
            let per_token = 2.0 * h * (2.0 * q + 2.0 * kv) + 6.0 * h * i + 4.0 * keys * q;
            return per_token * s * rows as f64 * self.num_hidden_layers as f64;
        }
        // ModernBERT's GeGLU has two up projections (`Wi` is `[2 I, h]`), as NomicBERT's
        // and GTE's gated feed-forwards.
        let up = match self.family(Path::new("config")) {
            Ok(Family::ModernBert | Family::NomicBert | Family::Gte) => 6.0,
            _ => 4.0,
        };
        let per_token = 8.0 * h * h + up * h * i + 4.0 * s * h;
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
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::ModelFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let keys = value
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        let value = distilbert::to_bert_names(value);
        let mut cfg: BertConfig = serde_json::from_value(value).map_err(|e| Error::ModelFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        cfg.keys = keys;
        // A decoder's fields that BERT's defaults would fill wrongly.
        if let Ok(family) = cfg.family(path) {
            if let Some(kind) = DecoderKind::of(family) {
                if !cfg.keys.iter().any(|k| k == "max_position_embeddings") {
                    cfg.max_position_embeddings = kind.default_max_positions();
                }
                if !cfg.keys.iter().any(|k| k == "hidden_act") {
                    cfg.hidden_act = "silu".into();
                }
                // transformers' default: none but for Gemma3 (0).
                if !cfg.keys.iter().any(|k| k == "pad_token_id") {
                    cfg.pad_token_id = (kind == DecoderKind::Gemma3).then_some(0);
                }
                for (key, p) in [
                    ("hidden_dropout_prob", &mut cfg.hidden_dropout_prob),
                    (
                        "attention_probs_dropout_prob",
                        &mut cfg.attention_probs_dropout_prob,
                    ),
                ] {
                    if !cfg.keys.iter().any(|k| k == key) {
                        *p = 0.0;
                    }
                }
            }
        }
        if let Some(kind) = cfg.family(path).ok().and_then(RotaryKind::of) {
            let (positions, act, types, eps, pad) = kind.defaults();
            let missing = |key: &str| !cfg.keys.iter().any(|k| k == key);
            if missing("max_position_embeddings") {
                cfg.max_position_embeddings = positions;
            }
            if missing("hidden_act") {
                cfg.hidden_act = act.into();
            }
            if missing("type_vocab_size") {
                cfg.type_vocab_size = types;
            }
            if missing("layer_norm_eps") {
                cfg.layer_norm_eps = eps;
            }
            if missing("pad_token_id") {
                cfg.pad_token_id = Some(pad);
            }
        }
        if let Ok(Family::DebertaV2) = cfg.family(path) {
            // transformers' DebertaV2Config defaults where they differ from BERT's.
            let missing = |key: &str| !cfg.keys.iter().any(|k| k == key);
            if missing("type_vocab_size") {
                cfg.type_vocab_size = 0;
            }
            if missing("layer_norm_eps") {
                cfg.layer_norm_eps = 1e-7;
            }
        }
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The row of the token table that PyTorch's `nn.Embedding(padding_idx=...)` never
    /// trains: `pad_token_id` when the file gives one (not `null`), else none. It matters
    /// for decoders, whose pad token is often their EOS, a real token of every text.
    pub fn padding_idx(&self) -> Option<u32> {
        self.pad_token_id.map(|id| id as u32)
    }

    /// The config as JSON, as a `config.json` writes it: a decoder's holds the keys of the
    /// file it was read from alone (the fields only BERT has stay out); an encoder's every
    /// field.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).unwrap_or_default();
        if matches!(self.family(Path::new("config")), Ok(Family::DistilBert)) {
            return distilbert::to_own_names(value);
        }
        let own_keys = self
            .family(Path::new("config"))
            .is_ok_and(|f| f.is_decoder() || f.is_rotary_post_norm() || f == Family::DebertaV2);
        if own_keys && !self.keys.is_empty() {
            if let Some(map) = value.as_object_mut() {
                map.retain(|k, _| self.keys.iter().any(|key| key == k));
            }
        }
        value
    }

    /// The family of `model_type`; another type is refused with the supported ones named.
    pub fn family(&self, path: &Path) -> Result<Family> {
        match self.model_type.as_deref() {
            None | Some("bert") => Ok(Family::Bert),
            // Jina v3's release: XLM-R's type over rotary layers (its remote code).
            Some("xlm-roberta") if self.position_embedding_type == "rotary" => Ok(Family::JinaV3),
            Some("roberta" | "xlm-roberta" | "camembert") => Ok(Family::Roberta),
            Some("mpnet") => Ok(Family::MpNet),
            Some("distilbert") => Ok(Family::DistilBert),
            Some("modernbert") => Ok(Family::ModernBert),
            Some("qwen3") => Ok(Family::Qwen3),
            Some("qwen2") => Ok(Family::Qwen2),
            Some("llama") => Ok(Family::Llama),
            Some("mistral") => Ok(Family::Mistral),
            Some("gemma3_text") => Ok(Family::Gemma3),
            Some("eurobert") => Ok(Family::EuroBert),
            Some("nomic_bert") => Ok(Family::NomicBert),
            Some("gte") => Ok(Family::Gte),
            Some("jina_embeddings_v3") => Ok(Family::JinaV3),
            Some("deberta-v2") => Ok(Family::DebertaV2),
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
            Ok(Family::Roberta) => self.pad_token_id.unwrap_or(0) + 1,
            // MPNet's embeddings fix the padding index at 1, whatever the config says.
            Ok(Family::MpNet) => 2,
            _ => 0,
        }
    }

    /// The fields a decoder's (and the rotary encoders') settings read.
    fn decoder_fields(&self) -> DecoderFields<'_> {
        DecoderFields {
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            num_hidden_layers: self.num_hidden_layers,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            hidden_act: &self.hidden_act,
            max_position_embeddings: self.max_position_embeddings,
            extra: &self.extra,
        }
    }

    /// A decoder's settings, read from the config's fields beyond BERT's; an error for an
    /// encoder family.
    pub fn decoder(&self, path: &Path) -> Result<DecoderSettings> {
        let family = self.family(path)?;
        let Some(kind) = DecoderKind::of(family) else {
            return Err(Error::UnsupportedConfig {
                field: "model_type",
                value: self.model_type.clone().unwrap_or_else(|| "bert".into()),
                supported: "qwen3, qwen2, llama, mistral, gemma3_text, eurobert",
                path: path.to_path_buf(),
            });
        };
        let fields = self.decoder_fields();
        DecoderSettings::from_config(&fields, kind, path)
    }

    /// The settings of NomicBERT, GTE or Jina v3 (the rotary post-norm layers); an error
    /// for another family.
    pub fn rotary(&self, path: &Path) -> Result<RotarySettings> {
        let family = self.family(path)?;
        let Some(kind) = RotaryKind::of(family) else {
            return Err(Error::UnsupportedConfig {
                field: "model_type",
                value: self.model_type.clone().unwrap_or_else(|| "bert".into()),
                supported: "nomic_bert, gte, jina_embeddings_v3",
                path: path.to_path_buf(),
            });
        };
        let fields = self.decoder_fields();
        RotarySettings::from_config(&fields, self.activation(path)?, kind, path)
    }

    /// The task adapters the model carries (Jina v3's `lora_adaptations`); `None` for a
    /// model without them, of any family.
    pub fn task_adapters(&self, path: &Path) -> Result<Option<TaskAdapters>> {
        if !self.family(path)?.is_rotary_post_norm() {
            return Ok(None);
        }
        Ok(self.rotary(path)?.tasks)
    }

    /// DeBERTa-v2/v3's settings, read from the config's fields beyond BERT's.
    pub fn deberta(&self, path: &Path) -> Result<DebertaSettings> {
        DebertaSettings::from_config(
            &self.extra,
            (
                self.hidden_size,
                self.num_attention_heads,
                self.max_position_embeddings,
            ),
            path,
        )
    }

    /// ModernBERT's settings, read from the config's fields beyond BERT's.
    pub fn modern(&self, path: &Path) -> Result<ModernSettings> {
        let x = &self.extra;
        let num = |key: &str, default: f64| x.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
        let flag =
            |key: &str, default: bool| x.get(key).and_then(|v| v.as_bool()).unwrap_or(default);
        let activation = match x.get("hidden_activation").and_then(|v| v.as_str()) {
            None | Some("gelu") => Activation::Gelu,
            Some("gelu_new" | "gelu_pytorch_tanh") => Activation::GeluTanh,
            Some("relu") => Activation::Relu,
            Some(other) => {
                return Err(Error::UnsupportedConfig {
                    field: "hidden_activation",
                    value: other.to_string(),
                    supported: "gelu, gelu_new, gelu_pytorch_tanh, relu",
                    path: path.to_path_buf(),
                })
            }
        };
        let layers = self.num_hidden_layers;
        let sliding = match x.get("layer_types").and_then(|v| v.as_array()) {
            Some(types) => {
                let parsed: Vec<Option<bool>> = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Some(true),
                        Some("full_attention") => Some(false),
                        _ => None,
                    })
                    .collect();
                if parsed.len() != layers || parsed.iter().any(Option::is_none) {
                    return Err(Error::UnsupportedConfig {
                        field: "layer_types",
                        value: serde_json::Value::Array(types.clone()).to_string(),
                        supported: "one of full_attention, sliding_attention per layer",
                        path: path.to_path_buf(),
                    });
                }
                parsed.into_iter().flatten().collect()
            }
            None => {
                let every = (num("global_attn_every_n_layers", 3.0) as usize).max(1);
                (0..layers).map(|i| i % every != 0).collect()
            }
        };
        let rope = |kind: &str, old_key: &str, default: f64| -> Result<f64> {
            let params = x.get("rope_parameters").and_then(|p| p.get(kind));
            if let Some(t) = params
                .and_then(|p| p.get("rope_type"))
                .and_then(|t| t.as_str())
            {
                if t != "default" {
                    return Err(Error::UnsupportedConfig {
                        field: "rope_parameters.rope_type",
                        value: t.to_string(),
                        supported: "default",
                        path: path.to_path_buf(),
                    });
                }
            }
            Ok(params
                .and_then(|p| p.get("rope_theta"))
                .and_then(|v| v.as_f64())
                .unwrap_or_else(|| num(old_key, default)))
        };
        Ok(ModernSettings {
            norm_eps: num("norm_eps", 1e-5),
            norm_bias: flag("norm_bias", false),
            attention_bias: flag("attention_bias", false),
            mlp_bias: flag("mlp_bias", false),
            activation,
            sliding,
            global_theta: rope("full_attention", "global_rope_theta", 160_000.0)?,
            local_theta: rope("sliding_attention", "local_rope_theta", 10_000.0)?,
            half_window: num("local_attention", 128.0) as usize / 2,
            dropout: [
                num("embedding_dropout", 0.0),
                num("attention_dropout", 0.0),
                num("mlp_dropout", 0.0),
            ],
        })
    }

    /// MPNet's number of relative position buckets (`relative_attention_num_buckets`,
    /// default 32).
    pub fn relative_attention_buckets(&self) -> usize {
        self.extra
            .get("relative_attention_num_buckets")
            .and_then(|v| v.as_u64())
            .map_or(32, |v| v as usize)
    }

    /// DistilBERT's `sinusoidal_pos_embds`: the position table starts from sinusoids.
    pub fn sinusoidal_positions(&self) -> bool {
        matches!(self.family(Path::new("config")), Ok(Family::DistilBert))
            && self
                .extra
                .get("sinusoidal_pos_embds")
                .and_then(|v| v.as_bool())
                == Some(true)
    }

    /// The longest sequence the position embeddings cover, in tokens (special tokens
    /// included).
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings
            .saturating_sub(self.first_position())
    }

    /// Checks the values a BERT encoder depends on; `path` names the config in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        if self.family(path)?.is_decoder() {
            self.decoder(path)?;
            if self.max_position_embeddings == 0 || self.num_hidden_layers == 0 {
                return Err(Error::InvalidConfig {
                    field: "max_position_embeddings / num_hidden_layers",
                    value: format!(
                        "{} / {}",
                        self.max_position_embeddings, self.num_hidden_layers
                    ),
                    reason: "must be at least 1",
                });
            }
            return Ok(());
        }
        if self.family(path)?.is_rotary_post_norm() {
            self.rotary(path)?;
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
            let positive = [
                ("vocab_size", self.vocab_size),
                ("intermediate_size", self.intermediate_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("max_position_embeddings", self.max_position_embeddings),
            ];
            if let Some((field, _)) = positive.into_iter().find(|(_, v)| *v == 0) {
                return Err(Error::InvalidConfig {
                    field,
                    value: "0".into(),
                    reason: "must be at least 1",
                });
            }
            return Ok(());
        }
        if self.family(path)? == Family::ModernBert {
            let m = self.modern(path)?;
            for p in m.dropout {
                if !(0.0..1.0).contains(&p) {
                    return Err(Error::InvalidConfig {
                        field: "embedding_dropout / attention_dropout / mlp_dropout",
                        value: p.to_string(),
                        reason: "a drop probability must be in [0, 1)",
                    });
                }
            }
            if !(self.hidden_size / self.num_attention_heads.max(1)).is_multiple_of(2) {
                return Err(Error::InvalidConfig {
                    field: "num_attention_heads",
                    value: self.num_attention_heads.to_string(),
                    reason: "rotary embeddings need an even head width",
                });
            }
        }
        let deberta = self.family(path)? == Family::DebertaV2;
        if deberta {
            self.deberta(path)?;
        }
        if self.family(path)? == Family::MpNet && self.relative_attention_buckets() < 4 {
            return Err(Error::InvalidConfig {
                field: "relative_attention_num_buckets",
                value: self.relative_attention_buckets().to_string(),
                reason: "must be at least 4",
            });
        }
        // A field as the file names it (DistilBERT's own names).
        let own = |field: &'static str| match self.family(path) {
            Ok(Family::DistilBert) => distilbert::own_name(field),
            _ => field,
        };
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
            // DeBERTa's default is none.
            (
                "type_vocab_size",
                self.type_vocab_size.max(usize::from(deberta)),
            ),
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
                    field: own(field),
                    value: "0".into(),
                    reason: "must be at least 1",
                });
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(Error::InvalidConfig {
                field: own("num_attention_heads"),
                value: self.num_attention_heads.to_string(),
                reason: match own("hidden_size") {
                    "dim" => "must divide dim",
                    _ => "must divide hidden_size",
                },
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
                    field: own(field),
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
            "silu" | "swish" => Ok(Activation::Silu),
            other => Err(Error::UnsupportedConfig {
                field: match self.family(path) {
                    Ok(Family::DistilBert) => distilbert::own_name("hidden_act"),
                    _ => "hidden_act",
                },
                value: other.to_string(),
                supported: "gelu, gelu_new, gelu_pytorch_tanh, relu, silu",
                path: path.to_path_buf(),
            }),
        }
    }
}
