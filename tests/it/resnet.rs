//! The ResNet tower and BatchNorm under the gradient cache: checkpointing policies give
//! `Off`'s gradients bit for bit, every parameter gets a gradient, running statistics move
//! once per chunk (in the representation pass, never in a replay or a recompute), and a
//! cached step equals a plain backward through the chunk-by-chunk forward.

use crate::common;

use crate::common::{bits, random, snapshot, train_ctx};
use candle_core::{DType, Device, Tensor};
use gradcache::resnet::{Block, ResNet, ResNetConfig};
use gradcache::{
    Ctx, Encoder, GradCache, InfoNce, ParamStore, Recompute, Recomputed, Similarity, Tower,
};

fn config(block: Block) -> ResNetConfig {
    ResNetConfig {
        in_channels: 3,
        width: 4,
        stages: vec![2, 1, 1],
        block,
        output: 8,
    }
}

fn tower(store: &ParamStore, cfg: &ResNetConfig, policy: Recompute) -> Recomputed<ResNet> {
    let tower = Tower::build(store, "", |vb| ResNet::new(cfg, vb)).unwrap();
    Recomputed::new(tower, policy).unwrap()
}

fn images(seed: u64, rows: usize) -> Tensor {
    random(seed, &[rows, 3, 8, 8])
}

#[test]
fn buffers_are_kept_out_of_the_parameters() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let enc = tower(&store, &config(Block::Basic), Recompute::Off);
    let buffers = enc.buffers();
    // stem + 4 blocks x 2 convs + 2 downsamples (stages 2 and 3) = 11 BatchNorms.
    assert_eq!(buffers.len(), 2 * 11);
    assert!(buffers
        .names()
        .all(|n| n.ends_with("running_mean") || n.ends_with("running_var")));
    assert!(enc.params().names().all(|n| !n.contains("running")));
    assert!(buffers
        .names()
        .any(|n| n == "layer2.0.downsample.1.running_var"));
    assert!(enc.params().names().any(|n| n == "layer1.1.conv2.weight"));
}

#[test]
fn every_policy_gives_off_gradients_bit_for_bit_and_leaves_running_statistics_alone() {
    for block in [Block::Basic, Block::Bottleneck] {
        let cfg = config(block);
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let x = images(11, 6);
        let cot = random(12, &[6, cfg.output]);
        let ctx = train_ctx(0);
        let mut enc = tower(&store, &cfg, Recompute::Off);
        let before = snapshot(&enc.buffers());
        let reference = enc.replay(&x, &cot, &ctx).unwrap();
        assert_eq!(
            reference.len(),
            enc.params().len(),
            "every parameter of the {block:?} ResNet receives a gradient"
        );
        for (name, g) in reference.iter() {
            assert!(common::max_abs(g) > 0.0, "{name}: zero gradient");
        }
        for policy in [
            Recompute::EveryLayer,
            Recompute::Every(2),
            Recompute::Sqrt,
            Recompute::Layers(vec![1, 3]),
        ] {
            enc.set_policy(policy.clone()).unwrap();
            let got = enc.replay(&x, &cot, &ctx).unwrap();
            for (name, want) in reference.iter() {
                let g = got.get(name).unwrap();
                assert!(bits(g) == bits(want), "{block:?} {policy}: {name} differs");
            }
        }
        assert_eq!(
            snapshot(&enc.buffers()),
            before,
            "replays and checkpoint recomputes must not move the running statistics"
        );
    }
}

#[test]
fn the_representation_pass_moves_running_statistics_once_like_a_training_forward() {
    let cfg = config(Block::Basic);
    let x = images(21, 5);
    let a = ParamStore::new(4, DType::F32, &Device::Cpu);
    let b = ParamStore::new(4, DType::F32, &Device::Cpu);
    let (ea, eb) = (
        tower(&a, &cfg, Recompute::Sqrt),
        tower(&b, &cfg, Recompute::Off),
    );
    let start = snapshot(&ea.buffers());
    let rep = ea.encode(&x, &train_ctx(0).updating_stats()).unwrap();
    let moved = snapshot(&ea.buffers());
    // The replay's forward normalises with the representation pass's batch statistics,
    // bit for bit (same rows, same operations), whatever the running statistics are now.
    let replayed = ea.forward(&x, &train_ctx(0)).unwrap();
    assert_eq!(bits(&rep), bits(&replayed));
    assert_ne!(
        moved, start,
        "the representation pass updates the statistics"
    );
    // A plain training forward with a graph over the same rows moves them the same way.
    eb.forward(&x, &train_ctx(0).updating_stats()).unwrap();
    assert_eq!(snapshot(&eb.buffers()), moved);
    // Forwards in Batch mode (replays) and evaluation never move them.
    ea.encode(&x, &train_ctx(0)).unwrap();
    ea.encode(&x, &Ctx::eval()).unwrap();
    assert_eq!(snapshot(&ea.buffers()), moved);

    // The running statistics are PyTorch's: momentum 0.1, unbiased batch variance.
    let mean = a.get("bn1.running_mean").unwrap();
    let stem = {
        let conv = a.get("conv1.weight").unwrap();
        x.conv2d(conv.as_tensor(), 1, 1, 1, 1).unwrap()
    };
    let batch_mean = stem
        .mean_keepdim(0)
        .and_then(|t| t.mean_keepdim(2))
        .and_then(|t| t.mean_keepdim(3))
        .and_then(|t| t.flatten_all())
        .unwrap();
    let want = (batch_mean * 0.1).unwrap();
    assert!(common::max_diff(mean.as_tensor(), &want) < 1e-6);
    let var = a.get("bn1.running_var").unwrap();
    let n = (5 * 8 * 8) as f64;
    let centered = stem
        .broadcast_sub(
            &stem
                .mean_keepdim(0)
                .and_then(|t| t.mean_keepdim(2))
                .and_then(|t| t.mean_keepdim(3))
                .unwrap(),
        )
        .unwrap();
    let unbiased = centered
        .sqr()
        .and_then(|t| t.sum_keepdim(0))
        .and_then(|t| t.sum_keepdim(2))
        .and_then(|t| t.sum_keepdim(3))
        .and_then(|t| t.flatten_all())
        .map(|t| (t / (n - 1.0)).unwrap())
        .unwrap();
    let want = ((unbiased * 0.1).unwrap() + 0.9).unwrap();
    assert!(common::max_diff(var.as_tensor(), &want) < 1e-5);
}

#[test]
fn evaluation_normalises_with_the_running_statistics() {
    let cfg = config(Block::Basic);
    let store = ParamStore::new(5, DType::F32, &Device::Cpu);
    let enc = tower(&store, &cfg, Recompute::Off);
    let x = images(31, 4);
    let one = x.narrow(0, 0, 1).unwrap();
    // Evaluation is per row: one image alone gives its row of the batch's output.
    let batch = enc.encode(&x, &Ctx::eval()).unwrap();
    let alone = enc.encode(&one, &Ctx::eval()).unwrap();
    assert!(common::max_diff(&batch.narrow(0, 0, 1).unwrap(), &alone) < 1e-5);
    // Training is not: the row depends on the rows normalised with it.
    let batch = enc.encode(&x, &train_ctx(0)).unwrap();
    let pair = enc
        .encode(&x.narrow(0, 0, 2).unwrap(), &train_ctx(0))
        .unwrap();
    assert!(
        common::max_diff(
            &batch.narrow(0, 0, 1).unwrap(),
            &pair.narrow(0, 0, 1).unwrap()
        ) > 1e-4
    );
    let err = enc
        .encode(&random(1, &[1, 3, 1, 1]), &train_ctx(0))
        .unwrap_err();
    assert!(
        err.to_string().contains("more than one value per channel"),
        "{err}"
    );
    let err = enc
        .encode(&random(1, &[2, 4, 8, 8]), &Ctx::eval())
        .unwrap_err();
    assert!(err.to_string().contains("channel"), "{err}");
}

#[test]
fn a_cached_step_equals_the_chunkwise_reference_and_updates_statistics_once_per_chunk() {
    let cfg = config(Block::Basic);
    let chunk = 3;
    let (q, p) = (images(41, 8), images(42, 8));
    let build = |policy| {
        let store = ParamStore::new(6, DType::F32, &Device::Cpu);
        let loss = InfoNce::new(0.1)
            .unwrap()
            .with_similarity(Similarity::Cosine);
        let gc = GradCache::shared(tower(&store, &cfg, policy), chunk, loss).unwrap();
        (store, gc)
    };
    let (_, reference) = build(Recompute::Off);
    let (want_loss, want) = common::chunkwise_reference(&reference, &q, &p, chunk);
    let want_stats = snapshot(&reference.buffers().unwrap());
    for policy in [Recompute::Off, Recompute::Sqrt] {
        let (_, gc) = build(policy.clone());
        let out = gc.cache_step(0, &q, &p).unwrap();
        assert!(
            (out.loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{policy}"
        );
        let err = out.grads.max_rel_err(&want, 1e-3).unwrap();
        assert!(err <= 1e-5, "{policy}: relative gradient error {err}");
        // Each of the 6 chunks (3 per side) moved the statistics exactly once, as in the
        // reference; the replays did not move them again.
        assert_eq!(snapshot(&gc.buffers().unwrap()), want_stats, "{policy}");
    }
}

#[test]
fn bad_resnet_and_batch_norm_settings_are_refused() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    for (cfg, key) in [
        (
            ResNetConfig {
                stages: vec![],
                ..config(Block::Basic)
            },
            "resnet.stages",
        ),
        (
            ResNetConfig {
                stages: vec![1, 0],
                ..config(Block::Basic)
            },
            "resnet.stages",
        ),
        (
            ResNetConfig {
                width: 0,
                ..config(Block::Basic)
            },
            "positive",
        ),
    ] {
        let err = Tower::build(&store, "", |vb| ResNet::new(&cfg, vb))
            .err()
            .unwrap();
        assert!(err.to_string().contains(key), "{err}");
    }
    let err = gradcache::nn::BatchNorm::with_options(4, 1e-5, 1.5, store.var_builder().pp("bn"))
        .unwrap_err();
    assert!(err.to_string().contains("momentum"), "{err}");
}
