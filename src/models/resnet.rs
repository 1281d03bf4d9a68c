//! A ResNet image tower (He et al. 2016) with BatchNorm, as a [`LayerStack`] of residual
//! blocks, so that activation checkpointing cuts it at block boundaries with any
//! [`Recompute`](crate::Recompute) segment policy.
//!
//! Layout and parameter names follow torchvision's `resnet.py` (`conv1`, `bn1`,
//! `layer{s}.{b}.conv1`, `.bn1`, `.downsample.0`, `.downsample.1`, `fc`), with the small
//! image stem of the CIFAR ResNets: one 3x3 convolution at stride 1 and no max pooling
//! (torchvision's 7x7 stem with its padded max pooling is meant for 224-pixel images, and
//! candle has no backward for an overlapping max pool), so ImageNet checkpoints do not
//! load: the tower starts from a fresh initialisation (Kaiming normal, fan out, as
//! torchvision). Stage `s` has width `width * 2^s` (times 4 at the output of bottleneck
//! blocks) and halves the resolution for `s > 0`; global average pooling and a linear
//! projection (`fc`) give the representation.

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

use crate::dropout::Ctx;
use crate::nn::{BatchNorm, Linear};
use crate::recompute::LayerStack;
use crate::{Error, Result};

/// Residual block kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Block {
    /// Two 3x3 convolutions (ResNet-18/34).
    #[default]
    Basic,
    /// 1x1 down, 3x3, 1x1 up to four times the width (ResNet-50 and deeper).
    Bottleneck,
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

/// Sizes of a [`ResNet`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResNetConfig {
    /// Input channels (3 for RGB).
    pub in_channels: usize,
    /// Width of the stem and the first stage; stage `s` has `width * 2^s`.
    pub width: usize,
    /// Blocks per stage (`[2, 2, 2, 2]` is ResNet-18's layout).
    pub stages: Vec<usize>,
    /// Basic or bottleneck blocks.
    pub block: Block,
    /// Representation width (the projection `fc`).
    pub output: usize,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            width: 16,
            stages: vec![1, 1, 1],
            block: Block::Basic,
            output: 64,
        }
    }
}

impl ResNetConfig {
    /// Checks the sizes.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.in_channels == 0 || self.width == 0 || self.output == 0 {
            return bad(
                "resnet",
                format!(
                    "in_channels {}, width {}, output {}",
                    self.in_channels, self.width, self.output
                ),
                "channel counts and the output width must be positive",
            );
        }
        if self.stages.is_empty() || self.stages.contains(&0) {
            return bad(
                "resnet.stages",
                format!("{:?}", self.stages),
                "give at least one stage, each with at least one block",
            );
        }
        Ok(())
    }

    /// Total number of residual blocks (the stack's layers).
    pub fn blocks(&self) -> usize {
        self.stages.iter().sum()
    }
}

/// A square convolution without bias, padded to keep the size at stride 1.
pub(crate) struct Conv {
    pub(crate) weight: Tensor,
    padding: usize,
    stride: usize,
}

impl Conv {
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::nn::conv2d(x, &self.weight, self.padding, self.stride)
    }
}

/// A `k x k` convolution from `cin` to `cout` channels at `stride`, torchvision's
/// initialisation (Kaiming normal, fan out).
pub(crate) fn conv(
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    vb: VarBuilder,
) -> Result<Conv> {
    let init = candle_nn::Init::Kaiming {
        dist: candle_nn::init::NormalOrUniform::Normal,
        fan: candle_nn::init::FanInOut::FanOut,
        non_linearity: candle_nn::init::NonLinearity::ReLU,
    };
    let weight = vb.get_with_hints((cout, cin, k, k), "weight", init)?;
    Ok(Conv {
        weight,
        padding: k / 2,
        stride,
    })
}

/// One residual block: `relu(F(x) + shortcut(x))`.
struct ResidualBlock {
    convs: Vec<(Conv, BatchNorm)>,
    downsample: Option<(Conv, BatchNorm)>,
}

impl ResidualBlock {
    fn new(kind: Block, cin: usize, width: usize, stride: usize, vb: VarBuilder) -> Result<Self> {
        let cout = width * kind.expansion();
        // (in, out, kernel, stride) of each convolution, named conv1, conv2, ...
        let shapes = match kind {
            Block::Basic => vec![(cin, width, 3, stride), (width, width, 3, 1)],
            Block::Bottleneck => vec![
                (cin, width, 1, 1),
                (width, width, 3, stride),
                (width, cout, 1, 1),
            ],
        };
        let convs = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (ci, co, k, s))| {
                Ok((
                    conv(ci, co, k, s, vb.pp(format!("conv{}", i + 1)))?,
                    BatchNorm::new(co, vb.pp(format!("bn{}", i + 1)))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let downsample = if stride != 1 || cin != cout {
            let vb = vb.pp("downsample");
            Some((
                conv(cin, cout, 1, stride, vb.pp("0"))?,
                BatchNorm::new(cout, vb.pp("1"))?,
            ))
        } else {
            None
        };
        Ok(Self { convs, downsample })
    }

    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let last = self.convs.len() - 1;
        let mut h = x.clone();
        for (i, (conv, bn)) in self.convs.iter().enumerate() {
            let z = conv.forward(&h)?;
            h = if i < last {
                bn.forward_relu(&z, ctx)?
            } else {
                bn.forward(&z, ctx)?
            };
        }
        let shortcut = match &self.downsample {
            Some((conv, bn)) => bn.forward(&conv.forward(x)?, ctx)?,
            None => x.clone(),
        };
        Ok((h + shortcut)?.relu()?)
    }
}

/// The ResNet tower over images `[rows, channels, height, width]` (f32, any size the
/// strides divide into at least one pixel).
pub struct ResNet {
    stem: (Conv, BatchNorm),
    blocks: Vec<ResidualBlock>,
    fc: Linear,
}

impl ResNet {
    /// Builds the tower with torchvision's parameter names under `vb`.
    pub fn new(cfg: &ResNetConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let stem = (
            conv(cfg.in_channels, cfg.width, 3, 1, vb.pp("conv1"))?,
            BatchNorm::new(cfg.width, vb.pp("bn1"))?,
        );
        let mut blocks = Vec::with_capacity(cfg.blocks());
        let mut cin = cfg.width;
        for (s, &count) in cfg.stages.iter().enumerate() {
            let width = cfg.width << s;
            for b in 0..count {
                let stride = if s > 0 && b == 0 { 2 } else { 1 };
                let vb = vb.pp(format!("layer{}.{b}", s + 1));
                blocks.push(ResidualBlock::new(cfg.block, cin, width, stride, vb)?);
                cin = width * cfg.block.expansion();
            }
        }
        let fc = Linear::new(cin, cfg.output, vb.pp("fc"))?;
        Ok(Self { stem, blocks, fc })
    }
}

impl LayerStack for ResNet {
    type Input = Tensor;
    type Aux = ();

    fn aux(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn embed(&self, images: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        let (conv, bn) = &self.stem;
        bn.forward_relu(&conv.forward(images)?, ctx)
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn layer(&self, i: usize, x: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        self.blocks[i].forward(x, ctx)
    }

    fn head(&self, x: &Tensor, _: &(), _: &Ctx) -> Result<Tensor> {
        let pooled = x.mean(D::Minus1)?.mean(D::Minus1)?;
        self.fc.forward(&pooled)
    }
}
