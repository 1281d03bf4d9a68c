//! `gradcache train` under `mpirun` (needs the `mpi` feature and Open MPI's `mpirun`).
//!
//! - a 2-rank run follows the loss curve of a 1-rank run with the same global batch, and
//!   ends with the same weights; all ranks hold identical weights (checked by the trainer
//!   after every step in debug builds, and at the end);
//! - one rank fed a malformed data file: every rank exits non-zero within 30 s, naming
//!   the failing rank and the file's line;
//! - a checkpoint of the 2-rank run resumes in one process, and one of the 1-rank run on
//!   two ranks, and both continue the same curve;
//! - SIGUSR1 sent to `mpirun` (which forwards it to every rank) stops both ranks after the
//!   same step with one checkpoint; resuming on two ranks ends with the weights of the
//!   uninterrupted 2-rank run, bit for bit;
//! - mismatched configs across ranks are refused at start-up, naming the key, and a global
//!   batch that does not split evenly over the ranks is refused;
//! - a rank killed with SIGKILL between two chunks of a step's replay (rank 1, then rank
//!   0, the lock holder) ends the job within 30 s, Open MPI naming the signal; the resume
//!   issued at once (no wait) is not refused and ends with the uninterrupted run's losses
//!   and weights, bit for bit;
//! - a rank that hangs (stopped with SIGSTOP between two chunks of a step's replay) ends
//!   the job once the other rank's collective passes `dist.timeout_s`, the watchdog
//!   naming the collective.
//!
//! Dropout is off for the curve comparison (masks derive from the rank and the chunk, so
//! with dropout on the runs are different samples of the same training, not equal).
//! Tolerance: relative 1e-5 on every step's loss (observed about 1e-7), relative 1e-4 per
//! weight tensor after 4 AdamW steps (observed at most 2.2e-5, on biases: they start at
//! zero and are about 2e-3 after 4 steps, so differences of a few 1e-8 are large relative
//! to them). The two runs differ only in summation order (two partial gradient sums added
//! by the all-reduce instead of one sequential sum), which Adam's normalisation amplifies
//! for small gradients.
#![cfg(feature = "mpi")]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;

mod common;
use common::max_abs;

const CONFIG: &str = "configs/distributed-cpu.toml";
const TOL: f64 = 1e-5;
const WEIGHT_TOL: f64 = 1e-4;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gradcache")
}

/// Small train/eval files from the shipped quickstart data.
fn small_data(dir: &Path) -> (PathBuf, PathBuf) {
    let take = |src: &str, n: usize, dst: PathBuf| {
        let text = fs::read_to_string(src).unwrap();
        let lines: Vec<&str> = text.lines().take(n).collect();
        fs::write(&dst, lines.join("\n") + "\n").unwrap();
        dst
    };
    (
        take("data/quickstart/train.jsonl", 200, dir.join("train.jsonl")),
        take("data/quickstart/eval.jsonl", 48, dir.join("eval.jsonl")),
    )
}

fn args(train: &Path, eval: &Path, out: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["train".into(), "--config".into(), CONFIG.into()];
    for set in [
        format!("data.train_file={}", train.display()),
        format!("data.eval_file={}", eval.display()),
        format!("output_dir={}", out.display()),
        "train.steps=4".into(),
        "train.batch_size=32".into(),
        // Chunks that divide neither the global batch nor a rank's 16 pairs.
        "train.query_chunk=6".into(),
        "train.passage_chunk=5".into(),
        "train.eval_every=0".into(),
        "train.checkpoint_every=2".into(),
        "model.dropout=false".into(),
        "model.fresh.vocab_size=500".into(),
        "optim.warmup_steps=1".into(),
    ] {
        v.push("--set".into());
        v.push(set);
    }
    v
}

/// `mpirun` with one app context per entry of `ranks` (one process each), killed after
/// `limit`. Returns (success, combined output, elapsed).
fn mpirun(ranks: &[Vec<String>], limit: Duration) -> (bool, String, Duration) {
    mpirun_with(ranks, limit, &[])
}

/// [`mpirun`] with environment variables passed to every rank.
fn mpirun_with(
    ranks: &[Vec<String>],
    limit: Duration,
    env: &[(&str, &str)],
) -> (bool, String, Duration) {
    let mut cmd = Command::new("mpirun");
    cmd.arg("--allow-run-as-root");
    for (name, value) in env {
        cmd.env(name, value).args(["-x", name]);
    }
    if ranks.len() > 2 {
        // More ranks than these machines' two cores.
        cmd.arg("--oversubscribe");
    }
    for (i, a) in ranks.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-n", "1", bin()]).args(a);
    }
    let out_file = tempfile::NamedTempFile::new().unwrap();
    let start = Instant::now();
    let mut child = cmd
        .stdout(out_file.reopen().unwrap())
        .stderr(out_file.reopen().unwrap())
        .stdin(Stdio::null())
        .spawn()
        .expect("mpirun is installed (apt-get install openmpi-bin)");
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let elapsed = start.elapsed();
    let text = fs::read_to_string(out_file.path()).unwrap_or_default();
    assert!(!text.contains("panicked"), "a rank panicked:\n{text}");
    let status = status.unwrap_or_else(|| panic!("still running after {limit:?}:\n{text}"));
    (status.success(), text, elapsed)
}

fn losses(out: &Path) -> Vec<f64> {
    fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

/// Runs the config of `args(out)` in one process (`dist.backend=none`, in `dir/one`) and
/// on two MPI ranks (in `dir/two`), and checks that the two runs' step losses agree within
/// [`TOL`] (rank 0 alone writes the metrics); returns the one-rank losses and the 2-rank
/// run's log.
fn one_and_two_ranks_agree(dir: &Path, args: impl Fn(&Path) -> Vec<String>) -> (Vec<f64>, String) {
    one_and_n_ranks_agree(dir, 2, args)
}

/// [`one_and_two_ranks_agree`] on `n` ranks.
fn one_and_n_ranks_agree(
    dir: &Path,
    n: usize,
    args: impl Fn(&Path) -> Vec<String>,
) -> (Vec<f64>, String) {
    let one = dir.join("one");
    let mut single = args(&one);
    single.extend(["--set".into(), "dist.backend=none".into()]);
    let out = Command::new(bin()).args(&single).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let two = dir.join("two");
    let a = args(&two);
    let (ok, text, _) = mpirun(&vec![a; n], Duration::from_secs(300));
    assert!(ok, "{n}-rank run failed:\n{text}");
    let (l1, l2) = (losses(&one), losses(&two));
    assert_eq!(l1.len(), 4);
    assert_eq!(l2.len(), 4, "rank 0 alone writes metrics.jsonl");
    for (step, (a, b)) in l1.iter().zip(&l2).enumerate() {
        let rel = ((a - b) / a).abs();
        assert!(
            rel <= TOL,
            "step {}: loss {a} vs {b} (rel {rel:e})",
            step + 1
        );
    }
    (l1, text)
}

#[test]
fn two_ranks_follow_the_one_rank_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let (l1, text) = one_and_two_ranks_agree(dir.path(), |out| args(&train, &eval, out));
    assert!(
        text.contains("all 2 ranks start from identical weights")
            && text.contains("all 2 ranks hold identical weights"),
        "no weight check in the log:\n{text}"
    );

    // The 2-rank run's step-2 checkpoint, resumed by one process, continues the curve.
    let three = dir.path().join("three");
    let mut resumed = args(&train, &eval, &three);
    resumed.extend([
        "--set".into(),
        "dist.backend=none".into(),
        "--resume".into(),
    ]);
    resumed.push(two.join("checkpoints/step-00000002").display().to_string());
    let out = Command::new(bin()).args(&resumed).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l3 = losses(&three);
    assert_eq!(l3.len(), 2, "steps 3 and 4 after resuming at 2");
    for (step, (a, b)) in l1[2..].iter().zip(&l3).enumerate() {
        let rel = ((a - b) / a).abs();
        assert!(
            rel <= TOL,
            "resumed step {}: loss {a} vs {b} (rel {rel:e})",
            step + 3
        );
    }

    // And the other way: the 1-rank run's step-2 checkpoint resumed by two ranks.
    let four = dir.path().join("four");
    let mut grown = args(&train, &eval, &four);
    grown.push("--resume".into());
    grown.push(one.join("checkpoints/step-00000002").display().to_string());
    let (ok, text, _) = mpirun(&[grown.clone(), grown], Duration::from_secs(300));
    assert!(ok, "1 -> 2 resume failed:\n{text}");
    assert!(
        text.contains("the checkpoint was written by 1 process(es) and resumes on 2"),
        "{text}"
    );
    let l4 = losses(&four);
    assert_eq!(l4.len(), 2, "steps 3 and 4 after resuming at 2");
    for (step, (a, b)) in l1[2..].iter().zip(&l4).enumerate() {
        let rel = ((a - b) / a).abs();
        assert!(
            rel <= TOL,
            "step {} resumed on 2 ranks: loss {a} vs {b} (rel {rel:e})",
            step + 3
        );
    }

    let w1 = gradcache::train::checkpoint::load(&one.join("checkpoints"), &Device::Cpu).unwrap();
    let w2 = gradcache::train::checkpoint::load(&two.join("checkpoints"), &Device::Cpu).unwrap();
    assert_eq!(w1.state.step, 4);
    assert_eq!(w2.state.step, 4);
    assert_eq!(w1.model.len(), w2.model.len());
    for (name, a) in &w1.model {
        // The attention key bias has a mathematically zero gradient (softmax ignores a
        // shift shared by all keys); Adam turns its rounding noise into steps of size lr
        // in both runs, so its value is noise, not a property of either run.
        if name.ends_with("attention.self.key.bias") {
            continue;
        }
        let b = &w2.model[name];
        let rel = max_abs(&(a - b).unwrap()) / max_abs(a).max(1e-12);
        assert!(
            rel <= WEIGHT_TOL,
            "weight {name}: relative difference {rel:e}"
        );
    }
}

#[test]
fn a_malformed_data_file_on_one_rank_stops_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let bad = dir.path().join("bad.jsonl");
    let good = fs::read_to_string(&train).unwrap();
    let mut lines: Vec<&str> = good.lines().collect();
    lines[2] = "{\"query\": \"truncated";
    fs::write(&bad, lines.join("\n")).unwrap();
    let out = dir.path().join("run");

    let rank0 = args(&train, &eval, &out);
    let rank1 = args(&bad, &eval, &out);
    let (ok, text, elapsed) = mpirun(&[rank0, rank1], Duration::from_secs(60));
    assert!(!ok, "the run should fail:\n{text}");
    assert!(
        elapsed < Duration::from_secs(30),
        "took {elapsed:?} to stop"
    );
    let expected = format!("rank 1 of 2 failed: {}:3", bad.display());
    for rank in 0..2 {
        let line = format!("error: [rank {rank}/2]: {expected}");
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    assert!(
        !out.join("metrics.jsonl").exists(),
        "nothing should be trained or written"
    );
}

#[test]
fn mismatched_configs_are_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let out = dir.path().join("run");
    let rank0 = args(&train, &eval, &out);
    let mut rank1 = rank0.clone();
    rank1.extend(["--set".into(), "loss.temperature=0.1".into()]);
    let (ok, text, _) = mpirun(&[rank0, rank1], Duration::from_secs(60));
    assert!(!ok, "the run should fail:\n{text}");
    let expected =
        "ranks disagree on the config: rank 1 differs from rank 0 in loss.temperature (0.05 vs 0.1)";
    assert!(text.contains(expected), "missing `{expected}` in:\n{text}");
}

#[test]
fn a_global_batch_that_does_not_split_over_the_ranks_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let out = dir.path().join("run");
    let mut a = args(&train, &eval, &out);
    a.extend(["--set".into(), "train.batch_size=33".into()]);
    let (ok, text, _) = mpirun(&[a.clone(), a], Duration::from_secs(60));
    assert!(!ok, "the run should fail:\n{text}");
    let expected = "invalid value for `train.batch_size`: 33 (the global batch must split evenly \
                    over the ranks";
    assert!(text.contains(expected), "missing `{expected}` in:\n{text}");
    assert!(!out.join("metrics.jsonl").exists());
}

/// Issue 25's losses over 2 ranks: prompts, Matryoshka widths, no-duplicate batches and a
/// frozen guide model judging the false-negative mask (each rank embeds its share with the
/// guide; the guide's embeddings are all-gathered like the representations). The 2-rank
/// run follows the 1-rank loss curve.
#[test]
fn two_ranks_with_a_guide_and_matryoshka_follow_the_one_rank_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let extra = |out: &Path, guide: Option<&Path>| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        let mut sets = vec![
            "model.query_prompt=\"query: \"".to_string(),
            "model.passage_prompt=\"passage: \"".into(),
            "loss.matryoshka_dims=[128, 32]".into(),
            "train.no_duplicates=true".into(),
        ];
        if let Some(g) = guide {
            sets.push(format!("loss.false_negative_guide=\"{}\"", g.display()));
            sets.push("loss.false_negative_margin=0.05".into());
        }
        for s in sets {
            v.push("--set".into());
            v.push(s);
        }
        v
    };
    // The guide: the 1-rank run without one, exported.
    let base = dir.path().join("base");
    let mut first = extra(&base, None);
    first.extend(["--set".into(), "dist.backend=none".into()]);
    let out = Command::new(bin()).args(&first).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let guide = dir.path().join("guide");
    let mut export = first.clone();
    export[0] = "export".into();
    export.extend(["--output".into(), guide.display().to_string()]);
    let out = Command::new(bin()).args(&export).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (l1, _) = one_and_two_ranks_agree(dir.path(), |out| extra(out, Some(&guide)));
    assert_ne!(l1, losses(&base), "the guide's mask changes the curve");
}

#[test]
fn sigusr1_to_mpirun_stops_every_rank_after_one_step_and_the_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let longer = |out: &Path| {
        let mut a = args(&train, &eval, out);
        for s in [
            "train.steps=24",
            "train.batch_size=16",
            "train.checkpoint_every=2",
        ] {
            a.extend(["--set".into(), s.into()]);
        }
        a
    };
    let plain = dir.path().join("plain");
    let a = longer(&plain);
    let (ok, text, _) = mpirun(&[a.clone(), a], Duration::from_secs(300));
    assert!(ok, "{text}");

    let out = dir.path().join("stopped");
    let a = longer(&out);
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "-n", "2", bin()]).args(&a);
    let log = dir.path().join("stopped.log");
    let mut child = cmd
        .stdout(fs::File::create(&log).unwrap())
        .stderr(fs::File::create(dir.path().join("stopped.err")).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let first = out.join("checkpoints/step-00000002");
    let start = Instant::now();
    while !first.is_dir() {
        assert!(child.try_wait().unwrap().is_none(), "ended before step 2");
        assert!(start.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: a signal to the mpirun this test started and has not reaped.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGUSR1) },
        0
    );
    let status = child.wait().unwrap();
    let text = fs::read_to_string(&log).unwrap()
        + &fs::read_to_string(dir.path().join("stopped.err")).unwrap();
    assert!(!text.contains("panicked"), "{text}");
    assert_eq!(status.code(), Some(128 + libc::SIGUSR1), "{text}");
    let c = gradcache::train::checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
    let k = c.state.step;
    assert!((2..24).contains(&k), "stopped at {k}:\n{text}");
    assert_eq!(
        text.matches("training stopped by SIGUSR1 after step")
            .count(),
        1,
        "rank 0 reports the stop once:\n{text}"
    );
    assert!(
        text.contains(&format!("after step {k}; checkpoint")),
        "{text}"
    );

    let mut resume = longer(&out);
    resume.extend([
        "--resume".into(),
        out.join("checkpoints").display().to_string(),
    ]);
    let (ok, text, _) = mpirun(&[resume.clone(), resume], Duration::from_secs(300));
    assert!(ok, "{text}");
    let want =
        gradcache::train::checkpoint::load(&plain.join("checkpoints"), &Device::Cpu).unwrap();
    let got = gradcache::train::checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
    assert_eq!((want.state.step, got.state.step), (24, 24));
    assert_eq!(losses(&out), losses(&plain), "every step's loss");
    for (name, w) in &want.model {
        assert_eq!(
            common::bits(w),
            common::bits(&got.model[name]),
            "{name} differs from the uninterrupted run"
        );
    }
}

#[test]
fn a_rank_killed_mid_step_ends_the_job_and_the_immediate_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let longer = |out: &Path| {
        let mut a = args(&train, &eval, out);
        for s in ["train.steps=10", "train.batch_size=16"] {
            a.extend(["--set".into(), s.into()]);
        }
        a
    };
    let plain = dir.path().join("plain");
    let a = longer(&plain);
    let (ok, text, _) = mpirun(&[a.clone(), a], Duration::from_secs(300));
    assert!(ok, "{text}");
    let want =
        gradcache::train::checkpoint::load(&plain.join("checkpoints"), &Device::Cpu).unwrap();
    for killed in ["1", "0"] {
        let out = dir.path().join(format!("killed-{killed}"));
        let a = longer(&out);
        // The sixth step (5 done before it; checkpoints every 2: the last one is step 4),
        // before the replay of its second chunk (8 pairs a rank in query chunks of 6).
        let at = format!("{killed}:5:1");
        let (ok, text, elapsed) = mpirun_with(
            &[a.clone(), a],
            Duration::from_secs(120),
            &[("GRADCACHE_KILL_AT", &at)],
        );
        assert!(!ok, "rank {killed} killed, the job succeeded:\n{text}");
        assert!(
            elapsed < Duration::from_secs(30),
            "rank {killed} killed: the job took {elapsed:?} to end:\n{text}"
        );
        assert!(
            text.contains("signal 9"),
            "Open MPI names the signal that killed rank {killed}:\n{text}"
        );
        let before =
            gradcache::train::checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
        assert_eq!(before.state.step, 4, "{text}");
        // At once, as a scheduler's requeue or a retry loop would.
        let mut resume = longer(&out);
        resume.extend([
            "--resume".into(),
            out.join("checkpoints").display().to_string(),
        ]);
        let (ok, text, _) = mpirun(&[resume.clone(), resume], Duration::from_secs(300));
        assert!(ok, "the resume after rank {killed} was killed:\n{text}");
        if killed == "0" {
            assert!(text.contains("took over the lock"), "{text}");
        }
        let got =
            gradcache::train::checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
        assert_eq!((want.state.step, got.state.step), (10, 10));
        assert_eq!(
            losses(&out),
            losses(&plain),
            "every step's loss (rank {killed} killed)"
        );
        for (name, w) in &want.model {
            assert_eq!(
                common::bits(w),
                common::bits(&got.model[name]),
                "{name} differs from the uninterrupted run (rank {killed} killed)"
            );
        }
    }
}

#[test]
fn a_rank_that_hangs_ends_the_job_after_the_collective_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let out = dir.path().join("hung");
    let mut a = args(&train, &eval, &out);
    for s in ["train.steps=10", "train.batch_size=16", "dist.timeout_s=3"] {
        a.extend(["--set".into(), s.into()]);
    }
    // Rank 1 stops in the sixth step; rank 0 waits for it in that step's collectives.
    let (ok, text, elapsed) = mpirun_with(
        &[a.clone(), a],
        Duration::from_secs(60),
        &[("GRADCACHE_HANG_AT", "1:5:1")],
    );
    assert!(!ok, "the job succeeded with a hung rank:\n{text}");
    assert!(
        elapsed < Duration::from_secs(30),
        "the job took {elapsed:?} to end:\n{text}"
    );
    assert!(
        text.contains("[rank 0]: the ") && text.contains("collective has not finished after 3 s"),
        "the watchdog names the collective:\n{text}"
    );
    let last = gradcache::train::checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
    assert_eq!(last.state.step, 4, "{text}");
}

#[test]
fn a_decoder_on_two_ranks_follows_the_one_rank_loss_curve() {
    // The tiny Qwen3 fixture: left padding, its instruction prompt, last-token pooling,
    // grouped KV heads, a windowed layer, selective recompute of the probabilities.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/qwen3");
    let decoder = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        for s in [
            format!("model.pretrained=\"{}\"", model.display()),
            "model.pooling=\"lasttoken\"".into(),
            "model.recompute=\"attention\"".into(),
            "model.query_max_len=32".into(),
            "model.passage_max_len=32".into(),
            "loss.temperature=0.02".into(),
        ] {
            v.push("--set".into());
            v.push(s);
        }
        v
    };
    one_and_two_ranks_agree(dir.path(), decoder);
}

#[test]
fn lora_adapters_on_two_ranks_follow_the_one_rank_loss_curve() {
    // The tiny Qwen3 fixture with LoRA adapters (the base frozen) and Qwen3-Embedding's
    // loss (every direction in one softmax): the adapters' gradients are summed across the
    // ranks like any parameter's, the loss runs on the gathered batch.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/qwen3");
    let adapted = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        for s in [
            format!("model.pretrained=\"{}\"", model.display()),
            "model.recompute=\"every_layer\"".into(),
            "model.query_max_len=32".into(),
            "model.passage_max_len=32".into(),
            "model.lora.rank=4".into(),
            "model.lora.alpha=8.0".into(),
            "loss.temperature=0.05".into(),
            "loss.directions=[\"query_to_doc\", \"query_to_query\", \"doc_to_query\", \"doc_to_doc\"]"
                .into(),
            "optim.lr=0.01".into(),
        ] {
            v.push("--set".into());
            v.push(s);
        }
        v
    };
    one_and_two_ranks_agree(dir.path(), adapted);
}

#[test]
fn lora_adapters_on_four_ranks_follow_the_one_rank_loss_curve() {
    // The tiny BERT of the distributed config with LoRA adapters on every projection (the
    // low-rank branch inside the layer nodes, the base frozen), 8 pairs per rank.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let adapted = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        for s in [
            "model.lora.rank=4",
            "model.lora.alpha=8.0",
            "model.lora.dropout=0.1",
            "optim.lr=0.01",
        ] {
            v.push("--set".into());
            v.push(s.into());
        }
        v
    };
    let (_, text) = one_and_n_ranks_agree(dir.path(), 4, adapted);
    assert!(
        text.contains("all 4 ranks hold identical weights"),
        "{text}"
    );
}

#[test]
fn a_colbert_on_two_and_four_ranks_follows_the_one_rank_loss_curve() {
    // configs/colbert.toml (a fresh model, MaxSim InfoNCE, queries expanded to 32 tokens):
    // the ranks' token matrices (queries 32 x 128, documents 64 x 128 values each) are
    // all-gathered, the loss runs on the global batch on every rank.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let colbert = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        v[2] = "configs/colbert.toml".into();
        for s in [
            "dist.backend=\"mpi\"",
            "model.multi_vector.dim=16",
            "loss.temperature=1.0",
        ] {
            v.push("--set".into());
            v.push(s.into());
        }
        v
    };
    for n in [2, 4] {
        let sub = dir.path().join(format!("ranks-{n}"));
        fs::create_dir_all(&sub).unwrap();
        one_and_n_ranks_agree(&sub, n, colbert);
    }
}

#[test]
fn a_sparse_model_on_two_ranks_follows_the_one_rank_loss_curve() {
    // configs/splade.toml (a fresh BERT with its MLM head, SPLADE max pooling): the
    // ranks' vocabulary-wide vectors are all-gathered and the FLOPS regularisers are
    // means over the global batch. Their weights here are a thousand times the config's,
    // warmed up from step 1, so that a regulariser over one rank's half of the batch
    // would move the loss far past the tolerance.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let sparse = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        v[2] = "configs/splade.toml".into();
        for s in [
            "dist.backend=\"mpi\"",
            "loss.temperature=1.0",
            "loss.splade.document_weight=3e-2",
            "loss.splade.query_weight=5e-2",
            "loss.splade.warmup_ratio=0",
        ] {
            v.push("--set".into());
            v.push(s.into());
        }
        v
    };
    one_and_two_ranks_agree(dir.path(), sparse);
}

#[test]
fn a_distilled_colbert_on_two_ranks_follows_the_one_rank_loss_curve() {
    // configs/colbert-distill.toml: each rank encodes its share of the queries and their
    // own passages (a positive and two negatives each); the teacher's scores of the global
    // batch are gathered in the order of the gathered token matrices.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let text = fs::read_to_string(&train).unwrap();
    let pairs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let n = pairs.len();
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let positive = |j: usize| pairs[j % n]["positive"].clone();
            let scores = [
                8.0 - (i % 3) as f64,
                2.0 + (i % 5) as f64 * 0.5,
                (i % 2) as f64,
            ];
            serde_json::json!({
                "query": pairs[i]["query"],
                "positive": positive(i),
                "negatives": [positive(i + 7), positive(i + 11)],
                "scores": scores,
            })
            .to_string()
        })
        .collect();
    fs::write(&train, lines.join("\n") + "\n").unwrap();
    let distilled = |out: &Path| -> Vec<String> {
        let mut v = args(&train, &eval, out);
        v[2] = "configs/colbert-distill.toml".into();
        for s in [
            "dist.backend=\"mpi\"",
            "model.multi_vector.dim=16",
            "train.hard_negatives=2",
        ] {
            v.push("--set".into());
            v.push(s.into());
        }
        v
    };
    one_and_n_ranks_agree(dir.path(), 2, distilled);
}

#[test]
fn a_mixture_on_two_ranks_draws_the_same_sources_and_follows_the_one_rank_loss_curve() {
    // Three sources, a step's global batch from one: `plain` (symmetric InfoNCE), `own`
    // (an instruction, each query against its own positive and hard negative only),
    // `distilled` (margin MSE against teacher scores, InfoNCE beside it), in turn. Every
    // rank draws the same source at every step; the two runs' losses agree.
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(dir.path());
    let pairs: Vec<serde_json::Value> = fs::read_to_string(&train)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let write = |name: &str, rows: &[serde_json::Value]| {
        let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        fs::write(dir.path().join(name), lines.join("\n") + "\n").unwrap();
    };
    write("plain.jsonl", &pairs[..96]);
    write("own.jsonl", &pairs[96..160]);
    let distilled: Vec<serde_json::Value> = (160..200)
        .map(|i| {
            let other = |j: usize| pairs[160 + (i - 160 + j) % 40]["positive"].clone();
            serde_json::json!({
                "query": pairs[i]["query"], "positive": pairs[i]["positive"],
                "negatives": [other(3), other(7)],
                "scores": [8.0 - (i % 3) as f64, 2.0 + (i % 5) as f64 * 0.5, (i % 2) as f64],
            })
        })
        .collect();
    write("distilled.jsonl", &distilled);
    let config = dir.path().join("mixture.toml");
    let d = dir.path().display();
    fs::write(
        &config,
        format!(
            r#"
seed = 5
output_dir = "unused"
[data]
eval_file = "{eval}"
sampling = "round_robin"
[[data.sources]]
name = "plain"
path = "{d}/plain.jsonl"
loss = {{ symmetric = true, distill = false }}
[[data.sources]]
name = "own"
path = "{d}/own.jsonl"
query_prompt = "Find the same verse: "
hard_negatives = 1
loss = {{ in_batch = false, distill = false }}
[[data.sources]]
name = "distilled"
path = "{d}/distilled.jsonl"
hard_negatives = 2
[model]
query_max_len = 32
passage_max_len = 32
dropout = false
[model.fresh]
vocab_size = 500
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
[loss]
temperature = 0.05
similarity = "cosine"
[loss.distillation]
kind = "margin_mse"
infonce_weight = 0.5
[train]
steps = 4
batch_size = 32
query_chunk = 6
passage_chunk = 5
checkpoint_every = 2
[optim]
lr = 1e-3
warmup_steps = 1
"#,
            eval = eval.display()
        ),
    )
    .unwrap();
    let run = |out: &Path| -> Vec<String> {
        vec![
            "train".into(),
            "--config".into(),
            config.display().to_string(),
            "--set".into(),
            format!("output_dir={}", out.display()),
            "--set".into(),
            "dist.backend=\"mpi\"".into(),
        ]
    };
    one_and_two_ranks_agree(dir.path(), run);
    let sources = |out: &Path| -> Vec<String> {
        fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["type"] == "step")
            .map(|v| v["source"].as_str().unwrap().to_string())
            .collect()
    };
    let one = sources(&dir.path().join("one"));
    assert_eq!(one, sources(&dir.path().join("two")));
    assert_eq!(one, ["plain", "own", "distilled", "plain"]);
}

#[test]
fn a_reranker_on_two_ranks_follows_the_one_rank_loss_curve() {
    // The shipped reranker config shortened: each rank scores its 4 queries' 7 pairs
    // (the positive, 3 mined negatives, 3 drawn from the global batch's other rows) in
    // chunks of 5 pairs that divide neither a rank's 28 pairs nor the global 56; the
    // scores are all-gathered and the loss is the global batch's.
    let dir = tempfile::tempdir().unwrap();
    let rerank = |out: &Path| -> Vec<String> {
        let mut v: Vec<String> = vec![
            "train".into(),
            "--config".into(),
            "configs/reranker.toml".into(),
        ];
        for s in [
            format!("output_dir={}", out.display()),
            "train.steps=4".into(),
            "train.batch_size=8".into(),
            "train.pair_chunk=5".into(),
            "train.eval_every=0".into(),
            "train.checkpoint_every=0".into(),
            "model.dropout=false".into(),
            "model.fresh.vocab_size=500".into(),
            "model.passage_max_len=64".into(),
            "model.query_max_len=64".into(),
            "data.eval_top_k=2".into(),
            "loss.reranker.num_negatives=3".into(),
            "dist.backend=\"mpi\"".into(),
        ] {
            v.push("--set".into());
            v.push(s);
        }
        v
    };
    one_and_two_ranks_agree(dir.path(), rerank);
}
