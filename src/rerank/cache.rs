//! The gradient cache for a cross-encoder: a (query, document) pair's representation is
//! its score.
//!
//! A step takes the batch's pairs query by query (`Q` queries, each with its group of `G`
//! documents, the positive first where the loss has one) and runs the cache's three
//! phases over them: every chunk of pairs is scored without a graph
//! ([`crate::cache::cached`], keeping only its input, its dropout seeds and its scores);
//! the loss over all `Q x G` scores gives each score's gradient; each chunk is replayed
//! with its slice. The parameter gradients equal those of one forward and backward over
//! every pair, while activation memory is that of one chunk: 64 queries with 1 + 31
//! candidates are 2,048 transformer passes in one loss, at the memory of `pair_chunk` of
//! them.
//!
//! Across ranks each rank scores its own queries' pairs; the scores (and labels) are
//! all-gathered, every rank computes the loss over the global batch and replays its own
//! rows, and the gradients are summed once per step, as [`crate::GradCache`] does.

use std::rc::Rc;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::batch::{Batch, Chunking, TokenBatch};
use crate::cache::{cached, StepOutput, StepPeaks, StepTimes};
use crate::dist::{self, Collective, Single};
use crate::dropout::{ChunkSeed, Ctx};
use crate::encoder::Encoder;
use crate::memory::PhaseMeter;
use crate::params::{GradAccumulator, Params};
use crate::rerank::loss::RerankLoss;
use crate::sink::Sink;
use crate::stop::StopSignal;
use crate::{Error, Result, Side};

/// The gradient cache over a cross-encoder's pairs.
pub struct RerankCache<E: Encoder<Input = TokenBatch>> {
    encoder: Arc<E>,
    chunking: Chunking,
    loss: RerankLoss,
    seed: u64,
    dropout: bool,
    comm: Rc<dyn Collective>,
    bucket_bytes: usize,
    stop: StopSignal,
}

impl<E: Encoder<Input = TokenBatch>> RerankCache<E> {
    /// A cache over `encoder` (a cross-encoder: one score per pair) in chunks of `chunk`
    /// pairs.
    pub fn new(encoder: E, chunk: usize, loss: RerankLoss) -> Result<Self> {
        if chunk == 0 {
            return Err(Error::ZeroChunkSize {
                side: Side::Passage,
            });
        }
        Ok(Self {
            encoder: Arc::new(encoder),
            chunking: Chunking::Rows(chunk),
            loss,
            seed: 0,
            dropout: true,
            comm: Rc::new(Single),
            bucket_bytes: dist::DEFAULT_BUCKET_BYTES,
            stop: StopSignal::new(),
        })
    }

    /// Cuts the pairs into chunks by tokens: consecutive pairs while a chunk's pairs times
    /// its longest stay within `tokens`.
    pub fn with_chunk_tokens(mut self, tokens: usize) -> Result<Self> {
        if tokens == 0 {
            return Err(Error::ZeroChunkSize {
                side: Side::Passage,
            });
        }
        self.chunking = Chunking::Tokens(tokens);
        Ok(self)
    }

    /// Sets the run seed the dropout masks derive from (default 0).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Turns dropout on (training, the default) or off.
    pub fn with_dropout(mut self, dropout: bool) -> Self {
        self.dropout = dropout;
        self
    }

    /// Runs every step across the processes of `comm` (each rank passes its own queries'
    /// pairs, as many on every rank).
    pub fn with_collective(mut self, comm: Rc<dyn Collective>) -> Self {
        self.comm = comm;
        self
    }

    /// Abandons a step between chunks once `stop` is set.
    pub fn with_stop_signal(mut self, stop: StopSignal) -> Self {
        self.stop = stop;
        self
    }

    /// The encoder.
    pub fn encoder(&self) -> &E {
        &self.encoder
    }

    /// The trainable parameters.
    pub fn params(&self) -> &Params {
        self.encoder.params()
    }

    /// The loss.
    pub fn loss(&self) -> &RerankLoss {
        &self.loss
    }

    /// How the pairs are cut into chunks.
    pub fn chunking(&self) -> Chunking {
        self.chunking
    }

    /// The collective the steps run across.
    pub fn collective(&self) -> &dyn Collective {
        &*self.comm
    }

    /// The forward context of chunk `chunk` at `step`.
    pub fn ctx(&self, step: u64, chunk: usize) -> Ctx {
        if !self.dropout {
            return Ctx::train_without_dropout();
        }
        Ctx::train(ChunkSeed {
            run: self.seed,
            step,
            rank: self.comm.rank() as u32,
            tower: 0,
            chunk: chunk as u32,
        })
    }

    /// One cached step over `pairs` (`rows / group` queries, each with its `group` pairs,
    /// query by query), with `labels` (one per pair) where the loss reads them. Returns
    /// the loss over the global batch and the gradients (summed across ranks).
    pub fn step(
        &self,
        step: u64,
        pairs: &TokenBatch,
        group: usize,
        labels: Option<&[f32]>,
    ) -> Result<StepOutput> {
        let _flush = crate::denormal::flush();
        let comm = &*self.comm;
        let mut meter = PhaseMeter::start();
        let phase = crate::profile::phase;
        check_layout(pairs.rows(), group, labels)?;
        let chunks = {
            let _p = phase("step.1 represent");
            dist::agree(comm, self.represent(step, pairs))?
        };
        let represent = meter.lap();
        let (value, pending) = {
            let _p = phase("step.2 loss");
            let local = chunks.iter().map(|c| c.rep().clone()).collect::<Vec<_>>();
            let local = Tensor::cat(&local, 0)?;
            dist::agree(comm, self.loss_over_ranks(&local, group, labels)).map(|v| (v, chunks))?
        };
        let loss = meter.lap();
        let out = {
            let _p = phase("step.3 replay");
            let run = || -> Result<_> {
                let sink = Sink::open();
                let mut grads = GradAccumulator::default();
                let mut start = 0;
                for chunk in pending {
                    self.stop.check()?;
                    let rows = chunk.rep().dim(0)?;
                    let cotangent = value.1.narrow(0, start, rows)?;
                    start += rows;
                    grads.add(chunk.replay(&cotangent)?)?;
                }
                let mut grads = grads.finish();
                grads.merge(sink.take(self.params())?)?;
                Ok(grads)
            };
            dist::agree(comm, run())?
        };
        let replay = meter.lap();
        let grads = {
            let _p = phase("step.4 reduce");
            dist::reduce_gradients(comm, self.params(), out, self.bucket_bytes)?
        };
        let reduce = meter.lap();
        Ok(StepOutput {
            loss: value.0,
            grads,
            times: StepTimes {
                represent: represent.0,
                loss: loss.0,
                replay: replay.0,
                reduce: reduce.0,
            },
            peaks: StepPeaks {
                represent: represent.1,
                loss: loss.1,
                replay: replay.1,
                reduce: reduce.1,
            },
        })
    }

    /// Phase 1: every chunk of pairs scored without a graph.
    fn represent(&self, step: u64, pairs: &TokenBatch) -> Result<Vec<crate::cache::Cached<'_>>> {
        let parts = pairs.chunked(self.chunking)?.ok_or(Error::TokensToCount {
            side: Side::Passage,
        })?;
        let mut out = Vec::with_capacity(parts.len());
        for (i, chunk) in parts.into_iter().enumerate() {
            self.stop.check()?;
            let c = cached(&*self.encoder, Side::Passage, chunk, self.ctx(step, i))?;
            one_score(c.rep())?;
            out.push(c);
        }
        Ok(out)
    }

    /// Phase 2: the scores (and labels) of every rank gathered, the loss over the global
    /// batch, and this rank's slice of its gradient `[rows, 1]`.
    fn loss_over_ranks(
        &self,
        local: &Tensor,
        group: usize,
        labels: Option<&[f32]>,
    ) -> Result<(f32, Tensor)> {
        let rows = local.dim(0)?;
        let comm = &*self.comm;
        let gather = |t: Tensor| -> Result<Tensor> {
            let t = if comm.world_size() == 1 {
                t
            } else {
                comm.all_gather(&t)?
            };
            Ok(t.flatten_all()?)
        };
        let scores: Vec<f64> = gather(local.clone())?.to_dtype(DType::F64)?.to_vec1()?;
        let labels: Option<Vec<f32>> = match labels {
            Some(l) => {
                let l = Tensor::from_slice(l, (l.len(), 1), local.device())?;
                Some(gather(l)?.to_vec1()?)
            }
            None => None,
        };
        let value = self
            .loss
            .value_and_grad(&scores, group, labels.as_deref())?;
        let loss = value.loss as f32;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss { value: loss });
        }
        let start = comm.rank() * rows;
        let grad = Tensor::from_slice(&value.grad[start..start + rows], (rows, 1), local.device())?
            .to_dtype(local.dtype())?;
        Ok((loss, grad))
    }

    /// A plain step for reference: one forward with a graph over every pair, the loss, one
    /// backward. Memory grows with the pairs; the gradients are what [`Self::step`] must
    /// reproduce. Dropout uses the masks of chunk 0 at `step`.
    pub fn full_batch_step(
        &self,
        step: u64,
        pairs: &TokenBatch,
        group: usize,
        labels: Option<&[f32]>,
    ) -> Result<StepOutput> {
        let _flush = crate::denormal::flush();
        check_layout(pairs.rows(), group, labels)?;
        let scores = self.encoder.forward(pairs, &self.ctx(step, 0))?;
        one_score(&scores)?;
        let values: Vec<f64> = scores.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let value = self.loss.value_and_grad(&values, group, labels)?;
        let grad = Tensor::from_slice(&value.grad, scores.shape(), scores.device())?
            .to_dtype(scores.dtype())?;
        // The loss's gradient enters as the cotangent of the scores: sum(scores * g).
        let surrogate = (scores * grad)?.sum_all()?;
        let store = surrogate.backward()?;
        Ok(StepOutput {
            loss: value.loss as f32,
            grads: self.params().grads_from(&store),
            times: StepTimes::default(),
            peaks: StepPeaks::default(),
        })
    }
}

/// Refuses pairs that are not whole groups, or labels not one per pair.
fn check_layout(rows: usize, group: usize, labels: Option<&[f32]>) -> Result<()> {
    if group == 0 || rows == 0 || !rows.is_multiple_of(group) {
        return Err(Error::InvalidArgument {
            what: "reranker batch",
            value: format!("{rows} pairs in groups of {group}"),
            reason: "the pairs are whole groups, query by query (each query's documents in a \
                     row)",
        });
    }
    if let Some(l) = labels {
        if l.len() != rows {
            return Err(Error::InvalidArgument {
                what: "reranker labels",
                value: format!("{} labels for {rows} pairs", l.len()),
                reason: "one label per pair",
            });
        }
    }
    Ok(())
}

/// Refuses a head of more than one output: the losses rank one score per pair.
fn one_score(rep: &Tensor) -> Result<()> {
    let width = rep.dim(1)?;
    if width != 1 {
        return Err(Error::InvalidArgument {
            what: "cross-encoder",
            value: format!("{width} labels"),
            reason: "a reranker's losses read one score per pair (num_labels = 1)",
        });
    }
    Ok(())
}
