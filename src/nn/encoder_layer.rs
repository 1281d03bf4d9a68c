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

use super::attention::{self as kernel, lane_dot, lane_sum, HeadLayout, KeyMask, Rows};
use super::blocks::{
    for_blocks, for_blocks_with_partials, in_serial, parallel_ranges, sum_partials, Float,
    SharedMut, BLOCK_ROWS,
};
use super::fused::AttentionSpec;
use super::math::Act;
use super::node::node_n_owned;

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
        rows: n * s,
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
    /// The rows computed: the real tokens (see [`Packing`]).
    rows: usize,
}

impl Shape {
    fn rows(&self) -> usize {
        self.rows
    }
}

/// The rows a layer computes: each sequence's tokens up to its last unmasked one, packed
/// one after another (no work on padding: text-embeddings-inference's and ModernBERT's
/// unpadding). Padding rows take no part in the real rows' results (they are masked keys,
/// and no gradient reaches them), so the real rows are what they would be padded; the
/// layer's output is 0 at padding. Dropout masks are those of each element's place in the
/// padded `[n, s, h]` tensor, so packing changes no mask.
pub(crate) struct Packing {
    rows: Rows,
    /// The padded row of every packed row.
    padded: Vec<usize>,
    /// Every row is real: packed and padded are the same.
    identity: bool,
}

impl Packing {
    fn new<T: Float>(mask: &KeyMask<T>, n: usize, s: usize) -> Self {
        let lengths: Vec<usize> = (0..n).map(|b| mask.len(b)).collect();
        let padded = lengths
            .iter()
            .enumerate()
            .flat_map(|(b, &l)| (0..l).map(move |t| b * s + t))
            .collect::<Vec<_>>();
        Self {
            identity: padded.len() == n * s,
            rows: Rows::packed(&lengths),
            padded,
        }
    }

    fn total(&self) -> usize {
        self.padded.len()
    }

    /// The packed rows of `x` (`[n s, width]`).
    fn gather<'a, T: Float>(&self, x: &'a [T], width: usize) -> std::borrow::Cow<'a, [T]> {
        if self.identity {
            return std::borrow::Cow::Borrowed(x);
        }
        let mut out = Vec::with_capacity(self.total() * width);
        for &r in &self.padded {
            out.extend_from_slice(&x[r * width..(r + 1) * width]);
        }
        std::borrow::Cow::Owned(out)
    }

    /// The packed rows `y` put back at their padded places, 0 elsewhere.
    fn scatter<T: Float>(&self, y: Vec<T>, padded_rows: usize, width: usize) -> Vec<T> {
        if self.identity {
            return y;
        }
        let mut out = vec![T::zero(); padded_rows * width];
        for (row, &r) in y.chunks_exact(width).zip(&self.padded) {
            out[r * width..(r + 1) * width].copy_from_slice(row);
        }
        out
    }
}

/// A contiguous CPU tensor's values, read in place for as long as the view (its storage's
/// read lock) lives.
pub(crate) struct View<G> {
    guard: G,
    range: (usize, usize),
}

impl View<()> {
    #[allow(clippy::new_ret_no_self)]
    pub(crate) fn new(
        t: &Tensor,
    ) -> candle_core::Result<View<impl std::ops::Deref<Target = candle_core::Storage> + '_>> {
        let (guard, layout) = t.storage_and_layout();
        let range = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("encoder layer: a strided input".into()))?;
        Ok(View { guard, range })
    }
}

impl<G: std::ops::Deref<Target = candle_core::Storage>> View<G> {
    pub(crate) fn values<T: Float>(&self) -> candle_core::Result<&[T]> {
        match &*self.guard {
            candle_core::Storage::Cpu(s) => Ok(&s.as_slice::<T>()?[self.range.0..self.range.1]),
            _ => candle_core::bail!("encoder layer: a tensor off the CPU"),
        }
    }
}

/// The sixteen weights, detached and contiguous (views of the variables: no copy).
struct Weights([Tensor; 16]);

impl Weights {
    fn new(w: &LayerWeights) -> candle_core::Result<Self> {
        let all = w.all();
        let mut out = Vec::with_capacity(16);
        for t in all {
            out.push(t.detach().contiguous()?);
        }
        let out: [Tensor; 16] = out
            .try_into()
            .map_err(|_| candle_core::Error::Msg("encoder layer: sixteen weights".into()))?;
        Ok(Self(out))
    }

    /// Runs `f` on the weights' values.
    fn read<T: Float, R>(
        &self,
        f: impl FnOnce(&W<T>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let views = self
            .0
            .iter()
            .map(View::new)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let v = |i: usize| views[i].values::<T>();
        let w = W {
            wqkv: [v(0)?, v(1)?, v(2)?],
            bqkv: [v(3)?, v(4)?, v(5)?],
            wo: v(6)?,
            bo: v(7)?,
            n1: (v(8)?, v(9)?),
            wi: v(10)?,
            bi: v(11)?,
            wd: v(12)?,
            bd: v(13)?,
            n2: (v(14)?, v(15)?),
        };
        f(&w)
    }
}

/// The weights' values.
struct W<'a, T> {
    wqkv: [&'a [T]; 3],
    bqkv: [&'a [T]; 3],
    wo: &'a [T],
    bo: &'a [T],
    n1: (&'a [T], &'a [T]),
    wi: &'a [T],
    bi: &'a [T],
    wd: &'a [T],
    bd: &'a [T],
    n2: (&'a [T], &'a [T]),
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
    let xd = x.detach().contiguous()?;
    let weights = Weights::new(w)?;
    let bias = spec.attention.bias.contiguous()?;
    if bias.elem_count() != dims.n * dims.s {
        candle_core::bail!(
            "encoder layer: key mask {:?} does not fit {} sequences of {} tokens",
            bias.dims(),
            dims.n,
            dims.s
        );
    }
    let mask = KeyMask::new(View::new(&bias)?.values::<T>()?, dims.n, dims.s);
    let packing = Packing::new(&mask, dims.n, dims.s);
    let dims = Shape {
        rows: packing.total(),
        ..dims
    };
    let padded_rows = dims.n * dims.s;
    let (out, kept) = weights.read::<T, _>(|wv| {
        let xv = View::new(&xd)?;
        let xp = packing.gather(xv.values::<T>()?, dims.h);
        forward(&xp, wv, &mask, &packing, spec, dims, tracked)
    })?;
    let out = packing.scatter(out, padded_rows, dims.h);
    let shape = (dims.n, dims.s, dims.h);
    let Some(kept) = kept else {
        return Tensor::from_vec(out, shape, x.device());
    };
    let params: Vec<Tensor> = w.all().into_iter().cloned().collect();
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
            let grads = weights.read::<T, _>(|wv| {
                let (xv, dyv) = (View::new(&xd)?, View::new(&dy)?);
                let xp = packing.gather(xv.values::<T>()?, dims.h);
                let dyp = packing.gather(dyv.values::<T>()?, dims.h);
                backward(&xp, &dyp, wv, &mask, &packing, &spec, dims, &kept)
            })?;
            let dx = packing.scatter(grads.dx, padded_rows, dims.h);
            let mut out = vec![Some(Tensor::from_vec(
                dx,
                shape,
                &candle_core::Device::Cpu,
            )?)];
            let [dwq, dwk, dwv] = grads.dwqkv;
            let [dbq, dbk, dbv] = grads.dbqkv;
            let all = [
                dwq, dwk, dwv, dbq, dbk, dbv, grads.dwo, grads.dbo, grads.dg1, grads.db1,
                grads.dwi, grads.dbi, grads.dwd, grads.dbd, grads.dg2, grads.db2,
            ];
            // Into the open gradient sink, or to candle when none is open.
            for (param, g) in params.iter().zip(all) {
                out.push(crate::sink::deposit(param, g)?);
            }
            Ok(out)
        }),
    )
}

/// The gemm crate's parallelism for the layer's large products (candle's own choice).
fn parallelism() -> gemm::Parallelism {
    if in_serial() {
        return gemm::Parallelism::None;
    }
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// A matrix operand: its values, row stride and column stride.
type Operand<'a, T> = (&'a [T], usize, usize);

/// The index of the last element `rows x cols` with these strides reach.
fn last(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs
}

/// `dst [m, n] (+)= lhs [m, k] rhs [k, n]`, `dst` with row stride `dst_rs`; with
/// `accumulate` the product is added to what `dst` holds.
fn product<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [T], usize),
    accumulate: bool,
    lhs: Operand<T>,
    rhs: Operand<T>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst.len() > last(m, n, dst_rs, 1),
        "product: destination too small"
    );
    // SAFETY: `dst` covers the destination (checked), borrowed mutably.
    unsafe { product_raw((m, n, k), (dst.as_mut_ptr(), dst_rs), accumulate, lhs, rhs) }
}

/// `lhs [m, k] rhs [k, n]` into a new `[m, n]` buffer.
fn product_new<T: Float>(
    (m, n, k): (usize, usize, usize),
    lhs: Operand<T>,
    rhs: Operand<T>,
) -> Vec<T> {
    if k == 0 {
        return vec![T::zero(); m * n];
    }
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the product writes every element of the `m * n` it was given room for
    // (`accumulate` off, `k > 0`), before the length is set.
    unsafe {
        product_raw((m, n, k), (out.as_mut_ptr(), n), false, lhs, rhs);
        out.set_len(m * n);
    }
    out
}

/// The gemm call behind [`product`] and [`product_new`].
///
/// # Safety
/// `dst` addresses `m x n` elements with row stride `dst_rs`, overlapping no operand.
unsafe fn product_raw<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): Operand<T>,
    (rhs, rhs_rs, rhs_cs): Operand<T>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 {
        assert!(
            lhs.len() > last(m, k, lhs_rs, lhs_cs) && rhs.len() > last(k, n, rhs_rs, rhs_cs),
            "product: operand too small"
        );
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
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

/// Rows of `width` holding the biases side by side, `rows` times (the destination of
/// products that add to them).
fn bias_rows<T: Float>(biases: &[&[T]], rows: usize) -> Vec<T> {
    let width: usize = biases.iter().map(|b| b.len()).sum();
    let mut y = Vec::with_capacity(rows * width);
    for _ in 0..rows {
        for b in biases {
            y.extend_from_slice(b);
        }
    }
    y
}

/// `x [rows, k] W^T + b`, `W` `[out, k]`: the bias pre-filled, the product added to it.
fn linear<T: Float>(x: &[T], w: &[T], b: &[T], rows: usize, k: usize) -> Vec<T> {
    let out = b.len();
    let mut y = bias_rows(&[b], rows);
    product((rows, out, k), (&mut y, out), true, (x, k, 1), (w, 1, k));
    y
}

/// The packed `[rows, 3h]` queries, keys and values: `x W_p^T + b_p` side by side.
fn qkv<T: Float>(x: &[T], w: &W<T>, rows: usize, h: usize) -> Vec<T> {
    let mut y = bias_rows(&w.bqkv, rows);
    for (p, wp) in w.wqkv.iter().enumerate() {
        product(
            (rows, h, h),
            (&mut y[p * h..], 3 * h),
            true,
            (x, h, 1),
            (wp, 1, h),
        );
    }
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
/// Dropout masks are those of each element's place in the padded `[n s, h]` tensor
/// (`places[row]` the padded row of each row).
fn add_norm<T: Float>(
    a: &[T],
    r: &[T],
    dropout: Option<(u64, f32)>,
    (g, b): (&[T], &[T]),
    eps: f64,
    places: &[usize],
) -> (Vec<T>, Vec<T>) {
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
            let at = base + i * h;
            add_row(
                &a[at..at + h],
                &r[at..at + h],
                dropout,
                places[first + i] * h,
                srow,
            );
            norm_row(srow, g, b, eps, yrow);
        }
    });
    (sum, y)
}

/// `out = dropout(a) + r` for the elements from `start` on (of the masked tensor).
#[inline(always)]
fn add_row<T: Float>(a: &[T], r: &[T], dropout: Option<(u64, f32)>, start: usize, out: &mut [T]) {
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
pub(crate) fn norm_row<T: Float>(x: &[T], g: &[T], b: &[T], eps: f64, y: &mut [T]) {
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
        macro_rules! each {
            ($a:expr) => {
                for (o, &v) in chunk.iter_mut().zip(src) {
                    *o = $a.value(v);
                }
            };
        }
        match act {
            Act::GeluErf => each!(Act::GeluErf),
            Act::GeluTanh => each!(Act::GeluTanh),
            Act::Relu => each!(Act::Relu),
        }
    });
    g
}

/// `act(u)` over `u` itself.
fn activate_in_place<T: Float>(u: &mut [T], act: Act, width: usize) {
    for_blocks(u, width, |_, chunk| {
        macro_rules! each {
            ($a:expr) => {
                for v in chunk.iter_mut() {
                    *v = $a.value(*v);
                }
            };
        }
        match act {
            Act::GeluErf => each!(Act::GeluErf),
            Act::GeluTanh => each!(Act::GeluTanh),
            Act::Relu => each!(Act::Relu),
        }
    });
}

/// `act(u)` and `act'(u)` element by element, in one pass (one exponential each).
fn activate_with_slope<T: Float>(u: &[T], act: Act, width: usize) -> (Vec<T>, Vec<T>) {
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
        }
    });
    (g, slope)
}

/// In place, `dy` becomes `dy * slope`; returns its column sums (the bias gradient).
fn times_slope<T: Float>(slope: &[T], dy: &mut [T], width: usize) -> Vec<T> {
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

/// Column sums of `[rows, width]` (a bias gradient), in a fixed order.
fn column_sums<T: Float>(x: &[T], width: usize) -> Vec<T> {
    let rows = x.len() / width.max(1);
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let mut partials = vec![T::zero(); blocks * width];
    let shared = SharedMut(partials.as_mut_ptr());
    parallel_ranges(blocks, |range| {
        for blk in range {
            // SAFETY: block `blk` owns partials `blk * width .. (blk + 1) * width`.
            let acc =
                unsafe { std::slice::from_raw_parts_mut(shared.get().add(blk * width), width) };
            let end = rows.min((blk + 1) * BLOCK_ROWS);
            for row in x[blk * BLOCK_ROWS * width..end * width].chunks_exact(width) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
        }
    });
    sum_partials(&partials, width)
}

/// The feed-forward half from `y1`: `u`, and the output `o = act(u) W_d^T + b_d`.
fn feed_forward<T: Float>(y1: &[T], w: &W<T>, spec: &LayerSpec, dims: Shape) -> (Vec<T>, Vec<T>) {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    let u = linear(y1, w.wi, w.bi, rows, h);
    let g = activate(&u, spec.act, i);
    let o = linear(&g, w.wd, w.bd, rows, i);
    (u, o)
}

/// The output of [`feed_forward`] alone, for a forward that does not keep `u`
/// (inference, or the `intermediate` site recomputed): the activation overwrites `u` in
/// place, so the layer's largest buffer (`[rows, I]`) exists once, not twice.
fn feed_forward_output<T: Float>(y1: &[T], w: &W<T>, spec: &LayerSpec, dims: Shape) -> Vec<T> {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    let mut u = linear(y1, w.wi, w.bi, rows, h);
    activate_in_place(&mut u, spec.act, i);
    linear(&u, w.wd, w.bd, rows, i)
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
fn forward<T: Float>(
    x: &[T],
    w: &W<T>,
    mask: &KeyMask<T>,
    packing: &Packing,
    spec: &LayerSpec,
    dims: Shape,
    keep: bool,
) -> candle_core::Result<(Vec<T>, Option<Kept<T>>)> {
    let (rows, h) = (dims.rows(), dims.h);
    let places = &packing.padded;
    let qkv = qkv(x, w, rows, h);
    let (ctx, probs) = attend(&qkv, mask, &packing.rows, spec, dims, keep);
    let qkv = keep.then_some(qkv);
    let a = linear(&ctx, w.wo, w.bo, rows, h);
    let ctx = keep.then_some(ctx);
    let (sum1, y1) = add_norm(&a, x, spec.attention_output_dropout, w.n1, spec.eps, places);
    drop(a);
    let (u, o) = if keep && !spec.recompute_intermediate {
        let (u, o) = feed_forward(&y1, w, spec, dims);
        (Some(u), o)
    } else {
        (None, feed_forward_output(&y1, w, spec, dims))
    };
    let (sum2, y) = add_norm(&o, &y1, spec.output_dropout, w.n2, spec.eps, places);
    let kept = qkv.zip(ctx).map(|(qkv, ctx)| Kept {
        qkv,
        probs,
        ctx,
        sum1: (!spec.recompute_attention_norm).then_some(sum1),
        u,
        sum2: (!spec.recompute_output_norm).then_some(sum2),
    });
    Ok((y, kept))
}

/// The attention of the packed `qkv`: the context `[rows, h]` and, when `keep` and the
/// probabilities are not recomputed, the probabilities.
fn attend<T: Float>(
    qkv: &[T],
    mask: &KeyMask<T>,
    rows: &Rows,
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
    let packed = |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let p = qkv.as_ptr();
    // SAFETY: qkv is a [rows, 3h] buffer, ctx a [rows, h] one.
    let probs = unsafe {
        kernel::forward(
            (kdims, rows),
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            (ctx.as_mut_ptr(), HeadLayout::in_rows(h, d, 0)),
            keep && !spec.attention.recompute,
        )
    };
    (ctx, probs)
}

/// Every gradient of the layer.
struct Grads<T> {
    dx: Vec<T>,
    dwqkv: [Vec<T>; 3],
    dbqkv: [Vec<T>; 3],
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
#[allow(clippy::too_many_arguments)]
fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    w: &W<T>,
    mask: &KeyMask<T>,
    packing: &Packing,
    spec: &LayerSpec,
    dims: Shape,
    kept: &Kept<T>,
) -> candle_core::Result<Grads<T>> {
    use std::borrow::Cow;
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    let places = &packing.padded;
    // What the forward did not keep, recomputed with its own arithmetic.
    let sum1 = match &kept.sum1 {
        Some(s) => Cow::Borrowed(s.as_slice()),
        None => {
            let a = linear(&kept.ctx, w.wo, w.bo, rows, h);
            Cow::Owned(add_norm(&a, x, spec.attention_output_dropout, w.n1, spec.eps, places).0)
        }
    };
    let y1 = norm(&sum1, w.n1, spec.eps);
    let (u, sum2) = match (&kept.u, &kept.sum2) {
        (Some(u), Some(s)) => (Cow::Borrowed(u.as_slice()), Cow::Borrowed(s.as_slice())),
        (u_kept, sum_kept) => {
            let (u, o) = feed_forward(&y1, w, spec, dims);
            let sum2 = match sum_kept {
                Some(s) => Cow::Borrowed(s.as_slice()),
                None => {
                    Cow::Owned(add_norm(&o, &y1, spec.output_dropout, w.n2, spec.eps, places).0)
                }
            };
            let u = match u_kept {
                Some(u) => Cow::Borrowed(u.as_slice()),
                None => Cow::Owned(u),
            };
            (u, sum2)
        }
    };
    // Second LayerNorm; its sum's gradient is also the residual gradient of y1.
    let (dsum2, dg2, db2) = norm_backward(&sum2, w.n2.0, dy, spec.eps);
    drop(sum2);
    let d_o = dropped(&dsum2, spec.output_dropout, h, Some(places));
    let dbd = column_sums(&d_o, h);
    let (g, slope) = activate_with_slope(&u, spec.act, i);
    drop(u);
    // dW_d [h, I] = d_o^T g ; dg [rows, I] = d_o W_d
    let dwd = product_new((h, i, rows), (&d_o, 1, h), (&g, i, 1));
    drop(g);
    let mut du = product_new((rows, i, h), (&d_o, h, 1), (w.wd, i, 1));
    drop(d_o);
    let dbi = times_slope(&slope, &mut du, i);
    drop(slope);
    // dW_i [I, h] = du^T y1 ; dy1 = dsum2 + du W_i
    let dwi = product_new((i, h, rows), (&du, 1, i), (&y1, h, 1));
    drop(y1);
    let mut dy1 = dsum2;
    product((rows, h, i), (&mut dy1, h), true, (&du, i, 1), (w.wi, h, 1));
    drop(du);
    // First LayerNorm.
    let (dsum1, dg1, db1) = norm_backward(&sum1, w.n1.0, &dy1, spec.eps);
    drop((sum1, dy1));
    let d_a = dropped(&dsum1, spec.attention_output_dropout, h, Some(places));
    let dbo = column_sums(&d_a, h);
    let dwo = product_new((h, h, rows), (&d_a, 1, h), (&kept.ctx, h, 1));
    let dctx = product_new((rows, h, h), (&d_a, h, 1), (w.wo, h, 1));
    drop(d_a);
    // Attention.
    let dqkv = attention_backward(
        &kept.qkv,
        kept.probs.as_deref(),
        &dctx,
        (mask, &packing.rows),
        spec,
        dims,
    );
    drop(dctx);
    let sums = column_sums(&dqkv, 3 * h);
    let dbqkv = [0, 1, 2].map(|p| sums[p * h..(p + 1) * h].to_vec());
    // dW_p [h, h] = dqkv_p^T x ; dx = dsum1 + sum_p dqkv_p W_p
    let dwqkv = [0, 1, 2].map(|p| product_new((h, h, rows), (&dqkv[p * h..], 1, 3 * h), (x, h, 1)));
    let mut dx = dsum1;
    for (p, wp) in w.wqkv.iter().enumerate() {
        product(
            (rows, h, h),
            (&mut dx, h),
            true,
            (&dqkv[p * h..], 3 * h, 1),
            (wp, h, 1),
        );
    }
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
}

/// `dqkv` `[rows, 3h]` from `dctx` `[rows, h]`.
fn attention_backward<T: Float>(
    qkv: &[T],
    probs: Option<&[T]>,
    dctx: &[T],
    (mask, rows): (&KeyMask<T>, &Rows),
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
    let packed = |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let (p, g) = (qkv.as_ptr(), dqkv.as_mut_ptr());
    // SAFETY: qkv and dqkv are [rows, 3h] buffers (the three gradients in disjoint
    // columns), dctx a [rows, h] one.
    unsafe {
        kernel::backward(
            (kdims, rows),
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            probs,
            (dctx.as_ptr(), HeadLayout::in_rows(h, d, 0)),
            (g, packed(0)),
            (g, packed(1)),
            (g, packed(2)),
        );
    }
    dqkv
}
