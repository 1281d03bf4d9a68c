//! A tiny ColBERT saved by PyLate 1.6 and by sentence-transformers 6.2
//! (tests/fixtures/colbert, written by scripts/make_colbert_fixtures.py): both
//! directories load, embed every query and document to the packages' token vectors, and
//! the cached MaxSim loss and every parameter's gradient equal PyLate's `Contrastive` and
//! sentence-transformers' `MultiVectorMultipleNegativesRankingLoss` on four (query,
//! positive, hard negative) triples, and PyLate's `Distillation` on four queries of three
//! passages with teacher scores, in several chunkings and under recompute.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use gradcache::hub::multi_vector::{Layout, MultiVectorConfig};
use gradcache::hub::MultiVectorModel;
use gradcache::recompute::Recompute;
use gradcache::{GradCache, Loss, MaxSim, MaxSimDistillation, TeacherScores};

use crate::common::{max_abs, max_diff};

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
        let read = MultiVectorConfig::read(&fixture(layout)).unwrap();
        assert_eq!(read.layout, want);
        assert_eq!(read.dense.len(), 1);
        let c = &read.head;
        assert_eq!(
            (c.query_prefix.as_str(), c.document_prefix.as_str()),
            ("[Q] ", "[D] ")
        );
        assert_eq!((c.query_length, c.document_length), (12, 20));
        assert!(c.query_expansion && !c.attend_to_expansion_tokens);
        assert!(c.skiplist_words.contains(&",".to_string()));
        assert_eq!(c.dim, 8, "the projection's width");
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
        let want = Expected::new(
            layout,
            r.meta["loss"].as_f64().unwrap(),
            &r.tensors,
            "grad.",
        );
        want.check(layout, &refs(&queries), &passages, |dim| {
            MaxSim::new(dim).unwrap()
        });
    }
}

#[test]
fn distillation_matches_pylate_in_chunks_and_under_recompute() {
    // PyLate's `Distillation` over each query's (positive, negative, next positive) with
    // teacher scores, `normalize_scores` on (its default) and off.
    let dir = fixture("pylate");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("distillation.json")).unwrap())
            .unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("distillation.safetensors"), &Device::Cpu).unwrap();
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    let queries = strings(&meta["queries"]);
    let passages: Vec<String> = meta["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(strings)
        .collect();
    let teacher: Vec<Vec<f32>> = serde_json::from_value(meta["teacher"].clone()).unwrap();
    let teacher = Tensor::new(teacher, &Device::Cpu).unwrap();
    for (key, normalize) in [("normalized", true), ("raw", false)] {
        let want = Expected::new(
            "pylate",
            meta[format!("{key}_loss")].as_f64().unwrap(),
            &tensors,
            &format!("{key}.grad."),
        );
        let cell = TeacherScores::new();
        cell.set(&teacher).unwrap();
        want.check(
            &format!("distillation ({key})"),
            &refs(&queries),
            &refs(&passages),
            |dim| {
                MaxSimDistillation::new(dim, cell.clone())
                    .unwrap()
                    .with_normalized_scores(normalize)
            },
        );
    }
}

/// A package's loss and parameter gradients on the fixture model.
struct Expected<'a> {
    /// The fixture directory the model is read from (`pylate`, `st6`).
    layout: &'a str,
    loss: f64,
    grads: HashMap<&'a str, &'a Tensor>,
}

impl<'a> Expected<'a> {
    /// The loss and the gradients stored under `prefix` + parameter name.
    fn new(layout: &'a str, loss: f64, tensors: &'a HashMap<String, Tensor>, prefix: &str) -> Self {
        let grads = tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n, v)))
            .collect();
        Self {
            layout,
            loss,
            grads,
        }
    }

    /// A cached step of the fixture model under the loss `make` builds (from the
    /// token width), in chunks of 4, 1 and 3 (under recompute), equals the package's
    /// loss (<= 1e-5) and every gradient (<= 1e-4, floored at 1e-3 of the largest).
    fn check<L: Loss>(
        &self,
        what: &str,
        queries: &[&str],
        passages: &[&str],
        make: impl Fn(usize) -> L,
    ) {
        let global = self.grads.values().map(|g| max_abs(g)).fold(0.0, f64::max);
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::Off),
            (3, Recompute::EveryLayer),
        ] {
            let model =
                MultiVectorModel::load(fixture(self.layout).to_str().unwrap(), &Device::Cpu)
                    .unwrap();
            let (qt, dt) = model.tokenizers();
            let q = qt.encode(queries, &Device::Cpu).unwrap();
            let p = dt.encode(passages, &Device::Cpu).unwrap();
            let loss = make(model.dim());
            let (mut encoder, _store) = model.into_encoder();
            encoder.set_policy(recompute.clone()).unwrap();
            let gc = GradCache::shared(encoder, chunk, loss)
                .unwrap()
                .with_dropout(false);
            let out = gc.cache_step(0, &q, &p).unwrap();
            let what = format!("{what}, chunk {chunk}, {recompute:?}");
            assert!(
                (out.loss as f64 - self.loss).abs() <= 1e-5 * self.loss,
                "{what}: loss {} against {}",
                out.loss,
                self.loss
            );
            let mut seen = 0;
            for (name, got) in out.grads.iter() {
                let reference = self
                    .grads
                    .get(name)
                    .unwrap_or_else(|| panic!("{what}: no reference gradient for `{name}`"));
                let err = max_diff(got, reference) / max_abs(reference).max(1e-3 * global);
                assert!(err <= 1e-4, "{what}: gradient of `{name}` off by {err:e}");
                seen += 1;
            }
            assert_eq!(
                seen,
                self.grads.len(),
                "{what}: every parameter gets a gradient"
            );
        }
    }
}

/// The queries and passages (a positive and a hard negative each) of the family checks.
const QUERIES: [&str; 3] = ["who is he", "the lord is my shepherd", "let there be light"];
const PASSAGES: [&str; 6] = [
    "and he said, who is he?",
    "thou shalt not kill.",
    "the lord is my shepherd; i shall not want.",
    "he maketh me to lie down in green pastures.",
    "and god said, let there be light: and there was light.",
    "and the evening and the morning were the first day.",
];

#[test]
fn every_encoder_family_is_a_colbert_backbone() {
    use gradcache::bert::{BertConfig, BertEncoder, BertOptions, DenseActivation, DenseSpec};
    use gradcache::hub::multi_vector::{MultiVectorHead, PUNCTUATION};
    use gradcache::hub::{load_tokenizer, ModelFiles};
    use gradcache::models::bert::{create_dense, with_model_weights};
    use gradcache::{ParamStore, TokenBatch};

    for family in ["bert", "roberta", "xlm-roberta", "mpnet", "modernbert"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/families")
            .join(family);
        let files = ModelFiles::from_dir(&dir).unwrap();
        let bert = BertConfig::from_file(&files.config).unwrap();
        let head = MultiVectorHead {
            dim: 8,
            query_length: 12,
            document_length: 20,
            query_prefix: String::new(),
            document_prefix: String::new(),
            query_expansion: true,
            attend_to_expansion_tokens: false,
            skiplist_words: PUNCTUATION.chars().map(String::from).collect(),
        };
        let (inner, _) = load_tokenizer(&files, &bert).unwrap();
        let (qt, dt) = head.tokenizers(&inner, &dir).unwrap();
        let (q, p) = (
            qt.encode(&QUERIES, &Device::Cpu).unwrap(),
            dt.encode(&PASSAGES, &Device::Cpu).unwrap(),
        );
        let build = |recompute: Recompute| {
            let options = BertOptions {
                normalize: true,
                multi_vector: true,
                recompute,
                dense: vec![DenseSpec {
                    path: "1_Dense".into(),
                    in_features: bert.hidden_size,
                    out_features: 8,
                    bias: false,
                    activation: DenseActivation::Identity,
                }],
                ..Default::default()
            };
            let plain = BertOptions {
                dense: Vec::new(),
                ..options.clone()
            };
            let store = ParamStore::new(4, candle_core::DType::F32, &Device::Cpu);
            // The projection the files lack starts from the seed (as a run creates it).
            create_dense(&store, "", &options.dense).unwrap();
            let store = with_model_weights(&files, "", &plain, store, false).unwrap();
            BertEncoder::build(&store, "", &bert, &options).unwrap()
        };
        // Cached == full batch, with every layer recomputed too.
        let gc = GradCache::shared(build(Recompute::Off), 2, MaxSim::new(8).unwrap())
            .unwrap()
            .with_dropout(false);
        let full = gc.full_batch_step(0, &q, &p).unwrap();
        let global = full
            .grads
            .iter()
            .map(|(_, g)| max_abs(g))
            .fold(0.0, f64::max);
        for recompute in [Recompute::Off, Recompute::EveryLayer] {
            let gc = GradCache::shared(build(recompute.clone()), 2, MaxSim::new(8).unwrap())
                .unwrap()
                .with_dropout(false);
            let cached = gc.cache_step(0, &q, &p).unwrap();
            let rel = ((cached.loss - full.loss) / full.loss).abs();
            assert!(rel <= 1e-5, "{family} {recompute:?}: loss {rel:e}");
            for (name, g) in cached.grads.iter() {
                let want = full.grads.get(name).unwrap();
                let err = max_diff(g, want) / max_abs(want).max(1e-3 * global);
                assert!(
                    err <= 1e-4,
                    "{family} {recompute:?}: `{name}` off by {err:e}"
                );
            }
        }
        // The expansion tokens change no real token of the queries.
        let encoder = build(Recompute::Off);
        let expanded = gradcache::Encoder::encode(&encoder, &q, &gradcache::Ctx::eval()).unwrap();
        let alone = TokenBatch::new(
            q.input_ids.clone(),
            q.attention_mask.clone(),
            q.token_type_ids.clone(),
        )
        .unwrap()
        .with_vectors(q.attention_mask.clone(), 12)
        .unwrap();
        let alone = gradcache::Encoder::encode(&encoder, &alone, &gradcache::Ctx::eval()).unwrap();
        let real = q
            .attention_mask
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .unsqueeze(2)
            .unwrap()
            .broadcast_as((3, 12, 8))
            .unwrap()
            .reshape((3, 96))
            .unwrap();
        let diff = max_diff(&expanded.mul(&real).unwrap(), &alone);
        assert!(
            diff <= 1e-5,
            "{family}: real query tokens moved by {diff:e}"
        );
    }
}

#[test]
fn directories_that_do_not_fit_are_refused_by_name() {
    // A copy of a fixture to break.
    let copy_of = |layout: &str| -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let src = fixture(layout);
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let to = dir.path().join(path.file_name().unwrap());
            if path.is_dir() {
                std::fs::create_dir_all(&to).unwrap();
                for f in std::fs::read_dir(&path).unwrap() {
                    let f = f.unwrap().path();
                    std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
                }
            } else {
                std::fs::copy(&path, &to).unwrap();
            }
        }
        dir
    };
    let copy = || copy_of("pylate");
    let edit = |dir: &Path, file: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let path = dir.join(file);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&path, v.to_string()).unwrap();
    };
    let load = |dir: &Path| {
        MultiVectorModel::load(dir.to_str().unwrap(), &Device::Cpu)
            .err()
            .unwrap()
            .to_string()
    };
    // A prefix that is not a token of the tokenizer.
    let dir = copy();
    edit(dir.path(), "config_sentence_transformers.json", &|v| {
        v["query_prefix"] = "[X] ".into()
    });
    let err = load(dir.path());
    assert!(err.contains("[X] ") && err.contains("not a token"), "{err}");
    // A query length without room for [CLS], the prefix and [SEP].
    let dir = copy();
    edit(dir.path(), "config_sentence_transformers.json", &|v| {
        v["query_length"] = 3.into()
    });
    let err = load(dir.path());
    assert!(err.contains("query_length"), "{err}");
    // A projection that does not take the hidden size.
    let dir = copy();
    edit(dir.path(), "1_Dense/config.json", &|v| {
        v["in_features"] = 16.into()
    });
    let err = load(dir.path());
    assert!(
        err.contains("Dense") || err.contains("linear.weight"),
        "{err}"
    );
    // A projection with PyLate's residual connection.
    let dir = copy();
    edit(dir.path(), "1_Dense/config.json", &|v| {
        v["use_residual"] = true.into()
    });
    assert!(load(dir.path()).contains("use_residual"));
    // A module this crate does not run.
    let dir = copy();
    edit(dir.path(), "modules.json", &|v| {
        v.as_array_mut().unwrap().push(
            serde_json::json!({"idx": 2, "name": "2", "path": "", "type": "pylate.models.Other"}),
        )
    });
    assert!(load(dir.path()).contains("pylate.models.Other"));
    // No query length.
    let dir = copy();
    edit(dir.path(), "config_sentence_transformers.json", &|v| {
        v.as_object_mut().unwrap().remove("query_length");
    });
    assert!(load(dir.path()).contains("query_length"));
    // Query expansion without a mask token in the tokenizer.
    let dir = copy();
    edit(dir.path(), "tokenizer.json", &|v| {
        let added = v["added_tokens"].as_array_mut().unwrap();
        added.retain(|t| t["content"] != "[MASK]");
        v["model"]["vocab"]
            .as_object_mut()
            .unwrap()
            .remove("[MASK]");
    });
    edit(dir.path(), "tokenizer_config.json", &|v| {
        v["pad_token"] = "[PAD]".into();
        v.as_object_mut().unwrap().remove("mask_token");
    });
    let err = load(dir.path());
    assert!(err.contains("mask token"), "{err}");
    // The sentence-transformers 6 layout: a skiplist on queries, an expansion strategy
    // this crate does not run.
    let dir = copy_of("st6");
    edit(dir.path(), "2_MultiVectorMask/config.json", &|v| {
        v["skiplist_tasks"] = serde_json::json!(["query", "document"])
    });
    assert!(load(dir.path()).contains("skiplist_tasks"));
    let dir = copy_of("st6");
    edit(dir.path(), "sentence_bert_config.json", &|v| {
        v["query_expansion"]["strategy"] = "dynamic".into()
    });
    assert!(load(dir.path()).contains("strategy"));
}
