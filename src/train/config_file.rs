//! Config files: a TOML file read into a table, `--set a.b=value` overrides applied to
//! it, and the keys two configs differ in (ranks compare theirs).

use std::path::Path;

use crate::error::invalid;
use crate::{Error, Result};

/// The dotted keys whose values differ between two JSON renderings of a config, with both
/// values (`train.batch_size (128 vs 64)`).
pub fn differing_keys(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    fn walk(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        use serde_json::Value::Object;
        match (a, b) {
            (Object(x), Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let null = serde_json::Value::Null;
                    let name = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(
                        &name,
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                        out,
                    );
                }
            }
            _ if a != b => out.push(format!("{prefix} ({a} vs {b})")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", a, b, &mut out);
    out
}

/// Reads a TOML config file into a table (a missing file and bad TOML are errors naming
/// the file).
pub fn read_table(path: &Path) -> Result<toml::Table> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: "config file",
        },
        _ => Error::io("read", path, e),
    })?;
    toml::from_str(&text).map_err(|e| config_error(path, e.to_string()))
}

pub(super) fn config_error(path: &Path, reason: String) -> Error {
    Error::ConfigFile {
        path: path.to_path_buf(),
        reason,
    }
}

/// Applies one `a.b.c=value` override to a TOML table.
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let bad = |reason: &'static str| invalid("--set", assignment, reason);
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| bad("expected key=value"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(bad("the key has an empty part"));
    }
    let raw = raw.trim();
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or(toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let mut node = table;
    for part in &path[..path.len() - 1] {
        let entry = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = entry
            .as_table_mut()
            .ok_or_else(|| bad("a part of the key is not a section"))?;
    }
    node.insert(path[path.len() - 1].to_string(), value);
    Ok(())
}
