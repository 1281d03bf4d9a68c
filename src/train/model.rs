//! The towers of a text-pair run: what the trainer builds from the config and the memory
//! budget's probes measure.

use std::sync::Arc;

use candle_core::{DType, Device};

use crate::dist::{self, Collective};
use crate::hub::multi_vector::MultiVectorConfig;
use crate::hub::multi_vector::MultiVectorHead;
use crate::hub::tokenizer::{model_max_length, read_tokenizer_file, train_wordpiece};
use crate::hub::{HubSettings, ModelFiles, Prompts, SentenceTransformersConfig};
use crate::models::bert::{
    create_dense, with_model_weights, BertConfig, BertEncoder, BertOptions, DenseActivation,
    DenseSpec,
};
use crate::names::pattern_matches;
use crate::params::{Freeze, ParamStore, Params};
use crate::sparse_static::{
    static_weight_name, SparseStaticEmbedding, StaticSparseEncoder, STATIC_PREFIX,
};
use crate::train::config::Config;
use crate::{Error, Result};

/// The run's file that holds the model's Hugging Face config.
pub const MODEL_CONFIG_FILE: &str = "model_config.json";
/// The run's tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The run's Dense modules after the pooling, when its pretrained model has any (their
/// paths and sentence-transformers configs).
pub const DENSE_FILE: &str = "dense_modules.json";

/// The run's copy of the model's `tokenizer_config.json` (padding side, special tokens),
/// its `model_max_length` the model's limit; an export writes it back.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The run's head: the pooling, normalisation and prompts it trains with (from its config
/// and its pretrained model's files), so that an export from the run directory writes
/// them back.
pub const HEAD_FILE: &str = "head.json";

/// The token limit of a fresh model's queries and passages when the config sets none.
pub const FRESH_MAX_LEN: usize = 64;

/// The towers of a run and what was built with them.
pub(super) struct Model {
    pub(super) query: BertEncoder,
    /// The passage tower; `None` when one tower is shared.
    pub(super) passage: Option<BertEncoder>,
    pub(super) bert: BertConfig,
    /// The encoders' options (with the pretrained model's Dense modules).
    pub(super) options: BertOptions,
    pub(super) tokenizer: tokenizers::Tokenizer,
    /// The model's `tokenizer_config.json`, its `model_max_length` the model's limit.
    pub(super) tokenizer_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// The tokenizer's chat template (a decoder reranker reads its pairs through it).
    pub(super) chat: Option<crate::hub::chat::ChatTemplate>,
    /// The token limits of queries and passages: the configured ones, else the model's.
    pub(super) query_max_len: usize,
    pub(super) passage_max_len: usize,
    /// The model's own limit (a fresh model's: its positions), what an export writes.
    pub(super) limit: usize,
    /// The prompts put before queries and passages.
    pub(super) prompts: Prompts,
    /// Whether the prompts' tokens are pooled.
    pub(super) prompt_pooled: bool,
    /// A multi-vector (ColBERT) run's settings.
    pub(super) multi_vector: Option<MultiVectorHead>,
    /// An inference-free sparse run's query side: a weight per vocabulary entry (`query`
    /// is then the document model).
    pub(super) static_query: Option<StaticSparseEncoder>,
    /// The task adapters queries and passages are encoded with (Jina v3's).
    pub(super) tasks: Option<super::tasks::RunTasks>,
    pub(super) store: ParamStore,
}

/// The path of the projection a multi-vector run adds to a model without one.
pub const COLBERT_DENSE: &str = "1_Dense";

/// A multi-vector run's encoder options over `base`: token vectors normalised, the
/// pretrained multi-vector model's projections (`own`), else a projection without bias
/// from the hidden size to `dim` (PyLate's Dense). A `dim` the pretrained projection
/// does not give is refused.
fn multi_vector_options(
    head: &MultiVectorHead,
    own: Option<&MultiVectorConfig>,
    hidden: usize,
    base: BertOptions,
) -> Result<BertOptions> {
    let dense = match own {
        Some(own) if !own.dense.is_empty() => {
            if own.head.dim != head.dim {
                return Err(Error::InvalidConfig {
                    field: "model.multi_vector.dim",
                    value: format!(
                        "{} (the pretrained projection gives {})",
                        head.dim, own.head.dim
                    ),
                    reason: "a pretrained multi-vector model keeps its projection: leave dim unset",
                });
            }
            own.dense.iter().map(|d| d.spec()).collect()
        }
        _ => vec![DenseSpec {
            path: COLBERT_DENSE.into(),
            in_features: hidden,
            out_features: head.dim,
            bias: false,
            activation: DenseActivation::Identity,
        }],
    };
    Ok(BertOptions {
        normalize: true,
        dense,
        ..base
    })
}

/// The prompts of a run (the configured ones, else the pretrained model's `head`) and
/// whether their tokens are pooled (`model.include_prompt`, else the model's pooling
/// config, else true).
pub(super) fn run_prompts(
    cfg: &Config,
    head: Option<&SentenceTransformersConfig>,
) -> Result<(Prompts, bool)> {
    let own = head.map(|h| h.prompts.clone()).unwrap_or_default();
    // A mixture's sources' instructions, by the sources' names (their passage prompts as
    // `<name>_passage`).
    let mut named = std::collections::BTreeMap::new();
    for s in &cfg.data.sources {
        if let Some(q) = &s.query_prompt {
            named.insert(s.name.clone(), q.clone());
        }
        if let Some(p) = &s.passage_prompt {
            named.insert(format!("{}_passage", s.name), p.clone());
        }
    }
    let prompts = Prompts {
        query: cfg.model.query_prompt.clone().unwrap_or(own.query),
        passage: cfg.model.passage_prompt.clone().unwrap_or(own.passage),
        named,
    };
    let pooled = cfg
        .model
        .include_prompt
        .unwrap_or_else(|| head.is_none_or(|h| h.include_prompt));
    Ok((prompts, pooled))
}

/// The encoder options a configuration asks for, on a pretrained model whose
/// sentence-transformers files say `head` (the pooling and normalisation it sets none of):
/// its Dense modules train with it.
pub(super) fn bert_options(
    cfg: &Config,
    head: Option<&SentenceTransformersConfig>,
) -> Result<BertOptions> {
    Ok(BertOptions {
        pooling: cfg
            .model
            .pooling
            .or(head.map(|h| h.pooling))
            .unwrap_or(crate::models::bert::Pooling::Mean),
        normalize: cfg
            .model
            .normalize
            .or(head.map(|h| h.normalize))
            .unwrap_or(true),
        recompute: cfg.model.recompute.clone(),
        precision: cfg.precision,
        dense: head
            .map(|h| h.dense.iter().map(|d| d.spec()).collect())
            .unwrap_or_default(),
        lora: cfg
            .model
            .lora
            .as_ref()
            .map(|l| l.spec().map(|(spec, _)| spec))
            .transpose()?,
        multi_vector: cfg.model.multi_vector.is_some(),
        sparse: match (&cfg.model.sparse, head.and_then(|h| h.sparse)) {
            (Some(settings), own) => Some(settings.resolve(own)?),
            (None, Some(_)) => {
                return Err(crate::Error::InvalidConfig {
                    field: "model.sparse",
                    value: "unset".into(),
                    reason: "the pretrained model is a sparse (SPLADE) SparseEncoder: set \
                             [model.sparse] (its own pooling fills what the section leaves \
                             unset) to train it as one",
                })
            }
            (None, None) => None,
        },
        classifier: cfg
            .model
            .reranker
            .as_ref()
            .map(|_| crate::models::bert::ClassifierSpec::labels(1)),
    })
}

/// The towers and tokenizer of a run, fresh or pretrained, checked against the
/// configured token limits. Writes nothing.
pub(super) fn build_model(
    cfg: &Config,
    texts: &[String],
    comm: &dyn Collective,
    device: &Device,
) -> Result<Model> {
    let store = ParamStore::new(cfg.seed, DType::F32, device).with_frozen(freeze(cfg)?);
    let model = if cfg.model.pretrained.is_empty() {
        let tokenizer = dist::from_root(comm, "the tokenizer", || fresh_tokenizer(cfg, texts))?;
        dist::agree(comm, fresh_model(cfg, tokenizer, store))
    } else {
        dist::agree(comm, pretrained_model(cfg, store))
    }?;
    check_freeze_and_targets(cfg, &model.store)?;
    let mut model = model;
    // A task's instruction is its side's prompt unless the run sets one.
    if let Some(tasks) = super::tasks::run_tasks(cfg)? {
        if cfg.model.query_prompt.is_none() && tasks.query.is_some() {
            model.prompts.query = tasks.instruction(tasks.query).to_string();
        }
        if cfg.model.passage_prompt.is_none() && tasks.passage.is_some() {
            model.prompts.passage = tasks.instruction(tasks.passage).to_string();
        }
        model.tasks = Some(tasks);
    }
    Ok(model)
}

/// What a run freezes: `model.freeze`, with LoRA everything but the adapters (the
/// adapted projections' base weights stored in `model.base_dtype`), and an inference-free
/// run's static query weights when they are frozen.
pub(super) fn freeze(cfg: &Config) -> Result<Freeze> {
    let mut patterns = cfg.model.freeze.clone();
    if query_weights_frozen(cfg)? {
        patterns.push(static_weight_name());
    }
    // Task adapters: those of the tasks in use train, and nothing else when one is.
    let mut trains_adapters_alone = false;
    if let Some(tasks) = super::tasks::run_tasks(cfg)? {
        let (unused, alone) = super::tasks::frozen(&tasks);
        patterns.extend(unused);
        trains_adapters_alone = alone;
    }
    let freeze = Freeze::patterns(&patterns);
    Ok(match &cfg.model.lora {
        Some(lora) => freeze
            .all_but_adapters()
            .narrowing(cfg.model.base_dtype.dtype(), &lora.spec()?.0.targets),
        None if trains_adapters_alone => freeze.all_but_adapters(),
        None => freeze,
    })
}

/// Whether an inference-free run's static query weights are frozen:
/// `model.sparse.freeze_query_weights`, else the pretrained `Router` model's `frozen`.
pub(super) fn query_weights_frozen(cfg: &Config) -> Result<bool> {
    let Some(sparse) = &cfg.model.sparse else {
        return Ok(false);
    };
    if let Some(frozen) = sparse.freeze_query_weights {
        return Ok(frozen);
    }
    if cfg.model.pretrained.is_empty() || sparse.inference_free == Some(false) {
        return Ok(false);
    }
    let files = ModelFiles::resolve(&cfg.model.pretrained, &HubSettings::from_env())?;
    Ok(files.router.is_some_and(|(_, layout)| layout.frozen))
}

/// The static query weights an inference-free run starts from: the pretrained `Router`
/// model's (`files.router`), else ones (sentence-transformers' fresh
/// `SparseStaticEmbedding`).
pub(super) fn initial_query_weights(
    files: Option<&ModelFiles>,
    tokenizer: &tokenizers::Tokenizer,
    vocab: usize,
) -> Result<Option<candle_core::Tensor>> {
    let Some((root, layout)) = files.and_then(|f| f.router.as_ref()) else {
        return Ok(None);
    };
    let tokenizer = crate::hub::Tokenizer::new(tokenizer.clone(), 2)?;
    crate::hub::router::read_static_weights(&root.join(&layout.query), &tokenizer, vocab).map(Some)
}

/// Creates an inference-free run's static query weights in `store` (before the
/// pretrained model's file backs it), set to `initial` when given.
fn static_query(
    store: &ParamStore,
    vocab: usize,
    initial: Option<candle_core::Tensor>,
) -> Result<StaticSparseEncoder> {
    let tower = SparseStaticEmbedding::tower(store, STATIC_PREFIX, vocab)?;
    if let Some(w) = initial {
        let var = store
            .get(&static_weight_name())
            .ok_or_else(|| Error::DuplicateParameter {
                name: static_weight_name(),
            })?;
        var.set(&w.to_dtype(store.dtype())?.to_device(store.device())?)?;
    }
    Ok(tower)
}

/// Whether the run is inference-free (see [`crate::train::config::Config`]'s
/// `model.sparse.inference_free`) on a pretrained model that is one when `own`.
fn inference_free(cfg: &Config, own: bool) -> Result<bool> {
    match &cfg.model.sparse {
        Some(s) => s.resolve_inference_free(own),
        None => Ok(false),
    }
}

/// Every `model.freeze` pattern and every LoRA target names something in the model.
fn check_freeze_and_targets(cfg: &Config, store: &ParamStore) -> Result<()> {
    let names: Vec<String> = store.params().names().map(String::from).collect();
    let sample = || {
        let mut some: Vec<&str> = names
            .iter()
            .filter(|n| !crate::nn::lora::is_adapter(n))
            .map(String::as_str)
            .take(4)
            .collect();
        some.push("...");
        some.join(", ")
    };
    for pattern in &cfg.model.freeze {
        if !names.iter().any(|n| pattern_matches(pattern, n)) {
            return Err(Error::InvalidConfig {
                field: "model.freeze",
                value: format!("{pattern:?} (the model's parameters: {})", sample()),
                reason: "matches no parameter of the model",
            });
        }
    }
    if let Some(lora) = &cfg.model.lora {
        let modules: Vec<&str> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .collect();
        let (spec, _) = lora.spec()?;
        for target in lora.targets.iter().flatten() {
            let spec = crate::nn::lora::LoraSpec {
                targets: vec![target.clone()],
                ..spec.clone()
            };
            if !modules.iter().any(|m| spec.targets_module(m)) {
                return Err(Error::InvalidConfig {
                    field: "model.lora.targets",
                    value: format!(
                        "{target:?} (the projections LoRA can adapt are the attention and \
                         feed-forward ones, e.g. {})",
                        sample()
                    ),
                    reason: "matches no projection of the model",
                });
            }
        }
    }
    Ok(())
}

/// The token limits of a run on a pretrained model whose limit is `limit` (from
/// `source`): the configured ones, refused above it, else the limit itself.
pub(super) fn max_lens(cfg: &Config, (limit, source): (usize, &str)) -> Result<(usize, usize)> {
    let mut out = [0; 2];
    for (o, (field, len)) in out.iter_mut().zip([
        ("model.query_max_len", cfg.model.query_max_len),
        ("model.passage_max_len", cfg.model.passage_max_len),
    ]) {
        *o = match len {
            Some(len) if len > limit => {
                return Err(Error::InvalidConfig {
                    field,
                    value: format!("{len} (the model's limit is {limit} tokens: {source})"),
                    reason: "exceeds the longest input the model takes; leave it unset to use \
                             the model's limit",
                })
            }
            Some(len) => len,
            None => limit,
        };
    }
    Ok((out[0], out[1]))
}

/// The model's limit as [`model_max_length`] reads it from `dir`, with a run directory's
/// copy of the tokenizer config (`model_max_length`) standing in for a model's files.
pub(super) fn model_limit(dir: &std::path::Path, bert: &BertConfig) -> Result<(usize, String)> {
    model_max_length(dir, bert.max_tokens())
}

/// The tokenizer of a fresh model: the one in `output_dir` (a resumed run or a rerun), or
/// one trained on the training texts.
fn fresh_tokenizer(cfg: &Config, texts: &[String]) -> Result<tokenizers::Tokenizer> {
    let path = cfg.output_dir.join(TOKENIZER_FILE);
    if path.is_file() {
        return read_tokenizer_file(&path);
    }
    let f = &cfg.model.fresh;
    let mut tokenizer =
        train_wordpiece(texts.iter().map(String::as_str), f.vocab_size, f.lowercase)?;
    // A multi-vector run's prefixes become tokens of the vocabulary, as PyLate adds them.
    if let Some(mv) = &cfg.model.multi_vector {
        let head = mv.resolve(None);
        let prefixes: Vec<tokenizers::AddedToken> = [head.query_prefix, head.document_prefix]
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| tokenizers::AddedToken::from(p, false).normalized(false))
            .collect();
        tokenizer
            .add_tokens(prefixes)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
    }
    Ok(tokenizer)
}

/// A BERT of the configured size with fresh weights. Two towers start from one
/// initialisation, copied into both (as DPR starts both from one checkpoint), and then
/// train apart: two towers drawn independently share nothing to align.
fn fresh_model(cfg: &Config, tokenizer: tokenizers::Tokenizer, store: ParamStore) -> Result<Model> {
    let f = &cfg.model.fresh;
    let multi_vector = cfg.model.multi_vector.as_ref().map(|m| m.resolve(None));
    let (query_max_len, passage_max_len) = match &multi_vector {
        Some(head) => (head.query_length, head.document_length),
        None => (
            cfg.model.query_max_len.unwrap_or(FRESH_MAX_LEN),
            cfg.model.passage_max_len.unwrap_or(FRESH_MAX_LEN),
        ),
    };
    let bert = BertConfig {
        hidden_dropout_prob: f.dropout_prob,
        attention_probs_dropout_prob: f.dropout_prob,
        ..BertConfig::new(
            tokenizer.get_vocab_size(true),
            f.hidden_size,
            f.num_layers,
            f.num_heads,
            f.intermediate_size,
            query_max_len.max(passage_max_len),
        )
    };
    let options = match &multi_vector {
        Some(head) => multi_vector_options(head, None, f.hidden_size, bert_options(cfg, None)?)?,
        None => bert_options(cfg, None)?,
    };
    let prompts = run_prompts(cfg, None)?;
    let free = inference_free(cfg, false)?;
    let static_query = match free {
        true => Some(static_query(&store, bert.vocab_size, None)?),
        false => None,
    };
    let (query, passage) = if cfg.model.shared {
        (BertEncoder::build(&store, "", &bert, &options)?, None)
    } else {
        let query = BertEncoder::build(&store, "query", &bert, &options)?;
        let passage = BertEncoder::build(&store, "passage", &bert, &options)?;
        copy_tower(&query.weights()?, "query.", &passage.weights()?, "passage.")?;
        (query, Some(passage))
    };
    Ok(Model {
        query,
        passage,
        bert,
        options,
        tokenizer,
        tokenizer_config: None,
        chat: None,
        query_max_len,
        passage_max_len,
        limit: query_max_len.max(passage_max_len),
        prompts: prompts.0,
        prompt_pooled: prompts.1,
        multi_vector,
        static_query,
        tasks: None,
        store,
    })
}

/// Sets every parameter `to_prefix + name` of `to` to the value of `from_prefix + name` in
/// `from`.
fn copy_tower(from: &Params, from_prefix: &str, to: &Params, to_prefix: &str) -> Result<()> {
    for (name, var) in to.iter() {
        let rest = name.strip_prefix(to_prefix).unwrap_or(name);
        let source =
            from.get(&format!("{from_prefix}{rest}"))
                .ok_or_else(|| Error::DuplicateParameter {
                    name: name.to_string(),
                })?;
        var.set(&source.as_tensor().copy()?)?;
    }
    Ok(())
}

/// A pretrained model from a directory or the Hub; two towers both load its weights.
fn pretrained_model(cfg: &Config, store: ParamStore) -> Result<Model> {
    let files = ModelFiles::resolve(&cfg.model.pretrained, &HubSettings::from_env())?;
    let bert = BertConfig::from_file(&files.config)?;
    let (tokenizer, tokenizer_config) = crate::hub::load_tokenizer(&files, &bert)?;
    let mut chat = crate::hub::chat::ChatTemplate::read(&files.dir, tokenizer_config.as_ref())?;
    if cfg.model.sparse.is_some() {
        crate::hub::check_sparse_vocabulary(&files, &tokenizer, &bert)?;
    }
    let (limit, source) = model_limit(&files.dir, &bert)?;
    let own = MultiVectorConfig::read_if_any(&files.dir)?;
    let multi_vector = match (&cfg.model.multi_vector, &own) {
        (Some(mv), own) => Some(mv.resolve(own.as_ref())),
        (None, Some(_)) => {
            return Err(Error::InvalidConfig {
                field: "model.pretrained",
                value: cfg.model.pretrained.clone(),
                reason: "is a multi-vector (ColBERT) model: train it with [model.multi_vector] \
                         (its settings are the model's own when left unset)",
            })
        }
        (None, None) => None,
    };
    let (query_max_len, passage_max_len) = match &multi_vector {
        Some(head) => {
            for (field, len) in [
                ("model.multi_vector.query_length", head.query_length),
                ("model.multi_vector.document_length", head.document_length),
            ] {
                if len > limit {
                    return Err(Error::InvalidConfig {
                        field,
                        value: format!("{len} (the model's limit is {limit} tokens: {source})"),
                        reason: "exceeds the longest input the model takes",
                    });
                }
            }
            (head.query_length, head.document_length)
        }
        None => max_lens(cfg, (limit, &source))?,
    };
    // The run's copy of the tokenizer config records the model's limit, wherever it came
    // from, so an export from the run directory knows it.
    let mut tokenizer_config = tokenizer_config.unwrap_or_default();
    tokenizer_config.insert("model_max_length".into(), limit.into());
    let tokenizer_config = Some(tokenizer_config);
    // A multi-vector run reads no single-vector head: its projection is the
    // multi-vector model's own, else a new one.
    let head = match multi_vector {
        Some(_) => None,
        None => files.head()?,
    };
    let free = inference_free(cfg, files.router.is_some())?;
    let mut options = bert_options(cfg, head.as_ref())?;
    // A causal LM reranks by its LM head's yes/no logits (Qwen3-Reranker's layout).
    if let Some(spec) = options.classifier.as_mut() {
        let own = crate::rerank::read_cross_encoder_files(&files.dir)?;
        spec.kind = crate::rerank::head_kind(&files, &own, &tokenizer)?;
    }
    let options = match &multi_vector {
        Some(mv) => multi_vector_options(mv, own.as_ref(), bert.hidden_size, options)?,
        None => options,
    };
    // Weights come from the model's files: the transformer's and its own projections'
    // (a projection a multi-vector run adds starts from the seed).
    let from_files = BertOptions {
        dense: match &own {
            Some(own) => own.dense.iter().map(|d| d.spec()).collect(),
            None if multi_vector.is_some() => Vec::new(),
            None => options.dense.clone(),
        },
        ..options.clone()
    };
    let new_head = cfg.model.sparse.as_ref().is_some_and(|s| s.new_head);
    if options.sparse.is_some() && !new_head {
        crate::models::bert::check_mlm_head(&files, &bert)?;
    }
    let new_classifier = cfg.model.reranker.as_ref().is_some_and(|r| r.new_head);
    if let Some(spec) = options.classifier.filter(|_| !new_classifier) {
        crate::models::bert::check_classifier(&files, &bert, spec.kind)?;
    }
    let load = |prefix: &str, store: ParamStore| -> Result<(BertEncoder, BertConfig, ParamStore)> {
        if multi_vector.is_some() && from_files.dense.is_empty() {
            create_dense(&store, prefix, &options.dense)?;
        }
        if let (Some(spec), true) = (options.sparse, new_head) {
            crate::models::bert::create_mlm_head(&store, prefix, &bert, spec)?;
        }
        if let (Some(spec), true) = (options.classifier, new_classifier) {
            crate::models::bert::create_classifier(&store, prefix, &bert, spec)?;
        }
        let store = with_model_weights(&files, prefix, &from_files, store, false)?;
        let encoder = BertEncoder::build(&store, prefix, &bert, &options)?;
        Ok((encoder, bert.clone(), store))
    };
    // An adapter to continue: its weights under every tower, checked to fit.
    let adapter = match &cfg.model.lora {
        Some(lora) => lora.spec()?.1,
        None => None,
    };
    let prefixes: &[&str] = if cfg.model.shared {
        &[""]
    } else {
        &["query", "passage"]
    };
    let mut store = store;
    if let Some(adapter) = &adapter {
        for prefix in prefixes {
            store = store.with_fallback_weights(prefix, Arc::new(adapter.weight_file()?));
        }
    }
    let covered = |encoder: &BertEncoder, prefix: &str| match &adapter {
        Some(adapter) => adapter.check_covers(crate::Encoder::params(encoder), prefix),
        None => Ok(()),
    };
    let (prompts, prompt_pooled) = run_prompts(cfg, head.as_ref())?;
    if cfg.model.shared {
        // The static query weights before the model's file backs the store.
        let queries = match free {
            true => {
                let initial = initial_query_weights(Some(&files), &tokenizer, bert.vocab_size)?;
                Some(static_query(&store, bert.vocab_size, initial)?)
            }
            false => None,
        };
        let (query, bert, store) = load("", store)?;
        covered(&query, "")?;
        Ok(Model {
            query,
            passage: None,
            bert,
            options: options.clone(),
            tokenizer,
            tokenizer_config,
            chat: chat.take(),
            query_max_len,
            passage_max_len,
            limit,
            prompts: prompts.clone(),
            prompt_pooled,
            multi_vector: multi_vector.clone(),
            static_query: queries,
            tasks: None,
            store,
        })
    } else {
        let (query, bert, store) = load("query", store)?;
        let (passage, _, store) = load("passage", store)?;
        covered(&query, "query")?;
        covered(&passage, "passage")?;
        Ok(Model {
            query,
            passage: Some(passage),
            bert,
            options: options.clone(),
            tokenizer,
            tokenizer_config,
            chat: chat.take(),
            query_max_len,
            passage_max_len,
            limit,
            prompts: prompts.clone(),
            prompt_pooled,
            multi_vector: multi_vector.clone(),
            static_query: None,
            tasks: None,
            store,
        })
    }
}

/// A pretrained model's tokenizer as the model expects it, and its tokenizer config.
pub(super) fn read_model_tokenizer(
    files: &ModelFiles,
) -> Result<(
    tokenizers::Tokenizer,
    Option<serde_json::Map<String, serde_json::Value>>,
)> {
    let bert = BertConfig::from_file(&files.config)?;
    crate::hub::load_tokenizer(files, &bert)
}
