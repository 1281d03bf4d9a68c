//! The binary on bad input: a clear message naming the problem, a non-zero exit, no panic.

use std::fs;
use std::process::Command;

use crate::common::{write_bert_dir, write_tiny_run, TINY_BERT};

/// Runs the binary: success, standard error, standard output.
fn run(args: &[&str]) -> (bool, String, String) {
    run_with_env(args, &[])
}

/// [`run`] with these environment variables set too.
fn run_with_env(args: &[&str], vars: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .envs(vars.iter().copied())
        .output()
        .expect("run the gradcache binary");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !stderr.contains("panicked"),
        "the binary panicked:\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    (out.status.success(), stderr, stdout)
}

fn gradcache(args: &[&str]) -> (bool, String) {
    let (ok, stderr, _) = run(args);
    (ok, stderr)
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
            vec![
                "--set",
                "model.recompute={ selective = { keep = [\"attention.prob\"] } }",
            ],
            "unknown sub-layer site `attention.prob` in `recompute.keep`".into(),
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
    // The output's directory is checked before the model is loaded (the model here does
    // not exist either: its error would come first otherwise), and nothing is written.
    let lost = dir.path().join("no/such/dir/out.jsonl");
    let (ok, stderr) = gradcache(&[
        "encode",
        "--model",
        "./nowhere",
        "--text",
        "hi",
        "--output",
        lost.to_str().unwrap(),
    ]);
    assert!(
        !ok && stderr.contains("is not a directory") && !stderr.contains("model"),
        "{stderr}"
    );
    let (ok, stderr) = gradcache(&[
        "encode",
        "--model",
        "./nowhere",
        "--text",
        "hi",
        "--output",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("it is a directory"), "{stderr}");
    // `eval --data` writes no run file or summary: asking for one is refused, not ignored.
    for flag in ["--run-file", "--output"] {
        let (ok, stderr) = gradcache(&[
            "eval",
            "--model",
            "./nowhere",
            "--data",
            "x.jsonl",
            flag,
            "out",
        ]);
        assert!(
            !ok && stderr.contains(flag) && stderr.contains("--beir"),
            "{flag}: {stderr}"
        );
    }
    // A line that is not UTF-8 is named by file and line.
    let latin1 = dir.path().join("latin1.txt");
    fs::write(&latin1, b"plain\ncaf\xe9\n").unwrap();
    let (ok, stderr) = gradcache(&[
        "encode",
        "--model",
        "./nowhere",
        "--input",
        latin1.to_str().unwrap(),
    ]);
    assert!(
        !ok && stderr.contains("latin1.txt:2: cannot read the line (not UTF-8 text?)"),
        "{stderr}"
    );
    // A GPU this build (no `cuda` feature in the tests) cannot open: an error, no panic.
    for cmd in [
        vec![
            "encode",
            "--model",
            "./nowhere",
            "--text",
            "hi",
            "--device",
            "cuda",
        ],
        vec![
            "eval",
            "--model",
            "./nowhere",
            "--data",
            "x.jsonl",
            "--device",
            "cuda:0",
        ],
    ] {
        let (ok, stderr) = gradcache(&cmd);
        assert!(
            !ok && stderr.contains("device `cuda:0` is unavailable")
                && !stderr.contains("panicked"),
            "{cmd:?}: {stderr}"
        );
    }
    let (ok, stderr) = gradcache(&["encode", "--model", "m", "--text", "hi", "--device", "tpu"]);
    assert!(!ok && stderr.contains("invalid device tpu"), "{stderr}");
    assert!(
        !dir.path().join("run").join("checkpoints").exists(),
        "no failed run wrote a checkpoint"
    );
}

/// The texts `encode` printed, one per line.
fn texts(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// The embeddings `encode` printed, one per line.
fn embeddings(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn a_plain_model_directory_pools_as_told_and_the_log_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("plain-bert");
    write_bert_dir(&model, TINY_BERT, false);
    let model = model.display().to_string();
    let texts = ["--text", "the lord is my shepherd", "--text", "light"];

    let mut args = vec!["encode", "--model", &model];
    args.extend(texts);
    let (ok, stderr, stdout) = run(&args);
    assert!(ok, "{stderr}");
    for want in [
        "pooling mean (default)",
        "normalize false (default)",
        "similarity cosine (default)",
        "no sentence-transformers files in",
    ] {
        assert!(stderr.contains(want), "`{want}` missing:\n{stderr}");
    }
    let mean = embeddings(&stdout);

    args.extend(["--pooling", "cls", "--normalize", "true"]);
    let (ok, stderr, stdout) = run(&args);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("pooling cls (given)") && stderr.contains("normalize true (given)"),
        "{stderr}"
    );
    let cls = embeddings(&stdout);
    assert_eq!(cls.len(), 2);
    for (c, m) in cls.iter().zip(&mean) {
        let norm = c.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "normalised: |e| = {norm}");
        assert_ne!(c, m, "CLS pooling gives other embeddings than mean pooling");
    }
}

#[test]
fn a_two_tower_run_exports_its_passage_tower_and_eval_uses_its_similarity() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_run(dir.path()).display().to_string();
    let sets = [
        "--set",
        "model.shared=false",
        "--set",
        "train.steps=2",
        "--set",
        "loss.similarity=dot",
        "--set",
        "model.normalize=false",
    ];
    let mut args = vec!["train", "--config", &config];
    args.extend(sets);
    let (ok, stderr) = gradcache(&args);
    assert!(ok, "{stderr}");
    // Where each step's time and memory went: in metrics.jsonl, in the log, in phases.png.
    let run_dir = dir.path().join("run");
    let steps: Vec<serde_json::Value> = fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .collect();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        let peaks = &s["phase_peak_bytes"];
        let bytes = |k: &str| peaks[k].as_u64().unwrap_or_else(|| panic!("no {k} in {s}"));
        // The counting allocator sees each phase: the replay holds a chunk's graph and the
        // gradients, more than the graph-free pass holds for the representations.
        assert!(
            bytes("represent") > 0 && bytes("replay") > bytes("represent"),
            "{peaks}"
        );
        assert!(bytes("optimizer") > 0, "{peaks}");
        // The step's own peak (measured around the whole step) still sees the phases'.
        let step_peak = s["peak_bytes"].as_u64().unwrap();
        assert!(
            step_peak >= bytes("replay"),
            "step peak {step_peak} < {peaks}"
        );
        assert!(s["phases_ms"]["replay_ms"].as_f64().unwrap() > 0.0);
    }
    assert!(stderr.contains("step 1: represent "), "{stderr}");
    assert!(stderr.contains(" MiB, loss "), "{stderr}");
    if stderr.contains("time and memory per phase") {
        assert!(run_dir.join("phases.png").is_file());
    } else {
        assert!(stderr.contains("no phase plot: no font"), "{stderr}");
    }

    let out = dir.path().join("passage-tower");
    let out_arg = out.display().to_string();
    let mut export = vec!["export", "--config", &config, "--output", &out_arg];
    export.extend(sets);
    export.extend(["--tower", "passage"]);
    let (ok, stderr) = gradcache(&export);
    assert!(ok && stderr.contains("exported step 2"), "{stderr}");
    assert!(out.join("model.safetensors").is_file());

    let eval = dir.path().join("eval.jsonl").display().to_string();
    let args = [
        "eval",
        "--model",
        &out_arg,
        "--data",
        &eval,
        "--max-len",
        "24",
    ];
    let (ok, stderr, stdout) = run(&args);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("similarity dot (from config_sentence_transformers.json)"),
        "{stderr}"
    );
    let metrics: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(metrics["queries"], 10);

    // Exporting into the same directory again is refused and changes nothing.
    let before = fs::read(out.join("model.safetensors")).unwrap();
    let (ok, stderr) = gradcache(&export);
    assert!(
        !ok && stderr.contains("exists and is not empty"),
        "{stderr}"
    );
    assert_eq!(fs::read(out.join("model.safetensors")).unwrap(), before);
}

#[test]
fn self_check_passes_on_the_cpu_and_rejects_an_unavailable_gpu() {
    let (ok, stderr, stdout) = run(&["self-check"]);
    assert!(ok, "{stderr}\n{stdout}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        15,
        "{stdout}"
    );
    assert!(stdout.contains("all 15 checks passed on cpu"), "{stdout}");
    let (ok, stderr) = gradcache(&["self-check", "--device", "cuda"]);
    assert!(
        !ok && stderr.contains("device `cuda:0` is unavailable"),
        "{stderr}"
    );
}

#[test]
fn the_image_text_config_trains_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = format!("output_dir={}", dir.path().join("run").display());
    let mut args = vec![
        "train",
        "--config",
        "configs/image-text.toml",
        "--set",
        &out,
    ];
    for set in [
        "data.image_size=16",
        "data.train=32",
        "data.eval=8",
        "image.width=4",
        "image.stages=[1]",
        "text.hidden_size=16",
        "text.num_layers=1",
        "text.intermediate_size=32",
        "train.steps=2",
        "train.batch_size=16",
        "train.image_chunk=8",
        "train.text_chunk=16",
    ] {
        args.extend(["--set", set]);
    }
    let (ok, stderr) = gradcache(&args);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("held-out image->text before"), "{stderr}");
    assert!(stderr.contains("held-out image->text after"), "{stderr}");
    let run = dir.path().join("run");
    assert!(run.join("model/image_tower.safetensors").is_file());
    assert!(run.join("checkpoints/step-00000002").is_dir());
    assert!(run.join("metrics.jsonl").is_file());

    // A bad value names its key and leaves nothing behind.
    let bad = dir.path().join("bad");
    let out = format!("output_dir={}", bad.display());
    let (ok, stderr) = gradcache(&[
        "train",
        "--config",
        "configs/image-text.toml",
        "--set",
        &out,
        "--set",
        "train.image_chunk=1",
    ]);
    assert!(!ok);
    assert!(stderr.contains("train.image_chunk"), "{stderr}");
    assert!(!bad.exists());
}

#[test]
fn encode_keeps_every_input_line_and_the_model_decides_the_limit() {
    // A decoder (the tiny Qwen3: left padding, EOS appended, last-token pooling). A blank
    // line is an empty text: line i of the output is line i of the input.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("texts.txt");
    fs::write(&input, "In the beginning\n\nJesus wept.\n   \nlast").unwrap();
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/qwen3");
    let model = model.display().to_string();
    let input = input.display().to_string();
    let (ok, stderr, stdout) = run(&["encode", "--model", &model, "--input", &input]);
    assert!(ok, "{stderr}");
    let texts = texts(&stdout);
    assert_eq!(
        texts,
        ["In the beginning", "", "Jesus wept.", "   ", "last"]
    );
    // The model's own limit (its tokenizer_config.json), logged; a larger one is capped.
    assert!(stderr.contains("max_len 32 (the model's"), "{stderr}");
    // Without --batch-size the CPU runs passes of up to 512 tokens.
    assert!(
        stderr.contains("encoded 5 texts, passes of up to 512 tokens"),
        "{stderr}"
    );
    let (ok, stderr, _) = run(&[
        "encode",
        "--model",
        &model,
        "--text",
        "a",
        "--max-len",
        "512",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("max_len 512 capped at the model's limit of 32"),
        "{stderr}"
    );

    // `--batch-size` sets the texts per forward pass: the same embeddings, line for line;
    // zero is refused.
    let (ok, stderr, small) = run(&[
        "encode",
        "--model",
        &model,
        "--input",
        &input,
        "--batch-size",
        "2",
    ]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("encoded 5 texts, 2 per pass"), "{stderr}");
    let (a, b) = (embeddings(&stdout), embeddings(&small));
    assert_eq!(a.len(), 5);
    for (x, y) in a.iter().zip(&b) {
        let err = x.iter().zip(y).fold(0f64, |m, (p, q)| m.max((p - q).abs()));
        assert!(err <= 1e-6, "batch size 2 against the default: {err:e}");
    }
    let (ok, stderr, _) = run(&[
        "encode",
        "--model",
        &model,
        "--text",
        "a",
        "--batch-size",
        "0",
    ]);
    assert!(!ok);
    assert!(stderr.contains("--batch-size 0 runs no text"), "{stderr}");
}

/// A long input is encoded and written a group of texts at a time (512 texts per group at
/// one text per pass): every line once, in order, each as the text embeds alone. With one
/// text per pass a text's embedding does not depend on the others, so two runs over the
/// first 700 and the last 400 lines print what one run over all 1,100 prints, byte for
/// byte, though their groups fall elsewhere; into a file too.
#[test]
fn encode_writes_a_long_input_group_by_group_line_for_line() {
    let dir = tempfile::tempdir().unwrap();
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/qwen3");
    let model = model.display().to_string();
    let lines: Vec<String> = (0..1100)
        .map(|i| format!("verse {i} {}", "and it was so ".repeat(i % 7)))
        .collect();
    let write = |name: &str, lines: &[String]| {
        let path = dir.path().join(name);
        fs::write(&path, lines.join("\n")).unwrap();
        path.display().to_string()
    };
    let (all, first, rest) = (
        write("all.txt", &lines),
        write("first.txt", &lines[..700]),
        write("rest.txt", &lines[700..]),
    );
    let encode = |input: &str| {
        let (ok, stderr, stdout) = run(&[
            "encode",
            "--model",
            &model,
            "--input",
            input,
            "--batch-size",
            "1",
        ]);
        assert!(ok, "{stderr}");
        stdout
    };
    let whole = encode(&all);
    let texts = texts(&whole);
    assert_eq!(texts, lines);
    assert!(
        whole == encode(&first) + &encode(&rest),
        "the groups changed a line"
    );
    let out = dir.path().join("out.jsonl");
    let (ok, stderr, stdout) = run(&[
        "encode",
        "--model",
        &model,
        "--input",
        &all,
        "--batch-size",
        "1",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(ok && stdout.is_empty(), "{stderr}");
    assert!(fs::read_to_string(&out).unwrap() == whole);
    assert!(
        stderr.contains("encoded 1100 texts, 1 per pass"),
        "{stderr}"
    );
}

#[test]
fn merge_writes_a_model_and_refuses_a_bad_merge() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = |family: &str| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/families")
            .join(family)
            .display()
            .to_string()
    };
    let (bert, roberta) = (fixture("bert"), fixture("roberta"));
    let out = dir.path().join("merged");
    let out_arg = out.display().to_string();
    let (ok, stderr) = gradcache(&[
        "merge", "--model", &bert, "--model", &bert, "--method", "slerp", "--output", &out_arg,
    ]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("merged 2 bert models"), "{stderr}");
    let (ok, _, stdout) = run(&["encode", "--model", &out_arg, "--text", "Jesus wept."]);
    assert!(ok && stdout.contains("embedding"), "{stdout}");

    let other = dir.path().join("other").display().to_string();
    let (ok, stderr) = gradcache(&[
        "merge", "--model", &bert, "--model", &roberta, "--output", &other,
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("model_type `roberta` cannot be merged with `bert`"),
        "{stderr}"
    );
    assert!(!dir.path().join("other").exists());
}

#[test]
fn a_profiled_encoding_counts_its_products_and_changes_no_embedding() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("plain-bert");
    write_bert_dir(&model, TINY_BERT, false);
    let model = model.display().to_string();
    let args = [
        "encode",
        "--model",
        &model,
        "--text",
        "the lord is my shepherd",
        "--text",
        "light",
    ];
    let (ok, stderr, plain) = run(&args);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("encode profile"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args(args)
        .env("GRADCACHE_PROFILE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Two layers of six products (queries, keys, values, attention output, up, down) on
    // the one chunk of two texts.
    assert!(
        stderr.contains("GFLOP in 12 products at"),
        "the products counted:\n{stderr}"
    );
    assert!(stderr.contains("cpu.products"), "{stderr}");
    assert_eq!(
        embeddings(&String::from_utf8_lossy(&out.stdout)),
        embeddings(&plain),
        "profiling changes no embedding"
    );
}

#[test]
fn a_blas_that_cannot_be_used_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("plain-bert");
    write_bert_dir(&model, TINY_BERT, false);
    let output = dir.path().join("embeddings.jsonl");
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    for (blas, says) in [
        ("/nonexistent/libmkl_rt.so.2", "no such file"),
        (manifest, "cannot open it as a shared library"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(["encode", "--model", &model.display().to_string()])
            .args(["--text", "light", "--output", &output.display().to_string()])
            .env("GRADCACHE_BLAS", blas)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{blas}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "cannot use the BLAS at {blas} (GRADCACHE_BLAS): {says}"
            )),
            "{stderr}"
        );
        assert!(!output.exists(), "nothing is written");
    }
}

/// A process-wide setting read from the environment variable `var`, on `gradcache encode`
/// of a tiny BERT: unset, no line says `quiet` (the start of its log line); set to `good`,
/// `logged` is in the log and the embeddings are the same bits; each of `bad`, and a value
/// that is not UTF-8, is refused by the variable's name before anything is written.
fn a_setting_changes_no_embedding_and_a_bad_one_is_refused(
    var: &str,
    (good, quiet, logged): (&str, &str, &str),
    bad: &[&str],
) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("plain-bert");
    write_bert_dir(&model, TINY_BERT, false);
    let model = model.display().to_string();
    let output = dir.path().join("embeddings.jsonl");
    let output_arg = output.display().to_string();
    let args = [
        "encode",
        "--model",
        &model,
        "--text",
        "light",
        "--text",
        "the lord is my shepherd",
    ];
    let encode = |value: &str, extra: &[&str]| {
        let all: Vec<&str> = args.iter().chain(extra).copied().collect();
        run_with_env(&all, &[(var, value)])
    };
    let (ok, stderr, plain) = encode("", &[]);
    assert!(ok && !stderr.contains(quiet), "{stderr}");
    let (ok, stderr, set) = encode(good, &[]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains(logged), "{stderr}");
    assert_eq!(embeddings(&set), embeddings(&plain), "the same bits");
    for bad in bad {
        let (ok, stderr, _) = encode(bad, &["--output", &output_arg]);
        assert!(!ok && !stderr.contains("panicked"), "{bad}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value for `{var}`: {bad}")),
            "{stderr}"
        );
        assert!(!output.exists(), "nothing is written");
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let out = Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(args)
            .args(["--output", &output_arg])
            .env(var, std::ffi::OsStr::from_bytes(b"rhs=\xff"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !stderr.contains("panicked"),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("`{var}`: (not UTF-8)")),
            "{stderr}"
        );
        assert!(!output.exists(), "nothing is written");
    }
}

#[test]
fn the_panel_kernel_setting_changes_no_embedding_and_a_bad_one_is_refused() {
    a_setting_changes_no_embedding_and_a_bad_one_is_refused(
        "GRADCACHE_PANEL_KERNEL",
        (
            "blocked=64",
            "panel products",
            "panel products: Blocked { inputs: 64 } (GRADCACHE_PANEL_KERNEL)",
        ),
        &["blocked=0", "fast"],
    );
}

#[test]
fn gemm_packing_thresholds_change_no_embedding_and_a_bad_one_is_refused() {
    a_setting_changes_no_embedding_and_a_bad_one_is_refused(
        "GRADCACHE_GEMM_PACKING",
        (
            "rhs=1, lhs=256",
            "packing thresholds",
            "gemm packing thresholds: rhs 1, lhs 256 (GRADCACHE_GEMM_PACKING)",
        ),
        &["rhs=0", "lhs", "nr=4"],
    );
}
