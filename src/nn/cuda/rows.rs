//! Launchers of `rows.cu`: the residual block's tail, norms, activations, dropout, column
//! sums.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Tensor};

use super::*;

/// See [`crate::nn::kernels::add_norm_forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_norm_forward(
    x: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
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
            ptr_or_null(residual)?,
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

/// Rows per chunk of the column sums' first pass: 64, or more where that would take more
/// chunks than a grid's second dimension holds.
fn chunk_rows(rows: usize) -> usize {
    64.max(rows.div_ceil(65_535))
}

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
    let per = chunk_rows(rows);
    let chunks = rows.div_ceil(per).max(1);
    let (partial, partial_ptr) = empty(&dev, DType::F32, (chunks, width))?;
    launch!(
        function!(&dev, Module::Rows, &typed("column_sums", x.dtype())?),
        column_grid(width, chunks),
        ptr(x)?,
        partial_ptr,
        i32_of(rows, "rows")?,
        i32_of(width, "width")?,
        i32_of(per, "chunk")?,
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
    let per = chunk_rows(rows);
    let chunks = rows.div_ceil(per).max(1);
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
        i32_of(per, "chunk")?,
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

/// See [`crate::nn::kernels::rms_forward`].
pub(crate) fn rms_forward(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    offset: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = device(x)?;
    let (rows, width) = x.dims2()?;
    let (y, y_ptr) = empty(&dev, x.dtype(), (rows, width))?;
    let (rstd, rstd_ptr) = empty(&dev, DType::F32, rows)?;
    if rows > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("rms_fwd", x.dtype())?),
            per_row(rows, width),
            ptr(x)?,
            ptr(weight)?,
            y_ptr,
            rstd_ptr,
            i32_of(width, "width")?,
            eps as f32,
            offset as f32,
        );
    }
    Ok((y, rstd))
}

/// See [`crate::nn::kernels::rms_backward`].
pub(crate) fn rms_backward(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    weight: &Tensor,
    offset: f64,
) -> candle_core::Result<Tensor> {
    let dev = device(dy)?;
    let (rows, width) = dy.dims2()?;
    let (dx, dx_ptr) = empty(&dev, dy.dtype(), (rows, width))?;
    if rows > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("rms_bwd", dy.dtype())?),
            per_row(rows, width),
            ptr(dy)?,
            ptr(x)?,
            ptr(rstd)?,
            ptr(weight)?,
            dx_ptr,
            i32_of(width, "width")?,
            offset as f32,
        );
    }
    Ok(dx)
}

/// See [`crate::nn::kernels::rms_param_grads`].
pub(crate) fn rms_param_grads(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
) -> candle_core::Result<Tensor> {
    let dev = device(dy)?;
    let (rows, width) = dy.dims2()?;
    let per = chunk_rows(rows);
    let chunks = rows.div_ceil(per).max(1);
    let (partial, partial_ptr) = empty(&dev, DType::F32, (chunks, width))?;
    launch!(
        function!(&dev, Module::Rows, &typed("rms_param_sums", dy.dtype())?),
        column_grid(width, chunks),
        ptr(dy)?,
        ptr(x)?,
        ptr(rstd)?,
        partial_ptr,
        i32_of(rows, "rows")?,
        i32_of(width, "width")?,
        i32_of(per, "chunk")?,
    );
    finish_column_sums(&dev, &partial)
}

/// See [`crate::nn::kernels::glu_forward`].
pub(crate) fn glu_forward(up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let dev = device(up)?;
    let (rows, width2) = up.dims2()?;
    let width = width2 / 2;
    let (out, out_ptr) = empty(&dev, up.dtype(), (rows, width))?;
    let total = rows * width;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("glu_fwd", up.dtype())?),
            elementwise(total),
            ptr(up)?,
            out_ptr,
            i32_of(width, "width")?,
            total,
            act_code(act),
        );
    }
    Ok(out)
}

/// See [`crate::nn::kernels::glu_backward`].
pub(crate) fn glu_backward(dout: &Tensor, up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let dev = device(up)?;
    let (rows, width2) = up.dims2()?;
    let width = width2 / 2;
    let (dup, dup_ptr) = empty(&dev, up.dtype(), (rows, width2))?;
    let total = rows * width;
    if total > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("glu_bwd", up.dtype())?),
            elementwise(total),
            ptr(dout)?,
            ptr(up)?,
            dup_ptr,
            i32_of(width, "width")?,
            total,
            act_code(act),
        );
    }
    Ok(dup)
}

/// `acc += g` in place on f32 CUDA storages of `n` elements (a gradient summed where it
/// is written).
pub(crate) fn add_in_place(
    acc: &candle_core::CudaStorage,
    acc_layout: &candle_core::Layout,
    g: &candle_core::CudaStorage,
    g_layout: &candle_core::Layout,
) -> candle_core::Result<()> {
    let n = acc_layout.shape().elem_count();
    if g_layout.shape().elem_count() != n {
        candle_core::bail!(
            "add in place: {n} and {} elements",
            g_layout.shape().elem_count()
        );
    }
    let dev = acc.device.clone();
    if n > 0 {
        launch!(
            function!(&dev, Module::Rows, &typed("add_in_place", DType::F32)?),
            elementwise(n),
            super::storage_ptr_f32(acc, acc_layout)?,
            super::storage_ptr_f32(g, g_layout)?,
            n,
        );
    }
    Ok(())
}
