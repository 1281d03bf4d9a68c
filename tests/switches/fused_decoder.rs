//! The decoder layer node (`src/nn/decoder_layer.rs`, on the grouped attention kernel)
//! against the op-by-op layer it replaces: a whole cached step, loss and every parameter
//! gradient, two towers, dropout on the probabilities, batches padded on the left and on
//! the right, for each family's layout (q/k norms and an explicit head width, one KV head
//! with q/k/v biases, attention and MLP biases, a causal window, Gemma's norms and
//! bidirectional windowed layers); selective recompute bit for bit; the node against
//! finite differences in f64. One test binary: it switches the kernels for the process.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::{
    Ctx, GradCache, Gradients, InfoNce, ParamStore, Recompute, StepOutput, TokenBatch,
};

use crate::common;
use crate::common::decoders::{config, perturb, tokens, FAMILIES};
use crate::common::{max_abs, max_diff};

fn step(family: &str, fused: bool, recompute: Recompute, left: bool) -> StepOutput {
    gradcache::nn::set_fused_kernels(fused);
    let cfg = config(family);
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = |pooling| BertOptions {
        lora: None,
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
    gc.cache_step(2, &tokens(1, 6, left), &tokens(2, 12, left))
        .unwrap()
}

/// The largest error of `got` against `want` over the parameters, each relative to its
/// largest entry (floored at 1e-3 of the largest in the model).
fn gradient_error(got: &Gradients, want: &Gradients) -> f64 {
    let global = want.iter().map(|(_, g)| max_abs(g)).fold(0.0, f64::max);
    assert_eq!(got.len(), want.len(), "the same parameters get gradients");
    want.iter()
        .map(|(name, w)| {
            let g = got
                .get(name)
                .unwrap_or_else(|| panic!("no gradient for `{name}`"));
            max_diff(g, w) / max_abs(w).max(1e-3 * global)
        })
        .fold(0.0, f64::max)
}

#[test]
fn the_layer_node_gives_the_composed_step() {
    let _switches = crate::switching();
    let result = std::panic::catch_unwind(|| {
        for family in FAMILIES {
            for left in [true, false] {
                for recompute in [Recompute::Off, Recompute::EveryLayer] {
                    let what = format!("{family}, left padding {left}, {recompute:?}");
                    let composed = step(family, false, recompute.clone(), left);
                    let fused = step(family, true, recompute.clone(), left);
                    let loss_err = ((fused.loss - composed.loss) / composed.loss).abs();
                    assert!(
                        loss_err <= 1e-6,
                        "{what}: loss {} vs {}",
                        fused.loss,
                        composed.loss
                    );
                    let err = gradient_error(&fused.grads, &composed.grads);
                    assert!(err <= 1e-5, "{what}: max gradient error {err:e}");
                }
                // Selective recompute of the probabilities: the gradients of keeping
                // them, bit for bit.
                let off = step(family, true, Recompute::Off, left);
                let selective = step(family, true, Recompute::Attention, left);
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
    });
    gradcache::nn::set_fused_kernels(true);
    result.unwrap();
}

/// `sum(hidden_states * r)` for a fixed `r` over the real tokens: a scalar of the whole
/// stack, in f64.
fn probe(store: &ParamStore, cfg: &BertConfig, batch: &TokenBatch) -> (Tensor, f64) {
    let enc = BertEncoder::build(store, "", cfg, &BertOptions::default()).unwrap();
    let h = enc
        .tower()
        .graph_model()
        .hidden_states(batch, &Ctx::eval())
        .unwrap();
    // Real tokens only: at padding the node writes 0, the composed layer what it computes.
    let mask = batch
        .attention_mask
        .to_dtype(DType::F64)
        .unwrap()
        .unsqueeze(2)
        .unwrap();
    let r = common::random(9, h.dims())
        .to_dtype(DType::F64)
        .unwrap()
        .broadcast_mul(&mask)
        .unwrap();
    let value = (&h * &r).unwrap().sum_all().unwrap();
    let scalar = value.to_scalar::<f64>().unwrap();
    (value, scalar)
}

#[test]
fn the_layer_node_matches_finite_differences() {
    let _switches = crate::steady();
    for family in ["qwen3", "gemma3_text", "llama"] {
        let mut cfg = config(family);
        cfg.num_hidden_layers = 2;
        cfg.extra.insert("attention_dropout".into(), 0.0.into());
        if family == "gemma3_text" {
            cfg.extra.insert(
                "layer_types".into(),
                serde_json::json!(["sliding_attention", "full_attention"]),
            );
        }
        let store = ParamStore::new(3, DType::F64, &Device::Cpu);
        let batch = tokens(4, 3, true);
        let _ = BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
        perturb(&store);
        let (value, _) = probe(&store, &cfg, &batch);
        let grads = value.backward().unwrap();
        for (name, var) in store.params().iter() {
            if name.starts_with("embed_tokens") {
                continue; // Its rows are checked through the layers' inputs.
            }
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("{family}: no gradient for `{name}`"));
            let flat: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
            let values: Vec<f64> = var.flatten_all().unwrap().to_vec1().unwrap();
            // The entry with the largest gradient, and the first.
            let big = flat
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap()
                .0;
            for at in [0, big] {
                let eps = 1e-6;
                let mut nudged = values.clone();
                nudged[at] += eps;
                var.set(&Tensor::from_vec(nudged.clone(), var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let up = probe(&store, &cfg, &batch).1;
                nudged[at] -= 2.0 * eps;
                var.set(&Tensor::from_vec(nudged, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let down = probe(&store, &cfg, &batch).1;
                var.set(&Tensor::from_vec(values.clone(), var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let numeric = (up - down) / (2.0 * eps);
                let err = (numeric - flat[at]).abs() / flat[at].abs().max(1e-3);
                assert!(
                    err <= 1e-5,
                    "{family}: `{name}`[{at}]: node {} vs finite differences {numeric}",
                    flat[at]
                );
            }
        }
    }
}
