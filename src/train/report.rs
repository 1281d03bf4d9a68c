//! What a training run reports: a [`StepReport`] per optimizer step (loss, learning rate,
//! gradient norm, speed, memory and the time of each phase) and the [`Event`]s an
//! [`Observer`] sees (the binary's console and metrics file, or [`Quiet`]). Every task's
//! trainer reports through these.

use std::path::PathBuf;

use crate::train::metrics::RetrievalMetrics;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step just completed (1-based count of updates).
    pub step: u64,
    /// Loss over the whole batch.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Query/positive pairs per second for this step.
    pub pairs_per_sec: f64,
    /// Peak bytes allocated during the step (0 unless the binary counts allocations).
    pub peak_bytes: usize,
    /// The heap's peak during the step: the bytes in use when it began (weights,
    /// optimizer state, data) plus `peak_bytes` (what `train.memory_budget` bounds; 0
    /// unless the binary counts allocations).
    pub heap_peak_bytes: usize,
    /// Hard negatives that were missing and filled from other pairs.
    pub filled_negatives: usize,
    /// The data source the batch was drawn from (a mixture's; `None` for one source).
    pub source: Option<String>,
    /// Wall time of each phase of the step.
    pub phases: PhaseTimes,
    /// Peak heap bytes of each phase above the step's start (0 unless the binary counts
    /// allocations).
    pub phase_peaks: PhasePeaks,
    /// Matrix-product FLOPs the step executed: this rank's sequences at their real
    /// lengths (on the CPU in f32, where the layers skip padding; elsewhere the chunks at
    /// their padded lengths), through every pass the engine runs (graph-free forward, replay forward
    /// and its backward, and the recompute forward when on). See
    /// [`BertConfig::forward_flops`](crate::bert::BertConfig::forward_flops).
    pub flops: f64,
    /// f16 training: the loss scale this step used, and whether the step was skipped.
    pub loss_scaling: Option<LossScaling>,
    /// The step met a NaN or infinite loss or gradient (an f16 overflow, or
    /// `train.on_nonfinite = "skip"`) and changed no weight, optimizer state or statistic.
    pub skipped: bool,
    /// On a GPU, its memory pool during the step: the most in use at once (the high mark
    /// of what the tensors really held) and the most the pool held from the driver; `None`
    /// on the CPU.
    pub gpu_memory: Option<crate::device::PoolMemory>,
    /// Where the step's time went, with `GRADCACHE_PROFILE=1` ([`crate::profile`]);
    /// empty otherwise.
    pub profile: Vec<crate::profile::Entry>,
}

/// What the dynamic loss scaler did in a step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LossScaling {
    /// The scale the step's loss gradient was multiplied by.
    pub used: f64,
    /// The gradients held an inf or NaN: no weight or optimizer state changed, and the
    /// scale backed off for the next step.
    pub skipped: bool,
}

/// Peak heap bytes of the phases of a training step, each above the bytes allocated when
/// the step's computation began (after tokenizing): what the weights, the optimizer state
/// and the batch leave free is what a phase may use.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhasePeaks {
    /// The graph-free representation pass.
    pub represent: usize,
    /// The loss and the cached gradients.
    pub loss: usize,
    /// The replay of every chunk.
    pub replay: usize,
    /// The gradient all-reduce.
    pub reduce: usize,
    /// Clipping and the optimizer update.
    pub optimizer: usize,
}

/// Wall time of the phases of a training step, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// Tokenizing this rank's share of the batch.
    pub tokenize_ms: f64,
    /// The graph-free representation pass.
    pub represent_ms: f64,
    /// The loss over the global batch and its gradient (with the all-gather).
    pub loss_ms: f64,
    /// The replay of every chunk.
    pub replay_ms: f64,
    /// The gradient all-reduce across ranks.
    pub reduce_ms: f64,
    /// Clipping and the optimizer update.
    pub optimizer_ms: f64,
}

impl PhaseTimes {
    /// The sum of the phases.
    pub fn total_ms(&self) -> f64 {
        self.tokenize_ms
            + self.represent_ms
            + self.loss_ms
            + self.replay_ms
            + self.reduce_ms
            + self.optimizer_ms
    }
}

/// Something the trainer reports while it runs.
#[derive(Debug, Clone)]
pub enum Event {
    /// An optimizer step finished.
    Step(StepReport),
    /// An evaluation finished (at `step` updates).
    Eval {
        /// Updates done when it ran.
        step: u64,
        /// Retrieval metrics on the held-out pairs (with several evaluation sets, their
        /// mean).
        metrics: RetrievalMetrics,
        /// Each named evaluation set's metrics (`[[data.evals]]`); empty with one set.
        sets: Vec<(String, RetrievalMetrics)>,
    },
    /// A training checkpoint of this step is about to be written (what was observed so
    /// far belongs on disk first).
    Checkpointing(u64),
    /// A training checkpoint was written to this directory.
    CheckpointSaved(PathBuf),
    /// A fact worth a log line.
    Note(String),
    /// The run was resumed with `--extend` to more steps (`metrics.jsonl` records it).
    Extended(crate::train::checkpoint::Extension),
}

/// Receives the trainer's events (the binary draws and logs them, and writes
/// `metrics.jsonl`).
pub trait Observer {
    /// Called for every event, in order. A failure (the metrics file cannot be written)
    /// ends the run with it, after the step in progress (every rank stops alike).
    fn event(&mut self, event: &Event) -> crate::Result<()>;
}

/// An observer that ignores everything.
pub struct Quiet;

impl Observer for Quiet {
    fn event(&mut self, _: &Event) -> crate::Result<()> {
        Ok(())
    }
}
