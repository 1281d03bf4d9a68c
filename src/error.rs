//! The library's one error type.
//!
//! Every fallible function in `gradcache` returns [`Result`]. Messages name the offending
//! value so that a user can fix the input without reading the source.

use std::fmt;
use std::path::PathBuf;

/// Which side of a contrastive pair a tower, batch or chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// The query side (anchors).
    Query,
    /// The passage side (positives and hard negatives).
    Passage,
}

impl Side {
    /// Stable numeric id, used in dropout seeds: queries are tower 0, passages tower 1.
    pub fn index(self) -> u32 {
        match self {
            Side::Query => 0,
            Side::Passage => 1,
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Query => "query",
            Side::Passage => "passage",
        })
    }
}

/// Errors raised by `gradcache`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A chunk size of zero was configured.
    #[error("chunk size of the {side} tower must be at least 1, got 0")]
    ZeroChunkSize { side: Side },

    /// Chunks by tokens were asked of an input that has no tokens.
    #[error(
        "chunks by tokens (train.chunk_tokens) need tokenized text, but the {side} tower's \
         input has no tokens: set a chunk size in rows instead"
    )]
    TokensToCount { side: Side },

    /// A batch with no rows was passed to a step.
    #[error("empty batch: the {side} batch has no rows")]
    EmptyBatch { side: Side },

    /// The passage count is not a whole multiple of the query count.
    #[error(
        "passages ({passages}) must be a multiple of queries ({queries}): each query needs one \
         positive and the same number k of hard negatives, so passages = queries * (k+1)"
    )]
    PassagesNotMultiple { queries: usize, passages: usize },

    /// The two towers produce representations of different widths.
    #[error(
        "towers return representations of different widths: queries have {query} columns, \
         passages have {passage}"
    )]
    WidthMismatch { query: usize, passage: usize },

    /// The loss is NaN or infinite; detected before any gradient is returned.
    #[error("non-finite loss ({value}); no gradient was computed or returned")]
    NonFiniteLoss { value: f32 },

    /// A training step produced a NaN or infinite loss or gradient norm, and
    /// `train.on_nonfinite = "stop"`: the step changed no weight.
    #[error(
        "step {step}: {what}; no weight was changed. The batch held {batch}. Set \
         train.on_nonfinite = \"skip\" to skip such steps, lower optim.lr, or resume from the \
         last checkpoint"
    )]
    NonFiniteStep {
        step: u64,
        what: String,
        batch: String,
    },

    /// A stop was asked for (SIGINT, SIGTERM) before the step reached the optimizer: the
    /// step was abandoned and changed nothing.
    #[error("{} arrived before the step reached the optimizer; the step was abandoned", crate::stop::signal_name(*signal))]
    Interrupted { signal: i32 },

    /// A training run stopped on a signal after writing a checkpoint of its last finished
    /// step (none when it stopped before its first step).
    #[error("training stopped by {} {}", crate::stop::signal_name(*signal), stopped_at(*step, checkpoint.as_deref()))]
    Stopped {
        signal: i32,
        step: u64,
        checkpoint: Option<PathBuf>,
    },

    /// Another run holds the output directory's lock.
    #[error("{} is in use by another training run ({owner}): {hint}", dir.display())]
    RunLocked {
        dir: PathBuf,
        owner: String,
        hint: &'static str,
    },

    /// An encoder returned a representation whose row count differs from its input chunk.
    #[error("the {side} encoder returned {got} rows for a chunk of {expected} inputs")]
    RowMismatch {
        side: Side,
        expected: usize,
        got: usize,
    },

    /// An encoder returned something that is not a `[rows, width]` matrix.
    #[error("the {side} encoder must return a [rows, width] matrix, got shape {shape:?}")]
    NotAMatrix { side: Side, shape: Vec<usize> },

    /// A cotangent handed to a replay does not match the shape of the replayed output.
    #[error("replay: the cotangent has shape {cotangent:?} but the output has shape {output:?}")]
    CotangentShape {
        output: Vec<usize>,
        cotangent: Vec<usize>,
    },

    /// Two towers own distinct parameters under one name, so their gradients would be mixed.
    #[error(
        "parameter `{name}` exists in both towers as two different variables; give the towers \
         distinct name prefixes (e.g. `query.` and `passage.`) or share one tower"
    )]
    DuplicateParameter { name: String },

    /// A configuration value is out of range.
    #[error("invalid value for `{field}`: {value} ({reason})")]
    InvalidConfig {
        field: &'static str,
        value: String,
        reason: &'static str,
    },

    /// A memory budget that no setting fits, found before any step ran.
    #[error(
        "memory budget of {} is too small: {what} needs {} (train.memory_budget)",
        crate::memory::human_bytes(*budget),
        crate::memory::human_bytes(*needed)
    )]
    MemoryBudget {
        budget: u64,
        needed: u64,
        what: String,
    },

    /// A selective recompute policy names a sub-layer site the model does not have.
    #[error(
        "unknown sub-layer site `{name}` in `recompute.keep`: this model's sites are {}",
        known.join(", ")
    )]
    UnknownSite { name: String, known: Vec<String> },

    /// A config file is not valid TOML, or does not fit the configuration (an unknown key,
    /// a value of the wrong type).
    #[error("invalid config file {path}: {reason}")]
    ConfigFile { path: PathBuf, reason: String },

    /// A function was called with an argument it cannot use (API misuse, not a config
    /// value).
    #[error("invalid {what} {value}: {reason}")]
    InvalidArgument {
        what: &'static str,
        value: String,
        reason: &'static str,
    },

    /// A file system operation failed (`action` is what was tried: read, create, write,
    /// rename, remove, open).
    #[error("cannot {action} {path}: {reason}")]
    Io {
        action: &'static str,
        path: PathBuf,
        reason: String,
    },

    /// A directory that would be written already holds files.
    #[error("{path} exists and is not empty; choose a new directory")]
    OutputExists { path: PathBuf },

    /// A training checkpoint file is missing, truncated or altered (its size or SHA-256
    /// differs from what the checkpoint recorded), or does not parse.
    #[error("damaged checkpoint file {path}: {reason}")]
    CorruptCheckpoint { path: PathBuf, reason: String },

    /// A checkpoint or saved state does not fit the run or model that reads it.
    #[error("{what} does not match this run: {detail}")]
    CheckpointMismatch { what: String, detail: String },

    /// A batch holds sequences longer than the model's position table.
    #[error(
        "sequences of {len} tokens are longer than the model's position embeddings cover \
         ({max} tokens of max_position_embeddings); truncate to at most that many tokens"
    )]
    SequenceTooLong { len: usize, max: usize },

    /// A file the model needs is not there.
    #[error("missing {what}: {path} does not exist")]
    MissingFile { path: PathBuf, what: &'static str },

    /// A model directory holds only a PyTorch pickle checkpoint.
    #[error(
        "{dir} holds only a PyTorch pickle checkpoint ({file}); gradcache loads safetensors \
         weights only (pickle files can run code when loaded). Convert it once, e.g. in \
         Python: `AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
    )]
    PickleOnly { dir: PathBuf, file: String },

    /// A model or checkpoint file (config, weights, tokenizer, trainer state) could not be
    /// read or parsed.
    #[error("cannot read {path}: {reason}")]
    ModelFile { path: PathBuf, reason: String },

    /// A weight the model needs is not in the weights file.
    #[error("weight `{name}` is missing from {path}")]
    MissingWeight { name: String, path: PathBuf },

    /// A weight has a shape other than the config implies.
    #[error("weight `{name}` in {path} has shape {found:?}, but the config needs {expected:?}")]
    WeightShape {
        name: String,
        path: PathBuf,
        found: Vec<usize>,
        expected: Vec<usize>,
    },

    /// A model config whose values do not fit together (a decoder's heads, head width,
    /// layer types or window), found before anything is built.
    #[error("model config {path} does not fit: `{field}` {reason}")]
    ModelConfig {
        path: PathBuf,
        field: String,
        reason: String,
    },

    /// A model config asks for something this encoder does not implement.
    #[error("unsupported `{field}` = {value:?} in {path}: supported are {supported}")]
    UnsupportedConfig {
        field: &'static str,
        value: String,
        supported: &'static str,
        path: PathBuf,
    },

    /// A model could not be found on the Hugging Face Hub or in its local cache.
    #[error("cannot get `{file}` of `{repo}` from the Hugging Face Hub: {reason}")]
    Hub {
        repo: String,
        file: String,
        reason: String,
    },

    /// A line of a data file is malformed (line 0: the file as a whole).
    #[error("{}: {reason}", data_location(path, *line))]
    Data {
        path: PathBuf,
        line: usize,
        reason: String,
    },

    /// Tokenization failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// Parts of a batch could not be put together.
    #[error("cannot concatenate batches: {0}")]
    Concat(String),

    /// Another rank of a distributed run failed; every rank stops with this error.
    #[error("rank {rank} of {world} failed: {message}")]
    RankFailed {
        rank: usize,
        world: usize,
        message: String,
    },

    /// Ranks of a distributed run disagree on something that must be equal everywhere
    /// (the config, a tensor shape in a collective, the weights after a step).
    #[error("ranks disagree on {what}: {detail}")]
    RankMismatch { what: String, detail: String },

    /// A distributed backend cannot be used in this build or on this machine.
    #[error("distributed backend `{backend}` is unavailable: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        reason: String,
    },

    /// A device cannot be used in this build or on this machine.
    #[error("device `{device}` is unavailable: {reason}")]
    DeviceUnavailable { device: String, reason: String },

    /// A training step needed more GPU memory than the device had. The step did not
    /// count and nothing was written for it.
    #[error(
        "device `{device}` ran out of memory in step {step} ({chunks}): lower {settings}, or \
         set train.memory_budget to have the chunk sizes chosen for you; the step did not \
         count and no checkpoint was written for it ({detail})"
    )]
    DeviceOutOfMemory {
        device: String,
        step: u64,
        chunks: String,
        settings: String,
        detail: String,
    },

    /// The BLAS named for the products (`GRADCACHE_BLAS`, [`crate::nn::use_blas`]) cannot
    /// be used; the products stay the gemm crate's.
    #[error("cannot use the BLAS at {path} (GRADCACHE_BLAS): {reason}")]
    Blas {
        path: std::path::PathBuf,
        reason: String,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// A failed file system operation: `action` is what was tried (read, create, write,
    /// rename, remove, open), `path` where.
    /// A malformed data file: `line` 0 names the file as a whole.
    pub(crate) fn data(path: &std::path::Path, line: usize, reason: impl Into<String>) -> Self {
        Error::Data {
            path: path.to_path_buf(),
            line,
            reason: reason.into(),
        }
    }

    pub(crate) fn io(action: &'static str, path: &std::path::Path, e: impl fmt::Display) -> Self {
        Error::Io {
            action,
            path: path.to_path_buf(),
            reason: e.to_string(),
        }
    }
}

fn stopped_at(step: u64, checkpoint: Option<&std::path::Path>) -> String {
    match checkpoint {
        Some(dir) => format!(
            "after step {step}; checkpoint {}: resume with --resume {}",
            dir.display(),
            dir.parent().unwrap_or(dir).display()
        ),
        None => "before its first step; nothing to resume".into(),
    }
}

fn data_location(path: &std::path::Path, line: usize) -> String {
    if line == 0 {
        path.display().to_string()
    } else {
        format!("{}:{line}", path.display())
    }
}

/// `Result` with the library's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// The environment variable `var` that sets a process-wide option, as written: `None`
/// when it is unset or blank; refused (naming `var`, with `expected` as the reason) when
/// it is not UTF-8.
pub(crate) fn env_setting(var: &'static str, expected: &'static str) -> Result<Option<String>> {
    match std::env::var(var) {
        Ok(text) if !text.trim().is_empty() => Ok(Some(text)),
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(invalid(var, "(not UTF-8)", expected)),
    }
}

/// A configuration value refused: `field` is `value`, which `reason` says is wrong.
pub(crate) fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> Error {
    Error::InvalidConfig {
        field,
        value: value.to_string(),
        reason,
    }
}
