//! A decoder layer (Qwen3, Qwen2, Llama, Mistral, Gemma3) as one node for the GPU, on the
//! padded chunk (each token's rotary position its place among its text's real tokens).
//!
//! ```text
//! n1  = RMSNorm(x)                              (every norm: x r (offset + w))
//! qkv = n1 [W_q; W_k; W_v]^T                    one product
//! q0, k0, v = heads(qkv + b)                    [n, heads, s, d], [n, kv_heads, s, d]
//! q, k = rotary(RMSNorm_d(q0)), rotary(RMSNorm_d(k0))   (the q/k norms where the family has them)
//! p   = softmax(scale q k^T + mask + pattern)   grouped: each key-value head's product
//!                                               takes its query heads' rows at once
//! ctx = merge(dropout(p) v)
//! a   = ctx W_o^T (+ b)        (Gemma: RMSNorm(a))
//! x1  = x + a
//! up  = RMSNorm(x1) [W_gate; W_up]^T (+ b)     one product, [g, u]
//! m   = (act(g) u) W_down^T (+ b)   (Gemma: RMSNorm(m))
//! y   = x1 + m
//! ```
//!
//! Kept per token: `x`, `q0`, `k0`, `v` (before their norms and rotation), the
//! probabilities (`heads * s`, unless `attention.probs` is recomputed), the context,
//! Gemma's two norm inputs, `x1` and `up`, and every norm's row statistic; the norms'
//! outputs, the rotated queries and keys and the gated activation are recomputed in the
//! backward with the forward's kernels. Every product runs in the activations' dtype with
//! f32 accumulation; a weight's gradient returns in the weight's dtype (none for a frozen
//! one). A LoRA adapter on a projection adds its low-rank branch (`super::lora`) beside
//! the frozen base weight.

use candle_core::{DType, Tensor};

use super::attention::Attention;
use super::lora::Adapter;
use crate::nn::cpu::decoder_layer::{DecoderSpec, DecoderWeights};
use crate::nn::kernels::{self as k, acc};
use crate::nn::lora::LoraInput;
use crate::nn::node::node_n;

/// The layer on `x` `[n, s, h]` with each token's rotary position `positions` (`[n s]`
/// u32): one node over `x` and the weights, or the output alone when nothing is tracked.
pub fn decoder_layer(
    x: &Tensor,
    w: &DecoderWeights,
    spec: &DecoderSpec,
    positions: &Tensor,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let (heads, kv_heads) = (spec.heads, spec.kv_heads);
    let d = spec.rotary.0.dim(1)?;
    let (inter, h2) = w.gate.0.dims2()?;
    let dims = Dims {
        n,
        s,
        h,
        heads,
        kv_heads,
        d,
    };
    let bias_fits =
        |p: &(Tensor, Option<Tensor>), out: usize| p.1.as_ref().is_none_or(|b| b.dims() == [out]);
    let fits = heads > 0
        && kv_heads > 0
        && heads % kv_heads == 0
        && d % 2 == 0
        && h2 == h
        && spec.rotary.1.dims() == spec.rotary.0.dims()
        && spec.attention.bias.elem_count() == n * s
        && positions.elem_count() == n * s
        && w.input_norm.dims() == [h]
        && w.mlp_norm.dims() == [h]
        && w.q.0.dims() == [dims.qd(), h]
        && w.k.0.dims() == [dims.kd(), h]
        && w.v.0.dims() == [dims.kd(), h]
        && w.o.0.dims() == [h, dims.qd()]
        && w.up.0.dims() == [inter, h]
        && w.down.0.dims() == [h, inter]
        && bias_fits(&w.q, dims.qd())
        && bias_fits(&w.k, dims.kd())
        && bias_fits(&w.v, dims.kd())
        && bias_fits(&w.o, h)
        && bias_fits(&w.gate, inter)
        && bias_fits(&w.up, inter)
        && bias_fits(&w.down, h)
        && [w.q_norm, w.k_norm]
            .iter()
            .flatten()
            .all(|t| t.dims() == [d])
        && [w.post_attention_norm, w.post_mlp_norm]
            .iter()
            .flatten()
            .all(|t| t.dims() == [h]);
    if !fits {
        candle_core::bail!(
            "decoder layer: hidden size {h}, {heads} query and {kv_heads} key-value heads of \
             {d}, feed-forward {inter}: the weights, the rotary tables {:?} or the positions \
             {:?} do not fit",
            spec.rotary.0.dims(),
            positions.dims()
        );
    }
    let shapes = [
        (h, dims.qd()),
        (h, dims.kd()),
        (h, dims.kd()),
        (dims.qd(), h),
        (h, inter),
        (h, inter),
        (inter, h),
    ];
    let adapter_fits = |l: &LoraInput, (i, o): (usize, usize)| {
        let r = l.a.dim(0).unwrap_or(0);
        l.a.dims() == [r, i] && l.b.dims() == [o, r]
    };
    if let Some(p) = (0..7).find(|&p| {
        w.lora[p]
            .as_ref()
            .is_some_and(|l| !adapter_fits(l, shapes[p]))
    }) {
        candle_core::bail!(
            "decoder layer: the LoRA adapter of projection {p} does not fit its weight"
        );
    }
    let weights = Slots::of(w);
    let mut inputs: Vec<&Tensor> = vec![x];
    inputs.extend(weights.present());
    // Each adapter's A and B, after the weights: the index of its A among the inputs.
    let mut adapter_input = [None; 7];
    for (p, l) in w.lora.iter().enumerate() {
        if let Some(l) = l {
            adapter_input[p] = Some(inputs.len());
            inputs.extend([&l.a, &l.b]);
        }
    }
    let tracked = inputs.iter().any(|t| t.track_op());
    let adapters = (
        std::array::from_fn(|p| w.lora[p].as_ref().map(Adapter::new)),
        adapter_input,
    );
    let layer = Layer::new(x, &weights, spec, positions, dims, adapters)?;
    let (y, kept) = {
        let pass = if tracked { "replay" } else { "first-pass" };
        let _s = crate::profile::span(|| format!("node.decoder-layer.forward.{pass}"));
        layer.forward(tracked)?
    };
    let y = y.reshape((n, s, h))?;
    if !tracked {
        return Ok(y);
    }
    let wants: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
    let originals: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    node_n(
        "gradcache-gpu-decoder-layer",
        &inputs,
        y,
        Box::new(move |dy| {
            let _s = crate::profile::span(|| "node.decoder-layer.backward".into());
            let mut grads = layer.backward(dy, &kept, &wants)?;
            super::into_sink(&mut grads, &originals)?;
            Ok(grads)
        }),
    )
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) n: usize,
    pub(super) s: usize,
    pub(super) h: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) d: usize,
}

impl Dims {
    pub(super) fn qd(&self) -> usize {
        self.heads * self.d
    }

    pub(super) fn kd(&self) -> usize {
        self.kv_heads * self.d
    }

    pub(super) fn rows(&self) -> usize {
        self.n * self.s
    }
}

/// The layer's weights by slot (`None` where the family has none), in node-input order.
pub(super) const SLOTS: usize = 20;
pub(super) const IN_NORM: usize = 0;
pub(super) const WQ: usize = 1;
pub(super) const BQ: usize = 2;
pub(super) const WK: usize = 3;
pub(super) const BK: usize = 4;
pub(super) const WV: usize = 5;
pub(super) const BV: usize = 6;
pub(super) const WO: usize = 7;
pub(super) const BO: usize = 8;
pub(super) const Q_NORM: usize = 9;
pub(super) const K_NORM: usize = 10;
pub(super) const POST_ATTN: usize = 11;
pub(super) const MLP_NORM: usize = 12;
pub(super) const WG: usize = 13;
pub(super) const BG: usize = 14;
pub(super) const WU: usize = 15;
pub(super) const BU: usize = 16;
pub(super) const WD: usize = 17;
pub(super) const BD: usize = 18;
pub(super) const POST_MLP: usize = 19;

pub(super) struct Slots([Option<Tensor>; SLOTS]);

impl Slots {
    fn of(w: &DecoderWeights) -> Self {
        let c = |t: &Tensor| Some(t.clone());
        Self([
            c(w.input_norm),
            c(&w.q.0),
            w.q.1.clone(),
            c(&w.k.0),
            w.k.1.clone(),
            c(&w.v.0),
            w.v.1.clone(),
            c(&w.o.0),
            w.o.1.clone(),
            w.q_norm.cloned(),
            w.k_norm.cloned(),
            w.post_attention_norm.cloned(),
            c(w.mlp_norm),
            c(&w.gate.0),
            w.gate.1.clone(),
            c(&w.up.0),
            w.up.1.clone(),
            c(&w.down.0),
            w.down.1.clone(),
            w.post_mlp_norm.cloned(),
        ])
    }

    /// The present weights, in slot order (the node's inputs after `x`).
    fn present(&self) -> Vec<&Tensor> {
        self.0.iter().flatten().collect()
    }
}

/// Everything the layer computes with, detached.
pub(super) struct Layer {
    pub(super) x: Tensor,
    /// The LoRA adapters of the q, k, v, o, gate, up and down projections, and each one's
    /// `A` among the node's inputs.
    pub(super) adapters: [Option<Adapter>; 7],
    pub(super) adapter_input: [Option<usize>; 7],
    /// The weights by slot, detached (cast where they are used).
    pub(super) w: [Option<Tensor>; SLOTS],
    /// Each present slot's index among the node's inputs.
    pub(super) input_of: [Option<usize>; SLOTS],
    pub(super) key_bias: Tensor,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) positions: Tensor,
    pub(super) dims: Dims,
    pub(super) dtype: DType,
    pub(super) spec: DecoderSpec,
}

impl Layer {
    fn new(
        x: &Tensor,
        weights: &Slots,
        spec: &DecoderSpec,
        positions: &Tensor,
        dims: Dims,
        (adapters, adapter_input): ([Option<Adapter>; 7], [Option<usize>; 7]),
    ) -> candle_core::Result<Self> {
        let dtype = x.dtype();
        let a = acc(dtype);
        let mut input_of = [None; SLOTS];
        let mut next = 1;
        for (slot, w) in input_of.iter_mut().zip(&weights.0) {
            if w.is_some() {
                *slot = Some(next);
                next += 1;
            }
        }
        let mut spec = spec.clone();
        let (cos, sin) = (spec.rotary.0.to_dtype(a)?, spec.rotary.1.to_dtype(a)?);
        spec.rotary = (cos.clone(), sin.clone());
        Ok(Self {
            x: x.detach().contiguous()?.reshape((dims.rows(), dims.h))?,
            adapters,
            adapter_input,
            w: weights.0.clone().map(|w| w.map(|t| t.detach())),
            input_of,
            key_bias: spec
                .attention
                .bias
                .detach()
                .to_dtype(a)?
                .contiguous()?
                .reshape((dims.n, dims.s))?,
            cos,
            sin,
            positions: positions.to_dtype(DType::U32)?.flatten_all()?,
            dims,
            dtype,
            spec,
        })
    }

    /// Slot `i` in the activations' dtype (a projection) or in the norms' (a norm).
    pub(super) fn get(&self, i: usize, dtype: DType) -> candle_core::Result<Option<Tensor>> {
        self.w[i].as_ref().map(|t| t.to_dtype(dtype)).transpose()
    }

    pub(super) fn weight(&self, i: usize) -> candle_core::Result<Tensor> {
        self.get(i, self.dtype)?
            .ok_or_else(|| candle_core::Error::Msg(format!("decoder layer: no weight in slot {i}")))
    }

    pub(super) fn norm(&self, i: usize) -> candle_core::Result<Option<Tensor>> {
        self.get(i, acc(self.dtype))
    }

    /// Weights of `slots` stacked along their output rows (one product for several
    /// projections), and their biases stacked likewise (zeros for a missing one, `None`
    /// when none has one).
    fn stacked(&self, slots: &[(usize, usize)]) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let ws: Vec<Tensor> = slots
            .iter()
            .map(|&(w, _)| self.weight(w))
            .collect::<candle_core::Result<_>>()?;
        let w = Tensor::cat(&ws, 0)?;
        if slots.iter().all(|&(_, b)| self.w[b].is_none()) {
            return Ok((w, None));
        }
        let bs: Vec<Tensor> = slots
            .iter()
            .zip(&ws)
            .map(|(&(_, b), w)| match self.get(b, self.dtype)? {
                Some(b) => Ok(b),
                None => Tensor::zeros(w.dim(0)?, self.dtype, w.device()),
            })
            .collect::<candle_core::Result<_>>()?;
        Ok((w, Some(Tensor::cat(&bs, 0)?)))
    }

    pub(super) fn qkv(&self) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        self.stacked(&[(WQ, BQ), (WK, BK), (WV, BV)])
    }

    pub(super) fn gate_up(&self) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        self.stacked(&[(WG, BG), (WU, BU)])
    }

    pub(super) fn rms(&self, x: &Tensor, slot: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let w = self.norm(slot)?.ok_or_else(|| {
            candle_core::Error::Msg(format!("decoder layer: no norm in slot {slot}"))
        })?;
        k::rms_forward(x, &w, self.spec.eps, self.spec.offset)
    }

    /// A per-head norm (q/k) over `t` `[n, heads, s, d]`, when the family has it.
    fn head_norm(&self, t: &Tensor, slot: usize) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        if self.w[slot].is_none() {
            return Ok((t.clone(), None));
        }
        let d = self.dims.d;
        let rows = t.elem_count() / d;
        let (y, r) = self.rms(&t.reshape((rows, d))?, slot)?;
        Ok((y.reshape(t.shape())?, Some(r)))
    }

    /// The q, k, v adapters with their widths, in the stacked product's order.
    pub(super) fn qkv_adapters(&self) -> [(Option<&Adapter>, usize); 3] {
        let d = self.dims;
        [
            (self.adapters[0].as_ref(), d.qd()),
            (self.adapters[1].as_ref(), d.kd()),
            (self.adapters[2].as_ref(), d.kd()),
        ]
    }

    /// The gate and up adapters with their widths.
    pub(super) fn gate_up_adapters(&self, inter: usize) -> [(Option<&Adapter>, usize); 2] {
        [
            (self.adapters[4].as_ref(), inter),
            (self.adapters[5].as_ref(), inter),
        ]
    }

    /// `x W^T (+ b)` of weight slot `w`, with the adapter of projection `p` if any.
    pub(super) fn linear(
        &self,
        x: &Tensor,
        w: usize,
        b: usize,
        p: usize,
    ) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight(w)?.t()?)?;
        let y = match &self.adapters[p] {
            Some(a) => (y + a.delta(x)?)?,
            None => y,
        };
        match self.get(b, self.dtype)? {
            Some(b) => y.broadcast_add(&b),
            None => Ok(y),
        }
    }

    /// The queries and keys as the attention reads them, normed and rotated, and their
    /// norms' row statistics (where the family has the norms).
    #[allow(clippy::type_complexity)]
    pub(super) fn rotated(
        &self,
        q0: &Tensor,
        k0: &Tensor,
    ) -> candle_core::Result<((Tensor, Option<Tensor>), (Tensor, Option<Tensor>))> {
        let (q, rq) = self.head_norm(q0, Q_NORM)?;
        let (kk, rk) = self.head_norm(k0, K_NORM)?;
        let q = k::rotary_forward(&q, &self.cos, &self.sin, &self.positions)?;
        let kk = k::rotary_forward(&kk, &self.cos, &self.sin, &self.positions)?;
        Ok(((q, rq), (kk, rk)))
    }

    pub(super) fn attention(&self) -> Attention {
        let d = self.dims;
        Attention {
            key_bias: self.key_bias.clone(),
            score_bias: None,
            scale: self.spec.attention.scale,
            dropout: self.spec.attention.dropout,
            pattern: (self.spec.causal, self.spec.attention.window),
            n: d.n,
            heads: d.heads,
            kv_heads: d.kv_heads,
            s: d.s,
            d: d.d,
        }
    }
}
