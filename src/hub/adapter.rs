//! PEFT LoRA adapter directories (`adapter_config.json`, `adapter_model.safetensors`):
//! what `gradcache export --adapter` writes and `PeftModel.save_pretrained` saves, read
//! to continue training an adapter (`model.lora.from`) or to embed with one over its base
//! model (`gradcache encode/eval --model ADAPTER_DIR`).

use std::path::{Path, PathBuf};

use crate::nn::lora::LoraSpec;
use crate::params::{Params, WeightFile};
use crate::{Error, Result};

/// PEFT's adapter config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// A LoRA adapter directory, read and checked.
#[derive(Debug, Clone)]
pub struct PeftAdapter {
    /// The directory.
    pub dir: PathBuf,
    /// Rank, alpha, targets and scale as the adapter was trained with.
    pub spec: LoraSpec,
    /// `base_model_name_or_path`: the model it adapts, if the config names one.
    pub base: Option<String>,
    /// The key prefix of its tensors (`base_model.model.` as PEFT saves them, or none).
    prefix: String,
    /// The adapters' module paths in the file.
    modules: Vec<String>,
    /// The family whose loaded names the file uses, read under the checkpoint's names.
    rotary: Option<crate::models::bert::RotaryKind>,
}

/// Whether `dir` holds a PEFT adapter (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

impl PeftAdapter {
    /// Reads `dir`'s adapter config and weights' names; settings this crate cannot run
    /// (another PEFT method, DoRA, trained biases, per-module ranks, extra trained
    /// modules, regular-expression targets) are refused naming the field.
    pub fn read(dir: &Path) -> Result<Self> {
        let config_path = dir.join(ADAPTER_CONFIG);
        let bad = |reason: String| Error::ModelFile {
            path: config_path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::MissingFile {
                    path: config_path.clone(),
                    what: "PEFT adapter config",
                }
            } else {
                Error::io("read", &config_path, e)
            }
        })?;
        let c: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let peft_type = c["peft_type"].as_str().unwrap_or("");
        if peft_type != "LORA" {
            return Err(bad(format!(
                "`peft_type` is {:?}: only LoRA adapters are supported",
                c["peft_type"]
            )));
        }
        let rank = c["r"]
            .as_u64()
            .filter(|&r| r > 0)
            .ok_or_else(|| bad(format!("`r` is {}, not a rank of 1 or more", c["r"])))?;
        let alpha = c["lora_alpha"]
            .as_f64()
            .filter(|a| a.is_finite() && *a > 0.0)
            .ok_or_else(|| {
                bad(format!(
                    "`lora_alpha` is {}, not a number > 0",
                    c["lora_alpha"]
                ))
            })?;
        let dropout = match &c["lora_dropout"] {
            serde_json::Value::Null => 0.0,
            value => value
                .as_f64()
                .filter(|p| (0.0..1.0).contains(p))
                .ok_or_else(|| {
                    bad(format!(
                        "`lora_dropout` is {value}, not a drop probability in [0, 1)"
                    ))
                })?,
        };
        let flag = |key: &str| c[key].as_bool().unwrap_or(false);
        let empty = |key: &str| match &c[key] {
            serde_json::Value::Null => true,
            serde_json::Value::Object(m) => m.is_empty(),
            serde_json::Value::Array(a) => a.is_empty(),
            _ => false,
        };
        for (key, refused) in [
            ("use_dora", flag("use_dora")),
            ("fan_in_fan_out", flag("fan_in_fan_out")),
            ("bias", !matches!(c["bias"].as_str(), None | Some("none"))),
            ("modules_to_save", !empty("modules_to_save")),
            ("rank_pattern", !empty("rank_pattern")),
            ("alpha_pattern", !empty("alpha_pattern")),
            ("layers_to_transform", !empty("layers_to_transform")),
        ] {
            if refused {
                return Err(bad(format!(
                    "`{key}` is {}: only plain LoRA on the projections (one rank and alpha, \
                     no trained biases or extra modules) is supported",
                    c[key]
                )));
            }
        }
        let targets = match &c["target_modules"] {
            serde_json::Value::Array(list) => list
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(String::from)
                        .ok_or_else(|| bad(format!("`target_modules` holds {t}, not a name")))
                })
                .collect::<Result<Vec<_>>>()?,
            serde_json::Value::String(s) if s == "all-linear" => Vec::new(),
            other => {
                return Err(bad(format!(
                    "`target_modules` is {other}: a list of module names (or \"all-linear\") \
                     is supported, not a regular expression"
                )))
            }
        };
        let weights = dir.join(ADAPTER_WEIGHTS);
        let probe = WeightFile::open(&weights, "")?;
        let names = probe.names();
        let prefix = if names.iter().any(|n| n.starts_with("base_model.model.")) {
            "base_model.model."
        } else {
            ""
        };
        let mut modules: Vec<String> = names
            .iter()
            .filter_map(|n| n.strip_prefix(prefix)?.strip_suffix(".lora_A.weight"))
            .map(String::from)
            .collect();
        modules.sort_unstable();
        if modules.is_empty() {
            return Err(Error::ModelFile {
                path: weights,
                reason: "holds no `lora_A` weight".into(),
            });
        }
        let adapter = Self {
            dir: dir.to_path_buf(),
            spec: LoraSpec {
                rank: rank as usize,
                alpha,
                targets,
                rslora: flag("use_rslora"),
                dropout,
            },
            base: c["base_model_name_or_path"]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(String::from),
            prefix: prefix.into(),
            modules,
            rotary: None,
        };
        // The base model's family where a config says it: the adapter directory's own
        // (`gradcache export --adapter` writes one), else a local base's.
        let config = [
            Some(dir.to_path_buf()),
            adapter.base.as_ref().map(PathBuf::from),
        ]
        .into_iter()
        .flatten()
        .map(|d| d.join("config.json"))
        .find(|c| c.is_file());
        match config.and_then(|c| crate::models::bert::BertConfig::from_file(&c).ok()) {
            Some(cfg) => match cfg.family(dir) {
                Ok(family) => adapter.for_family(family),
                Err(_) => Ok(adapter),
            },
            None => Ok(adapter),
        }
    }

    /// The adapter weights, read under the base model's names.
    pub fn weight_file(&self) -> Result<WeightFile> {
        let path = self.dir.join(ADAPTER_WEIGHTS);
        let file = WeightFile::open(&path, &self.prefix)?;
        let Some(kind) = self.rotary else {
            return Ok(file);
        };
        let adapters = file
            .read_all()?
            .into_iter()
            .filter_map(|(n, t)| Some((n.strip_prefix(&self.prefix)?.to_string(), t)))
            .collect();
        let renamed =
            crate::models::rotary_names::to_checkpoint_names(kind, &adapters).map_err(|e| {
                Error::ModelFile {
                    path: path.clone(),
                    reason: e.to_string(),
                }
            })?;
        Ok(WeightFile::from_tensors(&path, renamed))
    }

    /// The adapter for a base model of `family`: for NomicBERT, GTE and Jina v3, whose
    /// loaded modules PEFT names as transformers renames them, its tensors are read under
    /// the checkpoint's names (fused projections joined, `src/models/rotary_names.rs`).
    pub fn for_family(mut self, family: crate::models::bert::Family) -> Result<Self> {
        let Some(kind) = crate::models::bert::RotaryKind::of(family) else {
            return Ok(self);
        };
        if self.rotary.is_some() {
            return Ok(self);
        }
        self.rotary = Some(kind);
        let mut modules: Vec<String> = self
            .weight_file()?
            .names()
            .iter()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .map(String::from)
            .collect();
        modules.sort_unstable();
        // The targets as this crate names the modules (PEFT's name the loaded ones).
        self.spec.targets = modules.clone();
        self.modules = modules;
        Ok(self)
    }

    /// Every adapter a model built with [`Self::spec`] asked for (`params`, under the
    /// tower `prefix`) is in the file: an adapter trained for another model is refused
    /// rather than completed with fresh weights. Modules of the file the embedding model
    /// lacks (BertModel's pooler, which `dense` also targets) are left out.
    pub fn check_covers(&self, params: &Params, prefix: &str) -> Result<()> {
        let strip = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}.")
        };
        let wanted: Vec<&str> = params
            .names()
            .filter_map(|n| {
                n.strip_prefix(strip.as_str())?
                    .strip_suffix(".lora_A.weight")
            })
            .collect();
        if let Some(missing) = wanted.iter().find(|m| {
            self.modules
                .binary_search_by(|x| x.as_str().cmp(m))
                .is_err()
        }) {
            return Err(Error::ModelFile {
                path: self.dir.join(ADAPTER_WEIGHTS),
                reason: format!(
                    "has no adapter for `{missing}`, which its target_modules {:?} name in \
                     this model: the adapter was trained for another model",
                    self.spec.targets
                ),
            });
        }
        if wanted.is_empty() {
            return Err(Error::ModelFile {
                path: self.dir.join(ADAPTER_CONFIG),
                reason: format!(
                    "its target_modules {:?} name no projection of this model",
                    self.spec.targets
                ),
            });
        }
        Ok(())
    }
}
