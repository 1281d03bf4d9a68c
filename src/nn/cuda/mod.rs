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

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};

use super::Act;

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
            ],
        ),
        (
            Module::Attention,
            &["softmax_fwd", "softmax_bwd", "to_heads", "from_heads"],
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
fn typed(name: &str, dtype: DType) -> candle_core::Result<String> {
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
fn ptr_or_null(t: Option<&Tensor>) -> candle_core::Result<u64> {
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
    let n = shape.elem_count();
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
fn elementwise(total: usize) -> LaunchConfig {
    const THREADS: u32 = 256;
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row of `width` elements.
fn per_row(rows: usize, width: usize) -> LaunchConfig {
    let threads = width.next_multiple_of(32).clamp(32, 256) as u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
fn warp_per_row(rows: usize) -> LaunchConfig {
    const WARPS: usize = 4;
    LaunchConfig {
        grid_dim: (rows.div_ceil(WARPS).max(1) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The dropout arguments of a kernel: seed, threshold `ceil(p 2^24)` (0: no dropout) and
/// the scale `1 / (1 - p)` rounded to f32, as [`crate::rng::keep`] and the CPU kernels.
fn dropout_args(dropout: Option<(u64, f32)>) -> (u64, u32, f32) {
    match dropout.filter(|&(_, p)| p > 0.0) {
        Some((seed, p)) => (
            seed,
            (f64::from(p) * f64::from(1u32 << 24)).ceil() as u32,
            (1.0 / (1.0 - f64::from(p))) as f32,
        ),
        None => (0, 0, 1.0),
    }
}

fn act_code(act: Act) -> i32 {
    match act {
        Act::GeluErf => 0,
        Act::GeluTanh => 1,
        Act::Relu => 2,
        Act::Silu => 3,
    }
}

fn i32_of(n: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} {n} is too large")))
}

/// See [`crate::nn::kernels::add_norm_forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_norm_forward(
    x: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    dropout: Option<(u64, f32)>,
    keep_sum: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>, Tensor)> {
    let dev = device(x)?;
    let (rows, width) = x.dims2()?;
    let (y, y_ptr) = empty(&dev, x.dtype(), (rows, width))?;
    let sum = if keep_sum {
        Some(empty(&dev, DType::F32, (rows, width))?)
    } else {
        None
    };
    let (stats, stats_ptr) = empty(&dev, DType::F32, (rows, 2))?;
    let (seed, threshold, scale) = dropout_args(dropout);
    if rows > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("add_norm_fwd", x.dtype())?),
            per_row(rows, width),
            ptr(x)?,
            ptr_or_null(bias)?,
            ptr(residual)?,
            ptr(gamma)?,
            ptr(beta)?,
            y_ptr,
            sum.as_ref().map_or(0, |s| s.1),
            stats_ptr,
            i32_of(width, "width")?,
            eps as f32,
            seed,
            threshold,
            scale,
        );
    }
    Ok((y, sum.map(|s| s.0), stats))
}

/// See [`crate::nn::kernels::norm_apply`].
pub(crate) fn norm_apply(
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let dev = device(sum)?;
    let (rows, width) = sum.dims2()?;
    let (y, y_ptr) = empty(&dev, dtype, (rows, width))?;
    let total = rows * width;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("norm_apply", dtype)?),
            elementwise(total),
            ptr(sum)?,
            ptr(stats)?,
            ptr(gamma)?,
            ptr(beta)?,
            y_ptr,
            i32_of(width, "width")?,
            total,
        );
    }
    Ok(y)
}

/// See [`crate::nn::kernels::add_norm_backward`].
pub(crate) fn add_norm_backward(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = device(dy)?;
    let (rows, width) = dy.dims2()?;
    let (dsum, dsum_ptr) = empty(&dev, dy.dtype(), (rows, width))?;
    let (seed, threshold, scale) = dropout_args(dropout);
    let dpre = if threshold > 0 {
        Some(empty(&dev, dy.dtype(), (rows, width))?)
    } else {
        None
    };
    if rows > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("add_norm_bwd", dy.dtype())?),
            per_row(rows, width),
            ptr(dy)?,
            ptr(sum)?,
            ptr(stats)?,
            ptr(gamma)?,
            dsum_ptr,
            dpre.as_ref().map_or(0, |d| d.1),
            i32_of(width, "width")?,
            seed,
            threshold,
            scale,
        );
    }
    let dpre = match dpre {
        Some((t, _)) => t,
        None => dsum.clone(),
    };
    Ok((dsum, dpre))
}

/// Rows per chunk of the column sums' first pass.
const CHUNK_ROWS: usize = 64;

/// The grid of a column-sum pass over `chunks` chunks of rows and `width` columns.
fn column_grid(width: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (width.div_ceil(128).max(1) as u32, chunks.max(1) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Sums the rows of f32 partials `[chunks, width]` in order into `[width]`.
fn finish_column_sums(dev: &CudaDevice, partial: &Tensor) -> candle_core::Result<Tensor> {
    let (chunks, width) = partial.dims2()?;
    let (out, out_ptr) = empty(dev, DType::F32, width)?;
    launch!(
        function!(dev, Module::Rows, &typed("column_sums", DType::F32)?),
        column_grid(width, 1),
        ptr(partial)?,
        out_ptr,
        i32_of(chunks, "chunks")?,
        i32_of(width, "width")?,
        i32_of(chunks.max(1), "chunks")?,
    );
    Ok(out)
}

/// See [`crate::nn::kernels::column_sums`].
pub(crate) fn column_sums(x: &Tensor) -> candle_core::Result<Tensor> {
    let dev = device(x)?;
    let (rows, width) = x.dims2()?;
    let chunks = rows.div_ceil(CHUNK_ROWS).max(1);
    let (partial, partial_ptr) = empty(&dev, DType::F32, (chunks, width))?;
    launch!(
        function!(&dev, Module::Rows, &typed("column_sums", x.dtype())?),
        column_grid(width, chunks),
        ptr(x)?,
        partial_ptr,
        i32_of(rows, "rows")?,
        i32_of(width, "width")?,
        i32_of(CHUNK_ROWS, "chunk")?,
    );
    finish_column_sums(&dev, &partial)
}

/// See [`crate::nn::kernels::norm_param_grads`].
pub(crate) fn norm_param_grads(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = device(dy)?;
    let (rows, width) = dy.dims2()?;
    let chunks = rows.div_ceil(CHUNK_ROWS).max(1);
    let (partial, partial_ptr) = empty(&dev, DType::F32, (2 * chunks, width))?;
    launch!(
        function!(&dev, Module::Rows, &typed("norm_param_sums", dy.dtype())?),
        column_grid(width, chunks),
        ptr(dy)?,
        ptr(sum)?,
        ptr(stats)?,
        partial_ptr,
        i32_of(rows, "rows")?,
        i32_of(width, "width")?,
        i32_of(CHUNK_ROWS, "chunk")?,
    );
    let dgamma = finish_column_sums(&dev, &partial.narrow(0, 0, chunks)?)?;
    let dbeta = finish_column_sums(&dev, &partial.narrow(0, chunks, chunks)?)?;
    Ok((dgamma, dbeta))
}

/// See [`crate::nn::kernels::bias_act_forward`].
pub(crate) fn bias_act_forward(
    u: &Tensor,
    bias: &Tensor,
    act: Act,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = device(u)?;
    let (rows, width) = u.dims2()?;
    let (pre, pre_ptr) = empty(&dev, u.dtype(), (rows, width))?;
    let (g, g_ptr) = empty(&dev, u.dtype(), (rows, width))?;
    let total = rows * width;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("bias_act_fwd", u.dtype())?),
            elementwise(total),
            ptr(u)?,
            ptr(bias)?,
            pre_ptr,
            g_ptr,
            i32_of(width, "width")?,
            total,
            act_code(act),
        );
    }
    Ok((pre, g))
}

/// See [`crate::nn::kernels::act_forward`].
pub(crate) fn act_forward(pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let dev = device(pre)?;
    let total = pre.elem_count();
    let (g, g_ptr) = empty(&dev, pre.dtype(), pre.shape().clone())?;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("act_fwd", pre.dtype())?),
            elementwise(total),
            ptr(pre)?,
            g_ptr,
            total,
            act_code(act),
        );
    }
    Ok(g)
}

/// See [`crate::nn::kernels::act_backward`].
pub(crate) fn act_backward(dg: &Tensor, pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let dev = device(dg)?;
    let total = dg.elem_count();
    let (dpre, dpre_ptr) = empty(&dev, dg.dtype(), dg.shape().clone())?;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("act_bwd", dg.dtype())?),
            elementwise(total),
            ptr(dg)?,
            ptr(pre)?,
            dpre_ptr,
            total,
            act_code(act),
        );
    }
    Ok(dpre)
}

/// See [`crate::nn::kernels::dropout`].
pub(crate) fn dropout(x: &Tensor, seed: u64, p: f32) -> candle_core::Result<Tensor> {
    let dev = device(x)?;
    let total = x.elem_count();
    let (y, y_ptr) = empty(&dev, x.dtype(), x.shape().clone())?;
    let (seed, threshold, scale) = dropout_args(Some((seed, p)));
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("dropout", x.dtype())?),
            elementwise(total),
            ptr(x)?,
            y_ptr,
            total,
            0u64,
            seed,
            threshold,
            scale,
        );
    }
    Ok(y)
}

/// See [`crate::nn::kernels::softmax_forward`].
pub(crate) fn softmax_forward(
    scores: &Tensor,
    key_bias: &Tensor,
    score_bias: Option<&Tensor>,
    scale: f64,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let dev = device(scores)?;
    let (n, heads, s, _) = scores.dims4()?;
    let rows = n * heads * s;
    let (probs, probs_ptr) = empty(&dev, scores.dtype(), scores.shape().clone())?;
    let (seed, threshold, keep_scale) = dropout_args(dropout);
    let dropped = if threshold > 0 {
        Some(empty(&dev, scores.dtype(), scores.shape().clone())?)
    } else {
        None
    };
    if rows > 0 {
        launch!(
            function!(
                &dev,
                Module::Attention,
                &typed("softmax_fwd", scores.dtype())?
            ),
            warp_per_row(rows),
            ptr(scores)?,
            ptr(key_bias)?,
            ptr_or_null(score_bias)?,
            probs_ptr,
            dropped.as_ref().map_or(0, |d| d.1),
            i32_of(rows, "rows")?,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            scale as f32,
            seed,
            threshold,
            keep_scale,
        );
    }
    Ok((probs, dropped.map(|d| d.0)))
}

/// See [`crate::nn::kernels::softmax_backward`].
pub(crate) fn softmax_backward(
    probs: &Tensor,
    d: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    let dev = device(probs)?;
    let s = probs.dim(candle_core::D::Minus1)?;
    let rows = probs.elem_count() / s.max(1);
    let (dz, dz_ptr) = empty(&dev, probs.dtype(), probs.shape().clone())?;
    let (seed, threshold, keep_scale) = dropout_args(dropout);
    if rows > 0 {
        launch!(
            function!(
                &dev,
                Module::Attention,
                &typed("softmax_bwd", probs.dtype())?
            ),
            warp_per_row(rows),
            ptr(probs)?,
            ptr(d)?,
            dz_ptr,
            i32_of(rows, "rows")?,
            i32_of(s, "length")?,
            seed,
            threshold,
            keep_scale,
        );
    }
    Ok(dz)
}

/// See [`crate::nn::kernels::to_heads`].
pub(crate) fn to_heads(
    src: &Tensor,
    first: usize,
    (n, heads, s, d): (usize, usize, usize, usize),
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let dev = device(src)?;
    let width = src.dim(1)?;
    let (out, out_ptr) = empty(&dev, src.dtype(), (n, heads, s, d))?;
    let total = n * heads * s * d;
    if total > 0 {
        launch!(
            function!(&dev, Module::Attention, &typed("to_heads", src.dtype())?),
            elementwise(total),
            ptr(src)?,
            ptr_or_null(bias)?,
            out_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            i32_of(width, "width")?,
            i32_of(first, "column")?,
            total,
        );
    }
    Ok(out)
}

/// See [`crate::nn::kernels::from_heads`].
pub(crate) fn from_heads(
    parts: &[(&Tensor, usize, f64)],
    width: usize,
) -> candle_core::Result<Tensor> {
    let Some((first, _, _)) = parts.first() else {
        candle_core::bail!("from_heads: no parts")
    };
    let dev = device(first)?;
    let (n, _, s, _) = first.dims4()?;
    let (out, out_ptr) = empty(&dev, first.dtype(), (n * s, width))?;
    for &(part, column, mult) in parts {
        let (_, heads, s, d) = part.dims4()?;
        let total = part.elem_count();
        if total == 0 {
            continue;
        }
        launch!(
            function!(&dev, Module::Attention, &typed("from_heads", part.dtype())?),
            elementwise(total),
            ptr(part)?,
            out_ptr,
            i32_of(s, "length")?,
            i32_of(heads, "heads")?,
            i32_of(d, "head size")?,
            i32_of(width, "width")?,
            i32_of(column, "column")?,
            mult as f32,
            total,
        );
    }
    Ok(out)
}

/// The device address of element `layout.start_offset()` of an f32 CUDA storage (a
/// custom op's operand), which must be contiguous.
pub(crate) fn storage_ptr_f32(
    s: &CudaStorage,
    layout: &candle_core::Layout,
) -> candle_core::Result<u64> {
    let stream = s.device.cuda_stream();
    let Some((start, _)) = layout.contiguous_offsets() else {
        candle_core::bail!("an optimizer kernel was given a strided tensor")
    };
    let base = s.as_cuda_slice::<f32>()?.device_ptr(&stream).0;
    Ok(base + (start * 4) as u64)
}

/// AdamW's new moments `[m'; v']` from `[m; v]` at `mv` and the gradient at `g` (`n`
/// elements each, f32; see `src/train/optim.rs`).
pub(crate) fn adamw_moments(
    dev: &CudaDevice,
    (mv, g, n): (u64, u64, usize),
    (b1, b2): (f32, f32),
    (c1, c2): (f32, f32),
) -> candle_core::Result<CudaStorage> {
    // SAFETY: the kernel writes all 2n elements.
    let out = unsafe { dev.alloc::<f32>(2 * n)? };
    let out_ptr = out.device_ptr(&dev.cuda_stream()).0;
    if n > 0 {
        launch!(
            function!(dev, Module::Optim, "adamw_moments"),
            elementwise(n),
            mv,
            g,
            out_ptr,
            n,
            b1,
            b2,
            c1,
            c2,
        );
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// AdamW's weight update in place on the f32 weight at `w` from the new moments at `mv`
/// (`n` elements).
pub(crate) fn adamw_weights(
    dev: &CudaDevice,
    (w, mv, n): (u64, u64, usize),
    (lr, eps): (f32, f32),
    (mc, vc): (f32, f32),
    decay: Option<f32>,
) -> candle_core::Result<()> {
    if n > 0 {
        launch!(
            function!(dev, Module::Optim, "adamw_weights"),
            elementwise(n),
            w,
            mv,
            n,
            lr,
            eps,
            mc,
            vc,
            decay.unwrap_or(1.0),
            i32::from(decay.is_some()),
        );
    }
    Ok(())
}

/// `w -= lr g` in place on the f32 weight at `w` (`n` elements).
pub(crate) fn sgd(
    dev: &CudaDevice,
    (w, g, n): (u64, u64, usize),
    lr: f32,
) -> candle_core::Result<()> {
    if n > 0 {
        launch!(
            function!(dev, Module::Optim, "sgd"),
            elementwise(n),
            w,
            g,
            n,
            lr,
        );
    }
    Ok(())
}
