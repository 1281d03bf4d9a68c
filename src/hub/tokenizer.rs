//! Text to [`TokenBatch`] with a Hugging Face `tokenizer.json` (the `tokenizers` crate):
//! truncation to a maximum length, padding to the longest sequence of the batch.
//!
//! Batches are padded to their own longest sequence; when the gradient cache cuts a batch
//! into chunks, each chunk is trimmed to *its* longest sequence
//! ([`TokenBatch::trim_padding`]), so short chunks do not pay for one long text elsewhere
//! in the batch.
//!
//! A model's tokenizer is read as the model expects it ([`read_model_tokenizer`]): the
//! padding side and pad token of `tokenizer_config.json` (and of sentence-transformers'
//! tokenizer kwargs in `sentence_bert_config.json`), the BOS and EOS that Llama-style
//! configs ask for (`add_bos_token`, `add_eos_token`) when `tokenizer.json` does not add
//! them itself; its maximum length is the model's ([`model_max_length`]). Truncation
//! keeps the special tokens the post-processor adds (a decoder's appended EOS survives).

use std::path::Path;

use candle_core::{Device, Tensor};
use tokenizers::{PaddingDirection, PaddingParams, PaddingStrategy, TruncationParams};

use crate::batch::TokenBatch;
use crate::hub::chat::special_token;
use crate::hub::files;
use crate::{Error, Result};

mod pairs;

/// A tokenizer with the truncation and padding a bi-encoder needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    max_len: usize,
    /// Put before every text (a sentence-transformers prompt such as e5's `query: `).
    prompt: String,
    /// Leave the prompt (and the special token before it) out of the pooling
    /// (`include_prompt = false`).
    exclude_prompt: bool,
    /// The model's `tokenizer_config.json`, written back by an export.
    config: Option<serde_json::Map<String, serde_json::Value>>,
    /// A multi-vector (ColBERT) model's side: batches keep token vectors, padded to
    /// `max_len`.
    vectors: Option<VectorSide>,
    /// Whether the special tokens (`[CLS]`, `[SEP]`) are added: an inference-free sparse
    /// model's query side tokenizes without them.
    special_tokens: bool,
    /// A decoder reranker's chat template: pairs are rendered by it (see
    /// [`super::chat`]), the prompt their instruction.
    chat: Option<std::sync::Arc<super::chat::ChatTemplate>>,
    /// The task adapter its texts are encoded with (Jina v3's, by index; see
    /// [`TokenBatch::task`]).
    task: Option<usize>,
}

/// What a multi-vector (ColBERT) tokenizer does to one side's batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VectorSide {
    /// Queries: with `expansion`, padded to the query length with that token id (the
    /// mask token), kept and scored, attended to only with `attend`; without, the real
    /// tokens alone.
    Query {
        expansion: Option<u32>,
        attend: bool,
    },
    /// Documents: every real token but those of the skiplist (punctuation).
    Document { skiplist: Vec<u32> },
}

impl Tokenizer {
    /// Reads `tokenizer.json`; sequences are truncated to `max_len` tokens (special tokens
    /// included).
    pub fn from_file(path: &Path, max_len: usize) -> Result<Self> {
        Self::new(read_tokenizer_file(path)?, max_len)
    }

    /// Wraps a `tokenizers` tokenizer (e.g. one trained on the data).
    pub fn new(mut inner: tokenizers::Tokenizer, max_len: usize) -> Result<Self> {
        if max_len < 2 {
            return Err(Error::InvalidConfig {
                field: "max_len",
                value: max_len.to_string(),
                reason: "room for at least the two special tokens is needed",
            });
        }
        let pad_id = inner
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| inner.token_to_id("[PAD]"))
            .or_else(|| inner.token_to_id("<pad>"))
            .unwrap_or(0);
        let pad_token = inner.id_to_token(pad_id).unwrap_or_else(|| "[PAD]".into());
        // The side the model pads on (a decoder's left), as its files set it.
        let direction = inner
            .get_padding()
            .map_or(PaddingDirection::Right, |p| p.direction);
        inner
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                ..Default::default()
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            direction,
            pad_id,
            pad_token,
            ..Default::default()
        }));
        Ok(Self {
            inner,
            max_len,
            prompt: String::new(),
            exclude_prompt: false,
            config: None,
            vectors: None,
            special_tokens: true,
            chat: None,
            task: None,
        })
    }

    /// The same tokenizer marking its text batches for task adapter `task` (Jina v3's, by
    /// index; `None`: the base weights).
    pub fn with_task(mut self, task: Option<usize>) -> Self {
        self.task = task;
        self
    }

    /// The task adapter its text batches are marked for.
    pub fn task(&self) -> Option<usize> {
        self.task
    }

    /// The same tokenizer adding no special tokens (`add_special_tokens=False`, as
    /// sentence-transformers' `SparseStaticEmbedding` tokenizes queries).
    pub fn without_special_tokens(mut self) -> Self {
        self.special_tokens = false;
        self
    }

    /// The same tokenizer making multi-vector batches of one side (see [`VectorSide`]),
    /// their token vectors padded to the maximum length.
    pub fn with_vectors(mut self, side: VectorSide) -> Self {
        self.vectors = Some(side);
        self
    }

    /// The multi-vector side, if the tokenizer makes multi-vector batches.
    pub fn vectors(&self) -> Option<&VectorSide> {
        self.vectors.as_ref()
    }

    /// The same tokenizer carrying the model's `tokenizer_config.json` (an export writes
    /// it back, with this tokenizer's maximum length and padding side).
    pub fn with_config(
        mut self,
        config: Option<serde_json::Map<String, serde_json::Value>>,
    ) -> Self {
        self.config = config;
        self
    }

    /// The same tokenizer reading (query, document) pairs through a chat template (a
    /// decoder reranker's; the prompt, if any, is the instruction).
    pub fn with_chat_template(mut self, chat: Option<super::chat::ChatTemplate>) -> Self {
        self.chat = chat.map(std::sync::Arc::new);
        self
    }

    /// The chat template pairs are rendered by, if any.
    pub fn chat_template(&self) -> Option<&super::chat::ChatTemplate> {
        self.chat.as_deref()
    }

    /// The model's `tokenizer_config.json`, if it has one.
    pub fn config(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.config.as_ref()
    }

    /// Whether the model is fed token types (`transformers` passes `token_type_ids` only
    /// when the tokenizer's `model_input_names` has them): `tokenizer_config.json`'s
    /// `model_input_names` where it says, else by its `tokenizer_class` (the generic
    /// `TokenizersBackend` of transformers 5 and the RoBERTa, XLM-R, MPNet and DistilBERT
    /// tokenizers leave them out; BERT's and the fast default pass them). Only a pair's
    /// second segment has types other than 0, so this matters to cross-encoders alone.
    pub fn passes_token_types(&self) -> bool {
        let Some(config) = &self.config else {
            return true;
        };
        if let Some(names) = config.get("model_input_names").and_then(|v| v.as_array()) {
            return names.iter().any(|n| n.as_str() == Some("token_type_ids"));
        }
        let class = config
            .get("tokenizer_class")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let without = [
            "TokenizersBackend",
            "RobertaTokenizer",
            "XLMRobertaTokenizer",
            "MPNetTokenizer",
            "DistilBertTokenizer",
            "CamembertTokenizer",
        ];
        !without
            .iter()
            .any(|w| class.strip_suffix("Fast").unwrap_or(class) == *w)
    }

    /// Whether batches are padded on the left (decoders as Qwen3-Embedding).
    pub fn pads_left(&self) -> bool {
        self.inner
            .get_padding()
            .is_some_and(|p| matches!(p.direction, PaddingDirection::Left))
    }

    /// The same tokenizer putting `prompt` before every text (as sentence-transformers
    /// does with a prompt: the prompt is part of the text, inside the special tokens).
    pub fn with_prompt(mut self, prompt: &str) -> Self {
        self.prompt = prompt.to_string();
        self
    }

    /// The prompt put before every text (empty: none).
    pub fn prompt(&self) -> &str {
        &self.prompt
    }

    /// Whether the prompt's tokens are pooled (`include_prompt` of the pooling config,
    /// true by default). Without them, a batch pools from the position after the prompt:
    /// as sentence-transformers, the prompt's length is its own tokenization less its last
    /// special token, so the first special token is left out too.
    pub fn with_prompt_pooled(mut self, include: bool) -> Self {
        self.exclude_prompt = !include;
        self
    }

    /// The positions the pooling skips: 0, or with the prompt left out of the pooling the
    /// prompt's tokens with the special token before them.
    fn pool_from(&self) -> Result<usize> {
        if !self.exclude_prompt || self.prompt.is_empty() {
            return Ok(0);
        }
        let alone = self
            .inner
            .encode(self.prompt.as_str(), true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let ids = alone
            .get_attention_mask()
            .iter()
            .filter(|&&m| m != 0)
            .count();
        // As sentence-transformers: less the last token when it is a special one (BERT's
        // `[SEP]`, a decoder's EOS); a tokenizer that adds none counts the prompt whole.
        let last_special = alone.get_special_tokens_mask().last() == Some(&1);
        Ok(ids - usize::from(last_special && ids > 0))
    }

    /// The maximum sequence length.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// [`Tokenizer::encode`] with each text's own prompt where `prompts` gives one (a row's
    /// instruction), the tokenizer's elsewhere. A prompt left out of the pooling is one
    /// per tokenizer, so rows' own prompts are refused then.
    pub fn encode_prompted(
        &self,
        texts: &[&str],
        prompts: &[Option<&str>],
        device: &Device,
    ) -> Result<TokenBatch> {
        if prompts.len() != texts.len() {
            return Err(Error::InvalidArgument {
                what: "prompts",
                value: format!("{} for {} texts", prompts.len(), texts.len()),
                reason: "give one prompt (or none) per text",
            });
        }
        if prompts.iter().all(Option::is_none) {
            return self.encode(texts, device);
        }
        if self.exclude_prompt {
            return Err(Error::InvalidConfig {
                field: "model.include_prompt",
                value: "false".into(),
                reason: "leaves one prompt per side out of the pooling, and rows of the data \
                         carry their own (a `prompt` field): set include_prompt = true, or \
                         remove the rows' prompts",
            });
        }
        let prompted: Vec<String> = texts
            .iter()
            .zip(prompts)
            .map(|(t, p)| format!("{}{t}", p.unwrap_or(&self.prompt)))
            .collect();
        let refs: Vec<&str> = prompted.iter().map(String::as_str).collect();
        Self {
            prompt: String::new(),
            ..self.clone()
        }
        .encode(&refs, device)
    }

    /// Tokenizes `texts` into one batch padded to its longest sequence.
    pub fn encode(&self, texts: &[&str], device: &Device) -> Result<TokenBatch> {
        if texts.is_empty() {
            return Err(Error::EmptyBatch {
                side: crate::Side::Query,
            });
        }
        let encodings = if self.prompt.is_empty() {
            self.inner.encode_batch(texts.to_vec(), self.special_tokens)
        } else {
            let prompted: Vec<String> = texts
                .iter()
                .map(|t| format!("{}{t}", self.prompt))
                .collect();
            self.inner.encode_batch(prompted, self.special_tokens)
        }
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
        self.batch_of(&encodings, device, true)
    }

    /// A padded batch of `encodings` (all of one length): ids, mask and token types; with
    /// `texts` (not pairs), the pooling's first position after the prompt and a
    /// multi-vector side's rows.
    fn batch_of(
        &self,
        encodings: &[tokenizers::Encoding],
        device: &Device,
        texts: bool,
    ) -> Result<TokenBatch> {
        let rows = encodings.len();
        let len = encodings.first().map_or(0, |e| e.len());
        let field = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encodings
                .iter()
                .flat_map(|e| f(e).iter().copied())
                .collect()
        };
        let (ids, mask, mut types) = (
            field(|e| e.get_ids()),
            field(|e| e.get_attention_mask()),
            field(|e| e.get_type_ids()),
        );
        // A pair's second segment, for a model not fed token types.
        if !texts && !self.passes_token_types() {
            types.fill(0);
        }
        let tensor = |v: Vec<u32>, len: usize| Tensor::from_vec(v, (rows, len), device);
        let Some(side) = self.vectors.as_ref().filter(|_| texts) else {
            let host_mask = mask.chunks(len.max(1)).map(<[u32]>::to_vec).collect();
            let pool_from = if texts { self.pool_from()? } else { 0 };
            return Ok(TokenBatch::new(
                tensor(ids, len)?,
                tensor(mask, len)?,
                tensor(types, len)?,
            )?
            .with_host_mask(host_mask)?
            .with_pool_from(pool_from)
            .with_task(if texts { self.task } else { None }));
        };
        let (ids, mask, types, keep, len) =
            vector_rows(side, [ids, mask, types], len, self.max_len);
        Ok(
            TokenBatch::new(tensor(ids, len)?, tensor(mask, len)?, tensor(types, len)?)?
                .with_vectors(tensor(keep, len)?, self.max_len)?
                .with_task(self.task),
        )
    }
}

/// A multi-vector side's rows from a padded batch `[rows, len]` of ids, attention mask and
/// token types: `(ids, mask, types, keep, len)`. Queries with expansion are padded to
/// `width` with the expansion token, kept, attended to with `attend`; documents keep their
/// real tokens but the skiplist's.
fn vector_rows(
    side: &VectorSide,
    [ids, mask, types]: [Vec<u32>; 3],
    len: usize,
    width: usize,
) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, usize) {
    match side {
        VectorSide::Query {
            expansion: Some(token),
            attend,
        } => {
            let rows = ids.len() / len.max(1);
            let (mut out_ids, mut out_mask, mut out_types) = (vec![], vec![], vec![]);
            for r in 0..rows {
                for t in 0..width {
                    let real = t < len && mask[r * len + t] != 0;
                    out_ids.push(if real { ids[r * len + t] } else { *token });
                    out_mask.push(u32::from(real || *attend));
                    out_types.push(if real { types[r * len + t] } else { 0 });
                }
            }
            let keep = vec![1; out_ids.len()];
            (out_ids, out_mask, out_types, keep, width)
        }
        VectorSide::Query {
            expansion: None, ..
        } => {
            let keep = mask.clone();
            (ids, mask, types, keep, len)
        }
        VectorSide::Document { skiplist } => {
            let keep = ids
                .iter()
                .zip(&mask)
                .map(|(id, &m)| u32::from(m != 0 && !skiplist.contains(id)))
                .collect();
            (ids, mask, types, keep, len)
        }
    }
}

/// The model's own files beside its `tokenizer.json`: `tokenizer_config.json` and the
/// tokenizer kwargs of `sentence_bert_config.json` (`processor_kwargs`, older
/// `tokenizer_args`), which win over it as sentence-transformers passes them on.
fn tokenizer_settings(dir: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let read = |name: &str| -> Result<Option<serde_json::Value>> {
        let path = dir.join(name);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::ModelFile {
                path: path.clone(),
                reason: e.to_string(),
            })
    };
    let mut settings = match read(files::TOKENIZER_CONFIG)? {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    if let Some(st) = read(files::SENTENCE_BERT_CONFIG)? {
        for key in ["processor_kwargs", "tokenizer_args"] {
            if let Some(serde_json::Value::Object(kwargs)) = st.get(key) {
                for (k, v) in kwargs {
                    settings.insert(k.clone(), v.clone());
                }
            }
        }
    }
    Ok(settings)
}

/// Reads a model's `tokenizer.json` at `path` as the model expects it, with the settings
/// of its directory `dir`: the padding side and pad token, and a BOS/EOS that
/// `add_bos_token` / `add_eos_token` ask for and the post-processor does not add. Returns
/// the tokenizer and the model's `tokenizer_config.json` (to write back on export).
pub fn read_model_tokenizer(
    path: &Path,
    dir: &Path,
) -> Result<(
    tokenizers::Tokenizer,
    Option<serde_json::Map<String, serde_json::Value>>,
)> {
    let mut inner = read_tokenizer_file(path)?;
    let settings = tokenizer_settings(dir)?;
    let config_path = dir.join(files::TOKENIZER_CONFIG);
    let config = match std::fs::read_to_string(&config_path) {
        Ok(text) => match serde_json::from_str(&text) {
            Ok(serde_json::Value::Object(m)) => Some(m),
            _ => None,
        },
        Err(_) => None,
    };
    let bad = |reason: String| Error::ModelFile {
        path: config_path.clone(),
        reason,
    };
    let direction = match settings.get("padding_side").and_then(|v| v.as_str()) {
        Some("left") => Some(PaddingDirection::Left),
        Some("right") => Some(PaddingDirection::Right),
        Some(other) => {
            return Err(bad(format!(
                "`padding_side` = {other:?}: supported are \"left\" and \"right\""
            )))
        }
        None => None,
    };
    let pad = match special_token(&settings, "pad_token") {
        Some(token) => {
            let id = inner.token_to_id(&token).ok_or_else(|| {
                bad(format!(
                    "`pad_token` {token:?} is not in the tokenizer's vocabulary"
                ))
            })?;
            Some((token, id))
        }
        None => inner.get_padding().map(|p| (p.pad_token.clone(), p.pad_id)),
    };
    if let Some((pad_token, pad_id)) = pad {
        let direction = direction
            .or_else(|| inner.get_padding().map(|p| p.direction))
            .unwrap_or(PaddingDirection::Right);
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            direction,
            pad_id,
            pad_token,
            ..Default::default()
        }));
    }
    add_special_tokens(&mut inner, &settings).map_err(bad)?;
    Ok((inner, config))
}

/// Llama-style tokenizer configs say whether a BOS and an EOS surround every text
/// (`add_bos_token`, `add_eos_token`; transformers rebuilds the post-processor from them).
/// Where `tokenizer.json`'s own post-processor does not add what they ask for, a template
/// that does replaces it.
fn add_special_tokens(
    inner: &mut tokenizers::Tokenizer,
    settings: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<(), String> {
    let flag = |key: &str| settings.get(key).and_then(|v| v.as_bool());
    let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
    if add_bos.is_none() && add_eos.is_none() {
        return Ok(());
    }
    let token = |key: &str| -> std::result::Result<Option<(String, u32)>, String> {
        let Some(t) = special_token(settings, key) else {
            return Ok(None);
        };
        let id = inner
            .token_to_id(&t)
            .ok_or_else(|| format!("`{key}` {t:?} is not in the tokenizer's vocabulary"))?;
        Ok(Some((t, id)))
    };
    let bos = if add_bos == Some(true) {
        token("bos_token")?
    } else {
        None
    };
    let eos = if add_eos == Some(true) {
        token("eos_token")?
    } else {
        None
    };
    let probe = inner
        .encode("a", true)
        .map_err(|e| format!("cannot tokenize: {e}"))?;
    let ids = probe.get_ids();
    let has_bos = bos.as_ref().is_none_or(|(_, id)| ids.first() == Some(id));
    let has_eos = eos.as_ref().is_none_or(|(_, id)| ids.last() == Some(id));
    if has_bos && has_eos {
        return Ok(());
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some((t, _)) = &bos {
        single.push(format!("{t}:0"));
        pair.push(format!("{t}:0"));
    }
    single.push("$A:0".to_string());
    pair.push("$A:0".to_string());
    if let Some((t, _)) = &eos {
        single.push(format!("{t}:0"));
        pair.push(format!("{t}:0"));
    }
    if let Some((t, _)) = &bos {
        pair.push(format!("{t}:1"));
    }
    pair.push("$B:1".to_string());
    if let Some((t, _)) = &eos {
        pair.push(format!("{t}:1"));
    }
    let specials: Vec<(String, u32)> = bos.into_iter().chain(eos).collect();
    let template = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single(single.join(" "))
        .and_then(|b| b.try_pair(pair.join(" ")))
        .map_err(|e| format!("cannot build the BOS/EOS template: {e}"))?
        .special_tokens(specials)
        .build()
        .map_err(|e| format!("cannot build the BOS/EOS template: {e}"))?;
    inner.with_post_processor(Some(template));
    Ok(())
}

/// The longest input the model takes, in tokens, and where that limit comes from, as
/// sentence-transformers decides it: `max_seq_length` of `sentence_bert_config.json`
/// (older packages), else `model_max_length` of the tokenizer kwargs or of
/// `tokenizer_config.json` (what sentence-transformers 6 writes) capped at
/// `max_position_embeddings`, else the positions the model covers (`positions`); never
/// more than `positions`.
pub fn model_max_length(dir: &Path, positions: usize) -> Result<(usize, String)> {
    let st_path = dir.join(files::SENTENCE_BERT_CONFIG);
    if st_path.is_file() {
        let text = std::fs::read_to_string(&st_path).map_err(|e| Error::io("read", &st_path, e))?;
        let st: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::ModelFile {
            path: st_path.clone(),
            reason: e.to_string(),
        })?;
        if let Some(len) = st.get("max_seq_length").and_then(|v| v.as_f64()) {
            if len >= 1.0 {
                let len = (len as usize).min(positions);
                return Ok((len, "max_seq_length of sentence_bert_config.json".into()));
            }
        }
    }
    let settings = tokenizer_settings(dir)?;
    if let Some(len) = settings.get("model_max_length").and_then(|v| v.as_f64()) {
        if len >= 1.0 {
            // A length past 2^53 (transformers' "very large integer") is no limit.
            let len = if len > 1e15 {
                positions
            } else {
                (len as usize).min(positions)
            };
            return Ok((len, "model_max_length of tokenizer_config.json".into()));
        }
    }
    Ok((positions, "the model's max_position_embeddings".into()))
}

/// Reads a `tokenizer.json` as it is (no truncation or padding added).
pub fn read_tokenizer_file(path: &Path) -> Result<tokenizers::Tokenizer> {
    if !path.is_file() {
        return Err(Error::MissingFile {
            path: path.to_path_buf(),
            what: "tokenizer",
        });
    }
    tokenizers::Tokenizer::from_file(path).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Builds a BERT-style WordPiece tokenizer from `texts`: BERT normaliser and
/// pre-tokenizer, `[CLS] .. [SEP]` post-processing, special tokens `[PAD] [UNK] [CLS] [SEP]
/// [MASK]` with ids 0 to 4.
///
/// The vocabulary is every character seen (alone and as a `##` continuation), then the most
/// frequent words (seen at least twice; ties broken alphabetically) up to `vocab_size`, so
/// unknown words fall back to characters. It is a pure function of the texts: the
/// `tokenizers` crate's WordPiece trainer breaks frequency ties in hash order, so two runs
/// on the same data gave different vocabularies (4 of 4,000 tokens differed when we
/// measured), which would make two runs with one seed differ.
pub fn train_wordpiece<'a>(
    texts: impl Iterator<Item = &'a str>,
    vocab_size: usize,
    lowercase: bool,
) -> Result<tokenizers::Tokenizer> {
    use std::collections::{BTreeMap, BTreeSet, HashMap};
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::normalizers::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::processors::bert::BertProcessing;
    use tokenizers::{
        NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString,
        PreTokenizer,
    };

    let err = |e: tokenizers::Error| Error::Tokenizer(e.to_string());
    let normalizer = BertNormalizer::new(true, true, None, lowercase);
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut chars: BTreeSet<char> = BTreeSet::new();
    for text in texts {
        let mut normalized = NormalizedString::from(text);
        normalizer.normalize(&mut normalized).map_err(err)?;
        let mut pre = PreTokenizedString::from(normalized);
        BertPreTokenizer.pre_tokenize(&mut pre).map_err(err)?;
        for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Byte) {
            chars.extend(word.chars());
            *counts.entry(word.to_string()).or_default() += 1;
        }
    }
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
    let mut vocab: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    for c in &chars {
        vocab.push(c.to_string());
        vocab.push(format!("##{c}"));
    }
    let mut words: Vec<(&String, &u64)> = counts
        .iter()
        .filter(|(w, &n)| n >= 2 && w.chars().count() > 1)
        .collect();
    words.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    for (w, _) in words {
        if vocab.len() >= vocab_size {
            break;
        }
        vocab.push(w.clone());
    }
    let map: BTreeMap<String, u32> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    let spec = serde_json::json!({
        "type": "WordPiece",
        "unk_token": "[UNK]",
        "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100,
        "vocab": map,
    })
    .to_string();
    let model: WordPiece =
        serde_json::from_str(&spec).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_normalizer(Some(normalizer)).map_err(err)?;
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), 3),
        ("[CLS]".into(), 2),
    )));
    Ok(tok)
}
