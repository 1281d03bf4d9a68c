//! A DenseNet-BC image tower (Huang et al. 2017) with the memory-efficient concatenation of
//! Pleiss et al. 2017, as a [`LayerStack`] of dense blocks, so that activation
//! checkpointing cuts it at block boundaries with any [`Recompute`](crate::Recompute)
//! segment policy.
//!
//! Every layer of a dense block sees the concatenation of all earlier feature maps of the
//! block: `BN-ReLU-conv1x1` to `bn_size * growth_rate` channels (the bottleneck), then
//! `BN-ReLU-conv3x3` to `growth_rate` new channels. Written plainly, each layer's
//! concatenation and its BN and ReLU outputs are kept for the backward pass: memory
//! quadratic in the depth of a block. With `memory_efficient` each layer is one graph node
//! that keeps only its inputs (the feature maps, each kept once by the block anyway, and
//! the parameters) and recomputes the concatenation, both BN-ReLUs and the bottleneck in
//! the backward pass: memory linear in the depth, each layer holding only the
//! `growth_rate` channels it adds (Pleiss et al. recompute the concatenation and the first
//! BN-ReLU; recomputing the whole layer also drops the bottleneck's `4k` channels and their
//! BN-ReLU), for a second forward of each layer. The recomputation normalises with the same
//! batch statistics, bit for bit, and never moves the running statistics a second time.
//!
//! Layout and parameter names follow torchvision's `densenet.py` (`features.conv0`,
//! `features.norm0`, `features.denseblock{b}.denselayer{l}.norm1` / `conv1` / `norm2` /
//! `conv2`, `features.transition{b}.norm` / `conv`, `features.norm5`, `classifier`), with
//! the small-image stem of the CIFAR DenseNets: one 3x3 convolution at stride 1 and no
//! max pooling (as [`crate::resnet::ResNet`]); transitions compress the channels by
//! `compression` and halve the resolution with a 2x2 average pooling.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

use crate::dropout::Ctx;
use crate::nn::{BatchNorm, Linear};
use crate::recompute::LayerStack;
use crate::resnet::{conv, Conv};
use crate::{Error, Result};

/// Sizes of a [`DenseNet`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DenseNetConfig {
    /// Input channels (3 for RGB).
    pub in_channels: usize,
    /// New channels per layer (`k`; 32 in DenseNet-121).
    pub growth_rate: usize,
    /// Layers per dense block (`[6, 12, 24, 16]` is DenseNet-121's).
    pub block_config: Vec<usize>,
    /// Channels of the stem (`2k` in DenseNet-BC).
    pub init_features: usize,
    /// The bottleneck's width in multiples of the growth rate (4).
    pub bn_size: usize,
    /// The share of channels a transition keeps (0.5 in DenseNet-BC).
    pub compression: f64,
    /// Recompute each layer's concatenation, BN-ReLUs and bottleneck in the backward pass
    /// instead of keeping them (the memory-efficient DenseNet of Pleiss et al.).
    pub memory_efficient: bool,
    /// Representation width (the projection `classifier`).
    pub output: usize,
}

impl Default for DenseNetConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            growth_rate: 12,
            block_config: vec![4, 4, 4],
            init_features: 24,
            bn_size: 4,
            compression: 0.5,
            memory_efficient: true,
            output: 64,
        }
    }
}

impl DenseNetConfig {
    /// DenseNet-121's shape (growth 32, blocks 6/12/24/16, 64 stem channels).
    pub fn densenet121(output: usize) -> Self {
        Self {
            growth_rate: 32,
            block_config: vec![6, 12, 24, 16],
            init_features: 64,
            output,
            ..Self::default()
        }
    }

    /// Checks the sizes: every count positive, a compression in (0, 1] that leaves every
    /// transition a channel.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        for (field, value) in [
            ("densenet.in_channels", self.in_channels),
            ("densenet.growth_rate", self.growth_rate),
            ("densenet.init_features", self.init_features),
            ("densenet.bn_size", self.bn_size),
            ("densenet.output", self.output),
        ] {
            if value == 0 {
                return bad(field, "0".into(), "must be at least 1");
            }
        }
        if self.block_config.is_empty() || self.block_config.contains(&0) {
            return bad(
                "densenet.block_config",
                format!("{:?}", self.block_config),
                "give at least one dense block, each with at least one layer",
            );
        }
        if !(self.compression > 0.0 && self.compression <= 1.0) {
            return bad(
                "densenet.compression",
                self.compression.to_string(),
                "must be in (0, 1]: the share of channels a transition keeps",
            );
        }
        self.channels()?;
        Ok(())
    }

    /// The channels entering each dense block and leaving the last one.
    fn channels(&self) -> Result<(Vec<usize>, usize)> {
        let mut c = self.init_features;
        let mut entering = Vec::with_capacity(self.block_config.len());
        for (b, &layers) in self.block_config.iter().enumerate() {
            entering.push(c);
            c += layers * self.growth_rate;
            if b + 1 < self.block_config.len() {
                c = (c as f64 * self.compression).floor() as usize;
                if c == 0 {
                    return Err(Error::InvalidConfig {
                        field: "densenet.compression",
                        value: self.compression.to_string(),
                        reason: "leaves a transition without a channel",
                    });
                }
            }
        }
        Ok((entering, c))
    }

    /// The smallest image side the tower takes: each transition halves it.
    pub fn min_size(&self) -> usize {
        1 << (self.block_config.len() - 1)
    }
}

/// One layer of a dense block: the bottleneck (BN-ReLU-conv1x1) and BN-ReLU-conv3x3.
struct DenseLayer {
    norm1: BatchNorm,
    conv1: Conv,
    norm2: BatchNorm,
    conv2: Conv,
    memory_efficient: bool,
}

impl DenseLayer {
    fn new(cin: usize, cfg: &DenseNetConfig, vb: VarBuilder) -> Result<Self> {
        let width = cfg.bn_size * cfg.growth_rate;
        Ok(Self {
            norm1: BatchNorm::new(cin, vb.pp("norm1"))?,
            conv1: conv(cin, width, 1, 1, vb.pp("conv1"))?,
            norm2: BatchNorm::new(width, vb.pp("norm2"))?,
            conv2: conv(width, cfg.growth_rate, 3, 1, vb.pp("conv2"))?,
            memory_efficient: cfg.memory_efficient,
        })
    }

    /// The new feature maps from all earlier ones; with `memory_efficient`, one node that
    /// keeps only the features and the parameters.
    fn forward(&self, features: &[Tensor], ctx: &Ctx) -> Result<Tensor> {
        let params = [
            self.norm1.weight(),
            self.norm1.bias(),
            &self.conv1.weight,
            self.norm2.weight(),
            self.norm2.bias(),
            &self.conv2.weight,
        ];
        let (norm1, norm2) = (self.norm1.clone(), self.norm2.clone());
        let layer = move |features: &[Tensor], p: &[Tensor], ctx: &Ctx| -> Result<Tensor> {
            let norm1 = norm1.with_params(p[0].clone(), p[1].clone());
            let norm2 = norm2.with_params(p[3].clone(), p[4].clone());
            let cat = Tensor::cat(features, 1)?;
            let bottleneck = crate::nn::conv2d(&norm1.forward_relu(&cat, ctx)?, &p[2], 0, 1)?;
            crate::nn::conv2d(&norm2.forward_relu(&bottleneck, ctx)?, &p[5], 1, 1)
        };
        if !self.memory_efficient {
            let p: Vec<Tensor> = params.iter().map(|&t| t.clone()).collect();
            return layer(features, &p, ctx);
        }
        let n = features.len();
        let mut inputs: Vec<&Tensor> = features.iter().collect();
        inputs.extend(params);
        let ctx = *ctx;
        // The forward may move the running statistics (the representation pass, or a
        // plain training forward); the backward's recomputation never does.
        let first = AtomicBool::new(true);
        Ok(crate::nn::cpu::recomputed(
            "gradcache-dense-layer",
            &inputs,
            move |t| {
                let ctx = if first.swap(false, Ordering::SeqCst) {
                    ctx
                } else {
                    ctx.frozen_stats()
                };
                layer(&t[..n], &t[n..], &ctx).map_err(candle_core::Error::wrap)
            },
        )?)
    }
}

/// A dense block and the transition after it (none after the last block).
struct DenseBlock {
    layers: Vec<DenseLayer>,
    transition: Option<(BatchNorm, Conv)>,
}

impl DenseBlock {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut features = vec![x.clone()];
        for layer in &self.layers {
            let new = layer.forward(&features, ctx)?;
            features.push(new);
        }
        let out = Tensor::cat(&features, 1)?;
        match &self.transition {
            None => Ok(out),
            Some((norm, conv)) => {
                let h = conv.forward(&norm.forward_relu(&out, ctx)?)?;
                Ok(h.avg_pool2d(2)?)
            }
        }
    }
}

/// The DenseNet-BC tower over images `[rows, channels, height, width]` (f32; each side at
/// least [`DenseNetConfig::min_size`]).
pub struct DenseNet {
    stem: (Conv, BatchNorm),
    blocks: Vec<DenseBlock>,
    norm5: BatchNorm,
    classifier: Linear,
    min_size: usize,
}

impl DenseNet {
    /// Builds the tower with torchvision's parameter names under `vb`.
    pub fn new(cfg: &DenseNetConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (entering, out) = cfg.channels()?;
        let f = vb.pp("features");
        let stem = (
            conv(cfg.in_channels, cfg.init_features, 3, 1, f.pp("conv0"))?,
            BatchNorm::new(cfg.init_features, f.pp("norm0"))?,
        );
        let mut blocks = Vec::with_capacity(cfg.block_config.len());
        for (b, &count) in cfg.block_config.iter().enumerate() {
            let vb = f.pp(format!("denseblock{}", b + 1));
            let layers = (0..count)
                .map(|l| {
                    let cin = entering[b] + l * cfg.growth_rate;
                    DenseLayer::new(cin, cfg, vb.pp(format!("denselayer{}", l + 1)))
                })
                .collect::<Result<Vec<_>>>()?;
            let transition = match entering.get(b + 1) {
                Some(&next) => {
                    let cin = entering[b] + count * cfg.growth_rate;
                    let vb = f.pp(format!("transition{}", b + 1));
                    Some((
                        BatchNorm::new(cin, vb.pp("norm"))?,
                        conv(cin, next, 1, 1, vb.pp("conv"))?,
                    ))
                }
                None => None,
            };
            blocks.push(DenseBlock { layers, transition });
        }
        Ok(Self {
            stem,
            blocks,
            norm5: BatchNorm::new(out, f.pp("norm5"))?,
            classifier: Linear::new(out, cfg.output, vb.pp("classifier"))?,
            min_size: cfg.min_size(),
        })
    }
}

impl LayerStack for DenseNet {
    type Input = Tensor;
    type Aux = ();

    fn aux(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn embed(&self, images: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        let (_, _, h, w) = images.dims4().map_err(|_| Error::InvalidArgument {
            what: "images",
            value: format!("{:?}", images.dims()),
            reason: "a DenseNet takes images [rows, channels, height, width]",
        })?;
        if h.min(w) < self.min_size {
            return Err(Error::InvalidArgument {
                what: "image size",
                value: format!("{h}x{w}"),
                reason: "too small for the dense blocks: each transition halves the side",
            });
        }
        let (conv, bn) = &self.stem;
        bn.forward_relu(&conv.forward(images)?, ctx)
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn layer(&self, i: usize, x: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        self.blocks[i].forward(x, ctx)
    }

    fn head(&self, x: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        let h = self.norm5.forward_relu(x, ctx)?;
        let pooled = h.mean(D::Minus1)?.mean(D::Minus1)?;
        self.classifier.forward(&pooled)
    }
}
