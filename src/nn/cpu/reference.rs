//! The CPU forms of the CUDA kernels of the GPU layer nodes ([`crate::nn::kernels`]),
//! written plainly in f64, one loop per formula: what the GPU layer nodes run on when their
//! tensors are on the CPU (the tests prove each node's algebra there), and what
//! `gradcache self-check --device cuda` holds every CUDA kernel to. Not for speed: the CPU
//! trains through the layer nodes of this folder.
//!
//! Each function takes and returns what its CUDA launcher does ([`crate::nn::cuda`]):
//! values in the tensors' own dtype, a norm's kept sum and statistics and every column sum
//! in [`acc`] (f32, or f64 for f64 tensors), rounded where the kernel stores them (a
//! pre-activation is rounded to the activations' dtype before the activation reads it,
//! probabilities before dropout scales them).

use candle_core::{DType, Device, Shape, Tensor};

use crate::nn::cpu::elementwise::math::Act;

/// The dtype of a node's kept sums and statistics for activations in `dtype`.
pub(crate) fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn values(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

fn tensor(v: Vec<f64>, shape: impl Into<Shape>, dtype: DType) -> candle_core::Result<Tensor> {
    Tensor::from_vec(v, shape.into(), &Device::Cpu)?.to_dtype(dtype)
}

/// `v` rounded to `dtype` and back.
fn rounded(v: Vec<f64>, dtype: DType) -> candle_core::Result<Vec<f64>> {
    let n = v.len();
    values(&tensor(v, n, dtype)?)
}

/// `v` as the kernels of `dtype` hold it: rounded to f32 (the CUDA kernels' arithmetic)
/// for every dtype but f64.
fn narrow(v: f64, dtype: DType) -> f64 {
    if dtype == DType::F64 {
        v
    } else {
        f64::from(v as f32)
    }
}

/// The dropout factor of element `index` for tensors of `dtype`: `1 / (1 - p)` (rounded
/// as [`narrow`]) where [`crate::rng::keep`] keeps it, else 0; 1 without dropout.
fn factor(dropout: Option<(u64, f32)>, index: usize, dtype: DType) -> f64 {
    match dropout.filter(|&(_, p)| p > 0.0) {
        Some((seed, p)) => {
            if crate::rng::keep(seed, index as u64, p) {
                narrow(1.0 / (1.0 - f64::from(p)), dtype)
            } else {
                0.0
            }
        }
        None => 1.0,
    }
}

/// `LayerNorm(dropout(x + bias) + residual)` over rows `[rows, w]` (no residual: a
/// LayerNorm of `dropout(x + bias)`): `(y, sum, stats)`.
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
    let (rows, w) = x.dims2()?;
    let xv = values(x)?;
    let rv = match residual {
        Some(r) => values(r)?,
        None => vec![0.0; xv.len()],
    };
    let bv = bias.map(values).transpose()?;
    let (g, b) = (values(gamma)?, values(beta)?);
    let mut sum = vec![0f64; rows * w];
    let mut y = vec![0f64; rows * w];
    let mut stats = vec![0f64; rows * 2];
    for r in 0..rows {
        for j in 0..w {
            let i = r * w + j;
            let pre = xv[i] + bv.as_ref().map_or(0.0, |b| b[j]);
            sum[i] = pre * factor(dropout, i, x.dtype()) + rv[i];
        }
        let row = &sum[r * w..(r + 1) * w];
        let mean = row.iter().sum::<f64>() / w as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / w as f64;
        stats[2 * r] = mean;
        stats[2 * r + 1] = 1.0 / (var + eps).sqrt();
    }
    // The output from the sum and statistics as kept, so that [`norm_apply`] gives it
    // again bit for bit.
    let a = acc(x.dtype());
    let (sum, stats) = (rounded(sum, a)?, rounded(stats, a)?);
    for (i, y) in y.iter_mut().enumerate() {
        let (r, j) = (i / w, i % w);
        *y = normalized(sum[i], stats[2 * r], stats[2 * r + 1], g[j], b[j], a);
    }
    let sum = keep_sum.then(|| tensor(sum, (rows, w), a)).transpose()?;
    Ok((
        tensor(y, (rows, w), x.dtype())?,
        sum,
        tensor(stats, (rows, 2), a)?,
    ))
}

/// `(sum - mean) rstd gamma + beta`, each step rounded to `acc` as the kernels round it.
fn normalized(sum: f64, mean: f64, rstd: f64, gamma: f64, beta: f64, acc: DType) -> f64 {
    let xhat = narrow(narrow(sum - mean, acc) * rstd, acc);
    narrow(narrow(xhat * gamma, acc) + beta, acc)
}

/// The normalised rows from a kept sum and statistics: `xhat gamma + beta` in `dtype`.
pub(crate) fn norm_apply(
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let (rows, w) = sum.dims2()?;
    let (s, st, g, b) = (values(sum)?, values(stats)?, values(gamma)?, values(beta)?);
    let a = acc(dtype);
    let y = (0..rows * w)
        .map(|i| {
            let (r, j) = (i / w, i % w);
            normalized(s[i], st[2 * r], st[2 * r + 1], g[j], b[j], a)
        })
        .collect();
    tensor(y, (rows, w), dtype)
}

/// The backward of [`add_norm_forward`]: `(dsum, dpre)`, the gradients of the sum under
/// the norm and of `x + bias` (the same tensor without dropout).
pub(crate) fn add_norm_backward(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, w) = dy.dims2()?;
    let (d, s, st, g) = (values(dy)?, values(sum)?, values(stats)?, values(gamma)?);
    let mut dsum = vec![0f64; rows * w];
    for r in 0..rows {
        let (mean, rstd) = (st[2 * r], st[2 * r + 1]);
        let xhat = |j: usize| (s[r * w + j] - mean) * rstd;
        let mean_g = (0..w).map(|j| d[r * w + j] * g[j]).sum::<f64>() / w as f64;
        let mean_gx = (0..w).map(|j| d[r * w + j] * g[j] * xhat(j)).sum::<f64>() / w as f64;
        for j in 0..w {
            dsum[r * w + j] = rstd * (d[r * w + j] * g[j] - mean_g - xhat(j) * mean_gx);
        }
    }
    let dsum = rounded(dsum, dy.dtype())?;
    let has_dropout = dropout.is_some_and(|(_, p)| p > 0.0);
    let dpre = if has_dropout {
        let v = dsum
            .iter()
            .enumerate()
            .map(|(i, v)| v * factor(dropout, i, dy.dtype()))
            .collect();
        tensor(v, (rows, w), dy.dtype())?
    } else {
        tensor(dsum.clone(), (rows, w), dy.dtype())?
    };
    Ok((tensor(dsum, (rows, w), dy.dtype())?, dpre))
}

/// The sums of the columns of `x` `[rows, w]`, in [`acc`].
pub(crate) fn column_sums(x: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, w) = x.dims2()?;
    let v = values(x)?;
    let sums = (0..w)
        .map(|j| (0..rows).map(|r| v[r * w + j]).sum())
        .collect();
    tensor(sums, w, acc(x.dtype()))
}

/// The norm parameters' gradients `(sum_r dy xhat, sum_r dy)`, in [`acc`].
pub(crate) fn norm_param_grads(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, w) = dy.dims2()?;
    let (d, s, st) = (values(dy)?, values(sum)?, values(stats)?);
    let mut dg = vec![0f64; w];
    let mut db = vec![0f64; w];
    for r in 0..rows {
        for j in 0..w {
            let i = r * w + j;
            dg[j] += d[i] * (s[i] - st[2 * r]) * st[2 * r + 1];
            db[j] += d[i];
        }
    }
    let a = acc(dy.dtype());
    Ok((tensor(dg, w, a)?, tensor(db, w, a)?))
}

/// `(pre, act(pre))` with `pre = u + bias` (rounded to the dtype first).
pub(crate) fn bias_act_forward(
    u: &Tensor,
    bias: &Tensor,
    act: Act,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, w) = u.dims2()?;
    let (uv, b) = (values(u)?, values(bias)?);
    let pre: Vec<f64> = (0..rows * w).map(|i| uv[i] + b[i % w]).collect();
    let pre = tensor(pre, (rows, w), u.dtype())?;
    let g = act_forward(&pre, act)?;
    Ok((pre, g))
}

/// `act(pre)`.
pub(crate) fn act_forward(pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let v: Vec<f64> = values(pre)?
        .into_iter()
        .map(|x| act_value(act, x))
        .collect();
    tensor(v, pre.shape().clone(), pre.dtype())
}

/// `dg * act'(pre)`.
pub(crate) fn act_backward(dg: &Tensor, pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let (d, p) = (values(dg)?, values(pre)?);
    let v = d
        .iter()
        .zip(&p)
        .map(|(d, &x)| d * act_slope(act, x))
        .collect();
    tensor(v, dg.shape().clone(), dg.dtype())
}

/// Inverted dropout over the whole tensor (element `i` masked by `keep(seed, i, p)`).
pub(crate) fn dropout(x: &Tensor, seed: u64, p: f32) -> candle_core::Result<Tensor> {
    let v = values(x)?
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * factor(Some((seed, p)), i, x.dtype()))
        .collect();
    tensor(v, x.shape().clone(), x.dtype())
}

/// The softmax of `scale scores + key_bias (+ score_bias)` (-10000 more where the
/// decoder's `pattern` (causal, window) hides a key) over the last dimension of
/// `[n, heads, s, s]`, and the probabilities after dropout (`None` without).
pub(crate) fn softmax_forward(
    scores: &Tensor,
    key_bias: &Tensor,
    score_bias: Option<&Tensor>,
    scale: f64,
    dropout: Option<(u64, f32)>,
    pattern: (bool, Option<usize>),
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let (n, heads, s, s2) = scores.dims4()?;
    if s2 != s {
        candle_core::bail!("softmax: scores {:?} are not square", scores.dims());
    }
    let (x, kb) = (values(scores)?, values(key_bias)?);
    let sb = score_bias.map(values).transpose()?;
    let dtype = scores.dtype();
    let scale = narrow(scale, dtype);
    let (causal, window) = pattern;
    let sees = |q: usize, k: usize| match (causal, window) {
        (true, w) => k <= q && w.is_none_or(|w| q - k <= w),
        (false, Some(w)) => q.abs_diff(k) <= w,
        (false, None) => true,
    };
    let mut p = vec![0f64; x.len()];
    for row in 0..n * heads * s {
        let (b, head, q) = (row / (heads * s), (row / s) % heads, row % s);
        let z: Vec<f64> = (0..s)
            .map(|k| {
                // Each addition rounded as the kernel's f32 arithmetic rounds it: in a row
                // whose every key is hidden (a padding query in a window of padding keys)
                // the logits sit near -1e4, where f32's steps are 1e-3 and decide the row.
                let lin = narrow(scale * x[row * s + k], dtype);
                let mut z = narrow(lin + kb[b * s + k], acc(dtype));
                if let Some(v) = &sb {
                    z = narrow(z + v[(head * s + q) * s + k], acc(dtype));
                }
                if sees(q, k) {
                    z
                } else {
                    narrow(z - 10000.0, acc(dtype))
                }
            })
            .collect();
        let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = z.iter().map(|z| (z - mx).exp()).sum();
        for k in 0..s {
            p[row * s + k] = (z[k] - mx).exp() / total;
        }
    }
    let probs = tensor(p, scores.shape().clone(), scores.dtype())?;
    let dropped = match dropout.filter(|&(_, p)| p > 0.0) {
        Some((seed, p)) => Some(self::dropout(&probs, seed, p)?),
        None => None,
    };
    Ok((probs, dropped))
}

/// The backward of [`softmax_forward`]: from the gradient `d` of the dropped probabilities
/// the gradient of the logits, `p (dp - sum(p dp))` with `dp = d * mask * scale`.
pub(crate) fn softmax_backward(
    probs: &Tensor,
    d: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    let s = probs.dim(candle_core::D::Minus1)?;
    let (p, dv) = (values(probs)?, values(d)?);
    let mut dz = vec![0f64; p.len()];
    for row in 0..p.len() / s.max(1) {
        let dp: Vec<f64> = (0..s)
            .map(|k| dv[row * s + k] * factor(dropout, row * s + k, probs.dtype()))
            .collect();
        let dot: f64 = (0..s).map(|k| p[row * s + k] * dp[k]).sum();
        for k in 0..s {
            dz[row * s + k] = p[row * s + k] * (dp[k] - dot);
        }
    }
    tensor(dz, probs.shape().clone(), probs.dtype())
}

/// Columns `first .. first + heads d` of `src` `[n s, width]` (plus `bias[first + c]`) as
/// `[n, heads, s, d]`.
pub(crate) fn to_heads(
    src: &Tensor,
    first: usize,
    (n, heads, s, d): (usize, usize, usize, usize),
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let width = src.dim(1)?;
    let v = values(src)?;
    let bv = bias.map(values).transpose()?;
    let mut out = vec![0f64; n * heads * s * d];
    for (i, o) in out.iter_mut().enumerate() {
        let (e, t, head, b) = (
            i % d,
            (i / d) % s,
            (i / (d * s)) % heads,
            i / (d * s * heads),
        );
        let c = first + head * d + e;
        *o = v[(b * s + t) * width + c] + bv.as_ref().map_or(0.0, |bv| bv[c]);
    }
    tensor(out, (n, heads, s, d), src.dtype())
}

/// Heads `[n, heads, s, d]` times their factors into their columns of one `[n s, width]`.
pub(crate) fn from_heads(
    parts: &[(&Tensor, usize, f64)],
    width: usize,
) -> candle_core::Result<Tensor> {
    let Some((first, _, _)) = parts.first() else {
        candle_core::bail!("from_heads: no parts")
    };
    let (n, _, s, _) = first.dims4()?;
    let mut out = vec![0f64; n * s * width];
    for &(part, column, mult) in parts {
        let (_, heads, s, d) = part.dims4()?;
        let mult = narrow(mult, part.dtype());
        for (i, v) in values(part)?.into_iter().enumerate() {
            let (e, t, head, b) = (
                i % d,
                (i / d) % s,
                (i / (d * s)) % heads,
                i / (d * s * heads),
            );
            out[(b * s + t) * width + column + head * d + e] =
                if mult == 1.0 { v } else { v * mult };
        }
    }
    tensor(out, (n * s, width), first.dtype())
}

/// RMSNorm over the rows of `x` `[rows, w]`: `(x r (offset + weight), r)`, `r = 1 /
/// sqrt(mean(x^2) + eps)` per row (in [`acc`]).
pub(crate) fn rms_forward(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    offset: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, w) = x.dims2()?;
    let (xv, g) = (values(x)?, values(weight)?);
    let a = acc(x.dtype());
    let rstd: Vec<f64> = (0..rows)
        .map(|r| {
            let ms = xv[r * w..(r + 1) * w].iter().map(|v| v * v).sum::<f64>() / w as f64;
            1.0 / (ms + eps).sqrt()
        })
        .collect();
    let rstd = rounded(rstd, a)?;
    let y = (0..rows * w)
        .map(|i| narrow(xv[i] * rstd[i / w], a) * (offset + g[i % w]))
        .collect();
    Ok((tensor(y, (rows, w), x.dtype())?, tensor(rstd, rows, a)?))
}

/// The backward of [`rms_forward`]: `dx = r (g - x r^2 mean(g x))`, `g = dy (offset + w)`.
pub(crate) fn rms_backward(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    weight: &Tensor,
    offset: f64,
) -> candle_core::Result<Tensor> {
    let (rows, w) = dy.dims2()?;
    let (d, xv, r, g) = (values(dy)?, values(x)?, values(rstd)?, values(weight)?);
    let mut dx = vec![0f64; rows * w];
    for (row, &rr) in r.iter().enumerate().take(rows) {
        let at = |j: usize| row * w + j;
        let mean_gx = (0..w)
            .map(|j| d[at(j)] * (offset + g[j]) * xv[at(j)])
            .sum::<f64>()
            / w as f64;
        for j in 0..w {
            dx[at(j)] = rr * (d[at(j)] * (offset + g[j]) - xv[at(j)] * rr * rr * mean_gx);
        }
    }
    tensor(dx, (rows, w), dy.dtype())
}

/// RMSNorm's weight gradient `sum_rows dy x r`, in [`acc`].
pub(crate) fn rms_param_grads(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
) -> candle_core::Result<Tensor> {
    let (rows, w) = dy.dims2()?;
    let (d, xv, r) = (values(dy)?, values(x)?, values(rstd)?);
    let mut sums = vec![0f64; w];
    for row in 0..rows {
        for (j, s) in sums.iter_mut().enumerate() {
            *s += d[row * w + j] * xv[row * w + j] * r[row];
        }
    }
    tensor(sums, w, acc(dy.dtype()))
}

/// The gated unit over `up` `[rows, 2w]`: `act(gate) up`, `[rows, w]`.
pub(crate) fn glu_forward(up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let (rows, w2) = up.dims2()?;
    let w = w2 / 2;
    let u = values(up)?;
    let out = (0..rows * w)
        .map(|i| {
            let (r, j) = (i / w, i % w);
            act_value(act, u[r * w2 + j]) * u[r * w2 + w + j]
        })
        .collect();
    tensor(out, (rows, w), up.dtype())
}

/// The backward of [`glu_forward`]: `[dgate, dup]` `[rows, 2w]`.
pub(crate) fn glu_backward(dout: &Tensor, up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let (rows, w2) = up.dims2()?;
    let w = w2 / 2;
    let (d, u) = (values(dout)?, values(up)?);
    let mut out = vec![0f64; rows * w2];
    for r in 0..rows {
        for j in 0..w {
            let (g, v, dd) = (u[r * w2 + j], u[r * w2 + w + j], d[r * w + j]);
            out[r * w2 + j] = dd * v * act_slope(act, g);
            out[r * w2 + w + j] = dd * act_value(act, g);
        }
    }
    tensor(out, (rows, w2), up.dtype())
}

/// Rotary position embedding of `x` `[n, heads, s, d]`, token `(b, t)` at position
/// `positions[b s + t]` of the tables `cos`, `sin` `[positions, d]`: `x cos +
/// rotate_half(x) sin`.
pub(crate) fn rotary_forward(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    rotary(x, cos, sin, positions, 1.0, false)
}

/// The backward of [`rotary_forward`], times `mult`.
pub(crate) fn rotary_backward(
    dy: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    mult: f64,
) -> candle_core::Result<Tensor> {
    rotary(dy, cos, sin, positions, mult, true)
}

fn rotary(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    mult: f64,
    backward: bool,
) -> candle_core::Result<Tensor> {
    let (_, heads, s, d) = x.dims4()?;
    let (xv, c, sn) = (values(x)?, values(cos)?, values(sin)?);
    let pos: Vec<u32> = positions.flatten_all()?.to_vec1()?;
    let half = d / 2;
    let out = (0..xv.len())
        .map(|i| {
            let (e, t, b) = (i % d, (i / d) % s, i / (d * s * heads));
            let row = pos[b * s + t] as usize * d;
            let v = match (backward, e < half) {
                (false, true) => xv[i] * c[row + e] - xv[i + half] * sn[row + e],
                (false, false) => xv[i] * c[row + e] + xv[i - half] * sn[row + e],
                (true, true) => xv[i] * c[row + e] + xv[i + half] * sn[row + e + half],
                (true, false) => xv[i] * c[row + e] - xv[i - half] * sn[row + e - half],
            };
            mult * v
        })
        .collect();
    tensor(out, x.shape().clone(), x.dtype())
}

fn act_value(act: Act, x: f64) -> f64 {
    match act {
        Act::GeluErf => 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
        Act::GeluTanh => {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + u.tanh())
        }
        Act::Relu => x.max(0.0),
        Act::Silu => x / (1.0 + (-x).exp()),
    }
}

fn act_slope(act: Act, x: f64) -> f64 {
    match act {
        Act::GeluErf => {
            let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            cdf + x * pdf
        }
        Act::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let u = k * (x + 0.044715 * x * x * x);
            let t = u.tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
        }
        Act::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Act::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::MASKED_BIAS;

    /// `softmax_fwd` of attention.cu in f32 as the GPU runs it: each product and sum
    /// rounded to f32, `expf` on f32 arguments, the row's sum in f32.
    fn kernel_in_f32(
        x: &[f32],
        kb: &[f32],
        s: usize,
        scale: f32,
        sees: impl Fn(usize, usize) -> bool,
    ) -> Vec<f32> {
        let mut p = vec![0f32; x.len()];
        for row in 0..x.len() / s {
            let (b, q) = (row / s, row % s);
            let z: Vec<f32> = (0..s)
                .map(|k| {
                    let z = scale * x[row * s + k] + kb[b * s + k];
                    if sees(q, k) {
                        z
                    } else {
                        z - 10000.0
                    }
                })
                .collect();
            let mx = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = z.iter().map(|z| (z - mx).exp()).sum();
            for k in 0..s {
                p[row * s + k] = (z[k] - mx).exp() / total;
            }
        }
        p
    }

    /// A padding query whose window holds only padding keys: every logit is near -1e4 and
    /// the kernel's f32 rounding there decides the row; the reference rounds as it does
    /// (measured on an H200 before it did: 1.1e-5 and 1.2e-5 off in f32, over 1e-5).
    #[test]
    fn the_softmax_reference_rounds_hidden_logits_as_the_kernel_does() {
        let (s, scale) = (40usize, 0.35f32);
        let x: Vec<f32> = (0..s * s)
            .map(|i| ((i * 7919 % 1000) as f32 / 250.0) - 2.0)
            .collect();
        let kb: Vec<f32> = (0..s)
            .map(|k| if k >= s - 9 { MASKED_BIAS as f32 } else { 0.0 })
            .collect();
        for window in [Some(5usize), Some(7)] {
            let sees = |q: usize, k: usize| k <= q && window.is_none_or(|w| q - k <= w);
            let want = kernel_in_f32(&x, &kb, s, scale, sees);
            let scores = Tensor::from_vec(x.clone(), (1, 1, s, s), &Device::Cpu).unwrap();
            let key_bias = Tensor::from_vec(kb.clone(), (1, s), &Device::Cpu).unwrap();
            let (p, _) = softmax_forward(
                &scores,
                &key_bias,
                None,
                f64::from(scale),
                None,
                (true, window),
            )
            .unwrap();
            let got = p.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (mut diff, mut norm) = (0f64, 0f64);
            for (g, w) in got.iter().zip(&want) {
                diff += f64::from(g - w).powi(2);
                norm += f64::from(*w).powi(2);
            }
            let rel = (diff / norm).sqrt();
            assert!(
                rel < 1e-6,
                "window {window:?}: the reference is {rel:.2e} off the kernel's f32"
            );
        }
    }
}
