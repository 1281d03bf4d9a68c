//! The query side of an inference-free sparse model: sentence-transformers'
//! `SparseStaticEmbedding`. A query's vector is one learned weight per vocabulary entry
//! (an IDF-like weight) on the entries of the tokens it contains, and zero elsewhere; no
//! transformer runs, so a query costs a tokenization. Documents go through the SPLADE
//! model (`models::sparse`), and the two meet in the same vocabulary-wide space.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use crate::batch::TokenBatch;
use crate::dropout::Ctx;
use crate::encoder::{Network, Tower};
use crate::{Error, Result};

/// The parameter's name (sentence-transformers saves the module's one tensor as `weight`).
pub const STATIC_WEIGHT: &str = "weight";

/// The prefix of the static weights in a run's parameters (`static_query.weight`).
pub const STATIC_PREFIX: &str = "static_query";

/// `static_query.weight`: the static query weights' name in a run's parameters (its
/// checkpoints, `model.freeze`).
pub fn static_weight_name() -> String {
    format!("{STATIC_PREFIX}.{STATIC_WEIGHT}")
}

/// One weight per vocabulary entry; a text's vector is `presence(tokens) * weight`.
pub struct SparseStaticEmbedding {
    /// `[vocab]`.
    weight: Tensor,
}

/// The tower a gradient cache trains: the weights, and a graph-free copy over them.
pub type StaticSparseEncoder = Tower<SparseStaticEmbedding>;

impl SparseStaticEmbedding {
    /// The weights `[vocab]` under `vb` (named `weight`); fresh ones are ones, as
    /// sentence-transformers starts a `SparseStaticEmbedding` without weights.
    pub fn new(vocab: usize, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(vocab, STATIC_WEIGHT, candle_nn::Init::Const(1.0))?;
        Ok(Self { weight })
    }

    /// Builds the tower over `store`, its weight named `{prefix}.weight`.
    pub fn tower(
        store: &crate::ParamStore,
        prefix: &str,
        vocab: usize,
    ) -> Result<StaticSparseEncoder> {
        Tower::build(store, prefix, |vb| Self::new(vocab, vb))
    }

    /// The vocabulary size (the vectors' width).
    pub fn vocab(&self) -> usize {
        self.weight.dim(0).unwrap_or(0)
    }

    /// `[rows, vocab]`: 1 on the entries of the tokens the attention mask keeps, 0
    /// elsewhere (a token repeated counts once).
    fn presence(&self, input: &TokenBatch) -> Result<Tensor> {
        let vocab = self.vocab();
        let ids = input.input_ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let mask = input
            .attention_mask
            .to_dtype(DType::U32)?
            .to_vec2::<u32>()?;
        let mut presence = vec![0f32; ids.len() * vocab];
        for (row, (ids, mask)) in ids.iter().zip(&mask).enumerate() {
            for (&id, &m) in ids.iter().zip(mask) {
                if m == 0 {
                    continue;
                }
                if id as usize >= vocab {
                    return Err(Error::InvalidArgument {
                        what: "token id",
                        value: id.to_string(),
                        reason: "is past the static query weights' vocabulary (the tokenizer \
                                 knows more tokens than the model has weights)",
                    });
                }
                presence[row * vocab + id as usize] = 1.0;
            }
        }
        let device = self.weight.device();
        Ok(
            Tensor::from_vec(presence, (ids.len(), vocab), device)?
                .to_dtype(self.weight.dtype())?,
        )
    }
}

impl Network for SparseStaticEmbedding {
    type Input = TokenBatch;

    fn forward(&self, input: &TokenBatch, _ctx: &Ctx) -> Result<Tensor> {
        let presence = self.presence(input)?;
        Ok(presence.broadcast_mul(&self.weight.unsqueeze(0)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoder::Encoder;
    use candle_core::Device;

    #[test]
    fn a_vector_is_the_weights_of_the_tokens_present_once_each() {
        let store = crate::ParamStore::new(0, DType::F32, &Device::Cpu);
        let tower = SparseStaticEmbedding::tower(&store, "q", 6).unwrap();
        let w = Tensor::new(&[0.5f32, 1.0, 2.0, 3.0, 4.0, 5.0], &Device::Cpu).unwrap();
        tower.params().get("q.weight").unwrap().set(&w).unwrap();
        let ids = Tensor::new(&[[3u32, 1, 3, 0], [5, 0, 0, 0]], &Device::Cpu).unwrap();
        let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 0, 0, 0]], &Device::Cpu).unwrap();
        let batch = TokenBatch::new(ids.clone(), mask, ids.zeros_like().unwrap()).unwrap();
        let got = tower.encode(&batch, &Ctx::eval()).unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            [
                [0.0, 1.0, 0.0, 3.0, 0.0, 0.0],
                [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]
            ]
        );
        // The gradient of each weight is the sum of its entries' cotangents.
        let cot = Tensor::new(&[[1f32; 6], [2f32; 6]], &Device::Cpu).unwrap();
        let grads = tower.replay(&batch, &cot, &Ctx::eval()).unwrap();
        let g = grads.get("q.weight").unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, [0.0, 1.0, 0.0, 1.0, 0.0, 2.0]);
        // A token past the weights is refused by name.
        let far = Tensor::new(&[[6u32]], &Device::Cpu).unwrap();
        let one = Tensor::new(&[[1u32]], &Device::Cpu).unwrap();
        let bad = TokenBatch::new(far.clone(), one, far.zeros_like().unwrap()).unwrap();
        let err = tower.encode(&bad, &Ctx::eval()).unwrap_err().to_string();
        assert!(err.contains("token id") && err.contains('6'), "{err}");
    }
}
