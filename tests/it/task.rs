//! A third task through the one training loop: a kind of training the crate does not
//! ship (feature-vector pairs with two MLP towers), written only against the public
//! [`Task`] trait, gets the loop's evaluation schedule, checkpoints and exact resume.

use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use gradcache::dist::{Collective, Single};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::train::data::Position;
use gradcache::train::metrics::{evaluate, RetrievalMetrics};
use gradcache::train::run::TaskCache;
use gradcache::train::{Event, LoopConfig, Observer, Run, Task};
use gradcache::{Ctx, Encoder, Error, GradCache, InfoNce, ParamStore, Similarity, Tower};

use crate::common;
use crate::common::bits;

const DIM: usize = 12;
const BATCH: usize = 16;

/// Query vectors and their positives, a fixed linear map of the query plus noise.
struct VectorPairs {
    train: (Tensor, Tensor),
    eval: (Tensor, Tensor),
    /// Set by the test: the next seek fails (a data source that cannot reach a position).
    refuse_seek: bool,
}

impl VectorPairs {
    fn new(seed: u64) -> Self {
        let map = common::random(seed, &[DIM, DIM]);
        let pairs = |s: u64, rows: usize| {
            let q = common::random(s, &[rows, DIM]);
            let noise = (common::random(s + 1, &[rows, DIM]) * 0.1).unwrap();
            let p = (q.matmul(&map).unwrap() + noise).unwrap();
            (q, p)
        };
        Self {
            train: pairs(seed + 10, 8 * BATCH),
            eval: pairs(seed + 20, 48),
            refuse_seek: false,
        }
    }

    fn per_epoch(&self) -> u64 {
        (self.train.0.dim(0).unwrap() / BATCH) as u64
    }
}

impl Task for VectorPairs {
    type Query = Tower<Mlp>;
    type Passage = Tower<Mlp>;
    type Loss = InfoNce;
    type Batch = (Tensor, Tensor);
    type Config = ();

    fn config(&self) -> &() {
        &()
    }

    fn next_batch(&mut self, step: u64) -> gradcache::Result<(Tensor, Tensor)> {
        let start = (step % self.per_epoch()) as usize * BATCH;
        Ok((
            self.train.0.narrow(0, start, BATCH)?,
            self.train.1.narrow(0, start, BATCH)?,
        ))
    }

    fn batch_rows(&self, batch: &(Tensor, Tensor)) -> usize {
        batch.0.dim(0).unwrap_or(0)
    }

    fn inputs(
        &self,
        batch: &(Tensor, Tensor),
        _comm: &dyn Collective,
    ) -> gradcache::Result<(Tensor, Tensor)> {
        Ok(batch.clone())
    }

    fn position(&self, step: u64) -> Position {
        Position {
            epoch: step / self.per_epoch(),
            offset: (step % self.per_epoch()) as usize * BATCH,
        }
    }

    fn seek(&mut self, position: Position, step: u64) -> gradcache::Result<()> {
        if self.refuse_seek || position != self.position(step) {
            return Err(Error::InvalidArgument {
                what: "position",
                value: format!("{position:?}"),
                reason: "is not reachable",
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

fn run(dir: &Path, steps: u64, eval_every: u64) -> Run<VectorPairs> {
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    let mlp = MlpConfig {
        input: DIM,
        hidden: 32,
        output: 16,
        dropout: 0.1,
    };
    let query = Tower::build(&store, "query", |vb| Mlp::new(&mlp, vb)).unwrap();
    let passage = Tower::build(&store, "passage", |vb| Mlp::new(&mlp, vb)).unwrap();
    let gc = GradCache::two_towers(query, passage, 4, 8, InfoNce::new(0.05).unwrap())
        .unwrap()
        .with_seed(7);
    let settings = LoopConfig {
        output_dir: dir.to_path_buf(),
        steps,
        eval_every,
        checkpoint_every: 2,
        keep_checkpoints: 10,
        optim: gradcache::train::config::OptimConfig {
            lr: 1e-2,
            warmup_steps: 0,
            ..Default::default()
        },
        check_weights_every: 0,
        loss_scaler: None,
        fingerprint: format!("vector pairs, {steps} steps"),
        may_change: "output_dir",
        on_nonfinite: Default::default(),
    };
    let task = VectorPairs::new(3);
    Run::from_parts(
        task,
        gc,
        store,
        Device::Cpu,
        Rc::new(Single),
        settings,
        Vec::new(),
    )
    .unwrap()
}

fn state_bits(r: &Run<VectorPairs>) -> Vec<(String, Vec<u32>)> {
    let mut all: Vec<_> = r
        .state()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.to_string(), bits(v.as_tensor())))
        .collect();
    for (n, v) in r.optimizer_state().unwrap() {
        all.push((n, bits(&v)));
    }
    all
}

#[derive(Default)]
struct Events(Vec<Event>);

impl Observer for Events {
    fn event(&mut self, e: &Event) -> gradcache::Result<()> {
        self.0.push(e.clone());
        Ok(())
    }
}

#[test]
fn a_task_of_its_own_learns_with_the_loops_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = run(dir.path(), 24, 8);
    let mut events = Events::default();
    let (before, after) = r.run(&mut events).unwrap();
    let before = before.expect("a fresh run evaluates before its first step");
    // Measured: recall@1 0.021 -> 0.458 on 48 held-out pairs.
    assert!(
        after.recall_at_1 >= before.recall_at_1 + 0.3,
        "held-out recall@1 {:.3} -> {:.3}",
        before.recall_at_1,
        after.recall_at_1
    );
    let evals: Vec<u64> = events
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Eval { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(evals, [0, 8, 16, 24]);
    let steps = events
        .0
        .iter()
        .filter(|e| matches!(e, Event::Step(_)))
        .count();
    assert_eq!(steps, 24);
    let saved = events
        .0
        .iter()
        .filter(|e| matches!(e, Event::CheckpointSaved(_)))
        .count();
    assert_eq!(saved, 12);
    assert!(dir.path().join("checkpoints/step-00000024").is_dir());
}

#[test]
fn a_task_of_its_own_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let straight = {
        let mut r = run(&dir.path().join("a"), 6, 0);
        for _ in 0..5 {
            r.train_step().unwrap();
        }
        state_bits(&r)
    };
    let b = dir.path().join("b");
    let ckpt = {
        let mut r = run(&b, 6, 0);
        for _ in 0..3 {
            r.train_step().unwrap();
        }
        r.save_checkpoint().unwrap()
    };
    let mut resumed = run(&b, 6, 0);
    resumed.restore(&ckpt).unwrap();
    assert_eq!(resumed.step(), 3);
    resumed.train_step().unwrap();
    resumed.train_step().unwrap();
    let got = state_bits(&resumed);
    assert_eq!(got.len(), straight.len());
    for ((name, a), (_, want)) in got.iter().zip(&straight) {
        assert!(a == want, "{name} differs after resuming");
    }

    // A checkpoint of another configuration is refused, naming what may change.
    let mut other = run(&dir.path().join("c"), 7, 0);
    let err = other.restore(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("another configuration") && err.contains("output_dir"),
        "{err}"
    );
    assert_eq!(other.step(), 0);

    // A data position the task cannot reach is refused with the checkpoint named.
    let mut stuck = run(&dir.path().join("d"), 6, 0);
    stuck.task_mut().refuse_seek = true;
    let err = stuck.restore(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("data position") && err.contains("step-00000003"),
        "{err}"
    );
}
