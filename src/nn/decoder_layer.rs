//! A whole decoder layer (Qwen3, Qwen2, Llama, Mistral, Gemma3) as one graph node with its
//! backward written out, on the packed real tokens: wherever a batch is padded (decoders
//! pad on the left), only its real tokens are computed, and each token's rotary position
//! is its place among its text's real tokens.
//!
//! ```text
//! n1   = RMSNorm(x)                                  (every norm: x r (offset + w))
//! qkv  = n1 [W_q; W_k; W_v]^T (+ b)                  (one buffer, three products)
//! q, k = rotary(RMSNorm_head(q), RMSNorm_head(k))    (q/k norms where the family has them;
//!                                                      in place, head by head)
//! ctx  = attention(q, k, v)                          (super::attention_grouped: grouped KV
//!                                                      heads, causal or windowed blocks)
//! a    = ctx W_o^T (+ b)            (Gemma: RMSNorm(a))
//! x1   = x + a
//! up   = RMSNorm(x1) [W_gate; W_up]^T (+ b) = [g, u]
//! m    = (act(g) u) W_down^T (+ b)  (Gemma: RMSNorm(m))
//! y    = x1 + m
//! ```
//!
//! The forward keeps the input, the query-key-value projections before their norms and
//! rotation (`(heads + 2 kv_heads) d` per token), the probabilities (unless
//! `attention.probs` is recomputed), the context, Gemma's two norm inputs, `x1` and `up`;
//! the backward recomputes the norms' outputs, the normalised and rotated queries and keys
//! and the gated activation with the forward's arithmetic. Parameter gradients go into the
//! open gradient sink; a frozen weight (not a variable) gets none.

use std::borrow::Cow;

use candle_core::{DType, Tensor};

use super::attention_grouped::{self as grouped, Grouped, Pattern, Sequences};
use super::blocks::{for_blocks, Float, BLOCK_ROWS};
use super::fused::AttentionSpec;
use super::gated::{glu_rows, glu_rows_backward, rotate_head};
use super::gemm::{bias_rows, column_sums, linear, product, product_new};
use super::math::Act;
use super::node::node_n_owned;
use super::packing::{Packing, View};
use super::rows::{rms, rms_backward, rms_heads, rms_heads_backward};

/// A projection's weight and bias, when it has one.
pub type Projection = (Tensor, Option<Tensor>);

/// The weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderWeights<'a> {
    /// RMSNorm before the attention `[h]`.
    pub input_norm: &'a Tensor,
    /// Query projection `[heads d, h]`.
    pub q: Projection,
    /// Key projection `[kv_heads d, h]`.
    pub k: Projection,
    /// Value projection `[kv_heads d, h]`.
    pub v: Projection,
    /// Attention output projection `[h, heads d]`.
    pub o: Projection,
    /// Per-head RMSNorm of the queries `[d]`.
    pub q_norm: Option<&'a Tensor>,
    /// Per-head RMSNorm of the keys `[d]`.
    pub k_norm: Option<&'a Tensor>,
    /// Gemma's RMSNorm of the attention output `[h]`.
    pub post_attention_norm: Option<&'a Tensor>,
    /// RMSNorm before the feed-forward `[h]`.
    pub mlp_norm: &'a Tensor,
    /// The gate projection `[I, h]`.
    pub gate: Projection,
    /// The up projection `[I, h]`.
    pub up: Projection,
    /// The down projection `[h, I]`.
    pub down: Projection,
    /// Gemma's RMSNorm of the feed-forward output `[h]`.
    pub post_mlp_norm: Option<&'a Tensor>,
}

/// Slots of the weights, in node-input order.
const SLOTS: usize = 20;
mod slot {
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

/// A projection's weight and bias, borrowed.
fn parts(x: &Projection) -> (&Tensor, Option<&Tensor>) {
    (&x.0, x.1.as_ref())
}

impl DecoderWeights<'_> {
    fn slots(&self) -> [Option<&Tensor>; SLOTS] {
        let (q, k, v, o) = (
            parts(&self.q),
            parts(&self.k),
            parts(&self.v),
            parts(&self.o),
        );
        let (g, u, d) = (parts(&self.gate), parts(&self.up), parts(&self.down));
        [
            Some(self.input_norm),
            Some(q.0),
            q.1,
            Some(k.0),
            k.1,
            Some(v.0),
            v.1,
            Some(o.0),
            o.1,
            self.q_norm,
            self.k_norm,
            self.post_attention_norm,
            Some(self.mlp_norm),
            Some(g.0),
            g.1,
            Some(u.0),
            u.1,
            Some(d.0),
            d.1,
            self.post_mlp_norm,
        ]
    }
}

/// Everything of a decoder layer besides its weights.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (a divisor of `heads`).
    pub kv_heads: usize,
    /// The gate's activation.
    pub act: Act,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Added to every norm's weight (Gemma's `1 + w`: 1; else 0).
    pub offset: f64,
    /// The key mask `[n, 1, 1, s]`, scale, dropout on the probabilities, their recompute,
    /// and the sliding window (see [`Self::causal`]).
    pub attention: AttentionSpec,
    /// Causal attention (`j <= i`; a window `w` then keeps `i - w <= j`), else
    /// bidirectional (a window keeps `|i - j| <= w`).
    pub causal: bool,
    /// The rotary tables `(cos, sin)` of positions `0..s`, `[s, d]` each.
    pub rotary: (Tensor, Tensor),
}

/// The sizes of a layer applied to a batch.
#[derive(Debug, Clone, Copy)]
struct Shape {
    n: usize,
    s: usize,
    h: usize,
    inter: usize,
    grouped: Grouped,
}

impl Shape {
    /// Query width `heads d`.
    fn qd(&self) -> usize {
        self.grouped.heads * self.grouped.d
    }

    /// Key (and value) width `kv_heads d`.
    fn kd(&self) -> usize {
        self.grouped.kv_heads * self.grouped.d
    }

    /// The length of each slot's values.
    fn slot_len(&self, slot: usize) -> usize {
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

/// The layer on `x` `[n, s, h]` (CPU, f32 or f64): one node over `x` and the weights, or
/// the plain forward when none of them is tracked. `None` when the spec's shapes are not
/// this node's (the caller then runs the layer op by op).
pub fn decoder_layer(
    x: &Tensor,
    w: &DecoderWeights,
    spec: &DecoderSpec,
) -> candle_core::Result<Option<Tensor>> {
    let (n, s, h) = x.dims3()?;
    let (heads, kv_heads) = (spec.heads, spec.kv_heads);
    let d = spec.rotary.0.dim(1)?;
    let (inter, h2) = w.gate.0.dims2()?;
    let dims = Shape {
        n,
        s,
        h,
        inter,
        grouped: Grouped { heads, kv_heads, d },
    };
    let fits = heads > 0
        && kv_heads > 0
        && heads % kv_heads == 0
        && d % 2 == 0
        && h2 == h
        && spec.rotary.0.dims() == [s, d]
        && spec.rotary.1.dims() == [s, d]
        && spec.attention.bias.elem_count() == n * s
        && w.slots()
            .iter()
            .enumerate()
            .all(|(i, t)| t.is_none_or(|t| t.elem_count() == dims.slot_len(i)))
        && w.q.0.dims() == [dims.qd(), h]
        && w.down.0.dims() == [h, inter];
    if !fits {
        candle_core::bail!(
            "decoder layer: hidden size {h}, {heads} query and {kv_heads} key-value heads of \
             {d}, feed-forward {inter}: the weights or the rotary tables {:?} do not fit",
            spec.rotary.0.dims()
        );
    }
    let tracked = x.track_op() || w.slots().iter().flatten().any(|t| t.track_op());
    Ok(Some(match x.dtype() {
        DType::F32 => layer::<f32>(x, w, spec, dims, tracked)?,
        DType::F64 => layer::<f64>(x, w, spec, dims, tracked)?,
        other => candle_core::bail!("decoder layer: runs in f32 or f64, not {other:?}"),
    }))
}

/// The weights, detached and contiguous (views of the variables: no copy).
struct Weights([Option<Tensor>; SLOTS]);

impl Weights {
    fn new(w: &DecoderWeights) -> candle_core::Result<Self> {
        let mut out: [Option<Tensor>; SLOTS] = Default::default();
        for (o, t) in out.iter_mut().zip(w.slots()) {
            *o = t.map(|t| t.detach().contiguous()).transpose()?;
        }
        Ok(Self(out))
    }

    /// Runs `f` on the weights' values; a missing bias reads as zeros (a missing norm is
    /// not read).
    fn read<T: Float, R>(
        &self,
        dims: Shape,
        f: impl FnOnce(&[&[T]; SLOTS]) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let views = self
            .0
            .iter()
            .map(|t| t.as_ref().map(View::new).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let longest = (0..SLOTS).map(|i| dims.slot_len(i)).max().unwrap_or(0);
        let zeros = vec![T::zero(); longest];
        let mut v: [&[T]; SLOTS] = [&[]; SLOTS];
        for (slot, view) in views.iter().enumerate() {
            v[slot] = match view {
                Some(view) => view.values::<T>()?,
                None => &zeros[..dims.slot_len(slot)],
            };
        }
        f(&v)
    }
}

/// What the forward keeps for the backward.
struct Kept<T> {
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
struct Chunk<T> {
    packing: Packing,
    seqs: Sequences,
    /// Each packed row's place among its text's real tokens (its rotary position).
    positions: Vec<usize>,
    cos: Vec<T>,
    sin: Vec<T>,
    params: grouped::Params,
    /// Which norms the layer has: q/k norms, Gemma's post norms.
    qk_norm: bool,
    post_norms: bool,
}

fn layer<T: Float>(
    x: &Tensor,
    w: &DecoderWeights,
    spec: &DecoderSpec,
    dims: Shape,
    tracked: bool,
) -> candle_core::Result<Tensor> {
    let xd = x.detach().contiguous()?;
    let weights = Weights::new(w)?;
    let bias = spec.attention.bias.to_dtype(x.dtype())?.contiguous()?;
    let packing = Packing::real(View::new(&bias)?.values::<T>()?, dims.n, dims.s);
    let rows = &packing.rows;
    let shift = rows
        .starts
        .iter()
        .enumerate()
        .map(|(b, &start)| packing.padded.get(start).map_or(0, |&p| p - b * dims.s))
        .collect();
    let positions = rows
        .queries
        .iter()
        .flat_map(|&len| 0..len)
        .collect::<Vec<_>>();
    let table = |t: &Tensor| -> candle_core::Result<Vec<T>> {
        t.to_dtype(x.dtype())?.flatten_all()?.to_vec1()
    };
    let chunk = Chunk {
        seqs: Sequences {
            starts: rows.starts.clone(),
            lengths: rows.queries.clone(),
            shift,
            s: dims.s,
        },
        positions,
        cos: table(&spec.rotary.0)?,
        sin: table(&spec.rotary.1)?,
        params: grouped::Params {
            scale: spec.attention.scale,
            dropout: spec.attention.dropout,
            pattern: Pattern {
                causal: spec.causal,
                window: spec.attention.window,
            },
        },
        qk_norm: w.q_norm.is_some() && w.k_norm.is_some(),
        post_norms: w.post_attention_norm.is_some() && w.post_mlp_norm.is_some(),
        packing,
    };
    let padded_rows = dims.n * dims.s;
    let (out, kept) = weights.read::<T, _>(dims, |wv| {
        let xv = View::new(&xd)?;
        let xp = chunk.packing.gather(xv.values::<T>()?, dims.h);
        Ok(forward(&xp, wv, &chunk, spec, dims, tracked))
    })?;
    let out = chunk.packing.scatter(out, padded_rows, dims.h);
    let shape = (dims.n, dims.s, dims.h);
    let Some(kept) = kept else {
        return Tensor::from_vec(out, shape, x.device());
    };
    let slots = w.slots().map(|t| t.cloned());
    let mut inputs = vec![x];
    inputs.extend(w.slots().into_iter().flatten());
    let spec = spec.clone();
    node_n_owned(
        "gradcache-decoder-layer",
        &inputs,
        out,
        shape.into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let grads = weights.read::<T, _>(dims, |wv| {
                let (xv, dyv) = (View::new(&xd)?, View::new(&dy)?);
                let xp = chunk.packing.gather(xv.values::<T>()?, dims.h);
                let dyp = chunk.packing.gather(dyv.values::<T>()?, dims.h);
                Ok(backward(&xp, &dyp, wv, &chunk, &spec, dims, &kept))
            })?;
            let dx = chunk.packing.scatter(grads.dx, padded_rows, dims.h);
            let mut out = vec![Some(Tensor::from_vec(
                dx,
                shape,
                &candle_core::Device::Cpu,
            )?)];
            // Into the open gradient sink, or to candle when none is open; a weight that
            // is not a variable (frozen) gets none.
            for (param, g) in slots.iter().zip(grads.slots) {
                if let Some(param) = param {
                    out.push(match param.is_variable() || param.track_op() {
                        true => crate::sink::deposit(param, g)?,
                        false => None,
                    });
                }
            }
            Ok(out)
        }),
    )
}

/// The query-key-value projections of the packed rows `n1` `[rows, h]`, side by side in
/// one `[rows, (heads + 2 kv_heads) d]` buffer, biases pre-filled.
fn project<T: Float>(n1: &[T], w: &[&[T]; SLOTS], dims: Shape, rows: usize) -> Vec<T> {
    let (h, qd, kd) = (dims.h, dims.qd(), dims.kd());
    let width = dims.grouped.width();
    let mut qkv = bias_rows(&[w[slot::WQ + 1], w[slot::WK + 1], w[slot::WV + 1]], rows);
    for (col, (wp, out)) in [
        (0, (w[slot::WQ], qd)),
        (qd, (w[slot::WK], kd)),
        (qd + kd, (w[slot::WV], kd)),
    ] {
        product(
            (rows, out, h),
            (&mut qkv[col..], width),
            true,
            (n1, h, 1),
            (wp, 1, h),
        );
    }
    qkv
}

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

/// The queries and keys as the attention reads them: normalised and rotated.
fn prepared<T: Float>(
    qkv: &mut [T],
    w: &[&[T]; SLOTS],
    chunk: &Chunk<T>,
    spec: &DecoderSpec,
    dims: Shape,
) {
    let (width, d) = (dims.grouped.width(), dims.grouped.d);
    let off = T::of(spec.offset);
    if chunk.qk_norm {
        let (hq, hk) = (dims.grouped.heads, dims.grouped.kv_heads);
        rms_heads(qkv, width, (0, hq, d), w[slot::Q_NORM], spec.eps, off);
        rms_heads(qkv, width, (hq * d, hk, d), w[slot::K_NORM], spec.eps, off);
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
fn forward<T: Float>(
    x: &[T],
    w: &[&[T]; SLOTS],
    chunk: &Chunk<T>,
    spec: &DecoderSpec,
    dims: Shape,
    keep: bool,
) -> (Vec<T>, Option<Kept<T>>) {
    let (rows, h, i, qd) = (chunk.packing.total(), dims.h, dims.inter, dims.qd());
    let (eps, off) = (spec.eps, T::of(spec.offset));
    let n1 = rms(x, w[slot::IN_NORM], eps, off);
    let mut qkv = project(&n1, w, dims, rows);
    drop(n1);
    let raw = keep.then(|| qkv.clone());
    prepared(&mut qkv, w, chunk, spec, dims);
    let (ctx, probs) = grouped::forward(
        &qkv,
        (dims.grouped, &chunk.seqs),
        &chunk.params,
        keep && !spec.attention.recompute,
    );
    drop(qkv);
    let a = linear(&ctx, w[slot::WO], w[slot::WO + 1], rows, qd);
    let (x1, a) = if chunk.post_norms {
        let normed = rms(&a, w[slot::POST_ATTN], eps, off);
        (added(x, &normed), Some(a))
    } else {
        (added(x, &a), None)
    };
    let n2 = rms(&x1, w[slot::MLP_NORM], eps, off);
    let mut up = bias_rows(&[w[slot::WG + 1], w[slot::WU + 1]], rows);
    for (col, wp) in [(0, w[slot::WG]), (i, w[slot::WU])] {
        product(
            (rows, i, h),
            (&mut up[col..], 2 * i),
            true,
            (&n2, h, 1),
            (wp, 1, h),
        );
    }
    drop(n2);
    let g = glu_rows(&up, spec.act, i);
    let m = linear(&g, w[slot::WD], w[slot::WD + 1], rows, i);
    drop(g);
    let (y, m) = if chunk.post_norms {
        let normed = rms(&m, w[slot::POST_MLP], eps, off);
        (added(&x1, &normed), Some(m))
    } else {
        (added(&x1, &m), None)
    };
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

/// Every gradient: of the input and of the slots (a missing one's is unused).
struct Grads<T> {
    dx: Vec<T>,
    slots: [Vec<T>; SLOTS],
}

/// The backward pass from `dy`.
fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    w: &[&[T]; SLOTS],
    chunk: &Chunk<T>,
    spec: &DecoderSpec,
    dims: Shape,
    kept: &Kept<T>,
) -> Grads<T> {
    let (rows, h, i, qd, kd) = (
        chunk.packing.total(),
        dims.h,
        dims.inter,
        dims.qd(),
        dims.kd(),
    );
    let (eps, off) = (spec.eps, T::of(spec.offset));
    let width = dims.grouped.width();
    let mut slots: [Vec<T>; SLOTS] = Default::default();
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
    let g = glu_rows(&kept.up, spec.act, i);
    slots[slot::WD] = product_new((h, i, rows), (&dm, 1, h), (&g, i, 1));
    drop(g);
    let dg = product_new((rows, i, h), (&dm, h, 1), (w[slot::WD], i, 1));
    drop(dm);
    let dup = glu_rows_backward(&kept.up, &dg, spec.act, i);
    drop(dg);
    let sums = column_sums(&dup, 2 * i);
    slots[slot::WG + 1] = sums[..i].to_vec();
    slots[slot::WU + 1] = sums[i..].to_vec();
    let n2 = rms(&kept.x1, w[slot::MLP_NORM], eps, off);
    slots[slot::WG] = product_new((i, h, rows), (&dup, 1, 2 * i), (&n2, h, 1));
    slots[slot::WU] = product_new((i, h, rows), (&dup[i..], 1, 2 * i), (&n2, h, 1));
    drop(n2);
    let mut dn2 = product_new((rows, h, i), (&dup, 2 * i, 1), (w[slot::WG], h, 1));
    product(
        (rows, h, i),
        (&mut dn2, h),
        true,
        (&dup[i..], 2 * i, 1),
        (w[slot::WU], h, 1),
    );
    drop(dup);
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
    slots[slot::WO] = product_new((h, qd, rows), (&da, 1, h), (&kept.ctx, qd, 1));
    let dctx = product_new((rows, qd, h), (&da, h, 1), (w[slot::WO], qd, 1));
    drop(da);
    // The attention, on the normalised and rotated queries and keys (recomputed).
    let mut att = kept.qkv.clone();
    prepared(&mut att, w, chunk, spec, dims);
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
        (slot::WQ, 0, qd),
        (slot::WK, qd, kd),
        (slot::WV, qd + kd, kd),
    ];
    for (s, col, out) in parts {
        slots[s] = product_new((out, h, rows), (&dqkv[col..], 1, width), (&n1, h, 1));
    }
    drop(n1);
    let mut dn1 = vec![T::zero(); rows * h];
    for (s, col, out) in parts {
        product(
            (rows, h, out),
            (&mut dn1, h),
            true,
            (&dqkv[col..], width, 1),
            (w[s], h, 1),
        );
    }
    drop(dqkv);
    let (dxn, dw) = rms_backward(x, w[slot::IN_NORM], &dn1, eps, off);
    slots[slot::IN_NORM] = dw;
    let dx = added(&dx1, &dxn);
    Grads { dx, slots }
}
