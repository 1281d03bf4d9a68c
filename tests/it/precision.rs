//! Mixed precision on the CPU (slow there, but the same code the GPU runs): a bf16 or f16
//! cached step against the f32 step on the same weights and batch, every parameter
//! getting a finite gradient in f32, loss scaling that multiplies the gradients exactly
//! where the loss gradient enters the replay, and an overflow that the scaler detects.

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::precision::{all_finite, LossScaler};
use gradcache::selfcheck::{is_key_bias, relative_error, tokens, TINY_BERT};
use gradcache::{GradCache, Gradients, InfoNce, ParamStore, Precision, TokenBatch};

fn batch(seed: u64) -> TokenBatch {
    tokens(seed, 8, &Device::Cpu).unwrap()
}

/// A cached step (chunks of 3, dropout on) of a BERT tower computing in `precision`,
/// over the weights in `store`.
fn step(store: &ParamStore, precision: Precision, scale: f64) -> (f32, Gradients) {
    let cfg: BertConfig = serde_json::from_str(TINY_BERT).unwrap();
    let options = BertOptions {
        lora: None,
        pooling: Pooling::Mean,
        normalize: true,
        precision,
        ..Default::default()
    };
    let encoder = BertEncoder::build(store, "", &cfg, &options).unwrap();
    let loss = InfoNce::new(0.05).unwrap().with_symmetric(true);
    let gc = GradCache::shared(encoder, 3, loss).unwrap().with_seed(9);
    let out = gc
        .cache_step_scaled(0, &batch(1), &batch(2), scale)
        .unwrap();
    (out.loss, out.grads)
}

/// The largest relative gradient error over the parameters, key biases left out.
fn worst_rel(got: &Gradients, want: &Gradients) -> f64 {
    relative_error(got, want, is_key_bias).unwrap()
}

#[test]
fn half_precision_steps_match_f32_within_tolerance() {
    let store = ParamStore::new(4, DType::F32, &Device::Cpu);
    let (loss32, grads32) = step(&store, Precision::F32, 1.0);
    for (precision, tol) in [(Precision::Bf16, 5e-2), (Precision::F16, 1e-2)] {
        let (loss, grads) = step(&store, precision, 1.0);
        let rel = worst_rel(&grads, &grads32);
        let loss_rel = f64::from((loss - loss32).abs() / loss32);
        eprintln!("{precision}: loss {loss} vs {loss32} (rel {loss_rel:.1e}); worst gradient rel {rel:.2e}");
        assert!(loss_rel <= tol, "{precision} loss off by {loss_rel:e}");
        assert!(
            rel <= tol,
            "{precision} gradients off by {rel:e} (tolerance {tol:e})"
        );
        // The step really ran in the half dtype (and the masters stayed f32).
        assert!(
            rel > 1e-5,
            "{precision} gradients equal f32's: no half compute happened"
        );
        assert_eq!(grads.len(), grads32.len());
        for (name, g) in grads.iter() {
            assert_eq!(g.dtype(), DType::F32, "{name}: master gradients are f32");
        }
        assert!(all_finite(&grads).unwrap());
    }
}

#[test]
fn loss_scale_multiplies_the_gradients_and_an_overflow_is_detected() {
    let store = ParamStore::new(5, DType::F32, &Device::Cpu);
    let (_, plain) = step(&store, Precision::F16, 1.0);
    // 2^10: f16 gradients shift by a power of two, so unscaling them gives back nearly the
    // same values (small ones gain the bits that underflowed).
    let scaler = LossScaler {
        scale: 1024.0,
        ..LossScaler::default()
    };
    let (loss, mut scaled) = step(&store, Precision::F16, scaler.scale);
    assert!(loss.is_finite());
    assert!(scaler.unscale(&mut scaled).unwrap());
    let rel = worst_rel(&scaled, &plain);
    assert!(rel <= 1e-2, "unscaled gradients off by {rel:e}");

    // A scale no f16 gradient survives: the cached f32 gradient fits, its cast into the
    // f16 backward overflows.
    let huge = LossScaler {
        scale: 1e30,
        ..LossScaler::default()
    };
    let (_, mut over) = step(&store, Precision::F16, huge.scale);
    assert!(
        !huge.unscale(&mut over).unwrap(),
        "an f16 overflow went unnoticed"
    );
    // In f32 the same scale is representable end to end.
    let (_, mut wide) = step(&store, Precision::F32, huge.scale);
    assert!(huge.unscale(&mut wide).unwrap());
}
