//! The configuration of an image-text run ([`ImageTextConfig`]): its data, towers, loss and
//! training keys with their defaults, `--set` overrides, and one `validate` that names
//! the field and the value of anything wrong.

use std::path::{Path, PathBuf};

use crate::densenet::DenseNetConfig;
use crate::recompute::Recompute;
use crate::resnet::ResNetConfig;
use crate::train::config::{apply_override, OnNonFinite, OptimConfig};
use crate::vnet::VNetConfig;
use crate::{Error, Result};

/// The value of `task` that selects image-text (or volume-text) training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Task {
    /// Image-text training on the generated Shapes.
    #[serde(rename = "image-text")]
    ImageText,
    /// Volume-text training on the generated Solids, with a VNet volume tower
    /// (`[volume] arch = "vnet"`).
    #[serde(rename = "volume-text")]
    VolumeText,
}

/// An image-text run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageTextConfig {
    /// `"image-text"` or `"volume-text"`.
    pub task: Task,
    /// Seed of the weights, the data order and the dropout masks.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Where checkpoints, metrics, the loss curve and the final model go.
    pub output_dir: PathBuf,
    /// The generated data set.
    #[serde(default)]
    pub data: ShapesData,
    /// The image tower (`[volume]` in a volume-text config).
    #[serde(default, alias = "volume")]
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
    /// Image side in pixels (at least 16); `volume_size`, the volume's side in voxels, in
    /// a volume-text config.
    #[serde(alias = "volume_size")]
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

/// The image tower: a ResNet (or a DenseNet-BC) and its checkpointing policy.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageTower {
    /// `resnet` (sized by `width`, `stages`, `block`), `densenet` (DenseNet-BC, sized by
    /// `[image.densenet]`) or, for volumes, `vnet` (sized by `[volume.vnet]`).
    #[serde(skip_serializing_if = "ImageArch::is_resnet")]
    pub arch: ImageArch,
    /// Width of the ResNet's first stage.
    pub width: usize,
    /// The ResNet's residual blocks per stage.
    pub stages: Vec<usize>,
    /// `basic` or `bottleneck`.
    pub block: crate::resnet::Block,
    /// DenseNet-BC's sizes with `arch = "densenet"` (unset: growth 12, blocks [4, 4, 4],
    /// memory-efficient).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub densenet: Option<DenseNetSettings>,
    /// VNet's sizes with `arch = "vnet"` (unset: VNet's width 16, stages [1, 2, 3, 2],
    /// 5x5x5 kernels, plain units).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vnet: Option<VNetSettings>,
    /// Activation checkpointing over the blocks (residual or dense; a segment policy).
    pub recompute: Recompute,
}

impl Default for ImageTower {
    fn default() -> Self {
        let r = ResNetConfig::default();
        Self {
            arch: ImageArch::Resnet,
            width: r.width,
            stages: r.stages,
            block: r.block,
            densenet: None,
            vnet: None,
            recompute: Recompute::Off,
        }
    }
}

/// The image tower's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageArch {
    /// A ResNet ([`crate::resnet::ResNet`]).
    #[default]
    Resnet,
    /// A DenseNet-BC ([`crate::densenet::DenseNet`]).
    Densenet,
    /// A VNet volume tower ([`crate::vnet::VNet`]; volume-text runs).
    Vnet,
}

impl ImageArch {
    fn is_resnet(&self) -> bool {
        *self == ImageArch::Resnet
    }
}

/// `[image.densenet]`: a DenseNet-BC image tower's sizes (torchvision's names).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DenseNetSettings {
    /// New channels per layer.
    pub growth_rate: usize,
    /// Layers per dense block.
    pub block_config: Vec<usize>,
    /// Channels of the stem.
    pub init_features: usize,
    /// The bottleneck's width in multiples of the growth rate.
    pub bn_size: usize,
    /// The share of channels a transition keeps.
    pub compression: f64,
    /// Recompute each layer in the backward pass instead of keeping its intermediates.
    pub memory_efficient: bool,
}

impl Default for DenseNetSettings {
    fn default() -> Self {
        let d = DenseNetConfig::default();
        Self {
            growth_rate: d.growth_rate,
            block_config: d.block_config,
            init_features: d.init_features,
            bn_size: d.bn_size,
            compression: d.compression,
            memory_efficient: d.memory_efficient,
        }
    }
}

/// `[volume.vnet]`: a VNet volume tower's sizes.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VNetSettings {
    /// Channels of the input transition.
    pub width: usize,
    /// Convolutions of each down stage.
    pub stages: Vec<usize>,
    /// Side of the stages' cubic kernels (odd).
    pub kernel: usize,
    /// Each convolution unit one node recomputed a piece of rows at a time in the
    /// backward pass.
    pub memory_efficient: bool,
}

impl Default for VNetSettings {
    fn default() -> Self {
        let v = VNetConfig::default();
        Self {
            width: v.width,
            stages: v.stages,
            kernel: v.kernel,
            memory_efficient: v.memory_efficient,
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
    /// Images encoded with a graph at once (`volume_chunk` in a volume-text config).
    #[serde(alias = "volume_chunk")]
    pub image_chunk: usize,
    /// Captions encoded with a graph at once.
    pub text_chunk: usize,
    /// Evaluate every this many steps (0: only before and after training).
    pub eval_every: u64,
    /// Write a checkpoint every this many steps (and at the end; 0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// What a step with a NaN or infinite loss or gradient norm does: `"stop"` (default)
    /// or `"skip"` (see the text trainer's `train.on_nonfinite`).
    #[serde(skip_serializing_if = "OnNonFinite::is_stop")]
    pub on_nonfinite: OnNonFinite,
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
            on_nonfinite: OnNonFinite::Stop,
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
    /// Whether the TOML table is an image-text config (`task = "image-text"` or
    /// `"volume-text"`).
    pub fn is_image_text(table: &toml::Table) -> bool {
        matches!(
            table.get("task").and_then(|t| t.as_str()),
            Some("image-text" | "volume-text")
        )
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
        if x.kind == TextKind::Bert
            && (x.num_heads == 0 || !x.hidden_size.is_multiple_of(x.num_heads))
        {
            return Err(invalid(
                "text.num_heads",
                x.num_heads,
                "must divide text.hidden_size",
            ));
        }
        self.validate_densenet()?;
        self.validate_vnet()?;
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

    /// With `image.arch = "densenet"`: the sizes fit and the images are large enough; the
    /// ResNet's sizes are left out. `[image.densenet]` asks for `arch = "densenet"`.
    fn validate_densenet(&self) -> Result<()> {
        let i = &self.image;
        let Some(cfg) = self.densenet() else {
            if i.densenet.is_some() {
                return Err(invalid(
                    "image.densenet",
                    "set",
                    "sizes a DenseNet-BC: set image.arch = \"densenet\" too",
                ));
            }
            return Ok(());
        };
        let r = ImageTower::default();
        if (i.width, &i.stages, i.block) != (r.width, &r.stages, r.block) {
            return Err(invalid(
                "image.width / image.stages / image.block",
                "set",
                "size a ResNet: with image.arch = \"densenet\" size the tower in \
                 [image.densenet]",
            ));
        }
        cfg.validate()?;
        if self.data.image_size < cfg.min_size() {
            return Err(invalid(
                "data.image_size",
                self.data.image_size,
                "is too small for the DenseNet's transitions (each halves the side)",
            ));
        }
        Ok(())
    }

    /// A volume-text run has a VNet and a VNet a volume-text run; the VNet's sizes fit and
    /// the volume's side is a multiple of what its stages halve.
    fn validate_vnet(&self) -> Result<()> {
        let i = &self.image;
        let volumes = self.task == Task::VolumeText;
        if volumes != (i.arch == ImageArch::Vnet) {
            return Err(invalid(
                "volume.arch",
                format!("{:?} with task {:?}", i.arch, self.task),
                "a volume-text run takes a VNet (arch = \"vnet\") and a VNet takes volumes \
                 (task = \"volume-text\")",
            ));
        }
        if i.vnet.is_some() && !volumes {
            return Err(invalid(
                "image.vnet",
                "set",
                "sizes a VNet: set task = \"volume-text\" and volume.arch = \"vnet\"",
            ));
        }
        let Some(cfg) = self.vnet() else {
            return Ok(());
        };
        let r = ImageTower::default();
        if (i.width, &i.stages, i.block) != (r.width, &r.stages, r.block) || i.densenet.is_some() {
            return Err(invalid(
                "volume.width / volume.stages / volume.block / volume.densenet",
                "set",
                "size an image tower: with volume.arch = \"vnet\" size the tower in \
                 [volume.vnet]",
            ));
        }
        cfg.validate()?;
        let side = self.data.image_size;
        if side < 16 || !side.is_multiple_of(cfg.min_size()) {
            return Err(invalid(
                "data.volume_size",
                side,
                "must be at least 16 and a multiple of 2^(VNet's down stages): each halves it",
            ));
        }
        Ok(())
    }

    /// The VNet volume tower's sizes with `volume.arch = "vnet"` (one input channel; its
    /// output is the text tower's width).
    pub fn vnet(&self) -> Option<VNetConfig> {
        if self.image.arch != ImageArch::Vnet {
            return None;
        }
        let v = self.image.vnet.clone().unwrap_or_default();
        Some(VNetConfig {
            in_channels: 1,
            width: v.width,
            stages: v.stages,
            kernel: v.kernel,
            memory_efficient: v.memory_efficient,
            output: self.text.hidden_size,
        })
    }

    /// The DenseNet-BC image tower's sizes with `image.arch = "densenet"` (its output is
    /// the text tower's width).
    pub fn densenet(&self) -> Option<DenseNetConfig> {
        if self.image.arch != ImageArch::Densenet {
            return None;
        }
        let d = self.image.densenet.clone().unwrap_or_default();
        Some(DenseNetConfig {
            in_channels: 3,
            growth_rate: d.growth_rate,
            block_config: d.block_config,
            init_features: d.init_features,
            bn_size: d.bn_size,
            compression: d.compression,
            memory_efficient: d.memory_efficient,
            output: self.text.hidden_size,
        })
    }

    /// The ResNet image tower's sizes (its output is the text tower's width).
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
        shaping.train.on_nonfinite = OnNonFinite::Stop;
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
