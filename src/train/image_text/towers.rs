//! The towers of an image-text run: the image tower (a ResNet or a DenseNet-BC; a VNet for
//! volumes) and the
//! text tower (a fresh BERT or an LSTM), each chosen by the config, as one [`Encoder`]
//! each, and how they are built over the run's store.

use candle_core::Tensor;

use crate::batch::TokenBatch;
use crate::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use crate::densenet::DenseNet;
use crate::dropout::Ctx;
use crate::encoder::{Encoder, Tower};
use crate::lstm::{Lstm, LstmConfig, LstmEncoder};
use crate::params::{Gradients, ParamStore, Params};
use crate::recompute::Recomputed;
use crate::resnet::ResNet;
use crate::vnet::VNet;
use crate::Result;

use super::config::{ImageTextConfig, TextKind};

/// The text tower of an image-text run.
pub enum TextTower {
    /// A BERT.
    Bert(Box<BertEncoder>),
    /// An LSTM.
    Lstm(Box<LstmEncoder>),
}

impl Encoder for TextTower {
    type Input = TokenBatch;

    fn params(&self) -> &Params {
        match self {
            TextTower::Bert(e) => e.params(),
            TextTower::Lstm(e) => e.params(),
        }
    }

    fn buffers(&self) -> Params {
        match self {
            TextTower::Bert(e) => e.buffers(),
            TextTower::Lstm(e) => e.buffers(),
        }
    }

    fn encode(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            TextTower::Bert(e) => e.encode(input, ctx),
            TextTower::Lstm(e) => e.encode(input, ctx),
        }
    }

    fn forward(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            TextTower::Bert(e) => e.forward(input, ctx),
            TextTower::Lstm(e) => e.forward(input, ctx),
        }
    }

    fn replay(&self, input: &TokenBatch, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        match self {
            TextTower::Bert(e) => e.replay(input, cotangent, ctx),
            TextTower::Lstm(e) => e.replay(input, cotangent, ctx),
        }
    }
}

/// The image tower of an image-text run.
pub enum ImageEncoder {
    /// A ResNet.
    ResNet(Box<Recomputed<ResNet>>),
    /// A DenseNet-BC.
    DenseNet(Box<Recomputed<DenseNet>>),
    /// A VNet (volumes).
    VNet(Box<Recomputed<VNet>>),
}

impl Encoder for ImageEncoder {
    type Input = Tensor;

    fn params(&self) -> &Params {
        match self {
            ImageEncoder::ResNet(e) => e.params(),
            ImageEncoder::DenseNet(e) => e.params(),
            ImageEncoder::VNet(e) => e.params(),
        }
    }

    fn buffers(&self) -> Params {
        match self {
            ImageEncoder::ResNet(e) => e.buffers(),
            ImageEncoder::DenseNet(e) => e.buffers(),
            ImageEncoder::VNet(e) => e.buffers(),
        }
    }

    fn encode(&self, input: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        match self {
            ImageEncoder::ResNet(e) => e.encode(input, ctx),
            ImageEncoder::DenseNet(e) => e.encode(input, ctx),
            ImageEncoder::VNet(e) => e.encode(input, ctx),
        }
    }

    fn forward(&self, input: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        match self {
            ImageEncoder::ResNet(e) => e.forward(input, ctx),
            ImageEncoder::DenseNet(e) => e.forward(input, ctx),
            ImageEncoder::VNet(e) => e.forward(input, ctx),
        }
    }

    fn replay(&self, input: &Tensor, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        match self {
            ImageEncoder::ResNet(e) => e.replay(input, cotangent, ctx),
            ImageEncoder::DenseNet(e) => e.replay(input, cotangent, ctx),
            ImageEncoder::VNet(e) => e.replay(input, cotangent, ctx),
        }
    }
}

/// The image tower `cfg` asks for, under `image.` in `store`, with its checkpointing policy.
pub(super) fn build_image(cfg: &ImageTextConfig, store: &ParamStore) -> Result<ImageEncoder> {
    let policy = cfg.image.recompute.clone();
    if let Some(v) = cfg.vnet() {
        let tower = Tower::build(store, "image", |vb| VNet::new(&v, vb))?;
        return Ok(ImageEncoder::VNet(Box::new(Recomputed::new(
            tower, policy,
        )?)));
    }
    Ok(match cfg.densenet() {
        Some(d) => {
            let tower = Tower::build(store, "image", |vb| DenseNet::new(&d, vb))?;
            ImageEncoder::DenseNet(Box::new(Recomputed::new(tower, policy)?))
        }
        None => {
            let tower = Tower::build(store, "image", |vb| ResNet::new(&cfg.resnet(), vb))?;
            ImageEncoder::ResNet(Box::new(Recomputed::new(tower, policy)?))
        }
    })
}

pub(super) fn build_text(
    cfg: &ImageTextConfig,
    store: &ParamStore,
    vocab: usize,
) -> Result<TextTower> {
    let x = &cfg.text;
    Ok(match x.kind {
        TextKind::Bert => {
            let bert = BertConfig {
                hidden_dropout_prob: x.dropout_prob,
                attention_probs_dropout_prob: x.dropout_prob,
                ..BertConfig::new(
                    vocab,
                    x.hidden_size,
                    x.num_layers,
                    x.num_heads,
                    x.intermediate_size,
                    x.max_len,
                )
            };
            let options = BertOptions {
                lora: None,
                pooling: Pooling::Mean,
                normalize: false,
                recompute: x.recompute.clone(),
                ..Default::default()
            };
            TextTower::Bert(Box::new(BertEncoder::build(
                store, "text", &bert, &options,
            )?))
        }
        TextKind::Lstm => {
            let lstm = LstmConfig {
                vocab_size: vocab,
                embedding_size: x.hidden_size,
                hidden_size: x.hidden_size,
                num_layers: x.num_layers,
                pooling: x.pooling,
                output: x.hidden_size,
            };
            let tower = Tower::build(store, "text", |vb| Lstm::new(&lstm, vb))?;
            TextTower::Lstm(Box::new(LstmEncoder::new(tower, x.recompute.clone())?))
        }
    })
}
