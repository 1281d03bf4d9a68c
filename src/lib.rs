//! # gradcache
//!
//! Contrastive learning with batches far larger than memory, on [candle].
//!
//! - [`cache`]: the gradient cache (GradCache, Gao et al. 2021): chunked representation
//!   pass without a graph, one loss over the whole batch, replay of every chunk from the
//!   cached representation gradients. Same gradients as a full-batch step, activation memory
//!   of one chunk. Entry point: [`GradCache::cache_step`].
//! - [`replay`]: the one primitive underneath: back-propagate a cotangent through a re-run
//!   computation (used per chunk by the cache and per segment by checkpointing).
//! - [`loss`]: InfoNCE with in-batch and hard negatives, temperature, dot/cosine,
//!   symmetric term, row-block computation.
//! - [`encoder`]: the [`Encoder`] trait the cache runs, and [`Tower`], which makes any
//!   candle model graph-free-capable by building it over trainable and detached weights.
//! - [`dist`]: collectives across processes (MPI for CPUs, NCCL for GPUs) for the
//!   distributed step: representations all-gathered, gradients reduced once per step.
//! - [`dropout`]: dropout whose masks are a pure function of explicit seeds, so every
//!   replay sees the masks of the representation pass bit for bit.
//! - [`params`]: the parameter store (seeded initialisation) and gradients keyed by name.
//! - [`batch`]: splitting and concatenating inputs along the batch dimension.
//! - [`nn`]: differentiable layers where candle's fused ones cut the graph.
//! - [`toy`]: tiny towers for tests, examples and benchmarks.
//!
//! The library never prints; errors are [`Error`].
//!
//! [candle]: https://github.com/huggingface/candle

pub mod batch;
pub mod bert;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod dist;
pub mod dropout;
pub mod encoder;
mod error;
pub mod export;
pub mod loss;
pub mod memory;
pub mod metrics;
pub mod nn;
pub mod optim;
pub mod params;
pub mod pretrained;
pub mod replay;
pub mod resume;
pub mod rng;
pub mod tokenizer;
pub mod toy;
pub mod trainer;

pub use batch::{Batch, TokenBatch};
pub use cache::{cached, cat_reps, GradCache, GradientCache, Representations, StepOutput};
pub use checkpoint::{Checkpointed, Checkpointing, LayerStack};
pub use dist::{Collective, ReduceOp, Single};
pub use dropout::{ChunkSeed, Ctx, Dropout};
pub use encoder::{Encoder, Network, Tower};
pub use error::{Error, Result, Side};
pub use loss::{FnLoss, InfoNce, Loss, LossValue, Similarity};
pub use params::{Gradients, ParamStore, Params};

/// The README's code blocks, compiled and run as doctests so that they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
