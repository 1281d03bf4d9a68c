//! DeBERTa's disentangled attention terms on a layer node's packed query-key-value
//! buffer: the bias each sequence's scores get from the relative positions, and its
//! backward into the queries, the keys and the positions' projections.
//!
//! ```text
//! C2P[i, r] = q_i . Kr_r            P2C[j, r] = k_j . Qr_r        (r < R = 2 span)
//! bias[i, j] = c (C2P[i, idx(i, j)] + P2C[j, idx(i, j)])
//! ```
//!
//! `Kr` and `Qr` `[R, h]` are the relative embeddings through the key and query
//! projections (inputs of the node: their own graph gives the projections' and the
//! embeddings' gradients), `idx` the relative position's row (`[s, s]`), `c` the
//! attention's scale. Backward, from the gradient `t` of the scores after scaling:
//!
//! ```text
//! dC2P[i, r] = c sum_j [idx(i, j) = r] t[i, j]     dq_i += dC2P[i] Kr     dKr += dC2P^T q
//! dP2C[j, r] = c sum_i [idx(i, j) = r] t[i, j]     dk_j += dP2C[j] Qr     dQr += dP2C^T k
//! ```
//!
//! One task per head: each walks the sequences in order, so the positions' gradients are
//! summed in a fixed order (no dependence on the thread count).

use crate::nn::cpu::attention::heads::{for_tasks, gemm_into, Dims, KeyMask, Rows};
use crate::nn::cpu::blocks::{Float, SharedConst, SharedMut};

/// The relative positions' inputs of a layer node.
pub(in crate::nn) struct Relative<'a, T> {
    /// `Kr` `[R, h]` (content-to-position), if the model has the term.
    pub key: Option<&'a [T]>,
    /// `Qr` `[R, h]` (position-to-content), if the model has the term.
    pub query: Option<&'a [T]>,
    /// The row of every (query, key) pair of a sequence, `[s, s]`.
    pub index: &'a [u32],
    /// `R`.
    pub positions: usize,
    /// `c`.
    pub scale: f64,
}

/// The gradients of `Kr` and `Qr` (`[R, h]` each, for the terms the model has).
pub(in crate::nn) struct RelativeGrads<T> {
    pub key: Option<Vec<T>>,
    pub query: Option<Vec<T>>,
}

/// The per-sequence score bias `[n, heads, s, s]` of the packed `qkv` `[rows, 3h]`
/// (each sequence's `l x l` block written, where `l` is its computed length).
pub(in crate::nn) fn scores<T: Float>(
    qkv: &[T],
    rel: &Relative<T>,
    (dims, rows): (Dims, &Rows),
    mask: &KeyMask<T>,
) -> Vec<T> {
    let (s, d, heads) = (dims.s, dims.d, dims.heads);
    let (h, r) = (heads * d, rel.positions);
    let mut out = vec![T::zero(); dims.n * heads * s * s];
    let dst = SharedMut(out.as_mut_ptr());
    let src = SharedConst(qkv.as_ptr());
    let c = T::of(rel.scale);
    for_tasks::<T>(dims.n * heads, 2 * s * r, |task, buf| {
        let (b, head) = (task / heads, task % heads);
        let l = mask.len(b);
        let (c2p, p2c) = buf.split_at_mut(s * r);
        let row0 = rows.starts[b];
        // SAFETY: the packed rows of sequence b, head `head`'s columns; the positions
        // [R, h]; each task writes its own block of `out`.
        unsafe {
            let q = src.get().add(row0 * 3 * h + head * d);
            let k = src.get().add(row0 * 3 * h + h + head * d);
            // C2P [l, R] = q Kr_head^T ; P2C [l, R] = k Qr_head^T
            for (x, table, part) in [(q, rel.key, &mut *c2p), (k, rel.query, &mut *p2c)] {
                if let Some(table) = table {
                    gemm_into(
                        (l, r, d),
                        (part.as_mut_ptr(), r),
                        false,
                        (x, 3 * h, 1),
                        (table.as_ptr().add(head * d), 1, h),
                    );
                }
            }
            let block = dst.get().add((b * heads + head) * s * s);
            for i in 0..l {
                let out_row = std::slice::from_raw_parts_mut(block.add(i * s), l);
                let index = &rel.index[i * s..i * s + l];
                for (j, (o, &at)) in out_row.iter_mut().zip(index).enumerate() {
                    let at = at as usize;
                    let mut v = T::zero();
                    if rel.key.is_some() {
                        v += c2p[i * r + at];
                    }
                    if rel.query.is_some() {
                        v += p2c[j * r + at];
                    }
                    *o = c * v;
                }
            }
        }
    });
    out
}

/// The backward of [`scores`] from `dscores` (`[n, heads, s, s]`, the gradient of each
/// sequence's scores after scaling): the queries' and keys' gradients added into `dqkv`
/// `[rows, 3h]`, and the positions' gradients returned.
pub(in crate::nn) fn backward<T: Float>(
    qkv: &[T],
    dscores: &[T],
    rel: &Relative<T>,
    (dims, rows): (Dims, &Rows),
    mask: &KeyMask<T>,
    dqkv: &mut [T],
) -> RelativeGrads<T> {
    let (s, d, heads) = (dims.s, dims.d, dims.heads);
    let (h, r) = (heads * d, rel.positions);
    let c = T::of(rel.scale);
    // Per head, `[R, d]` each, written by that head's task alone.
    let mut dkey = rel.key.map(|_| vec![T::zero(); heads * r * d]);
    let mut dquery = rel.query.map(|_| vec![T::zero(); heads * r * d]);
    let (dk_ptr, dq_ptr) = (
        dkey.as_mut().map(|v| SharedMut(v.as_mut_ptr())),
        dquery.as_mut().map(|v| SharedMut(v.as_mut_ptr())),
    );
    let src = SharedConst(qkv.as_ptr());
    let grad = SharedMut(dqkv.as_mut_ptr());
    let ds = SharedConst(dscores.as_ptr());
    for_tasks::<T>(heads, 2 * s * r, |head, buf| {
        let (dc2p, dp2c) = buf.split_at_mut(s * r);
        for b in 0..dims.n {
            let l = mask.len(b);
            let row0 = rows.starts[b];
            dc2p[..l * r].fill(T::zero());
            dp2c[..l * r].fill(T::zero());
            // SAFETY: the block of (b, head) of dscores; the packed rows of sequence b in
            // head `head`'s columns of qkv and dqkv (this task's alone); this head's
            // blocks of the positions' gradients.
            unsafe {
                let block = ds.get().add((b * heads + head) * s * s);
                for i in 0..l {
                    let t = std::slice::from_raw_parts(block.add(i * s), l);
                    let index = &rel.index[i * s..i * s + l];
                    for (j, (&g, &at)) in t.iter().zip(index).enumerate() {
                        let g = c * g;
                        dc2p[i * r + at as usize] += g;
                        dp2c[j * r + at as usize] += g;
                    }
                }
                let parts = [(rel.key, dk_ptr, &*dc2p, 0), (rel.query, dq_ptr, &*dp2c, h)];
                for (table, dtable, dpart, at) in parts {
                    let (Some(table), Some(dtable)) = (table, dtable) else {
                        continue;
                    };
                    let x = src.get().add(row0 * 3 * h + at + head * d);
                    let dx = grad.get().add(row0 * 3 * h + at + head * d);
                    // dx [l, d] += dpart [l, R] table_head [R, d]
                    gemm_into(
                        (l, d, r),
                        (dx, 3 * h),
                        true,
                        (dpart.as_ptr(), r, 1),
                        (table.as_ptr().add(head * d), h, 1),
                    );
                    // dtable_head [R, d] += dpart^T [R, l] x [l, d]
                    gemm_into(
                        (r, d, l),
                        (dtable.get().add(head * r * d), d),
                        true,
                        (dpart.as_ptr(), 1, r),
                        (x, 3 * h, 1),
                    );
                }
            }
        }
    });
    // [heads, R, d] -> [R, h].
    let merge = |per_head: Vec<T>| {
        let mut out = vec![T::zero(); r * h];
        for head in 0..heads {
            for row in 0..r {
                let from = &per_head[(head * r + row) * d..(head * r + row + 1) * d];
                out[row * h + head * d..row * h + (head + 1) * d].copy_from_slice(from);
            }
        }
        out
    };
    RelativeGrads {
        key: dkey.map(merge),
        query: dquery.map(merge),
    }
}
