//! The attention of a layer node on its packed `[rows, 3h]` query-key-value buffer: the
//! per-head kernel ([`crate::nn::cpu::attention::heads`]) reading the heads where they lie and
//! writing the context `[rows, h]` (and, backward, the gradient `[rows, 3h]`) in place, for BERT's
//! and ModernBERT's layer nodes.

use crate::nn::cpu::attention::heads::{self as kernel, HeadLayout, KeyMask, Rows};
use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::AttentionSpec;

/// The attention kernel's parameters of a spec.
fn params(attention: &AttentionSpec) -> kernel::Params {
    kernel::Params {
        scale: attention.scale,
        dropout: attention.dropout,
        window: attention.window,
    }
}

/// The attention of the packed `[rows, 3h]` `qkv` (sequences of `rows`): the context
/// `[rows, h]` and, when `keep` and the probabilities are not recomputed, the
/// probabilities.
pub(in crate::nn) fn attend<T: Float>(
    qkv: &[T],
    (mask, rows): (&KeyMask<T>, &Rows),
    attention: &AttentionSpec,
    kdims: kernel::Dims,
    keep: bool,
) -> (Vec<T>, Option<Vec<T>>) {
    let _span = crate::profile::span(|| "cpu.attention".into());
    let (d, h) = (kdims.d, kdims.heads * kdims.d);
    let total: usize = rows.queries.iter().sum();
    let mut ctx = vec![T::zero(); total * h];
    let params = params(attention);
    let packed = |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let p = qkv.as_ptr();
    // SAFETY: qkv is a [rows, 3h] buffer, ctx a [rows, h] one.
    let probs = unsafe {
        kernel::forward(
            (kdims, rows),
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            (ctx.as_mut_ptr(), HeadLayout::in_rows(h, d, 0)),
            keep && !attention.recompute,
        )
    };
    (ctx, probs)
}

/// Which gradient of the mask's score bias the backward of [`attend`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::nn) enum ScoreGrad {
    /// None (the mask has no score bias, or it takes no gradient).
    None,
    /// A shared bias's, `[heads, s, s]`, summed over the sequences.
    Summed,
    /// Each sequence's, `[n, heads, s, s]`.
    PerSequence,
}

/// `dqkv` `[rows, 3h]` from `dctx` `[rows, h]` (the backward of [`attend`]), and the
/// gradient of the mask's score bias that `scores` asks for.
pub(in crate::nn) fn attention_backward<T: Float>(
    qkv: &[T],
    probs: Option<&[T]>,
    dctx: &[T],
    (mask, rows): (&KeyMask<T>, &Rows),
    attention: &AttentionSpec,
    kdims: kernel::Dims,
    scores: ScoreGrad,
) -> (Vec<T>, Option<Vec<T>>) {
    let (d, s) = (kdims.d, kdims.s);
    let h = kdims.heads * d;
    let total: usize = rows.queries.iter().sum();
    let mut dqkv = vec![T::zero(); total * 3 * h];
    let block = kdims.heads * s * s;
    let mut dscores = (scores != ScoreGrad::None).then(|| vec![T::zero(); kdims.n * block]);
    let params = params(attention);
    let packed = |part: usize| HeadLayout::in_rows(3 * h, d, part * h);
    let (p, g) = (qkv.as_ptr(), dqkv.as_mut_ptr());
    // SAFETY: qkv and dqkv are [rows, 3h] buffers (the three gradients in disjoint
    // columns), dctx a [rows, h] one.
    unsafe {
        kernel::backward(
            (kdims, rows),
            &params,
            mask,
            (p, packed(0)),
            (p, packed(1)),
            (p, packed(2)),
            probs,
            (dctx.as_ptr(), HeadLayout::in_rows(h, d, 0)),
            (g, packed(0)),
            (g, packed(1)),
            (g, packed(2)),
            dscores.as_mut().map(|b| b.as_mut_ptr()),
        );
    }
    if scores == ScoreGrad::PerSequence {
        return (dqkv, dscores);
    }
    // The score bias is shared: its gradient sums the sequences', in their order.
    let dscores = dscores.map(|per_sequence| {
        let mut sum = per_sequence[..block].to_vec();
        for seq in per_sequence[block..].chunks_exact(block) {
            for (a, &g) in sum.iter_mut().zip(seq) {
                *a += g;
            }
        }
        sum
    });
    (dqkv, dscores)
}
