//! Losses on each query's scores of its own passages only (no in-batch negatives): the
//! distillation of a teacher's scores into a single-vector or sparse model, as
//! sentence-transformers' `DistillKLDivLoss` and `MarginMSELoss` compute it, and InfoNCE
//! against a query's own positive and hard negatives (`in_batch = false`: for
//! classification or clustering data, where other queries' passages are false
//! negatives). [`Weighted`] adds such a loss to InfoNCE over the batch.
//!
//! Query `i` has its `group` passages `i * group ..` (its positive first, then its hard
//! negatives); its student scores are `s_ij = sim(q_i, p_{i*group+j})` (dot, or cosine of
//! the normalised vectors). With the teacher's scores `t_ij` of the same passages:
//!
//! - **KL** (`DistillKLDivLoss`): `sum_i KL(softmax(t_i / T_t) || softmax(s_i / T_s)) / Q
//!   * T_s^2`, the two temperatures 1 by default;
//! - **margin MSE** (`MarginMSELoss`): the mean over queries and hard negatives of
//!   `((s_i0 - s_ij) - (t_i0 - t_ij))^2`;
//! - **own-group InfoNCE**: `-sum_i log softmax(s_i / T)_0 / Q`.
//!
//! The scores are `Q x group` values, so the loss runs through autograd on the whole
//! global batch at once ([`Loss::value_and_grads`]'s default): exact under the gradient
//! cache, whatever the chunks.

use candle_core::{Tensor, D};

use super::{group_size, Loss, TeacherScores};
use crate::nn::l2_normalize;
use crate::{Error, Result, Similarity};

/// What a [`GroupScores`] loss computes from a query's scores of its own passages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GroupObjective {
    /// KL divergence from the teacher's softmax to the student's (`DistillKLDivLoss`).
    Kl {
        /// Divides the student's scores before their softmax (the loss is scaled by its
        /// square, as sentence-transformers does).
        student_temperature: f64,
        /// Divides the teacher's scores before their softmax.
        teacher_temperature: f64,
    },
    /// Squared error of the student's margins against the teacher's (`MarginMSELoss`).
    MarginMse,
    /// Cross-entropy of the positive among the query's own passages.
    InfoNce {
        /// Divides the scores before the softmax.
        temperature: f64,
    },
}

impl GroupObjective {
    /// Whether it reads a teacher's scores.
    pub fn needs_teacher(&self) -> bool {
        !matches!(self, GroupObjective::InfoNce { .. })
    }
}

/// A loss over each query's scores of its own group of passages (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupScores {
    objective: GroupObjective,
    similarity: Similarity,
    teacher: TeacherScores,
}

impl GroupScores {
    /// The loss `objective` on `similarity` scores, the teacher's scores read from
    /// `teacher` (set by the task before each step).
    pub fn new(
        objective: GroupObjective,
        similarity: Similarity,
        teacher: TeacherScores,
    ) -> Result<Self> {
        let positive = |what: &'static str, t: f64| -> Result<()> {
            if t.is_finite() && t > 0.0 {
                Ok(())
            } else {
                Err(Error::InvalidArgument {
                    what,
                    value: t.to_string(),
                    reason: "must be a finite number greater than 0",
                })
            }
        };
        match objective {
            GroupObjective::Kl {
                student_temperature,
                teacher_temperature,
            } => {
                positive("student temperature", student_temperature)?;
                positive("teacher temperature", teacher_temperature)?;
            }
            GroupObjective::InfoNce { temperature } => positive("temperature", temperature)?,
            GroupObjective::MarginMse => {}
        }
        Ok(Self {
            objective,
            similarity,
            teacher,
        })
    }

    /// The cell the teacher's scores are read from.
    pub fn teacher(&self) -> &TeacherScores {
        &self.teacher
    }

    /// What it computes.
    pub fn objective(&self) -> GroupObjective {
        self.objective
    }

    /// The student's scores `[Q, group]` of each query's own passages.
    pub fn scores(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let (nq, d) = queries.dims2()?;
        let group = group_size(nq, passages.dim(0)?)?;
        let (q, p) = match self.similarity {
            Similarity::Dot => (queries.clone(), passages.clone()),
            Similarity::Cosine => (l2_normalize(queries)?, l2_normalize(passages)?),
        };
        let p = p.reshape((nq, group, d))?;
        Ok(p.broadcast_mul(&q.unsqueeze(1)?)?.sum(D::Minus1)?)
    }
}

impl Loss for GroupScores {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let s = self.scores(queries, passages)?;
        let (nq, group) = s.dims2()?;
        let teacher = || -> Result<Tensor> {
            Ok(self
                .teacher
                .get(nq, group)?
                .to_dtype(s.dtype())?
                .to_device(s.device())?)
        };
        Ok(match self.objective {
            GroupObjective::Kl {
                student_temperature,
                teacher_temperature,
            } => {
                let log_p = candle_nn::ops::log_softmax(&(&s / student_temperature)?, D::Minus1)?;
                let log_t =
                    candle_nn::ops::log_softmax(&(teacher()? / teacher_temperature)?, D::Minus1)?;
                let kl = (log_t.exp()? * (log_t - log_p)?)?;
                ((kl.sum_all()? / nq as f64)? * (student_temperature * student_temperature))?
            }
            GroupObjective::MarginMse => {
                if group < 2 {
                    return Err(Error::InvalidArgument {
                        what: "margin MSE",
                        value: format!("{group} passage per query"),
                        reason: "needs a hard negative per query (a margin is the positive's \
                                 score less a negative's)",
                    });
                }
                let t = teacher()?;
                let margins = |x: &Tensor| -> Result<Tensor> {
                    let pos = x.narrow(1, 0, 1)?;
                    Ok(x.narrow(1, 1, group - 1)?.broadcast_sub(&pos)?.neg()?)
                };
                let diff = (margins(&s)? - margins(&t)?)?;
                (diff.sqr()?.sum_all()? / (nq * (group - 1)) as f64)?
            }
            GroupObjective::InfoNce { temperature } => {
                let log_p = candle_nn::ops::log_softmax(&(&s / temperature)?, D::Minus1)?;
                (log_p.narrow(1, 0, 1)?.sum_all()?.neg()? / nq as f64)?
            }
        })
    }
}

/// A weighted sum of losses over the same representations: `sum_k w_k L_k`, each part's
/// value and gradients computed by its own [`Loss::value_and_grads`] (InfoNCE by its
/// kernel, a [`GroupScores`] by autograd). One part of weight 1 is that part, bit for bit.
pub struct Weighted {
    parts: Vec<(f64, Box<dyn Loss>)>,
    teacher: Option<TeacherScores>,
}

impl Weighted {
    /// The sum of `parts` (at least one; weights finite and above 0).
    pub fn new(parts: Vec<(f64, Box<dyn Loss>)>) -> Result<Self> {
        if parts.is_empty() {
            return Err(Error::InvalidArgument {
                what: "weighted loss",
                value: "no parts".into(),
                reason: "needs at least one loss",
            });
        }
        if let Some((w, _)) = parts.iter().find(|(w, _)| !(w.is_finite() && *w > 0.0)) {
            return Err(Error::InvalidArgument {
                what: "loss weight",
                value: w.to_string(),
                reason: "must be a finite number greater than 0",
            });
        }
        Ok(Self {
            parts,
            teacher: None,
        })
    }

    /// Records the cell its distillation part reads the teacher's scores from (what the
    /// task sets before each step).
    pub fn with_teacher(mut self, teacher: TeacherScores) -> Self {
        self.teacher = Some(teacher);
        self
    }

    /// The teacher-score cell, when a part reads one.
    pub fn teacher(&self) -> Option<&TeacherScores> {
        self.teacher.as_ref()
    }

    /// The parts and their weights.
    pub fn parts(&self) -> impl Iterator<Item = (f64, &dyn Loss)> {
        self.parts.iter().map(|(w, l)| (*w, l.as_ref()))
    }
}

impl Loss for Weighted {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let mut total: Option<Tensor> = None;
        for (w, part) in &self.parts {
            let mut l = part.forward(queries, passages)?;
            if *w != 1.0 {
                l = (l * *w)?;
            }
            total = Some(match total {
                Some(t) => (t + l)?,
                None => l,
            });
        }
        total.ok_or(Error::EmptyBatch {
            side: crate::Side::Query,
        })
    }

    fn params(&self) -> crate::params::Params {
        let mut all = crate::params::Params::default();
        for (_, part) in &self.parts {
            // Parts share no parameter; a union that fails leaves the first parts' own.
            all = all.union(&part.params()).unwrap_or(all);
        }
        all
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<super::LossValue> {
        let mut out: Option<super::LossValue> = None;
        for (w, part) in &self.parts {
            let mut v = part.value_and_grads(queries, passages)?;
            if *w != 1.0 {
                v.loss *= *w as f32;
                v.grad_queries = (v.grad_queries * *w)?;
                v.grad_passages = (v.grad_passages * *w)?;
                v.params.scale(*w)?;
            }
            out = Some(match out {
                None => v,
                Some(mut acc) => {
                    acc.loss += v.loss;
                    acc.grad_queries = (acc.grad_queries + v.grad_queries)?;
                    acc.grad_passages = (acc.grad_passages + v.grad_passages)?;
                    acc.params.accumulate(v.params)?;
                    acc
                }
            });
        }
        out.ok_or(Error::EmptyBatch {
            side: crate::Side::Query,
        })
    }
}
