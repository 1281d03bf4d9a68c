//! Dropout whose masks come from explicit seeds, so they can be replayed bit for bit.
//!
//! The gradient cache runs every chunk twice (representation pass, then replay) and
//! activation checkpointing runs every segment twice again; the dropout masks of those
//! runs must be identical or the gradients are wrong. candle cannot snapshot or even seed the CPU RNG,
//! so a mask here is a pure function of the tuple
//! `(run seed, step, rank, tower, chunk, layer, site)`: the engine hands each chunk a
//! [`ChunkSeed`] naming the first five, and the model names the layer and the site
//! (which dropout inside the layer) when it applies [`Dropout`].

use candle_core::Tensor;

use crate::rng;
use crate::{Error, Result};

/// Where a chunk sits in training: everything a dropout mask depends on except the
/// layer and the site inside the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkSeed {
    /// The run's seed (from the config).
    pub run: u64,
    /// Optimizer step.
    pub step: u64,
    /// Process rank in distributed runs (0 otherwise).
    pub rank: u32,
    /// Tower (side) id: 0 for queries, 1 for passages, also when one encoder is shared.
    pub tower: u32,
    /// Index of the chunk within the tower's batch.
    pub chunk: u32,
}

impl ChunkSeed {
    /// The seed of the mask at `(layer, site)` of this chunk.
    pub fn mask_seed(&self, layer: u32, site: u32) -> u64 {
        rng::derive_seed(&[
            self.run,
            self.step,
            u64::from(self.rank),
            u64::from(self.tower),
            u64::from(self.chunk),
            u64::from(layer),
            u64::from(site),
        ])
    }
}

/// Per-forward context handed to encoders: `dropout` is `Some` in training (masks are drawn
/// from it) and `None` in evaluation (dropout is the identity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ctx {
    /// Seeds for this chunk's dropout masks; `None` disables dropout.
    pub dropout: Option<ChunkSeed>,
    /// The sub-layer sites a graph forward recomputes in its backward instead of keeping
    /// (selective recompute; set by [`Recomputed`](crate::Recomputed) from its policy).
    pub recompute: Sites,
    /// Which statistics layers with running statistics (BatchNorm) normalise with, and
    /// whether this forward updates them.
    pub norm: NormStats,
}

/// How a layer with running statistics (BatchNorm) behaves in one forward.
///
/// The gradient cache runs every chunk more than once: the representation pass, the
/// replay, and with checkpointing a graph-free forward and a recompute per segment. All of
/// them normalise with the batch statistics of the chunk's rows (the same rows, so the
/// same numbers, bit for bit), and only the representation pass moves the running
/// statistics: once per chunk and step, as a plain training step over that chunk would.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum NormStats {
    /// Evaluation: normalise with the running statistics.
    #[default]
    Running,
    /// Training: normalise with the statistics of the rows this forward sees and leave
    /// the running statistics alone (replays, checkpoint recomputes).
    Batch,
    /// Training, and fold this forward's batch statistics into the running statistics
    /// (the representation pass, or a plain training forward).
    BatchAndUpdate,
}

impl Ctx {
    /// The seed of the mask at `(layer, site)` of this chunk, `None` in evaluation.
    pub fn mask_seed(&self, layer: u32, site: u32) -> Option<u64> {
        self.dropout.map(|seed| seed.mask_seed(layer, site))
    }

    /// Evaluation: no dropout.
    pub fn eval() -> Self {
        Self::default()
    }

    /// Training with the masks of `seed`.
    pub fn train(seed: ChunkSeed) -> Self {
        Self {
            dropout: Some(seed),
            recompute: Sites::NONE,
            norm: NormStats::Batch,
        }
    }

    /// Training without dropout (batch statistics, no masks).
    pub fn train_without_dropout() -> Self {
        Self {
            norm: NormStats::Batch,
            ..Self::default()
        }
    }

    /// This context for the one forward per chunk that updates running statistics (the
    /// representation pass): `Batch` becomes `BatchAndUpdate`; evaluation stays as it is.
    pub fn updating_stats(self) -> Self {
        match self.norm {
            NormStats::Batch => Self {
                norm: NormStats::BatchAndUpdate,
                ..self
            },
            _ => self,
        }
    }

    /// This context for a forward that must not update running statistics (a replay).
    pub fn frozen_stats(self) -> Self {
        match self.norm {
            NormStats::BatchAndUpdate => Self {
                norm: NormStats::Batch,
                ..self
            },
            _ => self,
        }
    }
}

/// Inverted dropout with probability `p`, masks drawn from the context's [`ChunkSeed`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)`.
    pub fn new(p: f32) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidConfig {
                field: "dropout",
                value: p.to_string(),
                reason: "the drop probability must be in [0, 1)",
            });
        }
        Ok(Self { p })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The mask seed and drop probability of `(layer, site)` in the context's chunk, or
    /// `None` when this dropout is the identity (evaluation, `p == 0`).
    pub fn mask(&self, ctx: &Ctx, layer: u32, site: u32) -> Option<(u64, f32)> {
        match ctx.dropout {
            Some(seed) if self.p > 0.0 => Some((seed.mask_seed(layer, site), self.p)),
            _ => None,
        }
    }

    /// Applies dropout to `x` with the mask of `(layer, site)` in the context's chunk.
    /// Identity in evaluation or when `p == 0`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx, layer: u32, site: u32) -> Result<Tensor> {
        match ctx.dropout {
            Some(seed) if self.p > 0.0 => {
                crate::nn::dropout(x, seed.mask_seed(layer, site), self.p)
            }
            _ => Ok(x.clone()),
        }
    }
}

/// The sub-layer sites a layer recomputes, as a set of indices into
/// [`LayerStack::sites`](crate::recompute::LayerStack::sites) (at most 32). Carried in [`Ctx::recompute`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Sites(u32);

impl Sites {
    /// Nothing recomputed.
    pub const NONE: Sites = Sites(0);

    /// Whether site `index` (into [`LayerStack::sites`](crate::recompute::LayerStack::sites)) is recomputed.
    pub fn recomputes(self, index: usize) -> bool {
        index < 32 && self.0 & (1 << index) != 0
    }

    /// This set and site `index` (< 32).
    pub(crate) fn with(self, index: usize) -> Sites {
        Sites(self.0 | (1 << index))
    }
}
