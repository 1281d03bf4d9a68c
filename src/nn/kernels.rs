//! The kernels the GPU layer nodes ([`super::gpu`]) are written on, one dispatch point
//! each: the CUDA kernel ([`super::cuda`]) for CUDA tensors, its CPU reference form
//! ([`super::cpu::reference`]) for CPU tensors. Every function takes detached tensors
//! (made contiguous here) and records no graph; the node around them writes the backward.
//!
//! Dtypes: values in the activations' dtype `T` (f32, bf16 or f16 on CUDA; any float on
//! the CPU); a norm's scale and shift, kept sum and statistics, and every column sum in
//! [`acc`]`(T)` (f32, or f64 for f64 activations).

use candle_core::{DType, Tensor};

use super::cpu::reference;
pub(crate) use super::cpu::reference::acc;
use super::Act;

/// Whether `t` lives on a CUDA device.
fn on_cuda(t: &Tensor) -> bool {
    t.device().is_cuda()
}

fn c(t: &Tensor) -> candle_core::Result<Tensor> {
    t.contiguous()
}

/// Calls `$cuda` for a CUDA `$t`, `$cpu` otherwise.
macro_rules! dispatch {
    ($t:expr, $cuda:expr, $cpu:expr) => {{
        #[cfg(feature = "cuda")]
        if on_cuda($t) {
            return $cuda;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = on_cuda($t);
        $cpu
    }};
}

/// `LayerNorm(dropout(x + bias) + residual)` over the rows of `x` `[rows, w]` (the
/// residual block's tail; `bias` `[w]` and the residual optional: without either, a
/// plain LayerNorm; `gamma`, `beta` `[w]` in [`acc`]): `(y, sum, stats)`, the normalised
/// rows in `x`'s dtype, the sum under the norm (kept for the backward with `keep_sum`)
/// and each row's `(mean, 1 / sqrt(var + eps))` `[rows, 2]`, both in [`acc`].
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
    let x = c(x)?;
    let residual = residual.map(c).transpose()?;
    let bias = bias.map(c).transpose()?;
    let (gamma, beta) = (c(gamma)?, c(beta)?);
    let residual_fits = residual.as_ref().is_none_or(|r| r.dims() == x.dims());
    if !residual_fits || gamma.dims() != [x.dim(1)?] || beta.dims() != gamma.dims() {
        candle_core::bail!(
            "add_norm: rows {:?}, residual {:?}, scale {:?}, shift {:?} do not fit",
            x.dims(),
            residual.as_ref().map(|r| r.dims().to_vec()),
            gamma.dims(),
            beta.dims()
        );
    }
    dispatch!(
        &x,
        super::cuda::add_norm_forward(
            &x,
            bias.as_ref(),
            residual.as_ref(),
            &gamma,
            &beta,
            eps,
            dropout,
            keep_sum
        ),
        reference::add_norm_forward(
            &x,
            bias.as_ref(),
            residual.as_ref(),
            &gamma,
            &beta,
            eps,
            dropout,
            keep_sum,
        )
    )
}

/// The normalised rows again, `xhat gamma + beta` in `dtype`, from a kept sum and its
/// statistics (the input of the next product, recomputed in the backward).
pub(crate) fn norm_apply(
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let (sum, stats, gamma, beta) = (c(sum)?, c(stats)?, c(gamma)?, c(beta)?);
    dispatch!(
        &sum,
        super::cuda::norm_apply(&sum, &stats, &gamma, &beta, dtype),
        reference::norm_apply(&sum, &stats, &gamma, &beta, dtype)
    )
}

/// The backward of [`add_norm_forward`] from the output's gradient `dy`: `(dsum, dpre)`,
/// the gradient of the sum under the norm (the residual's) and of `x + bias` (`dsum`
/// through the dropout mask; `dsum` itself without dropout), in `dy`'s dtype.
pub(crate) fn add_norm_backward(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
    gamma: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (dy, sum, stats, gamma) = (c(dy)?, c(sum)?, c(stats)?, c(gamma)?);
    dispatch!(
        &dy,
        super::cuda::add_norm_backward(&dy, &sum, &stats, &gamma, dropout),
        reference::add_norm_backward(&dy, &sum, &stats, &gamma, dropout)
    )
}

/// The norm's parameter gradients `(sum_rows dy xhat, sum_rows dy)` in [`acc`].
pub(crate) fn norm_param_grads(
    dy: &Tensor,
    sum: &Tensor,
    stats: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (dy, sum, stats) = (c(dy)?, c(sum)?, c(stats)?);
    dispatch!(
        &dy,
        super::cuda::norm_param_grads(&dy, &sum, &stats),
        reference::norm_param_grads(&dy, &sum, &stats)
    )
}

/// The column sums of `x` `[rows, w]` in [`acc`] (a bias gradient), in a fixed order.
pub(crate) fn column_sums(x: &Tensor) -> candle_core::Result<Tensor> {
    let x = c(x)?;
    dispatch!(&x, super::cuda::column_sums(&x), reference::column_sums(&x))
}

/// `(pre, act(pre))` with `pre = u + bias` over `[rows, w]` (`bias` `[w]`, in `u`'s dtype).
pub(crate) fn bias_act_forward(
    u: &Tensor,
    bias: &Tensor,
    act: Act,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (u, bias) = (c(u)?, c(bias)?);
    dispatch!(
        &u,
        super::cuda::bias_act_forward(&u, &bias, act),
        reference::bias_act_forward(&u, &bias, act)
    )
}

/// `act(pre)`.
pub(crate) fn act_forward(pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let pre = c(pre)?;
    dispatch!(
        &pre,
        super::cuda::act_forward(&pre, act),
        reference::act_forward(&pre, act)
    )
}

/// `dg * act'(pre)`.
pub(crate) fn act_backward(dg: &Tensor, pre: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let (dg, pre) = (c(dg)?, c(pre)?);
    dispatch!(
        &dg,
        super::cuda::act_backward(&dg, &pre, act),
        reference::act_backward(&dg, &pre, act)
    )
}

/// Inverted dropout of the whole tensor with the mask of `seed` (element `i` of `x` in
/// row-major order kept when [`crate::rng::keep`]`(seed, i, p)`).
pub(crate) fn dropout(x: &Tensor, seed: u64, p: f32) -> candle_core::Result<Tensor> {
    let x = c(x)?;
    dispatch!(
        &x,
        super::cuda::dropout(&x, seed, p),
        reference::dropout(&x, seed, p)
    )
}

/// Attention probabilities from the scores `[n, heads, s, s]`:
/// `softmax(scale scores + key_bias (+ score_bias))` over the keys (`key_bias` `[n, s]`,
/// `score_bias` `[heads, s, s]`, both in [`acc`]; a decoder's `pattern` (causal, window)
/// adds -10000 where it hides a key), and with `dropout` the probabilities through its
/// mask (of each element's index in the scores).
pub(crate) fn softmax_forward(
    scores: &Tensor,
    key_bias: &Tensor,
    score_bias: Option<&Tensor>,
    scale: f64,
    dropout: Option<(u64, f32)>,
    pattern: (bool, Option<usize>),
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let (scores, key_bias) = (c(scores)?, c(key_bias)?);
    let score_bias = score_bias.map(c).transpose()?;
    let (n, heads, s, s2) = scores.dims4()?;
    let fits = s2 == s
        && key_bias.dims() == [n, s]
        && score_bias
            .as_ref()
            .is_none_or(|b| b.dims() == [heads, s, s]);
    if !fits {
        candle_core::bail!(
            "softmax: scores {:?}, key bias {:?} and score bias {:?} do not fit",
            scores.dims(),
            key_bias.dims(),
            score_bias.as_ref().map(|b| b.dims().to_vec())
        );
    }
    dispatch!(
        &scores,
        super::cuda::softmax_forward(
            &scores,
            &key_bias,
            score_bias.as_ref(),
            scale,
            dropout,
            pattern
        ),
        reference::softmax_forward(
            &scores,
            &key_bias,
            score_bias.as_ref(),
            scale,
            dropout,
            pattern
        )
    )
}

/// The backward of [`softmax_forward`]: from the gradient `d` of the probabilities after
/// dropout, the gradient of the logits `scale scores + ..` (not yet times `scale`).
pub(crate) fn softmax_backward(
    probs: &Tensor,
    d: &Tensor,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    let (probs, d) = (c(probs)?, c(d)?);
    dispatch!(
        &probs,
        super::cuda::softmax_backward(&probs, &d, dropout),
        reference::softmax_backward(&probs, &d, dropout)
    )
}

/// Columns `first .. first + heads d` of `src` `[n s, width]`, plus the same columns of
/// `bias` `[width]`, as the heads `[n, heads, s, d]` a batched product takes.
pub(crate) fn to_heads(
    src: &Tensor,
    first: usize,
    shape: (usize, usize, usize, usize),
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let src = c(src)?;
    let bias = bias.map(c).transpose()?;
    let (n, heads, s, d) = shape;
    let (rows, width) = src.dims2()?;
    if rows != n * s || first + heads * d > width {
        candle_core::bail!(
            "to_heads: columns {first}.. of {:?} as {heads} heads of {d}",
            src.dims()
        );
    }
    dispatch!(
        &src,
        super::cuda::to_heads(&src, first, shape, bias.as_ref()),
        reference::to_heads(&src, first, shape, bias.as_ref())
    )
}

/// Heads `[n, heads, s, d]`, each times its factor, into their columns of one
/// `[n s, width]`; the parts cover every column.
pub(crate) fn from_heads(
    parts: &[(&Tensor, usize, f64)],
    width: usize,
) -> candle_core::Result<Tensor> {
    let parts: Vec<(Tensor, usize, f64)> = parts
        .iter()
        .map(|&(t, column, mult)| Ok((c(t)?, column, mult)))
        .collect::<candle_core::Result<_>>()?;
    let covered: usize = parts
        .iter()
        .map(|(t, _, _)| t.dims().get(1..).map_or(0, |d| d[0] * d[2]))
        .sum();
    if covered != width || parts.is_empty() {
        candle_core::bail!("from_heads: the parts cover {covered} of {width} columns");
    }
    let refs: Vec<(&Tensor, usize, f64)> = parts.iter().map(|(t, c, m)| (t, *c, *m)).collect();
    dispatch!(
        refs[0].0,
        super::cuda::from_heads(&refs, width),
        reference::from_heads(&refs, width)
    )
}

/// RMSNorm over the rows of `x` `[rows, w]` (`weight` `[w]` in [`acc`]): `(x r (offset +
/// weight), r)` with each row's `r = 1 / sqrt(mean(x^2) + eps)` `[rows]` in [`acc`].
pub(crate) fn rms_forward(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    offset: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (x, weight) = (c(x)?, c(weight)?);
    if weight.dims() != [x.dim(1)?] {
        candle_core::bail!(
            "rms_norm: rows {:?} and weight {:?}",
            x.dims(),
            weight.dims()
        );
    }
    dispatch!(
        &x,
        super::cuda::rms_forward(&x, &weight, eps, offset),
        reference::rms_forward(&x, &weight, eps, offset)
    )
}

/// The backward of [`rms_forward`] to its input.
pub(crate) fn rms_backward(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    weight: &Tensor,
    offset: f64,
) -> candle_core::Result<Tensor> {
    let (dy, x, rstd, weight) = (c(dy)?, c(x)?, c(rstd)?, c(weight)?);
    dispatch!(
        &dy,
        super::cuda::rms_backward(&dy, &x, &rstd, &weight, offset),
        reference::rms_backward(&dy, &x, &rstd, &weight, offset)
    )
}

/// RMSNorm's weight gradient `sum_rows dy x r` in [`acc`].
pub(crate) fn rms_param_grads(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
) -> candle_core::Result<Tensor> {
    let (dy, x, rstd) = (c(dy)?, c(x)?, c(rstd)?);
    dispatch!(
        &dy,
        super::cuda::rms_param_grads(&dy, &x, &rstd),
        reference::rms_param_grads(&dy, &x, &rstd)
    )
}

/// The gated unit `act(gate) up` of `up` `[rows, 2w]` (the gate's columns first).
pub(crate) fn glu_forward(up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let up = c(up)?;
    if up.dim(1)? % 2 != 0 {
        candle_core::bail!("glu: {:?} has an odd width", up.dims());
    }
    dispatch!(
        &up,
        super::cuda::glu_forward(&up, act),
        reference::glu_forward(&up, act)
    )
}

/// The backward of [`glu_forward`]: the gradient of `up`, `[rows, 2w]`.
pub(crate) fn glu_backward(dout: &Tensor, up: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let (dout, up) = (c(dout)?, c(up)?);
    dispatch!(
        &up,
        super::cuda::glu_backward(&dout, &up, act),
        reference::glu_backward(&dout, &up, act)
    )
}

/// Rotary position embedding of `x` `[n, heads, s, d]`: token `(b, t)` takes row
/// `positions[b s + t]` (u32 `[n s]`) of the tables `cos`, `sin` `[positions, d]` (in
/// [`acc`]); `x cos + rotate_half(x) sin`.
pub(crate) fn rotary_forward(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let (x, cos, sin, positions) = (c(x)?, c(cos)?, c(sin)?, c(positions)?);
    check_rotary(&x, &cos, &sin, &positions)?;
    dispatch!(
        &x,
        super::cuda::rotary_forward(&x, &cos, &sin, &positions),
        reference::rotary_forward(&x, &cos, &sin, &positions)
    )
}

/// The backward of [`rotary_forward`], times `mult`.
pub(crate) fn rotary_backward(
    dy: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    mult: f64,
) -> candle_core::Result<Tensor> {
    let (dy, cos, sin, positions) = (c(dy)?, c(cos)?, c(sin)?, c(positions)?);
    check_rotary(&dy, &cos, &sin, &positions)?;
    dispatch!(
        &dy,
        super::cuda::rotary_backward(&dy, &cos, &sin, &positions, mult),
        reference::rotary_backward(&dy, &cos, &sin, &positions, mult)
    )
}

fn check_rotary(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
) -> candle_core::Result<()> {
    let (n, _, s, d) = x.dims4()?;
    let fits = d % 2 == 0
        && cos.rank() == 2
        && cos.dim(1)? == d
        && sin.dims() == cos.dims()
        && positions.elem_count() == n * s
        && positions.dtype() == DType::U32;
    if !fits {
        candle_core::bail!(
            "rotary: {:?} with tables {:?} and positions {:?}",
            x.dims(),
            cos.dims(),
            positions.dims()
        );
    }
    Ok(())
}
