//! Weights read from safetensors files on request: [`WeightFile`] (one file, or a sharded
//! checkpoint's index and its shards), served through a [`super::ParamStore`].

use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};

use crate::{Error, Result};

/// A safetensors file opened for reading weights on request.
pub struct WeightFile {
    path: PathBuf,
    tensors: Source,
    prefix: String,
}

/// Where the tensors are: the file mapped, or read and renamed in memory.
enum Source {
    Mapped(MmapedSafetensors),
    Memory(std::collections::HashMap<String, Tensor>),
}

impl WeightFile {
    /// Opens `path` (memory-mapped): a safetensors file, or the index of a sharded
    /// checkpoint (`model.safetensors.index.json`, as the 4B and 8B decoders ship), whose
    /// shards beside it are opened together. `prefix` is prepended to every requested
    /// name, e.g. `"bert."` for checkpoints saved from a Hugging Face `BertFor...` head
    /// model.
    pub fn open(path: &Path, prefix: &str) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::MissingFile {
                path: path.to_path_buf(),
                what: "safetensors weights",
            });
        }
        let bad = |reason: String| Error::ModelFile {
            path: path.to_path_buf(),
            reason,
        };
        let tensors = if path.to_string_lossy().ends_with(".index.json") {
            let shards = shards_of(path)?;
            // SAFETY: the files are mapped read-only; as with any memory-mapped model
            // file, they must not be modified while the store is alive.
            unsafe { MmapedSafetensors::multi(&shards) }.map_err(|e| bad(e.to_string()))?
        } else {
            // SAFETY: as above.
            unsafe { MmapedSafetensors::new(path) }.map_err(|e| bad(e.to_string()))?
        };
        Ok(Self {
            path: path.to_path_buf(),
            tensors: Source::Mapped(tensors),
            prefix: prefix.to_string(),
        })
    }

    /// Tensors read from `path` and held in memory under other names (a PEFT adapter's
    /// renamed to the checkpoint's); `path` is named in errors.
    pub fn from_tensors(path: &Path, tensors: std::collections::HashMap<String, Tensor>) -> Self {
        Self {
            path: path.to_path_buf(),
            tensors: Source::Memory(tensors),
            prefix: String::new(),
        }
    }

    /// Every tensor of the file, with the file's names (its prefix included).
    pub fn read_all(&self) -> Result<std::collections::HashMap<String, Tensor>> {
        match &self.tensors {
            Source::Mapped(m) => m
                .tensors()
                .into_iter()
                .map(|(n, _)| Ok((n.clone(), m.load(&n, &Device::Cpu)?)))
                .collect(),
            Source::Memory(t) => Ok(t.clone()),
        }
    }

    /// The names of every tensor in the file (its prefix included).
    pub fn names(&self) -> Vec<String> {
        match &self.tensors {
            Source::Mapped(m) => m.tensors().into_iter().map(|(n, _)| n).collect(),
            Source::Memory(t) => t.keys().cloned().collect(),
        }
    }

    /// Whether the file holds a tensor named exactly `name`.
    pub fn contains(&self, name: &str) -> bool {
        match &self.tensors {
            Source::Mapped(m) => m.get(name).is_ok(),
            Source::Memory(t) => t.contains_key(name),
        }
    }

    /// Whether the file serves `name` (its prefix prepended).
    pub(super) fn holds(&self, name: &str) -> bool {
        self.contains(&self.stored_name(name).0)
    }

    /// The name `name` is stored under, and the index along its first dimension where
    /// `name` is one slice of it: its prefix prepended; a LayerNorm's `weight` / `bias`
    /// under the older `gamma` / `beta` where only those are there (as older BERT
    /// checkpoints and PyLate's saves have them; transformers reads both); a weight
    /// PyTorch parametrized (Jina v3's release: `<m>.parametrizations.weight.original`)
    /// under that name; and task `t`'s adapter of such a module (`<m>.lora_A.task{t}`)
    /// as slice `t` of the stack of every task's (`<m>.parametrizations.weight.0.lora_A`,
    /// `[tasks, ..]`).
    fn stored_name(&self, name: &str) -> (String, Option<usize>) {
        let full = format!("{}{name}", self.prefix);
        if self.contains(&full) {
            return (full, None);
        }
        if let Some((module, leaf, task)) = crate::names::task_adapter_name(&full) {
            return (
                format!("{module}.parametrizations.weight.0.{leaf}"),
                Some(task),
            );
        }
        if let Some(module) = full.strip_suffix(".weight") {
            let original = format!("{module}.parametrizations.weight.original");
            if self.contains(&original) {
                return (original, None);
            }
        }
        if !full.contains("LayerNorm.") {
            return (full, None);
        }
        let legacy = match full.rsplit_once('.') {
            Some((module, "weight")) => format!("{module}.gamma"),
            Some((module, "bias")) => format!("{module}.beta"),
            _ => return (full, None),
        };
        if self.contains(&legacy) {
            (legacy, None)
        } else {
            (full, None)
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn load(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let (full, slice) = self.stored_name(name);
        let missing = || Error::MissingWeight {
            name: full.clone(),
            path: self.path.clone(),
        };
        let stored = match &self.tensors {
            Source::Mapped(m) => m.get(&full).map_err(|_| missing())?.shape().to_vec(),
            Source::Memory(t) => t.get(&full).ok_or_else(missing)?.dims().to_vec(),
        };
        // A task's slice of a stack: its shape without the first dimension, whose length
        // is the number of tasks.
        let found = match slice {
            Some(t) if stored.first().is_some_and(|&n| t < n) => stored[1..].to_vec(),
            Some(t) => {
                return Err(Error::ModelFile {
                    path: self.path.clone(),
                    reason: format!(
                        "`{full}` {stored:?} holds no adapter of task {t} (its first \
                         dimension counts the tasks)"
                    ),
                })
            }
            None => stored,
        };
        if found != shape.dims() {
            return Err(Error::WeightShape {
                name: full,
                path: self.path.clone(),
                found,
                expected: shape.dims().to_vec(),
            });
        }
        let t = match &self.tensors {
            Source::Mapped(m) => m.load(&full, device)?,
            Source::Memory(t) => t[&full].to_device(device)?,
        };
        let t = match slice {
            Some(i) => t.narrow(0, i, 1)?.squeeze(0)?.contiguous()?,
            None => t,
        };
        Ok(t.to_dtype(dtype)?)
    }
}

/// The shard files a sharded checkpoint's index names (`weight_map`'s values, each once,
/// beside the index), each checked to exist.
pub fn shards_of(index: &Path) -> Result<Vec<PathBuf>> {
    let bad = |reason: String| Error::ModelFile {
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| Error::io("read", index, e))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = value["weight_map"]
        .as_object()
        .ok_or_else(|| bad("no `weight_map` of tensor names to shard files".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shards: Vec<PathBuf> = Vec::new();
    for file in map.values() {
        let name = file
            .as_str()
            .filter(|f| !f.is_empty() && !f.contains(['/', '\\']))
            .ok_or_else(|| bad(format!("`weight_map` names {file}, not a file beside it")))?;
        let path = dir.join(name);
        if !shards.contains(&path) {
            if !path.is_file() {
                return Err(Error::MissingFile {
                    path,
                    what: "safetensors shard",
                });
            }
            shards.push(path);
        }
    }
    if shards.is_empty() {
        return Err(bad("`weight_map` names no shard".into()));
    }
    Ok(shards)
}
