//! The gradient cache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under
//! Memory Limited Setup").
//!
//! A step runs in three phases, each consuming the value the previous one returned, so
//! they cannot run out of order or twice:
//!
//! 1. [`Representations`]: every chunk is encoded without a graph; only its input, its
//!    dropout seeds and its representation are kept.
//! 2. [`GradientCache`]: the loss is computed over *all* representations, and its gradient
//!    with respect to each representation is cached.
//! 3. [`StepOutput`]: each chunk is replayed with its slice of the cache and the parameter
//!    gradients are summed across chunks and towers.
//!
//! The parameter gradients equal those of one forward/backward over the whole batch, while
//! activation memory is that of one chunk. [`GradCache::cache_step`] runs the three phases;
//! [`cached`] and [`Representations::push`] are the functional form (the reference's
//! `cached` / `cat_input_tensor`) for loops that collect many micro-batches into one loss.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;

use crate::batch::{Batch, Chunking};
use crate::dist::{self, Collective, Single};
use crate::dropout::{ChunkSeed, Ctx};
use crate::encoder::Encoder;
use crate::loss::{group_size, scalar, InfoNce, Loss};
use crate::memory::PhaseMeter;
use crate::params::{GradAccumulator, Gradients, Params};
use crate::sink::Sink;
use crate::stop::StopSignal;
use crate::{Error, Result, Side};

/// A deferred replay: cotangent in, parameter gradients out.
type ReplayFn<'a> = Box<dyn FnOnce(&Tensor) -> Result<Gradients> + 'a>;

/// One chunk's representation, detached, with the means to replay it later.
pub struct Cached<'a> {
    side: Side,
    rep: Tensor,
    params: Params,
    replay: ReplayFn<'a>,
}

/// Encodes `input` without a graph and keeps what is needed to replay it: the functional
/// form of the gradient cache (the reference's `cached` decorator). The representation must
/// be a `[rows, width]` matrix with one row per input row.
pub fn cached<'a, E>(encoder: &'a E, side: Side, input: E::Input, ctx: Ctx) -> Result<Cached<'a>>
where
    E: Encoder,
    E::Input: 'a,
{
    let _flush = crate::denormal::flush();
    // The representation pass is the one forward of the chunk that moves running
    // statistics (BatchNorm); the replay normalises with the same batch statistics and
    // leaves them alone.
    let rep = encoder.encode(&input, &ctx.updating_stats())?.detach();
    let ctx = ctx.frozen_stats();
    let dims = rep.dims();
    if dims.len() != 2 {
        return Err(Error::NotAMatrix {
            side,
            shape: dims.to_vec(),
        });
    }
    if dims[0] != input.rows() {
        return Err(Error::RowMismatch {
            side,
            expected: input.rows(),
            got: dims[0],
        });
    }
    Ok(Cached {
        side,
        rep,
        params: encoder.params().clone(),
        replay: Box::new(move |cotangent| encoder.replay(&input, cotangent, &ctx)),
    })
}

impl Cached<'_> {
    /// The detached representation `[rows, width]`.
    pub fn rep(&self) -> &Tensor {
        &self.rep
    }

    /// Which side this chunk belongs to.
    pub fn side(&self) -> Side {
        self.side
    }

    /// Back-propagates `cotangent` (dL/d this representation) into parameter gradients.
    pub fn replay(self, cotangent: &Tensor) -> Result<Gradients> {
        let _flush = crate::denormal::flush();
        (self.replay)(cotangent)
    }
}

/// Concatenates cached representations along rows (the reference's `cat_input_tensor`).
pub fn cat_reps(chunks: &[Cached<'_>]) -> Result<Tensor> {
    let reps: Vec<Tensor> = chunks.iter().map(|c| c.rep.clone()).collect();
    <Tensor as Batch>::cat(&reps)
}

/// Phase 1: the representations of every chunk of both sides, without graphs.
///
/// Built by [`GradCache::represent`], or by hand with [`Representations::push`] to collect
/// micro-batches of a training loop into one big-batch loss.
#[derive(Default)]
pub struct Representations<'a> {
    queries: Vec<Cached<'a>>,
    passages: Vec<Cached<'a>>,
    /// Looked at between replayed chunks (set by [`GradCache::represent`]).
    stop: Option<StopSignal>,
    /// The chunk before whose replay the process meets a fault (`GRADCACHE_KILL_AT`,
    /// `GRADCACHE_HANG_AT`: tests).
    fault: Option<(usize, crate::fault::Fault)>,
}

impl<'a> Representations<'a> {
    /// An empty collection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Encodes one chunk (or micro-batch) of `side` and keeps it for the loss.
    pub fn push<E>(&mut self, encoder: &'a E, side: Side, input: E::Input, ctx: Ctx) -> Result<()>
    where
        E: Encoder,
        E::Input: 'a,
    {
        let c = cached(encoder, side, input, ctx)?;
        self.push_cached(c);
        Ok(())
    }

    /// Keeps an already cached chunk.
    pub fn push_cached(&mut self, c: Cached<'a>) {
        match c.side {
            Side::Query => self.queries.push(c),
            Side::Passage => self.passages.push(c),
        }
    }

    /// All query representations `[Q, d]`, in push order.
    pub fn queries(&self) -> Result<Tensor> {
        self.side_reps(Side::Query)
    }

    /// All passage representations `[P, d]`, in push order.
    pub fn passages(&self) -> Result<Tensor> {
        self.side_reps(Side::Passage)
    }

    fn side_reps(&self, side: Side) -> Result<Tensor> {
        let chunks = match side {
            Side::Query => &self.queries,
            Side::Passage => &self.passages,
        };
        if chunks.is_empty() {
            return Err(Error::EmptyBatch { side });
        }
        cat_reps(chunks)
    }

    /// Phase 2: computes `loss` over all representations and caches its gradient with
    /// respect to each of them. Fails on a non-finite loss before any gradient is computed
    /// for a parameter.
    pub fn into_cache(self, loss: &dyn Loss) -> Result<GradientCache<'a>> {
        self.into_cache_across(loss, &Single)
    }

    /// Phase 2 of a distributed step: every rank's representations are all-gathered (rank
    /// order), `loss` is computed over the global batch on every rank (so every rank holds
    /// the same loss and the same representation gradients, with no second collective),
    /// and this rank keeps the slice of the gradient that belongs to its own rows. Every
    /// rank must hold the same number of queries and of passages.
    pub fn into_cache_across(
        self,
        loss: &dyn Loss,
        comm: &dyn Collective,
    ) -> Result<GradientCache<'a>> {
        let _flush = crate::denormal::flush();
        let (q, p) = dist::agree(comm, self.local_reps(loss.requires_equal_widths()))?;
        let (rows_q, rows_p) = (q.dim(0)?, p.dim(0)?);
        let (all_q, all_p) = if comm.world_size() == 1 {
            (q, p)
        } else {
            // One collective for both sides: rank r's block is [queries_r; passages_r],
            // flattened when the two are of different widths (token matrices of a
            // multi-vector model, each padded to its side's token count).
            let (wq, wp) = (q.dim(1)?, p.dim(1)?);
            let flat = |t: &Tensor| -> Result<Tensor> { Ok(t.flatten_all()?.unsqueeze(1)?) };
            let all = comm.all_gather(&Tensor::cat(&[&flat(&q)?, &flat(&p)?], 0)?)?;
            let (size_q, size_p) = (rows_q * wq, rows_p * wp);
            let block = size_q + size_p;
            let mut qs = Vec::with_capacity(comm.world_size());
            let mut ps = Vec::with_capacity(comm.world_size());
            for r in 0..comm.world_size() {
                qs.push(all.narrow(0, r * block, size_q)?.reshape((rows_q, wq))?);
                ps.push(
                    all.narrow(0, r * block + size_q, size_p)?
                        .reshape((rows_p, wp))?,
                );
            }
            (Tensor::cat(&qs, 0)?, Tensor::cat(&ps, 0)?)
        };
        let value = loss.value_and_grads(&all_q, &all_p)?;
        if !value.loss.is_finite() {
            return Err(Error::NonFiniteLoss { value: value.loss });
        }
        let rank = comm.rank();
        // Every rank computed the loss over the global batch, so every rank holds the full
        // gradient of the loss's own parameters: rank 0 alone contributes it to the sum
        // across ranks.
        let loss_params = if rank == 0 {
            value.params
        } else {
            value
                .params
                .into_iter()
                .map(|(n, g)| Ok((n, g.zeros_like()?)))
                .collect::<Result<Gradients>>()?
        };
        let grad_queries = value.grad_queries.narrow(0, rank * rows_q, rows_q)?;
        let grad_passages = value.grad_passages.narrow(0, rank * rows_p, rows_p)?;
        let mut pending = Vec::with_capacity(self.queries.len() + self.passages.len());
        for (chunks, grads) in [
            (self.queries, &grad_queries),
            (self.passages, &grad_passages),
        ] {
            let mut start = 0;
            for c in chunks {
                let rows = c.rep.dim(0)?;
                pending.push((c, grads.narrow(0, start, rows)?));
                start += rows;
            }
        }
        Ok(GradientCache {
            loss: value.loss,
            grad_queries,
            grad_passages,
            loss_params,
            pending,
            stop: self.stop,
            fault: self.fault,
        })
    }

    /// This process's query and passage representations, checked for shape.
    fn local_reps(&self, equal_widths: bool) -> Result<(Tensor, Tensor)> {
        let q = self.queries()?;
        let p = self.passages()?;
        group_size(q.dim(0)?, p.dim(0)?)?;
        let (qw, pw) = (q.dim(1)?, p.dim(1)?);
        if equal_widths && qw != pw {
            return Err(Error::WidthMismatch {
                query: qw,
                passage: pw,
            });
        }
        Ok((q, p))
    }
}

/// Phase 2: the loss and its gradient with respect to every representation.
pub struct GradientCache<'a> {
    loss: f32,
    grad_queries: Tensor,
    grad_passages: Tensor,
    loss_params: Gradients,
    pending: Vec<(Cached<'a>, Tensor)>,
    stop: Option<StopSignal>,
    fault: Option<(usize, crate::fault::Fault)>,
}

impl GradientCache<'_> {
    /// The loss over the whole batch.
    pub fn loss(&self) -> f32 {
        self.loss
    }

    /// dL/d this process's query representations `[Q, d]` (in a distributed step, the rows
    /// of this rank).
    pub fn grad_queries(&self) -> &Tensor {
        &self.grad_queries
    }

    /// dL/d this process's passage representations `[P, d]`.
    pub fn grad_passages(&self) -> &Tensor {
        &self.grad_passages
    }

    /// Multiplies every cached gradient by `factor` (loss scaling: the replay then
    /// produces `factor` times the parameter gradients). Each side is scaled once and the
    /// chunks' cotangents are taken again as views of it.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        self.grad_queries = (&self.grad_queries * factor)?;
        self.grad_passages = (&self.grad_passages * factor)?;
        self.loss_params.scale(factor)?;
        let (mut queries, mut passages) = (0, 0);
        for (chunk, cotangent) in &mut self.pending {
            let (grads, start) = match chunk.side() {
                Side::Query => (&self.grad_queries, &mut queries),
                Side::Passage => (&self.grad_passages, &mut passages),
            };
            let rows = cotangent.dim(0)?;
            *cotangent = grads.narrow(0, *start, rows)?;
            *start += rows;
        }
        Ok(())
    }

    /// Phase 3: replays every chunk with its slice of the cache and sums the parameter
    /// gradients across chunks and towers (a shared tower accumulates both sides). Built
    /// by [`GradCache::represent`], it stops with [`Error::Interrupted`] between chunks
    /// once the cache's [`StopSignal`] is set.
    pub fn replay(self) -> Result<StepOutput> {
        let _flush = crate::denormal::flush();
        // The parameter gradients the crate's nodes write are summed where they are
        // written, across every chunk (see `crate::sink`); the others here.
        let sink = Sink::open();
        let mut grads = GradAccumulator::default();
        grads.add(self.loss_params)?;
        let mut params = Params::default();
        for (i, (chunk, cotangent)) in self.pending.into_iter().enumerate() {
            if let Some(stop) = &self.stop {
                stop.check()?;
            }
            if let Some((at, fault)) = self.fault {
                if at == i {
                    crate::fault::meet(fault);
                }
            }
            params = params.union(&chunk.params)?;
            grads.add(chunk.replay(&cotangent)?)?;
        }
        let mut grads = grads.finish();
        grads.merge(sink.take(&params)?)?;
        Ok(StepOutput {
            loss: self.loss,
            grads,
            times: StepTimes::default(),
            peaks: StepPeaks::default(),
        })
    }
}

/// What a step returns: the loss over the whole batch and the accumulated parameter
/// gradients. The optimizer step is the caller's.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The loss over the whole batch.
    pub loss: f32,
    /// Parameter gradients, keyed by name.
    pub grads: Gradients,
    /// Wall time of each phase ([`GradCache::cache_step`] fills it; zero elsewhere).
    pub times: StepTimes,
    /// Peak heap bytes of each phase above the step's start ([`GradCache::cache_step`]
    /// fills it when the binary installs [`crate::memory::CountingAllocator`]; zero
    /// elsewhere).
    pub peaks: StepPeaks,
}

/// Wall time of the phases of one cached step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Phase 1: every chunk encoded without a graph.
    pub represent: Duration,
    /// Phase 2: the loss over all representations and its gradient (with the all-gather
    /// in a distributed step).
    pub loss: Duration,
    /// Phase 3: every chunk replayed from its cached gradient.
    pub replay: Duration,
    /// The gradient all-reduce across ranks (zero in one process).
    pub reduce: Duration,
}

/// Peak heap bytes of the phases of one cached step, each counted from the bytes allocated
/// when the step began (the weights, optimizer state and batch are below that line).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepPeaks {
    /// Phase 1: the representations of every chunk, plus one chunk's graph-free pass.
    pub represent: usize,
    /// Phase 2: the loss (its row blocks) and the cached gradients.
    pub loss: usize,
    /// Phase 3: one chunk's graph and the accumulated parameter gradients.
    pub replay: usize,
    /// The gradient all-reduce (its buckets).
    pub reduce: usize,
}

/// The gradient cache: one shared tower or two towers, a chunk size per side, a loss.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use gradcache::toy::{Mlp, MlpConfig};
/// use gradcache::{GradCache, InfoNce, ParamStore, Tower};
///
/// # fn main() -> gradcache::Result<()> {
/// let store = ParamStore::new(42, DType::F32, &Device::Cpu);
/// let cfg = MlpConfig { input: 16, hidden: 32, output: 8, dropout: 0.1 };
/// let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg, vb))?;
/// let gc = GradCache::shared(tower, 4, InfoNce::new(0.05)?)?;
///
/// let queries = Tensor::randn(0f32, 1., (10, 16), &Device::Cpu)?;
/// let passages = Tensor::randn(0f32, 1., (10, 16), &Device::Cpu)?;
/// let step = 0; // dropout masks derive from (seed, step, ...)
/// let out = gc.cache_step(step, &queries, &passages)?; // chunks of 4, one loss over all 10 pairs
/// assert!(out.loss.is_finite());
/// assert_eq!(out.grads.len(), store.params().len());
/// # Ok(()) }
/// ```
pub struct GradCache<Q: Encoder, P: Encoder = Q, L: Loss = InfoNce> {
    query: Arc<Q>,
    passage: Arc<P>,
    params: Params,
    query_chunking: Chunking,
    passage_chunking: Chunking,
    loss: L,
    seed: u64,
    dropout: bool,
    comm: Rc<dyn Collective>,
    bucket_bytes: usize,
    stop: StopSignal,
}

impl<E: Encoder, L: Loss> GradCache<E, E, L> {
    /// One encoder for queries and passages, chunks of `chunk` rows on both sides.
    pub fn shared(encoder: E, chunk: usize, loss: L) -> Result<Self> {
        let encoder = Arc::new(encoder);
        Self::new(Arc::clone(&encoder), encoder, chunk, chunk, loss)
    }
}

impl<Q: Encoder, P: Encoder, L: Loss> GradCache<Q, P, L> {
    /// A query tower and a passage tower, each with its own chunk size. The towers' parameter
    /// names must not collide unless they are the same variable.
    pub fn two_towers(
        query: Q,
        passage: P,
        query_chunk: usize,
        passage_chunk: usize,
        loss: L,
    ) -> Result<Self> {
        Self::new(
            Arc::new(query),
            Arc::new(passage),
            query_chunk,
            passage_chunk,
            loss,
        )
    }

    fn new(
        query: Arc<Q>,
        passage: Arc<P>,
        query_chunk: usize,
        passage_chunk: usize,
        loss: L,
    ) -> Result<Self> {
        nonzero_chunks(query_chunk, passage_chunk)?;
        let params = query
            .params()
            .union(passage.params())?
            .union(&loss.params())?;
        Ok(Self {
            query,
            passage,
            params,
            query_chunking: Chunking::Rows(query_chunk),
            passage_chunking: Chunking::Rows(passage_chunk),
            loss,
            seed: 0,
            dropout: true,
            comm: Rc::new(Single),
            bucket_bytes: dist::DEFAULT_BUCKET_BYTES,
            stop: StopSignal::new(),
        })
    }

    /// Sets different chunk sizes for the two sides (also for a shared tower).
    pub fn with_chunk_sizes(mut self, query_chunk: usize, passage_chunk: usize) -> Result<Self> {
        nonzero_chunks(query_chunk, passage_chunk)?;
        self.query_chunking = Chunking::Rows(query_chunk);
        self.passage_chunking = Chunking::Rows(passage_chunk);
        Ok(self)
    }

    /// Cuts each side's chunks by tokens instead of rows: consecutive rows while a chunk's
    /// rows times its longest text stay within `query_tokens` / `passage_tokens` (a longer
    /// text is a chunk alone). The inputs must be tokenized ([`Batch::token_lengths`]).
    pub fn with_chunk_tokens(mut self, query_tokens: usize, passage_tokens: usize) -> Result<Self> {
        nonzero_chunks(query_tokens, passage_tokens)?;
        self.query_chunking = Chunking::Tokens(query_tokens);
        self.passage_chunking = Chunking::Tokens(passage_tokens);
        Ok(self)
    }

    /// Sets how each side is cut into chunks (rows or tokens, each side its own).
    pub fn with_chunking(mut self, query: Chunking, passage: Chunking) -> Result<Self> {
        let size = |c: Chunking| match c {
            Chunking::Rows(n) | Chunking::Tokens(n) => n,
        };
        nonzero_chunks(size(query), size(passage))?;
        self.query_chunking = query;
        self.passage_chunking = passage;
        Ok(self)
    }

    /// How the query and the passage side are cut into chunks.
    pub fn chunking(&self) -> (Chunking, Chunking) {
        (self.query_chunking, self.passage_chunking)
    }

    /// Sets the run seed that dropout masks derive from (default 0).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Runs every step across the processes of `comm`: each rank passes its own share of
    /// the global batch to [`Self::cache_step`] (the same number of pairs on every rank),
    /// the representations are all-gathered, the loss is over the global batch, each rank
    /// replays its own chunks and the parameter gradients are summed across ranks once per
    /// step, so every rank gets the single-process gradient of the union batch. Dropout
    /// masks derive from the collective's rank.
    pub fn with_collective(mut self, comm: Rc<dyn Collective>) -> Self {
        self.comm = comm;
        self
    }

    /// Sets the size of one gradient all-reduce bucket in bytes (default 25 MiB).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// Abandons a step between chunks once `stop` is set ([`Error::Interrupted`]; see
    /// [`crate::stop`]). Unset, only [`Self::stop_signal`]'s own flag stops it.
    pub fn with_stop_signal(mut self, stop: StopSignal) -> Self {
        self.stop = stop;
        self
    }

    /// [`Self::with_stop_signal`] on a built cache.
    pub fn set_stop_signal(&mut self, stop: StopSignal) {
        self.stop = stop;
    }

    /// The flag that abandons a step between chunks.
    pub fn stop_signal(&self) -> &StopSignal {
        &self.stop
    }

    /// The collective the steps run across ([`Single`] unless set).
    pub fn collective(&self) -> &dyn Collective {
        &*self.comm
    }

    /// Turns dropout on (training, the default) or off.
    pub fn with_dropout(mut self, dropout: bool) -> Self {
        self.dropout = dropout;
        self
    }

    /// Every trainable parameter of both towers, sorted by name.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The buffers of both towers (BatchNorm running statistics), sorted by name.
    pub fn buffers(&self) -> Result<Params> {
        self.query.buffers().union(&self.passage.buffers())
    }

    /// Everything a training checkpoint must hold to resume exactly: the parameters and
    /// the buffers.
    pub fn state(&self) -> Result<Params> {
        self.params.union(&self.buffers()?)
    }

    /// The query encoder.
    pub fn query_encoder(&self) -> &Q {
        &self.query
    }

    /// The passage encoder (the same as the query encoder for a shared tower).
    pub fn passage_encoder(&self) -> &P {
        &self.passage
    }

    /// The loss.
    pub fn loss(&self) -> &L {
        &self.loss
    }

    /// The forward context of chunk `chunk` of `side` at `step`.
    pub fn ctx(&self, step: u64, side: Side, chunk: usize) -> Ctx {
        if !self.dropout {
            return Ctx::train_without_dropout();
        }
        Ctx::train(ChunkSeed {
            run: self.seed,
            step,
            rank: self.comm.rank() as u32,
            tower: side.index(),
            chunk: chunk as u32,
        })
    }

    /// One gradient-cache step over the whole batch. `step` is the caller's update count
    /// (0-based): with the run seed it names the dropout masks, so a resumed run passes the
    /// step it resumes at. Returns the loss and the gradients; does not touch the weights.
    ///
    /// In a distributed run (see [`Self::with_collective`]) `queries` and `passages` are
    /// this rank's share; the loss is the global batch's and the gradients are already
    /// summed across ranks. A failure on any rank fails the step on every rank with
    /// [`Error::RankFailed`].
    pub fn cache_step(
        &self,
        step: u64,
        queries: &Q::Input,
        passages: &P::Input,
    ) -> Result<StepOutput> {
        self.cache_step_scaled(step, queries, passages, 1.0)
    }

    /// [`Self::cache_step`] with the loss multiplied by `loss_scale` where its gradient
    /// enters the replay (the cached representation gradients), for f16 training with a
    /// [`LossScaler`](crate::precision::LossScaler): the returned gradients are
    /// `loss_scale` times the true ones (unscale them before clipping); the returned loss is
    /// not scaled.
    pub fn cache_step_scaled(
        &self,
        step: u64,
        queries: &Q::Input,
        passages: &P::Input,
        loss_scale: f64,
    ) -> Result<StepOutput> {
        // The weights do not change inside a step, and every chunk's forward (the
        // representation pass and the replay's) multiplies by each projection weight
        // transposed: the CPU layer nodes read copies transposed in panels, made once per
        // step ([`crate::nn::TransposedWeights`], at most its budget in bytes; the same
        // bits), instead of packing the weight in every product. Dropped before the step
        // returns, so the optimizer's phase (two moments per parameter) stays the peak.
        crate::nn::TransposedWeights::new()
            .run(|| self.cache_step_inner(step, queries, passages, loss_scale))
    }

    fn cache_step_inner(
        &self,
        step: u64,
        queries: &Q::Input,
        passages: &P::Input,
        loss_scale: f64,
    ) -> Result<StepOutput> {
        let _flush = crate::denormal::flush();
        let comm = &*self.comm;
        let mut meter = PhaseMeter::start();
        let phase = crate::profile::phase;
        let reps = {
            let _p = phase("step.1 represent");
            dist::agree(comm, self.represent(step, queries, passages))?
        };
        let represent = meter.lap();
        let cache = {
            let _p = phase("step.2 loss");
            let mut cache = reps.into_cache_across(&self.loss, comm)?;
            if loss_scale != 1.0 {
                cache.scale(loss_scale)?;
            }
            cache
        };
        let loss = meter.lap();
        let out = {
            let _p = phase("step.3 replay");
            dist::agree(comm, cache.replay())?
        };
        let replay = meter.lap();
        let grads = {
            let _p = phase("step.4 reduce");
            dist::reduce_gradients(comm, &self.params, out.grads, self.bucket_bytes)?
        };
        let reduce = meter.lap();
        Ok(StepOutput {
            loss: out.loss,
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

    /// Phase 1 of a step: checks the batch, then encodes every chunk without a graph.
    pub fn represent(
        &self,
        step: u64,
        queries: &Q::Input,
        passages: &P::Input,
    ) -> Result<Representations<'_>> {
        group_size(queries.rows(), passages.rows())?;
        let _flush = crate::denormal::flush();
        let mut reps = Representations::new();
        reps.stop = Some(self.stop.clone());
        reps.fault = crate::fault::fault_point(self.collective().rank(), step);
        let parts = queries
            .chunked(self.query_chunking)?
            .ok_or(Error::TokensToCount { side: Side::Query })?;
        for (i, chunk) in parts.into_iter().enumerate() {
            self.stop.check()?;
            reps.push(
                &*self.query,
                Side::Query,
                chunk,
                self.ctx(step, Side::Query, i),
            )?;
        }
        let parts = passages
            .chunked(self.passage_chunking)?
            .ok_or(Error::TokensToCount {
                side: Side::Passage,
            })?;
        for (i, chunk) in parts.into_iter().enumerate() {
            self.stop.check()?;
            let ctx = self.ctx(step, Side::Passage, i);
            reps.push(&*self.passage, Side::Passage, chunk, ctx)?;
        }
        Ok(reps)
    }

    /// A plain step for reference: one forward with a graph over the whole batch per side,
    /// the loss, one backward. Memory grows with the batch; the gradients are what
    /// [`Self::cache_step`] must reproduce. Dropout uses the masks of chunk 0 at `step`.
    pub fn full_batch_step(
        &self,
        step: u64,
        queries: &Q::Input,
        passages: &P::Input,
    ) -> Result<StepOutput> {
        group_size(queries.rows(), passages.rows())?;
        let _flush = crate::denormal::flush();
        let ctx = |side| self.ctx(step, side, 0).updating_stats();
        let q = self.query.forward(queries, &ctx(Side::Query))?;
        let p = self.passage.forward(passages, &ctx(Side::Passage))?;
        let loss = self.loss.forward(&q, &p)?;
        let value = scalar(&loss)?;
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss { value });
        }
        let store = loss.backward()?;
        Ok(StepOutput {
            loss: value,
            grads: self.params.grads_from(&store),
            times: StepTimes::default(),
            peaks: StepPeaks::default(),
        })
    }
}

/// Refuses a chunk of zero rows or tokens on either side.
fn nonzero_chunks(query: usize, passage: usize) -> Result<()> {
    for (side, chunk) in [(Side::Query, query), (Side::Passage, passage)] {
        if chunk == 0 {
            return Err(Error::ZeroChunkSize { side });
        }
    }
    Ok(())
}
