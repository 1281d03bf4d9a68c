//! Training Jina v3's task adapters through the trainer (the fixture
//! tests/fixtures/jina-tasks: the release's layout, three tasks): queries under
//! `retrieval.query` and passages under `retrieval.passage` train those two tasks'
//! adapters alone (the base and the third task stay the file's, bit for bit), resume
//! exactly, and export in the release's layout, which loads back with the same task
//! selection, or with one task merged as a plain model; bad task settings are refused before anything is written.

use std::fs;
use std::path::{Path, PathBuf};

use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::train::{export_run, export_run_as, Config, ExportLayout, Quiet, Trainer};
use gradcache::{Error, Side};

use crate::common::families::edited_copy;
use crate::common::{bits, max_diff, vocab_pairs};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jina-tasks")
}

fn run_config(dir: &Path, model: &Path, tasks: &str) -> PathBuf {
    vocab_pairs(&dir.join("pairs.jsonl"));
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{dir}/pairs.jsonl"
eval_pairs = 6
[model]
pretrained = "{model}"
query_max_len = 24
passage_max_len = 24
recompute = "every_layer"
{tasks}
[loss]
temperature = 0.1
[train]
steps = 4
batch_size = 6
query_chunk = 2
passage_chunk = 4
checkpoint_every = 2
[optim]
lr = 1e-2
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = model.display(),
    );
    let path = dir.join("tasks.toml");
    fs::write(&path, config).unwrap();
    path
}

fn weights(path: &Path) -> std::collections::HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
}

fn embed(dir: &Path, task: Option<&str>) -> candle_core::Tensor {
    let options = LoadOptions {
        task: task.map(String::from),
        ..Default::default()
    };
    let texts = ["the lord is my shepherd", "light", "my lords, the light"];
    EmbeddingModel::load(&dir.display().to_string(), &options)
        .unwrap()
        .embed(&texts, 2)
        .unwrap()
}

#[test]
fn a_run_trains_its_tasks_adapters_alone_resumes_exactly_and_exports_the_release_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = run_config(
        dir.path(),
        &fixture(),
        "query_task = \"retrieval.query\"\npassage_task = \"retrieval.passage\"",
    );
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    trainer.run(&mut Quiet).unwrap();

    // Two tasks' adapters train: 2 tables and 4 projections of 2 layers, A and B each.
    let names: Vec<&str> = trainer.params().names().collect();
    assert_eq!(names.len(), 2 * 10 * 2, "{names:?}");
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".task0") || n.ends_with(".task1")),
        "{names:?}"
    );
    for (name, var) in trainer.params().iter() {
        assert!(
            crate::common::max_abs(var.as_tensor()) > 0.0,
            "`{name}` is zero"
        );
    }

    // Resumed from step 2: the same adapters, bit for bit.
    let ckpt = dir.path().join("run/checkpoints/step-00000002");
    let mut elsewhere = cfg.clone();
    elsewhere.output_dir = dir.path().join("resumed");
    let mut resumed = Trainer::new(elsewhere, Some(&ckpt)).unwrap();
    resumed.run(&mut Quiet).unwrap();
    for (name, var) in trainer.params().iter() {
        let other = resumed.params().get(name).unwrap();
        assert_eq!(bits(var.as_tensor()), bits(other.as_tensor()), "`{name}`");
    }

    // The export: the release's layout, the base and the third task the file's bit for
    // bit, the trained tasks' slices moved.
    let out = dir.path().join("export");
    export_run(&cfg, None, &out, Side::Query).unwrap();
    let (before, after) = (
        weights(&fixture().join("model.safetensors")),
        weights(&out.join("model.safetensors")),
    );
    for (name, want) in &before {
        if name.starts_with("roberta.pooler.") {
            continue; // mean pooling reads no pooler: not part of the run
        }
        let got = after
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` missing from the export"));
        assert_eq!(got.dims(), want.dims(), "`{name}`");
        if name.contains(".lora_") {
            let slice = |t: &candle_core::Tensor, i: usize| t.get(i).unwrap();
            assert_eq!(
                bits(&slice(got, 2)),
                bits(&slice(want, 2)),
                "`{name}` task 2"
            );
            assert_ne!(
                bits(&slice(got, 0)),
                bits(&slice(want, 0)),
                "`{name}` task 0"
            );
            assert_ne!(
                bits(&slice(got, 1)),
                bits(&slice(want, 1)),
                "`{name}` task 1"
            );
        } else {
            assert_eq!(bits(got), bits(want), "`{name}` moved");
        }
    }
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "XLMRobertaLoRA");
    assert_eq!(config["lora_adaptations"].as_array().unwrap().len(), 3);

    // Loaded back: the untrained task and the base encode as before, the trained ones not.
    for task in [None, Some("text-matching")] {
        let err = max_diff(&embed(&out, task), &embed(&fixture(), task));
        assert!(err <= 1e-6, "{task:?}: {err:e}");
    }
    for task in ["retrieval.query", "retrieval.passage"] {
        let moved = max_diff(&embed(&out, Some(task)), &embed(&fixture(), Some(task)));
        assert!(moved > 1e-4, "{task}: {moved:e}");
    }

    // One task merged: a plain Jina v3 (no adapters, transformers 5's config) whose
    // queries (the task's instruction as their prompt) embed as the task did.
    let plain = dir.path().join("plain");
    export_run_as(
        &cfg,
        None,
        &plain,
        Side::Query,
        ExportLayout::Task("retrieval.query".into()),
    )
    .unwrap();
    let written = weights(&plain.join("model.safetensors"));
    assert!(
        written
            .keys()
            .all(|n| !n.contains("lora_") && !n.contains("parametrizations")),
        "{:?}",
        written.keys().collect::<Vec<_>>()
    );
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(plain.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "jina_embeddings_v3");
    assert!(config.get("lora_adaptations").is_none());
    let texts = ["the lord is my shepherd", "light", "my lords, the light"];
    let queries = EmbeddingModel::load(&plain.display().to_string(), &LoadOptions::default())
        .unwrap()
        .embed_queries(&texts, 2)
        .unwrap();
    let err = max_diff(&queries, &embed(&out, Some("retrieval.query")));
    assert!(err <= 1e-5, "merged task: {err:e}");
    let other = export_run_as(
        &cfg,
        None,
        &dir.path().join("none"),
        Side::Query,
        ExportLayout::Task("classification".into()),
    )
    .unwrap_err()
    .to_string();
    assert!(other.contains("classification"), "{other}");
    assert!(!dir.path().join("none").exists());
}

#[test]
fn bad_task_settings_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let refused_on = |model: &Path, tasks: &str| -> String {
        let path = run_config(dir.path(), model, tasks);
        let err: Error = match Config::load(&path, &[]) {
            Err(e) => e,
            Ok(cfg) => Trainer::new(cfg, None).err().expect("accepted"),
        };
        assert!(!out.exists(), "{err}: the run directory was created");
        err.to_string()
    };
    let refused = |tasks: &str| refused_on(&fixture(), tasks);
    let err = refused("task = \"classification\"");
    assert!(
        err.contains("classification") && err.contains("text-matching"),
        "{err}"
    );
    let err = refused("query_task = \"retrieval.query\"\n[model.lora]\nrank = 2");
    assert!(err.contains("model.lora"), "{err}");
    let err = refused("task = \"text-matching\"\nshared = false");
    assert!(err.contains("shared"), "{err}");
    // A task of a model without adapters, named with the model.
    let gte = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/gte");
    let err = refused_on(&gte, "task = \"retrieval.query\"");
    assert!(
        err.contains("no task adapters") && err.contains("families/gte"),
        "{err}"
    );
    // The release's adapter dropout, with dropout on (the default).
    let dropped = edited_copy(
        &fixture(),
        &dir.path().join("dropped"),
        "config.json",
        |c| c["lora_dropout_p"] = 0.1.into(),
    );
    let err = refused_on(&dropped, "task = \"text-matching\"");
    assert!(err.contains("lora_dropout_p"), "{err}");
    // With dropout off the release's dropout never runs: accepted.
    let path = run_config(
        dir.path(),
        &dropped,
        "task = \"text-matching\"\ndropout = false",
    );
    Trainer::new(Config::load(&path, &[]).unwrap(), None).unwrap();
    // A task merged out of a run whose model has none: refused, nothing written.
    std::fs::remove_dir_all(&out).unwrap();
    let cfg = Config::load(&run_config(dir.path(), &gte, ""), &[]).unwrap();
    Trainer::new(cfg.clone(), None)
        .unwrap()
        .run(&mut Quiet)
        .unwrap();
    let merged = dir.path().join("merged");
    let err = export_run_as(
        &cfg,
        None,
        &merged,
        Side::Query,
        ExportLayout::Task("retrieval.query".into()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no task adapters"), "{err}");
    assert!(!merged.exists());
}
