//! The arithmetic of the decoder layer node ([`crate::nn::cpu::layers::decoder_layer`]) on its
//! packed rows: the forward pass and what it keeps, the backward pass with every gradient, written
//! out op by op in the order the formulas of the node's documentation give.

use std::borrow::Cow;

use crate::nn::cpu::attention::grouped::Grouped;
use crate::nn::cpu::attention::grouped::{self as grouped, Sequences};
use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{for_blocks, Float, BLOCK_ROWS};
use crate::nn::cpu::elementwise::gated::{glu_rows, glu_rows_backward, rotate_head};
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::elementwise::rows::{rms, rms_backward, rms_heads, rms_heads_backward};
use crate::nn::cpu::layers::packing::Packing;
use crate::nn::cpu::products::gemm::{bias_rows, column_sums, product, product_new};
use crate::nn::cpu::products::lora_branch::{AdapterGrads, Branches};
use crate::nn::cpu::products::transposed::weight_rhs;
use crate::nn::cpu::products::weight_products::{linear, weight_product};

/// The layer's adapters (in the order of
/// [`crate::nn::cpu::layers::decoder_layer::DecoderWeights::lora`]), the transposed copies of its
/// projections, and which slots take a gradient (a frozen weight's is not computed).
pub(in crate::nn) struct Adapters<'a, T> {
    pub(in crate::nn) branches: Branches<'a, T, 7>,
    /// Copies `[in, out]` of the projections' weights, in the same order, where an
    /// inference keeps them ([`crate::nn::cpu::products::transposed`]): the forward's products
    /// read these.
    pub(in crate::nn) copies: [Option<&'a [T]>; 7],
    pub(in crate::nn) wants: [bool; SLOTS],
}

/// Indices into [`Adapters::branches`] and [`Adapters::copies`].
pub(in crate::nn) mod lora {
    use super::slot;
    pub const Q: usize = 0;
    pub const K: usize = 1;
    pub const V: usize = 2;
    pub const O: usize = 3;
    pub const GATE: usize = 4;
    pub const UP: usize = 5;
    pub const DOWN: usize = 6;
    /// The projections' weights among the slots, in that order.
    pub const WEIGHT: [usize; 7] = [
        slot::WQ,
        slot::WK,
        slot::WV,
        slot::WO,
        slot::WG,
        slot::WU,
        slot::WD,
    ];
}

/// Slots of the weights, in node-input order.
pub(in crate::nn) const SLOTS: usize = 20;
pub(in crate::nn) mod slot {
    pub const IN_NORM: usize = 0;
    pub const WQ: usize = 1;
    pub const WK: usize = 3;
    pub const WV: usize = 5;
    pub const WO: usize = 7;
    pub const Q_NORM: usize = 9;
    pub const K_NORM: usize = 10;
    pub const POST_ATTN: usize = 11;
    pub const MLP_NORM: usize = 12;
    pub const WG: usize = 13;
    pub const WU: usize = 15;
    pub const WD: usize = 17;
    pub const POST_MLP: usize = 19;
}

/// The sizes of a layer applied to a batch.
#[derive(Debug, Clone, Copy)]
pub(in crate::nn) struct Shape {
    pub(in crate::nn) n: usize,
    pub(in crate::nn) s: usize,
    pub(in crate::nn) h: usize,
    pub(in crate::nn) inter: usize,
    pub(in crate::nn) grouped: Grouped,
}

impl Shape {
    /// Query width `heads d`.
    pub(in crate::nn) fn qd(&self) -> usize {
        self.grouped.heads * self.grouped.d
    }

    /// Key (and value) width `kv_heads d`.
    pub(in crate::nn) fn kd(&self) -> usize {
        self.grouped.kv_heads * self.grouped.d
    }

    /// The length of each slot's values.
    pub(in crate::nn) fn slot_len(&self, slot: usize) -> usize {
        let (h, i, qd, kd, d) = (self.h, self.inter, self.qd(), self.kd(), self.grouped.d);
        [
            h,
            qd * h,
            qd,
            kd * h,
            kd,
            kd * h,
            kd,
            h * qd,
            h,
            d,
            d,
            h,
            h,
            i * h,
            i,
            i * h,
            i,
            h * i,
            h,
            h,
        ][slot]
    }
}

/// What the forward keeps for the backward.
pub(in crate::nn) struct Kept<T> {
    /// The projections before the q/k norms and rotation.
    qkv: Vec<T>,
    probs: Option<Vec<T>>,
    ctx: Vec<T>,
    /// Gemma: the attention output under its norm.
    a: Option<Vec<T>>,
    x1: Vec<T>,
    up: Vec<T>,
    /// Gemma: the feed-forward output under its norm.
    m: Option<Vec<T>>,
}

/// The packed rows' layout and the per-row constants of a chunk.
pub(in crate::nn) struct Chunk<T> {
    pub(in crate::nn) seqs: Sequences,
    /// Each packed row's place among its text's real tokens (its rotary position).
    pub(in crate::nn) positions: Vec<usize>,
    pub(in crate::nn) cos: Vec<T>,
    pub(in crate::nn) sin: Vec<T>,
    pub(in crate::nn) params: grouped::Params,
    /// Which norms the layer has: q/k norms, Gemma's post norms.
    pub(in crate::nn) qk_norm: bool,
    pub(in crate::nn) post_norms: bool,
    /// The gate's activation, the norms' epsilon and weight offset (Gemma's 1), and
    /// whether the probabilities are recomputed in the backward.
    pub(in crate::nn) act: Act,
    pub(in crate::nn) eps: f64,
    pub(in crate::nn) offset: f64,
    pub(in crate::nn) recompute_probs: bool,
    /// The rows whose output is wanted, when not every row's: each text's last (pooled)
    /// row, in text order. The queries, the attention output and the feed-forward then
    /// run on those rows alone (every row is still a key and a value), and the other rows
    /// pass their input through.
    pub(in crate::nn) pooled: Option<Vec<usize>>,
}

impl<T: Float> Chunk<T> {
    /// The padded places (dropout-mask rows) of the [`Self::wanted`] rows.
    fn wanted_places<'a>(&self, padded: &'a [usize]) -> Cow<'a, [usize]> {
        match &self.pooled {
            None => Cow::Borrowed(padded),
            Some(rows) => Cow::Owned(rows.iter().map(|&r| padded[r]).collect()),
        }
    }

    /// The rows of `t` (rows of `width`) whose output is wanted: all of them, or the
    /// pooled ones gathered.
    fn wanted<'a>(&self, t: &'a [T], width: usize) -> Cow<'a, [T]> {
        match &self.pooled {
            None => Cow::Borrowed(t),
            Some(rows) => Cow::Owned(
                rows.iter()
                    .flat_map(|&r| t[r * width..(r + 1) * width].iter().copied())
                    .collect(),
            ),
        }
    }

    /// `wanted` (the [`Self::wanted`] rows) put back at their rows of `base` (`rows` rows
    /// of `width`): `wanted` itself when every row is wanted.
    fn put_back(&self, wanted: Vec<T>, base: impl FnOnce() -> Vec<T>, width: usize) -> Vec<T> {
        match &self.pooled {
            None => wanted,
            Some(rows) => {
                let mut full = base();
                for (&r, row) in rows.iter().zip(wanted.chunks_exact(width)) {
                    full[r * width..(r + 1) * width].copy_from_slice(row);
                }
                full
            }
        }
    }
}

/// The query-key-value projections of the packed rows `n1` `[rows, h]`, side by side in
/// one `[rows, (heads + 2 kv_heads) d]` buffer, biases pre-filled (and the adapters'
/// branches, `places` the rows' padded places).
fn project<T: Float>(
    n1: &[T],
    (w, ad): (&[&[T]; SLOTS], &Adapters<T>),
    dims: Shape,
    places: &[usize],
) -> Vec<T> {
    let (h, qd, kd) = (dims.h, dims.qd(), dims.kd());
    let rows = places.len();
    let width = dims.grouped.width();
    let mut qkv = bias_rows(&[w[slot::WQ + 1], w[slot::WK + 1], w[slot::WV + 1]], rows);
    for (col, (wp, out), p) in [
        (0, (w[slot::WQ], qd), lora::Q),
        (qd, (w[slot::WK], kd), lora::K),
        (qd + kd, (w[slot::WV], kd), lora::V),
    ] {
        weight_product(
            (rows, out, h),
            (&mut qkv[col..], width),
            true,
            (n1, h, 1),
            weight_rhs(wp, ad.copies[p], rows, (out, h)),
        );
        ad.branches
            .forward(p, (n1, h), places, (&mut qkv[col..], width));
    }
    qkv
}

wide_fn! {
/// The q/k norms (where the layer has them) and the rotation of every query and key head,
/// in place, each at its row's position (`transpose`: the backward's `R^T`, norms left
/// out).
fn rotate_qk<T: Float>(qkv: &mut [T], chunk: &Chunk<T>, dims: Shape, transpose: bool) {
    let width = dims.grouped.width();
    let d = dims.grouped.d;
    let heads = dims.grouped.heads + dims.grouped.kv_heads;
    for_blocks(qkv, width, |blk, rows| {
        let first = blk * BLOCK_ROWS;
        for (r, row) in rows.chunks_exact_mut(width).enumerate() {
            let t = chunk.positions[first + r];
            let (c, sn) = (
                &chunk.cos[t * d..(t + 1) * d],
                &chunk.sin[t * d..(t + 1) * d],
            );
            for head in row[..heads * d].chunks_exact_mut(d) {
                rotate_head(head, c, sn, transpose);
            }
        }
    });
}
}

/// The queries and keys as the attention reads them: normalised and rotated.
fn prepared<T: Float>(qkv: &mut [T], w: &[&[T]; SLOTS], chunk: &Chunk<T>, dims: Shape) {
    let (width, d) = (dims.grouped.width(), dims.grouped.d);
    let off = T::of(chunk.offset);
    if chunk.qk_norm {
        let (hq, hk) = (dims.grouped.heads, dims.grouped.kv_heads);
        rms_heads(qkv, width, (0, hq, d), w[slot::Q_NORM], chunk.eps, off);
        rms_heads(qkv, width, (hq * d, hk, d), w[slot::K_NORM], chunk.eps, off);
    }
    rotate_qk(qkv, chunk, dims, false);
}

/// `a + b` element by element (a residual sum).
fn added<T: Float>(a: &[T], b: &[T]) -> Vec<T> {
    let mut y = a.to_vec();
    for (v, &r) in y.iter_mut().zip(b) {
        *v += r;
    }
    y
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
pub(in crate::nn) fn forward<T: Float>(
    x: &[T],
    (w, ad): (&[&[T]; SLOTS], &Adapters<T>),
    (packing, chunk): (&Packing, &Chunk<T>),
    dims: Shape,
    keep: bool,
) -> (Vec<T>, Option<Kept<T>>) {
    let (h, i, qd) = (dims.h, dims.inter, dims.qd());
    let (eps, off) = (chunk.eps, T::of(chunk.offset));
    let n1 = rms(x, w[slot::IN_NORM], eps, off);
    let mut qkv = project(&n1, (w, ad), dims, &packing.padded);
    drop(n1);
    let raw = keep.then(|| qkv.clone());
    prepared(&mut qkv, w, chunk, dims);
    let (ctx, probs) = grouped::forward(
        &qkv,
        (dims.grouped, &chunk.seqs),
        &chunk.params,
        keep && !chunk.recompute_probs,
    );
    drop(qkv);
    // From here on the rows whose output is wanted (all, or the pooled ones).
    let ctx = chunk.wanted(&ctx, qd).into_owned();
    let xs = chunk.wanted(x, h);
    let rows = xs.len() / h;
    let places = chunk.wanted_places(&packing.padded);
    let wo = weight_rhs(w[slot::WO], ad.copies[lora::O], rows, (h, qd));
    let mut a = linear(&ctx, wo, w[slot::WO + 1], rows, qd);
    ad.branches
        .forward(lora::O, (&ctx, qd), &places, (&mut a, h));
    let (x1, a) = if chunk.post_norms {
        let normed = rms(&a, w[slot::POST_ATTN], eps, off);
        (added(&xs, &normed), Some(a))
    } else {
        (added(&xs, &a), None)
    };
    drop(xs);
    let n2 = rms(&x1, w[slot::MLP_NORM], eps, off);
    let mut up = bias_rows(&[w[slot::WG + 1], w[slot::WU + 1]], rows);
    for (col, wp, p) in [(0, w[slot::WG], lora::GATE), (i, w[slot::WU], lora::UP)] {
        weight_product(
            (rows, i, h),
            (&mut up[col..], 2 * i),
            true,
            (&n2, h, 1),
            weight_rhs(wp, ad.copies[p], rows, (i, h)),
        );
        ad.branches
            .forward(p, (&n2, h), &places, (&mut up[col..], 2 * i));
    }
    drop(n2);
    let g = glu_rows(&up, chunk.act, i);
    let wd = weight_rhs(w[slot::WD], ad.copies[lora::DOWN], rows, (h, i));
    let mut m = linear(&g, wd, w[slot::WD + 1], rows, i);
    ad.branches
        .forward(lora::DOWN, (&g, i), &places, (&mut m, h));
    drop(g);
    let (y, m) = if chunk.post_norms {
        let normed = rms(&m, w[slot::POST_MLP], eps, off);
        (added(&x1, &normed), Some(m))
    } else {
        (added(&x1, &m), None)
    };
    let y = chunk.put_back(y, || x.to_vec(), h);
    let kept = raw.map(|qkv| Kept {
        qkv,
        probs,
        ctx,
        a,
        x1,
        up,
        m,
    });
    (y, kept)
}

/// Every gradient: of the input, of the slots (a missing or frozen one's is empty and
/// unused) and the adapters' `(dA, dB)` in the order of [`Adapters::branches`].
pub(in crate::nn) struct Grads<T> {
    pub(in crate::nn) dx: Vec<T>,
    pub(in crate::nn) slots: [Vec<T>; SLOTS],
    pub(in crate::nn) lora: AdapterGrads<T, 7>,
}

/// The backward pass from `dy`.
pub(in crate::nn) fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    (w, ad): (&[&[T]; SLOTS], &Adapters<T>),
    (packing, chunk): (&Packing, &Chunk<T>),
    dims: Shape,
    kept: &Kept<T>,
) -> Grads<T> {
    let (all, h, i, qd, kd) = (packing.total(), dims.h, dims.inter, dims.qd(), dims.kd());
    let (eps, off) = (chunk.eps, T::of(chunk.offset));
    let width = dims.grouped.width();
    let mut slots: [Vec<T>; SLOTS] = Default::default();
    let wants = |slot: usize| ad.wants[slot];
    let mut lora_grads = AdapterGrads::default();
    // Up to the attention, the rows whose output is wanted (all, or the pooled ones).
    let dy_all = dy;
    let dy = chunk.wanted(dy_all, h);
    let dy = &dy[..];
    let rows = dy.len() / h;
    let places = chunk.wanted_places(&packing.padded);
    // The feed-forward: y = x1 + norm(act(g) u W_d^T + b_d).
    let dm: Cow<[T]> = match &kept.m {
        Some(m) => {
            let (dm, dw) = rms_backward(m, w[slot::POST_MLP], dy, eps, off);
            slots[slot::POST_MLP] = dw;
            Cow::Owned(dm)
        }
        None => Cow::Borrowed(dy),
    };
    slots[slot::WD + 1] = column_sums(&dm, h);
    let g = glu_rows(&kept.up, chunk.act, i);
    if wants(slot::WD) {
        slots[slot::WD] = product_new((h, i, rows), (&dm, 1, h), (&g, i, 1));
    }
    let mut dg = product_new((rows, i, h), (&dm, h, 1), (w[slot::WD], i, 1));
    ad.branches.backward(
        lora::DOWN,
        (&g, i),
        &places,
        ((&dm, h), &mut dg),
        &mut lora_grads,
    );
    drop((g, dm));
    let dup = glu_rows_backward(&kept.up, &dg, chunk.act, i);
    drop(dg);
    let sums = column_sums(&dup, 2 * i);
    slots[slot::WG + 1] = sums[..i].to_vec();
    slots[slot::WU + 1] = sums[i..].to_vec();
    let n2 = rms(&kept.x1, w[slot::MLP_NORM], eps, off);
    if wants(slot::WG) {
        slots[slot::WG] = product_new((i, h, rows), (&dup, 1, 2 * i), (&n2, h, 1));
    }
    if wants(slot::WU) {
        slots[slot::WU] = product_new((i, h, rows), (&dup[i..], 1, 2 * i), (&n2, h, 1));
    }
    let mut dn2 = product_new((rows, h, i), (&dup, 2 * i, 1), (w[slot::WG], h, 1));
    product(
        (rows, h, i),
        (&mut dn2, h),
        true,
        (&dup[i..], 2 * i, 1),
        (w[slot::WU], h, 1),
    );
    ad.branches.backward(
        lora::GATE,
        (&n2, h),
        &places,
        ((&dup, 2 * i), &mut dn2),
        &mut lora_grads,
    );
    ad.branches.backward(
        lora::UP,
        (&n2, h),
        &places,
        ((&dup[i..], 2 * i), &mut dn2),
        &mut lora_grads,
    );
    drop((n2, dup));
    let (dx1_norm, dw) = rms_backward(&kept.x1, w[slot::MLP_NORM], &dn2, eps, off);
    slots[slot::MLP_NORM] = dw;
    drop(dn2);
    let dx1 = added(dy, &dx1_norm);
    drop(dx1_norm);
    // The attention output: x1 = x + norm(ctx W_o^T + b_o).
    let da: Cow<[T]> = match &kept.a {
        Some(a) => {
            let (da, dw) = rms_backward(a, w[slot::POST_ATTN], &dx1, eps, off);
            slots[slot::POST_ATTN] = dw;
            Cow::Owned(da)
        }
        None => Cow::Borrowed(&dx1),
    };
    slots[slot::WO + 1] = column_sums(&da, h);
    if wants(slot::WO) {
        slots[slot::WO] = product_new((h, qd, rows), (&da, 1, h), (&kept.ctx, qd, 1));
    }
    let mut dctx = product_new((rows, qd, h), (&da, h, 1), (w[slot::WO], qd, 1));
    ad.branches.backward(
        lora::O,
        (&kept.ctx, qd),
        &places,
        ((&da, h), &mut dctx),
        &mut lora_grads,
    );
    drop(da);
    let dctx = chunk.put_back(dctx, || vec![T::zero(); all * qd], qd);
    // The residual gradient of every row: a row that passed its input through gets its
    // output's gradient.
    let dx1 = chunk.put_back(dx1, || dy_all.to_vec(), h);
    // The attention, on the normalised and rotated queries and keys (recomputed).
    let mut att = kept.qkv.clone();
    prepared(&mut att, w, chunk, dims);
    let mut dqkv = grouped::backward(
        &att,
        kept.probs.as_deref(),
        &dctx,
        (dims.grouped, &chunk.seqs),
        &chunk.params,
    );
    drop((att, dctx));
    rotate_qk(&mut dqkv, chunk, dims, true);
    if chunk.qk_norm {
        let (hq, hk, d) = (dims.grouped.heads, dims.grouped.kv_heads, dims.grouped.d);
        let q = (0, hq, d);
        let k = (hq * d, hk, d);
        slots[slot::Q_NORM] =
            rms_heads_backward(&kept.qkv, &mut dqkv, width, q, w[slot::Q_NORM], eps, off);
        slots[slot::K_NORM] =
            rms_heads_backward(&kept.qkv, &mut dqkv, width, k, w[slot::K_NORM], eps, off);
    }
    let sums = column_sums(&dqkv, width);
    slots[slot::WQ + 1] = sums[..qd].to_vec();
    slots[slot::WK + 1] = sums[qd..qd + kd].to_vec();
    slots[slot::WV + 1] = sums[qd + kd..].to_vec();
    let n1 = rms(x, w[slot::IN_NORM], eps, off);
    let parts = [
        (slot::WQ, 0, qd, lora::Q),
        (slot::WK, qd, kd, lora::K),
        (slot::WV, qd + kd, kd, lora::V),
    ];
    for (s, col, out, _) in parts {
        if wants(s) {
            slots[s] = product_new((out, h, all), (&dqkv[col..], 1, width), (&n1, h, 1));
        }
    }
    let mut dn1 = vec![T::zero(); all * h];
    for (s, col, out, p) in parts {
        product(
            (all, h, out),
            (&mut dn1, h),
            true,
            (&dqkv[col..], width, 1),
            (w[s], h, 1),
        );
        ad.branches.backward(
            p,
            (&n1, h),
            &packing.padded,
            ((&dqkv[col..], width), &mut dn1),
            &mut lora_grads,
        );
    }
    drop((n1, dqkv));
    let (dxn, dw) = rms_backward(x, w[slot::IN_NORM], &dn1, eps, off);
    slots[slot::IN_NORM] = dw;
    let dx = added(&dx1, &dxn);
    Grads {
        dx,
        slots,
        lora: lora_grads,
    }
}
