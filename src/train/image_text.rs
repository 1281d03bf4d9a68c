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
use crate::recompute::Recomputed;
use crate::resnet::ResNet;
use crate::train::checkpoint::{self, TrainerState};
use crate::train::data::Position;
use crate::train::metrics::{self, RetrievalMetrics};
use crate::train::optim::{clip_grad_norm, Optimizer, Schedule};
use crate::train::shapes::{self, Scene, ShapesConfig};
use crate::train::trainer::{Event, Observer, PhasePeaks, PhaseTimes, StepReport, TOKENIZER_FILE};
use crate::{Error, GradCache, Result};

/// The name of the learnable logit scale in the store and in checkpoints.
pub const LOGIT_SCALE: &str = "logit_scale";

pub use super::image_text_config::{
    ClipLossConfig, ImageTextConfig, ImageTextTrain, ImageTower, ShapesData, Task, TextKind,
    TextTowerConfig,
};

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
