//! Training a sparse (SPLADE) model with `gradcache train`'s trainer: `[model.sparse]`
//! over a pretrained `SparseEncoder` or a fresh BERT, `[loss.splade]`'s FLOPS regularisers
//! with their warm-up; the run learns, resumes bit for bit mid-warm-up, and exports in
//! sentence-transformers' `SparseEncoder` layout, which loads back to the trained vectors;
//! bad settings are refused by name before anything is written.

use std::path::{Path, PathBuf};

use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::train::config::Config;
use gradcache::train::trainer::Trainer;
use gradcache::Side;

use crate::common;
use crate::common::{copy_dir, max_diff, quickstart_sample};

fn fixture(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sparse")
        .join(model)
}

/// A sparse run over `dir`'s train.jsonl / eval.jsonl from the DistilBERT SPLADE fixture
/// (its max pooling of relu), the regularisers warming up over the first half.
fn sparse_run(dir: &Path, steps: usize, extra: &str) -> PathBuf {
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
[loss]
temperature = 1.0
[loss.splade]
document_weight = 3e-3
query_weight = 5e-3
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
{extra}
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = fixture("distilbert").display(),
    );
    let path = dir.join("sparse.toml");
    std::fs::write(&path, config).unwrap();
    path
}

#[test]
fn a_sparse_run_resumes_bit_for_bit_through_the_warm_up_and_exports_a_sparse_encoder() {
    let tmp = tempfile::tempdir().unwrap();
    quickstart_sample(tmp.path(), 0..96, 1000..1020);
    let path = sparse_run(tmp.path(), 4, "");
    // Straight through.
    let cfg = Config::load(&path, &[]).unwrap();
    let mut straight = Trainer::new(cfg.clone(), None).unwrap();
    let losses: Vec<f32> = (0..4)
        .map(|_| straight.train_step().unwrap().loss)
        .collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    // Two steps, a checkpoint, and two more from it (the weights' scale at steps 2 and 3
    // of the warm-up come from the step alone).
    let other = tmp.path().join("other");
    let mut cfg2 = cfg.clone();
    cfg2.output_dir = other.clone();
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

    // The export is a SparseEncoder that loads back to the trained vectors.
    let export = tmp.path().join("export");
    straight.export(&export, Side::Query).unwrap();
    let read = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(
        read(export.join("config.json"))["architectures"][0],
        "DistilBertForMaskedLM"
    );
    assert_eq!(
        read(export.join("config_sentence_transformers.json"))["model_type"],
        "SparseEncoder"
    );
    assert_eq!(
        read(export.join("sentence_bert_config.json"))["transformer_task"],
        "fill-mask"
    );
    let pooling = read(export.join("1_SpladePooling/config.json"));
    assert_eq!(
        (
            pooling["pooling_strategy"].as_str(),
            pooling["activation_function"].as_str()
        ),
        (Some("max"), Some("relu"))
    );
    let options = LoadOptions {
        max_len: Some(32),
        ..Default::default()
    };
    let exported = EmbeddingModel::load(export.to_str().unwrap(), &options).unwrap();
    let original = EmbeddingModel::load(fixture("distilbert").to_str().unwrap(), &options).unwrap();
    let texts = [
        "In the beginning God created the heaven and the earth.",
        "Jesus wept.",
    ];
    let a = exported.embed(&texts, 2).unwrap();
    assert_eq!(a.dims()[1], 400, "one entry a vocabulary token");
    let b = original.embed(&texts, 2).unwrap();
    assert!(max_diff(&a, &b) > 1e-4, "the export is the untrained model");
    // `gradcache export` from the run directory's checkpoint gives the same model.
    straight.save_checkpoint().unwrap();
    let from_run = tmp.path().join("from-run");
    gradcache::train::export_run(&cfg, None, &from_run, Side::Query).unwrap();
    let c = EmbeddingModel::load(from_run.to_str().unwrap(), &options)
        .unwrap()
        .embed(&texts, 2)
        .unwrap();
    assert!(max_diff(&a, &c) <= 1e-6, "{}", max_diff(&a, &c));
}

#[test]
fn a_fresh_sparse_model_learns() {
    // A fresh BERT with its MLM head drawn from the seed, trained as SPLADE on 400
    // quickstart pairs for 60 steps, evaluated on 100 held-out pairs.
    let tmp = tempfile::tempdir().unwrap();
    quickstart_sample(tmp.path(), 0..400, 1000..1100);
    let config = format!(
        r#"
seed = 5
output_dir = "{out}"
[data]
train_file = "{dir}/train.jsonl"
eval_file = "{dir}/eval.jsonl"
[model]
query_max_len = 32
passage_max_len = 48
[model.fresh]
vocab_size = 1000
hidden_size = 64
num_layers = 2
num_heads = 4
intermediate_size = 128
[model.sparse]
[loss]
temperature = 1.0
[train]
steps = 60
batch_size = 32
query_chunk = 16
passage_chunk = 16
eval_every = 60
checkpoint_every = 60
[optim]
lr = 1e-3
warmup_ratio = 0.1
"#,
        out = tmp.path().join("run").display(),
        dir = tmp.path().display(),
    );
    let path = tmp.path().join("fresh.toml");
    std::fs::write(&path, config).unwrap();
    let cfg = Config::load(&path, &[]).unwrap();
    common::assert_learns(Trainer::new(cfg, None).unwrap());
}

#[test]
fn bad_sparse_settings_are_refused_by_name_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    quickstart_sample(tmp.path(), 0..32, 1000..1008);
    let path = sparse_run(tmp.path(), 2, "");
    for (set, field) in [
        ("model.pooling=\"mean\"", "model.pooling"),
        ("model.normalize=true", "model.normalize"),
        ("loss.matryoshka_dims=[8]", "loss.matryoshka_dims"),
        ("model.sparse.pooling=\"mean\"", "model.sparse.pooling"),
        (
            "model.sparse.activation=\"gelu\"",
            "model.sparse.activation",
        ),
        (
            "loss.splade.document_weight=-1.0",
            "loss.splade.document_weight",
        ),
        ("loss.splade.query_weight=-0.5", "loss.splade.query_weight"),
        (
            "loss.splade.documents_only=true",
            "loss.splade.query_weight",
        ),
        ("loss.splade.warmup_ratio=2.0", "loss.splade.warmup_ratio"),
    ] {
        let err = Config::load(&path, &[set.to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    assert!(!tmp.path().join("run").exists());
    // [loss.splade] on a dense run.
    let dense = tmp.path().join("dense.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("[model.sparse]\n", "");
    std::fs::write(&dense, text).unwrap();
    let err = Config::load(&dense, &[]).unwrap_err().to_string();
    assert!(
        err.contains("loss.splade") && err.contains("[model.sparse]"),
        "{err}"
    );
    // A SparseEncoder trained without the section.
    let text = std::fs::read_to_string(&path).unwrap();
    let plain = text[..text.find("[model.sparse]").unwrap()].to_string()
        + &text[text.find("[train]").unwrap()..];
    std::fs::write(&dense, plain).unwrap();
    let cfg = Config::load(&dense, &[]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("model.sparse"), "{err}");
    assert!(!tmp.path().join("run").exists());
    // A dense model asked to be sparse: its file has no MLM head.
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let cfg = Config::load(&path, &[format!("model.pretrained=\"{}\"", bert.display())]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("cls.predictions"), "{err}");
    assert!(!tmp.path().join("run").join("checkpoints").exists());
}

#[test]
fn the_shipped_splade_config_learns() {
    // configs/splade.toml as shipped (its fresh model, SPLADE pooling, temperature, FLOPS
    // weights and warm-up, optimizer), on 400 quickstart pairs for 20 steps, evaluated on
    // 100 held-out pairs.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    quickstart_sample(dir, 0..400, 1000..1100);
    let sets = vec![
        format!("output_dir=\"{}\"", dir.join("run").display()),
        format!("data.train_file=\"{}\"", dir.join("train.jsonl").display()),
        format!("data.eval_file=\"{}\"", dir.join("eval.jsonl").display()),
        "train.steps=20".into(),
        "train.eval_every=20".into(),
        "train.checkpoint_every=20".into(),
        "train.batch_size=64".into(),
    ];
    let cfg = Config::load(Path::new("configs/splade.toml"), &sets).unwrap();
    assert!(cfg.model.sparse.is_some() && cfg.loss.splade.is_some());
    common::assert_learns(Trainer::new(cfg, None).unwrap());
}

#[test]
fn a_tokenizer_larger_than_the_sparse_vocabulary_is_refused() {
    // The DistilBERT fixture with two tokens more in its tokenizer than its vocab_size.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&fixture("distilbert"), &model);
    let path = model.join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    for (i, token) in ["[EXTRA1]", "[EXTRA2]"].iter().enumerate() {
        tokenizer["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "id": vocab + i as u64, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
    }
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let want = format!(
        "{} tokens but config.json's vocab_size is {vocab}",
        vocab + 2
    );
    // Loading it for encode or eval.
    let err = gradcache::hub::EmbeddingModel::load(model.to_str().unwrap(), &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&want), "{err}");
    // Training it.
    quickstart_sample(tmp.path(), 0..32, 1000..1008);
    let run = sparse_run(tmp.path(), 2, "");
    let cfg = Config::load(&run, &[format!("model.pretrained=\"{}\"", model.display())]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains(&want), "{err}");
    assert!(!tmp.path().join("run").join("checkpoints").exists());
}

#[test]
fn a_model_without_an_mlm_head_gets_one_from_the_seed_when_asked() {
    // The family fixture is a BertModel: refused without new_head (above); with it, the
    // head is drawn from the seed, trains, and the export is a SparseEncoder.
    let tmp = tempfile::tempdir().unwrap();
    quickstart_sample(tmp.path(), 0..32, 1000..1008);
    let path = sparse_run(tmp.path(), 2, "");
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let sets = [
        format!("model.pretrained=\"{}\"", bert.display()),
        "model.sparse.new_head=true".to_string(),
    ];
    let cfg = Config::load(&path, &sets).unwrap();
    let mut run = Trainer::new(cfg.clone(), None).unwrap();
    let first = run.train_step().unwrap();
    assert!(first.loss.is_finite());
    // Two runs from one seed draw one head.
    let mut cfg2 = cfg.clone();
    cfg2.output_dir = tmp.path().join("again");
    let mut again = Trainer::new(cfg2, None).unwrap();
    assert_eq!(
        again.train_step().unwrap().loss.to_bits(),
        first.loss.to_bits()
    );
    let export = tmp.path().join("export");
    run.export(&export, Side::Query).unwrap();
    let model = EmbeddingModel::load(export.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert!(model.is_sparse());
    let v = model.embed(&["Jesus wept."], 1).unwrap();
    let vocab: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bert.join("config.json")).unwrap()).unwrap();
    assert_eq!(v.dims()[1] as u64, vocab["vocab_size"].as_u64().unwrap());
}
