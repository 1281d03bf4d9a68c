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

    /// The dtype of the parameters.
    pub fn dtype(&self) -> candle_core::DType {
        self.weight.dtype()
    }

    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// `x / max(||x||, 1e-12)` over the last dimension (as `torch.nn.functional.normalize`),
/// differentiable.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    Ok(x.broadcast_div(&norm)?)
}

/// Composed (differentiable) layer norm over the last dimension.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(normed.broadcast_mul(weight)?.broadcast_add(bias)?)
}

/// A fully connected layer `y = x W^T + b` with Hugging Face names (`weight` `[out, in]`,
/// `bias` `[out]`), for inputs `[.., in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's default initialisation (uniform in `+-1/sqrt(in)`), with a bias.
    pub fn new(input: usize, output: usize, vb: VarBuilder) -> Result<Self> {
        let bound = 1.0 / (input as f64).sqrt();
        let init = candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Ok(Self {
            weight: vb.get_with_hints((output, input), "weight", init)?,
            bias: Some(vb.get_with_hints(output, "bias", init)?),
        })
    }

    /// BERT's initialisation: weight normal(0, `std`), bias zero.
    pub fn normal(input: usize, output: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let init = candle_nn::Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        Ok(Self {
            weight: vb.get_with_hints((output, input), "weight", init)?,
            bias: Some(vb.get_with_hints(output, "bias", candle_nn::init::ZERO)?),
        })
    }

    /// `x W^T + b` over the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref())
    }
}

/// `x W^T + b`, computed as `(W x^T)^T` on the flattened rows of `x`.
///
/// Written this way round, candle's backward produces the weight gradient as one
/// contiguous `[out, in]` matmul, with no transpose node on the weight: `x.matmul(W.t())`
/// records a transpose whose backward allocates and adds a second weight-sized, strided
/// gradient. The replay of a gradient cache pays that once per chunk, so it matters.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let input = dims[dims.len() - 1];
    let rows = x.elem_count() / input.max(1);
    let x2 = x.reshape((rows, input))?;
    let y = weight.matmul(&x2.t()?)?.t()?.contiguous()?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out_dims = dims;
    let last = out_dims.len() - 1;
    out_dims[last] = weight.dim(0)?;
    Ok(y.reshape(out_dims)?)
}
