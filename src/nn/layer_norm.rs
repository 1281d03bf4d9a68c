//! [`LayerNorm`], the layer: a learned scale and (usually) shift over the last
//! dimension, run by [`super::layer_norm`] (the fused node where it runs).

use candle_core::Tensor;
use candle_nn::VarBuilder;

/// Layer normalisation over the last dimension with learned scale and shift
/// (Hugging Face names `weight` and `bias`), differentiable end to end.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub(super) weight: Tensor,
    pub(super) bias: Tensor,
    pub(super) eps: f64,
    /// Whether `bias` is a parameter (else a constant zero: ModernBERT's norms).
    pub(super) has_bias: bool,
}

impl LayerNorm {
    /// Scale initialised to ones, shift to zeros.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> crate::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(size, "weight", candle_nn::init::ONE)?,
            bias: vb.get_with_hints(size, "bias", candle_nn::init::ZERO)?,
            eps,
            has_bias: true,
        })
    }

    /// A scale initialised to ones and no shift (`weight` only, as `nn.LayerNorm(bias=False)`).
    pub fn without_bias(size: usize, eps: f64, vb: VarBuilder) -> crate::Result<Self> {
        let weight = vb.get_with_hints(size, "weight", candle_nn::init::ONE)?;
        let bias = Tensor::zeros(size, weight.dtype(), weight.device())?;
        Ok(Self {
            weight,
            bias,
            eps,
            has_bias: false,
        })
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> candle_core::DType {
        self.weight.dtype()
    }

    /// The scale (`weight`).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift (`bias`).
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// The shift parameter, `None` for a LayerNorm without one.
    pub fn shift(&self) -> Option<&Tensor> {
        self.has_bias.then_some(&self.bias)
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension. Without a
    /// bias parameter the zero constant's gradient goes nowhere (the gradient sink keeps
    /// parameters' gradients only; candle's backward drops a constant's).
    pub fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        super::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}
