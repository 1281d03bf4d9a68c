//! Convolutional towers' ops: a 2-D convolution whose backward beats candle's chain rule
//! on the CPU, and BatchNorm in training with batch statistics and a hand-written
//! backward (it keeps the normalised input's statistics, not a copy of the input).

use candle_core::Tensor;

use crate::nn::cpu::blocks::contiguous;
use crate::nn::node::node;

/// The most bytes of im2col columns one piece of a convolution unfolds (32 MiB): candle's
/// CPU convolution unfolds its whole input at once (`rows x out_h x out_w x c_in x k x k`
/// values, 600 MiB for 32 images of 64x64 at 128 channels and a 3x3 kernel), so the
/// convolutions here run over pieces of the rows and join the results.
pub const IM2COL_BYTES: usize = 32 << 20;

/// Rows per piece so that one piece's im2col columns fit [`IM2COL_BYTES`] (at least one).
fn rows_per_piece(rows: usize, per_row: usize) -> usize {
    (IM2COL_BYTES / per_row.max(1)).clamp(1, rows.max(1))
}

/// `f` over pieces of `rows` rows along dimension 0 of each of `xs`, the results
/// concatenated along dimension 0 (`f` itself when one piece holds every row).
fn in_pieces(
    xs: &[&Tensor],
    rows: usize,
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let n = xs[0].dim(0)?;
    if rows >= n {
        let whole: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
        return f(&whole);
    }
    let mut out = Vec::with_capacity(n.div_ceil(rows));
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let piece = xs
            .iter()
            .map(|x| x.narrow(0, start, len))
            .collect::<candle_core::Result<Vec<_>>>()?;
        out.push(f(&piece)?);
    }
    Tensor::cat(&out, 0)
}

/// A 2-D convolution `x [n, c_in, h, w]` * `weight [c_out, c_in, k, k]` (square kernel,
/// no bias, no dilation or groups) as one node whose backward is faster than candle's
/// rule on the CPU: for stride 1 the input gradient is a convolution of the output
/// gradient with the flipped, transposed kernel (candle's im2col path) instead of
/// candle's transposed convolution, about 3x slower at ResNet shapes; for other strides
/// it is candle's transposed convolution. The kernel gradient is candle's rule, summed over
/// pieces of the rows. Every convolution runs over pieces of the rows whose im2col columns
/// fit `IM2COL_BYTES`, so its transient memory does not grow with the chunk.
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    padding: usize,
    stride: usize,
) -> candle_core::Result<Tensor> {
    let (xd, wd) = (x.detach(), weight.detach());
    let (c_out, c_in, k, k2) = wd.dims4()?;
    let (n, h, w) = (x.dim(0)?, x.dim(2)?, x.dim(3)?);
    let (out_h, out_w) = (
        (h + 2 * padding - k) / stride + 1,
        (w + 2 * padding - k2) / stride + 1,
    );
    let per_row = out_h * out_w * c_in * k * k2 * 4;
    let rows = rows_per_piece(n, per_row);
    let y = in_pieces(&[&xd], rows, |p| p[0].conv2d(&wd, padding, stride, 1, 1))?;
    node(
        "gradcache-conv2d",
        [x, weight, weight],
        y,
        Box::new(move |dy| {
            let dx = if stride == 1 && k == k2 && padding < k {
                let reversed: Vec<u32> = (0..k as u32).rev().collect();
                let flip = Tensor::from_vec(reversed, k, wd.device())?;
                let flipped = wd
                    .transpose(0, 1)?
                    .contiguous()?
                    .index_select(&flip, 2)?
                    .index_select(&flip, 3)?;
                // Its im2col unfolds the output gradient: `c_out` channels at the input's size.
                let rows = rows_per_piece(n, h * w * c_out * k * k2 * 4);
                in_pieces(&[dy], rows, |p| {
                    p[0].conv2d(&flipped, k - 1 - padding, 1, 1, 1)
                })?
            } else {
                let out_h = (dy.dim(2)? - 1) * stride + k - 2 * padding;
                let out_padding = h.saturating_sub(out_h);
                dy.conv_transpose2d(&wd, padding, out_padding, stride, 1)?
            };
            let dx = if dx.dim(2)? != h || dx.dim(3)? != w {
                dx.narrow(2, 0, h)?.narrow(3, 0, w)?
            } else {
                dx
            };
            // The kernel gradient of each piece of rows, summed: a convolution of the
            // input (rows as channels) with the output gradient as the kernel.
            let mut dw: Option<Tensor> = None;
            for start in (0..n).step_by(rows) {
                let len = rows.min(n - start);
                let (xp, dyp) = (xd.narrow(0, start, len)?, dy.narrow(0, start, len)?);
                let piece = xp
                    .transpose(0, 1)?
                    // Stride 1 and dilation `stride`: the output gradient's pixels sit
                    // `stride` apart on the input.
                    .conv2d(&dyp.transpose(0, 1)?, padding, 1, stride, 1)?
                    .transpose(0, 1)?;
                dw = Some(match dw {
                    Some(sum) => (sum + piece)?,
                    None => piece,
                });
            }
            let dw = dw.ok_or_else(|| candle_core::Error::Msg("conv2d of no rows".into()))?;
            let dw = if dw.dim(2)? != k || dw.dim(3)? != k2 {
                dw.narrow(2, 0, k)?.narrow(3, 0, k2)?
            } else {
                dw
            };
            Ok([Some(dx), Some(dw.contiguous()?), None])
        }),
    )
}

/// Per-channel batch statistics of `[n, c, ...]` values: mean, biased variance and
/// `1 / sqrt(var + eps)`, accumulated in f64 (each row's run summed, then the rows).
pub(crate) struct ChannelStats {
    pub(crate) mean: Vec<f32>,
    pub(crate) var: Vec<f32>,
    pub(crate) rstd: Vec<f32>,
}

/// The [`ChannelStats`] of `xv`, `n` rows of `c` channels.
pub(crate) fn channel_stats(xv: &[f32], n: usize, c: usize, eps: f64) -> ChannelStats {
    let s = xv.len() / (n * c).max(1);
    let m = (n * s) as f64;
    // Channel `ch`'s values: `s` in a row at `(i * c + ch) * s` for every row `i`.
    let rows = |ch: usize| (0..n).map(move |i| (i * c + ch) * s);
    let (mut mean, mut var, mut rstd) = (vec![0f32; c], vec![0f32; c], vec![0f32; c]);
    for ch in 0..c {
        let sum: f64 = rows(ch)
            .map(|o| xv[o..o + s].iter().map(|&v| f64::from(v)).sum::<f64>())
            .sum();
        let mu = sum / m;
        let sq: f64 = rows(ch)
            .map(|o| {
                xv[o..o + s]
                    .iter()
                    .map(|&v| (f64::from(v) - mu).powi(2))
                    .sum::<f64>()
            })
            .sum();
        mean[ch] = mu as f32;
        var[ch] = (sq / m) as f32;
        rstd[ch] = (1.0 / (sq / m + eps).sqrt()) as f32;
    }
    ChannelStats { mean, var, rstd }
}

/// BatchNorm in training over `x [n, c, ...]` (f32, contiguous), normalising each
/// channel with the batch's statistics, as one node over `(x, weight, bias)` with the
/// hand-written backward
/// `dx = w rstd / m (m dy - sum(dy) - x_hat sum(dy x_hat))`, `dw = sum(dy x_hat)`,
/// `db = sum(dy)` (sums per channel over the `m` values). The composed form records about
/// ten nodes over activation-sized tensors and back-propagates through strided reductions
/// several times slower. With `relu`, the ReLU after the normalisation is part of the node
/// (its mask recomputed in the backward). Returns the output and the batch's mean and
/// biased variance `[c]` (for the running statistics). Statistics are accumulated in f64.
pub fn batch_norm_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    relu: bool,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let dims = x.dims().to_vec();
    let (n, c) = (dims[0], dims[1]);
    let s = x.elem_count() / (n * c).max(1);
    let m = (n * s) as f64;
    let xd = x.detach().contiguous()?;
    let wv = weight.detach().to_vec1::<f32>()?;
    let bv = bias.detach().to_vec1::<f32>()?;
    // Channel `ch`'s values: `s` in a row at `(i * c + ch) * s` for every row `i`.
    let rows = move |ch: usize| (0..n).map(move |i| (i * c + ch) * s);
    let (mean, var, rstd, y) = read_f32(&xd, |xv| {
        let ChannelStats { mean, var, rstd } = channel_stats(xv, n, c, eps);
        let mut y = vec![0f32; xv.len()];
        for ch in 0..c {
            let (mu, r, w, b) = (mean[ch], rstd[ch], wv[ch], bv[ch]);
            for o in rows(ch) {
                for (yo, &xo) in y[o..o + s].iter_mut().zip(&xv[o..o + s]) {
                    let v = (xo - mu) * r * w + b;
                    *yo = if relu { v.max(0.0) } else { v };
                }
            }
        }
        (mean, var, rstd, y)
    })?;
    let device = x.device().clone();
    let y = Tensor::from_vec(y, dims.clone(), &device)?;
    let mean_t = Tensor::from_vec(mean.clone(), c, &device)?;
    let var_t = Tensor::from_vec(var, c, &device)?;
    let out = node(
        "gradcache-batch-norm",
        [x, weight, bias],
        y,
        Box::new(move |dy| {
            // The input is read in place from the node's own input (kept by the graph
            // anyway), and the output gradient in place too: no copies of either.
            let dy = dy.contiguous()?;
            let (dx, dw, db) = read_f32(&xd, |xv| {
                read_f32(&dy, |dyv| {
                    let mut dx = vec![0f32; xv.len()];
                    let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
                    for ch in 0..c {
                        let (mu, r, w, b) = (mean[ch], rstd[ch], wv[ch], bv[ch]);
                        // The ReLU passes the gradient where its input was positive.
                        let grad = |g: f32, xhat: f32| {
                            if relu && xhat * w + b <= 0.0 {
                                0.0
                            } else {
                                g
                            }
                        };
                        let (mut sum_dy, mut sum_dy_xhat) = (0f64, 0f64);
                        for o in rows(ch) {
                            for (&g, &xo) in dyv[o..o + s].iter().zip(&xv[o..o + s]) {
                                let xhat = (xo - mu) * r;
                                let g = grad(g, xhat);
                                sum_dy += f64::from(g);
                                sum_dy_xhat += f64::from(g) * f64::from(xhat);
                            }
                        }
                        dw[ch] = sum_dy_xhat as f32;
                        db[ch] = sum_dy as f32;
                        let k = w * r;
                        let (mean_dy, mean_dy_xhat) =
                            ((sum_dy / m) as f32, (sum_dy_xhat / m) as f32);
                        for o in rows(ch) {
                            for ((d, &g), &xo) in dx[o..o + s]
                                .iter_mut()
                                .zip(&dyv[o..o + s])
                                .zip(&xv[o..o + s])
                            {
                                let xhat = (xo - mu) * r;
                                *d = k * (grad(g, xhat) - mean_dy - xhat * mean_dy_xhat);
                            }
                        }
                    }
                    (dx, dw, db)
                })
            })??;
            let dx = Tensor::from_vec(dx, dims.clone(), dy.device())?;
            let dw = Tensor::from_vec(dw, c, dy.device())?;
            let db = Tensor::from_vec(db, c, dy.device())?;
            Ok([Some(dx), Some(dw), Some(db)])
        }),
    )?;
    Ok((out, mean_t, var_t))
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, read in place.
fn read_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => Ok(f(contiguous::<f32>(cpu, layout)?)),
        _ => candle_core::bail!("the BatchNorm node runs on the CPU"),
    }
}
