//! The DenseNet-BC tower under the gradient cache: torchvision's names; the memory-efficient
//! layers (concatenation, BN-ReLUs and bottleneck recomputed in the backward pass) give
//! the plain tower's outputs and gradients bit for bit and move the running statistics
//! once; every checkpointing policy over the dense blocks gives `Off`'s
//! gradients bit for bit; a cached step equals the chunk-by-chunk reference; bad sizes are
//! refused by name.

use crate::common;

use crate::common::{bits, random, snapshot, train_ctx};
use candle_core::{DType, Device, Tensor};
use gradcache::densenet::{DenseNet, DenseNetConfig};
use gradcache::{
    Ctx, Encoder, GradCache, InfoNce, ParamStore, Recompute, Recomputed, Similarity, Tower,
};

fn config(memory_efficient: bool) -> DenseNetConfig {
    DenseNetConfig {
        in_channels: 3,
        growth_rate: 4,
        block_config: vec![3, 2, 2],
        init_features: 8,
        bn_size: 2,
        compression: 0.5,
        memory_efficient,
        output: 8,
    }
}

fn tower(store: &ParamStore, cfg: &DenseNetConfig, policy: Recompute) -> Recomputed<DenseNet> {
    let tower = Tower::build(store, "", |vb| DenseNet::new(cfg, vb)).unwrap();
    Recomputed::new(tower, policy).unwrap()
}

fn images(seed: u64, rows: usize) -> Tensor {
    random(seed, &[rows, 3, 8, 8])
}

#[test]
fn parameters_and_buffers_carry_torchvision_names() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let enc = tower(&store, &config(true), Recompute::Off);
    let names: Vec<String> = enc.params().names().map(String::from).collect();
    for want in [
        "features.conv0.weight",
        "features.norm0.weight",
        "features.denseblock1.denselayer3.conv1.weight",
        "features.denseblock2.denselayer1.norm2.bias",
        "features.transition2.conv.weight",
        "features.norm5.weight",
        "classifier.weight",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // Stem, 7 layers x 2, 2 transitions, the final norm: 18 BatchNorms.
    assert_eq!(enc.buffers().len(), 2 * 18);
    // Channels: 8 + 3 x 4 = 20 -> 10; 10 + 2 x 4 = 18 -> 9; 9 + 2 x 4 = 17 at the end.
    let w = store.get("features.transition1.conv.weight").unwrap();
    assert_eq!(w.as_tensor().dims(), &[10, 20, 1, 1]);
    let w = store.get("features.norm5.weight").unwrap();
    assert_eq!(w.as_tensor().dims(), &[17]);
    let out = enc.encode(&images(1, 2), &Ctx::eval()).unwrap();
    assert_eq!(out.dims(), &[2, 8]);
}

#[test]
fn memory_efficient_layers_change_no_bit_and_move_statistics_once() {
    let x = images(11, 5);
    let cot = random(12, &[5, 8]);
    let ctx = train_ctx(0);
    let build = |memory_efficient| {
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let enc = tower(&store, &config(memory_efficient), Recompute::Off);
        (store, enc)
    };
    let ((_a, plain), (_b, efficient)) = (build(false), build(true));
    // Outputs and every gradient, bit for bit.
    let (p, e) = (
        plain.encode(&x, &ctx).unwrap(),
        efficient.encode(&x, &ctx).unwrap(),
    );
    assert_eq!(bits(&p), bits(&e));
    let want = plain.replay(&x, &cot, &ctx).unwrap();
    let got = efficient.replay(&x, &cot, &ctx).unwrap();
    assert_eq!(want.len(), plain.params().len(), "every parameter");
    for (name, w) in want.iter() {
        assert!(common::max_abs(w) > 0.0, "{name}: zero gradient");
        assert_eq!(bits(got.get(name).unwrap()), bits(w), "{name}");
    }
    // A training forward with a graph that moves the statistics, and its backward (which
    // recomputes the layers): the statistics move once, as the plain tower's do.
    let start = snapshot(&efficient.buffers());
    for enc in [&plain, &efficient] {
        let y = enc.forward(&x, &ctx.updating_stats()).unwrap();
        y.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let moved = snapshot(&efficient.buffers());
    assert_ne!(moved, start);
    assert_eq!(moved, snapshot(&plain.buffers()));
}

#[test]
fn every_policy_gives_off_gradients_bit_for_bit_and_leaves_running_statistics_alone() {
    for memory_efficient in [false, true] {
        let store = ParamStore::new(4, DType::F32, &Device::Cpu);
        let x = images(21, 6);
        let cot = random(22, &[6, 8]);
        let ctx = train_ctx(0);
        let mut enc = tower(&store, &config(memory_efficient), Recompute::Off);
        let before = snapshot(&enc.buffers());
        let reference = enc.replay(&x, &cot, &ctx).unwrap();
        for policy in [
            Recompute::EveryLayer,
            Recompute::Sqrt,
            Recompute::Layers(vec![1]),
        ] {
            enc.set_policy(policy.clone()).unwrap();
            let got = enc.replay(&x, &cot, &ctx).unwrap();
            for (name, want) in reference.iter() {
                let what = format!("memory_efficient {memory_efficient}, {policy}: {name}");
                assert_eq!(bits(got.get(name).unwrap()), bits(want), "{what}");
            }
        }
        assert_eq!(snapshot(&enc.buffers()), before, "replays move nothing");
    }
}

#[test]
fn a_cached_step_equals_the_chunkwise_reference_and_updates_statistics_once_per_chunk() {
    let chunk = 3;
    let (q, p) = (images(41, 8), images(42, 8));
    let build = |policy| {
        let store = ParamStore::new(6, DType::F32, &Device::Cpu);
        let loss = InfoNce::new(0.1)
            .unwrap()
            .with_similarity(Similarity::Cosine);
        GradCache::shared(tower(&store, &config(true), policy), chunk, loss).unwrap()
    };
    let reference = build(Recompute::Off);
    let (want_loss, want) = common::chunkwise_reference(&reference, &q, &p, chunk);
    let want_stats = snapshot(&reference.buffers().unwrap());
    for policy in [Recompute::Off, Recompute::EveryLayer] {
        let gc = build(policy.clone());
        let out = gc.cache_step(0, &q, &p).unwrap();
        assert!(
            (out.loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{policy}"
        );
        // Each gradient within f32 rounding of the reference's: max |difference| <= 1e-4
        // of the tensor's largest value, floored at 1e-3 of the largest gradient (measured:
        // 5.2e-5 for the stem BatchNorm's scale, a sum of cancelling terms 1e-7 apart in
        // absolute terms; 3e-7 or less for every other tensor).
        assert_eq!(out.grads.len(), want.len());
        let global = want
            .iter()
            .map(|(_, w)| common::max_abs(w))
            .fold(0.0, f64::max);
        for (name, w) in want.iter() {
            let diff = common::max_diff(out.grads.get(name).unwrap(), w);
            let err = diff / common::max_abs(w).max(1e-3 * global);
            assert!(err <= 1e-4, "{policy}: {name} off by {err:e}");
        }
        assert_eq!(snapshot(&gc.buffers().unwrap()), want_stats, "{policy}");
    }
}

#[test]
fn sizes_that_do_not_fit_are_refused_by_name() {
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    for (cfg, field) in [
        (
            DenseNetConfig {
                growth_rate: 0,
                ..config(true)
            },
            "densenet.growth_rate",
        ),
        (
            DenseNetConfig {
                block_config: vec![2, 0],
                ..config(true)
            },
            "densenet.block_config",
        ),
        (
            DenseNetConfig {
                block_config: vec![],
                ..config(true)
            },
            "densenet.block_config",
        ),
        (
            DenseNetConfig {
                compression: 1.5,
                ..config(true)
            },
            "densenet.compression",
        ),
        (
            DenseNetConfig {
                compression: 0.01,
                ..config(true)
            },
            "densenet.compression",
        ),
    ] {
        let err = Tower::build(&store, "", |vb| DenseNet::new(&cfg, vb))
            .err()
            .unwrap();
        assert!(err.to_string().contains(field), "{field}: {err}");
    }
    // Images too small for the transitions (3 blocks: at least 4 pixels a side), and not
    // images at all.
    let enc = tower(&store, &config(true), Recompute::Off);
    let err = enc
        .encode(&random(1, &[2, 3, 2, 8]), &Ctx::eval())
        .unwrap_err();
    assert!(err.to_string().contains("image size"), "{err}");
    let err = enc
        .encode(&random(1, &[2, 3, 8]), &Ctx::eval())
        .unwrap_err();
    assert!(err.to_string().contains("[rows, channels"), "{err}");
}
