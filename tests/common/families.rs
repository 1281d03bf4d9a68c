//! The family fixtures of `tests/fixtures/families/` (written by
//! `scripts/make_family_fixtures.py`) and their references: the texts, queries and
//! passages, the reference loss, and the tensors transformers and sentence-transformers
//! computed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

/// The directory of fixture `family`.
pub fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(family)
}

/// A fixture's `reference.json` and `reference.safetensors`.
pub struct Reference {
    pub texts: Vec<String>,
    pub queries: Vec<String>,
    pub passages: Vec<String>,
    pub loss: f64,
    pub tensors: HashMap<String, Tensor>,
}

/// The references of fixture `family`.
pub fn reference(family: &str) -> Reference {
    let dir = fixture(family);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let list = |key: &str| -> Vec<String> {
        meta[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    Reference {
        texts: list("texts"),
        queries: list("queries"),
        passages: list("passages"),
        loss: meta["loss"].as_f64().unwrap(),
        tensors: candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
            .unwrap(),
    }
}

/// `&str`s of `v`.
pub fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
