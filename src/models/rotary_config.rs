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
            Self::Jina => 20_000.0,
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
    /// Jina v3's task adapters, where the checkpoint carries them.
    pub tasks: Option<TaskAdapters>,
}

/// Jina v3's task adapters as its release carries them (`lora_adaptations`): every
/// embedding table and linear projection of the model gains, per task, a low-rank update
/// of its weight (PyTorch parametrizations of the weight), which the task's inputs are
/// encoded with:
///
/// ```text
/// linear     W' = W + s B[t] A[t]     A [tasks, r, in], B [tasks, out, r]
/// embedding  E' = E + s A[t] B[t]     A [tasks, rows, r], B [tasks, r, dim]
/// s = lora_alpha / lora_rank
/// ```
///
/// No task: the base weights alone. A task's text is put after its instruction
/// (`task_instructions`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskAdapters {
    /// The tasks, in the order of the adapters' first dimension (`lora_adaptations`).
    pub names: Vec<String>,
    /// `lora_rank`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `lora_dropout_p`: dropout on the adapters' input features in training.
    pub dropout: f64,
    /// Each task's instruction (`task_instructions`; empty where it names none).
    pub instructions: Vec<String>,
}

impl TaskAdapters {
    /// The scale `s = alpha / r` of every update.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The index of `task`, or an error naming the tasks the model has (`field`: the
    /// setting that asked for it).
    pub fn index(&self, task: &str, field: &'static str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == task)
            .ok_or_else(|| Error::InvalidConfig {
                field,
                value: format!("{task:?} (the model's tasks: {})", self.names.join(", ")),
                reason: "is not one of the model's task adapters",
            })
    }

    /// The adapters a config declares (`None` without `lora_adaptations`): Jina v3's
    /// alone; a list that is empty or names a task twice, a rank of 0, or another
    /// family's, refused naming the field.
    fn from_config(cfg: &DecoderFields, kind: RotaryKind, path: &Path) -> Result<Option<Self>> {
        let x = &cfg.extra;
        let Some(list) = x.get("lora_adaptations").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let bad = |field: &str, reason: String| Error::ModelConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        if kind != RotaryKind::Jina {
            return Err(bad(
                "lora_adaptations",
                "task adapters are Jina v3's (jina_embeddings_v3); this family has none".into(),
            ));
        }
        let names: Vec<String> = list
            .as_array()
            .and_then(|a| a.iter().map(|v| v.as_str().map(String::from)).collect())
            .ok_or_else(|| {
                bad(
                    "lora_adaptations",
                    format!("= {list}: not a list of task names"),
                )
            })?;
        let mut seen = std::collections::HashSet::new();
        if names.is_empty() || !names.iter().all(|n| !n.is_empty() && seen.insert(n)) {
            return Err(bad(
                "lora_adaptations",
                format!("= {list}: needs at least one task, each named once"),
            ));
        }
        let rank = x.get("lora_rank").and_then(|v| v.as_u64()).unwrap_or(4) as usize;
        if rank == 0 {
            return Err(bad(
                "lora_rank",
                "= 0: an adapter needs a rank of at least 1".into(),
            ));
        }
        let alpha = x.get("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(1.0);
        let dropout = x
            .get("lora_dropout_p")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.0);
        if !(0.0..1.0).contains(&dropout) {
            return Err(bad("lora_dropout_p", format!("= {dropout}: not in [0, 1)")));
        }
        let own = x.get("task_instructions").and_then(|v| v.as_object());
        let instructions = names
            .iter()
            .map(|n| {
                own.and_then(|m| m.get(n))
                    .and_then(|v| v.as_str())
                    .unwrap_or("")
                    .to_string()
            })
            .collect();
        Ok(Some(Self {
            names,
            rank,
            alpha,
            dropout,
            instructions,
        }))
    }
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
        let tasks = TaskAdapters::from_config(cfg, kind, path)?;
        // The release's config names the rotary base `rotary_emb_base`.
        let theta = match cfg.extra.get("rotary_emb_base").and_then(|v| v.as_f64()) {
            Some(base) if kind == RotaryKind::Jina => base,
            _ => kind.default_theta(),
        };
        let rope = super::decoder_config::single_rope(cfg, head_dim, theta, path)?;
        Ok(Self {
            kind,
            head_dim,
            rope,
            activation,
            tasks,
        })
    }
}
