//! Training a multi-vector (ColBERT) model with `[model.multi_vector]`: a fresh model and
//! the PyLate fixture learn, the evaluation scores by MaxSim, a run resumes bit for bit,
//! the export loads (in our loader, as PyLate's layout) to the trained encoder's token
//! vectors, a ColBERT distils a teacher's scores given in the data, and the settings and
//! data that do not fit a multi-vector model are refused by name before anything is
//! written.

use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Device;
use gradcache::hub::MultiVectorModel;
use gradcache::train::config::Config;
use gradcache::train::trainer::{export_run_as, Quiet, Trainer};
use gradcache::train::ExportLayout;
use gradcache::Side;

use crate::common;
use crate::common::{max_diff, quickstart_sample};

/// A tiny fresh ColBERT run over the first 64 quickstart pairs (12 held out).
fn tiny_colbert(dir: &Path, extra: &str) -> PathBuf {
    quickstart_sample(dir, 0..64, 200..212);
    let config = format!(
        r#"
seed = 3
output_dir = "{out}"
[data]
train_file = "{dir}/train.jsonl"
eval_file = "{dir}/eval.jsonl"
[model]
recompute = "every_layer"
[model.multi_vector]
dim = 8
query_length = 12
document_length = 20
[model.fresh]
vocab_size = 300
hidden_size = 16
num_layers = 2
num_heads = 2
intermediate_size = 32
[loss]
temperature = 1.0
[train]
steps = 6
batch_size = 8
query_chunk = 3
passage_chunk = 5
checkpoint_every = 3
eval_every = 6
[optim]
lr = 3e-3
warmup_steps = 1
{extra}
"#,
        out = dir.join("run").display(),
        dir = dir.display()
    );
    let path = dir.join("colbert.toml");
    fs::write(&path, config).unwrap();
    path
}

#[test]
fn a_fresh_colbert_learns_resumes_exactly_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_colbert(dir.path(), "");
    let cfg = Config::load(&path, &[]).unwrap();
    let mut uninterrupted = cfg.clone();
    uninterrupted.output_dir = dir.path().join("whole");
    let mut full = Trainer::new(uninterrupted, None).unwrap();
    let losses: Vec<f32> = (0..6).map(|_| full.train_step().unwrap().loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");

    // Interrupted after 3 steps and resumed: the same losses, bit for bit.
    let mut first = Trainer::new(cfg.clone(), None).unwrap();
    let head: Vec<f32> = (0..3).map(|_| first.train_step().unwrap().loss).collect();
    let ckpt = first.save_checkpoint().unwrap();
    drop(first);
    assert_eq!(head, losses[..3]);
    let mut resumed = Trainer::new(cfg.clone(), Some(&ckpt)).unwrap();
    let tail: Vec<f32> = (0..3).map(|_| resumed.train_step().unwrap().loss).collect();
    assert_eq!(tail, losses[3..], "losses after the resume");

    // A full run learns: the held-out MaxSim retrieval improves.
    let mut run_cfg = cfg.clone();
    run_cfg.output_dir = dir.path().join("learns");
    run_cfg.train.steps = 30;
    run_cfg.train.eval_every = 30;
    run_cfg.train.checkpoint_every = 30;
    let mut trainer = Trainer::new(run_cfg.clone(), None).unwrap();
    let (before, after) = trainer.run(&mut Quiet).unwrap();
    let before = before.unwrap();
    assert!(
        after.mrr_at_10 > before.mrr_at_10,
        "MRR@10 {} -> {}",
        before.mrr_at_10,
        after.mrr_at_10
    );

    // The export is a PyLate directory our loader reads back to the same token vectors
    // the trained encoder writes.
    let out = dir.path().join("model");
    export_run_as(&run_cfg, None, &out, Side::Query, ExportLayout::Merged).unwrap();
    let st: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(out.join("config_sentence_transformers.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(st["model_type"], "ColBERT");
    assert_eq!(st["query_length"], 12);
    let model = MultiVectorModel::load(out.to_str().unwrap(), &Device::Cpu).unwrap();
    let texts = [
        "in the beginning god created the heaven",
        "and god said, let there be light.",
    ];
    let exported = model.document_vectors(&texts, 2).unwrap();
    let (_, documents) = model.tokenizers();
    let batch = documents.encode(&texts, &Device::Cpu).unwrap();
    let trained = gradcache::Encoder::encode(
        trainer.gradient_cache().passage_encoder(),
        &batch,
        &gradcache::Ctx::eval(),
    )
    .unwrap()
    .reshape((2, 20, 8))
    .unwrap();
    let keep = batch
        .vectors
        .as_ref()
        .unwrap()
        .keep
        .to_vec2::<u32>()
        .unwrap();
    for (i, e) in exported.iter().enumerate() {
        let kept: Vec<u32> = (0..keep[i].len() as u32)
            .filter(|&t| keep[i][t as usize] == 1)
            .collect();
        let idx = candle_core::Tensor::new(kept.as_slice(), &Device::Cpu).unwrap();
        let want = trained.get(i).unwrap().index_select(&idx, 0).unwrap();
        assert_eq!(e.dims(), want.dims());
        assert!(max_diff(e, &want) <= 1e-5, "text {i}");
    }
    // The punctuation of the second text is skiplisted.
    assert!(
        keep[1].iter().sum::<u32>()
            < batch
                .attention_mask
                .get(1)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<u32>()
                .unwrap()
    );
}

#[test]
fn single_vector_settings_are_refused_on_a_multi_vector_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_colbert(dir.path(), "");
    for (set, field) in [
        ("model.pooling=\"mean\"", "model.pooling"),
        ("model.query_max_len=16", "model.query_max_len"),
        ("model.query_prompt=\"query: \"", "model.query_prompt"),
        ("loss.symmetric=true", "loss.symmetric"),
        ("loss.similarity=\"dot\"", "loss.similarity"),
        ("loss.matryoshka_dims=[4]", "loss.matryoshka_dims"),
        ("model.multi_vector.dim=0", "model.multi_vector.dim"),
        ("train.memory_budget=\"1GiB\"", "train.memory_budget"),
        ("model.lora.rank=4", "model.lora"),
    ] {
        let err = Config::load(&path, &[set.to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    // A query length without room for [CLS], the prefix, [SEP] and a token: refused
    // before the run directory exists.
    let cfg = Config::load(&path, &["model.multi_vector.query_length=3".into()]).unwrap();
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("query_length"), "{err}");
    assert!(!dir.path().join("run").exists());
    // A pretrained ColBERT: a width its projection does not give, a length beyond the
    // model's limit (the fixture takes 32 tokens).
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/colbert/pylate");
    for (set, field) in [
        ("model.multi_vector.dim=16", "model.multi_vector.dim"),
        (
            "model.multi_vector.document_length=64",
            "model.multi_vector.document_length",
        ),
    ] {
        let sets = [
            format!("model.pretrained=\"{}\"", fixture.display()),
            set.to_string(),
        ];
        let cfg = Config::load(&path, &sets).unwrap();
        let err = Trainer::new(cfg, None).err().unwrap().to_string();
        assert!(err.contains(field), "{set}: {err}");
        assert!(!dir.path().join("run").exists());
    }
}

/// The tiny ColBERT run learning a made-up teacher's scores ([`teacher_data`], two
/// negatives).
fn tiny_distillation(dir: &Path) -> PathBuf {
    let path = tiny_colbert(dir, "");
    let config = fs::read_to_string(&path).unwrap();
    let config = config.replace("[loss]\ntemperature = 1.0", "[loss.distillation]");
    fs::write(&path, config).unwrap();
    teacher_data(&dir.join("train.jsonl"), 2);
    path
}

/// Rewrites the pairs of `train` with `k` negatives each (the next pairs' positives) and
/// a made-up teacher's scores: 8 for the positive, 2, 1, 0, ... for the negatives.
fn teacher_data(train: &Path, k: usize) {
    let pairs: Vec<serde_json::Value> = fs::read_to_string(train)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let n = pairs.len();
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let positive = |j: usize| pairs[j % n]["positive"].clone();
            let scores: Vec<f64> = std::iter::once(8.0)
                .chain((0..k).map(|j| 2.0 - j as f64))
                .collect();
            serde_json::json!({
                "query": pairs[i]["query"],
                "positive": positive(i),
                "negatives": (1..=k).map(|j| positive(i + j)).collect::<Vec<_>>(),
                "scores": scores,
            })
            .to_string()
        })
        .collect();
    fs::write(train, lines.join("\n")).unwrap();
}

#[test]
fn a_colbert_distils_teacher_scores_resumes_exactly_and_learns() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_distillation(dir.path());
    let cfg = Config::load(&path, &["train.hard_negatives=2".into()]).unwrap();
    assert!(cfg.loss.distillation.as_ref().unwrap().normalize_scores);
    let mut uninterrupted = cfg.clone();
    uninterrupted.output_dir = dir.path().join("whole");
    let mut full = Trainer::new(uninterrupted, None).unwrap();
    let losses: Vec<f32> = (0..6).map(|_| full.train_step().unwrap().loss).collect();
    // A KL divergence: finite and not negative.
    assert!(
        losses.iter().all(|l| l.is_finite() && *l >= 0.0),
        "{losses:?}"
    );
    let mut first = Trainer::new(cfg.clone(), None).unwrap();
    let head: Vec<f32> = (0..3).map(|_| first.train_step().unwrap().loss).collect();
    let ckpt = first.save_checkpoint().unwrap();
    drop(first);
    assert_eq!(head, losses[..3]);
    let mut resumed = Trainer::new(cfg.clone(), Some(&ckpt)).unwrap();
    let tail: Vec<f32> = (0..3).map(|_| resumed.train_step().unwrap().loss).collect();
    assert_eq!(tail, losses[3..], "losses after the resume");

    // Learning the teacher's preference for each positive improves held-out retrieval.
    let mut run_cfg = cfg;
    run_cfg.output_dir = dir.path().join("learns");
    run_cfg.train.steps = 30;
    run_cfg.train.eval_every = 30;
    run_cfg.train.checkpoint_every = 30;
    let mut trainer = Trainer::new(run_cfg, None).unwrap();
    let (before, after) = trainer.run(&mut Quiet).unwrap();
    let before = before.unwrap();
    assert!(
        after.mrr_at_10 > before.mrr_at_10,
        "MRR@10 {} -> {}",
        before.mrr_at_10,
        after.mrr_at_10
    );
}

#[test]
fn distillation_settings_and_data_that_do_not_fit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_distillation(dir.path());
    let k2 = "train.hard_negatives=2".to_string();
    // Settings: no hard negatives, a temperature (the loss has none).
    for (sets, field) in [
        (vec![], "train.hard_negatives"),
        (
            vec![k2.clone(), "loss.temperature=0.5".into()],
            "loss.temperature",
        ),
    ] {
        let err = Config::load(&path, &sets).unwrap_err().to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
    // A single-vector setting of distillation (margin MSE, InfoNCE beside) on a
    // multi-vector model, whose distillation is PyLate's.
    for set in [
        "loss.distillation.kind=margin_mse",
        "loss.distillation.infonce_weight=0.5",
    ] {
        let err = Config::load(&path, &[k2.clone(), set.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("multi-vector"), "{set}: {err}");
    }
    // Data: more hard negatives than a pair has (none can be filled), a pair without
    // scores, a score list of another length, scores that are not numbers; each names
    // its line, before the run directory exists.
    let train = dir.path().join("train.jsonl");
    let good = fs::read_to_string(&train).unwrap();
    let cfg = Config::load(&path, std::slice::from_ref(&k2)).unwrap();
    let mut three = cfg.clone();
    three.train.hard_negatives = 3;
    let err = Trainer::new(three, None).err().unwrap().to_string();
    assert!(err.contains("cannot fill"), "{err}");
    let scores = r#","scores":[8.0,2.0,1.0]"#;
    for (broken, want) in [
        ("", "0 teacher scores"),
        (r#","scores":[8.0,2.0]"#, "2 teacher scores"),
        (r#","scores":["high",2.0,1.0]"#, "list of numbers"),
    ] {
        let mut lines: Vec<String> = good.lines().map(String::from).collect();
        assert!(lines[4].contains(scores));
        lines[4] = lines[4].replace(scores, broken);
        fs::write(&train, lines.join("\n")).unwrap();
        let err = Trainer::new(cfg.clone(), None).err().unwrap().to_string();
        assert!(err.contains(want) && err.contains('5'), "{want}: {err}");
        assert!(!dir.path().join("run").exists());
    }
}

#[test]
fn a_pretrained_colbert_trains_from_its_own_settings_and_needs_the_section() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/colbert/pylate");
    let pretrained = format!("model.pretrained=\"{}\"", fixture.display());
    let path = tiny_colbert(dir.path(), "");
    // The fixture's own settings: 8-d, queries of 12, documents of 20, [Q] / [D].
    let plain = Config::load(
        &path,
        &[
            pretrained.clone(),
            "model.multi_vector={}".into(),
            "train.steps=2".into(),
        ],
    )
    .unwrap();
    let mut trainer = Trainer::new(plain, None).unwrap();
    let loss = trainer.train_step().unwrap().loss;
    assert!(loss.is_finite());
    // A multi-vector model trained as a single-vector one: refused, naming the section.
    let mut cfg = Config::load(&path, &[pretrained]).unwrap();
    cfg.model.multi_vector = None;
    cfg.output_dir = dir.path().join("single");
    let err = Trainer::new(cfg, None).err().unwrap().to_string();
    assert!(err.contains("[model.multi_vector]"), "{err}");
    assert!(!dir.path().join("single").exists());
}

#[test]
fn the_shipped_colbert_config_learns() {
    // configs/colbert.toml as shipped (its model, prefixes, lengths, temperature,
    // optimizer), on 400 quickstart pairs for 20 steps, evaluated on 100 held-out pairs.
    let dir = tempfile::tempdir().unwrap();
    quickstart_sample(dir.path(), 0..400, 1000..1100);
    let mut sets = shipped_run(dir.path());
    sets.push("train.batch_size=64".into());
    let cfg = Config::load(Path::new("configs/colbert.toml"), &sets).unwrap();
    common::assert_learns(Trainer::new(cfg, None).unwrap());
}

#[test]
fn the_shipped_distillation_config_learns() {
    // configs/colbert-distill.toml as shipped (its model, 7 passages a query with their
    // teacher scores, batch, optimizer), on 400 quickstart pairs given a made-up teacher's
    // scores, for 20 steps, evaluated on 100 held-out pairs.
    let dir = tempfile::tempdir().unwrap();
    quickstart_sample(dir.path(), 0..400, 1000..1100);
    teacher_data(&dir.path().join("train.jsonl"), 7);
    let sets = shipped_run(dir.path());
    let cfg = Config::load(Path::new("configs/colbert-distill.toml"), &sets).unwrap();
    assert_eq!(cfg.train.hard_negatives, 7);
    common::assert_learns(Trainer::new(cfg, None).unwrap());
}

#[test]
fn the_shipped_colbert_config_fine_tunes_a_pretrained_colbert_as_it_is() {
    // configs/colbert.toml sets nothing a pretrained ColBERT brings, so `--set
    // model.pretrained=...` alone fine-tunes one of another width and lengths: the
    // fixture (8-d vectors, queries of 12 tokens, documents of 20, a 32-token model) keeps
    // its own, where the shipped 128-d projection and 64-token documents were refused.
    let dir = tempfile::tempdir().unwrap();
    quickstart_sample(dir.path(), 0..32, 1000..1008);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/colbert/pylate");
    let mut sets = shipped_run(dir.path());
    sets.extend([
        format!("model.pretrained=\"{}\"", fixture.display()),
        "train.steps=1".into(),
        "train.batch_size=8".into(),
        "train.query_chunk=4".into(),
        "train.passage_chunk=4".into(),
        "train.eval_every=0".into(),
        "train.checkpoint_every=0".into(),
    ]);
    let cfg = Config::load(Path::new("configs/colbert.toml"), &sets).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    assert!(trainer.train_step().unwrap().loss.is_finite());
    let out = dir.path().join("export");
    trainer.export(&out, Side::Query).unwrap();
    let read = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let st = read(out.join("config_sentence_transformers.json"));
    assert_eq!(
        (st["query_length"].as_u64(), st["document_length"].as_u64()),
        (Some(12), Some(20))
    );
    assert_eq!(read(out.join("1_Dense/config.json"))["out_features"], 8);
}

/// A shipped config's run shortened to 20 steps over `dir`'s train.jsonl and eval.jsonl,
/// evaluated before and after.
fn shipped_run(dir: &Path) -> Vec<String> {
    vec![
        format!("output_dir=\"{}\"", dir.join("run").display()),
        format!("data.train_file=\"{}\"", dir.join("train.jsonl").display()),
        format!("data.eval_file=\"{}\"", dir.join("eval.jsonl").display()),
        "train.steps=20".into(),
        "train.eval_every=20".into(),
        "train.checkpoint_every=20".into(),
    ]
}

#[test]
fn a_single_vector_model_becomes_a_colbert_with_a_new_projection() {
    // The BERT family fixture (a sentence-transformers model with mean pooling, no
    // [Q] / [D] tokens): its pooling is not read, a projection to 8 values is added from
    // the seed, the prefixes are left out; it trains and its export is a ColBERT.
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_colbert(dir.path(), "");
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let sets: Vec<String> = vec![
        format!("model.pretrained=\"{}\"", bert.display()),
        "model.multi_vector.query_prefix=\"\"".into(),
        "model.multi_vector.document_prefix=\"\"".into(),
        "train.steps=2".into(),
        "train.checkpoint_every=2".into(),
    ];
    let cfg = Config::load(&path, &sets).unwrap();
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    assert!(trainer.params().get("1_Dense.linear.weight").is_some());
    for _ in 0..2 {
        assert!(trainer.train_step().unwrap().loss.is_finite());
    }
    trainer.save_checkpoint().unwrap();
    let out = dir.path().join("model");
    export_run_as(&cfg, None, &out, Side::Query, ExportLayout::Merged).unwrap();
    let model = MultiVectorModel::load(out.to_str().unwrap(), &Device::Cpu).unwrap();
    let q = model.query_vectors(&["who is he"], 1).unwrap();
    assert_eq!(q[0].dims(), &[12, 8], "queries expanded to 12 vectors of 8");
    // The same model without the section: a plain single-vector run.
    let mut plain = Config::load(&path, &sets).unwrap();
    plain.model.multi_vector = None;
    plain.output_dir = dir.path().join("plain");
    assert!(Trainer::new(plain, None).is_ok());
}

#[test]
fn mining_and_evaluation_run_on_a_colbert() {
    // `gradcache mine` and `gradcache eval --data` score by MaxSim with the PyLate fixture.
    let dir = tempfile::tempdir().unwrap();
    quickstart_sample(dir.path(), 0..40, 40..41);
    let data = dir.path().join("train.jsonl");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/colbert/st6");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!stderr.contains("panicked"), "{stderr}");
        (
            out.status.success(),
            stderr,
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let mined = dir.path().join("mined.jsonl");
    let (ok, stderr, _) = run(&[
        "mine",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--num-negatives",
        "2",
        "--output-scores",
        "--output",
        mined.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let rows = fs::read_to_string(&mined).unwrap();
    let first: serde_json::Value = serde_json::from_str(rows.lines().next().unwrap()).unwrap();
    assert_eq!(first["negatives"].as_array().unwrap().len(), 2);
    // `--output-scores`: the teacher's MaxSim scores of the positive and each negative.
    let teacher = MultiVectorModel::load(model.to_str().unwrap(), &Device::Cpu).unwrap();
    let text = |v: &serde_json::Value| v.as_str().unwrap().to_string();
    let q = teacher
        .query_vectors(&[first["query"].as_str().unwrap()], 1)
        .unwrap();
    let passages: Vec<String> = std::iter::once(text(&first["positive"]))
        .chain(first["negatives"].as_array().unwrap().iter().map(text))
        .collect();
    let refs: Vec<&str> = passages.iter().map(String::as_str).collect();
    let docs = teacher.document_vectors(&refs, 3).unwrap();
    let scores = first["scores"].as_array().unwrap();
    assert_eq!(scores.len(), 3);
    for (d, got) in docs.iter().zip(scores) {
        let want = q[0]
            .matmul(&d.t().unwrap())
            .unwrap()
            .max(1)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let got = got.as_f64().unwrap();
        assert!((got - want).abs() <= 1e-4 * want.abs(), "{got} vs {want}");
    }
    // The mined rows are data a ColBERT distils.
    let sub = dir.path().join("distil");
    fs::create_dir_all(&sub).unwrap();
    let path = tiny_distillation(&sub);
    let sets = [
        format!("data.train_file=\"{}\"", mined.display()),
        "train.hard_negatives=2".into(),
        "train.batch_size=4".into(),
    ];
    let mut trainer = Trainer::new(Config::load(&path, &sets).unwrap(), None).unwrap();
    assert!(trainer.train_step().unwrap().loss.is_finite());
    let (ok, stderr, stdout) = run(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let m: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(m["recall_at_1"].as_f64().unwrap() > 0.0, "{m}");
    // A single-vector flag on a multi-vector model is refused by name.
    let (ok, stderr, _) = run(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--pooling",
        "mean",
    ]);
    assert!(
        !ok && stderr.contains("--pooling") && stderr.contains("multi-vector"),
        "{stderr}"
    );
    // `encode` too, and it writes nothing.
    let out = dir.path().join("vectors.jsonl");
    let (ok, stderr, _) = run(&[
        "encode",
        "--model",
        model.to_str().unwrap(),
        "--text",
        "who is he",
        "--max-len",
        "8",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("--max-len"), "{stderr}");
    assert!(!out.exists());
}
