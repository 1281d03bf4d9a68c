//! Rerankers (cross-encoders) against sentence-transformers 6.3 on tiny fixtures saved by
//! its `CrossEncoder` (`tests/fixtures/rerank/`, written by
//! `scripts/make_rerank_fixtures.py`): every encoder family's classification head scores
//! the pairs within 1e-5 of `CrossEncoder.predict` (raw logits and the saved activation);
//! one cached step (chunks of 4, 1 and 3, the last with recompute) of
//! `CachedMultipleNegativesRankingLoss`, `BinaryCrossEntropyLoss`, `ListNetLoss`,
//! `LambdaLoss` and `MarginMSELoss` equals theirs: the loss within 1e-5, every parameter
//! gradient within 1e-4, both sides in float64 (a ranking gradient is a sum over a
//! query's documents of terms that nearly cancel, where float32's rounding shows at
//! 1e-4); the float32 step within 1e-3 of the same reference (floored at 1e-2 of the
//! largest gradient). The losses' hand-written
//! gradients against finite differences, and the refusals.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions, ClassifierSpec};
use gradcache::hub::ModelFiles;
use gradcache::rerank::loss::{RerankLoss, RerankObjective};
use gradcache::rerank::{CrossEncoder, RerankCache, ScoreActivation};
use gradcache::{ParamStore, Recompute};

use crate::common::families::assert_step_matches;
use crate::common::{max_abs, max_diff};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rerank")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn pairs(meta: &serde_json::Value) -> Vec<(String, String)> {
    serde_json::from_value::<Vec<(String, String)>>(meta["pairs"].clone()).unwrap()
}

#[test]
fn every_family_scores_pairs_as_sentence_transformers_cross_encoder() {
    let meta = reference();
    let pairs = pairs(&meta);
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(q, d)| (q.as_str(), d.as_str()))
        .collect();
    let families = meta["families"].as_object().unwrap();
    assert_eq!(families.len(), 7);
    for (family, want) in families {
        let model = CrossEncoder::load(dir().join(family).to_str().unwrap(), None, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        assert_eq!(model.labels(), 1, "{family}");
        assert_eq!(model.activation(), ScoreActivation::Sigmoid, "{family}");
        let logits: Vec<f32> = model
            .logits(&refs, 5)
            .unwrap()
            .into_iter()
            .map(|r| r[0])
            .collect();
        let scores = model.predict(&refs, 3).unwrap();
        let want_logits: Vec<f32> = serde_json::from_value(want["logits"].clone()).unwrap();
        let want_scores: Vec<f32> = serde_json::from_value(want["scores"].clone()).unwrap();
        for (i, (got, want)) in logits.iter().zip(&want_logits).enumerate() {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{family} pair {i}: logit {got} against {want}"
            );
        }
        for (i, (got, want)) in scores.iter().zip(&want_scores).enumerate() {
            assert!(
                (got - want).abs() <= 1e-5,
                "{family} pair {i}: score {got} against {want}"
            );
        }
        // The logits are not all alike: the heads are exercised, not a constant.
        let spread = want_logits.iter().fold(f32::MIN, |a, &b| a.max(b))
            - want_logits.iter().fold(f32::MAX, |a, &b| a.min(b));
        assert!(spread > 1e-3, "{family}: logits spread {spread}");
    }
}

struct Case {
    queries: Vec<String>,
    groups: Vec<Vec<String>>,
    labels: Option<Vec<f32>>,
    loss: f64,
}

fn case(meta: &serde_json::Value, name: &str) -> Case {
    let c = &meta["losses"][name];
    let labels: Option<Vec<Vec<f32>>> = serde_json::from_value(c["labels"].clone()).ok();
    Case {
        queries: serde_json::from_value(c["queries"].clone()).unwrap(),
        groups: serde_json::from_value(c["groups"].clone()).unwrap(),
        labels: labels.map(|l| l.into_iter().flatten().collect()),
        loss: c["loss"].as_f64().unwrap(),
    }
}

/// One cached step of `loss` over the case's groups, query by query, on the BERT fixture.
fn cached_step(
    c: &Case,
    loss: RerankLoss,
    chunk: usize,
    recompute: Recompute,
    dtype: DType,
) -> (f32, gradcache::Gradients) {
    let files = ModelFiles::from_dir(&dir().join("bert")).unwrap();
    let options = BertOptions {
        recompute,
        classifier: Some(ClassifierSpec::labels(1)),
        ..Default::default()
    };
    let store = ParamStore::new(0, dtype, &Device::Cpu);
    let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let model =
        CrossEncoder::load(dir().join("bert").to_str().unwrap(), None, &Device::Cpu).unwrap();
    let group = c.groups[0].len();
    let queries: Vec<&str> = c
        .queries
        .iter()
        .flat_map(|q| std::iter::repeat_n(q.as_str(), group))
        .collect();
    let documents: Vec<&str> = c.groups.iter().flatten().map(String::as_str).collect();
    let batch = model.encode_pairs(&queries, &documents).unwrap();
    assert!(
        batch
            .token_type_ids
            .to_vec2::<u32>()
            .unwrap()
            .iter()
            .flatten()
            .all(|&t| t == 0),
        "the fixture's tokenizer (TokenizersBackend) feeds the model no token types"
    );
    let cache = RerankCache::new(encoder, chunk, loss, group)
        .unwrap()
        .with_dropout(false);
    let out = cache.step(0, &batch, c.labels.as_deref()).unwrap();
    (out.loss, out.grads)
}

#[test]
fn one_cached_step_equals_sentence_transformers_cross_encoder_losses() {
    let meta = reference();
    let tensors =
        candle_core::safetensors::load(dir().join("reference.safetensors"), &Device::Cpu).unwrap();
    let losses = [
        ("cmnrl", RerankObjective::MultipleNegatives { scale: 10.0 }),
        ("bce", RerankObjective::BinaryCrossEntropy),
        ("listnet", RerankObjective::ListNet),
        (
            "lambda",
            RerankObjective::Lambda {
                mu: 10.0,
                sigma: 1.0,
                k: None,
            },
        ),
        ("margin_mse", RerankObjective::MarginMse),
    ];
    for (name, objective) in losses {
        let c = case(&meta, name);
        // Their names carry the `bert.` prefix of BertForSequenceClassification.
        let want: HashMap<String, &Tensor> = tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&format!("{name}.grad.")).map(|n| (n, v)))
            .map(|(n, v)| (n.strip_prefix("bert.").unwrap_or(n).to_string(), v))
            .collect();
        assert_eq!(want.len(), 41, "{name}");
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::Off),
            (3, Recompute::EveryLayer),
        ] {
            let loss = RerankLoss::new(objective).unwrap();
            let (value, grads) = cached_step(&c, loss, chunk, recompute, DType::F64);
            let what = format!("{name} chunk {chunk}");
            let seen = assert_step_matches(&what, (value, &grads), c.loss, &want);
            assert_eq!(seen, want.len(), "{what}: every parameter has its gradient");
        }
        // The float32 path the trainer runs, against the same reference: the ranking
        // gradients cancel across a query's documents (the bias's, under ListNet and
        // LambdaLoss, to exactly 0), so float32 holds them to 1e-3 of their size, floored
        // at 1e-2 of the largest.
        let loss = RerankLoss::new(objective).unwrap();
        let (value, grads) = cached_step(&c, loss, 3, Recompute::Off, DType::F32);
        assert!(
            (f64::from(value) - c.loss).abs() <= 1e-5 * c.loss.abs().max(1.0),
            "{name}"
        );
        let global = want.values().map(|g| max_abs(g)).fold(0.0, f64::max);
        for (n, g) in grads.iter() {
            let err = max_diff(g, want[n]) / max_abs(want[n]).max(1e-2 * global);
            assert!(
                err <= 1e-3,
                "{name} float32: gradient of `{n}` off by {err:e}"
            );
        }
    }
}

/// The losses' hand-written gradients against central differences of their values, for
/// each activation.
#[test]
fn rerank_loss_gradients_match_finite_differences() {
    let group = 4;
    let scores: Vec<f64> = (0..12)
        .map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.37)
        .collect();
    let graded: Vec<f32> = (0..12).map(|i| (i * 5 % 4) as f32).collect();
    let probs: Vec<f32> = graded.iter().map(|g| g / 3.0).collect();
    let objectives = [
        (RerankObjective::MultipleNegatives { scale: 10.0 }, None),
        (RerankObjective::BinaryCrossEntropy, Some(&probs)),
        (RerankObjective::ListNet, Some(&graded)),
        (
            RerankObjective::Lambda {
                mu: 10.0,
                sigma: 1.0,
                k: Some(3),
            },
            Some(&graded),
        ),
        (RerankObjective::MarginMse, Some(&graded)),
        (
            RerankObjective::Kl {
                student_temperature: 2.0,
                teacher_temperature: 0.5,
            },
            Some(&graded),
        ),
    ];
    for (objective, labels) in objectives {
        for act in [
            ScoreActivation::Identity,
            ScoreActivation::Sigmoid,
            ScoreActivation::Tanh,
        ] {
            let loss = RerankLoss::with_activation(objective, act).unwrap();
            let labels = labels.map(|l| l.as_slice());
            let value = loss.value_and_grad(&scores, group, labels).unwrap();
            assert!(
                value.grad.iter().any(|g| g.abs() > 1e-4),
                "{objective:?} {act:?}"
            );
            let largest = value.grad.iter().fold(0f64, |m, g| m.max(g.abs()));
            for i in 0..scores.len() {
                let h = 1e-5;
                let at = |d: f64| {
                    let mut s = scores.clone();
                    s[i] += d;
                    loss.value_and_grad(&s, group, labels).unwrap().loss
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                let got = value.grad[i];
                assert!(
                    (got - numeric).abs() <= 1e-3 * largest,
                    "{objective:?} {act:?} score {i}: {got} against {numeric}"
                );
            }
        }
    }
}

#[test]
fn rerank_losses_refuse_bad_input_by_name() {
    let bce = RerankLoss::new(RerankObjective::BinaryCrossEntropy).unwrap();
    let err = bce
        .value_and_grad(&[0.1, 0.2], 1, Some(&[1.0, 2.0]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[0, 1]") && err.contains('2'), "{err}");
    let err = bce
        .value_and_grad(&[0.1, 0.2], 1, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("label"), "{err}");
    let mnrl = RerankLoss::new(RerankObjective::MultipleNegatives { scale: 10.0 }).unwrap();
    let err = mnrl
        .value_and_grad(&[0.1, 0.2, 0.3], 2, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 scores in groups of 2"), "{err}");
    let err = RerankLoss::new(RerankObjective::MultipleNegatives { scale: 0.0 })
        .unwrap_err()
        .to_string();
    assert!(err.contains("loss.scale"), "{err}");
}

#[test]
fn a_plain_encoder_is_refused_as_a_cross_encoder_by_name() {
    let plain = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/bert");
    let err = CrossEncoder::load(plain.to_str().unwrap(), None, &Device::Cpu)
        .err()
        .expect("a plain encoder has no classification head")
        .to_string();
    assert!(
        err.contains("classifier.weight") && err.contains("new_head"),
        "{err}"
    );
}

/// With dropout on, one chunk of every pair replays its masks bit for bit: the cached step
/// equals the plain full-batch step (whose masks are chunk 0's), loss and every gradient,
/// for a loss with labels and one without.
#[test]
fn cached_step_with_dropout_equals_the_full_batch_step() {
    let meta = reference();
    for (name, objective) in [
        ("cmnrl", RerankObjective::MultipleNegatives { scale: 10.0 }),
        ("margin_mse", RerankObjective::MarginMse),
    ] {
        let c = case(&meta, name);
        let files = ModelFiles::from_dir(&dir().join("bert")).unwrap();
        let options = BertOptions {
            classifier: Some(ClassifierSpec::labels(1)),
            ..Default::default()
        };
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
        let model =
            CrossEncoder::load(dir().join("bert").to_str().unwrap(), None, &Device::Cpu).unwrap();
        let group = c.groups[0].len();
        let queries: Vec<&str> = c
            .queries
            .iter()
            .flat_map(|q| std::iter::repeat_n(q.as_str(), group))
            .collect();
        let documents: Vec<&str> = c.groups.iter().flatten().map(String::as_str).collect();
        let batch = model.encode_pairs(&queries, &documents).unwrap();
        let loss = RerankLoss::new(objective).unwrap();
        let cache = RerankCache::new(encoder, documents.len(), loss, group)
            .unwrap()
            .with_seed(7);
        let cached = cache.step(3, &batch, c.labels.as_deref()).unwrap();
        let full = cache
            .full_batch_step(3, &batch, c.labels.as_deref())
            .unwrap();
        let rel = (cached.loss - full.loss).abs() / full.loss.abs().max(1.0);
        assert!(rel <= 1e-6, "{name}: {} {}", cached.loss, full.loss);
        assert_eq!(cached.grads.len(), cache.params().len(), "{name}");
        for (n, g) in cached.grads.iter() {
            let want = full.grads.get(n).unwrap();
            let err = max_diff(g, want) / max_abs(want).max(1e-6);
            assert!(err <= 1e-4, "{name}: `{n}` off by {err:e}");
        }
        // Dropout is on: the step differs from one without it.
        let plain = RerankCache::new(
            load_pretrained(
                &files,
                "",
                &options,
                ParamStore::new(0, DType::F32, &Device::Cpu),
            )
            .unwrap()
            .0,
            4,
            loss,
            group,
        )
        .unwrap()
        .with_dropout(false)
        .step(3, &batch, c.labels.as_deref())
        .unwrap();
        assert_ne!(plain.loss, cached.loss, "{name}");
    }
}
