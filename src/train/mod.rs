//! The trainer behind `gradcache train`: [`config`] (TOML with documented defaults),
//! [`data`] (JSONL pairs, held-out split, seeded resumable loader), [`optim`] (AdamW,
//! SGD, the warmup schedule, clipping), [`metrics`] (retrieval quality), [`checkpoint`]
//! (training checkpoints written atomically, exact resume) and [`trainer`] (the loop, and
//! the export of a finished run).

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod metrics;
pub mod optim;
pub mod shapes;
pub mod trainer;

pub use config::Config;
pub use trainer::{export_run, Event, Observer, PhaseTimes, Quiet, StepReport, Trainer};
