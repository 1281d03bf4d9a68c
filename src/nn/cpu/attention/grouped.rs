//! Attention with grouped key-value heads under a causal or windowed pattern, for a
//! decoder layer's packed real tokens: the query, key and value heads of each token side
//! by side in one `[rows, (heads + 2 kv_heads) d]` buffer, the sequences packed one after
//! another (no padding, so no key mask).
//!
//! One task per (sequence, key-value head) takes the `heads / kv_heads` query heads of its
//! group through everything while its keys and values stay in cache: a key-value head is
//! read once for its group, never copied per query head (transformers' `repeat_kv`). The
//! query rows go in blocks of [`BLOCK_QUERIES`]; a block computes its scores against the
//! keys its rows can see and no others, so causal attention does about half the work of
//! the full square (`(1 + 1/blocks) / 2` of it), and a window only the band:
//!
//! - causal: query `i` sees keys `j <= i` (and `i - w <= j` with a window `w`);
//! - bidirectional: every key (`|i - j| <= w` with a window).
//!
//! Keys a row does not see get probability exactly 0. Dropout on the probabilities draws
//! each element's mask at its place in the padded `[n, heads, s, s]` probabilities
//! ([`crate::rng::keep`]), as the composed form does, so the two agree bit for bit. The
//! backward takes the probabilities kept by the forward (only the blocks computed) or
//! recomputes them with the same arithmetic; the key and value gradients of a group are
//! summed over its query heads in head order, in the task that owns them.

use crate::nn::cpu::attention::heads::{
    for_tasks, gemm_into as matmul, softmax_rows, softmax_shift,
};
use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{Float, SharedConst, SharedMut};

/// Query rows per block of a causal or windowed attention.
pub const BLOCK_QUERIES: usize = 32;

/// The shape of a grouped attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grouped {
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (a divisor of `heads`).
    pub kv_heads: usize,
    /// Head width.
    pub d: usize,
}

impl Grouped {
    /// Query heads per key-value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Width of a packed row: the queries, then the keys, then the values.
    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }

    /// Column of query head `h`.
    fn q(&self, h: usize) -> usize {
        h * self.d
    }

    /// Column of key head `g`.
    fn k(&self, g: usize) -> usize {
        (self.heads + g) * self.d
    }

    /// Column of value head `g`.
    fn v(&self, g: usize) -> usize {
        (self.heads + self.kv_heads + g) * self.d
    }
}

/// Which keys each query sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pattern {
    /// Keys up to the query's own place only.
    pub causal: bool,
    /// A sliding window: `i - w <= j` (causal) or `|i - j| <= w` (bidirectional).
    pub window: Option<usize>,
}

impl Pattern {
    /// The keys `[lo, hi)` query `i` of a sequence of `len` sees.
    fn visible(&self, i: usize, len: usize) -> (usize, usize) {
        let lo = self.window.map_or(0, |w| i.saturating_sub(w));
        let hi = match (self.causal, self.window) {
            (true, _) => i + 1,
            (false, Some(w)) => (i + w + 1).min(len),
            (false, None) => len,
        };
        (lo, hi)
    }

    /// The query blocks of the rows `from..len` of a sequence of `len` tokens and the keys
    /// each reads (a task's scratch is one block, `BLOCK_QUERIES x len` at most, however
    /// long the text).
    fn blocks(&self, from: usize, len: usize) -> Vec<Block> {
        (from.min(len)..len)
            .step_by(BLOCK_QUERIES)
            .map(|r0| {
                let r1 = (r0 + BLOCK_QUERIES).min(len);
                let (k0, _) = self.visible(r0, len);
                let (_, k1) = self.visible(r1 - 1, len);
                Block {
                    rows: (r0, r1),
                    keys: (k0, k1),
                }
            })
            .collect()
    }
}

/// Query rows `[rows.0, rows.1)` of a sequence and the keys `[keys.0, keys.1)` they read.
#[derive(Debug, Clone, Copy)]
struct Block {
    rows: (usize, usize),
    keys: (usize, usize),
}

impl Block {
    fn nr(&self) -> usize {
        self.rows.1 - self.rows.0
    }

    fn nk(&self) -> usize {
        self.keys.1 - self.keys.0
    }
}

/// The packed sequences: where each starts, its length, and where its first row sits in
/// the padded `[n, s]` batch (`shift`: the padding before it), for dropout's places.
#[derive(Debug, Clone)]
pub struct Sequences {
    /// First packed row of each sequence.
    pub starts: Vec<usize>,
    /// Rows of each sequence.
    pub lengths: Vec<usize>,
    /// The padded column of each sequence's first row.
    pub shift: Vec<usize>,
    /// The padded length.
    pub s: usize,
    /// The first query row of each sequence: its rows from there on are the queries (0:
    /// every row; its last: only the last token's output is wanted, as last-token pooling
    /// reads), every row is a key.
    pub queries_from: Vec<usize>,
}

/// What the attention computes besides its inputs.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Multiplies the scores.
    pub scale: f64,
    /// Dropout on the probabilities: `(mask seed, drop probability)`.
    pub dropout: Option<(u64, f32)>,
    /// Which keys each query sees.
    pub pattern: Pattern,
}

/// Each sequence's blocks and where its heads' kept probabilities start.
struct Plan {
    blocks: Vec<Vec<Block>>,
    /// Kept probabilities of one head of each sequence.
    per_head: Vec<usize>,
    /// Offset of each sequence's kept probabilities.
    offsets: Vec<usize>,
    total: usize,
}

impl Plan {
    fn new(seqs: &Sequences, dims: Grouped, pattern: Pattern) -> Self {
        let blocks: Vec<Vec<Block>> = seqs
            .lengths
            .iter()
            .zip(&seqs.queries_from)
            .map(|(&l, &from)| pattern.blocks(from, l))
            .collect();
        let per_head: Vec<usize> = blocks
            .iter()
            .map(|bs| bs.iter().map(|b| b.nr() * b.nk()).sum())
            .collect();
        let mut offsets = Vec::with_capacity(blocks.len());
        let mut total = 0;
        for &p in &per_head {
            offsets.push(total);
            total += p * dims.heads;
        }
        Self {
            blocks,
            per_head,
            offsets,
            total,
        }
    }

    /// Scratch a task needs per block buffer (the largest block).
    fn largest(&self) -> usize {
        self.blocks
            .iter()
            .flatten()
            .map(|b| b.nr() * b.nk())
            .max()
            .unwrap_or(0)
    }
}

/// The probabilities of block `blk` of query head `h` of sequence `b` into `p`
/// (`nr x nk`): scores, keys a row does not see at `-inf`, softmax.
///
/// # Safety
/// `qkv` addresses the packed buffer.
#[inline(always)]
unsafe fn probabilities<T: Float>(
    qkv: *const T,
    (dims, seqs): (Grouped, &Sequences),
    params: &Params,
    (b, h, blk): (usize, usize, Block),
    zeros: &[T],
    p: &mut [T],
) {
    let (w, d) = (dims.width(), dims.d);
    let start = seqs.starts[b];
    let (nr, nk) = (blk.nr(), blk.nk());
    matmul(
        (nr, nk, d),
        (p.as_mut_ptr(), nk),
        false,
        (qkv.add((start + blk.rows.0) * w + dims.q(h)), w, 1),
        (
            qkv.add((start + blk.keys.0) * w + dims.k(h / dims.group())),
            1,
            w,
        ),
    );
    let len = seqs.lengths[b];
    softmax_rows(p, nk, |r, row| {
        let (lo, hi) = params.pattern.visible(blk.rows.0 + r, len);
        let (lo, hi) = (
            lo.max(blk.keys.0) - blk.keys.0,
            hi.min(blk.keys.1) - blk.keys.0,
        );
        row[..lo].fill(T::neg_infinity());
        row[hi..].fill(T::neg_infinity());
        softmax_shift(row, &zeros[..nk], T::of(params.scale), false);
    });
}

/// Applies the dropout mask of block `blk` of head `h` of sequence `b` to `x` (`nr x
/// nk`) in place: each element's mask is the one of its place in the padded `[n, heads,
/// s, s]` probabilities.
fn dropout_block<T: Float>(
    (dims, seqs): (Grouped, &Sequences),
    (seed, p): (u64, f32),
    (b, h, blk): (usize, usize, Block),
    x: &mut [T],
) {
    let keep_scale = T::of(1.0 / (1.0 - f64::from(p)));
    let (s, shift) = (seqs.s as u64, seqs.shift[b] as u64);
    let first = ((b * dims.heads + h) as u64) * s;
    for (r, row) in x.chunks_exact_mut(blk.nk()).enumerate() {
        let i = shift + (blk.rows.0 + r) as u64;
        let start = (first + i) * s + shift + blk.keys.0 as u64;
        crate::rng::keep_run(seed, start, row.len(), p, |j, kept| {
            // A product with the mask value, as the composed form computes it.
            row[j] *= if kept { keep_scale } else { T::zero() };
        });
    }
}

wide_fn! {
/// The forward pass over the packed `qkv`: the context `[rows, heads d]` (0 at rows that
/// are not queries) and, with `keep`, the probabilities before dropout (the blocks
/// computed) for the backward.
pub fn forward<T: Float>(
    qkv: &[T],
    (dims, seqs): (Grouped, &Sequences),
    params: &Params,
    keep: bool,
) -> (Vec<T>, Option<Vec<T>>) {
    let rows: usize = seqs.lengths.iter().sum();
    let hd = dims.heads * dims.d;
    assert!(
        qkv.len() >= rows * dims.width(),
        "grouped attention: qkv too small"
    );
    let mut ctx = vec![T::zero(); rows * hd];
    let plan = Plan::new(seqs, dims, params.pattern);
    let mut kept = keep.then(|| vec![T::zero(); plan.total]);
    let kept_ptr = kept.as_mut().map(|k| SharedMut(k.as_mut_ptr()));
    let (src, out) = (SharedConst(qkv.as_ptr()), SharedMut(ctx.as_mut_ptr()));
    let largest = plan.largest();
    let zeros = vec![T::zero(); seqs.s.max(1)];
    let dropout = params.dropout.filter(|&(_, p)| p > 0.0);
    let n = seqs.lengths.len();
    for_tasks::<T>(n * dims.kv_heads, 2 * largest, |task, buf| {
        let (b, g) = (task / dims.kv_heads, task % dims.kv_heads);
        let (own, rest) = buf.split_at_mut(largest);
        let start = seqs.starts[b];
        for h in g * dims.group()..(g + 1) * dims.group() {
            let mut at = plan.offsets[b] + h * plan.per_head[b];
            for &blk in &plan.blocks[b] {
                let size = blk.nr() * blk.nk();
                // SAFETY: task (b, g) owns the kept blocks of its query heads.
                let p: &mut [T] = match kept_ptr {
                    Some(ptr) => unsafe { std::slice::from_raw_parts_mut(ptr.get().add(at), size) },
                    None => &mut own[..size],
                };
                at += size;
                // SAFETY: qkv holds the packed rows (checked above).
                unsafe {
                    probabilities(src.get(), (dims, seqs), params, (b, h, blk), &zeros, p);
                }
                let pd: &[T] = match dropout {
                    Some(drop) => {
                        let pd = &mut rest[..size];
                        pd.copy_from_slice(p);
                        dropout_block((dims, seqs), drop, (b, h, blk), pd);
                        pd
                    }
                    None => p,
                };
                let w = dims.width();
                // SAFETY: the block's context rows of head h belong to this task alone.
                unsafe {
                    matmul(
                        (blk.nr(), dims.d, blk.nk()),
                        (out.get().add((start + blk.rows.0) * hd + dims.q(h)), hd),
                        false,
                        (pd.as_ptr(), blk.nk(), 1),
                        (src.get().add((start + blk.keys.0) * w + dims.v(g)), w, 1),
                    );
                }
            }
        }
    });
    (ctx, kept)
}
}

wide_fn! {
/// The backward pass from `dctx` `[rows, heads d]`: the gradient of the packed `qkv`, from
/// the probabilities `kept` by the forward or recomputed.
pub fn backward<T: Float>(
    qkv: &[T],
    kept: Option<&[T]>,
    dctx: &[T],
    (dims, seqs): (Grouped, &Sequences),
    params: &Params,
) -> Vec<T> {
    let rows: usize = seqs.lengths.iter().sum();
    let (w, hd, d) = (dims.width(), dims.heads * dims.d, dims.d);
    assert!(
        qkv.len() >= rows * w && dctx.len() >= rows * hd,
        "grouped attention: buffers too small"
    );
    let mut dqkv = vec![T::zero(); rows * w];
    let plan = Plan::new(seqs, dims, params.pattern);
    if let Some(k) = kept {
        assert_eq!(k.len(), plan.total, "grouped attention: kept probabilities");
    }
    let kept = kept.map(|k| SharedConst(k.as_ptr()));
    let (src, dsrc, out) = (
        SharedConst(qkv.as_ptr()),
        SharedConst(dctx.as_ptr()),
        SharedMut(dqkv.as_mut_ptr()),
    );
    let largest = plan.largest();
    let zeros = vec![T::zero(); seqs.s.max(1)];
    let dropout = params.dropout.filter(|&(_, p)| p > 0.0);
    let scale = T::of(params.scale);
    let n = seqs.lengths.len();
    for_tasks::<T>(n * dims.kv_heads, 3 * largest, |task, buf| {
        let (b, g) = (task / dims.kv_heads, task % dims.kv_heads);
        let (own, rest) = buf.split_at_mut(largest);
        let (pd_buf, dp_buf) = rest.split_at_mut(largest);
        let start = seqs.starts[b];
        let (q0, k0) = (src.get(), src.get());
        for h in g * dims.group()..(g + 1) * dims.group() {
            let mut at = plan.offsets[b] + h * plan.per_head[b];
            for &blk in &plan.blocks[b] {
                let (nr, nk) = (blk.nr(), blk.nk());
                let size = nr * nk;
                let p: &[T] = match kept {
                    // SAFETY: the forward wrote this block.
                    Some(ptr) => unsafe { std::slice::from_raw_parts(ptr.get().add(at), size) },
                    None => {
                        let p = &mut own[..size];
                        // SAFETY: qkv holds the packed rows (checked above).
                        unsafe {
                            probabilities(src.get(), (dims, seqs), params, (b, h, blk), &zeros, p)
                        };
                        p
                    }
                };
                at += size;
                let pd: &[T] = match dropout {
                    Some(drop) => {
                        let pd = &mut pd_buf[..size];
                        pd.copy_from_slice(p);
                        dropout_block((dims, seqs), drop, (b, h, blk), pd);
                        pd
                    }
                    None => p,
                };
                let (r0, c0) = (start + blk.rows.0, start + blk.keys.0);
                // SAFETY: the rows of query head h in this block, and the key and value
                // rows of head g of this sequence, belong to this task alone; the gradient
                // columns of q, k and v are disjoint.
                unsafe {
                    let dc = dsrc.get().add(r0 * hd + dims.q(h));
                    // dV [nk, d] += P_d^T [nk, nr] dC [nr, d]
                    matmul(
                        (nk, d, nr),
                        (out.get().add(c0 * w + dims.v(g)), w),
                        true,
                        (pd.as_ptr(), 1, nk),
                        (dc, hd, 1),
                    );
                    // dP_d [nr, nk] = dC [nr, d] V^T [d, nk]
                    let dp = &mut dp_buf[..size];
                    matmul(
                        (nr, nk, d),
                        (dp.as_mut_ptr(), nk),
                        false,
                        (dc, hd, 1),
                        (src.get().add(c0 * w + dims.v(g)), 1, w),
                    );
                    if let Some(drop) = dropout {
                        dropout_block((dims, seqs), drop, (b, h, blk), dp);
                    }
                    // dS = scale P (dP - rowsum(dP P)), in place of dP.
                    for (dr, pr) in dp.chunks_exact_mut(nk).zip(p.chunks_exact(nk)) {
                        let dot = crate::nn::cpu::attention::heads::lane_dot(dr, pr);
                        for (gv, &pv) in dr.iter_mut().zip(pr) {
                            *gv = scale * pv * (*gv - dot);
                        }
                    }
                    // dQ [nr, d] = dS [nr, nk] K [nk, d]
                    matmul(
                        (nr, d, nk),
                        (out.get().add(r0 * w + dims.q(h)), w),
                        false,
                        (dp.as_ptr(), nk, 1),
                        (k0.add(c0 * w + dims.k(g)), w, 1),
                    );
                    // dK [nk, d] += dS^T [nk, nr] Q [nr, d]
                    matmul(
                        (nk, d, nr),
                        (out.get().add(c0 * w + dims.k(g)), w),
                        true,
                        (dp.as_ptr(), 1, nk),
                        (q0.add(r0 * w + dims.q(h)), w, 1),
                    );
                }
            }
        }
    });
    dqkv
}
}
