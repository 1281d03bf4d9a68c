//! The loss of a text-pair run: InfoNCE over single vectors (with its Matryoshka
//! widths), or over MaxSim scores of token matrices for a multi-vector model.

use candle_core::Tensor;

use crate::loss::{InfoNce, Loss, LossValue, Matryoshka, MaxSim};
use crate::params::Params;
use crate::Result;

/// What a text-pair run minimises.
pub enum TextLoss {
    /// Single vectors.
    InfoNce(Matryoshka<InfoNce>),
    /// Token matrices (ColBERT).
    MaxSim(MaxSim),
}

impl TextLoss {
    /// The MaxSim loss, on a multi-vector run.
    pub fn maxsim(&self) -> Option<&MaxSim> {
        match self {
            TextLoss::MaxSim(m) => Some(m),
            TextLoss::InfoNce(_) => None,
        }
    }
}

impl Loss for TextLoss {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        match self {
            TextLoss::InfoNce(l) => l.forward(queries, passages),
            TextLoss::MaxSim(l) => l.forward(queries, passages),
        }
    }

    fn params(&self) -> Params {
        match self {
            TextLoss::InfoNce(l) => l.params(),
            TextLoss::MaxSim(l) => l.params(),
        }
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        match self {
            TextLoss::InfoNce(l) => l.value_and_grads(queries, passages),
            TextLoss::MaxSim(l) => l.value_and_grads(queries, passages),
        }
    }

    fn requires_equal_widths(&self) -> bool {
        match self {
            TextLoss::InfoNce(l) => l.requires_equal_widths(),
            TextLoss::MaxSim(l) => l.requires_equal_widths(),
        }
    }
}
