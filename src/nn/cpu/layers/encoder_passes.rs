//! The arithmetic of the encoder layer node ([`super::encoder_layer`]) on its packed rows:
//! the forward pass and what it keeps, the backward pass with every gradient, written out
//! in the order of the formulas of the node's documentation, and the products and passes
//! they share.

use candle_core::Tensor;

use crate::nn::cpu::attention::disentangled::{self, Relative, RelativeGrads};
use crate::nn::cpu::attention::heads::{self as kernel, KeyMask};
use crate::nn::cpu::attention::packed::{attend, attention_backward, ScoreGrad};
use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::elementwise::rows::{
    activate, activate_in_place, activate_with_slope, add_norm, add_norm_output, dropped, norm,
    norm_backward, times_slope,
};
use crate::nn::cpu::layers::packing::Packing;
use crate::nn::cpu::products::gemm::{bias_rows, column_sums, product, product_new};
use crate::nn::cpu::products::lora_branch::{AdapterGrads, Branches};
use crate::nn::cpu::products::transposed::weight_rhs;
use crate::nn::cpu::products::weight_products::{weight_product, weight_product_new};
use crate::nn::cpu::AttentionSpec;

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
    /// A bias added to the attention scores of every sequence, `heads * s * s` values
    /// (`[1, heads, s, s]`; MPNet's relative position bias): an input of the node, which
    /// gives it its gradient (summed over the sequences).
    pub score_bias: Option<Tensor>,
    /// DeBERTa's disentangled attention terms, added to each sequence's scores.
    pub relative: Option<RelativeSpec>,
}

/// DeBERTa's disentangled attention in a layer node
/// (`crate::nn::cpu::attention::disentangled`): the relative embeddings through the
/// key and query projections (inputs of the node, which give them their gradients) and
/// the relative position row of every (query, key) pair; the terms are scaled by the
/// attention's scale.
#[derive(Debug, Clone)]
pub struct RelativeSpec {
    /// `Kr` `[R, h]` (content-to-position), if the model has the term.
    pub key: Option<Tensor>,
    /// `Qr` `[R, h]` (position-to-content), if the model has the term.
    pub query: Option<Tensor>,
    /// The row of every (query, key) pair of a sequence, `[s, s]` row-major.
    pub index: std::sync::Arc<Vec<u32>>,
}

/// The sizes of a layer applied to a batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) n: usize,
    pub(super) s: usize,
    pub(super) h: usize,
    pub(super) inter: usize,
    pub(super) heads: usize,
    pub(super) d: usize,
    /// The rows computed: the real tokens (see [`Packing`]).
    pub(super) rows: usize,
}

impl Shape {
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    pub(super) fn kernel(&self) -> kernel::Dims {
        kernel::Dims {
            n: self.n,
            heads: self.heads,
            s: self.s,
            d: self.d,
        }
    }
}

/// Indices into [`LayerWeights::lora`] and, for the weights, into their node-input order.
pub(super) mod lora {
    pub const OUTPUT: usize = 3;
    pub const UP: usize = 4;
    pub const DOWN: usize = 5;
    /// The weights' own indices among the sixteen: `W_q, W_k, W_v, W_o, W_i, W_d`.
    pub const WEIGHT: [usize; 6] = [0, 1, 2, 6, 10, 12];
}

/// The weights' values.
pub(super) struct W<'a, T> {
    /// Which weights take a gradient (a frozen one's is not computed).
    pub(super) wants: [bool; 16],
    /// Transposed copies of `W_q, W_k, W_v, W_o, W_i, W_d` (`[in, out]`) where an
    /// inference keeps them ([`crate::nn::cpu::products::transposed`]): the forward's products
    /// read these.
    pub(super) wt: [Option<&'a [T]>; 6],
    /// The adapters' branches, in the order of [`LayerWeights::lora`].
    pub(super) lora: Branches<'a, T, 6>,
    pub(super) wqkv: [&'a [T]; 3],
    pub(super) bqkv: [&'a [T]; 3],
    pub(super) wo: &'a [T],
    pub(super) bo: &'a [T],
    pub(super) n1: (&'a [T], &'a [T]),
    pub(super) wi: &'a [T],
    pub(super) bi: &'a [T],
    pub(super) wd: &'a [T],
    pub(super) bd: &'a [T],
    pub(super) n2: (&'a [T], &'a [T]),
    /// DeBERTa's relative positions' values.
    pub(super) relative: Option<Relative<'a, T>>,
}

/// `mask` with the disentangled terms of `qkv` added to each sequence's scores, when the
/// layer has them.
fn with_relative<T: Float>(
    mask: &KeyMask<T>,
    qkv: &[T],
    w: &W<T>,
    packing: &Packing,
    dims: Shape,
) -> Option<KeyMask<T>> {
    let rel = w.relative.as_ref()?;
    let scores = disentangled::scores(qkv, rel, (dims.kernel(), &packing.rows), mask);
    Some(mask.clone().with_sequence_scores(scores, dims.heads))
}

/// What the forward keeps for the backward (`None`: recomputed there).
pub(super) struct Kept<T> {
    qkv: Vec<T>,
    probs: Option<Vec<T>>,
    ctx: Vec<T>,
    sum1: Option<Vec<T>>,
    u: Option<Vec<T>>,
    sum2: Option<Vec<T>>,
}

/// The packed `[rows, 3h]` queries, keys and values: `x W_p^T + b_p` side by side (and
/// the adapters' branches).
fn qkv<T: Float>(x: &[T], w: &W<T>, rows: usize, h: usize, places: &[usize]) -> Vec<T> {
    let mut y = bias_rows(&w.bqkv, rows);
    for (p, wp) in w.wqkv.iter().enumerate() {
        weight_product(
            (rows, h, h),
            (&mut y[p * h..], 3 * h),
            true,
            (x, h, 1),
            weight_rhs(wp, w.wt[p], rows, (h, h)),
        );
        w.lora.forward(p, (x, h), places, (&mut y[p * h..], 3 * h));
    }
    y
}

/// `x W^T` of the projection `lora` (an index of [`LayerWeights::lora`]) with its
/// adapter's branch, `W` `[out, input]`; its bias is added by the pass that reads the
/// product next (the activation, the residual sum), not written here first.
fn projected<T: Float>(
    x: &[T],
    (weight, out): (&[T], usize),
    w: &W<T>,
    lora: usize,
    (rows, input): (usize, usize),
    places: &[usize],
) -> Vec<T> {
    let rhs = weight_rhs(weight, w.wt[lora], rows, (out, input));
    let mut y = weight_product_new((rows, out, input), (x, input, 1), rhs);
    w.lora.forward(lora, (x, input), places, (&mut y, out));
    y
}

/// The feed-forward half from `y1`: `u`, and the output `o = act(u) W_d^T + b_d`.
fn feed_forward<T: Float>(
    y1: &[T],
    w: &W<T>,
    spec: &LayerSpec,
    dims: Shape,
    places: &[usize],
) -> (Vec<T>, Vec<T>) {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    let mut u = projected(y1, (w.wi, i), w, lora::UP, (rows, h), places);
    let g = activate(&mut u, Some(w.bi), spec.act, i);
    let o = projected(&g, (w.wd, h), w, lora::DOWN, (rows, i), places);
    (u, o)
}

/// The output of [`feed_forward`] alone, for a forward that does not keep `u`
/// (inference, or the `intermediate` site recomputed): the activation overwrites `u` in
/// place, so the layer's largest buffer (`[rows, I]`) exists once, not twice.
fn feed_forward_output<T: Float>(
    y1: &[T],
    w: &W<T>,
    spec: &LayerSpec,
    dims: Shape,
    places: &[usize],
) -> Vec<T> {
    let (rows, h, i) = (dims.rows(), dims.h, dims.inter);
    let mut u = projected(y1, (w.wi, i), w, lora::UP, (rows, h), places);
    activate_in_place(&mut u, Some(w.bi), spec.act, i);
    projected(&u, (w.wd, h), w, lora::DOWN, (rows, i), places)
}

/// The forward pass: the output rows and, when `keep`, what the backward reads.
pub(super) fn forward<T: Float>(
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
    let qkv = qkv(x, w, rows, h, places);
    let relative = with_relative(mask, &qkv, w, packing, dims);
    let (ctx, probs) = attend(
        &qkv,
        (relative.as_ref().unwrap_or(mask), &packing.rows),
        &spec.attention,
        dims.kernel(),
        keep,
    );
    let qkv = keep.then_some(qkv);
    let a = projected(&ctx, (w.wo, h), w, lora::OUTPUT, (rows, h), places);
    let ctx = keep.then_some(ctx);
    // The sums under the LayerNorms are written out only where the backward takes them.
    let (biased, dropout) = ((&a[..], Some(w.bo)), spec.attention_output_dropout);
    let (sum1, y1) = if keep && !spec.recompute_attention_norm {
        let (sum1, y1) = add_norm(biased, x, dropout, w.n1, spec.eps, places);
        (Some(sum1), y1)
    } else {
        (
            None,
            add_norm_output(biased, x, dropout, w.n1, spec.eps, places),
        )
    };
    drop(a);
    let (u, o) = if keep && !spec.recompute_intermediate {
        let (u, o) = feed_forward(&y1, w, spec, dims, places);
        (Some(u), o)
    } else {
        (None, feed_forward_output(&y1, w, spec, dims, places))
    };
    let (biased, dropout) = ((&o[..], Some(w.bd)), spec.output_dropout);
    let (sum2, y) = if keep && !spec.recompute_output_norm {
        let (sum2, y) = add_norm(biased, &y1, dropout, w.n2, spec.eps, places);
        (Some(sum2), y)
    } else {
        (
            None,
            add_norm_output(biased, &y1, dropout, w.n2, spec.eps, places),
        )
    };
    let kept = qkv.zip(ctx).map(|(qkv, ctx)| Kept {
        qkv,
        probs,
        ctx,
        sum1,
        u,
        sum2,
    });
    Ok((y, kept))
}

/// Every gradient of the layer (`None`: a frozen weight's, not computed).
pub(super) struct Grads<T> {
    pub(super) dx: Vec<T>,
    pub(super) dwqkv: [Option<Vec<T>>; 3],
    pub(super) dbqkv: [Vec<T>; 3],
    pub(super) dwo: Option<Vec<T>>,
    pub(super) dbo: Vec<T>,
    pub(super) dg1: Vec<T>,
    pub(super) db1: Vec<T>,
    pub(super) dwi: Option<Vec<T>>,
    pub(super) dbi: Vec<T>,
    pub(super) dwd: Option<Vec<T>>,
    pub(super) dbd: Vec<T>,
    pub(super) dg2: Vec<T>,
    pub(super) db2: Vec<T>,
    /// The score bias's, `[heads, s, s]`, when the layer has one.
    pub(super) dscores: Option<Vec<T>>,
    /// The relative positions' projections', when the layer has them.
    pub(super) drelative: Option<RelativeGrads<T>>,
    /// The adapters' `(dA, dB)`, in the order of [`LayerWeights::lora`].
    pub(super) lora: AdapterGrads<T, 6>,
}

/// The backward pass from `dy`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<T: Float>(
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
    let wants = |p: usize| w.wants[lora::WEIGHT[p]];
    let mut lora_grads = AdapterGrads::default();
    // What the forward did not keep, recomputed with its own arithmetic.
    let sum1 = match &kept.sum1 {
        Some(s) => Cow::Borrowed(s.as_slice()),
        None => {
            let a = projected(&kept.ctx, (w.wo, h), w, lora::OUTPUT, (rows, h), places);
            let dropout = spec.attention_output_dropout;
            Cow::Owned(add_norm((&a, Some(w.bo)), x, dropout, w.n1, spec.eps, places).0)
        }
    };
    let y1 = norm(&sum1, w.n1, spec.eps);
    let (u, sum2) = match (&kept.u, &kept.sum2) {
        (Some(u), Some(s)) => (Cow::Borrowed(u.as_slice()), Cow::Borrowed(s.as_slice())),
        (u_kept, sum_kept) => {
            let (u, o) = feed_forward(&y1, w, spec, dims, places);
            let sum2 = match sum_kept {
                Some(s) => Cow::Borrowed(s.as_slice()),
                None => {
                    let sums = add_norm(
                        (&o, Some(w.bd)),
                        &y1,
                        spec.output_dropout,
                        w.n2,
                        spec.eps,
                        places,
                    );
                    Cow::Owned(sums.0)
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
    let dwd = wants(lora::DOWN).then(|| product_new((h, i, rows), (&d_o, 1, h), (&g, i, 1)));
    let mut du = product_new((rows, i, h), (&d_o, h, 1), (w.wd, i, 1));
    w.lora.backward(
        lora::DOWN,
        (&g, i),
        places,
        ((&d_o, h), &mut du),
        &mut lora_grads,
    );
    drop((g, d_o));
    let dbi = times_slope(&slope, &mut du, i);
    drop(slope);
    // dW_i [I, h] = du^T y1 ; dy1 = dsum2 + du W_i
    let dwi = wants(lora::UP).then(|| product_new((i, h, rows), (&du, 1, i), (&y1, h, 1)));
    let mut dy1 = dsum2;
    product((rows, h, i), (&mut dy1, h), true, (&du, i, 1), (w.wi, h, 1));
    w.lora.backward(
        lora::UP,
        (&y1, h),
        places,
        ((&du, i), &mut dy1),
        &mut lora_grads,
    );
    drop((du, y1));
    // First LayerNorm.
    let (dsum1, dg1, db1) = norm_backward(&sum1, w.n1.0, &dy1, spec.eps);
    drop((sum1, dy1));
    let d_a = dropped(&dsum1, spec.attention_output_dropout, h, Some(places));
    let dbo = column_sums(&d_a, h);
    let dwo =
        wants(lora::OUTPUT).then(|| product_new((h, h, rows), (&d_a, 1, h), (&kept.ctx, h, 1)));
    let mut dctx = product_new((rows, h, h), (&d_a, h, 1), (w.wo, h, 1));
    w.lora.backward(
        lora::OUTPUT,
        (&kept.ctx, h),
        places,
        ((&d_a, h), &mut dctx),
        &mut lora_grads,
    );
    drop(d_a);
    // Attention (the disentangled terms recomputed with the forward's arithmetic).
    let relative = with_relative(mask, &kept.qkv, w, packing, dims);
    let wanted = match (&w.relative, &spec.score_bias) {
        (Some(_), _) => ScoreGrad::PerSequence,
        (None, Some(_)) => ScoreGrad::Summed,
        (None, None) => ScoreGrad::None,
    };
    let (mut dqkv, mut dscores) = attention_backward(
        &kept.qkv,
        kept.probs.as_deref(),
        &dctx,
        (relative.as_ref().unwrap_or(mask), &packing.rows),
        &spec.attention,
        dims.kernel(),
        wanted,
    );
    drop(dctx);
    let drelative = match (&w.relative, dscores.take_if(|_| w.relative.is_some())) {
        (Some(rel), Some(per_sequence)) => Some(disentangled::backward(
            &kept.qkv,
            &per_sequence,
            rel,
            (dims.kernel(), &packing.rows),
            mask,
            &mut dqkv,
        )),
        _ => None,
    };
    let sums = column_sums(&dqkv, 3 * h);
    let dbqkv = [0, 1, 2].map(|p| sums[p * h..(p + 1) * h].to_vec());
    // dW_p [h, h] = dqkv_p^T x ; dx = dsum1 + sum_p dqkv_p W_p
    let dwqkv = [0, 1, 2].map(|p| {
        wants(p).then(|| product_new((h, h, rows), (&dqkv[p * h..], 1, 3 * h), (x, h, 1)))
    });
    let mut dx = dsum1;
    for (p, wp) in w.wqkv.iter().enumerate() {
        product(
            (rows, h, h),
            (&mut dx, h),
            true,
            (&dqkv[p * h..], 3 * h, 1),
            (wp, h, 1),
        );
        w.lora.backward(
            p,
            (x, h),
            places,
            ((&dqkv[p * h..], 3 * h), &mut dx),
            &mut lora_grads,
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
        dscores,
        drelative,
        lora: lora_grads,
    })
}
