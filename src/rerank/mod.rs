//! Rerankers: cross-encoders that read a (query, document) pair as one text and score it.
//!
//! [`CrossEncoder`] loads one for inference from a directory or the Hub, in
//! sentence-transformers' `CrossEncoder` layout or as plain
//! `AutoModelForSequenceClassification` files: the encoder family's own classification
//! head ([`crate::models::classifier`]), the activation `CrossEncoder.predict` applies
//! ([`ScoreActivation`]) and the tokenizer's pair template. [`loss`] holds the losses over
//! a batch's scores, and [`cache`] the gradient-cache step in which a pair's score is the
//! representation: every pair scored without a graph, the loss over all scores, each chunk
//! of pairs replayed with its slice of the scores' gradient.

pub mod cache;
pub mod evaluate;
pub mod export;
pub mod loss;

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::batch::{Batch, TokenBatch};
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::hub::chat::ChatTemplate;
use crate::hub::files::{HubSettings, ModelFiles};
use crate::hub::{load_tokenizer, tokenizer, Tokenizer};
use crate::models::bert::{
    check_classifier, load_pretrained, BertConfig, BertEncoder, BertOptions, ClassifierSpec,
};
use crate::models::classifier::HeadKind;
use crate::params::ParamStore;
use crate::{Error, Result};

pub use cache::RerankCache;
pub use loss::{RerankLoss, RerankObjective};

/// What `CrossEncoder.predict` applies to the logits (sentence-transformers'
/// `activation_fn`): a sigmoid for one label unless the model says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreActivation {
    /// `torch.nn.Sigmoid`: a probability of relevance.
    Sigmoid,
    /// `torch.nn.Identity`: the raw logit.
    Identity,
    /// `torch.nn.Tanh`.
    Tanh,
}

impl ScoreActivation {
    /// The class path sentence-transformers writes (`activation_fn`).
    pub fn class_path(self) -> &'static str {
        match self {
            ScoreActivation::Sigmoid => "torch.nn.modules.activation.Sigmoid",
            ScoreActivation::Identity => "torch.nn.modules.linear.Identity",
            ScoreActivation::Tanh => "torch.nn.modules.activation.Tanh",
        }
    }

    /// Reads a class path (`torch.nn.Sigmoid` and the module path both); `None` for one
    /// not built here.
    pub fn from_class_path(path: &str) -> Option<Self> {
        match path.rsplit('.').next()? {
            "Sigmoid" => Some(ScoreActivation::Sigmoid),
            "Identity" => Some(ScoreActivation::Identity),
            "Tanh" => Some(ScoreActivation::Tanh),
            _ => None,
        }
    }

    /// The activation of one logit.
    pub fn apply(self, x: f32) -> f32 {
        match self {
            ScoreActivation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            ScoreActivation::Identity => x,
            ScoreActivation::Tanh => x.tanh(),
        }
    }

    /// The default for a model with `labels` outputs: sigmoid for one, identity else.
    pub fn default_for(labels: usize) -> Self {
        if labels == 1 {
            ScoreActivation::Sigmoid
        } else {
            ScoreActivation::Identity
        }
    }
}

/// What a model's files say of it as a cross-encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEncoderFiles {
    /// Outputs per pair (`config.json`'s `id2label`, else `num_labels`).
    pub labels: Option<usize>,
    /// The activation sentence-transformers saved, and where it was read.
    pub activation: Option<(ScoreActivation, &'static str)>,
    /// Whether `config.json`'s architecture is a `*ForSequenceClassification`.
    pub classification: bool,
    /// Whether `config.json`'s architecture is a `*ForCausalLM` (a decoder reranker read
    /// by its LM head's yes/no logits).
    pub causal: bool,
    /// The token ids of a `LogitScore` module in `modules.json` (`true_token_id`,
    /// `false_token_id`).
    pub logit_score: Option<(u32, Option<u32>)>,
    /// The prompt `config_sentence_transformers.json`'s `default_prompt_name` names: the
    /// instruction `predict` applies when given none.
    pub default_prompt: Option<String>,
}

/// Reads what `dir`'s `config.json` and `config_sentence_transformers.json` say of a
/// cross-encoder: sentence-transformers 6 writes the activation to the latter, 4 and 5 to
/// `config.json`'s `sentence_transformers`, older ones `sbert_ce_default_activation_function`.
pub fn read_cross_encoder_files(dir: &Path) -> Result<CrossEncoderFiles> {
    let config = read_json(&dir.join("config.json"))?.unwrap_or_default();
    let st =
        read_json(&dir.join(crate::hub::export::SENTENCE_TRANSFORMERS_CONFIG))?.unwrap_or_default();
    let labels = config
        .get("id2label")
        .and_then(|v| v.as_object())
        .map(|m| m.len())
        .or_else(|| {
            config
                .get("num_labels")
                .and_then(|v| v.as_u64())
                .map(|n| n as usize)
        });
    let found = [
        (
            st.get("activation_fn"),
            "activation_fn of config_sentence_transformers.json",
        ),
        (
            config
                .get("sentence_transformers")
                .and_then(|v| v.get("activation_fn")),
            "sentence_transformers.activation_fn of config.json",
        ),
        (
            config.get("sbert_ce_default_activation_function"),
            "sbert_ce_default_activation_function of config.json",
        ),
    ]
    .into_iter()
    .find_map(|(v, at)| v.and_then(|v| v.as_str()).map(|s| (s.to_string(), at)));
    let activation = match found {
        Some((path, at)) => Some((
            ScoreActivation::from_class_path(&path).ok_or_else(|| Error::ModelFile {
                path: dir.join(if at.contains("sentence_transformers.json") {
                    crate::hub::export::SENTENCE_TRANSFORMERS_CONFIG
                } else {
                    "config.json"
                }),
                reason: format!(
                    "the activation `{path}` is not one built here (Sigmoid, Identity, Tanh)"
                ),
            })?,
            at,
        )),
        None => None,
    };
    let architecture = config
        .get("architectures")
        .and_then(|v| v.as_array())
        .and_then(|a| a.first())
        .and_then(|v| v.as_str())
        .unwrap_or("");
    Ok(CrossEncoderFiles {
        labels,
        activation,
        classification: architecture.ends_with("ForSequenceClassification"),
        causal: architecture.ends_with("ForCausalLM"),
        logit_score: read_logit_score(dir)?,
        default_prompt: st
            .get("default_prompt_name")
            .and_then(|n| n.as_str())
            .and_then(|n| st.get("prompts")?.get(n)?.as_str())
            .filter(|p| !p.is_empty())
            .map(String::from),
    })
}

/// A JSON file of a model's directory; `None` where there is none.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::ModelFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// The token ids of the `LogitScore` module `modules.json` names, if any.
fn read_logit_score(dir: &Path) -> Result<Option<(u32, Option<u32>)>> {
    let Some(list) = read_json(&dir.join(crate::hub::files::MODULES))? else {
        return Ok(None);
    };
    let bad = |path: &Path, reason: String| Error::ModelFile {
        path: path.to_path_buf(),
        reason,
    };
    let Some(entry) = list.as_array().into_iter().flatten().find(|m| {
        m.get("type")
            .and_then(|t| t.as_str())
            .is_some_and(|t| t.ends_with("LogitScore"))
    }) else {
        return Ok(None);
    };
    let folder = entry.get("path").and_then(|p| p.as_str()).unwrap_or("");
    let path = dir.join(folder).join("config.json");
    let config = read_json(&path)?
        .ok_or_else(|| bad(&path, "the LogitScore module's config is missing".into()))?;
    let id = |key: &str| -> Result<Option<u32>> {
        match config.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(&path, format!("`{key}` = {v} is not a token id"))),
        }
    };
    let yes =
        id("true_token_id")?.ok_or_else(|| bad(&path, "`true_token_id` is missing".into()))?;
    if let Some(input) = config.get("module_input_name").and_then(|v| v.as_str()) {
        if input != "causal_logits" {
            return Err(bad(
                &path,
                format!("`module_input_name` = {input:?}: only the causal LM's logits are read"),
            ));
        }
    }
    Ok(Some((yes, id("false_token_id")?)))
}

/// How the model of `files` (whose files say `own`) scores a pair: a causal LM
/// (`*ForCausalLM`, or a `LogitScore` module) by its LM head's logits of the
/// `LogitScore`'s tokens, else of the tokens "yes" and "no" (as sentence-transformers picks
/// them); any other model by its classification head.
pub fn head_kind(
    files: &ModelFiles,
    own: &CrossEncoderFiles,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<HeadKind> {
    if let Some((yes, no)) = own.logit_score {
        return Ok(HeadKind::LogitScore { yes, no });
    }
    if !own.causal {
        return Ok(HeadKind::Classification);
    }
    let id = |token: &str| {
        tokenizer
            .token_to_id(token)
            .ok_or_else(|| Error::ModelFile {
                path: files.dir.join(crate::hub::files::TOKENIZER),
                reason: format!(
                    "a causal-LM reranker scores by its \"yes\" and \"no\" tokens' logits, and \
                 the tokenizer has no token {token:?}: give the model a LogitScore module \
                 (1_LogitScore/config.json) naming its tokens"
                ),
            })
    };
    Ok(HeadKind::LogitScore {
        yes: id("yes")?,
        no: Some(id("no")?),
    })
}

/// A cross-encoder loaded for inference: encoder with its classification head, the
/// tokenizer's pair template, the activation of its scores.
pub struct CrossEncoder {
    encoder: BertEncoder,
    tokenizer: Tokenizer,
    config: BertConfig,
    labels: usize,
    activation: ScoreActivation,
    settings: String,
    device: Device,
    _store: ParamStore,
}

impl CrossEncoder {
    /// Loads a model directory or Hub repo id (see [`ModelFiles::resolve`]) with its
    /// classification head; `max_len` caps the pair's tokens (default and ceiling: the
    /// model's own limit).
    pub fn load(model: &str, max_len: Option<usize>, device: &Device) -> Result<Self> {
        let files = ModelFiles::resolve(model, &HubSettings::from_env())?;
        Self::from_files(&files, max_len, device)
    }

    /// Loads a cross-encoder from its resolved files.
    pub fn from_files(files: &ModelFiles, max_len: Option<usize>, device: &Device) -> Result<Self> {
        let config = BertConfig::from_file(&files.config)?;
        let (inner, tokenizer_config) = load_tokenizer(files, &config)?;
        let own = read_cross_encoder_files(&files.dir)?;
        let kind = head_kind(files, &own, &inner)?;
        check_classifier(files, &config, kind)?;
        // A causal LM's config keeps transformers' default two labels: its score is one.
        let labels = match kind {
            HeadKind::LogitScore { .. } => 1,
            HeadKind::Classification => own.labels.unwrap_or(1),
        };
        let (activation, activation_src) = match own.activation {
            Some((a, at)) => (a, format!("from {at}")),
            None => (
                ScoreActivation::default_for(labels),
                "sentence-transformers' default".to_string(),
            ),
        };
        let options = BertOptions {
            classifier: Some(ClassifierSpec { labels, kind }),
            ..Default::default()
        };
        let store = ParamStore::new(0, DType::F32, device);
        let (encoder, config, store) = load_pretrained(files, "", &options, store)?;
        let (limit, limit_src) = tokenizer::model_max_length(&files.dir, config.max_tokens())?;
        let max_len = max_len.map_or(limit, |m| m.min(limit));
        let chat = ChatTemplate::read(&files.dir, tokenizer_config.as_ref())?;
        let tokenizer = Tokenizer::new(inner, max_len)?
            .with_config(tokenizer_config)
            .with_chat_template(chat)
            .with_prompt(own.default_prompt.as_deref().unwrap_or_default());
        let head = match kind {
            HeadKind::LogitScore { yes, no: Some(no) } => {
                format!("the LM head's logit of token {yes} less token {no}'s")
            }
            HeadKind::LogitScore { yes, no: None } => format!("the LM head's logit of token {yes}"),
            HeadKind::Classification => {
                format!("{labels} label{}", if labels == 1 { "" } else { "s" })
            }
        };
        let settings = format!(
            "cross-encoder: {} ({}), {head}, activation {} ({activation_src}), max_len {max_len} \
             (the model's {limit}, {limit_src}){}{}",
            config.model_type.as_deref().unwrap_or("bert"),
            files.dir.display(),
            activation.class_path(),
            if tokenizer.chat_template().is_some() {
                ", pairs rendered by its chat template"
            } else {
                ""
            },
            match &own.default_prompt {
                Some(prompt) => format!(
                    ", instruction {prompt:?} (the default prompt of {})",
                    crate::hub::export::SENTENCE_TRANSFORMERS_CONFIG
                ),
                None => String::new(),
            },
        );
        Ok(Self {
            encoder,
            tokenizer,
            config,
            labels,
            activation,
            settings,
            device: device.clone(),
            _store: store,
        })
    }

    /// The same model reading every pair with `instruction`, as sentence-transformers'
    /// `predict(prompt=...)`: with a chat template, a `system` message before the query and
    /// the document (Qwen3-Reranker's `<Instruct>`); without one, put before the query.
    pub fn with_instruction(mut self, instruction: &str) -> Self {
        self.tokenizer = self.tokenizer.with_prompt(instruction);
        self.settings
            .push_str(&format!(", instruction {instruction:?}"));
        self
    }

    /// Outputs per pair.
    pub fn labels(&self) -> usize {
        self.labels
    }

    /// The activation [`Self::predict`] applies.
    pub fn activation(&self) -> ScoreActivation {
        self.activation
    }

    /// What was loaded and from where, for the log.
    pub fn settings(&self) -> &str {
        &self.settings
    }

    /// The model's config.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The tokenizer (its pair template).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The encoder with its head.
    pub fn encoder(&self) -> &BertEncoder {
        &self.encoder
    }

    /// The raw logits `[pairs, labels]` of (query, document) pairs, in evaluation mode, in
    /// passes of at most `batch` pairs of similar length (as `CrossEncoder.predict` sorts
    /// them), returned in the order given. On the CPU the passes run side by side, one per
    /// thread, the longest first (as [`crate::hub::embed`] runs its chunks).
    pub fn logits(&self, pairs: &[(&str, &str)], batch: usize) -> Result<Vec<Vec<f32>>> {
        let _flush = crate::denormal::flush();
        let batch = batch.max(1);
        let lengths: Vec<usize> = pairs.iter().map(|(q, d)| q.len() + d.len()).collect();
        // Shortest first: the passes are taken from the last, the longest.
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by_key(|&i| lengths[i]);
        let parts: Vec<&[usize]> = order.chunks(batch).collect();
        let pieces = parts
            .iter()
            .map(|part| {
                let queries: Vec<&str> = part.iter().map(|&i| pairs[i].0).collect();
                let documents: Vec<&str> = part.iter().map(|&i| pairs[i].1).collect();
                self.tokenizer
                    .encode_pairs(&queries, &documents, &self.device)
            })
            .collect::<Result<Vec<_>>>()?;
        let encode = |piece: &TokenBatch| -> Result<Vec<Vec<f32>>> {
            let rows = self.encoder.encode(piece, &Ctx::eval())?;
            Ok(rows.to_dtype(DType::F32)?.to_vec2()?)
        };
        let scored = if self.device.is_cpu() {
            crate::hub::longest_first(&pieces, |piece| crate::nn::serial(|| encode(piece)))?
        } else {
            pieces.iter().map(encode).collect::<Result<Vec<_>>>()?
        };
        let mut out = vec![Vec::new(); pairs.len()];
        for (part, rows) in parts.iter().zip(scored) {
            for (&i, row) in part.iter().zip(rows) {
                out[i] = row;
            }
        }
        Ok(out)
    }

    /// The scores of pairs with the model's activation (the first label's, for a model of
    /// one label: what `CrossEncoder.predict` returns).
    pub fn predict(&self, pairs: &[(&str, &str)], batch: usize) -> Result<Vec<f32>> {
        Ok(self
            .logits(pairs, batch)?
            .into_iter()
            .map(|row| self.activation.apply(row[0]))
            .collect())
    }

    /// One padded batch of pairs, as the trainer feeds the cache.
    pub fn encode_pairs(&self, queries: &[&str], documents: &[&str]) -> Result<TokenBatch> {
        let batch = self
            .tokenizer
            .encode_pairs(queries, documents, &self.device)?;
        debug_assert_eq!(batch.rows(), queries.len());
        Ok(batch)
    }

    /// The scores `[pairs, labels]` of one tokenized batch, in evaluation mode.
    pub fn score_batch(&self, input: &TokenBatch) -> Result<Tensor> {
        self.encoder.encode(input, &Ctx::eval())
    }
}
