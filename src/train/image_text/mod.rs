//! Image-text training (CLIP-style): a ResNet or DenseNet-BC image tower (`image.arch`)
//! and a text tower (a fresh BERT or an LSTM) under one [`GradCache`], each with its own chunk size, trained with CLIP's
//! symmetric InfoNCE and learnable temperature ([`ClipLoss`]) on the [`shapes`](crate::train::shapes) data set
//! the run generates from its seed (no download). Evaluation is image-to-text retrieval
//! over the held-out compositions: each held-out image against every distinct held-out
//! caption.
//!
//! `gradcache train --config configs/image-text.toml` runs it: a config whose top level
//! says `task = "image-text"` is an [`ImageTextConfig`]. With `task = "volume-text"` the
//! same loop trains a VNet volume tower (`[volume] arch = "vnet"`) against the captions of
//! the [`volumes`](crate::train::volumes) data set (solids in 3-D), `configs/volume-text.toml`.
//!
//! The data order is a pure function of the seed and the step (a seeded permutation per
//! epoch), so a checkpoint (weights, BatchNorm running statistics, logit scale, AdamW
//! moments, step) resumes the run exactly.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::batch::TokenBatch;
use crate::dist::{Collective, Single};
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::hub::tokenizer::{train_wordpiece, Tokenizer};
use crate::loss::{ClipLoss, Similarity};
use crate::params::ParamStore;
use crate::train::data::Position;
use crate::train::metrics::{self, RetrievalMetrics};
use crate::train::run::{self, LoopConfig, Run, TaskCache};
use crate::{Error, GradCache, Result};

/// The name of the learnable logit scale in the store and in checkpoints.
pub const LOGIT_SCALE: &str = "logit_scale";

mod config;
mod data;
mod export;
mod towers;

pub use config::{
    ClipLossConfig, DenseNetSettings, ImageArch, ImageTextConfig, ImageTextTrain, ImageTower,
    ShapesData, Task, TextKind, TextTowerConfig,
};
use data::{distinct, Data, Example};
pub use export::export_image_text;
use towers::{build_image, build_text};
pub use towers::{ImageEncoder, TextTower};

/// What may change between an image-text run and its resume.
const MAY_CHANGE: &str =
    "output_dir, train.eval_every, checkpoint_every, keep_checkpoints and on_nonfinite";

/// A running image-text training: [`ImageText`] through the one loop.
pub type ImageTextTrainer = Run<ImageText>;

/// CLIP-style image-text training on the generated shapes: the task of `gradcache train`
/// with `task = "image-text"`.
pub struct ImageText {
    cfg: ImageTextConfig,
    tokenizer: Tokenizer,
    data: Data,
    device: Device,
}

impl run::Task for ImageText {
    type Query = ImageEncoder;
    type Passage = TextTower;
    type Loss = ClipLoss;
    /// Indices of the batch's training scenes.
    type Batch = Vec<usize>;
    type Config = ImageTextConfig;

    fn config(&self) -> &ImageTextConfig {
        &self.cfg
    }

    fn chunk_settings(&self) -> (String, String) {
        let t = &self.cfg.train;
        (
            format!(
                "chunks of {} images and {} captions",
                t.image_chunk, t.text_chunk
            ),
            "train.image_chunk (train.volume_chunk for volumes) and train.text_chunk".into(),
        )
    }

    /// The scenes of update `step`: a seeded permutation per epoch, cut into batches.
    fn next_batch(&mut self, step: u64) -> Result<Vec<usize>> {
        let n = self.data.train.len();
        let b = self.cfg.train.batch_size;
        let per_epoch = (n / b) as u64;
        let epoch = step / per_epoch;
        let mut order: Vec<usize> = (0..n).collect();
        let seed = crate::rng::derive_seed(&[self.cfg.seed, 0x5ce7e5, epoch]);
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let start = (step % per_epoch) as usize * b;
        Ok(order[start..start + b].to_vec())
    }

    fn batch_rows(&self, batch: &Vec<usize>) -> usize {
        batch.len()
    }

    /// `training scenes 4, 19, ...` (their places in the generated set, from 0).
    fn describe_batch(&self, batch: &Vec<usize>) -> String {
        let mut scenes = batch.clone();
        scenes.sort_unstable();
        let shown: Vec<String> = scenes.iter().take(64).map(usize::to_string).collect();
        let more = scenes.len().saturating_sub(64);
        format!(
            "training scenes {}{} of the generated data (seed {})",
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            },
            self.cfg.data.seed
        )
    }

    /// Images `[rows, 3, size, size]` (volumes `[rows, 1, size, size, size]`) and tokenized
    /// captions of the scenes.
    fn inputs(&self, batch: &Vec<usize>, _comm: &dyn Collective) -> Result<(Tensor, TokenBatch)> {
        let scenes: Vec<&Example> = batch.iter().map(|&i| &self.data.train[i]).collect();
        let images = self.images(&scenes)?;
        let captions: Vec<&str> = scenes.iter().map(|s| s.caption.as_str()).collect();
        let tokens = self.tokenizer.encode(&captions, &self.device)?;
        Ok((images, tokens))
    }

    fn position(&self, step: u64) -> Position {
        let per_epoch = (self.data.train.len() / self.cfg.train.batch_size) as u64;
        Position {
            epoch: step / per_epoch,
            offset: (step % per_epoch) as usize * self.cfg.train.batch_size,
        }
    }

    /// The data order is a function of the step: the position must be the step's.
    fn seek(&mut self, position: Position, step: u64) -> Result<()> {
        if position != self.position(step) {
            return Err(Error::InvalidArgument {
                what: "data position",
                value: format!("{position:?}"),
                reason: "is not where the data of an image-text run stands at its step",
            });
        }
        Ok(())
    }

    /// Image-to-text retrieval on the held-out scenes: every image against every distinct
    /// held-out caption, evaluation mode (BatchNorm's running statistics, no dropout).
    fn evaluate(&self, gc: &TaskCache<Self>) -> Result<RetrievalMetrics> {
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
            let scenes: Vec<&Example> = chunk.iter().collect();
            image_reps.push(gc.query_encoder().encode(&self.images(&scenes)?, &ctx)?);
        }
        let mut text_reps = Vec::new();
        for chunk in captions.chunks(self.cfg.train.text_chunk.max(16)) {
            let texts: Vec<&str> = chunk.iter().map(String::as_str).collect();
            let batch = self.tokenizer.encode(&texts, &self.device)?;
            text_reps.push(gc.passage_encoder().encode(&batch, &ctx)?);
        }
        metrics::evaluate(
            &Tensor::cat(&image_reps, 0)?,
            &Tensor::cat(&text_reps, 0)?,
            &targets,
            Similarity::Cosine,
            256,
        )
    }

    /// The logit scale stays below its maximum.
    fn after_update(&self, gc: &TaskCache<Self>) -> Result<()> {
        gc.loss().clamp()
    }

    fn eval_note(&self, gc: &TaskCache<Self>) -> Result<Option<String>> {
        let scale = gc.loss().scale()?;
        Ok(Some(format!(
            "logit scale {scale:.2} (temperature {:.4})",
            1.0 / scale
        )))
    }

    /// Writes the trained model to `output_dir/model`.
    fn finish(&self, gc: &TaskCache<Self>, step: u64) -> Result<Option<String>> {
        let dir = self.export(gc, step, &self.cfg.output_dir.join("model"))?;
        Ok(Some(format!(
            "trained model (towers with BatchNorm statistics, tokenizer, logit scale {:.2}): {}",
            gc.loss().scale()?,
            dir.display()
        )))
    }
}

impl ImageText {
    /// Images `[rows, 3, size, size]` (volumes `[rows, 1, size, size, size]`) of `scenes`.
    fn images(&self, scenes: &[&Example]) -> Result<Tensor> {
        let values: Vec<f32> = scenes
            .iter()
            .flat_map(|s| s.values.iter().copied())
            .collect();
        let mut dims = vec![scenes.len()];
        dims.extend(&self.data.dims);
        Ok(Tensor::from_vec(values, dims, &self.device)?)
    }
}

impl Run<ImageText> {
    /// Generates the data, builds the towers, the loss and the optimiser; with `resume`, a
    /// checkpoint directory (or `output_dir/checkpoints`: its newest checkpoint) of the
    /// same configuration is restored.
    pub fn new(cfg: ImageTextConfig, resume: Option<&Path>) -> Result<Self> {
        cfg.validate()?;
        let device = Device::Cpu;
        let data = Data::generate(&cfg)?;
        let texts = data.train.iter().map(|s| s.caption.as_str());
        let inner = train_wordpiece(texts, cfg.text.vocab_size, true)?;
        let tokenizer = Tokenizer::new(inner, cfg.text.max_len)?;
        let store = ParamStore::new(cfg.seed, DType::F32, &device);
        let image = build_image(&cfg, &store)?;
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
        let volumes = cfg.task == Task::VolumeText;
        let side = cfg.data.image_size;
        let notes = vec![format!(
            "{}: {} training scenes, {} held-out scenes ({} distinct captions) of compositions never seen in \
             training, {}; {} tower: {} ({} parameters, {} BatchNorm buffers), \
             text tower: {:?}, {} trainable tensors in all",
            if volumes { "solids" } else { "shapes" },
            data.train.len(),
            data.eval.len(),
            distinct(&data.eval).len(),
            if volumes {
                format!("{side}^3 voxels")
            } else {
                format!("{side}x{side} pixels")
            },
            if volumes { "volume" } else { "image" },
            match cfg.densenet() {
                Some(d) => format!(
                    "DenseNet-BC growth {} blocks {:?}{}",
                    d.growth_rate,
                    d.block_config,
                    if d.memory_efficient {
                        ", memory-efficient"
                    } else {
                        ""
                    }
                ),
                None => match cfg.vnet() {
                    Some(v) => format!(
                        "VNet width {} stages {:?} kernel {}{}",
                        v.width,
                        v.stages,
                        v.kernel,
                        if v.memory_efficient {
                            ", memory-efficient units"
                        } else {
                            ""
                        }
                    ),
                    None => format!("ResNet {:?} width {}", cfg.image.stages, cfg.image.width),
                },
            },
            gc.query_encoder().params().elem_count(),
            gc.query_encoder().buffers().len(),
            cfg.text.kind,
            gc.params().len()
        )];
        let settings = LoopConfig {
            output_dir: cfg.output_dir.clone(),
            steps: t.steps,
            eval_every: t.eval_every,
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            optim: cfg.optim.clone(),
            check_weights_every: 0,
            loss_scaler: None,
            fingerprint: cfg.fingerprint()?,
            may_change: MAY_CHANGE,
            on_nonfinite: t.on_nonfinite,
        };
        let task = ImageText {
            cfg,
            tokenizer,
            data,
            device: device.clone(),
        };
        let mut trainer =
            Run::from_parts(task, gc, store, device, Rc::new(Single), settings, notes)?;
        if let Some(path) = resume {
            trainer.restore(path)?;
        }
        Ok(trainer)
    }

    /// Writes the trained model to `dir`: `image_tower.safetensors` (torchvision's
    /// names, BatchNorm running statistics included), `text_tower.safetensors`,
    /// `tokenizer.json`, `logit_scale` inside `image_text_config.json` with the config.
    pub fn export(&self, dir: &Path) -> Result<PathBuf> {
        self.task.export(&self.gc, self.step(), dir)
    }
}
