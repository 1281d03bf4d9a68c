//! Training data on the Hugging Face Hub: a source path
//! `hf://datasets/<owner>/<name>[@revision][/<path in the repo>]` is read from the hf-hub
//! cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, the layout
//! `huggingface_hub` writes: `datasets--owner--name/snapshots/<commit>/...`); when the
//! cache lacks it and `HF_HUB_OFFLINE` is not set, the repository's files under that path
//! are downloaded into the cache first (cargo feature `download`). What is then read is
//! the snapshot's folder or file, as a local path would be (a folder of Parquet shards,
//! the Hub's layout, reads in name order).

use std::path::PathBuf;

use crate::hub::files::HubSettings;
use crate::{Error, Result};

const SCHEME: &str = "hf://";

/// The local path of a source path: itself, or for `hf://datasets/...` its place in the
/// hf-hub cache (downloaded there first when allowed).
pub fn local_path(path: &str) -> Result<PathBuf> {
    local_path_with(path, &HubSettings::from_env())
}

/// [`local_path`] with the cache and offline setting given.
pub fn local_path_with(path: &str, hub: &HubSettings) -> Result<PathBuf> {
    let Some(rest) = path.strip_prefix(SCHEME) else {
        return Ok(PathBuf::from(path));
    };
    let bad = |reason: &'static str| Error::InvalidConfig {
        field: "data.sources.path",
        value: path.to_string(),
        reason,
    };
    let rest = rest.strip_prefix("datasets/").ok_or_else(|| {
        bad("a Hub source names a data set repository: hf://datasets/<owner>/<name>[/<path>]")
    })?;
    let mut parts = rest.splitn(3, '/');
    let (Some(owner), Some(name)) = (parts.next(), parts.next()) else {
        return Err(bad(
            "a Hub source names a data set repository: hf://datasets/<owner>/<name>[/<path>]",
        ));
    };
    let inner = parts.next().unwrap_or("").trim_matches('/').to_string();
    let (name, revision) = match name.split_once('@') {
        Some((n, r)) => (n, r.to_string()),
        None => (name, "main".to_string()),
    };
    if owner.is_empty() || name.is_empty() {
        return Err(bad(
            "a Hub source names a data set repository: hf://datasets/<owner>/<name>[/<path>]",
        ));
    }
    let id = format!("{owner}/{name}");
    if let Some(found) = cached(hub, owner, name, &revision, &inner) {
        return Ok(found);
    }
    let reason = if hub.offline {
        format!(
            "not in the local cache {} and HF_HUB_OFFLINE is set (unset it to download, or \
             fill the cache with `huggingface-cli download --repo-type dataset {id}`)",
            hub.cache_dir.display()
        )
    } else if !cfg!(feature = "download") {
        format!(
            "not in the local cache {}, and this build cannot download (cargo feature \
             `download`)",
            hub.cache_dir.display()
        )
    } else {
        download(&id, &revision, &inner, hub)?;
        if let Some(found) = cached(hub, owner, name, &revision, &inner) {
            return Ok(found);
        }
        "the repository has no files under this path".to_string()
    };
    Err(Error::Hub {
        repo: format!("datasets/{id}"),
        file: if inner.is_empty() { "/".into() } else { inner },
        reason,
    })
}

/// The cached snapshot's `inner` path (a file, a folder, or a glob with a match), if the
/// cache holds the revision.
fn cached(
    hub: &HubSettings,
    owner: &str,
    name: &str,
    revision: &str,
    inner: &str,
) -> Option<PathBuf> {
    let repo = hub.cache_dir.join(format!("datasets--{owner}--{name}"));
    let commit = std::fs::read_to_string(repo.join("refs").join(revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snapshot = repo.join("snapshots").join(commit);
    if !snapshot.is_dir() {
        return None;
    }
    let path = if inner.is_empty() {
        snapshot
    } else {
        snapshot.join(inner)
    };
    let text = path.to_string_lossy().into_owned();
    let found = if text.contains('*') || text.contains('?') {
        glob::glob(&text)
            .ok()?
            .filter_map(std::result::Result::ok)
            .next()
            .is_some()
    } else {
        path.exists()
    };
    found.then_some(path)
}

/// Downloads every file of the repository under `inner` (a folder, a file, or a glob)
/// into the cache.
#[cfg(feature = "download")]
fn download(id: &str, revision: &str, inner: &str, hub: &HubSettings) -> Result<()> {
    use hf_hub::{Repo, RepoType};
    let error = |e: String| Error::Hub {
        repo: format!("datasets/{id}"),
        file: inner.to_string(),
        reason: e,
    };
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(hub.cache_dir.clone())
        .with_progress(false)
        .build()
        .map_err(|e| error(e.to_string()))?;
    let repo = api.repo(Repo::with_revision(
        id.to_string(),
        RepoType::Dataset,
        revision.to_string(),
    ));
    let info = repo
        .info()
        .map_err(|e| error(format!("{e} (set HF_HUB_OFFLINE=1 to read the cache only)")))?;
    let pattern = glob::Pattern::new(inner).ok();
    for sibling in info.siblings {
        let file = sibling.rfilename;
        let wanted = inner.is_empty()
            || file == inner
            || file.starts_with(&format!("{inner}/"))
            || pattern.as_ref().is_some_and(|p| p.matches(&file));
        if wanted && !file.starts_with('.') {
            repo.get(&file).map_err(|e| error(e.to_string()))?;
        }
    }
    Ok(())
}

/// Without the `download` feature nothing is fetched.
#[cfg(not(feature = "download"))]
fn download(_: &str, _: &str, _: &str, _: &HubSettings) -> Result<()> {
    Ok(())
}
