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

use crate::hub::files::{read_modules, MODULES};
use crate::hub::Tokenizer;
use crate::{Error, Result};

/// The router's own config, beside `modules.json`.
pub const ROUTER_CONFIG: &str = "router_config.json";
/// The folder sentence-transformers saves the query route's module in.
pub const STATIC_DIR: &str = "query_0_SparseStaticEmbedding";
/// The folders of the document route's modules.
pub const DOCUMENT_DIR: &str = "document_0_Transformer";
/// The document route's pooling.
pub const DOCUMENT_POOLING_DIR: &str = "document_1_SpladePooling";

const SUPPORTED: &str = "a Router whose query route is one SparseStaticEmbedding and whose \
    document route is a Transformer (fill-mask) and SpladePooling";

/// Which route a text takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The static weights.
    Query,
    /// The masked-language model.
    Document,
}

/// Where an inference-free model's parts are, relative to its directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterLayout {
    /// The `SparseStaticEmbedding`'s folder.
    pub query: PathBuf,
    /// The document route's modules (type and folder), in order.
    pub document: Vec<(String, PathBuf)>,
    /// The route of a text given without one (`default_route`).
    pub default_route: Route,
    /// Whether the static weights are frozen (`frozen` of their config).
    pub frozen: bool,
}

/// The class name of a module type (`...sparse_static_embedding.SparseStaticEmbedding`).
fn class(type_name: &str) -> &str {
    type_name.rsplit('.').next().unwrap_or(type_name)
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: "sentence-transformers module config",
        },
        _ => Error::io("read", path, e),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Whether `dir`'s `modules.json` is a single `Router` (an inference-free model, or
/// another routed model [`RouterLayout::read`] names the problem of).
pub fn is_router(dir: &Path) -> bool {
    let path = dir.join(MODULES);
    path.is_file() && read_modules(&path).is_ok_and(|m| m.len() == 1 && class(&m[0].0) == "Router")
}

impl RouterLayout {
    /// Reads `dir`'s router: the query route must be one `SparseStaticEmbedding`, the
    /// document route a transformer and a `SpladePooling`.
    pub fn read(dir: &Path) -> Result<Self> {
        let mut layout = Self::read_routes(dir)?;
        let static_config = dir.join(&layout.query).join("config.json");
        if static_config.is_file() {
            layout.frozen = read_json(&static_config)?["frozen"]
                .as_bool()
                .unwrap_or(false);
        }
        Ok(layout)
    }

    /// [`Self::read`] from `router_config.json` alone (the modules' own files unread:
    /// `frozen` false).
    pub fn read_routes(dir: &Path) -> Result<Self> {
        let path = dir.join(ROUTER_CONFIG);
        let config = read_json(&path)?;
        let unsupported = |value: String| Error::UnsupportedConfig {
            field: "router",
            value,
            supported: SUPPORTED,
            path: path.clone(),
        };
        let types = config["types"]
            .as_object()
            .ok_or_else(|| unsupported("no `types`".into()))?;
        let structure = config["structure"]
            .as_object()
            .ok_or_else(|| unsupported("no `structure`".into()))?;
        let route = |name: &str| -> Result<Vec<(String, PathBuf)>> {
            let ids = structure[name]
                .as_array()
                .ok_or_else(|| unsupported(format!("no `{name}` route")))?;
            ids.iter()
                .map(|id| {
                    let id = id.as_str().unwrap_or_default();
                    let ty = types[id]
                        .as_str()
                        .ok_or_else(|| unsupported(format!("module {id:?} has no type")))?;
                    // A module's folder is its id, inside the model's directory.
                    if id.is_empty() || id.contains("..") || Path::new(id).is_absolute() {
                        return Err(unsupported(format!("module folder {id:?}")));
                    }
                    Ok((ty.to_string(), PathBuf::from(id)))
                })
                .collect()
        };
        if let Some(other) = structure
            .keys()
            .find(|k| !matches!(k.as_str(), "query" | "document"))
        {
            return Err(unsupported(format!("a route named {other:?}")));
        }
        let query = route("query")?;
        let document = route("document")?;
        let [(ty, query)] = <[_; 1]>::try_from(query)
            .map_err(|q: Vec<_>| unsupported(format!("{} modules on the query route", q.len())))?;
        if class(&ty) != "SparseStaticEmbedding" {
            return Err(unsupported(format!("{ty} on the query route")));
        }
        let classes: Vec<&str> = document.iter().map(|(t, _)| class(t)).collect();
        if !matches!(
            classes.as_slice(),
            ["Transformer" | "MLMTransformer", "SpladePooling"]
        ) {
            return Err(unsupported(format!("document route {classes:?}")));
        }
        let parameters = &config["parameters"];
        // A mapping that sends a task to the route of its own name changes nothing.
        if let Some(mappings) = parameters["route_mappings"].as_object() {
            for (key, target) in mappings {
                let own = target
                    .as_str()
                    .is_some_and(|t| key.starts_with(&format!("('{t}'")));
                if !own {
                    return Err(unsupported(format!("route mapping {key} -> {target}")));
                }
            }
        }
        // Unset, sentence-transformers falls back to the first route when
        // `allow_empty_key` (the default) is set.
        let default_route = match parameters["default_route"].as_str() {
            Some("query") => Route::Query,
            Some("document") => Route::Document,
            Some(other) => return Err(unsupported(format!("default route {other:?}"))),
            None if parameters["allow_empty_key"].as_bool() == Some(false) => Route::Document,
            None => match structure.keys().next().map(String::as_str) {
                Some("query") => Route::Query,
                _ => Route::Document,
            },
        };
        Ok(Self {
            query,
            document,
            default_route,
            frozen: false,
        })
    }

    /// The document route's transformer folder.
    pub fn transformer(&self) -> &Path {
        &self.document[0].1
    }
}

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
