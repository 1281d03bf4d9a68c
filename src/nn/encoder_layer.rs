//! A whole post-norm transformer encoder layer (BERT's) as one graph node with its
//! backward written out: no autograd graph inside the layer.
//!
//! ```text
//! qkv  = x W_qkv^T + b_qkv                    (one product, the bias pre-filled)
//! ctx  = attention(qkv)                       (super::attention: heads in place)
//! a    = ctx W_o^T + b_o
//! y1   = LayerNorm(dropout(a) + x)            (one pass per row)
//! u    = y1 W_i^T + b_i ; g = act(u)
//! o    = g W_d^T + b_d
//! y    = LayerNorm(dropout(o) + y1)
//! ```
//!
//! Per op, candle's backward would allocate a zero-filled accumulator for every gradient
//! that reaches a node and add into it, and each node would hand its precomputed output
//! over as a copy; the layer node writes every gradient once into a buffer of its own, its
//! output is its own buffer (no copy), the bias of every product is pre-filled into the
//! product's destination (no separate pass), and the residual gradients are accumulated by
//! the products themselves (`dx = dsum1 + dqkv W_qkv` in one product).
//!
//! What the backward reads, kept by the forward unless its sub-layer site is recomputed
//! (selective recompute; the recomputation is the forward's own arithmetic, so the
//! gradients equal those of keeping, bit for bit):
//!
//! | kept | per token | site that recomputes it instead |
//! |---|---:|---|
//! | the input `x` and the packed `qkv` | `4h` | (never) |
//! | the attention probabilities | `heads * L` | `attention.probs` |
//! | the context `ctx` | `h` | (never) |
//! | the residual sum under the first LayerNorm | `h` | `attention.output.LayerNorm` (one product `ctx W_o^T`) |
//! | the feed-forward pre-activation `u` | `I` | `intermediate` (one product `y1 W_i^T`) |
//! | the residual sum under the second LayerNorm | `h` | `output.LayerNorm` (one product `act(u) W_d^T`) |
//!
//! `y1` and `act(u)` are never kept: they are recomputed from the sum and from `u` in one
//! pass each. Reductions (LayerNorm statistics, bias gradients) run in a fixed order over
//! fixed blocks of rows, so nothing depends on the thread count but the products.

use candle_core::{DType, Tensor};

use super::attention::{self as kernel, lane_dot, lane_sum, with_values, HeadLayout, KeyMask};
use super::fused::{
    for_blocks, for_blocks_with_partials, node_n_owned, sum_partials, Act, AttentionSpec, Float,
    SharedMut, BLOCK_ROWS,
};

/// The weights of one encoder layer, Hugging Face's BERT layer in order.
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    /// Query, key and value projections `[h, h]`.
    pub qkv: [&'a Tensor; 3],
    /// Their biases `[h]`.
    pub qkv_bias: [&'a Tensor; 3],
    /// The attention output projection `[h, h]` and its bias.
    pub attention_output: (&'a Tensor, &'a Tensor),
    /// LayerNorm after attention: scale and shift `[h]`.
    pub attention_norm: (&'a Tensor, &'a Tensor),
    /// The feed-forward up projection `[I, h]` and its bias.
    pub intermediate: (&'a Tensor, &'a Tensor),
    /// The feed-forward down projection `[h, I]` and its bias.
    pub output: (&'a Tensor, &'a Tensor),
    /// LayerNorm after the feed-forward: scale and shift `[h]`.
    pub output_norm: (&'a Tensor, &'a Tensor),
}

impl<'a> LayerWeights<'a> {
    /// Every weight in node-input order.
    fn all(&self) -> [&'a Tensor; 16] {
        let [wq, wk, wv] = self.qkv;
        let [bq, bk, bv] = self.qkv_bias;
        [
            wq,
            wk,
            wv,
            bq,
            bk,
            bv,
            self.attention_output.0,
            self.attention_output.1,
            self.attention_norm.0,
            self.attention_norm.1,
            self.intermediate.0,
            self.intermediate.1,
            self.output.0,
            self.output.1,
            self.output_norm.0,
            self.output_norm.1,
        ]
    }
}

/// Everything of a layer's computation besides its weights.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    /// Attention heads.
    pub heads: usize,
    /// The feed-forward activation.
    pub act: Act,
    /// LayerNorm epsilon (both norms).
    pub eps: f64,
    /// The self-attention: key mask, scale, dropout on the probabilities, and whether the
    /// probabilities are recomputed in the backward (`attention.probs`).
    pub attention: AttentionSpec,
    /// Dropout on the attention output (before the first residual sum).
    pub attention_output_dropout: Option<(u64, f32)>,
    /// Dropout on the feed-forward output (before the second residual sum).
    pub output_dropout: Option<(u64, f32)>,
    /// Recompute the residual sum under the first LayerNorm (`attention.output.LayerNorm`).
    pub recompute_attention_norm: bool,
    /// Recompute the feed-forward pre-activation (`intermediate`).
    pub recompute_intermediate: bool,
    /// Recompute the residual sum under the second LayerNorm (`output.LayerNorm`).
    pub recompute_output_norm: bool,
}

/// The layer on `x` `[n, s, h]` (CPU, f32 or f64): one node over `x` and the sixteen
/// weights, or the plain forward when none of them is tracked (no buffer kept).
pub fn encoder_layer(
    x: &Tensor,
    w: &LayerWeights,
    spec: &LayerSpec,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let (inter, h2) = w.intermediate.0.dims2()?;
    let heads = spec.heads;
    let fits = heads > 0
        && h % heads == 0
        && h2 == h
        && w.output.0.dims2()? == (h, inter)
        && w.qkv.iter().all(|t| t.dims() == [h, h])
        && w.attention_output.0.dims() == [h, h]
        && [w.qkv_bias[0], w.qkv_bias[1], w.qkv_bias[2]]
            .iter()
            .chain([
                &w.attention_output.1,
                &w.attention_norm.0,
                &w.attention_norm.1,
            ])
            .chain([&w.output.1, &w.output_norm.0, &w.output_norm.1])
            .all(|t| t.dims() == [h])
        && w.intermediate.1.dims() == [inter];
    if !fits {
        candle_core::bail!(
            "encoder layer: hidden size {h}, {heads} heads and the weights ({:?} up, {:?} down) do not fit",
            w.intermediate.0.dims(),
            w.output.0.dims()
        );
    }
    let dims = Shape {
        n,
        s,
        h,
        inter,
        heads,
        d: h / heads,
    };
    let tracked = x.track_op() || w.all().iter().any(|t| t.track_op());
    match x.dtype() {
        DType::F32 => layer::<f32>(x, w, spec, dims, tracked),
        DType::F64 => layer::<f64>(x, w, spec, dims, tracked),
        other => candle_core::bail!("encoder layer: runs in f32 or f64, not {other:?}"),
    }
}

/// The sizes of a layer applied to a batch.
#[derive(Debug, Clone, Copy)]
struct Shape {
    n: usize,
    s: usize,
    h: usize,
    inter: usize,
    heads: usize,
    d: usize,
}

impl Shape {
    fn rows(&self) -> usize {
        self.n * self.s
    }
}

/// The weights as plain values (detached views; the query, key and value stacked).
struct Values<T> {
    wqkv: Vec<T>,
    bqkv: Vec<T>,
    wo: Tensor,
    bo: Tensor,
    g1: Tensor,
    b1: Tensor,
    wi: Tensor,
    bi: Tensor,
    wd: Tensor,
    bd: Tensor,
    g2: Tensor,
    b2: Tensor,
}

fn contiguous_detached(t: &Tensor) -> candle_core::Result<Tensor> {
    t.detach().contiguous()
}

impl<T: Float> Values<T> {
    fn new(w: &LayerWeights) -> candle_core::Result<Self> {
        let mut wqkv = Vec::new();
        for t in w.qkv {
            with_values::<T, _>(&contiguous_detached(t)?, |v| {
                wqkv.extend_from_slice(v);
                Ok(())
            })?;
        }
        let mut bqkv = Vec::new();
        for t in w.qkv_bias {
            with_values::<T, _>(&contiguous_detached(t)?, |v| {
                bqkv.extend_from_slice(v);
                Ok(())
            })?;
        }
        let c = contiguous_detached;
        Ok(Self {
            wqkv,
            bqkv,
            wo: c(w.attention_output.0)?,
            bo: c(w.attention_output.1)?,
            g1: c(w.attention_norm.0)?,
            b1: c(w.attention_norm.1)?,
            wi: c(w.intermediate.0)?,
            bi: c(w.intermediate.1)?,
            wd: c(w.output.0)?,
            bd: c(w.output.1)?,
            g2: c(w.output_norm.0)?,
            b2: c(w.output_norm.1)?,
        })
    }
}

/// What the forward keeps for the backward (`None`: recomputed there).
struct Kept<T> {
    qkv: Vec<T>,
    probs: Option<Vec<T>>,
    ctx: Vec<T>,
    sum1: Option<Vec<T>>,
    u: Option<Vec<T>>,
    sum2: Option<Vec<T>>,
}

fn layer<T: Float>(
    x: &Tensor,
    w: &LayerWeights,
    spec: &LayerSpec,
    dims: Shape,
    tracked: bool,
) -> candle_core::Result<Tensor> {
    let xd = contiguous_detached(x)?;
    let values = Values::<T>::new(w)?;
    let bias = spec.attention.bias.contiguous()?;
    if bias.elem_count() != dims.n * dims.s {
        candle_core::bail!(
            "encoder layer: key mask {:?} does not fit {} sequences of {} tokens",
            bias.dims(),
            dims.n,
            dims.s
        );
    }
    let mask = with_values::<T, _>(&bias, |b| Ok(KeyMask::new(b, dims.n, dims.s)))?;
    let (out, kept) =
        with_values::<T, _>(&xd, |xv| forward(xv, &values, &mask, spec, dims, tracked))?;
    let shape = (dims.n, dims.s, dims.h);
    let Some(kept) = kept else {
        return Tensor::from_vec(out, shape, x.device());
    };
    let mut inputs = vec![x];
    inputs.extend(w.all());
    let spec = spec.clone();
    node_n_owned(
        "gradcache-encoder-layer",
        &inputs,
        out,
        shape.into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let grads = with_values::<T, _>(&xd, |xv| {
                with_values::<T, _>(&dy, |dyv| {
                    backward(xv, dyv, &values, &mask, &spec, dims, &kept)
                })
            })?;
            let dev = candle_core::Device::Cpu;
            let (h, i) = (dims.h, dims.inter);
            let Grads {
                dx,
                dwqkv,
                dbqkv,
                dwo,
                dbo,
                dg1,
                db1,
                dwi,
                dbi,
                dwd,
                dbd,
                dg2,
                db2,
            } = grads;
            let dwqkv = Tensor::from_vec(dwqkv, (3 * h, h), &dev)?;
            let dbqkv = Tensor::from_vec(dbqkv, 3 * h, &dev)?;
            let mut out = vec![Some(Tensor::from_vec(dx, shape, &dev)?)];
            for p in 0..3 {
                out.push(Some(dwqkv.narrow(0, p * h, h)?));
            }
            for p in 0..3 {
                out.push(Some(dbqkv.narrow(0, p * h, h)?));
            }
            for (v, dims) in [
                (dwo, vec![h, h]),
                (dbo, vec![h]),
                (dg1, vec![h]),
                (db1, vec![h]),
                (dwi, vec![i, h]),
                (dbi, vec![i]),
                (dwd, vec![h, i]),
                (dbd, vec![h]),
                (dg2, vec![h]),
                (db2, vec![h]),
            ] {
                out.push(Some(Tensor::from_vec(v, dims, &dev)?));
            }
            Ok(out)
        }),
    )
}

/// The gemm crate's parallelism for the layer's large products (candle's own choice).
fn parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `dst [m, n] (+)= lhs [m, k] rhs [k, n]`, each operand `(values, row stride, column
/// stride)`; with `accumulate` the product is added to what `dst` holds.
#[allow(clippy::too_many_arguments)]
fn product<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(dst.len() >= m * n, "product: destination too small");
    if k > 0 {
        assert!(
            lhs.len() > last(m, k, lhs_rs, lhs_cs) && rhs.len() > last(k, n, rhs_rs, rhs_cs),
            "product: operand too small"
        );
    }
    // SAFETY: every element the strides reach is inside its slice (checked above), and
    // `dst` is borrowed mutably, so it overlaps neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            if accumulate { T::one() } else { T::zero() },
            T::one(),
            false,
            false,
            false,
            parallelism(),
        );
    }
}

/// `x [rows, k] W^T + b`, `W` `[out, k]`: the bias pre-filled, the product added to it.
fn linear<T: Float>(x: &[T], w: &[T], b: &[T], rows: usize, k: usize) -> Vec<T> {
    let out = b.len();
    let mut y = Vec::with_capacity(rows * out);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    product((rows, out, k), &mut y, true, (x, k, 1), (w, 1, k));
    y
}

/// The LayerNorm statistics `(mean, 1 / sqrt(var + eps))` of a row (eight-lane sums).
#[inline(always)]
fn stats<T: Float>(x: &[T], eps: f64) -> (T, T) {
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

/// `LayerNorm(dropout(a) + r)` row by row: returns the sums and the normalised rows.
/// Dropout masks are those of each element's place in the `[rows, h]` tensor.
fn add_norm<T: Float>(
    a: &[T],
    r: &[T],
    dropout: Option<(u64, f32)>,
    (g, b): (&[T], &[T]),
    eps: f64,
) -> (Vec<T>, Vec<T>) {
    let h = g.len();
    let mut sum = vec![T::zero(); a.len()];
    let mut y = vec![T::zero(); a.len()];
    let ys = SharedMut(y.as_mut_ptr());
    for_blocks(&mut sum, h, |blk, chunk| {
        let base = blk * BLOCK_ROWS * h;
        // SAFETY: block `blk` owns the same rows of `y` as of `sum`.
        let yb = unsafe { std::slice::from_raw_parts_mut(ys.get().add(base), chunk.len()) };
        add_rows(
            &a[base..base + chunk.len()],
            &r[base..base + chunk.len()],
            dropout,
            base,
            chunk,
        );
        for (srow, yrow) in chunk.chunks_exact(h).zip(yb.chunks_exact_mut(h)) {
            norm_row(srow, g, b, eps, yrow);
        }
    });
    (sum, y)
}

/// `out = dropout(a) + r` for the elements from `start` on.
#[inline(always)]
fn add_rows<T: Float>(a: &[T], r: &[T], dropout: Option<(u64, f32)>, start: usize, out: &mut [T]) {
    match dropout.filter(|&(_, p)| p > 0.0) {
        Some((seed, p)) => {
            let keep = T::of(1.0 / (1.0 - f64::from(p)));
            crate::rng::keep_run(seed, start as u64, out.len(), p, |j, kept| {
                out[j] = a[j] * if kept { keep } else { T::zero() };
            });
            for (o, &rv) in out.iter_mut().zip(r) {
                *o += rv;
            }
        }
        None => {
            for ((o, &av), &rv) in out.iter_mut().zip(a).zip(r) {
                *o = av + rv;
            }
        }
    }
}

#[inline(always)]
fn norm_row<T: Float>(x: &[T], g: &[T], b: &[T], eps: f64, y: &mut [T]) {
    let (mean, rstd) = stats(x, eps);
    for (((yv, &xv), &gv), &bv) in y.iter_mut().zip(x).zip(g).zip(b) {
        *yv = (xv - mean) * rstd * gv + bv;
    }
}

/// The normalised rows of `sum` (`y1` recomputed from the kept sum).
fn norm<T: Float>(sum: &[T], (g, b): (&[T], &[T]), eps: f64) -> Vec<T> {
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

/// `act(u)` element by element.
fn activate<T: Float>(u: &[T], act: Act, width: usize) -> Vec<T> {
    let mut g = vec![T::zero(); u.len()];
    for_blocks(&mut g, width, |blk, chunk| {
        let base = blk * BLOCK_ROWS * width;
        let src = &u[base..base + chunk.len()];
        match act {
            Act::GeluErf => chunk
                .iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = Act::GeluErf.value(v)),
            Act::GeluTanh => chunk
                .iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = Act::GeluTanh.value(v)),
            Act::Relu => chunk
                .iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = Act::Relu.value(v)),
        }
    });
    g
}

/// In place, `dy` becomes `dy * act'(u)`; returns its column sums (the bias gradient).
fn activation_backward<T: Float>(u: &[T], dy: &mut [T], act: Act, width: usize) -> Vec<T> {
    let partials = for_blocks_with_partials(dy, width, width, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * width;
        let len = chunk.len();
        for (row, urow) in chunk
            .chunks_exact_mut(width)
            .zip(u[base..base + len].chunks_exact(width))
        {
            macro_rules! each {
                ($a:expr) => {
                    for ((d, a), &uv) in row.iter_mut().zip(acc.iter_mut()).zip(urow) {
                        let g = *d * $a.derivative(uv);
                        *d = g;
                        *a += g;
                    }
                };
            }
            match act {
                Act::GeluErf => each!(Act::GeluErf),
                Act::GeluTanh => each!(Act::GeluTanh),
                Act::Relu => each!(Act::Relu),
            }
        }
    });
    sum_partials(&partials, width)
}

/// LayerNorm's backward over rows: `dy` becomes `dsum` (the gradient of the sum it
/// normalised) in place; returns `(dgamma, dbeta)`.
fn norm_backward<T: Float>(sum: &[T], g: &[T], dy: &mut [T], eps: f64) -> (Vec<T>, Vec<T>) {
    let h = g.len();
    let n = T::of(h as f64);
    let partials = for_blocks_with_partials(dy, h, 2 * h, |blk, chunk, acc| {
        let base = blk * BLOCK_ROWS * h;
        let len = chunk.len();
        let mut xhat = vec![T::zero(); h];
        let mut gd = vec![T::zero(); h];
        for (dyr, xr) in chunk
            .chunks_exact_mut(h)
            .zip(sum[base..base + len].chunks_exact(h))
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
                dyr[j] = rstd * (gd[j] - mean_d - xhat[j] * mean_dx);
            }
        }
    });
    let sums = sum_partials(&partials, 2 * h);
    (sums[..h].to_vec(), sums[h..].to_vec())
}

/// In place, `x` times its dropout mask (`x` the rows of a `[rows, h]` tensor).
fn apply_dropout<T: Float>(x: &mut [T], dropout: Option<(u64, f32)>, width: usize) {
    let Some((seed, p)) = dropout.filter(|&(_, p)| p > 0.0) else {
        return;
    };
    let keep = T::of(1.0 / (1.0 - f64::from(p)));
    for_blocks(x, width, |blk, chunk| {
        let base = blk * BLOCK_ROWS * width;
        crate::rng::keep_run(seed, base as u64, chunk.len(), p, |j, kept| {
            chunk[j] *= if kept { keep } else { T::zero() };
        });
    });
}

/// Column sums of `[rows, width]` (a bias gradient), in a fixed order.
fn column_sums<T: Float>(x: &[T], width: usize) -> Vec<T> {
    let mut scratch = x.to_vec();
    let partials = for_blocks_with_partials(&mut scratch, width, width, |_, chunk, acc| {
        for row in chunk.chunks_exact(width) {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v;
            }
        }
    });
    sum_partials(&partials, width)
}

/// The feed-forward half from `y1`: `u`, and the output `o = act(u) W_d^T + b_d`.
fn feed_forward<T: Float>(
    y1: &[T],
    v: &Values<T>,
    spec: &LayerSpec,
    dims: Shape,
) -> candle_core::Result<(Vec<T>, Vec<T>)> {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    with_values::<T, _>(&v.wi, |wi| {
        with_values::<T, _>(&v.bi, |bi| {
            with_values::<T, _>(&v.wd, |wd| {
                with_values::<T, _>(&v.bd, |bd| {
                    let u = linear(y1, wi, bi, rows, h);
                    let g = activate(&u, spec.act, i);
                    let o = linear(&g, wd, bd, rows, i);
                    Ok((u, o))
                })
            })
        })
    })
}

/// `a = ctx W_o^T + b_o`.
fn attention_output<T: Float>(
    ctx: &[T],
    v: &Values<T>,
    dims: Shape,
) -> candle_core::Result<Vec<T>> {
    with_values::<T, _>(&v.wo, |wo| {
        with_values::<T, _>(&v.bo, |bo| Ok(linear(ctx, wo, bo, dims.rows(), dims.h)))
    })
}

/// The two LayerNorms' scale and shift, read together.
fn with_norms<T: Float, R>(
    v: &Values<T>,
    f: impl FnOnce((&[T], &[T]), (&[T], &[T])) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_values::<T, _>(&v.g1, |g1| {
        with_values::<T, _>(&v.b1, |b1| {
            with_values::<T, _>(&v.g2, |g2| {
                with_values::<T, _>(&v.b2, |b2| f((g1, b1), (g2, b2)))
            })
        })
    })
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
fn forward<T: Float>(
    x: &[T],
    v: &Values<T>,
    mask: &KeyMask<T>,
    spec: &LayerSpec,
    dims: Shape,
    keep: bool,
) -> candle_core::Result<(Vec<T>, Option<Kept<T>>)> {
    let (rows, h) = (dims.rows(), dims.h);
    let qkv = linear(x, &v.wqkv, &v.bqkv, rows, h);
    let (ctx, probs) = attend(&qkv, mask, spec, dims, keep);
    let qkv = keep.then_some(qkv);
    let a = attention_output(&ctx, v, dims)?;
    let ctx = keep.then_some(ctx);
    with_norms(v, |n1, n2| {
        let (sum1, y1) = add_norm(&a, x, spec.attention_output_dropout, n1, spec.eps);
        drop(a);
        let (u, o) = feed_forward(&y1, v, spec, dims)?;
        let (sum2, y) = add_norm(&o, &y1, spec.output_dropout, n2, spec.eps);
        let kept = qkv.zip(ctx).map(|(qkv, ctx)| Kept {
            qkv,
            probs,
            ctx,
            sum1: (!spec.recompute_attention_norm).then_some(sum1),
            u: (!spec.recompute_intermediate).then_some(u),
            sum2: (!spec.recompute_output_norm).then_some(sum2),
        });
        Ok((y, kept))
    })
}

/// The attention of the packed `qkv`: the context `[rows, h]` and, when `keep` and the
/// probabilities are not recomputed, the probabilities.
fn attend<T: Float>(
    qkv: &[T],
    mask: &KeyMask<T>,
    spec: &LayerSpec,
    dims: Shape,
    keep: bool,
) -> (Vec<T>, Option<Vec<T>>) {
    let (h, d, s) = (dims.h, dims.d, dims.s);
    let mut ctx = vec![T::zero(); dims.rows() * h];
    let params = kernel::Params {
        scale: spec.attention.scale,
        dropout: spec.attention.dropout,
    };
    let kdims = kernel::Dims {
        n: dims.n,
        heads: dims.heads,
        s,
        d,
    };
    let packed = |part: usize| HeadLayout::in_rows(s, 3 * h, d, part * h);
    let p = qkv.as_ptr();
    // SAFETY: qkv is a [rows, 3h] buffer, ctx a [rows, h] one.
    let probs = unsafe {
        kernel::forward(
            kdims,
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            (ctx.as_mut_ptr(), HeadLayout::in_rows(s, h, d, 0)),
            keep && !spec.attention.recompute,
        )
    };
    (ctx, probs)
}

/// Every gradient of the layer.
struct Grads<T> {
    dx: Vec<T>,
    dwqkv: Vec<T>,
    dbqkv: Vec<T>,
    dwo: Vec<T>,
    dbo: Vec<T>,
    dg1: Vec<T>,
    db1: Vec<T>,
    dwi: Vec<T>,
    dbi: Vec<T>,
    dwd: Vec<T>,
    dbd: Vec<T>,
    dg2: Vec<T>,
    db2: Vec<T>,
}

/// The backward pass from `dy`.
fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    v: &Values<T>,
    mask: &KeyMask<T>,
    spec: &LayerSpec,
    dims: Shape,
    kept: &Kept<T>,
) -> candle_core::Result<Grads<T>> {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    with_norms(v, |n1, n2| {
        // What the forward did not keep, recomputed with its own arithmetic.
        let sum1 = match &kept.sum1 {
            Some(s) => std::borrow::Cow::Borrowed(s.as_slice()),
            None => {
                let a = attention_output(&kept.ctx, v, dims)?;
                std::borrow::Cow::Owned(
                    add_norm(&a, x, spec.attention_output_dropout, n1, spec.eps).0,
                )
            }
        };
        let y1 = norm(&sum1, n1, spec.eps);
        let (u, o) = match (&kept.u, &kept.sum2) {
            (Some(u), Some(_)) => (std::borrow::Cow::Borrowed(u.as_slice()), None),
            _ => {
                let (u, o) = feed_forward(&y1, v, spec, dims)?;
                (std::borrow::Cow::Owned(u), Some(o))
            }
        };
        let sum2 = match (&kept.sum2, o) {
            (Some(s), _) => std::borrow::Cow::Borrowed(s.as_slice()),
            (None, Some(o)) => {
                std::borrow::Cow::Owned(add_norm(&o, &y1, spec.output_dropout, n2, spec.eps).0)
            }
            (None, None) => unreachable!("the output is recomputed whenever its sum is"),
        };
        // Second LayerNorm: dy becomes the gradient of the sum (which is also the residual
        // gradient of y1).
        let mut dsum2 = dy.to_vec();
        let (dg2, db2) = norm_backward(&sum2, n2.0, &mut dsum2, spec.eps);
        drop(sum2);
        let mut d_o = dsum2.clone();
        apply_dropout(&mut d_o, spec.output_dropout, h);
        let dbd = column_sums(&d_o, h);
        let g = activate(&u, spec.act, i);
        let (dwd, dwi, dbi, dy1) = with_values::<T, _>(&v.wd, |wd| {
            with_values::<T, _>(&v.wi, |wi| {
                // dW_d [h, I] = d_o^T g
                let mut dwd = vec![T::zero(); h * i];
                product((h, i, rows), &mut dwd, false, (&d_o, 1, h), (&g, i, 1));
                drop(g);
                // dg [rows, I] = d_o W_d
                let mut du = vec![T::zero(); rows * i];
                product((rows, i, h), &mut du, false, (&d_o, h, 1), (wd, i, 1));
                drop(d_o);
                let dbi = activation_backward(&u, &mut du, spec.act, i);
                // dW_i [I, h] = du^T y1
                let mut dwi = vec![T::zero(); i * h];
                product((i, h, rows), &mut dwi, false, (&du, 1, i), (&y1, h, 1));
                // dy1 = dsum2 + du W_i
                let mut dy1 = dsum2;
                product((rows, h, i), &mut dy1, true, (&du, i, 1), (wi, h, 1));
                Ok((dwd, dwi, dbi, dy1))
            })
        })?;
        drop((u, y1));
        // First LayerNorm.
        let mut dsum1 = dy1;
        let (dg1, db1) = norm_backward(&sum1, n1.0, &mut dsum1, spec.eps);
        drop(sum1);
        let mut d_a = dsum1.clone();
        apply_dropout(&mut d_a, spec.attention_output_dropout, h);
        let dbo = column_sums(&d_a, h);
        let (dwo, dctx) = with_values::<T, _>(&v.wo, |wo| {
            let mut dwo = vec![T::zero(); h * h];
            product(
                (h, h, rows),
                &mut dwo,
                false,
                (&d_a, 1, h),
                (&kept.ctx, h, 1),
            );
            let mut dctx = vec![T::zero(); rows * h];
            product((rows, h, h), &mut dctx, false, (&d_a, h, 1), (wo, h, 1));
            Ok((dwo, dctx))
        })?;
        drop(d_a);
        // Attention.
        let dqkv = attention_backward(&kept.qkv, kept.probs.as_deref(), &dctx, mask, spec, dims);
        drop(dctx);
        let dbqkv = column_sums(&dqkv, 3 * h);
        let mut dwqkv = vec![T::zero(); 3 * h * h];
        product(
            (3 * h, h, rows),
            &mut dwqkv,
            false,
            (&dqkv, 1, 3 * h),
            (x, h, 1),
        );
        // dx = dsum1 + dqkv W_qkv
        let mut dx = dsum1;
        product(
            (rows, h, 3 * h),
            &mut dx,
            true,
            (&dqkv, 3 * h, 1),
            (&v.wqkv, h, 1),
        );
        Ok(Grads {
            dx,
            dwqkv,
            dbqkv,
            dwo,
            dbo,
            dg1,
            db1,
            dwi,
            dbi,
            dwd,
            dbd,
            dg2,
            db2,
        })
    })
}

/// `dqkv` `[rows, 3h]` from `dctx` `[rows, h]`.
fn attention_backward<T: Float>(
    qkv: &[T],
    probs: Option<&[T]>,
    dctx: &[T],
    mask: &KeyMask<T>,
    spec: &LayerSpec,
    dims: Shape,
) -> Vec<T> {
    let (h, d, s) = (dims.h, dims.d, dims.s);
    let mut dqkv = vec![T::zero(); dims.rows() * 3 * h];
    let params = kernel::Params {
        scale: spec.attention.scale,
        dropout: spec.attention.dropout,
    };
    let kdims = kernel::Dims {
        n: dims.n,
        heads: dims.heads,
        s,
        d,
    };
    let packed = |part: usize| HeadLayout::in_rows(s, 3 * h, d, part * h);
    let (p, g) = (qkv.as_ptr(), dqkv.as_mut_ptr());
    // SAFETY: qkv and dqkv are [rows, 3h] buffers (the three gradients in disjoint
    // columns), dctx a [rows, h] one.
    unsafe {
        kernel::backward(
            kdims,
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            probs,
            (dctx.as_ptr(), HeadLayout::in_rows(s, h, d, 0)),
            (g, packed(0)),
            (g, packed(1)),
            (g, packed(2)),
        );
    }
    dqkv
}
