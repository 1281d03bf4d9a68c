//! Knowledge distillation of a ColBERT: the KL divergence from a teacher's scores, given in
//! the data, to the model's MaxSim scores of each query's own passages (PyLate's
//! `Distillation`).
//!
//! Query `i` has its `group` passages `i * group ..` (as [`super::MaxSim`] lays them out);
//! its scores are `s_ij = maxsim(q_i, p_{i*group+j})`, min-max normalised over the group
//! when `normalize_scores` is on (PyLate's default: `(s - min) / (max - min + 1e-8)`).
//! The loss is `sum_i KL(softmax(t_i / T) || softmax(s_i)) / Q` for the teacher's scores
//! `t` (PyLate's `KLDivLoss(reduction="batchmean", log_target=True)` over log-softmaxes of
//! both; the teacher temperature `T` is 1 there, as suits a cross-encoder's logits; a
//! bi-encoder's cosine scores want the temperature it was trained with). Other queries' passages take no part: a query is scored against its own group
//! only, a block of one query by `group` passages at a time.

use candle_core::{DType, Tensor, D};

use super::maxsim::Pairs;
use super::{group_size, Loss, LossValue, MaxSim};
use crate::{Error, Result};

/// What PyLate adds to the spread of a group's scores before dividing by it.
const NORMALIZE_EPSILON: f64 = 1e-8;

/// A teacher's scores of the current batch: `[Q, group]`, each query's passages in the
/// order the loss sees them. The task that builds each batch sets them before the step
/// (every query of the global batch); the loss reads them. Clones share the scores.
#[derive(Clone, Default)]
pub struct TeacherScores(std::sync::Arc<std::sync::Mutex<Option<Tensor>>>);

impl TeacherScores {
    /// A cell without scores yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the teacher's scores `[Q, group]` of the batch the next loss is computed on.
    pub fn set(&self, scores: &Tensor) -> Result<()> {
        let scores = scores.detach().to_dtype(DType::F32)?;
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(scores);
        Ok(())
    }

    /// The scores set, checked to be `[queries, group]`.
    pub(crate) fn get(&self, queries: usize, group: usize) -> Result<Tensor> {
        let scores = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let scores = scores.ok_or(Error::InvalidArgument {
            what: "teacher scores",
            value: "none".into(),
            reason: "distillation needs the teacher's scores of the batch, set before the step",
        })?;
        if scores.dims() != [queries, group] {
            return Err(Error::InvalidArgument {
                what: "teacher scores",
                value: format!("{:?}", scores.dims()),
                reason: "distillation needs one score per passage of each query's group \
                         ([queries, passages / queries])",
            });
        }
        Ok(scores)
    }
}

impl std::fmt::Debug for TeacherScores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TeacherScores")
    }
}

impl PartialEq for TeacherScores {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// KL divergence from a teacher's scores to MaxSim scores (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct MaxSimDistillation {
    maxsim: MaxSim,
    normalize_scores: bool,
    teacher_temperature: f64,
    teacher: TeacherScores,
}

impl MaxSimDistillation {
    /// Distillation over token vectors of `dim` values, scores normalised (PyLate's
    /// default), reading the teacher's scores from `teacher`.
    pub fn new(dim: usize, teacher: TeacherScores) -> Result<Self> {
        Ok(Self {
            maxsim: MaxSim::new(dim)?,
            normalize_scores: true,
            teacher_temperature: 1.0,
            teacher,
        })
    }

    /// The teacher's scores are divided by `temperature` (> 0) before their softmax: 1
    /// (PyLate's) for logits; a bi-encoder teacher's cosine scores are nearly uniform
    /// under a softmax until divided by the temperature it was trained with.
    pub fn with_teacher_temperature(mut self, temperature: f64) -> Result<Self> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::InvalidConfig {
                field: "loss.distillation.teacher_temperature",
                value: temperature.to_string(),
                reason: "must be a finite number greater than 0",
            });
        }
        self.teacher_temperature = temperature;
        Ok(self)
    }

    /// Whether the model's scores are min-max normalised over each query's group before
    /// the softmax (PyLate's `normalize_scores`).
    pub fn with_normalized_scores(mut self, normalize: bool) -> Self {
        self.normalize_scores = normalize;
        self
    }

    /// The MaxSim scoring (its token width).
    pub fn maxsim(&self) -> &MaxSim {
        &self.maxsim
    }

    /// The cell the teacher's scores are read from.
    pub fn teacher(&self) -> &TeacherScores {
        &self.teacher
    }

    /// The model's scores of each query's own passages, `[Q, group]`.
    pub fn scores(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let group = group_size(queries.dim(0)?, passages.dim(0)?)?;
        self.maxsim
            .pair_scores(queries, passages, Pairs::Own(group))
    }

    /// The loss of the scores `[Q * group]` in `values` and, in their place, its gradient
    /// with respect to them (in f64, a query at a time).
    fn score_grads_in_place(&self, values: &mut [f32], teacher: &[f32], group: usize) -> f32 {
        let nq = values.len() / group;
        let mut total = 0f64;
        for (row, t) in values.chunks_mut(group).zip(teacher.chunks(group)) {
            let s: Vec<f64> = row.iter().map(|&v| v as f64).collect();
            let (lo, hi) = (argmin(&s), argmax(&s));
            let spread = s[hi] - s[lo] + NORMALIZE_EPSILON;
            let x: Vec<f64> = if self.normalize_scores {
                s.iter().map(|v| (v - s[lo]) / spread).collect()
            } else {
                s.clone()
            };
            let log_p = log_softmax(&x);
            let t: Vec<f64> = t
                .iter()
                .map(|&v| v as f64 / self.teacher_temperature)
                .collect();
            let log_t = log_softmax(&t);
            total += log_t
                .iter()
                .zip(&log_p)
                .map(|(lt, lp)| lt.exp() * (lt - lp))
                .sum::<f64>();
            // d/dx_j = (p_j - t_j) / Q.
            let gx: Vec<f64> = log_p
                .iter()
                .zip(&log_t)
                .map(|(lp, lt)| (lp.exp() - lt.exp()) / nq as f64)
                .collect();
            let gs = if self.normalize_scores {
                // x_j = (s_j - min) / (max - min + eps): the max and the min take their
                // share as autograd's max and min do (the first of equal extremes).
                let sum_g: f64 = gx.iter().sum();
                let sum_gx: f64 = gx.iter().zip(&x).map(|(g, x)| g * x).sum();
                let mut gs: Vec<f64> = gx.iter().map(|g| g / spread).collect();
                gs[lo] += (sum_gx - sum_g) / spread;
                gs[hi] -= sum_gx / spread;
                gs
            } else {
                gx
            };
            for (v, g) in row.iter_mut().zip(gs) {
                *v = g as f32;
            }
        }
        (total / nq as f64) as f32
    }
}

/// The first index of the largest value.
fn argmax(v: &[f64]) -> usize {
    (0..v.len()).fold(0, |best, j| if v[j] > v[best] { j } else { best })
}

/// The first index of the smallest value.
fn argmin(v: &[f64]) -> usize {
    (0..v.len()).fold(0, |best, j| if v[j] < v[best] { j } else { best })
}

fn log_softmax(v: &[f64]) -> Vec<f64> {
    let max = v.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let log_sum = v.iter().map(|x| (x - max).exp()).sum::<f64>().ln() + max;
    v.iter().map(|x| x - log_sum).collect()
}

impl Loss for MaxSimDistillation {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let scores = self.scores(queries, passages)?;
        let (nq, group) = scores.dims2()?;
        let teacher =
            (self.teacher.get(nq, group)?.to_dtype(scores.dtype())? / self.teacher_temperature)?;
        let x = if self.normalize_scores {
            let max = scores.max_keepdim(1)?;
            let min = scores.min_keepdim(1)?;
            let spread = ((max - &min)? + NORMALIZE_EPSILON)?;
            scores.broadcast_sub(&min)?.broadcast_div(&spread)?
        } else {
            scores
        };
        let log_p = candle_nn::ops::log_softmax(&x, D::Minus1)?;
        let log_t = candle_nn::ops::log_softmax(&teacher, D::Minus1)?;
        let kl = (log_t.exp()? * (log_t - log_p)?)?;
        Ok((kl.sum_all()? / nq as f64)?)
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let group = group_size(queries.dim(0)?, passages.dim(0)?)?;
        let nq = queries.dim(0)?;
        let teacher = self
            .teacher
            .get(nq, group)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let scores = self.scores(&queries.detach(), &passages.detach())?;
        let mut g = scores
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let loss = self.score_grads_in_place(&mut g, &teacher, group);
        let (grad_queries, grad_passages) =
            self.maxsim
                .pair_grads(queries, passages, Pairs::Own(group), &g)?;
        Ok(LossValue {
            loss,
            grad_queries,
            grad_passages,
            params: Default::default(),
        })
    }

    fn requires_equal_widths(&self) -> bool {
        false
    }
}
