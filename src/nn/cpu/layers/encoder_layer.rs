//! A whole post-norm transformer encoder layer (BERT's) as one graph node with its
//! backward written out: no autograd graph inside the layer.
//!
//! ```text
//! qkv  = x W_qkv^T + b_qkv                    (one product, the bias pre-filled)
//! ctx  = attention(qkv)                       (crate::nn::cpu::attention::heads: heads in place)
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

use crate::nn::cpu::attention::heads::KeyMask;
use crate::nn::cpu::blocks::Float;
// The node's settings are the passes' (defined there, so that the passes import nothing
// from here).
use crate::nn::cpu::layers::encoder_passes::{backward, forward, lora, Shape, W};
pub use crate::nn::cpu::layers::encoder_passes::{LayerSpec, RelativeSpec};
use crate::nn::cpu::layers::packing::{Packing, View};
use crate::nn::cpu::products::lora_branch::{node_inputs, LoraInput, NodeWeights};
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
    /// (the low-rank branch inside the node, see `crate::nn::cpu::products::lora_branch`); their
    /// base weights above are then the stored ones, frozen.
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
    if let Some(rel) = &spec.relative {
        let tables: Vec<&Tensor> = rel.key.iter().chain(&rel.query).collect();
        let rows = tables.first().map_or(Ok(0), |t| t.dim(0))?;
        let fits = rows > 0
            && tables.iter().all(|t| t.dims() == [rows, h])
            && rel.index.len() == s * s
            && rel.index.iter().all(|&r| (r as usize) < rows);
        if !fits {
            candle_core::bail!(
                "encoder layer: relative positions {:?} do not fit width {h} and {s} tokens",
                tables.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>()
            );
        }
    }
    let tracked = x.track_op()
        || w.all().iter().any(|t| t.track_op())
        || w.lora
            .iter()
            .flatten()
            .any(|l| l.a.track_op() || l.b.track_op())
        || spec.score_bias.as_ref().is_some_and(|t| t.track_op())
        || spec
            .relative
            .iter()
            .flat_map(|r| r.key.iter().chain(&r.query))
            .any(|t| t.track_op());
    match x.dtype() {
        DType::F32 => layer::<f32>(x, w, spec, dims, tracked),
        DType::F64 => layer::<f64>(x, w, spec, dims, tracked),
        other => candle_core::bail!("encoder layer: runs in f32 or f64, not {other:?}"),
    }
}

/// The sixteen weights and the adapters, held by the node.
struct Weights<T>(NodeWeights<T, 16, 6>);

/// DeBERTa's relative positions' inputs, detached and contiguous in the layer's dtype.
struct RelativeInputs {
    key: Option<Tensor>,
    query: Option<Tensor>,
    index: std::sync::Arc<Vec<u32>>,
    positions: usize,
    scale: f64,
}

impl RelativeInputs {
    fn new(spec: &LayerSpec, dtype: DType) -> candle_core::Result<Option<Self>> {
        let Some(rel) = &spec.relative else {
            return Ok(None);
        };
        let own = |t: &Option<Tensor>| -> candle_core::Result<Option<Tensor>> {
            t.as_ref()
                .map(|t| t.detach().to_dtype(dtype)?.contiguous())
                .transpose()
        };
        let (key, query) = (own(&rel.key)?, own(&rel.query)?);
        let positions = match key.as_ref().or(query.as_ref()) {
            Some(t) => t.dim(0)?,
            None => 0,
        };
        Ok(Some(Self {
            key,
            query,
            index: rel.index.clone(),
            positions,
            scale: spec.attention.scale,
        }))
    }
}

impl<T: Float> Weights<T> {
    fn new(w: &LayerWeights) -> candle_core::Result<Self> {
        Ok(Self(NodeWeights::new(w.all().map(Some), &w.lora)?))
    }

    /// Runs `f` on the weights' values (and the relative positions', when the layer has
    /// them).
    fn read<R>(
        &self,
        relative: Option<&RelativeInputs>,
        f: impl FnOnce(&W<T>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let relative_views = match relative {
            Some(r) => Some((
                r.key.as_ref().map(View::new).transpose()?,
                r.query.as_ref().map(View::new).transpose()?,
            )),
            None => None,
        };
        let relative = match (relative, &relative_views) {
            (Some(r), Some((k, q))) => Some(crate::nn::cpu::attention::disentangled::Relative {
                key: k.as_ref().map(|v| v.values::<T>()).transpose()?,
                query: q.as_ref().map(|v| v.values::<T>()).transpose()?,
                index: &r.index,
                positions: r.positions,
                scale: r.scale,
            }),
            _ => None,
        };
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
            relative,
        };
        f(&w)
    }
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
    let relative = RelativeInputs::new(spec, x.dtype())?;
    let (out, kept) = weights.read(relative.as_ref(), |wv| {
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
    let tables: Vec<Tensor> = spec
        .relative
        .iter()
        .flat_map(|r| r.key.iter().chain(&r.query))
        .cloned()
        .collect();
    inputs.extend(&tables);
    let tables_of_grads = tables.clone();
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
            let grads = weights.read(relative.as_ref(), |wv| {
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
            // The relative positions' projections, as their inputs' order.
            if let Some(d) = grads.drelative {
                let mut tables = tables_of_grads.iter();
                for g in [d.key, d.query].into_iter().flatten() {
                    let table = tables.next().expect("one input per gradient");
                    let g = Tensor::from_vec(g, table.shape(), &candle_core::Device::Cpu)?;
                    out.push(Some(g.to_dtype(table.dtype())?));
                }
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
