//! A whole post-norm rotary encoder layer (NomicBERT's, GTE's, Jina v3's) as one graph node
//! with its backward written out, on the packed real tokens (`Packing`) as the other
//! layer nodes run:
//!
//! ```text
//! qkv  = x W_qkv^T (+ b)                        (one product)
//! q, k = rotary(q, k) at each token's place     (in place, head by head)
//! ctx  = attention(qkv)                         (attention::heads)
//! y1   = LayerNorm1(dropout(ctx W_o^T (+ b)) + x)
//! u    = y1 W_i^T (+ b)
//! g    = act(u)                                 (plain: Jina v3)
//!      | dropout(act(a) * b), [a, b] = u        (gated: NomicBERT, GTE; the gate first)
//! y    = LayerNorm2(dropout(g W_d^T (+ b)) + y1)
//! ```
//!
//! Biases are optional on the products (NomicBERT has none; a missing one adds nothing and
//! gets no gradient). The forward keeps the input, the rotated `qkv`, the probabilities
//! (unless `attention.probs` is recomputed), `ctx`, and unless their sites are recomputed
//! the residual sum under the first LayerNorm, `u` and the sum under the second; what it
//! does not keep is recomputed in the backward with the forward's own arithmetic, so the
//! gradients equal those of keeping, bit for bit. `y1` and `g` are always recomputed (one
//! pass each).

use candle_core::{DType, Tensor};

use crate::nn::cpu::attention::heads::{self as kernel, KeyMask};
use crate::nn::cpu::attention::packed::{attend, attention_backward, ScoreGrad};
use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::elementwise::gated::{glu_rows_backward_ordered, glu_rows_ordered};
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::elementwise::rows::{
    activate, activate_with_slope, add_norm, dropped, norm, norm_backward, times_slope,
};
use crate::nn::cpu::layers::packing::{packed_layer, Packing, View};
use crate::nn::cpu::layers::prenorm_layer::{rotate_qk, Rotary};
use crate::nn::cpu::products::gemm::{column_sums, product, product_new};
use crate::nn::cpu::products::lora_branch::{
    node_inputs, AdapterGrads, Branches, LoraInput, NodeWeights,
};
use crate::nn::cpu::products::transposed::weight_rhs;
use crate::nn::cpu::products::weight_products::{linear, weight_product};
use crate::nn::cpu::AttentionSpec;

/// A weight and its bias, when the layer has one.
pub type Affine<'a> = (&'a Tensor, Option<&'a Tensor>);

/// The weights of one layer, in order.
#[derive(Debug, Clone)]
pub struct RotaryWeights<'a> {
    /// The query-key-value projection `[3h, h]`.
    pub qkv: Affine<'a>,
    /// The attention output projection `[h, h]`.
    pub attention_output: Affine<'a>,
    /// LayerNorm after the attention: scale and shift `[h]`.
    pub attention_norm: (&'a Tensor, &'a Tensor),
    /// The feed-forward's up projection: `[I, h]`, or a gated unit's gate and input
    /// `[2I, h]` (in the order [`RotarySpec::gate_second`] says), or with
    /// [`Self::up_second`] the first half `[I, h]` of those rows.
    pub up: Affine<'a>,
    /// A gated unit's second half `[I, h]` as a weight of its own (NomicBERT keeps its
    /// gate `fc12` and input `fc11` apart), without a bias and without an adapter.
    pub up_second: Option<&'a Tensor>,
    /// The feed-forward down projection `[h, I]`.
    pub down: Affine<'a>,
    /// LayerNorm after the feed-forward: scale and shift `[h]`.
    pub mlp_norm: (&'a Tensor, &'a Tensor),
    /// LoRA adapters of the query-key-value, attention output, up and down projections
    /// (the low-rank branch inside the node); their base weights above are then the stored
    /// ones, frozen.
    pub lora: [Option<LoraInput>; 4],
}

/// Slots of the weights: two per part (weight or scale, then bias or shift), then the
/// second half of a split up projection.
const SLOTS: usize = 13;
mod slot {
    pub const WQKV: usize = 0;
    pub const WO: usize = 2;
    pub const WI: usize = 6;
    pub const WD: usize = 8;
    pub const WI2: usize = 12;
}

impl<'a> RotaryWeights<'a> {
    /// The node's weights: the slots, then the adapters'.
    fn inputs(&self) -> Vec<Option<&Tensor>> {
        node_inputs(&self.slots(), &self.lora)
    }

    fn slots(&self) -> [Option<&'a Tensor>; SLOTS] {
        [
            Some(self.qkv.0),
            self.qkv.1,
            Some(self.attention_output.0),
            self.attention_output.1,
            Some(self.attention_norm.0),
            Some(self.attention_norm.1),
            Some(self.up.0),
            self.up.1,
            Some(self.down.0),
            self.down.1,
            Some(self.mlp_norm.0),
            Some(self.mlp_norm.1),
            self.up_second,
        ]
    }
}

/// Everything of the layer besides its weights.
#[derive(Debug, Clone)]
pub struct RotarySpec {
    /// Attention heads.
    pub heads: usize,
    /// The feed-forward activation.
    pub act: Act,
    /// A gated unit (`up` holds the gate and the input), else a plain activation.
    pub gated: bool,
    /// The gate is the second half of the gated unit's rows (GTE's `up_gate_proj`), else
    /// the first.
    pub gate_second: bool,
    /// LayerNorm epsilon (both norms).
    pub eps: f64,
    /// The self-attention: key mask, scale, dropout on the probabilities, recompute of
    /// the probabilities.
    pub attention: AttentionSpec,
    /// The rotary tables `(cos, sin)`, `[s, d]` each.
    pub rotary: (Tensor, Tensor),
    /// Dropout on the attention output (before the first residual sum).
    pub attention_output_dropout: Option<(u64, f32)>,
    /// Dropout on the gated unit's output (GTE's), before the down projection.
    pub gated_dropout: Option<(u64, f32)>,
    /// Dropout on the feed-forward output (before the second residual sum).
    pub output_dropout: Option<(u64, f32)>,
    /// Recompute the residual sum under the first LayerNorm.
    pub recompute_attention_norm: bool,
    /// Recompute the feed-forward's `u`.
    pub recompute_activation: bool,
    /// Recompute the residual sum under the second LayerNorm.
    pub recompute_mlp_norm: bool,
}

/// The layer on `x` `[n, s, h]` (CPU, f32 or f64): one node over `x` and the weights, or
/// the plain forward when none of them is tracked.
pub fn rotary_layer(
    x: &Tensor,
    w: &RotaryWeights,
    spec: &RotarySpec,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let (first, h2) = w.up.0.dims2()?;
    let up = match w.up_second {
        Some(_) => 2 * first,
        None => first,
    };
    let inter = if spec.gated { up / 2 } else { up };
    let heads = spec.heads;
    let d = h.checked_div(heads).unwrap_or(0);
    let vector = |t: Option<&Tensor>, len: usize| t.is_none_or(|t| t.dims() == [len]);
    let fits = heads > 0
        && h % heads == 0
        && d % 2 == 0
        && (!spec.gated || up % 2 == 0)
        && h2 == h
        && w.qkv.0.dims() == [3 * h, h]
        && vector(w.qkv.1, 3 * h)
        && w.attention_output.0.dims() == [h, h]
        && vector(w.attention_output.1, h)
        && w.attention_norm.0.dims() == [h]
        && w.attention_norm.1.dims() == [h]
        && w.mlp_norm.0.dims() == [h]
        && w.mlp_norm.1.dims() == [h]
        && vector(w.up.1, first)
        && w.up_second.is_none_or(|t| {
            spec.gated && t.dims() == [first, h] && w.up.1.is_none() && w.lora[2].is_none()
        })
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
            "rotary layer: hidden size {h}, {heads} heads, the weights ({:?} up, {:?} down) and the rotary tables {:?} do not fit",
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
        other => candle_core::bail!("rotary layer: runs in f32 or f64, not {other:?}"),
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

    /// The width of `u` (twice the feed-forward's for a gated unit).
    fn up(&self, gated: bool) -> usize {
        if gated {
            2 * self.inter
        } else {
            self.inter
        }
    }
}

/// The weights held by the node.
struct Weights<T>(NodeWeights<T, SLOTS, 4>);

impl<T: Float> Weights<T> {
    fn new(w: &RotaryWeights) -> candle_core::Result<Self> {
        Ok(Self(NodeWeights::new(w.slots(), &w.lora)?))
    }

    /// Runs `f` on the weights' values; a missing bias reads as zeros.
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
        let zeros = vec![T::zero(); (2 * dims.inter).max(3 * dims.h)];
        let split = self.0.slots[slot::WI2].is_some();
        let mut v: Vec<&[T]> = Vec::with_capacity(SLOTS);
        for (slot, view) in views.iter().enumerate() {
            v.push(match view {
                Some(view) => view.values::<T>()?,
                // Only the products' biases are optional: zeros of their width.
                None => {
                    let width = match slot {
                        1 => 3 * dims.h,
                        7 => v[slot::WI].len() / dims.h,
                        slot::WI2 => 0,
                        _ => dims.h,
                    };
                    &zeros[..width]
                }
            });
        }
        let copies = self.0.transposed(lora::WEIGHT, &v);
        let [second] = self.0.transposed([slot::WI2], &v);
        let w = W {
            wants: self.0.wants,
            wt: std::array::from_fn(|p| copies[p].as_deref().map(|c| &c[..])),
            lora: self.0.branches(),
            wqkv: v[0],
            bqkv: v[1],
            wo: v[2],
            bo: v[3],
            n1: (v[4], v[5]),
            wi: v[6],
            bi: v[7],
            wd: v[8],
            bd: v[9],
            n2: (v[10], v[11]),
            wi2: split.then(|| (v[slot::WI2], second.as_deref().map(|c| &c[..]))),
        };
        f(&w)
    }
}

/// The weights' values.
struct W<'a, T> {
    /// Which slots take a gradient (a frozen weight's is not computed).
    wants: [bool; SLOTS],
    /// Transposed copies of `W_qkv, W_o, W_i, W_d` (`[in, out]`) where an inference keeps
    /// them: the forward's products read these.
    wt: [Option<&'a [T]>; 4],
    /// The adapters' branches, in the order of [`RotaryWeights::lora`].
    lora: Branches<'a, T, 4>,
    wqkv: &'a [T],
    bqkv: &'a [T],
    wo: &'a [T],
    bo: &'a [T],
    n1: (&'a [T], &'a [T]),
    wi: &'a [T],
    bi: &'a [T],
    wd: &'a [T],
    bd: &'a [T],
    n2: (&'a [T], &'a [T]),
    /// The second half of a split up projection, and its transposed copy.
    wi2: Option<(&'a [T], Option<&'a [T]>)>,
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
    w: &RotaryWeights,
    spec: &RotarySpec,
    dims: Shape,
    tracked: bool,
) -> candle_core::Result<Tensor> {
    let weights = Weights::<T>::new(w)?;
    let bias = spec.attention.bias.contiguous()?;
    if bias.elem_count() != dims.n * dims.s {
        candle_core::bail!(
            "rotary layer: key mask {:?} does not fit {} sequences of {} tokens",
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
        "gradcache-rotary-layer",
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

/// `x W^T` of the projection `lora` (an index of [`RotaryWeights::lora`]) with its
/// adapter's branch, plus `bias` when given.
fn projected<T: Float>(
    x: &[T],
    (weight, bias, out): (&[T], Option<&[T]>, usize),
    w: &W<T>,
    lora: usize,
    input: usize,
    places: &[usize],
) -> Vec<T> {
    let rows = places.len();
    let rhs = weight_rhs(weight, w.wt[lora], rows, (out, input));
    let zeros;
    let b = match bias {
        Some(b) => b,
        None => {
            zeros = vec![T::zero(); out];
            &zeros
        }
    };
    let mut y = linear(x, rhs, b, rows, input);
    w.lora.forward(lora, (x, input), places, (&mut y, out));
    y
}

/// The feed-forward's activation `g` from `u` (biased): the gated unit with its dropout,
/// or the plain activation.
fn activation<T: Float>(u: &[T], spec: &RotarySpec, dims: Shape, places: &[usize]) -> Vec<T> {
    let i = dims.inter;
    if spec.gated {
        let g = glu_rows_ordered(u, spec.act, i, spec.gate_second);
        match spec.gated_dropout {
            Some(_) => dropped(&g, spec.gated_dropout, i, Some(places)).into_owned(),
            None => g,
        }
    } else {
        activate_with_slope(u, spec.act, i).0
    }
}

/// `u = y1 W_i^T + b_i` (a plain unit's bias added by the activation's pass).
fn up_product<T: Float>(
    y1: &[T],
    w: &W<T>,
    spec: &RotarySpec,
    dims: Shape,
    places: &[usize],
) -> Vec<T> {
    let width = dims.up(spec.gated);
    let mut u = match w.wi2 {
        None => projected(y1, (w.wi, None, width), w, lora::UP, dims.h, places),
        Some((wi2, wt2)) => {
            // Each half's product into its columns of `u`.
            let (rows, h, i) = (places.len(), dims.h, dims.inter);
            let mut u = vec![T::zero(); rows * width];
            let halves = [(w.wi, w.wt[lora::UP]), (wi2, wt2)];
            for (half, (weight, copy)) in halves.into_iter().enumerate() {
                let rhs = weight_rhs(weight, copy, rows, (i, h));
                weight_product(
                    (rows, i, h),
                    (&mut u[half * i..], width),
                    true,
                    (y1, h, 1),
                    rhs,
                );
            }
            u
        }
    };
    if spec.gated {
        for row in u.chunks_exact_mut(width) {
            for (v, &b) in row.iter_mut().zip(w.bi) {
                *v += b;
            }
        }
        u
    } else {
        // `activate` adds the bias into `u` in place (its output is dropped here).
        let _ = activate(&mut u, Some(w.bi), spec.act, width);
        u
    }
}

/// The feed-forward's output rows `g W_d^T` (the bias added by the residual's pass).
fn down_product<T: Float>(g: &[T], w: &W<T>, dims: Shape, places: &[usize]) -> Vec<T> {
    projected(g, (w.wd, None, dims.h), w, lora::DOWN, dims.inter, places)
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
fn forward<T: Float>(
    x: &[T],
    w: &W<T>,
    (mask, packing, rotary): (&KeyMask<T>, &Packing, &Rotary<T>),
    spec: &RotarySpec,
    dims: Shape,
    keep: bool,
) -> (Vec<T>, Option<Kept<T>>) {
    let h = dims.h;
    let places = &packing.padded;
    let mut qkv = projected(x, (w.wqkv, Some(w.bqkv), 3 * h), w, lora::QKV, h, places);
    rotate_qk(&mut qkv, rotary, (dims.h, dims.d), false);
    let (ctx, probs) = attend(
        &qkv,
        (mask, &packing.rows),
        &spec.attention,
        dims.kernel(),
        keep,
    );
    let a = projected(&ctx, (w.wo, None, h), w, lora::OUTPUT, h, places);
    let (sum1, y1) = add_norm(
        (&a, Some(w.bo)),
        x,
        spec.attention_output_dropout,
        w.n1,
        spec.eps,
        places,
    );
    drop(a);
    let u = up_product(&y1, w, spec, dims, places);
    let g = activation(&u, spec, dims, places);
    let o = down_product(&g, w, dims, places);
    drop(g);
    let (sum2, y) = add_norm(
        (&o, Some(w.bd)),
        &y1,
        spec.output_dropout,
        w.n2,
        spec.eps,
        places,
    );
    let kept = keep.then_some(Kept {
        qkv,
        probs,
        ctx,
        sum1: (!spec.recompute_attention_norm).then_some(sum1),
        u: (!spec.recompute_activation).then_some(u),
        sum2: (!spec.recompute_mlp_norm).then_some(sum2),
    });
    (y, kept)
}

/// Indices into [`RotaryWeights::lora`] (and [`W::wt`]).
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
/// and unused) and the adapters' `(dA, dB)` in the order of [`RotaryWeights::lora`].
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
    spec: &RotarySpec,
    dims: Shape,
    kept: &Kept<T>,
) -> Grads<T> {
    use std::borrow::Cow;
    let (rows, h, i) = (packing.total(), dims.h, dims.inter);
    let width = dims.up(spec.gated);
    let places = &packing.padded;
    let wants = |slot: usize| w.wants[slot];
    let product_if =
        |slot: usize, f: &dyn Fn() -> Vec<T>| if wants(slot) { f() } else { Vec::new() };
    let mut lora_grads = AdapterGrads::default();
    // What the forward did not keep, recomputed with its own arithmetic.
    let sum1 = match &kept.sum1 {
        Some(s) => Cow::Borrowed(s.as_slice()),
        None => {
            let a = projected(&kept.ctx, (w.wo, None, h), w, lora::OUTPUT, h, places);
            let dropout = spec.attention_output_dropout;
            Cow::Owned(add_norm((&a, Some(w.bo)), x, dropout, w.n1, spec.eps, places).0)
        }
    };
    let y1 = norm(&sum1, w.n1, spec.eps);
    let u = match &kept.u {
        Some(u) => Cow::Borrowed(u.as_slice()),
        None => Cow::Owned(up_product(&y1, w, spec, dims, places)),
    };
    let g = activation(&u, spec, dims, places);
    let sum2 = match &kept.sum2 {
        Some(s) => Cow::Borrowed(s.as_slice()),
        None => {
            let o = down_product(&g, w, dims, places);
            let dropout = spec.output_dropout;
            Cow::Owned(add_norm((&o, Some(w.bd)), &y1, dropout, w.n2, spec.eps, places).0)
        }
    };
    // Second LayerNorm; its sum's gradient is also the residual gradient of y1.
    let (dsum2, dg2, db2) = norm_backward(&sum2, w.n2.0, dy, spec.eps);
    drop(sum2);
    let d_o = dropped(&dsum2, spec.output_dropout, h, Some(places));
    let dbd = column_sums(&d_o, h);
    let dwd = product_if(slot::WD, &|| {
        product_new((h, i, rows), (&d_o, 1, h), (&g, i, 1))
    });
    let mut dg = product_new((rows, i, h), (&d_o, h, 1), (w.wd, i, 1));
    w.lora.backward(
        lora::DOWN,
        (&g, i),
        places,
        ((&d_o, h), &mut dg),
        &mut lora_grads,
    );
    drop((g, d_o));
    let (du, dbi) = if spec.gated {
        let dg = dropped(&dg, spec.gated_dropout, i, Some(places));
        let du = glu_rows_backward_ordered(&u, &dg, spec.act, i, spec.gate_second);
        let dbi = column_sums(&du, width);
        (du, dbi)
    } else {
        let (_, slope) = activate_with_slope(&u, spec.act, i);
        let dbi = times_slope(&slope, &mut dg, i);
        (dg, dbi)
    };
    drop(u);
    let mut dy1 = dsum2;
    // A split up projection: each half's columns of `du` against its own weight.
    let halves = match w.wi2 {
        None => vec![(w.wi, 0, width, slot::WI)],
        Some((wi2, _)) => vec![(w.wi, 0, i, slot::WI), (wi2, i, i, slot::WI2)],
    };
    let (mut dwi, mut dwi2) = (Vec::new(), Vec::new());
    for (weight, offset, out, which) in halves {
        let dw = product_if(which, &|| {
            product_new((out, h, rows), (&du[offset..], 1, width), (&y1, h, 1))
        });
        let lhs = (&du[offset..], width, 1);
        product((rows, h, out), (&mut dy1, h), true, lhs, (weight, h, 1));
        match which {
            slot::WI => dwi = dw,
            _ => dwi2 = dw,
        }
    }
    w.lora.backward(
        lora::UP,
        (&y1, h),
        places,
        ((&du, width), &mut dy1),
        &mut lora_grads,
    );
    drop((du, y1));
    // First LayerNorm.
    let (dsum1, dg1, db1) = norm_backward(&sum1, w.n1.0, &dy1, spec.eps);
    drop((sum1, dy1));
    let d_a = dropped(&dsum1, spec.attention_output_dropout, h, Some(places));
    let dbo = column_sums(&d_a, h);
    let dwo = product_if(slot::WO, &|| {
        product_new((h, h, rows), (&d_a, 1, h), (&kept.ctx, h, 1))
    });
    let mut dctx = product_new((rows, h, h), (&d_a, h, 1), (w.wo, h, 1));
    w.lora.backward(
        lora::OUTPUT,
        (&kept.ctx, h),
        places,
        ((&d_a, h), &mut dctx),
        &mut lora_grads,
    );
    drop(d_a);
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
    let dwqkv = product_if(slot::WQKV, &|| {
        product_new((3 * h, h, rows), (&dqkv, 1, 3 * h), (x, h, 1))
    });
    let mut dx = dsum1;
    product(
        (rows, h, 3 * h),
        (&mut dx, h),
        true,
        (&dqkv, 3 * h, 1),
        (w.wqkv, h, 1),
    );
    w.lora.backward(
        lora::QKV,
        (x, h),
        places,
        ((&dqkv, 3 * h), &mut dx),
        &mut lora_grads,
    );
    Grads {
        dx,
        slots: [
            dwqkv, dbqkv, dwo, dbo, dg1, db1, dwi, dbi, dwd, dbd, dg2, db2, dwi2,
        ],
        lora: lora_grads,
    }
}
