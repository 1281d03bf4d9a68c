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
//!
//! Faults the loop survives:
//! - **another run on the directory**: the run holds `output_dir/gradcache.lock` (rank 0;
//!   see [`crate::train::lock`]) from its first write to its end;
//! - **SIGINT / SIGTERM** ([`Run::set_stop_signal`]): a step that has not reached the
//!   optimizer is abandoned (its data and BatchNorm statistics put back), one that has is
//!   finished; then a checkpoint of the last finished step is written and
//!   [`Error::Stopped`] returned. Every rank takes the same decision at the same point;
//! - **a failed write** (full disk, file size limit): the error ends the run; checkpoints
//!   are written atomically and the older ones are kept, so the last good one resumes;
//! - **a damaged checkpoint**: refused naming the file; resuming from a checkpoints root
//!   falls back to the newest intact one and says so;
//! - **non-finite values**: an f16 step whose loss or gradients overflow is skipped and the
//!   loss scale halves; in f32/bf16 a NaN or infinite loss or gradient norm stops the run
//!   naming the step and the batch's data lines, or skips the step
//!   (`train.on_nonfinite`). A skipped step changes no weight, no optimizer state and no
//!   BatchNorm statistic;
//! - **another number of ranks**: a checkpoint written by N processes resumes on M (the
//!   cached step computes the full-batch gradient whatever the world size).

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};

use crate::cache::GradCache;
use crate::dist::{self, Collective};
use crate::encoder::Encoder;
use crate::loss::Loss;
use crate::memory;
use crate::params::{ParamStore, Params};
use crate::precision::LossScaler;
use crate::stop::StopSignal;
use crate::train::checkpoint::{self, Extension, TrainerState};
use crate::train::config::{OnNonFinite, OptimConfig};
use crate::train::data::Position;
use crate::train::lock::RunLock;
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

mod best;
mod resume;
pub use best::BEST_DIR;
pub(super) use resume::check_fingerprint;

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

    /// The metrics of each named evaluation set of the last [`Task::evaluate`], which
    /// returned their mean; none by default (one set).
    fn take_eval_sets(&self) -> Vec<(String, RetrievalMetrics)> {
        Vec::new()
    }

    /// What judges the checkpoint kept as best, and the score of an evaluation by it
    /// (higher is better): `train.best_by`'s set or the mean, by nDCG@10; `None` (the
    /// default): no best checkpoint is kept.
    fn best_score(
        &self,
        _metrics: &RetrievalMetrics,
        _sets: &[(String, RetrievalMetrics)],
    ) -> Option<(String, f64)> {
        None
    }

    /// The name of the data source `batch` was drawn from, for the step's report (a
    /// mixture's); `None` by default.
    fn batch_source(&self, _batch: &Self::Batch) -> Option<String> {
        None
    }

    /// The chunk sizes the step ran with and the settings that lower them, for the error
    /// of a step that ran out of GPU memory: `(chunks, settings)`.
    fn chunk_settings(&self) -> (String, String) {
        ("the chunks as configured".into(), "the chunk sizes".into())
    }

    /// The batch's examples as a user finds them in the data (e.g. `lines 3, 17, 52 of
    /// train.jsonl`), for the error of a non-finite step.
    fn describe_batch(&self, batch: &Self::Batch) -> String {
        format!("{} pairs", self.batch_rows(batch))
    }

    /// Parameters trained at their own learning rate, as multiples of `lr` (the
    /// configured one) on the same schedule. None by default.
    fn lr_scales(&self, _lr: f64) -> Vec<(String, f64)> {
        Vec::new()
    }

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
    /// f32/bf16: what a step with a NaN or infinite loss or gradient norm does.
    pub on_nonfinite: OnNonFinite,
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
    /// The output directory's lock, once the run writes there (rank 0).
    lock: Option<RunLock>,
    /// The newest checkpoint this run wrote (or resumed from) in its own directory.
    saved: Option<(u64, PathBuf)>,
    /// The configuration's fingerprint without the run's length (text-pair runs).
    pub(super) length_free_fingerprint: Option<String>,
    /// Whether a resume may continue a checkpoint of another `train.steps` (`--extend`).
    pub(super) extend: bool,
    /// Every extension of this run to more steps, restored and written with checkpoints.
    extensions: Vec<Extension>,
    /// This process extended the run on resuming (reported once when it runs).
    just_extended: bool,
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
    /// Non-finite values: no weight, optimizer state or statistic changed.
    skipped: bool,
}

/// The values of the buffers (BatchNorm running statistics) before a step, to put back
/// when the step is skipped or abandoned: the representation pass moves them.
struct Buffers(Vec<(Var, Tensor)>);

impl Buffers {
    fn take(state: &Params) -> Result<Self> {
        Ok(Self(
            state
                .iter()
                .map(|(_, v)| Ok((v.clone(), v.as_tensor().copy()?)))
                .collect::<Result<_>>()?,
        ))
    }

    fn put_back(&self) -> Result<()> {
        for (var, value) in &self.0 {
            var.set(value)?;
        }
        Ok(())
    }
}

/// An evaluation's metrics (the mean over its sets) and each named set's.
type Evaluated = (RetrievalMetrics, Vec<(String, RetrievalMetrics)>);

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
        let optimizer = Optimizer::new(settings.optim.kind(), gc.params().clone())?
            .with_lr_scales(task.lr_scales(settings.optim.lr));
        crate::profile::set_device(&device);
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
            lock: None,
            saved: None,
            length_free_fingerprint: None,
            extend: false,
            extensions: Vec::new(),
            just_extended: false,
        })
    }

    /// Stops the run cleanly when `stop` is set (by [`StopSignal::install`]'s SIGINT and
    /// SIGTERM handlers, or by hand): see [`Self::run`].
    pub fn set_stop_signal(&mut self, stop: StopSignal) {
        self.gc.set_stop_signal(stop);
    }

    /// The flag that stops the run.
    pub fn stop_signal(&self) -> &StopSignal {
        self.gc.stop_signal()
    }

    /// Every extension of this run to more steps (`--extend`), oldest first.
    pub fn extensions(&self) -> &[Extension] {
        &self.extensions
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
    fn evaluate_on_root(&self) -> Result<Evaluated> {
        dist::from_root(&*self.comm, "the evaluation", || {
            let metrics = self.evaluate()?;
            Ok((metrics, self.task.take_eval_sets()))
        })
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
    ///
    /// A step that fails (abandoned on a stop request, [`Error::Interrupted`]; a
    /// non-finite loss under `on_nonfinite = "stop"`) puts the data position and the
    /// BatchNorm statistics back as they were: the run stands where it stood before the
    /// call. A skipped step ([`StepReport::skipped`]: non-finite values) counts
    /// and moves the data on, but changes no weight, optimizer state or statistic.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let _flush = crate::denormal::flush();
        let position = self.task.position(self.step);
        let buffers = Buffers::take(&self.gc.buffers()?)?;
        let batch = self.task.next_batch(self.step)?;
        crate::device::reset_pool_peaks(&self.device);
        // The profile of this step alone (not of an evaluation before it).
        drop(crate::profile::take());
        let start = Instant::now();
        let heap_at_start = memory::current_bytes();
        let (_, peak, out) = memory::measure(|| self.update(&batch, start));
        let u = match out {
            Ok(u) => u,
            Err(e) => {
                // The step did not count: the data and the statistics stand where they
                // stood (best effort; the step's own error is the one to report).
                let _ = buffers.put_back();
                let _ = self.task.seek(position, self.step);
                return Err(self.out_of_memory(e));
            }
        };
        if u.skipped {
            buffers.put_back()?;
        }
        self.step += 1;
        let every = self.settings.check_weights_every;
        if self.world_size() > 1
            && (cfg!(debug_assertions) || (every > 0 && self.step.is_multiple_of(every)))
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
            source: self.task.batch_source(&batch),
            phases: u.phases,
            phase_peaks: u.phase_peaks,
            flops: u.flops,
            loss_scaling: u.scaling,
            skipped: u.skipped,
            gpu_memory: crate::device::pool_memory(&self.device),
            profile: crate::profile::take(),
        })
    }

    /// `e` as [`Error::DeviceOutOfMemory`] when it is the GPU running out of memory
    /// (naming the device, the step, the chunk sizes and what to lower), else as it is.
    fn out_of_memory(&self, e: Error) -> Error {
        let text = e.to_string();
        if !is_out_of_memory(&text) {
            return e;
        }
        let (chunks, settings) = self.task.chunk_settings();
        Error::DeviceOutOfMemory {
            device: crate::device::describe(&self.device),
            step: self.step + 1,
            chunks,
            settings,
            detail: text,
        }
    }

    /// The work of a step, from the batch to the updated weights.
    fn update(&mut self, batch: &T::Batch, start: Instant) -> Result<Update> {
        let tokenize = crate::profile::phase("step.0 tokenize");
        let inputs = self.task.inputs(batch, &*self.comm);
        let (q, p) = dist::agree(&*self.comm, inputs)?;
        drop(tokenize);
        let tokenize_ms = ms(start.elapsed());
        let flops = self.task.step_flops(&q, &p)?;
        let loss_scale = self.scaler.map(|s| s.scale);
        let mut meter = memory::PhaseMeter::start();
        // A NaN or infinite loss is found before any replay, on every rank alike (each
        // computes it over the same gathered representations): an f16 forward that
        // overflowed, or a diverged run.
        let out = match self
            .gc
            .cache_step_scaled(self.step, &q, &p, loss_scale.unwrap_or(1.0))
        {
            Ok(out) => Ok(out),
            Err(Error::NonFiniteLoss { value }) => Err(value),
            Err(e) => return Err(e),
        };
        meter.lap();
        let optimizer_phase = crate::profile::phase("step.5 optimizer");
        let optimizer_start = Instant::now();
        let lr = self.schedule.lr_at(self.step);
        let max_norm = match self.settings.optim.max_grad_norm {
            0.0 => f64::INFINITY,
            n => n,
        };
        let mut loss = f32::NAN;
        let mut times = crate::cache::StepTimes::default();
        let mut peaks = crate::cache::StepPeaks::default();
        // Why the step cannot update, if it cannot: f16 unscales before clipping and checks
        // every gradient; f32/bf16 look at the loss and the gradient norm.
        let mut grad_norm = f64::NAN;
        let fault = match out {
            Err(value) => Some(format!("the loss is {value}")),
            Ok(out) => {
                (loss, times, peaks) = (out.loss, out.times, out.peaks);
                let mut grads = out.grads;
                let finite = match &self.scaler {
                    Some(scaler) => scaler.unscale(&mut grads)?,
                    None => true,
                };
                if finite {
                    grad_norm = clip_grad_norm(&mut grads, max_norm)?;
                }
                if finite && grad_norm.is_finite() {
                    self.optimizer.step(self.step, &grads, lr)?;
                    self.task.after_update(&self.gc)?;
                    None
                } else if !finite {
                    Some("a gradient holds inf or NaN".to_string())
                } else {
                    Some(format!("the gradient norm is {grad_norm}"))
                }
            }
        };
        let skipped = fault.is_some();
        match (&mut self.scaler, fault) {
            // f16: an overflow in the forward or the backward skips the step, and the
            // scale backs off.
            (Some(scaler), _) => scaler.update(!skipped),
            (None, None) => {}
            (None, Some(what)) => {
                if self.settings.on_nonfinite == OnNonFinite::Stop {
                    return Err(Error::NonFiniteStep {
                        step: self.step + 1,
                        what,
                        batch: self.task.describe_batch(batch),
                    });
                }
            }
        }
        drop(optimizer_phase);
        let (_, optimizer_peak) = meter.lap();
        let (t, m) = (times, peaks);
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
        let scaling = loss_scale.map(|used| LossScaling { used, skipped });
        Ok(Update {
            loss,
            lr,
            grad_norm,
            phases,
            phase_peaks,
            flops,
            scaling,
            skipped,
        })
    }

    /// The end of a run asked to stop by `signal`: a checkpoint of the last finished step
    /// (unless there is one), then [`Error::Stopped`].
    fn stop(&mut self, signal: i32, observer: &mut dyn Observer) -> Result<Error> {
        if self.step == 0 {
            // Nothing trained: a fresh run starts the same way again.
            return Ok(Error::Stopped {
                signal,
                step: 0,
                checkpoint: None,
            });
        }
        observer.event(&Event::Checkpointing(self.step))?;
        let (dir, new) = self.checkpoint_here()?;
        if new {
            observer.event(&Event::CheckpointSaved(dir.clone()))?;
        }
        Ok(Error::Stopped {
            signal,
            step: self.step,
            checkpoint: Some(dir),
        })
    }

    /// After a step, on every rank alike: the observer's outcome (rank 0's console and
    /// metrics file) agreed, then whether any rank was asked to stop.
    fn step_boundary(&self, observed: Result<()>) -> Result<Option<i32>> {
        dist::agree(&*self.comm, observed)?;
        dist::any_stop(&*self.comm, self.stop_signal().requested())
    }

    /// Runs until `steps`, evaluating before the first step (unless resumed), every
    /// `eval_every` steps and at the end, and writing a checkpoint every
    /// `checkpoint_every` steps and at the end. Returns the evaluations (first and last).
    ///
    /// Holds the output directory's lock while it runs. When the run's [`StopSignal`] is
    /// set (see [`Self::set_stop_signal`]), the current step is abandoned if it has not
    /// reached the optimizer and finished if it has; a checkpoint of the last finished
    /// step is written (no evaluation first) and the run returns [`Error::Stopped`] naming
    /// it. An evaluation already in progress finishes first.
    pub fn run(
        &mut self,
        observer: &mut dyn Observer,
    ) -> Result<(Option<RetrievalMetrics>, RetrievalMetrics)> {
        self.lock_output_dir()?;
        for note in std::mem::take(&mut self.notes) {
            observer.event(&Event::Note(note))?;
        }
        if std::mem::take(&mut self.just_extended) {
            if let Some(e) = self.extensions.last() {
                observer.event(&Event::Extended(e.clone()))?;
            }
        }
        // A stop asked for during the set-up: no evaluation first.
        if let Some(signal) = self.step_boundary(Ok(()))? {
            return Err(self.stop(signal, observer)?);
        }
        let before = if self.step == 0 {
            let (m, sets) = self.evaluate_on_root()?;
            let observed = observer.event(&Event::Eval {
                step: 0,
                metrics: m,
                sets,
            });
            dist::agree(&*self.comm, observed)?;
            Some(m)
        } else {
            None
        };
        let mut filled = 0;
        // The observer's outcome since the last agreement (rank 0's metrics file).
        let mut observed = Ok(());
        while self.step < self.settings.steps {
            let report = match self.train_step() {
                Ok(report) => report,
                Err(Error::Interrupted { signal }) => return Err(self.stop(signal, observer)?),
                Err(e) => return Err(e),
            };
            filled += report.filled_negatives;
            observed = observed.and_then(|()| observer.event(&Event::Step(report)));
            // A stop asked for during the step: its checkpoint, without the evaluation.
            let agreed = std::mem::replace(&mut observed, Ok(()));
            if let Some(signal) = self.step_boundary(agreed)? {
                return Err(self.stop(signal, observer)?);
            }
            let (eval_every, checkpoint_every) =
                (self.settings.eval_every, self.settings.checkpoint_every);
            let last = self.step == self.settings.steps;
            if eval_every > 0 && self.step.is_multiple_of(eval_every) && !last {
                let (m, sets) = self.evaluate_on_root()?;
                let best = self.task.best_score(&m, &sets);
                observed = observer.event(&Event::Eval {
                    step: self.step,
                    metrics: m,
                    sets,
                });
                if let Some((by, score)) = best {
                    if let Some(note) = self.keep_if_best(&by, score)? {
                        observed = observed.and_then(|()| observer.event(&Event::Note(note)));
                    }
                }
                if let Some(note) = self.task.eval_note(&self.gc)? {
                    let line = format!("step {}: {note}", self.step);
                    observed = observed.and_then(|()| observer.event(&Event::Note(line)));
                }
            }
            if (checkpoint_every > 0 && self.step.is_multiple_of(checkpoint_every)) || last {
                // The metrics up to this step are on disk before the checkpoint is: a run
                // killed after it resumes with none of its steps' lines missing.
                observed = observed.and_then(|()| observer.event(&Event::Checkpointing(self.step)));
                let (dir, new) = self.checkpoint_here()?;
                if new {
                    observed = observed.and_then(|()| observer.event(&Event::CheckpointSaved(dir)));
                }
            }
        }
        dist::agree(&*self.comm, observed)?;
        if filled > 0 {
            observer.event(&Event::Note(format!(
                "{filled} missing hard negatives were filled with positives of other pairs"
            )))?;
        }
        if self.world_size() > 1 {
            let sum = dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
            observer.event(&Event::Note(format!(
                "all {} ranks hold identical weights (checksum {sum:016x})",
                self.world_size()
            )))?;
        }
        let (after, sets) = self.evaluate_on_root()?;
        let best = self.task.best_score(&after, &sets);
        observer.event(&Event::Eval {
            step: self.step,
            metrics: after,
            sets,
        })?;
        if let Some((by, score)) = best {
            if let Some(note) = self.keep_if_best(&by, score)? {
                observer.event(&Event::Note(note))?;
            }
        }
        if let Some(note) = self.task.finish(&self.gc, self.step)? {
            observer.event(&Event::Note(note))?;
        }
        Ok((before, after))
    }
}

/// Whether an error's text is the GPU running out of memory (cudarc's driver error for a
/// failed allocation, or cuBLAS failing to allocate its workspace).
fn is_out_of_memory(text: &str) -> bool {
    [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "out of memory",
    ]
    .iter()
    .any(|m| text.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_out_of_memory_error_names_the_device_the_step_and_what_to_lower() {
        let driver = candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        );
        assert!(is_out_of_memory(&Error::Candle(driver).to_string()));
        assert!(is_out_of_memory("cuBLAS: CUBLAS_STATUS_ALLOC_FAILED"));
        assert!(!is_out_of_memory(
            "matmul is only supported for contiguous tensors"
        ));
        let e = Error::DeviceOutOfMemory {
            device: "cuda:0".into(),
            step: 7,
            chunks: "chunks of 256 queries and 256 passages".into(),
            settings: "train.query_chunk and train.passage_chunk".into(),
            detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        }
        .to_string();
        for part in [
            "`cuda:0` ran out of memory in step 7",
            "chunks of 256 queries",
            "lower train.query_chunk and train.passage_chunk",
            "train.memory_budget",
            "no checkpoint was written",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }
}
