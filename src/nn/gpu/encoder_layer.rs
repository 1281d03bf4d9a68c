//! BERT's post-norm encoder layer (BERT, RoBERTa, XLM-R, MPNet) as one node for the GPU.
//!
//! ```text
//! qkv = x W_qkv^T                         one product for the three projections
//! q, k, v = heads(qkv + b_qkv)            [n, heads, s, d] each (the bias added on the way)
//! p   = softmax(scale q k^T + mask (+ relative bias));  pd = dropout(p)
//! ctx = merge(pd v)                       [n s, h]
//! y1  = LayerNorm(dropout(ctx W_o^T + b_o) + x)
//! pre = y1 W_i^T + b_i ; g = act(pre)
//! y   = LayerNorm(dropout(g W_d^T + b_d) + y1)
//! ```
//!
//! What the backward reads, kept by the forward unless its selective-recompute site says
//! to recompute it (the recomputation runs the forward's own kernels, so the gradients
//! are the same either way):
//!
//! | kept | per token | recomputed instead under |
//! |---|---:|---|
//! | the input `x` | `h` | (never) |
//! | `q`, `k`, `v` | `3h` | (never) |
//! | the probabilities `p` | `heads * s` | `attention.probs` (one `q k^T` and softmax) |
//! | the context `ctx` | `h` | (never) |
//! | the sum under the first norm (f32) and its row statistics | `h` f32 | `attention.output.LayerNorm` |
//! | the pre-activation `pre` | `I` | `intermediate` (one product `y1 W_i^T`) |
//! | the sum under the second norm (f32) and its row statistics | `h` f32 | `output.LayerNorm` |
//!
//! `y1`, `g` and the probabilities after dropout are recomputed from what is kept (one
//! elementwise pass each). The weights are read in the activations' dtype (a bf16 copy of
//! each f32 master weight, made again in the backward rather than kept); each weight's
//! gradient is computed in that dtype with f32 accumulation and returned in the weight's
//! own dtype. The norms run in f32 (their scale and shift, sums and statistics), as the
//! composed layer widens them. A LoRA adapter on a projection adds its low-rank branch
//! (`super::lora`) beside the frozen base weight, whose own gradient is not computed. Padding rows are computed like the others (their keys are
//! masked, and no gradient reaches them from the pooling).

use candle_core::{DType, Tensor};

use super::attention::Attention;
use super::lora::{self, Adapter, AdapterGrads};
use crate::nn::cpu::encoder_layer::{LayerSpec, LayerWeights};
use crate::nn::kernels::{self as k, acc};
use crate::nn::node::node_n;

/// The layer on `x` `[n, s, h]`: one node over `x`, the sixteen weights and the relative
/// score bias (if any), or the output alone when nothing is tracked. LoRA adapters and
/// windowed attention are not part of this node (the caller runs those layers op by op).
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
        && w.qkv_bias
            .iter()
            .chain([
                &w.attention_output.1,
                &w.attention_norm.0,
                &w.attention_norm.1,
            ])
            .chain([&w.output.1, &w.output_norm.0, &w.output_norm.1])
            .all(|t| t.dims() == [h])
        && w.intermediate.1.dims() == [inter]
        && spec.attention.bias.elem_count() == n * s
        && spec
            .score_bias
            .as_ref()
            .is_none_or(|b| b.elem_count() == heads * s * s)
        && w.lora
            .iter()
            .zip([(h, h), (h, h), (h, h), (h, h), (h, inter), (inter, h)])
            .all(|(l, (i, o))| {
                l.as_ref().is_none_or(|l| {
                    l.a.dims() == [l.a.dim(0).unwrap_or(0), i]
                        && l.b.dims() == [o, l.a.dim(0).unwrap_or(0)]
                })
            });
    if !fits {
        candle_core::bail!(
            "encoder layer: hidden size {h}, {heads} heads, {s} tokens and the weights \
             ({:?} up, {:?} down) do not fit",
            w.intermediate.0.dims(),
            w.output.0.dims()
        );
    }
    if spec.attention.window.is_some() {
        candle_core::bail!("encoder layer (GPU node): windowed attention runs op by op");
    }
    let dims = Dims {
        n,
        s,
        h,

        heads,
        d: h / heads,
    };
    let mut inputs: Vec<&Tensor> = vec![x];
    inputs.extend(all_weights(w));
    if let Some(b) = &spec.score_bias {
        inputs.push(b);
    }
    // Each adapter's A and B, after the weights: the index of its A among the inputs.
    let mut adapter_input = [None; 6];
    for (p, l) in w.lora.iter().enumerate() {
        if let Some(l) = l {
            adapter_input[p] = Some(inputs.len());
            inputs.extend([&l.a, &l.b]);
        }
    }
    let tracked = inputs.iter().any(|t| t.track_op());
    let layer = Layer::new(x, w, spec, dims, adapter_input)?;
    let (y, kept) = {
        let pass = if tracked { "replay" } else { "first-pass" };
        let _s = crate::profile::span(|| format!("node.encoder-layer.forward.{pass}"));
        layer.forward(tracked)?
    };
    let y = y.reshape((n, s, h))?;
    if !tracked {
        return Ok(y);
    }
    let wants: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
    let originals: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    node_n(
        "gradcache-gpu-encoder-layer",
        &inputs,
        y,
        Box::new(move |dy| {
            let _s = crate::profile::span(|| "node.encoder-layer.backward".into());
            let mut grads = layer.backward(dy, &kept, &wants)?;
            super::into_sink(&mut grads, &originals)?;
            Ok(grads)
        }),
    )
}

/// The same layer composed of candle's differentiable ops (any device and dtype; the
/// half-precision rules of [`crate::nn`]): what the node replaces, and what the tests
/// and the self-check hold it to. No LoRA adapters (see [`encoder_layer`]).
pub fn encoder_layer_composed(
    x: &Tensor,
    w: &LayerWeights,
    spec: &LayerSpec,
) -> crate::Result<Tensor> {
    use crate::nn::{add_norm_composed, bias_activation_composed, linear_composed};
    let (n, s, h) = x.dims3()?;
    let heads = spec.heads;
    let dtype = x.dtype();
    let cast = |t: &Tensor| t.to_dtype(dtype);
    let split = |t: Tensor| -> crate::Result<Tensor> {
        Ok(t.reshape((n, s, heads, h / heads))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let project = |i: usize| -> crate::Result<Tensor> {
        split(linear_composed(
            x,
            &cast(w.qkv[i])?,
            Some(&cast(w.qkv_bias[i])?),
        )?)
    };
    let (q, k, v) = (project(0)?, project(1)?, project(2)?);
    let mut attention = spec.attention.clone();
    if let Some(b) = &spec.score_bias {
        attention.bias = attention
            .bias
            .to_dtype(b.dtype())?
            .broadcast_add(&b.reshape((1, heads, s, s))?)?;
    }
    let ctx = crate::nn::attention_composed(&q, &k, &v, &attention)?;
    let ctx = ctx.transpose(1, 2)?.reshape((n, s, h))?;
    let a = linear_composed(
        &ctx,
        &cast(w.attention_output.0)?,
        Some(&cast(w.attention_output.1)?),
    )?;
    let norm = |(g, b): (&Tensor, &Tensor)| crate::nn::LayerNorm {
        weight: g.clone(),
        bias: b.clone(),
        eps: spec.eps,
        has_bias: true,
    };
    let y1 = add_norm_composed(
        &a,
        x,
        &norm(w.attention_norm),
        spec.attention_output_dropout,
    )?;
    let u = linear_composed(&y1, &cast(w.intermediate.0)?, None)?;
    let g = bias_activation_composed(&u, &cast(w.intermediate.1)?, spec.act)?;
    let o = linear_composed(&g, &cast(w.output.0)?, Some(&cast(w.output.1)?))?;
    add_norm_composed(&o, &y1, &norm(w.output_norm), spec.output_dropout)
}

/// The sixteen weights in node-input order.
fn all_weights<'a>(w: &LayerWeights<'a>) -> [&'a Tensor; 16] {
    let [wq, wk, wv] = w.qkv;
    let [bq, bk, bv] = w.qkv_bias;
    [
        wq,
        wk,
        wv,
        bq,
        bk,
        bv,
        w.attention_output.0,
        w.attention_output.1,
        w.attention_norm.0,
        w.attention_norm.1,
        w.intermediate.0,
        w.intermediate.1,
        w.output.0,
        w.output.1,
        w.output_norm.0,
        w.output_norm.1,
    ]
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    n: usize,
    s: usize,
    h: usize,
    heads: usize,
    d: usize,
}

impl Dims {
    fn heads_shape(&self) -> (usize, usize, usize, usize) {
        (self.n, self.heads, self.s, self.d)
    }
}

/// Everything the layer computes with, detached: the input, the weights as stored (cast
/// to the activations' dtype where they are used), the settings.
struct Layer {
    x: Tensor,
    weights: [Tensor; 16],
    /// The LoRA adapters of the query, key, value, attention output, up and down
    /// projections, and each one's `A` among the node's inputs.
    adapters: [Option<Adapter>; 6],
    adapter_input: [Option<usize>; 6],
    key_bias: Tensor,
    score_bias: Option<Tensor>,
    dims: Dims,
    dtype: DType,
    spec: LayerSpec,
}

/// What the forward keeps (`None`: recomputed in the backward).
struct Kept {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Option<Tensor>,
    ctx: Tensor,
    norm1: Option<(Tensor, Tensor)>,
    pre: Option<Tensor>,
    norm2: Option<(Tensor, Tensor)>,
}

/// The score bias's place among the node's inputs (after `x` and the sixteen weights).
const SCORE_BIAS: usize = 17;

/// Indices of the weights in [`all_weights`].
const WQ: usize = 0;
const BQ: usize = 3;
const WO: usize = 6;
const BO: usize = 7;
const G1: usize = 8;
const B1: usize = 9;
const WI: usize = 10;
const BI: usize = 11;
const WD: usize = 12;
const BD: usize = 13;
const G2: usize = 14;
const B2: usize = 15;

impl Layer {
    fn new(
        x: &Tensor,
        w: &LayerWeights,
        spec: &LayerSpec,
        dims: Dims,
        adapter_input: [Option<usize>; 6],
    ) -> candle_core::Result<Self> {
        let dtype = x.dtype();
        let a = acc(dtype);
        let key_bias = spec
            .attention
            .bias
            .detach()
            .to_dtype(a)?
            .contiguous()?
            .reshape((dims.n, dims.s))?;
        let score_bias = match &spec.score_bias {
            Some(b) => Some(
                b.detach()
                    .to_dtype(a)?
                    .contiguous()?
                    .reshape((dims.heads, dims.s, dims.s))?,
            ),
            None => None,
        };
        let mut spec = spec.clone();
        spec.score_bias = None;
        Ok(Self {
            x: x.detach()
                .contiguous()?
                .reshape((dims.n * dims.s, dims.h))?,
            weights: all_weights(w).map(Tensor::detach),
            adapters: std::array::from_fn(|p| w.lora[p].as_ref().map(Adapter::new)),
            adapter_input,
            key_bias,
            score_bias,
            dims,
            dtype,
            spec,
        })
    }

    /// Weight `i` in the activations' dtype.
    fn w(&self, i: usize) -> candle_core::Result<Tensor> {
        self.weights[i].to_dtype(self.dtype)
    }

    /// Norm parameter `i` in the norms' dtype.
    fn norm(&self, i: usize) -> candle_core::Result<Tensor> {
        self.weights[i].to_dtype(acc(self.dtype))
    }

    /// The query, key and value weights as one `[3h, h]` and their biases as one `[3h]`.
    fn qkv_weights(&self) -> candle_core::Result<(Tensor, Tensor)> {
        let w = Tensor::cat(&self.weights[WQ..WQ + 3], 0)?.to_dtype(self.dtype)?;
        let b = Tensor::cat(&self.weights[BQ..BQ + 3], 0)?.to_dtype(self.dtype)?;
        Ok((w, b))
    }

    fn attention(&self) -> Attention {
        let d = self.dims;
        Attention {
            key_bias: self.key_bias.clone(),
            score_bias: self.score_bias.clone(),
            scale: self.spec.attention.scale,
            dropout: self.spec.attention.dropout,
            pattern: (false, None),
            n: d.n,
            heads: d.heads,
            kv_heads: d.heads,
            s: d.s,
            d: d.d,
        }
    }

    /// `x W^T` of weight `w` plus its adapter's branch (projection `p`), if any.
    fn project(&self, x: &Tensor, w: usize, p: usize) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.w(w)?.t()?)?;
        match &self.adapters[p] {
            Some(a) => y + a.delta(x)?,
            None => Ok(y),
        }
    }

    /// The query, key and value adapters with their widths, in the stacked product's order.
    fn qkv_adapters(&self) -> [(Option<&Adapter>, usize); 3] {
        std::array::from_fn(|p| (self.adapters[p].as_ref(), self.dims.h))
    }

    fn first_norm(&self, ctx: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let a = self.project(ctx, WO, 3)?;
        let bo = self.w(BO)?;
        let (y1, sum, stats) = k::add_norm_forward(
            &a,
            Some(&bo),
            Some(&self.x),
            &self.norm(G1)?,
            &self.norm(B1)?,
            self.spec.eps,
            self.spec.attention_output_dropout,
            true,
        )?;
        Ok((y1, sum.expect("kept"), stats))
    }

    fn intermediate(&self, y1: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let u = self.project(y1, WI, 4)?;
        k::bias_act_forward(&u, &self.w(BI)?, self.spec.act)
    }

    fn second_norm(
        &self,
        g: &Tensor,
        y1: &Tensor,
        keep_sum: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>, Tensor)> {
        let o = self.project(g, WD, 5)?;
        k::add_norm_forward(
            &o,
            Some(&self.w(BD)?),
            Some(y1),
            &self.norm(G2)?,
            &self.norm(B2)?,
            self.spec.eps,
            self.spec.output_dropout,
            keep_sum,
        )
    }

    /// The layer's output `[n s, h]` and, when `keep`, what the backward reads.
    fn forward(&self, keep: bool) -> candle_core::Result<(Tensor, Option<Kept>)> {
        let d = self.dims;
        let (wqkv, bqkv) = self.qkv_weights()?;
        let qkv = self.x.matmul(&wqkv.t()?)?;
        let qkv = match lora::stacked_delta(&self.qkv_adapters(), &self.x)? {
            Some(delta) => (qkv + delta)?,
            None => qkv,
        };
        let shape = d.heads_shape();
        let q = k::to_heads(&qkv, 0, shape, Some(&bqkv))?;
        let kk = k::to_heads(&qkv, d.h, shape, Some(&bqkv))?;
        let v = k::to_heads(&qkv, 2 * d.h, shape, Some(&bqkv))?;
        drop(qkv);
        let attention = self.attention();
        let (probs, dropped) = attention.probabilities(&q, &kk)?;
        let ctx = attention.context(dropped.as_ref().unwrap_or(&probs), &v)?;
        drop(dropped);
        let (y1, sum1, stats1) = self.first_norm(&ctx)?;
        let (pre, g) = self.intermediate(&y1)?;
        let (y, sum2, stats2) = self.second_norm(&g, &y1, keep)?;
        if !keep {
            return Ok((y, None));
        }
        let spec = &self.spec;
        let kept = Kept {
            q,
            k: kk,
            v,
            probs: (!spec.attention.recompute).then_some(probs),
            ctx,
            norm1: (!spec.recompute_attention_norm).then_some((sum1, stats1)),
            pre: (!spec.recompute_intermediate).then_some(pre),
            norm2: match (spec.recompute_output_norm, sum2) {
                (false, Some(sum)) => Some((sum, stats2)),
                _ => None,
            },
        };
        Ok((y, Some(kept)))
    }

    /// Every input's gradient from the output's, in node-input order (`x`, the sixteen
    /// weights, the score bias); `None` where `wants` says the input takes none.
    fn backward(
        &self,
        dy: &Tensor,
        kept: &Option<Kept>,
        wants: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Some(kept) = kept else {
            candle_core::bail!("encoder layer: backward without the forward's tensors");
        };
        let d = self.dims;
        let rows = d.n * d.s;
        let dy = dy
            .to_dtype(self.dtype)?
            .reshape((rows, d.h))?
            .contiguous()?;
        let want = |i: usize| wants.get(i + 1).copied().unwrap_or(false);
        // What the forward did not keep, recomputed in the forward's order.
        let (sum1, stats1) = match &kept.norm1 {
            Some((s, st)) => (s.clone(), st.clone()),
            None => {
                let (_, s, st) = self.first_norm(&kept.ctx)?;
                (s, st)
            }
        };
        let y1 = k::norm_apply(&sum1, &stats1, &self.norm(G1)?, &self.norm(B1)?, self.dtype)?;
        let pre = match &kept.pre {
            Some(p) => p.clone(),
            None => self.intermediate(&y1)?.0,
        };
        let g = k::act_forward(&pre, self.spec.act)?;
        let (sum2, stats2) = match &kept.norm2 {
            Some((s, st)) => (s.clone(), st.clone()),
            None => {
                let (_, s, st) = self.second_norm(&g, &y1, true)?;
                (s.expect("kept"), st)
            }
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; wants.len()];
        // Weight `i`'s gradient, in the weight's dtype, where one is wanted.
        let mut weight_grads: Vec<(usize, Tensor)> = Vec::with_capacity(16);
        let mut put = |i: usize, t: Tensor| -> candle_core::Result<()> {
            if want(i) {
                weight_grads.push((i, t.to_dtype(self.weights[i].dtype())?));
            }
            Ok(())
        };

        // The second norm and the feed-forward.
        let (dsum2, dpre2) = k::add_norm_backward(
            &dy,
            &sum2,
            &stats2,
            &self.norm(G2)?,
            self.spec.output_dropout,
        )?;
        if want(G2) || want(B2) {
            let (dg2, db2) = k::norm_param_grads(&dy, &sum2, &stats2)?;
            put(G2, dg2)?;
            put(B2, db2)?;
        }
        drop((sum2, stats2));
        if want(BD) {
            put(BD, k::column_sums(&dpre2)?)?;
        }
        if want(WD) {
            put(WD, dpre2.t()?.matmul(&g)?)?;
        }
        let mut adapter_grads: Vec<(usize, AdapterGrads)> = Vec::new();
        let mut dact = dpre2.matmul(&self.w(WD)?)?;
        if let Some(a) = &self.adapters[5] {
            let grads = a.backward(&dpre2, &g)?;
            dact = (dact + &grads.x)?;
            adapter_grads.push((5, grads));
        }
        drop((g, dpre2));
        let dpre = k::act_backward(&dact, &pre, self.spec.act)?;
        drop((dact, pre));
        if want(BI) {
            put(BI, k::column_sums(&dpre)?)?;
        }
        if want(WI) {
            put(WI, dpre.t()?.matmul(&y1)?)?;
        }
        let mut dy1 = (dpre.matmul(&self.w(WI)?)? + dsum2)?;
        if let Some(a) = &self.adapters[4] {
            let grads = a.backward(&dpre, &y1)?;
            dy1 = (dy1 + &grads.x)?;
            adapter_grads.push((4, grads));
        }
        drop((y1, dpre));

        // The first norm and the attention output.
        let (dsum1, dpre1) = k::add_norm_backward(
            &dy1,
            &sum1,
            &stats1,
            &self.norm(G1)?,
            self.spec.attention_output_dropout,
        )?;
        if want(G1) || want(B1) {
            let (dg1, db1) = k::norm_param_grads(&dy1, &sum1, &stats1)?;
            put(G1, dg1)?;
            put(B1, db1)?;
        }
        drop((dy1, sum1, stats1));
        if want(BO) {
            put(BO, k::column_sums(&dpre1)?)?;
        }
        if want(WO) {
            put(WO, dpre1.t()?.matmul(&kept.ctx)?)?;
        }
        let mut dctx = dpre1.matmul(&self.w(WO)?)?;
        if let Some(a) = &self.adapters[3] {
            let grads = a.backward(&dpre1, &kept.ctx)?;
            dctx = (dctx + &grads.x)?;
            adapter_grads.push((3, grads));
        }
        drop(dpre1);

        // The attention.
        let grads_attention = self.attention().backward(
            &dctx,
            (&kept.q, &kept.k, &kept.v),
            kept.probs.as_ref(),
            wants.get(SCORE_BIAS).copied().unwrap_or(false),
        )?;
        drop(dctx);
        let (dq, dk, dv) = (grads_attention.q, grads_attention.k, grads_attention.v);
        let score_grad = match (&self.score_bias, grads_attention.score_bias) {
            (Some(b), Some(g)) => Some(g.reshape((1, d.heads, d.s, d.s))?.to_dtype(b.dtype())?),
            _ => None,
        };
        let scale = self.spec.attention.scale;
        let dqkv = k::from_heads(
            &[(&dq, 0, scale), (&dk, d.h, scale), (&dv, 2 * d.h, 1.0)],
            3 * d.h,
        )?;
        drop((dq, dk, dv));
        if (0..3).any(|i| want(BQ + i)) {
            let db = k::column_sums(&dqkv)?;
            for i in 0..3 {
                put(BQ + i, db.narrow(0, i * d.h, d.h)?)?;
            }
        }
        if (0..3).any(|i| want(WQ + i)) {
            let dw = dqkv.t()?.matmul(&self.x)?;
            for i in 0..3 {
                put(WQ + i, dw.narrow(0, i * d.h, d.h)?.contiguous()?)?;
            }
        }
        let (qkv_grads, qkv_dx) = lora::stacked_backward(&self.qkv_adapters(), &dqkv, &self.x)?;
        for (p, g) in qkv_grads.into_iter().enumerate() {
            if let Some(g) = g {
                adapter_grads.push((p, g));
            }
        }
        if wants.first().copied().unwrap_or(false) {
            let (wqkv, _) = self.qkv_weights()?;
            let dx = lora::plus((dqkv.matmul(&wqkv)? + dsum1)?, qkv_dx)?;
            grads[0] = Some(dx.reshape((d.n, d.s, d.h))?);
        }
        for (p, g) in adapter_grads {
            if let Some(i) = self.adapter_input[p] {
                grads[i] = Some(g.a);
                grads[i + 1] = Some(g.b);
            }
        }
        for (i, g) in weight_grads {
            grads[i + 1] = Some(g);
        }
        if let Some(g) = score_grad {
            grads[SCORE_BIAS] = Some(g);
        }
        Ok(grads)
    }
}
