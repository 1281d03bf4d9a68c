//! The retrieval workflow from the command line, on a slice of the shipped BEIR-layout set
//! (data/bible-beir) so that it runs in a debug build: train with the worked example's
//! config (prompts, Matryoshka widths, no-duplicates batches, evaluation against a BEIR
//! corpus) and see it learn, export (prompts and widths recorded), `eval --beir` (run file
//! and summary), `mine` (negatives that are not positives), train on the mined file with
//! the hard-negative config; and bad input refused with nothing written.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
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
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    (out.status.success(), stderr, stdout)
}

/// A BEIR folder with the shipped set's first `train` train and `test` dev queries (as
/// its `test` split) and a corpus of their documents and their neighbours (gzip, like the
/// shipped one).
fn slice(dir: &Path, train: usize, test: usize, neighbours: usize) {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/bible-beir");
    let qrels = |split: &str, n: usize| -> Vec<(String, String)> {
        fs::read_to_string(shipped.join(format!("qrels/{split}.tsv")))
            .unwrap()
            .lines()
            .skip(1)
            .take(n)
            .map(|l| {
                let c: Vec<&str> = l.split('\t').collect();
                (c[0].to_string(), c[1].to_string())
            })
            .collect()
    };
    let (train, test) = (qrels("train", train), qrels("dev", test));
    let wanted: std::collections::HashSet<&str> =
        train.iter().chain(&test).map(|(_, d)| d.as_str()).collect();
    let queries: std::collections::HashSet<&str> =
        train.iter().chain(&test).map(|(q, _)| q.as_str()).collect();
    fs::create_dir_all(dir.join("qrels")).unwrap();
    let corpus =
        flate2::read::GzDecoder::new(fs::File::open(shipped.join("corpus.jsonl.gz")).unwrap());
    let lines: Vec<String> = BufReader::new(corpus).lines().map(|l| l.unwrap()).collect();
    let ids: Vec<String> = lines
        .iter()
        .map(|l| {
            let doc: serde_json::Value = serde_json::from_str(l).unwrap();
            doc["_id"].as_str().unwrap().to_string()
        })
        .collect();
    // Each wanted verse with its `neighbours` verses either side: the same chapter, the
    // hardest distractors the corpus holds.
    let mut keep = vec![false; lines.len()];
    for (i, id) in ids.iter().enumerate() {
        if wanted.contains(id.as_str()) {
            let (lo, hi) = (
                i.saturating_sub(neighbours),
                (i + neighbours + 1).min(lines.len()),
            );
            keep[lo..hi].iter_mut().for_each(|k| *k = true);
        }
    }
    let mut out = flate2::write::GzEncoder::new(
        fs::File::create(dir.join("corpus.jsonl.gz")).unwrap(),
        flate2::Compression::fast(),
    );
    for (line, _) in lines.iter().zip(&keep).filter(|(_, &k)| k) {
        writeln!(out, "{line}").unwrap();
    }
    out.finish().unwrap();
    let q: String = fs::read_to_string(shipped.join("queries.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            queries.contains(v["_id"].as_str().unwrap())
        })
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(dir.join("queries.jsonl"), q).unwrap();
    for (name, rows) in [("train", &train), ("test", &test)] {
        let text: String = std::iter::once("query-id\tcorpus-id\tscore\n".to_string())
            .chain(rows.iter().map(|(q, d)| format!("{q}\t{d}\t1\n")))
            .collect();
        fs::write(dir.join(format!("qrels/{name}.tsv")), text).unwrap();
    }
}

fn metrics_line(stderr: &str, which: &str) -> f64 {
    // "before: recall@1 ... ndcg@10 0.812 ..." -> nDCG@10
    let line = stderr
        .lines()
        .find(|l| l.contains(which))
        .unwrap_or_else(|| panic!("no `{which}` line in\n{stderr}"));
    let after = line.split("ndcg@10 ").nth(1).unwrap();
    after.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn the_worked_example_learns_mines_and_evaluates() {
    let tmp = tempfile::tempdir().unwrap();
    let beir = tmp.path().join("beir");
    slice(&beir, 320, 60, 6);
    let beir_arg = beir.display().to_string();
    let out = tmp.path().join("run");
    let out_arg = format!("output_dir={}", out.display());
    let data = [
        format!("data.train_file={beir_arg}"),
        format!("data.eval_file={beir_arg}"),
        "data.eval_split=test".to_string(),
    ];
    let mut sets: Vec<String> = data.to_vec();
    sets.extend([
        out_arg.clone(),
        "train.steps=40".into(),
        "train.batch_size=32".into(),
        "train.eval_every=0".into(),
        "train.checkpoint_every=0".into(),
        "optim.lr=2e-3".into(),
    ]);
    let mut args = vec!["train", "--config", "configs/bible-beir.toml"];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let (ok, stderr, _) = run(&args);
    assert!(ok, "{stderr}");
    let (before, after) = (
        metrics_line(&stderr, "before:"),
        metrics_line(&stderr, "after:"),
    );
    assert!(
        after > before + 0.02,
        "the worked example's config must learn: nDCG@10 {before} -> {after}"
    );
    assert!(
        stderr.contains("recall@100"),
        "a corpus evaluation: {stderr}"
    );
    println!("nDCG@10 on the slice's test split: {before} before, {after} after training");

    let model = tmp.path().join("model");
    let model_arg = model.display().to_string();
    let mut export = vec![
        "export",
        "--config",
        "configs/bible-beir.toml",
        "--output",
        &model_arg,
    ];
    for s in &sets {
        export.extend(["--set", s.as_str()]);
    }
    let (ok, stderr, _) = run(&export);
    assert!(ok, "{stderr}");
    let st: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(model.join("config_sentence_transformers.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(st["prompts"]["query"], "query: ");
    assert_eq!(st["prompts"]["passage"], "passage: ");
    assert_eq!(st["matryoshka_dims"], serde_json::json!([128, 64, 32]));

    // eval --beir: the printed metrics, the summary and the run file agree.
    let run_file = tmp.path().join("test.trec");
    let summary = tmp.path().join("test.json");
    let (ok, stderr, stdout) = run(&[
        "eval",
        "--model",
        &model_arg,
        "--beir",
        &beir_arg,
        "--split",
        "test",
        "--run-file",
        run_file.to_str().unwrap(),
        "--output",
        summary.to_str().unwrap(),
        "--corpus-block",
        "100",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("query prompt \"query: \""),
        "prompts from the export: {stderr}"
    );
    let printed: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(written["metrics"], printed);
    assert_eq!(printed["queries"], 60);
    let ndcg = printed["ndcg_at_10"].as_f64().unwrap();
    assert!(
        (ndcg - after).abs() < 1e-3,
        "eval {ndcg} vs the trainer's last {after}"
    );
    let run_text = fs::read_to_string(&run_file).unwrap();
    assert_eq!(run_text.lines().count(), 60 * 100, "top 100 per query");
    let measured = gradcache::retrieval::metrics::corpus_metrics(
        &gradcache::retrieval::metrics::parse_trec_run(&run_text).unwrap(),
        &gradcache::retrieval::beir::read_qrels(&beir.join("qrels/test.tsv")).unwrap(),
    );
    assert!(
        (measured.ndcg_at_10 - ndcg).abs() < 1e-12,
        "the run file is what was measured"
    );

    // mine: three negatives per query, never a positive, from the corpus.
    let mined = tmp.path().join("mined.jsonl");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        &model_arg,
        "--beir",
        &beir_arg,
        "--split",
        "train",
        "--num-negatives",
        "3",
        "--range-max",
        "30",
        "--relative-margin",
        "0.05",
        "--output",
        mined.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> = fs::read_to_string(&mined)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(rows.len() >= 300, "{} rows: {stderr}", rows.len());
    for r in &rows {
        let negatives = r["negatives"].as_array().unwrap();
        assert_eq!(negatives.len(), 3);
        assert!(negatives.iter().all(|n| n != &r["positive"]), "{r}");
    }

    // The hard-negative config trains on them from the exported model.
    let hn_out = format!("output_dir={}", tmp.path().join("hn").display());
    let hn_sets = [
        format!("data.train_file={}", mined.display()),
        format!("data.eval_file={beir_arg}"),
        "data.eval_split=test".to_string(),
        format!("model.pretrained={model_arg}"),
        hn_out,
        "train.steps=3".into(),
        "train.batch_size=16".into(),
        "train.eval_every=0".into(),
    ];
    let mut args = vec![
        "train",
        "--config",
        "configs/bible-beir-hard-negatives.toml",
    ];
    for s in &hn_sets {
        args.extend(["--set", s.as_str()]);
    }
    let (ok, stderr, _) = run(&args);
    assert!(ok, "{stderr}");
    assert!(
        !stderr.contains("filled"),
        "every query has its mined negatives: {stderr}"
    );

    // Bad input: refused, nothing written.
    let nothing = tmp.path().join("nothing.jsonl");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        &model_arg,
        "--beir",
        &beir_arg,
        "--max-score",
        "-2",
        "--output",
        nothing.to_str().unwrap(),
    ]);
    assert!(
        !ok && stderr.contains("no query kept 3 negatives"),
        "{stderr}"
    );
    assert!(!nothing.exists());
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        &model_arg,
        "--data",
        mined.to_str().unwrap(),
        "--output",
        mined.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("is an input"), "{stderr}");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        &model_arg,
        "--beir",
        &beir_arg,
        "--range-min",
        "50",
        "--range-max",
        "20",
        "--output",
        nothing.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("range_max"), "{stderr}");
    let (ok, stderr, _) = run(&[
        "eval",
        "--model",
        &model_arg,
        "--beir",
        tmp.path().join("nope").to_str().unwrap(),
        "--run-file",
        nothing.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("missing BEIR corpus"), "{stderr}");
    assert!(!nothing.exists());
    // An output in a missing directory is refused before the model is loaded (this model
    // does not exist: its error would come first otherwise).
    let lost = tmp.path().join("no/such/dir/out");
    for command in ["eval", "mine"] {
        let flag = if command == "eval" {
            "--run-file"
        } else {
            "--output"
        };
        let (ok, stderr, _) = run(&[
            command,
            "--model",
            tmp.path().join("no-model").to_str().unwrap(),
            "--beir",
            &beir_arg,
            flag,
            lost.to_str().unwrap(),
        ]);
        assert!(
            !ok && stderr.contains("is not a directory") && !stderr.contains("no-model"),
            "{command}: {stderr}"
        );
    }
    let (ok, stderr, _) = run(&[
        "eval",
        "--model",
        tmp.path().join("no-model").to_str().unwrap(),
        "--beir",
        &beir_arg,
        "--output",
        lost.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("is not a directory"), "{stderr}");
    let (ok, stderr, _) = run(&[
        "eval", "--model", &model_arg, "--beir", &beir_arg, "--top-k", "0",
    ]);
    assert!(!ok && stderr.contains("--top-k"), "{stderr}");
    let (ok, stderr, _) = run(&[
        "eval",
        "--model",
        &model_arg,
        "--beir",
        &beir_arg,
        "--split",
        "test",
        "--run-file",
        tmp.path().join("no/such/dir/run.trec").to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("is not a directory"), "{stderr}");
    let (ok, stderr, _) = run(&[
        "eval", "--model", &model_arg, "--beir", &beir_arg, "--split", "dev",
    ]);
    assert!(!ok && stderr.contains("qrels/dev.tsv"), "{stderr}");
}
