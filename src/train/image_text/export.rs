//! An image-text model written out: the image (or volume) tower and the text tower as
//! safetensors files under torchvision's and the towers' names, the tokenizer, and the
//! config with the learnt logit scale; `gradcache export` of an image-text run.

use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::durable;
use crate::train::model::TOKENIZER_FILE;
use crate::train::run::TaskCache;
use crate::{Error, Result};

use super::{ImageText, ImageTextConfig, ImageTextTrainer, Task};

impl ImageText {
    /// The image tower's file in an exported model (the volume tower's for volumes).
    fn tower_file(&self) -> &'static str {
        if self.cfg.task == Task::VolumeText {
            "volume_tower.safetensors"
        } else {
            "image_tower.safetensors"
        }
    }

    /// Writes the model of `gc` after `step` updates to `dir`: `image_tower.safetensors`
    /// (torchvision's ResNet or DenseNet names, BatchNorm running statistics included),
    /// `text_tower.safetensors`, `tokenizer.json`, `logit_scale` inside
    /// `image_text_config.json` with the config.
    pub(super) fn export(&self, gc: &TaskCache<Self>, step: u64, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let state = gc.state()?;
        for (prefix, file) in [
            ("image.", self.tower_file()),
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
            durable::write_with::<Error>(&path, |tmp| {
                candle_core::safetensors::save(&tensors, tmp)
                    .map_err(|e| Error::io("write", &path, e))
            })?;
        }
        let path = dir.join(TOKENIZER_FILE);
        durable::write_with::<Error>(&path, |tmp| {
            self.tokenizer
                .inner()
                .save(tmp, false)
                .map_err(|e| Error::io("write", &path, e))
        })?;
        let path = dir.join("image_text_config.json");
        let json = serde_json::json!({
            "config": self.cfg,
            "logit_scale": gc.loss().scale()?,
            "step": step,
        });
        durable::write_json(&path, &json)?;
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
    crate::durable::refuse_non_empty(output)?;
    let root = cfg.output_dir.join("checkpoints");
    let trainer = ImageTextTrainer::new(cfg.clone(), Some(checkpoint.unwrap_or(&root)))?;
    trainer.export(output)?;
    Ok(trainer.step())
}
