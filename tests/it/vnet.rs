//! The VNet volume tower and its 3-D convolution: the convolution node equals a
//! composed reference (candle's 2-D convolutions summed over the kernel's depth, with
//! candle's autograd) forward and backward at several strides, paddings and piece sizes;
//! vnet.pytorch's names; the memory-efficient units equal the plain ones (outputs,
//! gradients, running statistics moved once); every checkpointing policy gives `Off`'s
//! gradients bit for bit; a cached step equals the chunk-by-chunk reference; bad shapes
//! and sizes are refused by name.

use crate::common;

use crate::common::{bits, max_abs, max_diff, random, snapshot, train_ctx};
use candle_core::{DType, Device, Tensor, Var};
use gradcache::vnet::{VNet, VNetConfig};
use gradcache::{
    Ctx, Encoder, GradCache, InfoNce, ParamStore, Recompute, Recomputed, Similarity, Tower,
};

/// The 3-D convolution composed from candle's 2-D ones: output depth `z` is the sum over
/// the kernel's depth `kz` of the input's (padded) depth `z * stride + kz` convolved with
/// the kernel's slice `kz`.
fn conv3d_reference(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Tensor {
    let k = w.dim(2).unwrap();
    let xp = x.pad_with_zeros(2, padding, padding).unwrap();
    let out_d = (xp.dim(2).unwrap() - k) / stride + 1;
    let planes: Vec<Tensor> = (0..out_d)
        .map(|z| {
            let mut sum: Option<Tensor> = None;
            for kz in 0..k {
                let slice = xp
                    .narrow(2, z * stride + kz, 1)
                    .unwrap()
                    .squeeze(2)
                    .unwrap();
                let kernel = w.narrow(2, kz, 1).unwrap().squeeze(2).unwrap();
                let y = slice.conv2d(&kernel, padding, stride, 1, 1).unwrap();
                sum = Some(match sum {
                    Some(s) => (s + y).unwrap(),
                    None => y,
                });
            }
            sum.unwrap()
        })
        .collect();
    Tensor::stack(&planes, 2).unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / max_abs(b).max(1e-12)
}

#[test]
fn the_3d_convolution_equals_the_composed_reference_forward_and_backward() {
    // (rows, c_in, c_out, side, kernel, padding, stride)
    for &(n, ci, co, side, k, p, s) in &[
        (2, 3, 4, 6, 3, 1, 1),
        (2, 2, 5, 7, 5, 2, 1),
        (3, 4, 6, 8, 2, 0, 2),
        (1, 2, 3, 5, 3, 0, 2),
        (2, 1, 4, 4, 1, 0, 1),
    ] {
        // An uneven height at stride 1 (candle's own 2-D backward fails on strides that
        // leave a remainder, so the reference keeps those even).
        let h = side + usize::from(s == 1);
        let x = Var::from_tensor(&random(1, &[n, ci, side, h, side])).unwrap();
        let w = Var::from_tensor(&(random(2, &[co, ci, k, k, k]) * 0.3).unwrap()).unwrap();
        let dy = random(
            3,
            &[
                n,
                co,
                (side + 2 * p - k) / s + 1,
                (h + 2 * p - k) / s + 1,
                (side + 2 * p - k) / s + 1,
            ],
        );
        let got = gradcache::nn::cpu::conv3d(x.as_tensor(), w.as_tensor(), p, s).unwrap();
        let want = conv3d_reference(x.as_tensor(), w.as_tensor(), p, s);
        assert_eq!(got.dims(), want.dims());
        assert!(
            rel(&got, &want) < 1e-5,
            "forward {:?}: {}",
            (n, ci, co, side, k, p, s),
            rel(&got, &want)
        );
        let g_got = (got * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let g_want = (want * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("input", &x), ("kernel", &w)] {
            let (a, b) = (
                g_got.get(v.as_tensor()).unwrap(),
                g_want.get(v.as_tensor()).unwrap(),
            );
            assert!(
                rel(a, b) < 1e-5,
                "{name} gradient {:?}: {}",
                (n, ci, co, side, k, p, s),
                rel(a, b)
            );
        }
    }
}

#[test]
fn the_3d_convolution_over_many_pieces_equals_one_piece() {
    // 64 channels x 5^3 taps x 16^2 positions x 4 bytes = 8 MiB a plane: four planes a
    // piece, so a 16-deep volume runs in 4 pieces a row.
    let x = Var::from_tensor(&random(4, &[2, 64, 16, 16, 16])).unwrap();
    let w = Var::from_tensor(&(random(5, &[3, 64, 5, 5, 5]) * 0.05).unwrap()).unwrap();
    let dy = random(6, &[2, 3, 16, 16, 16]);
    let got = gradcache::nn::cpu::conv3d(x.as_tensor(), w.as_tensor(), 2, 1).unwrap();
    let want = conv3d_reference(x.as_tensor(), w.as_tensor(), 2, 1);
    assert!(rel(&got, &want) < 1e-5, "{}", rel(&got, &want));
    let g_got = (got * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let g_want = (want * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    for v in [&x, &w] {
        let (a, b) = (
            g_got.get(v.as_tensor()).unwrap(),
            g_want.get(v.as_tensor()).unwrap(),
        );
        assert!(rel(a, b) < 1e-5, "{}", rel(a, b));
    }
}

#[test]
fn bad_3d_convolution_shapes_are_refused_by_name() {
    let w = random(1, &[4, 3, 3, 3, 3]);
    for x in [
        random(2, &[2, 3, 8, 8]),
        random(2, &[2, 2, 8, 8, 8]),
        random(2, &[2, 3, 1, 8, 8]),
    ] {
        let err = gradcache::nn::cpu::conv3d(&x, &w, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("conv3d"), "{err}");
    }
    let x = random(2, &[2, 3, 8, 8, 8])
        .to_dtype(candle_core::DType::F64)
        .unwrap();
    let err = gradcache::nn::cpu::conv3d(&x, &w, 1, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32"), "{err}");
}

fn config(memory_efficient: bool) -> VNetConfig {
    VNetConfig {
        in_channels: 1,
        width: 4,
        stages: vec![1, 2],
        kernel: 3,
        memory_efficient,
        output: 6,
    }
}

fn tower(store: &ParamStore, cfg: &VNetConfig, policy: Recompute) -> Recomputed<VNet> {
    let tower = Tower::build(store, "", |vb| VNet::new(cfg, vb)).unwrap();
    Recomputed::new(tower, policy).unwrap()
}

fn volumes(seed: u64, rows: usize) -> Tensor {
    random(seed, &[rows, 1, 8, 8, 8])
}

#[test]
fn parameters_and_buffers_carry_vnet_pytorch_names() {
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let enc = tower(&store, &config(true), Recompute::Off);
    let names: Vec<String> = enc.params().names().map(String::from).collect();
    for want in [
        "in_tr.conv1.weight",
        "in_tr.bn1.weight",
        "in_tr.relu1.weight",
        "down_tr8.down_conv.weight",
        "down_tr8.bn1.bias",
        "down_tr8.relu1.weight",
        "down_tr8.ops.0.conv1.weight",
        "down_tr8.ops.0.relu1.weight",
        "down_tr8.relu2.weight",
        "down_tr16.ops.1.bn1.weight",
        "fc.weight",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // Input transition, 2 down convolutions, 3 stage convolutions: 6 BatchNorms.
    assert_eq!(enc.buffers().len(), 2 * 6);
    let w = store.get("down_tr16.down_conv.weight").unwrap();
    assert_eq!(w.as_tensor().dims(), &[16, 8, 2, 2, 2]);
    let w = store.get("down_tr16.ops.0.conv1.weight").unwrap();
    assert_eq!(w.as_tensor().dims(), &[16, 16, 3, 3, 3]);
    let out = enc.encode(&volumes(1, 2), &Ctx::eval()).unwrap();
    assert_eq!(out.dims(), &[2, 6]);
}

#[test]
fn memory_efficient_units_equal_the_plain_ones_and_move_statistics_once() {
    let x = volumes(11, 5);
    let cot = random(12, &[5, 6]);
    let ctx = train_ctx(0);
    let build = |memory_efficient| {
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let enc = tower(&store, &config(memory_efficient), Recompute::Off);
        (store, enc)
    };
    let ((_a, plain), (_b, efficient)) = (build(false), build(true));
    // Different arithmetic (one kernel against composed ops), the same function: outputs
    // within 1e-5 of their largest value, every gradient within 1e-4 of its tensor's
    // largest value (floored at 1e-3 of the largest gradient).
    let (p, e) = (
        plain.encode(&x, &ctx).unwrap(),
        efficient.encode(&x, &ctx).unwrap(),
    );
    assert!(rel(&e, &p) < 1e-5, "outputs: {}", rel(&e, &p));
    let want = plain.replay(&x, &cot, &ctx).unwrap();
    let got = efficient.replay(&x, &cot, &ctx).unwrap();
    assert_eq!(want.len(), plain.params().len(), "every parameter");
    assert_eq!(got.len(), want.len(), "every parameter");
    let global = want.iter().map(|(_, w)| max_abs(w)).fold(0.0, f64::max);
    for (name, w) in want.iter() {
        assert!(max_abs(w) > 0.0, "{name}: zero gradient");
        let err = max_diff(got.get(name).unwrap(), w) / max_abs(w).max(1e-3 * global);
        assert!(err < 1e-4, "{name}: off by {err:e}");
    }
    // A training forward with a graph that moves the statistics, and its backward (which
    // recomputes the units): the statistics move once, as the plain tower's do.
    let start = snapshot(&efficient.buffers());
    for enc in [&plain, &efficient] {
        let y = enc.forward(&x, &ctx.updating_stats()).unwrap();
        y.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let moved = efficient.buffers();
    assert_ne!(snapshot(&moved), start);
    for ((name, a), (_, b)) in moved.iter().zip(plain.buffers().iter()) {
        let err = max_diff(a.as_tensor(), b.as_tensor()) / max_abs(b.as_tensor()).max(1e-6);
        assert!(err < 1e-5, "{name}: {err:e}");
    }
}

#[test]
fn memory_efficient_units_over_several_pieces_of_rows_equal_the_plain_ones() {
    // The input transition's output is 16 channels x 64^3 x 4 bytes = 16 MiB a volume:
    // its backward recomputes it two volumes at a time (32 MiB), so three volumes take
    // two pieces (and its residual is the tiled input).
    let cfg = |memory_efficient| VNetConfig {
        width: 16,
        stages: vec![1],
        ..config(memory_efficient)
    };
    let x = random(31, &[3, 1, 64, 64, 64]);
    let cot = random(32, &[3, 6]);
    let ctx = train_ctx(0);
    let grads = |memory_efficient| {
        let store = ParamStore::new(5, DType::F32, &Device::Cpu);
        tower(&store, &cfg(memory_efficient), Recompute::Off)
            .replay(&x, &cot, &ctx)
            .unwrap()
    };
    let (want, got) = (grads(false), grads(true));
    let global = want.iter().map(|(_, w)| max_abs(w)).fold(0.0, f64::max);
    for (name, w) in want.iter() {
        let err = max_diff(got.get(name).unwrap(), w) / max_abs(w).max(1e-3 * global);
        // Measured: every tensor of the down stage within 7e-6; the input transition's
        // (the two pieces) within 3.6e-4, its gradients being sums over 786,432 voxels
        // that the two sides group differently (the plain tower sums its PReLU slope's
        // gradient in f32, candle's broadcast reduction); an offset wrong by a piece would
        // be off by the gradient itself.
        let tol = if name.starts_with("in_tr.") {
            1e-3
        } else {
            5e-5
        };
        assert!(err < tol, "{name}: off by {err:e}");
    }
}

#[test]
fn every_policy_gives_off_gradients_bit_for_bit_and_leaves_running_statistics_alone() {
    for memory_efficient in [false, true] {
        let store = ParamStore::new(4, DType::F32, &Device::Cpu);
        let x = volumes(21, 6);
        let cot = random(22, &[6, 6]);
        let ctx = train_ctx(0);
        let mut enc = tower(&store, &config(memory_efficient), Recompute::Off);
        let before = snapshot(&enc.buffers());
        let reference = enc.replay(&x, &cot, &ctx).unwrap();
        for policy in [
            Recompute::EveryLayer,
            Recompute::Sqrt,
            Recompute::Layers(vec![2]),
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
    let (q, p) = (volumes(41, 8), volumes(42, 8));
    for memory_efficient in [false, true] {
        let build = |policy| {
            let store = ParamStore::new(6, DType::F32, &Device::Cpu);
            let loss = InfoNce::new(0.1)
                .unwrap()
                .with_similarity(Similarity::Cosine);
            GradCache::shared(
                tower(&store, &config(memory_efficient), policy),
                chunk,
                loss,
            )
            .unwrap()
        };
        let reference = build(Recompute::Off);
        let (want_loss, want) = common::chunkwise_reference(&reference, &q, &p, chunk);
        let want_stats = snapshot(&reference.buffers().unwrap());
        for policy in [Recompute::Off, Recompute::EveryLayer] {
            let what = format!("memory_efficient {memory_efficient}, {policy}");
            let gc = build(policy.clone());
            let out = gc.cache_step(0, &q, &p).unwrap();
            assert!(
                (out.loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
                "{what}"
            );
            // Each gradient within f32 rounding of the reference's: max |difference| <=
            // 1e-4 of the tensor's largest value, floored at 1e-3 of the largest gradient.
            assert_eq!(out.grads.len(), want.len());
            let global = want.iter().map(|(_, w)| max_abs(w)).fold(0.0, f64::max);
            for (name, w) in want.iter() {
                let diff = max_diff(out.grads.get(name).unwrap(), w);
                let err = diff / max_abs(w).max(1e-3 * global);
                assert!(err <= 1e-4, "{what}: {name} off by {err:e}");
            }
            assert_eq!(snapshot(&gc.buffers().unwrap()), want_stats, "{what}");
        }
    }
}

#[test]
fn bad_sizes_and_volumes_are_refused_by_name() {
    let store = ParamStore::new(7, DType::F32, &Device::Cpu);
    for (cfg, field) in [
        (
            VNetConfig {
                width: 0,
                ..config(true)
            },
            "vnet",
        ),
        (
            VNetConfig {
                in_channels: 3,
                ..config(true)
            },
            "vnet.width",
        ),
        (
            VNetConfig {
                stages: vec![],
                ..config(true)
            },
            "vnet.stages",
        ),
        (
            VNetConfig {
                stages: vec![1, 0],
                ..config(true)
            },
            "vnet.stages",
        ),
        (
            VNetConfig {
                kernel: 4,
                ..config(true)
            },
            "vnet.kernel",
        ),
    ] {
        let err = Tower::build(&store, "", |vb| VNet::new(&cfg, vb))
            .err()
            .unwrap();
        assert!(err.to_string().contains(field), "{field}: {err}");
    }
    let enc = tower(&store, &config(true), Recompute::Off);
    for (x, want) in [
        (random(1, &[2, 1, 8, 8]), "[rows, channels, depth"),
        (random(1, &[2, 2, 8, 8, 8]), "in_channels"),
        (random(1, &[2, 1, 8, 6, 8]), "multiple of 2^"),
    ] {
        let err = enc.encode(&x, &Ctx::eval()).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
        let err = enc.encode(&x, &train_ctx(0)).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}
