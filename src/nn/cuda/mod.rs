//! The CUDA kernels and their launchers.
//!
//! The kernel sources are the `.cu` files beside this one (`common.cuh` holds what they
//! share: half-float loads, the dropout mask of [`crate::rng::keep`] bit for bit, block
//! reductions). `build.rs` compiles each to PTX with nvcc when the `cuda` feature is on,
//! the PTX is embedded here, and the driver loads a module the first time one of its
//! kernels runs on a device (candle keeps the loaded modules per device). Build-time
//! compilation rather than NVRTC at run time: a kernel that does not compile fails the
//! build wherever nvcc is (CI's `scripts/check-cuda`, no GPU needed), nothing is compiled
//! while a user's run waits, and the bundle carries no compiler.
//!
//! Each launcher takes contiguous CUDA tensors, allocates its outputs from the device's
//! memory pool and launches on the device's one stream, without waiting for it: nothing
//! here reads back to the host. Every kernel exists for f32, bf16 and f16 (arithmetic in
//! f32); the statistics and sums a node keeps (a norm's sum and statistics, column sums)
//! are f32. [`crate::nn::kernels`] is the one dispatch point of each: these launchers on
//! CUDA tensors, the CPU reference forms ([`crate::nn::cpu::reference`]) elsewhere.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};

use super::Act;

pub(crate) use attention::{
    from_heads, rotary_backward, rotary_forward, softmax_backward, softmax_forward, to_heads,
};
pub(crate) use optim::{adamw_moments, adamw_weights, sgd, storage_ptr_f32};
pub(crate) use rows::{
    act_backward, act_forward, add_in_place, add_norm_backward, add_norm_forward, bias_act_forward,
    column_sums, dropout, glu_backward, glu_forward, norm_apply, norm_param_grads, rms_backward,
    rms_forward, rms_param_grads,
};

/// Loads kernel `name` of `module` on `dev` (once per device; candle keeps the module).
macro_rules! function {
    ($dev:expr, $module:expr, $name:expr) => {{
        let (module, name): (Module, &str) = ($module, $name);
        $dev.get_or_load_custom_func(name, module.name(), module.ptx())
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "cannot load the CUDA kernel `{name}` of {}: {e}",
                    module.name()
                ))
            })?
    }};
}

/// A module of kernels: its name (candle's key for the loaded module) and PTX.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Module {
    Rows,
    Attention,
    Optim,
}

impl Module {
    fn name(self) -> &'static str {
        match self {
            Module::Rows => "gradcache-rows",
            Module::Attention => "gradcache-attention",
            Module::Optim => "gradcache-optim",
        }
    }

    fn ptx(self) -> &'static str {
        match self {
            Module::Rows => include_str!(concat!(env!("OUT_DIR"), "/rows.ptx")),
            Module::Attention => include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")),
            Module::Optim => include_str!(concat!(env!("OUT_DIR"), "/optim.ptx")),
        }
    }
}

/// Every kernel of every module, for the self-check that loads them all on a GPU: a
/// module whose PTX the driver refuses fails there, naming it, before any training.
pub(crate) fn load_all(dev: &CudaDevice) -> candle_core::Result<()> {
    let kernels: [(Module, &[&str]); 3] = [
        (
            Module::Rows,
            &[
                "add_norm_fwd",
                "norm_apply",
                "add_norm_bwd",
                "column_sums",
                "norm_param_sums",
                "bias_act_fwd",
                "act_fwd",
                "act_bwd",
                "dropout",
                "rms_fwd",
                "rms_bwd",
                "rms_param_sums",
                "glu_fwd",
                "glu_bwd",
                "add_in_place",
            ],
        ),
        (
            Module::Attention,
            &[
                "softmax_fwd",
                "softmax_bwd",
                "to_heads",
                "from_heads",
                "rotary_fwd",
                "rotary_bwd",
            ],
        ),
        (Module::Optim, &[]),
    ];
    for (module, names) in kernels {
        for name in names {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                function!(dev, module, &typed(name, dtype)?);
            }
        }
    }
    for name in ["adamw_moments", "adamw_weights", "sgd"] {
        function!(dev, Module::Optim, name);
    }
    Ok(())
}

/// The name of the copy of kernel `name` for element type `dtype` (`name_f32`, ...).
pub(super) fn typed(name: &str, dtype: DType) -> candle_core::Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!(
            "the CUDA kernel `{name}` runs on f32, bf16 or f16 tensors, not {other:?}"
        ),
    };
    Ok(format!("{name}_{suffix}"))
}

/// The device of a CUDA tensor.
pub(crate) fn device(t: &Tensor) -> candle_core::Result<CudaDevice> {
    Ok(t.device().as_cuda_device()?.clone())
}

/// The device address of a contiguous CUDA tensor's first element. The tensor must live
/// until the kernel reading it is launched (the stream orders its release after).
pub(crate) fn ptr(t: &Tensor) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        candle_core::bail!("a CUDA kernel was given a tensor on {:?}", t.device())
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        candle_core::bail!("a CUDA kernel was given a strided tensor ({:?})", layout)
    };
    let stream = s.device.cuda_stream();
    let base = match &s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr(&stream).0,
        CudaStorageSlice::BF16(v) => v.device_ptr(&stream).0,
        CudaStorageSlice::F16(v) => v.device_ptr(&stream).0,
        CudaStorageSlice::F64(v) => v.device_ptr(&stream).0,
        CudaStorageSlice::U32(v) => v.device_ptr(&stream).0,
        _ => candle_core::bail!("a CUDA kernel was given a {:?} tensor", t.dtype()),
    };
    Ok(base + (start * t.dtype().size_in_bytes()) as u64)
}

/// The address of an optional tensor, 0 (a null pointer) for none.
pub(super) fn ptr_or_null(t: Option<&Tensor>) -> candle_core::Result<u64> {
    t.map_or(Ok(0), ptr)
}

/// A new tensor of `shape` on `dev` whose values a kernel is about to write, and its
/// address.
pub(crate) fn empty(
    dev: &CudaDevice,
    dtype: DType,
    shape: impl Into<Shape>,
) -> candle_core::Result<(Tensor, u64)> {
    let shape = shape.into();
    // (An empty tensor still gets one element: the pool refuses a zero-byte allocation.)
    let n = shape.elem_count().max(1);
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by the kernel the caller launches next.
    let (slice, addr) = unsafe {
        match dtype {
            DType::F32 => {
                let v = dev.alloc::<f32>(n)?;
                let a = v.device_ptr(&stream).0;
                (CudaStorageSlice::F32(v), a)
            }
            DType::BF16 => {
                let v = dev.alloc::<half::bf16>(n)?;
                let a = v.device_ptr(&stream).0;
                (CudaStorageSlice::BF16(v), a)
            }
            DType::F16 => {
                let v = dev.alloc::<half::f16>(n)?;
                let a = v.device_ptr(&stream).0;
                (CudaStorageSlice::F16(v), a)
            }
            other => candle_core::bail!("a CUDA kernel's output in {other:?}"),
        }
    };
    let storage = Storage::Cuda(CudaStorage {
        slice,
        device: dev.clone(),
    });
    Ok((
        Tensor::from_storage(storage, shape, BackpropOp::none(), false),
        addr,
    ))
}

/// Launches `$func` with `$cfg` and the arguments (each pushed by reference; they live to
/// the end of the block).
macro_rules! launch {
    ($func:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let func = $func;
        let mut builder = func.builder();
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        // SAFETY: the arguments match the kernel's parameters (see its .cu source), every
        // address is a live allocation of the sizes the kernel reads and writes.
        unsafe { builder.launch($cfg) }.w()?;
    }};
}

/// A grid-stride launch over `total` elements.
pub(super) fn elementwise(total: usize) -> LaunchConfig {
    const THREADS: u32 = 256;
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row of `width` elements.
pub(super) fn per_row(rows: usize, width: usize) -> LaunchConfig {
    let threads = width.next_multiple_of(32).clamp(32, 256) as u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
pub(super) fn warp_per_row(rows: usize) -> LaunchConfig {
    const WARPS: usize = 4;
    LaunchConfig {
        grid_dim: (rows.div_ceil(WARPS).max(1) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The dropout arguments of a kernel: seed, threshold `ceil(p 2^24)` (0: no dropout) and
/// the scale `1 / (1 - p)` rounded to f32, as [`crate::rng::keep`] and the CPU kernels.
pub(super) fn dropout_args(dropout: Option<(u64, f32)>) -> (u64, u32, f32) {
    match dropout.filter(|&(_, p)| p > 0.0) {
        Some((seed, p)) => (
            seed,
            (f64::from(p) * f64::from(1u32 << 24)).ceil() as u32,
            (1.0 / (1.0 - f64::from(p))) as f32,
        ),
        None => (0, 0, 1.0),
    }
}

pub(super) fn act_code(act: Act) -> i32 {
    match act {
        Act::GeluErf => 0,
        Act::GeluTanh => 1,
        Act::Relu => 2,
        Act::Silu => 3,
    }
}

pub(super) fn i32_of(n: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} {n} is too large")))
}

mod attention;
mod optim;
mod rows;
