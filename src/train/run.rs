//! The one training loop every task runs: [`Run`] over a [`Task`].
//!
//! A task (text pairs: [`Trainer`](crate::train::Trainer); image-text:
//! [`ImageTextTrainer`](crate::train::image_text::ImageTextTrainer); the next ones)
//! supplies what is its own: the towers and the loss (inside the [`GradCache`] it builds),
//! its batches and where its data stands, how a batch becomes this rank's inputs, and its
//! evaluation. The loop supplies the rest, once: the steps (gradient cache, the f16 loss
//! scaler, clipping, the optimizer and its schedule), the evaluation schedule, checkpoints
//! and exact resume, what each step reports, the identical-weights check across ranks.
//!
//! One step counter: [`Run::step`] counts the updates done; the same number names the
//! dropout masks of the step ([`GradCache::cache_step`]), its learning rate
//! ([`Schedule::lr_at`]) and AdamW's bias correction ([`Optimizer::step`]).
//!
//! Resume is exact: weights (and buffers such as BatchNorm statistics) and optimizer
//! moments are stored as f32, the step and the task's data position are stored, dropout
//! masks derive from (seed, step, ...), and the learning rate from the step. With the same
//! thread count on CPU, every later step's loss equals that of an uninterrupted run bit
//! for bit.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use crate::cache::GradCache;
use crate::dist::{self, Collective};
use crate::encoder::Encoder;
use crate::loss::Loss;
use crate::memory;
use crate::params::{ParamStore, Params};
use crate::precision::LossScaler;
use crate::train::checkpoint::{self, TrainerState};
use crate::train::config::OptimConfig;
use crate::train::data::Position;
use crate::train::metrics::RetrievalMetrics;
use crate::train::optim::{clip_grad_norm, Optimizer, Schedule};
use crate::train::report::{Event, LossScaling, Observer, PhasePeaks, PhaseTimes, StepReport};
use crate::{Error, Result};

/// The gradient cache of a task: its towers and its loss.
pub type TaskCache<T> = GradCache<<T as Task>::Query, <T as Task>::Passage, <T as Task>::Loss>;

/// One chunk of the query (or image) tower's input.
pub type QueryInput<T> = <<T as Task>::Query as Encoder>::Input;

/// One chunk of the passage (or text) tower's input.
pub type PassageInput<T> = <<T as Task>::Passage as Encoder>::Input;

/// What a kind of training supplies to the loop: its data, its inputs, its evaluation.
/// Its towers and loss are the [`GradCache`] handed to [`Run::from_parts`].
pub trait Task: Sized {
    /// The query-side (or image) tower.
    type Query: Encoder;
    /// The passage-side (or text) tower.
    type Passage: Encoder;
    /// The loss over the batch's representations.
    type Loss: Loss;
    /// One global batch, as the data gives it.
    type Batch;
    /// The task's configuration.
    type Config;

    /// The configuration.
    fn config(&self) -> &Self::Config;

    /// The global batch of update `step` (the data advances).
    fn next_batch(&mut self, step: u64) -> Result<Self::Batch>;

    /// Pairs in `batch` (the global batch: what `pairs_per_sec` counts).
    fn batch_rows(&self, batch: &Self::Batch) -> usize;

    /// Hard negatives of `batch` that were missing and filled from other pairs.
    fn filled_negatives(&self, _batch: &Self::Batch) -> usize {
        0
    }

    /// This rank's share of `batch` as the towers' inputs.
    fn inputs(
        &self,
        batch: &Self::Batch,
        comm: &dyn Collective,
    ) -> Result<(QueryInput<Self>, PassageInput<Self>)>;

    /// Matrix-product FLOPs a cached step runs on these inputs (0 when not counted).
    fn step_flops(
        &self,
        _queries: &QueryInput<Self>,
        _passages: &PassageInput<Self>,
    ) -> Result<f64> {
        Ok(0.0)
    }

    /// Where the data stands after `step` updates (stored in checkpoints).
    fn position(&self, step: u64) -> Position;

    /// Moves the data to `position`, read from a checkpoint taken after `step` updates.
    fn seek(&mut self, position: Position, step: u64) -> Result<()>;

    /// Retrieval metrics on the held-out data (evaluation mode: no dropout).
    fn evaluate(&self, gc: &TaskCache<Self>) -> Result<RetrievalMetrics>;

    /// Runs after every optimizer update (a learnable temperature is clamped here).
    fn after_update(&self, _gc: &TaskCache<Self>) -> Result<()> {
        Ok(())
    }

    /// A line for the log after an evaluation during the run.
    fn eval_note(&self, _gc: &TaskCache<Self>) -> Result<Option<String>> {
        Ok(None)
    }

    /// Runs once at the end of [`Run::run`] on every rank (after the last evaluation);
    /// returns a line for the log.
    fn finish(&self, _gc: &TaskCache<Self>, _step: u64) -> Result<Option<String>> {
        Ok(None)
    }
}

/// What the loop needs from a task's configuration.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// The run's directory: checkpoints go to `checkpoints/` under it.
    pub output_dir: PathBuf,
    /// Optimizer updates in all.
    pub steps: u64,
    /// Evaluate every this many steps (0: only before and after).
    pub eval_every: u64,
    /// Checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Optimizer, learning rate, warmup and clipping.
    pub optim: OptimConfig,
    /// Check that every rank holds identical weights every this many steps (0: only at the
    /// end; every step in debug builds).
    pub check_weights_every: u64,
    /// f16: the dynamic loss scaler it starts from.
    pub loss_scaler: Option<LossScaler>,
    /// A fingerprint of what the run trains; a checkpoint of another is refused.
    pub fingerprint: String,
    /// What may change between a run and its resume, for the refusal's message.
    pub may_change: &'static str,
}

/// A training run of task `T`.
pub struct Run<T: Task> {
    pub(super) task: T,
    pub(super) gc: TaskCache<T>,
    pub(super) store: ParamStore,
    pub(super) device: Device,
    pub(super) comm: Rc<dyn Collective>,
    pub(super) notes: Vec<String>,
    settings: LoopConfig,
    optimizer: Optimizer,
    schedule: Schedule,
    scaler: Option<LossScaler>,
    step: u64,
}

/// What the update of a step measured (the rest of its [`StepReport`]).
struct Update {
    loss: f32,
    lr: f64,
    grad_norm: f64,
    phases: PhaseTimes,
    phase_peaks: PhasePeaks,
    flops: f64,
    scaling: Option<LossScaling>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl<T: Task> Run<T> {
    /// A run at step 0 of `task` with its towers and loss in `gc` (whose parameters live
    /// in `store`), over the processes of `comm`; `notes` are the set-up's lines for the
    /// log.
    pub fn from_parts(
        task: T,
        gc: TaskCache<T>,
        store: ParamStore,
        device: Device,
        comm: Rc<dyn Collective>,
        settings: LoopConfig,
        notes: Vec<String>,
    ) -> Result<Self> {
        let optimizer = Optimizer::new(settings.optim.kind(), gc.params().clone())?;
        let schedule = Schedule {
            lr: settings.optim.lr,
            warmup: settings.optim.warmup(settings.steps),
            total: settings.steps,
        };
        Ok(Self {
            task,
            gc,
            store,
            device,
            comm,
            notes,
            scaler: settings.loss_scaler,
            settings,
            optimizer,
            schedule,
            step: 0,
        })
    }

    /// Restores weights, buffers, optimizer state, data position, step and loss scaler from
    /// a checkpoint (a `step-N` directory, or a checkpoints root: then the newest) written
    /// with the same configuration. Every rank reads it; a failure on one fails all. A
    /// checkpoint of another configuration is refused before anything changes; after a
    /// later failure (a missing tensor, a data position the task cannot reach) the run is
    /// partly restored and should be dropped.
    pub fn restore(&mut self, path: &Path) -> Result<()> {
        let restored = self.restore_local(path);
        dist::agree(&*self.comm, restored)
    }

    fn restore_local(&mut self, path: &Path) -> Result<()> {
        let ckpt = checkpoint::load(path, &self.device)?;
        check_fingerprint(
            &self.settings.fingerprint,
            self.settings.may_change,
            &ckpt.dir,
            &ckpt.state,
        )?;
        checkpoint::restore(&self.gc.state()?, &ckpt.model, &ckpt.dir)?;
        self.optimizer.load_state(&ckpt.optimizer)?;
        self.task
            .seek(ckpt.state.data, ckpt.state.step)
            .map_err(|e| Error::CheckpointMismatch {
                what: format!("the data position of {}", ckpt.dir.display()),
                detail: e.to_string(),
            })?;
        self.step = ckpt.state.step;
        if self.scaler.is_some() {
            self.scaler = ckpt.state.loss_scaler.or(self.scaler);
        }
        self.notes.push(format!(
            "resumed from {} at step {}",
            ckpt.dir.display(),
            self.step
        ));
        Ok(())
    }

    /// Notes of the set-up (device, memory plan, data), as the log shows them.
    pub fn setup_notes(&self) -> &[String] {
        &self.notes
    }

    /// This process's rank (0 in a single-process run).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The collective the run uses.
    pub fn collective(&self) -> &dyn Collective {
        &*self.comm
    }

    /// Updates done so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &T::Config {
        self.task.config()
    }

    /// The task.
    pub fn task(&self) -> &T {
        &self.task
    }

    /// The task, to change what the loop does not own (its data, its evaluation set).
    pub fn task_mut(&mut self) -> &mut T {
        &mut self.task
    }

    /// Every trainable parameter.
    pub fn params(&self) -> &Params {
        self.gc.params()
    }

    /// Everything a checkpoint holds besides the optimizer: parameters, buffers (BatchNorm
    /// statistics), loss parameters (a learnable temperature).
    pub fn state(&self) -> Result<Params> {
        self.gc.state()
    }

    /// The gradient cache (towers and loss).
    pub fn gradient_cache(&self) -> &TaskCache<T> {
        &self.gc
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The optimizer's state (AdamW's moments, by `m.<name>` / `v.<name>`), as a
    /// checkpoint writes it.
    pub fn optimizer_state(&self) -> Result<std::collections::BTreeMap<String, Tensor>> {
        self.optimizer.state()
    }

    /// Retrieval metrics on the held-out data, computed by this process.
    pub fn evaluate(&self) -> Result<RetrievalMetrics> {
        let _flush = crate::denormal::flush();
        self.task.evaluate(&self.gc)
    }

    /// Evaluates on rank 0 only; every rank receives rank 0's metrics (a failure there
    /// stops every rank).
    fn evaluate_on_root(&self) -> Result<RetrievalMetrics> {
        dist::from_root(&*self.comm, "the evaluation", || self.evaluate())
    }

    /// Times one gradient-cache step over `batch` (its inputs prepared as a training
    /// batch's, dropout of the current step) and changes nothing: no update, no step
    /// counted, the data position untouched. The same batch timed at different points of a
    /// run shows what the weights alone do to the speed (subnormal floats: see
    /// [`crate::denormal`]); `benches/train_step.rs` does that.
    pub fn time_step(&self, batch: &T::Batch) -> Result<PhaseTimes> {
        let _flush = crate::denormal::flush();
        let start = Instant::now();
        let (q, p) = self.task.inputs(batch, &*self.comm)?;
        let tokenize_ms = ms(start.elapsed());
        let out = self.gc.cache_step(self.step, &q, &p)?;
        let t = out.times;
        Ok(PhaseTimes {
            tokenize_ms,
            represent_ms: ms(t.represent),
            loss_ms: ms(t.loss),
            replay_ms: ms(t.replay),
            reduce_ms: ms(t.reduce),
            optimizer_ms: 0.0,
        })
    }

    /// One optimizer step on the next (global) batch; in a distributed run this rank
    /// encodes its share and every rank applies the same reduced gradients.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let _flush = crate::denormal::flush();
        let batch = self.task.next_batch(self.step)?;
        let start = Instant::now();
        let heap_at_start = memory::current_bytes();
        let (_, peak, out) = memory::measure(|| self.update(&batch, start));
        let u = out?;
        self.step += 1;
        let every = self.settings.check_weights_every;
        if self.world_size() > 1
            && (cfg!(debug_assertions) || (every > 0 && self.step % every == 0))
        {
            dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
        }
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        Ok(StepReport {
            step: self.step,
            loss: u.loss,
            lr: u.lr,
            grad_norm: u.grad_norm,
            pairs_per_sec: self.task.batch_rows(&batch) as f64 / secs,
            peak_bytes: peak,
            heap_peak_bytes: if peak > 0 { heap_at_start + peak } else { 0 },
            filled_negatives: self.task.filled_negatives(&batch),
            phases: u.phases,
            phase_peaks: u.phase_peaks,
            flops: u.flops,
            loss_scaling: u.scaling,
        })
    }

    /// The work of a step, from the batch to the updated weights.
    fn update(&mut self, batch: &T::Batch, start: Instant) -> Result<Update> {
        let inputs = self.task.inputs(batch, &*self.comm);
        let (q, p) = dist::agree(&*self.comm, inputs)?;
        let tokenize_ms = ms(start.elapsed());
        let flops = self.task.step_flops(&q, &p)?;
        let loss_scale = self.scaler.map(|s| s.scale);
        let mut meter = memory::PhaseMeter::start();
        let out = self
            .gc
            .cache_step_scaled(self.step, &q, &p, loss_scale.unwrap_or(1.0))?;
        meter.lap();
        let optimizer_start = Instant::now();
        let mut grads = out.grads;
        // f16: unscale before clipping; a step with an inf or NaN gradient changes no
        // weight and no optimizer state, and the scale backs off.
        let finite = match &mut self.scaler {
            Some(scaler) => {
                let finite = scaler.unscale(&mut grads)?;
                scaler.update(finite);
                finite
            }
            None => true,
        };
        let max_norm = match self.settings.optim.max_grad_norm {
            0.0 => f64::INFINITY,
            n => n,
        };
        let lr = self.schedule.lr_at(self.step);
        let grad_norm = if finite {
            let norm = clip_grad_norm(&mut grads, max_norm)?;
            self.optimizer.step(self.step, &grads, lr)?;
            self.task.after_update(&self.gc)?;
            norm
        } else {
            f64::NAN
        };
        let (_, optimizer_peak) = meter.lap();
        let (t, m) = (out.times, out.peaks);
        let phase_peaks = PhasePeaks {
            represent: m.represent,
            loss: m.loss,
            replay: m.replay,
            reduce: m.reduce,
            optimizer: optimizer_peak,
        };
        let phases = PhaseTimes {
            tokenize_ms,
            represent_ms: ms(t.represent),
            loss_ms: ms(t.loss),
            replay_ms: ms(t.replay),
            reduce_ms: ms(t.reduce),
            optimizer_ms: ms(optimizer_start.elapsed()),
        };
        let scaling = loss_scale.map(|used| LossScaling {
            used,
            skipped: !finite,
        });
        Ok(Update {
            loss: out.loss,
            lr,
            grad_norm,
            phases,
            phase_peaks,
            flops,
            scaling,
        })
    }

    /// Writes a training checkpoint of the current state under `output_dir/checkpoints`.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let state = TrainerState {
            step: self.step,
            data: self.task.position(self.step),
            config_fingerprint: self.settings.fingerprint.clone(),
            loss_scaler: self.scaler,
        };
        checkpoint::save(
            &self.settings.output_dir.join("checkpoints"),
            &self.gc.state()?,
            &self.optimizer.state()?,
            &state,
            self.settings.keep_checkpoints,
        )
    }

    /// Runs until `steps`, evaluating before the first step (unless resumed), every
    /// `eval_every` steps and at the end, and writing a checkpoint every
    /// `checkpoint_every` steps and at the end. Returns the evaluations (first and last).
    pub fn run(
        &mut self,
        observer: &mut dyn Observer,
    ) -> Result<(Option<RetrievalMetrics>, RetrievalMetrics)> {
        if self.rank() == 0 {
            let dir = &self.settings.output_dir;
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        }
        for note in std::mem::take(&mut self.notes) {
            observer.event(&Event::Note(note));
        }
        let before = if self.step == 0 {
            let m = self.evaluate_on_root()?;
            observer.event(&Event::Eval {
                step: 0,
                metrics: m,
            });
            Some(m)
        } else {
            None
        };
        let mut filled = 0;
        while self.step < self.settings.steps {
            let report = self.train_step()?;
            filled += report.filled_negatives;
            observer.event(&Event::Step(report));
            let s = &self.settings;
            let last = self.step == s.steps;
            if s.eval_every > 0 && self.step % s.eval_every == 0 && !last {
                let m = self.evaluate_on_root()?;
                observer.event(&Event::Eval {
                    step: self.step,
                    metrics: m,
                });
                if let Some(note) = self.task.eval_note(&self.gc)? {
                    observer.event(&Event::Note(format!("step {}: {note}", self.step)));
                }
            }
            if (s.checkpoint_every > 0 && self.step % s.checkpoint_every == 0) || last {
                let saved = if self.rank() == 0 {
                    self.save_checkpoint().map(Some)
                } else {
                    Ok(None)
                };
                if let Some(dir) = dist::agree(&*self.comm, saved)? {
                    observer.event(&Event::CheckpointSaved(dir));
                }
            }
        }
        if filled > 0 {
            observer.event(&Event::Note(format!(
                "{filled} missing hard negatives were filled with positives of other pairs"
            )));
        }
        if self.world_size() > 1 {
            let sum = dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
            observer.event(&Event::Note(format!(
                "all {} ranks hold identical weights (checksum {sum:016x})",
                self.world_size()
            )));
        }
        let after = self.evaluate_on_root()?;
        observer.event(&Event::Eval {
            step: self.step,
            metrics: after,
        });
        if let Some(note) = self.task.finish(&self.gc, self.step)? {
            observer.event(&Event::Note(note));
        }
        Ok((before, after))
    }
}

/// A checkpoint must have been written with this configuration (fingerprint `expected`);
/// `may_change` says what may differ between a run and its resume.
pub(super) fn check_fingerprint(
    expected: &str,
    may_change: &str,
    dir: &Path,
    state: &TrainerState,
) -> Result<()> {
    if state.config_fingerprint != expected {
        return Err(Error::CheckpointMismatch {
            what: format!("checkpoint {}", dir.display()),
            detail: format!(
                "it was written with another configuration (only {may_change} may change)"
            ),
        });
    }
    Ok(())
}
