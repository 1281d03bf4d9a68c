//! Where the encoder runs: `"cpu"`, `"cuda"` (GPU 0) or `"cuda:N"`.
//!
//! A CUDA device in a build without the `cuda` feature, or on a machine whose CUDA driver
//! cannot be loaded (cudarc panics there), is [`Error::DeviceUnavailable`], never a panic.
//!
//! A GPU is set up for training as it opens: one stream without per-allocation event
//! tracking, and a memory pool that keeps what it frees ([`pool_memory`] reads what the
//! process held).

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::{Error, Result};

/// A device named in a configuration or on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU (every core candle uses).
    #[default]
    Cpu,
    /// CUDA GPU number `ordinal`.
    Cuda(usize),
}

impl DeviceSpec {
    /// Opens the device.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => open_cuda(ordinal),
        }
    }

    /// Whether this is a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument {
            what: "device",
            value: s.to_string(),
            reason: "expected \"cpu\", \"cuda\" or \"cuda:N\" (N the GPU number)",
        };
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

fn unavailable(device: String, reason: String) -> Error {
    Error::DeviceUnavailable { device, reason }
}

/// Opens GPU `ordinal`. cudarc panics (rather than failing) when the CUDA driver library
/// cannot be loaded; that becomes an error here, without the panic message.
#[cfg(feature = "cuda")]
pub(crate) fn open_cuda(ordinal: usize) -> Result<Device> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| Device::new_cuda(ordinal));
    std::panic::set_hook(hook);
    let name = format!("cuda:{ordinal}");
    match opened {
        Ok(Ok(device)) => {
            prepare_cuda(&device).map_err(|e| unavailable(name, format!("cannot set up: {e}")))?;
            Ok(device)
        }
        Ok(Err(e)) => Err(unavailable(name, format!("cannot open GPU {ordinal}: {e}"))),
        Err(_) => Err(unavailable(
            name,
            "the CUDA driver library (libcuda.so) could not be loaded: is this a machine \
             with an NVIDIA GPU and driver?"
                .into(),
        )),
    }
}

/// Without the `cuda` feature there is no GPU to open.
#[cfg(not(feature = "cuda"))]
pub(crate) fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(unavailable(
        format!("cuda:{ordinal}"),
        "this build has no CUDA support: rebuild with `--features cuda`".into(),
    ))
}

/// What opening a GPU sets up:
/// - cudarc's per-allocation events off: candle launches everything on one stream, where
///   they order nothing, and each allocation would create two events and each free
///   destroy them (a few microseconds each);
/// - the device's default memory pool (cudarc allocates from it with `cuMemAllocAsync`)
///   keeps freed memory instead of handing it back to the driver at each
///   synchronisation (its release threshold raised to the maximum), so a step in the
///   steady state allocates nothing from the driver: PyTorch's caching allocator, in the
///   driver.
#[cfg(feature = "cuda")]
fn prepare_cuda(device: &Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cuda = device.as_cuda_device()?;
    // SAFETY: every kernel, copy and collective of this process runs on candle's one
    // stream of this device (no other stream is created), so no tensor needs an event to
    // order a use on another stream.
    unsafe { cuda.disable_event_tracking() };
    let Some(pool) = memory_pool(device)? else {
        return Ok(());
    };
    let mut threshold = u64::MAX;
    // SAFETY: a valid pool of this device and an attribute that takes a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| candle_core::Error::Msg(format!("the memory pool's release threshold: {e}")))?;
    Ok(())
}

/// The default memory pool of a CUDA device (`None` where the device allocates without
/// one).
#[cfg(feature = "cuda")]
fn memory_pool(
    device: &Device,
) -> Result<Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool>> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = device.as_cuda_device()?.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    let msg = |e| candle_core::Error::Msg(format!("the GPU's memory pool: {e}"));
    ctx.bind_to_thread().map_err(msg)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: an out-pointer for the pool of a valid device.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(msg)?;
    Ok(Some(pool))
}

/// GPU memory held by this process's allocations (candle's tensors, our kernels'
/// buffers), read from the device's memory pool in bytes: what is in use now and the
/// most ever in use since [`reset_pool_peaks`] (`used`, `used_high`), and what the pool
/// holds from the driver (`reserved`, `reserved_high`; what nvidia-smi sees, less the
/// context and the libraries' own memory).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolMemory {
    /// Bytes in use by allocations now.
    pub used: u64,
    /// The most bytes in use at once since the last reset.
    pub used_high: u64,
    /// Bytes the pool holds from the driver now.
    pub reserved: u64,
    /// The most bytes the pool held at once since the last reset.
    pub reserved_high: u64,
}

/// The memory pool's reading of a CUDA device; `None` for the CPU, or a GPU that
/// allocates without a pool.
pub fn pool_memory(device: &Device) -> Option<PoolMemory> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as A;
        let pool = memory_pool(device).ok()??;
        let read = |attr: A| -> Option<u64> {
            let mut v = 0u64;
            // SAFETY: a valid pool and an attribute that gives a u64.
            unsafe {
                candle_core::cuda_backend::cudarc::driver::sys::cuMemPoolGetAttribute(
                    pool,
                    attr,
                    (&mut v as *mut u64).cast(),
                )
            }
            .result()
            .ok()?;
            Some(v)
        };
        return Some(PoolMemory {
            used: read(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        });
    }
    let _ = device;
    None
}

/// Starts the pool's high-water marks afresh from what is in use now (a no-op off a GPU).
pub fn reset_pool_peaks(device: &Device) {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::sys::{self, CUmemPool_attribute as A};
        if let Ok(Some(pool)) = memory_pool(device) {
            for attr in [
                A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            ] {
                let mut zero = 0u64;
                // SAFETY: a valid pool; the high marks may only be set to 0.
                let _ = unsafe {
                    sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast())
                };
            }
        }
    }
    let _ = device;
}

/// Waits for every kernel queued on `device` (a no-op on the CPU): a timing boundary.
pub fn synchronize(device: &Device) -> Result<()> {
    device.synchronize()?;
    Ok(())
}

/// Refuses bf16 on a GPU without it (compute capability below 8.0, before Ampere),
/// naming the device and the precisions it has.
pub fn check_precision(device: &Device, precision: crate::Precision) -> Result<()> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() && precision == crate::Precision::Bf16 {
        let stream = device.as_cuda_device()?.cuda_stream();
        if let Ok((major, minor)) = stream.context().compute_capability() {
            if major < 8 {
                return Err(Error::InvalidConfig {
                    field: "precision",
                    value: format!(
                        "bf16 on {:?} (compute capability {major}.{minor})",
                        device.location()
                    ),
                    reason: "bf16 needs a GPU of compute capability 8.0 or more (Ampere on): \
                             set precision = \"f16\" or \"f32\"",
                });
            }
        }
    }
    let _ = (device, precision);
    Ok(())
}

/// `cpu` or `cuda:N` (`metal:N`).
pub fn describe(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
        candle_core::DeviceLocation::Cpu => "cpu".into(),
    }
}
