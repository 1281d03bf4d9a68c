//! The GPU layer nodes (`gradcache::nn::gpu`) proved on the CPU, where they run through
//! the reference forms of their CUDA kernels: BERT's layer node gives the composed layer's
//! cached step (loss and every parameter gradient, dropout on, padded rows, two towers,
//! BERT and MPNet with its relative position bias), its selective-recompute sites give the
//! gradients of keeping, bit for bit, and every gradient of one node matches f64 finite
//! differences; the decoder node gives the op-by-op step of every decoder family's layout
//! (q/k norms, grouped heads, biases, causal and windowed patterns, Gemma's norms,
//! bidirectional layers), padded on the left and on the right. `gradcache self-check --device cuda` holds the CUDA kernels to the same
//! reference forms on a GPU.

use candle_core::{DType, Device, Tensor, Var};
use gradcache::bert::{BertEncoder, BertOptions, Pooling};
use gradcache::nn::cpu::encoder_layer::{LayerSpec, LayerWeights};
use gradcache::nn::{Act, AttentionSpec};
use gradcache::{GradCache, InfoNce, ParamStore, Precision, Recompute, StepOutput};

use crate::common;
use crate::common::encoders::{config, key_biases, tokens, LAYOUTS};
use crate::common::rel_err_with_zeros;

/// One cached step of two towers with the CPU's nodes off: through the GPU nodes with
/// `gpu`, else the composed layer op by op.
fn step(family: &str, gpu: bool, recompute: Recompute, precision: Precision) -> StepOutput {
    gradcache::nn::set_fused_kernels(false);
    gradcache::nn::run_gpu_nodes_on_cpu(gpu);
    let cfg = config(family);
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = |pooling| BertOptions {
        lora: None,
        pooling,
        normalize: true,
        recompute: recompute.clone(),
        precision,
        dense: Vec::new(),
        multi_vector: false,
        sparse: None,
        classifier: None,
    };
    let q = BertEncoder::build(&store, "query", &cfg, &options(Pooling::Cls)).unwrap();
    let p = BertEncoder::build(&store, "passage", &cfg, &options(Pooling::Mean)).unwrap();
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::two_towers(q, p, 3, 4, loss)
        .unwrap()
        .with_seed(5);
    let out = gc.cache_step(2, &tokens(1, 6), &tokens(2, 12)).unwrap();
    gradcache::nn::run_gpu_nodes_on_cpu(false);
    gradcache::nn::set_fused_kernels(true);
    out
}

#[test]
fn the_gpu_layer_node_gives_the_composed_step() {
    let _switches = crate::switching();
    for family in LAYOUTS {
        let zero = key_biases(family, 3);
        let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
        for recompute in [Recompute::Off, Recompute::EveryLayer] {
            let composed = step(family, false, recompute.clone(), Precision::F32);
            let node = step(family, true, recompute.clone(), Precision::F32);
            let loss_err = ((node.loss - composed.loss) / composed.loss).abs();
            assert!(
                loss_err <= 1e-6,
                "{family} {recompute:?}: loss {} vs {}",
                node.loss,
                composed.loss
            );
            assert_eq!(node.grads.len(), composed.grads.len());
            let err = rel_err_with_zeros(&node.grads, &composed.grads, &zero, 1e-5);
            assert!(
                err <= 1e-5,
                "{family} {recompute:?}: max relative gradient error {err:e}"
            );
        }

        // In bf16 the node and the composed layer round at different places: the same
        // step within bf16's tolerance.
        let composed = step(family, false, Recompute::Off, Precision::Bf16);
        let node = step(family, true, Recompute::Off, Precision::Bf16);
        let loss_err = ((node.loss - composed.loss) / composed.loss).abs();
        assert!(
            loss_err <= 1e-2,
            "{family} bf16: loss {} vs {}",
            node.loss,
            composed.loss
        );
        let err = rel_err_with_zeros(&node.grads, &composed.grads, &zero, 5e-2);
        assert!(
            err <= 5e-2,
            "{family} bf16: max relative gradient error {err:e}"
        );

        // Selective recompute: the gradients of keeping, bit for bit.
        let off = step(family, true, Recompute::Off, Precision::F32);
        let policy = Recompute::Selective {
            segments: Box::new(Recompute::Off),
            keep: vec![],
        };
        for policy in [Recompute::Attention, policy] {
            let got = step(family, true, policy.clone(), Precision::F32);
            assert_eq!(
                got.loss.to_bits(),
                off.loss.to_bits(),
                "{family} {policy:?}"
            );
            for (name, want) in off.grads.iter() {
                let g = got.grads.get(name).expect("a gradient");
                assert_eq!(
                    common::bits(g),
                    common::bits(want),
                    "{family} {policy:?}: `{name}` differs from keeping"
                );
            }
        }
    }
}

fn var(seed: u64, dims: &[usize], scale: f64) -> Var {
    let t = (common::random(seed, dims).to_dtype(DType::F64).unwrap() * scale).unwrap();
    Var::from_tensor(&t).unwrap()
}

/// One layer node in f64 with dropout, a padded key and a relative score bias: every
/// input's gradient against central finite differences of `sum(y * c)`.
#[test]
fn every_gradient_of_the_node_matches_finite_differences() {
    let _switches = crate::steady();
    let (n, s, h, heads, inter) = (2, 5, 8, 2, 12);
    let x = var(1, &[n, s, h], 1.0);
    let shapes: [&[usize]; 16] = [
        &[h, h],
        &[h, h],
        &[h, h],
        &[h],
        &[h],
        &[h],
        &[h, h],
        &[h],
        &[h],
        &[h],
        &[inter, h],
        &[inter],
        &[h, inter],
        &[h],
        &[h],
        &[h],
    ];
    let weights: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let v = var(10 + i as u64, d, 0.5);
            if i == 8 || i == 14 {
                // LayerNorm scales near 1.
                Var::from_tensor(&(v.as_tensor() + 1.0).unwrap()).unwrap()
            } else {
                v
            }
        })
        .collect();
    let score_bias = var(40, &[1, heads, s, s], 0.3);
    // The second text's last key is padding.
    let mut mask = vec![0f64; n * s];
    mask[n * s - 1] = gradcache::nn::MASKED_BIAS;
    let key_bias = Tensor::from_vec(mask, (n, 1, 1, s), &Device::Cpu).unwrap();
    let c = common::random(50, &[n, s, h]).to_dtype(DType::F64).unwrap();
    let w: Vec<&Tensor> = weights.iter().map(|v| v.as_tensor()).collect();
    let spec = LayerSpec {
        heads,
        act: Act::GeluErf,
        eps: 1e-5,
        attention: AttentionSpec {
            bias: key_bias,
            scale: 1.0 / ((h / heads) as f64).sqrt(),
            dropout: Some((7, 0.2)),
            recompute: false,
            window: None,
        },
        attention_output_dropout: Some((8, 0.2)),
        output_dropout: Some((9, 0.2)),
        recompute_attention_norm: false,
        recompute_intermediate: false,
        recompute_output_norm: false,
        score_bias: Some(score_bias.as_tensor().clone()),
        relative: None,
    };
    let loss = |x: &Tensor, w: &[&Tensor], sb: &Tensor| -> f64 {
        let weights = LayerWeights {
            qkv: [w[0], w[1], w[2]],
            qkv_bias: [w[3], w[4], w[5]],
            attention_output: (w[6], w[7]),
            attention_norm: (w[8], w[9]),
            intermediate: (w[10], w[11]),
            output: (w[12], w[13]),
            output_norm: (w[14], w[15]),
            lora: Default::default(),
        };
        let spec = LayerSpec {
            score_bias: Some(sb.clone()),
            ..spec.clone()
        };
        let y = gradcache::nn::gpu::encoder_layer(x, &weights, &spec).unwrap();
        (y * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    // The analytic gradients.
    let weights_t = LayerWeights {
        qkv: [w[0], w[1], w[2]],
        qkv_bias: [w[3], w[4], w[5]],
        attention_output: (w[6], w[7]),
        attention_norm: (w[8], w[9]),
        intermediate: (w[10], w[11]),
        output: (w[12], w[13]),
        output_norm: (w[14], w[15]),
        lora: Default::default(),
    };
    let y = gradcache::nn::gpu::encoder_layer(x.as_tensor(), &weights_t, &spec).unwrap();
    let grads = (y * &c).unwrap().sum_all().unwrap().backward().unwrap();

    let mut inputs: Vec<(&str, &Var)> = vec![("x", &x)];
    let names = [
        "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "g1", "b1", "wi", "bi", "wd", "bd", "g2",
        "b2",
    ];
    inputs.extend(names.iter().zip(&weights).map(|(n, v)| (*n, v)));
    inputs.push(("score bias", &score_bias));
    let eps = 1e-6;
    for (k, (name, v)) in inputs.iter().enumerate() {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let flat = v
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let largest = g.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(
            largest > 0.0 || *name == "bk",
            "{name}: an all-zero gradient"
        );
        for e in [0, flat.len() / 3, flat.len() - 1] {
            let shifted = |delta: f64| -> f64 {
                let mut values = flat.clone();
                values[e] += delta;
                let t = Tensor::from_vec(values, v.as_tensor().shape(), &Device::Cpu).unwrap();
                let mut ws: Vec<Tensor> = w.iter().map(|t| t.detach()).collect();
                let mut xs = x.as_tensor().detach();
                let mut sb = score_bias.as_tensor().detach();
                match k {
                    0 => xs = t,
                    17 => sb = t,
                    i => ws[i - 1] = t,
                }
                let refs: Vec<&Tensor> = ws.iter().collect();
                loss(&xs, &refs, &sb)
            };
            let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
            let err = (numeric - g[e]).abs();
            assert!(
                err <= 1e-6 * largest.max(1.0),
                "{name}[{e}]: analytic {} vs numeric {numeric} (largest {largest})",
                g[e]
            );
        }
    }
}

/// One cached two-tower step of a tiny decoder of `family`'s layout (left or right
/// padding, dropout on the probabilities) with the CPU's nodes off: through the GPU
/// decoder node with `gpu`, else op by op.
fn decoder_step(family: &str, gpu: bool, recompute: Recompute, left: bool) -> StepOutput {
    use common::decoders::{config, perturb, tokens};
    gradcache::nn::set_fused_kernels(false);
    gradcache::nn::run_gpu_nodes_on_cpu(gpu);
    let cfg = config(family);
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = |pooling| BertOptions {
        pooling,
        normalize: true,
        recompute: recompute.clone(),
        ..Default::default()
    };
    let q = BertEncoder::build(&store, "query", &cfg, &options(Pooling::LastToken)).unwrap();
    let p = BertEncoder::build(&store, "passage", &cfg, &options(Pooling::Mean)).unwrap();
    perturb(&store);
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::two_towers(q, p, 3, 4, loss)
        .unwrap()
        .with_seed(5);
    let out = gc
        .cache_step(2, &tokens(1, 6, left), &tokens(2, 12, left))
        .unwrap();
    gradcache::nn::run_gpu_nodes_on_cpu(false);
    gradcache::nn::set_fused_kernels(true);
    out
}

/// The largest error of `got` against `want` over the parameters, each relative to its
/// largest entry (floored at 1e-3 of the largest in the model).
fn gradient_error(got: &gradcache::Gradients, want: &gradcache::Gradients) -> f64 {
    let global = want
        .iter()
        .map(|(_, g)| common::max_abs(g))
        .fold(0.0, f64::max);
    assert_eq!(got.len(), want.len(), "the same parameters get gradients");
    want.iter()
        .map(|(name, w)| {
            let g = got
                .get(name)
                .unwrap_or_else(|| panic!("no gradient for `{name}`"));
            common::max_diff(g, w) / common::max_abs(w).max(1e-3 * global)
        })
        .fold(0.0, f64::max)
}

#[test]
fn the_gpu_decoder_node_gives_the_composed_step() {
    let _switches = crate::switching();
    for family in common::decoders::FAMILIES {
        for left in [true, false] {
            let what = format!("{family}, left padding {left}");
            let composed = decoder_step(family, false, Recompute::Off, left);
            let node = decoder_step(family, true, Recompute::Off, left);
            let loss_err = ((node.loss - composed.loss) / composed.loss).abs();
            assert!(
                loss_err <= 1e-6,
                "{what}: loss {} vs {}",
                node.loss,
                composed.loss
            );
            let err = gradient_error(&node.grads, &composed.grads);
            assert!(err <= 1e-5, "{what}: max gradient error {err:e}");
        }
        // Recomputing the probabilities gives keeping's gradients bit for bit.
        let off = decoder_step(family, true, Recompute::Off, true);
        let selective = decoder_step(family, true, Recompute::Attention, true);
        assert_eq!(off.loss.to_bits(), selective.loss.to_bits(), "{family}");
        for (name, g) in off.grads.iter() {
            assert_eq!(
                common::bits(g),
                common::bits(selective.grads.get(name).unwrap()),
                "{family}: `{name}` under selective recompute"
            );
        }
    }
}

/// One cached step of a shared tower of `family` (a BERT, or a tiny decoder's layout)
/// with LoRA adapters of rank 2 on every projection (dropout `p` on their inputs, B moved
/// off zero) and the base frozen, with the CPU's nodes off: through the GPU nodes with
/// `gpu`, else op by op.
fn lora_step(family: &str, gpu: bool, p: f64) -> StepOutput {
    use gradcache::nn::lora::LoraSpec;
    gradcache::nn::set_fused_kernels(false);
    gradcache::nn::run_gpu_nodes_on_cpu(gpu);
    let decoder = family != "bert";
    let cfg = if decoder {
        common::decoders::config(family)
    } else {
        config(family)
    };
    let store = ParamStore::new(7, DType::F32, &Device::Cpu)
        .with_frozen(gradcache::params::Freeze::default().all_but_adapters());
    let options = BertOptions {
        pooling: if decoder {
            Pooling::LastToken
        } else {
            Pooling::Mean
        },
        normalize: true,
        lora: Some(LoraSpec {
            rank: 2,
            alpha: 4.0,
            targets: vec![],
            rslora: false,
            dropout: p,
        }),
        ..Default::default()
    };
    let enc = BertEncoder::build(&store, "", &cfg, &options).unwrap();
    for (i, (name, var)) in store.params().iter().enumerate() {
        if name.contains(".lora_B.") {
            let moved = common::random(40 + i as u64, var.dims())
                .affine(0.3, 0.0)
                .unwrap();
            var.set(&moved).unwrap();
        }
    }
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::shared(enc, 4, loss).unwrap().with_seed(5);
    let (q, p) = if decoder {
        (
            common::decoders::tokens(1, 6, true),
            common::decoders::tokens(2, 6, true),
        )
    } else {
        (tokens(1, 6), tokens(2, 6))
    };
    let out = gc.cache_step(3, &q, &p).unwrap();
    gradcache::nn::run_gpu_nodes_on_cpu(false);
    gradcache::nn::set_fused_kernels(true);
    out
}

#[test]
fn lora_adapters_inside_the_gpu_nodes_give_the_composed_step() {
    let _switches = crate::switching();
    for family in ["bert", "qwen3", "gemma3_text"] {
        let composed = lora_step(family, false, 0.3);
        let node = lora_step(family, true, 0.3);
        assert!(
            !node.grads.is_empty() && node.grads.iter().all(|(n, _)| n.contains(".lora_")),
            "{family}: only the adapters train"
        );
        let loss_err = ((node.loss - composed.loss) / composed.loss).abs();
        assert!(
            loss_err <= 1e-6,
            "{family}: loss {} vs {}",
            node.loss,
            composed.loss
        );
        let err = gradient_error(&node.grads, &composed.grads);
        assert!(err <= 1e-5, "{family}: max gradient error {err:e}");
        // The adapters' dropout acts (the masks are drawn inside the node).
        let plain = lora_step(family, true, 0.0);
        assert!(
            (plain.loss - node.loss).abs() > 1e-5,
            "{family}: LoRA dropout changed nothing"
        );
    }
}
