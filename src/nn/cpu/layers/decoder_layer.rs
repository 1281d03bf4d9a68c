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
//! ctx  = attention(q, k, v)                          (attention::grouped: grouped KV
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

use candle_core::{DType, Tensor};

use crate::nn::cpu::attention::grouped::{self as grouped, Grouped, Pattern, Sequences};
use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::layers::decoder_passes::{
    backward, forward, lora, Adapters, Chunk, Shape, SLOTS,
};
use crate::nn::cpu::layers::packing::{packed_layer, Packing, View};
use crate::nn::cpu::products::lora_branch::{node_inputs, LoraInput, NodeWeights};
use crate::nn::cpu::AttentionSpec;

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
    /// LoRA adapters of the q, k, v, o, gate, up and down projections (the low-rank
    /// branch inside the node, see `crate::nn::cpu::products::lora_branch`); their base weights
    /// above are then the stored ones, frozen, read widened where stored narrower.
    pub lora: [Option<LoraInput>; 7],
}

/// A projection's weight and bias, borrowed.
fn parts(x: &Projection) -> (&Tensor, Option<&Tensor>) {
    (&x.0, x.1.as_ref())
}

impl DecoderWeights<'_> {
    /// The projections' shapes `(in, out)` in the order of [`Self::lora`].
    fn projection_shapes(dims: Shape) -> [(usize, usize); 7] {
        let (h, i, qd, kd) = (dims.h, dims.inter, dims.qd(), dims.kd());
        [(h, qd), (h, kd), (h, kd), (qd, h), (h, i), (h, i), (i, h)]
    }

    /// The node's weights: the slots, then the adapters'.
    fn inputs(&self) -> Vec<Option<&Tensor>> {
        node_inputs(&self.slots(), &self.lora)
    }

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
    /// Only each text's last real token's output is wanted (the last layer under
    /// last-token pooling): the node runs the queries, the attention output and the
    /// feed-forward on those rows alone, every row still a key and a value, and passes
    /// the other rows' input through; their output is not the layer's. The op-by-op layer
    /// computes every row (the same values at the last ones).
    pub last_token_only: bool,
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
        && w.down.0.dims() == [h, inter]
        && w.lora
            .iter()
            .zip(DecoderWeights::projection_shapes(dims))
            .all(|(l, (i, o))| l.as_ref().is_none_or(|l| l.fits(i, o)));
    if !fits {
        candle_core::bail!(
            "decoder layer: hidden size {h}, {heads} query and {kv_heads} key-value heads of \
             {d}, feed-forward {inter}: the weights or the rotary tables {:?} do not fit",
            spec.rotary.0.dims()
        );
    }
    let tracked = x.track_op() || w.inputs().iter().flatten().any(|t| t.track_op());
    Ok(Some(match x.dtype() {
        DType::F32 => layer::<f32>(x, w, spec, dims, tracked)?,
        DType::F64 => layer::<f64>(x, w, spec, dims, tracked)?,
        other => candle_core::bail!("decoder layer: runs in f32 or f64, not {other:?}"),
    }))
}

/// The weights held by the node.
struct Weights<T>(NodeWeights<T, SLOTS, 7>);

impl<T: Float> Weights<T> {
    fn new(w: &DecoderWeights) -> candle_core::Result<Self> {
        Ok(Self(NodeWeights::new(w.slots(), &w.lora)?))
    }

    /// Runs `f` on the weights' values (a missing bias reads as zeros, a missing norm is
    /// not read) and the adapters.
    fn read<R>(
        &self,
        dims: Shape,
        f: impl FnOnce(&[&[T]; SLOTS], &Adapters<T>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let views = self
            .0
            .slots
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
        let copies = self.0.transposed(lora::WEIGHT, &v);
        let adapters = Adapters {
            branches: self.0.branches(),
            copies: std::array::from_fn(|p| copies[p].as_deref().map(|c| &c[..])),
            wants: self.0.wants,
        };
        f(&v, &adapters)
    }
}

fn layer<T: Float>(
    x: &Tensor,
    w: &DecoderWeights,
    spec: &DecoderSpec,
    dims: Shape,
    tracked: bool,
) -> candle_core::Result<Tensor> {
    let weights = Weights::<T>::new(w)?;
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
    // With last-token pooling reading this layer's output: each text's last row alone.
    let last = spec.last_token_only;
    let queries_from = rows
        .queries
        .iter()
        .map(|&len| if last { len.saturating_sub(1) } else { 0 })
        .collect();
    let pooled = last.then(|| {
        rows.starts
            .iter()
            .zip(&rows.queries)
            .filter(|(_, &len)| len > 0)
            .map(|(&start, &len)| start + len - 1)
            .collect()
    });
    let chunk = Chunk {
        seqs: Sequences {
            starts: rows.starts.clone(),
            lengths: rows.queries.clone(),
            shift,
            s: dims.s,
            queries_from,
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
        act: spec.act,
        eps: spec.eps,
        offset: spec.offset,
        recompute_probs: spec.attention.recompute,
        pooled,
    };
    // Read by the forward, then owned by the backward.
    let shared = std::sync::Arc::new((weights, chunk));
    let owned = std::sync::Arc::clone(&shared);
    packed_layer(
        "gradcache-decoder-layer",
        x,
        &w.inputs(),
        packing,
        |xp, packing| {
            let (weights, chunk) = &*shared;
            weights.read(dims, |wv, ad| {
                Ok(forward(xp, (wv, ad), (packing, chunk), dims, tracked))
            })
        },
        move |xp, dyp, packing, kept| {
            let (weights, chunk) = &*owned;
            weights.read(dims, |wv, ad| {
                let grads = backward(xp, dyp, (wv, ad), (packing, chunk), dims, kept);
                let all = grads.slots.into_iter().chain(grads.lora.flat()).collect();
                Ok((grads.dx, all))
            })
        },
    )
}
