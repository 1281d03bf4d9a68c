//! Issue 25's losses over the gradient cache: Matryoshka widths and the false-negative
//! mask. Each keeps `cache_step` equal to one full-batch step (loss and every gradient
//! within 1e-5 relative, as tests/it/equivalence.rs) with hard negatives, the symmetric term,
//! row blocks and every chunking; each computes what it says (hand-computed values); bad
//! settings are refused. The no-duplicates sampler never puts a text twice in a batch and
//! resumes exactly.

use candle_core::{DType, Device, Tensor};
use gradcache::loss::Matryoshka;
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::train::data::{Loader, Pair};
use gradcache::{Error, GradCache, InfoNce, Loss, ParamStore, Similarity, Tower};

use crate::common;

const TOL: f64 = 1e-5;
const B: usize = 8;
const FEATURES: usize = 12;
const WIDTH: usize = 16;

fn tower(store: &ParamStore, prefix: &str) -> Tower<Mlp> {
    let cfg = MlpConfig {
        input: FEATURES,
        hidden: 24,
        output: WIDTH,
        dropout: 0.0,
    };
    Tower::build(store, prefix, |vb| Mlp::new(&cfg, vb)).unwrap()
}

fn infonce(symmetric: bool, block: Option<usize>, similarity: Similarity) -> InfoNce {
    InfoNce::new(0.1)
        .unwrap()
        .with_symmetric(symmetric)
        .with_similarity(similarity)
        .with_block_rows(block)
        .unwrap()
}

/// Cached against full batch for two towers (symmetric, so that no gradient is
/// mathematically zero) and a shared tower, every chunking.
fn check_equivalent(name: &str, make: &dyn Fn() -> Matryoshka<InfoNce>, hard: usize) {
    for two in [false, true] {
        for chunk in [1, 3, B - 1, B, 2 * B] {
            let store = ParamStore::new(1, DType::F32, &Device::Cpu);
            let gc = if two {
                GradCache::two_towers(tower(&store, "q"), tower(&store, "p"), chunk, 3, make())
                    .unwrap()
            } else {
                GradCache::shared(tower(&store, ""), chunk, make()).unwrap()
            }
            .with_dropout(false);
            let q = common::features(10, B, FEATURES);
            let p = common::features(11, B * (hard + 1), FEATURES);
            let reference = gc.full_batch_step(0, &q, &p).unwrap();
            let cached = gc.cache_step(0, &q, &p).unwrap();
            let loss_err = ((cached.loss - reference.loss) / reference.loss).abs() as f64;
            assert!(
                loss_err <= TOL,
                "{name} two={two} chunk={chunk}: loss {loss_err:e}"
            );
            assert_eq!(cached.grads.len(), gc.params().len());
            let err = cached.grads.max_rel_err(&reference.grads, 0.0).unwrap();
            assert!(
                err <= TOL,
                "{name} two={two} chunk={chunk}: gradients {err:e}"
            );
        }
    }
}

#[test]
fn matryoshka_cached_equals_full_batch() {
    for similarity in [Similarity::Cosine, Similarity::Dot] {
        for hard in [0, 2] {
            for block in [None, Some(3)] {
                let make = || {
                    Matryoshka::new(
                        infonce(true, block, similarity),
                        vec![WIDTH, 8, 3],
                        vec![1.0, 0.5, 2.0],
                    )
                    .unwrap()
                };
                check_equivalent(
                    &format!("matryoshka {similarity:?} hard={hard} block={block:?}"),
                    &make,
                    hard,
                );
            }
        }
    }
}

#[test]
fn false_negative_mask_cached_equals_full_batch() {
    // The margin masks candidates on this kind of batch (else the test would test nothing).
    let (q, p) = (
        common::random(3, &[B, WIDTH]),
        common::random(4, &[B * 3, WIDTH]),
    );
    let plain = infonce(true, None, Similarity::Cosine);
    let masked = plain.clone().with_false_negative_margin(Some(0.2)).unwrap();
    assert!((loss_of(&plain, &q, &p) - loss_of(&masked, &q, &p)).abs() > 1e-4);
    for hard in [0, 2] {
        for block in [None, Some(3)] {
            let make = || {
                let inner = infonce(true, block, Similarity::Cosine)
                    .with_false_negative_margin(Some(0.2))
                    .unwrap();
                Matryoshka::new(inner, vec![WIDTH, 4], Vec::new()).unwrap()
            };
            check_equivalent(&format!("mask hard={hard} block={block:?}"), &make, hard);
        }
    }
}

fn loss_of(l: &dyn Loss, q: &Tensor, p: &Tensor) -> f64 {
    f64::from(l.value_and_grads(q, p).unwrap().loss)
}

#[test]
fn matryoshka_is_the_weighted_sum_over_prefixes() {
    let q = common::random(1, &[6, WIDTH]);
    let p = common::random(2, &[12, WIDTH]);
    let inner = infonce(true, Some(2), Similarity::Cosine);
    let m = Matryoshka::new(inner.clone(), vec![WIDTH, 5], vec![1.0, 0.25]).unwrap();
    let want = loss_of(&inner, &q, &p)
        + 0.25
            * loss_of(
                &inner,
                &q.narrow(1, 0, 5).unwrap(),
                &p.narrow(1, 0, 5).unwrap(),
            );
    let v = m.value_and_grads(&q, &p).unwrap();
    assert!(
        (f64::from(v.loss) - want).abs() <= 1e-5 * want,
        "{} vs {want}",
        v.loss
    );
    let forward = m.forward(&q, &p).unwrap().to_scalar::<f32>().unwrap();
    assert!((f64::from(forward) - want).abs() <= 1e-5 * want);
    // Widths below the embedding leave the columns beyond the widest one without gradient.
    let narrow = Matryoshka::new(inner, vec![6, 3], Vec::new()).unwrap();
    let g = narrow.value_and_grads(&q, &p).unwrap().grad_queries;
    let beyond = common::max_abs(&g.narrow(1, 6, WIDTH - 6).unwrap());
    assert_eq!(beyond, 0.0);
    assert!(common::max_abs(&g.narrow(1, 0, 6).unwrap()) > 0.0);
}

#[test]
fn the_mask_leaves_out_candidates_too_close_to_the_positive() {
    // Query 0's positive is passage 0; passage 1 (query 1's positive) is a copy of it, a
    // false negative for query 0. With a margin the copy is left out of query 0's softmax:
    // the loss equals the cross-entropy computed by hand without that logit.
    let q = Tensor::new(
        &[[1f32, 0.2, 0.0], [0.1, 1.0, 0.3], [0.0, 0.3, 1.0]],
        &Device::Cpu,
    )
    .unwrap();
    let p = Tensor::new(
        &[[0.9f32, 0.1, 0.1], [0.9, 0.1, 0.1], [0.1, 0.2, 1.0]],
        &Device::Cpu,
    )
    .unwrap();
    let t = 0.1;
    let plain = InfoNce::new(t).unwrap().with_similarity(Similarity::Dot);
    let masked = plain
        .clone()
        .with_false_negative_margin(Some(0.01))
        .unwrap();
    let sims = q.matmul(&p.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
    // Row by row: leave out candidates j != i with sim > sim_ii - 0.01.
    let mut want = 0.0;
    let mut left_out = 0;
    for (i, row) in sims.iter().enumerate() {
        let pos = f64::from(row[i]);
        let kept: Vec<f64> = row
            .iter()
            .enumerate()
            .filter(|&(j, &s)| j == i || f64::from(s) <= pos - 0.01)
            .map(|(_, &s)| f64::from(s) / t)
            .collect();
        left_out += row.len() - kept.len();
        let lse = kept.iter().map(|x| x.exp()).sum::<f64>().ln();
        want += lse - pos / t;
    }
    want /= 3.0;
    assert!(left_out >= 1, "the fixture must exercise the mask");
    let got = loss_of(&masked, &q, &p);
    assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
    assert!(
        (loss_of(&plain, &q, &p) - got).abs() > 1e-3,
        "the mask changes the loss"
    );
    let g = masked.value_and_grads(&q, &p).unwrap();
    assert!(common::max_abs(&g.grad_queries).is_finite());
    assert!(common::max_abs(&g.grad_passages).is_finite());
}

#[test]
fn bad_loss_settings_are_refused() {
    let inner = || InfoNce::new(0.1).unwrap();
    for (dims, weights, field) in [
        (vec![0], vec![], "loss.matryoshka_dims"),
        (vec![8, 8], vec![], "loss.matryoshka_dims"),
        (vec![8, 4], vec![1.0], "loss.matryoshka_weights"),
        (vec![8], vec![-1.0], "loss.matryoshka_weights"),
    ] {
        match Matryoshka::new(inner(), dims.clone(), weights).unwrap_err() {
            Error::InvalidConfig { field: f, .. } => assert_eq!(f, field, "{dims:?}"),
            other => panic!("{dims:?}: {other}"),
        }
    }
    let wide = Matryoshka::new(inner(), vec![WIDTH + 1], Vec::new()).unwrap();
    let q = common::random(1, &[2, WIDTH]);
    assert!(matches!(
        wide.value_and_grads(&q, &q).unwrap_err(),
        Error::InvalidConfig { .. }
    ));
    assert!(inner().with_false_negative_margin(Some(f64::NAN)).is_err());
}

fn pairs_with_repeats() -> Vec<Pair> {
    // 60 pairs; queries repeat every 7, positives every 11: many possible collisions.
    (0..60)
        .map(|i| Pair {
            query: format!("query {}", i % 7 + 100 * (i / 30)),
            positive: format!("passage {}", i % 11),
            negatives: vec![format!("passage {}", (i + 3) % 13)],
            scores: Vec::new(),
            prompt: None,
        })
        .collect()
}

#[test]
fn no_duplicates_batches_hold_every_text_once_and_resume_exactly() {
    let batch = 5;
    let make = || {
        Loader::new(pairs_with_repeats(), batch, 1, 3)
            .unwrap()
            .with_no_duplicates(true)
            .unwrap()
    };
    let mut loader = make();
    let mut served = Vec::new();
    for _ in 0..40 {
        let b = loader.next_batch().unwrap();
        let mut texts: Vec<&String> = b.queries.iter().chain(&b.passages).collect();
        let n = texts.len();
        texts.sort();
        texts.dedup();
        assert_eq!(texts.len(), n, "a text repeats in {b:?}");
        served.push(b);
    }
    // Without the sampler the same data does repeat texts within batches.
    let mut plain = Loader::new(pairs_with_repeats(), batch, 1, 3).unwrap();
    let repeats = (0..40).any(|_| {
        let b = plain.next_batch().unwrap();
        let mut t: Vec<&String> = b.queries.iter().chain(&b.passages).collect();
        let n = t.len();
        t.sort();
        t.dedup();
        t.len() < n
    });
    assert!(repeats, "the fixture must hold colliding pairs");
    // Resume at any position gives the same batches.
    let mut again = make();
    for _ in 0..17 {
        again.next_batch().unwrap();
    }
    let position = again.position();
    let mut resumed = make();
    resumed.seek(position).unwrap();
    for b in &served[17..] {
        assert_eq!(&resumed.next_batch().unwrap(), b);
    }
    // Impossible: every pair shares one query.
    let same: Vec<Pair> = (0..10)
        .map(|i| Pair {
            query: "q".into(),
            positive: format!("p{i}"),
            negatives: Vec::new(),
            scores: Vec::new(),
            prompt: None,
        })
        .collect();
    match Loader::new(same, 2, 0, 1).unwrap().with_no_duplicates(true) {
        Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "train.no_duplicates"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("no batch of 2 distinct queries exists"),
    }
}

#[test]
fn a_guide_judges_the_mask_and_keeps_cached_equal_to_full() {
    use gradcache::loss::Guide;
    let hard = 1;
    // A guide that is the model's own normalised representations masks exactly what the
    // model itself would.
    let (q, p) = (
        common::random(5, &[B, WIDTH]),
        common::random(6, &[B * 2, WIDTH]),
    );
    let own = infonce(true, Some(3), Similarity::Cosine)
        .with_false_negative_margin(Some(0.3))
        .unwrap();
    let guide = Guide::new();
    let guided = own.clone().with_guide(Some(guide.clone()));
    guide.set(&q, &p).unwrap();
    let (a, b) = (loss_of(&own, &q, &p), loss_of(&guided, &q, &p));
    assert!((a - b).abs() <= 1e-6 * a, "{a} vs {b}");
    // Another guide masks other candidates.
    guide
        .set(&common::random(7, &[B, 5]), &common::random(8, &[B * 2, 5]))
        .unwrap();
    assert!((loss_of(&guided, &q, &p) - a).abs() > 1e-4);
    // Cached == full with a guide, every chunking, two towers and one.
    let guide = Guide::new();
    guide
        .set(
            &common::random(9, &[B, 6]),
            &common::random(10, &[B * (hard + 1), 6]),
        )
        .unwrap();
    let make = || {
        let inner = infonce(true, Some(3), Similarity::Cosine)
            .with_false_negative_margin(Some(0.1))
            .unwrap()
            .with_guide(Some(guide.clone()));
        Matryoshka::new(inner, vec![WIDTH, 8], Vec::new()).unwrap()
    };
    check_equivalent("guide", &make, hard);
    // A guide without embeddings of the batch, or of another batch, is an error.
    let unset = infonce(false, None, Similarity::Cosine).with_guide(Some(Guide::new()));
    assert!(unset.value_and_grads(&q, &p).is_err());
    let wrong = Guide::new();
    wrong
        .set(
            &common::random(1, &[B + 1, 4]),
            &common::random(2, &[B * 2, 4]),
        )
        .unwrap();
    let l = infonce(false, None, Similarity::Cosine).with_guide(Some(wrong));
    assert!(matches!(
        l.value_and_grads(&q, &p).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
}

/// The trainer refuses Matryoshka widths wider than its embedding before any step.
#[test]
fn the_trainer_refuses_widths_beyond_the_embedding() {
    use gradcache::train::{Config, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(tmp.path());
    // The tiny run's embedding is 16 wide.
    let cfg = Config::load(&config, &["loss.matryoshka_dims=[16, 17]".to_string()]).unwrap();
    match Trainer::new(cfg, None).err().unwrap() {
        Error::InvalidConfig { field, value, .. } => {
            assert_eq!(field, "loss.matryoshka_dims");
            assert!(value.contains("width 16"), "{value}");
        }
        other => panic!("{other}"),
    }
}
