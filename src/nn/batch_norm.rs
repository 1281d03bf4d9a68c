//! Batch normalisation with running statistics that the gradient cache moves exactly once
//! per chunk.
//!
//! # What a cached step with BatchNorm computes
//!
//! In training, BatchNorm normalises with the mean and variance of the rows it sees. Under
//! the gradient cache a tower sees one *chunk* at a time, so a cached step is the step of
//! a model whose BatchNorm normalises each chunk with that chunk's statistics (the
//! "ghost batch normalisation" of Hoffer et al. 2017), not the full-batch step: the chunk
//! size is part of the model's definition, like the batch size of a plain run. Inside
//! that definition the step is exact: its gradients equal a plain backward through the
//! chunk-by-chunk forward, and every re-run of a chunk (the replay, checkpoint recomputes)
//! uses the representation pass's statistics bit for bit, since it normalises the same
//! rows with the same operations.
//!
//! The running statistics move once per chunk, in the representation pass only (see
//! [`NormStats`]): a replay or a checkpoint recompute never moves them, unlike
//! `torch.utils.checkpoint`, which leaves that to the user. Statistics are never
//! synchronised across chunks, towers or processes (no SyncBatchNorm): in a distributed
//! step each rank normalises its own chunks, so the running statistics of two ranks
//! drift apart (the image-text trainer runs in one process). Whether the rows of a chunk
//! are a random sample (shuffled across ranks, as SimCLR's global BN and MoCo's "shuffle
//! BN" arrange, to keep batch statistics from leaking which rows are
//! positives) is the data order's business: chunks are slices of the batch as given.

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::dropout::{Ctx, NormStats};
use crate::{Error, Result};

/// BatchNorm over channel dimension 1 of `[rows, channels]` or `[rows, channels, ...]`
/// (PyTorch's `BatchNorm1d`/`BatchNorm2d`): parameters `weight`, `bias` and buffers
/// `running_mean`, `running_var` (PyTorch's names). Statistics are taken in f32.
#[derive(Clone, Debug)]
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    eps: f64,
    momentum: f64,
}

impl BatchNorm {
    /// PyTorch's defaults: `eps = 1e-5`, `momentum = 0.1`.
    pub fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        Self::with_options(channels, 1e-5, 0.1, vb)
    }

    /// BatchNorm with `eps` added to the variance and running statistics updated as
    /// `running = (1 - momentum) * running + momentum * batch` (the batch variance
    /// unbiased, as PyTorch does).
    pub fn with_options(channels: usize, eps: f64, momentum: f64, vb: VarBuilder) -> Result<Self> {
        if !(0.0..=1.0).contains(&momentum) {
            return Err(Error::InvalidConfig {
                field: "momentum",
                value: momentum.to_string(),
                reason: "BatchNorm's momentum must be in [0, 1]",
            });
        }
        Ok(Self {
            weight: vb.get_with_hints(channels, "weight", Init::Const(1.))?,
            bias: vb.get_with_hints(channels, "bias", Init::Const(0.))?,
            running_mean: vb.get_with_hints(channels, "running_mean", Init::Const(0.))?,
            running_var: vb.get_with_hints(channels, "running_var", Init::Const(1.))?,
            eps,
            momentum,
        })
    }

    /// The scale (a parameter).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift (a parameter).
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// This layer with another scale and shift (the same running statistics): how a
    /// node that recomputes it sees its parameters as inputs.
    pub(crate) fn with_params(&self, weight: Tensor, bias: Tensor) -> Self {
        Self {
            weight,
            bias,
            ..self.clone()
        }
    }

    /// The `eps` added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The running mean (a view of the stored buffer).
    pub fn running_mean(&self) -> &Tensor {
        &self.running_mean
    }

    /// The running variance (a view of the stored buffer).
    pub fn running_var(&self) -> &Tensor {
        &self.running_var
    }

    fn channels(&self) -> usize {
        self.weight.elem_count()
    }

    /// Shape `[1, channels, 1, ...]` that broadcasts against an input of `rank` dims.
    fn per_channel(&self, t: &Tensor, rank: usize) -> Result<Tensor> {
        let mut dims = vec![1; rank];
        dims[1] = self.channels();
        Ok(t.reshape(dims)?)
    }

    /// Normalises `x` with the batch statistics in training ([`NormStats::Batch`],
    /// [`NormStats::BatchAndUpdate`], which also updates the running statistics) and with
    /// the running statistics in evaluation.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self.forward_with(x, ctx, false)
    }

    /// `relu(self.forward(x))`, one node with the normalisation in training on the CPU.
    pub fn forward_relu(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self.forward_with(x, ctx, true)
    }

    fn forward_with(&self, x: &Tensor, ctx: &Ctx, relu: bool) -> Result<Tensor> {
        let rank = x.rank();
        if rank < 2 || x.dim(1)? != self.channels() {
            return Err(Error::InvalidArgument {
                what: "BatchNorm input shape",
                value: format!("{:?} (channels: {})", x.dims(), self.channels()),
                reason: "BatchNorm needs an input [rows, channels, ...] with its channel count",
            });
        }
        let dtype = x.dtype();
        let training = ctx.norm != NormStats::Running;
        if training && dtype == DType::F32 && super::fused_ok(&[x, &self.weight, &self.bias]) {
            let n = x.elem_count() / self.channels();
            self.check_batch(x, n)?;
            let (y, mean, var) = super::cpu::batch_norm_train(
                &x.contiguous()?,
                &self.weight,
                &self.bias,
                self.eps,
                relu,
            )?;
            if ctx.norm == NormStats::BatchAndUpdate {
                self.update(&mean, &var, n)?;
            }
            return Ok(y);
        }
        let xf = x.to_dtype(DType::F32)?;
        let reduce: Vec<usize> = (0..rank).filter(|&d| d != 1).collect();
        let (mean, var) = match ctx.norm {
            NormStats::Running => (
                self.per_channel(&self.running_mean.to_dtype(DType::F32)?, rank)?,
                self.per_channel(&self.running_var.to_dtype(DType::F32)?, rank)?,
            ),
            NormStats::Batch | NormStats::BatchAndUpdate => {
                let n = x.elem_count() / self.channels();
                self.check_batch(x, n)?;
                let mean = xf.mean_keepdim(reduce.clone())?;
                let var = xf.broadcast_sub(&mean)?.sqr()?.mean_keepdim(reduce)?;
                if ctx.norm == NormStats::BatchAndUpdate {
                    self.update(&mean.detach(), &var.detach(), n)?;
                }
                (mean, var)
            }
        };
        let scale = (var + self.eps)?.sqrt()?;
        let weight = self.per_channel(&self.weight.to_dtype(DType::F32)?, rank)?;
        let bias = self.per_channel(&self.bias.to_dtype(DType::F32)?, rank)?;
        let y = xf
            .broadcast_sub(&mean)?
            .broadcast_div(&scale)?
            .broadcast_mul(&weight)?
            .broadcast_add(&bias)?;
        let y = if relu { y.relu()? } else { y };
        Ok(y.to_dtype(dtype)?)
    }

    fn check_batch(&self, x: &Tensor, n: usize) -> Result<()> {
        if n < 2 {
            return Err(Error::InvalidArgument {
                what: "BatchNorm input shape",
                value: format!("{:?}", x.dims()),
                reason: "BatchNorm in training needs more than one value per channel \
                         (a chunk of one row without spatial positions has one)",
            });
        }
        Ok(())
    }

    /// Folds one batch's statistics into the running ones, in place (the buffers share
    /// storage with the store's variables, so every build of the model sees the update).
    pub(crate) fn update(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let m = self.momentum;
        let unbiased = (var.flatten_all()? * (n as f64 / (n as f64 - 1.0)))?;
        for (running, batch) in [
            (&self.running_mean, mean.flatten_all()?),
            (&self.running_var, unbiased),
        ] {
            let next = ((running.to_dtype(DType::F32)? * (1.0 - m))? + (batch * m)?)?
                .to_dtype(running.dtype())?;
            running.slice_set(&next, 0, 0)?;
        }
        Ok(())
    }
}
