//! sentence-transformers' `Dense` module after the pooling, trained with the encoder:
//! `activation(x W^T + b)` on the sentence embedding. Its weights live in the module's own
//! directory (`2_Dense/model.safetensors`, `linear.weight` and `linear.bias`), so its
//! parameters are named after that directory (`2_Dense.linear.weight`, under the tower's
//! prefix) and the export writes them back there.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::nn::Linear;
use crate::Result;

/// The activation of a sentence-transformers `Dense` module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseActivation {
    /// `torch.nn.modules.linear.Identity`.
    Identity,
    /// `torch.nn.modules.activation.Tanh` (the package's default).
    Tanh,
    /// `torch.nn.modules.activation.ReLU`.
    Relu,
    /// `torch.nn.modules.activation.GELU` (exact).
    Gelu,
    /// `torch.nn.modules.activation.Sigmoid`.
    Sigmoid,
}

impl DenseActivation {
    /// The activation named by a `Dense` config's `activation_function` (a PyTorch class
    /// path; only its last part is read).
    pub fn from_torch_name(name: &str) -> Option<Self> {
        match name.rsplit('.').next().unwrap_or(name) {
            "Identity" => Some(Self::Identity),
            "Tanh" => Some(Self::Tanh),
            "ReLU" => Some(Self::Relu),
            "GELU" => Some(Self::Gelu),
            "Sigmoid" => Some(Self::Sigmoid),
            _ => None,
        }
    }

    /// The PyTorch class path a `Dense` config names it by.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::Identity => "torch.nn.modules.linear.Identity",
            Self::Tanh => "torch.nn.modules.activation.Tanh",
            Self::Relu => "torch.nn.modules.activation.ReLU",
            Self::Gelu => "torch.nn.modules.activation.GELU",
            Self::Sigmoid => "torch.nn.modules.activation.Sigmoid",
        }
    }

    /// The activation of `y`.
    pub fn apply(self, y: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Identity => y.clone(),
            Self::Tanh => y.tanh()?,
            Self::Relu => y.relu()?,
            Self::Gelu => y.gelu_erf()?,
            Self::Sigmoid => candle_nn::ops::sigmoid(y)?,
        })
    }
}

/// The shape of a `Dense` module and where it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseSpec {
    /// The module's directory in the model (`2_Dense`); its parameters are named
    /// `<path>.linear.weight` and `<path>.linear.bias`.
    pub path: String,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Whether the product adds a bias.
    pub bias: bool,
    /// The activation after the product.
    pub activation: DenseActivation,
}

impl DenseSpec {
    /// The module's `config.json` as sentence-transformers writes it.
    pub fn config(&self) -> serde_json::Value {
        serde_json::json!({
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias,
            "activation_function": self.activation.torch_name(),
        })
    }

    /// The module at `path` from its `config.json` (`None` for a value that is not one:
    /// a count missing, an activation this crate does not implement).
    pub fn from_config(path: &str, cfg: &serde_json::Value) -> Option<Self> {
        let count = |key: &str| cfg[key].as_u64().map(|v| v as usize);
        Some(Self {
            path: path.to_string(),
            in_features: count("in_features")?,
            out_features: count("out_features")?,
            bias: cfg["bias"].as_bool().unwrap_or(true),
            activation: DenseActivation::from_torch_name(
                cfg["activation_function"]
                    .as_str()
                    .unwrap_or("torch.nn.modules.activation.Tanh"),
            )?,
        })
    }
}

/// A trainable `Dense` module.
pub(crate) struct Dense {
    linear: Linear,
    activation: DenseActivation,
}

impl Dense {
    /// The module of `spec` under `vb` (its weights from the store's source for
    /// `spec.path`, or drawn as PyTorch's `nn.Linear` is not: normal(0, 0.02)).
    pub(crate) fn new(spec: &DenseSpec, vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp(&spec.path).pp("linear");
        let (i, o) = (spec.in_features, spec.out_features);
        let linear = if spec.bias {
            Linear::normal(i, o, 0.02, vb)?
        } else {
            Linear::normal_without_bias(i, o, 0.02, vb)?
        };
        Ok(Self {
            linear,
            activation: spec.activation,
        })
    }

    /// The module applied to sentence embeddings `[n, in]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.activation.apply(&self.linear.forward(x)?)
    }
}
