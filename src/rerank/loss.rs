//! The losses of a reranker over a batch's scores: `Q` queries, each with a group of `G`
//! scored documents (the positive first where the loss has one), and, where the loss reads
//! them, a label per pair (a binary or graded relevance, a teacher's score).
//!
//! Each is sentence-transformers' cross-encoder loss of the same name, written on the
//! `Q x G` logits in f64 with its gradient by hand: the scores of a whole global batch are
//! a few thousand numbers, and the gradient cache needs only their value and gradient
//! (`tests/it/rerank.rs` holds each to sentence-transformers' autograd, and to finite
//! differences).
//!
//! - [`RerankObjective::MultipleNegatives`]: `MultipleNegativesRankingLoss` (and its cached
//!   form): cross-entropy of `scale * act(s)` with the positive in column 0 (sigmoid and 10
//!   by default, as theirs);
//! - [`RerankObjective::BinaryCrossEntropy`]: `BinaryCrossEntropyLoss`, with logits, mean
//!   over the pairs, labels in `[0, 1]`;
//! - [`RerankObjective::ListNet`]: `ListNetLoss`, cross-entropy of `softmax(act(s))`
//!   against `softmax(labels)` per query;
//! - [`RerankObjective::Lambda`]: `LambdaLoss` with its default NDCG-Loss2++ weighting
//!   (`mu`), `sigma`, binary logarithm, over every pair of documents whose labels differ;
//! - [`RerankObjective::MarginMse`]: `MarginMSELoss`, the squared error between the
//!   student's margins `s_pos - s_neg` and the teacher's;
//! - [`RerankObjective::Kl`]: the KL divergence of the student's softmax over a group from
//!   the teacher's (as the bi-encoders' `DistillKLDivLoss`, temperatures included).

use crate::rerank::ScoreActivation;
use crate::{Error, Result};

/// Which loss, with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RerankObjective {
    /// Cross-entropy over each group with the positive in column 0.
    MultipleNegatives {
        /// The logits' factor (theirs: 10).
        scale: f64,
    },
    /// Binary cross-entropy with logits against a label in `[0, 1]` per pair.
    BinaryCrossEntropy,
    /// Listwise cross-entropy against the labels' softmax.
    ListNet,
    /// LambdaLoss with NDCG-Loss2++ weights.
    Lambda {
        /// The weight of NDCG-Loss2 beside LambdaRank (theirs: 10).
        mu: f64,
        /// The slope of the pairwise logistic (theirs: 1).
        sigma: f64,
        /// Only pairs with a document in the top `k` count (`None`: all).
        k: Option<usize>,
    },
    /// The squared error of the margins against the teacher's.
    MarginMse,
    /// The KL divergence from the teacher's softmax over a group.
    Kl {
        /// The student's temperature.
        student_temperature: f64,
        /// The teacher's temperature.
        teacher_temperature: f64,
    },
}

impl RerankObjective {
    /// Whether the loss reads a label per pair.
    pub fn needs_labels(self) -> bool {
        !matches!(self, RerankObjective::MultipleNegatives { .. })
    }

    /// The name the config and the log use.
    pub fn name(self) -> &'static str {
        match self {
            RerankObjective::MultipleNegatives { .. } => "multiple_negatives",
            RerankObjective::BinaryCrossEntropy => "bce",
            RerankObjective::ListNet => "listnet",
            RerankObjective::Lambda { .. } => "lambda",
            RerankObjective::MarginMse => "margin_mse",
            RerankObjective::Kl { .. } => "kl",
        }
    }

    /// The activation sentence-transformers' loss of this kind applies to the logits by
    /// default: a sigmoid for the multiple-negatives ranking loss, none for the others.
    pub fn default_activation(self) -> ScoreActivation {
        match self {
            RerankObjective::MultipleNegatives { .. } => ScoreActivation::Sigmoid,
            _ => ScoreActivation::Identity,
        }
    }
}

/// A reranker's loss: the objective and the activation applied to the logits first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RerankLoss {
    objective: RerankObjective,
    activation: ScoreActivation,
}

/// A loss value and its gradient with respect to each score, in the scores' order.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoresGrad {
    /// The loss.
    pub loss: f64,
    /// dL/d score, one per score.
    pub grad: Vec<f64>,
}

impl RerankLoss {
    /// `objective` with its default activation.
    pub fn new(objective: RerankObjective) -> Result<Self> {
        Self::with_activation(objective, objective.default_activation())
    }

    /// `objective` after `activation`.
    pub fn with_activation(
        objective: RerankObjective,
        activation: ScoreActivation,
    ) -> Result<Self> {
        let positive = |what: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::InvalidConfig {
                    field: what,
                    value: v.to_string(),
                    reason: "must be a positive number",
                })
            }
        };
        match objective {
            RerankObjective::MultipleNegatives { scale } => positive("loss.scale", scale)?,
            RerankObjective::Lambda { mu, sigma, k } => {
                if !(mu.is_finite() && mu >= 0.0) {
                    return Err(Error::InvalidConfig {
                        field: "loss.mu",
                        value: mu.to_string(),
                        reason: "must be a number of at least 0",
                    });
                }
                positive("loss.sigma", sigma)?;
                if k == Some(0) {
                    return Err(Error::InvalidConfig {
                        field: "loss.k",
                        value: "0".into(),
                        reason: "counts the top documents: at least 1",
                    });
                }
            }
            RerankObjective::Kl {
                student_temperature,
                teacher_temperature,
            } => {
                positive("loss.student_temperature", student_temperature)?;
                positive("loss.teacher_temperature", teacher_temperature)?;
            }
            _ => {}
        }
        Ok(Self {
            objective,
            activation,
        })
    }

    /// The objective.
    pub fn objective(&self) -> RerankObjective {
        self.objective
    }

    /// The activation applied before the objective.
    pub fn activation(&self) -> ScoreActivation {
        self.activation
    }

    /// The loss over `scores` (rows of `group` scores each, row-major; f64, so a model
    /// run in f64 keeps its precision) and its gradient. `labels` (one per score) is required by every objective but the
    /// multiple-negatives one.
    pub fn value_and_grad(
        &self,
        scores: &[f64],
        group: usize,
        labels: Option<&[f32]>,
    ) -> Result<ScoresGrad> {
        if group == 0 || scores.is_empty() || !scores.len().is_multiple_of(group) {
            return Err(Error::InvalidArgument {
                what: "reranker scores",
                value: format!("{} scores in groups of {group}", scores.len()),
                reason: "every query has the same number of scored documents (at least one)",
            });
        }
        let labels: Option<Vec<f64>> = match (labels, self.objective.needs_labels()) {
            (Some(l), _) if l.len() != scores.len() => {
                return Err(Error::InvalidArgument {
                    what: "reranker labels",
                    value: format!("{} labels for {} scores", l.len(), scores.len()),
                    reason: "one label per scored pair",
                })
            }
            (Some(l), _) => Some(l.iter().map(|&v| f64::from(v)).collect()),
            (None, true) => {
                return Err(Error::InvalidArgument {
                    what: "reranker loss",
                    value: self.objective.name().into(),
                    reason: "this loss reads a label (relevance or teacher score) per pair",
                })
            }
            (None, false) => None,
        };
        let act = self.activation;
        let x: Vec<f64> = scores.iter().map(|&s| activate(act, s).0).collect();
        let rows = scores.len() / group;
        let (loss, dx) = match self.objective {
            RerankObjective::MultipleNegatives { scale } => multiple_negatives(&x, group, scale),
            RerankObjective::BinaryCrossEntropy => {
                binary_cross_entropy(&x, labels.as_deref().unwrap_or(&[]))?
            }
            RerankObjective::ListNet => list_net(&x, group, labels.as_deref().unwrap_or(&[])),
            RerankObjective::Lambda { mu, sigma, k } => lambda(
                &x,
                group,
                labels.as_deref().unwrap_or(&[]),
                (mu, sigma, k.unwrap_or(group).min(group)),
            ),
            RerankObjective::MarginMse => margin_mse(&x, group, labels.as_deref().unwrap_or(&[])),
            RerankObjective::Kl {
                student_temperature,
                teacher_temperature,
            } => kl(
                &x,
                group,
                labels.as_deref().unwrap_or(&[]),
                (student_temperature, teacher_temperature),
            ),
        };
        debug_assert_eq!(dx.len(), rows * group);
        let grad = scores
            .iter()
            .zip(&dx)
            .map(|(&s, &d)| d * activate(act, s).1)
            .collect();
        Ok(ScoresGrad { loss, grad })
    }
}

/// The activation's value and slope at `x`.
fn activate(act: ScoreActivation, x: f64) -> (f64, f64) {
    match act {
        ScoreActivation::Identity => (x, 1.0),
        ScoreActivation::Sigmoid => {
            let s = sigmoid(x);
            (s, s * (1.0 - s))
        }
        ScoreActivation::Tanh => {
            let t = x.tanh();
            (t, 1.0 - t * t)
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `softmax(row)`.
fn softmax(row: &[f64]) -> Vec<f64> {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|&v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// `log(sum(exp(row)))`.
fn log_sum_exp(row: &[f64]) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + row.iter().map(|&v| (v - max).exp()).sum::<f64>().ln()
}

fn multiple_negatives(x: &[f64], group: usize, scale: f64) -> (f64, Vec<f64>) {
    let rows = x.len() / group;
    let mut loss = 0.0;
    let mut dx = vec![0.0; x.len()];
    for (r, row) in x.chunks(group).enumerate() {
        let z: Vec<f64> = row.iter().map(|&v| v * scale).collect();
        loss += log_sum_exp(&z) - z[0];
        for (j, p) in softmax(&z).into_iter().enumerate() {
            let target = if j == 0 { 1.0 } else { 0.0 };
            dx[r * group + j] = (p - target) * scale / rows as f64;
        }
    }
    (loss / rows as f64, dx)
}

fn binary_cross_entropy(x: &[f64], labels: &[f64]) -> Result<(f64, Vec<f64>)> {
    if let Some(bad) = labels.iter().find(|y| !(0.0..=1.0).contains(*y)) {
        return Err(Error::InvalidArgument {
            what: "binary cross-entropy label",
            value: bad.to_string(),
            reason: "a label is a probability of relevance, in [0, 1]",
        });
    }
    let n = x.len() as f64;
    let mut loss = 0.0;
    let dx = x
        .iter()
        .zip(labels)
        .map(|(&v, &y)| {
            loss += v.max(0.0) - v * y + (-v.abs()).exp().ln_1p();
            (sigmoid(v) - y) / n
        })
        .collect();
    Ok((loss / n, dx))
}

fn list_net(x: &[f64], group: usize, labels: &[f64]) -> (f64, Vec<f64>) {
    let rows = x.len() / group;
    let mut loss = 0.0;
    let mut dx = vec![0.0; x.len()];
    for (r, (row, y)) in x.chunks(group).zip(labels.chunks(group)).enumerate() {
        let target = softmax(y);
        let lse = log_sum_exp(row);
        let p = softmax(row);
        let mass: f64 = target.iter().sum();
        for j in 0..group {
            loss -= target[j] * (row[j] - lse);
            dx[r * group + j] = (p[j] * mass - target[j]) / rows as f64;
        }
    }
    (loss / rows as f64, dx)
}

fn lambda(
    x: &[f64],
    group: usize,
    labels: &[f64],
    (mu, sigma, k): (f64, f64, usize),
) -> (f64, Vec<f64>) {
    const EPS: f64 = 1e-10;
    let discount: Vec<f64> = (0..group).map(|r| (2.0 + r as f64).log2()).collect();
    let mut total = 0.0;
    let mut count = 0usize;
    let mut dx = vec![0.0; x.len()];
    for (r, (row, y)) in x.chunks(group).zip(labels.chunks(group)).enumerate() {
        // Documents in order of predicted score, highest first.
        let mut order: Vec<usize> = (0..group).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let true_sorted: Vec<f64> = order.iter().map(|&i| y[i]).collect();
        let mut ideal: Vec<f64> = y.iter().map(|&v| v.max(0.0)).collect();
        ideal.sort_by(|a, b| b.total_cmp(a));
        let max_dcg = (0..k)
            .map(|i| (2f64.powf(ideal[i]) - 1.0) / discount[i])
            .sum::<f64>()
            .max(EPS);
        let gain: Vec<f64> = true_sorted
            .iter()
            .map(|&v| (2f64.powf(v.max(0.0)) - 1.0) / max_dcg)
            .collect();
        for a in 0..group {
            for b in 0..group {
                let counted = true_sorted[a] - true_sorted[b] > 0.0 && (a < k || b < k);
                if !counted {
                    continue;
                }
                let d = a.abs_diff(b);
                let ndcg2 = (1.0 / discount[d - 1] - 1.0 / discount[d]).abs();
                let lambda_rank = (1.0 / discount[a] - 1.0 / discount[b]).abs();
                let w = (mu * ndcg2 + lambda_rank) * (gain[a] - gain[b]).abs();
                let diff = sigma * (row[order[a]] - row[order[b]]);
                // log(sigmoid(diff)), stable both ways.
                let log_sigmoid = diff.min(0.0) - (-diff.abs()).exp().ln_1p();
                total += w * log_sigmoid / std::f64::consts::LN_2;
                count += 1;
                // d log(sigmoid(t)) / dt = 1 - sigmoid(t).
                let slope = w * sigma * (1.0 - sigmoid(diff)) / std::f64::consts::LN_2;
                dx[r * group + order[a]] += slope;
                dx[r * group + order[b]] -= slope;
            }
        }
    }
    let m = count.max(1) as f64;
    for d in &mut dx {
        *d = -*d / m;
    }
    (-total / m, dx)
}

fn margin_mse(x: &[f64], group: usize, labels: &[f64]) -> (f64, Vec<f64>) {
    let rows = x.len() / group;
    let n = (rows * (group - 1)).max(1) as f64;
    let mut loss = 0.0;
    let mut dx = vec![0.0; x.len()];
    for (r, (row, y)) in x.chunks(group).zip(labels.chunks(group)).enumerate() {
        for j in 1..group {
            let e = (row[0] - row[j]) - (y[0] - y[j]);
            loss += e * e;
            let d = 2.0 * e / n;
            dx[r * group] += d;
            dx[r * group + j] -= d;
        }
    }
    (loss / n, dx)
}

fn kl(x: &[f64], group: usize, labels: &[f64], (ts, tt): (f64, f64)) -> (f64, Vec<f64>) {
    let rows = x.len() / group;
    let mut loss = 0.0;
    let mut dx = vec![0.0; x.len()];
    for (r, (row, y)) in x.chunks(group).zip(labels.chunks(group)).enumerate() {
        let s: Vec<f64> = row.iter().map(|&v| v / ts).collect();
        let t: Vec<f64> = y.iter().map(|&v| v / tt).collect();
        let (lse_s, lse_t) = (log_sum_exp(&s), log_sum_exp(&t));
        let p = softmax(&s);
        for j in 0..group {
            let q = (t[j] - lse_t).exp();
            loss += q * ((t[j] - lse_t) - (s[j] - lse_s));
            dx[r * group + j] = (p[j] - q) * ts / rows as f64;
        }
    }
    (loss / rows as f64 * ts * ts, dx)
}
