//! InfoNCE's value and gradients as one kernel with its backward written out, the logits
//! a `block x tile` piece at a time (as flash attention does): for each block of anchor
//! rows, a first pass over the candidates' column tiles keeps each row's running maximum
//! and sum of exponentials (an online log-sum-exp), and a second pass recomputes each
//! tile's logits and turns them into the gradients of the anchors and of the candidates,
//! `dS = w (softmax - onehot) / t` added through two matrix products. Beyond the `[B, d]`
//! representations and their gradients the loss holds one tile's similarities, judge
//! values and gradients: memory flat in the batch, where the composed row blocks keep
//! about twelve `[block, B]` temporaries.
//!
//! A term is the softmax of each anchor row `i` over the segments of its candidates:
//!
//! ```text
//! query_to_doc   q_i . p_j    every passage j       target p_{i group}
//! query_to_query q_i . q_j    j != i
//! doc_to_query   d_i . q_j    every query j          d_i = p_{i group}, the positive
//! doc_to_doc     d_i . p_j    j outside i's group
//! ```
//!
//! a candidate judged (on the model's similarities, or a guide's) above the target's score
//! minus a margin left out of the softmax, never the target nor the anchor's own pair
//! (`doc_to_query`'s `d_i . q_i`, the target's similarity again). The loss is
//! `sum_terms w sum_i (lse_i - target_i / t)`, `w` the term's weight over the queries.

use candle_core::{DType, Tensor};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{parallel_ranges, Float, SharedMut};
use crate::nn::cpu::layers::packing::View;
use crate::nn::cpu::products::gemm::{product, product_new};

/// Whose rows a segment's anchors are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Query `i`.
    Queries,
    /// Query `i`'s positive passage (passage `i * group`).
    Positives,
}

/// Which representations a segment's candidates are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Columns {
    /// Every query.
    Queries,
    /// Every passage.
    Passages,
}

/// The candidates a segment leaves out for anchor row `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclude {
    /// None.
    Nothing,
    /// Column `i` (the anchor itself).
    Own,
    /// Columns `i * group .. (i + 1) * group` (the passages of query `i`).
    OwnGroup,
}

/// One block of a term's candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The anchors.
    pub rows: Rows,
    /// The candidates.
    pub columns: Columns,
    /// What is left out.
    pub exclude: Exclude,
}

/// A softmax over segments, the target in the first (column `i * stride`: passage
/// `i * group`, or query `i`).
#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    /// The segments, the target's first.
    pub segments: Vec<Segment>,
    /// The term's weight (its mean over the queries is taken here).
    pub weight: f64,
}

/// What the kernel computes.
pub struct Plan<'a> {
    /// Queries `[Q, d]` (normalised for cosine).
    pub q: &'a Tensor,
    /// Passages `[Q group, d]`, each query's positive first in its group.
    pub p: &'a Tensor,
    /// Passages per query.
    pub group: usize,
    /// A guide's (normalised) queries and passages: the false-negative mask is judged on
    /// their similarities.
    pub guide: Option<(&'a Tensor, &'a Tensor)>,
    /// Logits are similarities over it.
    pub temperature: f64,
    /// Mask candidates judged above the target minus this margin; `None`: no mask.
    pub margin: Option<f64>,
    /// Anchor rows per block.
    pub block_rows: usize,
    /// The queries and passages before their L2 normalisation (cosine similarity), when
    /// `q` and `p` are them normalised: the gradients returned are then with respect to
    /// these, through the normalisation's backward in place.
    pub unnormalized: Option<(&'a Tensor, &'a Tensor)>,
    /// The terms.
    pub terms: &'a [Term],
}

/// Candidate columns per tile.
const TILE: usize = 512;

/// The loss and its gradients with respect to `q` and `p` (CPU, f32 or f64; every input
/// of one dtype); `None` where the kernel does not run (the caller then composes ops).
pub fn value_and_grads(plan: &Plan) -> crate::Result<Option<(f64, Tensor, Tensor)>> {
    let mut inputs = vec![plan.q, plan.p];
    if let Some((gq, gp)) = plan.guide {
        inputs.extend([gq, gp]);
    }
    if let Some((q, p)) = plan.unnormalized {
        inputs.extend([q, p]);
    }
    if !crate::nn::fused_ok(&inputs) || plan.terms.is_empty() {
        return Ok(None);
    }
    Ok(Some(match plan.q.dtype() {
        DType::F32 => run::<f32>(plan)?,
        DType::F64 => run::<f64>(plan)?,
        _ => return Ok(None),
    }))
}

/// A `[rows, width]` matrix's values.
#[derive(Clone, Copy)]
struct Matrix<'a, T> {
    values: &'a [T],
    width: usize,
}

impl<'a, T: Float> Matrix<'a, T> {
    fn rows(&self) -> usize {
        self.values.len() / self.width.max(1)
    }

    fn row(&self, i: usize) -> &'a [T] {
        &self.values[i * self.width..(i + 1) * self.width]
    }

    fn from(&self, i: usize) -> &'a [T] {
        &self.values[i * self.width..]
    }
}

fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
}

/// Rows `i * group` of `p` `[Q group, d]`.
fn positives<T: Float>(p: Matrix<T>, queries: usize, group: usize) -> Vec<T> {
    (0..queries)
        .flat_map(|i| p.row(i * group).iter().copied())
        .collect()
}

/// The representations (and a guide's) as the segments read them.
struct Sides<'a, T> {
    q: Matrix<'a, T>,
    p: Matrix<'a, T>,
    pos: Matrix<'a, T>,
}

impl<'a, T: Float> Sides<'a, T> {
    fn anchors(&self, rows: Rows) -> Matrix<'a, T> {
        match rows {
            Rows::Queries => self.q,
            Rows::Positives => self.pos,
        }
    }

    fn columns(&self, columns: Columns) -> Matrix<'a, T> {
        match columns {
            Columns::Queries => self.q,
            Columns::Passages => self.p,
        }
    }
}

fn run<T: Float>(plan: &Plan) -> crate::Result<(f64, Tensor, Tensor)> {
    let (queries, d) = plan.q.dims2()?;
    let passages = plan.p.dims2()?.0;
    let group = plan.group;
    let (qv, pv) = (View::new(plan.q)?, View::new(plan.p)?);
    let (q, p) = (
        Matrix {
            values: qv.values::<T>()?,
            width: d,
        },
        Matrix {
            values: pv.values::<T>()?,
            width: d,
        },
    );
    // Without hard negatives the positives are the passages: no copy.
    let pos = if group == 1 {
        Vec::new()
    } else {
        positives(p, queries, group)
    };
    let model = Sides {
        q,
        p,
        pos: if group == 1 {
            p
        } else {
            Matrix {
                values: &pos,
                width: d,
            }
        },
    };
    let guide_views = match plan.guide {
        Some((gq, gp)) => Some((View::new(gq)?, View::new(gp)?, gq.dims2()?.1)),
        None => None,
    };
    let guide_pos;
    let guide = match &guide_views {
        Some((gq, gp, dg)) => {
            let gq = Matrix {
                values: gq.values::<T>()?,
                width: *dg,
            };
            let gp = Matrix {
                values: gp.values::<T>()?,
                width: *dg,
            };
            guide_pos = positives(gp, queries, group);
            Some(Sides {
                q: gq,
                p: gp,
                pos: Matrix {
                    values: &guide_pos,
                    width: *dg,
                },
            })
        }
        None => None,
    };
    let mut grads = Grads {
        q: vec![T::zero(); queries * d],
        p: vec![T::zero(); passages * d],
        // Without hard negatives the positives' gradients are the passages'.
        pos: if group == 1 {
            None
        } else {
            Some(vec![T::zero(); queries * d])
        },
    };
    let kernel = Kernel {
        model,
        guide,
        group,
        inv_t: 1.0 / plan.temperature,
        margin: plan.margin,
    };
    let mut loss = 0f64;
    let block = plan.block_rows.max(1);
    for term in plan.terms {
        for start in (0..queries).step_by(block) {
            let rows = start..(start + block).min(queries);
            loss += kernel.block(term, rows, queries, &mut grads)?;
        }
    }
    // The positives' gradients go to their passages.
    if let Some(pos) = &grads.pos {
        for i in 0..queries {
            let (dst, src) = (
                &mut grads.p[i * group * d..(i * group + 1) * d],
                &pos[i * d..(i + 1) * d],
            );
            for (a, &b) in dst.iter_mut().zip(src) {
                *a += b;
            }
        }
    }
    if let Some((raw_q, raw_p)) = plan.unnormalized {
        normalize_backward(
            &View::new(raw_q)?.values::<T>()?[..queries * d],
            &mut grads.q,
            d,
        );
        normalize_backward(
            &View::new(raw_p)?.values::<T>()?[..passages * d],
            &mut grads.p,
            d,
        );
    }
    let device = plan.q.device();
    Ok((
        loss,
        Tensor::from_vec(grads.q, (queries, d), device)?,
        Tensor::from_vec(grads.p, (passages, d), device)?,
    ))
}

wide_fn! {
/// In place, row by row of width `d`: the gradient `g` with respect to `y = x / max(|x|,
/// 1e-12)` becomes the gradient with respect to `x`, `(g - y (g . y)) / |x|` (`g / 1e-12`
/// on rows whose norm was clamped), as autograd through the normalisation gives it.
fn normalize_backward<T: Float>(x: &[T], g: &mut [T], d: usize) {
    let rows = g.len() / d.max(1);
    let out = SharedMut(g.as_mut_ptr());
    parallel_ranges(rows, |range| {
        for r in range {
            let x = &x[r * d..(r + 1) * d];
            // SAFETY: each task owns rows `range` of `g`.
            let g = unsafe { std::slice::from_raw_parts_mut(out.get().add(r * d), d) };
            let norm = x.iter().map(|&v| v * v).sum::<T>().sqrt();
            let clamped = num_traits::Float::max(norm, T::of(1e-12));
            let along = if norm >= T::of(1e-12) {
                g.iter().zip(x).map(|(&a, &b)| a * b).sum::<T>() / (clamped * clamped)
            } else {
                T::zero()
            };
            for (gi, &xi) in g.iter_mut().zip(x) {
                *gi = (*gi - xi * along) / clamped;
            }
        }
    });
}
}

/// The gradients being summed: of the queries, the passages, and the positives as
/// anchors (added to their passages at the end; the passages' own without hard
/// negatives).
struct Grads<T> {
    q: Vec<T>,
    p: Vec<T>,
    pos: Option<Vec<T>>,
}

impl<T> Grads<T> {
    fn anchors(&mut self, rows: Rows) -> &mut [T] {
        match (rows, &mut self.pos) {
            (Rows::Queries, _) => &mut self.q,
            (Rows::Positives, Some(pos)) => pos,
            (Rows::Positives, None) => &mut self.p,
        }
    }

    fn columns(&mut self, columns: Columns) -> &mut [T] {
        match columns {
            Columns::Queries => &mut self.q,
            Columns::Passages => &mut self.p,
        }
    }
}

struct Kernel<'a, T> {
    model: Sides<'a, T>,
    guide: Option<Sides<'a, T>>,
    group: usize,
    inv_t: f64,
    margin: Option<f64>,
}

/// One tile of a segment: its similarities `[n, t]` and the judge's (the guide's, when
/// there is one).
struct Tile<T> {
    start: usize,
    cols: usize,
    sims: Vec<T>,
    judge: Option<Vec<T>>,
}

impl<T: Float> Kernel<'_, T> {
    fn stride(&self, columns: Columns) -> usize {
        match columns {
            Columns::Queries => 1,
            Columns::Passages => self.group,
        }
    }

    /// The tiles of segment `seg` for anchor rows `rows`, one at a time.
    fn tiles(
        &self,
        seg: Segment,
        rows: &std::ops::Range<usize>,
        mut f: impl FnMut(Tile<T>) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let n = rows.len();
        let (a, c) = (
            self.model.anchors(seg.rows),
            self.model.columns(seg.columns),
        );
        let d = a.width;
        for start in (0..c.rows()).step_by(TILE) {
            let cols = TILE.min(c.rows() - start);
            let sims = product_new(
                (n, cols, d),
                (a.from(rows.start), d, 1),
                (c.from(start), 1, d),
            );
            let judge = self.guide.as_ref().map(|g| {
                let (ga, gc) = (g.anchors(seg.rows), g.columns(seg.columns));
                let dg = ga.width;
                product_new(
                    (n, cols, dg),
                    (ga.from(rows.start), dg, 1),
                    (gc.from(start), 1, dg),
                )
            });
            f(Tile {
                start,
                cols,
                sims,
                judge,
            })?;
        }
        Ok(())
    }

    /// Whether entry `(i, j)` (absolute anchor row, candidate column) of segment `k` is in
    /// the softmax, given the tile's similarity and judge value there.
    fn live(
        &self,
        k: usize,
        seg: Segment,
        (i, j): (usize, usize),
        judged: T,
        threshold: T,
    ) -> bool {
        let excluded = match seg.exclude {
            Exclude::Nothing => false,
            Exclude::Own => j == i,
            Exclude::OwnGroup => j / self.group == i,
        };
        if excluded {
            return false;
        }
        // The target, and the anchor's own pair seen from its passage (`doc_to_query`'s
        // column `i`, the target's similarity again), are never masked.
        let own_pair = seg.rows == Rows::Positives && seg.columns == Columns::Queries && j == i;
        if (k == 0 && j == i * self.stride(seg.columns)) || own_pair {
            return true;
        }
        self.margin.is_none() || judged <= threshold
    }

    /// One block of anchor rows of `term`: its loss, its gradients added to `grads`.
    fn block(
        &self,
        term: &Term,
        rows: std::ops::Range<usize>,
        queries: usize,
        grads: &mut Grads<T>,
    ) -> crate::Result<f64> {
        let n = rows.len();
        let first = term.segments[0];
        let stride = self.stride(first.columns);
        let w = term.weight / queries as f64;
        // Each row's target similarity, and the mask's threshold: the judge's score of
        // the target minus the margin.
        let (a0, c0) = (
            self.model.anchors(first.rows),
            self.model.columns(first.columns),
        );
        let target: Vec<T> = rows
            .clone()
            .map(|i| dot(a0.row(i), c0.row(i * stride)))
            .collect();
        let margin = T::of(self.margin.unwrap_or(0.0));
        let threshold: Vec<T> = match &self.guide {
            Some(g) => {
                let (ga, gc) = (g.anchors(first.rows), g.columns(first.columns));
                rows.clone()
                    .map(|i| dot(ga.row(i), gc.row(i * stride)) - margin)
                    .collect()
            }
            None => target.iter().map(|&t| t - margin).collect(),
        };
        // Pass 1: the online log-sum-exp of every row.
        // The row statistics in f64 (the tiles' similarities are T): the log-sum-exp of
        // thousands of terms keeps the composed softmax's accuracy.
        let mut max = vec![f64::NEG_INFINITY; n];
        let mut sum = vec![0f64; n];
        for (k, &seg) in term.segments.iter().enumerate() {
            self.tiles(seg, &rows, |tile| {
                let (m, s) = (SharedMut(max.as_mut_ptr()), SharedMut(sum.as_mut_ptr()));
                parallel_ranges(n, |range| {
                    for r in range {
                        // SAFETY: each task owns rows `range` of `max` and `sum` (length n).
                        let (m, s) = unsafe { (&mut *m.get().add(r), &mut *s.get().add(r)) };
                        let i = rows.start + r;
                        let sims = &tile.sims[r * tile.cols..(r + 1) * tile.cols];
                        let judged = tile.judge.as_ref().map(|j| &j[r * tile.cols..]);
                        for (c, &x) in sims.iter().enumerate() {
                            let judge = judged.map_or(x, |j| j[c]);
                            if !self.live(k, seg, (i, tile.start + c), judge, threshold[r]) {
                                continue;
                            }
                            let z = x.to_f64() * self.inv_t;
                            if z > *m {
                                *s = *s * (*m - z).exp() + 1.0;
                                *m = z;
                            } else {
                                *s += (z - *m).exp();
                            }
                        }
                    }
                });
                Ok(())
            })?;
        }
        let lse: Vec<f64> = max.iter().zip(&sum).map(|(&m, &s)| m + s.ln()).collect();
        let loss: f64 = lse
            .iter()
            .zip(&target)
            .map(|(&l, &t)| l - t.to_f64() * self.inv_t)
            .sum::<f64>()
            * w;
        // Pass 2: each tile's softmax minus the target, into the gradients.
        let scale = w * self.inv_t;
        for (k, &seg) in term.segments.iter().enumerate() {
            let (a, c) = (
                self.model.anchors(seg.rows),
                self.model.columns(seg.columns),
            );
            let d = a.width;
            self.tiles(seg, &rows, |tile| {
                let mut ds = tile.sims;
                let out = SharedMut(ds.as_mut_ptr());
                parallel_ranges(n, |range| {
                    for r in range {
                        // SAFETY: each task owns rows `range` of the tile (n x cols).
                        let row = unsafe {
                            std::slice::from_raw_parts_mut(out.get().add(r * tile.cols), tile.cols)
                        };
                        let i = rows.start + r;
                        let judged = tile.judge.as_ref().map(|j| &j[r * tile.cols..]);
                        for (col, x) in row.iter_mut().enumerate() {
                            let j = tile.start + col;
                            let judge = judged.map_or(*x, |v| v[col]);
                            let mut g = if self.live(k, seg, (i, j), judge, threshold[r]) {
                                scale * (x.to_f64() * self.inv_t - lse[r]).exp()
                            } else {
                                0.0
                            };
                            if k == 0 && j == i * stride {
                                g -= scale;
                            }
                            *x = T::of(g);
                        }
                    }
                });
                let cols = tile.cols;
                // d anchors [n, d] += dS [n, cols] C [cols, d]
                let ga = grads.anchors(seg.rows);
                product(
                    (n, d, cols),
                    (&mut ga[rows.start * d..], d),
                    true,
                    (&ds, cols, 1),
                    (c.from(tile.start), d, 1),
                );
                // d candidates [cols, d] += dS^T [cols, n] A [n, d]
                let gc = grads.columns(seg.columns);
                product(
                    (cols, d, n),
                    (&mut gc[tile.start * d..], d),
                    true,
                    (&ds, 1, cols),
                    (a.from(rows.start), d, 1),
                );
                Ok(())
            })?;
        }
        Ok(loss)
    }
}
