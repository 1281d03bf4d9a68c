//! The trainer: configuration parsing and every rejected value, `--set` overrides, and
//! exact resume (the loss of every step after a resume equals the uninterrupted run's).

use std::fs;
use std::path::Path;

use gradcache::train::config::{apply_override, Config, OptimName};
use gradcache::train::trainer::{Quiet, Trainer};
use gradcache::{Chunking, Error, Recompute};

use crate::common::write_tiny_run as setup;

#[test]
fn every_shipped_config_is_valid() {
    for name in [
        "quickstart",
        "minilm",
        "two-towers-hard-negatives",
        "distributed-cpu",
        "qwen3",
        "qwen3-lora",
        "colbert",
    ] {
        let path = format!("configs/{name}.toml");
        let cfg = Config::load(Path::new(&path), &[]).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            cfg.train.batch_size > cfg.train.query_chunk,
            "{path}: the batch should span several chunks"
        );
    }
}

#[test]
fn the_lora_recipe_of_docs_lora_md_parses() {
    // docs/lora.md's step 3, as a shell passes its --set values.
    let sets: Vec<String> = [
        "data.train_file=mined.jsonl",
        "data.eval_file=my-beir",
        "data.eval_split=dev",
        "train.hard_negatives=3",
        "train.chunk_tokens=2048",
        "model.base_dtype=bf16",
        r#"loss.directions=["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]"#,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cfg = Config::load(Path::new("configs/qwen3-lora.toml"), &sets).unwrap();
    assert_eq!(
        cfg.model.base_dtype,
        gradcache::train::config::BaseDtype::Bf16
    );
    assert_eq!(cfg.loss.directions.len(), 4);
    assert_eq!(cfg.train.chunk_tokens, Some(2048));
    assert_eq!(cfg.model.lora.as_ref().and_then(|l| l.rank), Some(16));
}

#[test]
fn quickstart_config_parses_with_overrides() {
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &[]).unwrap();
    assert_eq!(cfg.train.batch_size, 128);
    let sets = [
        "train.steps=1",
        "optim.name=sgd",
        "optim.lr=0.5",
        "optim.warmup_steps=0",
        "model.recompute={ every = 2 }",
        "model.fresh.hidden_size=64",
        "loss.similarity=dot",
        "data.fields.query=anchor",
        "seed=3",
        "output_dir=/tmp/elsewhere",
        "model.pretrained=org/model",
    ];
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &sets).unwrap();
    assert_eq!(cfg.train.steps, 1);
    assert_eq!(cfg.optim.name, OptimName::Sgd);
    assert_eq!(cfg.optim.lr, 0.5);
    assert_eq!(cfg.model.recompute, Recompute::Every(2));
    assert_eq!(cfg.model.fresh.hidden_size, 64);
    let selective = |value: &str| {
        let set = format!("model.recompute={value}");
        Config::load(Path::new("configs/quickstart.toml"), &[set])
            .unwrap()
            .model
            .recompute
    };
    assert_eq!(selective("\"attention\""), Recompute::Attention);
    assert_eq!(
        selective("{ selective = { segments = \"sqrt\", keep = [\"intermediate\"] } }"),
        Recompute::Selective {
            segments: Box::new(Recompute::Sqrt),
            keep: vec!["intermediate".into()],
        }
    );
    assert_eq!(
        selective("{ selective = { segments = { every = 2 } } }"),
        Recompute::Selective {
            segments: Box::new(Recompute::Every(2)),
            keep: vec![],
        }
    );
    assert_eq!(cfg.data.fields.query, "anchor");
    assert_eq!(cfg.seed, 3);
    assert_eq!(cfg.output_dir, Path::new("/tmp/elsewhere"));
    assert_eq!(cfg.model.pretrained, "org/model");
}

#[test]
fn every_bad_value_is_rejected_with_its_key() {
    let q = Path::new("configs/quickstart.toml");
    let cases = [
        ("train.chunk_size=4", "unknown field `chunk_size`"),
        ("optimizer.lr=1", "unknown field `optimizer`"),
        ("train.query_chunk=0", "`train.query_chunk`: 0"),
        ("train.passage_chunk=0", "`train.passage_chunk`: 0"),
        ("train.chunk_tokens=0", "`train.chunk_tokens`: 0"),
        ("train.batch_size=0", "`train.batch_size`: 0"),
        ("train.steps=0", "`train.steps`: 0"),
        ("loss.temperature=0", "`loss.temperature`: 0"),
        ("loss.temperature=-1", "`loss.temperature`: -1"),
        ("optim.lr=-1", "`optim.lr`"),
        ("optim.name=adam", "unknown variant `adam`"),
        ("model.pooling=median", "unknown variant `median`"),
        ("model.query_max_len=1", "`model.query_max_len`"),
        ("model.fresh.num_heads=3", "`model.fresh.num_heads`"),
        ("train.steps=ten", "invalid type"),
        ("novalue", "expected key=value"),
        ("train.keep_checkpoints=0", "`train.keep_checkpoints`: 0"),
        (
            "optim.warmup_steps=1000",
            "`optim.warmup_steps`: 1000 (must not exceed train.steps",
        ),
        ("optim.warmup_ratio=1.5", "`optim.warmup_ratio`: 1.5"),
        ("optim.warmup_ratio=-0.1", "`optim.warmup_ratio`: -0.1"),
        ("optim.max_grad_norm=-1", "`optim.max_grad_norm`: -1"),
        ("model.fresh.vocab_size=5", "`model.fresh.vocab_size`: 5"),
        (
            "model.fresh.dropout_prob=1.0",
            "`model.fresh.dropout_prob`: 1",
        ),
        ("optim.beta1=1.5", "`optim.beta1`: 1.5"),
        ("precision=f8", "unknown variant `f8`"),
        (
            "device=tpu",
            "invalid device tpu: expected \"cpu\", \"cuda\" or \"cuda:N\"",
        ),
        ("device=cuda:x", "invalid device cuda:x"),
        ("loss_scale.init=0", "`loss_scale.init`: 0"),
        (
            "loss_scale.backoff_factor=2",
            "`loss_scale.backoff_factor`: 2",
        ),
        (
            "loss_scale.growth_factor=0.5",
            "`loss_scale.growth_factor`: 0.5",
        ),
        (
            "loss_scale.growth_interval=0",
            "`loss_scale.growth_interval`: 0",
        ),
    ];
    for (set, want) in cases {
        let err = Config::load(q, &[set.to_string()]).unwrap_err();
        assert!(
            err.to_string().contains(want),
            "--set {set}: `{err}` should contain `{want}`"
        );
    }
    let err = Config::load(Path::new("configs/missing.toml"), &[]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingFile {
                what: "config file",
                ..
            }
        ),
        "{err:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    fs::write(&bad, "seed = 1\noutput_dir = \"x\"\nsurprise = true\n[data]\ntrain_file = \"t\"\neval_pairs = 2\n").unwrap();
    let err = Config::load(&bad, &[]).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `surprise`"),
        "{err}"
    );
}

#[test]
fn missing_or_malformed_data_is_reported_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let path = setup(dir.path());
    let cfg = Config::load(
        &path,
        &[format!(
            "data.train_file={}/none.jsonl",
            dir.path().display()
        )],
    )
    .unwrap();
    let err = Trainer::new(cfg, None).err().unwrap();
    assert!(
        matches!(
            err,
            Error::MissingFile {
                what: "data file",
                ..
            }
        ),
        "{err:?}"
    );

    let broken = dir.path().join("broken.jsonl");
    fs::write(
        &broken,
        "{\"query\": \"a\", \"positive\": \"b\"}\n{\"query\": \"a\"\n",
    )
    .unwrap();
    let cfg = Config::load(&path, &[format!("data.eval_file={}", broken.display())]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap();
    assert!(
        err.to_string()
            .starts_with(&format!("{}:2: not valid JSON", broken.display())),
        "{err}"
    );
    assert!(
        !dir.path().join("run").join("checkpoints").exists(),
        "nothing was trained or saved"
    );
}

#[test]
fn chunks_by_tokens_train_as_chunks_by_rows_do() {
    // Without dropout a step's gradient does not depend on how the rows are cut: a run in
    // chunks of at most 40 padded tokens ends where the run in chunks of 3/5 rows does.
    let dir = tempfile::tempdir().unwrap();
    let path = setup(dir.path());
    let run = |name: &str, sets: &[&str]| {
        let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        sets.push("model.dropout=false".into());
        let mut cfg = Config::load(&path, &sets).unwrap();
        cfg.output_dir = dir.path().join(name);
        let mut trainer = Trainer::new(cfg, None).unwrap();
        let losses: Vec<f32> = (0..2).map(|_| trainer.train_step().unwrap().loss).collect();
        (losses, trainer)
    };
    let (rows, by_rows) = run("rows", &[]);
    let (tokens, by_tokens) = run("tokens", &["train.chunk_tokens=40"]);
    assert_eq!(
        by_rows.gradient_cache().chunking(),
        (Chunking::Rows(3), Chunking::Rows(5))
    );
    assert_eq!(
        by_tokens.gradient_cache().chunking(),
        (Chunking::Tokens(40), Chunking::Tokens(40))
    );
    for (a, b) in rows.iter().zip(&tokens) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "losses {rows:?} vs {tokens:?}"
        );
    }
    for (name, var) in by_rows.params().iter() {
        let other = by_tokens.params().get(name).unwrap().as_tensor();
        let diff = var.as_tensor().sub(other).unwrap().abs().unwrap();
        let diff = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-5, "`{name}` differs by {diff:e} after two steps");
    }

    let both = [
        "train.chunk_tokens=40".to_string(),
        "train.memory_budget=\"1GiB\"".to_string(),
    ];
    let err = Config::load(&path, &both).unwrap_err();
    assert!(
        err.to_string().contains("`train.chunk_tokens`: 40")
            && err.to_string().contains("memory_budget"),
        "{err}"
    );
}

#[test]
fn resume_continues_with_identical_losses() {
    let dir = tempfile::tempdir().unwrap();
    let path = setup(dir.path());
    let cfg = Config::load(&path, &[]).unwrap();
    // The uninterrupted run has a directory of its own (one run per directory).
    let mut uninterrupted = cfg.clone();
    uninterrupted.output_dir = dir.path().join("uninterrupted");
    let mut full = Trainer::new(uninterrupted, None).unwrap();
    let losses: Vec<f32> = (0..4).map(|_| full.train_step().unwrap().loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()));

    // The same run, interrupted after 2 steps (checkpoint), then resumed in a new trainer.
    let mut first = Trainer::new(cfg.clone(), None).unwrap();
    let head: Vec<f32> = (0..2).map(|_| first.train_step().unwrap().loss).collect();
    let ckpt = first.save_checkpoint().unwrap();
    drop(first);
    assert_eq!(head, losses[..2], "same seed, same first steps");
    let mut resumed = Trainer::new(cfg.clone(), Some(&ckpt)).unwrap();
    assert_eq!(resumed.step(), 2);
    let tail: Vec<f32> = (0..2).map(|_| resumed.train_step().unwrap().loss).collect();
    assert_eq!(
        tail,
        losses[2..],
        "losses after the resume must equal the uninterrupted run's"
    );
    for (name, var) in full.params().iter() {
        let other = resumed.params().get(name).unwrap();
        let d = var
            .as_tensor()
            .sub(other.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(
            d.to_scalar::<f32>().unwrap(),
            0.0,
            "`{name}` differs after resume"
        );
    }

    // A checkpoint of another configuration is refused.
    let other = Config::load(&path, &["optim.lr=0.5".to_string()]).unwrap();
    let err = Trainer::new(other, Some(&ckpt)).err().unwrap();
    assert!(err.to_string().contains("another configuration"), "{err}");
}

#[test]
fn run_evaluates_checkpoints_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let path = setup(dir.path());
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    let (before, after) = trainer.run(&mut Quiet).unwrap();
    assert_eq!(before.unwrap().queries, 10);
    assert_eq!(after.queries, 10);
    let ckpts =
        gradcache::train::checkpoint::list(&dir.path().join("run").join("checkpoints")).unwrap();
    assert_eq!(ckpts.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2, 4]);
    let out = dir.path().join("exported");
    trainer.export(&out, gradcache::Side::Query).unwrap();
    assert!(out.join("model.safetensors").is_file() && out.join("modules.json").is_file());

    let mut table = toml::Table::new();
    apply_override(&mut table, "a.b.c=[1, 2]").unwrap();
    assert_eq!(
        table["a"]["b"]["c"],
        toml::Value::Array(vec![1.into(), 2.into()])
    );
}

#[test]
fn the_loss_splits_into_row_blocks_by_itself_only_when_the_batch_is_large() {
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &[]).unwrap();
    let l = &cfg.loss;
    assert_eq!(l.block_rows, 0);
    assert_eq!(
        l.effective_block_rows(128, 0),
        None,
        "the quickstart: one block"
    );
    assert_eq!(
        l.effective_block_rows(2048, 0),
        None,
        "2^22 logits still fit"
    );
    assert_eq!(l.effective_block_rows(4096, 0), Some(1024));
    // 65,536 pairs: 64 rows x 65,536 candidates = 2^22 logits per block.
    assert_eq!(l.effective_block_rows(65_536, 0), Some(64));
    // Hard negatives widen the candidates and narrow the blocks.
    assert_eq!(l.effective_block_rows(4096, 3), Some(256));
    let sets = ["loss.block_rows=5".to_string()];
    let set = Config::load(Path::new("configs/quickstart.toml"), &sets).unwrap();
    assert_eq!(set.loss.effective_block_rows(65_536, 0), Some(5));
}

/// `train.memory_budget` measures with the counting allocator; a program without it (this
/// test binary) gets an error saying so, not a plan from zeros.
#[test]
fn a_memory_budget_without_the_counting_allocator_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let sets = vec![
        format!("output_dir={}", dir.path().join("run").display()),
        "train.memory_budget=\"1GiB\"".to_string(),
    ];
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &sets).unwrap();
    let e = Trainer::new(cfg, None)
        .err()
        .expect("no allocator to measure with");
    assert!(e.to_string().contains("CountingAllocator"), "{e}");
    assert!(!dir.path().join("run").exists());
}
