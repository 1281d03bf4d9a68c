//! Attention as graph nodes over the small-head kernel of [`crate::nn::cpu::attention::heads`]:
//! scaled dot-product attention over `q`, `k`, `v`, and BERT's self-attention from the hidden
//! states (one product for query, key and value). They keep the probabilities, or with
//! `recompute` nothing but their inputs.

use candle_core::Tensor;
use num_traits::Zero as _;

use crate::nn::cpu::attention::heads::{Dims, HeadLayout, KeyMask, Params, Rows};
use crate::nn::cpu::blocks::with_values;
use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::elementwise::accumulate::{AddInPlace, SumRows};
use crate::nn::node::{node, node_n};

/// What scaled dot-product attention needs besides `q`, `k`, `v`.
#[derive(Debug, Clone)]
pub struct AttentionSpec {
    /// Additive key mask `[n, 1, 1, k]` (BERT's -10000 on padding). A key whose bias is
    /// -10000 or below is masked: probability exactly 0, and the fused kernel does not
    /// compute it ([`crate::nn::cpu::attention::heads`](mod@crate::nn::cpu::attention::heads)).
    pub bias: Tensor,
    /// Multiplies the scores (`1 / sqrt(head_dim)`).
    pub scale: f64,
    /// Dropout on the probabilities: `(mask seed, drop probability)`.
    pub dropout: Option<(u64, f32)>,
    /// Recompute the probabilities (scores, softmax, dropout mask) in the backward pass
    /// instead of keeping them (selective recompute): nothing of size `[n, heads, s, s]`
    /// outlives the forward, for one more `q k^T` product and softmax in the backward.
    pub recompute: bool,
    /// Attend only to keys within this distance of the query (`|i - j| <= w`: a sliding
    /// window, ModernBERT's local layers); `None` for every key.
    pub window: Option<usize>,
}

/// The attention kernel's shape, parameters and key mask for `n` sequences of `s` tokens
/// in `heads` heads of `d`, with the spec's bias read as `[n, s]`.
fn attention_setup<T: Float>(
    spec: &AttentionSpec,
    n: usize,
    heads: usize,
    s: usize,
    d: usize,
) -> candle_core::Result<(Dims, Params, KeyMask<T>)> {
    if spec.bias.elem_count() != n * s {
        candle_core::bail!(
            "attention: key mask {:?} does not fit {n} sequences of {s} tokens",
            spec.bias.dims()
        );
    }
    let bias = spec.bias.contiguous()?;
    let mask = with_values::<T, _>(&bias, |b| Ok(KeyMask::new(b, n, s)))?;
    let params = Params {
        scale: spec.scale,
        dropout: spec.dropout,
        window: spec.window,
    };
    Ok((Dims { n, heads, s, d }, params, mask))
}

/// Calls `$body` with `$t` bound to the float type of `$dtype` (f32 or f64).
macro_rules! with_float {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            other => candle_core::bail!("fused kernels run in f32 or f64, not {other:?}"),
        }
    };
}

/// The kept probabilities of the attention kernel, as a flat tensor.
fn kept_tensor<T: Float>(kept: Option<Vec<T>>) -> candle_core::Result<Option<Tensor>> {
    kept.map(|k| {
        let len = k.len();
        Tensor::from_vec(k, len, &candle_core::Device::Cpu)
    })
    .transpose()
}

/// `dropout(softmax(scale * q k^T + bias)) v` for `q`, `k`, `v` `[n, heads, s, d]`, as one
/// node ([`crate::nn::cpu::attention::heads`](mod@crate::nn::cpu::attention::heads): one task per
/// sequence and head, padding keys skipped). With `spec.recompute` it keeps nothing of size `[n,
/// heads, s, s]`: the backward recomputes the probabilities from `q` and `k` with the same
/// arithmetic and regenerates the dropout mask from its seed (Megatron's selective recompute of
/// attention); without it the node keeps the probabilities before dropout.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    let (n, heads, s, d) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        candle_core::bail!(
            "attention: q {:?}, k {:?} and v {:?} differ",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let (qd, kd, vd) = (
        q.contiguous()?.detach(),
        k.contiguous()?.detach(),
        v.contiguous()?.detach(),
    );
    let layout = HeadLayout::heads_first(heads, s, d);
    let rows = Rows::padded(n, s);
    let len = n * heads * s * d;
    with_float!(q.dtype(), T => {
        let (dims, params, mask) = attention_setup::<T>(spec, n, heads, s, d)?;
        let mut out = vec![T::zero(); len];
        let kept = with_values::<T, _>(&qd, |qv| {
            with_values::<T, _>(&kd, |kv| {
                with_values::<T, _>(&vd, |vv| {
                    // SAFETY: q, k, v and out are contiguous [n, heads, s, d] buffers.
                    Ok(unsafe {
                        crate::nn::cpu::attention::heads::forward(
                            (dims, &rows),
                            &params,
                            &mask,
                            (qv.as_ptr(), layout),
                            (kv.as_ptr(), layout),
                            (vv.as_ptr(), layout),
                            (out.as_mut_ptr(), layout),
                            !spec.recompute,
                        )
                    })
                })
            })
        })?;
        let kept = kept_tensor(kept)?;
        let out = Tensor::from_vec(out, (n, heads, s, d), q.device())?;
        node(
            "gradcache-attention",
            [q, k, v],
            out,
            Box::new(move |dctx| {
                let dctx = dctx.contiguous()?;
                let mut grads = [vec![T::zero(); len], vec![T::zero(); len], vec![T::zero(); len]];
                let [gq, gk, gv] = &mut grads;
                let (gq, gk, gv) = (gq.as_mut_ptr(), gk.as_mut_ptr(), gv.as_mut_ptr());
                with_values::<T, _>(&qd, |qv| {
                    with_values::<T, _>(&kd, |kv| {
                        with_values::<T, _>(&vd, |vv| {
                            with_values::<T, _>(&dctx, |dc| {
                                let run = |kept: Option<&[T]>| {
                                    // SAFETY: every buffer is a contiguous [n, heads, s, d].
                                    unsafe {
                                        crate::nn::cpu::attention::heads::backward(
                                            (dims, &rows),
                                            &params,
                                            &mask,
                                            (qv.as_ptr(), layout),
                                            (kv.as_ptr(), layout),
                                            (vv.as_ptr(), layout),
                                            kept,
                                            (dc.as_ptr(), layout),
                                            (gq, layout),
                                            (gk, layout),
                                            (gv, layout),
                                            None,
                                        )
                                    }
                                };
                                match &kept {
                                    Some(t) => with_values::<T, _>(t, |kv| {
                                        run(Some(kv));
                                        Ok(())
                                    }),
                                    None => {
                                        run(None);
                                        Ok(())
                                    }
                                }
                            })
                        })
                    })
                })?;
                let dev = candle_core::Device::Cpu;
                let [gq, gk, gv] = grads;
                Ok([
                    Some(Tensor::from_vec(gq, (n, heads, s, d), &dev)?),
                    Some(Tensor::from_vec(gk, (n, heads, s, d), &dev)?),
                    Some(Tensor::from_vec(gv, (n, heads, s, d), &dev)?),
                ])
            }),
        )
    })
}

/// BERT's self-attention from the hidden states `x` `[n, s, h]` as one node over
/// `(x, W_qkv, b_qkv)`, the query, key and value projections stacked into one `[3h, h]`
/// weight: one matrix product gives the packed `[n s, 3h]` queries, keys and values, which
/// the attention kernel
/// ([`crate::nn::cpu::attention::heads`](mod@crate::nn::cpu::attention::heads)) reads where they
/// lie, head by head, writing the context with the heads merged, `[n, s, h]`: no split or merge
/// copies. The backward takes the kept probabilities or recomputes them (`spec.recompute`), writes
/// `dq`, `dk`, `dv` into one packed `[n s, 3h]` gradient and runs one product for `dx` and one for
/// `dW_qkv`. candle's autograd sees one node where three projections, the head split and merge and
/// the attention record fifteen, each with a zero-filled accumulator and an addition in the
/// backward pass.
pub fn self_attention(
    x: &Tensor,
    w_qkv: &Tensor,
    b_qkv: &Tensor,
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    self_attention_node(x, &[w_qkv], &[b_qkv], heads, spec)
}

/// [`self_attention`] over the three projections as they are stored, `[W_q, W_k, W_v]`
/// and `[b_q, b_k, b_v]`: the node stacks them for its products and hands each its block
/// of the gradient, so the graph holds no stacked copy of them.
pub fn self_attention_projections(
    x: &Tensor,
    [wq, wk, wv]: [&Tensor; 3],
    [bq, bk, bv]: [&Tensor; 3],
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    self_attention_node(x, &[wq, wk, wv], &[bq, bk, bv], heads, spec)
}

/// The node of [`self_attention`] over `x`, the `weights` and the `biases` (one stacked
/// projection, or one per query, key and value).
fn self_attention_node(
    x: &Tensor,
    weights: &[&Tensor],
    biases: &[&Tensor],
    heads: usize,
    spec: &AttentionSpec,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    // The stacked projection, made again in the backward: the graph keeps no copy.
    let stack = |ts: &[Tensor]| -> candle_core::Result<Tensor> {
        match ts {
            [one] => Ok(one.clone()),
            many => Tensor::cat(many, 0),
        }
    };
    let weights_d: Vec<Tensor> = weights.iter().map(|t| t.detach()).collect();
    let biases_d: Vec<Tensor> = biases.iter().map(|t| t.detach()).collect();
    let (wd, bd) = (stack(&weights_d)?, stack(&biases_d)?);
    if heads == 0
        || h % heads != 0
        || wd.dims2()? != (3 * h, h)
        || bd.dims1()? != 3 * h
        || weights.len() != biases.len()
    {
        candle_core::bail!(
            "self-attention: hidden size {h}, {heads} heads and a {:?} projection do not fit",
            wd.dims()
        );
    }
    let d = h / heads;
    let rows = n * s;
    let xd = x.detach();
    let x2 = xd.reshape((rows, h))?;
    let qkv = x2.matmul(&wd.t()?)?;
    qkv.inplace_op2(&bd, &AddInPlace { rows: true })?;
    drop((wd, bd));
    let packed = move |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let merged = HeadLayout::in_rows(h, d, 0);
    let seqs = Rows::padded(n, s);
    with_float!(x.dtype(), T => {
        let (dims, params, mask) = attention_setup::<T>(spec, n, heads, s, d)?;
        let mut out = vec![T::zero(); rows * h];
        let kept = with_values::<T, _>(&qkv, |all| {
            let p = all.as_ptr();
            // SAFETY: qkv is a contiguous [n s, 3h] buffer, out a [n s, h] one.
            Ok(unsafe {
                crate::nn::cpu::attention::heads::forward(
                    (dims, &seqs),
                    &params,
                    &mask,
                    (p, packed(0)),
                    (p, packed(1)),
                    (p, packed(2)),
                    (out.as_mut_ptr(), merged),
                    !spec.recompute,
                )
            })
        })?;
        let kept = kept_tensor(kept)?;
        let out = Tensor::from_vec(out, (n, s, h), x.device())?;
        let parts = weights.len();
        let mut inputs = vec![x];
        inputs.extend(weights);
        inputs.extend(biases);
        node_n(
            "gradcache-self-attention",
            &inputs,
            out,
            Box::new(move |dout| {
                let dout = dout.contiguous()?;
                let mut dqkv = vec![T::zero(); rows * 3 * h];
                with_values::<T, _>(&qkv, |all| {
                    with_values::<T, _>(&dout, |dc| {
                        let (p, g) = (all.as_ptr(), dqkv.as_mut_ptr());
                        let run = |kept: Option<&[T]>| {
                            // SAFETY: qkv and dqkv are contiguous [n s, 3h] buffers (the
                            // three gradients in disjoint columns), dout a [n s, h] one.
                            unsafe {
                                crate::nn::cpu::attention::heads::backward(
                                    (dims, &seqs),
                                    &params,
                                    &mask,
                                    (p, packed(0)),
                                    (p, packed(1)),
                                    (p, packed(2)),
                                    kept,
                                    (dc.as_ptr(), merged),
                                    (g, packed(0)),
                                    (g, packed(1)),
                                    (g, packed(2)),
                                    None,
                                )
                            }
                        };
                        match &kept {
                            Some(t) => with_values::<T, _>(t, |kv| {
                                run(Some(kv));
                                Ok(())
                            }),
                            None => {
                                run(None);
                                Ok(())
                            }
                        }
                    })
                })?;
                drop(dout);
                let dqkv = Tensor::from_vec(dqkv, (rows, 3 * h), &candle_core::Device::Cpu)?;
                let dx = dqkv.matmul(&stack(&weights_d)?)?.reshape((n, s, h))?;
                let dw = dqkv.t()?.matmul(&x2)?;
                let db = dqkv.apply_op1_no_bwd(&SumRows)?;
                // Each projection its block of rows.
                let block = 3 * h / parts;
                let mut grads = vec![Some(dx)];
                for g in [dw, db] {
                    for i in 0..parts {
                        grads.push(Some(g.narrow(0, i * block, block)?));
                    }
                }
                Ok(grads)
            }),
        )
    })
}
