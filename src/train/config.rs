//! The trainer's configuration: TOML with documented defaults, unknown keys rejected, and
//! every value settable from the command line with `--set section.key=value`.
//!
//! [`Config::load`] reads the file, applies the overrides, deserialises (unknown keys are
//! errors naming the key) and [`Config::validate`]s every value before any tensor work.

use std::path::{Path, PathBuf};

use crate::device::DeviceSpec;
use crate::dist::Backend;
use crate::error::invalid;
use crate::loss::{LossDirection, Similarity};
use crate::models::bert::Pooling;
use crate::precision::{LossScaler, Precision};
use crate::recompute::Recompute;
use crate::{Error, Result};

/// The whole run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Seed of everything random: initial weights, data order, dropout masks.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Where checkpoints, metrics, the loss curve and the tokenizer go.
    pub output_dir: PathBuf,
    /// Training and evaluation data.
    pub data: DataConfig,
    /// The encoder.
    #[serde(default)]
    pub model: ModelConfig,
    /// The contrastive loss.
    #[serde(default)]
    pub loss: LossConfig,
    /// Steps, batch and chunk sizes, evaluation and checkpoint cadence.
    #[serde(default)]
    pub train: TrainConfig,
    /// Optimiser and schedule.
    #[serde(default)]
    pub optim: OptimConfig,
    /// Multi-process training.
    #[serde(default)]
    pub dist: DistConfig,
    /// Where the encoder runs: `"cpu"`, `"cuda"` (GPU 0) or `"cuda:N"`. Unset: the CPU, or
    /// with `dist.backend = "nccl"` each rank's local GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceSpec>,
    /// The dtype of the encoder's forward and backward: `"f32"`, `"bf16"` or `"f16"`
    /// (master weights, optimizer state, LayerNorm and softmax statistics and the loss stay
    /// f32; f16 uses the dynamic loss scaler of `[loss_scale]`).
    #[serde(default, skip_serializing_if = "Precision::is_f32")]
    pub precision: Precision,
    /// The dynamic loss scaler of `precision = "f16"`.
    #[serde(default, skip_serializing_if = "LossScaleConfig::is_default")]
    pub loss_scale: LossScaleConfig,
}

/// Dynamic loss scaling for f16 (PyTorch's `GradScaler` defaults).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    /// The first scale.
    pub init: f64,
    /// Good steps in a row before the scale grows.
    pub growth_interval: u64,
    /// Multiplies the scale when it grows.
    pub growth_factor: f64,
    /// Multiplies the scale after a step with an inf or NaN gradient (which is skipped).
    pub backoff_factor: f64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        let s = LossScaler::default();
        Self {
            init: s.scale,
            growth_interval: s.growth_interval,
            growth_factor: s.growth_factor,
            backoff_factor: s.backoff_factor,
        }
    }
}

impl LossScaleConfig {
    /// Whether every value is the default (then the section is left out of fingerprints).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// A scaler in its starting state.
    pub fn scaler(&self) -> LossScaler {
        LossScaler {
            scale: self.init,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            good_steps: 0,
        }
    }
}

fn default_seed() -> u64 {
    42
}

/// The encoder: pretrained or trained from scratch, one tower or two.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A local model directory or a Hugging Face Hub id; empty: a fresh model from `fresh`
    /// with a WordPiece tokenizer trained on the training data.
    pub pretrained: String,
    /// `true`: one encoder for queries and passages; `false`: two towers.
    pub shared: bool,
    /// `mean`, `cls`, `max`, `mean_sqrt_len_tokens`, `weightedmean` or `lasttoken`.
    /// Unset: the pretrained model's own (its sentence-transformers pooling config: a
    /// decoder's last token), else `mean`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooling: Option<Pooling>,
    /// L2-normalise embeddings. Unset: the pretrained model's own (whether its
    /// sentence-transformers modules end with Normalize), else true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
    /// Token limit for queries (truncation). Unset: the pretrained model's own limit
    /// (`max_seq_length` of its `sentence_bert_config.json`, else `model_max_length` of
    /// its `tokenizer_config.json`, capped at its positions), 64 for a fresh model; a value
    /// above the model's limit is refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_max_len: Option<usize>,
    /// Token limit for passages (truncation); unset as `query_max_len`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passage_max_len: Option<usize>,
    /// Put before every query in training and evaluation, and written to the export's
    /// `config_sentence_transformers.json` (e.g. e5's `"query: "`, or an instruction).
    /// Unset: the pretrained model's own query prompt, if it has one; `""`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_prompt: Option<String>,
    /// Put before every passage (e.g. `"passage: "`); unset: the pretrained model's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passage_prompt: Option<String>,
    /// Encode queries and passages with this task adapter of a model that carries them
    /// (Jina v3's release: `retrieval.query`, `retrieval.passage`, `separation`,
    /// `classification`, `text-matching`), its instruction as the prompt unless one is
    /// set; the adapters of the tasks in use train, the base and the other tasks stay.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// The queries' task adapter (over `task`), e.g. `retrieval.query`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_task: Option<String>,
    /// The passages' task adapter (over `task`), e.g. `retrieval.passage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passage_task: Option<String>,
    /// Pool the prompts' tokens with the text (sentence-transformers' `include_prompt`);
    /// `false` leaves the prompt and the special token before it out of the pooling (they
    /// still attend). Unset: the pretrained model's pooling config, else true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub include_prompt: Option<bool>,
    /// Activation checkpointing: `"off"`, `"every_layer"`, `"sqrt"`, `{ every = k }`,
    /// `{ layers = [..] }`.
    pub recompute: Recompute,
    /// Dropout during training (the model config's probabilities); off: deterministic
    /// forward passes.
    pub dropout: bool,
    /// Architecture of a fresh model.
    pub fresh: FreshModel,
    /// Parameters that do not train (no gradient, no optimizer state; exports keep them
    /// as they were): names or module paths (`embeddings`, `encoder.layer.0`), or
    /// patterns with `*` over whole names (`layers.*.self_attn.*`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
    /// LoRA adapters on the attention and feed-forward projections; the base model is
    /// frozen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// With LoRA: the dtype the adapted projections' frozen base weights are stored in
    /// (`bf16` halves them; the adapters, their gradients and optimizer state stay f32,
    /// and the merge runs in f32). Every other weight stays f32.
    #[serde(skip_serializing_if = "BaseDtype::is_f32")]
    pub base_dtype: BaseDtype,
    /// A multi-vector (ColBERT, late interaction) model: a token vector per token, scored
    /// by MaxSim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multi_vector: Option<MultiVectorSettings>,
    /// A sparse (SPLADE) model: the masked-language model's logits pooled into one
    /// vocabulary-wide vector, scored by dot products.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sparse: Option<SparseSettings>,
    /// A reranker (cross-encoder): each (query, document) pair read as one text and
    /// scored by the family's classification head (see [`crate::rerank`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reranker: Option<RerankerModel>,
}

pub use super::data_config::{DataConfig, EvalSet};
pub use super::lora_config::{BaseDtype, LoraConfig, DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK};
pub use super::multi_vector_config::{DistillKind, DistillationConfig, MultiVectorSettings};
pub use super::rerank_config::{RerankLossKind, RerankerLoss, RerankerModel};
pub use super::sources::{Batches, Sampling, SamplingName, SourceConfig, SourceLoss};
pub use super::sparse_config::{SparseSettings, SpladeConfig};

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            pretrained: String::new(),
            shared: true,
            pooling: None,
            normalize: None,
            query_max_len: None,
            passage_max_len: None,
            query_prompt: None,
            passage_prompt: None,
            task: None,
            query_task: None,
            passage_task: None,
            include_prompt: None,
            recompute: Recompute::Off,
            dropout: true,
            fresh: FreshModel::default(),
            freeze: Vec::new(),
            lora: None,
            base_dtype: BaseDtype::F32,
            multi_vector: None,
            sparse: None,
            reranker: None,
        }
    }
}

/// A BERT trained from scratch, with its own WordPiece vocabulary.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FreshModel {
    /// WordPiece vocabulary size to train.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Dropout probability (hidden and attention).
    pub dropout_prob: f64,
    /// Lower-case text before tokenizing.
    pub lowercase: bool,
}

impl Default for FreshModel {
    fn default() -> Self {
        Self {
            vocab_size: 4000,
            hidden_size: 128,
            num_layers: 2,
            num_heads: 4,
            intermediate_size: 256,
            dropout_prob: 0.1,
            lowercase: true,
        }
    }
}

/// InfoNCE settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    /// Softmax temperature (logits are similarities divided by it).
    pub temperature: f64,
    /// `cosine` or `dot`.
    pub similarity: Similarity,
    /// Add the passage-to-query term.
    pub symmetric: bool,
    /// The interactions of the loss's one softmax, as sentence-transformers'
    /// `MultipleNegativesRankingLoss(directions=...)` names them: `query_to_doc` (always),
    /// `query_to_query`, `doc_to_query`, `doc_to_doc` (`passage` for `doc` also reads).
    /// Qwen3-Embedding's and GTE's loss: all four.
    #[serde(skip_serializing_if = "LossConfig::only_query_to_doc")]
    pub directions: Vec<LossDirection>,
    /// Compute the loss in blocks of this many anchor rows; 0: one block while the
    /// logits fit in [`AUTO_BLOCK_LOGITS`], else blocks that do (see
    /// [`LossConfig::effective_block_rows`]).
    pub block_rows: usize,
    /// Matryoshka widths: the loss is summed over these prefixes of the embedding (e.g.
    /// `[384, 256, 128, 64]`); empty: the whole embedding only. The export records them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub matryoshka_dims: Vec<usize>,
    /// One weight per Matryoshka width; empty: 1 each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub matryoshka_weights: Vec<f64>,
    /// Mask in-batch candidates whose similarity to the query is above the positive's
    /// minus this margin (likely false negatives, judged by the model itself as GISTEmbed's
    /// filter); `0.0` masks candidates scoring above the positive. Unset: no mask.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub false_negative_margin: Option<f64>,
    /// A frozen guide model (directory or Hub id) that judges the false-negative mask
    /// instead of the model itself (GISTEmbed): candidates the guide scores above the
    /// positive minus `false_negative_margin` (0 when unset) are masked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub false_negative_guide: Option<String>,
    /// `[loss.distillation]`: learn a teacher's scores given in the data (multi-vector).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distillation: Option<DistillationConfig>,
    /// `[loss.splade]`: the FLOPS regularisers of a sparse model (`[model.sparse]`); a
    /// sparse run without the section gets sentence-transformers' documented weights.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub splade: Option<SpladeConfig>,
    /// `[loss.reranker]`: a reranker run's loss (with `[model.reranker]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reranker: Option<RerankerLoss>,
}

use super::config_file::config_error;
pub use super::config_file::{apply_override, differing_keys, read_table};
pub use crate::loss::AUTO_BLOCK_LOGITS;

impl LossConfig {
    fn only_query_to_doc(directions: &[LossDirection]) -> bool {
        directions == [LossDirection::QueryToDoc]
    }

    /// The row blocks the loss is computed in for a global batch of `batch` pairs with
    /// `hard_negatives` per query: `block_rows` when set, else one block (`None`) while
    /// `batch x batch(1 + hard_negatives)` logits fit in [`AUTO_BLOCK_LOGITS`], else as many
    /// rows as fit (at least one).
    pub fn effective_block_rows(&self, batch: usize, hard_negatives: usize) -> Option<usize> {
        if self.block_rows > 0 {
            return Some(self.block_rows);
        }
        crate::loss::auto_block_rows(batch, batch.saturating_mul(1 + hard_negatives))
    }
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            temperature: 0.05,
            similarity: Similarity::Cosine,
            symmetric: false,
            directions: vec![LossDirection::QueryToDoc],
            block_rows: 0,
            matryoshka_dims: Vec::new(),
            matryoshka_weights: Vec::new(),
            false_negative_margin: None,
            false_negative_guide: None,
            distillation: None,
            splade: None,
            reranker: None,
        }
    }
}

/// How long and how big.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Total batch size: query/positive pairs per optimizer step (all of them are in-batch
    /// negatives for each other). Not limited by memory: see the chunk sizes.
    pub batch_size: usize,
    /// Chunk size of the query tower: how many queries are encoded with a graph at once.
    /// This, not the batch size, sets activation memory.
    pub query_chunk: usize,
    /// Chunk size of the passage tower.
    pub passage_chunk: usize,
    /// Chunks by tokens instead of rows (sentence-transformers' `mini_batch_num_tokens`):
    /// after the length ordering, each tower's chunk takes consecutive texts while their
    /// number times the chunk's longest text stays within this many tokens (a longer text
    /// is a chunk alone). Short texts then go in many per chunk and long ones in few, so a
    /// chunk's activations stay about the same size. `query_chunk` and `passage_chunk`
    /// still size the evaluation's chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk_tokens: Option<usize>,
    /// Hard negatives per query (missing ones are filled from other pairs' positives).
    pub hard_negatives: usize,
    /// Batches with no text twice (sentence-transformers' no-duplicates sampler): a
    /// repeated text is a false negative for the other pair that holds it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub no_duplicates: bool,
    /// Evaluate every N steps (0: only before the first and after the last step).
    pub eval_every: u64,
    /// Write a checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints to keep (the newest; at least 1). Keep 2 or more so that a damaged newest
    /// checkpoint leaves an older one to resume from.
    pub keep_checkpoints: usize,
    /// f32/bf16: what a step whose loss or gradient norm is NaN or infinite does:
    /// `"stop"` (the default: the run ends naming the step and the data lines of its
    /// batch, no weight changed) or `"skip"` (no weight, optimizer state or statistic
    /// changes, the run goes on with the next batch). f16 always skips such a step and
    /// halves the loss scale.
    #[serde(skip_serializing_if = "OnNonFinite::is_stop")]
    pub on_nonfinite: OnNonFinite,
    /// Heap memory a step may use, e.g. `"2GiB"` (CPU runs). When set, a probe at
    /// start-up measures the encoder's replay per row and picks the chunk sizes and the
    /// recompute policy (`query_chunk`, `passage_chunk` and `model.recompute` are then
    /// chosen, not read); a budget nothing fits is refused before any step. See
    /// [`crate::budget`].
    pub memory_budget: Option<String>,
    /// Which evaluation picks the checkpoint kept as best (`best/` in the checkpoints
    /// folder): the name of a `[[data.evals]]` set, or `"mean"` (their mean nDCG@10);
    /// unset: no best checkpoint is kept. Judged by nDCG@10 at each evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_by: Option<String>,
    /// A reranker run: (query, document) pairs scored with a graph at once (the chunk of
    /// the pairs; `chunk_tokens` cuts by tokens instead). Unset: 32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pair_chunk: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 100,
            batch_size: 64,
            query_chunk: 16,
            passage_chunk: 16,
            chunk_tokens: None,
            hard_negatives: 0,
            no_duplicates: false,
            eval_every: 0,
            checkpoint_every: 0,
            keep_checkpoints: 2,
            on_nonfinite: OnNonFinite::Stop,
            memory_budget: None,
            best_by: None,
            pair_chunk: None,
        }
    }
}

/// What a step with a NaN or infinite loss or gradient norm does (`train.on_nonfinite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// End the run with an error naming the step and its batch (no weight changed).
    #[default]
    Stop,
    /// Skip the step: no weight, optimizer state or statistic changes.
    Skip,
}

impl OnNonFinite {
    /// Whether this is the default, `stop`.
    pub fn is_stop(&self) -> bool {
        *self == OnNonFinite::Stop
    }
}

/// Optimiser and learning-rate schedule.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `adamw` or `sgd`.
    pub name: OptimName,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warmup steps; 0: `warmup_ratio` of `train.steps` instead.
    pub warmup_steps: u64,
    /// Linear warmup as a fraction of `train.steps`, rounded up (Hugging Face's
    /// `warmup_ratio`); used when `warmup_steps` is 0, so a shortened run keeps its shape.
    pub warmup_ratio: f64,
    /// AdamW decoupled weight decay (not applied to biases and LayerNorm weights).
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this value (0: no clipping).
    pub max_grad_norm: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimName::Adamw,
            lr: 5e-5,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: 1.0,
        }
    }
}

impl OptimConfig {
    /// The warmup of a run of `total` steps: `warmup_steps` if set, else `warmup_ratio` of
    /// `total`, rounded up (as `transformers.TrainingArguments.get_warmup_steps`).
    pub fn warmup(&self, total: u64) -> u64 {
        if self.warmup_steps > 0 {
            self.warmup_steps
        } else {
            (self.warmup_ratio * total as f64).ceil() as u64
        }
    }

    /// The optimiser these settings describe.
    pub fn kind(&self) -> crate::train::optim::OptimizerKind {
        match self.name {
            OptimName::Sgd => crate::train::optim::OptimizerKind::Sgd,
            OptimName::Adamw => crate::train::optim::OptimizerKind::AdamW {
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
            },
        }
    }
}

/// Optimiser names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimName {
    /// AdamW.
    Adamw,
    /// Plain SGD.
    Sgd,
}

/// Multi-process training: `mpirun -n N gradcache train ... --set dist.backend=mpi`.
///
/// `train.batch_size` is the global batch: each of the `N` ranks encodes `batch_size / N`
/// pairs (so it must divide evenly), and the loss is formed over all of them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// `none` (one process), `mpi` (CPU processes) or `nccl` (one process per GPU).
    pub backend: Backend,
    /// Size of one gradient all-reduce bucket, in MiB (gradients are reduced once per step).
    pub bucket_mib: usize,
    /// Check that every rank holds bit-identical weights every this many steps (0: only at
    /// the end of training). Debug builds check after every step.
    pub check_weights_every: u64,
    /// A collective that has not finished after this many seconds ends the process (a
    /// peer is gone or stuck), and the launcher ends the job; 0 turns the watchdog off.
    /// Waits for rank 0's evaluations and checkpoints are not timed.
    pub timeout_s: u64,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            backend: Backend::None,
            bucket_mib: crate::dist::DEFAULT_BUCKET_BYTES >> 20,
            check_weights_every: 0,
            timeout_s: 1800,
        }
    }
}

impl Config {
    /// Reads `path`, applies `overrides` (`section.key=value`, value in TOML syntax, bare
    /// words taken as strings), then deserialises and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let mut table = read_table(path)?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let cfg: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| config_error(path, e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every value; the first bad one is reported with its key.
    pub fn validate(&self) -> Result<()> {
        let t = &self.train;
        if t.steps == 0 {
            return Err(invalid("train.steps", 0, "must be at least 1"));
        }
        if t.batch_size == 0 {
            return Err(invalid("train.batch_size", 0, "must be at least 1"));
        }
        if t.query_chunk == 0 {
            return Err(invalid("train.query_chunk", 0, "must be at least 1"));
        }
        if t.passage_chunk == 0 {
            return Err(invalid("train.passage_chunk", 0, "must be at least 1"));
        }
        if t.chunk_tokens == Some(0) {
            return Err(invalid("train.chunk_tokens", 0, "must be at least 1"));
        }
        if let Some(budget) = &t.memory_budget {
            crate::budget::parse_bytes(budget)?;
            if let Some(tokens) = t.chunk_tokens {
                return Err(invalid(
                    "train.chunk_tokens",
                    tokens,
                    "train.memory_budget chooses the chunks itself: set one of the two",
                ));
            }
        }
        self.loss_scale.scaler().validate()?;
        if self.dist.backend == Backend::Nccl {
            match self.device {
                Some(DeviceSpec::Cpu) => {
                    return Err(invalid(
                        "device",
                        "cpu",
                        "dist.backend = \"nccl\" runs on GPUs: set device = \"cuda\" or leave it unset",
                    ))
                }
                Some(DeviceSpec::Cuda(n)) if n > 0 => {
                    return Err(invalid(
                        "device",
                        format!("cuda:{n}"),
                        "with dist.backend = \"nccl\" each rank takes its local GPU: set device = \"cuda\"",
                    ))
                }
                _ => {}
            }
        }
        if self.dist.bucket_mib == 0 {
            return Err(invalid("dist.bucket_mib", 0, "must be at least 1"));
        }
        if t.keep_checkpoints == 0 {
            return Err(invalid("train.keep_checkpoints", 0, "must be at least 1"));
        }
        let l = &self.loss;
        if !(l.temperature.is_finite() && l.temperature > 0.0) {
            return Err(invalid(
                "loss.temperature",
                l.temperature,
                "must be a finite number greater than 0",
            ));
        }
        crate::loss::InfoNce::new(l.temperature)?.with_directions(&l.directions)?;
        let o = &self.optim;
        if !(o.lr.is_finite() && o.lr >= 0.0) {
            return Err(invalid(
                "optim.lr",
                o.lr,
                "must be a finite number, 0 or more",
            ));
        }
        if o.max_grad_norm.is_nan() || o.max_grad_norm < 0.0 {
            return Err(invalid(
                "optim.max_grad_norm",
                o.max_grad_norm,
                "must be 0 (off) or more",
            ));
        }
        o.kind().validate()?;
        if !(0.0..=1.0).contains(&o.warmup_ratio) {
            return Err(invalid(
                "optim.warmup_ratio",
                o.warmup_ratio,
                "must be in [0, 1]",
            ));
        }
        if o.warmup_steps > t.steps {
            return Err(invalid(
                "optim.warmup_steps",
                o.warmup_steps,
                "must not exceed train.steps; optim.warmup_ratio scales with the run",
            ));
        }
        let m = &self.model;
        for (field, len) in [
            ("model.query_max_len", m.query_max_len),
            ("model.passage_max_len", m.passage_max_len),
        ] {
            let Some(len) = len else { continue };
            if len < 2 {
                return Err(invalid(
                    field,
                    len,
                    "room for at least the two special tokens is needed",
                ));
            }
        }
        if let Some(lora) = &m.lora {
            lora.validate(&m.pretrained)?;
        }
        if let Some(mv) = &m.multi_vector {
            let l = &self.loss;
            let d = LossConfig::default();
            mv.validate(
                &[
                    ("model.pooling", m.pooling.is_some()),
                    ("model.normalize", m.normalize.is_some()),
                    ("model.query_max_len", m.query_max_len.is_some()),
                    ("model.passage_max_len", m.passage_max_len.is_some()),
                    ("model.query_prompt", m.query_prompt.is_some()),
                    ("model.passage_prompt", m.passage_prompt.is_some()),
                    ("model.include_prompt", m.include_prompt.is_some()),
                ],
                &[
                    ("loss.similarity", l.similarity != d.similarity),
                    ("loss.symmetric", l.symmetric),
                    ("loss.directions", l.directions != d.directions),
                    ("loss.block_rows", l.block_rows != 0),
                    ("loss.matryoshka_dims", !l.matryoshka_dims.is_empty()),
                    ("loss.matryoshka_weights", !l.matryoshka_weights.is_empty()),
                    (
                        "loss.false_negative_margin",
                        l.false_negative_margin.is_some(),
                    ),
                    (
                        "loss.false_negative_guide",
                        l.false_negative_guide.is_some(),
                    ),
                ],
                (m.lora.is_some(), t.memory_budget.is_some()),
            )?;
        }
        self.validate_sparse()?;
        if let Some(d) = &self.loss.distillation {
            let temperature_set = self.loss.temperature != LossConfig::default().temperature;
            // The temperature is InfoNCE's: refused only when no batch uses it.
            let all_distilled = self.sources().iter().all(|s| s.distill);
            d.validate(
                m.multi_vector.is_some(),
                self.widest_hard_negatives(),
                temperature_set && all_distilled,
            )?;
        }
        if m.base_dtype != BaseDtype::F32 && m.lora.is_none() {
            return Err(invalid(
                "model.base_dtype",
                format!("{:?}", m.base_dtype).to_lowercase(),
                "narrows the frozen base weights of LoRA's projections: set [model.lora], or \
                 leave it f32 (for a model trained whole, precision = \"bf16\" is the \
                 compute dtype)",
            ));
        }
        if let Some(p) = m.freeze.iter().find(|p| p.trim().is_empty()) {
            return Err(invalid(
                "model.freeze",
                format!("{p:?}"),
                "names no parameter",
            ));
        }
        let f = &m.fresh;
        if m.pretrained.is_empty() {
            if f.hidden_size == 0 || f.num_heads == 0 || !f.hidden_size.is_multiple_of(f.num_heads)
            {
                return Err(invalid(
                    "model.fresh.num_heads",
                    f.num_heads,
                    "must be at least 1 and divide model.fresh.hidden_size",
                ));
            }
            if f.vocab_size < 10 {
                return Err(invalid(
                    "model.fresh.vocab_size",
                    f.vocab_size,
                    "must be at least 10",
                ));
            }
            if !(0.0..1.0).contains(&f.dropout_prob) {
                return Err(invalid(
                    "model.fresh.dropout_prob",
                    f.dropout_prob,
                    "must be in [0, 1)",
                ));
            }
        }
        self.validate_sources()?;
        self.validate_evals()?;
        Ok(())
    }

    /// A stable fingerprint of everything that shapes the training trajectory, stored in
    /// checkpoints so a resume with a different configuration is refused.
    pub fn fingerprint(&self) -> Result<String> {
        self.fingerprint_of(true)
    }

    /// [`Self::fingerprint`] leaving out the run's length: `train.steps`, and the warmup
    /// as written (a ratio stays a ratio of whatever length). What `--extend` compares.
    pub fn length_free_fingerprint(&self) -> Result<String> {
        self.fingerprint_of(false)
    }

    fn fingerprint_of(&self, with_length: bool) -> Result<String> {
        let mut shaping = self.clone();
        if with_length {
            // The warmup is what it amounts to, however it was written.
            shaping.optim.warmup_steps = self.optim.warmup(self.train.steps);
            shaping.optim.warmup_ratio = 0.0;
        } else {
            shaping.train.steps = 0;
        }
        // The cadence of evaluation and checkpoints may change on resume; the run length
        // may not (the learning-rate schedule decays to 0 at `train.steps`).
        shaping.train.eval_every = 0;
        shaping.train.checkpoint_every = 0;
        shaping.train.keep_checkpoints = 1;
        // What a non-finite step does may change: a run stopped on one resumes with
        // `skip`.
        shaping.train.on_nonfinite = OnNonFinite::Stop;
        // Nor which evaluation picks the best checkpoint.
        shaping.train.best_by = None;
        // How many processes share the work does not change what is trained: a run may
        // resume (or be exported) with another backend or world size.
        shaping.dist = DistConfig::default();
        // Nor whether the pairs are held in memory or read from disk: the batches are the
        // same.
        shaping.data.stream = false;
        // Nor where the run's files go: a run directory may be moved or copied.
        shaping.output_dir = PathBuf::new();
        // Nor where it runs: a run may move between the CPU and a GPU (the dtype stays).
        shaping.device = None;
        let text = serde_json::to_string(&shaping).map_err(|e| Error::InvalidArgument {
            what: "configuration",
            value: e.to_string(),
            reason: "cannot be serialised for its fingerprint",
        })?;
        Ok(format!("{:016x}", crate::rng::hash_str(&text)))
    }

    /// The configuration as JSON (for comparing ranks' configurations).
    pub fn to_json(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self).map_err(|e| Error::InvalidArgument {
            what: "configuration",
            value: e.to_string(),
            reason: "cannot be serialised",
        })
    }
}
