//! Distillation of a teacher's scores into single-vector and sparse models (and the loss of
//! a query against its own passages only), against sentence-transformers 6.3 on the tiny
//! fixture models (`tests/fixtures/distill/`, written by
//! `scripts/make_distill_fixtures.py`): one cached step's loss (1e-5 relative) and every
//! parameter gradient (1e-4 relative) equal to `MarginMSELoss`, `DistillKLDivLoss` (its
//! defaults, and separate student and teacher temperatures) with dot and cosine
//! similarity, and `SpladeLoss` over `SparseMarginMSELoss` / `SparseDistillKLDivLoss` (its
//! default temperature, 2) with the FLOPS regularisers, at chunks of 4, 1 and 3 (the last
//! with recompute).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions};
use gradcache::hub::{read_sentence_transformers_config, ModelFiles, Tokenizer};
use gradcache::loss::{
    Flops, GroupObjective, GroupScores, Loss, SpladeLoss, TeacherScores, Weighted,
};
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, Similarity};

use crate::common::families::{assert_step_matches, refs};
use crate::common::max_abs;

const MAX_LEN: usize = 32;

struct Fixture {
    queries: Vec<String>,
    passages: Vec<String>,
    teacher: Vec<Vec<f32>>,
    cases: HashMap<String, f64>,
    tensors: HashMap<String, Tensor>,
}

fn fixture() -> Fixture {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/distill");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let list = |key: &str| -> Vec<String> { serde_json::from_value(meta[key].clone()).unwrap() };
    Fixture {
        queries: list("queries"),
        passages: list("passages"),
        teacher: serde_json::from_value(meta["teacher"].clone()).unwrap(),
        cases: serde_json::from_value(meta["cases"].clone()).unwrap(),
        tensors: candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
            .unwrap(),
    }
}

fn model_dir(model: &str) -> std::path::PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    match model {
        "dense" => base.join("families/bert"),
        _ => base.join("sparse/bert"),
    }
}

/// One cached step of `loss` on the fixture's batch with `model`'s encoder.
fn step<L: Loss>(
    f: &Fixture,
    model: &str,
    loss: L,
    teacher: &TeacherScores,
    chunk: usize,
    recompute: Recompute,
) -> (f32, gradcache::Gradients) {
    let dir = model_dir(model);
    let files = ModelFiles::from_dir(&dir).unwrap();
    let head = read_sentence_transformers_config(&dir).unwrap();
    let options = BertOptions {
        recompute,
        sparse: head.as_ref().and_then(|h| h.sparse),
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let scores: Vec<f32> = f.teacher.iter().flatten().copied().collect();
    let group = f.teacher[0].len();
    teacher
        .set(&Tensor::from_vec(scores, (f.queries.len(), group), &Device::Cpu).unwrap())
        .unwrap();
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let q = tokenizer.encode(&refs(&f.queries), &Device::Cpu).unwrap();
    let p = tokenizer.encode(&refs(&f.passages), &Device::Cpu).unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

fn objective(kind: &str) -> GroupObjective {
    match kind {
        "margin_mse" => GroupObjective::MarginMse,
        "kl" => GroupObjective::Kl {
            student_temperature: 1.0,
            teacher_temperature: 1.0,
        },
        "kl_t" => GroupObjective::Kl {
            student_temperature: 2.0,
            teacher_temperature: 0.5,
        },
        // SparseDistillKLDivLoss's default temperature.
        "kl_sparse" => GroupObjective::Kl {
            student_temperature: 2.0,
            teacher_temperature: 2.0,
        },
        _ => panic!("unknown case {kind}"),
    }
}

fn check(f: &Fixture, case: &str, build: &dyn Fn(&TeacherScores) -> Box<dyn Loss>) {
    let (model, _) = case.split_once('.').unwrap();
    let prefix = format!("{case}.grad.");
    // The reference's names carry the base model's prefix (a SPLADE model's `bert.`).
    let want: HashMap<String, &Tensor> = f
        .tensors
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|n| (n, v)))
        .map(|(n, v)| (n.strip_prefix("bert.").unwrap_or(n).to_string(), v))
        .collect();
    assert!(
        want.len() > 30,
        "{case}: {} reference gradients",
        want.len()
    );
    for (chunk, recompute) in [
        (4, Recompute::Off),
        (1, Recompute::Off),
        (3, Recompute::EveryLayer),
    ] {
        let teacher = TeacherScores::new();
        let loss = build(&teacher);
        let (loss, grads) = step(
            f,
            model,
            BoxedLoss(loss),
            &teacher,
            chunk,
            recompute.clone(),
        );
        let what = format!("{case}, chunk {chunk}, recompute {recompute:?}");
        let seen = assert_step_matches(&what, (loss, &grads), f.cases[case], &want);
        let nonzero = want.values().filter(|g| max_abs(g) > 0.0).count();
        assert!(seen >= nonzero, "{what}: {seen} gradients for {nonzero}");
    }
}

/// A boxed loss as a loss the cache owns.
struct BoxedLoss(Box<dyn Loss>);

impl Loss for BoxedLoss {
    fn forward(&self, q: &Tensor, p: &Tensor) -> gradcache::Result<Tensor> {
        self.0.forward(q, p)
    }

    fn value_and_grads(&self, q: &Tensor, p: &Tensor) -> gradcache::Result<gradcache::LossValue> {
        self.0.value_and_grads(q, p)
    }
}

#[test]
fn single_vector_distillation_matches_sentence_transformers() {
    let f = fixture();
    for kind in ["margin_mse", "kl", "kl_t"] {
        for (sim_name, similarity) in [("dot", Similarity::Dot), ("cosine", Similarity::Cosine)] {
            let case = format!("dense.{kind}.{sim_name}");
            check(&f, &case, &|teacher| {
                let scores = GroupScores::new(objective(kind), similarity, teacher.clone());
                Box::new(
                    Weighted::new(vec![(1.0, Box::new(scores.unwrap()) as Box<dyn Loss>)]).unwrap(),
                )
            });
        }
    }
}

#[test]
fn sparse_distillation_with_the_flops_regularisers_matches_sentence_transformers() {
    let f = fixture();
    for kind in ["margin_mse", "kl"] {
        let case = format!("sparse.{kind}.dot");
        check(&f, &case, &|teacher| {
            let kind = if kind == "kl" { "kl_sparse" } else { kind };
            let scores = GroupScores::new(objective(kind), Similarity::Dot, teacher.clone());
            let base =
                Weighted::new(vec![(1.0, Box::new(scores.unwrap()) as Box<dyn Loss>)]).unwrap();
            Box::new(
                SpladeLoss::new(base, Flops::new(3e-3).unwrap())
                    .with_queries(Some(Flops::new(5e-3).unwrap())),
            )
        });
    }
}

/// A weighted sum is the weighted sum of its parts' values and gradients: distillation at
/// weight 0.5 beside InfoNCE at 2 against each part alone.
#[test]
fn a_weighted_sum_adds_its_parts() {
    let q = Tensor::new(&[[0.3f32, -0.2, 0.9], [0.1, 0.4, -0.5]], &Device::Cpu).unwrap();
    let p = Tensor::new(
        &[
            [0.2f32, -0.1, 0.8],
            [0.5, 0.5, 0.1],
            [0.0, 0.3, -0.4],
            [-0.6, 0.2, 0.2],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let teacher = TeacherScores::new();
    teacher
        .set(&Tensor::new(&[[2.0f32, 0.5], [1.5, 1.0]], &Device::Cpu).unwrap())
        .unwrap();
    let kl = || {
        GroupScores::new(
            GroupObjective::Kl {
                student_temperature: 1.0,
                teacher_temperature: 1.0,
            },
            Similarity::Cosine,
            teacher.clone(),
        )
        .unwrap()
    };
    let infonce = || {
        InfoNce::new(0.05)
            .unwrap()
            .with_similarity(Similarity::Cosine)
    };
    let sum = Weighted::new(vec![
        (0.5, Box::new(kl()) as Box<dyn Loss>),
        (2.0, Box::new(infonce())),
    ])
    .unwrap();
    let all = sum.value_and_grads(&q, &p).unwrap();
    let a = kl().value_and_grads(&q, &p).unwrap();
    let b = infonce().value_and_grads(&q, &p).unwrap();
    assert!((all.loss - (0.5 * a.loss + 2.0 * b.loss)).abs() < 1e-5);
    let want = ((a.grad_queries * 0.5).unwrap() + (b.grad_queries * 2.0).unwrap()).unwrap();
    assert!(crate::common::max_diff(&all.grad_queries, &want) < 1e-6);
    let want = ((a.grad_passages * 0.5).unwrap() + (b.grad_passages * 2.0).unwrap()).unwrap();
    assert!(crate::common::max_diff(&all.grad_passages, &want) < 1e-6);
    // A weight of 0 or less, no part, a temperature of 0 are refused.
    assert!(Weighted::new(vec![(0.0, Box::new(infonce()) as Box<dyn Loss>)]).is_err());
    assert!(Weighted::new(Vec::new()).is_err());
    for objective in [
        GroupObjective::Kl {
            student_temperature: 0.0,
            teacher_temperature: 1.0,
        },
        GroupObjective::Kl {
            student_temperature: 1.0,
            teacher_temperature: f64::NAN,
        },
        GroupObjective::InfoNce { temperature: -1.0 },
    ] {
        let made = GroupScores::new(objective, Similarity::Dot, TeacherScores::new());
        assert!(made.is_err(), "{objective:?}");
    }
    // Margin MSE needs a hard negative per query; the teacher's scores must be set and
    // of the batch's shape.
    let margin =
        GroupScores::new(GroupObjective::MarginMse, Similarity::Dot, teacher.clone()).unwrap();
    assert!(margin
        .value_and_grads(&q, &p.narrow(0, 0, 2).unwrap())
        .is_err());
    let unset = GroupScores::new(
        GroupObjective::MarginMse,
        Similarity::Dot,
        TeacherScores::new(),
    )
    .unwrap();
    assert!(unset.value_and_grads(&q, &p).is_err());
}

/// Without in-batch negatives a query is ranked against its own passages only: another
/// query's passages change nothing.
#[test]
fn own_group_infonce_ignores_other_queries_passages() {
    let loss = GroupScores::new(
        GroupObjective::InfoNce { temperature: 0.1 },
        Similarity::Dot,
        TeacherScores::new(),
    )
    .unwrap();
    let q = Tensor::new(&[[1.0f32, 0.0], [0.0, 1.0]], &Device::Cpu).unwrap();
    let p1 = Tensor::new(
        &[[0.9f32, 0.1], [0.2, 0.3], [0.1, 0.8], [0.4, 0.4]],
        &Device::Cpu,
    )
    .unwrap();
    // The second query's passages moved: the first query's term is unchanged.
    let p2 = Tensor::new(
        &[[0.9f32, 0.1], [0.2, 0.3], [5.0, -3.0], [0.4, 0.4]],
        &Device::Cpu,
    )
    .unwrap();
    let one = |p: &Tensor| {
        loss.value_and_grads(&q.narrow(0, 0, 1).unwrap(), &p.narrow(0, 0, 2).unwrap())
            .unwrap()
            .loss
    };
    assert_eq!(one(&p1), one(&p2));
    let v = loss.value_and_grads(&q, &p1).unwrap();
    // By hand: query 0 scores 0.9 and 0.2, query 1 scores 0.8 and 0.4, at temperature 0.1.
    let term = |pos: f64, neg: f64| -(pos / 0.1 - ((pos / 0.1).exp() + (neg / 0.1).exp()).ln());
    let want = (term(0.9, 0.2) + term(0.8, 0.4)) / 2.0;
    assert!(
        (v.loss as f64 - want).abs() < 1e-5,
        "{} against {want}",
        v.loss
    );
}
