//! Reranker (cross-encoder) training behind `gradcache train` with `[model.reranker]`: the
//! [`Rerank`] task through the one training loop ([`Run`]).
//!
//! The data are the text-pair runs' own (every layout, sources and mixtures, hard
//! negatives, teacher `scores`, the same seeded order and exact resume). Each query's
//! group is its positive, its `train.hard_negatives` hard negatives and
//! `loss.reranker.num_negatives` documents of other rows of the global batch (drawn from
//! the seed, the step and the row, so a resumed run draws the same); every (query,
//! document) pair is one row of the cache's query side ([`crate::rerank::cache`]). The
//! labels are what the loss reads: none for the ranking loss, 1 for the positive and 0
//! for the negatives for binary cross-entropy, the rows' `scores` (a teacher's, or graded
//! relevance) for the others.
//!
//! Evaluation reranks a first-stage run (`data.eval_run_file`) on a BEIR folder
//! (`data.eval_file`, its `eval_split`): the reranked run's trec_eval measures are the
//! run's metrics, and the log gives the first stage's and the reranked run's
//! `CrossEncoderRerankingEvaluator` measures. The trained model is written to
//! `output_dir/model` in sentence-transformers' `CrossEncoder` layout at the end.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;

use crate::batch::{Chunking, TokenBatch};
use crate::cache::GradCache;
use crate::dist::Collective;
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::hub::Tokenizer;
use crate::models::bert::{BertConfig, BertEncoder};
use crate::models::classifier::HeadKind;
use crate::rerank::cache::{label_column, LabelTower, ScoreLoss};
use crate::rerank::evaluate::{rerank_beir, RerankMetrics, RerankOptions};
use crate::rerank::ScoreActivation;
use crate::retrieval::metrics::{corpus_metrics, parse_trec_run, Ranking};
use crate::retrieval::BeirSet;
use crate::train::config::{Config, RerankLossKind, RerankerLoss};
use crate::train::data::{Position, TextBatch};
use crate::train::metrics::RetrievalMetrics;
use crate::train::mixture::Mixture;
use crate::train::model::build_model;
use crate::train::run::{LoopConfig, Run, Task, TaskCache};
use crate::train::run_export::MAY_CHANGE;
use crate::train::text_data::load_data;
use crate::{Error, Result};

/// Pairs scored with a graph at once when `train.pair_chunk` is unset (theirs:
/// `mini_batch_size` 32).
pub const DEFAULT_PAIR_CHUNK: usize = 32;

/// A reranker run: [`Rerank`] through the one loop.
pub type RerankTrainer = Run<Rerank>;

/// What a reranker run evaluates on: a BEIR split and the first stage's run over it.
struct RerankEval {
    set: BeirSet,
    first_stage: BTreeMap<String, Ranking>,
    options: RerankOptions,
}

/// Cross-encoder training on text pairs: the task of `gradcache train` with
/// `[model.reranker]`.
pub struct Rerank {
    cfg: Config,
    device: Device,
    bert: BertConfig,
    /// How the model scores a pair (its classification head, or a causal LM's yes/no
    /// logits).
    kind: HeadKind,
    tokenizer: Tokenizer,
    mixture: Mixture,
    loss: RerankerLoss,
    /// Hard negatives per row.
    hard_negatives: usize,
    /// Documents per query: the positive, the hard negatives, the drawn ones.
    group: usize,
    /// The step of the batch being trained on (the in-batch negatives' draw).
    step: Cell<u64>,
    eval: RerankEval,
    /// The last evaluation's evaluator measures, first stage and reranked.
    last: RefCell<Option<(RerankMetrics, RerankMetrics)>>,
}

impl Task for Rerank {
    type Query = BertEncoder;
    type Passage = LabelTower;
    type Loss = ScoreLoss;
    type Batch = TextBatch;
    type Config = Config;

    fn config(&self) -> &Config {
        &self.cfg
    }

    fn next_batch(&mut self, step: u64) -> Result<TextBatch> {
        self.step.set(step);
        self.mixture.next_batch(step)
    }

    fn batch_rows(&self, batch: &TextBatch) -> usize {
        batch.queries.len()
    }

    fn chunk_settings(&self) -> (String, String) {
        match self.cfg.train.chunk_tokens {
            Some(tokens) => (
                format!("chunks of up to {tokens} padded tokens of pairs"),
                "train.chunk_tokens".into(),
            ),
            None => (
                format!("chunks of {} pairs", self.pair_chunk()),
                "train.pair_chunk".into(),
            ),
        }
    }

    fn describe_batch(&self, batch: &TextBatch) -> String {
        let mut lines = batch.lines.clone();
        lines.sort_unstable();
        let shown: Vec<String> = lines.iter().take(64).map(usize::to_string).collect();
        format!(
            "pairs {} of {}",
            shown.join(", "),
            self.mixture.describe_source(batch.source)
        )
    }

    /// This rank's queries' pairs, query by query, and their labels.
    fn inputs(&self, batch: &TextBatch, comm: &dyn Collective) -> Result<(TokenBatch, Tensor)> {
        let rows = batch.queries.len() / comm.world_size();
        let first = comm.rank() * rows;
        let per_row = 1 + self.hard_negatives;
        let mut queries = Vec::with_capacity(rows * self.group);
        let mut documents = Vec::with_capacity(rows * self.group);
        let mut labels = Vec::with_capacity(rows * self.group);
        for i in first..first + rows {
            let own = &batch.passages[i * per_row..(i + 1) * per_row];
            let drawn = self.drawn_negatives(batch, i)?;
            for (k, doc) in own
                .iter()
                .chain(drawn.iter().map(|&j| &batch.passages[j]))
                .enumerate()
            {
                queries.push(batch.queries[i].as_str());
                documents.push(doc.as_str());
                labels.push(match self.loss.kind {
                    RerankLossKind::MultipleNegatives => 0.0,
                    RerankLossKind::Bce => f32::from(u8::from(k == 0)),
                    _ => batch.scores.get(i * per_row + k).copied().ok_or_else(|| {
                        Error::InvalidArgument {
                            what: "reranker batch",
                            value: format!("row {i} without teacher scores"),
                            reason: "this loss reads each row's `scores` (the positive's and \
                                     each hard negative's)",
                        }
                    })?,
                });
            }
        }
        let pairs = self
            .tokenizer
            .encode_pairs(&queries, &documents, &self.device)?;
        let labels = label_column(Some(&labels), labels.len(), &self.device)?;
        Ok((pairs, labels))
    }

    fn position(&self, _step: u64) -> Position {
        self.mixture.position()
    }

    fn seek(&mut self, position: Position, step: u64) -> Result<()> {
        self.mixture.seek(position, step)
    }

    /// Reranks the first stage's run with the model in evaluation mode.
    fn evaluate(&self, gc: &TaskCache<Self>) -> Result<RetrievalMetrics> {
        let encoder = gc.query_encoder();
        let chunk = self.pair_chunk().max(16);
        let e = &self.eval;
        let report = rerank_beir(&e.set, &e.first_stage, &e.options, &mut |pairs| {
            let mut out = Vec::with_capacity(pairs.len());
            for part in pairs.chunks(chunk) {
                let (q, d): (Vec<&str>, Vec<&str>) = part.iter().copied().unzip();
                let input = self.tokenizer.encode_pairs(&q, &d, &self.device)?;
                let scores = encoder.encode(&input, &Ctx::eval())?;
                out.extend(
                    scores
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?,
                );
            }
            Ok(out)
        })?;
        *self.last.borrow_mut() = Some((report.base, report.reranked));
        Ok(RetrievalMetrics::from(&corpus_metrics(
            &report.run,
            &e.set.qrels,
        )))
    }

    fn eval_note(&self, _gc: &TaskCache<Self>) -> Result<Option<String>> {
        Ok(self.last.borrow().map(|(base, reranked)| {
            format!(
                "reranking the first stage's top {}: ndcg@{k} {:.4} -> {:.4}, mrr@{k} {:.4} -> \
                 {:.4}, map {:.4} -> {:.4} ({} queries)",
                self.eval.options.top_k,
                base.ndcg,
                reranked.ndcg,
                base.mrr,
                reranked.mrr,
                base.map,
                reranked.map,
                reranked.queries,
                k = reranked.at_k,
            )
        }))
    }

    /// Writes the trained cross-encoder to `output_dir/model` (rank 0).
    fn finish(&self, gc: &TaskCache<Self>, _step: u64) -> Result<Option<String>> {
        if gc.collective().rank() != 0 {
            return Ok(None);
        }
        let dir = self.cfg.output_dir.join("model");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| Error::io("replace", &dir, e))?;
        }
        self.export(gc, &dir)?;
        Ok(Some(format!(
            "trained cross-encoder (sentence-transformers' CrossEncoder layout): {}",
            dir.display()
        )))
    }
}

impl Rerank {
    /// Writes the cross-encoder of `gc` to `dir`.
    fn export(&self, gc: &TaskCache<Self>, dir: &Path) -> Result<()> {
        crate::rerank::export::export_cross_encoder(
            dir,
            &self.bert,
            self.kind,
            gc.query_encoder().params(),
            &self.tokenizer,
            ScoreActivation::Sigmoid,
        )
    }

    fn pair_chunk(&self) -> usize {
        self.cfg.train.pair_chunk.unwrap_or(DEFAULT_PAIR_CHUNK)
    }

    /// Row `i`'s drawn negatives (their places among the batch's passages): `num_negatives` documents of the other rows of the
    /// global batch (their positives and hard negatives), without repeats, a pure function
    /// of the seed, the step and the row.
    fn drawn_negatives(&self, batch: &TextBatch, i: usize) -> Result<Vec<usize>> {
        let n = self.loss.num_negatives;
        if n == 0 {
            return Ok(Vec::new());
        }
        let per_row = 1 + self.hard_negatives;
        let pool: Vec<usize> = (0..batch.passages.len())
            .filter(|p| p / per_row != i)
            .collect();
        let seed = crate::rng::derive_seed(&[self.cfg.seed, 0x7e_7a_4c, self.step.get(), i as u64]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let picked = rand::seq::index::sample(&mut rng, pool.len(), n.min(pool.len()));
        Ok(picked.into_iter().map(|j| pool[j]).collect())
    }
}

/// Refuses what a reranker run cannot do, naming the field.
fn check(cfg: &Config, loss: &RerankerLoss) -> Result<()> {
    let bad = |field: &'static str, value: String, reason: &'static str| {
        Err(Error::InvalidConfig {
            field,
            value,
            reason,
        })
    };
    let pool = cfg.train.batch_size.saturating_sub(1) * (1 + cfg.train.hard_negatives);
    if loss.kind == RerankLossKind::MultipleNegatives && loss.num_negatives > pool {
        return bad(
            "loss.reranker.num_negatives",
            format!("{} (batch {})", loss.num_negatives, cfg.train.batch_size),
            "the drawn negatives come from the other rows of the batch: at most (batch - 1) \
             x (1 + hard negatives)",
        );
    }
    if loss.kind != RerankLossKind::MultipleNegatives
        && loss.num_negatives > 0
        && loss.reads_scores()
    {
        return bad(
            "loss.reranker.num_negatives",
            loss.num_negatives.to_string(),
            "a loss over the rows' scores has no score for a drawn document: set 0",
        );
    }
    if loss.kind == RerankLossKind::Bce && loss.num_negatives > 0 {
        return bad(
            "loss.reranker.num_negatives",
            loss.num_negatives.to_string(),
            "binary cross-entropy labels the row's own documents: set 0",
        );
    }
    if cfg.train.pair_chunk == Some(0) {
        return bad(
            "train.pair_chunk",
            "0".into(),
            "at least one pair per chunk",
        );
    }
    if cfg.model.multi_vector.is_some() || cfg.model.sparse.is_some() || !cfg.model.shared {
        return bad(
            "model.reranker",
            "with multi_vector, sparse or two towers".into(),
            "a cross-encoder is one model over the pair with a classification head",
        );
    }
    if cfg.data.eval_file.is_none() || cfg.data.eval_run_file.is_none() {
        return bad(
            "data.eval_run_file",
            "unset".into(),
            "a reranker is evaluated by reranking a first-stage run: give data.eval_file (a \
             BEIR folder) and data.eval_run_file (its TREC run, e.g. from `gradcache eval \
             --run-file`)",
        );
    }
    if cfg.train.memory_budget.is_some() {
        return bad(
            "train.memory_budget",
            "set".into(),
            "a reranker run sets its chunk with train.pair_chunk (or chunk_tokens)",
        );
    }
    Ok(())
}

impl Run<Rerank> {
    /// Sets up a reranker run over the processes of `comm`; with `resume`, continues from
    /// a checkpoint.
    pub fn reranker(cfg: Config, resume: Option<&Path>, comm: Rc<dyn Collective>) -> Result<Self> {
        cfg.validate()?;
        let loss_cfg = cfg.loss.reranker.clone().unwrap_or_default();
        let loss = loss_cfg.loss()?;
        check(&cfg, &loss_cfg)?;
        if !cfg.train.batch_size.is_multiple_of(comm.world_size()) {
            return Err(Error::InvalidConfig {
                field: "train.batch_size",
                value: cfg.train.batch_size.to_string(),
                reason: "the global batch must split evenly over the ranks",
            });
        }
        // Everything is read before anything is written.
        let eval_dir = cfg.data.eval_file.clone().unwrap_or_default();
        let run_path = cfg.data.eval_run_file.clone().unwrap_or_default();
        let set = BeirSet::load(&eval_dir, &cfg.data.eval_split)?;
        let text =
            std::fs::read_to_string(&run_path).map_err(|e| Error::io("read", &run_path, e))?;
        let first_stage = parse_trec_run(&text).map_err(|line| Error::Data {
            path: run_path.clone(),
            line,
            reason: "not a TREC run line (`qid Q0 docid rank score tag`)".into(),
        })?;
        let fingerprint = cfg.fingerprint()?;
        let mut notes = Vec::new();
        let data = load_data(&cfg, &*comm, &mut notes)?;
        let device = cfg.device.unwrap_or_default().open()?;
        let model = build_model(&cfg, &data.texts, &*comm, &device)?;
        let max_len = cfg
            .model
            .passage_max_len
            .unwrap_or(model.limit)
            .min(model.limit);
        let instruction = cfg
            .model
            .reranker
            .as_ref()
            .and_then(|r| r.instruction.clone())
            .unwrap_or_default();
        let tokenizer = Tokenizer::new(model.tokenizer.clone(), max_len)?
            .with_config(model.tokenizer_config.clone())
            .with_chat_template(model.chat)
            .with_prompt(&instruction);
        let hard_negatives = cfg.train.hard_negatives;
        let group = 1
            + hard_negatives
            + loss_cfg.num_negatives
                * usize::from(loss_cfg.kind == RerankLossKind::MultipleNegatives);
        let t = &cfg.train;
        let pair_chunk = t.pair_chunk.unwrap_or(DEFAULT_PAIR_CHUNK);
        let passage_rows = Chunking::Rows(usize::MAX);
        let query_chunking = match t.chunk_tokens {
            Some(tokens) => Chunking::Tokens(tokens),
            None => Chunking::Rows(pair_chunk),
        };
        let gc = GradCache::two_towers(
            model.query,
            LabelTower::default(),
            pair_chunk,
            usize::MAX,
            ScoreLoss::new(loss, group)?,
        )?
        .with_chunking(query_chunking, passage_rows)?
        .with_seed(cfg.seed)
        .with_dropout(cfg.model.dropout)
        .with_collective(Rc::clone(&comm))
        .with_bucket_bytes(cfg.dist.bucket_mib << 20);
        notes.push(format!(
            "reranker: {} pairs per query (the positive, {hard_negatives} hard negatives, {} \
             drawn from other rows), loss {} with activation {:?}, pairs of at most {max_len} \
             tokens in {}; evaluation reranks the top {} of {} on {} ({} queries of `{}`)",
            group,
            group - 1 - hard_negatives,
            loss.objective().name(),
            loss.activation(),
            match t.chunk_tokens {
                Some(tokens) => format!("chunks of {tokens} padded tokens"),
                None => format!("chunks of {pair_chunk} pairs"),
            },
            cfg.data.eval_top_k.unwrap_or(100),
            run_path.display(),
            eval_dir.display(),
            set.queries.len(),
            cfg.data.eval_split,
        ));
        let settings = LoopConfig {
            output_dir: cfg.output_dir.clone(),
            steps: t.steps,
            eval_every: t.eval_every,
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            optim: cfg.optim.clone(),
            check_weights_every: cfg.dist.check_weights_every,
            loss_scaler: None,
            fingerprint,
            may_change: MAY_CHANGE,
            on_nonfinite: t.on_nonfinite,
        };
        let options = RerankOptions {
            top_k: cfg.data.eval_top_k.unwrap_or(100),
            at_k: 10,
            always_rerank_positives: false,
            title_separator: cfg.data.title_separator.clone(),
        };
        let task = Rerank {
            device: device.clone(),
            kind: model
                .options
                .classifier
                .map_or(HeadKind::Classification, |c| c.kind),
            bert: model.bert,
            tokenizer,
            mixture: data.mixture,
            loss: loss_cfg,
            hard_negatives,
            group,
            step: Cell::new(0),
            eval: RerankEval {
                set,
                first_stage,
                options,
            },
            last: RefCell::new(None),
            cfg,
        };
        let mut trainer = Run::from_parts(task, gc, model.store, device, comm, settings, notes)?;
        if let Some(path) = resume {
            trainer.restore(path)?;
        }
        Ok(trainer)
    }

    /// Writes the model at its current step to `dir` in sentence-transformers'
    /// `CrossEncoder` layout (`dir` must not exist or be empty).
    pub fn export(&self, dir: &Path) -> Result<()> {
        self.task.export(&self.gc, dir)
    }
}
