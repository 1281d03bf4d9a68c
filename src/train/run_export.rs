//! A run directory's own files and the export from them: what the trainer writes beside
//! its checkpoints (the tokenizer, the model config, the head, the Dense modules) so that
//! the directory alone resumes or exports, and [`export_run`] / [`export_run_as`], which
//! read a checkpoint and those files and write a Hugging Face + sentence-transformers
//! directory (or a PEFT adapter).

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};

use super::model::{
    DENSE_FILE, HEAD_FILE, MODEL_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
use crate::durable;
use crate::hub::export::ExportNotes;
use crate::hub::multi_vector::MultiVectorConfig;
use crate::hub::tokenizer::read_tokenizer_file;
use crate::hub::{export_bert, HubSettings, ModelFiles, Prompts, Tokenizer};
use crate::models::bert::{with_model_weights, BertConfig, BertEncoder, DenseSpec};
use crate::params::{ParamStore, WeightFile};
use crate::train::checkpoint;
use crate::train::config::Config;
use crate::train::model::{
    bert_options, freeze, max_lens, model_limit, read_model_tokenizer, run_prompts,
};
use crate::train::run::check_fingerprint;
use crate::{Error, Result, Side};

/// What may change between a text-pair run and its resume (see [`Config::fingerprint`]).
pub(super) const MAY_CHANGE: &str =
    "output_dir, train.eval_every, checkpoint_every, keep_checkpoints, \
     on_nonfinite, data.stream, device and the dist section";

/// Writes `tokenizer.json` (unless the same one is there), `model_config.json`, the
/// pretrained model's `tokenizer_config.json` and, for a model with Dense modules,
/// `dense_modules.json` into `dir`, creating it.
pub(super) fn write_run_files(
    dir: &Path,
    (tokenizer, tokenizer_config): (
        &tokenizers::Tokenizer,
        Option<&serde_json::Map<String, serde_json::Value>>,
    ),
    (bert, head): (&BertConfig, &RunHead),
    dense: &[DenseSpec],
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let path = dir.join(TOKENIZER_FILE);
    let json = tokenizer
        .to_string(false)
        .map_err(|e| Error::io("write", &path, e))?;
    if std::fs::read_to_string(&path).ok().as_deref() != Some(json.as_str()) {
        durable::write(&path, &json)?;
    }
    if !dense.is_empty() {
        let modules: Vec<serde_json::Value> = dense
            .iter()
            .map(|d| serde_json::json!({"path": d.path, "config": d.config()}))
            .collect();
        durable::write_json(&dir.join(DENSE_FILE), &modules)?;
    }
    if let Some(config) = tokenizer_config {
        durable::write_json(&dir.join(TOKENIZER_CONFIG_FILE), config)?;
    }
    durable::write_json(&dir.join(HEAD_FILE), head)?;
    durable::write_json(&dir.join(MODEL_CONFIG_FILE), &bert.to_json())
}

/// The head a run trains with, as resolved from its config and its pretrained model's
/// files (`head.json` in the run directory): what an export from the run directory alone
/// writes back.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct RunHead {
    pub(super) pooling: crate::models::bert::Pooling,
    pub(super) normalize: bool,
    pub(super) prompts: Prompts,
    pub(super) include_prompt: bool,
}

/// The run's head (`head.json`; `None` for a run written before it was recorded).
fn read_run_head(dir: &Path) -> Result<Option<RunHead>> {
    let path = dir.join(HEAD_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read", &path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::ModelFile {
            path,
            reason: e.to_string(),
        })
}

/// The run's Dense modules (`dense_modules.json` in the run directory; none without it).
fn read_dense_modules(dir: &Path) -> Result<Vec<DenseSpec>> {
    let path = dir.join(DENSE_FILE);
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
    let bad = |reason: String| Error::ModelFile {
        path: path.clone(),
        reason,
    };
    let modules: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a list of modules: {e}")))?;
    modules
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m["path"]
                .as_str()
                .and_then(|p| DenseSpec::from_config(p, &m["config"]))
                .ok_or_else(|| {
                    bad(format!(
                        "module {i} is not a Dense module's path and config"
                    ))
                })
        })
        .collect()
}

/// Exports tower `side` of a finished run as a Hugging Face + sentence-transformers
/// directory `output`, from the checkpoint `checkpoint` (default: the newest under
/// `<output_dir>/checkpoints`). Read-only on the run: it reads the checkpoint's weights
/// and state, the run's `model_config.json` and `tokenizer.json` (for a run from a
/// pretrained model that has none, the model's own files), and no training data; it
/// writes only `output`. Returns the checkpoint it read: its step is `state.step`, and
/// `skipped` names newer checkpoints passed over because they are damaged.
pub fn export_run(
    cfg: &Config,
    checkpoint: Option<&Path>,
    output: &Path,
    side: Side,
) -> Result<checkpoint::Resolved> {
    export_run_as(cfg, checkpoint, output, side, ExportLayout::Merged)
}

/// What an export of a LoRA run writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportLayout {
    /// The whole model, adapters merged into their projections (any run).
    Merged,
    /// The adapters alone in PEFT's layout (`adapter_config.json`,
    /// `adapter_model.safetensors`) over the run's pretrained model, with the
    /// sentence-transformers files beside them.
    Adapter,
    /// A model with task adapters (Jina v3's) with this task's merged into the base: a
    /// plain model of its family, the task's instruction as its prompts.
    Task(String),
}

/// [`export_run`] writing `layout`.
pub fn export_run_as(
    cfg: &Config,
    checkpoint: Option<&Path>,
    output: &Path,
    side: Side,
    layout: ExportLayout,
) -> Result<checkpoint::Resolved> {
    cfg.validate()?;
    let adapter_of = match layout {
        ExportLayout::Merged => None,
        ExportLayout::Adapter if cfg.model.lora.is_none() => {
            return Err(Error::InvalidArgument {
                what: "--adapter",
                value: output.display().to_string(),
                reason: "the run trains no LoRA adapters ([model.lora]): export the whole \
                         model without --adapter",
            })
        }
        ExportLayout::Adapter if cfg.model.pretrained.is_empty() => {
            return Err(Error::InvalidArgument {
                what: "--adapter",
                value: output.display().to_string(),
                reason: "the run's model is fresh (model.pretrained is empty): an adapter \
                         needs a base model to load onto; export the merged model without \
                         --adapter",
            })
        }
        ExportLayout::Adapter => Some(cfg.model.pretrained.clone()),
        ExportLayout::Task(_) => None,
    };
    let root = cfg.output_dir.join("checkpoints");
    let found = checkpoint::resolve(checkpoint.unwrap_or(&root))?;
    let (dir, state) = (&found.dir, &found.state);
    check_fingerprint(&cfg.fingerprint()?, MAY_CHANGE, dir, state)?;

    let run_config = cfg.output_dir.join(MODEL_CONFIG_FILE);
    let run_tokenizer = cfg.output_dir.join(TOKENIZER_FILE);
    let pretrained =
        if cfg.model.pretrained.is_empty() || (run_config.is_file() && run_tokenizer.is_file()) {
            None
        } else {
            Some(ModelFiles::resolve(
                &cfg.model.pretrained,
                &HubSettings::from_env(),
            )?)
        };
    let bert = match &pretrained {
        None => BertConfig::from_file(&run_config)?,
        Some(files) => BertConfig::from_file(&files.config)?,
    };
    let run_tokenizer_config = cfg.output_dir.join(TOKENIZER_CONFIG_FILE);
    let (tokenizer, tokenizer_config) = match &pretrained {
        None => {
            let config = match std::fs::read_to_string(&run_tokenizer_config) {
                Ok(text) => Some(serde_json::from_str(&text).map_err(|e| Error::ModelFile {
                    path: run_tokenizer_config.clone(),
                    reason: e.to_string(),
                })?),
                Err(_) => None,
            };
            (read_tokenizer_file(&run_tokenizer)?, config)
        }
        Some(files) => read_model_tokenizer(files)?,
    };
    // The model's own limit (what the run's model takes; a fresh model's positions): the
    // export's, whatever each side trained at.
    let limit = if cfg.model.pretrained.is_empty() {
        bert.max_tokens()
    } else {
        let dir = match &pretrained {
            Some(files) => files.dir.clone(),
            None => cfg.output_dir.clone(),
        };
        let (limit, source) = model_limit(&dir, &bert)?;
        max_lens(cfg, (limit, &source))?;
        limit
    };
    let tokenizer = Tokenizer::new(tokenizer, limit)?.with_config(tokenizer_config);

    let prefix = match (cfg.model.shared, side) {
        (true, _) => "",
        (false, Side::Query) => "query",
        (false, Side::Passage) => "passage",
    };
    let file_prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}.")
    };
    let weights = WeightFile::open(&checkpoint::model_file(dir), &file_prefix)?;
    let mut store =
        ParamStore::new(cfg.seed, DType::F32, &Device::Cpu).with_weights(prefix, Arc::new(weights));
    // A multi-vector run: its settings over the pretrained multi-vector model's own (the
    // run's projections are recorded in its Dense file).
    let multi_vector = match &cfg.model.multi_vector {
        Some(mv) => {
            let own = match pretrained_files(cfg, pretrained.as_ref())? {
                Some(f) => MultiVectorConfig::read_if_any(&f.dir)?,
                None => None,
            };
            Some(mv.resolve(own.as_ref()))
        }
        None => None,
    };
    let head = match &pretrained {
        Some(files) if multi_vector.is_none() => files.head()?,
        _ => None,
    };
    let mut options = bert_options(cfg, head.as_ref())?;
    let recorded = read_dense_modules(&cfg.output_dir)?;
    if !recorded.is_empty() {
        options.dense = recorded;
    }
    let (mut prompts, mut prompt_pooled) = run_prompts(cfg, head.as_ref())?;
    if let Some(recorded) = read_run_head(&cfg.output_dir)? {
        options.pooling = recorded.pooling;
        options.normalize = recorded.normalize;
        prompts = recorded.prompts;
        prompt_pooled = recorded.include_prompt;
    }
    let static_query = static_query_of(cfg, &store, pretrained.as_ref(), &bert)?;
    // A checkpoint holds the trained weights; the frozen ones are the pretrained model's.
    if !freeze(cfg)?.is_empty() && !cfg.model.pretrained.is_empty() {
        let files = match pretrained {
            Some(files) => files,
            None => ModelFiles::resolve(&cfg.model.pretrained, &HubSettings::from_env())?,
        };
        store = with_model_weights(&files, prefix, &options, store, true)?;
    }
    let encoder = BertEncoder::build(&store, prefix, &bert, &options)?;
    // One task merged: its instruction is the prompt of either side.
    let merge_task = match &layout {
        ExportLayout::Task(name) => {
            let tasks = bert
                .task_adapters(Path::new("config.json"))?
                .ok_or_else(|| Error::InvalidArgument {
                    what: "--task",
                    value: name.clone(),
                    reason: "the run's model has no task adapters (only Jina v3's release \
                             carries them)",
                })?;
            let t = tasks.index(name, "--task")?;
            let instruction = tasks.instructions[t].clone();
            prompts.query = instruction.clone();
            prompts.passage = instruction;
            Some(t)
        }
        _ => None,
    };
    export_bert(
        output,
        &bert,
        &options,
        cfg.similarity(),
        &encoder.weights()?,
        prefix,
        &tokenizer,
        &ExportNotes {
            prompts,
            matryoshka_dims: cfg.loss.matryoshka_dims.clone(),
            prompt_left_out: !prompt_pooled,
            adapter_of,
            multi_vector,
            static_query,
            merge_task,
        },
    )?;
    Ok(found)
}

/// The run's pretrained model's files: `pretrained` when already resolved, else resolved
/// now; `None` for a fresh model.
fn pretrained_files(cfg: &Config, pretrained: Option<&ModelFiles>) -> Result<Option<ModelFiles>> {
    match pretrained {
        Some(files) => Ok(Some(files.clone())),
        None if cfg.model.pretrained.is_empty() => Ok(None),
        None => ModelFiles::resolve(&cfg.model.pretrained, &HubSettings::from_env()).map(Some),
    }
}

/// An inference-free run's static query weights, for its export: the checkpoint's (in
/// `store`), or, frozen, those it started from (the pretrained `Router` model's, else
/// ones); and whether they are frozen. `None` for any other run.
fn static_query_of(
    cfg: &Config,
    store: &ParamStore,
    pretrained: Option<&ModelFiles>,
    bert: &BertConfig,
) -> Result<Option<(candle_core::Tensor, bool)>> {
    let Some(sparse) = &cfg.model.sparse else {
        return Ok(None);
    };
    let files = pretrained_files(cfg, pretrained)?;
    let own = files.as_ref().is_some_and(|f| f.router.is_some());
    if !sparse.resolve_inference_free(own)? {
        return Ok(None);
    }
    let name = crate::sparse_static::static_weight_name();
    let weight = if store.reads_from_file(&name) {
        let tower = crate::sparse_static::SparseStaticEmbedding::tower(
            store,
            crate::sparse_static::STATIC_PREFIX,
            bert.vocab_size,
        )?;
        let params = crate::encoder::Encoder::params(&tower);
        params
            .get(&name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| Error::DuplicateParameter { name: name.clone() })?
    } else {
        let tokenizer = match &files {
            Some(f) => read_model_tokenizer(f)?.0,
            None => read_tokenizer_file(&cfg.output_dir.join(TOKENIZER_FILE))?,
        };
        match super::model::initial_query_weights(files.as_ref(), &tokenizer, bert.vocab_size)? {
            Some(w) => w,
            None => candle_core::Tensor::ones(bert.vocab_size, DType::F32, &Device::Cpu)?,
        }
    };
    Ok(Some((weight, super::model::query_weights_frozen(cfg)?)))
}
