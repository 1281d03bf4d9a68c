//! Faults a long run meets, survived by the training loop (library side; the binary's
//! signals, file size limits and MPI ranks are in tests/it/faults_cli.rs):
//!
//! - a second run on one output directory is refused naming the first; a lock left by a
//!   process that is gone is taken over, one of another host or a live process is not;
//! - a stop asked for in the middle of a step's representation pass or replay abandons the
//!   step: step, data position, weights, optimizer state and BatchNorm statistics are as
//!   before, and the run continues bit for bit as one that was never stopped;
//! - a stop after a step writes a checkpoint of it and returns `Error::Stopped`; resuming
//!   from the checkpoints root gives the uninterrupted run bit for bit;
//! - a NaN loss stops the run naming the step and its batch (`on_nonfinite = "stop"`) or
//!   skips the step changing nothing (`"skip"`); in the text trainer the error names the
//!   data lines of the batch;
//! - an f16 forward that overflows is skipped like a backward that does, and the loss
//!   scale halves.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use gradcache::dist::{Collective, Single};
use gradcache::nn::BatchNorm;
use gradcache::params::Gradients;
use gradcache::stop::{StopSignal, SIGINT, SIGTERM};
use gradcache::train::config::{Config, OnNonFinite};
use gradcache::train::data::Position;
use gradcache::train::lock::{LockOwner, LOCK_FILE};
use gradcache::train::metrics::{evaluate, RetrievalMetrics};
use gradcache::train::run::TaskCache;
use gradcache::train::{Event, LoopConfig, Observer, Quiet, Run, Task, Trainer};
use gradcache::{
    Ctx, Encoder, Error, GradCache, InfoNce, Network, ParamStore, Params, Similarity, Tower,
};

use crate::common;
use crate::common::{bits, write_tiny_run};

const DIM: usize = 12;
const BATCH: usize = 16;

/// A linear layer and BatchNorm: a tower with running statistics, which the
/// representation pass moves.
struct LinearBn {
    linear: candle_nn::Linear,
    norm: BatchNorm,
}

impl LinearBn {
    fn new(vb: VarBuilder) -> gradcache::Result<Self> {
        Ok(Self {
            linear: candle_nn::linear(DIM, 16, vb.pp("linear"))?,
            norm: BatchNorm::new(16, vb.pp("norm"))?,
        })
    }
}

impl Network for LinearBn {
    type Input = Tensor;

    fn forward(&self, input: &Tensor, ctx: &Ctx) -> gradcache::Result<Tensor> {
        self.norm.forward(&self.linear.forward(input)?, ctx)
    }
}

/// Which call of a tower asks the run to stop (as a signal handler would, mid-step).
#[derive(Clone, Copy, PartialEq)]
enum StopAt {
    Never,
    /// After the n-th chunk of the representation pass (counted from 1 over the run).
    Encode(usize),
    /// After the n-th chunk replayed.
    Replay(usize),
}

/// A tower that can ask for a stop from inside a step.
struct Stopping {
    inner: Tower<LinearBn>,
    stop: StopSignal,
    at: Cell<StopAt>,
    encodes: Cell<usize>,
    replays: Cell<usize>,
}

impl Encoder for Stopping {
    type Input = Tensor;

    fn params(&self) -> &Params {
        self.inner.params()
    }

    fn buffers(&self) -> Params {
        Encoder::buffers(&self.inner)
    }

    fn encode(&self, input: &Tensor, ctx: &Ctx) -> gradcache::Result<Tensor> {
        let out = self.inner.encode(input, ctx)?;
        self.encodes.set(self.encodes.get() + 1);
        if self.at.get() == StopAt::Encode(self.encodes.get()) {
            self.stop.request(SIGTERM);
        }
        Ok(out)
    }

    fn forward(&self, input: &Tensor, ctx: &Ctx) -> gradcache::Result<Tensor> {
        self.inner.forward(input, ctx)
    }

    fn replay(
        &self,
        input: &Tensor,
        cotangent: &Tensor,
        ctx: &Ctx,
    ) -> gradcache::Result<Gradients> {
        let out = self.inner.replay(input, cotangent, ctx)?;
        self.replays.set(self.replays.get() + 1);
        if self.at.get() == StopAt::Replay(self.replays.get()) {
            self.stop.request(SIGINT);
        }
        Ok(out)
    }
}

/// Feature-vector pairs; `poison` makes the queries of that step NaN.
struct Vectors {
    train: (Tensor, Tensor),
    eval: (Tensor, Tensor),
    poison: Option<u64>,
}

impl Vectors {
    fn new() -> Self {
        let map = common::random(3, &[DIM, DIM]);
        let pairs = |s: u64, rows: usize| {
            let q = common::random(s, &[rows, DIM]);
            let p = q.matmul(&map).unwrap();
            (q, p)
        };
        Self {
            train: pairs(13, 4 * BATCH),
            eval: pairs(23, 32),
            poison: None,
        }
    }

    fn per_epoch(&self) -> u64 {
        (self.train.0.dim(0).unwrap() / BATCH) as u64
    }
}

impl Task for Vectors {
    type Query = Stopping;
    type Passage = Stopping;
    type Loss = InfoNce;
    /// The step the batch belongs to, and its rows.
    type Batch = (u64, Tensor, Tensor);
    type Config = ();

    fn config(&self) -> &() {
        &()
    }

    fn next_batch(&mut self, step: u64) -> gradcache::Result<Self::Batch> {
        let start = (step % self.per_epoch()) as usize * BATCH;
        Ok((
            step,
            self.train.0.narrow(0, start, BATCH)?,
            self.train.1.narrow(0, start, BATCH)?,
        ))
    }

    fn batch_rows(&self, batch: &Self::Batch) -> usize {
        batch.1.dim(0).unwrap_or(0)
    }

    fn describe_batch(&self, batch: &Self::Batch) -> String {
        format!("the vectors of step {}", batch.0 + 1)
    }

    fn inputs(
        &self,
        batch: &Self::Batch,
        _comm: &dyn Collective,
    ) -> gradcache::Result<(Tensor, Tensor)> {
        let q = if self.poison == Some(batch.0) {
            (&batch.1 * f64::NAN)?
        } else {
            batch.1.clone()
        };
        Ok((q, batch.2.clone()))
    }

    fn position(&self, step: u64) -> Position {
        Position {
            epoch: step / self.per_epoch(),
            offset: (step % self.per_epoch()) as usize * BATCH,
        }
    }

    fn seek(&mut self, position: Position, step: u64) -> gradcache::Result<()> {
        if position != self.position(step) {
            return Err(Error::InvalidArgument {
                what: "position",
                value: format!("{position:?}"),
                reason: "is not where that step starts",
            });
        }
        Ok(())
    }

    fn evaluate(&self, gc: &TaskCache<Self>) -> gradcache::Result<RetrievalMetrics> {
        let ctx = Ctx::eval();
        let q = gc.query_encoder().encode(&self.eval.0, &ctx)?;
        let p = gc.passage_encoder().encode(&self.eval.1, &ctx)?;
        let targets: Vec<usize> = (0..q.dim(0)?).collect();
        evaluate(&q, &p, &targets, Similarity::Cosine, 64)
    }
}

fn run(dir: &Path, steps: u64, on_nonfinite: OnNonFinite) -> Run<Vectors> {
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    let stop = StopSignal::new();
    let tower = |prefix: &str| Stopping {
        inner: Tower::build(&store, prefix, LinearBn::new).unwrap(),
        stop: stop.clone(),
        at: Cell::new(StopAt::Never),
        encodes: Cell::new(0),
        replays: Cell::new(0),
    };
    // Chunks of 4 queries and 8 passages: 4 + 2 chunks per step, between which a stop is
    // looked at.
    let gc = GradCache::two_towers(
        tower("query"),
        tower("passage"),
        4,
        8,
        InfoNce::new(0.1).unwrap(),
    )
    .unwrap()
    .with_seed(7)
    .with_stop_signal(stop);
    let settings = LoopConfig {
        output_dir: dir.to_path_buf(),
        steps,
        eval_every: 0,
        checkpoint_every: 0,
        keep_checkpoints: 2,
        optim: gradcache::train::config::OptimConfig {
            lr: 1e-2,
            warmup_steps: 0,
            ..Default::default()
        },
        check_weights_every: 0,
        loss_scaler: None,
        fingerprint: format!("vectors, {steps} steps"),
        may_change: "output_dir",
        on_nonfinite,
    };
    Run::from_parts(
        Vectors::new(),
        gc,
        store,
        Device::Cpu,
        Rc::new(Single),
        settings,
        Vec::new(),
    )
    .unwrap()
}

/// Weights, BatchNorm statistics and optimizer moments, as bits.
fn state_bits<T: Task>(r: &Run<T>) -> BTreeMap<String, Vec<u32>> {
    let mut all: BTreeMap<String, Vec<u32>> = r
        .state()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.to_string(), bits(v.as_tensor())))
        .collect();
    for (n, v) in r.optimizer_state().unwrap() {
        all.insert(n, bits(&v));
    }
    all
}

/// Asserts two states equal bit for bit, naming the tensors that differ.
#[track_caller]
fn assert_same(got: &BTreeMap<String, Vec<u32>>, want: &BTreeMap<String, Vec<u32>>, what: &str) {
    let differing: Vec<&String> = want
        .keys()
        .chain(got.keys())
        .filter(|k| got.get(*k) != want.get(*k))
        .collect();
    assert!(differing.is_empty(), "{what}: {differing:?} differ");
}

fn stop_at(r: &Run<Vectors>, at: StopAt) {
    r.gradient_cache().query_encoder().at.set(at);
}

#[test]
fn a_stop_inside_a_step_abandons_it_and_the_run_goes_on_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let mut plain = run(&dir.path().join("plain"), 6, OnNonFinite::Stop);
    let want: Vec<f32> = (0..6).map(|_| plain.train_step().unwrap().loss).collect();
    let want_state = state_bits(&plain);
    assert!(
        want_state.keys().any(|n| n.ends_with("running_mean")),
        "the towers have BatchNorm statistics"
    );

    let mut r = run(&dir.path().join("stopped"), 6, OnNonFinite::Stop);
    let mut got = Vec::new();
    for _ in 0..2 {
        got.push(r.train_step().unwrap().loss);
    }
    // Step 3 is asked to stop after its second query chunk (BatchNorm statistics have
    // moved), step 4 after its second replayed query chunk (gradients half summed).
    for (encode, signal) in [(true, SIGTERM), (false, SIGINT)] {
        let before = state_bits(&r);
        let step = r.step();
        let q = r.gradient_cache().query_encoder();
        let at = if encode {
            StopAt::Encode(q.encodes.get() + 2)
        } else {
            StopAt::Replay(q.replays.get() + 2)
        };
        stop_at(&r, at);
        match r.train_step() {
            Err(Error::Interrupted { signal: s }) => assert_eq!(s, signal),
            other => panic!("expected an abandoned step, got {other:?}"),
        }
        assert_eq!(r.step(), step, "an abandoned step does not count");
        assert_same(
            &state_bits(&r),
            &before,
            "weights, BatchNorm statistics and optimizer state are as before",
        );
        // The request was honoured; cleared, the run goes on.
        r.stop_signal().clear();
        stop_at(&r, StopAt::Never);
        got.push(r.train_step().unwrap().loss);
    }
    for _ in 0..2 {
        got.push(r.train_step().unwrap().loss);
    }
    assert_eq!(got, want, "the same losses as the run never stopped");
    assert_same(&state_bits(&r), &want_state, "the state at the end");
}

/// Asks the run to stop when step `at` reports.
struct StopAfter {
    at: u64,
    stop: StopSignal,
    saved: Vec<std::path::PathBuf>,
}

impl Observer for StopAfter {
    fn event(&mut self, e: &Event) -> gradcache::Result<()> {
        match e {
            Event::Step(r) if r.step == self.at => self.stop.request(SIGTERM),
            Event::CheckpointSaved(dir) => self.saved.push(dir.clone()),
            _ => {}
        }
        Ok(())
    }
}

#[test]
fn a_stop_after_a_step_writes_its_checkpoint_and_the_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut plain = run(&dir.path().join("plain"), 6, OnNonFinite::Stop);
    plain.run(&mut Quiet).unwrap();
    let want = state_bits(&plain);

    let out = dir.path().join("stopped");
    let mut r = run(&out, 6, OnNonFinite::Stop);
    let mut observer = StopAfter {
        at: 3,
        stop: r.stop_signal().clone(),
        saved: Vec::new(),
    };
    let err = r.run(&mut observer).unwrap_err();
    let Error::Stopped {
        signal,
        step,
        checkpoint: Some(ckpt),
    } = &err
    else {
        panic!("expected a clean stop, got {err:?}");
    };
    assert_eq!((*signal, *step), (SIGTERM, 3));
    assert!(
        ckpt.ends_with("checkpoints/step-00000003"),
        "{}",
        ckpt.display()
    );
    assert_eq!(observer.saved, vec![ckpt.clone()]);
    let message = err.to_string();
    assert!(
        message.contains("training stopped by SIGTERM after step 3")
            && message.contains("resume with --resume"),
        "{message}"
    );
    assert!(
        !out.join(LOCK_FILE).exists() || r.step() == 3,
        "the lock stays while the run object lives"
    );
    drop(r);
    assert!(
        !out.join(LOCK_FILE).exists(),
        "a dropped run releases its lock"
    );

    let mut resumed = run(&out, 6, OnNonFinite::Stop);
    resumed.restore(&out.join("checkpoints")).unwrap();
    assert_eq!(resumed.step(), 3);
    resumed.run(&mut Quiet).unwrap();
    assert_same(
        &state_bits(&resumed),
        &want,
        "bit for bit the uninterrupted run",
    );

    // A stop before the first step has nothing to save.
    let fresh = dir.path().join("fresh");
    let mut r = run(&fresh, 6, OnNonFinite::Stop);
    r.stop_signal().request(SIGINT);
    match r.run(&mut Quiet) {
        Err(Error::Stopped {
            step: 0,
            checkpoint: None,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(!fresh.join("checkpoints").exists());
}

/// An observer that cannot write (the binary's metrics file on a full disk) from step 2.
struct FullDisk;

impl Observer for FullDisk {
    fn event(&mut self, e: &Event) -> gradcache::Result<()> {
        match e {
            Event::Step(r) if r.step >= 2 => Err(Error::Io {
                action: "write",
                path: "metrics.jsonl".into(),
                reason: "No space left on device (os error 28)".into(),
            }),
            _ => Ok(()),
        }
    }
}

#[test]
fn an_observer_that_cannot_write_ends_the_run_after_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = run(&dir.path().join("full"), 6, OnNonFinite::Stop);
    let err = r.run(&mut FullDisk).unwrap_err().to_string();
    assert_eq!(
        err,
        "cannot write metrics.jsonl: No space left on device (os error 28)"
    );
    assert_eq!(
        r.step(),
        2,
        "the run ended after the step it could not record"
    );
}

#[test]
fn a_nan_loss_stops_naming_the_step_or_is_skipped_changing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = run(&dir.path().join("stop"), 6, OnNonFinite::Stop);
    r.train_step().unwrap();
    r.task_mut().poison = Some(1);
    let before = state_bits(&r);
    let err = r.train_step().unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(err, Error::NonFiniteStep { step: 2, .. })
            && message.contains("the loss is NaN")
            && message.contains("the vectors of step 2")
            && message.contains("train.on_nonfinite = \"skip\""),
        "{message}"
    );
    assert_same(&state_bits(&r), &before, "no weight or statistic changed");
    assert_eq!(r.step(), 1, "the failed step did not count");

    let mut plain = run(&dir.path().join("plain"), 6, OnNonFinite::Stop);
    let mut r = run(&dir.path().join("skip"), 6, OnNonFinite::Skip);
    r.task_mut().poison = Some(1);
    plain.train_step().unwrap();
    r.train_step().unwrap();
    let before = state_bits(&r);
    let skipped = r.train_step().unwrap();
    assert!(skipped.skipped && skipped.loss.is_nan(), "{skipped:?}");
    assert_eq!(r.step(), 2, "a skipped step counts");
    assert_same(
        &state_bits(&r),
        &before,
        "weights, optimizer state and BatchNorm statistics untouched",
    );
    // The run goes on; the skipped batch is not trained on again.
    let next = r.train_step().unwrap();
    assert!(!next.skipped && next.loss.is_finite());
}

/// Sets every value of the parameters whose name ends with `suffix`.
fn set_param(t: &Trainer, suffix: &str, value: f64) {
    let (_, var) = t
        .params()
        .iter()
        .find(|(n, _)| n.ends_with(suffix))
        .unwrap_or_else(|| panic!("no parameter ends with {suffix}"));
    let filled = (var.as_tensor().ones_like().unwrap() * value).unwrap();
    var.set(&filled).unwrap();
}

fn tiny(dir: &Path, sets: &[&str]) -> Config {
    let path = write_tiny_run(dir);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Config::load(&path, &sets).unwrap()
}

#[test]
fn a_nan_in_the_text_trainer_names_the_data_lines_of_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    // One batch of all 48 training pairs: the lines it names are every line of the file.
    let cfg = tiny(dir.path(), &["train.batch_size=48"]);
    let mut t = Trainer::new(cfg, None).unwrap();
    set_param(&t, "embeddings.word_embeddings.weight", f64::NAN);
    let err = t.train_step().unwrap_err().to_string();
    let lines: Vec<String> = (1..=48).map(|l| l.to_string()).collect();
    let train = dir.path().join("train.jsonl");
    assert!(
        err.starts_with("step 1: the loss is NaN; no weight was changed")
            && err.contains(&format!(
                "lines {} of {}",
                lines.join(", "),
                train.display()
            )),
        "{err}"
    );
}

#[test]
fn an_f16_forward_that_overflows_is_skipped_and_the_scale_halves() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), &["precision=f16", "model.dropout=false"]);
    let mut t = Trainer::new(cfg, None).unwrap();
    // Each value fits f16 (65,504 at most); the feed-forward's product of them does not.
    set_param(&t, "layer.0.intermediate.dense.bias", 6e4);
    set_param(&t, "layer.0.output.dense.weight", 1e3);
    let before = state_bits(&t);
    let first = t.train_step().unwrap();
    let s = first.loss_scaling.expect("f16 reports its loss scale");
    assert!(first.skipped && s.skipped, "{first:?}");
    assert!(
        !first.loss.is_finite(),
        "the forward overflowed, not the backward"
    );
    assert_same(
        &state_bits(&t),
        &before,
        "no weight and no optimizer state moved",
    );
    let second = t.train_step().unwrap();
    assert_eq!(
        second.loss_scaling.unwrap().used,
        s.used / 2.0,
        "the scale halved"
    );
    assert_eq!(t.step(), 2);
}

#[test]
fn a_second_run_on_the_directory_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), &[]);
    let first = Trainer::new(cfg.clone(), None).unwrap();
    let lock = cfg.output_dir.join(LOCK_FILE);
    let owner: LockOwner = serde_json::from_str(&std::fs::read_to_string(&lock).unwrap()).unwrap();
    assert_eq!(owner.pid, std::process::id());
    let err = Trainer::new(cfg.clone(), None).err().unwrap().to_string();
    assert!(
        err.contains("is in use by another training run")
            && err.contains(&format!("process {} on host {}", owner.pid, owner.host)),
        "{err}"
    );
    drop(first);
    assert!(!lock.exists(), "released with the run");
    let again = Trainer::new(cfg, None).unwrap();
    assert!(again.setup_notes().iter().all(|n| !n.contains("took over")));
}

#[test]
fn a_lock_whose_kernel_lock_is_free_is_taken_over_another_hosts_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(dir.path(), &[]);
    std::fs::create_dir_all(&cfg.output_dir).unwrap();
    let lock = cfg.output_dir.join(LOCK_FILE);
    let me = LockOwner::this_process();
    let write =
        |owner: &LockOwner| std::fs::write(&lock, serde_json::to_string(owner).unwrap()).unwrap();

    // A run killed with -9: its process is gone, its lock file is still there.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let gone = LockOwner {
        pid: child.id(),
        ..me.clone()
    };
    write(&gone);
    let t = Trainer::new(cfg.clone(), None).unwrap();
    assert!(
        t.setup_notes()
            .iter()
            .any(|n| n.contains("took over the lock")
                && n.contains(&format!("process {}", gone.pid))),
        "{:?}",
        t.setup_notes()
    );
    drop(t);

    // A live process of this host whose lock is free (a rank being torn down after
    // mpirun killed the job, or a process id reused): the kernel's lock is trusted.
    write(&LockOwner {
        pid: 1,
        ..me.clone()
    });
    let t = Trainer::new(cfg.clone(), None).unwrap();
    assert!(
        t.setup_notes()
            .iter()
            .any(|n| n.contains("took over the lock") && n.contains("process 1 on host")),
        "{:?}",
        t.setup_notes()
    );
    drop(t);

    // Another host: cannot be checked from here.
    write(&LockOwner {
        host: "elsewhere".into(),
        ..me
    });
    let err = Trainer::new(cfg.clone(), None).err().unwrap().to_string();
    assert!(
        err.contains("on host elsewhere") && err.contains("another host"),
        "{err}"
    );
    assert!(
        !cfg.output_dir.join("checkpoints").exists(),
        "a refused run writes nothing"
    );
}
