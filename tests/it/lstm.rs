//! The LSTM tower: its hand-written backward through time equals autograd through the
//! composed forward, and every segment policy over time steps gives `Off`'s gradients bit
//! for bit, with padding and with stacked layers.

use crate::common;

use crate::common::{bits, random};
use candle_core::{DType, Device, Tensor};
use gradcache::lstm::{Lstm, LstmConfig, LstmEncoder, LstmPooling};
use gradcache::replay::replay;
use gradcache::{Ctx, Encoder, GradCache, InfoNce, ParamStore, Recompute, TokenBatch, Tower};

fn config(layers: usize, pooling: LstmPooling) -> LstmConfig {
    LstmConfig {
        vocab_size: 50,
        embedding_size: 6,
        hidden_size: 5,
        num_layers: layers,
        pooling,
        output: 4,
    }
}

fn encoder(seed: u64, cfg: &LstmConfig, policy: Recompute) -> LstmEncoder {
    let store = ParamStore::new(seed, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Lstm::new(cfg, vb)).unwrap();
    LstmEncoder::new(tower, policy).unwrap()
}

/// `rows` sequences of `steps` tokens; row `r` has `steps - r` real tokens (padding right).
fn batch(seed: u64, rows: usize, steps: usize) -> TokenBatch {
    let ids: Vec<u32> = (0..rows * steps)
        .map(|i| 1 + ((i as u64 * 7919 + seed * 104_729) % 49) as u32)
        .collect();
    let mask: Vec<u32> = (0..rows * steps)
        .map(|i| u32::from(i % steps < steps - (i / steps).min(steps - 1)))
        .collect();
    let ids = Tensor::from_vec(ids, (rows, steps), &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(mask, (rows, steps), &Device::Cpu).unwrap();
    TokenBatch::new(ids.clone(), mask, ids.zeros_like().unwrap()).unwrap()
}

#[test]
fn the_handwritten_backward_through_time_equals_autograd() {
    for (layers, pooling) in [
        (1, LstmPooling::Mean),
        (2, LstmPooling::Mean),
        (2, LstmPooling::Last),
    ] {
        let cfg = config(layers, pooling);
        let enc = encoder(1, &cfg, Recompute::Off);
        let input = batch(3, 4, 9);
        let cot = random(5, &[4, cfg.output]);
        let ctx = Ctx::eval();
        let want = replay(enc.params(), &cot, || enc.forward(&input, &ctx)).unwrap();
        assert_eq!(
            want.len(),
            enc.params().len(),
            "autograd reaches every parameter"
        );
        let got = enc.replay(&input, &cot, &ctx).unwrap();
        assert_eq!(
            got.len(),
            enc.params().len(),
            "every parameter receives a gradient"
        );
        for (name, g) in got.iter() {
            assert!(common::max_abs(g) > 0.0, "{name}: zero gradient");
        }
        let err = got.max_rel_err(&want, 1e-4).unwrap();
        assert!(
            err <= 1e-5,
            "{layers} layers, {pooling:?}: relative error {err}"
        );
        // The graph-free representation is the graph forward's.
        let a = enc.encode(&input, &ctx).unwrap();
        let b = enc.forward(&input, &ctx).unwrap();
        assert_eq!(bits(&a), bits(&b));
    }
}

#[test]
fn every_segment_policy_gives_off_gradients_bit_for_bit() {
    let cfg = config(2, LstmPooling::Mean);
    let input = batch(7, 3, 23);
    let cot = random(8, &[3, cfg.output]);
    let mut enc = encoder(2, &cfg, Recompute::Off);
    let reference = enc.replay(&input, &cot, &Ctx::eval()).unwrap();
    for policy in [
        Recompute::Sqrt,
        Recompute::EveryLayer,
        Recompute::Every(4),
        Recompute::Layers(vec![5, 17]),
    ] {
        enc.set_policy(policy.clone()).unwrap();
        let got = enc.replay(&input, &cot, &Ctx::eval()).unwrap();
        assert_eq!(got.len(), reference.len());
        for (name, want) in reference.iter() {
            assert!(
                bits(got.get(name).unwrap()) == bits(want),
                "{policy}: {name} differs from off"
            );
        }
    }
}

#[test]
fn padding_steps_leave_the_representation_unchanged() {
    let cfg = config(2, LstmPooling::Last);
    let enc = encoder(3, &cfg, Recompute::Off);
    let long = batch(9, 2, 12);
    // Row 1 has 11 real tokens: the same row cut to those 11 tokens encodes the same.
    let short = TokenBatch::new(
        long.input_ids
            .narrow(0, 1, 1)
            .unwrap()
            .narrow(1, 0, 11)
            .unwrap(),
        long.attention_mask
            .narrow(0, 1, 1)
            .unwrap()
            .narrow(1, 0, 11)
            .unwrap(),
        long.token_type_ids
            .narrow(0, 1, 1)
            .unwrap()
            .narrow(1, 0, 11)
            .unwrap(),
    )
    .unwrap();
    let a = enc.encode(&long, &Ctx::eval()).unwrap().get(1).unwrap();
    let b = enc.encode(&short, &Ctx::eval()).unwrap().get(0).unwrap();
    assert!(common::max_diff(&a, &b) < 1e-6);
}

#[test]
fn selective_policies_are_refused() {
    let cfg = config(1, LstmPooling::Mean);
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let tower = Tower::build(&store, "", |vb| Lstm::new(&cfg, vb)).unwrap();
    let err = LstmEncoder::new(tower, Recompute::Attention).err().unwrap();
    assert!(err.to_string().contains("segment policy"), "{err}");
    let store = ParamStore::new(1, DType::F32, &Device::Cpu);
    let bad = LstmConfig {
        hidden_size: 0,
        ..cfg
    };
    let err = Tower::build(&store, "", |vb| Lstm::new(&bad, vb))
        .err()
        .unwrap();
    assert!(err.to_string().contains("positive"), "{err}");
}

#[test]
fn a_cached_step_with_checkpointed_lstms_equals_the_full_batch_step() {
    let cfg = config(1, LstmPooling::Mean);
    let (q, p) = (batch(11, 8, 10), batch(12, 8, 14));
    let loss = || InfoNce::new(0.1).unwrap();
    let full = GradCache::shared(encoder(4, &cfg, Recompute::Off), 8, loss()).unwrap();
    let want = full.full_batch_step(0, &q, &p).unwrap();
    let cached = GradCache::shared(encoder(4, &cfg, Recompute::Sqrt), 3, loss()).unwrap();
    let got = cached.cache_step(0, &q, &p).unwrap();
    assert!((got.loss - want.loss).abs() <= 1e-5 * want.loss.abs());
    let err = got.grads.max_rel_err(&want.grads, 1e-4).unwrap();
    assert!(err <= 1e-5, "relative error {err}");
}
