//! The trainer behind `gradcache train`: [`config`] (TOML with documented defaults),
//! [`sources`] (a mixture of training sets: which source each step draws, each with its
//! own prompts, hard negatives and loss; [`hub_data`] reads one from the Hub's cache),
//! [`data`] (pairs, held-out split, seeded resumable loader), [`formats`] (pairs from
//! JSONL, Tevatron, TSV/CSV and BEIR folders, plain or compressed), [`optim`] (AdamW,
//! SGD, the warmup schedule, clipping), [`metrics`] (retrieval quality), [`checkpoint`]
//! (training checkpoints written atomically, exact resume), [`run`] (the one training
//! loop and the [`Task`] trait every kind of training implements), [`trainer`] (text
//! pairs; the export of a finished run is `run_export`'s) and [`image_text`] (CLIP-style training
//! of a ResNet and a text tower on the generated [`shapes`] data set).
//!
//! A new kind of training implements [`Task`] (its batches, its inputs, its evaluation,
//! where its data stands) and hands its towers and loss to [`Run::from_parts`]; the loop,
//! the evaluation schedule, checkpoints and exact resume come with it (`tests/it/task.rs`
//! does this for a task the crate does not ship).

pub mod budget;
pub mod checkpoint;
pub mod config;
mod config_file;
pub mod data;
mod data_config;
pub mod formats;
pub mod hub_data;
pub mod image_text;
pub mod lock;
mod lora_config;
mod mixture;
pub use mixture::Served;
pub mod metrics;
mod model;
mod multi_vector_config;
pub mod optim;
pub mod report;
mod rerank_config;
pub mod rerank_task;
pub mod run;
mod run_export;
pub mod shapes;
pub mod sources;
mod sparse_config;
pub mod stream;
mod tasks;
mod text_data;
mod text_loss;
mod text_towers;
pub use text_towers::PairTower;
pub mod volumes;
pub use text_loss::{ActiveSource, TextLoss};
pub mod trainer;

pub use config::Config;
pub use run::{LoopConfig, Run, Task};
pub use trainer::{
    export_run, export_run_as, Event, ExportLayout, Observer, PhaseTimes, Quiet, StepReport,
    TextPairs, Trainer, DENSE_FILE,
};
