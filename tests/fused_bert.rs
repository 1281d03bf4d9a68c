//! A whole cached BERT step with the fused kernels equals the same step with the composed
//! ops they replace: loss and every parameter gradient, dropout on, padded batches, two
//! towers with mean and CLS pooling. One test in its own binary: it switches the kernels
//! for the whole process.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::{GradCache, InfoNce, ParamStore, Precision, Recompute, StepOutput, TokenBatch};

mod common;
use common::rel_err_with_zeros;

fn config() -> BertConfig {
    let mut cfg = BertConfig::new(60, 16, 3, 2, 24, 32);
    cfg.initializer_range = 0.2;
    cfg
}

/// Rows of different lengths, right-padded.
fn tokens(seed: usize, rows: usize) -> TokenBatch {
    let len = 9;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 7 + seed) % (len - 2);
        for c in 0..len {
            ids.push(if c < real {
                1 + ((r * 31 + c * 17 + seed * 13) % 59) as u32
            } else {
                0
            });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(vec![0; rows * len])).unwrap()
}

fn step(fused: bool, recompute: Recompute) -> StepOutput {
    step_in(fused, recompute, Precision::F32)
}

fn step_in(fused: bool, recompute: Recompute, precision: Precision) -> StepOutput {
    gradcache::nn::set_fused_kernels(fused);
    let cfg = config();
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = |pooling| BertOptions {
        pooling,
        normalize: true,
        recompute: recompute.clone(),
        precision,
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
    let cfg = config();
    let zero: Vec<String> = ["query.", "passage."]
        .iter()
        .flat_map(|p| {
            (0..cfg.num_hidden_layers)
                .map(move |i| format!("{p}encoder.layer.{i}.attention.self.key.bias"))
        })
        .collect();
    let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
    for recompute in [Recompute::Off, Recompute::EveryLayer] {
        let composed = step(false, recompute.clone());
        let fused = step(true, recompute.clone());
        let loss_err = ((fused.loss - composed.loss) / composed.loss).abs();
        assert!(
            loss_err <= 1e-6,
            "{recompute:?}: loss {} vs {}",
            fused.loss,
            composed.loss
        );
        assert_eq!(fused.grads.len(), composed.grads.len());
        let err = rel_err_with_zeros(&fused.grads, &composed.grads, &zero, 1e-5);
        assert!(
            err <= 1e-5,
            "{recompute:?}: max relative gradient error {err:e}"
        );
    }

    // Selective recompute on the composed path (what runs on a GPU) and in half
    // precision: the gradients of `off`, bit for bit.
    for (fused, precision) in [(false, Precision::F32), (true, Precision::Bf16)] {
        let off = step_in(fused, Recompute::Off, precision);
        for policy in [
            Recompute::Attention,
            Recompute::Selective {
                segments: Box::new(Recompute::Sqrt),
                keep: vec!["output.LayerNorm".into()],
            },
        ] {
            let got = step_in(fused, policy.clone(), precision);
            assert_eq!(
                got.loss.to_bits(),
                off.loss.to_bits(),
                "{policy:?} {precision:?}"
            );
            assert_eq!(got.grads.len(), off.grads.len());
            for (name, want) in off.grads.iter() {
                let g = got.grads.get(name).expect("a gradient");
                assert_eq!(
                    common::bits(g),
                    common::bits(want),
                    "{policy:?} {precision:?} fused={fused}: `{name}` differs from off"
                );
            }
        }
    }
}
