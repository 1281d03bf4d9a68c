//! `gradcache train --resume DIR --extend`: a finished run continues to a larger
//! `train.steps` with the new length's learning-rate schedule from its step on, recorded in
//! the checkpoints and metrics.jsonl; without the flag the refusal names it; a shorter
//! length, or any other change, is refused with it, nothing written.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use candle_core::Device;
use gradcache::train::checkpoint::{self, Extension};

fn train(config: &Path, sets: &[&str], extra: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradcache"));
    cmd.args(["train", "--config"]).arg(config);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.args(extra).env("HF_HUB_OFFLINE", "1").output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("panicked"), "{text}");
    (out.status.success(), text)
}

/// Every file under `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut all = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                all.insert(p.display().to_string(), std::fs::read(&p).unwrap());
            }
        }
    }
    all
}

/// The `metrics.jsonl` lines of `type` in `run`.
fn lines(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == kind)
        .collect()
}

#[test]
fn a_finished_run_extends_to_more_steps_with_the_new_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(dir.path());
    let run = dir.path().join("run");
    let (ok, text) = train(&config, &[], &[]);
    assert!(ok, "{text}");
    let checkpoints = run.join("checkpoints");
    let resume = ["--resume", checkpoints.to_str().unwrap()];
    let before = files(&run);

    // Another length without the flag: refused, naming it.
    let (ok, text) = train(&config, &["train.steps=8"], &resume);
    assert!(!ok && text.contains("resume with --extend"), "{text}");
    // A shorter length, another learning rate, or the flag without a checkpoint.
    let (ok, text) = train(
        &config,
        &["train.steps=3"],
        &[&resume[..], &["--extend"]].concat(),
    );
    assert!(!ok && text.contains("--extend needs more steps"), "{text}");
    let (ok, text) = train(
        &config,
        &["train.steps=8", "optim.lr=2e-3"],
        &[&resume[..], &["--extend"]].concat(),
    );
    assert!(
        !ok && text.contains("not only another train.steps"),
        "{text}"
    );
    let (ok, text) = train(&config, &["train.steps=8"], &["--extend"]);
    assert!(!ok && text.contains("--resume"), "{text}");
    assert_eq!(files(&run), before, "a refused extension writes nothing");

    // Extended to 8 steps.
    let (ok, text) = train(
        &config,
        &["train.steps=8"],
        &[&resume[..], &["--extend"]].concat(),
    );
    assert!(ok, "{text}");
    assert!(
        text.contains("extended from 4 to 8 steps at step 4")
            && text.contains("no longer the uninterrupted run"),
        "{text}"
    );
    let last = checkpoint::load(&checkpoints, &Device::Cpu).unwrap();
    let extension = Extension {
        step: 4,
        from_steps: 4,
        to_steps: 8,
    };
    assert_eq!(last.state.step, 8);
    assert_eq!(last.state.train_steps, Some(8));
    assert_eq!(last.state.extensions, vec![extension]);
    let recorded = lines(&run, "extended");
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (
            &recorded[0]["step"],
            &recorded[0]["from_steps"],
            &recorded[0]["to_steps"]
        ),
        (&4.into(), &4.into(), &8.into())
    );
    let steps: Vec<u64> = lines(&run, "step")
        .iter()
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());

    // From step 5 the learning rate is the 8-step schedule's, as an 8-step run's.
    let long = dir.path().join("long");
    let out = format!("output_dir=\"{}\"", long.display());
    let (ok, text) = train(&config, &["train.steps=8", &out], &[]);
    assert!(ok, "{text}");
    let lr = |run: &Path| -> Vec<f64> {
        lines(run, "step")
            .iter()
            .map(|v| v["lr"].as_f64().unwrap())
            .collect()
    };
    let (extended, straight) = (lr(&run), lr(&long));
    assert_eq!(extended[4..], straight[4..], "steps 5-8");
    assert_ne!(
        extended[..4],
        straight[..4],
        "steps 1-4 followed the 4-step schedule"
    );

    // The extended run's checkpoints now resume with 8 steps and no flag.
    let (ok, text) = train(&config, &["train.steps=8"], &resume);
    assert!(ok, "{text}");
}

#[test]
fn checkpoints_from_before_the_flag_and_image_text_runs_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(dir.path());
    let run = dir.path().join("run");
    let (ok, text) = train(&config, &[], &[]);
    assert!(ok, "{text}");
    // A checkpoint as written before --extend existed: no length-free fingerprint.
    let checkpoints = run.join("checkpoints");
    let last = checkpoint::load(&checkpoints, &Device::Cpu).unwrap().dir;
    let state = last.join("trainer_state.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    let fields = json.as_object_mut().unwrap();
    fields.remove("length_free_fingerprint");
    fields.remove("train_steps");
    std::fs::write(&state, json.to_string()).unwrap();
    let before = files(&run);
    let resume = ["--resume", checkpoints.to_str().unwrap(), "--extend"];
    let (ok, text) = train(&config, &["train.steps=8"], &resume);
    assert!(
        !ok && text.contains("written before --extend existed"),
        "{text}"
    );
    assert_eq!(files(&run), before, "nothing written");
    // Image-text and volume-text runs resume with their own length only.
    let out = format!("output_dir=\"{}\"", dir.path().join("volumes").display());
    let (ok, text) = train(Path::new("configs/volume-text.toml"), &[&out], &resume);
    assert!(
        !ok && text.contains("--extend continues text-pair runs"),
        "{text}"
    );
    assert!(!dir.path().join("volumes").exists(), "nothing written");
}
