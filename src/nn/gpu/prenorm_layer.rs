//! ModernBERT's pre-norm layer as one node for the GPU:
//!
//! ```text
//! n1  = LayerNorm1(x)                         (the identity in a layer without one)
//! qkv = n1 W_qkv^T (+ b)                      one product
//! q, k = rotary(q, k)                         each token at its place t
//! p   = softmax(scale q k^T + mask (+ window)); pd = dropout(p)
//! x1  = x + dropout(merge(pd v) W_o^T (+ b))
//! up  = LayerNorm2(x1) W_i^T (+ b) = [a, g]
//! y   = x1 + dropout(act(a) g) W_d^T (+ b)
//! ```
//!
//! Kept per token and layer: `x`, the first norm's sum (f32) and statistics, `q` and `k`
//! before their rotation and `v`, the probabilities (unless `attention.probs` is
//! recomputed), the context, `x1` as the second norm's sum (f32) and `up`; the norms'
//! outputs, the rotated queries and keys and the gated activation are recomputed in the
//! backward with the forward's kernels. Biases are optional everywhere (ModernBERT has
//! none). A LoRA adapter on a projection adds its branch (`super::lora`) beside the
//! frozen base weight.

use candle_core::{DType, Tensor};

use super::attention::Attention;
use super::lora::{Adapter, AdapterGrads};
use crate::nn::cpu::prenorm_layer::{PreNormSpec, PreNormWeights};
use crate::nn::kernels::{self as k, acc};
use crate::nn::node::node_n;

/// The weights by slot, in node-input order (a missing one is `None`).
const SLOTS: usize = 12;
const G1: usize = 0;
const B1: usize = 1;
const WQKV: usize = 2;
const BQKV: usize = 3;
const WO: usize = 4;
const BO: usize = 5;
const G2: usize = 6;
const B2: usize = 7;
const WI: usize = 8;
const BI: usize = 9;
const WD: usize = 10;
const BD: usize = 11;

/// The layer on `x` `[n, s, h]`: one node over `x`, its weights and adapters, or the
/// output alone when nothing is tracked.
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
    let adapter_fits = |p: usize, (i, o): (usize, usize)| {
        w.lora[p].as_ref().is_none_or(|l| {
            let r = l.a.dim(0).unwrap_or(0);
            l.a.dims() == [r, i] && l.b.dims() == [o, r]
        })
    };
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
        && spec.attention.bias.elem_count() == n * s
        && [(h, 3 * h), (h, h), (h, up), (inter, h)]
            .into_iter()
            .enumerate()
            .all(|(p, shape)| adapter_fits(p, shape));
    if !fits {
        candle_core::bail!(
            "pre-norm layer: hidden size {h}, {heads} heads, the weights ({:?} up, {:?} down) \
             and the rotary tables {:?} do not fit",
            w.up.0.dims(),
            w.down.0.dims(),
            spec.rotary.0.dims()
        );
    }
    let (g1, b1) = match w.attention_norm {
        Some((g, b)) => (Some(g), b),
        None => (None, None),
    };
    let slots: [Option<&Tensor>; SLOTS] = [
        g1,
        b1,
        Some(w.qkv.0),
        w.qkv.1,
        Some(w.attention_output.0),
        w.attention_output.1,
        Some(w.mlp_norm.0),
        w.mlp_norm.1,
        Some(w.up.0),
        w.up.1,
        Some(w.down.0),
        w.down.1,
    ];
    let mut inputs: Vec<&Tensor> = vec![x];
    let mut input_of = [None; SLOTS];
    for (slot, t) in slots.iter().enumerate() {
        if let Some(t) = t {
            input_of[slot] = Some(inputs.len());
            inputs.push(t);
        }
    }
    let mut adapter_input = [None; 4];
    for (p, l) in w.lora.iter().enumerate() {
        if let Some(l) = l {
            adapter_input[p] = Some(inputs.len());
            inputs.extend([&l.a, &l.b]);
        }
    }
    let tracked = inputs.iter().any(|t| t.track_op());
    let dims = Dims { n, s, h, heads, d };
    let layer = Layer {
        x: x.detach().contiguous()?.reshape((n * s, h))?,
        w: slots.map(|t| t.map(Tensor::detach)),
        input_of,
        adapters: std::array::from_fn(|p| w.lora[p].as_ref().map(Adapter::new)),
        adapter_input,
        key_bias: spec
            .attention
            .bias
            .detach()
            .to_dtype(acc(x.dtype()))?
            .contiguous()?
            .reshape((n, s))?,
        cos: spec.rotary.0.to_dtype(acc(x.dtype()))?,
        sin: spec.rotary.1.to_dtype(acc(x.dtype()))?,
        positions: Tensor::arange(0u32, s as u32, x.device())?
            .unsqueeze(0)?
            .broadcast_as((n, s))?
            .contiguous()?
            .flatten_all()?,
        dims,
        dtype: x.dtype(),
        spec: spec.clone(),
    };
    let (y, kept) = {
        let pass = if tracked { "replay" } else { "first-pass" };
        let _s = crate::profile::span(|| format!("node.prenorm-layer.forward.{pass}"));
        layer.forward(tracked)?
    };
    let y = y.reshape((n, s, h))?;
    if !tracked {
        return Ok(y);
    }
    let wants: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
    let originals: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    node_n(
        "gradcache-gpu-prenorm-layer",
        &inputs,
        y,
        Box::new(move |dy| {
            let _s = crate::profile::span(|| "node.prenorm-layer.backward".into());
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
    d: usize,
}

struct Layer {
    x: Tensor,
    w: [Option<Tensor>; SLOTS],
    input_of: [Option<usize>; SLOTS],
    /// The adapters of the query-key-value, attention output, up and down projections.
    adapters: [Option<Adapter>; 4],
    adapter_input: [Option<usize>; 4],
    key_bias: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    dims: Dims,
    dtype: DType,
    spec: PreNormSpec,
}

struct Kept {
    norm1: Option<(Tensor, Tensor)>,
    q0: Tensor,
    k0: Tensor,
    v: Tensor,
    probs: Option<Tensor>,
    ctx: Tensor,
    /// `x1` as the second norm's sum, and its statistics.
    norm2: (Tensor, Tensor),
    up: Tensor,
}

impl Layer {
    fn weight(&self, slot: usize) -> candle_core::Result<Tensor> {
        match &self.w[slot] {
            Some(t) => t.to_dtype(self.dtype),
            None => candle_core::bail!("pre-norm layer: no weight in slot {slot}"),
        }
    }

    fn bias(&self, slot: usize) -> candle_core::Result<Option<Tensor>> {
        self.w[slot]
            .as_ref()
            .map(|t| t.to_dtype(self.dtype))
            .transpose()
    }

    /// A norm's scale and shift in the norms' dtype (a missing shift: zeros).
    fn norm(&self, g: usize, b: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let a = acc(self.dtype);
        let gamma = match &self.w[g] {
            Some(t) => t.to_dtype(a)?,
            None => candle_core::bail!("pre-norm layer: no norm in slot {g}"),
        };
        let beta = match &self.w[b] {
            Some(t) => t.to_dtype(a)?,
            None => gamma.zeros_like()?,
        };
        Ok((gamma, beta))
    }

    /// `x W^T (+ b)` with the adapter of projection `p`, if any.
    fn project(&self, x: &Tensor, w: usize, b: usize, p: usize) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight(w)?.t()?)?;
        let y = match &self.adapters[p] {
            Some(a) => (y + a.delta(x)?)?,
            None => y,
        };
        match self.bias(b)? {
            Some(b) => y.broadcast_add(&b),
            None => Ok(y),
        }
    }

    /// The first norm's output, and its sum and statistics (none without the norm).
    fn first_norm(&self) -> candle_core::Result<(Tensor, Option<(Tensor, Tensor)>)> {
        if self.w[G1].is_none() {
            return Ok((self.x.clone(), None));
        }
        let (g, b) = self.norm(G1, B1)?;
        let (n1, sum, stats) =
            k::add_norm_forward(&self.x, None, None, &g, &b, self.spec.eps, None, true)?;
        Ok((n1, Some((sum.expect("kept"), stats))))
    }

    fn attention(&self) -> Attention {
        let d = self.dims;
        Attention {
            key_bias: self.key_bias.clone(),
            score_bias: None,
            scale: self.spec.attention.scale,
            dropout: self.spec.attention.dropout,
            pattern: (false, self.spec.attention.window),
            n: d.n,
            heads: d.heads,
            kv_heads: d.heads,
            s: d.s,
            d: d.d,
        }
    }

    fn rotated(&self, q0: &Tensor, k0: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((
            k::rotary_forward(q0, &self.cos, &self.sin, &self.positions)?,
            k::rotary_forward(k0, &self.cos, &self.sin, &self.positions)?,
        ))
    }

    fn dropout(&self, t: &Tensor, dropout: Option<(u64, f32)>) -> candle_core::Result<Tensor> {
        match dropout.filter(|&(_, p)| p > 0.0) {
            Some((seed, p)) => k::dropout(t, seed, p),
            None => Ok(t.clone()),
        }
    }

    fn forward(&self, keep: bool) -> candle_core::Result<(Tensor, Option<Kept>)> {
        let d = self.dims;
        let (n1, norm1) = self.first_norm()?;
        let qkv = self.project(&n1, WQKV, BQKV, 0)?;
        drop(n1);
        let shape = (d.n, d.heads, d.s, d.d);
        let q0 = k::to_heads(&qkv, 0, shape, None)?;
        let k0 = k::to_heads(&qkv, d.h, shape, None)?;
        let v = k::to_heads(&qkv, 2 * d.h, shape, None)?;
        drop(qkv);
        let (q, kk) = self.rotated(&q0, &k0)?;
        let attention = self.attention();
        let (probs, dropped) = attention.probabilities(&q, &kk)?;
        drop((q, kk));
        let ctx = attention.context(dropped.as_ref().unwrap_or(&probs), &v)?;
        drop(dropped);
        let o = self.project(&ctx, WO, BO, 1)?;
        let x1 = (&self.x + self.dropout(&o, self.spec.attention_output_dropout)?)?;
        drop(o);
        let (g2, b2) = self.norm(G2, B2)?;
        let (n2, sum2, stats2) =
            k::add_norm_forward(&x1, None, None, &g2, &b2, self.spec.eps, None, keep)?;
        let up = self.project(&n2, WI, BI, 2)?;
        drop(n2);
        let gated = self.dropout(&k::glu_forward(&up, self.spec.act)?, self.spec.mlp_dropout)?;
        let y = (x1 + self.project(&gated, WD, BD, 3)?)?;
        if !keep {
            return Ok((y, None));
        }
        Ok((
            y,
            Some(Kept {
                norm1,
                q0,
                k0,
                v,
                probs: (!self.spec.attention.recompute).then_some(probs),
                ctx,
                norm2: (sum2.expect("kept"), stats2),
                up,
            }),
        ))
    }

    fn backward(
        &self,
        dy: &Tensor,
        kept: &Option<Kept>,
        wants: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Some(kept) = kept else {
            candle_core::bail!("pre-norm layer: backward without the forward's tensors");
        };
        let d = self.dims;
        let dy = dy
            .to_dtype(self.dtype)?
            .reshape((d.n * d.s, d.h))?
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
        let mut adapter_grads: Vec<(usize, AdapterGrads)> = Vec::new();

        // The feed-forward: y = x1 + dropout(glu(up)) W_d^T.
        if want(BD) {
            put(BD, k::column_sums(&dy)?)?;
        }
        let gated = self.dropout(
            &k::glu_forward(&kept.up, self.spec.act)?,
            self.spec.mlp_dropout,
        )?;
        if want(WD) {
            put(WD, dy.t()?.matmul(&gated)?)?;
        }
        let mut dgated = dy.matmul(&self.weight(WD)?)?;
        if let Some(a) = &self.adapters[3] {
            let g = a.backward(&dy, &gated)?;
            dgated = (dgated + &g.x)?;
            adapter_grads.push((3, g));
        }
        drop(gated);
        let dglu = self.dropout(&dgated, self.spec.mlp_dropout)?;
        drop(dgated);
        let dup = k::glu_backward(&dglu, &kept.up, self.spec.act)?;
        drop(dglu);
        let (sum2, stats2) = &kept.norm2;
        let (g2, b2) = self.norm(G2, B2)?;
        let n2 = k::norm_apply(sum2, stats2, &g2, &b2, self.dtype)?;
        if want(BI) {
            put(BI, k::column_sums(&dup)?)?;
        }
        if want(WI) {
            put(WI, dup.t()?.matmul(&n2)?)?;
        }
        let mut dn2 = dup.matmul(&self.weight(WI)?)?;
        if let Some(a) = &self.adapters[2] {
            let g = a.backward(&dup, &n2)?;
            dn2 = (dn2 + &g.x)?;
            adapter_grads.push((2, g));
        }
        drop((dup, n2));
        if want(G2) || want(B2) {
            let (dg, db) = k::norm_param_grads(&dn2, sum2, stats2)?;
            put(G2, dg)?;
            put(B2, db)?;
        }
        let (dsum2, _) = k::add_norm_backward(&dn2, sum2, stats2, &g2, None)?;
        drop(dn2);
        let dx1 = (dy + dsum2)?;

        // The attention output: x1 = x + dropout(ctx W_o^T).
        let dout = self.dropout(&dx1, self.spec.attention_output_dropout)?;
        if want(BO) {
            put(BO, k::column_sums(&dout)?)?;
        }
        if want(WO) {
            put(WO, dout.t()?.matmul(&kept.ctx)?)?;
        }
        let mut dctx = dout.matmul(&self.weight(WO)?)?;
        if let Some(a) = &self.adapters[1] {
            let g = a.backward(&dout, &kept.ctx)?;
            dctx = (dctx + &g.x)?;
            adapter_grads.push((1, g));
        }
        drop(dout);

        // The attention.
        let (q, kk) = self.rotated(&kept.q0, &kept.k0)?;
        let att =
            self.attention()
                .backward(&dctx, (&q, &kk, &kept.v), kept.probs.as_ref(), false)?;
        drop((dctx, q, kk));
        let scale = self.spec.attention.scale;
        let dq = k::rotary_backward(&att.q, &self.cos, &self.sin, &self.positions, scale)?;
        let dk = k::rotary_backward(&att.k, &self.cos, &self.sin, &self.positions, scale)?;
        let dqkv = k::from_heads(
            &[(&dq, 0, 1.0), (&dk, d.h, 1.0), (&att.v, 2 * d.h, 1.0)],
            3 * d.h,
        )?;
        drop((dq, dk, att));
        if want(BQKV) {
            put(BQKV, k::column_sums(&dqkv)?)?;
        }
        let n1 = match &kept.norm1 {
            Some((sum, stats)) => {
                let (g1, b1) = self.norm(G1, B1)?;
                k::norm_apply(sum, stats, &g1, &b1, self.dtype)?
            }
            None => self.x.clone(),
        };
        if want(WQKV) {
            put(WQKV, dqkv.t()?.matmul(&n1)?)?;
        }
        let mut dn1 = dqkv.matmul(&self.weight(WQKV)?)?;
        if let Some(a) = &self.adapters[0] {
            let g = a.backward(&dqkv, &n1)?;
            dn1 = (dn1 + &g.x)?;
            adapter_grads.push((0, g));
        }
        drop((dqkv, n1));
        let dx = match &kept.norm1 {
            Some((sum, stats)) => {
                if want(G1) || want(B1) {
                    let (dg, db) = k::norm_param_grads(&dn1, sum, stats)?;
                    put(G1, dg)?;
                    put(B1, db)?;
                }
                let (g1, _) = self.norm(G1, B1)?;
                k::add_norm_backward(&dn1, sum, stats, &g1, None)?.0
            }
            None => dn1,
        };
        if wants.first().copied().unwrap_or(false) {
            grads[0] = Some((dx1 + dx)?.reshape((d.n, d.s, d.h))?);
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
