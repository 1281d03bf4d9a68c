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
use super::lora::{self, Adapter, AdapterGrads};
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
struct Dims {
    n: usize,
    s: usize,
    h: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Dims {
    fn qd(&self) -> usize {
        self.heads * self.d
    }

    fn kd(&self) -> usize {
        self.kv_heads * self.d
    }

    fn rows(&self) -> usize {
        self.n * self.s
    }
}

/// The layer's weights by slot (`None` where the family has none), in node-input order.
const SLOTS: usize = 20;
const IN_NORM: usize = 0;
const WQ: usize = 1;
const BQ: usize = 2;
const WK: usize = 3;
const BK: usize = 4;
const WV: usize = 5;
const BV: usize = 6;
const WO: usize = 7;
const BO: usize = 8;
const Q_NORM: usize = 9;
const K_NORM: usize = 10;
const POST_ATTN: usize = 11;
const MLP_NORM: usize = 12;
const WG: usize = 13;
const BG: usize = 14;
const WU: usize = 15;
const BU: usize = 16;
const WD: usize = 17;
const BD: usize = 18;
const POST_MLP: usize = 19;

struct Slots([Option<Tensor>; SLOTS]);

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
struct Layer {
    x: Tensor,
    /// The LoRA adapters of the q, k, v, o, gate, up and down projections, and each one's
    /// `A` among the node's inputs.
    adapters: [Option<Adapter>; 7],
    adapter_input: [Option<usize>; 7],
    /// The weights by slot, detached (cast where they are used).
    w: [Option<Tensor>; SLOTS],
    /// Each present slot's index among the node's inputs.
    input_of: [Option<usize>; SLOTS],
    key_bias: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    dims: Dims,
    dtype: DType,
    spec: DecoderSpec,
}

/// What the forward keeps (`None`: recomputed in the backward).
struct Kept {
    r1: Tensor,
    q0: Tensor,
    rq: Option<Tensor>,
    k0: Tensor,
    rk: Option<Tensor>,
    v: Tensor,
    probs: Option<Tensor>,
    ctx: Tensor,
    /// Gemma: the attention output under its norm, and that norm's statistic.
    a: Option<(Tensor, Tensor)>,
    x1: Tensor,
    r2: Tensor,
    up: Tensor,
    /// Gemma: the feed-forward output under its norm, and that norm's statistic.
    m: Option<(Tensor, Tensor)>,
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
    fn get(&self, i: usize, dtype: DType) -> candle_core::Result<Option<Tensor>> {
        self.w[i].as_ref().map(|t| t.to_dtype(dtype)).transpose()
    }

    fn weight(&self, i: usize) -> candle_core::Result<Tensor> {
        self.get(i, self.dtype)?
            .ok_or_else(|| candle_core::Error::Msg(format!("decoder layer: no weight in slot {i}")))
    }

    fn norm(&self, i: usize) -> candle_core::Result<Option<Tensor>> {
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

    fn qkv(&self) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        self.stacked(&[(WQ, BQ), (WK, BK), (WV, BV)])
    }

    fn gate_up(&self) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        self.stacked(&[(WG, BG), (WU, BU)])
    }

    fn rms(&self, x: &Tensor, slot: usize) -> candle_core::Result<(Tensor, Tensor)> {
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
    fn qkv_adapters(&self) -> [(Option<&Adapter>, usize); 3] {
        let d = self.dims;
        [
            (self.adapters[0].as_ref(), d.qd()),
            (self.adapters[1].as_ref(), d.kd()),
            (self.adapters[2].as_ref(), d.kd()),
        ]
    }

    /// The gate and up adapters with their widths.
    fn gate_up_adapters(&self, inter: usize) -> [(Option<&Adapter>, usize); 2] {
        [
            (self.adapters[4].as_ref(), inter),
            (self.adapters[5].as_ref(), inter),
        ]
    }

    /// `x W^T (+ b)` of weight slot `w`, with the adapter of projection `p` if any.
    fn linear(&self, x: &Tensor, w: usize, b: usize, p: usize) -> candle_core::Result<Tensor> {
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
    fn rotated(
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

    fn attention(&self) -> Attention {
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

    /// The layer's output `[n s, h]` and, when `keep`, what the backward reads.
    fn forward(&self, keep: bool) -> candle_core::Result<(Tensor, Option<Kept>)> {
        let d = self.dims;
        let (n1, r1) = self.rms(&self.x, IN_NORM)?;
        let (wqkv, bqkv) = self.qkv()?;
        let qkv = n1.matmul(&wqkv.t()?)?;
        let qkv = match lora::stacked_delta(&self.qkv_adapters(), &n1)? {
            Some(delta) => (qkv + delta)?,
            None => qkv,
        };
        drop((n1, wqkv));
        let q0 = k::to_heads(&qkv, 0, (d.n, d.heads, d.s, d.d), bqkv.as_ref())?;
        let k0 = k::to_heads(&qkv, d.qd(), (d.n, d.kv_heads, d.s, d.d), bqkv.as_ref())?;
        let v = k::to_heads(
            &qkv,
            d.qd() + d.kd(),
            (d.n, d.kv_heads, d.s, d.d),
            bqkv.as_ref(),
        )?;
        drop(qkv);
        let ((q, rq), (kk, rk)) = self.rotated(&q0, &k0)?;
        let attention = self.attention();
        let (probs, dropped) = attention.probabilities(&q, &kk)?;
        drop((q, kk));
        let ctx = attention.context(dropped.as_ref().unwrap_or(&probs), &v)?;
        drop(dropped);
        let a_pre = self.linear(&ctx, WO, BO, 3)?;
        let (a, a_kept) = match self.w[POST_ATTN] {
            Some(_) => {
                let (a, r) = self.rms(&a_pre, POST_ATTN)?;
                (a, Some((a_pre, r)))
            }
            None => (a_pre, None),
        };
        let x1 = (&self.x + a)?;
        let (n2, r2) = self.rms(&x1, MLP_NORM)?;
        let (wgu, bgu) = self.gate_up()?;
        let up = n2.matmul(&wgu.t()?)?;
        let inter = wgu.dim(0)? / 2;
        let up = match lora::stacked_delta(&self.gate_up_adapters(inter), &n2)? {
            Some(delta) => (up + delta)?,
            None => up,
        };
        let up = match bgu {
            Some(b) => up.broadcast_add(&b)?,
            None => up,
        };
        drop((n2, wgu));
        let gated = k::glu_forward(&up, self.spec.act)?;
        let m_pre = self.linear(&gated, WD, BD, 6)?;
        drop(gated);
        let (m, m_kept) = match self.w[POST_MLP] {
            Some(_) => {
                let (m, r) = self.rms(&m_pre, POST_MLP)?;
                (m, Some((m_pre, r)))
            }
            None => (m_pre, None),
        };
        let y = (&x1 + m)?;
        if !keep {
            return Ok((y, None));
        }
        Ok((
            y,
            Some(Kept {
                r1,
                q0,
                rq,
                k0,
                rk,
                v,
                probs: (!self.spec.attention.recompute).then_some(probs),
                ctx,
                a: a_kept,
                x1,
                r2,
                up,
                m: m_kept,
            }),
        ))
    }

    /// Every input's gradient from the output's, in node-input order; `None` where `wants`
    /// says the input takes none.
    fn backward(
        &self,
        dy: &Tensor,
        kept: &Option<Kept>,
        wants: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Some(kept) = kept else {
            candle_core::bail!("decoder layer: backward without the forward's tensors");
        };
        let d = self.dims;
        let offset = self.spec.offset;
        let dy = dy
            .to_dtype(self.dtype)?
            .reshape((d.rows(), d.h))?
            .contiguous()?;
        let want = |slot: usize| {
            self.input_of[slot]
                .and_then(|i| wants.get(i).copied())
                .unwrap_or(false)
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; wants.len()];
        let mut put = |slot: usize, t: Tensor| -> candle_core::Result<()> {
            if let (true, Some(i), Some(w)) = (want(slot), self.input_of[slot], &self.w[slot]) {
                grads[i] = Some(t.to_dtype(w.dtype())?);
            }
            Ok(())
        };
        let rms_back =
            |dy: &Tensor, x: &Tensor, r: &Tensor, slot: usize| -> candle_core::Result<Tensor> {
                let w = self.norm(slot)?.expect("a norm in this slot");
                k::rms_backward(dy, x, r, &w, offset)
            };

        // The feed-forward.
        let dm = match &kept.m {
            Some((m, r)) => {
                if want(POST_MLP) {
                    put(POST_MLP, k::rms_param_grads(&dy, m, r)?)?;
                }
                rms_back(&dy, m, r, POST_MLP)?
            }
            None => dy.clone(),
        };
        if want(BD) {
            put(BD, k::column_sums(&dm)?)?;
        }
        let mut adapter_grads: Vec<(usize, AdapterGrads)> = Vec::new();
        let mut dgated = dm.matmul(&self.weight(WD)?)?;
        if want(WD) || self.adapters[6].is_some() {
            let gated = k::glu_forward(&kept.up, self.spec.act)?;
            if want(WD) {
                put(WD, dm.t()?.matmul(&gated)?)?;
            }
            if let Some(a) = &self.adapters[6] {
                let g = a.backward(&dm, &gated)?;
                dgated = (dgated + &g.x)?;
                adapter_grads.push((6, g));
            }
        }
        drop(dm);
        let dup = k::glu_backward(&dgated, &kept.up, self.spec.act)?;
        drop(dgated);
        let (n2, _) = self.rms(&kept.x1, MLP_NORM)?;
        if want(BG) || want(BU) {
            let db = k::column_sums(&dup)?;
            let inter = db.dim(0)? / 2;
            put(BG, db.narrow(0, 0, inter)?)?;
            put(BU, db.narrow(0, inter, inter)?)?;
        }
        if want(WG) || want(WU) {
            let dw = dup.t()?.matmul(&n2)?;
            let inter = dw.dim(0)? / 2;
            put(WG, dw.narrow(0, 0, inter)?.contiguous()?)?;
            put(WU, dw.narrow(0, inter, inter)?.contiguous()?)?;
        }
        let (wgu, _) = self.gate_up()?;
        let inter = wgu.dim(0)? / 2;
        let (gu_grads, gu_dx) = lora::stacked_backward(&self.gate_up_adapters(inter), &dup, &n2)?;
        for (p, g) in gu_grads.into_iter().enumerate() {
            if let Some(g) = g {
                adapter_grads.push((4 + p, g));
            }
        }
        drop(n2);
        let dn2 = lora::plus(dup.matmul(&wgu)?, gu_dx)?;
        drop((dup, wgu));
        if want(MLP_NORM) {
            put(MLP_NORM, k::rms_param_grads(&dn2, &kept.x1, &kept.r2)?)?;
        }
        let dx1 = (rms_back(&dn2, &kept.x1, &kept.r2, MLP_NORM)? + &dy)?;
        drop((dn2, dy));

        // The attention output.
        let da = match &kept.a {
            Some((a, r)) => {
                if want(POST_ATTN) {
                    put(POST_ATTN, k::rms_param_grads(&dx1, a, r)?)?;
                }
                rms_back(&dx1, a, r, POST_ATTN)?
            }
            None => dx1.clone(),
        };
        if want(BO) {
            put(BO, k::column_sums(&da)?)?;
        }
        if want(WO) {
            put(WO, da.t()?.matmul(&kept.ctx)?)?;
        }
        let mut dctx = da.matmul(&self.weight(WO)?)?;
        if let Some(a) = &self.adapters[3] {
            let g = a.backward(&da, &kept.ctx)?;
            dctx = (dctx + &g.x)?;
            adapter_grads.push((3, g));
        }
        drop(da);

        // The attention.
        let ((q, _), (kk, _)) = self.rotated(&kept.q0, &kept.k0)?;
        let grads_attention =
            self.attention()
                .backward(&dctx, (&q, &kk, &kept.v), kept.probs.as_ref(), false)?;
        drop((dctx, q, kk));
        let (dq, dk, dv) = (grads_attention.q, grads_attention.k, grads_attention.v);
        let scale = self.spec.attention.scale;
        let dq = k::rotary_backward(&dq, &self.cos, &self.sin, &self.positions, scale)?;
        let dk = k::rotary_backward(&dk, &self.cos, &self.sin, &self.positions, scale)?;
        let mut head_norm_back = |t: Tensor,
                                  t0: &Tensor,
                                  r: &Option<Tensor>,
                                  slot: usize|
         -> candle_core::Result<Tensor> {
            let Some(r) = r else { return Ok(t) };
            let rows = t.elem_count() / d.d;
            let (t2, t02) = (t.reshape((rows, d.d))?, t0.reshape((rows, d.d))?);
            if want(slot) {
                put(slot, k::rms_param_grads(&t2, &t02, r)?)?;
            }
            rms_back(&t2, &t02, r, slot)?.reshape(t.shape())
        };
        let dq0 = head_norm_back(dq, &kept.q0, &kept.rq, Q_NORM)?;
        let dk0 = head_norm_back(dk, &kept.k0, &kept.rk, K_NORM)?;
        let width = d.qd() + 2 * d.kd();
        let dqkv = k::from_heads(
            &[
                (&dq0, 0, 1.0),
                (&dk0, d.qd(), 1.0),
                (&dv, d.qd() + d.kd(), 1.0),
            ],
            width,
        )?;
        drop((dq0, dk0, dv));
        let splits = [
            (WQ, BQ, 0, d.qd()),
            (WK, BK, d.qd(), d.kd()),
            (WV, BV, d.qd() + d.kd(), d.kd()),
        ];
        if splits.iter().any(|&(_, b, _, _)| want(b)) {
            let db = k::column_sums(&dqkv)?;
            for &(_, b, at, len) in &splits {
                put(b, db.narrow(0, at, len)?)?;
            }
        }
        let (n1, _) = self.rms(&self.x, IN_NORM)?;
        if splits.iter().any(|&(w, _, _, _)| want(w)) {
            let dw = dqkv.t()?.matmul(&n1)?;
            for &(w, _, at, len) in &splits {
                put(w, dw.narrow(0, at, len)?.contiguous()?)?;
            }
        }
        let (qkv_grads, qkv_dx) = lora::stacked_backward(&self.qkv_adapters(), &dqkv, &n1)?;
        for (p, g) in qkv_grads.into_iter().enumerate() {
            if let Some(g) = g {
                adapter_grads.push((p, g));
            }
        }
        let (wqkv, _) = self.qkv()?;
        let dn1 = lora::plus(dqkv.matmul(&wqkv)?, qkv_dx)?;
        drop((dqkv, wqkv));
        if want(IN_NORM) {
            put(IN_NORM, k::rms_param_grads(&dn1, &self.x, &kept.r1)?)?;
        }
        drop(n1);
        if wants.first().copied().unwrap_or(false) {
            let dx = (rms_back(&dn1, &self.x, &kept.r1, IN_NORM)? + dx1)?;
            grads[0] = Some(dx.reshape((d.n, d.s, d.h))?);
        }
        for (p, g) in adapter_grads {
            if let Some(i) = self.adapter_input[p] {
                grads[i] = Some(g.a);
                grads[i + 1] = Some(g.b);
            }
        }
        Ok(grads)
    }
}
