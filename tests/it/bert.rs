//! The trainable BERT encoder: forward parity with candle-transformers' inference
//! `BertModel` on the same weights, gradients for every parameter through `cache_step`,
//! checkpointing that changes memory but not gradients, and cached + checkpointed steps
//! equal to a plain full-batch step.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::params::WeightFile;
use gradcache::recompute::{LayerStack, Recompute, Recomputed};
use gradcache::toy::{DeepMlp, DeepMlpConfig};
use gradcache::{
    ChunkSeed, Ctx, Encoder, GradCache, Gradients, InfoNce, ParamStore, TokenBatch, Tower,
};

use crate::common;
use crate::common::{max_abs, max_diff, rel_err_with_zeros};

const CONFIG: &str = r#"{
  "architectures": ["BertModel"],
  "model_type": "bert",
  "vocab_size": 60,
  "hidden_size": 16,
  "num_hidden_layers": 4,
  "num_attention_heads": 2,
  "intermediate_size": 24,
  "hidden_act": "gelu",
  "hidden_dropout_prob": 0.1,
  "attention_probs_dropout_prob": 0.1,
  "max_position_embeddings": 32,
  "type_vocab_size": 2,
  "initializer_range": 0.2,
  "layer_norm_eps": 1e-12,
  "pad_token_id": 0
}"#;

fn config() -> BertConfig {
    serde_json::from_str(CONFIG).unwrap()
}

/// Rows of different lengths, right-padded, with two segments.
fn tokens(seed: u64, rows: usize) -> TokenBatch {
    let len = 9;
    let mut ids = vec![];
    let mut mask = vec![];
    let mut types = vec![];
    for r in 0..rows {
        let real = 3 + (r * 7 + seed as usize) % (len - 2);
        for c in 0..len {
            let id = 1 + ((r * 31 + c * 17 + seed as usize * 13) % 59) as u32;
            ids.push(if c < real { id } else { 0 });
            mask.push(u32::from(c < real));
            types.push(u32::from(c >= real / 2 && c < real));
        }
    }
    let t = |v| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(types)).unwrap()
}

fn options(pooling: Pooling, recompute: Recompute) -> BertOptions {
    BertOptions {
        lora: None,
        pooling,
        normalize: false,
        recompute,
        ..Default::default()
    }
}

/// Key biases add one constant to every score of a query, which softmax ignores: their
/// gradient is mathematically zero, so only rounding noise is there to compare.
fn key_biases(cfg: &BertConfig, prefix: &str) -> Vec<String> {
    (0..cfg.num_hidden_layers)
        .map(|i| format!("{prefix}encoder.layer.{i}.attention.self.key.bias"))
        .collect()
}

/// Max relative error over parameters, the mathematically-zero ones checked as noise.
fn compare(got: &Gradients, want: &Gradients, zero: &[String]) -> f64 {
    let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
    rel_err_with_zeros(got, want, &zero, 1e-5)
}

#[test]
fn forward_matches_candle_transformers_bert() {
    let cfg = config();
    let dir = tempfile::tempdir().unwrap();
    // Random weights from our seeded initialisation, written as a BertForX checkpoint
    // would be (with the `bert.` prefix).
    let store = ParamStore::new(11, DType::F32, &Device::Cpu);
    BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
    let tensors: HashMap<String, Tensor> = store
        .params()
        .iter()
        .map(|(n, v)| (format!("bert.{n}"), v.as_tensor().clone()))
        .collect();
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();

    let theirs_cfg: candle_transformers::models::bert::Config =
        serde_json::from_str(CONFIG).unwrap();
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap()
    };
    let theirs = candle_transformers::models::bert::BertModel::load(vb, &theirs_cfg).unwrap();

    let file = Arc::new(WeightFile::open(&path, "bert.").unwrap());
    let ours_store = ParamStore::new(0, DType::F32, &Device::Cpu).with_weights("", file);
    let ours = BertEncoder::build(&ours_store, "", &cfg, &BertOptions::default()).unwrap();

    let batch = tokens(1, 5);
    let want = theirs
        .forward(
            &batch.input_ids,
            &batch.token_type_ids,
            Some(&batch.attention_mask),
        )
        .unwrap();
    let got = ours
        .tower()
        .detached_model()
        .hidden_states(&batch, &Ctx::eval())
        .unwrap();
    assert_eq!(got.dims(), want.dims());
    // Padding positions are not computed (the layers run on the real tokens only) and
    // hold 0; every real token matches.
    let mask = batch
        .attention_mask
        .to_dtype(DType::F32)
        .unwrap()
        .unsqueeze(2)
        .unwrap();
    let real = |t: &Tensor| t.broadcast_mul(&mask).unwrap();
    let diff = max_abs(&real(&got).sub(&real(&want)).unwrap());
    assert!(diff <= 1e-5, "last hidden state differs by {diff:e}");
    let padding = max_abs(&got.sub(&real(&got)).unwrap());
    assert_eq!(padding, 0.0, "padding positions hold {padding:e}");
    let padded = mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as usize;
    assert!(
        padded < batch.input_ids.elem_count(),
        "the batch has padding"
    );
    // The graph forward computes the same thing.
    let graph = ours
        .tower()
        .graph_model()
        .hidden_states(&batch, &Ctx::eval())
        .unwrap();
    assert!(max_abs(&real(&graph).sub(&real(&want)).unwrap()) <= 1e-5);
}

#[test]
fn every_parameter_gets_a_gradient_through_cache_step() {
    let cfg = config();
    let store = ParamStore::new(12, DType::F32, &Device::Cpu);
    let opts = BertOptions {
        lora: None,
        pooling: Pooling::Mean,
        normalize: true,
        recompute: Recompute::Sqrt,
        ..Default::default()
    };
    let enc = BertEncoder::build(&store, "", &cfg, &opts).unwrap();
    let loss = InfoNce::new(0.05).unwrap().with_symmetric(true);
    let gc = GradCache::shared(enc, 3, loss).unwrap().with_seed(3);
    // Every token id and both token types occur, so every embedding row can get a gradient.
    let ids: Vec<u32> = (0..60).collect();
    let ids = Tensor::from_vec(ids, (6, 10), &Device::Cpu).unwrap();
    let types =
        Tensor::from_vec((0..60u32).map(|i| i % 2).collect(), (6, 10), &Device::Cpu).unwrap();
    let q = TokenBatch::new(ids.clone(), ids.ones_like().unwrap(), types).unwrap();
    let out = gc.cache_step(0, &q, &tokens(5, 6)).unwrap();

    let params = store.params();
    assert_eq!(
        params.len(),
        5 + 16 * cfg.num_hidden_layers,
        "embeddings (5) + 16 per layer"
    );
    let zero = key_biases(&cfg, "");
    for (name, _) in params.iter() {
        let g = out
            .grads
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` received no gradient"));
        let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "`{name}`: non-finite gradient"
        );
        if !zero.iter().any(|z| z == name) {
            assert!(max_abs(g) > 1e-8, "`{name}`: zero gradient");
        }
    }
}

fn policies() -> Vec<Recompute> {
    vec![
        Recompute::EveryLayer,
        Recompute::Every(3),
        Recompute::Sqrt,
        Recompute::Layers(vec![1, 3]),
    ]
}

#[test]
fn checkpointing_does_not_change_bert_gradients() {
    let cfg = config();
    let store = ParamStore::new(13, DType::F32, &Device::Cpu);
    let off = BertEncoder::build(&store, "", &cfg, &options(Pooling::Cls, Recompute::Off)).unwrap();
    let batch = tokens(2, 4);
    let ctx = Ctx::train(ChunkSeed {
        run: 1,
        step: 2,
        rank: 0,
        tower: 0,
        chunk: 1,
    });
    let g = gradcache::rng::normal(9, 0.0, 1.0, &(4, 16).into(), DType::F32, &Device::Cpu).unwrap();
    let want = off.replay(&batch, &g, &ctx).unwrap();
    // Dropout is really on: other masks give other gradients.
    let other = Ctx::train(ChunkSeed {
        chunk: 2,
        ..ctx.dropout.unwrap()
    });
    let moved = compare(
        &off.replay(&batch, &g, &other).unwrap(),
        &want,
        &key_biases(&cfg, ""),
    );
    assert!(moved > 1e-2, "dropout masks had no effect ({moved:e})");

    for policy in policies() {
        let enc =
            BertEncoder::build(&store, "", &cfg, &options(Pooling::Cls, policy.clone())).unwrap();
        let got = enc.replay(&batch, &g, &ctx).unwrap();
        assert_eq!(got.len(), want.len(), "{policy:?}: gradient count");
        let err = compare(&got, &want, &key_biases(&cfg, ""));
        assert!(
            err <= 1e-6,
            "{policy:?}: max relative gradient error {err:e}"
        );
    }
}

/// The first parameter whose gradient differs in any bit (or is missing), if any.
fn differing_bits(got: &Gradients, want: &Gradients) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} gradients, want {}", got.len(), want.len()));
    }
    want.iter()
        .find(|(name, w)| got.get(name).map(common::bits) != Some(common::bits(w)))
        .map(|(name, _)| name.to_string())
}

/// The selective recompute policies (each sub-layer site alone, all of them, and
/// composed with segments) leave every gradient of `off` unchanged, bit for bit, dropout
/// on, on padded rows.
#[test]
fn selective_recompute_gives_the_gradients_of_off_bit_for_bit() {
    let cfg = config();
    let store = ParamStore::new(16, DType::F32, &Device::Cpu);
    let build = |policy| BertEncoder::build(&store, "", &cfg, &options(Pooling::Mean, policy));
    let (ids, mask) = (
        Tensor::new(&[[5u32, 9, 14, 3, 0, 0], [7, 2, 11, 4, 8, 6]], &Device::Cpu).unwrap(),
        Tensor::new(&[[1u32, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], &Device::Cpu).unwrap(),
    );
    // Two segments per row (the token types' gradient sums rows of both kinds).
    let types = Tensor::new(&[[0u32, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], &Device::Cpu).unwrap();
    let batch = TokenBatch::new(ids, mask, types).unwrap();
    let ctx = Ctx::train(ChunkSeed {
        run: 3,
        step: 1,
        rank: 0,
        tower: 1,
        chunk: 0,
    });
    let g = gradcache::rng::normal(8, 0.0, 1.0, &(2, 16).into(), DType::F32, &Device::Cpu).unwrap();
    let want = build(Recompute::Off)
        .unwrap()
        .replay(&batch, &g, &ctx)
        .unwrap();
    let mut policies = vec![
        Recompute::Attention,
        Recompute::selective(Recompute::Sqrt, &[]),
        Recompute::selective(Recompute::EveryLayer, &["intermediate", "attention.probs"]),
    ];
    for site in gradcache::bert::SITES {
        // Only `site` recomputed: keep the others.
        let keep: Vec<&str> = gradcache::bert::SITES
            .into_iter()
            .filter(|s| *s != site)
            .collect();
        policies.push(Recompute::keep(&keep));
    }
    for policy in policies {
        let got = build(policy.clone())
            .unwrap()
            .replay(&batch, &g, &ctx)
            .unwrap();
        let diff = differing_bits(&got, &want);
        assert_eq!(diff, None, "{policy:?}: gradients differ from `off`");
    }
    // The test can fail: other dropout masks change the bits.
    let other = Ctx::train(ChunkSeed {
        chunk: 1,
        ..ctx.dropout.unwrap()
    });
    let moved = build(Recompute::Attention)
        .unwrap()
        .replay(&batch, &g, &other)
        .unwrap();
    assert!(
        differing_bits(&moved, &want).is_some(),
        "other masks, same gradients"
    );
}

#[test]
fn unknown_sub_layer_sites_and_selective_recompute_without_sites_are_refused() {
    let cfg = config();
    let store = ParamStore::new(17, DType::F32, &Device::Cpu);
    let policy = Recompute::keep(&["attention.probs", "attention.dropout"]);
    let e = BertEncoder::build(&store, "", &cfg, &options(Pooling::Cls, policy))
        .err()
        .expect("an unknown site is an error");
    let msg = e.to_string();
    assert!(msg.contains("`attention.dropout`"), "{msg}");
    assert!(
        msg.contains("attention.probs, attention.output.LayerNorm"),
        "{msg}"
    );
    let nested = Recompute::Selective {
        segments: Box::new(Recompute::Attention),
        keep: vec![],
    };
    let e = BertEncoder::build(&store, "", &cfg, &options(Pooling::Cls, nested))
        .err()
        .expect("a selective policy as segments is an error");
    assert!(e.to_string().contains("segment policy"), "{e}");
    // A model without sub-layer sites (the residual MLP) refuses selective recompute.
    let mlp = DeepMlpConfig {
        input: 4,
        hidden: 8,
        blocks: 2,
        output: 4,
        dropout: 0.0,
    };
    let tower = Tower::build(&store, "mlp", |vb| DeepMlp::new(&mlp, vb)).unwrap();
    let e = Recomputed::new(tower, Recompute::Attention)
        .err()
        .expect("no sites");
    assert!(e.to_string().contains("sub-layer sites"), "{e}");
}

#[test]
fn checkpointing_does_not_change_deep_mlp_gradients() {
    let cfg = DeepMlpConfig {
        input: 8,
        hidden: 16,
        blocks: 9,
        output: 6,
        dropout: 0.2,
    };
    let store = ParamStore::new(14, DType::F32, &Device::Cpu);
    let build = |policy| {
        Recomputed::new(
            Tower::build(&store, "", |vb| DeepMlp::new(&cfg, vb)).unwrap(),
            policy,
        )
        .unwrap()
    };
    let off = build(Recompute::Off);
    assert_eq!(off.tower().graph_model().num_layers(), 9);
    let x = gradcache::rng::normal(1, 0.0, 1.0, &(5, 8).into(), DType::F32, &Device::Cpu).unwrap();
    let g = gradcache::rng::normal(2, 0.0, 1.0, &(5, 6).into(), DType::F32, &Device::Cpu).unwrap();
    let ctx = Ctx::train(ChunkSeed {
        run: 4,
        step: 0,
        rank: 0,
        tower: 1,
        chunk: 0,
    });
    let want = off.replay(&x, &g, &ctx).unwrap();
    assert_eq!(want.len(), store.params().len());
    for policy in policies() {
        let got = build(policy.clone()).replay(&x, &g, &ctx).unwrap();
        let err = got.max_rel_err(&want, 0.0).unwrap();
        assert!(
            err <= 1e-6,
            "{policy:?}: max relative gradient error {err:e}"
        );
    }
}

#[test]
fn cached_and_checkpointed_bert_matches_a_full_batch_step() {
    let mut cfg = config();
    cfg.hidden_dropout_prob = 0.0;
    cfg.attention_probs_dropout_prob = 0.0;
    let b = 6;
    let (q, p) = (tokens(3, b), tokens(4, 2 * b));
    for chunk in [1, 3, b] {
        for policy in [Recompute::Off, Recompute::Sqrt] {
            let store = ParamStore::new(15, DType::F32, &Device::Cpu);
            let qe = BertEncoder::build(
                &store,
                "query",
                &cfg,
                &options(Pooling::Cls, policy.clone()),
            )
            .unwrap();
            let pe = BertEncoder::build(
                &store,
                "passage",
                &cfg,
                &options(Pooling::Mean, policy.clone()),
            )
            .unwrap();
            let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
            let gc = GradCache::two_towers(qe, pe, chunk, chunk + 1, loss).unwrap();
            let reference = gc.full_batch_step(0, &q, &p).unwrap();
            let cached = gc.cache_step(0, &q, &p).unwrap();
            assert!(((cached.loss - reference.loss) / reference.loss).abs() <= 1e-5);
            let mut zero = key_biases(&cfg, "query.");
            zero.extend(key_biases(&cfg, "passage."));
            let err = compare(&cached.grads, &reference.grads, &zero);
            assert!(
                err <= 1e-5,
                "chunk {chunk} {policy:?}: max relative gradient error {err:e}"
            );
        }
    }
}

#[test]
fn chunks_by_tokens_match_a_full_batch_step() {
    // Rows of 3..=9 real tokens: a budget of 9 puts one long text in a chunk and several
    // short ones, 1 makes every text a chunk alone, 1,000 the whole side one chunk.
    let mut cfg = config();
    cfg.hidden_dropout_prob = 0.0;
    cfg.attention_probs_dropout_prob = 0.0;
    let b = 6;
    let (q, p) = (tokens(3, b), tokens(4, 2 * b));
    for (q_tokens, p_tokens) in [(9, 14), (1, 1), (20, 9), (1000, 1000)] {
        let store = ParamStore::new(15, DType::F32, &Device::Cpu);
        let opts = options(Pooling::Mean, Recompute::Sqrt);
        let qe = BertEncoder::build(&store, "query", &cfg, &opts).unwrap();
        let pe = BertEncoder::build(&store, "passage", &cfg, &opts).unwrap();
        let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
        let gc = GradCache::two_towers(qe, pe, b, 2 * b, loss)
            .unwrap()
            .with_chunk_tokens(q_tokens, p_tokens)
            .unwrap();
        let reference = gc.full_batch_step(0, &q, &p).unwrap();
        let cached = gc.cache_step(0, &q, &p).unwrap();
        assert!(((cached.loss - reference.loss) / reference.loss).abs() <= 1e-5);
        let mut zero = key_biases(&cfg, "query.");
        zero.extend(key_biases(&cfg, "passage."));
        let err = compare(&cached.grads, &reference.grads, &zero);
        assert!(
            err <= 1e-5,
            "chunk tokens {q_tokens}/{p_tokens}: max relative gradient error {err:e}"
        );
    }
}

#[test]
fn fresh_weights_follow_the_seed() {
    let cfg = config();
    let weights = |seed| {
        let store = ParamStore::new(seed, DType::F32, &Device::Cpu);
        BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
        let w = store
            .get("encoder.layer.1.attention.self.query.weight")
            .unwrap();
        w.as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(weights(21), weights(21), "one seed, identical weights");
    assert_ne!(weights(21), weights(22));
    // normal(0, initializer_range): the sample standard deviation is close to 0.2.
    let w = weights(21);
    let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((std - 0.2).abs() < 0.03, "std {std}");
}

/// Half precision stays close to f32 on padded batches: the weights are the f32 ones
/// rounded (the seeded initialisation draws in f32), and the hidden states differ from
/// f32's by at most a stated fraction of their largest entry: 1e-2 in f16 (10-bit
/// mantissa), 5e-2 in bf16 (7 bits); measured 1.2e-3 and 9.0e-3 (1.7e-3 and 1.5e-2 before
/// LayerNorm and softmax widened half inputs to f32). Padding stays
/// finite (the mask bias is -10000, not f32::MIN, which overflows to -inf in half).
#[test]
fn half_precision_tracks_f32_on_padded_batches() {
    let cfg = config();
    let batch = tokens(6, 4);
    let hidden = |dtype: DType| {
        let store = ParamStore::new(16, dtype, &Device::Cpu);
        let enc = BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
        let h = enc
            .tower()
            .detached_model()
            .hidden_states(&batch, &Ctx::eval())
            .unwrap();
        assert_eq!(h.dtype(), dtype);
        h.to_dtype(DType::F32).unwrap()
    };
    let reference = hidden(DType::F32);
    let scale = max_abs(&reference);
    for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let h = hidden(dtype);
        let v = h.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{dtype:?}: non-finite hidden state"
        );
        let err = max_diff(&h, &reference) / scale;
        eprintln!("{dtype:?}: max |h - h_f32| / max |h_f32| = {err:.2e}");
        assert!(err <= tol, "{dtype:?}: relative error {err:e} > {tol:e}");
    }
}
