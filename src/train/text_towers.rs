//! The towers of a text-pair run as the gradient cache holds them: a BERT-family encoder
//! on either side, or, for an inference-free sparse model, the static query weights
//! ([`crate::sparse_static`]) on the query side.

use candle_core::Tensor;

use crate::batch::TokenBatch;
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::models::bert::BertEncoder;
use crate::params::{Gradients, Params};
use crate::sparse_static::StaticSparseEncoder;
use crate::Result;

/// One tower of a text-pair run.
pub enum PairTower {
    /// A BERT-family encoder (a SPLADE model's included).
    Bert(Box<BertEncoder>),
    /// An inference-free model's query side: a weight per vocabulary entry.
    Static(Box<StaticSparseEncoder>),
}

impl PairTower {
    /// The encoder, when the tower is one (not the static query weights).
    pub fn bert(&self) -> Option<&BertEncoder> {
        match self {
            PairTower::Bert(e) => Some(e),
            PairTower::Static(_) => None,
        }
    }
}

impl Encoder for PairTower {
    type Input = TokenBatch;

    fn params(&self) -> &Params {
        match self {
            PairTower::Bert(e) => Encoder::params(e.as_ref()),
            PairTower::Static(e) => Encoder::params(e.as_ref()),
        }
    }

    fn buffers(&self) -> Params {
        match self {
            PairTower::Bert(e) => Encoder::buffers(e.as_ref()),
            PairTower::Static(e) => Encoder::buffers(e.as_ref()),
        }
    }

    fn encode(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            PairTower::Bert(e) => e.encode(input, ctx),
            PairTower::Static(e) => e.encode(input, ctx),
        }
    }

    fn forward(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            PairTower::Bert(e) => e.forward(input, ctx),
            PairTower::Static(e) => e.forward(input, ctx),
        }
    }

    fn replay(&self, input: &TokenBatch, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        match self {
            PairTower::Bert(e) => e.replay(input, cotangent, ctx),
            PairTower::Static(e) => e.replay(input, cotangent, ctx),
        }
    }
}
