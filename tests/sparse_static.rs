//! Inference-free sparse models against sentence-transformers, without network:
//! `tests/fixtures/sparse/inference_free/` is a `SparseEncoder` whose `Router` sends queries
//! through a `SparseStaticEmbedding` (a trainable weight per vocabulary entry) and
//! documents through a DistilBERT masked-language model with `SpladePooling(max, relu)`,
//! saved by sentence-transformers 6.2 with references
//! (`scripts/make_inference_free_fixture.py`):
//!
//! - `encode_query`, `encode_document` and `encode` (the default route) vectors, <= 1e-5
//!   relative to the largest entry;
//! - the loss and every parameter's gradient, the static weights' included, of
//!   `SpladeLoss(SparseMultipleNegativesRankingLoss)` with both FLOPS regularisers as one
//!   gradient-cache step (queries by the static tower, documents by the MLM) in chunks of
//!   4, 1 and 3, recompute off and on, <= 1e-4 relative;
//! - a router this crate does not run is refused naming what it has.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::load_pretrained;
use gradcache::hub::router::RouterLayout;
use gradcache::hub::{EmbeddingModel, LoadOptions, ModelFiles, Tokenizer};
use gradcache::loss::{Flops, SpladeLoss};
use gradcache::sparse_static::SparseStaticEmbedding;
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, Similarity};

mod common;
use common::families::{assert_step_matches, reference_at, refs};
use common::{max_abs, max_diff};

const MAX_LEN: usize = 32;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sparse/inference_free")
}

fn rel(got: &Tensor, want: &Tensor) -> f64 {
    max_diff(got, want) / max_abs(want).max(1e-12)
}

fn load(dir: &Path) -> Result<EmbeddingModel, gradcache::Error> {
    let options = LoadOptions {
        max_len: Some(MAX_LEN),
        ..Default::default()
    };
    EmbeddingModel::load(dir.to_str().unwrap(), &options)
}

#[test]
fn query_document_and_default_vectors_match_sentence_transformers() {
    let r = reference_at(&fixture());
    let m = load(&fixture()).unwrap();
    assert!(m.settings().starts_with("inference-free"), "{}", m.settings());
    assert_eq!(m.similarity(), Similarity::Dot);
    let texts = refs(&r.texts);
    for (got, key) in [
        (m.embed_queries(&texts, 4).unwrap(), "queries"),
        (m.embed_passages(&texts, 4).unwrap(), "documents"),
        (m.embed(&texts, 3).unwrap(), "embeddings"),
    ] {
        let want = &r.tensors[key];
        assert_eq!(got.dims(), want.dims(), "{key}");
        let err = rel(&got, want);
        assert!(err <= 1e-5, "{key}: off by {err:e}");
    }
    // A query's vector is its tokens' weights: an entry per distinct token, none for
    // [CLS] or [SEP].
    let text = "the earth the earth";
    let q = m.embed_queries(&[text], 1).unwrap();
    let active: Vec<u32> = (0..q.dim(1).unwrap() as u32)
        .filter(|&i| q.get(0).unwrap().get(i as usize).unwrap().to_scalar::<f32>().unwrap() != 0.0)
        .collect();
    let inner = m.tokenizer().inner();
    let mut ids = inner.encode(text, false).unwrap().get_ids().to_vec();
    ids.sort();
    ids.dedup();
    assert_eq!(active, ids);
    for special in ["[CLS]", "[SEP]"] {
        assert!(!active.contains(&inner.token_to_id(special).unwrap()));
    }
}

/// One gradient-cache step of sentence-transformers' `SpladeLoss` with queries through
/// the static weights.
fn step(chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture();
    let r = reference_at(&dir);
    let layout = RouterLayout::read(&dir).unwrap();
    let files = ModelFiles::from_dir(&dir.join(layout.transformer())).unwrap();
    let head = gradcache::hub::read_sentence_transformers_config(&files.dir).unwrap();
    assert!(head.is_none(), "the transformer's folder holds no modules.json");
    let pooling = gradcache::hub::sentence_transformers::read_splade_pooling(
        &dir.join(&layout.document[1].1).join("config.json"),
    )
    .unwrap();
    let options = gradcache::bert::BertOptions {
        recompute,
        sparse: Some(pooling),
        ..Default::default()
    };
    // The static weights first, in the store the document model's file then backs.
    let vocab = gradcache::bert::BertConfig::from_file(&files.config)
        .unwrap()
        .vocab_size;
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let queries = SparseStaticEmbedding::tower(&store, "query", vocab).unwrap();
    let (documents, cfg, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let tokenizer = Tokenizer::from_file(&files.dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let weight = gradcache::hub::router::read_static_weights(
        &dir.join(&layout.query),
        &tokenizer,
        cfg.vocab_size,
    )
    .unwrap();
    queries.params().get("query.weight").unwrap().set(&weight).unwrap();
    let base = InfoNce::new(1.0).unwrap().with_similarity(Similarity::Dot);
    let loss = SpladeLoss::new(base, Flops::new(3e-3).unwrap())
        .with_queries(Some(Flops::new(5e-3).unwrap()));
    let gc = GradCache::two_towers(queries, documents, chunk, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let q = tokenizer
        .clone()
        .without_special_tokens()
        .encode(&refs(&r.queries), &Device::Cpu)
        .unwrap();
    let p = tokenizer.encode(&refs(&r.passages), &Device::Cpu).unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn a_cached_step_gives_sentence_transformers_loss_and_gradients_static_weights_included() {
    let r = reference_at(&fixture());
    let want: HashMap<String, &Tensor> = r
        .tensors
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
        .map(|(n, v)| {
            let n = match n {
                "static.weight" => "query.weight",
                n => n.strip_prefix("distilbert.").unwrap_or(n),
            };
            (n.to_string(), v)
        })
        .collect();
    for (chunk, recompute) in [
        (4, Recompute::Off),
        (1, Recompute::Off),
        (3, Recompute::EveryLayer),
    ] {
        let (loss, grads) = step(chunk, recompute.clone());
        let what = format!("chunk {chunk}, recompute {recompute:?}");
        let seen = assert_step_matches(&what, (loss, &grads), r.loss, &want);
        let nonzero = want.values().filter(|g| max_abs(g) > 0.0).count();
        assert!(seen >= nonzero, "{what}: {seen} gradients for {nonzero}");
        assert!(
            grads.get("query.weight").is_some(),
            "{what}: the static weights get a gradient"
        );
    }
}

#[test]
fn a_router_other_than_static_queries_and_splade_documents_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let copy = |edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let dir = tmp.path().join(format!(
            "m{}",
            std::fs::read_dir(tmp.path()).unwrap().count()
        ));
        copy_dir(&fixture(), &dir);
        let path = dir.join("router_config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut cfg);
        std::fs::write(&path, cfg.to_string()).unwrap();
        dir
    };
    let err = |dir: &Path| load(dir).err().unwrap().to_string();
    let dir = copy(&|c| {
        c["structure"]["query"] = serde_json::json!(["document_0_Transformer"]);
    });
    let e = err(&dir);
    assert!(e.contains("Transformer on the query route"), "{e}");
    let dir = copy(&|c| {
        c["structure"]["image"] = serde_json::json!(["document_0_Transformer"]);
    });
    let e = err(&dir);
    assert!(e.contains("route named") && e.contains("image"), "{e}");
    let dir = copy(&|c| {
        c["structure"]["document"] = serde_json::json!(["document_0_Transformer"]);
    });
    assert!(err(&dir).contains("document route"));
    let dir = copy(&|c| {
        c["parameters"]["route_mappings"] = serde_json::json!({"('query', None)": "document"});
    });
    assert!(err(&dir).contains("route mapping"));
    // Static weights of another width than the vocabulary.
    let dir = copy(&|_| {});
    let weights = dir.join("query_0_SparseStaticEmbedding/model.safetensors");
    let short = Tensor::ones(7, DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&HashMap::from([("weight", short)]), &weights).unwrap();
    let e = err(&dir);
    assert!(e.contains("[7]") && e.contains("400"), "{e}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
