//! `cache_step` must reproduce one plain forward/backward over the whole batch: same loss,
//! same gradient for every parameter, for every chunking (1, 3, B-1, B, 2B: an uneven last
//! chunk and a chunk larger than the batch), one shared tower and two towers with different
//! chunk sizes, with and without hard negatives, symmetric on and off, row-block loss on
//! and off. Tolerance: max relative error <= 1e-5 in f32, per parameter measured as
//! `max|a - b| / max|b|` (see `Gradients::max_rel_err`).
//!
//! Some gradients are mathematically zero and have no meaningful relative error: with two
//! towers and no symmetric term, anything that shifts every passage representation by the
//! same vector `c` (the passage tower's output bias, and its LayerNorm bias, which reaches
//! the output as `W c`) adds `q_i . c` to every logit of row `i`, which softmax ignores.
//! Those parameters are checked for what they are: both gradients must be rounding noise,
//! below `ZERO_TOL` times the largest gradient entry of the model.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{BagOfWords, BagOfWordsConfig, Mlp, MlpConfig};
use gradcache::{
    Batch, Encoder, GradCache, Gradients, InfoNce, Loss, ParamStore, Similarity, StepOutput,
    TokenBatch, Tower,
};

use crate::common;
use crate::common::rel_err_with_zeros;

const TOL: f64 = 1e-5;
const ZERO_TOL: f64 = 1e-6;
/// Queries per batch.
const B: usize = 8;
const FEATURES: usize = 12;

fn mlp_cfg(output: usize) -> MlpConfig {
    MlpConfig {
        input: FEATURES,
        hidden: 24,
        output,
        dropout: 0.0,
    }
}

fn features(seed: u64, rows: usize) -> Tensor {
    common::features(seed, rows, FEATURES)
}

fn tokens(seed: u64, rows: usize, vocab: u32) -> TokenBatch {
    // Rows of different lengths, right-padded, so the masked mean matters.
    let len = 7;
    let noise = features(seed, rows * len / FEATURES + 1)
        .flatten_all()
        .unwrap();
    let noise = noise.to_vec1::<f32>().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    let mut types = Vec::new();
    for r in 0..rows {
        let real = 2 + r % (len - 1);
        for c in 0..len {
            let v = noise[(r * len + c) % noise.len()];
            ids.push(if c < real {
                (v.abs() * 1000.0) as u32 % vocab
            } else {
                0
            });
            mask.push(u32::from(c < real));
            types.push(u32::from(c >= real / 2 && c < real));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(types)).unwrap()
}

fn loss(symmetric: bool, block: Option<usize>, sim: Similarity) -> InfoNce {
    InfoNce::new(0.1)
        .unwrap()
        .with_symmetric(symmetric)
        .with_similarity(sim)
        .with_block_rows(block)
        .unwrap()
}

/// Asserts equal losses and gradients; `zero` names parameters whose true gradient is 0.
fn assert_equivalent(
    name: &str,
    reference: &StepOutput,
    cached: &StepOutput,
    n: usize,
    zero: &[&str],
) {
    assert_eq!(
        reference.grads.len(),
        n,
        "{name}: reference missing gradients"
    );
    assert_eq!(cached.grads.len(), n, "{name}: cached missing gradients");
    let loss_err = ((cached.loss - reference.loss) / reference.loss).abs() as f64;
    assert!(
        loss_err <= TOL,
        "{name}: loss {} vs {} (rel {loss_err:e})",
        cached.loss,
        reference.loss
    );

    let grad_err = rel_err_with_zeros(&cached.grads, &reference.grads, zero, ZERO_TOL);
    assert!(
        grad_err <= TOL,
        "{name}: max relative gradient error {grad_err:e} > {TOL:e}"
    );
}

fn chunk_sizes() -> [usize; 5] {
    [1, 3, B - 1, B, 2 * B]
}

fn settings() -> Vec<(usize, bool, Option<usize>)> {
    let mut v = Vec::new();
    for hard in [0, 2] {
        for symmetric in [false, true] {
            for block in [None, Some(3)] {
                v.push((hard, symmetric, block));
            }
        }
    }
    v
}

fn run<Q: Encoder, P: Encoder, L: Loss>(
    name: &str,
    gc: &mut GradCache<Q, P, L>,
    q: &Q::Input,
    p: &P::Input,
    zero: &[&str],
) {
    let n = gc.params().len();
    let reference = gc.full_batch_step(0, q, p).unwrap();
    let cached = gc.cache_step(0, q, p).unwrap();
    assert_equivalent(name, &reference, &cached, n, zero);
}

#[test]
fn shared_tower_matches_full_batch() {
    for (hard, symmetric, block) in settings() {
        for chunk in chunk_sizes() {
            let store = ParamStore::new(1, DType::F32, &Device::Cpu);
            let tower = Tower::build(&store, "", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
            let l = loss(symmetric, block, Similarity::Dot);
            let mut gc = GradCache::shared(tower, chunk, l)
                .unwrap()
                .with_dropout(false);
            let name = format!("shared hard={hard} sym={symmetric} block={block:?} chunk={chunk}");
            run(
                &name,
                &mut gc,
                &features(10, B),
                &features(11, B * (hard + 1)),
                &[],
            );
        }
    }
}

#[test]
fn two_towers_with_different_chunk_sizes_match_full_batch() {
    for (hard, symmetric, block) in settings() {
        for chunk in chunk_sizes() {
            // The passage side gets a different chunk size that also leaves an uneven tail.
            let passage_chunk = chunk + 2;
            let store = ParamStore::new(2, DType::F32, &Device::Cpu);
            let q = Tower::build(&store, "query", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
            let p = Tower::build(&store, "passage", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
            let l = loss(symmetric, block, Similarity::Dot);
            let mut gc = GradCache::two_towers(q, p, chunk, passage_chunk, l)
                .unwrap()
                .with_dropout(false);
            let name = format!(
                "two towers hard={hard} sym={symmetric} block={block:?} chunks={chunk}/{passage_chunk}"
            );
            let zero: &[&str] = if symmetric {
                &[]
            } else {
                &["passage.norm.bias", "passage.out.bias"]
            };
            run(
                &name,
                &mut gc,
                &features(20, B),
                &features(21, B * (hard + 1)),
                zero,
            );
        }
    }
}

#[test]
fn cosine_similarity_matches_full_batch() {
    for (hard, symmetric, block) in settings() {
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let tower = Tower::build(&store, "", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
        let l = loss(symmetric, block, Similarity::Cosine);
        let mut gc = GradCache::shared(tower, 3, l).unwrap().with_dropout(false);
        let name = format!("cosine hard={hard} sym={symmetric} block={block:?}");
        run(
            &name,
            &mut gc,
            &features(30, B),
            &features(31, B * (hard + 1)),
            &[],
        );
    }
}

#[test]
fn token_batches_match_full_batch() {
    let cfg = BagOfWordsConfig {
        vocab: 50,
        hidden: 16,
        output: 16,
        dropout: 0.0,
    };
    for (hard, symmetric, block) in settings() {
        for chunk in chunk_sizes() {
            let store = ParamStore::new(4, DType::F32, &Device::Cpu);
            let tower = Tower::build(&store, "", |vb| BagOfWords::new(&cfg, vb)).unwrap();
            let l = loss(symmetric, block, Similarity::Dot);
            let mut gc = GradCache::shared(tower, chunk, l)
                .unwrap()
                .with_dropout(false);
            let name = format!("tokens hard={hard} sym={symmetric} block={block:?} chunk={chunk}");
            run(
                &name,
                &mut gc,
                &tokens(40, B, 50),
                &tokens(41, B * (hard + 1), 50),
                &[],
            );
        }
    }
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    let check = |what: &str, grads: &Gradients, names: Vec<&str>| {
        assert!(!names.is_empty());
        for name in names {
            let g = grads
                .get(name)
                .unwrap_or_else(|| panic!("{what}: `{name}` received no gradient"));
            let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{what}: `{name}` has a non-finite gradient"
            );
            assert!(
                v.iter().any(|&x| x != 0.0),
                "{what}: `{name}` has an all-zero gradient"
            );
        }
    };
    let l = || InfoNce::new(0.1).unwrap().with_symmetric(true);

    let store = ParamStore::new(5, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
    let gc = GradCache::shared(tower, 3, l()).unwrap().with_seed(9);
    let out = gc
        .cache_step(0, &features(50, B), &features(51, 2 * B))
        .unwrap();
    check("shared mlp", &out.grads, store.params().names().collect());
    assert_eq!(store.params().len(), 8);

    let store = ParamStore::new(6, DType::F32, &Device::Cpu);
    let q = Tower::build(&store, "query", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
    let p = Tower::build(&store, "passage", |vb| Mlp::new(&mlp_cfg(16), vb)).unwrap();
    let gc = GradCache::two_towers(q, p, 2, 5, l()).unwrap().with_seed(9);
    let out = gc
        .cache_step(0, &features(52, B), &features(53, B))
        .unwrap();
    check("two towers", &out.grads, store.params().names().collect());
    assert_eq!(store.params().len(), 16);

    let cfg = BagOfWordsConfig {
        vocab: 50,
        hidden: 16,
        output: 16,
        dropout: 0.1,
    };
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| BagOfWords::new(&cfg, vb)).unwrap();
    let gc = GradCache::shared(tower, 3, l()).unwrap().with_seed(9);
    // Every token id appears so that every embedding row can receive a gradient.
    let ids: Vec<u32> = (0..50).collect();
    let ids = Tensor::from_vec(ids, (10, 5), &Device::Cpu).unwrap();
    let ones = ids.ones_like().unwrap();
    let types =
        Tensor::from_vec((0..50u32).map(|i| i % 2).collect(), (10, 5), &Device::Cpu).unwrap();
    let batch = TokenBatch::new(ids, ones, types).unwrap();
    let out = gc
        .cache_step(0, &batch, &batch.slice(0, 10).unwrap())
        .unwrap();
    check("bag of words", &out.grads, store.params().names().collect());
}
