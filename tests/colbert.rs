//! A tiny ColBERT saved by PyLate 1.6 and by sentence-transformers 6.2
//! (tests/fixtures/colbert, written by scripts/make_colbert_fixtures.py): both
//! directories load, embed every query and document to the packages' token vectors, and
//! the cached MaxSim loss and every parameter's gradient equal PyLate's `Contrastive` and
//! sentence-transformers' `MultiVectorMultipleNegativesRankingLoss` on four (query,
//! positive, hard negative) triples, in several chunkings and under recompute.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use gradcache::hub::multi_vector::{Layout, MultiVectorConfig};
use gradcache::hub::MultiVectorModel;
use gradcache::recompute::Recompute;
use gradcache::{GradCache, MaxSim};

mod common;
use common::{max_abs, max_diff};

fn fixture(layout: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/colbert")
        .join(layout)
}

struct Reference {
    meta: serde_json::Value,
    tensors: HashMap<String, Tensor>,
}

impl Reference {
    fn read(layout: &str) -> Self {
        let dir = fixture(layout);
        let meta =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let tensors =
            candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
                .unwrap();
        Self { meta, tensors }
    }

    fn texts(&self, key: &str) -> Vec<String> {
        self.meta[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn both_layouts_are_read_with_their_settings() {
    for (layout, want) in [
        ("pylate", Layout::PyLate),
        ("st6", Layout::SentenceTransformers),
    ] {
        let c = MultiVectorConfig::read(&fixture(layout)).unwrap();
        assert_eq!(c.layout, want);
        assert_eq!(
            (c.query_prefix.as_str(), c.document_prefix.as_str()),
            ("[Q] ", "[D] ")
        );
        assert_eq!((c.query_length, c.document_length), (12, 20));
        assert!(c.query_expansion && !c.attend_to_expansion_tokens);
        assert!(c.skiplist_words.contains(&",".to_string()));
        assert_eq!(c.dense.len(), 1);
        assert_eq!(c.dim(32), 8);
    }
}

#[test]
fn token_embeddings_match_pylate_and_sentence_transformers() {
    for layout in ["pylate", "st6"] {
        let r = Reference::read(layout);
        let model =
            MultiVectorModel::load(fixture(layout).to_str().unwrap(), &Device::Cpu).unwrap();
        for (side, key) in [("query", "query_texts"), ("document", "document_texts")] {
            let texts = r.texts(key);
            let got = match side {
                "query" => model.query_vectors(&refs(&texts), 3).unwrap(),
                _ => model.document_vectors(&refs(&texts), 3).unwrap(),
            };
            for (i, g) in got.iter().enumerate() {
                let want = &r.tensors[&format!("{side}.{i}")];
                assert_eq!(g.dims(), want.dims(), "{layout} {side} {i}: {:?}", texts[i]);
                let diff = max_diff(g, want);
                assert!(diff <= 1e-5, "{layout} {side} {i}: off by {diff:e}");
            }
        }
    }
}

#[test]
fn loss_and_gradients_match_the_packages_in_chunks_and_under_recompute() {
    for layout in ["pylate", "st6"] {
        let r = Reference::read(layout);
        let want_loss = r.meta["loss"].as_f64().unwrap();
        let want: HashMap<&str, &Tensor> = r
            .tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
            .collect();
        let global = want.values().map(|g| max_abs(g)).fold(0.0, f64::max);
        let (queries, positives, negatives) = (
            r.texts("queries"),
            r.texts("positives"),
            r.texts("negatives"),
        );
        let passages: Vec<&str> = positives
            .iter()
            .zip(&negatives)
            .flat_map(|(p, n)| [p.as_str(), n.as_str()])
            .collect();
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::Off),
            (3, Recompute::EveryLayer),
        ] {
            let model =
                MultiVectorModel::load(fixture(layout).to_str().unwrap(), &Device::Cpu).unwrap();
            let (qt, dt) = model.tokenizers();
            let q = qt.encode(&refs(&queries), &Device::Cpu).unwrap();
            let p = dt.encode(&passages, &Device::Cpu).unwrap();
            let loss = MaxSim::new(model.dim()).unwrap();
            let (mut encoder, _store) = model.into_encoder();
            encoder.set_policy(recompute.clone()).unwrap();
            let gc = GradCache::shared(encoder, chunk, loss)
                .unwrap()
                .with_dropout(false);
            let out = gc.cache_step(0, &q, &p).unwrap();
            let what = format!("{layout}, chunk {chunk}, {recompute:?}");
            assert!(
                (out.loss as f64 - want_loss).abs() <= 1e-5 * want_loss,
                "{what}: loss {} against {want_loss}",
                out.loss
            );
            let mut seen = 0;
            for (name, got) in out.grads.iter() {
                let reference = want
                    .get(name)
                    .unwrap_or_else(|| panic!("{what}: no reference gradient for `{name}`"));
                let err = max_diff(got, reference) / max_abs(reference).max(1e-3 * global);
                assert!(err <= 1e-4, "{what}: gradient of `{name}` off by {err:e}");
                seen += 1;
            }
            assert_eq!(seen, want.len(), "{what}: every parameter gets a gradient");
        }
    }
}
