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

use crate::common;
use crate::common::families::{assert_step_matches, reference_at, refs};
use crate::common::{max_abs, max_diff};

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
    assert!(
        m.settings().starts_with("inference-free"),
        "{}",
        m.settings()
    );
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
        .filter(|&i| {
            q.get(0)
                .unwrap()
                .get(i as usize)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                != 0.0
        })
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
    assert!(
        head.is_none(),
        "the transformer's folder holds no modules.json"
    );
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
    queries
        .params()
        .get("query.weight")
        .unwrap()
        .set(&weight)
        .unwrap();
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
    // No weights file (and no IDF file configured instead).
    let dir = copy(&|_| {});
    std::fs::remove_file(dir.join("query_0_SparseStaticEmbedding/model.safetensors")).unwrap();
    let e = err(&dir);
    assert!(e.contains("SparseStaticEmbedding weights"), "{e}");
    // A query tokenizer with more tokens than the static weights cover.
    let dir = copy(&|_| {});
    let path = dir.join("query_0_SparseStaticEmbedding/tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 400, "content": "[EXTRA]", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let e = err(&dir);
    assert!(e.contains("401 tokens") && e.contains("cover 400"), "{e}");
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

/// An inference-free run over `dir`'s train.jsonl / eval.jsonl from the fixture, its
/// static weights at `query_lr` 1e-2 beside the model's 2e-4.
fn static_run(dir: &Path, steps: usize, extra: &[String]) -> gradcache::train::Config {
    let config = format!(
        r#"
seed = 3
output_dir = "{out}"
[data]
train_file = "{dir}/train.jsonl"
eval_file = "{dir}/eval.jsonl"
[model]
pretrained = "{model}"
query_max_len = 24
passage_max_len = 32
[model.sparse]
query_lr = 1e-2
[loss]
temperature = 1.0
[loss.splade]
document_weight = 3e-3
warmup_ratio = 0.5
[train]
steps = {steps}
batch_size = 16
query_chunk = 5
passage_chunk = 3
eval_every = 0
checkpoint_every = 2
[optim]
lr = 2e-4
warmup_steps = 1
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = fixture().display(),
    );
    let path = dir.join("static.toml");
    std::fs::write(&path, config).unwrap();
    gradcache::train::Config::load(&path, extra).unwrap()
}

fn static_weights(model: &Path) -> Tensor {
    let m = load(model).unwrap();
    m.static_query_weights().unwrap().0
}

#[test]
fn an_inference_free_run_resumes_bit_for_bit_and_exports_a_router_that_loads_back() {
    use gradcache::train::trainer::Trainer;
    let tmp = tempfile::tempdir().unwrap();
    common::quickstart_sample(tmp.path(), 0..96, 1000..1020);
    let cfg = static_run(tmp.path(), 4, &[]);
    let mut straight = Trainer::new(cfg.clone(), None).unwrap();
    let losses: Vec<f32> = (0..4)
        .map(|_| straight.train_step().unwrap().loss)
        .collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let mut cfg2 = cfg.clone();
    cfg2.output_dir = tmp.path().join("other");
    let mut first = Trainer::new(cfg2.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step().unwrap();
    }
    let checkpoint = first.save_checkpoint().unwrap();
    drop(first);
    let mut resumed = Trainer::new(cfg2, Some(&checkpoint)).unwrap();
    for want in &losses[2..] {
        let got = resumed.train_step().unwrap().loss;
        assert_eq!(got.to_bits(), want.to_bits(), "{got} vs {want}");
    }

    // The export is a Router: static query weights, trained, beside the SPLADE model.
    let export = tmp.path().join("export");
    straight.export(&export, gradcache::Side::Query).unwrap();
    for file in [
        "modules.json",
        "router_config.json",
        "config_sentence_transformers.json",
        "query_0_SparseStaticEmbedding/model.safetensors",
        "query_0_SparseStaticEmbedding/tokenizer.json",
        "document_0_Transformer/model.safetensors",
        "document_0_Transformer/sentence_bert_config.json",
        "document_1_SpladePooling/config.json",
    ] {
        assert!(export.join(file).is_file(), "{file}");
    }
    let before = static_weights(&fixture());
    let after = static_weights(&export);
    // Trained at query_lr: AdamW moves each weight with a gradient by about that much.
    let moved = max_diff(&before, &after);
    assert!(moved > 5e-3, "the static weights moved by {moved}");
    let exported = load(&export).unwrap();
    let original = load(&fixture()).unwrap();
    let texts = ["Who created the heaven and the earth?", "Jesus wept."];
    let d = exported.embed_passages(&texts, 2).unwrap();
    assert!(max_diff(&d, &original.embed_passages(&texts, 2).unwrap()) > 1e-5);
    // `gradcache export` from the checkpoint gives the same model.
    straight.save_checkpoint().unwrap();
    let from_run = tmp.path().join("from-run");
    gradcache::train::export_run(&cfg, None, &from_run, gradcache::Side::Query).unwrap();
    let again = load(&from_run).unwrap();
    assert_eq!(max_diff(&static_weights(&from_run), &after), 0.0);
    assert!(max_diff(&again.embed_passages(&texts, 2).unwrap(), &d) <= 1e-6);
    assert_eq!(
        max_diff(
            &again.embed_queries(&texts, 2).unwrap(),
            &exported.embed_queries(&texts, 2).unwrap()
        ),
        0.0
    );
}

#[test]
fn frozen_query_weights_stay_and_a_masked_language_model_starts_from_ones() {
    use gradcache::train::trainer::Trainer;
    let tmp = tempfile::tempdir().unwrap();
    common::quickstart_sample(tmp.path(), 0..48, 1000..1010);
    let frozen = vec!["model.sparse.freeze_query_weights=true".to_string()];
    let mut cfg = static_run(tmp.path(), 2, &frozen);
    cfg.model.sparse.as_mut().unwrap().query_lr = None;
    let mut run = Trainer::new(cfg.clone(), None).unwrap();
    for _ in 0..2 {
        run.train_step().unwrap();
    }
    let export = tmp.path().join("export");
    run.export(&export, gradcache::Side::Query).unwrap();
    assert_eq!(
        max_diff(&static_weights(&export), &static_weights(&fixture())),
        0.0
    );
    let read = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(
        read(export.join("query_0_SparseStaticEmbedding/config.json"))["frozen"],
        true
    );
    // From the checkpoint (which holds only what trains): the weights it started from.
    run.save_checkpoint().unwrap();
    let from_run = tmp.path().join("from-run");
    gradcache::train::export_run(&cfg, None, &from_run, gradcache::Side::Query).unwrap();
    assert_eq!(
        max_diff(&static_weights(&from_run), &static_weights(&fixture())),
        0.0
    );

    // A SparseEncoder without a router made inference-free: its query weights start at
    // ones and train.
    let mlm = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sparse/distilbert");
    let sets = vec![
        format!("model.pretrained=\"{}\"", mlm.display()),
        "model.sparse.inference_free=true".into(),
        format!("output_dir=\"{}\"", tmp.path().join("mlm-run").display()),
    ];
    let cfg = static_run(tmp.path(), 2, &sets);
    let mut run = Trainer::new(cfg, None).unwrap();
    for _ in 0..2 {
        run.train_step().unwrap();
    }
    let export = tmp.path().join("mlm-export");
    run.export(&export, gradcache::Side::Query).unwrap();
    let w = static_weights(&export).to_vec1::<f32>().unwrap();
    assert_eq!(w.len(), 400);
    assert!(w.contains(&1.0), "tokens never seen keep their one");
    assert!(w.iter().any(|&x| x != 1.0), "the seen ones trained");
}

#[test]
fn inference_free_settings_are_refused_by_name_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    common::quickstart_sample(tmp.path(), 0..32, 1000..1008);
    let path = tmp.path().join("static.toml");
    static_run(tmp.path(), 2, &[]);
    for (set, field) in [
        ("model.sparse.query_lr=0.0", "model.sparse.query_lr"),
        ("model.shared=false", "model.shared"),
    ] {
        let sets = [set.to_string(), "model.sparse.inference_free=true".into()];
        let err = gradcache::train::Config::load(&path, &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    use gradcache::train::trainer::Trainer;
    // The router model made not inference-free; query settings on a model that is not.
    let mlm = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sparse/distilbert");
    for (sets, field) in [
        (
            vec!["model.sparse.inference_free=false".to_string()],
            "model.sparse.inference_free",
        ),
        (
            vec![format!("model.pretrained=\"{}\"", mlm.display())],
            "model.sparse.query_lr",
        ),
    ] {
        let cfg = gradcache::train::Config::load(&path, &sets).unwrap();
        let err = Trainer::new(cfg, None).err().unwrap().to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
    assert!(!tmp.path().join("run").exists());
}

#[test]
fn the_shipped_splade_config_learns_inference_free() {
    // configs/splade.toml with its queries by static weights (from ones), on 400
    // quickstart pairs for 20 steps, evaluated on 100 held-out pairs.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::quickstart_sample(dir, 0..400, 1000..1100);
    let sets = vec![
        format!("output_dir=\"{}\"", dir.join("run").display()),
        format!("data.train_file=\"{}\"", dir.join("train.jsonl").display()),
        format!("data.eval_file=\"{}\"", dir.join("eval.jsonl").display()),
        "model.sparse.inference_free=true".into(),
        "train.steps=20".into(),
        "train.eval_every=20".into(),
        "train.checkpoint_every=20".into(),
        "train.batch_size=64".into(),
    ];
    let cfg = gradcache::train::Config::load(Path::new("configs/splade.toml"), &sets).unwrap();
    common::assert_learns(gradcache::train::trainer::Trainer::new(cfg, None).unwrap());
}
