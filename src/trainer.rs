//! The training loop behind `gradcache train`: data, tokenizers, towers, gradient cache,
//! optimiser, schedule, clipping, evaluation, checkpoints and resume.
//!
//! The library side of the trainer prints nothing: progress goes to an [`Observer`] (the
//! binary draws the progress bar, writes the metrics file and the loss curve). It writes
//! only the run's own files under `output_dir`: the tokenizer it trained, the model config
//! and the checkpoints.
//!
//! Resume is exact: weights and optimiser moments are stored as f32, the data loader's
//! position and the step are stored, dropout masks derive from (seed, step, ...), and the
//! learning rate from the step. With the same thread count on CPU, every later step's loss
//! equals that of an uninterrupted run bit for bit (matrix products split their work by
//! thread count, so another thread count may change the last bits).

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::batch::Batch;
use crate::bert::{load_pretrained, BertConfig, BertEncoder, BertOptions};
use crate::cache::GradCache;
use crate::config::Config;
use crate::data::{read_jsonl, split, Loader, Pair, TextBatch};
use crate::dist::{self, Collective};
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::loss::InfoNce;
use crate::memory;
use crate::metrics::{evaluate, RetrievalMetrics};
use crate::optim::{clip_grad_norm, Optimizer, Schedule};
use crate::params::ParamStore;
use crate::pretrained::{HubSettings, ModelFiles};
use crate::resume::{self, TrainerState};
use crate::tokenizer::{train_wordpiece, Tokenizer};
use crate::{Error, Result, Side};

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step just completed (1-based count of updates).
    pub step: u64,
    /// Loss over the whole batch.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Query/positive pairs per second for this step.
    pub pairs_per_sec: f64,
    /// Peak bytes allocated during the step (0 unless the binary counts allocations).
    pub peak_bytes: usize,
    /// Hard negatives that were missing and filled from other pairs.
    pub filled_negatives: usize,
}

/// Something the trainer reports while it runs.
#[derive(Debug, Clone)]
pub enum Event {
    /// An optimizer step finished.
    Step(StepReport),
    /// An evaluation finished (at `step` updates).
    Eval {
        /// Updates done when it ran.
        step: u64,
        /// Retrieval metrics on the held-out pairs.
        metrics: RetrievalMetrics,
    },
    /// A checkpoint was written.
    Checkpoint(PathBuf),
    /// A fact worth a log line.
    Note(String),
}

/// Receives the trainer's events (the binary draws and logs them).
pub trait Observer {
    /// Called for every event, in order.
    fn event(&mut self, event: &Event);
}

/// An observer that ignores everything.
pub struct Quiet;

impl Observer for Quiet {
    fn event(&mut self, _: &Event) {}
}

/// A training run.
pub struct Trainer {
    cfg: Config,
    device: Device,
    store: ParamStore,
    bert: BertConfig,
    options: BertOptions,
    gc: GradCache<BertEncoder, BertEncoder, InfoNce>,
    query_tokenizer: Tokenizer,
    passage_tokenizer: Tokenizer,
    optimizer: Optimizer,
    schedule: Schedule,
    loader: Loader,
    eval: Vec<Pair>,
    step: u64,
    notes: Vec<String>,
    comm: Rc<dyn Collective>,
}

/// The towers of a run and what was built with them.
struct Model {
    query: BertEncoder,
    /// The passage tower; `None` when one tower is shared.
    passage: Option<BertEncoder>,
    bert: BertConfig,
    tokenizer: tokenizers::Tokenizer,
    store: ParamStore,
}

fn read_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(path).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

const TOKENIZER_FILE: &str = "tokenizer.json";
const MODEL_CONFIG_FILE: &str = "model_config.json";

impl Trainer {
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
        cfg.validate()?;
        let (rank, world) = (comm.rank(), comm.world_size());
        if cfg.train.batch_size % world != 0 {
            return Err(Error::InvalidConfig {
                field: "train.batch_size",
                value: cfg.train.batch_size.to_string(),
                reason: "the global batch must split evenly over the ranks (a multiple of the \
                         world size)",
            });
        }
        let device = comm.device();
        let mut notes = Vec::new();

        let (train, eval) = dist::agree(&*comm, load_pairs(&cfg))?;
        check_same_run(&*comm, &cfg, &train, &eval)?;
        if train.len() % cfg.train.batch_size != 0 {
            notes.push(format!(
                "{} training pairs make {} batches of {} per epoch; the last {} pairs of each \
                 (shuffled) epoch are dropped",
                train.len(),
                train.len() / cfg.train.batch_size,
                cfg.train.batch_size,
                train.len() % cfg.train.batch_size
            ));
        }
        if world > 1 {
            notes.push(format!(
                "{world} ranks ({} backend): {} pairs per rank, loss over the global batch of {}",
                comm.backend(),
                cfg.train.batch_size / world,
                cfg.train.batch_size
            ));
        }
        // A fresh tokenizer learns from the training split only (never the held-out pairs).
        let texts: Vec<String> = if cfg.model.pretrained.is_empty() {
            train
                .iter()
                .flat_map(|p| [p.query.clone(), p.positive.clone()])
                .collect()
        } else {
            Vec::new()
        };
        let loader = Loader::new(
            train,
            cfg.train.batch_size,
            cfg.train.hard_negatives,
            cfg.seed,
        )?;

        let made_dir = if rank == 0 {
            std::fs::create_dir_all(&cfg.output_dir).map_err(|e| Error::ModelFile {
                path: cfg.output_dir.clone(),
                reason: e.to_string(),
            })
        } else {
            Ok(())
        };
        dist::agree(&*comm, made_dir)?;
        let options = BertOptions {
            pooling: cfg.model.pooling,
            normalize: cfg.model.normalize,
            checkpointing: cfg.model.checkpointing.clone(),
        };
        let store = ParamStore::new(cfg.seed, DType::F32, &device);
        let model = if cfg.model.pretrained.is_empty() {
            let tokenizer = fresh_tokenizer(&cfg, &texts, &*comm)?;
            dist::agree(
                &*comm,
                Self::fresh_model(&cfg, tokenizer, &options, store, rank == 0),
            )?
        } else {
            dist::agree(&*comm, Self::pretrained_model(&cfg, &options, store))?
        };
        let Model {
            query,
            passage,
            bert,
            tokenizer,
            store,
        } = model;
        let query_tokenizer = Tokenizer::new(tokenizer.clone(), cfg.model.query_max_len)?;
        let passage_tokenizer = Tokenizer::new(tokenizer, cfg.model.passage_max_len)?;
        let max_len = cfg.model.query_max_len.max(cfg.model.passage_max_len);
        if max_len > bert.max_position_embeddings {
            return Err(Error::InvalidConfig {
                field: "model.query_max_len",
                value: max_len.to_string(),
                reason: "exceeds the model's max_position_embeddings",
            });
        }

        let block = (cfg.loss.block_rows > 0).then_some(cfg.loss.block_rows);
        let loss = InfoNce::new(cfg.loss.temperature)?
            .with_similarity(cfg.loss.similarity)
            .with_symmetric(cfg.loss.symmetric)
            .with_block_rows(block)?;
        let (qc, pc) = (cfg.train.query_chunk, cfg.train.passage_chunk);
        let gc = match passage {
            None => GradCache::shared(query, qc, loss)?.with_chunk_sizes(qc, pc)?,
            Some(passage) => GradCache::two_towers(query, passage, qc, pc, loss)?,
        }
        .with_seed(cfg.seed)
        .with_dropout(cfg.model.dropout)
        .with_collective(Rc::clone(&comm))
        .with_bucket_bytes(cfg.dist.bucket_mib << 20);

        let kind = cfg.optim.kind();
        let optimizer = Optimizer::new(kind, gc.params().clone())?;
        let schedule = Schedule {
            lr: cfg.optim.lr,
            warmup: cfg.optim.warmup_steps,
            total: cfg.train.steps,
        };
        let mut trainer = Self {
            cfg,
            device,
            store,
            bert,
            options,
            gc,
            query_tokenizer,
            passage_tokenizer,
            optimizer,
            schedule,
            loader,
            eval,
            step: 0,
            notes,
            comm,
        };
        if let Some(path) = resume {
            let resumed = trainer.resume_from(path);
            dist::agree(&*trainer.comm, resumed)?;
        }
        if world > 1 {
            let sum = dist::ensure_identical_weights(&*trainer.comm, trainer.gc.params())?;
            trainer.notes.push(format!(
                "all {world} ranks start from identical weights (checksum {sum:016x})"
            ));
        }
        Ok(trainer)
    }

    /// This process's rank (0 in a single-process run).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The collective the run uses.
    pub fn collective(&self) -> &dyn Collective {
        &*self.comm
    }

    fn fresh_model(
        cfg: &Config,
        tokenizer: tokenizers::Tokenizer,
        options: &BertOptions,
        store: ParamStore,
        write_files: bool,
    ) -> Result<Model> {
        let f = &cfg.model.fresh;
        let bert = BertConfig {
            hidden_dropout_prob: f.dropout_prob,
            attention_probs_dropout_prob: f.dropout_prob,
            ..BertConfig::new(
                tokenizer.get_vocab_size(true),
                f.hidden_size,
                f.num_layers,
                f.num_heads,
                f.intermediate_size,
                cfg.model.query_max_len.max(cfg.model.passage_max_len),
            )
        };
        if write_files {
            let json = serde_json::to_string_pretty(&bert).unwrap_or_default();
            let path = cfg.output_dir.join(MODEL_CONFIG_FILE);
            std::fs::write(&path, json).map_err(|e| Error::ModelFile {
                path,
                reason: e.to_string(),
            })?;
        }
        let (query, passage) = if cfg.model.shared {
            (BertEncoder::build(&store, "", &bert, options)?, None)
        } else {
            (
                BertEncoder::build(&store, "query", &bert, options)?,
                Some(BertEncoder::build(&store, "passage", &bert, options)?),
            )
        };
        Ok(Model {
            query,
            passage,
            bert,
            tokenizer,
            store,
        })
    }

    fn pretrained_model(cfg: &Config, options: &BertOptions, store: ParamStore) -> Result<Model> {
        let files = ModelFiles::resolve(&cfg.model.pretrained, &HubSettings::from_env())?;
        let tok_path = files.tokenizer.clone().ok_or_else(|| Error::MissingFile {
            path: files.config.with_file_name("tokenizer.json"),
            what: "tokenizer",
        })?;
        let tokenizer = read_tokenizer(&tok_path)?;
        if cfg.model.shared {
            let (q, bert, store) = load_pretrained(&files, "", options, store)?;
            Ok(Model {
                query: q,
                passage: None,
                bert,
                tokenizer,
                store,
            })
        } else {
            let (q, bert, store) = load_pretrained(&files, "query", options, store)?;
            let (p, _, store) = load_pretrained(&files, "passage", options, store)?;
            Ok(Model {
                query: q,
                passage: Some(p),
                bert,
                tokenizer,
                store,
            })
        }
    }

    fn resume_from(&mut self, path: &Path) -> Result<()> {
        let ckpt = resume::load(path, &self.device)?;
        let want = self.cfg.fingerprint();
        if ckpt.state.config_fingerprint != want {
            return Err(Error::InvalidConfig {
                field: "--resume",
                value: ckpt.dir.display().to_string(),
                reason: "the checkpoint was written with another configuration (only \
                         output_dir, train.eval_every, checkpoint_every, keep_checkpoints \
                         and the dist section may change)",
            });
        }
        resume::restore(self.gc.params(), &ckpt.model, &ckpt.dir)?;
        self.optimizer.load_state(&ckpt.optimizer)?;
        self.loader.seek(ckpt.state.data)?;
        self.step = ckpt.state.step;
        self.notes.push(format!(
            "resumed from {} at step {}",
            ckpt.dir.display(),
            self.step
        ));
        Ok(())
    }

    /// Updates done so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Every trainable parameter.
    pub fn params(&self) -> &crate::params::Params {
        self.gc.params()
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// Retrieval metrics on the held-out pairs: every held-out query against every held-out
    /// positive (dropout off).
    pub fn evaluate(&self) -> Result<RetrievalMetrics> {
        let queries: Vec<&str> = self.eval.iter().map(|p| p.query.as_str()).collect();
        let passages: Vec<&str> = self.eval.iter().map(|p| p.positive.as_str()).collect();
        let q = embed(
            self.gc.query_encoder(),
            &self.query_tokenizer,
            &queries,
            self.cfg.train.query_chunk,
            &self.device,
        )?;
        let p = embed(
            self.gc.passage_encoder(),
            &self.passage_tokenizer,
            &passages,
            self.cfg.train.passage_chunk,
            &self.device,
        )?;
        let targets: Vec<usize> = (0..queries.len()).collect();
        evaluate(&q, &p, &targets, self.cfg.loss.similarity, 256)
    }

    /// One optimizer step on the next (global) batch; in a distributed run this rank
    /// encodes its share and every rank applies the same reduced gradients.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let batch = self.loader.next_batch()?;
        let start = Instant::now();
        let (_, peak, out) = memory::measure(|| -> Result<_> {
            let share = self.share(&batch);
            let inputs = share.and_then(|(queries, passages)| {
                let q = self.query_tokenizer.encode(&queries, &self.device)?;
                let p = self.passage_tokenizer.encode(&passages, &self.device)?;
                Ok((q, p))
            });
            let (q, p) = dist::agree(&*self.comm, inputs)?;
            self.gc.set_step(self.step);
            let out = self.gc.cache_step(&q, &p)?;
            let mut grads = out.grads;
            let grad_norm = if self.cfg.optim.max_grad_norm > 0.0 {
                clip_grad_norm(&mut grads, self.cfg.optim.max_grad_norm)?
            } else {
                clip_grad_norm(&mut grads, f64::INFINITY)?
            };
            let lr = self.schedule.lr_at(self.step);
            self.optimizer.step(&grads, lr)?;
            Ok((out.loss, lr, grad_norm))
        });
        let (loss, lr, grad_norm) = out?;
        self.step += 1;
        let every = self.cfg.dist.check_weights_every;
        if self.world_size() > 1
            && (cfg!(debug_assertions) || (every > 0 && self.step % every == 0))
        {
            dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
        }
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            grad_norm,
            pairs_per_sec: batch.queries.len() as f64 / secs,
            peak_bytes: peak,
            filled_negatives: batch.filled,
        })
    }

    /// This rank's queries and passages of a global batch: an equal, contiguous share
    /// (passages keep their per-query groups).
    fn share<'b>(&self, batch: &'b TextBatch) -> Result<(Vec<&'b str>, Vec<&'b str>)> {
        let (rank, world) = (self.rank(), self.world_size());
        let rows = batch.queries.len() / world;
        let group = batch.passages.len() / batch.queries.len().max(1);
        if rows * world != batch.queries.len()
            || group * batch.queries.len() != batch.passages.len()
        {
            return Err(Error::Data {
                path: self.cfg.data.train_file.clone(),
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

    /// Writes a checkpoint of the current state.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let state = TrainerState {
            step: self.step,
            data: self.loader.position(),
            seed: self.cfg.seed,
            config_fingerprint: self.cfg.fingerprint(),
        };
        resume::save(
            &self.cfg.output_dir.join("checkpoints"),
            self.gc.params(),
            &self.optimizer.state()?,
            &state,
            self.cfg.train.keep_checkpoints,
        )
    }

    /// Runs until `train.steps`, evaluating before the first step (unless resumed), every
    /// `eval_every` steps and at the end, and checkpointing every `checkpoint_every` steps
    /// and at the end. Returns the evaluations (first and last).
    pub fn run(
        &mut self,
        observer: &mut dyn Observer,
    ) -> Result<(Option<RetrievalMetrics>, RetrievalMetrics)> {
        for note in std::mem::take(&mut self.notes) {
            observer.event(&Event::Note(note));
        }
        let before = if self.step == 0 {
            let m = self.evaluate_on_root()?;
            observer.event(&Event::Eval {
                step: 0,
                metrics: m,
            });
            Some(m)
        } else {
            None
        };
        let mut filled = 0;
        while self.step < self.cfg.train.steps {
            let report = self.train_step()?;
            filled += report.filled_negatives;
            observer.event(&Event::Step(report));
            let t = &self.cfg.train;
            let last = self.step == t.steps;
            if t.eval_every > 0 && self.step % t.eval_every == 0 && !last {
                let m = self.evaluate_on_root()?;
                observer.event(&Event::Eval {
                    step: self.step,
                    metrics: m,
                });
            }
            if (t.checkpoint_every > 0 && self.step % t.checkpoint_every == 0) || last {
                let saved = if self.rank() == 0 {
                    self.save_checkpoint().map(Some)
                } else {
                    Ok(None)
                };
                if let Some(dir) = dist::agree(&*self.comm, saved)? {
                    observer.event(&Event::Checkpoint(dir));
                }
            }
        }
        if filled > 0 {
            observer.event(&Event::Note(format!(
                "{filled} missing hard negatives were filled with positives of other pairs"
            )));
        }
        if self.world_size() > 1 {
            let sum = dist::ensure_identical_weights(&*self.comm, self.gc.params())?;
            observer.event(&Event::Note(format!(
                "all {} ranks hold identical weights (checksum {sum:016x})",
                self.world_size()
            )));
        }
        let after = self.evaluate_on_root()?;
        observer.event(&Event::Eval {
            step: self.step,
            metrics: after,
        });
        Ok((before, after))
    }

    /// Evaluates on rank 0 only, agrees on the outcome (a failure there stops every rank)
    /// and hands rank 0's metrics to every rank.
    fn evaluate_on_root(&self) -> Result<RetrievalMetrics> {
        if self.world_size() == 1 {
            return self.evaluate();
        }
        let local = if self.rank() == 0 {
            self.evaluate().map(Some)
        } else {
            Ok(None)
        };
        let mine = dist::agree(&*self.comm, local)?;
        let json = mine
            .map(|m| serde_json::to_vec(&m).unwrap_or_default())
            .unwrap_or_default();
        let all = self.comm.all_gather_bytes(&json)?;
        serde_json::from_slice(&all[0]).map_err(|e| Error::RankMismatch {
            what: "the evaluation".into(),
            detail: format!("rank 0's metrics do not parse: {e}"),
        })
    }

    /// Exports the tower of `side` (the shared tower for either side) as a Hugging Face +
    /// sentence-transformers directory.
    pub fn export(&self, dir: &Path, side: Side) -> Result<()> {
        let (params, prefix, tokenizer) = match (side, self.cfg.model.shared) {
            (_, true) => (self.gc.query_encoder().params(), "", &self.query_tokenizer),
            (Side::Query, false) => (
                self.gc.query_encoder().params(),
                "query",
                &self.query_tokenizer,
            ),
            (Side::Passage, false) => (
                self.gc.passage_encoder().params(),
                "passage",
                &self.passage_tokenizer,
            ),
        };
        crate::export::export_bert(
            dir,
            &self.bert,
            &self.options,
            self.cfg.loss.similarity,
            params,
            prefix,
            tokenizer,
        )
    }
}

/// The training and held-out pairs of a run.
fn load_pairs(cfg: &Config) -> Result<(Vec<Pair>, Vec<Pair>)> {
    let pairs = read_jsonl(&cfg.data.train_file, &cfg.data.fields)?;
    match &cfg.data.eval_file {
        Some(path) => Ok((pairs, read_jsonl(path, &cfg.data.fields)?)),
        None => split(pairs, cfg.data.eval_pairs, cfg.seed),
    }
}

/// Checks that every rank runs the same configuration on the same data. Data paths may
/// differ between ranks (per-node copies); the data itself may not.
fn check_same_run(
    comm: &dyn Collective,
    cfg: &Config,
    train: &[Pair],
    eval: &[Pair],
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut shaping = cfg.clone();
    shaping.data.train_file = PathBuf::new();
    shaping.data.eval_file = None;
    let json = serde_json::to_string(&shaping).unwrap_or_default();
    let all = comm.all_gather_bytes(json.as_bytes())?;
    let differing: Vec<String> = (1..all.len())
        .filter(|&r| all[r] != all[0])
        .map(|r| {
            let theirs = String::from_utf8_lossy(&all[r]);
            let keys =
                crate::config::differing_keys(&json_of(&all[0]), &json_of(theirs.as_bytes()));
            format!("rank {r} differs from rank 0 in {}", keys.join(", "))
        })
        .collect();
    if !differing.is_empty() {
        return Err(Error::RankMismatch {
            what: "the config".into(),
            detail: differing.join("; "),
        });
    }
    let mut hash = crate::rng::hash_str("");
    for p in train.iter().chain(eval) {
        for text in [&p.query, &p.positive].into_iter().chain(&p.negatives) {
            hash = hash.rotate_left(5) ^ crate::rng::hash_str(text);
        }
    }
    let print = format!(
        "{} training pairs, {} held out, hash {hash:016x}",
        train.len(),
        eval.len()
    );
    dist::ensure_same(comm, "the data", print.as_bytes(), |b| {
        String::from_utf8_lossy(b).into_owned()
    })
}

fn json_of(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or(serde_json::Value::Null)
}

/// The tokenizer of a fresh model: rank 0 reuses the one in `output_dir` (a resumed run or
/// a rerun) or trains one on the training texts and saves it; every other rank receives
/// rank 0's, so all ranks tokenize identically and only rank 0 writes.
fn fresh_tokenizer(
    cfg: &Config,
    texts: &[String],
    comm: &dyn Collective,
) -> Result<tokenizers::Tokenizer> {
    let tok_path = cfg.output_dir.join(TOKENIZER_FILE);
    let tokenizer_error = |e: tokenizers::Error| Error::ModelFile {
        path: tok_path.clone(),
        reason: e.to_string(),
    };
    let local = if comm.rank() == 0 {
        let made = if tok_path.is_file() {
            read_tokenizer(&tok_path)
        } else {
            let f = &cfg.model.fresh;
            let tok = train_wordpiece(texts.iter().map(String::as_str), f.vocab_size, f.lowercase);
            tok.and_then(|tok| {
                tok.save(&tok_path, false).map_err(tokenizer_error)?;
                Ok(tok)
            })
        };
        made.map(Some)
    } else {
        Ok(None)
    };
    let mine = dist::agree(comm, local)?;
    if comm.world_size() == 1 {
        if let Some(tok) = mine {
            return Ok(tok);
        }
    }
    let json = match &mine {
        Some(tok) => tok.to_string(false).map_err(tokenizer_error)?,
        None => String::new(),
    };
    let all = comm.all_gather_bytes(json.as_bytes())?;
    match mine {
        Some(tok) => Ok(tok),
        None => tokenizers::Tokenizer::from_bytes(&all[0]).map_err(|e| {
            Error::Tokenizer(format!(
                "the tokenizer received from rank 0 does not parse: {e}"
            ))
        }),
    }
}

fn to_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Embeds `texts` with `encoder` (evaluation mode) in chunks of `chunk`.
pub fn embed(
    encoder: &BertEncoder,
    tokenizer: &Tokenizer,
    texts: &[&str],
    chunk: usize,
    device: &Device,
) -> Result<Tensor> {
    let mut parts = Vec::new();
    for block in texts.chunks(chunk.max(1) * 8) {
        let batch = tokenizer.encode(block, device)?;
        for piece in batch.chunks(chunk.max(1))? {
            parts.push(encoder.encode(&piece, &Ctx::eval())?);
        }
    }
    Ok(Tensor::cat(&parts, 0)?)
}
