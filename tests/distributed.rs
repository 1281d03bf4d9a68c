//! Distributed gradient cache over MPI. Run under a launcher, e.g.
//!
//! ```text
//! cargo test --features mpi --test distributed --no-run   # prints the binary's path
//! mpirun --allow-run-as-root -n 2 target/debug/deps/distributed-<hash>
//! mpirun --allow-run-as-root --oversubscribe -n 4 target/debug/deps/distributed-<hash>
//! ```
//!
//! (`scripts/mpi-test N` does both.) Started without `mpirun` it runs as a world of one.
//! Every rank runs every check; a failure on any rank makes that rank exit non-zero, and
//! `mpirun` then reports the job as failed.
//!
//! What is checked, all in f32 with dropout off:
//! - the collectives themselves: rank-ordered all-gather, sum/avg all-reduce, broadcast,
//!   variable-length byte gather, a shape mismatch reported on every rank;
//! - equivalence: N ranks x 6 pairs give the loss and parameter gradients of one process
//!   over the 6N pairs (max relative error <= 1e-5), with one shared tower and with two
//!   towers, with hard negatives, with chunk sizes that do not divide 6;
//! - scale: the reduced gradient is the union batch's, not 1/N of it (what averaging, as
//!   DDP does, would give);
//! - failure: a step that fails on the last rank fails on every rank, naming that rank;
//!   a fingerprint that differs on one rank is reported on every rank;
//! - BatchNorm towers (a VNet over volumes, a DenseNet-BC over images, checkpointed):
//!   N ranks give the loss and gradients of one process over the union batch cut into the
//!   same chunks (each chunk normalised with its own statistics on either side);
//! - volume: the bytes the step moved equal [`StepVolume`]'s formula;
//! - a second start of MPI in the same process is an error, not a crash.

use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use gradcache::dist::{self, Backend, Collective, ReduceOp, StepVolume};
use gradcache::loss::Matryoshka;
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{Error, GradCache, InfoNce, ParamStore, Similarity, StepOutput, Tower};

mod common;

const TOL: f64 = 1e-5;
/// Pairs per rank.
const LOCAL: usize = 6;
const FEATURES: usize = 10;
const WIDTH: usize = 8;

type Check = fn(&Rc<dyn Collective>) -> Result<(), String>;

fn main() {
    let comm = dist::init(Backend::Mpi).expect("MPI starts");
    let checks: [(&str, Check); 13] = [
        ("collectives", collectives),
        ("shape mismatch is reported on every rank", shape_mismatch),
        ("shared tower, in-batch negatives, chunk 4", shared_in_batch),
        (
            "shared tower, hard negatives, chunks 4/5",
            shared_hard_negatives,
        ),
        (
            "two towers, hard negatives, symmetric, chunks 5/4",
            two_towers,
        ),
        (
            "two towers, cosine, row blocks, chunk 1",
            two_towers_cosine_blocks,
        ),
        (
            "two towers, Matryoshka, false-negative mask, symmetric, chunks 5/3",
            two_towers_matryoshka,
        ),
        ("gradient scale is the union batch's", scale),
        (
            "VNet and DenseNet-BC towers (BatchNorm), chunk 2, checkpointed",
            batch_norm_towers,
        ),
        ("one rank's failure fails every rank", failure),
        (
            "a stop on one rank stops every rank at the same point",
            stop_on_one_rank,
        ),
        ("step volume matches the formula", volume),
        ("a second MPI start is refused", second_init),
    ];
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut failed = 0;
    for (name, check) in checks {
        match check(&comm) {
            Ok(()) => println!("rank {rank}/{world}: ok   {name}"),
            Err(e) => {
                println!("rank {rank}/{world}: FAIL {name}: {e}");
                failed += 1;
            }
        }
    }
    // Finalise MPI before exiting.
    drop(comm);
    if failed > 0 {
        std::process::exit(1);
    }
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn vec1(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn collectives(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mine = Tensor::from_vec(vec![r as f32, 10.0 * r as f32], (1, 2), &Device::Cpu).unwrap();
    let all = vec1(&comm.all_gather(&mine).map_err(|e| e.to_string())?);
    let expected: Vec<f32> = (0..n).flat_map(|k| [k as f32, 10.0 * k as f32]).collect();
    ensure(all == expected, || {
        format!("all_gather {all:?} != {expected:?}")
    })?;

    let sum = vec1(&comm.all_reduce(&mine, ReduceOp::Sum).unwrap());
    let total = (n * (n - 1) / 2) as f32;
    ensure(sum == [total, 10.0 * total], || format!("sum {sum:?}"))?;
    let avg = vec1(&comm.all_reduce(&mine, ReduceOp::Avg).unwrap());
    let mean = total / n as f32;
    ensure((avg[0] - mean).abs() < 1e-6, || format!("avg {avg:?}"))?;

    let f64s = Tensor::new(&[r as f64 + 0.25], &Device::Cpu).unwrap();
    let s = comm.all_reduce(&f64s, ReduceOp::Sum).unwrap();
    ensure(s.dtype() == DType::F64, || {
        "f64 all_reduce changed dtype".into()
    })?;

    let root = n - 1;
    let b = vec1(&comm.broadcast(&mine, root).unwrap());
    ensure(b == [root as f32, 10.0 * root as f32], || {
        format!("broadcast {b:?}")
    })?;

    let bytes = vec![r as u8; r + 1];
    let got = comm.all_gather_bytes(&bytes).unwrap();
    let want: Vec<Vec<u8>> = (0..n).map(|k| vec![k as u8; k + 1]).collect();
    ensure(got == want, || format!("all_gather_bytes {got:?}"))?;
    comm.barrier().map_err(|e| e.to_string())
}

fn shape_mismatch(comm: &Rc<dyn Collective>) -> Result<(), String> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let rows = if comm.rank() == comm.world_size() - 1 {
        3
    } else {
        2
    };
    let t = Tensor::zeros((rows, 4), DType::F32, &Device::Cpu).unwrap();
    match comm.all_gather(&t) {
        Err(Error::RankMismatch { what, detail }) => ensure(
            what.contains("all_gather") && detail.contains("[3, 4]"),
            || format!("unclear message: {what}: {detail}"),
        ),
        other => Err(format!("expected RankMismatch, got {other:?}")),
    }
}

fn features(seed: u64, rows: usize) -> Tensor {
    common::features(seed, rows, FEATURES)
}

fn mlp(prefix: &str, store: &ParamStore) -> Tower<Mlp> {
    let cfg = MlpConfig {
        input: FEATURES,
        hidden: 16,
        output: WIDTH,
        dropout: 0.1,
    };
    Tower::build(store, prefix, |vb| Mlp::new(&cfg, vb)).unwrap()
}

/// How a case is set up.
#[derive(Clone, Copy)]
struct Case {
    two_towers: bool,
    hard: usize,
    query_chunk: usize,
    passage_chunk: usize,
    loss: fn() -> Matryoshka<InfoNce>,
}

type Gc = GradCache<Tower<Mlp>, Tower<Mlp>, Matryoshka<InfoNce>>;

fn build(case: Case, comm: Option<&Rc<dyn Collective>>) -> Gc {
    // Same seed on every rank and for the reference: identical initial weights.
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    let gc = if case.two_towers {
        GradCache::two_towers(
            mlp("query", &store),
            mlp("passage", &store),
            case.query_chunk,
            case.passage_chunk,
            (case.loss)(),
        )
        .unwrap()
    } else {
        GradCache::shared(mlp("", &store), case.query_chunk, (case.loss)())
            .unwrap()
            .with_chunk_sizes(case.query_chunk, case.passage_chunk)
            .unwrap()
    };
    let gc = gc.with_dropout(false).with_bucket_bytes(256);
    match comm {
        Some(c) => gc.with_collective(Rc::clone(c)),
        None => gc,
    }
}

/// The global batch (the same on every rank) and this rank's share of it.
fn data(case: Case, comm: &dyn Collective) -> (Tensor, Tensor, Tensor, Tensor) {
    let global = LOCAL * comm.world_size();
    let group = case.hard + 1;
    let q = features(100, global);
    let p = features(200, global * group);
    let r = comm.rank();
    let q_local = q.narrow(0, r * LOCAL, LOCAL).unwrap();
    let p_local = p.narrow(0, r * LOCAL * group, LOCAL * group).unwrap();
    (q, p, q_local, p_local)
}

/// Runs `case` distributed and as one process over the union batch.
fn run(case: Case, comm: &Rc<dyn Collective>) -> Result<(StepOutput, StepOutput), String> {
    let (q, p, q_local, p_local) = data(case, comm.as_ref());
    let reference = build(case, None);
    let single = reference
        .full_batch_step(0, &q, &p)
        .map_err(|e| format!("reference step: {e}"))?;
    let gc = build(case, Some(comm));
    let dist = gc
        .cache_step(0, &q_local, &p_local)
        .map_err(|e| format!("distributed step: {e}"))?;
    Ok((single, dist))
}

fn equivalent(case: Case, comm: &Rc<dyn Collective>) -> Result<(), String> {
    let (single, dist) = run(case, comm)?;
    let loss_err = ((dist.loss - single.loss) / single.loss).abs() as f64;
    ensure(loss_err <= TOL, || {
        format!("loss {} vs {} (rel {loss_err:e})", dist.loss, single.loss)
    })?;
    ensure(dist.grads.len() == single.grads.len(), || {
        format!("{} gradients vs {}", dist.grads.len(), single.grads.len())
    })?;
    let err = dist.grads.max_rel_err(&single.grads, 0.0).unwrap();
    ensure(err <= TOL, || {
        format!("max relative gradient error {err:e}")
    })?;
    println!(
        "rank {}/{}:      world={} loss={:.6} max_rel_err={err:.2e}",
        comm.rank(),
        comm.world_size(),
        comm.world_size(),
        dist.loss
    );
    Ok(())
}

/// A VNet (memory-efficient units) and a DenseNet-BC under stage checkpointing: N ranks of
/// 4 rows in chunks of 2 equal one process over the 4N rows in chunks of 2, whose chunks
/// are the ranks' (BatchNorm normalises each chunk on its own, so the chunks must match).
fn batch_norm_towers(comm: &Rc<dyn Collective>) -> Result<(), String> {
    use gradcache::densenet::{DenseNet, DenseNetConfig};
    use gradcache::vnet::{VNet, VNetConfig};
    use gradcache::{Encoder, Recompute, Recomputed};

    fn compare<E: Encoder<Input = Tensor>>(
        what: &str,
        build: impl Fn() -> E,
        dims: &[usize],
        comm: &Rc<dyn Collective>,
    ) -> Result<(), String> {
        let (rank, world, local) = (comm.rank(), comm.world_size(), 4);
        let mut all = vec![local * world];
        all.extend(dims);
        let (q, p) = (common::random(300, &all), common::random(301, &all));
        let loss = || {
            InfoNce::new(0.1)
                .unwrap()
                .with_similarity(Similarity::Cosine)
        };
        let single = GradCache::shared(build(), 2, loss())
            .unwrap()
            .cache_step(0, &q, &p)
            .map_err(|e| format!("{what}: reference step: {e}"))?;
        let (ql, pl) = (
            q.narrow(0, rank * local, local).unwrap(),
            p.narrow(0, rank * local, local).unwrap(),
        );
        let dist = GradCache::shared(build(), 2, loss())
            .unwrap()
            .with_collective(Rc::clone(comm))
            .cache_step(0, &ql, &pl)
            .map_err(|e| format!("{what}: distributed step: {e}"))?;
        let loss_err = ((dist.loss - single.loss) / single.loss).abs() as f64;
        // Floored at 1e-3 of the largest gradient: BatchNorm shifts whose gradients are
        // sums of cancelling terms (as in tests/it/densenet.rs and tests/it/vnet.rs).
        let err = dist.grads.max_rel_err(&single.grads, 1e-3).unwrap();
        ensure(loss_err <= TOL && err <= 1e-4, || {
            format!("{what}: loss rel {loss_err:e}, max relative gradient error {err:e}")
        })?;
        println!(
            "rank {rank}/{world}:      {what}: loss={:.6} max_rel_err={err:.2e}",
            dist.loss
        );
        Ok(())
    }
    let vnet = VNetConfig {
        width: 4,
        stages: vec![1, 2],
        kernel: 3,
        memory_efficient: true,
        output: 6,
        ..VNetConfig::default()
    };
    compare(
        "vnet",
        || {
            let store = ParamStore::new(9, DType::F32, &Device::Cpu);
            let tower = Tower::build(&store, "", |vb| VNet::new(&vnet, vb)).unwrap();
            Recomputed::new(tower, Recompute::EveryLayer).unwrap()
        },
        &[1, 8, 8, 8],
        comm,
    )?;
    let densenet = DenseNetConfig {
        growth_rate: 4,
        block_config: vec![2, 2],
        init_features: 8,
        bn_size: 2,
        memory_efficient: true,
        output: 6,
        ..DenseNetConfig::default()
    };
    compare(
        "densenet",
        || {
            let store = ParamStore::new(10, DType::F32, &Device::Cpu);
            let tower = Tower::build(&store, "", |vb| DenseNet::new(&densenet, vb)).unwrap();
            Recomputed::new(tower, Recompute::EveryLayer).unwrap()
        },
        &[3, 8, 8],
        comm,
    )
}

/// The loss alone (no Matryoshka widths).
fn alone(l: InfoNce) -> Matryoshka<InfoNce> {
    Matryoshka::new(l, Vec::new(), Vec::new()).unwrap()
}

fn infonce() -> InfoNce {
    InfoNce::new(0.1).unwrap()
}

fn plain() -> Matryoshka<InfoNce> {
    alone(infonce())
}

fn symmetric() -> Matryoshka<InfoNce> {
    alone(infonce().with_symmetric(true))
}

fn cosine_blocks() -> Matryoshka<InfoNce> {
    alone(
        infonce()
            .with_similarity(Similarity::Cosine)
            .with_block_rows(Some(3))
            .unwrap(),
    )
}

/// Matryoshka widths over a symmetric cosine loss with row blocks that masks likely false
/// negatives: every piece of issue 25's losses at once.
fn matryoshka_false_negatives() -> Matryoshka<InfoNce> {
    let inner = infonce()
        .with_similarity(Similarity::Cosine)
        .with_symmetric(true)
        .with_block_rows(Some(4))
        .unwrap()
        .with_false_negative_margin(Some(0.1))
        .unwrap();
    Matryoshka::new(inner, vec![WIDTH, 4, 2], vec![1.0, 0.5, 0.25]).unwrap()
}

fn two_towers_matryoshka(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: true,
        hard: 1,
        query_chunk: 5,
        passage_chunk: 3,
        loss: matryoshka_false_negatives,
    };
    equivalent(case, comm)
}

fn shared_in_batch(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: false,
        hard: 0,
        query_chunk: 4,
        passage_chunk: 4,
        loss: plain,
    };
    equivalent(case, comm)
}

fn shared_hard_negatives(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: false,
        hard: 1,
        query_chunk: 4,
        passage_chunk: 5,
        loss: plain,
    };
    equivalent(case, comm)
}

// Two towers use the symmetric term: without it the passage tower's output bias has a
// mathematically zero gradient (softmax ignores a common shift), which has no meaningful
// relative error (see tests/it/equivalence.rs).
fn two_towers(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: true,
        hard: 1,
        query_chunk: 5,
        passage_chunk: 4,
        loss: symmetric,
    };
    equivalent(case, comm)
}

fn two_towers_cosine_blocks(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: true,
        hard: 0,
        query_chunk: 1,
        passage_chunk: 1,
        loss: cosine_blocks,
    };
    equivalent(case, comm)
}

/// The reference implementation's `DistributedContrastiveLoss` under DDP averaging yields
/// 1/N of the union-batch gradient. Ours must be the union-batch gradient itself: check the
/// norm ratio; and that this rank's own share of the gradient, averaged over the ranks by
/// the collective (`ReduceOp::Avg`, what DDP does), would indeed have been off by N.
fn scale(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: false,
        hard: 1,
        query_chunk: 4,
        passage_chunk: 4,
        loss: plain,
    };
    let (single, dist) = run(case, comm)?;
    let norm = |g: &gradcache::Gradients| -> f64 {
        g.iter()
            .map(|(_, t)| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            })
            .sum::<f64>()
            .sqrt()
    };
    let ratio = norm(&dist.grads) / norm(&single.grads);
    ensure((ratio - 1.0).abs() <= TOL, || {
        format!(
            "|distributed| / |single| = {ratio} (1/N would be {})",
            1.0 / comm.world_size() as f64
        )
    })?;
    // This rank's gradient before any reduction: the three phases by hand.
    let (_, _, q_local, p_local) = data(case, comm.as_ref());
    let gc = build(case, Some(comm));
    let local = gc
        .represent(0, &q_local, &p_local)
        .and_then(|reps| reps.into_cache_across(gc.loss(), comm.as_ref()))
        .and_then(|cache| cache.replay())
        .map_err(|e| format!("local step: {e}"))?
        .grads;
    let averaged: gradcache::Gradients = local
        .iter()
        .map(|(name, g)| (name.to_string(), comm.all_reduce(g, ReduceOp::Avg).unwrap()))
        .collect();
    let n = comm.world_size() as f64;
    let avg_ratio = norm(&averaged) / norm(&single.grads);
    ensure((avg_ratio - 1.0 / n).abs() <= TOL, || {
        format!("averaged ratio {avg_ratio}, expected 1/{n}")
    })?;
    let mut rescaled = averaged.clone();
    rescaled.scale(n).unwrap();
    let err = rescaled.max_rel_err(&single.grads, 0.0).unwrap();
    ensure(err <= TOL, || {
        format!("N x the averaged gradient differs from the union batch's: {err:e}")
    })
}

/// A stop asked for on the last rank only (a signal that reached one process): the step
/// is abandoned on every rank, and the end-of-step agreement gives every rank the signal.
/// A real failure elsewhere wins over a stop.
fn stop_on_one_rank(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let (n, r) = (comm.world_size(), comm.rank());
    let last = r == n - 1;
    let case = Case {
        two_towers: false,
        hard: 0,
        query_chunk: 4,
        passage_chunk: 4,
        loss: plain,
    };
    let (_, _, q_local, p_local) = data(case, comm.as_ref());
    let stop = gradcache::stop::StopSignal::new();
    if last {
        stop.request(gradcache::stop::SIGTERM);
    }
    let gc = build(case, Some(comm)).with_stop_signal(stop);
    match gc.cache_step(0, &q_local, &p_local) {
        Err(Error::Interrupted { signal }) if signal == gradcache::stop::SIGTERM => {}
        other => {
            return Err(format!(
                "expected the step abandoned on every rank, got {other:?}"
            ))
        }
    }
    let asked = last.then_some(gradcache::stop::SIGUSR1);
    match dist::any_stop(comm.as_ref(), asked) {
        Ok(Some(s)) if s == gradcache::stop::SIGUSR1 => {}
        other => return Err(format!("expected SIGUSR1 on every rank, got {other:?}")),
    }
    let local: gradcache::Result<()> = match (r, last) {
        (0, _) if n > 1 => Err(Error::InvalidArgument {
            what: "test",
            value: "x".into(),
            reason: "rank 0 fails",
        }),
        (_, true) => Err(Error::Interrupted { signal: 2 }),
        _ => Ok(()),
    };
    match dist::agree(comm.as_ref(), local) {
        Err(Error::RankFailed { rank: 0, .. }) if n > 1 => Ok(()),
        Err(Error::Interrupted { signal: 2 }) if n == 1 => Ok(()),
        other => Err(format!("expected rank 0's failure to win, got {other:?}")),
    }
}

fn failure(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let (n, r) = (comm.world_size(), comm.rank());
    let case = Case {
        two_towers: false,
        hard: 0,
        query_chunk: 4,
        passage_chunk: 4,
        loss: plain,
    };
    let (_, _, q_local, p_local) = data(case, comm.as_ref());
    // The last rank passes a passage batch that is not a multiple of its queries.
    let p_local = if r == n - 1 {
        p_local.narrow(0, 0, LOCAL - 1).unwrap()
    } else {
        p_local
    };
    let gc = build(case, Some(comm));
    match gc.cache_step(0, &q_local, &p_local) {
        Err(Error::RankFailed {
            rank,
            world,
            message,
        }) if n > 1 => ensure(
            rank == n - 1 && world == n && message.contains("multiple of queries"),
            || format!("rank {rank} of {world}: {message}"),
        )?,
        Err(Error::PassagesNotMultiple { .. }) if n == 1 => {}
        other => return Err(format!("expected the last rank's failure, got {other:?}")),
    }
    // A fingerprint that differs on the last rank.
    let print = if r == n - 1 && n > 1 { "b" } else { "a" };
    match dist::ensure_same(comm.as_ref(), "the config", print.as_bytes(), |b| {
        String::from_utf8_lossy(b).into_owned()
    }) {
        Ok(()) if n == 1 => Ok(()),
        Err(Error::RankMismatch { what, detail }) => ensure(
            what == "the config" && detail.contains(&format!("rank {} has b", n - 1)),
            || format!("{what}: {detail}"),
        ),
        other => Err(format!("expected RankMismatch, got {other:?}")),
    }
}

fn volume(comm: &Rc<dyn Collective>) -> Result<(), String> {
    let case = Case {
        two_towers: true,
        hard: 1,
        query_chunk: 4,
        passage_chunk: 4,
        loss: symmetric,
    };
    let (_, _, q_local, p_local) = data(case, comm.as_ref());
    let gc = build(case, Some(comm)).with_bucket_bytes(1 << 20);
    let before = comm.traffic();
    gc.cache_step(0, &q_local, &p_local)
        .map_err(|e| e.to_string())?;
    let after = comm.traffic();
    let n = comm.world_size() as u64;
    let params = gc.params().elem_count() as u64;
    let expected = if n == 1 {
        StepVolume {
            all_gather_bytes: 0,
            all_reduce_bytes: 0,
        }
    } else {
        StepVolume::of(LOCAL as u64 * n, 2, WIDTH as u64, params, 4)
    };
    let gathered = after.all_gather_bytes - before.all_gather_bytes;
    let reduced = after.all_reduce_bytes - before.all_reduce_bytes;
    let calls = after.all_reduce_calls - before.all_reduce_calls;
    ensure(
        gathered == expected.all_gather_bytes && reduced == expected.all_reduce_bytes,
        || format!("moved {gathered} + {reduced} bytes, formula {expected:?}"),
    )?;
    // The whole model fits one 1 MiB bucket: one all-reduce per step, not one per chunk.
    ensure(n == 1 || calls == 1, || format!("{calls} all-reduce calls"))
}

fn second_init(_: &Rc<dyn Collective>) -> Result<(), String> {
    match dist::init(Backend::Mpi) {
        Err(Error::BackendUnavailable { backend, reason }) => ensure(
            backend == "mpi" && reason.contains("already initialised"),
            || format!("unclear: {reason}"),
        ),
        Err(other) => Err(format!("expected BackendUnavailable, got {other}")),
        Ok(_) => Err("MPI started twice".into()),
    }
}
