//! `[model.lora]` and `model.base_dtype`: the LoRA settings of a text-pair run, and the
//! adapter `model.lora.from` continues.

use std::path::PathBuf;

use crate::error::invalid;
use crate::hub::adapter::PeftAdapter;
use crate::{Error, Result};

/// `model.base_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseDtype {
    /// Full width.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl BaseDtype {
    pub(super) fn is_f32(&self) -> bool {
        *self == BaseDtype::F32
    }

    /// The candle dtype.
    pub fn dtype(self) -> candle_core::DType {
        match self {
            BaseDtype::F32 => candle_core::DType::F32,
            BaseDtype::Bf16 => candle_core::DType::BF16,
            BaseDtype::F16 => candle_core::DType::F16,
        }
    }
}

/// `[model.lora]`: low-rank adapters as PEFT builds them.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// A PEFT adapter directory to continue training (`adapter_config.json`,
    /// `adapter_model.safetensors`): its rank, alpha, targets and weights; the settings
    /// below, where given, must agree with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<PathBuf>,
    /// The adapters' rank `r` (default 16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The update is scaled by `alpha / rank` (`alpha / sqrt(rank)` with `rslora`;
    /// default 32).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// Dropout on the adapters' input (PEFT's `lora_dropout`), in `[0, 1)`; unset: 0, or
    /// with `from` the adapter's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// Module names as PEFT's `target_modules` matches them (`q_proj`, `query`,
    /// `self_attn.o_proj`, `layers.*.mlp.*`); unset: every linear projection of attention
    /// and feed-forward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<String>>,
    /// rsLoRA's scale `alpha / sqrt(rank)` (default false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rslora: Option<bool>,
}

/// The rank of a new adapter when `model.lora.rank` is unset.
pub const DEFAULT_LORA_RANK: usize = 16;
/// The alpha of a new adapter when `model.lora.alpha` is unset.
pub const DEFAULT_LORA_ALPHA: f64 = 32.0;

impl LoraConfig {
    /// Checks the settings that need no file (`pretrained`: the run's `model.pretrained`).
    pub(super) fn validate(&self, pretrained: &str) -> Result<()> {
        if self.rank == Some(0) {
            return Err(invalid("model.lora.rank", 0, "must be at least 1"));
        }
        if let Some(alpha) = self.alpha.filter(|a| !(a.is_finite() && *a > 0.0)) {
            return Err(invalid(
                "model.lora.alpha",
                alpha,
                "must be a finite number greater than 0",
            ));
        }
        if self.from.is_some() && pretrained.is_empty() {
            return Err(invalid(
                "model.lora.from",
                self.from
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                "continues an adapter of a pretrained model: set model.pretrained to its \
                 base model",
            ));
        }
        if let Some(p) = self.dropout.filter(|p| !(0.0..1.0).contains(p)) {
            return Err(invalid(
                "model.lora.dropout",
                p,
                "the drop probability must be in [0, 1)",
            ));
        }
        if let Some(t) = self.targets.iter().flatten().find(|t| t.trim().is_empty()) {
            return Err(invalid(
                "model.lora.targets",
                format!("{t:?}"),
                "names no module",
            ));
        }
        Ok(())
    }

    /// The adapters' settings: the configured ones, or with `from` the adapter's (which
    /// configured ones must match), and the adapter read.
    pub fn spec(&self) -> Result<(crate::nn::lora::LoraSpec, Option<PeftAdapter>)> {
        let Some(dir) = &self.from else {
            return Ok((
                crate::nn::lora::LoraSpec {
                    rank: self.rank.unwrap_or(DEFAULT_LORA_RANK),
                    alpha: self.alpha.unwrap_or(DEFAULT_LORA_ALPHA),
                    targets: self.targets.clone().unwrap_or_default(),
                    rslora: self.rslora.unwrap_or(false),
                    dropout: self.dropout.unwrap_or(0.0),
                },
                None,
            ));
        };
        let adapter = PeftAdapter::read(dir)?;
        let theirs = &adapter.spec;
        let differs = |field: &'static str, ours: String, key: &str, theirs: String| {
            Err(Error::InvalidConfig {
                field,
                value: format!(
                    "{ours} (the adapter's `{key}` is {theirs}: {})",
                    dir.display()
                ),
                reason: "must match the adapter model.lora.from continues; leave it unset",
            })
        };
        if let Some(rank) = self.rank.filter(|&r| r != theirs.rank) {
            return differs(
                "model.lora.rank",
                rank.to_string(),
                "r",
                theirs.rank.to_string(),
            );
        }
        if let Some(alpha) = self.alpha.filter(|&a| a != theirs.alpha) {
            return differs(
                "model.lora.alpha",
                alpha.to_string(),
                "lora_alpha",
                theirs.alpha.to_string(),
            );
        }
        if let Some(targets) = self.targets.as_ref().filter(|t| **t != theirs.targets) {
            return differs(
                "model.lora.targets",
                format!("{targets:?}"),
                "target_modules",
                format!("{:?}", theirs.targets),
            );
        }
        if let Some(rslora) = self.rslora.filter(|&r| r != theirs.rslora) {
            return differs(
                "model.lora.rslora",
                rslora.to_string(),
                "use_rslora",
                theirs.rslora.to_string(),
            );
        }
        let mut spec = adapter.spec.clone();
        // A training setting, not the adapter's: the configured one where given.
        if let Some(p) = self.dropout {
            spec.dropout = p;
        }
        Ok((spec, Some(adapter)))
    }
}
