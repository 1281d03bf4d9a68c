//! The distributed gradient cache, checked: every rank encodes its share of a global batch
//! in chunks, the representations are all-gathered, the loss is over the global batch,
//! each rank replays its own chunks and the gradients are summed once per step. The result
//! is compared with one process running a plain forward/backward over the whole global
//! batch (f32, dropout off), for one shared tower and two towers, with hard negatives and
//! chunk sizes that do not divide a rank's share. Prints `world=<n> max_rel_err=<x>` and
//! exits non-zero above 1e-5.
//!
//! ```text
//! cargo build --release --features mpi --example distributed
//! mpirun -n 2 target/release/examples/distributed      # as root: --allow-run-as-root
//! mpirun -n 4 --oversubscribe target/release/examples/distributed
//! ```

use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use gradcache::dist::{self, Backend, Collective};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{GradCache, InfoNce, ParamStore, StepOutput, Tower};

/// Pairs per rank, and passages per query (a positive and 3 hard negatives).
const PER_RANK: usize = 12;
const GROUP: usize = 4;
const FEATURES: usize = 32;
const TOLERANCE: f64 = 1e-5;

fn features(seed: u64, rows: usize) -> gradcache::Result<Tensor> {
    let shape = (rows, FEATURES).into();
    gradcache::rng::normal(seed, 0.0, 1.0, &shape, DType::F32, &Device::Cpu)
}

fn tower(store: &ParamStore, prefix: &str) -> gradcache::Result<Tower<Mlp>> {
    let cfg = MlpConfig {
        input: FEATURES,
        hidden: 64,
        output: 32,
        dropout: 0.1,
    };
    Tower::build(store, prefix, |vb| Mlp::new(&cfg, vb))
}

/// The gradient cache of one setup; the same seed everywhere gives the same weights.
fn build(two_towers: bool) -> gradcache::Result<GradCache<Tower<Mlp>>> {
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let loss = InfoNce::new(0.05)?.with_symmetric(true);
    let gc = if two_towers {
        GradCache::two_towers(
            tower(&store, "query")?,
            tower(&store, "passage")?,
            5,
            7,
            loss,
        )?
    } else {
        GradCache::shared(tower(&store, "")?, 5, loss)?.with_chunk_sizes(5, 7)?
    };
    Ok(gc.with_dropout(false))
}

/// The distributed step's error against one process over the union batch.
fn compare(comm: &Rc<dyn Collective>, two_towers: bool) -> gradcache::Result<(f32, f64)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let queries = features(1, PER_RANK * world)?;
    let passages = features(2, PER_RANK * world * GROUP)?;
    let single: StepOutput = build(two_towers)?.full_batch_step(0, &queries, &passages)?;

    let gc = build(two_towers)?.with_collective(Rc::clone(comm));
    let my_queries = queries.narrow(0, rank * PER_RANK, PER_RANK)?;
    let my_passages = passages.narrow(0, rank * PER_RANK * GROUP, PER_RANK * GROUP)?;
    let dist = gc.cache_step(0, &my_queries, &my_passages)?;
    let loss_err = ((dist.loss - single.loss) / single.loss).abs();
    Ok((loss_err, dist.grads.max_rel_err(&single.grads, 0.0)?))
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let comm = dist::init(Backend::Mpi)?;
    let mut worst = 0f64;
    for two_towers in [false, true] {
        let (loss_err, grad_err) = compare(&comm, two_towers)?;
        if comm.rank() == 0 {
            let towers = if two_towers { "two" } else { "shared" };
            println!(
                "towers={towers} pairs={} loss_rel_err={loss_err:.2e} max_rel_err={grad_err:.2e}",
                PER_RANK * comm.world_size()
            );
        }
        worst = worst.max(grad_err).max(f64::from(loss_err));
    }
    // Every rank's worst error, so rank 0 reports the worst of all.
    let all = comm.all_gather(&Tensor::new(&[worst], &Device::Cpu)?)?;
    let worst = all.max(0)?.to_scalar::<f64>()?;
    let world = comm.world_size();
    if comm.rank() == 0 {
        println!("world={world} max_rel_err={worst:.3e}");
    }
    drop(comm);
    if worst > TOLERANCE {
        eprintln!("max relative error {worst:e} exceeds {TOLERANCE:e}");
        std::process::exit(1);
    }
    Ok(())
}
