//! `gradcache merge`: one model from several trained models of one architecture.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use gradcache::hub::merge::{merge_models, MergeMethod};

/// The arguments of `gradcache merge`.
#[derive(Args)]
pub struct MergeArgs {
    /// A model directory to merge (an export, or any Hugging Face / sentence-transformers
    /// directory); give two or more, all of one architecture.
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
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
    let report = merge_models(&args.models, &args.weights, method, &args.output)?;
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
