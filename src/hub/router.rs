//! An inference-free sparse model as sentence-transformers saves it: `modules.json` holds
//! one `Router` (at the model's own directory), whose `router_config.json` sends queries
//! through a `SparseStaticEmbedding` (one weight per vocabulary entry; no transformer) and
//! documents through the masked-language model and its `SpladePooling`, each module in a
//! folder of its own (`query_0_SparseStaticEmbedding`, `document_0_Transformer`,
//! `document_1_SpladePooling`):
//!
//! ```json
//! {"types": {"query_0_SparseStaticEmbedding": "...SparseStaticEmbedding", ...},
//!  "structure": {"query": ["query_0_SparseStaticEmbedding"],
//!                "document": ["document_0_Transformer", "document_1_SpladePooling"]},
//!  "parameters": {"default_route": "document", "allow_empty_key": true, "route_mappings": {}}}
//! ```
//!
//! [`RouterLayout::read`] reads that layout (and only that one: another route or module is
//! refused by name); [`write_router`] writes it around a SPLADE export.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

pub use crate::hub::files::{
    is_router, Route, RouterLayout, DOCUMENT_DIR, DOCUMENT_POOLING_DIR, ROUTER_CONFIG, STATIC_DIR,
};
use crate::hub::files::{read_json, MODULES};
use crate::hub::Tokenizer;
use crate::{Error, Result};

/// The static weights `[vocab]` of the `SparseStaticEmbedding` in `dir`: its
/// `model.safetensors`' `weight`, or, for a module configured with an IDF file (`path` of
/// its config: `{token: weight}`), those weights on `tokenizer`'s tokens and 0 elsewhere.
pub fn read_static_weights(dir: &Path, tokenizer: &Tokenizer, vocab: usize) -> Result<Tensor> {
    let weights = dir.join(crate::hub::files::WEIGHTS);
    let weight = if weights.is_file() {
        let tensors = candle_core::safetensors::load(&weights, &Device::Cpu)?;
        tensors
            .get("weight")
            .ok_or_else(|| Error::ModelFile {
                path: weights.clone(),
                reason: "holds no `weight` (the SparseStaticEmbedding's one tensor)".into(),
            })?
            .to_dtype(DType::F32)?
    } else {
        let config = read_json(&dir.join("config.json"))?;
        let Some(file) = config["path"].as_str() else {
            return Err(Error::MissingFile {
                path: weights,
                what: "SparseStaticEmbedding weights",
            });
        };
        let path = dir.join(file);
        let idf = read_json(&path)?;
        let idf = idf.as_object().ok_or_else(|| Error::ModelFile {
            path: path.clone(),
            reason: "expected {token: weight}".into(),
        })?;
        let mut w = vec![0f32; vocab];
        for (token, value) in idf {
            if let (Some(id), Some(v)) = (tokenizer.inner().token_to_id(token), value.as_f64()) {
                if let Some(slot) = w.get_mut(id as usize) {
                    *slot = v as f32;
                }
            }
        }
        Tensor::new(w, &Device::Cpu)?
    };
    if weight.dims() != [vocab] {
        return Err(Error::ModelFile {
            path: dir.to_path_buf(),
            reason: format!(
                "the static query weights are {:?}; the document model's vocabulary has {vocab} \
                 entries (one weight each)",
                weight.dims()
            ),
        });
    }
    Ok(weight)
}

/// Writes the router around an export of the document model in `dir/DOCUMENT_DIR` (with its
/// pooling in `dir/DOCUMENT_POOLING_DIR`): `modules.json`, `router_config.json`, and the
/// static query weights with the tokenizer's files in `dir/STATIC_DIR`.
pub fn write_router(dir: &Path, weight: &Tensor, frozen: bool) -> Result<()> {
    let write = |path: PathBuf, value: &Value| -> Result<()> {
        let text = serde_json::to_string_pretty(value).map_err(|e| Error::ModelFile {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&path, text + "\n").map_err(|e| Error::io("write", &path, e))
    };
    let modules = json!([{
        "idx": 0, "name": "0", "path": "",
        "type": "sentence_transformers.base.modules.router.Router"
    }]);
    write(dir.join(MODULES), &modules)?;
    let router = json!({
        "types": {
            STATIC_DIR: "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding",
            DOCUMENT_DIR: "sentence_transformers.base.modules.transformer.Transformer",
            DOCUMENT_POOLING_DIR: "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling",
        },
        "structure": {
            "query": [STATIC_DIR],
            "document": [DOCUMENT_DIR, DOCUMENT_POOLING_DIR],
        },
        "parameters": {"default_route": "document", "allow_empty_key": true, "route_mappings": {}},
    });
    write(dir.join(ROUTER_CONFIG), &router)?;
    let query = dir.join(STATIC_DIR);
    std::fs::create_dir_all(&query).map_err(|e| Error::io("create", &query, e))?;
    write(query.join("config.json"), &json!({ "frozen": frozen }))?;
    let weights = query.join(crate::hub::files::WEIGHTS);
    let weight = weight.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("weight".to_string(), weight)]),
        &weights,
    )?;
    // The query side tokenizes with the document model's tokenizer.
    for file in [
        crate::hub::files::TOKENIZER,
        crate::hub::files::TOKENIZER_CONFIG,
    ] {
        let from = dir.join(DOCUMENT_DIR).join(file);
        if from.is_file() {
            std::fs::copy(&from, query.join(file)).map_err(|e| Error::io("copy", &from, e))?;
        }
    }
    Ok(())
}
