//! Training a reranker with `[model.reranker]` on the tiny BERT cross-encoder of
//! `tests/fixtures/rerank/` and its BEIR folder: the run trains (the loss falls, every
//! parameter moves), resumes exactly (a run stopped at a checkpoint and resumed gives the
//! uninterrupted run's losses bit for bit), evaluates by reranking the fixture's first
//! stage, and writes a model that sentence-transformers' layout loads
//! ([`CrossEncoder`]); bad settings are refused by name before anything is written.

use std::fs;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use gradcache::rerank::CrossEncoder;
use gradcache::train::config::Config;
use gradcache::train::report::{Event, Observer};
use gradcache::train::rerank_task::RerankTrainer;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rerank")
}

/// Training rows from the fixture's BEIR folder: each query, its relevant verse, three
/// other verses, and teacher scores (the positive's highest).
fn write_pairs(path: &Path) {
    let beir = fixture().join("beir");
    let corpus: Vec<serde_json::Value> = fs::read_to_string(beir.join("corpus.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text = |d: &serde_json::Value| {
        format!(
            "{} {}",
            d["title"].as_str().unwrap(),
            d["text"].as_str().unwrap()
        )
    };
    let queries: Vec<serde_json::Value> = fs::read_to_string(beir.join("queries.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut out = String::new();
    for (i, q) in queries.iter().enumerate() {
        let others = corpus.len() - 12;
        let negatives: Vec<String> = (0..3)
            .map(|k| text(&corpus[12 + (i * 3 + k) % others]))
            .collect();
        let row = serde_json::json!({
            "query": q["text"],
            "positive": text(&corpus[i]),
            "negatives": negatives,
            "scores": [5.0, 1.0 + i as f64 * 0.1, 0.5, -1.0],
        });
        out += &row.to_string();
        out.push('\n');
    }
    fs::write(path, out).unwrap();
}

fn config(dir: &Path, extra: &str) -> Config {
    config_for(dir, &fixture().join("bert"), extra)
}

/// A reranker run of `model` on the fixture's BEIR folder (6 steps of 4 rows, one hard
/// negative each, chunks of 5 pairs, evaluated and checkpointed every 3 steps).
pub(crate) fn config_for(dir: &Path, model: &Path, extra: &str) -> Config {
    let pairs = dir.join("pairs.jsonl");
    write_pairs(&pairs);
    let text = format!(
        r#"
seed = 3
output_dir = "{out}"
[data]
train_file = "{pairs}"
eval_file = "{beir}"
eval_split = "test"
eval_run_file = "{run}"
eval_top_k = 8
[model]
pretrained = "{model}"
[model.reranker]
[train]
steps = 6
batch_size = 4
hard_negatives = 1
pair_chunk = 5
eval_every = 3
checkpoint_every = 3
[optim]
lr = 1e-3
{extra}
"#,
        out = dir.join("run").display(),
        pairs = pairs.display(),
        beir = fixture().join("beir").display(),
        run = fixture().join("beir/run.trec").display(),
        model = model.display(),
    );
    let path = dir.join("rerank.toml");
    fs::write(&path, text).unwrap();
    Config::load(&path, &[]).unwrap()
}

#[derive(Default)]
struct Losses(Vec<(u64, u32)>, usize);

impl Observer for Losses {
    fn event(&mut self, event: &Event) -> gradcache::Result<()> {
        match event {
            Event::Step(r) => self.0.push((r.step, r.loss.to_bits())),
            Event::Eval { .. } => self.1 += 1,
            _ => {}
        }
        Ok(())
    }
}

fn single() -> Rc<dyn gradcache::Collective> {
    Rc::new(gradcache::Single)
}

#[test]
fn a_reranker_trains_resumes_exactly_and_exports_a_cross_encoder() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        tmp.path(),
        "[loss.reranker]\nkind = \"multiple_negatives\"\nnum_negatives = 2",
    );
    let mut trainer = RerankTrainer::reranker(cfg.clone(), None, single()).unwrap();
    let before: Vec<(String, Vec<f32>)> = trainer
        .state()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect();
    let mut seen = Losses::default();
    let (first, last) = trainer.run(&mut seen).unwrap();
    assert_eq!(seen.0.len(), 6);
    assert!(
        seen.1 >= 3,
        "evaluations before, at 3 and at the end: {}",
        seen.1
    );
    assert!(first.is_some() && last.queries == 12, "{last:?}");
    // Every parameter moved (the head included).
    let after = trainer.state().unwrap();
    for (name, values) in &before {
        let now: Vec<f32> = after
            .get(name)
            .unwrap()
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_ne!(&now, values, "`{name}` did not train");
    }
    // The exported cross-encoder loads and scores.
    let model_dir = cfg.output_dir.join("model");
    let model =
        CrossEncoder::load(model_dir.to_str().unwrap(), None, &candle_core::Device::Cpu).unwrap();
    let s = model
        .predict(&[("light", "Let there be light")], 4)
        .unwrap();
    assert!(s[0] > 0.0 && s[0] < 1.0, "{s:?}");
    // The token types the model was trained with are the ones transformers will feed it
    // (the fixture's tokenizer feeds none).
    let tokenizer_config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(model_dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        tokenizer_config["model_input_names"],
        serde_json::json!(["input_ids", "attention_mask"])
    );
    // Resume from the step-3 checkpoint: the same losses, bit for bit.
    let tmp2 = tempfile::tempdir().unwrap();
    let mut cfg2 = cfg.clone();
    cfg2.output_dir = tmp2.path().join("run");
    let checkpoint = cfg.output_dir.join("checkpoints/step-00000003");
    assert!(checkpoint.is_dir());
    let copy = tmp2.path().join("step-3");
    crate::common::copy_dir(&checkpoint, &copy);
    let mut resumed = RerankTrainer::reranker(cfg2, Some(&copy), single()).unwrap();
    let mut again = Losses::default();
    resumed.run(&mut again).unwrap();
    assert_eq!(again.0, seen.0[3..].to_vec(), "resumed losses differ");
}

#[test]
fn every_reranker_loss_trains_a_step() {
    for loss in ["bce", "listnet", "lambda", "margin_mse", "kl"] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = config(
            tmp.path(),
            &format!("[loss.reranker]\nkind = \"{loss}\"\nnum_negatives = 0"),
        );
        cfg.train.steps = 2;
        cfg.train.eval_every = 0;
        cfg.train.checkpoint_every = 0;
        let mut trainer = RerankTrainer::reranker(cfg, None, single()).unwrap();
        let mut seen = Losses::default();
        trainer
            .run(&mut seen)
            .unwrap_or_else(|e| panic!("{loss}: {e}"));
        assert_eq!(seen.0.len(), 2, "{loss}");
        assert!(
            seen.0.iter().all(|(_, b)| f32::from_bits(*b).is_finite()),
            "{loss}"
        );
    }
}

#[test]
fn bad_reranker_settings_are_refused_by_name_with_nothing_written() {
    let cases = [
        (
            "[loss.reranker]\nnum_negatives = 99",
            "loss.reranker.num_negatives",
        ),
        (
            "[loss.reranker]\nkind = \"margin_mse\"\nnum_negatives = 2",
            "loss.reranker.num_negatives",
        ),
        (
            "[loss.reranker]\nactivation = \"softplus\"",
            "loss.reranker.activation",
        ),
    ];
    for (extra, field) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = config(tmp.path(), extra);
        let err = RerankTrainer::reranker(cfg.clone(), None, single())
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(field), "{extra}: {err}");
        assert!(!cfg.output_dir.exists(), "{extra}: nothing written");
    }
    // Settings outside [loss.reranker], each named.
    type Edit = fn(&mut Config);
    let edits: [(Edit, &str); 6] = [
        (
            |c| {
                c.loss.reranker.as_mut().unwrap().kind =
                    gradcache::train::config::RerankLossKind::Listnet;
                c.train.hard_negatives = 0;
            },
            // The data's check (a loss over a query's documents needs them).
            "data.sources.hard_negatives",
        ),
        (|c| c.train.pair_chunk = Some(0), "train.pair_chunk"),
        (|c| c.model.shared = false, "model.reranker"),
        (|c| c.data.eval_run_file = None, "data.eval_run_file"),
        (
            |c| c.train.memory_budget = Some("1GiB".into()),
            "train.memory_budget",
        ),
        (
            |c| {
                let r = c.loss.reranker.as_mut().unwrap();
                r.kind = gradcache::train::config::RerankLossKind::Bce;
                r.num_negatives = 2;
            },
            "loss.reranker.num_negatives",
        ),
    ];
    for (edit, field) in edits {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = config(tmp.path(), "[loss.reranker]\nnum_negatives = 0");
        edit(&mut cfg);
        let err = RerankTrainer::reranker(cfg.clone(), None, single())
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
        assert!(!cfg.output_dir.exists(), "{field}: nothing written");
    }
    // A plain encoder without a head, and without new_head.
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), "");
    cfg.model.pretrained = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families/bert")
        .display()
        .to_string();
    let err = RerankTrainer::reranker(cfg.clone(), None, single())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("new_head"), "{err}");
    assert!(!cfg.output_dir.exists());
    // With new_head the plain encoder trains with a fresh head.
    cfg.model.reranker = Some(gradcache::train::config::RerankerModel {
        new_head: true,
        ..Default::default()
    });
    cfg.train.steps = 1;
    cfg.train.eval_every = 0;
    cfg.train.checkpoint_every = 0;
    let mut trainer = RerankTrainer::reranker(cfg, None, single()).unwrap();
    trainer.run(&mut Losses::default()).unwrap();
}

/// The shipped `configs/reranker.toml` runs and learns, shortened (60 steps of 16 queries,
/// the first stage's top 5 reranked): nDCG@10 of the reranked dev run rises well above the
/// untrained model's.
#[test]
fn the_shipped_reranker_config_learns() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let set = [
        format!("output_dir={}", out.display()),
        "train.steps=60".to_string(),
        "train.batch_size=16".to_string(),
        "train.eval_every=0".to_string(),
        "train.checkpoint_every=0".to_string(),
        "data.eval_top_k=5".to_string(),
    ];
    // The config's data paths are relative to the repository root.
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(cwd, root, "cargo runs the tests from the package root");
    let cfg = Config::load(&root.join("configs/reranker.toml"), &set).unwrap();
    let mut trainer = RerankTrainer::reranker(cfg, None, single()).unwrap();
    let mut seen = Losses::default();
    let (before, after) = trainer.run(&mut seen).unwrap();
    let before = before.unwrap();
    assert_eq!(after.queries, 200);
    assert!(
        after.ndcg_at_10 > before.ndcg_at_10 + 0.05,
        "nDCG@10 {} -> {}",
        before.ndcg_at_10,
        after.ndcg_at_10
    );
    let first: f32 = seen.0[..5]
        .iter()
        .map(|(_, b)| f32::from_bits(*b))
        .sum::<f32>()
        / 5.0;
    let last: f32 = seen.0[55..]
        .iter()
        .map(|(_, b)| f32::from_bits(*b))
        .sum::<f32>()
        / 5.0;
    assert!(last < first, "loss {first} -> {last}");
}

/// DeBERTa-v3 as a reranker's encoder (the base of most strong cross-encoders): a run of
/// the fixture's `DebertaV2ForSequenceClassification` trains every parameter (its
/// ContextPooler head, the relative embeddings and their norm included) and exports the
/// family's head under transformers' names, which loads back and scores the trained
/// model's pairs differently from the untrained one's.
#[test]
fn a_deberta_reranker_trains_every_parameter_and_exports_its_head() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config_for(
        tmp.path(),
        &fixture().join("deberta-v2"),
        "[loss.reranker]\nkind = \"multiple_negatives\"\nnum_negatives = 2",
    );
    let mut trainer = RerankTrainer::reranker(cfg.clone(), None, single()).unwrap();
    let snapshot = |t: &RerankTrainer| -> Vec<(String, Vec<f32>)> {
        t.state()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                let values = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                (n.to_string(), values)
            })
            .collect()
    };
    let before = snapshot(&trainer);
    for name in [
        "encoder.rel_embeddings.weight",
        "encoder.LayerNorm.weight",
        "pooler.dense.weight",
        "classifier.weight",
    ] {
        assert!(before.iter().any(|(n, _)| n == name), "no `{name}`");
    }
    trainer.run(&mut Losses::default()).unwrap();
    let after = snapshot(&trainer);
    for ((name, was), (_, now)) in before.iter().zip(&after) {
        assert_ne!(was, now, "`{name}` did not train");
    }
    let model_dir = cfg.output_dir.join("model");
    let exported: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(model_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        exported["architectures"],
        serde_json::json!(["DebertaV2ForSequenceClassification"])
    );
    assert_eq!(exported["model_type"], "deberta-v2");
    let pairs = [
        ("light", "Let there be light"),
        ("void", "the earth was void"),
    ];
    let device = candle_core::Device::Cpu;
    let trained = CrossEncoder::load(model_dir.to_str().unwrap(), None, &device).unwrap();
    let untrained = fixture().join("deberta-v2");
    let untrained = CrossEncoder::load(untrained.to_str().unwrap(), None, &device).unwrap();
    let (a, b) = (
        trained.logits(&pairs, 2).unwrap(),
        untrained.logits(&pairs, 2).unwrap(),
    );
    assert!(a.iter().flatten().all(|v| v.is_finite()), "{a:?}");
    assert_ne!(a, b, "the export scores as the untrained model");
}
