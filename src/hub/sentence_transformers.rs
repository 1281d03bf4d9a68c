//! Reading the sentence-transformers files of a model, of every version of the package:
//! `modules.json` (module types of the old layout, `sentence_transformers.models.Pooling`,
//! and of the new, `sentence_transformers.sentence_transformer.modules.pooling.Pooling`
//! or `sentence_transformers.base.modules.dense.Dense`), the pooling config (the old
//! `pooling_mode_*` booleans with `word_embedding_dimension`, or the new `pooling_mode`
//! string with `embedding_dimension` and `include_prompt`), `Dense` modules after the
//! pooling (their weights from `model.safetensors`), `Normalize`, and the similarity of
//! `config_sentence_transformers.json`.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use crate::hub::files::{read_json, read_modules, MODULES, SENTENCE_TRANSFORMERS_CONFIG};
use crate::loss::Similarity;
use crate::models::bert::{
    DenseActivation, DenseSpec, Pooling, SparseSpec, SpladeActivation, SpladeStrategy,
};
use crate::{Error, Result};

/// What a sentence-transformers model directory says about its head.
#[derive(Debug, Clone)]
pub struct SentenceTransformersConfig {
    /// From the pooling module's `config.json`.
    pub pooling: Pooling,
    /// `include_prompt` of the pooling config (`true` when absent): whether the tokens of
    /// a prompt count in the pooling.
    pub include_prompt: bool,
    /// The `Dense` modules after the pooling, in order.
    pub dense: Vec<DenseLayer>,
    /// Whether `modules.json` lists a `Normalize` module (it comes last).
    pub normalize: bool,
    /// `similarity_fn_name` of `config_sentence_transformers.json`, when the file names one.
    pub similarity: Option<Similarity>,
    /// The query and passage prompts of `config_sentence_transformers.json`.
    pub prompts: Prompts,
    /// A `SparseEncoder`'s `SpladePooling` (then `pooling` is unused): the model is the
    /// transformer's masked-language-model head, pooled into one vocabulary-wide vector.
    pub sparse: Option<SparseSpec>,
}

/// The texts put before queries and passages (e5's `query: ` / `passage: `, an
/// instruction). Empty: none.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Prompts {
    /// Before every query.
    pub query: String,
    /// Before every passage (corpus document).
    pub passage: String,
    /// More prompts by name (a mixture's sources' instructions), written into `prompts`
    /// beside `query` and `passage` so that `encode(..., prompt_name=...)` finds them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub named: std::collections::BTreeMap<String, String>,
}

/// The prompt names sentence-transformers' `encode_document` looks for, in its order.
const PASSAGE_PROMPT_NAMES: [&str; 3] = ["document", "passage", "corpus"];

impl Prompts {
    /// Reads `prompts` and `default_prompt_name` of a `config_sentence_transformers.json`
    /// as `encode_query` / `encode_document` use them: the prompt named `query` (else the
    /// default prompt) for queries, the first of `document`, `passage`, `corpus` (else the
    /// default) for passages.
    pub fn from_sentence_transformers(config: &Value, path: &Path) -> Result<Self> {
        let prompts = match &config["prompts"] {
            Value::Null => serde_json::Map::new(),
            Value::Object(m) => m.clone(),
            _ => return Err(model_file(path, "`prompts` must map names to prompt texts")),
        };
        let text = |name: &str| -> Result<Option<String>> {
            match prompts.get(name) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(model_file(path, format!("prompt `{name}` is not a string"))),
            }
        };
        let default = match &config["default_prompt_name"] {
            Value::Null => None,
            Value::String(name) => Some(text(name)?.ok_or_else(|| {
                model_file(
                    path,
                    format!("`default_prompt_name` names `{name}`, which `prompts` does not hold"),
                )
            })?),
            _ => return Err(model_file(path, "`default_prompt_name` must be a string")),
        };
        let mut passage = None;
        for name in PASSAGE_PROMPT_NAMES {
            if let Some(p) = text(name)? {
                passage = Some(p);
                break;
            }
        }
        Ok(Self {
            query: text("query")?
                .or_else(|| default.clone())
                .unwrap_or_default(),
            passage: passage.or(default).unwrap_or_default(),
            named: Default::default(),
        })
    }

    /// The `prompts` object sentence-transformers reads back as the same two prompts.
    pub fn to_sentence_transformers(&self) -> Value {
        let mut m = serde_json::Map::new();
        if !self.query.is_empty() {
            m.insert("query".into(), json!(self.query));
        }
        if !self.passage.is_empty() {
            m.insert("passage".into(), json!(self.passage));
        }
        for (name, text) in &self.named {
            m.entry(name.clone()).or_insert_with(|| json!(text));
        }
        Value::Object(m)
    }

    /// Whether neither side has a prompt.
    pub fn is_empty(&self) -> bool {
        self.query.is_empty() && self.passage.is_empty()
    }
}

/// A `Dense` module: `activation(x W^T + b)` on the sentence embedding.
#[derive(Debug, Clone)]
pub struct DenseLayer {
    /// `linear.weight` `[out, in]`.
    pub weight: Tensor,
    /// `linear.bias` `[out]`, when the module has one.
    pub bias: Option<Tensor>,
    /// The activation after the product.
    pub activation: DenseActivation,
    /// The module's directory.
    pub dir: PathBuf,
}

impl DenseLayer {
    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.weight.dims().get(1).copied().unwrap_or(0)
    }

    /// The module as the encoder trains and applies it: its shape, and its directory's
    /// name (which names its parameters).
    pub fn spec(&self) -> DenseSpec {
        DenseSpec {
            path: self
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
            in_features: self.in_features(),
            out_features: self.out_features(),
            bias: self.bias.is_some(),
            activation: self.activation,
        }
    }
}

/// The kinds of module a sentence-transformers `modules.json` may list here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Module {
    Transformer,
    Pooling,
    Dense,
    Normalize,
    SpladePooling,
}

const SUPPORTED_MODULES: &str = "Transformer, Pooling, Dense, Normalize (in that order), or \
    Transformer (fill-mask) and SpladePooling";

/// The kind of a module type name of either layout: read from its class name, the last
/// part of the path.
fn module_kind(type_name: &str) -> Option<Module> {
    match type_name.rsplit('.').next().unwrap_or(type_name) {
        "Transformer" => Some(Module::Transformer),
        "Pooling" => Some(Module::Pooling),
        "Dense" => Some(Module::Dense),
        "Normalize" => Some(Module::Normalize),
        // The transformer of a SparseEncoder saved before sentence-transformers 5.4.
        "MLMTransformer" => Some(Module::Transformer),
        "SpladePooling" => Some(Module::SpladePooling),
        _ => None,
    }
}

fn model_file(path: &Path, reason: impl Into<String>) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The pooling mode and `include_prompt` of a pooling module's `config.json`, in the old
/// layout (`pooling_mode_*` booleans) or the new (`pooling_mode`).
pub fn read_pooling(path: &Path) -> Result<(Pooling, bool)> {
    let cfg = read_json(path)?;
    let include_prompt = cfg["include_prompt"].as_bool().unwrap_or(true);
    let unsupported = |value: String| Error::UnsupportedConfig {
        field: "pooling_mode",
        value,
        supported: "one of cls, mean, max, mean_sqrt_len_tokens, weightedmean, lasttoken",
        path: path.to_path_buf(),
    };
    let mode = match &cfg["pooling_mode"] {
        Value::String(name) => Pooling::from_name(name).ok_or_else(|| unsupported(name.clone()))?,
        Value::Array(names) if names.len() == 1 => {
            let name = names[0].as_str().unwrap_or_default();
            Pooling::from_name(name).ok_or_else(|| unsupported(name.to_string()))?
        }
        Value::Array(names) => {
            return Err(unsupported(format!(
                "{} (several modes concatenated)",
                Value::Array(names.clone())
            )))
        }
        Value::Null => {
            let on: Vec<Pooling> = Pooling::ALL
                .into_iter()
                .filter(|p| cfg[p.legacy_key()] == json!(true))
                .collect();
            match on.as_slice() {
                [one] => *one,
                [] => return Err(unsupported("no pooling_mode_* set".into())),
                several => {
                    let keys: Vec<&str> = several.iter().map(|p| p.legacy_key()).collect();
                    return Err(unsupported(format!(
                        "{} (several modes concatenated)",
                        keys.join(" + ")
                    )));
                }
            }
        }
        other => return Err(unsupported(other.to_string())),
    };
    Ok((mode, include_prompt))
}

/// A `Dense` module from its directory: `config.json` (`in_features`, `out_features`,
/// `bias`, `activation_function`) and `model.safetensors` (`linear.weight`,
/// `linear.bias`), read onto the CPU.
pub fn read_dense(dir: &Path) -> Result<DenseLayer> {
    let cfg_path = dir.join("config.json");
    let cfg = read_json(&cfg_path)?;
    let size = |key: &str| {
        cfg[key]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| model_file(&cfg_path, format!("`{key}` is missing or not a count")))
    };
    let (inp, out) = (size("in_features")?, size("out_features")?);
    let has_bias = cfg["bias"].as_bool().unwrap_or(true);
    let name = cfg["activation_function"]
        .as_str()
        .unwrap_or("torch.nn.modules.activation.Tanh");
    let activation =
        DenseActivation::from_torch_name(name).ok_or_else(|| Error::UnsupportedConfig {
            field: "activation_function",
            value: name.to_string(),
            supported: "Identity, Tanh, ReLU, GELU, Sigmoid",
            path: cfg_path.clone(),
        })?;
    let weights = dir.join("model.safetensors");
    if !weights.is_file() {
        if let Some(pickle) = ["pytorch_model.bin", "model.bin"]
            .iter()
            .find(|p| dir.join(p).is_file())
        {
            return Err(Error::PickleOnly {
                dir: dir.to_path_buf(),
                file: pickle.to_string(),
            });
        }
        return Err(Error::MissingFile {
            path: weights,
            what: "Dense module weights",
        });
    }
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu)
        .map_err(|e| model_file(&weights, e.to_string()))?;
    let weight = tensors
        .get("linear.weight")
        .cloned()
        .ok_or_else(|| model_file(&weights, "no tensor `linear.weight`"))?;
    if weight.dims() != [out, inp] {
        return Err(model_file(
            &weights,
            format!(
                "`linear.weight` is {:?}, the config says [{out}, {inp}]",
                weight.dims()
            ),
        ));
    }
    let bias = if has_bias {
        let b = tensors
            .get("linear.bias")
            .cloned()
            .ok_or_else(|| model_file(&weights, "no tensor `linear.bias`"))?;
        if b.dims() != [out] {
            return Err(model_file(
                &weights,
                format!("`linear.bias` is {:?}", b.dims()),
            ));
        }
        Some(b)
    } else {
        None
    };
    Ok(DenseLayer {
        weight: weight.to_dtype(candle_core::DType::F32)?,
        bias: bias
            .map(|b| b.to_dtype(candle_core::DType::F32))
            .transpose()?,
        activation,
        dir: dir.to_path_buf(),
    })
}

/// Reads the head of a sentence-transformers directory (an export of ours or any
/// sentence-transformers model, old or new): `None` when it has no `modules.json`. The
/// modules must be a Transformer, a Pooling, any number of Dense and at most one
/// Normalize, in that order; a module, pooling mode, activation or similarity this crate
/// does not implement is an error that names it, not a silent substitute.
pub fn read_sentence_transformers_config(dir: &Path) -> Result<Option<SentenceTransformersConfig>> {
    let modules_path = dir.join(MODULES);
    if !modules_path.is_file() || is_cross_encoder(dir) {
        return Ok(None);
    }
    let modules = read_modules(&modules_path)?;
    read_head(dir, &modules, &modules_path).map(Some)
}

/// Whether `dir` holds a sentence-transformers `CrossEncoder` (its
/// `config_sentence_transformers.json` says so): its one module is the transformer with
/// its classification head, no pooling (see [`crate::rerank`]).
pub fn is_cross_encoder(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(super::files::SENTENCE_TRANSFORMERS_CONFIG))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("model_type").and_then(|m| m.as_str()) == Some("CrossEncoder"))
}

/// The head of the model in `dir` whose modules are `modules` (types and directories
/// relative to `dir`, as `modules_path` lists them: a `modules.json`, or a router's route).
pub(crate) fn read_head(
    dir: &Path,
    modules: &[(String, PathBuf)],
    modules_path: &Path,
) -> Result<SentenceTransformersConfig> {
    let modules_path = modules_path.to_path_buf();
    let mut transformer = PathBuf::new();
    let mut pooling = None;
    let mut dense = Vec::new();
    let mut normalize = false;
    let mut sparse = None;
    let mut last = None;
    for (ty, path) in modules {
        let kind = module_kind(ty).ok_or_else(|| Error::UnsupportedConfig {
            field: "modules",
            value: ty.clone(),
            supported: SUPPORTED_MODULES,
            path: modules_path.clone(),
        })?;
        let in_order = match kind {
            Module::Transformer => last.is_none(),
            Module::Pooling | Module::SpladePooling => last == Some(Module::Transformer),
            Module::Dense => matches!(last, Some(Module::Pooling | Module::Dense)),
            Module::Normalize => matches!(last, Some(Module::Pooling | Module::Dense)),
        };
        if !in_order {
            return Err(Error::UnsupportedConfig {
                field: "modules",
                value: format!("{ty} after {last:?}"),
                supported: SUPPORTED_MODULES,
                path: modules_path.clone(),
            });
        }
        match kind {
            Module::Transformer => transformer = path.clone(),
            Module::Pooling => pooling = Some(read_pooling(&dir.join(path).join("config.json"))?),
            Module::Dense => dense.push(read_dense(&dir.join(path))?),
            Module::Normalize => normalize = true,
            Module::SpladePooling => {
                let config = dir.join(path).join("config.json");
                sparse = Some(read_splade_pooling(&config)?);
                check_splade_width(&config, &dir.join(&transformer).join("config.json"))?;
                pooling = Some((Pooling::Mean, true));
            }
        }
        last = Some(kind);
    }
    if sparse.is_some() && last != Some(Module::SpladePooling) {
        return Err(Error::UnsupportedConfig {
            field: "modules",
            value: format!("{last:?} after SpladePooling"),
            supported: SUPPORTED_MODULES,
            path: modules_path,
        });
    }
    let Some((pooling, include_prompt)) = pooling else {
        return Err(Error::UnsupportedConfig {
            field: "modules",
            value: "no Pooling module".into(),
            supported: SUPPORTED_MODULES,
            path: modules_path,
        });
    };
    let st_path = dir.join(SENTENCE_TRANSFORMERS_CONFIG);
    let st_config = if st_path.is_file() {
        read_json(&st_path)?
    } else {
        Value::Null
    };
    let prompts = Prompts::from_sentence_transformers(&st_config, &st_path)?;
    let similarity = if st_path.is_file() {
        match st_config["similarity_fn_name"].as_str() {
            // A SparseEncoder's default.
            None if sparse.is_some() => Some(Similarity::Dot),
            None => None,
            Some(name) => Some(
                Similarity::from_sentence_transformers_name(name).ok_or_else(|| {
                    Error::UnsupportedConfig {
                        field: "similarity_fn_name",
                        value: name.to_string(),
                        supported: "cosine, dot",
                        path: st_path.clone(),
                    }
                })?,
            ),
        }
    } else {
        None
    };
    Ok(SentenceTransformersConfig {
        pooling,
        include_prompt,
        dense,
        normalize,
        similarity,
        prompts,
        sparse,
    })
}

/// A `SpladePooling` config's `embedding_dimension` (or the older
/// `word_embedding_dimension`), when it gives one, must be the model's vocabulary size
/// (`config.json`'s `vocab_size`): the vector has one entry per vocabulary token.
fn check_splade_width(pooling: &Path, model_config: &Path) -> Result<()> {
    let config = read_json(pooling)?;
    let width = ["embedding_dimension", "word_embedding_dimension"]
        .iter()
        .find_map(|k| config[*k].as_u64());
    let (Some(width), true) = (width, model_config.is_file()) else {
        return Ok(());
    };
    let vocab = crate::models::bert::BertConfig::from_file(model_config)?.vocab_size;
    if width as usize != vocab {
        return Err(Error::UnsupportedConfig {
            field: "embedding_dimension",
            value: format!("{width} (the model's vocabulary has {vocab} tokens)"),
            supported: "the model's vocab_size: a sparse vector has one entry per token",
            path: pooling.to_path_buf(),
        });
    }
    Ok(())
}

/// The settings of a `SpladePooling` module's `config.json` (`pooling_strategy`,
/// `activation_function`; `embedding_dimension` is the vocabulary's size, read from the
/// model). A strategy or activation this crate does not run is refused by name.
pub fn read_splade_pooling(path: &Path) -> Result<SparseSpec> {
    let config = read_json(path)?;
    let name = |key: &str, default: &'static str| -> String {
        config[key].as_str().unwrap_or(default).to_string()
    };
    let strategy = name("pooling_strategy", "max");
    let strategy = SpladeStrategy::from_name(&strategy).ok_or(Error::UnsupportedConfig {
        field: "pooling_strategy",
        value: strategy,
        supported: "max, sum",
        path: path.to_path_buf(),
    })?;
    let activation = name("activation_function", "relu");
    let activation = SpladeActivation::from_name(&activation).ok_or(Error::UnsupportedConfig {
        field: "activation_function",
        value: activation,
        supported: "relu, log1p_relu",
        path: path.to_path_buf(),
    })?;
    Ok(SparseSpec {
        strategy,
        activation,
    })
}

impl crate::hub::files::ModelFiles {
    /// The sentence-transformers head of the model (an inference-free model's: its
    /// document route's); `None` without sentence-transformers files.
    pub fn head(&self) -> Result<Option<SentenceTransformersConfig>> {
        match &self.router {
            Some((root, layout)) => read_head(
                root,
                &layout.document,
                &root.join(crate::hub::files::ROUTER_CONFIG),
            )
            .map(Some),
            None => read_sentence_transformers_config(&self.dir),
        }
    }
}
