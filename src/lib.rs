//! # gradcache
//!
//! Contrastive learning with batches far larger than memory, on [candle].
//!
//! The crate has layers, and the folders show them. No module imports another that
//! imports it back, and imports run downward but for two that remain: the engine's
//! [`Dropout`] calls [`nn`]'s dropout kernel, and BERT's loading reads [`hub`]'s model
//! files.
//!
//! ```text
//! the binary (src/bin/gradcache)       console, progress, plots
//!   train      the loop and its tasks, config, data, optimisers, metrics, checkpoints,
//!              memory budget
//!   hub        model files, tokenizers, export, the inference path
//!   models     BERT and its families, the decoder embedders, ResNet, LSTM, toy towers
//!   nn         layers and fused kernels, one file per op family
//!   engine     cache, replay, recompute, loss, encoder, dropout, params, precision, ...
//! ```
//!
//! **The engine** (top-level modules): what makes a big-batch step exact in little memory.
//!
//! - [`cache`]: the gradient cache (GradCache, Gao et al. 2021): chunked representation
//!   pass without a graph, one loss over the whole batch, replay of every chunk from the
//!   cached representation gradients. Same gradients as a full-batch step, activation memory
//!   of one chunk. Entry point: [`GradCache::cache_step`].
//! - [`replay`]: the one primitive underneath: back-propagate a cotangent through a re-run
//!   computation (used per chunk by the cache and per segment by [`recompute`]).
//! - [`recompute`]: activation checkpointing ([`Recompute`] policies) for any
//!   [`LayerStack`]: keep segment inputs, recompute segments in the backward pass.
//! - [`loss`]: InfoNCE with in-batch and hard negatives, temperature, dot/cosine,
//!   symmetric term, row-block computation; CLIP's loss with a learnable temperature.
//! - [`encoder`]: the [`Encoder`] trait the cache runs, and [`Tower`], which makes any
//!   candle model graph-free-capable by building it over trainable and detached weights.
//! - [`dropout`] and [`rng`]: dropout whose masks are a pure function of explicit seeds, so
//!   every replay sees the masks of the representation pass bit for bit.
//! - [`params`]: the parameter store (seeded initialisation) and gradients keyed by name.
//! - [`batch`]: splitting and concatenating inputs along the batch dimension.
//! - [`memory`]: a counting allocator for peak-memory measurements.
//! - [`pool`]: a short spin for candle's CPU pool workers on machines with few cores.
//! - [`denormal`]: flush-to-zero and denormals-are-zero on every thread that computes
//!   (subnormal floats cost Intel cores a microcode assist each), held by the entry points.
//! - [`precision`]: mixed precision (bf16/f16 compute over f32 master weights) and the
//!   dynamic loss scaler; [`device`]: `cpu`, `cuda`, `cuda:N`.
//!
//! **Layers and models**: [`nn`] (differentiable layers where candle's fused ones cut the
//! graph, BatchNorm whose running statistics move once per chunk) and [`models`] ([`bert`],
//! the trainable BERT-family encoder; [`resnet`], an image tower; [`lstm`], a recurrent
//! text tower checkpointed over time steps; [`toy`], tiny towers for tests, examples and
//! benchmarks).
//!
//! **Hugging Face I/O**: [`hub`]: model files from a directory or the Hub, tokenizers,
//! export to a `transformers` + `sentence-transformers` directory, and the one inference
//! path ([`hub::EmbeddingModel`]) that `eval`, `encode` and the examples use.
//!
//! **The trainer**: [`train`]: configuration, data, optimisers, retrieval metrics,
//! training checkpoints, the memory budget ([`budget`], re-exported from
//! [`train::budget`]) and the loop behind `gradcache train`.
//!
//! **Collectives**: [`dist`]: all-gather and all-reduce across processes (MPI for CPUs,
//! NCCL for GPUs) for the distributed step.
//!
//! The library never prints; errors are [`Error`]. The command-line trainer (the `cli`
//! feature, on by default) owns the console.
//!
//! [candle]: https://github.com/huggingface/candle

pub mod batch;
pub mod cache;
pub mod denormal;
pub mod device;
pub mod dist;
pub mod dropout;
pub mod durable;
pub mod encoder;
mod error;
mod fault;
pub mod freeze;
pub mod hub;
pub mod loss;
pub mod memory;
pub mod models;
pub mod names;
pub mod nn;
pub mod params;
pub mod pool;
pub mod precision;
pub mod profile;
pub mod recompute;
pub mod replay;
pub mod rerank;
pub mod retrieval;
pub mod rng;
pub mod selfcheck;
mod sink;
pub mod stop;
pub mod train;

pub use train::budget;

pub use batch::{Batch, Chunking, TokenBatch, TokenVectors};
pub use cache::{
    cached, cat_reps, GradCache, GradientCache, Representations, StepOutput, StepPeaks, StepTimes,
};
pub use device::DeviceSpec;
pub use dist::{Collective, ReduceOp, Single};
pub use dropout::{ChunkSeed, Ctx, Dropout, NormStats};
pub use encoder::{Encoder, Network, Tower};
pub use error::{Error, Result, Side};
pub use loss::{
    ClipLoss, FnLoss, InfoNce, Loss, LossValue, MaxSim, MaxSimDistillation, Similarity,
    TeacherScores,
};
pub use models::{bert, densenet, lstm, resnet, sparse_static, toy, vnet};
pub use params::{Gradients, ParamStore, Params};
pub use precision::{LossScaler, Precision};
pub use recompute::{LayerStack, Recompute, Recomputed};

/// The README's code blocks, compiled and run as doctests so that they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The code blocks of the pages under `docs/`, compiled and run as doctests too.
#[cfg(doctest)]
pub mod docs_doctests {
    #[doc = include_str!("../docs/library.md")]
    pub struct Library;
    #[doc = include_str!("../docs/models.md")]
    pub struct Models;
    #[doc = include_str!("../docs/memory.md")]
    pub struct Memory;
    #[doc = include_str!("../docs/training.md")]
    pub struct Training;
    #[doc = include_str!("../docs/distributed.md")]
    pub struct Distributed;
    #[doc = include_str!("../docs/gpu.md")]
    pub struct Gpu;
    #[doc = include_str!("../docs/image-text.md")]
    pub struct ImageText;
    #[doc = include_str!("../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../docs/design.md")]
    pub struct Design;
    #[doc = include_str!("../docs/lora.md")]
    pub struct Lora;
    #[doc = include_str!("../docs/retrieval.md")]
    pub struct Retrieval;
}
