//! Row kernels on slices that the layer and embeddings nodes share: LayerNorm rows (their
//! statistics, the normalisation, the backward with `dgamma` and `dbeta` summed per
//! block), the residual sum under a dropout mask, and the activations (with their slopes
//! for the backward, or in place where nothing is kept).

use crate::nn::cpu::attention::heads::{lane_dot, lane_sum};
use crate::nn::cpu::blocks::{
    for_blocks, for_blocks_with_partials, sum_partials, wide_fn, Float, SharedMut, BLOCK_ROWS,
};
use crate::nn::cpu::elementwise::math::Act;

/// The LayerNorm statistics `(mean, 1 / sqrt(var + eps))` of a row (eight-lane sums).
#[inline(always)]
pub(in crate::nn) fn stats<T: Float>(x: &[T], eps: f64) -> (T, T) {
    let n = T::of(x.len() as f64);
    let mean = lane_sum(x) / n;
    let mut acc = [T::zero(); 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            let d = c[k] - mean;
            acc[k] += d * d;
        }
    }
    for (k, &v) in chunks.remainder().iter().enumerate() {
        let d = v - mean;
        acc[k] += d * d;
    }
    let var =
        (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) / n;
    (mean, T::one() / (var + T::of(eps)).sqrt())
}

wide_fn! {
/// `LayerNorm(dropout(a + bias) + r)` row by row: returns the sums and the normalised
/// rows. `a` is a projection's product and `bias` its bias, added here (where the rows are
/// read anyway) rather than written into the product's destination first. Dropout masks
/// are those of each element's place in the padded `[n s, h]` tensor (`places[row]` the
/// padded row of each row).
pub(in crate::nn) fn add_norm<T: Float>(
    (a, bias): (&[T], Option<&[T]>),
    r: &[T],
    dropout: Option<(u64, f32)>,
    (g, b): (&[T], &[T]),
    eps: f64,
    places: &[usize],
) -> (Vec<T>, Vec<T>) {
    let _span = crate::profile::span(|| "cpu.add-norm".into());
    let h = g.len();
    let mut sum = vec![T::zero(); a.len()];
    let mut y = vec![T::zero(); a.len()];
    let ys = SharedMut(y.as_mut_ptr());
    for_blocks(&mut sum, h, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        let base = first * h;
        // SAFETY: block `blk` owns the same rows of `y` as of `sum`.
        let yb = unsafe { std::slice::from_raw_parts_mut(ys.get().add(base), chunk.len()) };
        for (i, (srow, yrow)) in chunk
            .chunks_exact_mut(h)
            .zip(yb.chunks_exact_mut(h))
            .enumerate()
        {
            let row = first + i;
            add_norm_row((a, bias), r, dropout, (g, b, eps), (row, places[row]), srow, yrow);
        }
    });
    (sum, y)
}
}

wide_fn! {
/// The normalised rows of [`add_norm`] alone, for a forward that keeps no sum
/// (inference): each row's sum lives in a scratch row, so no `[rows, h]` buffer of sums is
/// written. The same bits as `add_norm`'s second output.
pub(in crate::nn) fn add_norm_output<T: Float>(
    (a, bias): (&[T], Option<&[T]>),
    r: &[T],
    dropout: Option<(u64, f32)>,
    (g, b): (&[T], &[T]),
    eps: f64,
    places: &[usize],
) -> Vec<T> {
    let _span = crate::profile::span(|| "cpu.add-norm".into());
    let h = g.len();
    let mut y = vec![T::zero(); a.len()];
    for_blocks(&mut y, h, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        let mut sum = vec![T::zero(); h];
        for (i, yrow) in chunk.chunks_exact_mut(h).enumerate() {
            let row = first + i;
            add_norm_row((a, bias), r, dropout, (g, b, eps), (row, places[row]), &mut sum, yrow);
        }
    });
    y
}
}

/// One row of [`add_norm`]: `sum = dropout(a + bias) + r` of row `row` (padded row
/// `place`), and its LayerNorm into `y`.
#[inline(always)]
fn add_norm_row<T: Float>(
    (a, bias): (&[T], Option<&[T]>),
    r: &[T],
    dropout: Option<(u64, f32)>,
    (g, b, eps): (&[T], &[T], f64),
    (row, place): (usize, usize),
    sum: &mut [T],
    y: &mut [T],
) {
    let h = g.len();
    let at = row * h;
    add_row(
        (&a[at..at + h], bias),
        &r[at..at + h],
        dropout,
        place * h,
        sum,
    );
    norm_row(sum, g, b, eps, y);
}

/// `out = dropout(a + bias) + r` for the elements from `start` on (of the masked tensor).
#[inline(always)]
pub(in crate::nn) fn add_row<T: Float>(
    (a, bias): (&[T], Option<&[T]>),
    r: &[T],
    dropout: Option<(u64, f32)>,
    start: usize,
    out: &mut [T],
) {
    match (dropout.filter(|&(_, p)| p > 0.0), bias) {
        (Some((seed, p)), bias) => {
            match bias {
                Some(bias) => {
                    for ((o, &av), &bv) in out.iter_mut().zip(a).zip(bias) {
                        *o = av + bv;
                    }
                }
                None => out.copy_from_slice(a),
            }
            let keep = T::of(1.0 / (1.0 - f64::from(p)));
            crate::rng::keep_run(seed, start as u64, out.len(), p, |j, kept| {
                out[j] *= if kept { keep } else { T::zero() };
            });
            for (o, &rv) in out.iter_mut().zip(r) {
                *o += rv;
            }
        }
        (None, Some(bias)) => {
            for (((o, &av), &bv), &rv) in out.iter_mut().zip(a).zip(bias).zip(r) {
                *o = (av + bv) + rv;
            }
        }
        (None, None) => {
            for ((o, &av), &rv) in out.iter_mut().zip(a).zip(r) {
                *o = av + rv;
            }
        }
    }
}

#[inline(always)]
pub(crate) fn norm_row<T: Float>(x: &[T], g: &[T], b: &[T], eps: f64, y: &mut [T]) {
    let (mean, rstd) = stats(x, eps);
    for (((yv, &xv), &gv), &bv) in y.iter_mut().zip(x).zip(g).zip(b) {
        *yv = (xv - mean) * rstd * gv + bv;
    }
}

wide_fn! {
/// The normalised rows of `sum` (`y1` recomputed from the kept sum).
pub(in crate::nn) fn norm<T: Float>(sum: &[T], (g, b): (&[T], &[T]), eps: f64) -> Vec<T> {
    let h = g.len();
    let mut y = vec![T::zero(); sum.len()];
    for_blocks(&mut y, h, |blk, chunk| {
        let base = blk * BLOCK_ROWS * h;
        for (srow, yrow) in sum[base..base + chunk.len()]
            .chunks_exact(h)
            .zip(chunk.chunks_exact_mut(h))
        {
            norm_row(srow, g, b, eps, yrow);
        }
    });
    y
}
}

wide_fn! {
/// `u += bias` on every row (the bias of the product `u`, added here where the rows are
/// read anyway; `None`: `u` as it is), then `act(u)` element by element.
pub(in crate::nn) fn activate<T: Float>(
    u: &mut [T],
    bias: Option<&[T]>,
    act: Act,
    width: usize,
) -> Vec<T> {
    let _span = crate::profile::span(|| "cpu.activation".into());
    let mut g = vec![T::zero(); u.len()];
    let us = SharedMut(u.as_mut_ptr());
    for_blocks(&mut g, width, |blk, chunk| {
        let base = blk * BLOCK_ROWS * width;
        // SAFETY: block `blk` owns the same elements of `u` as of `g`.
        let src = unsafe { std::slice::from_raw_parts_mut(us.get().add(base), chunk.len()) };
        if let Some(bias) = bias {
            for row in src.chunks_exact_mut(width) {
                for (v, &b) in row.iter_mut().zip(bias) {
                    *v += b;
                }
            }
        }
        macro_rules! each {
            ($a:expr) => {
                for (o, &v) in chunk.iter_mut().zip(src.iter()) {
                    *o = $a.value(v);
                }
            };
        }
        match act {
            Act::GeluErf => each!(Act::GeluErf),
            Act::GeluTanh => each!(Act::GeluTanh),
            Act::Relu => each!(Act::Relu),
            Act::Silu => each!(Act::Silu),
        }
    });
    g
}
}

wide_fn! {
/// `act(u + bias)` over `u` itself (`None`: `act(u)`).
pub(in crate::nn) fn activate_in_place<T: Float>(
    u: &mut [T],
    bias: Option<&[T]>,
    act: Act,
    width: usize,
) {
    let _span = crate::profile::span(|| "cpu.activation".into());
    for_blocks(u, width, |_, chunk| {
        macro_rules! each {
            ($a:expr) => {
                match bias {
                    Some(bias) => {
                        for row in chunk.chunks_exact_mut(width) {
                            for (v, &b) in row.iter_mut().zip(bias) {
                                *v = $a.value(*v + b);
                            }
                        }
                    }
                    None => {
                        for v in chunk.iter_mut() {
                            *v = $a.value(*v);
                        }
                    }
                }
            };
        }
        match act {
            Act::GeluErf => each!(Act::GeluErf),
            Act::GeluTanh => each!(Act::GeluTanh),
            Act::Relu => each!(Act::Relu),
            Act::Silu => each!(Act::Silu),
        }
    });
}
}

wide_fn! {
/// `act(u)` and `act'(u)` element by element, in one pass (one exponential each).
pub(in crate::nn) fn activate_with_slope<T: Float>(
    u: &[T],
    act: Act,
    width: usize,
) -> (Vec<T>, Vec<T>) {
    let mut g = vec![T::zero(); u.len()];
    let mut slope = vec![T::zero(); u.len()];
    let sp = SharedMut(slope.as_mut_ptr());
    for_blocks(&mut g, width, |blk, chunk| {
        let base = blk * BLOCK_ROWS * width;
        let src = &u[base..base + chunk.len()];
        // SAFETY: block `blk` owns the same elements of `slope` as of `g`.
        let sl = unsafe { std::slice::from_raw_parts_mut(sp.get().add(base), chunk.len()) };
        macro_rules! each {
            ($a:expr) => {
                for ((o, d), &v) in chunk.iter_mut().zip(sl.iter_mut()).zip(src) {
                    let (value, derivative) = $a.value_and_derivative(v);
                    *o = value;
                    *d = derivative;
                }
            };
        }
        match act {
            Act::GeluErf => each!(Act::GeluErf),
            Act::GeluTanh => each!(Act::GeluTanh),
            Act::Relu => each!(Act::Relu),
            Act::Silu => each!(Act::Silu),
        }
    });
    (g, slope)
}
}

wide_fn! {
/// In place, `dy` becomes `dy * slope`; returns its column sums (the bias gradient).
pub(in crate::nn) fn times_slope<T: Float>(slope: &[T], dy: &mut [T], width: usize) -> Vec<T> {
    let partials = for_blocks_with_partials(dy, width, width, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * width;
        let len = chunk.len();
        for (row, srow) in chunk
            .chunks_exact_mut(width)
            .zip(slope[base..base + len].chunks_exact(width))
        {
            for ((d, a), &sv) in row.iter_mut().zip(acc.iter_mut()).zip(srow) {
                let g = *d * sv;
                *d = g;
                *a += g;
            }
        }
    });
    sum_partials(&partials, width)
}
}

wide_fn! {
/// LayerNorm's backward over rows: the gradient of the sum it normalised, from the
/// output's `dy`; and `(dgamma, dbeta)`.
pub(crate) fn norm_backward<T: Float>(
    sum: &[T],
    g: &[T],
    dy: &[T],
    eps: f64,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let h = g.len();
    let n = T::of(h as f64);
    let mut dsum = vec![T::zero(); dy.len()];
    let partials = for_blocks_with_partials(&mut dsum, h, 2 * h, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * h;
        let len = chunk.len();
        let mut xhat = vec![T::zero(); h];
        let mut gd = vec![T::zero(); h];
        for ((dsr, xr), dyr) in chunk
            .chunks_exact_mut(h)
            .zip(sum[base..base + len].chunks_exact(h))
            .zip(dy[base..base + len].chunks_exact(h))
        {
            let (mean, rstd) = stats(xr, eps);
            let (dg, db) = acc.split_at_mut(h);
            for j in 0..h {
                xhat[j] = (xr[j] - mean) * rstd;
                gd[j] = dyr[j] * g[j];
                dg[j] += dyr[j] * xhat[j];
                db[j] += dyr[j];
            }
            let mean_d = lane_sum(&gd) / n;
            let mean_dx = lane_dot(&gd, &xhat) / n;
            for j in 0..h {
                dsr[j] = rstd * (gd[j] - mean_d - xhat[j] * mean_dx);
            }
        }
    });
    let sums = sum_partials(&partials, 2 * h);
    (dsum, sums[..h].to_vec(), sums[h..].to_vec())
}
}

wide_fn! {
/// `x` times its dropout mask (`x` rows of `width`, `places[row]` each row's place in
/// the masked tensor, or `None`: the rows in order): `x` itself without dropout, else a
/// new buffer.
pub(crate) fn dropped<'a, T: Float>(
    x: &'a [T],
    dropout: Option<(u64, f32)>,
    width: usize,
    places: Option<&[usize]>,
) -> std::borrow::Cow<'a, [T]> {
    let Some((seed, p)) = dropout.filter(|&(_, p)| p > 0.0) else {
        return std::borrow::Cow::Borrowed(x);
    };
    let keep = T::of(1.0 / (1.0 - f64::from(p)));
    let mut out = vec![T::zero(); x.len()];
    for_blocks(&mut out, width, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
            let at = (first + i) * width;
            let src = &x[at..at + width];
            let place = places.map_or(first + i, |pl| pl[first + i]);
            crate::rng::keep_run(seed, (place * width) as u64, width, p, |j, kept| {
                row[j] = src[j] * if kept { keep } else { T::zero() };
            });
        }
    });
    std::borrow::Cow::Owned(out)
}
}

/// `1 / sqrt(mean(x^2) + eps)` of a row (eight-lane sums): RMSNorm's statistic.
#[inline(always)]
pub(in crate::nn) fn rms_inv<T: Float>(x: &[T], eps: f64) -> T {
    let ms = lane_dot(x, x) / T::of(x.len() as f64);
    T::one() / (ms + T::of(eps)).sqrt()
}

/// RMSNorm of one row into `y`: `(x r) (offset + w)`, `r` = [`rms_inv`] (as transformers
/// multiplies: the normalised row, then the scale).
#[inline(always)]
pub(in crate::nn) fn rms_row<T: Float>(x: &[T], w: &[T], eps: f64, offset: T, y: &mut [T]) {
    let r = rms_inv(x, eps);
    for ((yv, &xv), &wv) in y.iter_mut().zip(x).zip(w) {
        *yv = xv * r * (offset + wv);
    }
}

wide_fn! {
/// RMSNorm of every row of `x` (rows of `w.len()`).
pub(in crate::nn) fn rms<T: Float>(x: &[T], w: &[T], eps: f64, offset: T) -> Vec<T> {
    let h = w.len();
    let mut y = vec![T::zero(); x.len()];
    for_blocks(&mut y, h, |blk, chunk| {
        let base = blk * BLOCK_ROWS * h;
        for (xr, yr) in x[base..base + chunk.len()]
            .chunks_exact(h)
            .zip(chunk.chunks_exact_mut(h))
        {
            rms_row(xr, w, eps, offset, yr);
        }
    });
    y
}
}

wide_fn! {
/// RMSNorm's backward over rows: the gradient of `x` from the output's `dy`, and the
/// scale's (summed per block, in block order).
pub(in crate::nn) fn rms_backward<T: Float>(
    x: &[T],
    w: &[T],
    dy: &[T],
    eps: f64,
    offset: T,
) -> (Vec<T>, Vec<T>) {
    let h = w.len();
    let n = T::of(h as f64);
    let mut dx = vec![T::zero(); x.len()];
    let partials = for_blocks_with_partials(&mut dx, h, h, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * h;
        let len = chunk.len();
        let mut xhat = vec![T::zero(); h];
        let mut gd = vec![T::zero(); h];
        for ((dxr, xr), dyr) in chunk
            .chunks_exact_mut(h)
            .zip(x[base..base + len].chunks_exact(h))
            .zip(dy[base..base + len].chunks_exact(h))
        {
            let r = rms_inv(xr, eps);
            for j in 0..h {
                xhat[j] = xr[j] * r;
                gd[j] = dyr[j] * (offset + w[j]);
                acc[j] += dyr[j] * xhat[j];
            }
            let mean = lane_dot(&gd, &xhat) / n;
            for j in 0..h {
                dxr[j] = r * (gd[j] - xhat[j] * mean);
            }
        }
    });
    (dx, sum_partials(&partials, h))
}
}

wide_fn! {
/// Per-head RMSNorm in place: in every row of `width` of `x`, the `count` heads of `d`
/// values from column `first` (the q/k norms of Qwen3 and Gemma3).
pub(in crate::nn) fn rms_heads<T: Float>(
    x: &mut [T],
    width: usize,
    (first, count, d): (usize, usize, usize),
    w: &[T],
    eps: f64,
    offset: T,
) {
    for_blocks(x, width, |_, chunk| {
        let mut y = vec![T::zero(); d];
        for row in chunk.chunks_exact_mut(width) {
            for head in row[first..first + count * d].chunks_exact_mut(d) {
                rms_row(head, w, eps, offset, &mut y);
                head.copy_from_slice(&y);
            }
        }
    });
}
}

wide_fn! {
/// The backward of [`rms_heads`]: `dx` holds the gradient of the normalised heads and
/// becomes that of `x` (the heads before the norm); returns the scale's gradient, summed
/// over rows (per block, in block order) and heads.
pub(in crate::nn) fn rms_heads_backward<T: Float>(
    x: &[T],
    dx: &mut [T],
    width: usize,
    (first, count, d): (usize, usize, usize),
    w: &[T],
    eps: f64,
    offset: T,
) -> Vec<T> {
    let n = T::of(d as f64);
    let partials = for_blocks_with_partials(dx, width, d, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * width;
        let mut xhat = vec![T::zero(); d];
        let mut gd = vec![T::zero(); d];
        for (r, drow) in chunk.chunks_exact_mut(width).enumerate() {
            let xrow = &x[base + r * width..base + (r + 1) * width];
            for (dh, xh) in drow[first..first + count * d]
                .chunks_exact_mut(d)
                .zip(xrow[first..first + count * d].chunks_exact(d))
            {
                let inv = rms_inv(xh, eps);
                for j in 0..d {
                    xhat[j] = xh[j] * inv;
                    gd[j] = dh[j] * (offset + w[j]);
                    acc[j] += dh[j] * xhat[j];
                }
                let mean = lane_dot(&gd, &xhat) / n;
                for j in 0..d {
                    dh[j] = inv * (gd[j] - xhat[j] * mean);
                }
            }
        }
    });
    sum_partials(&partials, d)
}
}
