//! The trainer's optimiser against hand-computed updates, its saveable state, the learning
//! rate schedule and gradient clipping.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};
use gradcache::train::optim::{clip_grad_norm, decays, Optimizer, OptimizerKind, Schedule};
use gradcache::{Gradients, Params};

/// A tensor of `values`; a `weight` is a `[1, n]` matrix (AdamW decays only tensors of
/// two or more dimensions), anything else a vector.
fn tensor(name: &str, values: &[f32]) -> Tensor {
    let t = Tensor::new(values, &Device::Cpu).unwrap();
    if name.ends_with("weight") {
        t.unsqueeze(0).unwrap()
    } else {
        t
    }
}

fn params(values: &[(&str, &[f32])]) -> Params {
    Params::new(
        values
            .iter()
            .map(|(n, v)| (n.to_string(), Var::from_tensor(&tensor(n, v)).unwrap())),
    )
}

fn grads(values: &[(&str, &[f32])]) -> Gradients {
    values
        .iter()
        .map(|(n, v)| (n.to_string(), tensor(n, v)))
        .collect()
}

fn value(p: &Params, name: &str) -> Vec<f32> {
    let t = p.get(name).unwrap().as_tensor().flatten_all().unwrap();
    t.to_vec1::<f32>().unwrap()
}

/// One AdamW update of one scalar, written out: decoupled decay, then the Adam step.
#[allow(clippy::too_many_arguments)]
fn adamw_by_hand(w: f64, g: f64, m: &mut f64, v: &mut f64, t: i32, lr: f64, wd: f64) -> f64 {
    let (b1, b2, eps) = (0.9, 0.999, 1e-8);
    *m = b1 * *m + (1.0 - b1) * g;
    *v = b2 * *v + (1.0 - b2) * g * g;
    let m_hat = *m / (1.0 - f64::powi(b1, t));
    let v_hat = *v / (1.0 - f64::powi(b2, t));
    w * (1.0 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
}

#[test]
fn adamw_matches_a_hand_computed_update() {
    let p = params(&[("layer.weight", &[1.0, -2.0]), ("layer.bias", &[0.5, 0.25])]);
    let mut opt = Optimizer::new(OptimizerKind::adamw(), p.clone()).unwrap();
    let steps: [[f32; 4]; 3] = [
        [0.5, 0.1, -0.2, 0.3],
        [-0.5, 0.3, 0.1, 0.1],
        [0.05, -0.4, 0.2, -0.3],
    ];
    let mut want = [1.0f64, -2.0, 0.5, 0.25];
    let (mut m, mut v) = ([0f64; 4], [0f64; 4]);
    for (t, g) in steps.iter().enumerate() {
        let lr = 0.1;
        opt.step(
            t as u64,
            &grads(&[("layer.weight", &g[..2]), ("layer.bias", &g[2..])]),
            lr,
        )
        .unwrap();
        for i in 0..4 {
            let wd = if i < 2 { 0.01 } else { 0.0 }; // biases are not decayed
            want[i] = adamw_by_hand(
                want[i],
                f64::from(g[i]),
                &mut m[i],
                &mut v[i],
                t as i32 + 1,
                lr,
                wd,
            );
        }
        let got: Vec<f32> = [value(&p, "layer.weight"), value(&p, "layer.bias")].concat();
        for i in 0..4 {
            assert!(
                (f64::from(got[i]) - want[i]).abs() < 1e-6,
                "step {t}, entry {i}: {} vs {}",
                got[i],
                want[i]
            );
        }
    }
}

#[test]
fn weight_decay_skips_biases_and_layer_norms() {
    for name in [
        "encoder.layer.0.output.dense.weight",
        "embeddings.word_embeddings.weight",
        "fc1.weight",
    ] {
        assert!(decays(name), "{name} should decay");
    }
    for name in [
        "fc1.bias",
        "embeddings.LayerNorm.weight",
        "encoder.layer.3.output.LayerNorm.bias",
        "norm.weight",
        "blocks.2.norm.weight",
    ] {
        assert!(!decays(name), "{name} should not decay");
    }
}

#[test]
fn adamw_decays_no_tensor_of_fewer_than_two_dimensions() {
    use gradcache::train::optim::{Optimizer, OptimizerKind};
    let store = gradcache::ParamStore::new(1, candle_core::DType::F32, &candle_core::Device::Cpu);
    let vb = store.var_builder();
    let init = candle_nn::Init::Const(2.0);
    vb.get_with_hints((3, 3), "layer1.0.conv1.weight", init)
        .unwrap();
    vb.get_with_hints(3, "layer1.0.bn1.weight", init).unwrap();
    vb.get_with_hints((), "logit_scale", init).unwrap();
    let params = store.params();
    let kind = OptimizerKind::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = Optimizer::new(kind, params.clone()).unwrap();
    let zeros: gradcache::Gradients = params
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_tensor().zeros_like().unwrap()))
        .collect();
    opt.step(0, &zeros, 0.5).unwrap();
    let value = |n: &str| {
        let t = params.get(n).unwrap().as_tensor().flatten_all().unwrap();
        t.to_vec1::<f32>().unwrap()[0]
    };
    assert!((value("layer1.0.conv1.weight") - 2.0 * (1.0 - 0.5 * 0.1)).abs() < 1e-6);
    assert_eq!(value("layer1.0.bn1.weight"), 2.0);
    assert_eq!(value("logit_scale"), 2.0);
}

#[test]
fn sgd_is_w_minus_lr_g() {
    let p = params(&[("w", &[1.0, 2.0])]);
    let mut opt = Optimizer::new(OptimizerKind::Sgd, p.clone()).unwrap();
    opt.step(0, &grads(&[("w", &[0.5, -1.0])]), 0.1).unwrap();
    assert_eq!(value(&p, "w"), vec![0.95, 2.1]);
    // A parameter without a gradient is left alone.
    opt.step(1, &Gradients::default(), 0.1).unwrap();
    assert_eq!(value(&p, "w"), vec![0.95, 2.1]);
}

#[test]
fn saved_state_resumes_exactly() {
    let g = |k: f32| grads(&[("w.weight", &[0.3 * k, -0.2]), ("w.bias", &[0.1, k])]);
    let a = params(&[("w.weight", &[1.0, 2.0]), ("w.bias", &[0.0, 0.5])]);
    let mut opt_a = Optimizer::new(OptimizerKind::adamw(), a.clone()).unwrap();
    opt_a.step(0, &g(1.0), 0.01).unwrap();
    opt_a.step(1, &g(-2.0), 0.01).unwrap();
    let state: BTreeMap<String, Tensor> = opt_a.state().unwrap();

    // A second run restores weights and optimiser state, then both take the same step.
    let b = params(&[
        ("w.weight", &value(&a, "w.weight")),
        ("w.bias", &value(&a, "w.bias")),
    ]);
    let mut opt_b = Optimizer::new(OptimizerKind::adamw(), b.clone()).unwrap();
    opt_b.load_state(&state).unwrap();
    // The step number comes from the caller (the trainer's one counter, also saved).
    opt_a.step(2, &g(0.7), 0.01).unwrap();
    opt_b.step(2, &g(0.7), 0.01).unwrap();
    for name in ["w.weight", "w.bias"] {
        assert_eq!(
            value(&a, name),
            value(&b, name),
            "{name} differs after resume"
        );
    }

    // A state for other parameters is refused.
    let c = params(&[("other", &[1.0, 2.0])]);
    let mut opt_c = Optimizer::new(OptimizerKind::adamw(), c).unwrap();
    let err = opt_c.load_state(&state).unwrap_err();
    assert!(err.to_string().contains("optimizer state"), "{err}");
}

#[test]
fn invalid_hyper_parameters() {
    let bad = OptimizerKind::AdamW {
        beta1: 1.0,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let err = Optimizer::new(bad, Params::default()).err().unwrap();
    assert!(
        err.to_string()
            .starts_with("invalid value for `optim.beta1`: 1"),
        "{err}"
    );
    let bad = OptimizerKind::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 0.0,
        weight_decay: 0.0,
    };
    assert!(Optimizer::new(bad, Params::default()).is_err());
}

#[test]
fn warmup_then_linear_decay_like_transformers() {
    let s = Schedule {
        lr: 1.0,
        warmup: 2,
        total: 6,
    };
    let lrs: Vec<f64> = (0..8).map(|t| s.lr_at(t)).collect();
    assert_eq!(lrs, vec![0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]);
    let flat = Schedule {
        lr: 2e-5,
        warmup: 0,
        total: 4,
    };
    assert_eq!(flat.lr_at(0), 2e-5);
    assert_eq!(flat.lr_at(2), 1e-5);
}

#[test]
fn clipping_scales_to_the_maximum_norm() {
    let mut g = grads(&[("a", &[3.0]), ("b", &[4.0])]);
    let norm = clip_grad_norm(&mut g, 1.0).unwrap();
    assert!((norm - 5.0).abs() < 1e-9);
    let a = g.get("a").unwrap().to_vec1::<f32>().unwrap()[0];
    let b = g.get("b").unwrap().to_vec1::<f32>().unwrap()[0];
    assert!((a - 0.6).abs() < 1e-6 && (b - 0.8).abs() < 1e-6, "{a} {b}");

    let mut small = grads(&[("a", &[0.3]), ("b", &[0.4])]);
    assert!((clip_grad_norm(&mut small, 1.0).unwrap() - 0.5).abs() < 1e-7);
    assert_eq!(small.get("a").unwrap().to_vec1::<f32>().unwrap(), vec![0.3]);
}
