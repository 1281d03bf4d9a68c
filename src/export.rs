//! Writing a trained BERT tower as a Hugging Face model directory that
//! `transformers.AutoModel` and `sentence_transformers.SentenceTransformer` load:
//! `config.json`, `model.safetensors` (Hugging Face `BertModel` names), `tokenizer.json`,
//! `tokenizer_config.json`, plus the sentence-transformers files `modules.json`,
//! `sentence_bert_config.json`, `config_sentence_transformers.json` and
//! `1_Pooling/config.json` (and `2_Normalize` when the encoder normalises).
//!
//! The directory is written under a temporary name and renamed when complete; an existing
//! non-empty directory is never overwritten.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde_json::json;

use crate::bert::{BertConfig, BertOptions, Pooling};
use crate::loss::Similarity;
use crate::params::Params;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| io(path, e))?;
    fs::write(path, text + "\n").map_err(|e| io(path, e))
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
    if dir.exists() && fs::read_dir(dir).map_err(|e| io(dir, e))?.next().is_some() {
        return Err(Error::InvalidConfig {
            field: "export directory",
            value: dir.display().to_string(),
            reason: "exists and is not empty; choose a new directory",
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
        return Err(Error::InvalidConfig {
            field: "export prefix",
            value: prefix.to_string(),
            reason: "no parameter has this prefix",
        });
    }

    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let file_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-export-{file_name}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    fs::create_dir_all(tmp.join("1_Pooling")).map_err(|e| io(&tmp, e))?;

    let mut config = serde_json::to_value(cfg).map_err(|e| io(&tmp, e))?;
    config["architectures"] = json!(["BertModel"]);
    config["model_type"] = json!("bert");
    write_json(&tmp.join("config.json"), &config)?;
    candle_core::safetensors::save(&weights, tmp.join("model.safetensors"))?;

    let mut plain = tokenizer.inner().clone();
    plain.with_padding(None);
    plain
        .with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    plain
        .save(tmp.join("tokenizer.json"), false)
        .map_err(|e| io(&tmp.join("tokenizer.json"), e))?;
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
        fs::create_dir_all(tmp.join("2_Normalize")).map_err(|e| io(&tmp, e))?;
        modules.push(json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    write_json(&tmp.join("modules.json"), &json!(modules))?;
    write_json(
        &tmp.join("sentence_bert_config.json"),
        &json!({"max_seq_length": tokenizer.max_len(), "do_lower_case": false}),
    )?;
    let similarity = match similarity {
        Similarity::Cosine => "cosine",
        Similarity::Dot => "dot",
    };
    write_json(
        &tmp.join("config_sentence_transformers.json"),
        &json!({"similarity_fn_name": similarity}),
    )?;
    write_json(
        &tmp.join("1_Pooling").join("config.json"),
        &json!({
            "word_embedding_dimension": cfg.hidden_size,
            "pooling_mode_cls_token": options.pooling == Pooling::Cls,
            "pooling_mode_mean_tokens": options.pooling == Pooling::Mean,
            "pooling_mode_max_tokens": false,
            "pooling_mode_mean_sqrt_len_tokens": false,
        }),
    )?;

    if dir.exists() {
        fs::remove_dir(dir).map_err(|e| io(dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io(dir, e))
}

/// Reads the pooling options back from an exported (or any sentence-transformers)
/// directory: `1_Pooling/config.json` and whether `modules.json` lists a Normalize module.
pub fn sentence_transformers_options(dir: &Path) -> Result<Option<(Pooling, bool)>> {
    let pooling_path = dir.join("1_Pooling").join("config.json");
    let modules_path = dir.join("modules.json");
    if !pooling_path.is_file() || !modules_path.is_file() {
        return Ok(None);
    }
    let read = |p: &Path| -> Result<serde_json::Value> {
        let text = fs::read_to_string(p).map_err(|e| io(p, e))?;
        serde_json::from_str(&text).map_err(|e| io(p, e))
    };
    let pooling = read(&pooling_path)?;
    let pooling = if pooling["pooling_mode_cls_token"] == json!(true) {
        Pooling::Cls
    } else {
        Pooling::Mean
    };
    let normalize = read(&modules_path)?.as_array().is_some_and(|m| {
        m.iter()
            .any(|x| x["type"] == json!("sentence_transformers.models.Normalize"))
    });
    Ok(Some((pooling, normalize)))
}
