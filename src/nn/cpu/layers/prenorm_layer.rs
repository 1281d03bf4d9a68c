//! A whole pre-norm transformer encoder layer (ModernBERT's) as one graph node with its
//! backward written out, on the packed real tokens (`Packing`) as BERT's layer node
//! ([`crate::nn::cpu::layers::encoder_layer`]) runs:
//!
//! ```text
//! n1   = LayerNorm1(x)                        (the identity in a layer without one)
//! qkv  = n1 W_qkv^T (+ b)                     (one product)
//! q, k = rotary(q, k) at each token's place   (in place, head by head)
//! ctx  = attention(qkv)                       (attention::heads; a local layer's window)
//! x1   = x + dropout(ctx W_o^T (+ b))
//! up   = LayerNorm2(x1) W_i^T (+ b) = [a, g]
//! y    = x1 + dropout(act(a) g) W_d^T (+ b)
//! ```
//!
//! Biases are optional everywhere (ModernBERT has none; a missing one adds nothing and
//! gets no gradient). The forward keeps the input, the rotated `qkv`, the probabilities
//! (unless `attention.probs` is recomputed), `ctx`, `x1` and `up`; the norms' outputs and
//! the gated activations are recomputed in the backward with the forward's arithmetic.
//! The rotation and the gated unit are the per-op nodes' own row functions
//! (`crate::nn::cpu::elementwise::gated`).

use candle_core::{DType, Tensor};

use crate::nn::cpu::attention::heads::{self as kernel, KeyMask};
use crate::nn::cpu::attention::packed::{attend, attention_backward, ScoreGrad};
use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{for_blocks, Float, BLOCK_ROWS};
use crate::nn::cpu::elementwise::gated::{glu_rows, glu_rows_backward, rotate_head};
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::elementwise::rows::{add_row, dropped, norm, norm_backward};
use crate::nn::cpu::layers::packing::{packed_layer, Packing, View};
use crate::nn::cpu::products::gemm::{column_sums, product, product_new};
use crate::nn::cpu::products::lora_branch::{
    node_inputs, AdapterGrads, Branches, LoraInput, NodeWeights,
};
use crate::nn::cpu::products::transposed::weight_rhs;
use crate::nn::cpu::products::weight_products::{linear, weight_product};
use crate::nn::cpu::AttentionSpec;

/// A weight and its bias, when the layer has one.
pub type Affine<'a> = (&'a Tensor, Option<&'a Tensor>);

/// The weights of one pre-norm layer, in order.
#[derive(Debug, Clone)]
pub struct PreNormWeights<'a> {
    /// LayerNorm before the attention: scale and shift `[h]`; `None`: the identity.
    pub attention_norm: Option<Affine<'a>>,
    /// The query-key-value projection `[3h, h]`.
    pub qkv: Affine<'a>,
    /// The attention output projection `[h, h]`.
    pub attention_output: Affine<'a>,
    /// LayerNorm before the feed-forward: scale and shift `[h]`.
    pub mlp_norm: Affine<'a>,
    /// The gated unit's input and gate, `[2I, h]`.
    pub up: Affine<'a>,
    /// The feed-forward down projection `[h, I]`.
    pub down: Affine<'a>,
    /// LoRA adapters of the query-key-value, attention output, up and down projections
    /// (the low-rank branch inside the node, see `crate::nn::cpu::products::lora_branch`); their
    /// base weights above are then the stored ones, frozen, read widened where stored narrower.
    pub lora: [Option<LoraInput>; 4],
}

/// Slots of the weights: two per part (weight or scale, then bias or shift).
const SLOTS: usize = 12;
mod slot {
    pub const WQKV: usize = 2;
    pub const WO: usize = 4;
    pub const WI: usize = 8;
    pub const WD: usize = 10;
}

impl<'a> PreNormWeights<'a> {
    /// The node's weights: the slots, then the adapters'.
    fn inputs(&self) -> Vec<Option<&Tensor>> {
        node_inputs(&self.slots(), &self.lora)
    }

    fn slots(&self) -> [Option<&'a Tensor>; SLOTS] {
        let (n1, b1) = match self.attention_norm {
            Some((g, b)) => (Some(g), b),
            None => (None, None),
        };
        [
            n1,
            b1,
            Some(self.qkv.0),
            self.qkv.1,
            Some(self.attention_output.0),
            self.attention_output.1,
            Some(self.mlp_norm.0),
            self.mlp_norm.1,
            Some(self.up.0),
            self.up.1,
            Some(self.down.0),
            self.down.1,
        ]
    }
}

/// Everything of the layer besides its weights.
#[derive(Debug, Clone)]
pub struct PreNormSpec {
    /// Attention heads.
    pub heads: usize,
    /// The gated unit's activation.
    pub act: Act,
    /// LayerNorm epsilon (both norms).
    pub eps: f64,
    /// The self-attention: key mask, scale, dropout on the probabilities, recompute of
    /// the probabilities, sliding window.
    pub attention: AttentionSpec,
    /// The rotary tables `(cos, sin)`, `[s, d]` each.
    pub rotary: (Tensor, Tensor),
    /// Dropout on the attention output (before the first residual sum).
    pub attention_output_dropout: Option<(u64, f32)>,
    /// Dropout on the gated unit's output (before the down projection).
    pub mlp_dropout: Option<(u64, f32)>,
}

/// The layer on `x` `[n, s, h]` (CPU, f32 or f64): one node over `x` and the weights, or
/// the plain forward when none of them is tracked.
pub fn prenorm_layer(
    x: &Tensor,
    w: &PreNormWeights,
    spec: &PreNormSpec,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let (up, h2) = w.up.0.dims2()?;
    let inter = up / 2;
    let heads = spec.heads;
    let d = h.checked_div(heads).unwrap_or(0);
    let vector = |t: Option<&Tensor>, len: usize| t.is_none_or(|t| t.dims() == [len]);
    let fits = heads > 0
        && h % heads == 0
        && d % 2 == 0
        && up % 2 == 0
        && h2 == h
        && w.qkv.0.dims() == [3 * h, h]
        && vector(w.qkv.1, 3 * h)
        && w.attention_output.0.dims() == [h, h]
        && vector(w.attention_output.1, h)
        && w.attention_norm
            .is_none_or(|(g, b)| g.dims() == [h] && vector(b, h))
        && w.mlp_norm.0.dims() == [h]
        && vector(w.mlp_norm.1, h)
        && vector(w.up.1, up)
        && w.down.0.dims() == [h, inter]
        && vector(w.down.1, h)
        && spec.rotary.0.dims() == [s, d]
        && spec.rotary.1.dims() == [s, d]
        && w.lora
            .iter()
            .zip([(h, 3 * h), (h, h), (h, up), (inter, h)])
            .all(|(l, (i, o))| l.as_ref().is_none_or(|l| l.fits(i, o)));
    if !fits {
        candle_core::bail!(
            "pre-norm layer: hidden size {h}, {heads} heads, the weights ({:?} up, {:?} down) and the rotary tables {:?} do not fit",
            w.up.0.dims(),
            w.down.0.dims(),
            spec.rotary.0.dims()
        );
    }
    let dims = Shape {
        n,
        s,
        h,
        inter,
        heads,
        d,
    };
    let tracked = x.track_op() || w.inputs().iter().flatten().any(|t| t.track_op());
    match x.dtype() {
        DType::F32 => layer::<f32>(x, w, spec, dims, tracked),
        DType::F64 => layer::<f64>(x, w, spec, dims, tracked),
        other => candle_core::bail!("pre-norm layer: runs in f32 or f64, not {other:?}"),
    }
}

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
    fn kernel(&self) -> kernel::Dims {
        kernel::Dims {
            n: self.n,
            heads: self.heads,
            s: self.s,
            d: self.d,
        }
    }

    /// The length of each slot's values.
    fn slot_len(&self, slot: usize) -> usize {
        let (h, i) = (self.h, self.inter);
        [
            h,
            h,
            3 * h * h,
            3 * h,
            h * h,
            h,
            h,
            h,
            2 * i * h,
            2 * i,
            h * i,
            h,
        ][slot]
    }
}

/// The weights held by the node.
struct Weights<T>(NodeWeights<T, SLOTS, 4>);

impl<T: Float> Weights<T> {
    fn new(w: &PreNormWeights) -> candle_core::Result<Self> {
        Ok(Self(NodeWeights::new(w.slots(), &w.lora)?))
    }

    /// Runs `f` on the weights' values; a missing bias or shift reads as zeros.
    fn read<R>(
        &self,
        dims: Shape,
        f: impl FnOnce(&W<T>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let views = self
            .0
            .slots
            .iter()
            .map(|t| t.as_ref().map(View::new).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let zeros = vec![T::zero(); 2 * dims.inter.max(2 * dims.h)];
        let mut v: Vec<&[T]> = Vec::with_capacity(SLOTS);
        for (slot, view) in views.iter().enumerate() {
            v.push(match view {
                Some(view) => view.values::<T>()?,
                None => &zeros[..dims.slot_len(slot).min(zeros.len())],
            });
        }
        let copies = self.0.transposed(lora::WEIGHT, &v);
        let w = W {
            wants: self.0.wants,
            wt: std::array::from_fn(|p| copies[p].as_deref().map(|c| &c[..])),
            lora: self.0.branches(),
            n1: self.0.slots[0].is_some().then_some((v[0], v[1])),
            wqkv: v[2],
            bqkv: v[3],
            wo: v[4],
            bo: v[5],
            n2: (v[6], v[7]),
            wi: v[8],
            bi: v[9],
            wd: v[10],
            bd: v[11],
        };
        f(&w)
    }
}

/// The weights' values.
struct W<'a, T> {
    /// Which slots take a gradient (a frozen weight's is not computed).
    wants: [bool; SLOTS],
    /// Transposed copies of `W_qkv, W_o, W_i, W_d` (`[in, out]`) where an inference keeps
    /// them ([`crate::nn::cpu::products::transposed`]): the forward's products read these.
    wt: [Option<&'a [T]>; 4],
    /// The adapters' branches, in the order of [`PreNormWeights::lora`].
    lora: Branches<'a, T, 4>,
    n1: Option<(&'a [T], &'a [T])>,
    wqkv: &'a [T],
    bqkv: &'a [T],
    wo: &'a [T],
    bo: &'a [T],
    n2: (&'a [T], &'a [T]),
    wi: &'a [T],
    bi: &'a [T],
    wd: &'a [T],
    bd: &'a [T],
}

/// What the forward keeps for the backward.
struct Kept<T> {
    qkv: Vec<T>,
    probs: Option<Vec<T>>,
    ctx: Vec<T>,
    x1: Vec<T>,
    up: Vec<T>,
}

/// The rotary tables' values and each packed row's place in its sequence (the pre-norm
/// and the post-norm rotary layer nodes').
pub(super) struct Rotary<T> {
    cos: Vec<T>,
    sin: Vec<T>,
    positions: Vec<usize>,
}

impl<T: Float> Rotary<T> {
    /// The tables `(cos, sin)` `[s, d]` in `dtype` (`T`'s), for the rows of `packing`.
    pub(super) fn new(
        (cos, sin): &(Tensor, Tensor),
        packing: &Packing,
        s: usize,
        dtype: DType,
    ) -> candle_core::Result<Self> {
        let table = |t: &Tensor| -> candle_core::Result<Vec<T>> {
            t.to_dtype(dtype)?.flatten_all()?.to_vec1()
        };
        Ok(Self {
            cos: table(cos)?,
            sin: table(sin)?,
            positions: packing.padded.iter().map(|&r| r % s).collect(),
        })
    }
}

fn layer<T: Float>(
    x: &Tensor,
    w: &PreNormWeights,
    spec: &PreNormSpec,
    dims: Shape,
    tracked: bool,
) -> candle_core::Result<Tensor> {
    let weights = Weights::<T>::new(w)?;
    let bias = spec.attention.bias.contiguous()?;
    if bias.elem_count() != dims.n * dims.s {
        candle_core::bail!(
            "pre-norm layer: key mask {:?} does not fit {} sequences of {} tokens",
            bias.dims(),
            dims.n,
            dims.s
        );
    }
    let mask = KeyMask::new(View::new(&bias)?.values::<T>()?, dims.n, dims.s);
    let packing = Packing::new(&mask, dims.n, dims.s);
    let rotary = Rotary::new(&spec.rotary, &packing, dims.s, x.dtype())?;
    // Read by the forward, then owned by the backward.
    let shared = std::sync::Arc::new((weights, mask, rotary, spec.clone()));
    let owned = std::sync::Arc::clone(&shared);
    packed_layer(
        "gradcache-prenorm-layer",
        x,
        &w.inputs(),
        packing,
        |xp, packing| {
            let (weights, mask, rotary, spec) = &*shared;
            weights.read(dims, |wv| {
                Ok(forward(
                    xp,
                    wv,
                    (mask, packing, rotary),
                    spec,
                    dims,
                    tracked,
                ))
            })
        },
        move |xp, dyp, packing, kept| {
            let (weights, mask, rotary, spec) = &*owned;
            weights.read(dims, |wv| {
                let grads = backward(xp, dyp, wv, (mask, packing, rotary), spec, dims, kept);
                let all = grads.slots.into_iter().chain(grads.lora.flat()).collect();
                Ok((grads.dx, all))
            })
        },
    )
}

wide_fn! {
/// Rotates the query and key parts of the packed `[rows, 3h]` `qkv` in place, each head
/// at its row's place (`transpose`: the backward's `R^T`), as
/// [`crate::nn::cpu::elementwise::gated`]'s rotary (`h` wide, heads of `d`).
pub(super) fn rotate_qk<T: Float>(qkv: &mut [T], rotary: &Rotary<T>, (h, d): (usize, usize), transpose: bool) {
    for_blocks(qkv, 3 * h, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, row) in chunk.chunks_exact_mut(3 * h).enumerate() {
            let t = rotary.positions[first + r];
            let c = &rotary.cos[t * d..(t + 1) * d];
            let sn = &rotary.sin[t * d..(t + 1) * d];
            for x in row[..2 * h].chunks_exact_mut(d) {
                rotate_head(x, c, sn, transpose);
            }
        }
    });
}
}

/// The first norm's output (`x` itself in a layer without one).
fn first_norm<'a, T: Float>(x: &'a [T], w: &W<T>, eps: f64) -> std::borrow::Cow<'a, [T]> {
    match w.n1 {
        Some(n1) => std::borrow::Cow::Owned(norm(x, n1, eps)),
        None => std::borrow::Cow::Borrowed(x),
    }
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
fn forward<T: Float>(
    x: &[T],
    w: &W<T>,
    (mask, packing, rotary): (&KeyMask<T>, &Packing, &Rotary<T>),
    spec: &PreNormSpec,
    dims: Shape,
    keep: bool,
) -> (Vec<T>, Option<Kept<T>>) {
    let (rows, h, i) = (packing.total(), dims.h, dims.inter);
    let places = &packing.padded;
    let n1 = first_norm(x, w, spec.eps);
    let mut qkv = projected(&n1, (w.wqkv, w.bqkv), w, lora::QKV, h, places);
    drop(n1);
    rotate_qk(&mut qkv, rotary, (dims.h, dims.d), false);
    let (ctx, probs) = attend(
        &qkv,
        (mask, &packing.rows),
        &spec.attention,
        dims.kernel(),
        keep,
    );
    let a = projected(&ctx, (w.wo, w.bo), w, lora::OUTPUT, h, places);
    let mut x1 = vec![T::zero(); rows * h];
    for_blocks(&mut x1, h, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, out) in chunk.chunks_exact_mut(h).enumerate() {
            let at = (first + r) * h;
            let (a, x) = (&a[at..at + h], &x[at..at + h]);
            add_row(
                (a, None),
                x,
                spec.attention_output_dropout,
                places[first + r] * h,
                out,
            );
        }
    });
    drop(a);
    let up = projected(
        &norm(&x1, w.n2, spec.eps),
        (w.wi, w.bi),
        w,
        lora::UP,
        h,
        places,
    );
    let g = glu_rows(&up, spec.act, i);
    let g = dropped(&g, spec.mlp_dropout, i, Some(places));
    let mut y = x1.clone();
    for (yrow, brow) in y.chunks_exact_mut(h).zip(std::iter::repeat(w.bd)) {
        for (v, &b) in yrow.iter_mut().zip(brow) {
            *v += b;
        }
    }
    let wd = weight_rhs(w.wd, w.wt[lora::DOWN], rows, (h, i));
    weight_product((rows, h, i), (&mut y, h), true, (&g, i, 1), wd);
    w.lora.forward(lora::DOWN, (&g, i), places, (&mut y, h));
    let kept = keep.then_some(Kept {
        qkv,
        probs,
        ctx,
        x1,
        up,
    });
    (y, kept)
}

/// `x W^T + b` of the projection `lora` (an index of [`PreNormWeights::lora`]) with its
/// adapter's branch, `places` the rows' padded places.
fn projected<T: Float>(
    x: &[T],
    (weight, bias): (&[T], &[T]),
    w: &W<T>,
    lora: usize,
    input: usize,
    places: &[usize],
) -> Vec<T> {
    let rhs = weight_rhs(weight, w.wt[lora], places.len(), (bias.len(), input));
    let mut y = linear(x, rhs, bias, places.len(), input);
    w.lora
        .forward(lora, (x, input), places, (&mut y, bias.len()));
    y
}

/// Indices into [`PreNormWeights::lora`] (and [`W::wt`]).
mod lora {
    pub const QKV: usize = 0;
    pub const OUTPUT: usize = 1;
    pub const UP: usize = 2;
    pub const DOWN: usize = 3;
    /// The projections' weights among the slots, in that order.
    pub const WEIGHT: [usize; 4] = [
        super::slot::WQKV,
        super::slot::WO,
        super::slot::WI,
        super::slot::WD,
    ];
}

/// Every gradient: of the input, of the twelve slots (a missing or frozen one's is empty
/// and unused) and the adapters' `(dA, dB)` in the order of [`PreNormWeights::lora`].
struct Grads<T> {
    dx: Vec<T>,
    slots: [Vec<T>; SLOTS],
    lora: AdapterGrads<T, 4>,
}

/// The backward pass from `dy`.
fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    w: &W<T>,
    (mask, packing, rotary): (&KeyMask<T>, &Packing, &Rotary<T>),
    spec: &PreNormSpec,
    dims: Shape,
    kept: &Kept<T>,
) -> Grads<T> {
    let (rows, h, i) = (packing.total(), dims.h, dims.inter);
    let places = &packing.padded;
    let wants = |slot: usize| w.wants[slot];
    let product_if =
        |slot: usize, f: &dyn Fn() -> Vec<T>| if wants(slot) { f() } else { Vec::new() };
    let mut lora_grads = AdapterGrads::default();
    // The feed-forward: y = x1 + dropout(glu(up)) W_d^T + b_d.
    let dbd = column_sums(dy, h);
    let g = glu_rows(&kept.up, spec.act, i);
    let g = dropped(&g, spec.mlp_dropout, i, Some(places));
    let dwd = product_if(slot::WD, &|| {
        product_new((h, i, rows), (dy, 1, h), (&g, i, 1))
    });
    let mut dg = product_new((rows, i, h), (dy, h, 1), (w.wd, i, 1));
    w.lora.backward(
        lora::DOWN,
        (&g, i),
        places,
        ((dy, h), &mut dg),
        &mut lora_grads,
    );
    drop(g);
    let dg = dropped(&dg, spec.mlp_dropout, i, Some(places));
    let dup = glu_rows_backward(&kept.up, &dg, spec.act, i);
    drop(dg);
    let dbi = column_sums(&dup, 2 * i);
    let n2 = norm(&kept.x1, w.n2, spec.eps);
    let dwi = product_if(slot::WI, &|| {
        product_new((2 * i, h, rows), (&dup, 1, 2 * i), (&n2, h, 1))
    });
    let mut dn2 = product_new((rows, h, 2 * i), (&dup, 2 * i, 1), (w.wi, h, 1));
    w.lora.backward(
        lora::UP,
        (&n2, h),
        places,
        ((&dup, 2 * i), &mut dn2),
        &mut lora_grads,
    );
    drop((n2, dup));
    let (mut dx1, dg2, db2) = norm_backward(&kept.x1, w.n2.0, &dn2, spec.eps);
    drop(dn2);
    for (a, &b) in dx1.iter_mut().zip(dy) {
        *a += b;
    }
    // The attention: x1 = x + dropout(ctx W_o^T + b_o).
    let da = dropped(&dx1, spec.attention_output_dropout, h, Some(places));
    let dbo = column_sums(&da, h);
    let dwo = product_if(slot::WO, &|| {
        product_new((h, h, rows), (&da, 1, h), (&kept.ctx, h, 1))
    });
    let mut dctx = product_new((rows, h, h), (&da, h, 1), (w.wo, h, 1));
    w.lora.backward(
        lora::OUTPUT,
        (&kept.ctx, h),
        places,
        ((&da, h), &mut dctx),
        &mut lora_grads,
    );
    drop(da);
    let (mut dqkv, _) = attention_backward(
        &kept.qkv,
        kept.probs.as_deref(),
        &dctx,
        (mask, &packing.rows),
        &spec.attention,
        dims.kernel(),
        ScoreGrad::None,
    );
    drop(dctx);
    rotate_qk(&mut dqkv, rotary, (dims.h, dims.d), true);
    let dbqkv = column_sums(&dqkv, 3 * h);
    let n1 = first_norm(x, w, spec.eps);
    let dwqkv = product_if(slot::WQKV, &|| {
        product_new((3 * h, h, rows), (&dqkv, 1, 3 * h), (&n1, h, 1))
    });
    let (dx, dg1, db1) = match w.n1 {
        Some((g1, _)) => {
            let mut dn1 = product_new((rows, h, 3 * h), (&dqkv, 3 * h, 1), (w.wqkv, h, 1));
            w.lora.backward(
                lora::QKV,
                (&n1, h),
                places,
                ((&dqkv, 3 * h), &mut dn1),
                &mut lora_grads,
            );
            drop(n1);
            let (mut dx, dg1, db1) = norm_backward(x, g1, &dn1, spec.eps);
            for (a, &b) in dx.iter_mut().zip(&dx1) {
                *a += b;
            }
            (dx, dg1, db1)
        }
        None => {
            let mut dx = dx1;
            product(
                (rows, h, 3 * h),
                (&mut dx, h),
                true,
                (&dqkv, 3 * h, 1),
                (w.wqkv, h, 1),
            );
            w.lora.backward(
                lora::QKV,
                (&n1, h),
                places,
                ((&dqkv, 3 * h), &mut dx),
                &mut lora_grads,
            );
            (dx, Vec::new(), Vec::new())
        }
    };
    Grads {
        dx,
        slots: [
            dg1, db1, dwqkv, dbqkv, dwo, dbo, dg2, db2, dwi, dbi, dwd, dbd,
        ],
        lora: lora_grads,
    }
}
