//! Trainer paths end to end, each on a tiny run: two towers with hard negatives (they
//! start from one initialisation and learn below chance), a pretrained model directory
//! with two towers exported tower by tower, an export that reads only the run directory,
//! and set-up failures that leave the output directory untouched.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::train::{export_run, Config, Quiet, Trainer};
use gradcache::{Error, Side, Similarity};

use crate::common::{max_diff, vocab_pairs, write_bert_dir, write_tiny_run, TINY_BERT};

fn load(path: &Path, sets: &[&str]) -> Config {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Config::load(path, &sets).unwrap()
}

/// Every file under `dir` with its size and modification time.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else {
                out.insert(path, (meta.len(), meta.modified().unwrap()));
            }
        }
    }
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn two_towers_with_hard_negatives_start_alike_and_learn_below_chance() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tiny_run(dir.path());
    let cfg = load(
        &path,
        &[
            "model.shared=false",
            "train.hard_negatives=1",
            "train.steps=12",
            "optim.lr=3e-3",
            "train.checkpoint_every=0",
        ],
    );
    let mut trainer = Trainer::new(cfg, None).unwrap();
    // One initialisation, copied into both towers (DPR starts both from one checkpoint).
    let params = trainer.params().clone();
    let mut towers = 0;
    for (name, var) in params.iter() {
        if let Some(rest) = name.strip_prefix("query.") {
            let other = params.get(&format!("passage.{rest}")).unwrap();
            assert_eq!(max_diff(var.as_tensor(), other.as_tensor()), 0.0, "{rest}");
            towers += 1;
        }
    }
    assert_eq!(
        towers * 2,
        params.len(),
        "two towers of the same parameters"
    );

    let losses: Vec<f32> = (0..12)
        .map(|_| trainer.train_step().unwrap().loss)
        .collect();
    // 8 queries, each against 8 x (1 + 1) passages: chance is ln(16).
    let chance = (16f32).ln();
    let last: f32 = losses[9..].iter().sum::<f32>() / 3.0;
    assert!(
        last < 0.8 * chance && last < losses[0],
        "losses {losses:?}: the last three average {last}, chance is {chance}"
    );
    // The towers trained apart.
    let moved = params
        .iter()
        .filter_map(|(name, var)| {
            let rest = name.strip_prefix("query.")?;
            let other = params.get(&format!("passage.{rest}"))?;
            Some(max_diff(var.as_tensor(), other.as_tensor()))
        })
        .fold(0.0, f64::max);
    assert!(moved > 0.0, "the towers are still identical");
}

fn pretrained_run(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-bert");
    write_bert_dir(&model, TINY_BERT, true);
    vocab_pairs(&dir.join("pairs.jsonl"));
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{dir}/pairs.jsonl"
eval_pairs = 6
[model]
pretrained = "{model}"
shared = false
pooling = "cls"
normalize = false
query_max_len = 10
passage_max_len = 12
[loss]
similarity = "dot"
temperature = 1.0
[train]
steps = 3
batch_size = 4
query_chunk = 3
passage_chunk = 5
hard_negatives = 1
[optim]
lr = 1e-3
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = model.display(),
    );
    let path = dir.join("pretrained.toml");
    fs::write(&path, config).unwrap();
    path
}

#[test]
fn a_pretrained_directory_trains_two_towers_and_exports_each() {
    let dir = tempfile::tempdir().unwrap();
    let path = pretrained_run(dir.path());
    let mut trainer = Trainer::new(load(&path, &[]), None).unwrap();
    let (before, after) = trainer.run(&mut Quiet).unwrap();
    assert_eq!(before.unwrap().queries, 6);
    assert_eq!(after.queries, 6);

    let texts = ["the lord is my shepherd", "light", "my lords, the light"];
    let mut embeddings = Vec::new();
    for side in [Side::Query, Side::Passage] {
        let from_run = dir.path().join(format!("export-{side}"));
        let step = export_run(trainer.config(), None, &from_run, side)
            .unwrap()
            .state
            .step;
        assert_eq!(step, 3);
        let live = dir.path().join(format!("live-{side}"));
        trainer.export(&live, side).unwrap();
        let a =
            EmbeddingModel::load(&from_run.display().to_string(), &LoadOptions::default()).unwrap();
        let b = EmbeddingModel::load(&live.display().to_string(), &LoadOptions::default()).unwrap();
        // The export says how the run pooled and compared.
        assert_eq!(a.similarity(), Similarity::Dot);
        assert!(
            a.settings()
                .contains("pooling cls (from 1_Pooling/config.json)")
                && a.settings().contains("normalize false (from modules.json)")
                && a.settings()
                    .contains("similarity dot (from config_sentence_transformers.json)"),
            "{}",
            a.settings()
        );
        let (ea, eb) = (a.embed(&texts, 2).unwrap(), b.embed(&texts, 2).unwrap());
        assert_eq!(
            max_diff(&ea, &eb),
            0.0,
            "{side}: checkpoint and live state differ"
        );
        embeddings.push(ea);
    }
    assert!(
        max_diff(&embeddings[0], &embeddings[1]) > 0.0,
        "the query and passage towers trained apart"
    );
}

#[test]
fn a_token_limit_beyond_the_position_table_names_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = pretrained_run(dir.path());
    // The tiny model covers 16 positions; only the passage limit is too long.
    let err = Trainer::new(load(&path, &["model.passage_max_len=20"]), None)
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "model.passage_max_len",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!dir.path().join("run").exists(), "nothing was written");
}

/// The tiny run of `dir`, trained for 2 steps (a checkpoint at step 2): its config file
/// and configuration.
fn trained_tiny_run(dir: &Path) -> (PathBuf, Config) {
    let path = write_tiny_run(dir);
    let cfg = load(&path, &["train.steps=2"]);
    Trainer::new(cfg.clone(), None)
        .unwrap()
        .run(&mut Quiet)
        .unwrap();
    (path, cfg)
}

#[test]
fn export_reads_only_the_run_directory_and_writes_only_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = trained_tiny_run(dir.path());
    fs::remove_file(dir.path().join("train.jsonl")).unwrap();
    fs::remove_file(dir.path().join("eval.jsonl")).unwrap();
    let run = dir.path().join("run");
    let before = snapshot(&run);

    let out = dir.path().join("exported");
    for side in [Side::Query, Side::Passage] {
        // A shared tower exports as itself for either side.
        let target = dir.path().join(format!("exported-{side}"));
        export_run(&cfg, None, &target, side).unwrap();
    }
    fs::rename(dir.path().join("exported-query"), &out).unwrap();
    assert_eq!(snapshot(&run), before, "the run directory is unchanged");
    assert_eq!(
        names(dir.path()),
        ["exported", "exported-passage", "run", "tiny.toml"],
        "nothing else was written"
    );
    let model = EmbeddingModel::load(&out.display().to_string(), &LoadOptions::default()).unwrap();
    assert_eq!(model.similarity(), Similarity::Cosine);
    model.embed(&["in the beginning"], 1).unwrap();

    // The weights file is as readable as its siblings (the safetensors writer makes it
    // private).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |f: &str| fs::metadata(out.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode("model.safetensors"), mode("config.json"));
    }

    // Another configuration than the run's is refused, and writes nothing.
    let other = load(&path, &["train.steps=2", "loss.temperature=0.5"]);
    let err = export_run(&other, None, &dir.path().join("x"), Side::Query).unwrap_err();
    assert!(matches!(err, Error::CheckpointMismatch { .. }), "{err:?}");
    assert!(!dir.path().join("x").exists());
}

#[test]
fn a_failed_set_up_leaves_the_output_directory_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = trained_tiny_run(dir.path());
    let good = dir
        .path()
        .join("run")
        .join("checkpoints")
        .join("step-00000002");
    assert!(good.is_dir());

    // A corrupt copy of the checkpoint, resumed into a new output directory.
    let corrupt = dir.path().join("corrupt");
    fs::create_dir_all(&corrupt).unwrap();
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        fs::copy(good.join(f), corrupt.join(f)).unwrap();
    }
    fs::write(corrupt.join("model.safetensors"), b"not safetensors").unwrap();
    let fresh = dir.path().join("fresh-run");
    let out = format!("output_dir={}", fresh.display());
    let err = Trainer::new(load(&path, &["train.steps=2", &out]), Some(&corrupt))
        .err()
        .unwrap();
    assert!(
        matches!(&err, Error::CorruptCheckpoint { path, .. } if path.ends_with("model.safetensors")),
        "{err:?}"
    );
    assert!(
        !fresh.exists(),
        "a failed resume wrote into {}",
        fresh.display()
    );

    // A checkpoint of another configuration: refused, nothing written.
    let err = Trainer::new(
        load(&path, &["train.steps=2", &out, "optim.lr=0.5"]),
        Some(&good),
    )
    .err()
    .unwrap();
    assert!(
        matches!(err, Error::CheckpointMismatch { .. }) && err.to_string().contains("another"),
        "{err:?}"
    );
    assert!(!fresh.exists());

    // An output directory that cannot be created says so.
    let file = dir.path().join("a-file");
    fs::write(&file, "x").unwrap();
    let out = format!("output_dir={}", file.join("run").display());
    let err = Trainer::new(load(&path, &["train.steps=2", &out]), None)
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            Error::Io {
                action: "create",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().starts_with("cannot create"), "{err}");
}

#[test]
fn short_runs_of_the_quickstart_keep_their_warmup_shape() {
    let q = Path::new("configs/quickstart.toml");
    let cfg = load(q, &["train.steps=4"]);
    assert_eq!(cfg.optim.warmup(4), 1);
    assert_eq!(cfg.optim.warmup(100), 10);
    // However the warmup is written, the same run has the same fingerprint.
    let ratio = load(q, &[]);
    let steps = load(q, &["optim.warmup_steps=10", "optim.warmup_ratio=0"]);
    assert_eq!(ratio.fingerprint().unwrap(), steps.fingerprint().unwrap());
}
