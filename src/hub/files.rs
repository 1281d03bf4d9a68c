//! Finding a model's files: a local directory, or a Hugging Face Hub repo id resolved
//! through `hf-hub`, honouring the local cache and offline mode.
//!
//! A model is named either by a directory that holds `config.json` and `model.safetensors`
//! (and usually `tokenizer.json`), or by a repo id such as
//! `sentence-transformers/all-MiniLM-L6-v2` (optionally `id@revision`). Repo ids are looked
//! up in the Hugging Face cache first (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, the layout `huggingface_hub` writes); with `HF_HUB_OFFLINE=1`
//! nothing else is tried, otherwise missing files are downloaded into that cache (cargo
//! feature `download`, on by default; without it the cache is all there is).
//!
//! An inference-free sparse model keeps its parts in folders its `Router` names
//! ([`RouterLayout`], read here; its weights in [`crate::hub::router`]): its files are its
//! document model's, with the layout beside them.
//!
//! Only safetensors weights are loaded: a PyTorch pickle checkpoint can run code when it is
//! unpickled, so a model that has only `pytorch_model.bin` gets an error saying how to
//! convert it.

use std::path::{Path, PathBuf};

use hf_hub::{Repo, RepoType};

use crate::{Error, Result};

/// The sentence-transformers module list of a model.
pub const MODULES: &str = "modules.json";
/// The pooling module's config, under the pooling module's directory.
pub const POOLING: &str = "1_Pooling/config.json";
/// The model-level sentence-transformers config (holds `similarity_fn_name`).
pub const SENTENCE_TRANSFORMERS_CONFIG: &str = "config_sentence_transformers.json";

/// The configuration file of a model.
pub const CONFIG: &str = "config.json";
/// The weights file.
pub const WEIGHTS: &str = "model.safetensors";
/// The index of a sharded checkpoint's weights (`model-00001-of-00004.safetensors`, ...).
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// The tokenizer file.
pub const TOKENIZER: &str = "tokenizer.json";
/// The tokenizer's config (padding side, special tokens, `model_max_length`).
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The file transformers 5 writes a tokenizer's chat template to.
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
/// sentence-transformers' config of its Transformer module (`max_seq_length`, tokenizer
/// kwargs).
pub const SENTENCE_BERT_CONFIG: &str = "sentence_bert_config.json";
/// Pickle checkpoints that are recognised (and refused).
const PICKLES: [&str; 2] = ["pytorch_model.bin", "model.bin"];

/// The files of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// The directory holding them (a Hub snapshot directory for a repo id), where the
    /// sentence-transformers files are looked for.
    pub dir: PathBuf,
    /// `config.json`.
    pub config: PathBuf,
    /// `model.safetensors`, or the index of a sharded checkpoint
    /// (`model.safetensors.index.json`, its shards beside it).
    pub weights: PathBuf,
    /// `tokenizer.json`, if the model has one.
    pub tokenizer: Option<PathBuf>,
    /// An inference-free sparse model ([`crate::hub::router`]): its own directory and
    /// router. The files above are then its document model's (its folder is `dir`).
    pub router: Option<(PathBuf, RouterLayout)>,
}

/// Where the Hugging Face cache is and whether the network may be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSettings {
    /// The hub cache directory (the one holding `models--org--name`).
    pub cache_dir: PathBuf,
    /// Offline mode: only the cache is read.
    pub offline: bool,
}

impl HubSettings {
    /// From the process environment (`HF_HUB_CACHE`, `HF_HOME`, `HF_HUB_OFFLINE`).
    pub fn from_env() -> Self {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// From any variable lookup, e.g. a map in tests.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Self {
        let cache_dir = match (var("HF_HUB_CACHE"), var("HF_HOME")) {
            (Some(cache), _) if !cache.is_empty() => PathBuf::from(cache),
            (_, Some(home)) if !home.is_empty() => PathBuf::from(home).join("hub"),
            _ => {
                let home = var("HOME").unwrap_or_else(|| ".".into());
                PathBuf::from(home)
                    .join(".cache")
                    .join("huggingface")
                    .join("hub")
            }
        };
        let offline = var("HF_HUB_OFFLINE")
            .map(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            })
            .unwrap_or(false);
        Self { cache_dir, offline }
    }
}

impl ModelFiles {
    /// Resolves `name`: an existing directory is read as is, anything else is a Hub repo id.
    pub fn resolve(name: &str, hub: &HubSettings) -> Result<Self> {
        let path = Path::new(name);
        if path.is_dir() {
            Self::from_dir(path)
        } else if path.exists() || name.starts_with('.') || name.starts_with('/') {
            Err(Error::MissingFile {
                path: path.to_path_buf(),
                what: "model directory",
            })
        } else {
            Self::from_hub(name, hub)
        }
    }

    /// The files of a model directory (of an inference-free model's, its document
    /// model's, with the router beside them).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.join(CONFIG).is_file() && is_router(dir) {
            let layout = RouterLayout::read(dir)?;
            let files = Self::from_dir(&dir.join(layout.transformer()))?;
            return Ok(Self {
                router: Some((dir.to_path_buf(), layout)),
                ..files
            });
        }
        let config = dir.join(CONFIG);
        if !config.is_file() {
            return Err(Error::MissingFile {
                path: config,
                what: "model config",
            });
        }
        let mut weights = dir.join(WEIGHTS);
        if !weights.is_file() && dir.join(WEIGHTS_INDEX).is_file() {
            weights = dir.join(WEIGHTS_INDEX);
        }
        if !weights.is_file() {
            if let Some(pickle) = PICKLES.iter().find(|p| dir.join(p).is_file()) {
                return Err(Error::PickleOnly {
                    dir: dir.to_path_buf(),
                    file: pickle.to_string(),
                });
            }
            return Err(Error::MissingFile {
                path: weights,
                what: "safetensors weights",
            });
        }
        let tokenizer = Some(dir.join(TOKENIZER)).filter(|p| p.is_file());
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            tokenizer,
            router: None,
        })
    }

    /// The files of a Hub repo (`org/name` or `org/name@revision`): from the cache, then,
    /// unless offline, downloaded into it.
    pub fn from_hub(id: &str, hub: &HubSettings) -> Result<Self> {
        let (repo_id, revision) = match id.split_once('@') {
            Some((r, rev)) => (r, rev),
            None => (id, "main"),
        };
        let repo = Repo::with_revision(repo_id.into(), RepoType::Model, revision.into());
        let cache = hf_hub::Cache::new(hub.cache_dir.clone()).repo(repo.clone());
        let fetch = |file: &str| -> Result<Option<PathBuf>> {
            if let Some(path) = cache.get(file) {
                return Ok(Some(path));
            }
            if hub.offline || !cfg!(feature = "download") {
                return Ok(None);
            }
            download(id, &repo, file, hub)
        };
        let missing = |file: &str| {
            let reason = if hub.offline {
                format!(
                    "not in the local cache {} and HF_HUB_OFFLINE is set",
                    hub.cache_dir.display()
                )
            } else if !cfg!(feature = "download") {
                format!(
                    "not in the local cache {}, and this build cannot download (cargo \
                     feature `download`)",
                    hub.cache_dir.display()
                )
            } else {
                "the repository has no such file".to_string()
            };
            hub_error(id, file, reason)
        };
        // An inference-free model keeps its parts in its router's folders: fetched into
        // the same snapshot, which then reads as a directory.
        if let Some(modules) = fetch(MODULES)? {
            let root = modules.parent().map(Path::to_path_buf).unwrap_or_default();
            if is_router(&root) {
                fetch(ROUTER_CONFIG)?.ok_or_else(|| missing(ROUTER_CONFIG))?;
                let layout = RouterLayout::read_routes(&root)?;
                fetch(SENTENCE_TRANSFORMERS_CONFIG)?;
                for (_, folder) in layout
                    .document
                    .iter()
                    .chain([&(String::new(), layout.query.clone())])
                {
                    let folder = folder.to_string_lossy();
                    for file in [
                        CONFIG,
                        WEIGHTS,
                        TOKENIZER,
                        TOKENIZER_CONFIG,
                        SENTENCE_BERT_CONFIG,
                    ] {
                        fetch(&format!("{folder}/{file}"))?;
                    }
                }
                return Self::from_dir(&root);
            }
        }
        let config = fetch(CONFIG)?.ok_or_else(|| missing(CONFIG))?;
        let weights = match fetch(WEIGHTS)? {
            Some(w) => w,
            // A sharded checkpoint: the index, then every shard it names.
            None if fetch(WEIGHTS_INDEX)?.is_some() => {
                let index = fetch(WEIGHTS_INDEX)?.ok_or_else(|| missing(WEIGHTS_INDEX))?;
                for shard in shard_names(&index)? {
                    fetch(&shard)?.ok_or_else(|| missing(&shard))?;
                }
                index
            }
            None => {
                if let Some(pickle) = PICKLES.iter().find(|p| cache.get(p).is_some()) {
                    return Err(Error::PickleOnly {
                        dir: config.parent().map(Path::to_path_buf).unwrap_or_default(),
                        file: pickle.to_string(),
                    });
                }
                return Err(missing(WEIGHTS));
            }
        };
        let tokenizer = fetch(TOKENIZER)?;
        // The sentence-transformers head (pooling, Dense modules, normalisation,
        // similarity, prompts, the token limit) and the tokenizer's config (padding side,
        // pad token, BOS/EOS) and chat template, when the repo has them: fetched into the same snapshot
        // directory.
        for file in [
            POOLING,
            SENTENCE_TRANSFORMERS_CONFIG,
            SENTENCE_BERT_CONFIG,
            TOKENIZER_CONFIG,
            CHAT_TEMPLATE,
        ] {
            fetch(file)?;
        }
        if let Some(modules) = fetch(MODULES)? {
            for file in module_files(&modules) {
                fetch(&file)?;
            }
        }
        Ok(Self {
            dir: config.parent().map(Path::to_path_buf).unwrap_or_default(),
            config,
            weights,
            tokenizer,
            router: None,
        })
    }
}

/// The shard file names of a sharded checkpoint's index (`weight_map`'s values, once each).
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io("read", index, e))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::ModelFile {
        path: index.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut names: Vec<String> = Vec::new();
    for file in value["weight_map"]
        .as_object()
        .into_iter()
        .flat_map(|m| m.values())
    {
        if let Some(f) = file.as_str() {
            if !names.iter().any(|n| n == f) {
                names.push(f.to_string());
            }
        }
    }
    Ok(names)
}

/// The module list of a `modules.json`: each module's type name and directory (relative
/// to the model's), in order.
pub fn read_modules(path: &Path) -> Result<Vec<(String, PathBuf)>> {
    let bad = |reason: String| Error::ModelFile {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    let modules: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let list = modules
        .as_array()
        .ok_or_else(|| bad("expected a list of modules".into()))?;
    list.iter()
        .map(|m| {
            let ty = m["type"]
                .as_str()
                .ok_or_else(|| bad(format!("a module without a type: {m}")))?;
            let dir = m["path"].as_str().unwrap_or_default();
            Ok((ty.to_string(), PathBuf::from(dir)))
        })
        .collect()
}

/// The files of the modules a `modules.json` lists after the transformer: each module's
/// `config.json`, and a `Dense` module's weights. An unreadable list names none (reading
/// the head later says what is wrong with it).
fn module_files(modules: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for (ty, dir) in read_modules(modules).unwrap_or_default() {
        let dir = dir.to_string_lossy();
        if dir.is_empty() {
            continue;
        }
        files.push(format!("{dir}/config.json"));
        if ty.ends_with("Dense") {
            files.push(format!("{dir}/model.safetensors"));
        }
    }
    files
}

/// Downloads `file` of `repo` into the cache; `None` when the repo has no such file.
#[cfg(feature = "download")]
fn download(id: &str, repo: &Repo, file: &str, hub: &HubSettings) -> Result<Option<PathBuf>> {
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(hub.cache_dir.clone())
        .with_progress(false)
        .build()
        .map_err(|e| hub_error(id, file, e.to_string()))?;
    match api.repo(repo.clone()).get(file) {
        Ok(path) => Ok(Some(path)),
        Err(e) if e.to_string().contains("404") => Ok(None),
        Err(e) => Err(hub_error(id, file, e.to_string())),
    }
}

/// Without the `download` feature nothing is fetched: the local cache is all there is.
#[cfg(not(feature = "download"))]
fn download(_: &str, _: &Repo, _: &str, _: &HubSettings) -> Result<Option<PathBuf>> {
    Ok(None)
}

fn hub_error(repo: &str, file: &str, reason: String) -> Error {
    Error::Hub {
        repo: repo.to_string(),
        file: file.to_string(),
        reason,
    }
}

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

/// A JSON file of a model's (a missing one named as a sentence-transformers module's
/// config).
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
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
