//! Mixed precision: the dtype the encoder computes in, and the dynamic loss scaler that f16
//! needs.
//!
//! Master weights and optimizer state stay f32. With [`Precision::Bf16`] or
//! [`Precision::F16`] the encoder casts each weight to the compute dtype where it is used
//! (a tracked cast, so the gradient comes back to the f32 variable in f32) and runs its
//! matrix products and activations in that dtype; LayerNorm statistics, the attention
//! softmax, the pooling and the loss run in f32 (see [`crate::nn`]).
//!
//! f16 has five exponent bits: small gradients underflow to zero and large ones overflow.
//! [`LossScaler`] is the dynamic scaling of `torch.cuda.amp.GradScaler`: the cached
//! representation gradients, the one place where the loss gradient enters the replay, are
//! multiplied by the scale; the parameter gradients are divided by it before clipping; a
//! step whose gradients hold an inf or NaN is skipped and the scale halves; after
//! `growth_interval` good steps in a row it doubles.

use candle_core::DType;

use crate::params::Gradients;
use crate::{Error, Result};

/// The dtype of the encoder's forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bfloat16 compute (f32's range, 8 bits of mantissa): no loss scaling needed.
    Bf16,
    /// IEEE half compute (10 bits of mantissa, range to 65504): needs a [`LossScaler`].
    F16,
}

impl Precision {
    /// The compute dtype.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Whether this is plain f32 (for `skip_serializing_if`).
    pub fn is_f32(&self) -> bool {
        *self == Precision::F32
    }

    /// Whether training in this precision needs dynamic loss scaling.
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::F16
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

/// Whether `dtype` is a half-precision float (f16 or bf16).
pub fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// Dynamic loss scaling (the rule of `torch.cuda.amp.GradScaler`). Its state is part of a
/// training checkpoint, so a resumed run scales exactly as the uninterrupted one.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Multiplies the scale after `growth_interval` good steps in a row.
    pub growth_factor: f64,
    /// Multiplies the scale after a step with an inf or NaN gradient.
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows.
    pub growth_interval: u64,
    /// Good steps since the last change of the scale.
    pub good_steps: u64,
}

impl Default for LossScaler {
    /// PyTorch's defaults: scale 2^16, x2 after 2000 good steps, x0.5 after an overflow.
    fn default() -> Self {
        Self {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
        }
    }
}

impl LossScaler {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let checks: [(&'static str, f64, bool, &'static str); 3] = [
            (
                "loss_scale.init",
                self.scale,
                self.scale.is_finite() && self.scale > 0.0,
                "must be a finite number greater than 0",
            ),
            (
                "loss_scale.growth_factor",
                self.growth_factor,
                self.growth_factor.is_finite() && self.growth_factor >= 1.0,
                "must be at least 1",
            ),
            (
                "loss_scale.backoff_factor",
                self.backoff_factor,
                self.backoff_factor > 0.0 && self.backoff_factor < 1.0,
                "must be in (0, 1)",
            ),
        ];
        for (field, value, ok, reason) in checks {
            if !ok {
                return Err(Error::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason,
                });
            }
        }
        if self.growth_interval == 0 {
            return Err(Error::InvalidConfig {
                field: "loss_scale.growth_interval",
                value: "0".into(),
                reason: "must be at least 1",
            });
        }
        Ok(())
    }

    /// Divides `grads` (computed from a loss multiplied by [`Self::scale`]) by the scale, in
    /// place, and says whether every value is finite. Call [`Self::update`] with the answer.
    pub fn unscale(&self, grads: &mut Gradients) -> Result<bool> {
        grads.scale(1.0 / self.scale)?;
        all_finite(grads)
    }

    /// Moves the scale after a step: halves it (and restarts the count) when the step's
    /// gradients were not finite, grows it after `growth_interval` good steps in a row.
    pub fn update(&mut self, finite: bool) {
        if !finite {
            self.scale *= self.backoff_factor;
            self.good_steps = 0;
            return;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= self.growth_factor;
            self.good_steps = 0;
        }
    }
}

/// Whether every gradient value is finite (summed in f64, where no finite f32 values can
/// overflow, so the sum is finite exactly when every term is).
///
/// Gradients off the CPU are checked on their device and read back at once: `sum(0 g)`
/// is 0 exactly when every value is finite (an inf or NaN makes it NaN), and one read for
/// all of them waits for the device once per step.
pub fn all_finite(grads: &Gradients) -> Result<bool> {
    let mut on_device = Vec::new();
    for (_, g) in grads.iter() {
        if !g.device().is_cpu() {
            on_device.push((g.to_dtype(DType::F32)? * 0.0)?.sum_all()?);
            continue;
        }
        let sum = g
            .to_dtype(DType::F64)?
            .abs()?
            .sum_all()?
            .to_scalar::<f64>()?;
        if !sum.is_finite() {
            return Ok(false);
        }
    }
    if on_device.is_empty() {
        return Ok(true);
    }
    let sums = candle_core::Tensor::stack(&on_device, 0)?.to_vec1::<f32>()?;
    Ok(sums.iter().all(|s| *s == 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_halves_on_overflow_and_grows_after_the_interval() {
        let mut s = LossScaler {
            scale: 8.0,
            growth_interval: 3,
            ..LossScaler::default()
        };
        s.update(true);
        s.update(true);
        assert_eq!((s.scale, s.good_steps), (8.0, 2));
        s.update(false); // an overflow restarts the count
        assert_eq!((s.scale, s.good_steps), (4.0, 0));
        for _ in 0..2 {
            s.update(true);
        }
        assert_eq!(s.scale, 4.0);
        s.update(true);
        assert_eq!((s.scale, s.good_steps), (8.0, 0));
        assert!(s.validate().is_ok());
        let bad = LossScaler {
            backoff_factor: 1.0,
            ..s
        };
        assert!(bad.validate().is_err());
    }
}
