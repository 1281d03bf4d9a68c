//! Launchers of `optim.cu`: AdamW and SGD in place on f32 weights.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage};

use super::*;

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
