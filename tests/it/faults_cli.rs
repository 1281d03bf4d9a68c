//! `gradcache train` under the faults of a shared machine, as a user meets them:
//!
//! - SIGINT in the middle of a run: the run finishes its step, writes a checkpoint, exits
//!   with 130; `--resume` then ends with the weights and losses of a run never
//!   interrupted, bit for bit; meanwhile a second run on the same directory is refused,
//!   naming the first run's process;
//! - a second SIGINT exits at once (130, no checkpoint written for it);
//! - a write that fails (a file size limit, `ulimit -f`, as a full disk would) ends the run
//!   with an error naming the file; the last good checkpoint is intact and resumes to the
//!   uninterrupted run's weights;
//! - a damaged newest checkpoint: `--resume` falls back to the previous one and says so.
#![cfg(unix)]

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use gradcache::train::checkpoint;

use crate::common::{bits, copy_dir, write_tiny_run};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gradcache")
}

/// `gradcache train` on the tiny run's config with `sets`, its output in `out`.
fn train_args(config: &Path, out: &Path, sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "train".into(),
        "--config".into(),
        config.display().to_string(),
        "--set".into(),
        format!("output_dir={}", out.display()),
    ];
    for s in sets {
        args.push("--set".into());
        args.push(s.to_string());
    }
    args
}

/// Runs to the end; panics with the output on failure.
fn run_ok(args: &[String]) -> String {
    let out = Command::new(bin())
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?} failed:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// Starts a run whose standard error goes to `log`.
fn spawn(args: &[String], log: &Path) -> Child {
    let file = fs::File::create(log).unwrap();
    Command::new(bin())
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .unwrap()
}

/// Waits until `ready()` or the child ends; panics after a minute.
fn wait_until(child: &mut Child, what: &str, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before {what}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no {what} after a minute"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sends a signal to a child process this test started and has not reaped.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill failed");
}

fn finish(mut child: Child, log: &Path) -> (Option<i32>, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!(
                "still running after two minutes:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = fs::read_to_string(log).unwrap();
    assert!(!text.contains("panicked"), "{text}");
    (status.code(), text)
}

/// Step -> loss bits, from `metrics.jsonl`.
fn losses(out: &Path) -> BTreeMap<u64, u32> {
    let mut all = BTreeMap::new();
    for line in fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["type"] == "step" {
            let step = v["step"].as_u64().unwrap();
            let loss = v["loss"].as_f64().unwrap() as f32;
            assert!(
                all.insert(step, loss.to_bits()).is_none(),
                "step {step} twice"
            );
        }
    }
    all
}

/// The newest checkpoint's step and tensors (weights and optimizer state) as bits.
fn newest(out: &Path) -> (u64, BTreeMap<String, Vec<u32>>) {
    let c = checkpoint::load(&out.join("checkpoints"), &Device::Cpu).unwrap();
    assert!(c.skipped.is_empty(), "{:?}", c.skipped);
    let mut all: BTreeMap<String, Vec<u32>> =
        c.model.iter().map(|(n, t)| (n.clone(), bits(t))).collect();
    for (n, t) in &c.optimizer {
        all.insert(format!("optimizer {n}"), bits(t));
    }
    (c.state.step, all)
}

#[track_caller]
fn assert_same_as_uninterrupted(
    got: &BTreeMap<String, Vec<u32>>,
    want: &BTreeMap<String, Vec<u32>>,
) {
    let differing: Vec<&String> = want
        .keys()
        .chain(got.keys())
        .filter(|n| got.get(*n) != want.get(*n))
        .collect();
    assert!(
        differing.is_empty(),
        "{differing:?} differ from the uninterrupted run"
    );
}

fn checkpoint_names(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

const STEPS: &str = "train.steps=60";

#[test]
fn sigint_stops_after_the_step_and_the_resume_equals_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_run(dir.path());
    let plain = dir.path().join("plain");
    run_ok(&train_args(&config, &plain, &[STEPS]));
    let (last, want) = newest(&plain);
    assert_eq!(last, 60);

    let out = dir.path().join("interrupted");
    let args = train_args(&config, &out, &[STEPS]);
    let log = dir.path().join("interrupted.log");
    let mut child = spawn(&args, &log);
    let first = out.join("checkpoints").join("step-00000002");
    wait_until(&mut child, "the step-2 checkpoint", || first.is_dir());

    // A second run on the same directory is refused while the first lives.
    let second = Command::new(bin()).args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success());
    assert!(
        stderr.contains(&format!(
            "{} is in use by another training run (process {} on host",
            out.display(),
            child.id()
        )),
        "{stderr}"
    );

    signal(&child, libc::SIGINT);
    let (code, text) = finish(child, &log);
    assert_eq!(code, Some(130), "{text}");
    let (k, _) = newest(&out);
    assert!((2..60).contains(&k), "stopped at step {k}:\n{text}");
    assert!(
        text.contains(&format!(
            "training stopped by SIGINT after step {k}; checkpoint"
        )),
        "{text}"
    );
    assert!(!out.join("gradcache.lock").exists(), "the lock is released");
    let seen = losses(&out);
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        (1..=k).collect::<Vec<_>>(),
        "metrics.jsonl holds every finished step"
    );

    let mut resume = args.clone();
    resume.extend([
        "--resume".into(),
        out.join("checkpoints").display().to_string(),
    ]);
    run_ok(&resume);
    let (step, got) = newest(&out);
    assert_eq!(step, 60);
    assert_eq!(
        losses(&out),
        losses(&plain),
        "every step's loss, bit for bit"
    );
    assert_same_as_uninterrupted(&got, &want);
}

#[test]
fn a_second_sigint_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_run(dir.path());
    // A held-out set of 4,000 pairs: the evaluation before the first step takes a while,
    // and a stop waits for an evaluation in progress.
    let out = dir.path().join("run");
    let eval = format!(
        "data.eval_file={}",
        Path::new("data/quickstart/train.jsonl")
            .canonicalize()
            .unwrap()
            .display()
    );
    let args = train_args(&config, &out, &[STEPS, &eval]);
    let log = dir.path().join("run.log");
    let mut child = spawn(&args, &log);
    wait_until(&mut child, "the first evaluation", || {
        fs::read_to_string(&log).is_ok_and(|t| t.contains("training 60 steps"))
    });
    signal(&child, libc::SIGINT);
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, libc::SIGINT);
    let start = Instant::now();
    let (code, text) = finish(child, &log);
    assert_eq!(code, Some(130), "{text}");
    assert!(
        !text.contains("training stopped"),
        "the second SIGINT waited for the first one's clean stop instead of exiting:\n{text}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(!out.join("checkpoints").exists(), "nothing was trained");
}

#[test]
fn a_write_past_a_file_size_limit_ends_the_run_and_the_last_checkpoint_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_run(dir.path());
    let sets = ["train.steps=6", "train.checkpoint_every=2"];
    let plain = dir.path().join("plain");
    run_ok(&train_args(&config, &plain, &sets));
    let (_, want) = newest(&plain);

    // The run got to step 2 (its checkpoint is the uninterrupted run's), then resumes
    // where a file may hold at most 20 KiB: less than a checkpoint's weights.
    let out = dir.path().join("limited");
    fs::create_dir_all(out.join("checkpoints")).unwrap();
    let two = out.join("checkpoints/step-00000002");
    copy_dir(&plain.join("checkpoints/step-00000002"), &two);
    // The run's own files (tokenizer, model config) come with it.
    for f in ["tokenizer.json", "model_config.json"] {
        fs::copy(plain.join(f), out.join(f)).unwrap();
    }
    let mut args = train_args(&config, &out, &sets);
    args.extend([
        "--resume".into(),
        out.join("checkpoints").display().to_string(),
    ]);
    let limited = Command::new("bash")
        .arg("-c")
        .arg("ulimit -f 20 && exec \"$@\"")
        .arg("bash")
        .arg(bin())
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&limited.stderr);
    assert_eq!(limited.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("error: cannot write")
            && stderr.contains("model.safetensors")
            && stderr.contains("File too large"),
        "{stderr}"
    );
    assert_eq!(
        checkpoint_names(&out),
        vec!["step-00000002".to_string()],
        "the failed checkpoint left nothing behind"
    );
    checkpoint::verify(&two).unwrap();
    assert!(!out.join("gradcache.lock").exists());

    run_ok(&args);
    let (step, got) = newest(&out);
    assert_eq!(step, 6);
    assert_same_as_uninterrupted(&got, &want);
}

#[test]
fn resume_falls_back_past_a_damaged_checkpoint_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_run(dir.path());
    let out = dir.path().join("run");
    let sets = ["train.steps=4", "train.checkpoint_every=2"];
    run_ok(&train_args(&config, &out, &sets));
    let newest_dir = out.join("checkpoints/step-00000004");
    let model = newest_dir.join("model.safetensors");
    let len = fs::metadata(&model).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(len - 100)
        .unwrap();

    // Named directly, the damaged checkpoint is refused with the file named.
    let mut direct = train_args(&config, &out, &sets);
    direct.extend(["--resume".into(), newest_dir.display().to_string()]);
    let o = Command::new(bin()).args(&direct).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains(&format!(
            "damaged checkpoint file {}: truncated",
            model.display()
        )),
        "{stderr}"
    );

    // From the checkpoints directory, the previous one, and the log says which and why.
    let mut root = train_args(&config, &out, &sets);
    root.extend([
        "--resume".into(),
        out.join("checkpoints").display().to_string(),
    ]);
    let stderr = run_ok(&root);
    assert!(
        stderr.contains("step-00000004 skipped: damaged checkpoint file")
            && stderr.contains("resumed from")
            && stderr.contains("step-00000002 at step 2"),
        "{stderr}"
    );
    assert_eq!(newest(&out).0, 4, "the run trained steps 3 and 4 again");
}

#[test]
fn an_image_text_run_refused_by_the_lock_leaves_the_holders_files_alone() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    fs::create_dir_all(&out).unwrap();
    fs::write(out.join("metrics.jsonl"), "the holder's\n").unwrap();
    // This process holds the directory, as a running training would.
    let held = gradcache::train::lock::RunLock::acquire(&out).unwrap();
    let o = Command::new(bin())
        .args([
            "train",
            "--config",
            "configs/image-text.toml",
            "--set",
            &format!("output_dir={}", out.display()),
            "--set",
            "train.steps=2",
            "--set",
            "data.train=256",
            "--set",
            "data.eval=16",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is in use by another training run")
            && stderr.contains(&format!("process {}", std::process::id())),
        "{stderr}"
    );
    assert_eq!(
        fs::read_to_string(out.join("metrics.jsonl")).unwrap(),
        "the holder's\n"
    );
    assert!(!out.join("checkpoints").exists());
    drop(held);
}
