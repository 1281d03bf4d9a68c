//! The gradient cache for a cross-encoder: a (query, document) pair's representation is
//! its score.
//!
//! A step takes the batch's pairs query by query (`Q` queries, each with its group of `G`
//! documents, the positive first where the loss has one) and runs the crate's one
//! [`GradCache`] over them: the cross-encoder is the query tower (every chunk of pairs
//! scored without a graph, keeping only its input, dropout seeds and scores), the pairs'
//! labels ride as the passage side ([`LabelTower`]: no parameters, its representation is
//! its input), and [`ScoreLoss`] is the reranker's loss over all `Q x G` scores with their
//! labels. Each chunk is then replayed with its slice of the scores' gradient. The
//! parameter gradients equal those of one forward and backward over every pair, while
//! activation memory is that of one chunk: 64 queries with 1 + 31 candidates are 2,048
//! transformer passes in one loss, at the memory of `pair_chunk` of them.
//!
//! Across ranks everything is [`GradCache`]'s: each rank scores its own queries' pairs,
//! scores and labels are all-gathered, every rank computes the loss over the global batch
//! and replays its own rows, and the gradients are summed once per step.

use std::rc::Rc;

use candle_core::{DType, Tensor};

use crate::batch::{Chunking, TokenBatch};
use crate::cache::{GradCache, StepOutput};
use crate::dist::Collective;
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::loss::{Loss, LossValue};
use crate::params::{Gradients, Params};
use crate::rerank::loss::RerankLoss;
use crate::stop::StopSignal;
use crate::{Error, Result};

/// The passage side of a reranker's step: the pairs' labels `[pairs, 1]`, passed through
/// as they are (no parameters, nothing to replay).
#[derive(Debug, Default, Clone)]
pub struct LabelTower {
    params: Params,
}

impl Encoder for LabelTower {
    type Input = Tensor;

    fn params(&self) -> &Params {
        &self.params
    }

    fn encode(&self, input: &Tensor, _: &Ctx) -> Result<Tensor> {
        Ok(input.clone())
    }

    fn forward(&self, input: &Tensor, _: &Ctx) -> Result<Tensor> {
        Ok(input.clone())
    }

    fn replay(&self, _: &Tensor, _: &Tensor, _: &Ctx) -> Result<Gradients> {
        Ok(Gradients::default())
    }
}

/// A reranker's loss as the gradient cache sees it: "queries" are the scores `[pairs, 1]`
/// in groups of `group` (query by query), "passages" their labels `[pairs, 1]` (read where
/// the objective reads labels).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreLoss {
    loss: RerankLoss,
    group: usize,
}

impl ScoreLoss {
    /// `loss` over groups of `group` scores.
    pub fn new(loss: RerankLoss, group: usize) -> Result<Self> {
        if group == 0 {
            return Err(Error::InvalidArgument {
                what: "reranker group",
                value: "0 documents".into(),
                reason: "each query has at least one scored document",
            });
        }
        Ok(Self { loss, group })
    }

    /// The reranker's loss.
    pub fn rerank_loss(&self) -> &RerankLoss {
        &self.loss
    }

    /// Documents per query.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The loss and each score's gradient, on the host in f64.
    fn host(&self, scores: &Tensor, labels: &Tensor) -> Result<(f64, Vec<f64>)> {
        for t in [scores, labels] {
            let width = t.dim(1)?;
            if width != 1 {
                return Err(Error::InvalidArgument {
                    what: "cross-encoder",
                    value: format!("{width} outputs"),
                    reason: "a reranker's losses read one score per pair (num_labels = 1)",
                });
            }
        }
        let s: Vec<f64> = scores.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let l: Vec<f32> = labels.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let labels = self.loss.objective().needs_labels().then_some(l.as_slice());
        let value = self.loss.value_and_grad(&s, self.group, labels)?;
        Ok((value.loss, value.grad))
    }
}

impl Loss for ScoreLoss {
    /// The loss's value, with the gradient of the scores at this point: `loss + sum(s * g)
    /// - sum(s * g)` with the last term detached (the full-batch reference step).
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        let (loss, grad) = self.host(queries, passages)?;
        let g =
            Tensor::from_vec(grad, queries.shape(), queries.device())?.to_dtype(queries.dtype())?;
        let linear = (queries * &g)?.sum_all()?;
        let constant = (loss - linear.to_dtype(DType::F64)?.to_scalar::<f64>()?) as f32;
        Ok((linear.to_dtype(DType::F32)? + f64::from(constant))?)
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        let (loss, grad) = self.host(queries, passages)?;
        Ok(LossValue {
            loss: loss as f32,
            grad_queries: Tensor::from_vec(grad, queries.shape(), queries.device())?
                .to_dtype(queries.dtype())?,
            grad_passages: passages.zeros_like()?,
            params: Gradients::default(),
        })
    }
}

/// The gradient cache over a cross-encoder's pairs.
pub struct RerankCache<E: Encoder<Input = TokenBatch>> {
    gc: GradCache<E, LabelTower, ScoreLoss>,
}

/// The labels of a step as the passage side's input: one per pair, zeros where the loss
/// reads none.
pub fn label_column(
    labels: Option<&[f32]>,
    pairs: usize,
    device: &candle_core::Device,
) -> Result<Tensor> {
    match labels {
        Some(l) if l.len() != pairs => Err(Error::InvalidArgument {
            what: "reranker labels",
            value: format!("{} labels for {pairs} pairs", l.len()),
            reason: "one label per pair",
        }),
        Some(l) => Ok(Tensor::from_slice(l, (pairs, 1), device)?),
        None => Ok(Tensor::zeros((pairs, 1), DType::F32, device)?),
    }
}

impl<E: Encoder<Input = TokenBatch>> RerankCache<E> {
    /// A cache over `encoder` (a cross-encoder: one score per pair) in chunks of `chunk`
    /// pairs, `loss` over groups of `group` documents per query.
    pub fn new(encoder: E, chunk: usize, loss: RerankLoss, group: usize) -> Result<Self> {
        let gc = GradCache::two_towers(
            encoder,
            LabelTower::default(),
            chunk,
            usize::MAX,
            ScoreLoss::new(loss, group)?,
        )?;
        Ok(Self { gc })
    }

    /// Cuts the pairs into chunks by tokens: consecutive pairs while a chunk's pairs times
    /// its longest stay within `tokens`.
    pub fn with_chunk_tokens(self, tokens: usize) -> Result<Self> {
        Ok(Self {
            gc: self
                .gc
                .with_chunking(Chunking::Tokens(tokens), Chunking::Rows(usize::MAX))?,
        })
    }

    /// Sets the run seed the dropout masks derive from (default 0).
    pub fn with_seed(self, seed: u64) -> Self {
        Self {
            gc: self.gc.with_seed(seed),
        }
    }

    /// Turns dropout on (training, the default) or off.
    pub fn with_dropout(self, dropout: bool) -> Self {
        Self {
            gc: self.gc.with_dropout(dropout),
        }
    }

    /// Runs every step across the processes of `comm` (each rank passes its own queries'
    /// pairs, as many on every rank).
    pub fn with_collective(self, comm: Rc<dyn Collective>) -> Self {
        Self {
            gc: self.gc.with_collective(comm),
        }
    }

    /// Abandons a step between chunks once `stop` is set.
    pub fn with_stop_signal(self, stop: StopSignal) -> Self {
        Self {
            gc: self.gc.with_stop_signal(stop),
        }
    }

    /// The gradient cache underneath.
    pub fn inner(&self) -> &GradCache<E, LabelTower, ScoreLoss> {
        &self.gc
    }

    /// The trainable parameters.
    pub fn params(&self) -> &Params {
        self.gc.params()
    }

    /// One cached step over `pairs` (query by query, each query's documents in a row),
    /// with `labels` (one per pair) where the loss reads them. Returns the loss over the
    /// global batch and the gradients (summed across ranks).
    pub fn step(
        &self,
        step: u64,
        pairs: &TokenBatch,
        labels: Option<&[f32]>,
    ) -> Result<StepOutput> {
        let labels = label_column(labels, crate::Batch::rows(pairs), pairs.input_ids.device())?;
        self.gc.cache_step(step, pairs, &labels)
    }

    /// A plain step for reference: one forward with a graph over every pair, the loss, one
    /// backward.
    pub fn full_batch_step(
        &self,
        step: u64,
        pairs: &TokenBatch,
        labels: Option<&[f32]>,
    ) -> Result<StepOutput> {
        let labels = label_column(labels, crate::Batch::rows(pairs), pairs.input_ids.device())?;
        self.gc.full_batch_step(step, pairs, &labels)
    }
}
