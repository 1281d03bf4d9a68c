//! Jina v3's task adapters against the release's arithmetic: the fixture
//! tests/fixtures/jina-tasks (written by scripts/make_task_adapter_fixture.py) holds the
//! release's layout (`xlm-roberta` with rotary positions, parametrized weights, adapters
//! stacked over three tasks) and what the release's code gives: each task's embeddings
//! (instruction, updated weights, mean pooling), and one contrastive loss with queries
//! under `retrieval.query` and passages under `retrieval.passage` with every gradient.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions};
use gradcache::hub::Tokenizer;
use gradcache::hub::{EmbeddingModel, LoadOptions, ModelFiles};
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, Similarity};

use crate::common::families::{assert_step_matches, edited_copy, reference_at, refs};
use crate::common::{max_abs, max_diff};

const MAX_LEN: usize = 32;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jina-tasks")
}

fn load(task: Option<&str>) -> gradcache::Result<EmbeddingModel> {
    load_from(&fixture(), task)
}

/// The model in `dir` under `task` (none: the base).
fn load_from(dir: &std::path::Path, task: Option<&str>) -> gradcache::Result<EmbeddingModel> {
    let options = LoadOptions {
        max_len: Some(MAX_LEN),
        task: task.map(String::from),
        ..Default::default()
    };
    EmbeddingModel::load(dir.to_str().unwrap(), &options)
}

#[test]
fn each_task_encodes_as_the_release_does_and_no_task_as_the_base() {
    let _switches = crate::steady();
    let r = reference_at(&fixture());
    let texts = refs(&r.texts);
    for task in [
        None,
        Some("retrieval.query"),
        Some("retrieval.passage"),
        Some("text-matching"),
    ] {
        let model = load(task).unwrap();
        let want = &r.tensors[&format!("embeddings.{}", task.unwrap_or("none"))];
        for got in [
            model.embed(&texts, 4).unwrap(),
            model.embed_queries(&texts, 3).unwrap(),
            model.embed_passages(&texts, 8).unwrap(),
        ] {
            let err = max_diff(&got, want);
            assert!(err <= 1e-5, "task {task:?}: embeddings differ by {err:e}");
        }
    }
}

/// The cached step of the reference loss: queries under task 0, passages under task 1.
fn step(chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture();
    let r = reference_at(&dir);
    let files = ModelFiles::from_dir(&dir).unwrap();
    let options = BertOptions {
        recompute,
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, config, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let tasks = config.task_adapters(&files.config).unwrap().unwrap();
    let loss = InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine);
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let side = |task: &str| {
        let t = tasks.index(task, "task").unwrap();
        tokenizer
            .clone()
            .with_prompt(&tasks.instructions[t])
            .with_task(Some(t))
    };
    let q = side("retrieval.query")
        .encode(&refs(&r.queries), &Device::Cpu)
        .unwrap();
    let p = side("retrieval.passage")
        .encode(&refs(&r.passages), &Device::Cpu)
        .unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn gradients_of_the_base_and_both_tasks_adapters_match_pytorch() {
    let _switches = crate::steady();
    let r = reference_at(&fixture());
    let want: HashMap<String, &Tensor> = r
        .tensors
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n.to_string(), v)))
        .collect();
    for (chunk, recompute) in [
        (4, Recompute::Off),
        (1, Recompute::Attention),
        (3, Recompute::EveryLayer),
    ] {
        let (loss, grads) = step(chunk, recompute.clone());
        let what = format!("chunk {chunk}, recompute {recompute:?}");
        // The third task's adapters: no text uses them, no gradient reaches them (zero,
        // exactly); compared as zero references beside the others.
        let unused: Vec<(String, Tensor)> = grads
            .iter()
            .filter(|(name, _)| name.ends_with(".task2"))
            .map(|(name, got)| {
                assert_eq!(max_abs(got), 0.0, "{what}: unused task's `{name}` moved");
                (name.to_string(), got.zeros_like().unwrap())
            })
            .collect();
        let mut expected = want.clone();
        expected.extend(unused.iter().map(|(n, z)| (n.clone(), z)));
        let seen = assert_step_matches(&what, (loss, &grads), r.loss, &expected);
        assert_eq!(
            seen,
            expected.len(),
            "{what}: every parameter gets a gradient"
        );
    }
}

#[test]
fn a_task_the_model_lacks_and_a_model_without_tasks_are_refused_by_name() {
    let err = load(Some("classification")).err().unwrap().to_string();
    assert!(
        err.contains("classification") && err.contains("retrieval.query"),
        "{err}"
    );
    let plain = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/gte");
    let err = load_from(&plain, Some("retrieval.query"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("no task adapters") && err.contains("retrieval.query"),
        "{err}"
    );
    // A batch marked for a task, given to a model without adapters (the library's path
    // past the loaders' checks).
    let files = ModelFiles::from_dir(&plain).unwrap();
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, _, _store) = load_pretrained(&files, "", &BertOptions::default(), store).unwrap();
    let batch = Tokenizer::from_file(&plain.join("tokenizer.json"), MAX_LEN)
        .unwrap()
        .with_task(Some(0))
        .encode(&["Jesus wept."], &Device::Cpu)
        .unwrap();
    let err = gradcache::Encoder::encode(&encoder, &batch, &gradcache::Ctx::eval())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("without task adapters"), "{err}");
    // A config naming more tasks than the weights stack: refused naming the stack.
    let tmp = tempfile::tempdir().unwrap();
    let more = edited_copy(&fixture(), &tmp.path().join("more"), "config.json", |c| {
        c["lora_adaptations"]
            .as_array_mut()
            .unwrap()
            .push("separation".into())
    });
    let err = crate::families::load_err(&more);
    assert!(
        err.contains("parametrizations.weight.0.lora_") && err.contains("task 3"),
        "{err}"
    );
}
