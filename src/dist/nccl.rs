//! The NCCL backend: one process per GPU, collectives on device memory through candle's
//! cudarc, started by `mpirun` and bootstrapped over MPI.
//!
//! Rank 0 creates the NCCL unique id and broadcasts it over MPI; every rank then joins the
//! NCCL communicator on GPU `local rank` of its node. Tensors travel as f32 (other float
//! dtypes are converted on the device and back). Control-plane messages (failure
//! agreement, fingerprints) stay on MPI.

use std::cell::Cell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclReduce};
use mpi::traits::*;

use super::{Collective, Mpi, ReduceOp, Traffic};
use crate::{Error, Result};

/// NCCL across one GPU per process, with MPI alongside for the control plane.
pub struct Nccl {
    comm: Comm,
    device: Device,
    traffic: Cell<Traffic>,
    // Declared last: MPI is finalised after NCCL is torn down.
    mpi: Mpi,
}

fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable {
        backend: "nccl",
        reason,
    }
}

/// Opens GPU `ordinal` ([`crate::device`] turns cudarc's panic without a driver into an
/// error), reported as this backend's failure.
fn open_gpu(ordinal: usize) -> Result<Device> {
    crate::device::open_cuda(ordinal).map_err(|e| match e {
        Error::DeviceUnavailable { reason, .. } => unavailable(reason),
        other => other,
    })
}

impl Nccl {
    /// Initialises MPI, opens GPU `OMPI_COMM_WORLD_LOCAL_RANK` (or the rank) and joins the
    /// NCCL communicator of all ranks.
    pub fn init() -> Result<Self> {
        let mpi = Mpi::init()?;
        let (rank, world) = (mpi.rank(), mpi.world_size());
        let local = [
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
        ]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .unwrap_or(rank);
        // Every rank must agree that its GPU opened before anyone waits for the NCCL id.
        let device = super::agree(&mpi, open_gpu(local))?;
        let id = super::agree(
            &mpi,
            if rank == 0 {
                Id::new().map_err(|e| unavailable(format!("ncclGetUniqueId: {e:?}")))
            } else {
                Ok(Id::uninit([0; 128]))
            },
        )?;
        let mut raw = *id.internal();
        mpi.world().process_at_rank(0).broadcast_into(&mut raw[..]);
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = super::agree(
            &mpi,
            Comm::from_rank(stream, rank, world, Id::uninit(raw))
                .map_err(|e| unavailable(format!("ncclCommInitRank: {e:?}"))),
        )?;
        Ok(Self {
            comm,
            device,
            traffic: Cell::new(Traffic::default()),
            mpi,
        })
    }

    /// The collective `kind` on `tensor`, waited for (the stream synchronised) under the
    /// watchdog: NCCL enqueues it and returns, so a peer that never joins would otherwise
    /// hang the next synchronisation, unseen.
    fn run(&self, tensor: &Tensor, kind: Kind) -> Result<Tensor> {
        super::watchdog::watch(kind.name(), || {
            self.mpi.ensure_same_shape(kind.name(), tensor.dims())?;
            let dtype = tensor.dtype();
            let t = tensor.to_dtype(DType::F32)?.contiguous()?;
            let out = t.apply_op1_no_bwd(&NcclOp {
                comm: &self.comm,
                kind,
            })?;
            self.device.synchronize()?;
            let bytes = (out.elem_count() * 4) as u64;
            let mut traffic = self.traffic.get();
            match kind {
                Kind::AllGather => traffic.all_gather_bytes += bytes,
                Kind::AllReduce => {
                    traffic.all_reduce_bytes += bytes;
                    traffic.all_reduce_calls += 1;
                }
                Kind::Broadcast(_) => {}
            }
            self.traffic.set(traffic);
            Ok(out.to_dtype(dtype)?)
        })
    }
}

impl Collective for Nccl {
    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn world_size(&self) -> usize {
        self.mpi.world_size()
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.run(tensor, Kind::AllGather)
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let sum = self.run(tensor, Kind::AllReduce)?;
        Ok(match op {
            ReduceOp::Sum => sum,
            ReduceOp::Avg => (sum / self.world_size() as f64)?,
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        self.run(tensor, Kind::Broadcast(root))
    }

    fn barrier(&self) -> Result<()> {
        super::watchdog::watch("barrier", || {
            self.device.synchronize()?;
            self.mpi.barrier()
        })
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.mpi.all_gather_bytes(bytes)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    fn abort(&self, code: i32) -> ! {
        self.mpi.abort(code)
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    AllGather,
    AllReduce,
    Broadcast(usize),
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllGather => "all_gather",
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast(_) => "broadcast",
        }
    }
}

/// One NCCL collective as a candle op on a contiguous f32 CUDA tensor.
struct NcclOp<'a> {
    comm: &'a Comm,
    kind: Kind,
}

impl CustomOp1 for NcclOp<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives need tensors on a CUDA device")
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("NCCL collectives need a contiguous tensor")
        };
        if storage.dtype() != DType::F32 {
            candle_core::bail!("NCCL collectives here run on f32 tensors")
        }
        let src = storage.as_cuda_slice::<f32>()?.slice(start..end);
        let device = storage.device().clone();
        let mut dims = layout.dims().to_vec();
        let len = match self.kind {
            Kind::AllGather => {
                let world = self.comm.world_size();
                if let Some(d) = dims.first_mut() {
                    *d *= world;
                }
                (end - start) * world
            }
            Kind::AllReduce | Kind::Broadcast(_) => end - start,
        };
        let mut dst = device.alloc_zeros::<f32>(len)?;
        let done = match self.kind {
            Kind::AllGather => self.comm.all_gather(&src, &mut dst),
            Kind::AllReduce => self.comm.all_reduce(&src, &mut dst, &NcclReduce::Sum),
            Kind::Broadcast(root) => self.comm.broadcast(Some(&src), &mut dst, root as i32),
        };
        done.map_err(|e| candle_core::Error::Msg(format!("NCCL {}: {e:?}", self.kind.name())))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, device), Shape::from(dims)))
    }
}
