//! Merging trained models of one architecture into one (`gradcache merge`): a weighted
//! average of every weight (`linear`), or the spherical interpolation of two models
//! (`slerp`, as Qwen3-Embedding merges its checkpoints and mergekit computes it: per
//! tensor, along the great circle between the two flattened weights).
//!
//! The inputs are model directories (exports, or any Hugging Face / sentence-transformers
//! directory): every `*.safetensors` file of the first one's tree is merged with the file
//! of the same path in the others (the model's weights, a sharded checkpoint's shards read
//! as one, each `Dense` module's), every other file is copied from the first. The result is
//! written under a temporary name and renamed when complete, so it loads like any export.
//! Models of different families, tensors missing from one model or of different shapes or
//! dtypes are refused, naming them, before anything is written.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::durable;
use crate::params::shards_of;
use crate::{Error, Result};

/// The model's weights, whole or as the shards its index names.
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// How the weights are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MergeMethod {
    /// The weighted average of every tensor (weights normalised to sum to 1).
    #[default]
    Linear,
    /// Spherical interpolation of two models at `t` = the second model's share of the
    /// weights: per tensor, `sin((1-t)W)/sin W * a + sin(tW)/sin W * b` with `W` the angle
    /// between the flattened tensors (the linear average where they are nearly parallel).
    Slerp,
}

/// What a merge wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeReport {
    /// The models' `model_type`.
    pub family: String,
    /// Tensors merged (all weight files together).
    pub tensors: usize,
    /// The weights used, normalised to sum to 1, one per model.
    pub weights: Vec<f64>,
}

/// Merges `models` with `weights` (one per model, equal when empty) into the new
/// directory `output`, which must not exist or be empty.
pub fn merge_models(
    models: &[PathBuf],
    weights: &[f64],
    method: MergeMethod,
    output: &Path,
) -> Result<MergeReport> {
    let weights = check_inputs(models, weights, method)?;
    durable::refuse_non_empty(output)?;
    let family = same_family(models)?;
    let files = weight_files(&models[0])?;
    let mut merged = Vec::new();
    let mut tensors = 0;
    for file in &files {
        let loaded = models
            .iter()
            .map(|m| read_weights(m, file))
            .collect::<Result<Vec<_>>>()?;
        let out = merge_tensors(models, file, &loaded, &weights, method)?;
        tensors += out.len();
        merged.push((file.clone(), out));
    }
    write_merged(&models[0], &files, merged, output)?;
    Ok(MergeReport {
        family,
        tensors,
        weights,
    })
}

/// The weights normalised to sum to 1, after checking the models and the method agree.
fn check_inputs(models: &[PathBuf], weights: &[f64], method: MergeMethod) -> Result<Vec<f64>> {
    let invalid = |what: &'static str, value: String, reason: &'static str| {
        Err(Error::InvalidArgument {
            what,
            value,
            reason,
        })
    };
    if models.len() < 2 {
        return invalid(
            "--model",
            models.len().to_string(),
            "a merge needs two models or more",
        );
    }
    if method == MergeMethod::Slerp && models.len() != 2 {
        return invalid(
            "--method slerp",
            format!("{} models", models.len()),
            "slerp interpolates between exactly two models",
        );
    }
    let weights = if weights.is_empty() {
        vec![1.0; models.len()]
    } else {
        weights.to_vec()
    };
    if weights.len() != models.len() {
        return invalid(
            "--weight",
            format!("{} weights for {} models", weights.len(), models.len()),
            "give one weight per model, or none for equal weights",
        );
    }
    if let Some(w) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return invalid(
            "--weight",
            w.to_string(),
            "weights must be finite and not negative",
        );
    }
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 {
        return invalid(
            "--weight",
            format!("{weights:?}"),
            "the weights must not all be 0",
        );
    }
    for m in models {
        if m.join("trainer_state.json").is_file() {
            return Err(Error::InvalidArgument {
                what: "--model",
                value: m.display().to_string(),
                reason: "is a training checkpoint: give the run's --config to merge its \
                         checkpoints (or export it first with gradcache export --checkpoint)",
            });
        }
        if !m.join("config.json").is_file() {
            return Err(Error::MissingFile {
                path: m.join("config.json"),
                what: "model config (a model directory to merge)",
            });
        }
    }
    Ok(weights.iter().map(|w| w / sum).collect())
}

/// The models' `model_type`, refused unless every model has the same.
fn same_family(models: &[PathBuf]) -> Result<String> {
    let family = |dir: &Path| -> Result<String> {
        let path = dir.join("config.json");
        let text = fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::ModelFile {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Ok(value["model_type"].as_str().unwrap_or("bert").to_string())
    };
    let first = family(&models[0])?;
    for m in &models[1..] {
        let other = family(m)?;
        if other != first {
            return Err(Error::ModelFile {
                path: m.join("config.json"),
                reason: format!(
                    "model_type `{other}` cannot be merged with `{first}` ({}): merge models \
                     of one architecture",
                    models[0].display()
                ),
            });
        }
    }
    Ok(first)
}

/// The weight files of `dir` by path relative to it: `model.safetensors` (also when the
/// model is sharded) and every other `*.safetensors` of its tree but the shards.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let shards: Vec<PathBuf> = if dir.join(INDEX).is_file() {
        shards_of(&dir.join(INDEX))?
    } else {
        Vec::new()
    };
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in fs::read_dir(&at).map_err(|e| Error::io("list", &at, e))? {
            let path = entry.map_err(|e| Error::io("list", &at, e))?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "safetensors")
                && !shards.contains(&path)
            {
                let rel = path.strip_prefix(dir).unwrap_or(&path).to_path_buf();
                files.push(rel);
            }
        }
    }
    if !shards.is_empty() {
        files.push(PathBuf::from(WEIGHTS));
    }
    files.sort();
    files.dedup();
    if !files.contains(&PathBuf::from(WEIGHTS)) {
        return Err(Error::MissingFile {
            path: dir.join(WEIGHTS),
            what: "model weights",
        });
    }
    Ok(files)
}

/// The tensors of weight file `rel` of model `dir` (its shards, for a sharded model's
/// `model.safetensors`).
fn read_weights(dir: &Path, rel: &Path) -> Result<HashMap<String, Tensor>> {
    let path = dir.join(rel);
    let load = |p: &Path| {
        candle_core::safetensors::load(p, &Device::Cpu).map_err(|e| Error::ModelFile {
            path: p.to_path_buf(),
            reason: e.to_string(),
        })
    };
    if rel == Path::new(WEIGHTS) && !path.is_file() && dir.join(INDEX).is_file() {
        let mut all = HashMap::new();
        for shard in shards_of(&dir.join(INDEX))? {
            all.extend(load(&shard)?);
        }
        return Ok(all);
    }
    if !path.is_file() {
        return Err(Error::MissingFile {
            path,
            what: "weight file the first model has",
        });
    }
    load(&path)
}

/// One merged tensor per name of the first model's file `rel`.
fn merge_tensors(
    models: &[PathBuf],
    rel: &Path,
    loaded: &[HashMap<String, Tensor>],
    weights: &[f64],
    method: MergeMethod,
) -> Result<HashMap<String, Tensor>> {
    let mismatch = |model: &Path, reason: String| Error::ModelFile {
        path: model.join(rel),
        reason,
    };
    for (m, tensors) in models.iter().zip(loaded).skip(1) {
        if let Some(name) = tensors.keys().find(|n| !loaded[0].contains_key(*n)) {
            return Err(mismatch(
                m,
                format!("tensor `{name}` is not in {}", models[0].display()),
            ));
        }
    }
    let mut out = HashMap::new();
    for (name, first) in &loaded[0] {
        let mut parts = vec![first.clone()];
        for (m, tensors) in models.iter().zip(loaded).skip(1) {
            let t = tensors
                .get(name)
                .ok_or_else(|| mismatch(m, format!("tensor `{name}` is missing")))?;
            if t.dims() != first.dims() || t.dtype() != first.dtype() {
                return Err(mismatch(
                    m,
                    format!(
                        "tensor `{name}` is {:?} {:?}, {:?} {:?} in {}",
                        t.dtype(),
                        t.dims(),
                        first.dtype(),
                        first.dims(),
                        models[0].display()
                    ),
                ));
            }
            parts.push(t.clone());
        }
        out.insert(name.clone(), merge_one(name, &parts, weights, method)?);
    }
    Ok(out)
}

/// The merge of one tensor's versions, computed in f32 and stored in their dtype. Integer
/// tensors (position ids and the like) are not weights: they must be equal and are kept.
fn merge_one(name: &str, parts: &[Tensor], weights: &[f64], method: MergeMethod) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    if !dtype.is_float() {
        for p in &parts[1..] {
            let differs = p.ne(&parts[0])?.to_dtype(DType::F32)?.sum_all()?;
            if differs.to_scalar::<f32>()? != 0.0 {
                return Err(Error::InvalidArgument {
                    what: "tensor",
                    value: format!("`{name}`"),
                    reason: "is an integer tensor that differs between the models",
                });
            }
        }
        return Ok(parts[0].clone());
    }
    let wide = parts
        .iter()
        .map(|p| p.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let merged = match method {
        MergeMethod::Linear => {
            let mut sum = (&wide[0] * weights[0])?;
            for (p, w) in wide.iter().zip(weights).skip(1) {
                sum = (sum + (p * *w)?)?;
            }
            sum
        }
        MergeMethod::Slerp => slerp(&wide[0], &wide[1], weights[1])?,
    };
    Ok(merged.to_dtype(dtype)?)
}

/// Spherical interpolation from `a` (t = 0) to `b` (t = 1), the linear one where the two
/// are nearly parallel or one is zero.
fn slerp(a: &Tensor, b: &Tensor, t: f64) -> Result<Tensor> {
    let norm = |x: &Tensor| -> Result<f64> {
        Ok(f64::from(x.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt())
    };
    let (na, nb) = (norm(a)?, norm(b)?);
    let lerp = || -> Result<Tensor> { Ok(((a * (1.0 - t))? + (b * t)?)?) };
    if na == 0.0 || nb == 0.0 {
        return lerp();
    }
    let dot = f64::from((a * b)?.sum_all()?.to_scalar::<f32>()?) / (na * nb);
    let dot = dot.clamp(-1.0, 1.0);
    if dot.abs() > 0.9995 {
        return lerp();
    }
    let omega = dot.acos();
    let sin = omega.sin();
    let (wa, wb) = (((1.0 - t) * omega).sin() / sin, (t * omega).sin() / sin);
    Ok(((a * wa)? + (b * wb)?)?)
}

/// Writes the merged weight files and a copy of every other file of `first` under a
/// temporary directory beside `output`, then renames it into place.
fn write_merged(
    first: &Path,
    files: &[PathBuf],
    merged: Vec<(PathBuf, HashMap<String, Tensor>)>,
    output: &Path,
) -> Result<()> {
    let tmp = durable::temporary_dir(output, "merge")?;
    let written = (|| -> Result<()> {
        let skip: Vec<PathBuf> = if first.join(INDEX).is_file() {
            let mut s = shards_of(&first.join(INDEX))?;
            s.push(first.join(INDEX));
            s
        } else {
            Vec::new()
        };
        copy_tree(first, &tmp, &|p: &Path| {
            skip.iter().any(|s| s == p) || files.iter().any(|f| first.join(f) == p)
        })?;
        for (rel, tensors) in merged {
            let path = tmp.join(&rel);
            if let Some(dir) = path.parent() {
                fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
            }
            candle_core::safetensors::save(&tensors, &path)
                .map_err(|e| Error::io("write", &path, e))?;
            // The safetensors writer creates its file private (0600): give it the
            // permissions of the copied config.
            let shared = fs::metadata(tmp.join("config.json"))
                .map_err(|e| Error::io("read", &tmp.join("config.json"), e))?
                .permissions();
            fs::set_permissions(&path, shared)
                .map_err(|e| Error::io("set permissions of", &path, e))?;
        }
        durable::publish_dir(&tmp, output)
    })();
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}

/// Copies the tree `from` into `to`, leaving out the files `skip` names.
fn copy_tree(from: &Path, to: &Path, skip: &dyn Fn(&Path) -> bool) -> Result<()> {
    fs::create_dir_all(to).map_err(|e| Error::io("create", to, e))?;
    for entry in fs::read_dir(from).map_err(|e| Error::io("list", from, e))? {
        let path = entry.map_err(|e| Error::io("list", from, e))?.path();
        let dest = to.join(path.file_name().unwrap_or_default());
        if path.is_dir() {
            copy_tree(&path, &dest, skip)?;
        } else if !skip(&path) {
            fs::copy(&path, &dest).map_err(|e| Error::io("copy", &path, e))?;
        }
    }
    Ok(())
}
