//! The CPU kernels of a MaxSim block ([`crate::loss::MaxSim`]): from a block's token
//! similarities (one matrix product), each query token's best kept token of each passage
//! and where it is; from those, the block's scores; and the gradient of the scores sent
//! to the chosen pairs of token vectors (a gather and a scatter of `dim` values per
//! (query token, passage), where the composed path multiplies by a dense one-hot matrix
//! as large as the similarities).

use candle_core::Tensor;
use rayon::prelude::*;

use crate::nn::cpu::layers::packing::View;

/// A block of `nq` queries of `lq` tokens by `np` passages of `lp` tokens.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockShape {
    pub nq: usize,
    pub lq: usize,
    pub np: usize,
    pub lp: usize,
}

/// What the max chose in a block: for each (query token, passage) `[nq * lq, np]`, the
/// best similarity over the passage's kept tokens and that token's index (`u32::MAX`
/// where the passage keeps none).
pub(crate) struct Chosen {
    pub best: Vec<f32>,
    pub at: Vec<u32>,
}

/// The max over each passage's kept tokens (`p_kept` `[np * lp]`) of the similarities
/// `sims` `[nq * lq, np * lp]` (contiguous f32 on the CPU), rows in parallel.
pub(crate) fn choose(sims: &Tensor, p_kept: &[bool], shape: BlockShape) -> crate::Result<Chosen> {
    let BlockShape { nq, lq, np, lp } = shape;
    let view = View::new(sims)?;
    let sims = view.values::<f32>()?;
    let rows = nq * lq;
    let mut best = vec![0f32; rows * np];
    let mut at = vec![u32::MAX; rows * np];
    best.par_chunks_mut(np)
        .zip(at.par_chunks_mut(np))
        .enumerate()
        .for_each(|(r, (best, at))| {
            let row = &sims[r * np * lp..(r + 1) * np * lp];
            for j in 0..np {
                let mut top = f32::NEG_INFINITY;
                let mut pick = u32::MAX;
                for t in 0..lp {
                    let v = row[j * lp + t];
                    // The first of equal maxima, as argmax.
                    if p_kept[j * lp + t] && (pick == u32::MAX || v > top) {
                        top = v;
                        pick = t as u32;
                    }
                }
                if pick != u32::MAX {
                    best[j] = top;
                    at[j] = pick;
                }
            }
        });
    Ok(Chosen { best, at })
}

/// The block's scores `[nq, np]`: each kept query token's best (`q_kept` `[nq * lq]`),
/// summed.
pub(crate) fn scores(chosen: &Chosen, q_kept: &[bool], shape: BlockShape) -> Vec<f32> {
    let BlockShape { nq, lq, np, .. } = shape;
    let mut out = vec![0f32; nq * np];
    for i in 0..nq {
        for s in 0..lq {
            if !q_kept[i * lq + s] {
                continue;
            }
            let r = i * lq + s;
            for j in 0..np {
                out[i * np + j] += chosen.best[r * np + j];
            }
        }
    }
    out
}

/// Which token vectors of `x` `[rows * tokens, dim]` (contiguous f32 on the CPU) are there
/// (not all zero), read in place.
pub(crate) fn kept(x: &Tensor, dim: usize) -> crate::Result<Vec<bool>> {
    let view = View::new(x)?;
    Ok(view
        .values::<f32>()?
        .chunks(dim.max(1))
        .map(|v| v.iter().any(|&x| x != 0.0))
        .collect())
}

/// [`scatter`] reading the token vectors of one block in place: queries `q_rows` of `q`
/// and passages `p_rows` of `p` (token-vector rows of the contiguous f32 CPU tensors).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_block(
    chosen: &Chosen,
    q_kept: &[bool],
    (q, q_rows): (&Tensor, std::ops::Range<usize>),
    (p, p_rows): (&Tensor, std::ops::Range<usize>),
    g: &[f32],
    (dq, dp): (&mut [f32], &mut [f32]),
    shape: BlockShape,
    dim: usize,
) -> crate::Result<()> {
    let (qv, pv) = (View::new(q)?, View::new(p)?);
    let q = &qv.values::<f32>()?[q_rows.start * dim..q_rows.end * dim];
    let p = &pv.values::<f32>()?[p_rows.start * dim..p_rows.end * dim];
    scatter(chosen, q_kept, (q, p), g, (dq, dp), shape, dim);
    Ok(())
}

/// Adds the gradient of the block's scores `g` `[nq, np]` to the query token vectors'
/// `dq` `[nq * lq, dim]` and the passage token vectors' `dp` `[np * lp, dim]`: each kept
/// query token gets `g * p[chosen]`, each chosen passage token `g * q`.
fn scatter(
    chosen: &Chosen,
    q_kept: &[bool],
    (q, p): (&[f32], &[f32]),
    g: &[f32],
    (dq, dp): (&mut [f32], &mut [f32]),
    shape: BlockShape,
    dim: usize,
) {
    let BlockShape { lq, np, lp, .. } = shape;
    dq.par_chunks_mut(dim).enumerate().for_each(|(r, dq)| {
        let i = r / lq;
        if !q_kept[r] {
            return;
        }
        for j in 0..np {
            let t = chosen.at[r * np + j];
            if t == u32::MAX {
                continue;
            }
            let w = g[i * np + j];
            let pt = &p[(j * lp + t as usize) * dim..][..dim];
            for (d, v) in dq.iter_mut().zip(pt) {
                *d += w * v;
            }
        }
    });
    dp.par_chunks_mut(lp * dim).enumerate().for_each(|(j, dp)| {
        for (r, &kept) in q_kept.iter().enumerate() {
            let t = chosen.at[r * np + j];
            if !kept || t == u32::MAX {
                continue;
            }
            let w = g[(r / lq) * np + j];
            let qr = &q[r * dim..][..dim];
            for (d, v) in dp[t as usize * dim..][..dim].iter_mut().zip(qr) {
                *d += w * v;
            }
        }
    });
}
