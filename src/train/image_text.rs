//! Image-text training (CLIP-style): a ResNet image tower and a text tower (a fresh BERT
//! or an LSTM) under one [`GradCache`], each with its own chunk size, trained with CLIP's
//! symmetric InfoNCE and learnable temperature ([`ClipLoss`]) on the [`shapes`] data set
//! the run generates from its seed (no download). Evaluation is image-to-text retrieval
//! over the held-out compositions: each held-out image against every distinct held-out
//! caption.
//!
//! `gradcache train --config configs/image-text.toml` runs it: a config whose top level
//! says `task = "image-text"` is an [`ImageTextConfig`].
//!
//! The data order is a pure function of the seed and the step (a seeded permutation per
//! epoch), so a checkpoint (weights, BatchNorm running statistics, logit scale, AdamW
//! moments, step) resumes the run exactly.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::batch::TokenBatch;
use crate::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use crate::dropout::Ctx;
use crate::encoder::{Encoder, Tower};
use crate::hub::tokenizer::{train_wordpiece, Tokenizer};
use crate::loss::{ClipLoss, Similarity};
use crate::lstm::{Lstm, LstmConfig, LstmEncoder};
use crate::memory::{self, PhaseMeter};
use crate::params::{Gradients, ParamStore, Params};
use crate::recompute::{Recompute, Recomputed};
use crate::resnet::{ResNet, ResNetConfig};
use crate::train::checkpoint::{self, TrainerState};
use crate::train::config::{apply_override, OptimConfig};
use crate::train::data::Position;
use crate::train::metrics::{self, RetrievalMetrics};
use crate::train::optim::{clip_grad_norm, Optimizer, Schedule};
use crate::train::shapes::{self, Scene, ShapesConfig};
use crate::train::trainer::{Event, Observer, PhasePeaks, PhaseTimes, StepReport, TOKENIZER_FILE};
use crate::{Error, GradCache, Result};

/// The name of the learnable logit scale in the store and in checkpoints.
pub const LOGIT_SCALE: &str = "logit_scale";

/// The value of `task` that selects image-text training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Task {
    /// Image-text training.
    #[serde(rename = "image-text")]
    ImageText,
}

/// An image-text run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageTextConfig {
    /// Must be `"image-text"`.
    pub task: Task,
    /// Seed of the weights, the data order and the dropout masks.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Where checkpoints, metrics, the loss curve and the final model go.
    pub output_dir: PathBuf,
    /// The generated data set.
    #[serde(default)]
    pub data: ShapesData,
    /// The image tower.
    #[serde(default)]
    pub image: ImageTower,
    /// The text tower.
    #[serde(default)]
    pub text: TextTowerConfig,
    /// The loss.
    #[serde(default)]
    pub loss: ClipLossConfig,
    /// Steps, batch and chunk sizes, cadence.
    #[serde(default)]
    pub train: ImageTextTrain,
    /// Optimiser and schedule (as in the text trainer's `[optim]`).
    #[serde(default)]
    pub optim: OptimConfig,
}

fn default_seed() -> u64 {
    42
}

/// The Shapes data set of the run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShapesData {
    /// Image side in pixels (at least 16).
    pub image_size: usize,
    /// Training scenes.
    pub train: usize,
    /// Held-out scenes (compositions never seen in training).
    pub eval: usize,
    /// Seed of the scenes (independent of the run's seed).
    pub seed: u64,
}

impl Default for ShapesData {
    fn default() -> Self {
        Self {
            image_size: 32,
            train: 4096,
            eval: 256,
            seed: 0,
        }
    }
}

/// The image tower: a ResNet and its checkpointing policy.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageTower {
    /// Width of the first stage.
    pub width: usize,
    /// Residual blocks per stage.
    pub stages: Vec<usize>,
    /// `basic` or `bottleneck`.
    pub block: crate::resnet::Block,
    /// Activation checkpointing over the blocks (a segment policy).
    pub recompute: Recompute,
}

impl Default for ImageTower {
    fn default() -> Self {
        let r = ResNetConfig::default();
        Self {
            width: r.width,
            stages: r.stages,
            block: r.block,
            recompute: Recompute::Off,
        }
    }
}

/// Which text tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextKind {
    /// A BERT trained from scratch, mean pooling.
    #[default]
    Bert,
    /// An LSTM (embedding, LSTM layers, pooling, projection).
    Lstm,
}

/// The text tower.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextTowerConfig {
    /// `bert` or `lstm`.
    pub kind: TextKind,
    /// Token limit of a caption.
    pub max_len: usize,
    /// WordPiece vocabulary size (trained on the training captions).
    pub vocab_size: usize,
    /// Width of the tower (BERT's hidden size, the LSTM's state); also the embedding width
    /// both towers map to.
    pub hidden_size: usize,
    /// BERT layers or LSTM layers.
    pub num_layers: usize,
    /// BERT attention heads.
    pub num_heads: usize,
    /// BERT feed-forward width.
    pub intermediate_size: usize,
    /// BERT dropout probability.
    pub dropout_prob: f64,
    /// LSTM pooling: `mean` or `last`.
    pub pooling: crate::lstm::LstmPooling,
    /// Activation checkpointing (BERT: over layers, selective policies too; LSTM: over
    /// time steps).
    pub recompute: Recompute,
}

impl Default for TextTowerConfig {
    fn default() -> Self {
        Self {
            kind: TextKind::Bert,
            max_len: 16,
            vocab_size: 100,
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            intermediate_size: 128,
            dropout_prob: 0.1,
            pooling: crate::lstm::LstmPooling::Mean,
            recompute: Recompute::Off,
        }
    }
}

/// CLIP's loss settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClipLossConfig {
    /// The initial temperature (CLIP: 0.07, a logit scale of 1 / 0.07).
    pub temperature: f64,
    /// The largest logit scale the clamp allows (CLIP: 100).
    pub max_logit_scale: f64,
}

impl Default for ClipLossConfig {
    fn default() -> Self {
        Self {
            temperature: 0.07,
            max_logit_scale: 100.0,
        }
    }
}

/// Steps, batch and chunk sizes, cadence.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageTextTrain {
    /// Optimizer steps.
    pub steps: u64,
    /// Image-caption pairs per step.
    pub batch_size: usize,
    /// Images encoded with a graph at once.
    pub image_chunk: usize,
    /// Captions encoded with a graph at once.
    pub text_chunk: usize,
    /// Evaluate every this many steps (0: only before and after training).
    pub eval_every: u64,
    /// Write a checkpoint every this many steps (and at the end; 0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
}

impl Default for ImageTextTrain {
    fn default() -> Self {
        Self {
            steps: 200,
            batch_size: 128,
            image_chunk: 32,
            text_chunk: 64,
            eval_every: 50,
            checkpoint_every: 100,
            keep_checkpoints: 2,
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> Error {
    Error::InvalidConfig {
        field,
        value: value.to_string(),
        reason,
    }
}

impl ImageTextConfig {
    /// Whether the TOML table is an image-text config (`task = "image-text"`).
    pub fn is_image_text(table: &toml::Table) -> bool {
        table.get("task").and_then(|t| t.as_str()) == Some("image-text")
    }

    /// Reads `path`, applies `--set` overrides, deserialises and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let table = crate::train::config::read_table(path)?;
        Self::from_table(table, path, overrides)
    }

    /// Deserialises an already read table (with overrides) and validates it.
    pub fn from_table(mut table: toml::Table, path: &Path, overrides: &[String]) -> Result<Self> {
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let cfg: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| Error::ConfigFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every value; the first bad one is reported with its key.
    pub fn validate(&self) -> Result<()> {
        let t = &self.train;
        if t.steps == 0 {
            return Err(invalid("train.steps", 0, "must be at least 1"));
        }
        if t.batch_size < 2 {
            return Err(invalid(
                "train.batch_size",
                t.batch_size,
                "needs at least 2 pairs (in-batch negatives)",
            ));
        }
        if t.image_chunk < 2 {
            return Err(invalid(
                "train.image_chunk",
                t.image_chunk,
                "BatchNorm needs chunks of at least 2 images",
            ));
        }
        if t.text_chunk == 0 {
            return Err(invalid("train.text_chunk", 0, "must be at least 1"));
        }
        if t.batch_size % t.image_chunk == 1 {
            return Err(invalid(
                "train.image_chunk",
                t.image_chunk,
                "the batch would end with a chunk of one image, which BatchNorm cannot \
                 normalise: choose a chunk size that leaves at least 2",
            ));
        }
        if self.data.train < t.batch_size {
            return Err(invalid(
                "data.train",
                self.data.train,
                "must hold at least one batch of scenes",
            ));
        }
        if self.data.eval < 2 {
            return Err(invalid(
                "data.eval",
                self.data.eval,
                "needs at least 2 scenes",
            ));
        }
        if t.keep_checkpoints == 0 {
            return Err(invalid("train.keep_checkpoints", 0, "must be at least 1"));
        }
        let x = &self.text;
        if x.max_len < 3 || x.vocab_size < 10 || x.hidden_size == 0 || x.num_layers == 0 {
            return Err(invalid(
                "text",
                format!(
                    "max_len {}, vocab_size {}, hidden_size {}, num_layers {}",
                    x.max_len, x.vocab_size, x.hidden_size, x.num_layers
                ),
                "max_len >= 3, vocab_size >= 10 and positive sizes are needed",
            ));
        }
        if x.kind == TextKind::Bert && (x.num_heads == 0 || x.hidden_size % x.num_heads != 0) {
            return Err(invalid(
                "text.num_heads",
                x.num_heads,
                "must divide text.hidden_size",
            ));
        }
        if self.image.stages.is_empty() || self.image.stages.contains(&0) {
            return Err(invalid(
                "image.stages",
                format!("{:?}", self.image.stages),
                "give at least one stage, each with at least one block",
            ));
        }
        if self.image.width == 0 {
            return Err(invalid("image.width", 0, "must be at least 1"));
        }
        self.resnet().validate()?;
        self.optim.kind().validate()?;
        if !(self.optim.lr > 0.0 && self.optim.lr.is_finite()) {
            return Err(invalid("optim.lr", self.optim.lr, "must be positive"));
        }
        Ok(())
    }

    /// The image tower's sizes (its output is the text tower's width).
    pub fn resnet(&self) -> ResNetConfig {
        ResNetConfig {
            in_channels: 3,
            width: self.image.width,
            stages: self.image.stages.clone(),
            block: self.image.block,
            output: self.text.hidden_size,
        }
    }

    /// A fingerprint of what the run trains (cadence and output directory excluded).
    pub fn fingerprint(&self) -> Result<String> {
        let mut shaping = self.clone();
        shaping.output_dir = PathBuf::new();
        shaping.train.eval_every = 0;
        shaping.train.checkpoint_every = 0;
        shaping.train.keep_checkpoints = 1;
        shaping.optim.warmup_steps = self.optim.warmup(self.train.steps);
        shaping.optim.warmup_ratio = 0.0;
        let text = serde_json::to_string(&shaping).map_err(|e| Error::InvalidArgument {
            what: "configuration",
            value: e.to_string(),
            reason: "cannot be serialised for its fingerprint",
        })?;
        Ok(format!("{:016x}", crate::rng::hash_str(&text)))
    }
}

/// The text tower of an image-text run.
pub enum TextTower {
    /// A BERT.
    Bert(BertEncoder),
    /// An LSTM.
    Lstm(LstmEncoder),
}

impl Encoder for TextTower {
    type Input = TokenBatch;

    fn params(&self) -> &Params {
        match self {
            TextTower::Bert(e) => e.params(),
            TextTower::Lstm(e) => e.params(),
        }
    }

    fn buffers(&self) -> Params {
        match self {
            TextTower::Bert(e) => e.buffers(),
            TextTower::Lstm(e) => e.buffers(),
        }
    }

    fn encode(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            TextTower::Bert(e) => e.encode(input, ctx),
            TextTower::Lstm(e) => e.encode(input, ctx),
        }
    }

    fn forward(&self, input: &TokenBatch, ctx: &Ctx) -> Result<Tensor> {
        match self {
            TextTower::Bert(e) => e.forward(input, ctx),
            TextTower::Lstm(e) => e.forward(input, ctx),
        }
    }

    fn replay(&self, input: &TokenBatch, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        match self {
            TextTower::Bert(e) => e.replay(input, cotangent, ctx),
            TextTower::Lstm(e) => e.replay(input, cotangent, ctx),
        }
    }
}

/// The image tower type.
pub type ImageEncoder = Recomputed<ResNet>;

/// A running image-text training.
pub struct ImageTextTrainer {
    cfg: ImageTextConfig,
    store: ParamStore,
    gc: GradCache<ImageEncoder, TextTower, ClipLoss>,
    tokenizer: Tokenizer,
    data: shapes::Shapes,
    optimizer: Optimizer,
    schedule: Schedule,
    step: u64,
    device: Device,
    notes: Vec<String>,
}

impl ImageTextTrainer {
    /// Generates the data, builds the towers, the loss and the optimiser; with `resume`, a
    /// checkpoint directory (or `output_dir/checkpoints`: its newest checkpoint) of the
    /// same configuration is restored.
    pub fn new(cfg: ImageTextConfig, resume: Option<&Path>) -> Result<Self> {
        cfg.validate()?;
        let device = Device::Cpu;
        let data = shapes::generate(&ShapesConfig {
            size: cfg.data.image_size,
            train: cfg.data.train,
            eval: cfg.data.eval,
            seed: cfg.data.seed,
        })?;
        let texts = data.train.iter().map(|s| s.caption.as_str());
        let inner = train_wordpiece(texts, cfg.text.vocab_size, true)?;
        let tokenizer = Tokenizer::new(inner, cfg.text.max_len)?;
        let store = ParamStore::new(cfg.seed, DType::F32, &device);
        let image = Tower::build(&store, "image", |vb| ResNet::new(&cfg.resnet(), vb))?;
        let image = Recomputed::new(image, cfg.image.recompute.clone())?;
        let text = build_text(&cfg, &store, tokenizer.inner().get_vocab_size(true))?;
        let loss = ClipLoss::new(
            &store,
            LOGIT_SCALE,
            cfg.loss.temperature,
            cfg.loss.max_logit_scale,
        )?;
        let t = &cfg.train;
        let gc = GradCache::two_towers(image, text, t.image_chunk, t.text_chunk, loss)?
            .with_seed(cfg.seed);
        let optimizer = Optimizer::new(cfg.optim.kind(), gc.params().clone())?;
        let schedule = Schedule {
            lr: cfg.optim.lr,
            warmup: cfg.optim.warmup(t.steps),
            total: t.steps,
        };
        let notes = vec![format!(
            "shapes: {} training scenes, {} held-out scenes ({} distinct captions) of compositions never seen in \
             training, {}x{} pixels; image tower: ResNet {:?} width {} ({} parameters, {} \
             BatchNorm buffers), text tower: {:?}, {} trainable tensors in all",
            data.train.len(),
            data.eval.len(),
            distinct(&data.eval).len(),
            cfg.data.image_size,
            cfg.data.image_size,
            cfg.image.stages,
            cfg.image.width,
            gc.query_encoder().params().elem_count(),
            gc.query_encoder().buffers().len(),
            cfg.text.kind,
            gc.params().len()
        )];
        let mut trainer = Self {
            cfg,
            store,
            gc,
            tokenizer,
            data,
            optimizer,
            schedule,
            step: 0,
            device,
            notes,
        };
        if let Some(path) = resume {
            trainer.restore(path)?;
        }
        Ok(trainer)
    }

    /// Notes of the set-up, for the log.
    pub fn setup_notes(&self) -> &[String] {
        &self.notes
    }

    /// Updates done.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &ImageTextConfig {
        &self.cfg
    }

    /// The parameter store (parameters, BatchNorm buffers, the logit scale).
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The gradient cache (towers and loss).
    pub fn gradient_cache(&self) -> &GradCache<ImageEncoder, TextTower, ClipLoss> {
        &self.gc
    }

    /// The optimizer's state (for checkpoints and tests).
    pub fn optimizer_state(&self) -> Result<std::collections::BTreeMap<String, Tensor>> {
        self.optimizer.state()
    }

    /// The scenes of update `step`: a seeded permutation per epoch, cut into batches.
    fn batch_indices(&self, step: u64) -> Vec<usize> {
        let n = self.data.train.len();
        let b = self.cfg.train.batch_size;
        let per_epoch = (n / b) as u64;
        let epoch = step / per_epoch;
        let mut order: Vec<usize> = (0..n).collect();
        let seed = crate::rng::derive_seed(&[self.cfg.seed, 0x5ce7e5, epoch]);
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let start = (step % per_epoch) as usize * b;
        order[start..start + b].to_vec()
    }

    /// Images `[rows, 3, size, size]` of `scenes`.
    fn images(&self, scenes: &[&Scene]) -> Result<Tensor> {
        let size = self.cfg.data.image_size;
        let pixels: Vec<f32> = scenes
            .iter()
            .flat_map(|s| s.pixels.iter().copied())
            .collect();
        Ok(Tensor::from_vec(
            pixels,
            (scenes.len(), 3, size, size),
            &self.device,
        )?)
    }

    /// One optimizer update on the batch of the current step.
    pub fn train_step(&mut self) -> Result<StepReport> {
        let _flush = crate::denormal::flush();
        let start = std::time::Instant::now();
        let heap_at_start = memory::current_bytes();
        let scenes: Vec<&Scene> = self
            .batch_indices(self.step)
            .into_iter()
            .map(|i| &self.data.train[i])
            .collect();
        let images = self.images(&scenes)?;
        let captions: Vec<&str> = scenes.iter().map(|s| s.caption.as_str()).collect();
        let tokens = self.tokenizer.encode(&captions, &self.device)?;
        let tokenize_ms = start.elapsed().as_secs_f64() * 1e3;
        let (_, peak, out) = memory::measure(|| -> Result<_> {
            let out = self.gc.cache_step(self.step, &images, &tokens)?;
            let mut meter = PhaseMeter::start();
            let optimizer_start = std::time::Instant::now();
            let mut grads = out.grads;
            let max_norm = match self.cfg.optim.max_grad_norm {
                0.0 => f64::INFINITY,
                n => n,
            };
            let lr = self.schedule.lr_at(self.step);
            let grad_norm = clip_grad_norm(&mut grads, max_norm)?;
            self.optimizer.step(self.step, &grads, lr)?;
            self.gc.loss().clamp()?;
            let (_, optimizer_peak) = meter.lap();
            let optimizer_ms = optimizer_start.elapsed().as_secs_f64() * 1e3;
            // The gradients are dropped here, before the report is written.
            let phases = (out.loss, out.times, out.peaks);
            Ok((phases, lr, grad_norm, optimizer_ms, optimizer_peak))
        });
        let ((loss, t, m), lr, grad_norm, optimizer_ms, optimizer_peak) = out?;
        self.step += 1;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            grad_norm,
            pairs_per_sec: scenes.len() as f64 / start.elapsed().as_secs_f64().max(1e-9),
            peak_bytes: peak,
            heap_peak_bytes: if peak > 0 { heap_at_start + peak } else { 0 },
            filled_negatives: 0,
            phases: PhaseTimes {
                tokenize_ms,
                represent_ms: ms(t.represent),
                loss_ms: ms(t.loss),
                replay_ms: ms(t.replay),
                reduce_ms: ms(t.reduce),
                optimizer_ms,
            },
            phase_peaks: PhasePeaks {
                represent: m.represent,
                loss: m.loss,
                replay: m.replay,
                reduce: m.reduce,
                optimizer: optimizer_peak,
            },
            flops: 0.0,
            loss_scaling: None,
        })
    }

    /// Image-to-text retrieval on the held-out scenes: every image against every distinct
    /// held-out caption, evaluation mode (BatchNorm's running statistics, no dropout).
    pub fn evaluate(&self) -> Result<RetrievalMetrics> {
        let _flush = crate::denormal::flush();
        let captions = distinct(&self.data.eval);
        let targets: Vec<usize> = self
            .data
            .eval
            .iter()
            .map(|s| captions.iter().position(|c| *c == s.caption).unwrap_or(0))
            .collect();
        let ctx = Ctx::eval();
        let mut image_reps = Vec::new();
        for chunk in self.data.eval.chunks(self.cfg.train.image_chunk.max(16)) {
            let scenes: Vec<&Scene> = chunk.iter().collect();
            image_reps.push(
                self.gc
                    .query_encoder()
                    .encode(&self.images(&scenes)?, &ctx)?,
            );
        }
        let mut text_reps = Vec::new();
        for chunk in captions.chunks(self.cfg.train.text_chunk.max(16)) {
            let texts: Vec<&str> = chunk.iter().map(String::as_str).collect();
            let batch = self.tokenizer.encode(&texts, &self.device)?;
            text_reps.push(self.gc.passage_encoder().encode(&batch, &ctx)?);
        }
        metrics::evaluate(
            &Tensor::cat(&image_reps, 0)?,
            &Tensor::cat(&text_reps, 0)?,
            &targets,
            Similarity::Cosine,
            256,
        )
    }

    /// Trains to `train.steps`, evaluating before (on a fresh run), every `eval_every`
    /// steps and after, writing checkpoints and, at the end, the trained model
    /// (`output_dir/model`). Returns the metrics before (fresh runs) and after.
    pub fn run(
        &mut self,
        observer: &mut dyn Observer,
    ) -> Result<(Option<RetrievalMetrics>, RetrievalMetrics)> {
        std::fs::create_dir_all(&self.cfg.output_dir)
            .map_err(|e| Error::io("create", &self.cfg.output_dir, e))?;
        for note in &self.notes {
            observer.event(&Event::Note(note.clone()));
        }
        let before = if self.step == 0 {
            let m = self.evaluate()?;
            observer.event(&Event::Eval {
                step: 0,
                metrics: m,
            });
            Some(m)
        } else {
            None
        };
        let t = self.cfg.train;
        while self.step < t.steps {
            let report = self.train_step()?;
            observer.event(&Event::Step(report));
            let last = self.step == t.steps;
            if t.eval_every > 0 && self.step % t.eval_every == 0 && !last {
                let m = self.evaluate()?;
                observer.event(&Event::Eval {
                    step: self.step,
                    metrics: m,
                });
                observer.event(&Event::Note(format!(
                    "step {}: logit scale {:.2} (temperature {:.4})",
                    self.step,
                    self.gc.loss().scale()?,
                    1.0 / self.gc.loss().scale()?
                )));
            }
            if (t.checkpoint_every > 0 && self.step % t.checkpoint_every == 0) || last {
                let dir = self.save_checkpoint()?;
                observer.event(&Event::CheckpointSaved(dir));
            }
        }
        let after = self.evaluate()?;
        observer.event(&Event::Eval {
            step: self.step,
            metrics: after,
        });
        let dir = self.export(&self.cfg.output_dir.join("model"))?;
        observer.event(&Event::Note(format!(
            "trained model (towers with BatchNorm statistics, tokenizer, logit scale {:.2}): {}",
            self.gc.loss().scale()?,
            dir.display()
        )));
        Ok((before, after))
    }

    /// Everything a checkpoint holds besides the optimizer: parameters, BatchNorm
    /// buffers, the logit scale.
    pub fn state(&self) -> Result<Params> {
        self.gc.state()
    }

    fn trainer_state(&self) -> Result<TrainerState> {
        let per_epoch = (self.data.train.len() / self.cfg.train.batch_size) as u64;
        Ok(TrainerState {
            step: self.step,
            data: Position {
                epoch: self.step / per_epoch,
                offset: (self.step % per_epoch) as usize * self.cfg.train.batch_size,
            },
            config_fingerprint: self.cfg.fingerprint()?,
            loss_scaler: None,
        })
    }

    /// Writes a checkpoint of the current step under `output_dir/checkpoints`.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        checkpoint::save(
            &self.cfg.output_dir.join("checkpoints"),
            &self.state()?,
            &self.optimizer.state()?,
            &self.trainer_state()?,
            self.cfg.train.keep_checkpoints,
        )
    }

    fn restore(&mut self, path: &Path) -> Result<()> {
        let ckpt = checkpoint::load(path, &self.device)?;
        if ckpt.state.config_fingerprint != self.cfg.fingerprint()? {
            return Err(Error::CheckpointMismatch {
                what: format!("checkpoint {}", ckpt.dir.display()),
                detail: "it was written with another configuration (only output_dir, \
                         train.eval_every, checkpoint_every and keep_checkpoints may change)"
                    .into(),
            });
        }
        checkpoint::restore(&self.state()?, &ckpt.model, &ckpt.dir)?;
        self.optimizer.load_state(&ckpt.optimizer)?;
        self.step = ckpt.state.step;
        self.notes.push(format!(
            "resumed from {} at step {}",
            ckpt.dir.display(),
            self.step
        ));
        Ok(())
    }

    /// Writes the trained model to `dir`: `image_tower.safetensors` (torchvision ResNet
    /// names, BatchNorm running statistics included), `text_tower.safetensors`,
    /// `tokenizer.json`, `logit_scale` inside `image_text_config.json` with the config.
    pub fn export(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let state = self.state()?;
        for (prefix, file) in [
            ("image.", "image_tower.safetensors"),
            ("text.", "text_tower.safetensors"),
        ] {
            let tensors: std::collections::HashMap<String, Tensor> = state
                .iter()
                .filter_map(|(n, v)| {
                    n.strip_prefix(prefix)
                        .map(|rest| (rest.to_string(), v.as_tensor().clone()))
                })
                .collect();
            let path = dir.join(file);
            candle_core::safetensors::save(&tensors, &path)
                .map_err(|e| Error::io("write", &path, e))?;
        }
        let path = dir.join(TOKENIZER_FILE);
        self.tokenizer
            .inner()
            .save(&path, false)
            .map_err(|e| Error::io("write", &path, e))?;
        let path = dir.join("image_text_config.json");
        let json = serde_json::json!({
            "config": self.cfg,
            "logit_scale": self.gc.loss().scale()?,
            "step": self.step,
        });
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        )
        .map_err(|e| Error::io("write", &path, e))?;
        Ok(dir.to_path_buf())
    }
}

/// `gradcache export` for an image-text run: restores `checkpoint` (default: the newest
/// under `output_dir/checkpoints`) and writes the model as [`ImageTextTrainer::export`]
/// does into `output`, which must not exist or be empty. Returns the checkpoint's step.
pub fn export_image_text(
    cfg: &ImageTextConfig,
    checkpoint: Option<&Path>,
    output: &Path,
) -> Result<u64> {
    let not_empty = output.exists()
        && std::fs::read_dir(output)
            .map_err(|e| Error::io("list", output, e))?
            .next()
            .is_some();
    if not_empty {
        return Err(Error::OutputExists {
            path: output.to_path_buf(),
        });
    }
    let root = cfg.output_dir.join("checkpoints");
    let trainer = ImageTextTrainer::new(cfg.clone(), Some(checkpoint.unwrap_or(&root)))?;
    trainer.export(output)?;
    Ok(trainer.step())
}

/// The distinct captions of `scenes`, in first-seen order.
fn distinct(scenes: &[Scene]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    scenes
        .iter()
        .filter(|s| seen.insert(s.caption.clone()))
        .map(|s| s.caption.clone())
        .collect()
}

fn build_text(cfg: &ImageTextConfig, store: &ParamStore, vocab: usize) -> Result<TextTower> {
    let x = &cfg.text;
    Ok(match x.kind {
        TextKind::Bert => {
            let bert = BertConfig {
                hidden_dropout_prob: x.dropout_prob,
                attention_probs_dropout_prob: x.dropout_prob,
                ..BertConfig::new(
                    vocab,
                    x.hidden_size,
                    x.num_layers,
                    x.num_heads,
                    x.intermediate_size,
                    x.max_len,
                )
            };
            let options = BertOptions {
                pooling: Pooling::Mean,
                normalize: false,
                recompute: x.recompute.clone(),
                ..Default::default()
            };
            TextTower::Bert(BertEncoder::build(store, "text", &bert, &options)?)
        }
        TextKind::Lstm => {
            let lstm = LstmConfig {
                vocab_size: vocab,
                embedding_size: x.hidden_size,
                hidden_size: x.hidden_size,
                num_layers: x.num_layers,
                pooling: x.pooling,
                output: x.hidden_size,
            };
            let tower = Tower::build(store, "text", |vb| Lstm::new(&lstm, vb))?;
            TextTower::Lstm(LstmEncoder::new(tower, x.recompute.clone())?)
        }
    })
}
