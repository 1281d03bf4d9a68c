//! `gradcache merge`: one model from several trained models of one architecture.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Args, ValueEnum};
use gradcache::dist::Backend;
use gradcache::hub::merge::{merge_models, MergeMethod};
use gradcache::train::{export_run_as, Config, ExportLayout};
use gradcache::Side;

/// The arguments of `gradcache merge`.
#[derive(Args)]
pub struct MergeArgs {
    /// A model directory to merge (an export, or any Hugging Face / sentence-transformers
    /// directory), or a training checkpoint of the run `--config` names; give two or
    /// more, all of one architecture.
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
    /// The run's TOML config, to merge its training checkpoints (each exported first, as
    /// `gradcache export --checkpoint` would, merged model for a LoRA run).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Config overrides used for the run.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Each model's weight, in the order of `--model` (normalised to sum to 1; default
    /// equal). For slerp, the second model's share is how far along the arc the result
    /// lies.
    #[arg(long = "weight")]
    weights: Vec<f64>,
    /// linear: the weighted average of every tensor; slerp: spherical interpolation
    /// between two models, tensor by tensor.
    #[arg(long, value_enum, default_value_t = MethodArg::Linear)]
    method: MethodArg,
    /// The new model directory (must not exist or be empty).
    #[arg(long)]
    output: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
enum MethodArg {
    Linear,
    Slerp,
}

/// Merges the models and writes the result.
pub fn merge(args: &MergeArgs) -> Result<()> {
    let method = match args.method {
        MethodArg::Linear => MergeMethod::Linear,
        MethodArg::Slerp => MergeMethod::Slerp,
    };
    let exported = Exported::of_checkpoints(args)?;
    let report = merge_models(&exported.models, &args.weights, method, &args.output)?;
    tracing::info!(
        "merged {} {} models ({}, weights {:?}): {} tensors in {}",
        args.models.len(),
        report.family,
        match method {
            MergeMethod::Linear => "linear",
            MergeMethod::Slerp => "slerp",
        },
        report.weights,
        report.tensors,
        args.output.display()
    );
    Ok(())
}

/// The models to merge, training checkpoints exported into directories beside the output
/// (removed when the merge is done or refused).
struct Exported {
    models: Vec<PathBuf>,
    temporary: Vec<PathBuf>,
}

impl Exported {
    fn of_checkpoints(args: &MergeArgs) -> Result<Self> {
        let is_checkpoint = |m: &Path| m.join("trainer_state.json").is_file();
        let mut out = Self {
            models: Vec::new(),
            temporary: Vec::new(),
        };
        if !args.models.iter().any(|m| is_checkpoint(m)) {
            out.models = args.models.clone();
            return Ok(out);
        }
        let Some(config) = &args.config else {
            // The library's refusal names the checkpoint.
            out.models = args.models.clone();
            return Ok(out);
        };
        gradcache::durable::refuse_non_empty(&args.output)?;
        let mut cfg = Config::load(config, &args.set)?;
        cfg.dist.backend = Backend::None;
        let name = args
            .output
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "merged".into());
        for (i, m) in args.models.iter().enumerate() {
            if !is_checkpoint(m) {
                out.models.push(m.clone());
                continue;
            }
            let dir = args
                .output
                .with_file_name(format!(".{name}.checkpoint-{i}.export"));
            out.temporary.push(dir.clone());
            export_run_as(&cfg, Some(m), &dir, Side::Query, ExportLayout::Merged)?;
            tracing::info!("exported checkpoint {} for the merge", m.display());
            out.models.push(dir);
        }
        Ok(out)
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        for dir in &self.temporary {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
