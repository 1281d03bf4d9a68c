//! Text-pair training behind `gradcache train`: the [`TextPairs`] task (data, tokenizers,
//! BERT towers, InfoNCE, retrieval evaluation on held-out pairs) that [`Trainer`] runs
//! through the one training loop ([`Run`]); and [`export_run`], which turns a finished
//! run into a model directory.
//!
//! The library side of the trainer prints nothing: progress goes to an [`Observer`] (the
//! binary draws the progress bar, writes the metrics file and the loss curve). It writes
//! only the run's own files under `output_dir` (the tokenizer, the model config and the
//! checkpoints), and only after every input has been read and checked, so a run that
//! fails at set-up (bad data, a corrupt or mismatched checkpoint) leaves the directory as
//! it was.
//!
//! Resume is exact (see [`Run`]): the data loader's position is part of the checkpoint.
//! Matrix products split their work by thread count, so another thread count may change
//! the last bits.

use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Device};

use crate::batch::{Batch, Chunking, TokenBatch};
use crate::cache::GradCache;
use crate::dist::{self, Backend, Collective};
use crate::hub::export::ExportNotes;
use crate::hub::multi_vector::MultiVectorHead;
use crate::hub::{export_bert, Prompts, Tokenizer};
use crate::hub::{EmbeddingModel, LoadOptions};
use crate::loss::Guide;
use crate::loss::{TeacherScores, WeightScale};
use crate::models::bert::{BertConfig, BertOptions};
use crate::precision::Precision;
use crate::train::budget::plan_memory;
use crate::train::config::Config;
use crate::train::config::SpladeConfig;
use crate::train::data::{Position, TextBatch};
use crate::train::formats::Layout;
use crate::train::metrics::RetrievalMetrics;
use crate::train::mixture::Mixture;
use crate::train::model::{build_model, Model};
use crate::train::run::{LoopConfig, Run, Task, TaskCache};
pub use crate::train::run_export::{export_run, export_run_as, ExportLayout};
use crate::train::run_export::{write_run_files, RunHead, MAY_CHANGE};
use crate::train::sources::Source;
use crate::train::text_data::{load_data, Evaluation, RunData};
use crate::train::text_loss::{set_teacher_scores, ActiveSource, TextLoss};
use crate::train::text_towers::PairTower;

mod eval;
use crate::{Error, Result, Side};

pub use super::model::{
    DENSE_FILE, HEAD_FILE, MODEL_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
pub use super::report::{Event, LossScaling, Observer, PhasePeaks, PhaseTimes, Quiet, StepReport};

/// A text-pair training run: [`TextPairs`] through the one loop.
pub type Trainer = Run<TextPairs>;

/// Text pairs (query, positive, hard negatives) with BERT towers and InfoNCE: the task of
/// `gradcache train` with a text-pair config.
pub struct TextPairs {
    cfg: Config,
    device: Device,
    bert: BertConfig,
    options: BertOptions,
    tokenizer: tokenizers::Tokenizer,
    /// The pretrained model's tokenizer config (written into the run directory).
    tokenizer_config: Option<serde_json::Map<String, serde_json::Value>>,
    prompts: Prompts,
    /// Whether the prompts' tokens are pooled.
    prompt_pooled: bool,
    query_tokenizer: Tokenizer,
    passage_tokenizer: Tokenizer,
    /// The tokenizer an export writes: the model's own limit, not a side's training one.
    export_tokenizer: Tokenizer,
    /// The training batches over the run's sources.
    mixture: Mixture,
    /// Each source's query and passage tokenizers (its prompts over the model's); under
    /// `data.batches = "mixed"` one pair, each row's prompt carried by the batch.
    source_tokenizers: Vec<(Tokenizer, Tokenizer)>,
    /// What the run evaluates on.
    evals: Vec<Evaluation>,
    /// The last evaluation's metrics of each named set (`[[data.evals]]`).
    eval_sets: std::cell::RefCell<Vec<(String, RetrievalMetrics)>>,
    /// With `train.memory_budget`: the predicted heap peak of a step (bytes).
    predicted_peak: Option<u64>,
    /// With `loss.false_negative_guide`: the frozen guide model and the cell the loss
    /// reads its embeddings of each batch from.
    guide: Option<(EmbeddingModel, Guide)>,
    /// With `loss.distillation`: the cell the loss reads each batch's teacher scores from.
    teacher: Option<TeacherScores>,
    /// The source of the batch being trained on, which picks its loss.
    active_source: ActiveSource,
    /// A multi-vector (ColBERT) run's settings.
    multi_vector: Option<MultiVectorHead>,
    /// A sparse run's handle on its regularisers' weights and their warm-up.
    splade: Option<(WeightScale, SpladeConfig)>,
    /// An inference-free run: queries are the static weights on their tokens.
    static_queries: bool,
}

impl Task for TextPairs {
    type Query = PairTower;
    type Passage = PairTower;
    type Loss = TextLoss;
    type Batch = TextBatch;
    type Config = Config;

    fn config(&self) -> &Config {
        &self.cfg
    }

    /// An inference-free run's static query weights at `model.sparse.query_lr`.
    fn lr_scales(&self, lr: f64) -> Vec<(String, f64)> {
        let query_lr = self.cfg.model.sparse.as_ref().and_then(|s| s.query_lr);
        match query_lr {
            Some(q) if self.static_queries && lr > 0.0 => {
                vec![(crate::sparse_static::static_weight_name(), q / lr)]
            }
            _ => Vec::new(),
        }
    }

    fn next_batch(&mut self, step: u64) -> Result<TextBatch> {
        // A sparse run's FLOPS weights at this step of their warm-up (a function of the
        // step alone, so a resumed run continues it exactly).
        if let Some((scale, splade)) = &self.splade {
            scale.set(splade.weight_scale(step, self.cfg.train.steps));
        }
        self.mixture.next_batch(step)
    }

    fn batch_source(&self, batch: &TextBatch) -> Option<String> {
        if self.mixture.sources().len() > 1 && !self.mixture.is_mixed() {
            Some(self.mixture.sources()[batch.source].source.name.clone())
        } else {
            None
        }
    }

    fn batch_rows(&self, batch: &TextBatch) -> usize {
        batch.queries.len()
    }

    fn filled_negatives(&self, batch: &TextBatch) -> usize {
        batch.filled
    }

    /// `lines 3, 17, 52 of train.jsonl` (rows of a Parquet file, pairs of a BEIR split).
    fn chunk_settings(&self) -> (String, String) {
        let t = &self.cfg.train;
        match t.chunk_tokens {
            Some(tokens) => (
                format!("chunks of up to {tokens} padded tokens"),
                "train.chunk_tokens".into(),
            ),
            None => (
                format!(
                    "chunks of {} queries and {} passages",
                    t.query_chunk, t.passage_chunk
                ),
                "train.query_chunk and train.passage_chunk".into(),
            ),
        }
    }

    fn describe_batch(&self, batch: &TextBatch) -> String {
        let source = &self.mixture.sources()[batch.source];
        let unit = crate::train::formats::origin_unit(Layout::of(&source.files[0]));
        let mut lines = batch.lines.clone();
        lines.sort_unstable();
        format!(
            "{} {} of {}",
            unit,
            list_numbers(&lines, 64),
            self.mixture.describe_source(batch.source)
        )
    }

    /// This rank's share, tokenized and put in length order.
    fn inputs(&self, batch: &TextBatch, comm: &dyn Collective) -> Result<(TokenBatch, TokenBatch)> {
        let (queries, passages) = self.share(batch, comm)?;
        let (query_tokenizer, passage_tokenizer) = &self.source_tokenizers[batch.source];
        let rows = queries.len();
        let first = comm.rank() * rows;
        let prompts = batch.prompts.get(first..first + rows).unwrap_or(&[]);
        let q = if prompts.iter().any(Option::is_some) {
            let prompts: Vec<Option<&str>> = prompts.iter().map(Option::as_deref).collect();
            query_tokenizer.encode_prompted(&queries, &prompts, &self.device)?
        } else {
            query_tokenizer.encode(&queries, &self.device)?
        };
        let p = passage_tokenizer.encode(&passages, &self.device)?;
        // The loss of the batch's source (its own settings, or distillation on or off).
        self.active_source.set(batch.source);
        let (q, p, order) = in_length_order(&q, &p)?;
        let distilled = self.mixture.sources()[batch.source].source.distill;
        if let (Some(cell), true) = (&self.teacher, distilled) {
            set_teacher_scores(cell, batch, first, &order, comm, &self.device)?;
        }
        if let Some((guide, cell)) = &self.guide {
            // The guide's embeddings of the global batch, in the order the loss sees the
            // representations: this rank's rows in length order, ranks in rank order.
            let group = passages.len() / queries.len().max(1);
            let sorted_q: Vec<&str> = order.iter().map(|&i| queries[i]).collect();
            let sorted_p: Vec<&str> = order
                .iter()
                .flat_map(|&i| (0..group).map(move |j| i * group + j))
                .map(|j| passages[j])
                .collect();
            let t = &self.cfg.train;
            let mut gq = guide.embed_queries(&sorted_q, t.query_chunk)?;
            let mut gp = guide.embed_passages(&sorted_p, t.passage_chunk)?;
            if comm.world_size() > 1 {
                gq = comm.all_gather(&gq)?;
                gp = comm.all_gather(&gp)?;
            }
            cell.set(&gq, &gp)?;
        }
        Ok((q, p))
    }

    fn step_flops(&self, queries: &TokenBatch, passages: &TokenBatch) -> Result<f64> {
        // Graph-free forward, replay forward, backward (two forwards' worth); a recompute
        // policy adds the graph-free forward of the replay's segments.
        // Selective recompute alone re-runs no matrix product but the attention scores
        // (not counted as a pass).
        let layers = self.bert.num_hidden_layers;
        let segmented = self.cfg.model.recompute.segments(layers)?.is_some();
        let passes = if segmented { 5.0 } else { 4.0 };
        let t = &self.cfg.train;
        // On the CPU in f32 the layers run on the real tokens only (packed, no padding);
        // elsewhere on every chunk at its padded length.
        let packed = self.device.is_cpu() && self.cfg.precision == Precision::F32;
        let mut forward = 0.0;
        for (batch, chunk) in [(queries, t.query_chunk), (passages, t.passage_chunk)] {
            // Static query weights run no product.
            if self.static_queries && std::ptr::eq(batch, queries) {
                continue;
            }
            let chunking = t
                .chunk_tokens
                .map_or(Chunking::Rows(chunk), Chunking::Tokens);
            if packed {
                let lengths = batch
                    .attention_mask
                    .to_dtype(DType::U32)?
                    .sum(1)?
                    .to_vec1::<u32>()?;
                for len in lengths {
                    forward += self.bert.forward_flops(1, len as usize);
                }
            } else {
                for piece in batch.chunked(chunking)?.unwrap_or_default() {
                    forward += self.bert.forward_flops(piece.rows(), piece.seq_len());
                }
            }
        }
        Ok(forward * passes)
    }

    fn position(&self, _step: u64) -> Position {
        self.mixture.position()
    }

    fn seek(&mut self, position: Position, step: u64) -> Result<()> {
        self.mixture.seek(position, step)
    }

    fn eval_note(&self, _gc: &TaskCache<Self>) -> Result<Option<String>> {
        Ok(self.served_note())
    }

    fn finish(&self, _gc: &TaskCache<Self>, _step: u64) -> Result<Option<String>> {
        Ok(self.served_note())
    }

    fn best_score(
        &self,
        metrics: &RetrievalMetrics,
        sets: &[(String, RetrievalMetrics)],
    ) -> Option<(String, f64)> {
        let by = self.cfg.train.best_by.as_ref()?;
        let m = match by.as_str() {
            "mean" => metrics,
            name => &sets.iter().find(|(n, _)| n == name)?.1,
        };
        Some((by.clone(), m.ndcg_at_10))
    }

    fn take_eval_sets(&self) -> Vec<(String, RetrievalMetrics)> {
        std::mem::take(&mut *self.eval_sets.borrow_mut())
    }

    /// Every evaluation set (each as `trainer/eval.rs` evaluates one); with several, the mean of
    /// their metrics, each set's kept for [`Task::take_eval_sets`].
    fn evaluate(&self, gc: &TaskCache<Self>) -> Result<RetrievalMetrics> {
        let mut sets = Vec::with_capacity(self.evals.len());
        for e in &self.evals {
            sets.push(self.evaluate_set(gc, e)?);
        }
        let named: Vec<(String, RetrievalMetrics)> = self
            .evals
            .iter()
            .zip(&sets)
            .filter_map(|(e, m)| e.name.clone().map(|n| (n, *m)))
            .collect();
        let mean = RetrievalMetrics::mean(&sets).ok_or(Error::EmptyBatch { side: Side::Query })?;
        *self.eval_sets.borrow_mut() = named;
        Ok(mean)
    }
}

impl TextPairs {
    /// Steps and pairs each source has served since step 0.
    fn served(&self) -> Vec<(String, crate::train::Served)> {
        self.mixture
            .sources()
            .iter()
            .zip(self.mixture.served())
            .map(|(s, n)| (s.source.name.clone(), *n))
            .collect()
    }

    /// `steps per source: web 12 (768 pairs), nli 4 (256 pairs)` for a mixture.
    fn served_note(&self) -> Option<String> {
        if self.mixture.sources().len() < 2 || self.mixture.is_mixed() {
            return None;
        }
        let parts: Vec<String> = self
            .served()
            .iter()
            .map(|(name, n)| format!("{name} {} ({} pairs)", n.steps, n.pairs))
            .collect();
        Some(format!("steps per source: {}", parts.join(", ")))
    }

    /// This rank's queries and passages of a global batch: an equal, contiguous share
    /// (passages keep their per-query groups).
    fn share<'b>(
        &self,
        batch: &'b TextBatch,
        comm: &dyn Collective,
    ) -> Result<(Vec<&'b str>, Vec<&'b str>)> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let rows = batch.queries.len() / world;
        let group = batch.passages.len() / batch.queries.len().max(1);
        if rows * world != batch.queries.len()
            || group * batch.queries.len() != batch.passages.len()
        {
            return Err(Error::Data {
                path: self.mixture.sources()[batch.source].files[0].clone(),
                line: 0,
                reason: format!(
                    "a batch of {} queries and {} passages does not split over {world} ranks",
                    batch.queries.len(),
                    batch.passages.len()
                ),
            });
        }
        let q = &batch.queries[rank * rows..(rank + 1) * rows];
        let p = &batch.passages[rank * rows * group..(rank + 1) * rows * group];
        Ok((to_refs(q), to_refs(p)))
    }
}

impl Run<TextPairs> {
    /// Sets up a run from its configuration; with `resume`, continues from a checkpoint
    /// (a `step-N` directory, or a checkpoints root: then the newest). Starts the
    /// distributed backend `dist.backend` (at most once per process).
    pub fn new(cfg: Config, resume: Option<&Path>) -> Result<Self> {
        cfg.validate()?;
        let comm = dist::init(cfg.dist.backend)?;
        Self::with_collective(cfg, resume, comm)
    }

    /// Sets up a run over the processes of `comm`. Every rank reads the same data and
    /// builds the same global batches; rank `r` of `N` encodes pairs `r*B/N..(r+1)*B/N` of
    /// each. Only rank 0 writes files (tokenizer, model config, checkpoints); every
    /// rank reads the checkpoint on resume. Ranks must run the same configuration (data
    /// paths may differ if the data is the same): this is checked, as are identical
    /// starting weights.
    pub fn with_collective(
        cfg: Config,
        resume: Option<&Path>,
        comm: Rc<dyn Collective>,
    ) -> Result<Self> {
        Self::with_options(cfg, resume, false, comm)
    }

    /// [`Self::with_collective`]; with `extend`, the checkpoint of `resume` may have been
    /// written for fewer `train.steps` (nothing else different): the run continues from it
    /// to this configuration's length, the learning rate following this configuration's
    /// schedule from that step on (`gradcache train --resume DIR --extend`).
    pub fn with_options(
        cfg: Config,
        resume: Option<&Path>,
        extend: bool,
        comm: Rc<dyn Collective>,
    ) -> Result<Self> {
        cfg.validate()?;
        check_batch_splits(&cfg, &*comm)?;
        if comm.world_size() > 1 {
            dist::watchdog::set_timeout(
                comm.rank(),
                std::time::Duration::from_secs(cfg.dist.timeout_s),
            );
        }
        // The configuration as written: the chunk sizes and policy a memory budget picks
        // below depend on a measurement, not on what is trained.
        let fingerprint = cfg.fingerprint()?;
        let length_free = cfg.length_free_fingerprint()?;
        let mut notes = Vec::new();
        let data = load_data(&cfg, &*comm, &mut notes)?;
        let device = dist::agree(&*comm, run_device(&cfg, &*comm))?;
        if cfg.precision != Precision::F32 || !device.is_cpu() {
            notes.push(format!(
                "device {}, precision {}{}",
                crate::device::describe(&device),
                cfg.precision,
                if cfg.precision.needs_loss_scaling() {
                    format!(" (dynamic loss scale from {})", cfg.loss_scale.init)
                } else {
                    String::new()
                }
            ));
        }
        let mut model = build_model(&cfg, &data.texts, &*comm, &device)?;
        let mut cfg = cfg;
        let mut predicted_peak = None;
        if let Some(budget) = cfg.train.memory_budget.clone() {
            let world = comm.world_size();
            let plan = plan_memory(&cfg, &mut model, &data.texts, &device, world, &budget)?;
            cfg.model.recompute = plan.policy.clone();
            cfg.train.query_chunk = plan.query_chunk;
            cfg.train.passage_chunk = plan.passage_chunk;
            predicted_peak = Some(plan.predicted);
            notes.push(plan.note);
        }
        let mut trainer = Self::assemble(cfg, data, model, comm, notes, device, fingerprint)?;
        trainer.task.predicted_peak = predicted_peak;
        trainer.length_free_fingerprint = Some(length_free);
        trainer.extend = extend;
        if let Some(path) = resume {
            trainer.restore(path)?;
        }
        trainer.lock_output_dir()?;
        trainer.write_run_files()?;
        trainer.check_identical_start()?;
        Ok(trainer)
    }

    /// Tokenizers, loss, gradient cache, optimiser and schedule around a built model;
    /// `fingerprint` is what its checkpoints record.
    fn assemble(
        cfg: Config,
        data: RunData,
        model: Model,
        comm: Rc<dyn Collective>,
        notes: Vec<String>,
        device: Device,
        fingerprint: String,
    ) -> Result<Self> {
        let m = &cfg.model;
        let static_queries = model.static_query.is_some();
        let (query_tokenizer, passage_tokenizer) = match &model.multi_vector {
            Some(head) => {
                let (q, p) = head.tokenizers(&model.tokenizer, &cfg.output_dir)?;
                (
                    q.with_config(model.tokenizer_config.clone()),
                    p.with_config(model.tokenizer_config.clone()),
                )
            }
            // An inference-free model's queries are tokenized without special tokens, as
            // sentence-transformers' SparseStaticEmbedding does.
            None if static_queries => (
                Tokenizer::new(model.tokenizer.clone(), model.query_max_len)?
                    .without_special_tokens()
                    .with_prompt(&model.prompts.query)
                    .with_config(model.tokenizer_config.clone()),
                Tokenizer::new(model.tokenizer.clone(), model.passage_max_len)?
                    .with_prompt(&model.prompts.passage)
                    .with_prompt_pooled(model.prompt_pooled)
                    .with_config(model.tokenizer_config.clone()),
            ),
            None => (
                Tokenizer::new(model.tokenizer.clone(), model.query_max_len)?
                    .with_prompt(&model.prompts.query)
                    .with_prompt_pooled(model.prompt_pooled)
                    .with_config(model.tokenizer_config.clone())
                    .with_task(model.tasks.as_ref().and_then(|t| t.query)),
                Tokenizer::new(model.tokenizer.clone(), model.passage_max_len)?
                    .with_prompt(&model.prompts.passage)
                    .with_prompt_pooled(model.prompt_pooled)
                    .with_config(model.tokenizer_config.clone())
                    .with_task(model.tasks.as_ref().and_then(|t| t.passage)),
            ),
        };
        let export_tokenizer = Tokenizer::new(model.tokenizer.clone(), model.limit)?
            .with_config(model.tokenizer_config.clone());
        let guide = match &cfg.loss.false_negative_guide {
            None => None,
            Some(name) => {
                let options = LoadOptions {
                    max_len: Some(model.query_max_len.max(model.passage_max_len)),
                    device: device.clone(),
                    ..LoadOptions::default()
                };
                Some((EmbeddingModel::load(name, &options)?, Guide::new()))
            }
        };
        let cell = guide.as_ref().map(|(_, cell)| cell.clone());
        let sources: Vec<&Source> = data.mixture.sources().iter().map(|s| &s.source).collect();
        let (loss, active_source) = TextLoss::for_sources(
            &cfg,
            &sources,
            model.multi_vector.as_ref(),
            cell,
            static_queries,
        )?;
        let source_tokenizers = data
            .mixture
            .sources()
            .iter()
            .map(|s| {
                let q = match &s.source.query_prompt {
                    Some(prompt) if !data.mixture.is_mixed() => {
                        query_tokenizer.clone().with_prompt(prompt)
                    }
                    _ => query_tokenizer.clone(),
                };
                let p = match &s.source.passage_prompt {
                    Some(prompt) => passage_tokenizer.clone().with_prompt(prompt),
                    None => passage_tokenizer.clone(),
                };
                (q, p)
            })
            .take(if data.mixture.is_mixed() {
                1
            } else {
                usize::MAX
            })
            .collect();
        let width = model
            .options
            .dense
            .last()
            .map_or(model.bert.hidden_size, |d| d.out_features);
        if cfg.loss.matryoshka_dims.iter().any(|&d| d > width) {
            return Err(Error::InvalidConfig {
                field: "loss.matryoshka_dims",
                value: format!("{:?} (embedding width {width})", cfg.loss.matryoshka_dims),
                reason: "every width must fit the embedding",
            });
        }
        let (qc, pc) = (cfg.train.query_chunk, cfg.train.passage_chunk);
        let tower = |e| PairTower::Bert(Box::new(e));
        let gc = match (model.static_query, model.passage) {
            (None, None) => {
                GradCache::shared(tower(model.query), qc, loss)?.with_chunk_sizes(qc, pc)?
            }
            (None, Some(passage)) => {
                GradCache::two_towers(tower(model.query), tower(passage), qc, pc, loss)?
            }
            // Inference-free: the static weights for queries, the model for documents.
            (Some(queries), _) => GradCache::two_towers(
                PairTower::Static(Box::new(queries)),
                tower(model.query),
                qc,
                pc,
                loss,
            )?,
        };
        let gc = match cfg.train.chunk_tokens {
            Some(tokens) => gc.with_chunk_tokens(tokens, tokens)?,
            None => gc,
        }
        .with_seed(cfg.seed)
        .with_dropout(m.dropout)
        .with_collective(Rc::clone(&comm))
        .with_bucket_bytes(cfg.dist.bucket_mib << 20);
        let t = &cfg.train;
        let settings = LoopConfig {
            output_dir: cfg.output_dir.clone(),
            steps: t.steps,
            eval_every: t.eval_every,
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            optim: cfg.optim.clone(),
            check_weights_every: cfg.dist.check_weights_every,
            loss_scaler: cfg
                .precision
                .needs_loss_scaling()
                .then(|| cfg.loss_scale.scaler()),
            fingerprint,
            may_change: MAY_CHANGE,
            on_nonfinite: t.on_nonfinite,
        };
        let task = TextPairs {
            device: device.clone(),
            options: model.options,
            bert: model.bert,
            tokenizer: model.tokenizer,
            tokenizer_config: model.tokenizer_config,
            prompts: model.prompts,
            prompt_pooled: model.prompt_pooled,
            query_tokenizer,
            passage_tokenizer,
            export_tokenizer,
            source_tokenizers,
            mixture: data.mixture,
            evals: data.evals,
            eval_sets: Default::default(),
            active_source,
            predicted_peak: None,
            guide,
            teacher: gc.loss().teacher().cloned(),
            splade: gc.loss().splade(&cfg),
            static_queries,
            multi_vector: model.multi_vector,
            cfg,
        };
        Run::from_parts(task, gc, model.store, device, comm, settings, notes)
    }

    /// Rank 0 writes the run's tokenizer and model config into `output_dir`, so that the
    /// run directory alone is enough to resume or export it.
    fn write_run_files(&self) -> Result<()> {
        let written = if self.rank() == 0 {
            let t = &self.task;
            let head = RunHead {
                pooling: t.options.pooling,
                normalize: t.options.normalize,
                prompts: t.prompts.clone(),
                include_prompt: t.prompt_pooled,
            };
            write_run_files(
                &t.cfg.output_dir,
                (&t.tokenizer, t.tokenizer_config.as_ref()),
                (&t.bert, &head),
                &t.options.dense,
            )
        } else {
            Ok(())
        };
        dist::agree(&*self.comm, written)
    }

    /// Every rank must start from bit-identical weights.
    fn check_identical_start(&mut self) -> Result<()> {
        let world = self.world_size();
        if world > 1 {
            let sum = dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
            self.notes.push(format!(
                "all {world} ranks start from identical weights (checksum {sum:016x})"
            ));
        }
        Ok(())
    }

    /// Steps and pairs each source has served since step 0 (a mixture's).
    pub fn served(&self) -> Vec<(String, crate::train::Served)> {
        self.task.served()
    }

    /// With `train.memory_budget`: the heap peak a step was predicted to reach, in bytes
    /// (what the chosen chunk sizes and recompute policy were fitted to).
    pub fn predicted_peak(&self) -> Option<u64> {
        self.task.predicted_peak
    }

    /// Exports the tower of `side` (the shared tower for either side) as a Hugging Face +
    /// sentence-transformers directory.
    pub fn export(&self, dir: &Path, side: Side) -> Result<()> {
        let t = &self.task;
        let tokenizer = &t.export_tokenizer;
        let (encoder, prefix) = match (side, t.cfg.model.shared) {
            // An inference-free model's one encoder is its passage tower.
            _ if t.static_queries => (self.gc.passage_encoder(), ""),
            (_, true) => (self.gc.query_encoder(), ""),
            (Side::Query, false) => (self.gc.query_encoder(), "query"),
            (Side::Passage, false) => (self.gc.passage_encoder(), "passage"),
        };
        let static_query = match self.gc.query_encoder() {
            PairTower::Static(q) => {
                let name = crate::sparse_static::static_weight_name();
                let weight = (q.params().get(&name))
                    .or_else(|| q.frozen().get(&name))
                    .map(|v| v.as_tensor().clone());
                weight.map(|w| (w, q.frozen().get(&name).is_some()))
            }
            PairTower::Bert(_) => None,
        };
        let encoder = encoder.bert().ok_or_else(|| Error::InvalidArgument {
            what: "export side",
            value: format!("{side:?}"),
            reason: "names no encoder of the run",
        })?;
        export_bert(
            dir,
            &t.bert,
            &t.options,
            t.cfg.similarity(),
            &encoder.weights()?,
            prefix,
            tokenizer,
            &ExportNotes {
                prompts: t.prompts.clone(),
                matryoshka_dims: t.cfg.loss.matryoshka_dims.clone(),
                prompt_left_out: !t.prompt_pooled,
                adapter_of: None,
                multi_vector: t.multi_vector.clone(),
                static_query,
                merge_task: None,
            },
        )
    }
}

/// The device this rank trains on: with NCCL its local GPU, else `device` (the CPU unset).
fn run_device(cfg: &Config, comm: &dyn Collective) -> Result<Device> {
    let device = if cfg.dist.backend == Backend::Nccl {
        comm.device()
    } else {
        cfg.device.unwrap_or_default().open()?
    };
    crate::device::check_precision(&device, cfg.precision)?;
    Ok(device)
}

/// The global batch must split evenly over the ranks.
fn check_batch_splits(cfg: &Config, comm: &dyn Collective) -> Result<()> {
    if !cfg.train.batch_size.is_multiple_of(comm.world_size()) {
        return Err(Error::InvalidConfig {
            field: "train.batch_size",
            value: cfg.train.batch_size.to_string(),
            reason: "the global batch must split evenly over the ranks (a multiple of the \
                     world size)",
        });
    }
    Ok(())
}

/// The pairs of a batch reordered by length (query plus its longest passage), so that each
/// chunk is padded only to the longest of pairs of similar length. The loss is a sum over
/// pairs, so the order changes nothing but the padding the chunks compute on (and which
/// chunk, hence which dropout masks, a pair falls in; still a pure function of the seed).
fn in_length_order(q: &TokenBatch, p: &TokenBatch) -> Result<(TokenBatch, TokenBatch, Vec<usize>)> {
    let rows = q.rows();
    let group = p.rows() / rows.max(1);
    let lengths = |b: &TokenBatch| -> Result<Vec<u32>> {
        let rows = b.mask_rows()?;
        Ok(rows.iter().map(|r| r.iter().sum()).collect())
    };
    let (ql, pl) = (lengths(q)?, lengths(p)?);
    let key = |i: usize| ql[i] + (0..group).map(|j| pl[i * group + j]).max().unwrap_or(0);
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by_key(|&i| key(i));
    let q_rows: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    let p_rows: Vec<u32> = order
        .iter()
        .flat_map(|&i| (0..group).map(move |j| (i * group + j) as u32))
        .collect();
    Ok((q.select_rows(&q_rows)?, p.select_rows(&p_rows)?, order))
}

/// `3, 17, 52`, the first `at_most` of `numbers` and how many more.
fn list_numbers(numbers: &[usize], at_most: usize) -> String {
    let shown: Vec<String> = numbers.iter().take(at_most).map(usize::to_string).collect();
    let mut text = shown.join(", ");
    if numbers.len() > at_most {
        text += &format!(" and {} more", numbers.len() - at_most);
    }
    text
}

fn to_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
