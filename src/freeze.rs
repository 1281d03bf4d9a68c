//! Which parameters a run freezes (`model.freeze`, LoRA's base) and the dtype LoRA's frozen
//! projections are stored in: the rule the parameter store serves frozen names by.

use std::sync::Arc;

use candle_core::DType;

use crate::names::{is_adapter, is_buffer, pattern_matches, targets_module};

/// Which parameters a run freezes: those matching a pattern of `model.freeze`, and with
/// LoRA every parameter but the adapters'.
///
/// A pattern matches a parameter name (with or without its tower's `query.` / `passage.`
/// prefix) when it names the parameter or a module above it (`embeddings`,
/// `encoder.layer.0`, `layers.3.mlp`), or, with `*` standing for any run of characters,
/// the whole name (`encoder.layer.*.attention.*`).
#[derive(Clone, Debug, Default)]
pub struct Freeze {
    patterns: Arc<Vec<String>>,
    all_but_adapters: bool,
    /// The dtype LoRA's targeted projections' base weights are stored in, and the
    /// adapters' settings that say which they are.
    narrow: Option<(DType, Arc<Vec<String>>)>,
}

impl Freeze {
    /// Freezes what `patterns` match.
    pub fn patterns(patterns: &[String]) -> Self {
        Self {
            patterns: Arc::new(patterns.to_vec()),
            all_but_adapters: false,
            narrow: None,
        }
    }

    /// Also freezes everything but the LoRA adapters (`lora_A` / `lora_B`).
    pub fn all_but_adapters(mut self) -> Self {
        self.all_but_adapters = true;
        self
    }

    /// Stores the base weights of the projections LoRA's `targets` name (empty: the
    /// default ones) in `dtype` (bf16 halves them); the adapters merge onto them in f32.
    pub fn narrowing(mut self, dtype: DType, targets: &[String]) -> Self {
        self.narrow = (dtype != DType::F32).then(|| (dtype, Arc::new(targets.to_vec())));
        self
    }

    /// The dtype the weight `name` is stored in when it is narrowed.
    pub(crate) fn narrowed(&self, name: &str) -> Option<DType> {
        let (dtype, targets) = self.narrow.as_ref()?;
        let module = name.strip_suffix(".weight")?;
        (self.matches(name) && targets_module(targets, module)).then_some(*dtype)
    }

    /// Whether nothing is frozen.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty() && !self.all_but_adapters
    }

    /// The patterns, as given.
    pub fn pattern_list(&self) -> &[String] {
        &self.patterns
    }

    /// Whether the parameter `name` is frozen.
    pub fn matches(&self, name: &str) -> bool {
        if is_buffer(name) {
            return false;
        }
        if self.all_but_adapters && !is_adapter(name) {
            return true;
        }
        self.patterns.iter().any(|p| pattern_matches(p, name))
    }
}
