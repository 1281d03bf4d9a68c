//! Hugging Face I/O: [`files`] finds a model's files in a directory or through the Hub
//! cache, [`tokenizer`] turns text into [`TokenBatch`](crate::batch::TokenBatch)es, [`export`] writes a trained tower
//! as a `transformers` + `sentence-transformers` directory, and [`EmbeddingModel`] is the
//! one inference path: `gradcache eval`, `gradcache encode` and the examples load and run
//! models through it, and the trainer's evaluation uses the same [`embed`].
//!
//! A model directory (or Hub repo) with sentence-transformers files (`modules.json`,
//! `1_Pooling/config.json`, `config_sentence_transformers.json`) says how it pools,
//! whether it normalises and which similarity it was trained with; one without them (a
//! DPR or plain BERT checkpoint) gets what the caller names in [`LoadOptions`], else
//! sentence-transformers' own defaults for a plain model (mean pooling, no normalisation,
//! cosine similarity). [`EmbeddingModel::settings`] says which was used and why, so the
//! binary can log it.

pub mod adapter;
pub mod chat;
mod embedding;
pub mod export;
pub mod files;
pub mod merge;
pub mod multi_vector;
pub mod router;
pub mod sentence_transformers;
pub mod sparse;
pub mod tokenizer;

use std::path::Path;

use candle_core::{DType, Device, Tensor};

pub use crate::models::bert::DenseActivation;
pub(crate) use embedding::longest_first;
pub use embedding::{block_texts, embed, BLOCK_CHUNKS, TOKEN_BLOCK_TEXTS, TRANSPOSED_FROM_TEXTS};
pub use export::export_bert;
pub use files::{HubSettings, ModelFiles};
pub use multi_vector::{MultiVectorConfig, MultiVectorModel};
pub use sentence_transformers::{
    read_sentence_transformers_config, DenseLayer, Prompts, SentenceTransformersConfig,
};
pub use tokenizer::Tokenizer;

use crate::batch::Chunking;
use crate::encoder::Encoder;
use crate::loss::Similarity;
use crate::models::bert::{load_pretrained, BertConfig, BertEncoder, BertOptions, Pooling};
use crate::params::ParamStore;
use crate::{Error, Result};

/// A model that retrieves: it embeds queries and passages, and says how they are scored
/// (one vector each with a similarity, or token matrices by MaxSim). `gradcache eval`
/// and `gradcache mine` run on either kind through it.
pub trait Retriever {
    /// How embeddings are scored.
    fn scoring(&self) -> crate::retrieval::Scoring;
    /// Query embeddings (`[texts, width]`, or token matrices `[texts, tokens, width]`).
    fn embed_queries(&self, texts: &[&str], chunk: usize) -> Result<Tensor>;
    /// Passage embeddings, as the queries'.
    fn embed_passages(&self, texts: &[&str], chunk: usize) -> Result<Tensor>;
    /// The texts put before queries and passages.
    fn prompts(&self) -> Prompts;
}

impl Retriever for EmbeddingModel {
    fn scoring(&self) -> crate::retrieval::Scoring {
        if self.is_sparse() {
            crate::retrieval::Scoring::Sparse
        } else {
            self.similarity().into()
        }
    }

    fn embed_queries(&self, texts: &[&str], chunk: usize) -> Result<Tensor> {
        EmbeddingModel::embed_queries(self, texts, chunk)
    }

    fn embed_passages(&self, texts: &[&str], chunk: usize) -> Result<Tensor> {
        EmbeddingModel::embed_passages(self, texts, chunk)
    }

    fn prompts(&self) -> Prompts {
        EmbeddingModel::prompts(self).clone()
    }
}

/// How to load a model for inference. `None` means: what the model's
/// sentence-transformers files say, else the plain-model default.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Pooling (default for a plain model: mean).
    pub pooling: Option<Pooling>,
    /// L2-normalise embeddings (default for a plain model: no).
    pub normalize: Option<bool>,
    /// Similarity for ranking (default: cosine).
    pub similarity: Option<Similarity>,
    /// Token limit. `None`: the model's own ([`tokenizer::model_max_length`]); a larger
    /// one is capped at it (the settings line says so).
    pub max_len: Option<usize>,
    /// Where to run.
    pub device: Device,
    /// Put before queries (default: the model's `query` prompt, else its default prompt).
    pub query_prompt: Option<String>,
    /// Put before passages (default: the model's `document`/`passage`/`corpus` prompt,
    /// else its default prompt).
    pub passage_prompt: Option<String>,
    /// For a PEFT adapter directory: the base model it adapts (default: the adapter
    /// config's `base_model_name_or_path`).
    pub base: Option<String>,
    /// Encode with this task adapter of the model (Jina v3's `lora_adaptations`), its
    /// instruction put before every text unless a prompt is given.
    pub task: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pooling: None,
            normalize: None,
            similarity: None,
            max_len: None,
            device: Device::Cpu,
            query_prompt: None,
            passage_prompt: None,
            base: None,
            task: None,
        }
    }
}

/// A model loaded for inference: encoder, tokenizer, pooling, normalisation, similarity.
pub struct EmbeddingModel {
    encoder: BertEncoder,
    /// The sentence-transformers `Dense` modules after the pooling.
    dense: Vec<DenseLayer>,
    tokenizer: Tokenizer,
    /// The tokenizer with the query prompt, and with the passage prompt.
    query_tokenizer: Tokenizer,
    passage_tokenizer: Tokenizer,
    prompts: Prompts,
    config: BertConfig,
    options: BertOptions,
    similarity: Similarity,
    settings: String,
    device: Device,
    _store: ParamStore,
    /// An inference-free model's query route (its static weights and tokenizer).
    static_query: Option<StaticQuery>,
    /// Whether a text given without a side (`embed`) takes the query route.
    queries_by_default: bool,
}

/// The static query weights' parameter name.
fn static_name() -> String {
    crate::sparse_static::static_weight_name()
}

/// The query route of an inference-free sparse model ([`router`]): a weight per
/// vocabulary entry, and the tokenizer that adds no special tokens.
struct StaticQuery {
    encoder: crate::sparse_static::StaticSparseEncoder,
    tokenizer: Tokenizer,
    frozen: bool,
    _store: ParamStore,
}

/// Where one setting of a loaded model came from.
fn pick<T: std::fmt::Debug>(
    given: Option<T>,
    from_files: Option<T>,
    file: &str,
    default: T,
) -> (T, String) {
    match (given, from_files) {
        (Some(v), _) => (v, "given".to_string()),
        (None, Some(v)) => (v, format!("from {file}")),
        (None, None) => (default, "default".to_string()),
    }
}

impl EmbeddingModel {
    /// Loads a model directory or Hub repo id (see [`ModelFiles::resolve`]), or a PEFT
    /// LoRA adapter directory over its base model (see [`Self::from_adapter`]).
    pub fn load(model: &str, options: &LoadOptions) -> Result<Self> {
        let path = Path::new(model);
        if path.is_dir() && adapter::is_adapter_dir(path) {
            return Self::from_adapter(path, options);
        }

        let files = ModelFiles::resolve(model, &HubSettings::from_env())?;
        Self::from_files(&files, options)
    }

    /// Loads the LoRA adapter in `dir` over its base model (`options.base`, else the
    /// adapter config's `base_model_name_or_path`): the base model's weights with the
    /// adapters on its projections. The sentence-transformers files and tokenizer are the
    /// adapter directory's where it has them (`gradcache export --adapter` writes them),
    /// else the base model's.
    pub fn from_adapter(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let adapter = adapter::PeftAdapter::read(dir)?;
        let base = options
            .base
            .clone()
            .or_else(|| adapter.base.clone())
            .ok_or_else(|| Error::ModelFile {
                path: dir.join(adapter::ADAPTER_CONFIG),
                reason: "names no base model (`base_model_name_or_path`): give it with --base"
                    .into(),
            })?;
        let base_files = ModelFiles::resolve(&base, &HubSettings::from_env())?;
        let family = BertConfig::from_file(&base_files.config)?.family(&base_files.config)?;
        let adapter = adapter.for_family(family)?;
        let own_head = dir.join(export::MODULES).is_file();
        let tokenizer = dir.join("tokenizer.json");
        let files = ModelFiles {
            dir: if own_head {
                dir.to_path_buf()
            } else {
                base_files.dir.clone()
            },
            tokenizer: if own_head && tokenizer.is_file() {
                Some(tokenizer)
            } else {
                base_files.tokenizer.clone()
            },
            ..base_files
        };
        let mut model = Self::build(&files, options, Some(&adapter))?;
        model.settings += &format!(
            "; LoRA adapter {} (r {}, alpha {}) over {base}",
            dir.display(),
            adapter.spec.rank,
            adapter.spec.alpha
        );
        Ok(model)
    }

    /// Loads a model from its resolved files.
    pub fn from_files(files: &ModelFiles, options: &LoadOptions) -> Result<Self> {
        Self::build(files, options, None)
    }

    fn build(
        files: &ModelFiles,
        options: &LoadOptions,
        adapter: Option<&adapter::PeftAdapter>,
    ) -> Result<Self> {
        let mut model = Self::build_with(files, files.head()?, options, adapter)?;
        if let Some((root, layout)) = &files.router {
            model.attach_static_query(root, layout, options)?;
        }
        Ok(model)
    }

    /// An inference-free model's query route (see [`router`]): its static weights and
    /// its tokenizer, which adds no special tokens.
    fn attach_static_query(
        &mut self,
        root: &Path,
        layout: &router::RouterLayout,
        options: &LoadOptions,
    ) -> Result<()> {
        let static_dir = root.join(&layout.query);
        let own = static_dir.join(files::TOKENIZER);
        let tokenizer = if own.is_file() {
            Tokenizer::from_file(&own, self.tokenizer.max_len())?
        } else {
            self.tokenizer.clone()
        }
        .without_special_tokens()
        .with_prompt(&self.prompts.query);
        let vocab = self.config.vocab_size;
        let known = tokenizer.inner().get_vocab_size(true);
        if known > vocab {
            return Err(Error::ModelFile {
                path: static_dir,
                reason: format!(
                    "the query tokenizer knows {known} tokens and the static weights cover \
                     {vocab}: a query's vector has one entry per vocabulary entry"
                ),
            });
        }
        let weight = router::read_static_weights(&static_dir, &tokenizer, vocab)?;
        let store = ParamStore::new(0, DType::F32, &options.device);
        let encoder = crate::sparse_static::SparseStaticEmbedding::tower(
            &store,
            crate::sparse_static::STATIC_PREFIX,
            vocab,
        )?;
        if let Some(var) = crate::encoder::Encoder::params(&encoder).get(&static_name()) {
            var.set(&weight.to_device(&options.device)?)?;
        }
        self.settings = format!(
            "inference-free sparse: queries by static weights (SparseStaticEmbedding{}, no \
             transformer), documents by the masked-language model; {}",
            if layout.frozen { ", frozen" } else { "" },
            self.settings
        );
        self.static_query = Some(StaticQuery {
            encoder,
            tokenizer,
            frozen: layout.frozen,
            _store: store,
        });
        self.queries_by_default = layout.default_route == router::Route::Query;
        Ok(())
    }

    fn build_with(
        files: &ModelFiles,
        head: Option<SentenceTransformersConfig>,
        options: &LoadOptions,
        adapter: Option<&adapter::PeftAdapter>,
    ) -> Result<Self> {
        let (pooling, pooling_src) = pick(
            options.pooling,
            head.as_ref().map(|h| h.pooling),
            export::POOLING,
            Pooling::Mean,
        );
        let (normalize, normalize_src) = pick(
            options.normalize,
            head.as_ref().map(|h| h.normalize),
            export::MODULES,
            false,
        );
        let (similarity, similarity_src) = pick(
            options.similarity,
            head.as_ref().and_then(|h| h.similarity),
            export::SENTENCE_TRANSFORMERS_CONFIG,
            Similarity::Cosine,
        );
        let dense = head.as_ref().map(|h| h.dense.clone()).unwrap_or_default();
        let head_note = if let Some(h) = &head {
            let mut note = "sentence-transformers files found".to_string();
            for d in &h.dense {
                note += &format!(
                    "; Dense {} -> {} ({:?}) from {}",
                    d.weight.dim(1)?,
                    d.out_features(),
                    d.activation,
                    d.dir.display()
                );
            }
            note
        } else {
            format!(
                "no sentence-transformers files in {}: a plain model, defaults as \
                 sentence-transformers gives one (set --pooling, --normalize, --similarity \
                 to change)",
                files.dir.display()
            )
        };
        let from_files = head.as_ref().map(|h| h.prompts.clone()).unwrap_or_default();
        // A task adapter's instruction is the prompt of either side.
        let task = match &options.task {
            Some(name) => {
                let config = BertConfig::from_file(&files.config)?;
                let tasks =
                    config
                        .task_adapters(&files.config)?
                        .ok_or_else(|| Error::InvalidArgument {
                            what: "--task",
                            value: name.clone(),
                            reason: "the model has no task adapters (its config.json names no \
                                 lora_adaptations): only Jina v3's release carries them",
                        })?;
                let index = tasks.index(name, "--task")?;
                Some((index, tasks.instructions[index].clone()))
            }
            None => None,
        };
        let (from_files, default_prompt) = match &task {
            Some((_, instruction)) => (
                Prompts {
                    query: instruction.clone(),
                    passage: instruction.clone(),
                    ..Default::default()
                },
                instruction.clone(),
            ),
            None => (from_files, String::new()),
        };
        let prompts = Prompts {
            query: options.query_prompt.clone().unwrap_or(from_files.query),
            passage: options.passage_prompt.clone().unwrap_or(from_files.passage),
            ..Default::default()
        };
        let prompt_pooled = head.as_ref().is_none_or(|h| h.include_prompt);
        let mut settings = format!(
            "pooling {} ({pooling_src}), normalize {normalize} ({normalize_src}), similarity \
             {} ({similarity_src}); {head_note}",
            pooling.name(),
            similarity.sentence_transformers_name(),
        );
        for (side, prompt) in [("query", &prompts.query), ("passage", &prompts.passage)] {
            if !prompt.is_empty() {
                settings += &format!("; {side} prompt {prompt:?}");
            }
        }
        if let (Some(name), Some((index, _))) = (&options.task, &task) {
            settings += &format!("; task adapter {name:?} (number {index} of the model's)");
        }
        if !prompts.is_empty() && !prompt_pooled {
            settings += " (left out of the pooling: include_prompt false)";
        }
        let sparse = head.as_ref().and_then(|h| h.sparse);
        if let Some(spec) = sparse {
            settings = format!(
                "sparse (SPLADE): {} pooling of {} over the MLM head's logits, similarity {} \
                 ({similarity_src}); {head_note}",
                spec.strategy.name(),
                spec.activation.name(),
                similarity.sentence_transformers_name(),
            );
        }
        let bert_options = BertOptions {
            lora: adapter.map(|a| a.spec.clone()),
            pooling,
            normalize: normalize && sparse.is_none(),
            dense: dense.iter().map(DenseLayer::spec).collect(),
            sparse,
            ..Default::default()
        };
        let mut store = ParamStore::new(0, DType::F32, &options.device);
        if let Some(adapter) = adapter {
            store = store.with_fallback_weights("", std::sync::Arc::new(adapter.weight_file()?));
        }
        let (encoder, config, store) = load_pretrained(files, "", &bert_options, store)?;
        if let Some(adapter) = adapter {
            adapter.check_covers(encoder.params(), "")?;
        }
        let (inner, tokenizer_config) = load_tokenizer(files, &config)?;
        if sparse.is_some() {
            check_sparse_vocabulary(files, &inner, &config)?;
        }
        let (limit, limit_src) = tokenizer::model_max_length(&files.dir, config.max_tokens())?;
        let max_len = match options.max_len {
            Some(asked) if asked > limit => {
                settings += &format!(
                    "; max_len {asked} capped at the model's limit of {limit} tokens ({limit_src})"
                );
                limit
            }
            Some(asked) => asked,
            None => {
                settings += &format!("; max_len {limit} (the model's, {limit_src})");
                limit
            }
        };
        let tokenizer = Tokenizer::new(inner, max_len)?
            .with_config(tokenizer_config)
            .with_task(task.as_ref().map(|(index, _)| *index));
        Ok(Self {
            encoder,
            dense,
            query_tokenizer: tokenizer
                .clone()
                .with_prompt(&prompts.query)
                .with_prompt_pooled(prompt_pooled),
            passage_tokenizer: tokenizer
                .clone()
                .with_prompt(&prompts.passage)
                .with_prompt_pooled(prompt_pooled),
            // A task's texts are put after its instruction whichever side they are.
            tokenizer: tokenizer.with_prompt(&default_prompt),
            prompts,
            config,
            options: bert_options,
            similarity,
            settings,
            device: options.device.clone(),
            _store: store,
            static_query: None,
            queries_by_default: false,
        })
    }

    /// Embeddings `[texts, width]` in chunks of `passes` (a number of texts, or
    /// [`Chunking::Tokens`]: see [`embed`]), without a prompt (an inference-free model's:
    /// by its default route, the document model unless its router says otherwise).
    pub fn embed(&self, texts: &[&str], passes: impl Into<Chunking>) -> Result<Tensor> {
        let passes = passes.into();
        match &self.static_query {
            Some(q) if self.queries_by_default => {
                let tokenizer = q.tokenizer.clone().with_prompt("");
                embed(&q.encoder, &tokenizer, texts, passes, &self.device)
            }
            _ => embed(&self.encoder, &self.tokenizer, texts, passes, &self.device),
        }
    }

    /// Query embeddings: [`EmbeddingModel::embed`] with the query prompt (an
    /// inference-free model's: its static weights on the query's tokens).
    pub fn embed_queries(&self, texts: &[&str], passes: impl Into<Chunking>) -> Result<Tensor> {
        let passes = passes.into();
        if let Some(q) = &self.static_query {
            return embed(&q.encoder, &q.tokenizer, texts, passes, &self.device);
        }
        embed(
            &self.encoder,
            &self.query_tokenizer,
            texts,
            passes,
            &self.device,
        )
    }

    /// Passage embeddings: [`EmbeddingModel::embed`] with the passage prompt.
    pub fn embed_passages(&self, texts: &[&str], passes: impl Into<Chunking>) -> Result<Tensor> {
        let passes = passes.into();
        embed(
            &self.encoder,
            &self.passage_tokenizer,
            texts,
            passes,
            &self.device,
        )
    }

    /// The query and passage prompts in use.
    pub fn prompts(&self) -> &Prompts {
        &self.prompts
    }

    /// The sentence-transformers `Dense` modules after the pooling, in order.
    pub fn dense(&self) -> &[DenseLayer] {
        &self.dense
    }

    /// The similarity to rank with.
    pub fn similarity(&self) -> Similarity {
        self.similarity
    }

    /// Whether the model is a sparse (SPLADE) one: its vectors are vocabulary-wide.
    pub fn is_sparse(&self) -> bool {
        self.options.sparse.is_some()
    }

    /// The encoder's options (pooling, normalisation, a sparse head, ...).
    pub fn options(&self) -> &BertOptions {
        &self.options
    }

    /// One line saying which pooling, normalisation and similarity are used, and where
    /// each came from (`given`, `from FILE`, `default`).
    pub fn settings(&self) -> &str {
        &self.settings
    }

    /// The model's config.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The tokenizer (with the effective token limit).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The encoder (an inference-free model's document model).
    pub fn encoder(&self) -> &BertEncoder {
        &self.encoder
    }

    /// An inference-free model's static query weights `[vocab]` and whether they are
    /// frozen; `None` for any other model.
    pub fn static_query_weights(&self) -> Option<(Tensor, bool)> {
        let q = self.static_query.as_ref()?;
        let var = crate::encoder::Encoder::params(&q.encoder).get(&static_name())?;
        Some((var.as_tensor().clone(), q.frozen))
    }
}

/// A model's tokenizer as the model expects it ([`tokenizer::read_model_tokenizer`]) and
/// its `tokenizer_config.json`. A decoder's tokenizer must have a pad token (its batches
/// are padded, on the side its files say).
pub fn load_tokenizer(
    files: &ModelFiles,
    config: &BertConfig,
) -> Result<(
    tokenizers::Tokenizer,
    Option<serde_json::Map<String, serde_json::Value>>,
)> {
    let path = files.tokenizer.as_ref().ok_or_else(|| Error::MissingFile {
        path: files.dir.join(files::TOKENIZER),
        what: "tokenizer",
    })?;
    let (inner, tokenizer_config) = tokenizer::read_model_tokenizer(path, &files.dir)?;
    let decoder = config.family(&files.config).is_ok_and(|f| f.is_decoder());
    if decoder && inner.get_padding().is_none() {
        return Err(Error::ModelFile {
            path: files.dir.join(files::TOKENIZER_CONFIG),
            reason: "the tokenizer has no pad token, and a decoder's batches are padded: set \
                     `pad_token` (Qwen3-Embedding uses its `<|endoftext|>`, the Llama family \
                     often its EOS)"
                .into(),
        });
    }
    Ok((inner, tokenizer_config))
}

/// Refuses a sparse model whose tokenizer knows more tokens than the model's vocabulary:
/// a sparse vector has one entry per vocabulary entry of the model, and a token past them
/// would have no embedding and no entry.
pub fn check_sparse_vocabulary(
    files: &ModelFiles,
    tokenizer: &tokenizers::Tokenizer,
    config: &BertConfig,
) -> Result<()> {
    let tokens = tokenizer.get_vocab_size(true);
    if tokens > config.vocab_size {
        return Err(Error::ModelFile {
            path: files
                .tokenizer
                .clone()
                .unwrap_or_else(|| files.dir.join(files::TOKENIZER)),
            reason: format!(
                "the tokenizer has {tokens} tokens but config.json's vocab_size is {}: a \
                 sparse model's vectors have one entry per vocabulary entry, and the tokens \
                 past it have neither an embedding nor an entry (use the model's own \
                 tokenizer)",
                config.vocab_size
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `longest_first` on a pool of `threads`: its results, and the items in the order
    /// they were started.
    fn run_longest_first(threads: usize, items: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let seen = std::sync::Mutex::new(Vec::new());
        let out = pool
            .install(|| {
                longest_first(items, |&i| {
                    seen.lock().unwrap().push(i);
                    Ok(i * 10)
                })
            })
            .unwrap();
        (out, seen.into_inner().unwrap())
    }

    #[test]
    fn longest_first_keeps_the_order_of_the_items() {
        let items: Vec<usize> = (0..37).collect();
        let expected: Vec<usize> = items.iter().map(|i| i * 10).collect();
        // One thread: the last item first, then back to the first.
        let (out, seen) = run_longest_first(1, &items);
        assert_eq!(out, expected);
        assert_eq!(seen, items.iter().rev().copied().collect::<Vec<_>>());
        // Several: each item once, the results in the items' order.
        let (out, mut seen) = run_longest_first(4, &items);
        assert_eq!(out, expected);
        seen.sort_unstable();
        assert_eq!(seen, items);
    }

    #[test]
    fn longest_first_returns_an_items_error() {
        let items: Vec<usize> = (0..8).collect();
        let out = longest_first(&items, |&i| {
            if i == 5 {
                Err(Error::Tokenizer("item 5".into()))
            } else {
                Ok(i)
            }
        });
        assert!(matches!(out, Err(Error::Tokenizer(m)) if m == "item 5"));
    }
}
