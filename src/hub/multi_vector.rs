//! Multi-vector (ColBERT) model directories, as PyLate and sentence-transformers 6 write
//! them, and [`MultiVectorModel`]: a loaded ColBERT that embeds queries and documents as
//! token matrices.
//!
//! PyLate (`config_sentence_transformers.json` with `model_type: ColBERT`): modules
//! Transformer and `pylate.models.Dense.Dense`; the settings `query_prefix`,
//! `document_prefix`, `query_length`, `document_length`, `do_query_expansion`,
//! `attend_to_expansion_tokens`, `skiplist_words` in that file; token vectors always
//! L2-normalised. sentence-transformers 6 (`model_type: MultiVectorEncoder`): modules
//! Transformer, Dense, `MultiVectorMask` (the skiplist), Normalize; the prefixes as the
//! `query` / `document` prompts; `document_length` and `query_expansion` in
//! `sentence_bert_config.json`. A skiplist word that is not one token of the vocabulary
//! is left out, as sentence-transformers does (PyLate would skip every `[UNK]` instead).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::files::{read_modules, MODULES, SENTENCE_BERT_CONFIG, SENTENCE_TRANSFORMERS_CONFIG};
use super::sentence_transformers::{read_dense, DenseLayer};
use super::tokenizer::{Tokenizer, VectorSide};
use super::{load_tokenizer, HubSettings, ModelFiles};
use crate::encoder::Encoder;
use crate::models::bert::{load_pretrained, BertConfig, BertEncoder, BertOptions};
use crate::params::ParamStore;
use crate::{Error, Result};

/// Punctuation, the skiplist of PyLate and Stanford ColBERT (Python's
/// `string.punctuation`).
pub const PUNCTUATION: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/// Which package's layout a multi-vector directory has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// PyLate's `ColBERT`.
    PyLate,
    /// sentence-transformers 6's `MultiVectorEncoder`.
    SentenceTransformers,
}

/// A multi-vector directory: its layout, its settings and its projections.
#[derive(Debug, Clone)]
pub struct MultiVectorConfig {
    /// The layout the directory had.
    pub layout: Layout,
    /// Prefixes, lengths, query expansion, skiplist, and the token vectors' width (the
    /// last projection's output, else the hidden size).
    pub head: MultiVectorHead,
    /// The projections after the transformer (PyLate's Dense: no bias, to 128 or fewer).
    pub dense: Vec<DenseLayer>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A multi-vector model's settings without its weights: what a run trains with (each
/// configured, else the pretrained model's, else PyLate's) and an export writes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MultiVectorHead {
    /// Token vector width.
    pub dim: usize,
    /// Query length.
    pub query_length: usize,
    /// Document length.
    pub document_length: usize,
    /// Query prefix.
    pub query_prefix: String,
    /// Document prefix.
    pub document_prefix: String,
    /// Query expansion.
    pub query_expansion: bool,
    /// Attention to the expansion tokens.
    pub attend_to_expansion_tokens: bool,
    /// The document skiplist.
    pub skiplist_words: Vec<String>,
}

/// Whether the directory holds a multi-vector model (its
/// `config_sentence_transformers.json` says `ColBERT` or `MultiVectorEncoder`).
pub fn is_multi_vector_dir(dir: &Path) -> bool {
    let path = dir.join(SENTENCE_TRANSFORMERS_CONFIG);
    path.is_file()
        && read_json(&path).is_ok_and(|c| {
            matches!(
                c["model_type"].as_str(),
                Some("ColBERT" | "MultiVectorEncoder")
            )
        })
}

/// Whether `model` (a directory, or a Hub id already in the local cache) is a
/// multi-vector model.
pub fn is_multi_vector_model(model: &str) -> bool {
    let path = Path::new(model);
    if path.is_dir() {
        return is_multi_vector_dir(path);
    }
    ModelFiles::resolve(model, &HubSettings::from_env()).is_ok_and(|f| is_multi_vector_dir(&f.dir))
}

impl MultiVectorConfig {
    /// The settings of `dir` when it holds a multi-vector model, else `None`.
    pub fn read_if_any(dir: &Path) -> Result<Option<Self>> {
        match is_multi_vector_dir(dir) {
            true => Self::read(dir).map(Some),
            false => Ok(None),
        }
    }

    /// Reads the settings of a PyLate or sentence-transformers 6 multi-vector directory.
    pub fn read(dir: &Path) -> Result<Self> {
        let st_path = dir.join(SENTENCE_TRANSFORMERS_CONFIG);
        let st = read_json(&st_path)?;
        let layout = match st["model_type"].as_str() {
            Some("ColBERT") => Layout::PyLate,
            Some("MultiVectorEncoder") => Layout::SentenceTransformers,
            other => {
                return Err(bad(
                    &st_path,
                    format!("`model_type` {other:?} is not a multi-vector model (ColBERT, MultiVectorEncoder)"),
                ))
            }
        };
        let modules_path = dir.join(MODULES);
        let mut dense = Vec::new();
        let mut skiplist = None;
        for (i, (ty, path)) in read_modules(&modules_path)?.into_iter().enumerate() {
            let class = ty.rsplit('.').next().unwrap_or(&ty).to_string();
            match (i, class.as_str()) {
                (0, "Transformer") => {}
                (i, "Dense") if i > 0 => {
                    let cfg = read_json(&dir.join(&path).join("config.json"))?;
                    if cfg["use_residual"].as_bool() == Some(true) {
                        return Err(bad(&dir.join(&path).join("config.json"), "a Dense with `use_residual` is not supported"));
                    }
                    dense.push(read_dense(&dir.join(&path))?)
                }
                (i, "MultiVectorMask") if i > 0 => {
                    let path = dir.join(&path).join("config.json");
                    let cfg = read_json(&path)?;
                    let tasks: Vec<&str> = match &cfg["skiplist_tasks"] {
                        Value::Null => vec!["document"],
                        Value::String(s) => vec![s.as_str()],
                        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                        _ => vec![],
                    };
                    if tasks != ["document"] || !cfg["keep_only_token_ids"].is_null() {
                        return Err(bad(&path, "only a document skiplist is supported (`skiplist_tasks: [\"document\"]`, no `keep_only_token_ids`)"));
                    }
                    skiplist = Some(words(&cfg["skiplist_words"]));
                }
                (i, "Normalize") if i > 0 => {}
                _ => {
                    return Err(Error::UnsupportedConfig {
                        field: "modules",
                        value: ty,
                        supported: "a multi-vector model of Transformer, Dense (PyLate's or sentence-transformers'), MultiVectorMask, Normalize",
                        path: modules_path,
                    })
                }
            }
        }
        let count = |v: &Value, key: &str, path: &Path| -> Result<usize> {
            v[key]
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| bad(path, format!("`{key}` is missing or not a count")))
        };
        // The token vectors' width: the last projection's, else the hidden size.
        let dim = match dense.last() {
            Some(d) => d.out_features(),
            None => count(
                &read_json(&dir.join("config.json"))?,
                "hidden_size",
                &dir.join("config.json"),
            )?,
        };
        let head = match layout {
            Layout::PyLate => MultiVectorHead {
                dim,
                query_prefix: st["query_prefix"].as_str().unwrap_or("[Q] ").to_string(),
                document_prefix: st["document_prefix"].as_str().unwrap_or("[D] ").to_string(),
                query_length: count(&st, "query_length", &st_path)?,
                document_length: count(&st, "document_length", &st_path)?,
                query_expansion: st["do_query_expansion"].as_bool().unwrap_or(true),
                attend_to_expansion_tokens: st["attend_to_expansion_tokens"]
                    .as_bool()
                    .unwrap_or(false),
                skiplist_words: match &st["skiplist_words"] {
                    Value::Null => PUNCTUATION.chars().map(String::from).collect(),
                    v => words(v),
                },
            },
            Layout::SentenceTransformers => {
                let sb_path = dir.join(SENTENCE_BERT_CONFIG);
                let sb = read_json(&sb_path)?;
                // Without its own lengths a side is cut at the model's limit, as
                // sentence-transformers does.
                let limit = model_limit(dir, &sb);
                let length = |key: &str| -> Result<usize> {
                    match &sb[key] {
                        Value::Null => limit.ok_or_else(|| bad(&sb_path, format!("no `{key}` and no `max_seq_length` or model limit to fall back on"))),
                        _ => count(&sb, key, &sb_path),
                    }
                };
                let prompt =
                    |name: &str| st["prompts"][name].as_str().unwrap_or_default().to_string();
                let expansion = &sb["query_expansion"];
                let (query_expansion, attend, query_length) = match expansion {
                    Value::Null => (false, false, length("max_seq_length")?),
                    e => {
                        if e["strategy"].as_str().is_some_and(|s| s != "fixed")
                            || !e["token"].is_null()
                        {
                            return Err(bad(&sb_path, "only `query_expansion` with strategy `fixed` and the mask token (`token: null`) is supported"));
                        }
                        (
                            true,
                            e["attend"].as_bool().unwrap_or(false),
                            count(e, "length", &sb_path)?,
                        )
                    }
                };
                MultiVectorHead {
                    dim,
                    query_prefix: prompt("query"),
                    document_prefix: prompt("document"),
                    query_length,
                    document_length: length("document_length")?,
                    query_expansion,
                    attend_to_expansion_tokens: attend,
                    skiplist_words: skiplist.unwrap_or_default(),
                }
            }
        };
        Ok(Self {
            layout,
            head,
            dense,
        })
    }
}

impl MultiVectorHead {
    /// The query and document tokenizers of this model over `base` (the model's
    /// tokenizer): prefixes as prompts, the lengths, expansion with the mask token, the
    /// skiplist's token ids. Refuses a prefix that is not one token of the vocabulary and
    /// a query length without room for the special tokens, the prefix and one token.
    pub fn tokenizers(
        &self,
        base: &tokenizers::Tokenizer,
        dir: &Path,
    ) -> Result<(Tokenizer, Tokenizer)> {
        let path = dir.join(SENTENCE_TRANSFORMERS_CONFIG);
        for prefix in [&self.query_prefix, &self.document_prefix] {
            if !prefix.is_empty() && base.token_to_id(prefix).is_none() {
                return Err(bad(&path, format!("the prefix {prefix:?} is not a token of the tokenizer (PyLate adds it to the vocabulary)")));
            }
        }
        let specials = 2 + usize::from(!self.query_prefix.is_empty());
        if self.query_length <= specials || self.document_length <= specials {
            return Err(Error::InvalidConfig {
                field: "query_length",
                value: format!("{} (documents {})", self.query_length, self.document_length),
                reason: "a query and a document need room for the special tokens, the prefix and one token",
            });
        }
        let expansion = match self.query_expansion {
            true => Some(
                ["[MASK]", "<mask>"]
                    .iter()
                    .find_map(|t| base.token_to_id(t))
                    .ok_or_else(|| bad(&path, "query expansion needs a mask token (`[MASK]` or `<mask>`) in the tokenizer"))?,
            ),
            false => None,
        };
        let skiplist = self
            .skiplist_words
            .iter()
            .filter_map(|w| base.token_to_id(w))
            .collect();
        let query = Tokenizer::new(base.clone(), self.query_length)?
            .with_prompt(&self.query_prefix)
            .with_vectors(VectorSide::Query {
                expansion,
                attend: self.attend_to_expansion_tokens,
            });
        let document = Tokenizer::new(base.clone(), self.document_length)?
            .with_prompt(&self.document_prefix)
            .with_vectors(VectorSide::Document { skiplist });
        Ok((query, document))
    }
}

/// A sentence-transformers model's limit: `max_seq_length`, else the tokenizer config's
/// `model_max_length` (when it is a real one), else the positions of `config.json`.
fn model_limit(dir: &Path, sb: &Value) -> Option<usize> {
    let read = |name: &str, key: &str| -> Option<usize> {
        let v = read_json(&dir.join(name)).ok()?;
        v[key]
            .as_u64()
            .map(|n| n as usize)
            .filter(|&n| n < 1_000_000)
    };
    sb["max_seq_length"]
        .as_u64()
        .map(|n| n as usize)
        .or_else(|| read("tokenizer_config.json", "model_max_length"))
        .or_else(|| read("config.json", "max_position_embeddings"))
}

fn words(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// A multi-vector model loaded for inference: a token matrix per text.
pub struct MultiVectorModel {
    encoder: BertEncoder,
    config: MultiVectorConfig,
    bert: BertConfig,
    query: Tokenizer,
    document: Tokenizer,
    device: Device,
    _store: ParamStore,
}

impl super::Retriever for MultiVectorModel {
    fn scoring(&self) -> crate::retrieval::Scoring {
        crate::retrieval::Scoring::MaxSim
    }

    fn embed_queries(&self, texts: &[&str], chunk: usize) -> Result<Tensor> {
        self.matrices(&self.query, texts, chunk)
    }

    fn embed_passages(&self, texts: &[&str], chunk: usize) -> Result<Tensor> {
        self.matrices(&self.document, texts, chunk)
    }

    fn prompts(&self) -> super::Prompts {
        super::Prompts {
            query: self.config.head.query_prefix.clone(),
            passage: self.config.head.document_prefix.clone(),
            ..Default::default()
        }
    }
}

impl MultiVectorModel {
    /// Loads a PyLate or sentence-transformers 6 multi-vector model from a directory or
    /// the Hub cache.
    pub fn load(model: &str, device: &Device) -> Result<Self> {
        let files = ModelFiles::resolve(model, &HubSettings::from_env())?;
        let config = MultiVectorConfig::read(&files.dir)?;
        let options = BertOptions {
            normalize: true,
            multi_vector: true,
            dense: config.dense.iter().map(DenseLayer::spec).collect(),
            ..Default::default()
        };
        let store = ParamStore::new(0, DType::F32, device);
        let (encoder, bert, store) = load_pretrained(&files, "", &options, store)?;
        let (inner, _) = load_tokenizer(&files, &bert)?;
        let (query, document) = config.head.tokenizers(&inner, &files.dir)?;
        Ok(Self {
            encoder,
            config,
            bert,
            query,
            document,
            device: device.clone(),
            _store: store,
        })
    }

    /// The model's settings.
    pub fn config(&self) -> &MultiVectorConfig {
        &self.config
    }

    /// The transformer's config.
    pub fn bert_config(&self) -> &BertConfig {
        &self.bert
    }

    /// The encoder (a multi-vector head over the transformer).
    pub fn encoder(&self) -> &BertEncoder {
        &self.encoder
    }

    /// The encoder for training, with the store that holds its variables.
    pub fn into_encoder(self) -> (BertEncoder, ParamStore) {
        (self.encoder, self._store)
    }

    /// The query and document tokenizers.
    pub fn tokenizers(&self) -> (&Tokenizer, &Tokenizer) {
        (&self.query, &self.document)
    }

    /// The token vectors' width.
    pub fn dim(&self) -> usize {
        self.config.head.dim
    }

    /// Each query's token vectors `[kept tokens, dim]` (with expansion, `query_length`).
    pub fn query_vectors(&self, texts: &[&str], chunk: usize) -> Result<Vec<Tensor>> {
        self.kept(&self.query, texts, chunk)
    }

    /// Each document's token vectors `[kept tokens, dim]`: its real tokens but the
    /// skiplist's, in order.
    pub fn document_vectors(&self, texts: &[&str], chunk: usize) -> Result<Vec<Tensor>> {
        self.kept(&self.document, texts, chunk)
    }

    /// The token matrices `[texts, width, dim]` of `texts` (`width` the side's length;
    /// absent tokens zero vectors), `chunk` texts at a time: what MaxSim scores.
    pub fn matrices(&self, tokenizer: &Tokenizer, texts: &[&str], chunk: usize) -> Result<Tensor> {
        let parts = self.long_run(texts.len(), || {
            texts
                .chunks(chunk.max(1))
                .map(|part| Ok(self.encode_part(tokenizer, part)?.0))
                .collect::<Result<Vec<_>>>()
        })?;
        if parts.is_empty() {
            return Err(Error::EmptyBatch {
                side: crate::Side::Query,
            });
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// One part's token matrices `[texts, width, dim]` and the tokens its batch keeps
    /// (`[texts, width]`, a row per text).
    fn encode_part(&self, tokenizer: &Tokenizer, part: &[&str]) -> Result<(Tensor, Vec<Vec<u32>>)> {
        let _flush = crate::denormal::flush();
        let batch = tokenizer.encode(part, &self.device)?;
        let reps = self.encoder.encode(&batch, &crate::dropout::Ctx::eval())?;
        let rows = reps.dim(0)?;
        let keep = match &batch.vectors {
            Some(v) => v.keep.to_vec2::<u32>()?,
            None => Vec::new(),
        };
        Ok((reps.reshape((rows, (), self.dim()))?, keep))
    }

    /// `f`, with the projection weights read from transposed copies when it encodes
    /// `texts` texts on the CPU, as many as [`super::embed`] makes them for (the same
    /// bits, faster products).
    fn long_run<R>(&self, texts: usize, f: impl FnOnce() -> R) -> R {
        if self.device.is_cpu() && texts >= super::TRANSPOSED_FROM_TEXTS {
            crate::nn::TransposedWeights::new().run(f)
        } else {
            f()
        }
    }

    fn kept(&self, tokenizer: &Tokenizer, texts: &[&str], chunk: usize) -> Result<Vec<Tensor>> {
        self.long_run(texts.len(), || self.kept_all(tokenizer, texts, chunk))
    }

    fn kept_all(&self, tokenizer: &Tokenizer, texts: &[&str], chunk: usize) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(texts.len());
        for part in texts.chunks(chunk.max(1)) {
            let (reps, keep) = self.encode_part(tokenizer, part)?;
            for (r, kept) in keep.iter().enumerate() {
                let idx: Vec<u32> = kept
                    .iter()
                    .enumerate()
                    .filter(|(_, &k)| k != 0)
                    .map(|(t, _)| t as u32)
                    .collect();
                let idx = Tensor::new(idx.as_slice(), &self.device)?;
                out.push(reps.get(r)?.index_select(&idx, 0)?);
            }
        }
        Ok(out)
    }
}
