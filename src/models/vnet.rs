//! A VNet volume tower (Milletari et al. 2016): the down-path of VNet with a pooled
//! embedding head, as a [`LayerStack`] of stages, so that activation checkpointing cuts it
//! at stage boundaries with any [`Recompute`](crate::Recompute) segment policy.
//!
//! The input transition convolves the volume to `width` channels (5x5x5) and adds the
//! volume itself, its channels tiled over the width; each down stage halves every side
//! with a 2x2x2 convolution at stride 2 that doubles the channels, then runs its 5x5x5
//! convolutions and adds the stage's input back (a residual stage). Every convolution is
//! followed by BatchNorm and a PReLU; the residual sum by a second PReLU. Global average
//! pooling and a linear projection (`fc`) give the representation. Parameter names follow
//! vnet.pytorch (`in_tr.conv1`, `in_tr.bn1`, `in_tr.relu1`, `down_tr32.down_conv`,
//! `down_tr32.bn1`, `down_tr32.relu1`, `down_tr32.ops.{i}.conv1` / `.bn1` / `.relu1`,
//! `down_tr32.relu2`); the convolutions have no bias (BatchNorm follows each) and the
//! stages no dropout.
//!
//! Activations of a down-path sit mostly in its first stage (each stage has an eighth of
//! the voxels and twice the channels: a quarter of the memory), so segment checkpointing
//! alone keeps the peak near that stage's own footprint. With `memory_efficient` every
//! convolution unit (convolution, BatchNorm, PReLU, residual sum) is one node that keeps
//! only its inputs and whose backward recomputes the unit a piece of rows at a time
//! ([`crate::nn::cpu::conv_unit`](fn@crate::nn::cpu::conv_unit)).

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

use crate::dropout::{Ctx, NormStats};
use crate::nn::cpu::{conv_unit, Skip, UnitParams};
use crate::nn::{BatchNorm, Linear};
use crate::recompute::LayerStack;
use crate::{Error, Result};

/// Sizes of a [`VNet`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VNetConfig {
    /// Input channels (1 for a scan's intensities).
    pub in_channels: usize,
    /// Channels of the input transition (16 in VNet); a multiple of `in_channels`.
    pub width: usize,
    /// Convolutions of each down stage (`[1, 2, 3, 2]` is VNet's); stage `s` has
    /// `width * 2^(s+1)` channels at `1 / 2^(s+1)` of the side.
    pub stages: Vec<usize>,
    /// Side of the stages' cubic kernels (5 in VNet; odd).
    pub kernel: usize,
    /// Each convolution unit one node that keeps only its inputs, recomputed a piece of
    /// rows at a time in the backward pass.
    pub memory_efficient: bool,
    /// Representation width (the projection `fc`).
    pub output: usize,
}

impl Default for VNetConfig {
    fn default() -> Self {
        Self {
            in_channels: 1,
            width: 16,
            stages: vec![1, 2, 3, 2],
            kernel: 5,
            memory_efficient: false,
            output: 64,
        }
    }
}

impl VNetConfig {
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
                "vnet",
                format!(
                    "in_channels {}, width {}, output {}",
                    self.in_channels, self.width, self.output
                ),
                "channel counts and the output width must be positive",
            );
        }
        if !self.width.is_multiple_of(self.in_channels) {
            return bad(
                "vnet.width",
                self.width.to_string(),
                "must be a multiple of the input channels (the input is tiled over it)",
            );
        }
        if self.stages.is_empty() || self.stages.contains(&0) || self.stages.len() > 8 {
            return bad(
                "vnet.stages",
                format!("{:?}", self.stages),
                "give 1 to 8 down stages, each with at least one convolution",
            );
        }
        if self.kernel.is_multiple_of(2) {
            return bad(
                "vnet.kernel",
                self.kernel.to_string(),
                "must be odd (the convolutions keep the side)",
            );
        }
        Ok(())
    }

    /// The smallest side a volume may have: each down stage halves it.
    pub fn min_size(&self) -> usize {
        1 << self.stages.len()
    }
}

/// A convolution unit: `prelu_out(prelu_in?(bn(conv(h))) + skip)`.
struct ConvUnit {
    weight: Tensor,
    padding: usize,
    stride: usize,
    bn: BatchNorm,
    prelu_in: Option<Tensor>,
    prelu_out: Tensor,
    skip: Skip,
    memory_efficient: bool,
}

/// A 3-D kernel `[cout, cin, k, k, k]` named `weight` under `vb`, Kaiming normal (fan out).
fn kernel(cin: usize, cout: usize, k: usize, vb: VarBuilder) -> Result<Tensor> {
    let init = candle_nn::Init::Kaiming {
        dist: candle_nn::init::NormalOrUniform::Normal,
        fan: candle_nn::init::FanInOut::FanOut,
        non_linearity: candle_nn::init::NonLinearity::ReLU,
    };
    Ok(vb.get_with_hints((cout, cin, k, k, k), "weight", init)?)
}

/// PReLU's slopes `[channels]` named `weight` under `vb` (PyTorch's 0.25).
fn slopes(channels: usize, vb: VarBuilder) -> Result<Tensor> {
    Ok(vb.get_with_hints(channels, "weight", candle_nn::Init::Const(0.25))?)
}

/// `max(x, 0) + a min(x, 0)` with one slope per channel (dimension 1).
fn prelu(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    let mut dims = vec![1; x.rank()];
    dims[1] = a.elem_count();
    let pos = x.relu()?;
    let neg = (x - &pos)?;
    Ok((pos + neg.broadcast_mul(&a.reshape(dims)?)?)?)
}

impl ConvUnit {
    fn forward(&self, h: &Tensor, skip: Option<&Tensor>, ctx: &Ctx) -> Result<Tensor> {
        let training = ctx.norm != NormStats::Running;
        if self.memory_efficient
            && training
            && crate::nn::fused_f32(&[h, &self.weight, &self.prelu_out])
        {
            let p = UnitParams {
                weight: &self.weight,
                padding: self.padding,
                stride: self.stride,
                gamma: self.bn.weight(),
                beta: self.bn.bias(),
                eps: self.bn.eps(),
                prelu_in: self.prelu_in.as_ref(),
                prelu_out: &self.prelu_out,
            };
            let (y, mean, var) = conv_unit(h, self.skip, skip, &p)?;
            if ctx.norm == NormStats::BatchAndUpdate {
                let rows = y.elem_count() / y.dim(1)?;
                self.bn.update(&mean, &var, rows)?;
            }
            return Ok(y);
        }
        let z = crate::nn::cpu::conv3d(h, &self.weight, self.padding, self.stride)?;
        let mut t = self.bn.forward(&z, ctx)?;
        if let Some(a) = &self.prelu_in {
            t = prelu(&t, a)?;
        }
        let u = match (self.skip, skip) {
            (Skip::None, _) => t,
            (Skip::Repeat, _) => {
                let reps = t.dim(1)? / h.dim(1)?;
                (t + Tensor::cat(&vec![h.clone(); reps], 1)?)?
            }
            (Skip::Tensor, Some(s)) => (t + s)?,
            (Skip::Tensor, None) => {
                return Err(Error::InvalidArgument {
                    what: "VNet unit",
                    value: "no residual".into(),
                    reason: "a residual unit needs its stage's input",
                })
            }
        };
        prelu(&u, &self.prelu_out)
    }
}

/// One stage: the input transition (one unit with the tiled input as residual) or a down
/// stage (the strided down convolution, then its convolutions, the last one adding the
/// down convolution's output back).
struct Stage {
    down: Option<ConvUnit>,
    ops: Vec<ConvUnit>,
}

impl Stage {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let down = match &self.down {
            Some(unit) => unit.forward(x, None, ctx)?,
            None => x.clone(),
        };
        let mut h = down.clone();
        for unit in &self.ops {
            h = unit.forward(&h, Some(&down), ctx)?;
        }
        Ok(h)
    }
}

/// The VNet tower over volumes `[rows, channels, depth, height, width]` (f32 on the CPU;
/// each side a multiple of [`VNetConfig::min_size`]).
pub struct VNet {
    stages: Vec<Stage>,
    fc: Linear,
    in_channels: usize,
    min_size: usize,
}

impl VNet {
    /// Builds the tower with vnet.pytorch's parameter names under `vb`.
    pub fn new(cfg: &VNetConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (k, me) = (cfg.kernel, cfg.memory_efficient);
        let unit = |cin, cout, k, stride, name: &str, vb: &VarBuilder| -> Result<ConvUnit> {
            Ok(ConvUnit {
                weight: kernel(cin, cout, k, vb.pp(name))?,
                padding: if stride == 1 { k / 2 } else { 0 },
                stride,
                bn: BatchNorm::new(cout, vb.pp("bn1"))?,
                prelu_in: None,
                prelu_out: slopes(cout, vb.pp("relu1"))?,
                skip: Skip::None,
                memory_efficient: me,
            })
        };
        let w = cfg.width;
        let in_tr = vb.pp("in_tr");
        let mut stages = vec![Stage {
            down: None,
            ops: vec![ConvUnit {
                skip: Skip::Repeat,
                ..unit(cfg.in_channels, w, k, 1, "conv1", &in_tr)?
            }],
        }];
        for (s, &convs) in cfg.stages.iter().enumerate() {
            let (cin, cout) = (w << s, w << (s + 1));
            let vb = vb.pp(format!("down_tr{cout}"));
            let down = unit(cin, cout, 2, 2, "down_conv", &vb)?;
            let ops = (0..convs)
                .map(|i| {
                    let op = vb.pp(format!("ops.{i}"));
                    let u = unit(cout, cout, k, 1, "conv1", &op)?;
                    if i + 1 < convs {
                        return Ok(u);
                    }
                    // The last convolution's PReLU comes before the residual sum, the
                    // stage's (`relu2`) after it.
                    Ok(ConvUnit {
                        prelu_in: Some(u.prelu_out),
                        prelu_out: slopes(cout, vb.pp("relu2"))?,
                        skip: Skip::Tensor,
                        ..u
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            stages.push(Stage {
                down: Some(down),
                ops,
            });
        }
        let out = w << cfg.stages.len();
        Ok(Self {
            stages,
            fc: Linear::new(out, cfg.output, vb.pp("fc"))?,
            in_channels: cfg.in_channels,
            min_size: cfg.min_size(),
        })
    }
}

impl LayerStack for VNet {
    type Input = Tensor;
    type Aux = ();

    fn aux(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn embed(&self, volumes: &Tensor, _: &(), _: &Ctx) -> Result<Tensor> {
        let dims = volumes.dims();
        let bad = |reason| Error::InvalidArgument {
            what: "volumes",
            value: format!("{dims:?}"),
            reason,
        };
        let &[_, c, d, h, w] = dims else {
            return Err(bad(
                "a VNet takes volumes [rows, channels, depth, height, width]",
            ));
        };
        if c != self.in_channels {
            return Err(bad("the channel count is not the tower's in_channels"));
        }
        if [d, h, w].iter().any(|&s| s == 0 || s % self.min_size != 0) {
            return Err(bad(
                "each side must be a positive multiple of 2^(down stages): every stage halves it",
            ));
        }
        Ok(volumes.clone())
    }

    fn num_layers(&self) -> usize {
        self.stages.len()
    }

    fn layer(&self, i: usize, x: &Tensor, _: &(), ctx: &Ctx) -> Result<Tensor> {
        self.stages[i].forward(x, ctx)
    }

    fn head(&self, x: &Tensor, _: &(), _: &Ctx) -> Result<Tensor> {
        let pooled = x.flatten_from(2)?.mean(D::Minus1)?;
        self.fc.forward(&pooled)
    }
}
