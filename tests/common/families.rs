//! The family fixtures of `tests/fixtures/families/` (written by
//! `scripts/make_family_fixtures.py`) and their references: the texts, queries and
//! passages, the reference loss, and the tensors transformers and sentence-transformers
//! computed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

/// The encoder families of the fixtures.
pub const ENCODERS: [&str; 11] = [
    "bert",
    "roberta",
    "xlm-roberta",
    "mpnet",
    "modernbert",
    "distilbert",
    "eurobert",
    "nomic_bert",
    "gte",
    "jina_embeddings_v3",
    "deberta-v2",
];

/// The decoder families of the fixtures.
pub const DECODERS: [&str; 5] = ["qwen3", "qwen2", "llama", "mistral", "gemma3_text"];

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
    reference_at(&fixture(family))
}

/// The `reference.json` and `reference.safetensors` of the fixture in `dir`.
pub fn reference_at(dir: &Path) -> Reference {
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

/// Checks one cached step against the reference: the loss within 1e-5 (relative, floored
/// at 1) of `loss_ref`, and each gradient within 1e-4 of `want`'s (relative to its largest
/// entry, floored at 1e-3 of the largest entry of them all). Returns how many gradients
/// were compared; a gradient without a reference fails.
pub fn assert_step_matches(
    what: &str,
    (loss, grads): (f32, &gradcache::Gradients),
    loss_ref: f64,
    want: &HashMap<String, &Tensor>,
) -> usize {
    assert!(
        (loss as f64 - loss_ref).abs() <= 1e-5 * loss_ref.abs().max(1.0),
        "{what}: loss {loss} against {loss_ref}"
    );
    let global = want.values().map(|g| super::max_abs(g)).fold(0.0, f64::max);
    let mut seen = 0;
    for (name, got) in grads.iter() {
        let reference = want
            .get(name)
            .unwrap_or_else(|| panic!("{what}: no reference gradient for `{name}`"));
        let err = super::max_diff(got, reference) / super::max_abs(reference).max(1e-3 * global);
        assert!(err <= 1e-4, "{what}: gradient of `{name}` off by {err:e}");
        seen += 1;
    }
    seen
}

/// A copy of the model directory `src` at `out`, its `file` (JSON) edited by `edit`.
pub fn edited_copy(
    src: &Path,
    out: &Path,
    file: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> PathBuf {
    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_dir() {
                found.extend(walk(&e.path()));
            } else {
                found.push(e.path());
            }
        }
        found
    }
    for entry in walk(src) {
        let to = out.join(entry.strip_prefix(src).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &to).unwrap();
    }
    let path = out.join(file);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
    out.to_path_buf()
}
