//! LoRA against PEFT on PyTorch, without network: `tests/fixtures/lora/<family>/adapter`
//! holds a PEFT adapter (r 4, alpha 8, every attention and feed-forward projection,
//! moved off its initialisation) on the tiny `bert` and `qwen3` family fixtures, saved
//! by `PeftModel.save_pretrained`, with references from `scripts/make_lora_fixtures.py`:
//!
//! - every adapter's gradient of the fixture loss (cosine x 20, cross-entropy over the
//!   in-batch passages; the decoder with its prompts) <= 1e-4 relative (floored at 1e-3
//!   of the largest entry), in chunks and under recompute; the loss <= 1e-5;
//! - the adapted model's embeddings through `EmbeddingModel` given the adapter directory
//!   (the base model from its config, or `--base`), <= 1e-5;
//! - `model.lora.from` continues the adapter from its saved values, and refuses settings
//!   that do not match it or an adapter of another model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions};
use gradcache::hub::adapter::PeftAdapter;
use gradcache::hub::{
    read_sentence_transformers_config, EmbeddingModel, LoadOptions, ModelFiles, Tokenizer,
};
use gradcache::params::Freeze;
use gradcache::train::{Config, Trainer};
use gradcache::{Encoder, Error, GradCache, InfoNce, ParamStore, Recompute, Similarity};

use crate::common::families::{fixture, reference, refs};
use crate::common::{bits, max_abs, max_diff};

const MAX_LEN: usize = 32;

fn adapter_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora")
        .join(family)
}

/// The adapter fixture's gradients, loss and embeddings.
fn peft_reference(family: &str) -> (HashMap<String, Tensor>, f64) {
    let dir = adapter_dir(family);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    (tensors, meta["loss"].as_f64().unwrap())
}

/// The gradient-cache step of the fixture loss on the base model of `family` with the
/// PEFT adapter.
fn step(family: &str, chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture(family);
    let r = reference(family);
    let adapter = PeftAdapter::read(&adapter_dir(family).join("adapter")).unwrap();
    let files = ModelFiles::from_dir(&dir).unwrap();
    let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
    let options = BertOptions {
        lora: Some(adapter.spec.clone()),
        recompute,
        pooling: head.pooling,
        normalize: head.normalize,
        dense: head.dense.iter().map(|d| d.spec()).collect(),
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu)
        .with_frozen(Freeze::default().all_but_adapters())
        .with_fallback_weights("", std::sync::Arc::new(adapter.weight_file().unwrap()));
    let (encoder, bert, _store) = load_pretrained(&files, "", &options, store).unwrap();
    adapter.check_covers(encoder.params(), "").unwrap();
    let loss = InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine);
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let (inner, config) = gradcache::hub::load_tokenizer(&files, &bert).unwrap();
    let tokenizer = Tokenizer::new(inner, MAX_LEN).unwrap().with_config(config);
    let pooled = head.include_prompt;
    let q = tokenizer
        .clone()
        .with_prompt(&head.prompts.query)
        .with_prompt_pooled(pooled)
        .encode(&refs(&r.queries), &Device::Cpu)
        .unwrap();
    let p = tokenizer
        .with_prompt(&head.prompts.passage)
        .with_prompt_pooled(pooled)
        .encode(&refs(&r.passages), &Device::Cpu)
        .unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn adapter_gradients_match_peft_in_chunks_and_under_recompute() {
    for family in ["bert", "qwen3"] {
        let (tensors, want_loss) = peft_reference(family);
        let want: HashMap<&str, &Tensor> = tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
            .collect();
        let global = want.values().map(|g| max_abs(g)).fold(0.0, f64::max);
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::EveryLayer),
            (3, Recompute::Sqrt),
        ] {
            let (loss, grads) = step(family, chunk, recompute.clone());
            let what = format!("{family}, chunk {chunk}, recompute {recompute:?}");
            assert!(
                (loss as f64 - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
                "{what}: loss {loss} against PEFT's {want_loss}"
            );
            assert_eq!(grads.len(), want.len(), "{what}: adapters with a gradient");
            for (name, got) in grads.iter() {
                let reference = want
                    .get(name)
                    .unwrap_or_else(|| panic!("{what}: no PEFT gradient for `{name}`"));
                let err = max_diff(got, reference) / max_abs(reference).max(1e-3 * global);
                assert!(err <= 1e-4, "{what}: gradient of `{name}` off by {err:e}");
            }
        }
    }
}

#[test]
fn an_adapter_directory_embeds_as_the_peft_model() {
    for family in ["bert", "qwen3"] {
        let (tensors, _) = peft_reference(family);
        let r = reference(family);
        let dir = adapter_dir(family).join("adapter");
        // The base from the adapter config (a path from the repository's root), then given.
        for base in [None, Some(fixture(family).display().to_string())] {
            let options = LoadOptions {
                max_len: Some(MAX_LEN),
                base: base.clone(),
                ..Default::default()
            };
            let model = EmbeddingModel::load(dir.to_str().unwrap(), &options).unwrap();
            assert!(
                model.settings().contains("LoRA adapter"),
                "{}",
                model.settings()
            );
            let got = model.embed(&refs(&r.texts), 3).unwrap();
            let err = max_diff(&got, &tensors["embeddings"]);
            assert!(
                err <= 1e-5,
                "{family} (base {base:?}): embeddings off by {err:e}"
            );
        }
    }
}

fn write_run(dir: &Path, family: &str, lora: &str) -> Config {
    let lines: Vec<String> = std::fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .take(24)
        .map(String::from)
        .collect();
    std::fs::write(dir.join("train.jsonl"), lines.join("\n")).unwrap();
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{dir}/train.jsonl"
eval_pairs = 4
[model]
pretrained = "{model}"
query_max_len = 24
passage_max_len = 24
[model.lora]
{lora}
[train]
steps = 1
batch_size = 8
query_chunk = 4
passage_chunk = 4
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = fixture(family).display(),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, config).unwrap();
    Config::load(&path, &[]).unwrap()
}

#[test]
fn lora_from_continues_the_adapter_and_refuses_one_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = adapter_dir("qwen3").join("adapter");
    let saved =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let from = format!("from = \"{}\"", adapter.display());
    let cfg = write_run(dir.path(), "qwen3", &from);
    let trainer = Trainer::new(cfg, None).unwrap();
    assert_eq!(trainer.params().len(), saved.len());
    for (name, var) in trainer.params().iter() {
        let want = &saved[&format!("base_model.model.{name}")];
        assert_eq!(
            bits(var.as_tensor()),
            bits(want),
            "`{name}` not the adapter's"
        );
    }
    drop(trainer);

    let refused = |lora: &str| -> Error {
        let d = tempfile::tempdir().unwrap();
        let cfg = write_run(d.path(), "qwen3", lora);
        let err = Trainer::new(cfg, None).err().expect("accepted");
        assert!(
            !d.path().join("run").exists(),
            "{err}: the run directory was created"
        );
        err
    };
    let err = refused(&format!("{from}\nrank = 8"));
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "model.lora.rank",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("`r` is 4"), "{err}");
    // The BERT fixture's adapter on the Qwen3 model: its targets name none of it.
    let bert_adapter = adapter_dir("bert").join("adapter");
    let err = refused(&format!("from = \"{}\"", bert_adapter.display()));
    assert!(err.to_string().contains("target_modules"), "{err}");
}

/// A copy of the qwen3 fixture's adapter with `edit` applied to its config.
fn edited_adapter(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let from = adapter_dir("qwen3").join("adapter");
    std::fs::create_dir_all(dir).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(from.join(file), dir.join(file)).unwrap();
    }
    let path = dir.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir.to_path_buf()
}

#[test]
fn adapters_this_crate_cannot_run_are_refused_naming_the_setting() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, serde_json::Value); 8] = [
        ("peft_type", "peft_type", "IA3".into()),
        ("use_dora", "use_dora", true.into()),
        ("bias", "bias", "all".into()),
        (
            "modules_to_save",
            "modules_to_save",
            serde_json::json!(["score"]),
        ),
        (
            "rank_pattern",
            "rank_pattern",
            serde_json::json!({"q_proj": 8}),
        ),
        ("target_modules", "target_modules", ".*proj".into()),
        ("r", "r", 0.into()),
        ("lora_dropout", "lora_dropout", 1.5.into()),
    ];
    for (i, (key, named, value)) in cases.into_iter().enumerate() {
        let dir = edited_adapter(&tmp.path().join(i.to_string()), |c| c[key] = value.clone());
        let err = PeftAdapter::read(&dir).unwrap_err();
        assert!(err.to_string().contains(named), "{key}: {err}");
    }
    // A PEFT adapter trained with dropout brings it (a training setting of the run that
    // continues it).
    let dir = edited_adapter(&tmp.path().join("dropout"), |c| {
        c["lora_dropout"] = 0.1.into()
    });
    assert_eq!(PeftAdapter::read(&dir).unwrap().spec.dropout, 0.1);
    // An adapter whose weights lack a module its targets name in the model.
    let dir = edited_adapter(&tmp.path().join("short"), |_| {});
    let weights = dir.join("adapter_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    tensors.retain(|name, _| !name.contains("layers.1.mlp.up_proj"));
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let options = LoadOptions {
        base: Some(fixture("qwen3").display().to_string()),
        ..Default::default()
    };
    let err = EmbeddingModel::load(dir.to_str().unwrap(), &options)
        .err()
        .expect("an incomplete adapter loaded");
    assert!(err.to_string().contains("layers.1.mlp.up_proj"), "{err}");
    // With no base named anywhere.
    let dir = edited_adapter(&tmp.path().join("baseless"), |c| {
        c["base_model_name_or_path"] = serde_json::Value::Null
    });
    let err = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
        .err()
        .expect("an adapter without a base loaded");
    assert!(err.to_string().contains("--base"), "{err}");
}
