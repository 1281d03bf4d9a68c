//! The MPI backend: CPU processes started by `mpirun`, over the `mpi` crate (Open MPI).

use std::cell::Cell;

use candle_core::{DType, Device, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::{Collective, ReduceOp, Traffic};
use crate::{Error, Result};

/// MPI's world communicator. Dropping it finalises MPI.
pub struct Mpi {
    world: SimpleCommunicator,
    traffic: Cell<Traffic>,
    // Declared last: dropped (MPI_Finalize) after the communicator.
    _universe: Universe,
}

impl Mpi {
    /// Initialises MPI (once per process). Started without `mpirun`, this is a world of one.
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| Error::BackendUnavailable {
            backend: "mpi",
            reason: "MPI is already initialised in this process (start the backend once)".into(),
        })?;
        Ok(Self {
            world: universe.world(),
            traffic: Cell::new(Traffic::default()),
            _universe: universe,
        })
    }

    /// The world communicator, for control-plane messages of other backends.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn world(&self) -> &SimpleCommunicator {
        &self.world
    }

    /// Fails with [`Error::RankMismatch`] unless every rank passes the same shape.
    pub(crate) fn ensure_same_shape(&self, op: &str, dims: &[usize]) -> Result<()> {
        let mine: Vec<u8> = dims
            .iter()
            .flat_map(|&d| (d as u64).to_le_bytes())
            .collect();
        super::ensure_same(self, &format!("the tensor shape of {op}"), &mine, |b| {
            let dims: Vec<u64> = b
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            format!("{dims:?}")
        })
    }

    fn count(&self, f: impl FnOnce(&mut Traffic)) {
        let mut t = self.traffic.get();
        f(&mut t);
        self.traffic.set(t);
    }
}

/// A CPU tensor's elements as `f64` or `f32` (other dtypes travel as `f32`).
enum Host {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

fn to_host(t: &Tensor) -> Result<Host> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F64 => Host::F64(flat.to_vec1::<f64>()?),
        DType::F32 => Host::F32(flat.to_vec1::<f32>()?),
        _ => Host::F32(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?),
    })
}

fn from_host(h: Host, dims: &[usize], like: &Tensor) -> Result<Tensor> {
    let t = match h {
        Host::F32(v) => Tensor::from_vec(v, dims, &Device::Cpu)?,
        Host::F64(v) => Tensor::from_vec(v, dims, &Device::Cpu)?,
    };
    Ok(t.to_dtype(like.dtype())?.to_device(like.device())?)
}

impl Collective for Mpi {
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        super::watchdog::watch("all_gather", || {
            self.ensure_same_shape("all_gather", tensor.dims())?;
            let n = self.world_size();
            let mut dims = tensor.dims().to_vec();
            if dims.is_empty() {
                dims.push(1);
            }
            dims[0] *= n;
            let out = match to_host(tensor)? {
                Host::F32(v) => {
                    let mut buf = vec![0f32; v.len() * n];
                    self.world.all_gather_into(&v[..], &mut buf[..]);
                    Host::F32(buf)
                }
                Host::F64(v) => {
                    let mut buf = vec![0f64; v.len() * n];
                    self.world.all_gather_into(&v[..], &mut buf[..]);
                    Host::F64(buf)
                }
            };
            let bytes = (tensor.elem_count() * n * tensor.dtype().size_in_bytes()) as u64;
            self.count(|t| t.all_gather_bytes += bytes);
            from_host(out, &dims, tensor)
        })
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::watchdog::watch("all_reduce", || {
            self.ensure_same_shape("all_reduce", tensor.dims())?;
            let sum = SystemOperation::sum();
            let out = match to_host(tensor)? {
                Host::F32(v) => {
                    let mut buf = vec![0f32; v.len()];
                    self.world.all_reduce_into(&v[..], &mut buf[..], sum);
                    Host::F32(buf)
                }
                Host::F64(v) => {
                    let mut buf = vec![0f64; v.len()];
                    self.world.all_reduce_into(&v[..], &mut buf[..], sum);
                    Host::F64(buf)
                }
            };
            let bytes = (tensor.elem_count() * tensor.dtype().size_in_bytes()) as u64;
            self.count(|t| {
                t.all_reduce_bytes += bytes;
                t.all_reduce_calls += 1;
            });
            let out = from_host(out, tensor.dims(), tensor)?;
            Ok(match op {
                ReduceOp::Sum => out,
                ReduceOp::Avg => (out / self.world_size() as f64)?,
            })
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        super::watchdog::watch("broadcast", || {
            self.ensure_same_shape("broadcast", tensor.dims())?;
            let root = self.world.process_at_rank(root as i32);
            let out = match to_host(tensor)? {
                Host::F32(mut v) => {
                    root.broadcast_into(&mut v[..]);
                    Host::F32(v)
                }
                Host::F64(mut v) => {
                    root.broadcast_into(&mut v[..]);
                    Host::F64(v)
                }
            };
            from_host(out, tensor.dims(), tensor)
        })
    }

    fn barrier(&self) -> Result<()> {
        super::watchdog::watch("barrier", || {
            self.world.barrier();
            Ok(())
        })
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        super::watchdog::watch("all_gather_bytes", || {
            let n = self.world_size();
            let mut lens = vec![0u64; n];
            self.world
                .all_gather_into(&(bytes.len() as u64), &mut lens[..]);
            let counts: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let displs: Vec<i32> = counts
                .iter()
                .scan(0, |acc, &c| {
                    let d = *acc;
                    *acc += c;
                    Some(d)
                })
                .collect();
            let total = lens.iter().sum::<u64>() as usize;
            if total == 0 {
                // Open MPI rejects a zero-sized gather of empty buffers.
                return Ok(vec![Vec::new(); n]);
            }
            let mut buf = vec![0u8; total];
            {
                let mut part = PartitionMut::new(&mut buf[..], counts.clone(), &displs[..]);
                self.world.all_gather_varcount_into(bytes, &mut part);
            }
            Ok(counts
                .iter()
                .zip(&displs)
                .map(|(&c, &d)| buf[d as usize..(d + c) as usize].to_vec())
                .collect())
        })
    }

    fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
