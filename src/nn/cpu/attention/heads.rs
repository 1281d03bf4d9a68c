//! Scaled dot-product attention for small heads on the CPU: one task per (sequence, head).
//!
//! BERT-family encoders have heads of 32 to 64 dimensions over a few hundred tokens at
//! most. Run as batched tensor products, such attention is a string of passes over
//! `[n, heads, s, s]` tensors (the scores, the probabilities, their dropout, the split of
//! the heads and their merge, each a copy), each a tiny matrix product or a thread-pool
//! dispatch. Here each task takes one head of one sequence through everything while its
//! `s x L` block stays in cache:
//!
//! - `S = Q K^T`, `L` the sequence's key length: keys after its last real token (the
//!   padding) are never computed, and a masked key inside gets probability exactly 0 (a
//!   key is masked when its additive bias is `-10000` or below, BERT's convention);
//! - the softmax row by row, with reductions over eight lanes (vectorised, in a fixed
//!   order) and probabilities below `f32::MIN_POSITIVE` flushed to 0, so no subnormal
//!   float leaves it ([`crate::denormal`]);
//! - dropout on the probabilities, its mask regenerated from its seed at each element's
//!   place in the batch's `[n, heads, s, s]` probabilities ([`crate::rng::keep`]), so it
//!   agrees bit for bit with the composed mask;
//! - `context = P V`, written straight into the merged-heads layout.
//!
//! The inputs and outputs are read and written where they lie (a [`HeadLayout`] says
//! where): the packed `[n s, 3h]` output of the query-key-value projection, or separate
//! `[n, heads, s, d]` tensors. The products are the gemm crate's, single-threaded inside a
//! task (the tasks are the parallelism).
//!
//! The backward of one task: `dV = P_d^T dC`, `dP_d = dC V^T`, the dropout mask,
//! `dS = scale P (dP - rowsum(dP P))`, `dQ = dS K`, `dK = dS^T Q`, all into the
//! gradient's own layout. It takes the probabilities kept by the forward (compact:
//! `heads * s * L` per sequence) or recomputes them from `Q` and `K` with the same
//! arithmetic, bit for bit (selective recompute keeps nothing of size `s x s`).

pub use crate::nn::cpu::attention::layout::{
    Dims, HeadLayout, KeyMask, Rows, MASKED_BIAS, UNATTENDED_BIAS,
};
use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{parallel_ranges, Float, SharedConst, SharedMut};
use crate::nn::cpu::elementwise::math::exp;

/// Sum over eight lanes, combined in a fixed order (vectorised; deterministic).
#[inline(always)]
pub(crate) fn lane_sum<T: Float>(xs: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            acc[k] += c[k];
        }
    }
    for (k, &v) in chunks.remainder().iter().enumerate() {
        acc[k] += v;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `sum(a * b)` over eight lanes (see [`lane_sum`]).
#[inline(always)]
pub(crate) fn lane_dot<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    for (k, (&x, &y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[k] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// The largest of `xs` over eight lanes (`-inf` for none).
#[inline(always)]
fn lane_max<T: Float>(xs: &[T]) -> T {
    let mut acc = [T::neg_infinity(); 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            // A select the compiler vectorises (`max` keeps NaN semantics it cannot).
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    for (k, &v) in chunks.remainder().iter().enumerate() {
        acc[k] = if v > acc[k] { v } else { acc[k] };
    }
    let m = |a: T, b: T| if b > a { b } else { a };
    m(
        m(m(acc[0], acc[4]), m(acc[1], acc[5])),
        m(m(acc[2], acc[6]), m(acc[3], acc[7])),
    )
}

/// `softmax(scale * row + bias)` in place over one row of `L` keys; masked keys (with
/// `masking`) get exactly 0, and so does any probability below the normal range.
#[inline(always)]
pub fn softmax_row<T: Float>(row: &mut [T], bias: &[T], scale: T, masking: bool) {
    softmax_shift(row, bias, scale, masking);
    for v in row.iter_mut() {
        *v = exp(*v);
    }
    softmax_normalise(row);
}

/// [`softmax_row`] over every row of `p` (rows of `l`), the same bits: `shift(i, row)`
/// brings row `i` to `scale * row + bias - max` (a fill of its own, then
/// [`softmax_shift`]), then one exponential pass runs over the whole block, then each row
/// is normalised. Rows of a few dozen keys so take their exponentials in full vectors,
/// where row by row each left a scalar tail (1.7 -> 1.0 us for a 37 x 37 block).
#[inline(always)]
pub fn softmax_rows<T: Float>(p: &mut [T], l: usize, mut shift: impl FnMut(usize, &mut [T])) {
    if l == 0 {
        return;
    }
    for (i, row) in p.chunks_exact_mut(l).enumerate() {
        shift(i, row);
    }
    for v in p.iter_mut() {
        *v = exp(*v);
    }
    for row in p.chunks_exact_mut(l) {
        softmax_normalise(row);
    }
}

/// The first half of [`softmax_row`]: `scale * row + bias` (masked keys `-inf`), less
/// its largest value.
#[inline(always)]
pub fn softmax_shift<T: Float>(row: &mut [T], bias: &[T], scale: T, masking: bool) {
    let masked = T::of(MASKED_BIAS);
    let bias = &bias[..row.len()];
    if masking {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v = if b <= masked {
                T::neg_infinity()
            } else {
                *v * scale + b
            };
        }
    } else {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v = *v * scale + b;
        }
    }
    let max = lane_max(row);
    for v in row.iter_mut() {
        *v -= max;
    }
}

/// The last half of [`softmax_row`]: the exponentials divided by their sum, any
/// probability below the normal range flushed to 0.
#[inline(always)]
fn softmax_normalise<T: Float>(row: &mut [T]) {
    let inv = T::one() / lane_sum(row);
    let tiny = T::of(f64::from(f32::MIN_POSITIVE));
    for v in row.iter_mut() {
        let p = *v * inv;
        *v = if p < tiny { T::zero() } else { p };
    }
}

/// `dst [m, n] = lhs [m, k] * rhs [k, n]`, strided, single-threaded (the gemm crate).
///
/// # Safety
/// As [`gemm_into`].
#[allow(clippy::too_many_arguments)]
unsafe fn matmul<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    lhs: *const T,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const T,
    (rhs_rs, rhs_cs): (usize, usize),
) {
    gemm_into(
        (m, n, k),
        (dst, dst_rs),
        false,
        (lhs, lhs_rs, lhs_cs),
        (rhs, rhs_rs, rhs_cs),
    );
}

/// `dst [m, n] (+)= lhs [m, k] rhs [k, n]` (with `accumulate` added to what `dst` holds),
/// operands as (pointer, row stride, column stride), single-threaded (the gemm crate):
/// the attention kernels' products, one task's at a time.
///
/// # Safety
/// Every pointer must address the elements its strides reach; `dst`'s must not overlap
/// the inputs' or another thread's.
pub(in crate::nn) unsafe fn gemm_into<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (*const T, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const T, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst.add(i * dst_rs), 0, n);
            }
        }
        return;
    }
    crate::nn::cpu::products::gemm::gemm_call(
        (m, n, k),
        (dst, dst_rs),
        accumulate,
        (lhs, lhs_rs, lhs_cs),
        (rhs, rhs_rs, rhs_cs),
        gemm::Parallelism::None,
    );
}

/// What the attention computes besides its inputs.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Multiplies the scores before the bias is added.
    pub scale: f64,
    /// Dropout on the probabilities: `(mask seed, drop probability)`.
    pub dropout: Option<(u64, f32)>,
    /// A sliding window: query `i` attends to keys `j` with `|i - j| <= w` only.
    pub window: Option<usize>,
}

impl Params {
    fn dropout(&self) -> Option<(u64, f32)> {
        self.dropout.filter(|&(_, p)| p > 0.0)
    }
}

/// Runs `f(task, scratch)` for tasks `0..count` on candle's CPU thread pool, each worker
/// with a scratch buffer of `scratch` elements of its own.
pub(in crate::nn) fn for_tasks<T: Float>(
    count: usize,
    scratch: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    parallel_ranges(count, |range| {
        let mut buf = vec![T::zero(); scratch];
        for task in range {
            f(task, &mut buf);
        }
    });
}

/// The probabilities of head `h` of sequence `b` into `p` (`s x L`, row-major): scores,
/// softmax; no dropout.
///
/// # Safety
/// `q` and `k` address their layouts for `dims`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn probabilities<T: Float>(
    (dims, rows): (Dims, &Rows),
    params: &Params,
    mask: &KeyMask<T>,
    (b, h): (usize, usize),
    q: (*const T, HeadLayout),
    k: (*const T, HeadLayout),
    p: &mut [T],
) {
    let (s, d, l) = (dims.s, dims.d, mask.len(b));
    matmul(
        (rows.queries[b], l, d),
        p.as_mut_ptr(),
        l,
        q.0.add(q.1.at(rows, b, h)),
        (q.1.row, 1),
        k.0.add(k.1.at(rows, b, h)),
        (1, k.1.row),
    );
    let bias = &mask.bias[b * s..(b + 1) * s];
    let mut scale = T::of(params.scale);
    if let Some(scores) = &mask.scores {
        // The scores scaled here, the per-head bias added; the softmax then scales by 1.
        for (i, row) in p.chunks_exact_mut(l).enumerate() {
            let at = mask.scores_at(b) + (h * s + i) * s;
            for (v, &c) in row.iter_mut().zip(&scores[at..at + l]) {
                *v = *v * scale + c;
            }
        }
        scale = T::one();
    }
    softmax_rows(p, l, |i, row| {
        if let Some(w) = params.window {
            // Keys outside the window get -inf (probability exactly 0). A row whose window
            // holds no computed key (a padding query far past the last real key) keeps
            // the key mask alone, so it stays finite.
            let (lo, hi) = (i.saturating_sub(w), (i + w + 1).min(l));
            if lo < hi {
                row[..lo].fill(T::neg_infinity());
                row[hi..].fill(T::neg_infinity());
            }
        }
        softmax_shift(row, bias, scale, mask.masking[b]);
    });
}

/// Applies the dropout mask of head `h` of sequence `b` to its `s x L` block `x` (rows of
/// the batch's `[n, heads, s, s]` probabilities), in place.
#[inline(always)]
fn dropout_block<T: Float>(
    dims: Dims,
    (seed, p): (u64, f32),
    (b, h): (usize, usize),
    l: usize,
    x: &mut [T],
) {
    let keep_scale = T::of(1.0 / (1.0 - f64::from(p)));
    let s = dims.s;
    let first = ((b * dims.heads + h) * s) as u64;
    for (i, row) in x.chunks_exact_mut(l).enumerate() {
        let start = (first + i as u64) * s as u64;
        crate::rng::keep_run(seed, start, l, p, |j, kept| {
            // A product with the mask value, as the composed form computes it.
            row[j] *= if kept { keep_scale } else { T::zero() };
        });
    }
}

wide_fn! {
/// The forward pass: `context = dropout(softmax(scale q k^T + bias)) v` into `out`, and,
/// with `keep`, the probabilities before dropout for the backward (compact; see
/// [`KeyMask`]).
///
/// # Safety
/// Every pointer addresses its layout for `dims`; `out` is written at every element of its
/// layout and overlaps nothing else.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward<T: Float>(
    (dims, rows): (Dims, &Rows),
    params: &Params,
    mask: &KeyMask<T>,
    q: (*const T, HeadLayout),
    k: (*const T, HeadLayout),
    v: (*const T, HeadLayout),
    out: (*mut T, HeadLayout),
    keep: bool,
) -> Option<Vec<T>> {
    let (s, d) = (dims.s, dims.d);
    let mut kept = keep.then(|| vec![T::zero(); mask.kept_len(dims, rows)]);
    let offsets = mask.kept_offsets(dims, rows);
    let kept_ptr = kept.as_mut().map(|k| SharedMut(k.as_mut_ptr()));
    let (q, k, v) = (
        (SharedConst(q.0), q.1),
        (SharedConst(k.0), k.1),
        (SharedConst(v.0), v.1),
    );
    let out = (SharedMut(out.0), out.1);
    let dropout = params.dropout();
    // Probabilities (unless kept) and the dropped ones.
    let scratch = 2 * s * s;
    for_tasks::<T>(dims.n * dims.heads, scratch, |task, buf| {
        let (b, h) = (task / dims.heads, task % dims.heads);
        let (l, nq) = (mask.len(b), rows.queries[b]);
        let (own, rest) = buf.split_at_mut(s * s);
        let p: &mut [T] = match kept_ptr {
            // SAFETY: task (b, h) owns its block of the kept probabilities.
            Some(ptr) => {
                std::slice::from_raw_parts_mut(ptr.get().add(offsets[b] + h * nq * l), nq * l)
            }
            None => &mut own[..nq * l],
        };
        probabilities(
            (dims, rows),
            params,
            mask,
            (b, h),
            (q.0.get(), q.1),
            (k.0.get(), k.1),
            p,
        );
        let pd: &[T] = match dropout {
            Some(drop) => {
                let pd = &mut rest[..nq * l];
                pd.copy_from_slice(p);
                dropout_block(dims, drop, (b, h), l, pd);
                pd
            }
            None => p,
        };
        matmul(
            (nq, d, l),
            out.0.get().add(out.1.at(rows, b, h)),
            out.1.row,
            pd.as_ptr(),
            (l, 1),
            v.0.get().add(v.1.at(rows, b, h)),
            (v.1.row, 1),
        );
    });
    kept
}
}

wide_fn! {
/// The backward pass from `dctx` into `dq`, `dk`, `dv`: with `kept` the forward's
/// probabilities, else recomputed. Rows of `dk` and `dv` past a sequence's key length
/// are not written (their gradient is 0: the caller's buffers start at zero). With
/// `dscores`, a `[n, heads, s, s]` buffer of zeros, the gradient of each sequence's
/// scores after scaling (that of the mask's per-head score bias, before its sum over the
/// sequences) is written into it, likewise only where computed.
///
/// # Safety
/// Every pointer addresses its layout for `dims`; the gradients overlap nothing else and
/// one another only in disjoint columns.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward<T: Float>(
    (dims, rows): (Dims, &Rows),
    params: &Params,
    mask: &KeyMask<T>,
    q: (*const T, HeadLayout),
    k: (*const T, HeadLayout),
    v: (*const T, HeadLayout),
    kept: Option<&[T]>,
    dctx: (*const T, HeadLayout),
    dq: (*mut T, HeadLayout),
    dk: (*mut T, HeadLayout),
    dv: (*mut T, HeadLayout),
    dscores: Option<*mut T>,
) {
    let (s, d) = (dims.s, dims.d);
    let dscores = dscores.map(SharedMut);
    let offsets = mask.kept_offsets(dims, rows);
    let kept = kept.map(|k| SharedConst(k.as_ptr()));
    let (q, k, v, dctx) = (
        (SharedConst(q.0), q.1),
        (SharedConst(k.0), k.1),
        (SharedConst(v.0), v.1),
        (SharedConst(dctx.0), dctx.1),
    );
    let (dq, dk, dv) = (
        (SharedMut(dq.0), dq.1),
        (SharedMut(dk.0), dk.1),
        (SharedMut(dv.0), dv.1),
    );
    let dropout = params.dropout();
    let scale = T::of(params.scale);
    for_tasks::<T>(dims.n * dims.heads, 3 * s * s, |task, buf| {
        let (b, h) = (task / dims.heads, task % dims.heads);
        let (l, nq) = (mask.len(b), rows.queries[b]);
        let (own, rest) = buf.split_at_mut(s * s);
        let (pd_buf, dp_buf) = rest.split_at_mut(s * s);
        let p: &[T] = match kept {
            // SAFETY: the forward wrote this block.
            Some(ptr) => std::slice::from_raw_parts(ptr.get().add(offsets[b] + h * nq * l), nq * l),
            None => {
                let p = &mut own[..nq * l];
                probabilities(
                    (dims, rows),
                    params,
                    mask,
                    (b, h),
                    (q.0.get(), q.1),
                    (k.0.get(), k.1),
                    p,
                );
                p
            }
        };
        let pd: &[T] = match dropout {
            Some(drop) => {
                let pd = &mut pd_buf[..nq * l];
                pd.copy_from_slice(p);
                dropout_block(dims, drop, (b, h), l, pd);
                pd
            }
            None => p,
        };
        let dc = dctx.0.get().add(dctx.1.at(rows, b, h));
        // dV [L, d] = P_d^T [L, q] dC [q, d]
        matmul(
            (l, d, nq),
            dv.0.get().add(dv.1.at(rows, b, h)),
            dv.1.row,
            pd.as_ptr(),
            (1, l),
            dc,
            (dctx.1.row, 1),
        );
        // dP_d [q, L] = dC [q, d] V^T [d, L]
        let dp = &mut dp_buf[..nq * l];
        matmul(
            (nq, l, d),
            dp.as_mut_ptr(),
            l,
            dc,
            (dctx.1.row, 1),
            v.0.get().add(v.1.at(rows, b, h)),
            (1, v.1.row),
        );
        if let Some(drop) = dropout {
            dropout_block(dims, drop, (b, h), l, dp);
        }
        // dS = scale P (dP - rowsum(dP P)), in place of dP.
        match dscores {
            None => {
                for (dr, pr) in dp.chunks_exact_mut(l).zip(p.chunks_exact(l)) {
                    let dot = lane_dot(dr, pr);
                    for (g, &pv) in dr.iter_mut().zip(pr) {
                        *g = scale * pv * (*g - dot);
                    }
                }
            }
            Some(ptr) => {
                // SAFETY: task (b, h) owns its s x s block of the buffer.
                let block = ptr.get().add((b * dims.heads + h) * s * s);
                for (i, (dr, pr)) in dp.chunks_exact_mut(l).zip(p.chunks_exact(l)).enumerate() {
                    let dot = lane_dot(dr, pr);
                    let out = std::slice::from_raw_parts_mut(block.add(i * s), l);
                    for ((g, &pv), o) in dr.iter_mut().zip(pr).zip(out) {
                        let t = pv * (*g - dot);
                        *o = t;
                        *g = scale * t;
                    }
                }
            }
        }
        // dQ [q, d] = dS [q, L] K [L, d]
        matmul(
            (nq, d, l),
            dq.0.get().add(dq.1.at(rows, b, h)),
            dq.1.row,
            dp.as_ptr(),
            (l, 1),
            k.0.get().add(k.1.at(rows, b, h)),
            (k.1.row, 1),
        );
        // dK [L, d] = dS^T [L, q] Q [q, d]
        matmul(
            (l, d, nq),
            dk.0.get().add(dk.1.at(rows, b, h)),
            dk.1.row,
            dp.as_ptr(),
            (1, l),
            q.0.get().add(q.1.at(rows, b, h)),
            (q.1.row, 1),
        );
    });
}
}
