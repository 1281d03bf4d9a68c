//! Optimisers, learning-rate schedule and gradient clipping for the trainer.
//!
//! candle-nn's `AdamW` applies one weight decay to every variable and keeps its moments
//! private, so a run could not be saved and resumed exactly. [`Optimizer`] is ours: AdamW
//! with decoupled weight decay (Loshchilov & Hutter 2019, as `torch.optim.AdamW`) that skips
//! biases and LayerNorm weights (the BERT recipe), or plain SGD; its state (the moments) is a
//! set of named tensors that a checkpoint can write and read back. The optimiser does not
//! count steps: the trainer's one step counter is passed to every update (AdamW's bias
//! correction uses it), as it is to the gradient cache (dropout seeds) and the schedule.
//! Parameters are visited in name order.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use crate::params::{Gradients, Params};
use crate::{Error, Result};

/// Which optimiser, with its hyper-parameters (the learning rate comes from the schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay.
    AdamW {
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the root of the second moment.
        eps: f64,
        /// Decoupled weight decay, not applied to biases and LayerNorm weights.
        weight_decay: f64,
    },
    /// Plain stochastic gradient descent: `w -= lr * g`.
    Sgd,
}

impl OptimizerKind {
    /// AdamW with the usual BERT fine-tuning values (0.9, 0.999, 1e-8, decay 0.01).
    pub fn adamw() -> Self {
        OptimizerKind::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Checks the hyper-parameters.
    pub fn validate(&self) -> Result<()> {
        if let OptimizerKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = *self
        {
            for (field, v) in [("optim.beta1", beta1), ("optim.beta2", beta2)] {
                if !(0.0..1.0).contains(&v) {
                    return Err(Error::InvalidConfig {
                        field,
                        value: v.to_string(),
                        reason: "must be in [0, 1)",
                    });
                }
            }
            if eps.is_nan() || eps <= 0.0 {
                return Err(Error::InvalidConfig {
                    field: "optim.eps",
                    value: eps.to_string(),
                    reason: "must be greater than 0",
                });
            }
            if weight_decay.is_nan() || weight_decay < 0.0 {
                return Err(Error::InvalidConfig {
                    field: "optim.weight_decay",
                    value: weight_decay.to_string(),
                    reason: "must be 0 or more",
                });
            }
        }
        Ok(())
    }
}

/// Whether weight decay applies to the parameter `name`: not to biases, not to LayerNorm
/// weights (Hugging Face names `LayerNorm.weight`, ours `norm.weight`). AdamW also skips
/// every tensor of fewer than two dimensions whatever its name (BatchNorm weights, CLIP's
/// logit scale), which for BERT is the same set.
pub fn decays(name: &str) -> bool {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    let owner = name.rsplit('.').nth(1).unwrap_or("");
    leaf != "bias" && !owner.eq_ignore_ascii_case("layernorm") && !owner.ends_with("norm")
}

/// An optimiser over a fixed set of parameters, with saveable state.
pub struct Optimizer {
    kind: OptimizerKind,
    params: Params,
    moments: BTreeMap<String, (Tensor, Tensor)>,
}

impl Optimizer {
    /// An optimiser for `params`.
    pub fn new(kind: OptimizerKind, params: Params) -> Result<Self> {
        kind.validate()?;
        Ok(Self {
            kind,
            params,
            moments: BTreeMap::new(),
        })
    }

    /// The optimiser.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// Applies update number `step` (0-based: AdamW's bias correction uses `step + 1`) with
    /// learning rate `lr`. Parameters without a gradient are left untouched (and their
    /// moments do not advance).
    pub fn step(&mut self, step: u64, grads: &Gradients, lr: f64) -> Result<()> {
        let t = i32::try_from(step.saturating_add(1)).unwrap_or(i32::MAX);
        for (name, var) in self.params.iter() {
            let Some(g) = grads.get(name) else { continue };
            let w = var.as_tensor();
            let g = g.to_dtype(w.dtype())?;
            let updated = match self.kind {
                OptimizerKind::Sgd => (w - (g * lr)?)?,
                OptimizerKind::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    let (m, v) = match self.moments.remove(name) {
                        Some(mv) => mv,
                        None => (g.zeros_like()?, g.zeros_like()?),
                    };
                    let m = ((m * beta1)? + (&g * (1.0 - beta1))?)?;
                    let v = ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let m_hat = (&m / (1.0 - beta1.powi(t)))?;
                    let v_hat = (&v / (1.0 - beta2.powi(t)))?;
                    // Tensors of fewer than two dimensions never decay (OpenCLIP's rule):
                    // BatchNorm gains, CLIP's logit scale, any bias.
                    let decayed = if decays(name) && w.rank() >= 2 && weight_decay > 0.0 {
                        (w * (1.0 - lr * weight_decay))?
                    } else {
                        w.clone()
                    };
                    let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
                    let new = (decayed - (update * lr)?)?;
                    self.moments.insert(name.to_string(), (m, v));
                    new
                }
            };
            var.set(&updated.detach())?;
        }
        Ok(())
    }

    /// The state as named tensors (`m.<param>`, `v.<param>`), for checkpoints.
    pub fn state(&self) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        for (name, (m, v)) in &self.moments {
            out.insert(format!("m.{name}"), m.clone());
            out.insert(format!("v.{name}"), v.clone());
        }
        out
    }

    /// Restores a state written by [`Self::state`]. Moments of unknown parameters or of the
    /// wrong shape are an error ([`Error::CheckpointMismatch`]); other entries are ignored.
    pub fn load_state(&mut self, state: &BTreeMap<String, Tensor>) -> Result<()> {
        let bad = |what: String| Error::CheckpointMismatch {
            what: "optimizer state".into(),
            detail: format!("{what} does not match the model's parameters"),
        };
        let mut moments = BTreeMap::new();
        for (key, m) in state {
            let Some(name) = key.strip_prefix("m.") else {
                continue;
            };
            let var = self.params.get(name).ok_or_else(|| bad(key.clone()))?;
            let v = state
                .get(&format!("v.{name}"))
                .ok_or_else(|| bad(format!("v.{name}")))?;
            if m.shape() != var.shape() || v.shape() != var.shape() {
                return Err(bad(format!("{key} has shape {:?}", m.dims())));
            }
            moments.insert(name.to_string(), (m.clone(), v.clone()));
        }
        self.moments = moments;
        Ok(())
    }
}

/// Linear warmup from 0 to the base rate over `warmup` steps, then linear decay to 0 at
/// `total` steps: exactly `transformers.get_linear_schedule_with_warmup` (so the first
/// update of a run with warmup has learning rate 0, as there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup: u64,
    /// Total steps of the run.
    pub total: u64,
}

impl Schedule {
    /// The learning rate of the update at `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * step as f64 / self.warmup as f64;
        }
        let remaining = self.total.saturating_sub(step) as f64;
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        self.lr * (remaining / span).clamp(0.0, 1.0)
    }
}

/// Scales all gradients so that their global L2 norm is at most `max_norm` (as
/// `torch.nn.utils.clip_grad_norm_`). Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Gradients, max_norm: f64) -> Result<f64> {
    let mut total = 0f64;
    for (_, g) in grads.iter() {
        total += g
            .to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    let norm = total.sqrt();
    if norm.is_finite() && norm > max_norm && norm > 0.0 {
        grads.scale(max_norm / (norm + 1e-6))?;
    }
    Ok(norm)
}
