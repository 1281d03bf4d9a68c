//! Writing a trained BERT-family tower as a Hugging Face model directory that
//! `transformers.AutoModel` and `sentence_transformers.SentenceTransformer` load:
//! `config.json` (the family's `model_type` and architecture), `model.safetensors`
//! (Hugging Face `BertModel` / `RobertaModel` names, which are the same), `tokenizer.json`,
//! `tokenizer_config.json`, plus the sentence-transformers files `modules.json`,
//! `sentence_bert_config.json`, `config_sentence_transformers.json` and
//! `1_Pooling/config.json`, each `Dense` module the encoder trains in its own directory
//! (`2_Dense/config.json` and `model.safetensors`), and `N_Normalize` when the encoder
//! normalises.
//!
//! The directory is written under a temporary name, flushed to disk and renamed when
//! complete (a failed write removes it); an existing non-empty directory is never
//! overwritten. Every file gets the permissions the process
//! gives a new file (a model directory is meant to be shared).
//!
//! [`read_sentence_transformers_config`](crate::hub::sentence_transformers) reads the
//! pooling, normalisation and similarity back from such a directory (ours or any
//! sentence-transformers model).

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde_json::json;

pub use crate::hub::files::{MODULES, POOLING, SENTENCE_TRANSFORMERS_CONFIG};
pub use crate::hub::sentence_transformers::{
    read_sentence_transformers_config, Prompts, SentenceTransformersConfig,
};
use crate::hub::tokenizer::Tokenizer;
use crate::loss::Similarity;
use crate::models::bert::{BertConfig, BertOptions, Pooling};
use crate::params::Params;
use crate::{Error, Result};

/// A sparse model's `SpladePooling` module directory.
const SPLADE_POOLING: &str = "1_SpladePooling";

/// What an export records in `config_sentence_transformers.json` besides the similarity.
#[derive(Debug, Clone, Default)]
pub struct ExportNotes {
    /// The query and passage prompts the model was trained with (`prompts`).
    pub prompts: Prompts,
    /// The Matryoshka widths it was trained at (`matryoshka_dims`; empty: none), so that
    /// a user knows which prefixes of the embedding are usable (`truncate_dim`).
    pub matryoshka_dims: Vec<usize>,
    /// The prompts' tokens are left out of the pooling (`include_prompt = false` in the
    /// pooling config); false, the default: pooled with the text.
    pub prompt_left_out: bool,
    /// Export a LoRA run's adapters in PEFT's layout over this base model (its Hub id or
    /// directory, `base_model_name_or_path`) instead of the merged model; `None`: merged.
    pub adapter_of: Option<String>,
    /// A multi-vector (ColBERT) model: written in PyLate's layout (Transformer and its
    /// projections, `model_type: ColBERT` with these settings; sentence-transformers 6
    /// reads it too), with no pooling.
    pub multi_vector: Option<crate::hub::multi_vector::MultiVectorHead>,
    /// A model with task adapters (Jina v3's): write it with this task's merged into the
    /// base and no adapters, a plain model of its family (transformers' and
    /// sentence-transformers' own classes load it); `None`: the release's layout.
    pub merge_task: Option<usize>,
    /// An inference-free sparse model's query side: its static weights `[vocab]` and
    /// whether they are frozen. The export is then a sentence-transformers `Router`
    /// ([`crate::hub::router`]): the sparse model in `document_0_Transformer` and
    /// `document_1_SpladePooling`, the weights in `query_0_SparseStaticEmbedding`.
    pub static_query: Option<(Tensor, bool)>,
}

/// Writes `tensors` to `path` with the permissions of `sibling` (the safetensors writer
/// creates its file private, 0600; the siblings have what the process umask decided),
/// and returns those permissions.
fn write_weights(
    tensors: &HashMap<String, Tensor>,
    path: &Path,
    sibling: &Path,
) -> Result<fs::Permissions> {
    candle_core::safetensors::save(tensors, path).map_err(|e| Error::io("write", path, e))?;
    let shared = fs::metadata(sibling)
        .map_err(|e| Error::io("read", sibling, e))?
        .permissions();
    fs::set_permissions(path, shared.clone())
        .map_err(|e| Error::io("set permissions of", path, e))?;
    Ok(shared)
}

/// The model's `config.json`, under its family's own names so that `AutoModel` builds the
/// same architecture, and its `model.safetensors`.
fn write_model_files(
    dir: &Path,
    cfg: &BertConfig,
    weights: &HashMap<String, Tensor>,
    (masked_lm, merged_task): (bool, bool),
) -> Result<fs::Permissions> {
    let config_path = dir.join("config.json");
    let mut config = cfg.to_json();
    if merged_task {
        crate::models::task_adapters::plain_config(&mut config);
        config["architectures"] = json!(["JinaEmbeddingsV3Model"]);
        write_json(&config_path, &config)?;
        return write_weights(weights, &dir.join("model.safetensors"), &config_path);
    }
    let model_type = cfg.model_type.clone().unwrap_or_else(|| "bert".into());
    let decoder = cfg
        .family(&config_path)
        .ok()
        .and_then(crate::models::bert::DecoderKind::of);
    let rotary = cfg
        .family(&config_path)
        .ok()
        .and_then(crate::models::bert::RotaryKind::of);
    let architecture = match (model_type.as_str(), decoder) {
        (_, Some(kind)) => kind.architecture(),
        _ if rotary.is_some() => rotary.map_or("", |k| k.architecture()),
        ("roberta", _) => "RobertaModel",
        ("xlm-roberta", _) => "XLMRobertaModel",
        ("camembert", _) => "CamembertModel",
        ("mpnet", _) => "MPNetModel",
        ("modernbert", _) => "ModernBertModel",
        ("distilbert", _) => "DistilBertModel",
        _ => "BertModel",
    };
    // A sparse model is its family's masked-language model.
    let architecture = match (masked_lm, architecture) {
        (true, "DistilBertModel") => "DistilBertForMaskedLM",
        (true, _) => "BertForMaskedLM",
        (false, a) => a,
    };
    // Jina v3's release keeps its own classes (its remote code reads the adapters).
    let release = cfg.task_adapters(&config_path).ok().flatten().is_some()
        && config.get("architectures").is_some_and(|a| !a.is_null());
    if !release {
        config["architectures"] = json!([architecture]);
    }
    config["model_type"] = json!(model_type);
    write_json(&config_path, &config)?;
    write_weights(weights, &dir.join("model.safetensors"), &config_path)
}

pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::io("write", path, e))?;
    fs::write(path, text + "\n").map_err(|e| Error::io("write", path, e))
}

/// Exports the tower whose parameters are `params` under `prefix` (`""` for a shared
/// tower, e.g. `"query"` for one of two) to `dir`.
#[allow(clippy::too_many_arguments)]
pub fn export_bert(
    dir: &Path,
    cfg: &BertConfig,
    options: &BertOptions,
    similarity: Similarity,
    params: &Params,
    prefix: &str,
    tokenizer: &Tokenizer,
    notes: &ExportNotes,
) -> Result<()> {
    let adapter = match (&notes.adapter_of, &options.lora) {
        (Some(base), Some(lora)) => Some((base, lora)),
        (Some(_), None) => {
            return Err(Error::InvalidArgument {
                what: "--adapter",
                value: dir.display().to_string(),
                reason: "the run trains no LoRA adapters ([model.lora]): export the whole \
                         model without --adapter",
            })
        }
        (None, _) => None,
    };
    crate::durable::refuse_non_empty(dir)?;
    let strip = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}.")
    };
    let mut weights: HashMap<String, Tensor> = params
        .iter()
        .filter_map(|(n, v)| {
            n.strip_prefix(strip.as_str())
                .map(|s| (s.to_string(), v.as_tensor().clone()))
        })
        .collect();
    // A LoRA run exports the merged model, which loads as its base family's class, or
    // its adapters alone in PEFT's layout.
    let peft = match adapter {
        Some((base, lora)) => {
            // PEFT adapts the loaded model, whose modules transformers names its own way
            // for the families it renames on load (NomicBERT, GTE, Jina v3).
            let rotary = cfg
                .family(Path::new("config.json"))
                .ok()
                .and_then(crate::models::bert::RotaryKind::of);
            let named = match rotary {
                Some(kind) => crate::models::rotary_names::to_transformers_names(kind, &weights)?,
                None => weights.clone(),
            };
            Some(crate::nn::lora::peft_files(&named, lora, base)?)
        }
        None => {
            if let Some(lora) = &options.lora {
                crate::nn::lora::merge_into(&mut weights, lora)?;
            }
            None
        }
    };
    // Each Dense module's parameters go to its own directory, under `linear.*`.
    let mut dense_weights = Vec::new();
    for spec in &options.dense {
        let module = format!("{}.", spec.path);
        let names: Vec<String> = weights
            .keys()
            .filter(|n| n.starts_with(&module))
            .cloned()
            .collect();
        let mut own = HashMap::new();
        for name in names {
            if let Some(t) = weights.remove(&name) {
                own.insert(name[module.len()..].to_string(), t);
            }
        }
        dense_weights.push(own);
    }
    // A model with task adapters is written in its release's layout (the adapters
    // stacked over the tasks as parametrizations of their weights), or with one task
    // merged as a plain model.
    let tasks = cfg.task_adapters(Path::new("config.json"))?;
    let merged_task = match (&tasks, notes.merge_task) {
        (Some(tasks), Some(t)) => {
            weights = crate::models::task_adapters::merge_task(weights, t, tasks)?;
            true
        }
        (Some(tasks), None) => {
            weights = crate::models::task_adapters::release_layout(weights, tasks.names.len())?;
            false
        }
        (None, Some(t)) => {
            return Err(Error::InvalidArgument {
                what: "--task",
                value: t.to_string(),
                reason: "the model has no task adapters to merge",
            })
        }
        (None, None) => false,
    };
    // A sparse model's file is its `*ForMaskedLM`'s: the base model under the family's
    // prefix, the head under its own names beside it.
    let sparse = options.sparse;
    if sparse.is_some() {
        let family = cfg.family(Path::new("config.json"))?;
        let names =
            crate::models::sparse::MlmNames::of(family).ok_or_else(|| Error::InvalidArgument {
                what: "sparse export",
                value: cfg.model_type.clone().unwrap_or_else(|| "bert".into()),
                reason: "a sparse head exists for bert and distilbert models",
            })?;
        let base = match family {
            crate::models::bert::Family::DistilBert => "distilbert.",
            _ => "bert.",
        };
        weights = weights
            .into_iter()
            .map(|(n, t)| {
                let head = names
                    .modules
                    .iter()
                    .any(|m| n.starts_with(&format!("{m}.")));
                (if head { n } else { format!("{base}{n}") }, t)
            })
            .collect();
    }
    if weights.is_empty() {
        return Err(Error::InvalidArgument {
            what: "export prefix",
            value: format!("`{prefix}`"),
            reason: "no parameter has this prefix",
        });
    }

    let tmp = crate::durable::temporary_dir(dir, "export")?;
    let written = (|| -> Result<()> {
    fs::create_dir_all(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
    // An inference-free model's transformer goes to its router's document folder.
    let routed = notes.static_query.is_some() && sparse.is_some();
    let model_dir = if routed {
        tmp.join(crate::hub::router::DOCUMENT_DIR)
    } else {
        tmp.clone()
    };
    fs::create_dir_all(&model_dir).map_err(|e| Error::io("create", &model_dir, e))?;
    let colbert = notes.multi_vector.as_ref();
    if colbert.is_none() && sparse.is_none() {
        let pooling_dir = tmp.join("1_Pooling");
        fs::create_dir_all(&pooling_dir).map_err(|e| Error::io("create", &pooling_dir, e))?;
    }

    let shared = match &peft {
        Some((adapter_config, adapters)) => {
            let config_path = tmp.join("adapter_config.json");
            write_json(&config_path, adapter_config)?;
            write_weights(adapters, &tmp.join("adapter_model.safetensors"), &config_path)?
        }
        None => write_model_files(&model_dir, cfg, &weights, (sparse.is_some(), merged_task))?,
    };

    write_tokenizer_files(&model_dir, tokenizer)?;

    let mut modules = vec![
        json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
    ];
    match sparse {
        Some(spec) => {
            let pooling_dir = tmp.join(if routed {
                crate::hub::router::DOCUMENT_POOLING_DIR
            } else {
                SPLADE_POOLING
            });
            fs::create_dir_all(&pooling_dir)
                .map_err(|e| Error::io("create", &pooling_dir, e))?;
            write_json(
                &pooling_dir.join("config.json"),
                &json!({
                    "pooling_strategy": spec.strategy.name(),
                    "activation_function": spec.activation.name(),
                    "embedding_dimension": cfg.vocab_size,
                }),
            )?;
            modules.push(json!({"idx": 1, "name": "1", "path": SPLADE_POOLING, "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}));
        }
        None if colbert.is_none() => {
            modules.push(json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}));
        }
        None => {}
    }
    for (spec, own) in options.dense.iter().zip(&dense_weights) {
        let idx = modules.len();
        let module_dir = tmp.join(&spec.path);
        fs::create_dir_all(&module_dir).map_err(|e| Error::io("create", &module_dir, e))?;
        let mut config = spec.config();
        if colbert.is_some() {
            config["use_residual"] = json!(false);
        }
        write_json(&module_dir.join("config.json"), &config)?;
        let module_weights = module_dir.join("model.safetensors");
        candle_core::safetensors::save(own, &module_weights)
            .map_err(|e| Error::io("write", &module_weights, e))?;
        fs::set_permissions(&module_weights, shared.clone())
            .map_err(|e| Error::io("set permissions of", &module_weights, e))?;
        let class = match colbert {
            Some(_) => "pylate.models.Dense.Dense",
            None => "sentence_transformers.models.Dense",
        };
        modules.push(json!({"idx": idx, "name": idx.to_string(), "path": spec.path, "type": class}));
    }
    // PyLate normalises every token vector itself: no Normalize module.
    if options.normalize && colbert.is_none() && sparse.is_none() {
        let idx = modules.len();
        let path = format!("{idx}_Normalize");
        let normalize_dir = tmp.join(&path);
        fs::create_dir_all(&normalize_dir).map_err(|e| Error::io("create", &normalize_dir, e))?;
        modules.push(json!({"idx": idx, "name": idx.to_string(), "path": path, "type": "sentence_transformers.models.Normalize"}));
    }
    match &notes.static_query {
        Some((weight, frozen)) if routed => crate::hub::router::write_router(&tmp, weight, *frozen)?,
        _ => write_json(&tmp.join(MODULES), &json!(modules))?,
    }
    let mut transformer = json!({"max_seq_length": tokenizer.max_len(), "do_lower_case": false});
    if sparse.is_some() {
        transformer["transformer_task"] = json!("fill-mask");
    }
    write_json(&model_dir.join("sentence_bert_config.json"), &transformer)?;
    let st_config = match colbert {
        Some(c) => json!({
            "model_type": "ColBERT",
            "similarity_fn_name": "MaxSim",
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": null,
            "query_prefix": c.query_prefix,
            "document_prefix": c.document_prefix,
            "query_length": c.query_length,
            "document_length": c.document_length,
            "do_query_expansion": c.query_expansion,
            "attend_to_expansion_tokens": c.attend_to_expansion_tokens,
            "skiplist_words": c.skiplist_words,
        }),
        None if sparse.is_some() => json!({
            "model_type": "SparseEncoder",
            "similarity_fn_name": Similarity::Dot.sentence_transformers_name(),
            "prompts": notes.prompts.to_sentence_transformers(),
            "default_prompt_name": null,
        }),
        None => json!({
            "similarity_fn_name": similarity.sentence_transformers_name(),
            "prompts": notes.prompts.to_sentence_transformers(),
            "default_prompt_name": null,
            "matryoshka_dims": notes.matryoshka_dims,
        }),
    };
    write_json(&tmp.join(SENTENCE_TRANSFORMERS_CONFIG), &st_config)?;
    if colbert.is_none() && sparse.is_none() {
        write_json(
            &tmp.join(POOLING),
            &pooling_config(cfg.hidden_size, options.pooling, !notes.prompt_left_out),
        )?;
    }
    Ok(())
    })()
    .and_then(|()| crate::durable::publish_dir(&tmp, dir));
    if written.is_err() {
        // A failed write (a full disk) leaves no partial directory behind.
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}

/// Writes `tokenizer.json` (no padding or truncation) and `tokenizer_config.json` (the
/// model's own with this tokenizer's limit and padding side, else one generated for the
/// vocabulary's special tokens) into `model_dir`.
pub(crate) fn write_tokenizer_files(model_dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
    let mut plain = tokenizer.inner().clone();
    plain.with_padding(None);
    plain
        .with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    plain
        .save(model_dir.join("tokenizer.json"), false)
        .map_err(|e| Error::io("write", &model_dir.join("tokenizer.json"), e))?;
    // The special tokens of the vocabulary's convention: BERT's `[CLS]`-style or the
    // RoBERTa family's `<s>`-style (the first that the vocabulary holds).
    let special = |names: &[&str]| {
        names
            .iter()
            .find(|t| plain.token_to_id(t).is_some())
            .map(|t| json!(t))
            .unwrap_or(serde_json::Value::Null)
    };
    let tokenizer_config = match tokenizer.config() {
        // The model's own (its special tokens, padding side, class), with this
        // tokenizer's limit and side.
        Some(own) => {
            let mut own = serde_json::Value::Object(own.clone());
            own["model_max_length"] = json!(tokenizer.max_len());
            own["padding_side"] = json!(if tokenizer.pads_left() {
                "left"
            } else {
                "right"
            });
            own
        }
        None => {
            let mut generated = json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": tokenizer.max_len(),
                "cls_token": special(&["[CLS]", "<s>"]),
                "sep_token": special(&["[SEP]", "</s>"]),
                "pad_token": special(&["[PAD]", "<pad>"]),
                "unk_token": special(&["[UNK]", "<unk>"]),
                "mask_token": special(&["[MASK]", "<mask>"]),
            });
            if plain.token_to_id("<s>").is_some() && plain.token_to_id("</s>").is_some() {
                generated["bos_token"] = json!("<s>");
                generated["eos_token"] = json!("</s>");
            }
            generated
        }
    };
    write_json(&model_dir.join("tokenizer_config.json"), &tokenizer_config)?;
    Ok(())
}

/// The pooling module's `config.json` in the layout every version of sentence-transformers
/// reads: the width as `word_embedding_dimension` and one `pooling_mode_*` boolean per
/// mode (the current package converts both to its `embedding_dimension` and
/// `pooling_mode`; older ones refuse keys they do not know).
pub fn pooling_config(width: usize, pooling: Pooling, include_prompt: bool) -> serde_json::Value {
    let mut cfg = serde_json::Map::new();
    cfg.insert("word_embedding_dimension".into(), json!(width));
    for mode in Pooling::ALL {
        cfg.insert(mode.legacy_key().into(), json!(mode == pooling));
    }
    cfg.insert("include_prompt".into(), json!(include_prompt));
    serde_json::Value::Object(cfg)
}
