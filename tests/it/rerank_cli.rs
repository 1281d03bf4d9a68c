//! `gradcache rerank` and `gradcache score` on the tiny BERT cross-encoder of
//! `tests/fixtures/rerank/` (saved by sentence-transformers' `CrossEncoder`): reranking
//! the fixture's first-stage run equals sentence-transformers'
//! `CrossEncoderRerankingEvaluator` (before and after, the positives reranked or not) to
//! 1e-6; the run's document that is not in the corpus is counted and named; `score`
//! writes `CrossEncoder.predict`'s scores in order; bad input is refused with nothing
//! written.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use gradcache::rerank::CrossEncoder as CrossEncoderModel;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rerank")
}

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
    (
        out.status.success(),
        stderr,
        String::from_utf8_lossy(&out.stdout).to_string(),
    )
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

#[test]
fn rerank_equals_cross_encoder_reranking_evaluator() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference()["rerank"].clone();
    let (model, beir, run_file) = (
        dir().join("bert"),
        dir().join("beir"),
        dir().join("beir/run.trec"),
    );
    for (mode, flag) in [
        ("retrieved", None),
        ("always", Some("--always-rerank-positives")),
    ] {
        let summary = tmp.path().join(format!("{mode}.json"));
        let reranked = tmp.path().join(format!("{mode}.trec"));
        let mut args = vec![
            "rerank",
            "--model",
            model.to_str().unwrap(),
            "--beir",
            beir.to_str().unwrap(),
            "--run-file",
            run_file.to_str().unwrap(),
            "--batch-size",
            "7",
            "--output",
            summary.to_str().unwrap(),
            "--output-run",
            reranked.to_str().unwrap(),
        ];
        args.extend(flag);
        let (ok, stderr, _) = run(&args);
        assert!(ok, "{stderr}");
        assert!(
            stderr.contains("1 documents of") && stderr.contains("nowhere (query q8001004)"),
            "the missing document is counted and named: {stderr}"
        );
        let got: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&summary).unwrap()).unwrap();
        let w = &want[mode];
        for (ours, theirs) in [
            (&got["reranked"]["map"], &w["map"]),
            (&got["reranked"]["mrr"], &w["mrr@10"]),
            (&got["reranked"]["ndcg"], &w["ndcg@10"]),
            (&got["base"]["map"], &w["base_map"]),
            (&got["base"]["mrr"], &w["base_mrr@10"]),
            (&got["base"]["ndcg"], &w["base_ndcg@10"]),
        ] {
            let (a, b) = (ours.as_f64().unwrap(), theirs.as_f64().unwrap());
            assert!((a - b).abs() <= 1e-6, "{mode}: {a} against {b}");
        }
        assert_eq!(got["missing_documents"], 1);
        // The reranked run: every query's documents, by the cross-encoder's score.
        let text = fs::read_to_string(&reranked).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines.len(),
            if mode == "always" { 12 * 8 + 3 } else { 12 * 8 }
        );
        let scores: Vec<f32> = lines[..8]
            .iter()
            .map(|l| l.split(' ').nth(4).unwrap().parse().unwrap())
            .collect();
        assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    }
    // Reranking changes the measures here: the base and reranked ones differ.
    assert_ne!(
        want["retrieved"]["ndcg@10"],
        want["retrieved"]["base_ndcg@10"]
    );
}

#[test]
fn score_writes_cross_encoder_predict_scores_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let meta = reference();
    let pairs: Vec<(String, String)> = serde_json::from_value(meta["pairs"].clone()).unwrap();
    let input = tmp.path().join("pairs.jsonl");
    let mut text = String::new();
    for (i, (q, d)) in pairs.iter().enumerate() {
        // Both spellings of the document's field.
        let key = if i % 2 == 0 { "document" } else { "passage" };
        text += &serde_json::json!({ "query": q, key: d }).to_string();
        text.push('\n');
    }
    fs::write(&input, text).unwrap();
    let output = tmp.path().join("scores.jsonl");
    let model = dir().join("bert");
    let (ok, stderr, _) = run(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--batch-size",
        "4",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("pairs longer than 32 tokens: truncated"),
        "{stderr}"
    );
    let want: Vec<f64> =
        serde_json::from_value(meta["families"]["bert"]["scores"].clone()).unwrap();
    let got: Vec<f64> = fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["score"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-5, "pair {i}: {g} against {w}");
    }
}

#[test]
fn rerank_and_score_refuse_bad_input_with_nothing_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.json");
    let plain = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let beir = dir().join("beir");
    let run_file = dir().join("beir/run.trec");
    // A model without a classification head.
    let (ok, stderr, _) = run(&[
        "rerank",
        "--model",
        plain.to_str().unwrap(),
        "--beir",
        beir.to_str().unwrap(),
        "--run-file",
        run_file.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("classification head"), "{stderr}");
    // A run file that is not one.
    let bad_run = tmp.path().join("bad.trec");
    fs::write(&bad_run, "q1 Q0 d1 1 0.5 x\nnot a run line\n").unwrap();
    let model = dir().join("bert");
    let (ok, stderr, _) = run(&[
        "rerank",
        "--model",
        model.to_str().unwrap(),
        "--beir",
        beir.to_str().unwrap(),
        "--run-file",
        bad_run.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("bad.trec:2"), "{stderr}");
    // A row without a document.
    let input = tmp.path().join("pairs.jsonl");
    fs::write(
        &input,
        "{\"query\": \"a\", \"document\": \"b\"}\n{\"query\": \"a\"}\n",
    )
    .unwrap();
    let (ok, stderr, _) = run(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        !ok && stderr.contains("pairs.jsonl") && stderr.contains("`document`"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing written on a refusal");
}

#[test]
fn mine_rescore_with_writes_the_cross_encoder_scores() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mined.jsonl");
    let bi = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let ce = dir().join("bert");
    let beir = dir().join("beir");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        bi.to_str().unwrap(),
        "--beir",
        beir.to_str().unwrap(),
        "--split",
        "test",
        "--num-negatives",
        "2",
        "--rescore-with",
        ce.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let model =
        CrossEncoderModel::load(ce.to_str().unwrap(), None, &candle_core::Device::Cpu).unwrap();
    let rows: Vec<serde_json::Value> = fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 12);
    for row in &rows {
        let q = row["query"].as_str().unwrap();
        let docs: Vec<&str> = std::iter::once(row["positive"].as_str().unwrap())
            .chain(
                row["negatives"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap()),
            )
            .collect();
        let pairs: Vec<(&str, &str)> = docs.iter().map(|&d| (q, d)).collect();
        let want = model.predict(&pairs, 3).unwrap();
        let got: Vec<f32> = serde_json::from_value(row["scores"].clone()).unwrap();
        assert_eq!(got.len(), 3);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "{g} against {w}");
        }
    }
    // A rescoring model without a head is refused before anything is mined or written.
    let out2 = tmp.path().join("mined2.jsonl");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        bi.to_str().unwrap(),
        "--beir",
        beir.to_str().unwrap(),
        "--split",
        "test",
        "--rescore-with",
        bi.to_str().unwrap(),
        "--output",
        out2.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("classification head"), "{stderr}");
    assert!(!out2.exists());
}
