//! Weights read from safetensors files on request: [`WeightFile`] (one file, or a sharded
//! checkpoint's index and its shards), served through a [`super::ParamStore`].

use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};

use crate::{Error, Result};

/// A safetensors file opened for reading weights on request.
pub struct WeightFile {
    path: PathBuf,
    tensors: MmapedSafetensors,
    prefix: String,
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
            tensors,
            prefix: prefix.to_string(),
        })
    }

    /// The names of every tensor in the file (its prefix included).
    pub fn names(&self) -> Vec<String> {
        self.tensors.tensors().into_iter().map(|(n, _)| n).collect()
    }

    /// Whether the file holds a tensor named exactly `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.get(name).is_ok()
    }

    /// Whether the file serves `name` (its prefix prepended).
    pub(super) fn holds(&self, name: &str) -> bool {
        self.contains(&self.stored_name(name))
    }

    /// The name `name` is stored under: its prefix prepended, and a LayerNorm's
    /// `weight` / `bias` under the older `gamma` / `beta` where only those are there (as
    /// older BERT checkpoints and PyLate's saves have them; transformers reads both).
    fn stored_name(&self, name: &str) -> String {
        let full = format!("{}{name}", self.prefix);
        if self.contains(&full) || !full.contains("LayerNorm.") {
            return full;
        }
        let legacy = match full.rsplit_once('.') {
            Some((module, "weight")) => format!("{module}.gamma"),
            Some((module, "bias")) => format!("{module}.beta"),
            _ => return full,
        };
        if self.contains(&legacy) {
            legacy
        } else {
            full
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
        let full = self.stored_name(name);
        let view = self.tensors.get(&full).map_err(|_| Error::MissingWeight {
            name: full.clone(),
            path: self.path.clone(),
        })?;
        if view.shape() != shape.dims() {
            return Err(Error::WeightShape {
                name: full,
                path: self.path.clone(),
                found: view.shape().to_vec(),
                expected: shape.dims().to_vec(),
            });
        }
        Ok(self.tensors.load(&full, device)?.to_dtype(dtype)?)
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
