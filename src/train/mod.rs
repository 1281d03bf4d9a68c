//! The trainer behind `gradcache train`: [`config`] (TOML with documented defaults),
//! [`data`] (JSONL pairs, held-out split, seeded resumable loader), [`optim`] (AdamW,
//! SGD, the warmup schedule, clipping), [`metrics`] (retrieval quality), [`checkpoint`]
//! (training checkpoints written atomically, exact resume), [`trainer`] (the loop, and
//! the export of a finished run) and [`image_text`] (CLIP-style training of a ResNet and a
//! text tower on the generated [`shapes`] data set).

pub mod budget;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod image_text;
mod image_text_config;
pub mod metrics;
mod model;
pub mod optim;
pub mod report;
pub mod shapes;
pub mod trainer;

pub use config::Config;
pub use trainer::{export_run, Event, Observer, PhaseTimes, Quiet, StepReport, Trainer};
