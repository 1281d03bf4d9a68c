//! Sparse (SPLADE) models against sentence-transformers' `SparseEncoder`, without
//! network: `tests/fixtures/sparse/<model>/` holds a tiny masked-language model (DistilBERT
//! with max pooling of `relu`, BERT with sum pooling of `log1p_relu`) saved by
//! sentence-transformers 6.2 (`Transformer(fill-mask)` + `SpladePooling`), with references
//! written by `scripts/make_sparse_fixtures.py`:
//!
//! - the vectors `encode` gives (vocabulary-wide, mostly zeros), <= 1e-5 relative to the
//!   largest entry, and under each of the four poolings from the same logits;
//! - the loss and the gradient of every parameter (the MLM head's, the word embeddings'
//!   tied to the decoder) of `SpladeLoss(SparseMultipleNegativesRankingLoss)` with both
//!   FLOPS regularisers, <= 1e-4 relative, as one gradient-cache step in chunks of 4, 1 and
//!   3 with and without recompute;
//! - a model whose file holds no MLM head, asked to be sparse, is refused naming the
//!   missing weight; a family without a sparse head, naming the families that have one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions, SparseSpec, SpladeActivation, SpladeStrategy};
use gradcache::hub::{EmbeddingModel, LoadOptions, ModelFiles, Tokenizer};
use gradcache::loss::{Flops, SpladeLoss};
use gradcache::{GradCache, InfoNce, Loss, ParamStore, Recompute, Similarity};

use crate::common::families::{assert_step_matches, reference_at, refs, Reference};
use crate::common::{max_abs, max_diff};

const MODELS: [&str; 2] = ["distilbert", "bert"];
const MAX_LEN: usize = 32;

fn fixture(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sparse")
        .join(model)
}

fn reference(model: &str) -> Reference {
    reference_at(&fixture(model))
}

/// The largest difference relative to the reference's largest entry.
fn rel(got: &Tensor, want: &Tensor) -> f64 {
    max_diff(got, want) / max_abs(want).max(1e-12)
}

fn load(dir: &Path) -> EmbeddingModel {
    let options = LoadOptions {
        max_len: Some(MAX_LEN),
        ..Default::default()
    };
    EmbeddingModel::load(dir.to_str().unwrap(), &options).unwrap()
}

#[test]
fn vectors_match_sentence_transformers() {
    for model in MODELS {
        let r = reference(model);
        let m = load(&fixture(model));
        assert!(
            m.settings().starts_with("sparse (SPLADE)"),
            "{}",
            m.settings()
        );
        assert_eq!(m.similarity(), Similarity::Dot);
        let got = m.embed(&refs(&r.texts), 4).unwrap();
        let want = &r.tensors["embeddings"];
        assert_eq!(
            got.dims(),
            want.dims(),
            "{model}: one vocabulary-wide vector a text"
        );
        let err = rel(&got, want);
        assert!(err <= 1e-5, "{model}: vectors off by {err:e}");
        // Sparse: most entries exactly zero, on both sides alike.
        let zeros = |t: &Tensor| -> Vec<u8> {
            t.eq(0.0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<u8>()
                .unwrap()
        };
        let (ours, theirs) = (zeros(&got), zeros(want));
        let agree = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
        assert!(
            agree as f64 >= 0.999 * ours.len() as f64,
            "{model}: zeros differ"
        );
    }
}

#[test]
fn every_splade_pooling_matches_sentence_transformers() {
    for model in MODELS {
        let r = reference(model);
        let dir = fixture(model);
        let files = ModelFiles::from_dir(&dir).unwrap();
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
        let batch = tokenizer.encode(&refs(&r.texts), &Device::Cpu).unwrap();
        for strategy in [SpladeStrategy::Max, SpladeStrategy::Sum] {
            for activation in [SpladeActivation::Relu, SpladeActivation::Log1pRelu] {
                let options = BertOptions {
                    sparse: Some(SparseSpec {
                        strategy,
                        activation,
                    }),
                    ..Default::default()
                };
                let store = ParamStore::new(0, DType::F32, &Device::Cpu);
                let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
                let got =
                    gradcache::Encoder::forward(&encoder, &batch, &gradcache::Ctx::eval()).unwrap();
                let key = format!("pooled.{}.{}", strategy.name(), activation.name());
                let err = rel(&got, &r.tensors[&key]);
                assert!(err <= 1e-5, "{model} {key}: off by {err:e}");
            }
        }
    }
}

/// One gradient-cache step of sentence-transformers' `SpladeLoss` on `model`.
fn step(model: &str, chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture(model);
    let r = reference(model);
    let files = ModelFiles::from_dir(&dir).unwrap();
    let head = gradcache::hub::read_sentence_transformers_config(&dir)
        .unwrap()
        .unwrap();
    let options = BertOptions {
        recompute,
        sparse: head.sparse,
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
    // SparseMultipleNegativesRankingLoss: dot products, scale 1.
    let base = InfoNce::new(1.0).unwrap().with_similarity(Similarity::Dot);
    let loss = SpladeLoss::new(base, Flops::new(3e-3).unwrap())
        .with_queries(Some(Flops::new(5e-3).unwrap()));
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let q = tokenizer.encode(&refs(&r.queries), &Device::Cpu).unwrap();
    let p = tokenizer.encode(&refs(&r.passages), &Device::Cpu).unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn a_cached_step_gives_sentence_transformers_loss_and_gradients() {
    for model in MODELS {
        let r = reference(model);
        // The reference's names carry the base model's prefix; the head's do not.
        let want: HashMap<String, &Tensor> = r
            .tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
            .map(|(n, v)| {
                let n = n
                    .strip_prefix("bert.")
                    .or_else(|| n.strip_prefix("distilbert."))
                    .unwrap_or(n);
                (n.to_string(), v)
            })
            .collect();
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::Off),
            (3, Recompute::EveryLayer),
        ] {
            let (loss, grads) = step(model, chunk, recompute.clone());
            let what = format!("{model}, chunk {chunk}, recompute {recompute:?}");
            let seen = assert_step_matches(&what, (loss, &grads), r.loss, &want);
            // Every parameter with a reference gradient got one (the tied decoder's
            // part of the word embeddings' included).
            let nonzero = want.values().filter(|g| max_abs(g) > 0.0).count();
            assert!(seen >= nonzero, "{what}: {seen} gradients for {nonzero}");
        }
    }
}

#[test]
fn the_regularisers_are_the_reference_parts() {
    // The FLOPS parts of the reference, from the vectors sentence-transformers encodes.
    let r = reference("distilbert");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("distilbert").join("reference.json")).unwrap(),
    )
    .unwrap();
    let m = load(&fixture("distilbert"));
    let q = m.embed(&refs(&r.queries), 4).unwrap();
    let p = m.embed(&refs(&r.passages), 4).unwrap();
    let base = InfoNce::new(1.0).unwrap().with_similarity(Similarity::Dot);
    let loss = SpladeLoss::new(base, Flops::new(3e-3).unwrap())
        .with_queries(Some(Flops::new(5e-3).unwrap()));
    let parts = loss.parts(&q, &p).unwrap();
    for (got, key) in [
        (parts.base, "base_loss"),
        (parts.documents, "document_regularizer_loss"),
        (parts.queries, "query_regularizer_loss"),
    ] {
        let want = meta["parts"][key].as_f64().unwrap();
        assert!(
            (got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{key}: {got} vs {want}"
        );
    }
    // The differentiable form gives the same total.
    let total = loss.forward(&q, &p).unwrap().to_scalar::<f32>().unwrap();
    assert!((total as f64 - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0));
}

#[test]
fn a_model_without_an_mlm_head_or_of_another_family_is_refused() {
    // The family fixture is a BertModel: no `cls.predictions.*` in its file.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let files = ModelFiles::from_dir(&dir).unwrap();
    let options = BertOptions {
        sparse: Some(SparseSpec::default()),
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let err = load_pretrained(&files, "", &options, store)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("cls.predictions"), "{err}");
    // A family this crate builds no MLM head for.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/mpnet");
    let files = ModelFiles::from_dir(&dir).unwrap();
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let err = load_pretrained(&files, "", &options, store)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("mpnet") && err.contains("distilbert"), "{err}");
}

#[test]
fn encode_writes_the_active_entries_by_token_and_by_index() {
    let r = reference("distilbert");
    let dir = fixture("distilbert");
    let text = &r.texts[3];
    let row = r.tensors["embeddings"]
        .get(3)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let encode = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["encode", "--model", dir.to_str().unwrap(), "--text", text];
        args.extend_from_slice(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let line = encode(&[]);
    let indices: Vec<usize> = line["indices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let want: Vec<usize> = (0..row.len()).filter(|&i| row[i] != 0.0).collect();
    assert_eq!(indices, want, "the active entries");
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let tokens = line["sparse"].as_object().unwrap();
    assert_eq!(tokens.len(), want.len());
    for (k, &i) in want.iter().enumerate() {
        let value = line["values"][k].as_f64().unwrap();
        assert!((value - row[i] as f64).abs() <= 1e-5 * row[i].abs().max(1.0) as f64);
        let token = tokenizer.inner().id_to_token(i as u32).unwrap();
        assert_eq!(tokens[&token].as_f64().unwrap(), value, "{token}");
    }
    // The five largest only.
    let top = encode(&["--top-k", "5"]);
    let mut largest: Vec<usize> = want.clone();
    largest.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    largest.truncate(5);
    largest.sort();
    let got: Vec<usize> = top["indices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(got, largest);
    // --top-k 0 is refused.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args([
            "encode",
            "--model",
            dir.to_str().unwrap(),
            "--text",
            "x",
            "--top-k",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--top-k"));
}

#[test]
fn a_pooling_width_other_than_the_vocabulary_or_an_unknown_strategy_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let copy = |edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let dir = tmp.path().join(format!(
            "m{}",
            std::fs::read_dir(tmp.path()).unwrap().count()
        ));
        std::fs::create_dir_all(dir.join("1_SpladePooling")).unwrap();
        for entry in std::fs::read_dir(fixture("distilbert")).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
            }
        }
        let pooling = "1_SpladePooling/config.json";
        let mut cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("distilbert").join(pooling)).unwrap(),
        )
        .unwrap();
        edit(&mut cfg);
        std::fs::write(dir.join(pooling), cfg.to_string()).unwrap();
        dir
    };
    let err = |dir: &Path| -> String {
        EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
            .err()
            .unwrap()
            .to_string()
    };
    let dir = copy(&|c| c["embedding_dimension"] = 30522.into());
    let e = err(&dir);
    assert!(
        e.contains("embedding_dimension") && e.contains("400"),
        "{e}"
    );
    let dir = copy(&|c| c["pooling_strategy"] = "mean".into());
    assert!(err(&dir).contains("pooling_strategy"));
    let dir = copy(&|c| c["activation_function"] = "gelu".into());
    assert!(err(&dir).contains("activation_function"));
    // A module after SpladePooling (its vector is final).
    let dir = copy(&|_| {});
    let mut modules: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("modules.json")).unwrap()).unwrap();
    modules.as_array_mut().unwrap().push(serde_json::json!({
        "idx": 2, "name": "2", "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize"
    }));
    std::fs::write(dir.join("modules.json"), modules.to_string()).unwrap();
    let e = err(&dir);
    assert!(e.contains("modules") && e.contains("SpladePooling"), "{e}");
}
