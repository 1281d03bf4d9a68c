//! Training checkpoints: weights, optimiser state, step, data position and seeds, written
//! atomically, the last `keep` of them kept.
//!
//! A checkpoint is a directory `step-NNNNNNNN` holding `model.safetensors`,
//! `optimizer.safetensors` and `trainer_state.json`. It is first written in full under a
//! temporary name (`.tmp-step-NNNNNNNN`), every file flushed to disk, and only then renamed
//! to its final name: a run killed at any point leaves either a complete checkpoint or a
//! temporary directory that [`latest`] ignores (and the next [`save`] removes).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::params::Params;
use crate::train::data::Position;
use crate::{Error, Result};

const MODEL: &str = "model.safetensors";
const OPTIMIZER: &str = "optimizer.safetensors";
const STATE: &str = "trainer_state.json";
const PREFIX: &str = "step-";
const TMP: &str = ".tmp-";

/// What a checkpoint records about the run besides tensors.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the data loader stands.
    pub data: Position,
    /// A fingerprint of the configuration, to refuse resuming with another one.
    pub config_fingerprint: String,
    /// The dynamic loss scaler's state (f16 training).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<crate::precision::LossScaler>,
}

/// Everything read back from a checkpoint.
pub struct Checkpoint {
    /// The directory it was read from.
    pub dir: PathBuf,
    /// Parameter values by name.
    pub model: HashMap<String, Tensor>,
    /// Optimiser state by name.
    pub optimizer: BTreeMap<String, Tensor>,
    /// Step, data position, configuration fingerprint.
    pub state: TrainerState,
}

fn name(step: u64) -> String {
    format!("{PREFIX}{step:08}")
}

/// Writes the files of a checkpoint into `dir` (which must not exist) and flushes them.
/// This is the first half of [`save`]; the second is the rename.
pub fn write_files(
    dir: &Path,
    params: &Params,
    optimizer: &BTreeMap<String, Tensor>,
    state: &TrainerState,
) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let model: HashMap<String, Tensor> = params
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
        .collect();
    let path = dir.join(MODEL);
    candle_core::safetensors::save(&model, &path).map_err(|e| Error::io("write", &path, e))?;
    let optimizer: HashMap<String, Tensor> = optimizer.clone().into_iter().collect();
    let path = dir.join(OPTIMIZER);
    candle_core::safetensors::save(&optimizer, &path).map_err(|e| Error::io("write", &path, e))?;
    let path = dir.join(STATE);
    let json = serde_json::to_string_pretty(state).map_err(|e| Error::io("write", &path, e))?;
    fs::write(&path, json).map_err(|e| Error::io("write", &path, e))?;
    for file in [MODEL, OPTIMIZER, STATE] {
        let path = dir.join(file);
        fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("flush", &path, e))?;
    }
    Ok(())
}

/// Saves a checkpoint of `state.step` under `root` atomically, then deletes all but the
/// newest `keep` checkpoints (and any temporary leftovers). Returns its directory.
pub fn save(
    root: &Path,
    params: &Params,
    optimizer: &BTreeMap<String, Tensor>,
    state: &TrainerState,
    keep: usize,
) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(|e| Error::io("create", root, e))?;
    let final_dir = root.join(name(state.step));
    let tmp = root.join(format!("{TMP}{}", name(state.step)));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io("remove", &tmp, e))?;
    }
    write_files(&tmp, params, optimizer, state)?;
    if final_dir.exists() {
        fs::remove_dir_all(&final_dir).map_err(|e| Error::io("remove", &final_dir, e))?;
    }
    fs::rename(&tmp, &final_dir).map_err(|e| Error::io("rename into", &final_dir, e))?;
    if let Ok(d) = fs::File::open(root) {
        // Make the rename itself durable where the platform allows it.
        let _ = d.sync_all();
    }
    let all = list(root)?;
    for (_, dir) in all.iter().rev().skip(keep.max(1)) {
        fs::remove_dir_all(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    for entry in fs::read_dir(root)
        .map_err(|e| Error::io("list", root, e))?
        .flatten()
    {
        let path = entry.path();
        let leftover = entry.file_name().to_string_lossy().starts_with(TMP);
        if leftover && path != tmp {
            let _ = fs::remove_dir_all(&path);
        }
    }
    Ok(final_dir)
}

/// Complete checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(Error::io("list", root, e)),
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(step) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        if [MODEL, OPTIMIZER, STATE]
            .iter()
            .all(|f| dir.join(f).is_file())
        {
            found.push((step, dir));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list(root)?.pop().map(|(_, d)| d))
}

/// The checkpoint directory `path` names: a `step-N` directory itself, or a root holding
/// them (then the newest complete one).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(STATE).is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(|| Error::MissingFile {
        path: path.to_path_buf(),
        what: "checkpoint (no complete step-* directory)",
    })
}

/// Reads a checkpoint's `trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE);
    let text = fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::ModelFile {
        path,
        reason: e.to_string(),
    })
}

/// The path of a checkpoint's weights file (parameter names as the run's store has them).
pub fn model_file(dir: &Path) -> PathBuf {
    dir.join(MODEL)
}

fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, device).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Reads a checkpoint directory (a `step-N` directory, or a root holding them: then the
/// newest).
pub fn load(path: &Path, device: &Device) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let state = read_state(&dir)?;
    let model = read_tensors(&dir.join(MODEL), device)?;
    let optimizer = read_tensors(&dir.join(OPTIMIZER), device)?
        .into_iter()
        .collect();
    Ok(Checkpoint {
        dir,
        model,
        optimizer,
        state,
    })
}

/// Copies checkpointed values into the variables of `params`. Every parameter must be in
/// the checkpoint with its shape.
pub fn restore(params: &Params, model: &HashMap<String, Tensor>, dir: &Path) -> Result<()> {
    for (name, var) in params.iter() {
        let t = model.get(name).ok_or_else(|| Error::MissingWeight {
            name: name.to_string(),
            path: dir.join(MODEL),
        })?;
        if t.shape() != var.shape() {
            return Err(Error::WeightShape {
                name: name.to_string(),
                path: dir.join(MODEL),
                found: t.dims().to_vec(),
                expected: var.dims().to_vec(),
            });
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
