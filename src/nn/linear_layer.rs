//! [`Linear`], the fully connected layer (`x W^T + b`, an optional LoRA adapter), run by
//! [`super::linear`] (the CPU node where it runs, composed elsewhere).

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::Act;

/// A fully connected layer `y = x W^T + b` with Hugging Face names (`weight` `[out, in]`,
/// `bias` `[out]`), for inputs `[.., in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
    /// A LoRA adapter on the (then frozen) weight.
    pub(super) lora: Option<super::lora::Adapter>,
}

impl Linear {
    /// PyTorch's default initialisation (uniform in `+-1/sqrt(in)`), with a bias.
    pub fn new(input: usize, output: usize, vb: VarBuilder) -> crate::Result<Self> {
        let bound = 1.0 / (input as f64).sqrt();
        let init = candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Ok(Self {
            weight: vb.get_with_hints((output, input), "weight", init)?,
            bias: Some(vb.get_with_hints(output, "bias", init)?),
            lora: None,
        })
    }

    /// BERT's initialisation: weight normal(0, `std`), bias zero.
    pub fn normal(input: usize, output: usize, std: f64, vb: VarBuilder) -> crate::Result<Self> {
        let init = candle_nn::Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        Ok(Self {
            weight: vb.get_with_hints((output, input), "weight", init)?,
            bias: Some(vb.get_with_hints(output, "bias", candle_nn::init::ZERO)?),
            lora: None,
        })
    }

    /// BERT's initialisation without a bias (`nn.Linear(bias=False)`): weight normal(0,
    /// `std`).
    pub fn normal_without_bias(
        input: usize,
        output: usize,
        std: f64,
        vb: VarBuilder,
    ) -> crate::Result<Self> {
        let init = candle_nn::Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        Ok(Self {
            weight: vb.get_with_hints((output, input), "weight", init)?,
            bias: None,
            lora: None,
        })
    }

    /// A transformer projection `in -> out`, BERT's initialisation with or without a bias,
    /// with a LoRA adapter when `lora` targets it (the decoders' and ModernBERT's layers).
    pub fn projection(
        (input, output, bias): (usize, usize, bool),
        std: f64,
        lora: Option<&super::lora::LoraSpec>,
        vb: VarBuilder,
    ) -> crate::Result<Self> {
        let plain = if bias {
            Self::normal(input, output, std, vb.clone())?
        } else {
            Self::normal_without_bias(input, output, std, vb.clone())?
        };
        plain.adapted(lora, &vb)
    }

    /// Gives the layer a LoRA adapter when `spec` targets the module under `vb` (see
    /// [`super::lora`]).
    pub fn adapted(
        mut self,
        spec: Option<&super::lora::LoraSpec>,
        vb: &VarBuilder,
    ) -> crate::Result<Self> {
        let (output, input) = self.weight.dims2()?;
        self.lora = super::lora::Adapter::build(spec, input, output, vb)?;
        Ok(self)
    }

    /// The same layer with `adapter` in place of its own (a task adapter chosen per
    /// batch).
    pub fn with_adapter(&self, adapter: &super::lora::Adapter) -> Self {
        Self {
            lora: Some(adapter.clone()),
            ..self.clone()
        }
    }

    /// This layer for one forward of a chunk: its adapter (if any) with the dropout mask
    /// of `seed` on its input (the chunk's seed at the layer and the adapter's
    /// [`super::lora::site`], `None` in evaluation).
    pub fn at(&self, seed: Option<u64>) -> Self {
        Self {
            lora: self.lora.as_ref().map(|a| a.at(seed)),
            ..self.clone()
        }
    }

    /// Whether the layer is a plain product with [`Self::weight`] this forward: no
    /// adapter, or one without a dropout mask (merged into the weight).
    pub fn merges(&self) -> bool {
        self.lora.as_ref().is_none_or(|a| a.merges())
    }

    /// The adapter as a layer node takes it, if the layer has one.
    pub fn lora_input(&self) -> Option<super::lora::LoraInput> {
        self.lora.as_ref().map(|a| a.input())
    }

    /// The effective weight `[out, in]`: the weight, or with an adapter `W + s B A`
    /// computed from the adapter's current values (tracked when they are). An adapter
    /// with a dropout mask this forward has none (see [`Self::merges`]).
    pub fn weight(&self) -> crate::Result<Tensor> {
        match &self.lora {
            Some(adapter) if !adapter.merges() => {
                Err(crate::Error::Candle(candle_core::Error::Msg(
                    "a LoRA projection with dropout on its input has no merged weight".into(),
                )))
            }
            Some(adapter) => adapter.merged(&self.weight),
            None => Ok(self.weight.clone()),
        }
    }

    /// The stored weight `[out, in]`, without an adapter's update.
    pub fn base_weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x W^T + b` over the last dimension of `x` (with an adapter masked this forward,
    /// `x W^T + b + s (dropout(x) A^T) B^T`).
    pub fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        match self.branch(x)? {
            Some(branch) => Ok((super::linear(x, &self.weight, self.bias.as_ref())? + branch)?),
            None => super::linear(x, &self.weight()?, self.bias.as_ref()),
        }
    }

    /// `act(x W^T + b)`, the bias added inside the fused activation.
    pub fn forward_activated(&self, x: &Tensor, act: Act) -> crate::Result<Tensor> {
        let y = match self.branch(x)? {
            Some(branch) => (super::linear(x, &self.weight, None)? + branch)?,
            None => super::linear(x, &self.weight()?, None)?,
        };
        match &self.bias {
            Some(b) => super::bias_activation(&y, b, act),
            None => {
                let zero = Tensor::zeros(y.dim(candle_core::D::Minus1)?, y.dtype(), y.device())?;
                super::bias_activation(&y, &zero, act)
            }
        }
    }

    /// The adapter's branch on `x` where it is not merged this forward (beside the base
    /// weight, which [`super::linear`] reads in `x`'s dtype).
    fn branch(&self, x: &Tensor) -> crate::Result<Option<Tensor>> {
        match &self.lora {
            Some(adapter) if !adapter.merges() => Ok(Some(adapter.branch(x)?)),
            _ => Ok(None),
        }
    }
}
