//! Training checkpoints: weights, optimiser state, step, data position and seeds, written
//! atomically with checksums, the last `keep` of them kept.
//!
//! A checkpoint is a directory `step-NNNNNNNN` holding `model.safetensors`,
//! `optimizer.safetensors` and `trainer_state.json`; the state records the size and
//! SHA-256 of both tensor files (`sha256sum` prints the same digests). It is first written
//! in full under a temporary name (`.tmp-step-NNNNNNNN`), every file and the directory
//! flushed to disk, and only then renamed to its final name: a run killed at any point
//! leaves either a complete checkpoint or a temporary directory that [`latest`] ignores
//! (and the next [`save`] removes). A write that fails (a full disk, a file size limit)
//! removes its temporary directory and leaves the older checkpoints as they were.
//!
//! Reading verifies: a file that is missing, shorter or longer than recorded, or whose
//! digest differs, makes the checkpoint [`Error::CorruptCheckpoint`] naming the file.
//! [`load`] of a checkpoints root takes the newest checkpoint that verifies and says which
//! newer ones it skipped and why ([`Checkpoint::skipped`]); a `step-N` directory named
//! directly is read or refused, never replaced by another.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use crate::durable;
use crate::params::Params;
use crate::train::data::Position;
use crate::{Error, Result};

const MODEL: &str = "model.safetensors";
const OPTIMIZER: &str = "optimizer.safetensors";
const STATE: &str = "trainer_state.json";
const PREFIX: &str = "step-";
const TMP: &str = ".tmp-";
const OLD: &str = ".old-";

/// What a checkpoint records about the run besides tensors.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// How many processes wrote it (a run may resume on another number: the cached step
    /// computes the full-batch gradient whatever the world size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<usize>,
    /// `train.steps` of the run that wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_steps: Option<u64>,
    /// The configuration's fingerprint leaving out the run's length (`train.steps`, the
    /// warmup as written): what a resume with `--extend` compares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length_free_fingerprint: Option<String>,
    /// Every extension of the run to more steps so far, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<Extension>,
    /// Size and SHA-256 of each tensor file, filled in by [`write_files`]; a checkpoint
    /// written before checksums has none and is read unverified.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileDigest>,
}

/// A run resumed with `--extend`: from `step`, the schedule of `to_steps` steps replaced
/// that of `from_steps`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Extension {
    /// The step the run was resumed at.
    pub step: u64,
    /// `train.steps` before.
    pub from_steps: u64,
    /// `train.steps` after.
    pub to_steps: u64,
}

/// The size and SHA-256 of a checkpoint file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256, lower-case hex.
    pub sha256: String,
}

impl FileDigest {
    /// The size and digest of the file at `path`.
    pub fn of(path: &Path) -> Result<Self> {
        let mut file = fs::File::open(path).map_err(|e| Error::io("read", path, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| Error::io("read", path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        let sha256 = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Self { bytes, sha256 })
    }
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
    /// Newer checkpoints of the same root that were passed over, each with the reason
    /// (a damaged or missing file): empty when the newest was read.
    pub skipped: Vec<String>,
}

fn name(step: u64) -> String {
    format!("{PREFIX}{step:08}")
}

/// The directory a checkpoint of `step` has under `root`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(name(step))
}

/// Writes the files of a checkpoint into `dir` (which must not exist), records the size
/// and digest of each tensor file in its state, and flushes everything. This is the first
/// half of [`save`]; the second is the rename.
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
    let optimizer: HashMap<String, Tensor> = optimizer.clone().into_iter().collect();
    let mut state = state.clone();
    state.files.clear();
    for (file, tensors) in [(MODEL, &model), (OPTIMIZER, &optimizer)] {
        let path = dir.join(file);
        candle_core::safetensors::save(tensors, &path).map_err(|e| Error::io("write", &path, e))?;
        state.files.insert(file.to_string(), FileDigest::of(&path)?);
    }
    let path = dir.join(STATE);
    let json = serde_json::to_string_pretty(&state).map_err(|e| Error::io("write", &path, e))?;
    fs::write(&path, json).map_err(|e| Error::io("write", &path, e))?;
    durable::sync_tree(dir)
}

/// Saves a checkpoint of `state.step` under `root` atomically, then deletes all but the
/// newest `keep` checkpoints (and any temporary leftovers). Returns its directory. When the
/// write fails, its temporary directory is removed and every older checkpoint is kept.
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
    if let Err(e) = write_files(&tmp, params, optimizer, state) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // A checkpoint of the same step already there (a resumed run saving again) is moved
    // aside first and removed only once the new one holds its name.
    let old = root.join(format!("{OLD}{}", name(state.step)));
    if final_dir.exists() {
        let _ = fs::remove_dir_all(&old);
        fs::rename(&final_dir, &old).map_err(|e| Error::io("rename into", &old, e))?;
    }
    if let Err(e) = fs::rename(&tmp, &final_dir) {
        let _ = fs::remove_dir_all(&tmp);
        if old.exists() {
            let _ = fs::rename(&old, &final_dir);
        }
        return Err(Error::io("rename into", &final_dir, e));
    }
    durable::sync_parent(&final_dir)?;
    let all = list(root)?;
    for (_, dir) in all.iter().rev().skip(keep.max(1)) {
        fs::remove_dir_all(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    for entry in fs::read_dir(root)
        .map_err(|e| Error::io("list", root, e))?
        .flatten()
    {
        let path = entry.path();
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        let leftover = file_name.starts_with(TMP) || file_name.starts_with(OLD);
        if leftover && path != tmp {
            let _ = fs::remove_dir_all(&path);
        }
    }
    Ok(final_dir)
}

/// The `step-N` directories under `root`, oldest first (complete or not: [`verify`]
/// tells).
fn candidates(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
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
        if dir.is_dir() {
            found.push((step, dir));
        }
    }
    found.sort();
    Ok(found)
}

/// Complete checkpoints under `root` (every file present), oldest first.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    Ok(candidates(root)?
        .into_iter()
        .filter(|(_, dir)| {
            [MODEL, OPTIMIZER, STATE]
                .iter()
                .all(|f| dir.join(f).is_file())
        })
        .collect())
}

/// The newest complete checkpoint under `root`, if any (not verified: see [`resolve`]).
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list(root)?.pop().map(|(_, d)| d))
}

/// Checks a checkpoint directory without loading its tensors: its state parses, both
/// tensor files are there, and their sizes and digests are the recorded ones. Returns the
/// state; a damaged checkpoint is [`Error::CorruptCheckpoint`] (or a missing or unreadable
/// file) naming the file.
pub fn verify(dir: &Path) -> Result<TrainerState> {
    let state = read_state(dir)?;
    for file in [MODEL, OPTIMIZER] {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(Error::CorruptCheckpoint {
                path,
                reason: "the file is missing".into(),
            });
        }
        let Some(expected) = state.files.get(file) else {
            continue;
        };
        let found = FileDigest::of(&path)?;
        if found.bytes != expected.bytes {
            let how = if found.bytes < expected.bytes {
                "truncated"
            } else {
                "longer than written"
            };
            return Err(Error::CorruptCheckpoint {
                path,
                reason: format!("{how}: {} bytes, {} recorded", found.bytes, expected.bytes),
            });
        }
        if found.sha256 != expected.sha256 {
            return Err(Error::CorruptCheckpoint {
                path,
                reason: format!(
                    "its SHA-256 is {}, {} was recorded",
                    found.sha256, expected.sha256
                ),
            });
        }
    }
    Ok(state)
}

/// A checkpoint found by [`resolve`].
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Its directory.
    pub dir: PathBuf,
    /// Its verified state.
    pub state: TrainerState,
    /// Newer checkpoints passed over, each with why.
    pub skipped: Vec<String>,
}

/// The checkpoint `path` names, verified: a `step-N` directory itself (refused if
/// damaged), or a root holding them: then the newest that verifies, with the newer ones
/// it passed over. A root with no intact checkpoint is an error listing what is wrong
/// with each.
pub fn resolve(path: &Path) -> Result<Resolved> {
    resolve_with(path, |dir| verify(dir).map(|state| (state, ()))).map(
        |(dir, (state, ()), skipped)| Resolved {
            dir,
            state,
            skipped,
        },
    )
}

/// [`resolve`] with a reader that may fail on its own (e.g. a tensor file that verifies but
/// does not parse, in a checkpoint written before checksums): the first candidate it reads
/// wins.
fn resolve_with<T>(
    path: &Path,
    read: impl Fn(&Path) -> Result<T>,
) -> Result<(PathBuf, T, Vec<String>)> {
    if path.join(STATE).is_file() {
        return read(path).map(|t| (path.to_path_buf(), t, Vec::new()));
    }
    let mut skipped = Vec::new();
    for (_, dir) in candidates(path)?.into_iter().rev() {
        match read(&dir) {
            Ok(t) => return Ok((dir, t, skipped)),
            Err(e) => skipped.push(format!("{} skipped: {e}", dir.display())),
        }
    }
    if skipped.is_empty() {
        return Err(Error::MissingFile {
            path: path.to_path_buf(),
            what: "checkpoint (no complete step-* directory)",
        });
    }
    Err(Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason: format!("no checkpoint under it is intact: {}", skipped.join("; ")),
    })
}

/// Reads a checkpoint's `trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE);
    let text = fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::CorruptCheckpoint {
            path: path.clone(),
            reason: "the file is missing".into(),
        },
        _ => Error::io("read", &path, e),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::CorruptCheckpoint {
        path,
        reason: format!("not a trainer state ({e})"),
    })
}

/// The path of a checkpoint's weights file (parameter names as the run's store has them).
pub fn model_file(dir: &Path) -> PathBuf {
    dir.join(MODEL)
}

fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, device).map_err(|e| Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason: format!("not a readable safetensors file ({e})"),
    })
}

/// Reads a checkpoint directory, verified (see [`resolve`]): a `step-N` directory, or a
/// root holding them: then the newest intact one, with the newer ones it skipped in
/// [`Checkpoint::skipped`].
pub fn load(path: &Path, device: &Device) -> Result<Checkpoint> {
    let read = |dir: &Path| -> Result<_> {
        let state = verify(dir)?;
        let model = read_tensors(&dir.join(MODEL), device)?;
        let optimizer: BTreeMap<String, Tensor> = read_tensors(&dir.join(OPTIMIZER), device)?
            .into_iter()
            .collect();
        Ok((state, model, optimizer))
    };
    let (dir, (state, model, optimizer), skipped) = resolve_with(path, read)?;
    Ok(Checkpoint {
        dir,
        model,
        optimizer,
        state,
        skipped,
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
