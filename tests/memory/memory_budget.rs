//! `train.memory_budget`: the trainer probes the encoder, picks chunk sizes and a
//! recompute policy, and the steps it then runs stay within the budget; the prediction is
//! held to 15% of the measured peak (counting allocator) at three budgets; a budget nothing
//! fits is refused before any step and before any file is written.

use std::path::Path;

use gradcache::memory;
use gradcache::train::{Config, Trainer};
use gradcache::Error;

use crate::alone;

/// The quickstart model and data at a test's size.
fn config(dir: &Path, budget: &str) -> Config {
    try_config(dir, budget).unwrap()
}

fn try_config(dir: &Path, budget: &str) -> gradcache::Result<Config> {
    let sets = [
        format!("output_dir={}", dir.display()),
        "train.steps=3".into(),
        "train.batch_size=48".into(),
        "train.eval_every=0".into(),
        "model.query_max_len=32".into(),
        "model.passage_max_len=32".into(),
        format!("train.memory_budget=\"{budget}\""),
    ];
    Config::load(Path::new("configs/quickstart.toml"), &sets)
}

/// The largest heap in use during any of `steps` steps: the bytes allocated when the step
/// began plus the step's peak above them (the report's `heap_peak_bytes`, checked here).
fn measured_peak(trainer: &mut Trainer, steps: usize) -> u64 {
    (0..steps)
        .map(|_| {
            let before = memory::current_bytes() as u64;
            let report = trainer.train_step().unwrap();
            // The report reads the heap after drawing the batch (its texts, a few KiB).
            let heap = report.heap_peak_bytes as u64;
            let ours = before + report.peak_bytes as u64;
            assert!(
                heap.abs_diff(ours) < 1 << 20,
                "heap peak {heap}, {ours} from here"
            );
            heap
        })
        .max()
        .unwrap()
}

#[test]
fn steps_fit_the_budget_and_the_prediction_is_within_15_percent() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    // A budget larger than any setting needs: the whole batch in one chunk, no recompute.
    let roomy = Trainer::new(config(&dir.path().join("roomy"), "8GiB"), None).unwrap();
    let full = roomy.predicted_peak().unwrap();
    assert_eq!(roomy.config().train.query_chunk, 48);
    assert_eq!(roomy.config().model.recompute, gradcache::Recompute::Off);
    let base = memory::current_bytes() as u64;
    drop(roomy);
    // Three budgets between what the weights need and the whole batch. The optimizer
    // step (gradients and AdamW's moments) sets a floor at about 40% of the way from the
    // weights to the whole batch in one chunk, so the smallest sits above it.
    let mut chunks = vec![];
    for (i, fraction) in [1.0, 0.7, 0.5].into_iter().enumerate() {
        let budget = base + ((full - base) as f64 * fraction) as u64;
        let cfg = config(&dir.path().join(format!("run{i}")), &format!("{budget}B"));
        let mut trainer = Trainer::new(cfg, None).unwrap();
        let predicted = trainer.predicted_peak().unwrap();
        assert!(
            predicted <= budget,
            "budget {budget}: predicted {predicted}"
        );
        assert!(
            trainer
                .setup_notes()
                .iter()
                .any(|n| n.starts_with("memory budget")),
            "the plan is logged: {:?}",
            trainer.setup_notes()
        );
        let t = &trainer.config().train;
        chunks.push((
            t.query_chunk,
            format!("{:?}", trainer.config().model.recompute),
        ));
        let measured = measured_peak(&mut trainer, 3);
        let err = (predicted as f64 - measured as f64).abs() / measured as f64;
        println!(
            "budget {budget}: chunks {:?}, predicted {predicted}, measured {measured}, error {err:.3}",
            chunks.last().unwrap()
        );
        assert!(err <= 0.15, "budget {budget}: prediction off by {err:.3}");
        assert!(
            measured as f64 <= budget as f64 * 1.15,
            "budget {budget}: a step used {measured}"
        );
    }
    // Smaller budgets get smaller chunks (or a leaner policy).
    assert!(chunks[2] != chunks[0], "{chunks:?}");
}

#[test]
fn an_impossible_budget_is_refused_before_any_step_or_file() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let err = Trainer::new(config(&out, "4MiB"), None)
        .err()
        .expect("4 MiB cannot hold a step");
    assert!(matches!(err, Error::MemoryBudget { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("memory budget of 4.0 MiB is too small"),
        "{msg}"
    );
    assert!(!out.exists(), "nothing may be written: {}", out.display());
    let err = try_config(&out, "2 GiBs").expect_err("not a size");
    assert!(err.to_string().contains("train.memory_budget"), "{err}");
}

/// ModernBERT takes inputs up to `max_position_embeddings` (8,192 for the published
/// models) and has no position table to bound them: long inputs are fitted to the budget
/// like any other. The tiny ModernBERT fixture with its limit raised to 4,096 trains on
/// texts of 512 tokens (longer than any position table of the BERT family here); the plan the budget picks keeps every step within it.
#[test]
fn long_modernbert_inputs_fit_the_budget() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/modernbert");
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let path = entry.unwrap().path();
        let to = model.join(path.file_name().unwrap());
        if path.is_file() {
            std::fs::copy(&path, &to).unwrap();
        } else {
            // The pooling module's directory.
            std::fs::create_dir_all(&to).unwrap();
            for inner in std::fs::read_dir(&path).unwrap() {
                let inner = inner.unwrap().path();
                std::fs::copy(&inner, to.join(inner.file_name().unwrap())).unwrap();
            }
        }
    }
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 4096.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    // The tokenizer's limit too (the model's limit is the smaller of the two).
    let tok_path = model.join("tokenizer_config.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    tok["model_max_length"] = 4096.into();
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    // Long texts: quickstart lines run together.
    let lines: Vec<String> = std::fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["positive"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let long = |i: usize| lines[i * 40..(i + 1) * 40].join(" ");
    let data = dir.path().join("long.jsonl");
    let rows: Vec<String> = (0..12)
        .map(|i| serde_json::json!({"query": long(2 * i), "positive": long(2 * i + 1)}).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let run = |name: &str, budget: &str| {
        let sets = [
            format!("output_dir={}", dir.path().join(name).display()),
            format!("data.train_file=\"{}\"", data.display()),
            format!("data.eval_file=\"{}\"", data.display()),
            format!("model.pretrained=\"{}\"", model.display()),
            "train.steps=1".into(),
            "train.batch_size=8".into(),
            "train.eval_every=0".into(),
            "model.query_max_len=512".into(),
            "model.passage_max_len=512".into(),
            format!("train.memory_budget=\"{budget}\""),
        ];
        Trainer::new(
            Config::load(Path::new("configs/quickstart.toml"), &sets).unwrap(),
            None,
        )
        .unwrap()
    };
    let roomy = run("roomy", "8GiB");
    let full = roomy.predicted_peak().unwrap();
    assert_eq!(roomy.config().train.query_chunk, 8);
    let base = memory::current_bytes() as u64;
    drop(roomy);
    let budget = base + (full - base) / 2;
    let mut trainer = run("tight", &format!("{budget}B"));
    let t = &trainer.config().train;
    assert!(
        t.query_chunk < 8 || trainer.config().model.recompute != gradcache::Recompute::Off,
        "half the room needs smaller chunks or recompute"
    );
    let predicted = trainer.predicted_peak().unwrap();
    assert!(
        predicted <= budget,
        "budget {budget}: predicted {predicted}"
    );
    let measured = measured_peak(&mut trainer, 1);
    assert!(
        measured as f64 <= budget as f64 * 1.15,
        "budget {budget}: a step used {measured}"
    );
}

/// The chunk sizes a budget picks come from a measurement, not from the configuration: a
/// checkpoint of a budget run resumes and exports with the configuration as written (its
/// fingerprint is taken before the budget's choice).
#[test]
fn a_budget_run_resumes_and_exports_with_its_config_as_written() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir.path().join("run"), "8GiB");
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    assert_ne!(
        trainer.config().train.query_chunk,
        cfg.train.query_chunk,
        "the budget chose another chunk size than the config's"
    );
    trainer.train_step().unwrap();
    let ckpt = trainer.save_checkpoint().unwrap();
    drop(trainer);
    let resumed = Trainer::new(cfg.clone(), Some(&ckpt)).unwrap();
    assert_eq!(resumed.step(), 1);
    drop(resumed);
    let found = gradcache::train::export_run(
        &cfg,
        None,
        &dir.path().join("model"),
        gradcache::Side::Query,
    )
    .unwrap();
    assert_eq!(found.state.step, 1);
}
