//! The generated data of an image-text run: the shapes' images or the solids' volumes
//! with their captions, from the run's seed ([`crate::train::shapes`],
//! [`crate::train::volumes`]).

use crate::train::shapes::{self, ShapesConfig};
use crate::train::volumes::{self, VolumesConfig};
use crate::Result;

use super::{ImageTextConfig, Task};

/// One generated example: an image's or a volume's values and its caption.
pub(super) struct Example {
    pub(super) values: Vec<f32>,
    pub(super) caption: String,
}

/// The generated data of a run: Shapes' images or Solids' volumes.
pub(super) struct Data {
    pub(super) train: Vec<Example>,
    pub(super) eval: Vec<Example>,
    /// One example's dimensions: `[3, side, side]` or `[1, side, side, side]`.
    pub(super) dims: Vec<usize>,
}

impl Data {
    /// The data set `cfg` asks for.
    pub(super) fn generate(cfg: &ImageTextConfig) -> Result<Self> {
        let (size, train, eval, seed) = (
            cfg.data.image_size,
            cfg.data.train,
            cfg.data.eval,
            cfg.data.seed,
        );
        if cfg.task == Task::VolumeText {
            let data = volumes::generate(&VolumesConfig {
                size,
                train,
                eval,
                seed,
            })?;
            let take = |scenes: Vec<volumes::VolumeScene>| {
                scenes
                    .into_iter()
                    .map(|s| Example {
                        values: s.voxels,
                        caption: s.caption,
                    })
                    .collect()
            };
            return Ok(Self {
                train: take(data.train),
                eval: take(data.eval),
                dims: vec![1, size, size, size],
            });
        }
        let data = shapes::generate(&ShapesConfig {
            size,
            train,
            eval,
            seed,
        })?;
        let take = |scenes: Vec<shapes::Scene>| {
            scenes
                .into_iter()
                .map(|s| Example {
                    values: s.pixels,
                    caption: s.caption,
                })
                .collect()
        };
        Ok(Self {
            train: take(data.train),
            eval: take(data.eval),
            dims: vec![3, size, size],
        })
    }
}

/// The distinct captions of `scenes`, in first-seen order.
pub(super) fn distinct(scenes: &[Example]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    scenes
        .iter()
        .filter(|s| seen.insert(s.caption.clone()))
        .map(|s| s.caption.clone())
        .collect()
}
