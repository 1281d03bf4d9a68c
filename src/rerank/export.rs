//! A trained cross-encoder as sentence-transformers' `CrossEncoder` saves one: the
//! family's `*ForSequenceClassification` (`config.json` with its architecture and one
//! label, `model.safetensors` with the base model under its prefix and the head beside
//! it), the tokenizer, and the sentence-transformers files that say it is a
//! `CrossEncoder`, its activation and its max length. Loads with `CrossEncoder(path)`,
//! `AutoModelForSequenceClassification.from_pretrained(path)` and [`super::CrossEncoder`].
//! A causal-LM reranker (Qwen3-Reranker's layout) is written as its `*ForCausalLM` (the
//! LM head beside the base model unless tied to the word embeddings) with the
//! `LogitScore` module of its yes/no tokens, loading with `CrossEncoder(path)` and
//! `AutoModelForCausalLM`; a chat template is written beside the tokenizer.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde_json::json;

use crate::hub::chat::CHAT_TEMPLATE;
use crate::hub::export::{
    write_json, write_tokenizer_files, MODULES, SENTENCE_TRANSFORMERS_CONFIG,
};
use crate::hub::Tokenizer;
use crate::models::bert::{BertConfig, Family};
use crate::models::classifier::{head_modules, HeadKind};
use crate::params::Params;
use crate::rerank::ScoreActivation;
use crate::{Error, Result};

/// The folder sentence-transformers saves a `LogitScore` module in.
const LOGIT_SCORE_DIR: &str = "1_LogitScore";

/// The model's class (the family's `*ForSequenceClassification`, or a decoder's
/// `*ForCausalLM` for a yes/no logit score) and its base model's prefix.
fn architecture(cfg: &BertConfig, kind: HeadKind) -> Result<(String, &'static str, Family)> {
    let family = cfg.family(Path::new("config.json"))?;
    let model_type = cfg.model_type.as_deref().unwrap_or("bert");
    let class = |name: &str| match kind {
        HeadKind::Classification => format!("{name}ForSequenceClassification"),
        HeadKind::LogitScore { .. } => format!("{name}ForCausalLM"),
    };
    let names = match (family, model_type) {
        (Family::Bert, _) => (class("Bert"), "bert."),
        (Family::Roberta, "xlm-roberta") => (class("XLMRoberta"), "roberta."),
        (Family::Roberta, "camembert") => (class("Camembert"), "roberta."),
        (Family::Roberta, _) => (class("Roberta"), "roberta."),
        (Family::MpNet, _) => (class("MPNet"), "mpnet."),
        (Family::DistilBert, _) => (class("DistilBert"), "distilbert."),
        (Family::DebertaV2, _) => (class("DebertaV2"), "deberta."),
        (Family::ModernBert, _) => (class("ModernBert"), "model."),
        (Family::Qwen3, _) => (class("Qwen3"), "model."),
        (Family::Qwen2, _) => (class("Qwen2"), "model."),
        (Family::Llama, _) => (class("Llama"), "model."),
        (Family::Mistral, _) => (class("Mistral"), "model."),
        (Family::EuroBert, _) => (class("EuroBert"), "model."),
        (Family::NomicBert, _) => (class("NomicBert"), "model."),
        (Family::Gte, _) => (class("Gte"), "model."),
        (Family::JinaV3, _) => (class("JinaEmbeddingsV3"), "roberta."),
        (Family::Gemma3, _) => match kind {
            HeadKind::Classification => ("Gemma3TextForSequenceClassification".into(), "model."),
            HeadKind::LogitScore { .. } => ("Gemma3ForCausalLM".into(), "model."),
        },
    };
    Ok((names.0, names.1, family))
}

/// Writes the cross-encoder whose parameters are `params` (names as the crate's BERT
/// builds them, head included) to `dir` (which must not exist or be empty); written
/// whole or not at all.
pub fn export_cross_encoder(
    dir: &Path,
    cfg: &BertConfig,
    kind: HeadKind,
    params: &Params,
    tokenizer: &Tokenizer,
    activation: ScoreActivation,
) -> Result<()> {
    crate::durable::refuse_non_empty(dir)?;
    let (architecture, base, family) = architecture(cfg, kind)?;
    let head = head_modules(cfg, family, kind);
    let tied = matches!(kind, HeadKind::LogitScore { .. }) && head.is_empty();
    if !tied
        && !head
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
        if kind == HeadKind::Classification {
            config["id2label"] = json!({"0": "LABEL_0"});
            config["label2id"] = json!({"LABEL_0": 0});
        }
        if family.is_decoder() && config.get("pad_token_id").is_none_or(|v| v.is_null()) {
            // A decoder's sequence classification finds the last real token by it.
            if let Some(pad) = tokenizer.inner().get_padding() {
                config["pad_token_id"] = json!(pad.pad_id);
            }
        }
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
        if let Some(chat) = tokenizer.chat_template() {
            let path = tmp.join(CHAT_TEMPLATE);
            fs::write(&path, chat.source()).map_err(|e| Error::io("write", &path, e))?;
        }
        let transformer = json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"});
        let (task, output) = match kind {
            HeadKind::Classification => ("sequence-classification", "scores"),
            HeadKind::LogitScore { .. } => ("text-generation", "causal_logits"),
        };
        let forward = json!({"method": "forward", "method_output_name": "logits"});
        let mut modality = json!({"text": forward});
        if tokenizer.chat_template().is_some() {
            let mut message = forward.clone();
            message["format"] = json!("flat");
            modality["message"] = message;
        }
        match kind {
            HeadKind::Classification => write_json(&tmp.join(MODULES), &json!([transformer]))?,
            HeadKind::LogitScore { yes, no } => {
                write_json(
                    &tmp.join(MODULES),
                    &json!([transformer, {"idx": 1, "name": "1", "path": LOGIT_SCORE_DIR, "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]),
                )?;
                let folder = tmp.join(LOGIT_SCORE_DIR);
                fs::create_dir_all(&folder).map_err(|e| Error::io("create", &folder, e))?;
                write_json(
                    &folder.join("config.json"),
                    &json!({"true_token_id": yes, "false_token_id": no, "module_input_name": "causal_logits"}),
                )?;
            }
        }
        write_json(
            &tmp.join("sentence_bert_config.json"),
            &json!({
                "transformer_task": task,
                "modality_config": modality,
                "module_output_name": output,
                "max_seq_length": tokenizer.max_len(),
            }),
        )?;
        write_json(
            &tmp.join(SENTENCE_TRANSFORMERS_CONFIG),
            &match tokenizer.prompt() {
                "" => json!({
                    "model_type": "CrossEncoder",
                    "activation_fn": activation.class_path(),
                    "prompts": {},
                    "default_prompt_name": null,
                }),
                // The instruction it was trained with, applied when `predict` gets none.
                prompt => json!({
                    "model_type": "CrossEncoder",
                    "activation_fn": activation.class_path(),
                    "prompts": {"instruction": prompt},
                    "default_prompt_name": "instruction",
                }),
            },
        )?;
        Ok(())
    })()
    .and_then(|()| crate::durable::publish_dir(&tmp, dir));
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}
