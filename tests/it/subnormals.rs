//! No subnormal floats (issue 22): the kernels give exact zeros where the true value is
//! below f32's normal range, masked keys get probability exactly 0 and take no part in
//! anything, and flush-to-zero / denormals-are-zero is on in every thread that computes
//! while the library does (and back off on the caller's thread afterwards).
//!
//! Intel cores run an instruction with a subnormal operand or result through a microcode
//! assist (about a hundred cycles), so a subnormal that slips through is a several-fold
//! slowdown there even where AMD does not notice it.

use std::hint::black_box;

use candle_core::{DType, Device, Tensor, Var};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::denormal::{count_subnormals, flush, on_in_pools};
use gradcache::nn::{self, cpu, Act, AttentionSpec};
use gradcache::{ChunkSeed, Ctx, GradCache, InfoNce, ParamStore, Recompute, TokenBatch};

use crate::common::{bits, random};

/// An additive key mask `[n, 1, 1, k]` whose sequence `i` has `k - i` real keys.
fn padding_bias(n: usize, k: usize) -> Tensor {
    let v: Vec<f32> = (0..n)
        .flat_map(|i| (0..k).map(move |j| if j + i >= k { -10000.0 } else { 0.0 }))
        .collect();
    Tensor::from_vec(v, (n, 1, 1, k), &Device::Cpu).unwrap()
}

#[test]
fn exp_is_exactly_zero_below_the_normal_range() {
    // No flush-to-zero on this thread: the zeros are the kernel's own.
    let mut x = -200.0f32;
    while x < 88.0 {
        let y = cpu::exp(black_box(x));
        assert!(!y.is_subnormal(), "exp({x}) = {y:e} is subnormal");
        if f64::from(x).exp() < f64::from(f32::MIN_POSITIVE) {
            assert_eq!(
                y, 0.0,
                "exp({x}) = {y:e}, true value below the normal range"
            );
        } else if x > -87.0 {
            let rel = (f64::from(y) - f64::from(x).exp()).abs() / f64::from(x).exp();
            assert!(rel < 3e-7, "exp({x}) off by {rel:e}");
        }
        x += 0.003_7;
    }
}

#[test]
fn masked_keys_get_probability_exactly_zero() {
    // Four keys tie at the top, the rest sit 100 below them (e^-100 is far below the
    // normal range) or are masked: the old kernel clamped exp at e^-87 and divided by the
    // row sum of 4, giving 4e-39, a subnormal.
    let (n, heads, q, k) = (3, 2, 5, 12);
    let mut scores = vec![0f32; n * heads * q * k];
    for (i, v) in scores.iter_mut().enumerate() {
        *v = if i % k < 4 { 10.0 } else { -90.0 };
    }
    let scores = Tensor::from_vec(scores, (n, heads, q, k), &Device::Cpu).unwrap();
    let bias = padding_bias(n, k);
    let p = nn::masked_softmax(&scores, &bias, 1.0).unwrap();
    assert_eq!(count_subnormals(&p).unwrap(), 0);
    let v = p.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mask = bias.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (i, &pv) in v.iter().enumerate() {
        let (seq, key) = (i / (heads * q * k), i % k);
        if mask[seq * k + key] < 0.0 || key >= 4 {
            assert_eq!(pv.to_bits(), 0, "probability {i} is {pv:e}, not +0");
        } else {
            assert!((pv - 0.25).abs() < 1e-6);
        }
    }
}

#[test]
fn attention_ignores_masked_keys_entirely() {
    let (n, heads, s, d) = (3, 2, 7, 4);
    let bias = padding_bias(n, s);
    let mask = bias.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let spec = AttentionSpec {
        bias: bias.clone(),
        scale: 0.5,
        dropout: Some((5, 0.2)),
        recompute: false,
        window: None,
    };
    let q = random(1, &[n, heads, s, d]);
    let (k, v) = (random(2, &[n, heads, s, d]), random(3, &[n, heads, s, d]));
    // The masked keys' keys and values replaced by huge ones.
    let huge = |t: &Tensor| {
        let mut x = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, x) in x.iter_mut().enumerate() {
            let (b, key) = (i / (heads * s * d), (i / d) % s);
            if mask[b * s + key] < 0.0 {
                *x = 1e15;
            }
        }
        Tensor::from_vec(x, (n, heads, s, d), &Device::Cpu).unwrap()
    };
    let cot = random(4, &[n, heads, s, d]);
    let run = |k: &Tensor, v: &Tensor| {
        let vars = [&q, k, v].map(|t| Var::from_tensor(t).unwrap());
        let out = nn::attention(&vars[0], &vars[1], &vars[2], &spec).unwrap();
        let store = (&out * &cot)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads = vars.map(|v| store.get(&v).unwrap().clone());
        (out, grads)
    };
    let (out, grads) = run(&k, &v);
    let (out_huge, grads_huge) = run(&huge(&k), &huge(&v));
    assert_eq!(
        bits(&out),
        bits(&out_huge),
        "masked keys changed the output"
    );
    assert_eq!(
        bits(&grads[0]),
        bits(&grads_huge[0]),
        "... or the query gradient"
    );
    for g in &grads[1..] {
        let x = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, &x) in x.iter().enumerate() {
            let (b, key) = (i / (heads * s * d), (i / d) % s);
            if mask[b * s + key] < 0.0 {
                assert_eq!(x, 0.0, "masked key {key} of sequence {b} has a gradient");
            }
        }
    }
}

#[test]
fn flush_to_zero_is_on_in_every_pool_worker_and_off_again_on_the_caller() {
    let tiny = black_box(1e-20f32);
    assert!((tiny * tiny).is_subnormal() || tiny * tiny == 0.0);
    let before = (black_box(1e-38f32) * black_box(0.5f32)).is_subnormal();
    {
        let _flush = flush();
        assert!(gradcache::denormal::is_on());
        assert!(on_in_pools(), "a pool worker does not flush subnormals");
        // The caller: 1e-38 / 2 is subnormal, flushed to 0.
        assert_eq!(black_box(1e-38f32) * black_box(0.5f32), 0.0);
        // The rayon pool the products run on, every worker.
        let flushed: Vec<bool> =
            rayon::broadcast(|_| black_box(1e-38f32) * black_box(0.5f32) == 0.0);
        assert!(flushed.iter().all(|&f| f), "{flushed:?}");
        // A fused kernel over many blocks (candle's pool and this thread): GELU of 1e-38
        // is 5e-39, subnormal.
        let x = Tensor::full(1e-38f32, (512, 256), &Device::Cpu).unwrap();
        let zero = Tensor::zeros(256, DType::F32, &Device::Cpu).unwrap();
        let y = nn::bias_activation(&x, &zero, Act::GeluErf).unwrap();
        assert_eq!(count_subnormals(&y).unwrap(), 0);
        // A matrix product large enough to run on several threads: 1e-20 * 1e-20 * 256.
        let a = Tensor::full(1e-20f32, (256, 256), &Device::Cpu).unwrap();
        let c = nn::linear(&a, &a, None).unwrap();
        assert_eq!(count_subnormals(&c).unwrap(), 0);
    }
    // The caller's own arithmetic has its gradual underflow back.
    assert!(!gradcache::denormal::is_on());
    assert_eq!(
        (black_box(1e-38f32) * black_box(0.5f32)).is_subnormal(),
        before
    );
    #[cfg(target_arch = "x86_64")]
    assert!(before, "x86-64 keeps gradual underflow by default");
}

const CONFIG: &str = r#"{
  "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
  "intermediate_size": 32, "hidden_act": "gelu", "max_position_embeddings": 16,
  "initializer_range": 0.5, "layer_norm_eps": 1e-12
}"#;

/// Right-padded rows of 3 to 10 tokens out of 10; padding tokens have id `pad`.
fn tokens(seed: usize, rows: usize, pad: u32) -> TokenBatch {
    let len = 10;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 5 + seed) % 8;
        for c in 0..len {
            ids.push(if c < real {
                1 + ((r * 13 + c * 7 + seed) % 48) as u32
            } else {
                pad
            });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    let types = t(vec![0; rows * len]);
    TokenBatch::new(t(ids), t(mask), types).unwrap()
}

/// A padded batch through the BERT tower under every recompute policy, forward and
/// backward: no activation, representation, cached gradient or parameter gradient holds a
/// subnormal, and the padding tokens' ids change no real token's state and no gradient,
/// bit for bit (masked keys take no part).
#[test]
fn a_padded_bert_batch_has_no_subnormals_under_any_policy() {
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let policies = [
        Recompute::Off,
        Recompute::EveryLayer,
        Recompute::Sqrt,
        Recompute::Attention,
        Recompute::selective(Recompute::EveryLayer, &["intermediate"]),
    ];
    for policy in policies {
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let options = BertOptions {
            lora: None,
            pooling: Pooling::Mean,
            normalize: true,
            recompute: policy.clone(),
            ..Default::default()
        };
        let encoder = BertEncoder::build(&store, "", &cfg, &options).unwrap();
        let (q0, p0) = (tokens(1, 6, 0), tokens(2, 6, 0));
        let (q1, p1) = (tokens(1, 6, 7), tokens(2, 6, 9));
        // Every layer's output (the detached model: graph-free), under a flush guard as
        // the encoders hold one.
        let model = encoder.tower().detached_model();
        let ctx = Ctx::train(ChunkSeed {
            run: 1,
            step: 0,
            rank: 0,
            tower: 0,
            chunk: 0,
        });
        for (a, b) in [(&q0, &q1), (&p0, &p1)] {
            let _flush = flush();
            use gradcache::recompute::LayerStack;
            let states = |t: &TokenBatch| {
                let aux = model.aux(t).unwrap();
                let mut x = model.embed(t, &aux, &ctx).unwrap();
                let mut all = vec![x.clone()];
                for i in 0..model.num_layers() {
                    x = model.layer(i, &x, &aux, &ctx).unwrap();
                    all.push(x.clone());
                }
                all
            };
            let mask = a
                .attention_mask
                .to_dtype(DType::F32)
                .unwrap()
                .unsqueeze(2)
                .unwrap();
            for (x, y) in states(a).iter().zip(states(b).iter()) {
                assert_eq!(count_subnormals(x).unwrap(), 0, "{policy:?}: activation");
                // Padding masked out (+ 0, so that -0 and +0 read alike).
                let real = |t: &Tensor| bits(&(t.broadcast_mul(&mask).unwrap() + 0.0).unwrap());
                assert_eq!(real(x), real(y), "{policy:?}: padding ids changed a state");
            }
        }
        // The cached step: representations, cached gradients, parameter gradients.
        let gc = GradCache::shared(encoder, 4, InfoNce::new(0.05).unwrap())
            .unwrap()
            .with_seed(11);
        let reps = gc.represent(0, &q0, &p0).unwrap();
        for t in [reps.queries().unwrap(), reps.passages().unwrap()] {
            assert_eq!(
                count_subnormals(&t).unwrap(),
                0,
                "{policy:?}: representation"
            );
        }
        let cache = reps.into_cache(gc.loss()).unwrap();
        for t in [cache.grad_queries(), cache.grad_passages()] {
            assert_eq!(
                count_subnormals(t).unwrap(),
                0,
                "{policy:?}: cached gradient"
            );
        }
        let out = cache.replay().unwrap();
        let other = gc.cache_step(0, &q1, &p1).unwrap();
        assert_eq!(out.loss.to_bits(), other.loss.to_bits(), "{policy:?}: loss");
        for (name, g) in out.grads.iter() {
            assert_eq!(count_subnormals(g).unwrap(), 0, "{policy:?}: `{name}`");
            let o = other.grads.get(name).unwrap();
            // The word embeddings of the padding ids get no gradient from padding.
            assert_eq!(bits(g), bits(o), "{policy:?}: padding ids changed `{name}`");
        }
    }
}
