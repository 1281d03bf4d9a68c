//! Writing a trained BERT tower as a Hugging Face model directory that
//! `transformers.AutoModel` and `sentence_transformers.SentenceTransformer` load:
//! `config.json`, `model.safetensors` (Hugging Face `BertModel` names), `tokenizer.json`,
//! `tokenizer_config.json`, plus the sentence-transformers files `modules.json`,
//! `sentence_bert_config.json`, `config_sentence_transformers.json` and
//! `1_Pooling/config.json` (and `2_Normalize` when the encoder normalises).
//!
//! The directory is written under a temporary name and renamed when complete; an existing
//! non-empty directory is never overwritten. Every file gets the permissions the process
//! gives a new file (a model directory is meant to be shared).
//!
//! [`read_sentence_transformers_config`] reads the pooling, normalisation and similarity
//! back from such a directory (ours or any sentence-transformers model).

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde_json::json;

pub use crate::hub::files::{MODULES, POOLING, SENTENCE_TRANSFORMERS_CONFIG};
use crate::hub::tokenizer::Tokenizer;
use crate::loss::Similarity;
use crate::models::bert::{BertConfig, BertOptions, Pooling};
use crate::params::Params;
use crate::{Error, Result};

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::io("write", path, e))?;
    fs::write(path, text + "\n").map_err(|e| Error::io("write", path, e))
}

/// Exports the tower whose parameters are `params` under `prefix` (`""` for a shared
/// tower, e.g. `"query"` for one of two) to `dir`.
pub fn export_bert(
    dir: &Path,
    cfg: &BertConfig,
    options: &BertOptions,
    similarity: Similarity,
    params: &Params,
    prefix: &str,
    tokenizer: &Tokenizer,
) -> Result<()> {
    if dir.exists()
        && fs::read_dir(dir)
            .map_err(|e| Error::io("list", dir, e))?
            .next()
            .is_some()
    {
        return Err(Error::OutputExists {
            path: dir.to_path_buf(),
        });
    }
    let strip = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}.")
    };
    let weights: HashMap<String, Tensor> = params
        .iter()
        .filter_map(|(n, v)| {
            n.strip_prefix(strip.as_str())
                .map(|s| (s.to_string(), v.as_tensor().clone()))
        })
        .collect();
    if weights.is_empty() {
        return Err(Error::InvalidArgument {
            what: "export prefix",
            value: format!("`{prefix}`"),
            reason: "no parameter has this prefix",
        });
    }

    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
    let file_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-export-{file_name}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io("remove", &tmp, e))?;
    }
    let pooling_dir = tmp.join("1_Pooling");
    fs::create_dir_all(&pooling_dir).map_err(|e| Error::io("create", &pooling_dir, e))?;

    let config_path = tmp.join("config.json");
    let mut config = serde_json::to_value(cfg).map_err(|e| Error::io("write", &config_path, e))?;
    config["architectures"] = json!(["BertModel"]);
    config["model_type"] = json!("bert");
    write_json(&config_path, &config)?;
    let weights_path = tmp.join("model.safetensors");
    candle_core::safetensors::save(&weights, &weights_path)
        .map_err(|e| Error::io("write", &weights_path, e))?;
    // The safetensors writer creates its file private (0600); give it the permissions of
    // its siblings, which the process umask decided.
    let shared = fs::metadata(&config_path)
        .map_err(|e| Error::io("read", &config_path, e))?
        .permissions();
    fs::set_permissions(&weights_path, shared)
        .map_err(|e| Error::io("set permissions of", &weights_path, e))?;

    let mut plain = tokenizer.inner().clone();
    plain.with_padding(None);
    plain
        .with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    plain
        .save(tmp.join("tokenizer.json"), false)
        .map_err(|e| Error::io("write", &tmp.join("tokenizer.json"), e))?;
    let special = |t: &str| {
        plain
            .token_to_id(t)
            .map(|_| json!(t))
            .unwrap_or(serde_json::Value::Null)
    };
    write_json(
        &tmp.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": tokenizer.max_len(),
            "cls_token": special("[CLS]"),
            "sep_token": special("[SEP]"),
            "pad_token": special("[PAD]"),
            "unk_token": special("[UNK]"),
            "mask_token": special("[MASK]"),
        }),
    )?;

    let mut modules = vec![
        json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
        json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}),
    ];
    if options.normalize {
        let normalize_dir = tmp.join("2_Normalize");
        fs::create_dir_all(&normalize_dir).map_err(|e| Error::io("create", &normalize_dir, e))?;
        modules.push(json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    write_json(&tmp.join(MODULES), &json!(modules))?;
    write_json(
        &tmp.join("sentence_bert_config.json"),
        &json!({"max_seq_length": tokenizer.max_len(), "do_lower_case": false}),
    )?;
    write_json(
        &tmp.join(SENTENCE_TRANSFORMERS_CONFIG),
        &json!({"similarity_fn_name": similarity.sentence_transformers_name()}),
    )?;
    write_json(
        &tmp.join(POOLING),
        &json!({
            "word_embedding_dimension": cfg.hidden_size,
            "pooling_mode_cls_token": options.pooling == Pooling::Cls,
            "pooling_mode_mean_tokens": options.pooling == Pooling::Mean,
            "pooling_mode_max_tokens": false,
            "pooling_mode_mean_sqrt_len_tokens": false,
        }),
    )?;

    if dir.exists() {
        fs::remove_dir(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| Error::io("rename into", dir, e))
}

/// What a sentence-transformers model directory says about its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentenceTransformersConfig {
    /// From `1_Pooling/config.json`.
    pub pooling: Pooling,
    /// Whether `modules.json` lists a `Normalize` module.
    pub normalize: bool,
    /// `similarity_fn_name` of `config_sentence_transformers.json`, when the file names one.
    pub similarity: Option<Similarity>,
}

/// Reads the head of a sentence-transformers directory (an export of ours or any
/// sentence-transformers model): `None` when it has no `modules.json` and
/// `1_Pooling/config.json`. A pooling mode or similarity this crate does not implement
/// is an error, not a silent substitute.
pub fn read_sentence_transformers_config(dir: &Path) -> Result<Option<SentenceTransformersConfig>> {
    let pooling_path = dir.join(POOLING);
    let modules_path = dir.join(MODULES);
    if !pooling_path.is_file() || !modules_path.is_file() {
        return Ok(None);
    }
    let read = |p: &Path| -> Result<serde_json::Value> {
        let text = fs::read_to_string(p).map_err(|e| Error::io("read", p, e))?;
        serde_json::from_str(&text).map_err(|e| Error::ModelFile {
            path: p.to_path_buf(),
            reason: e.to_string(),
        })
    };
    let modes = read(&pooling_path)?;
    let on = |key: &str| modes[key] == json!(true);
    let pooling = match (on("pooling_mode_cls_token"), on("pooling_mode_mean_tokens")) {
        (true, false) => Pooling::Cls,
        (false, true) => Pooling::Mean,
        _ => {
            let set: Vec<&str> = modes
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| k.starts_with("pooling_mode_") && **v == json!(true))
                .map(|(k, _)| k.as_str())
                .collect();
            return Err(Error::UnsupportedConfig {
                field: "pooling_mode_*",
                value: set.join(" + "),
                supported: "exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens",
                path: pooling_path,
            });
        }
    };
    let normalize = read(&modules_path)?.as_array().is_some_and(|m| {
        m.iter()
            .any(|x| x["type"] == json!("sentence_transformers.models.Normalize"))
    });
    let st_path = dir.join(SENTENCE_TRANSFORMERS_CONFIG);
    let similarity = if st_path.is_file() {
        match read(&st_path)?["similarity_fn_name"].as_str() {
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
    Ok(Some(SentenceTransformersConfig {
        pooling,
        normalize,
        similarity,
    }))
}
