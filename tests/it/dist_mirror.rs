//! The distributed step's bookkeeping without MPI: a `Mirror` collective plays a world of N
//! ranks that all hold the same local batch (every all-gather repeats this rank's tensor
//! N times, every all-reduce multiplies by N). The distributed step must then equal one
//! process over the local batch repeated N times: this checks the representation
//! gather, the split of the cached gradient into this rank's chunks, the scale (a sum over
//! ranks), the bucketed gradient flattening and unflattening (64-byte buckets, so
//! parameters straddle bucket boundaries), and the failure agreement, in plain
//! `cargo test`. Since every mirrored rank holds the same rows, a wrong row offset would go
//! unnoticed here: the real multi-process checks are in `tests/distributed.rs` (run under
//! `mpirun`).

use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use gradcache::dist::{self, Collective, ReduceOp, Traffic};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{Error, GradCache, InfoNce, ParamStore, Tower};

use crate::common;

struct Mirror {
    rank: usize,
    world: usize,
    /// Byte messages the other ranks send (this rank's own message is used for itself).
    others: Vec<u8>,
}

impl Collective for Mirror {
    fn backend(&self) -> &'static str {
        "mirror"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, t: &Tensor) -> gradcache::Result<Tensor> {
        Ok(Tensor::cat(&vec![t.clone(); self.world], 0)?)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> gradcache::Result<Tensor> {
        Ok(match op {
            ReduceOp::Sum => (t * self.world as f64)?,
            ReduceOp::Avg => t.clone(),
        })
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> gradcache::Result<Tensor> {
        Ok(t.clone())
    }
    fn barrier(&self) -> gradcache::Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> gradcache::Result<Vec<Vec<u8>>> {
        Ok((0..self.world)
            .map(|r| {
                if r == self.rank {
                    bytes.to_vec()
                } else {
                    self.others.clone()
                }
            })
            .collect())
    }
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
}

const LOCAL: usize = 5;
const FEATURES: usize = 6;

fn features(seed: u64, rows: usize) -> Tensor {
    common::features(seed, rows, FEATURES)
}

fn gc(two_towers: bool) -> GradCache<Tower<Mlp>> {
    let store = ParamStore::new(11, DType::F32, &Device::Cpu);
    let cfg = MlpConfig {
        input: FEATURES,
        hidden: 10,
        output: 4,
        dropout: 0.0,
    };
    let tower = |prefix: &str| Tower::build(&store, prefix, |vb| Mlp::new(&cfg, vb)).unwrap();
    let loss = InfoNce::new(0.2).unwrap().with_symmetric(true);
    let gc = if two_towers {
        GradCache::two_towers(tower("query"), tower("passage"), 2, 3, loss).unwrap()
    } else {
        GradCache::shared(tower(""), 2, loss)
            .unwrap()
            .with_chunk_sizes(2, 3)
            .unwrap()
    };
    gc.with_dropout(false).with_bucket_bytes(64)
}

#[test]
fn mirrored_ranks_equal_one_process_on_the_repeated_batch() {
    for two_towers in [false, true] {
        for (rank, world) in [(0, 2), (1, 2), (2, 3)] {
            let q = features(1, LOCAL);
            let p = features(2, LOCAL * 2); // one hard negative per query
            let repeat = |t: &Tensor| Tensor::cat(&vec![t.clone(); world], 0).unwrap();
            let single = gc(two_towers)
                .full_batch_step(0, &repeat(&q), &repeat(&p))
                .unwrap();
            let comm = Rc::new(Mirror {
                rank,
                world,
                others: Vec::new(),
            });
            let dist = gc(two_towers)
                .with_collective(comm)
                .cache_step(0, &q, &p)
                .unwrap();
            let err = dist.grads.max_rel_err(&single.grads, 0.0).unwrap();
            let loss_err = ((dist.loss - single.loss) / single.loss).abs();
            assert!(
                err <= 1e-5 && loss_err <= 1e-5,
                "two_towers={two_towers} rank {rank}/{world}: grad err {err:e}, loss err {loss_err:e}"
            );
            assert_eq!(dist.grads.len(), single.grads.len());
        }
    }
}

#[test]
fn another_ranks_failure_fails_this_rank_with_its_message() {
    let comm = Rc::new(Mirror {
        rank: 0,
        world: 3,
        others: b"data.jsonl:7: not valid JSON".to_vec(),
    });
    let gc = gc(false).with_collective(comm.clone());
    // This rank's batch is fine; the others report a failure.
    match gc.cache_step(0, &features(1, LOCAL), &features(2, LOCAL)) {
        Err(Error::RankFailed {
            rank,
            world,
            message,
        }) => {
            assert_eq!((rank, world), (1, 3), "the lowest failing rank is named");
            assert_eq!(message, "data.jsonl:7: not valid JSON");
        }
        other => panic!("expected RankFailed, got {other:?}"),
    }
    // A local failure is reported under this rank's number, with its message.
    let local: gradcache::Result<()> = Err(Error::EmptyBatch {
        side: gradcache::Side::Query,
    });
    let quiet = Mirror {
        rank: 2,
        world: 3,
        others: Vec::new(),
    };
    match dist::agree(&quiet, local) {
        Err(Error::RankFailed {
            rank: 2, message, ..
        }) => {
            assert!(message.contains("the query batch has no rows"), "{message}")
        }
        other => panic!("expected RankFailed from rank 2, got {other:?}"),
    }
}

#[test]
fn differing_fingerprints_name_the_rank_and_both_values() {
    let comm = Mirror {
        rank: 0,
        world: 2,
        others: b"temperature 0.1".to_vec(),
    };
    let err = dist::ensure_same(&comm, "the config", b"temperature 0.05", |b| {
        String::from_utf8_lossy(b).into_owned()
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ranks disagree on the config: rank 0 has temperature 0.05; rank 1 has temperature 0.1"
    );
}
