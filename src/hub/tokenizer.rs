//! Text to [`TokenBatch`] with a Hugging Face `tokenizer.json` (the `tokenizers` crate):
//! truncation to a maximum length, padding to the longest sequence of the batch.
//!
//! Batches are padded to their own longest sequence; when the gradient cache cuts a batch
//! into chunks, each chunk is trimmed to *its* longest sequence
//! ([`TokenBatch::trim_padding`]), so short chunks do not pay for one long text elsewhere
//! in the batch.

use std::path::Path;

use candle_core::{Device, Tensor};
use tokenizers::{PaddingParams, PaddingStrategy, TruncationParams};

use crate::batch::TokenBatch;
use crate::{Error, Result};

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
        inner
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                ..Default::default()
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            pad_id,
            pad_token,
            ..Default::default()
        }));
        Ok(Self {
            inner,
            max_len,
            prompt: String::new(),
            exclude_prompt: false,
        })
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
        Ok(ids.saturating_sub(1))
    }

    /// The maximum sequence length.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Tokenizes `texts` into one batch padded to its longest sequence.
    pub fn encode(&self, texts: &[&str], device: &Device) -> Result<TokenBatch> {
        if texts.is_empty() {
            return Err(Error::EmptyBatch {
                side: crate::Side::Query,
            });
        }
        let encodings = if self.prompt.is_empty() {
            self.inner.encode_batch(texts.to_vec(), true)
        } else {
            let prompted: Vec<String> = texts
                .iter()
                .map(|t| format!("{}{t}", self.prompt))
                .collect();
            self.inner.encode_batch(prompted, true)
        }
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let rows = encodings.len();
        let len = encodings.first().map_or(0, |e| e.len());
        let field = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Result<Tensor> {
            let flat: Vec<u32> = encodings
                .iter()
                .flat_map(|e| f(e).iter().copied())
                .collect();
            Ok(Tensor::from_vec(flat, (rows, len), device)?)
        };
        Ok(TokenBatch::new(
            field(|e| e.get_ids())?,
            field(|e| e.get_attention_mask())?,
            field(|e| e.get_type_ids())?,
        )?
        .with_pool_from(self.pool_from()?))
    }
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
