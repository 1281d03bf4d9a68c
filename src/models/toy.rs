//! Tiny towers for tests, examples, doctests and benchmarks: small enough to run in
//! milliseconds on a CPU, with the pieces that make gradient caching delicate (a LayerNorm,
//! dropout, a residual connection, masked pooling).

use candle_core::{DType, Tensor, D};
use candle_nn::{Embedding, Module, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::{Ctx, Dropout};
use crate::encoder::Network;
use crate::nn::{LayerNorm, Linear};
use crate::Result;

/// Sizes of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlpConfig {
    /// Input features.
    pub input: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Representation width.
    pub output: usize,
    /// Dropout probability after each hidden activation.
    pub dropout: f32,
}

/// `x -> GELU(W1 x) -> dropout -> + GELU(W2 h) -> dropout -> LayerNorm -> W3`: a residual
/// MLP tower over feature vectors `[rows, input]`.
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
    norm: LayerNorm,
    out: Linear,
    dropout: Dropout,
}

impl Mlp {
    /// Builds the tower with parameters `fc1`, `fc2`, `norm`, `out` under `vb`.
    pub fn new(cfg: &MlpConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            fc1: Linear::new(cfg.input, cfg.hidden, vb.pp("fc1"))?,
            fc2: Linear::new(cfg.hidden, cfg.hidden, vb.pp("fc2"))?,
            norm: LayerNorm::new(cfg.hidden, 1e-5, vb.pp("norm"))?,
            out: Linear::new(cfg.hidden, cfg.output, vb.pp("out"))?,
            dropout: Dropout::new(cfg.dropout)?,
        })
    }
}

impl Network for Mlp {
    type Input = Tensor;

    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let h = self.fc1.forward(x)?.gelu()?;
        let h = self.dropout.forward(&h, ctx, 0, 0)?;
        let r = self.fc2.forward(&h)?.gelu()?;
        let h = (h + self.dropout.forward(&r, ctx, 1, 0)?)?;
        self.out.forward(&self.norm.forward(&h)?)
    }
}

/// Sizes of a [`BagOfWords`] tower.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BagOfWordsConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Embedding width.
    pub hidden: usize,
    /// Representation width.
    pub output: usize,
    /// Dropout probability on the token embeddings.
    pub dropout: f32,
}

/// Token embeddings (word + token type) -> dropout -> masked mean -> LayerNorm -> linear:
/// the smallest tower over [`TokenBatch`] inputs.
pub struct BagOfWords {
    words: Embedding,
    types: Embedding,
    norm: LayerNorm,
    out: Linear,
    dropout: Dropout,
}

impl BagOfWords {
    /// Builds the tower with parameters `words`, `types`, `norm`, `out` under `vb`.
    pub fn new(cfg: &BagOfWordsConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            words: candle_nn::embedding(cfg.vocab, cfg.hidden, vb.pp("words"))?,
            types: candle_nn::embedding(2, cfg.hidden, vb.pp("types"))?,
            norm: LayerNorm::new(cfg.hidden, 1e-5, vb.pp("norm"))?,
            out: Linear::new(cfg.hidden, cfg.output, vb.pp("out"))?,
            dropout: Dropout::new(cfg.dropout)?,
        })
    }
}

impl Network for BagOfWords {
    type Input = TokenBatch;

    fn forward(&self, batch: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        let emb =
            (self.words.forward(&batch.input_ids)? + self.types.forward(&batch.token_type_ids)?)?;
        let emb = self.dropout.forward(&emb, ctx, 0, 0)?;
        let mask = batch
            .attention_mask
            .to_dtype(DType::F32)?
            .unsqueeze(D::Minus1)?;
        let summed = emb.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?.maximum(1f32)?;
        let mean = summed.broadcast_div(&counts)?;
        self.out.forward(&self.norm.forward(&mean)?)
    }
}

/// Sizes of a [`DeepMlp`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepMlpConfig {
    /// Input features.
    pub input: usize,
    /// Width of every block.
    pub hidden: usize,
    /// Number of residual blocks.
    pub blocks: usize,
    /// Representation width.
    pub output: usize,
    /// Dropout probability inside every block.
    pub dropout: f32,
}

/// A deep residual MLP, `x -> W_in x -> [h + W2 GELU(W1 LN(h))] x blocks -> LN -> W_out`:
/// the non-transformer deep model that checkpointing is shown on (the pre-norm residual
/// block of ResNet-style MLPs).
pub struct DeepMlp {
    input: Linear,
    blocks: Vec<(LayerNorm, Linear, Linear)>,
    norm: LayerNorm,
    out: Linear,
    dropout: Dropout,
}

impl DeepMlp {
    /// Builds the model with parameters `input`, `blocks.{i}.{norm,fc1,fc2}`, `norm`, `out`.
    pub fn new(cfg: &DeepMlpConfig, vb: VarBuilder) -> Result<Self> {
        let h = cfg.hidden;
        let blocks = (0..cfg.blocks)
            .map(|i| {
                let vb = vb.pp(format!("blocks.{i}"));
                Ok((
                    LayerNorm::new(h, 1e-5, vb.pp("norm"))?,
                    Linear::new(h, 2 * h, vb.pp("fc1"))?,
                    Linear::new(2 * h, h, vb.pp("fc2"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            input: Linear::new(cfg.input, h, vb.pp("input"))?,
            blocks,
            norm: LayerNorm::new(h, 1e-5, vb.pp("norm"))?,
            out: Linear::new(h, cfg.output, vb.pp("out"))?,
            dropout: Dropout::new(cfg.dropout)?,
        })
    }
}

impl crate::recompute::LayerStack for DeepMlp {
    type Input = Tensor;
    type Aux = ();

    fn aux(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn embed(&self, x: &Tensor, _: &(), _: &Ctx) -> Result<Tensor> {
        self.input.forward(x)
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn layer(&self, i: usize, h: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        let (norm, fc1, fc2) = &self.blocks[i];
        let r = fc2.forward(&fc1.forward(&norm.forward(h)?)?.gelu()?)?;
        Ok((h + self.dropout.forward(&r, ctx, i as u32, 0)?)?)
    }

    fn head(&self, h: &Tensor, _: &(), _: &Ctx) -> Result<Tensor> {
        self.out.forward(&self.norm.forward(h)?)
    }
}
