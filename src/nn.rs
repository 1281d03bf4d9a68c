//! Differentiable building blocks.
//!
//! Some of candle's fused ops have no backward pass and silently cut the graph:
//! `candle_nn::LayerNorm` on contiguous input (it calls the fused `ops::layer_norm`),
//! `ops::rms_norm`, `ops::softmax_last_dim`. Nothing fails, the parameters behind them just
//! never receive a gradient. The layers here are composed from differentiable ops, and each
//! hot piece sits behind one small function so that a fused kernel with a hand-written
//! backward can replace it later, checked against the composed version.

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

use crate::Result;

/// Layer normalisation over the last dimension with learned scale and shift
/// (Hugging Face names `weight` and `bias`), differentiable end to end.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Scale initialised to ones, shift to zeros.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(size, "weight", candle_nn::init::ONE)?,
            bias: vb.get_with_hints(size, "bias", candle_nn::init::ZERO)?,
            eps,
        })
    }

    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// Composed (differentiable) layer norm over the last dimension.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(normed.broadcast_mul(weight)?.broadcast_add(bias)?)
}
