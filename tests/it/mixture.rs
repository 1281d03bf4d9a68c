//! Training on a mixture of sources (`[[data.sources]]`):
//!
//! - which source a step draws: proportional counts within 3 sigma of the sizes over 1,000
//!   steps, round robin in order, weighted and tempered shares, a pure function of (seed,
//!   step);
//! - each source shuffles by its own epochs: no pair twice within one of its epochs, every
//!   pair once; a step's whole batch from its source;
//! - a row's own instruction replaces its source's, and the export writes the sources'
//!   prompts by name;
//! - `metrics.jsonl` names each step's source, the log counts steps and pairs per source;
//!   kill -9 in the middle of a mixture and `--resume`: every loss equal to the
//!   uninterrupted run's, bit for bit, and the same source at every step;
//! - distillation per source (a source without scores trains by InfoNCE alone) and a
//!   source without in-batch negatives, under the cache;
//! - a folder or a glob of shards, a streamed source and a source's own field names serve
//!   what one file in memory would; `mixed` batches take rows of every source;
//! - a Hub data set of two Parquet shards trains from the hf-hub cache with the network
//!   off;
//! - `[[data.evals]]` reported by name with their mean; `train.best_by` keeps the best
//!   evaluation's checkpoint;
//! - bad mixtures refused by name before anything is written;
//! - `configs/mixture.toml` as shipped learns (shortened).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use gradcache::hub::Tokenizer;
use gradcache::train::config::{Sampling, SamplingName};
use gradcache::train::sources::SourcePicker;
use gradcache::train::{Config, Task, Trainer};

use crate::common::quickstart_sample;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gradcache")
}

/// Three sources cut from the quickstart pairs: `verses` (40 pairs), `prompted` (24 pairs,
/// an instruction of its own, two rows with their own), `distilled` (16 pairs, 2 hard
/// negatives each with teacher scores); held-out pairs to evaluate on; the config at
/// `dir/mix.toml` (`extra` appended), the run in `dir/run`.
fn write_mixture(dir: &Path, extra: &str) -> PathBuf {
    quickstart_sample(dir, 0..80, 100..112);
    let lines: Vec<serde_json::Value> = fs::read_to_string(dir.join("train.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let write = |name: &str, rows: Vec<serde_json::Value>| {
        let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        fs::write(dir.join(name), text.join("\n")).unwrap();
    };
    write("verses.jsonl", lines[0..40].to_vec());
    write(
        "prompted.jsonl",
        lines[40..64]
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let mut l = l.clone();
                if i < 2 {
                    l["prompt"] = serde_json::json!("Find its twin: ");
                }
                l
            })
            .collect(),
    );
    let n = 16;
    write(
        "distilled.jsonl",
        (0..n)
            .map(|i| {
                let row = &lines[64 + i];
                let other = |j: usize| lines[64 + (i + j) % n]["positive"].clone();
                serde_json::json!({
                    "query": row["query"], "positive": row["positive"],
                    "negatives": [other(1), other(2)], "scores": [8.0, 2.0, 1.0],
                })
            })
            .collect(),
    );
    let config = format!(
        r#"
seed = 11
output_dir = "{out}"
[data]
eval_file = "{dir}/eval.jsonl"
[[data.sources]]
name = "verses"
path = "{dir}/verses.jsonl"
loss = {{ symmetric = true }}
[[data.sources]]
name = "prompted"
path = "{dir}/prompted.jsonl"
query_prompt = "Find the same verse: "
[[data.sources]]
name = "distilled"
path = "{dir}/distilled.jsonl"
hard_negatives = 2
[model]
query_max_len = 24
passage_max_len = 24
[model.fresh]
vocab_size = 300
hidden_size = 16
num_layers = 1
num_heads = 2
intermediate_size = 32
[loss]
temperature = 0.1
[train]
steps = 8
batch_size = 8
query_chunk = 3
passage_chunk = 5
checkpoint_every = 2
keep_checkpoints = 8
[optim]
lr = 1e-3
{extra}
"#,
        out = dir.join("run").display(),
        dir = dir.display()
    );
    let path = dir.join("mix.toml");
    fs::write(&path, config).unwrap();
    path
}

#[test]
fn sources_are_drawn_by_size_in_turn_by_weight_and_tempered() {
    let sizes = [600, 300, 100];
    let steps = 1000u64;
    let picker = SourcePicker::new(None, &sizes, &[1.0; 3], 5);
    let mut counts = [0u64; 3];
    for step in 0..steps {
        counts[picker.pick(step)] += 1;
    }
    for (i, &n) in sizes.iter().enumerate() {
        let p = n as f64 / 1000.0;
        let mean = p * steps as f64;
        let sigma = (steps as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (counts[i] as f64 - mean).abs() <= 3.0 * sigma,
            "source {i}: {} steps for {mean:.0} +- {sigma:.1}",
            counts[i]
        );
    }
    // A pure function of (seed, step): the same again, another seed another sequence.
    let again: Vec<usize> = (0..200).map(|s| picker.pick(s)).collect();
    assert_eq!(again, (0..200).map(|s| picker.pick(s)).collect::<Vec<_>>());
    let other = SourcePicker::new(None, &sizes, &[1.0; 3], 6);
    assert_ne!(again, (0..200).map(|s| other.pick(s)).collect::<Vec<_>>());
    // Round robin: in the order written.
    let turns = SourcePicker::new(
        Some(Sampling::Named(SamplingName::RoundRobin)),
        &sizes,
        &[1.0; 3],
        5,
    );
    let order: Vec<usize> = (0..7).map(|s| turns.pick(s)).collect();
    assert_eq!(order, [0, 1, 2, 0, 1, 2, 0]);
    // By weight, and by size^(1/T).
    let weighted = SourcePicker::new(
        Some(Sampling::Named(SamplingName::Weighted)),
        &sizes,
        &[1.0, 1.0, 2.0],
        5,
    );
    let p = weighted.probabilities();
    assert!(
        (p[0] - 0.25).abs() < 1e-12 && (p[2] - 0.5).abs() < 1e-12,
        "{p:?}"
    );
    let tempered = SourcePicker::new(
        Some(Sampling::Tempered { temperature: 2.0 }),
        &sizes,
        &[1.0; 3],
        5,
    );
    let p = tempered.probabilities();
    let roots: Vec<f64> = sizes.iter().map(|&n| (n as f64).sqrt()).collect();
    let total: f64 = roots.iter().sum();
    for (got, root) in p.iter().zip(&roots) {
        assert!((got - root / total).abs() < 1e-12, "{p:?}");
    }
}

#[test]
fn each_source_serves_its_pairs_once_per_epoch_a_whole_batch_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    let sizes = [40usize, 24, 16];
    let picker = SourcePicker::new(None, &sizes, &[1.0; 3], 11);
    let mut served: Vec<Vec<Vec<usize>>> = vec![Vec::new(); 3];
    for step in 0..90 {
        let batch = trainer.task_mut().next_batch(step).unwrap();
        assert_eq!(batch.source, picker.pick(step), "step {step}");
        assert_eq!(batch.queries.len(), 8);
        // A source's passages: its positive and its own hard negatives.
        let group = if batch.source == 2 { 3 } else { 1 };
        assert_eq!(batch.passages.len(), 8 * group);
        assert_eq!(batch.filled, 0);
        served[batch.source].push(batch.lines.clone());
    }
    for (s, batches) in served.iter().enumerate() {
        let per_epoch = sizes[s] / 8;
        assert!(
            batches.len() > per_epoch,
            "source {s}: {} batches",
            batches.len()
        );
        for epoch in batches.chunks(per_epoch).filter(|e| e.len() == per_epoch) {
            let lines: Vec<usize> = epoch.iter().flatten().copied().collect();
            let distinct: HashSet<usize> = lines.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                lines.len(),
                "source {s}: a pair twice in an epoch"
            );
            assert_eq!(distinct.len(), per_epoch * 8);
        }
        // The epochs are shuffled apart.
        assert_ne!(batches[0], batches[per_epoch], "source {s}");
    }
}

#[test]
fn a_rows_own_prompt_replaces_its_sources_and_the_export_names_the_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    // The tokenizer's prompt for the rest, each row's own where it has one: the same ids
    // as the texts written out in full.
    let tokenizer = Tokenizer::from_file(&cfg.output_dir.join("tokenizer.json"), 64)
        .unwrap()
        .with_prompt("Find the same verse: ");
    let texts = ["In the beginning", "And God said"];
    let got = tokenizer
        .encode_prompted(&texts, &[Some("Find its twin: "), None], &Device::Cpu)
        .unwrap();
    let plain = tokenizer.clone().with_prompt("");
    let want = plain
        .encode(
            &[
                "Find its twin: In the beginning",
                "Find the same verse: And God said",
            ],
            &Device::Cpu,
        )
        .unwrap();
    assert_eq!(
        got.input_ids.to_vec2::<u32>().unwrap(),
        want.input_ids.to_vec2::<u32>().unwrap()
    );
    // A prompt left out of the pooling is one per side: rows' own prompts are refused.
    let pooled_apart = tokenizer.clone().with_prompt_pooled(false);
    match pooled_apart.encode_prompted(&texts, &[Some("Find its twin: "), None], &Device::Cpu) {
        Err(gradcache::Error::InvalidConfig { field, .. }) => {
            assert_eq!(field, "model.include_prompt")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // The rows of `prompted` carry their own prompts into the batch.
    let mut seen = 0;
    for step in 0..40 {
        let batch = trainer.task_mut().next_batch(step).unwrap();
        if batch.source == 1 {
            seen += batch.prompts.iter().filter(|p| p.is_some()).count();
        } else {
            assert!(batch.prompts.iter().all(Option::is_none));
        }
    }
    assert!(seen >= 2, "{seen} rows with their own prompt");
    // The export writes the sources' prompts by name.
    let out = dir.path().join("model");
    trainer.export(&out, gradcache::Side::Query).unwrap();
    let st: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(out.join("config_sentence_transformers.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(st["prompts"]["prompted"], "Find the same verse: ");
}

/// Step -> (loss bits, source), from `metrics.jsonl`; a step written twice (after a kill,
/// the resume runs it again) keeps its last line.
fn steps(out: &Path) -> BTreeMap<u64, (u32, String)> {
    let mut all = BTreeMap::new();
    for line in fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["type"] == "step" {
            let loss = v["loss"].as_f64().unwrap() as f32;
            let source = v["source"].as_str().expect("each step names its source");
            all.insert(
                v["step"].as_u64().unwrap(),
                (loss.to_bits(), source.to_string()),
            );
        }
    }
    all
}

fn train(config: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin());
    cmd.args(["train", "--config"])
        .arg(config)
        .arg("--set")
        .arg(format!("output_dir={}", out.display()))
        .args(extra)
        .env("HF_HUB_OFFLINE", "1");
    cmd
}

fn wait(mut child: Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("still running after three minutes");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_mixture_killed_and_resumed_trains_as_if_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let steps_set = ["--set", "train.steps=40"];
    // The uninterrupted run.
    let whole = dir.path().join("whole");
    let out = train(&path, &whole, &steps_set).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("3 sources"), "{log}");
    assert!(log.contains("steps per source: verses"), "{log}");
    let want = steps(&whole);
    assert_eq!(want.len(), 40);
    let names: HashSet<&str> = want.values().map(|(_, s)| s.as_str()).collect();
    assert!(names.len() >= 2, "{names:?}");
    // The same run killed (SIGKILL) once its checkpoint of step 6 exists, then resumed.
    let cut = dir.path().join("cut");
    let child = train(&path, &cut, &steps_set)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let ckpt = cut.join("checkpoints").join("step-00000006");
    while !ckpt.is_dir() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    let status = wait(child);
    assert!(!status.success());
    // Killed in the middle: the resume has steps to run.
    assert!(
        !cut.join("checkpoints/step-00000040").exists(),
        "killed after the end"
    );
    let out = train(&path, &cut, &steps_set)
        .arg("--resume")
        .arg(cut.join("checkpoints"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(steps(&cut), want, "every step's loss and source");
}

#[test]
fn per_source_losses_train_under_the_cache() {
    // `distilled` learns its teacher's scores (KL beside InfoNCE), `prompted` ranks each
    // query against its own passages only (hard negatives filled from other positives
    // are its candidates), `verses` is symmetric InfoNCE: one step of each trains, the
    // cached step equal to the uncached one.
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(
        dir.path(),
        "[loss.distillation]\nkind = \"kl\"\ninfonce_weight = 0.5\n",
    );
    let text = fs::read_to_string(&path)
        .unwrap()
        .replace(
            "query_prompt = \"Find the same verse: \"",
            "query_prompt = \"Find the same verse: \"\nhard_negatives = 1\nloss = { in_batch = false, distill = false }",
        )
        .replace("loss = { symmetric = true }", "loss = { symmetric = true, distill = false }")
        .replace("checkpoint_every = 2", "checkpoint_every = 0");
    fs::write(&path, text).unwrap();
    let cfg = Config::load(&path, &["train.steps=6".into()]).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    let mut seen = HashSet::new();
    for _ in 0..6 {
        let r = trainer.train_step().unwrap();
        assert!(r.loss.is_finite() && r.loss > 0.0, "{r:?}");
        seen.insert(r.source.clone().unwrap());
    }
    assert!(seen.len() >= 2, "{seen:?}");
}

#[test]
fn bad_mixtures_are_refused_by_name_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let text = fs::read_to_string(&path).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (
            text.replacen("name = \"verses\"\n", "", 1),
            "data.sources.name",
        ),
        (
            text.replacen("name = \"prompted\"", "name = \"verses\"", 1),
            "names two sources",
        ),
        (
            text.replacen("name = \"verses\"", "name = \"verses\"\nweight = 0", 1),
            "data.sources.weight",
        ),
        (
            text.replacen("[data]", "[data]\nsampling = { temperature = -1.0 }", 1),
            "data.sampling.temperature",
        ),
        (
            text.replacen(
                "loss = { symmetric = true }",
                "loss = { in_batch = false }",
                1,
            ),
            "data.sources.loss.in_batch",
        ),
        (
            text.replacen("[data]", "[data]\ntrain_file = \"x.jsonl\"", 1),
            "data.train_file",
        ),
        (
            text.replacen("[data]", "[data]\nbatches = \"mixed\"", 1),
            "data.batches",
        ),
    ];
    for (config, want) in cases {
        fs::write(&path, &config).unwrap();
        let err = Config::load(&path, &[]).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    // Found when the data is read: a source smaller than one global batch, distillation
    // on a source whose rows lack scores (naming the file and the line), a Hub data set
    // neither cached nor reachable (naming the repository and HF_HUB_OFFLINE).
    let run = dir.path().join("run");
    fs::write(&path, &text).unwrap();
    let cfg = Config::load(&path, &["train.batch_size=24".into()]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("source \"distilled\" holds 16 pairs"), "{err}");
    let every_source_distils = text.replacen("temperature = 0.1\n", "", 1);
    fs::write(
        &path,
        format!("{every_source_distils}\n[loss.distillation]\n"),
    )
    .unwrap();
    let cfg = Config::load(&path, &["train.hard_negatives=1".into()]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("verses.jsonl:1:"), "{err}");
    assert!(err.contains("teacher scores"), "{err}");
    let hub = text.replacen(
        &format!("path = \"{}/verses.jsonl\"", dir.path().display()),
        "path = \"hf://datasets/nobody/nothing/data\"",
        1,
    );
    fs::write(&path, hub).unwrap();
    let out = train(&path, &run, &[])
        .env("HF_HUB_CACHE", dir.path().join("hub"))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        log.contains("datasets/nobody/nothing") && log.contains("HF_HUB_OFFLINE"),
        "{log}"
    );
    assert!(!run.exists(), "a refused run wrote {}", run.display());
}

#[test]
fn a_hub_data_set_of_parquet_shards_trains_from_the_cache_offline() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    // The hf-hub cache layout: refs/main names the snapshot; the data set's two Parquet
    // shards under data/.
    let repo = dir.path().join("hub/datasets--someone--verses");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), commit).unwrap();
    let data = repo.join("snapshots").join(commit).join("data");
    fs::create_dir_all(&data).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet");
    fs::copy(
        fixtures.join("pairs.parquet"),
        data.join("train-00000-of-00002.parquet"),
    )
    .unwrap();
    fs::copy(
        fixtures.join("tevatron.parquet"),
        data.join("train-00001-of-00002.parquet"),
    )
    .unwrap();
    let text = fs::read_to_string(&path).unwrap().replacen(
        &format!("path = \"{}/verses.jsonl\"", dir.path().display()),
        "path = \"hf://datasets/someone/verses/data\"",
        1,
    );
    fs::write(&path, text).unwrap();
    // The shards hold 5 pairs: a batch of 4.
    let run = dir.path().join("run");
    let out = train(
        &path,
        &run,
        &["--set", "train.batch_size=4", "--set", "train.steps=3"],
    )
    .env("HF_HUB_CACHE", dir.path().join("hub"))
    .output()
    .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("verses 5 pairs"), "{log}");
}

#[test]
fn shards_in_a_folder_or_a_glob_read_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let verses = fs::read_to_string(dir.path().join("verses.jsonl")).unwrap();
    let lines: Vec<&str> = verses.lines().collect();
    let shards = dir.path().join("shards");
    fs::create_dir_all(&shards).unwrap();
    fs::write(shards.join("part-0.jsonl"), lines[..25].join("\n")).unwrap();
    fs::write(shards.join("part-1.jsonl"), lines[25..].join("\n")).unwrap();
    fs::write(shards.join("notes.txt"), "not data").unwrap();
    let text = fs::read_to_string(&path).unwrap();
    let verses_path = format!("path = \"{}/verses.jsonl\"", dir.path().display());
    let folder = format!("path = \"{}\"", shards.display());
    let glob = format!("path = \"{}/part-*.jsonl\"", shards.display());
    for (what, path_line) in [("folder", folder), ("glob", glob)] {
        fs::write(&path, text.replacen(&verses_path, &path_line, 1)).unwrap();
        let cfg = Config::load(&path, &[]).unwrap();
        let mut trainer = Trainer::new(cfg, None).unwrap();
        let notes = trainer.setup_notes().join("\n");
        assert!(notes.contains("verses 40 pairs"), "{what}: {notes}");
        // Every pair of both shards once in the source's first epoch (5 batches of 8).
        let mut queries = HashSet::new();
        let mut step = 0;
        while queries.len() < 40 && step < 200 {
            let batch = trainer.task_mut().next_batch(step).unwrap();
            if batch.source == 0 {
                queries.extend(batch.queries.clone());
            }
            step += 1;
        }
        assert_eq!(queries.len(), 40, "{what}");
    }
}

#[test]
fn mixed_batches_shuffle_the_sources_together() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    // Mixed batches need the sources to share hard negatives and loss settings.
    let text = fs::read_to_string(&path)
        .unwrap()
        .replacen("loss = { symmetric = true }\n", "", 1)
        .replacen("hard_negatives = 2\n", "", 1)
        .replacen("[data]", "[data]\nbatches = \"mixed\"", 1);
    fs::write(&path, text).unwrap();
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    // The `prompted` source's rows carry its instruction (or their own), the others none:
    // some batch holds both kinds.
    let mut both = 0;
    for step in 0..10 {
        let batch = trainer.task_mut().next_batch(step).unwrap();
        let prompted = batch.prompts.iter().filter(|p| p.is_some()).count();
        if prompted > 0 && prompted < batch.prompts.len() {
            both += 1;
        }
    }
    assert!(both >= 5, "{both} of 10 batches mix the sources");
    for _ in 0..2 {
        let r = trainer.train_step().unwrap();
        assert!(r.loss.is_finite());
        assert_eq!(r.source, None, "a mixed batch has no one source");
    }
}

/// `[[data.evals]]` lines of `metrics.jsonl`: step -> set -> nDCG@10.
fn evals(out: &Path) -> BTreeMap<u64, BTreeMap<String, f64>> {
    let mut all: BTreeMap<u64, BTreeMap<String, f64>> = BTreeMap::new();
    for line in fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["type"] == "eval" {
            let set = v["set"].as_str().expect("each evaluation names its set");
            all.entry(v["step"].as_u64().unwrap()).or_default().insert(
                set.to_string(),
                v["metrics"]["ndcg_at_10"].as_f64().unwrap(),
            );
        }
    }
    all
}

#[test]
fn evaluation_sets_are_reported_by_name_with_their_mean_and_the_best_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let eval = fs::read_to_string(dir.path().join("eval.jsonl")).unwrap();
    let lines: Vec<&str> = eval.lines().collect();
    fs::write(dir.path().join("first.jsonl"), lines[..6].join("\n")).unwrap();
    fs::write(dir.path().join("second.jsonl"), lines[6..].join("\n")).unwrap();
    let d = dir.path().display();
    let text = fs::read_to_string(&path).unwrap().replacen(
        &format!("eval_file = \"{d}/eval.jsonl\"\n"),
        &format!(
            "[[data.evals]]\nname = \"first\"\npath = \"{d}/first.jsonl\"\n\
             [[data.evals]]\nname = \"second\"\npath = \"{d}/second.jsonl\"\n\
             query_prompt = \"Find the same verse: \"\n"
        ),
        1,
    );
    // The sources' tables after the evaluation sets' would belong to them: move them.
    let (head, sources) = text.split_once("[[data.sources]]").unwrap();
    let (sources, rest) = sources.split_once("[model]").unwrap();
    let (before, evals_text) = head.split_once("[[data.evals]]").unwrap();
    let text = format!("{before}[[data.sources]]{sources}[[data.evals]]{evals_text}[model]{rest}");
    fs::write(&path, text).unwrap();
    let out = dir.path().join("run");
    let run = train(
        &path,
        &out,
        &[
            "--set",
            "train.eval_every=2",
            "--set",
            "train.best_by=\"mean\"",
            "--set",
            "train.steps=6",
        ],
    )
    .output()
    .unwrap();
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{log}");
    assert!(log.contains("eval first at step 0"), "{log}");
    assert!(log.contains("eval mean of 2 sets at step 6"), "{log}");
    let all = evals(&out);
    assert_eq!(all.keys().copied().collect::<Vec<_>>(), [0, 2, 4, 6]);
    let mut best: Option<(u64, f64)> = None;
    for (step, sets) in &all {
        let mean = (sets["first"] + sets["second"]) / 2.0;
        assert!((sets["mean"] - mean).abs() < 1e-12, "step {step}: {sets:?}");
        if *step > 0 && best.is_none_or(|(_, b)| mean > b + 1e-12) {
            best = Some((*step, mean));
        }
    }
    let (step, score) = best.unwrap();
    let kept: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out.join("checkpoints/best/best.json")).unwrap())
            .unwrap();
    assert_eq!(kept["step"], step);
    assert_eq!(kept["by"], "mean");
    assert!((kept["score"].as_f64().unwrap() - score).abs() < 1e-12);
    // It is a whole checkpoint: resumable, its weights those of that step's checkpoint.
    assert!(out.join("checkpoints/best/model.safetensors").is_file());
    let best_state = fs::read_to_string(out.join("checkpoints/best/trainer_state.json")).unwrap();
    assert!(
        best_state.contains(&format!("\"step\": {step}")),
        "{best_state}"
    );
}

#[test]
fn the_shipped_mixture_config_learns() {
    // configs/mixture.toml as shipped (its three sources, instructions, distillation and
    // evaluation sets), shortened to 24 steps of 32 pairs.
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::load(
        Path::new("configs/mixture.toml"),
        &[
            format!("output_dir={}", dir.path().join("run").display()),
            "train.steps=24".into(),
            "train.batch_size=32".into(),
            "train.eval_every=0".into(),
            "train.checkpoint_every=0".into(),
        ],
    )
    .unwrap();
    assert_eq!(cfg.sources().len(), 3);
    assert_eq!(cfg.data.evals.len(), 2);
    crate::common::assert_learns(Trainer::new(cfg, None).unwrap());
}

#[test]
fn a_streamed_source_and_a_source_with_its_own_fields_serve_the_same_batches() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let batches = |trainer: &mut Trainer| -> Vec<(usize, Vec<String>, Vec<String>)> {
        (0..30)
            .map(|step| {
                let b = trainer.task_mut().next_batch(step).unwrap();
                (b.source, b.queries, b.passages)
            })
            .collect()
    };
    let cfg = Config::load(&path, &[]).unwrap();
    let want = batches(&mut Trainer::new(cfg, None).unwrap());
    // `verses` read from disk as batches need it; `prompted` with fields named q and p.
    let prompted = fs::read_to_string(dir.path().join("prompted.jsonl")).unwrap();
    let renamed: Vec<String> = prompted
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut r = serde_json::json!({"q": v["query"], "p": v["positive"]});
            if let Some(prompt) = v.get("prompt") {
                r["prompt"] = prompt.clone();
            }
            r.to_string()
        })
        .collect();
    fs::write(dir.path().join("renamed.jsonl"), renamed.join("\n")).unwrap();
    let text = fs::read_to_string(&path)
        .unwrap()
        .replacen("name = \"verses\"", "name = \"verses\"\nstream = true", 1)
        .replacen(
            &format!("path = \"{}/prompted.jsonl\"", dir.path().display()),
            &format!(
                "path = \"{}/renamed.jsonl\"\nfields = {{ query = \"q\", positive = \"p\" }}",
                dir.path().display()
            ),
            1,
        );
    fs::write(&path, text).unwrap();
    let cfg = Config::load(&path, &[]).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    assert!(
        trainer
            .setup_notes()
            .iter()
            .any(|n| n.contains("streaming 40 training pairs")),
        "{:?}",
        trainer.setup_notes()
    );
    assert_eq!(batches(&mut trainer), want);
}

#[test]
fn more_bad_mixtures_evaluation_sets_and_distillation_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mixture(dir.path(), "");
    let text = fs::read_to_string(&path).unwrap();
    let d = dir.path().display();
    let eval_file = format!("eval_file = \"{d}/eval.jsonl\"\n");
    let evals = |tables: &str| text.replacen(&eval_file, "", 1) + tables;
    let set =
        |name: &str| format!("\n[[data.evals]]\nname = \"{name}\"\npath = \"{d}/eval.jsonl\"\n");
    let alike = text
        .replacen("loss = { symmetric = true }\n", "", 1)
        .replacen("hard_negatives = 2\n", "", 1);
    let multi_vector = text
        .replacen("query_max_len = 24\npassage_max_len = 24\n", "", 1)
        .replacen(
            "[model.fresh]",
            "[model.multi_vector]\ndim = 8\n[model.fresh]",
            1,
        )
        .replacen(
            "hard_negatives = 2\n",
            "hard_negatives = 2\nloss = { in_batch = false }\n",
            1,
        );
    let cases: Vec<(String, &str)> = vec![
        (evals(&set("")), "data.evals.name"),
        (evals(&set("mean")), "data.evals.name"),
        (evals(&(set("a") + &set("a"))), "names two evaluation sets"),
        (text.clone() + &set("a"), "data.eval_file"),
        (
            evals(&set("a")).replacen("[train]\n", "[train]\nbest_by = \"b\"\n", 1),
            "train.best_by",
        ),
        (text.replacen(&eval_file, "", 1), "data.eval_file"),
        (
            text.replacen(&format!("path = \"{d}/verses.jsonl\""), "path = \"\"", 1),
            "data.sources.path",
        ),
        (
            text.replacen(
                "loss = { symmetric = true }",
                "hard_negatives = 1\nloss = { symmetric = true, in_batch = false }",
                1,
            ),
            "data.sources.loss.in_batch",
        ),
        (
            alike.replacen(
                "[data]",
                "[data]\nbatches = \"mixed\"\nsampling = \"round_robin\"",
                1,
            ),
            "data.sampling",
        ),
        (multi_vector, "data.sources.loss"),
        (
            text.replacen("temperature = 0.1\n", "", 1) + "\n[loss.distillation]\n",
            "data.sources.hard_negatives",
        ),
    ];
    for (field, value) in [
        ("student_temperature", "0"),
        ("weight", "0"),
        ("infonce_weight", "-1"),
    ] {
        let beside = if field == "infonce_weight" {
            ""
        } else {
            "infonce_weight = 1.0\n"
        };
        let config = format!("{text}\n[loss.distillation]\n{beside}{field} = {value}\n");
        fs::write(&path, config).unwrap();
        let err = Config::load(&path, &[]).unwrap_err().to_string();
        assert!(
            err.contains(&format!("loss.distillation.{field}")),
            "{field}: {err}"
        );
    }
    for (config, want) in cases {
        fs::write(&path, &config).unwrap();
        let err = Config::load(&path, &[]).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    // Found when the data is read: a glob matching nothing, a folder with no data file,
    // a Hub path that names no data set.
    let empty = dir.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    fs::write(empty.join("notes.txt"), "not data").unwrap();
    for (path_line, want) in [
        (
            format!("path = \"{d}/none-*.jsonl\""),
            "the glob matches no file",
        ),
        (
            format!("path = \"{}\"", empty.display()),
            "holds no data file",
        ),
        (
            "path = \"hf://models/someone/model\"".to_string(),
            "data set repository",
        ),
    ] {
        fs::write(
            &path,
            text.replacen(&format!("path = \"{d}/verses.jsonl\""), &path_line, 1),
        )
        .unwrap();
        let cfg = Config::load(&path, &[]).unwrap();
        let err = Trainer::new(cfg, None).err().unwrap().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    assert!(!dir.path().join("run").exists());
}
