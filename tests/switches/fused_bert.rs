//! A whole cached BERT step with the fused kernels equals the same step with the composed
//! ops they replace: loss and every parameter gradient, dropout on, padded batches, two
//! towers with mean and CLS pooling; for BERT, for MPNet (whose whole-layer node adds the
//! trained relative position bias to the scores and gives it its gradient) and for
//! ModernBERT (the pre-norm layer node: rotary, global and windowed layers, GeGLU), with
//! and without biases. One test in its own binary: it switches the kernels for the whole
//! process.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertEncoder, BertOptions, Pooling};
use gradcache::{GradCache, InfoNce, ParamStore, Precision, Recompute, StepOutput};

use crate::common;
use crate::common::encoders::{config, key_biases, tokens, LAYOUTS};
use crate::common::rel_err_with_zeros;

fn step(family: &str, fused: bool, recompute: Recompute) -> StepOutput {
    step_in(family, fused, recompute, Precision::F32)
}

fn step_in(family: &str, fused: bool, recompute: Recompute, precision: Precision) -> StepOutput {
    gradcache::nn::set_fused_kernels(fused);
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
    gc.cache_step(2, &tokens(1, 6), &tokens(2, 12)).unwrap()
}

#[test]
fn fused_kernels_give_the_composed_step() {
    let _switches = crate::switching();
    for family in LAYOUTS {
        fused_equals_composed(family);
    }
}

fn fused_equals_composed(family: &str) {
    let cfg = config(family);
    let zero = key_biases(family, cfg.num_hidden_layers);
    let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
    for recompute in [Recompute::Off, Recompute::EveryLayer] {
        let composed = step(family, false, recompute.clone());
        let fused = step(family, true, recompute.clone());
        let loss_err = ((fused.loss - composed.loss) / composed.loss).abs();
        assert!(
            loss_err <= 1e-6,
            "{family} {recompute:?}: loss {} vs {}",
            fused.loss,
            composed.loss
        );
        assert_eq!(fused.grads.len(), composed.grads.len());
        let err = rel_err_with_zeros(&fused.grads, &composed.grads, &zero, 1e-5);
        assert!(
            err <= 1e-5,
            "{family} {recompute:?}: max relative gradient error {err:e}"
        );
        if family == "mpnet" {
            let table = "query.encoder.relative_attention_bias.weight";
            assert!(
                fused.grads.get(table).is_some(),
                "no gradient for `{table}`"
            );
        }
    }

    // Selective recompute on the composed path (what runs on a GPU) and in half
    // precision: the gradients of `off`, bit for bit.
    for (fused, precision) in [(false, Precision::F32), (true, Precision::Bf16)] {
        let off = step_in(family, fused, Recompute::Off, precision);
        for policy in [
            Recompute::Attention,
            Recompute::Selective {
                segments: Box::new(Recompute::Sqrt),
                keep: vec!["output.LayerNorm".into()],
            },
        ] {
            let got = step_in(family, fused, policy.clone(), precision);
            assert_eq!(
                got.loss.to_bits(),
                off.loss.to_bits(),
                "{family} {policy:?} {precision:?}"
            );
            assert_eq!(got.grads.len(), off.grads.len());
            for (name, want) in off.grads.iter() {
                let g = got.grads.get(name).expect("a gradient");
                let segmented = matches!(policy, Recompute::Selective { .. });
                if segmented && name.ends_with("relative_attention_bias.weight") {
                    // MPNet's table is shared by every layer: its gradient sums the
                    // layers' contributions, which segments group differently (a sum
                    // per segment), so it agrees up to rounding, not bit for bit.
                    let (a, b) = (values(g), values(want));
                    let largest = b.iter().fold(0f64, |m, v| m.max(v.abs()));
                    let err = a
                        .iter()
                        .zip(&b)
                        .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        err <= 1e-5 * largest,
                        "{family} {policy:?} {precision:?} fused={fused}: `{name}` off by {err:e} (largest {largest:e})"
                    );
                    continue;
                }
                assert_eq!(
                    common::bits(g),
                    common::bits(want),
                    "{family} {policy:?} {precision:?} fused={fused}: `{name}` differs from off"
                );
            }
        }
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .expect("gradient values")
}
