//! A trained cross-encoder as sentence-transformers' `CrossEncoder` saves one: the
//! family's `*ForSequenceClassification` (`config.json` with its architecture and one
//! label, `model.safetensors` with the base model under its prefix and the head beside
//! it), the tokenizer, and the sentence-transformers files that say it is a
//! `CrossEncoder`, its activation and its max length. Loads with `CrossEncoder(path)`,
//! `AutoModelForSequenceClassification.from_pretrained(path)` and [`super::CrossEncoder`].

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde_json::json;

use crate::hub::export::{
    write_json, write_tokenizer_files, MODULES, SENTENCE_TRANSFORMERS_CONFIG,
};
use crate::hub::Tokenizer;
use crate::models::bert::{BertConfig, Family};
use crate::models::classifier::head_modules;
use crate::params::Params;
use crate::rerank::ScoreActivation;
use crate::{Error, Result};

/// The family's `*ForSequenceClassification` class and its base model's prefix.
fn classification(cfg: &BertConfig) -> Result<(&'static str, &'static str, Family)> {
    let family = cfg.family(Path::new("config.json"))?;
    let model_type = cfg.model_type.as_deref().unwrap_or("bert");
    let names = match (family, model_type) {
        (Family::Bert, _) => ("BertForSequenceClassification", "bert."),
        (Family::Roberta, "xlm-roberta") => ("XLMRobertaForSequenceClassification", "roberta."),
        (Family::Roberta, "camembert") => ("CamembertForSequenceClassification", "roberta."),
        (Family::Roberta, _) => ("RobertaForSequenceClassification", "roberta."),
        (Family::MpNet, _) => ("MPNetForSequenceClassification", "mpnet."),
        (Family::DistilBert, _) => ("DistilBertForSequenceClassification", "distilbert."),
        (Family::ModernBert, _) => ("ModernBertForSequenceClassification", "model."),
        _ => {
            return Err(Error::InvalidArgument {
                what: "cross-encoder export",
                value: model_type.to_string(),
                reason: "a classification head is built for the encoder families (bert, \
                         roberta, xlm-roberta, camembert, mpnet, distilbert, modernbert)",
            })
        }
    };
    Ok((names.0, names.1, family))
}

/// Writes the cross-encoder whose parameters are `params` (names as the crate's BERT
/// builds them, head included) to `dir` (which must not exist or be empty); written
/// whole or not at all.
pub fn export_cross_encoder(
    dir: &Path,
    cfg: &BertConfig,
    params: &Params,
    tokenizer: &Tokenizer,
    activation: ScoreActivation,
) -> Result<()> {
    crate::durable::refuse_non_empty(dir)?;
    let (architecture, base, family) = classification(cfg)?;
    let head = head_modules(family).unwrap_or(&[]);
    if !head
        .iter()
        .any(|m| params.iter().any(|(n, _)| n.starts_with(&format!("{m}."))))
    {
        return Err(Error::InvalidArgument {
            what: "cross-encoder export",
            value: format!("{} parameters", params.len()),
            reason: "the model has no classification head to export",
        });
    }
    let weights: HashMap<String, Tensor> = params
        .iter()
        .map(|(n, v)| {
            let own = head.iter().any(|m| n.starts_with(&format!("{m}.")));
            let name = if own {
                n.to_string()
            } else {
                format!("{base}{n}")
            };
            (name, v.as_tensor().clone())
        })
        .collect();
    let tmp = crate::durable::temporary_dir(dir, "export")?;
    let written = (|| -> Result<()> {
        fs::create_dir_all(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        let config_path = tmp.join("config.json");
        let mut config = cfg.to_json();
        config["architectures"] = json!([architecture]);
        config["model_type"] = json!(cfg.model_type.clone().unwrap_or_else(|| "bert".into()));
        config["id2label"] = json!({"0": "LABEL_0"});
        config["label2id"] = json!({"LABEL_0": 0});
        write_json(&config_path, &config)?;
        let weights_path = tmp.join("model.safetensors");
        candle_core::safetensors::save(&weights, &weights_path)
            .map_err(|e| Error::io("write", &weights_path, e))?;
        let shared = fs::metadata(&config_path)
            .map_err(|e| Error::io("read", &config_path, e))?
            .permissions();
        fs::set_permissions(&weights_path, shared)
            .map_err(|e| Error::io("set permissions of", &weights_path, e))?;
        write_tokenizer_files(&tmp, tokenizer)?;
        // transformers feeds the model token types only when `model_input_names` has
        // them: say what the model was trained with.
        let path = tmp.join("tokenizer_config.json");
        let text = fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
        let mut tokenizer_config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::io("read", &path, e))?;
        tokenizer_config["model_input_names"] = if tokenizer.passes_token_types() {
            json!(["input_ids", "token_type_ids", "attention_mask"])
        } else {
            json!(["input_ids", "attention_mask"])
        };
        write_json(&path, &tokenizer_config)?;
        write_json(
            &tmp.join(MODULES),
            &json!([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"}]),
        )?;
        write_json(
            &tmp.join("sentence_bert_config.json"),
            &json!({
                "transformer_task": "sequence-classification",
                "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                "module_output_name": "scores",
                "max_seq_length": tokenizer.max_len(),
            }),
        )?;
        write_json(
            &tmp.join(SENTENCE_TRANSFORMERS_CONFIG),
            &json!({
                "model_type": "CrossEncoder",
                "activation_fn": activation.class_path(),
                "prompts": {},
                "default_prompt_name": null,
            }),
        )?;
        Ok(())
    })()
    .and_then(|()| crate::durable::publish_dir(&tmp, dir));
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}
