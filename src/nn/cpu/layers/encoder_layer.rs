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

use super::attention::{self as kernel, KeyMask};
use super::blocks::Float;
use super::gemm::{
    bias_rows, column_sums, product, product_new, weight_product, weight_product_new,
};
use super::lora_branch::{node_inputs, AdapterGrads, Branches, LoraInput, NodeWeights};
use super::math::Act;
use super::packed_attention::{attend, attention_backward};
use super::packing::{Packing, View};
use super::rows::{
    activate, activate_in_place, activate_with_slope, add_norm, add_norm_output, dropped, norm,
    norm_backward, times_slope,
};
use super::transposed::weight_rhs;
use super::AttentionSpec;
use crate::nn::node::node_n_owned;

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
    /// LoRA adapters of the query, key, value, attention output, up and down projections
    /// (the low-rank branch inside the node, see [`super::lora_branch`]); their base
    /// weights above are then the stored ones, frozen.
    pub lora: [Option<LoraInput>; 6],
}

/// The projections' shapes `(in, out)` in the order of [`LayerWeights::lora`].
fn projection_shapes(h: usize, inter: usize) -> [(usize, usize); 6] {
    [(h, h), (h, h), (h, h), (h, h), (h, inter), (inter, h)]
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
    /// A bias added to the attention scores of every sequence, `heads * s * s` values
    /// (`[1, heads, s, s]`; MPNet's relative position bias): an input of the node, which
    /// gives it its gradient (summed over the sequences).
    pub score_bias: Option<Tensor>,
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
        && w.intermediate.1.dims() == [inter]
        && w.lora
            .iter()
            .zip(projection_shapes(h, inter))
            .all(|(l, (i, o))| l.as_ref().is_none_or(|l| l.fits(i, o)));
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
    if let Some(scores) = &spec.score_bias {
        if scores.elem_count() != heads * s * s {
            candle_core::bail!(
                "encoder layer: score bias {:?} does not fit {heads} heads of {s} tokens",
                scores.dims()
            );
        }
    }
    let tracked = x.track_op()
        || w.all().iter().any(|t| t.track_op())
        || w.lora
            .iter()
            .flatten()
            .any(|l| l.a.track_op() || l.b.track_op())
        || spec.score_bias.as_ref().is_some_and(|t| t.track_op());
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

    fn kernel(&self) -> kernel::Dims {
        kernel::Dims {
            n: self.n,
            heads: self.heads,
            s: self.s,
            d: self.d,
        }
    }
}

/// The sixteen weights and the adapters, held by the node.
struct Weights<T>(NodeWeights<T, 16, 6>);

impl<T: Float> Weights<T> {
    fn new(w: &LayerWeights) -> candle_core::Result<Self> {
        Ok(Self(NodeWeights::new(w.all().map(Some), &w.lora)?))
    }

    /// Runs `f` on the weights' values.
    fn read<R>(&self, f: impl FnOnce(&W<T>) -> candle_core::Result<R>) -> candle_core::Result<R> {
        let views = self
            .0
            .slots
            .iter()
            .flatten()
            .map(View::new)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let v = |i: usize| views[i].values::<T>();
        let values = (0..16).map(v).collect::<candle_core::Result<Vec<_>>>()?;
        let copies = self.0.transposed(lora::WEIGHT, &values);
        let w = W {
            wants: self.0.wants,
            wt: std::array::from_fn(|p| copies[p].as_deref().map(|c| &c[..])),
            lora: self.0.branches(),
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
    /// Which weights take a gradient (a frozen one's is not computed).
    wants: [bool; 16],
    /// Transposed copies of `W_q, W_k, W_v, W_o, W_i, W_d` (`[in, out]`) where an
    /// inference keeps them ([`super::transposed`]): the forward's products read these.
    wt: [Option<&'a [T]>; 6],
    /// The adapters' branches, in the order of [`LayerWeights::lora`].
    lora: Branches<'a, T, 6>,
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
    let weights = Weights::<T>::new(w)?;
    let bias = spec.attention.bias.contiguous()?;
    if bias.elem_count() != dims.n * dims.s {
        candle_core::bail!(
            "encoder layer: key mask {:?} does not fit {} sequences of {} tokens",
            bias.dims(),
            dims.n,
            dims.s
        );
    }
    let mut mask = KeyMask::new(View::new(&bias)?.values::<T>()?, dims.n, dims.s);
    if let Some(scores) = &spec.score_bias {
        let scores = scores.to_dtype(x.dtype())?.contiguous()?;
        mask = mask.with_scores(View::new(&scores)?.values::<T>()?);
    }
    let packing = Packing::new(&mask, dims.n, dims.s);
    let dims = Shape {
        rows: packing.total(),
        ..dims
    };
    let padded_rows = dims.n * dims.s;
    let (out, kept) = weights.read(|wv| {
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
    let adapters: Vec<Option<Tensor>> = node_inputs(&[], &w.lora)
        .into_iter()
        .map(|t| t.cloned())
        .collect();
    let mut inputs = vec![x];
    inputs.extend(w.all());
    if let Some(scores) = &spec.score_bias {
        inputs.push(scores);
    }
    inputs.extend(node_inputs(&[], &w.lora).into_iter().flatten());
    let score_bias = spec.score_bias.clone();
    let spec = spec.clone();
    node_n_owned(
        "gradcache-encoder-layer",
        &inputs,
        out,
        shape.into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let grads = weights.read(|wv| {
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
                dwq,
                dwk,
                dwv,
                Some(dbq),
                Some(dbk),
                Some(dbv),
                grads.dwo,
                Some(grads.dbo),
                Some(grads.dg1),
                Some(grads.db1),
                grads.dwi,
                Some(grads.dbi),
                grads.dwd,
                Some(grads.dbd),
                Some(grads.dg2),
                Some(grads.db2),
            ];
            // Into the open gradient sink, or to candle when none is open.
            for (param, g) in params.iter().zip(all) {
                out.push(crate::sink::deposit_wanted(param, g)?);
            }
            if let (Some(scores), Some(g)) = (&score_bias, grads.dscores) {
                // Not a variable: the gradient goes back through the graph that made it.
                let g = Tensor::from_vec(g, scores.shape(), &candle_core::Device::Cpu)?;
                out.push(Some(g.to_dtype(scores.dtype())?));
            }
            for (param, g) in adapters.iter().zip(grads.lora.flat()) {
                if let Some(param) = param {
                    out.push(crate::sink::deposit(param, g)?);
                }
            }
            Ok(out)
        }),
    )
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

/// Indices into [`LayerWeights::lora`] and, for the weights, into their node-input order.
mod lora {
    pub const OUTPUT: usize = 3;
    pub const UP: usize = 4;
    pub const DOWN: usize = 5;
    /// The weights' own indices among the sixteen: `W_q, W_k, W_v, W_o, W_i, W_d`.
    pub const WEIGHT: [usize; 6] = [0, 1, 2, 6, 10, 12];
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
    let qkv = qkv(x, w, rows, h, places);
    let (ctx, probs) = attend(
        &qkv,
        (mask, &packing.rows),
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
struct Grads<T> {
    dx: Vec<T>,
    dwqkv: [Option<Vec<T>>; 3],
    dbqkv: [Vec<T>; 3],
    dwo: Option<Vec<T>>,
    dbo: Vec<T>,
    dg1: Vec<T>,
    db1: Vec<T>,
    dwi: Option<Vec<T>>,
    dbi: Vec<T>,
    dwd: Option<Vec<T>>,
    dbd: Vec<T>,
    dg2: Vec<T>,
    db2: Vec<T>,
    /// The score bias's, `[heads, s, s]`, when the layer has one.
    dscores: Option<Vec<T>>,
    /// The adapters' `(dA, dB)`, in the order of [`LayerWeights::lora`].
    lora: AdapterGrads<T, 6>,
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
    // Attention.
    let (dqkv, dscores) = attention_backward(
        &kept.qkv,
        kept.probs.as_deref(),
        &dctx,
        (mask, &packing.rows),
        &spec.attention,
        dims.kernel(),
        spec.score_bias.is_some(),
    );
    drop(dctx);
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
        lora: lora_grads,
    })
}
