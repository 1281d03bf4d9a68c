//! What the configs of NomicBERT, GTE and Jina v3 say beyond BERT's fields
//! ([`RotarySettings`]), and the three layouts' names and defaults ([`RotaryKind`]), read
//! from the `config.json` transformers 5 writes for each and checked before anything is
//! built (the layers: `super::rotary_encoder`).

use std::path::Path;

use super::decoder_config::{DecoderFields, Rope};
use super::family::{Activation, Family};
use crate::{Error, Result};

/// Which of the three layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotaryKind {
    /// `nomic_bert`.
    Nomic,
    /// `gte`.
    Gte,
    /// `jina_embeddings_v3`.
    Jina,
}

impl RotaryKind {
    /// The family's layout, if it is one of these.
    pub fn of(family: Family) -> Option<Self> {
        match family {
            Family::NomicBert => Some(Self::Nomic),
            Family::Gte => Some(Self::Gte),
            Family::JinaV3 => Some(Self::Jina),
            _ => None,
        }
    }

    /// `config.json`'s `architectures` entry of the base model.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Nomic => "NomicBertModel",
            Self::Gte => "GteModel",
            Self::Jina => "JinaEmbeddingsV3Model",
        }
    }

    /// transformers' defaults for the fields a file may leave out: `max_position_embeddings`,
    /// `hidden_act`, `type_vocab_size`, `layer_norm_eps`, `pad_token_id`.
    pub fn defaults(self) -> (usize, &'static str, usize, f64, usize) {
        match self {
            Self::Nomic => (2_048, "silu", 2, 1e-12, 0),
            Self::Gte => (8_192, "gelu", 1, 1e-12, 1),
            Self::Jina => (8_194, "gelu", 1, 1e-5, 1),
        }
    }

    /// transformers' rotary base where the file names none (its config's `default_theta`).
    fn default_theta(self) -> f64 {
        match self {
            Self::Nomic => 1_000.0,
            Self::Gte => 160_000.0,
            Self::Jina => 10_000.0,
        }
    }

    /// The module names of a layer: `(layers list, qkv, attention output, first norm,
    /// second norm)`.
    pub(super) fn names(
        self,
    ) -> (
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
    ) {
        match self {
            Self::Nomic => (
                "encoder.layers",
                "attn.Wqkv",
                "attn.out_proj",
                "norm1",
                "norm2",
            ),
            Self::Gte => (
                "encoder.layer",
                "attention.qkv_proj",
                "attention.o_proj",
                "attn_ln",
                "mlp_ln",
            ),
            Self::Jina => (
                "encoder.layers",
                "mixer.Wqkv",
                "mixer.out_proj",
                "norm1",
                "norm2",
            ),
        }
    }

    /// The embeddings' norm.
    pub(super) fn embedding_norm(self) -> &'static str {
        match self {
            Self::Gte => "embeddings.LayerNorm",
            Self::Nomic | Self::Jina => "emb_ln",
        }
    }
}

/// What these families' configs say beyond BERT's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct RotarySettings {
    /// The layout.
    pub kind: RotaryKind,
    /// Width of a head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// The rotary frequencies (`rope_parameters`, or transformers 4's `rope_theta` and
    /// `rope_scaling`).
    pub rope: Rope,
    /// The feed-forward activation (`hidden_act`).
    pub activation: Activation,
}

impl RotarySettings {
    /// Reads and checks the fields of a config (`cfg`, its feed-forward `activation`;
    /// from `path`, named in errors).
    pub fn from_config(
        cfg: &DecoderFields,
        activation: Activation,
        kind: RotaryKind,
        path: &Path,
    ) -> Result<Self> {
        let bad = |field: &str, reason: String| Error::ModelConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let heads = cfg.num_attention_heads;
        if heads == 0 || cfg.hidden_size == 0 || !cfg.hidden_size.is_multiple_of(heads) {
            return Err(bad(
                "num_attention_heads",
                format!(
                    "= {heads} must divide hidden_size = {} (and be at least 1)",
                    cfg.hidden_size
                ),
            ));
        }
        let head_dim = cfg.hidden_size / heads;
        if let Some(d) = cfg.extra.get("head_dim").and_then(|v| v.as_u64()) {
            if d as usize != head_dim {
                return Err(bad(
                    "head_dim",
                    format!(
                        "= {d}: these layers' heads are hidden_size / num_attention_heads = \
                         {head_dim} wide"
                    ),
                ));
            }
        }
        if !head_dim.is_multiple_of(2) {
            return Err(bad(
                "num_attention_heads",
                format!("= {heads}: rotary embeddings need an even head width, not {head_dim}"),
            ));
        }
        // Jina v3's task adapters (the original release's LoRA weights beside the base)
        // change every projection's arithmetic: not built, refused rather than ignored.
        if let Some(tasks) = cfg.extra.get("lora_adaptations").filter(|v| !v.is_null()) {
            return Err(Error::UnsupportedConfig {
                field: "lora_adaptations",
                value: tasks.to_string(),
                supported: "none (Jina v3's task adapters are not built yet: load a \
                            checkpoint without them)",
                path: path.to_path_buf(),
            });
        }
        let rope = super::decoder_config::single_rope(cfg, head_dim, kind.default_theta(), path)?;
        Ok(Self {
            kind,
            head_dim,
            rope,
            activation,
        })
    }
}
