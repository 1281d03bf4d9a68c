//! The binary on bad input: a clear message naming the problem, a non-zero exit, no panic.

use std::fs;
use std::process::Command;

fn gradcache(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run the gradcache binary");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !stderr.contains("panicked"),
        "the binary panicked:\n{stderr}"
    );
    (out.status.success(), stderr)
}

#[test]
fn bad_configs_and_data_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.jsonl");
    fs::write(
        &broken,
        "{\"query\": \"a\", \"positive\": \"b\"}\nnot json\n",
    )
    .unwrap();
    let out = format!("output_dir={}", dir.path().join("run").display());
    let broken_set = format!("data.train_file={}", broken.display());
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--set", "train.query_chunk=0"],
            "invalid value for `train.query_chunk`: 0".into(),
        ),
        (
            vec!["--set", "train.batchsize=8"],
            "unknown field `batchsize`".into(),
        ),
        (
            vec!["--set", "loss.temperature=0"],
            "invalid value for `loss.temperature`".into(),
        ),
        (
            vec!["--set", "data.train_file=/nonexistent/train.jsonl"],
            "missing data file: /nonexistent/train.jsonl".into(),
        ),
        (
            vec!["--set", &broken_set],
            format!("{}:2: not valid JSON", broken.display()),
        ),
        (
            vec!["--set", "model.pretrained=./no-such-model"],
            "missing model directory".into(),
        ),
        (
            vec!["--set", "model.pretrained=org/not-cached"],
            "HF_HUB_OFFLINE is set".into(),
        ),
        (
            vec!["--set", "dist.bucket_mib=0"],
            "invalid value for `dist.bucket_mib`: 0".into(),
        ),
        (
            vec!["--set", "dist.backend=gloo"],
            "unknown variant `gloo`".into(),
        ),
        #[cfg(not(feature = "mpi"))]
        (
            vec!["--set", "dist.backend=mpi"],
            "distributed backend `mpi` is unavailable: this build has no MPI support".into(),
        ),
        #[cfg(not(feature = "nccl"))]
        (
            vec!["--set", "dist.backend=nccl"],
            "distributed backend `nccl` is unavailable: this build has no NCCL support".into(),
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec![
            "train",
            "--config",
            "configs/quickstart.toml",
            "--set",
            &out,
        ];
        args.extend(extra.iter().copied());
        let (ok, stderr) = gradcache(&args);
        assert!(!ok, "{extra:?} should fail");
        assert!(
            stderr.contains(&want),
            "{extra:?}: stderr should contain `{want}`:\n{stderr}"
        );
    }
    let (ok, stderr) = gradcache(&["train", "--config", "configs/nope.toml"]);
    assert!(
        !ok && stderr.contains("missing config file: configs/nope.toml"),
        "{stderr}"
    );
    let (ok, stderr) = gradcache(&["encode", "--model", "./nowhere", "--text", "hi"]);
    assert!(
        !ok && stderr.contains("missing model directory"),
        "{stderr}"
    );
    let (ok, stderr) = gradcache(&["encode", "--model", "./nowhere"]);
    assert!(!ok && stderr.contains("nothing to encode"), "{stderr}");
    assert!(
        !dir.path().join("run").join("checkpoints").exists(),
        "no failed run wrote a checkpoint"
    );
}
