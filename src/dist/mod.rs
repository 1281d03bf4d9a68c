//! Distributed training: collectives across processes and what a step needs from them.
//!
//! DPR-style training is stronger with more in-batch negatives, so a run over `N`
//! processes all-gathers the representations: every query is scored against every passage
//! of the global batch. A [`Collective`] is the small set of operations that needs (rank,
//! world size, all-gather, all-reduce, broadcast, barrier), with three backends:
//!
//! - [`Single`]: one process, every operation is the identity;
//! - `Mpi` (cargo feature `mpi`): CPU processes started by `mpirun`, over Open MPI;
//! - `Nccl` (cargo feature `nccl`): one process per GPU, NCCL collectives on device
//!   memory, started by `mpirun` and bootstrapped over MPI (rank 0's NCCL id is
//!   broadcast), so one launcher serves both.
//!
//! On top of the trait: [`agree`] turns one rank's failure into the same error on every
//! rank (no rank is left waiting in a collective), [`ensure_same`] compares a fingerprint
//! across ranks, [`reduce_gradients`] sums parameter gradients in a few large buckets once
//! per step, and [`weights_checksum`] / [`ensure_identical_weights`] check that every rank
//! holds the same weights.

use std::rc::Rc;

use candle_core::{DType, Device, Tensor};

use crate::params::{Gradients, Params};
use crate::rng;
use crate::{Error, Result};

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
pub use self::nccl::Nccl;
pub mod watchdog;

/// How an all-reduce combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (the sum divided by the world size).
    Avg,
}

/// Payload moved by the data-plane collectives of one process so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes of all-gather results (the whole gathered tensor, this rank's part included).
    pub all_gather_bytes: u64,
    /// Bytes of all-reduced buffers.
    pub all_reduce_bytes: u64,
    /// Number of all-reduce calls.
    pub all_reduce_calls: u64,
}

/// The collectives a distributed step needs. Every rank must call the same operations in
/// the same order with tensors of the same shape and dtype; shapes are checked.
pub trait Collective {
    /// The backend's name (`none`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;

    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of processes.
    fn world_size(&self) -> usize;

    /// The device this rank computes on (its GPU for NCCL, the CPU otherwise).
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// Concatenates every rank's `tensor` along dimension 0, in rank order.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor>;

    /// Combines every rank's `tensor` element-wise.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Returns rank `root`'s `tensor` on every rank (the others pass one of the same shape).
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;

    /// Waits until every rank has arrived.
    fn barrier(&self) -> Result<()>;

    /// Control plane: every rank's `bytes`, in rank order; lengths may differ.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Payload moved by this process's data-plane collectives so far.
    fn traffic(&self) -> Traffic;

    /// Ends every process of the job at once with exit code `code` (`MPI_Abort`): for a
    /// failure the other ranks cannot learn of through [`agree`].
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// One process: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn backend(&self) -> &'static str {
        "none"
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        Ok(tensor.clone())
    }

    fn all_reduce(&self, tensor: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        Ok(tensor.clone())
    }

    fn broadcast(&self, tensor: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(tensor.clone())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }

    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
}

/// The distributed backend of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// One process.
    #[default]
    None,
    /// CPU processes over MPI (`mpirun -n N`); needs the `mpi` cargo feature.
    Mpi,
    /// One process per GPU over NCCL, started by `mpirun`; needs the `nccl` cargo feature.
    Nccl,
}

/// Starts `backend`: MPI is initialised once per process (so at most one [`init`] per
/// process for `mpi` and `nccl`); `nccl` also opens the GPU numbered by the rank's local
/// rank on its node (`OMPI_COMM_WORLD_LOCAL_RANK`, else the rank).
pub fn init(backend: Backend) -> Result<Rc<dyn Collective>> {
    match backend {
        Backend::None => Ok(Rc::new(Single)),
        #[cfg(feature = "mpi")]
        Backend::Mpi => Ok(Rc::new(Mpi::init()?)),
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi => Err(Error::BackendUnavailable {
            backend: "mpi",
            reason: "this build has no MPI support; rebuild with `cargo build --release \
                     --features mpi` (needs Open MPI: `apt-get install openmpi-bin \
                     libopenmpi-dev libclang-dev`)"
                .into(),
        }),
        #[cfg(feature = "nccl")]
        Backend::Nccl => Ok(Rc::new(Nccl::init()?)),
        #[cfg(not(feature = "nccl"))]
        Backend::Nccl => Err(Error::BackendUnavailable {
            backend: "nccl",
            reason: "this build has no NCCL support; rebuild with `cargo build --release \
                     --features nccl` on a machine with CUDA and NCCL"
                .into(),
        }),
    }
}

/// Makes one rank's failure every rank's failure: each rank passes the outcome of its
/// local work, and all ranks return `Ok` only if every rank succeeded; otherwise all return
/// [`Error::RankFailed`] naming the lowest failing rank and its message. A stop request
/// ([`Error::Interrupted`]) on any rank, and no failure elsewhere, becomes
/// [`Error::Interrupted`] on every rank, so that all abandon the same step. Call it after
/// local work that can fail and before the next data-plane collective, so that no rank
/// waits for a partner that has given up. With one process, `local` is returned as is.
pub fn agree<T>(comm: &dyn Collective, local: Result<T>) -> Result<T> {
    if comm.world_size() == 1 {
        return local;
    }
    let status = match &local {
        Ok(_) => Vec::new(),
        // A stop request: a zero byte (no message starts with one), then the signal.
        Err(Error::Interrupted { signal }) => vec![0, (*signal).clamp(1, 255) as u8],
        // A failure message is never empty, so empty means success.
        Err(e) => format!("{e}").into_bytes(),
    };
    let all = comm.all_gather_bytes(&status)?;
    if let Some(rank) = all.iter().position(|s| s.first().is_some_and(|&b| b != 0)) {
        return Err(Error::RankFailed {
            rank,
            world: all.len(),
            message: String::from_utf8_lossy(&all[rank]).into_owned(),
        });
    }
    match all.iter().find(|s| !s.is_empty()) {
        None => local,
        Some(stop) => Err(Error::Interrupted {
            signal: i32::from(stop.get(1).copied().unwrap_or(0)),
        }),
    }
}

/// Whether any rank was asked to stop (`local`: this rank's [`crate::stop::StopSignal`]),
/// agreed by all: every rank returns the same answer (the lowest rank's signal). With one
/// process, `local` itself.
pub fn any_stop(comm: &dyn Collective, local: Option<i32>) -> Result<Option<i32>> {
    if comm.world_size() == 1 {
        return Ok(local);
    }
    let mine = local.map_or(Vec::new(), |s| vec![s.clamp(1, 255) as u8]);
    let all = comm.all_gather_bytes(&mine)?;
    Ok(all.iter().find_map(|s| s.first().map(|&b| i32::from(b))))
}

/// Rank 0 computes, every rank receives: runs `compute` on rank 0 only, agrees on its
/// outcome (a failure there becomes every rank's [`Error::RankFailed`]) and hands rank 0's
/// value to every rank (as JSON over the control plane). Used for work that must happen
/// once and be seen identically everywhere: training the tokenizer, the evaluation. With
/// one process this is `compute()`.
pub fn from_root<T>(
    comm: &dyn Collective,
    what: &str,
    compute: impl FnOnce() -> Result<T>,
) -> Result<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    if comm.world_size() == 1 {
        return compute();
    }
    // The other ranks wait for rank 0's work, as long as it takes: not a stuck peer.
    watchdog::patient(|| from_root_inner(comm, what, compute))
}

fn from_root_inner<T>(
    comm: &dyn Collective,
    what: &str,
    compute: impl FnOnce() -> Result<T>,
) -> Result<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let local = if comm.rank() == 0 {
        compute().and_then(|value| {
            let bytes = serde_json::to_vec(&value).map_err(|e| Error::RankMismatch {
                what: what.to_string(),
                detail: format!("rank 0 cannot serialise it: {e}"),
            })?;
            Ok(Some((value, bytes)))
        })
    } else {
        Ok(None)
    };
    let mine = agree(comm, local)?;
    let bytes = mine.as_ref().map(|(_, b)| b.as_slice()).unwrap_or_default();
    let all = comm.all_gather_bytes(bytes)?;
    match mine {
        Some((value, _)) => Ok(value),
        None => serde_json::from_slice(&all[0]).map_err(|e| Error::RankMismatch {
            what: what.to_string(),
            detail: format!("rank 0's value does not parse: {e}"),
        }),
    }
}

/// Checks that every rank passes the same `bytes` (e.g. a config fingerprint); on a
/// difference every rank returns [`Error::RankMismatch`] naming the ranks that differ from
/// rank 0, with `describe(bytes)` of each side.
pub fn ensure_same(
    comm: &dyn Collective,
    what: &str,
    bytes: &[u8],
    describe: impl Fn(&[u8]) -> String,
) -> Result<()> {
    let all = comm.all_gather_bytes(bytes)?;
    let differing: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    if differing.is_empty() {
        return Ok(());
    }
    let detail = differing
        .iter()
        .map(|&r| format!("rank {r} has {}", describe(&all[r])))
        .collect::<Vec<_>>()
        .join("; ");
    Err(Error::RankMismatch {
        what: what.to_string(),
        detail: format!("rank 0 has {}; {detail}", describe(&all[0])),
    })
}

/// Default size of one gradient all-reduce bucket: 25 MiB, PyTorch DDP's default.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Sums every rank's parameter gradients, once per step: gradients are flattened in
/// parameter-name order (a parameter without a gradient contributes zeros, so every rank
/// sends the same layout) and reduced in buckets of about `bucket_bytes`. Returns a
/// gradient for every parameter. With one process the gradients are returned unchanged.
///
/// Summing (not averaging) is what makes the result the single-process gradient of the
/// union batch: each rank's local gradient is already its share of the global loss.
pub fn reduce_gradients(
    comm: &dyn Collective,
    params: &Params,
    grads: Gradients,
    bucket_bytes: usize,
) -> Result<Gradients> {
    if comm.world_size() == 1 {
        return Ok(grads);
    }
    let mut flat: Vec<(String, Tensor)> = Vec::with_capacity(params.len());
    for (name, var) in params.iter() {
        let g = match grads.get(name) {
            Some(g) => g.clone(),
            None => var.as_tensor().zeros_like()?,
        };
        flat.push((name.to_string(), g));
    }
    let mut out = Vec::with_capacity(flat.len());
    let mut bucket: Vec<(String, Tensor)> = Vec::new();
    let mut bytes = 0;
    for (name, g) in flat {
        bytes += g.elem_count() * g.dtype().size_in_bytes();
        bucket.push((name, g));
        if bytes >= bucket_bytes {
            out.extend(reduce_bucket(comm, std::mem::take(&mut bucket))?);
            bytes = 0;
        }
    }
    if !bucket.is_empty() {
        out.extend(reduce_bucket(comm, bucket)?);
    }
    Ok(out.into_iter().collect())
}

fn reduce_bucket(
    comm: &dyn Collective,
    bucket: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let flat: Vec<Tensor> = bucket
        .iter()
        .map(|(_, g)| g.flatten_all())
        .collect::<candle_core::Result<_>>()?;
    let summed = comm.all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)?;
    let mut start = 0;
    let mut out = Vec::with_capacity(bucket.len());
    for (name, g) in bucket {
        let n = g.elem_count();
        out.push((name, summed.narrow(0, start, n)?.reshape(g.shape())?));
        start += n;
    }
    Ok(out)
}

/// A 64-bit FNV-1a hash of every parameter's bytes in name order: equal on two ranks only
/// if their weights are bit-identical (up to hash collisions).
pub fn weights_checksum(params: &Params) -> Result<u64> {
    let mut hash = rng::FNV_OFFSET;
    for (name, var) in params.iter() {
        hash = rng::hash_bytes(hash, name.as_bytes());
        let values = var.as_tensor().flatten_all()?.to_dtype(DType::F32)?;
        for v in values.to_vec1::<f32>()? {
            hash = rng::hash_bytes(hash, &v.to_bits().to_le_bytes());
        }
    }
    Ok(hash)
}

/// Checks that every rank holds bit-identical weights; returns the common checksum.
pub fn ensure_identical_weights(comm: &dyn Collective, params: &Params) -> Result<u64> {
    let sum = weights_checksum(params)?;
    ensure_same(
        comm,
        "the weights",
        &sum.to_le_bytes(),
        |b| match <[u8; 8]>::try_from(b) {
            Ok(a) => format!("checksum {:016x}", u64::from_le_bytes(a)),
            Err(_) => format!("a malformed checksum of {} bytes", b.len()),
        },
    )?;
    Ok(sum)
}

/// Data-plane volume of one distributed gradient-cache step, per rank, on paper.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepVolume {
    /// Bytes of the gathered representations (queries and passages of the global batch).
    pub all_gather_bytes: u64,
    /// Bytes of the all-reduced gradient buffer (every parameter once).
    pub all_reduce_bytes: u64,
}

impl StepVolume {
    /// The volume of a step over a global batch of `batch` queries with `passages_per_query`
    /// passages each, representations of `width` elements and `params` parameter elements,
    /// `elem_bytes` bytes per element.
    pub fn of(
        batch: u64,
        passages_per_query: u64,
        width: u64,
        params: u64,
        elem_bytes: u64,
    ) -> Self {
        Self {
            all_gather_bytes: batch * (1 + passages_per_query) * width * elem_bytes,
            all_reduce_bytes: params * elem_bytes,
        }
    }

    /// Bytes each rank sends (and receives) with ring algorithms over `world` ranks: an
    /// all-gather moves `(N-1)/N` of its result, an all-reduce `2(N-1)/N` of its buffer.
    pub fn ring_bytes_per_rank(&self, world: u64) -> f64 {
        let n = world as f64;
        let share = (n - 1.0) / n;
        self.all_gather_bytes as f64 * share + 2.0 * self.all_reduce_bytes as f64 * share
    }
}
