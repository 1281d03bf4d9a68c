//! LoRA and frozen weights in the gradient cache.
//!
//! A LoRA layer `x W^T + s (x A^T) B^T` is the plain layer on `W' = W + s B A`, so its
//! adapter gradients are fixed by the plain layer's weight gradient: `dA = s B^T dW'` and
//! `dB = s dW' A^T`. The tests run a model with adapters beside the same model without
//! them whose projections hold `W'`, for an encoder (BERT, MPNet, ModernBERT) and a
//! decoder (Qwen3), dropout on, and hold the adapters' gradients to those products; the
//! adapters alone train; cached == full batch and recompute on == off with adapters;
//! frozen weights get no gradient and leave every other gradient as it was.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::nn::lora::LoraSpec;
use gradcache::params::Freeze;
use gradcache::{Encoder, GradCache, Gradients, InfoNce, ParamStore, Recompute, TokenBatch};

use crate::common;
use crate::common::{max_abs, rel_err_with_zeros};

fn config(family: &str) -> BertConfig {
    let mut cfg = BertConfig::new(60, 16, 3, 2, 24, 48);
    cfg.initializer_range = 0.2;
    let mut set = |key: &str, value: serde_json::Value| {
        cfg.extra.insert(key.into(), value);
    };
    match family {
        "bert" | "distilbert" => {}
        "mpnet" => {
            set("relative_attention_num_buckets", 8.into());
        }
        "modernbert" => {
            set("global_attn_every_n_layers", 2.into());
            set("local_attention", 4.into());
            set("attention_dropout", 0.1.into());
        }
        "nomic_bert" | "gte" | "jina_embeddings_v3" => {
            set("rope_theta", 50.0.into());
        }
        "deberta-v2" => {
            // Disentangled attention with each layer's own position projections (the
            // fixture shares the attention's), absolute positions and token types.
            set("relative_attention", true.into());
            set("position_buckets", 4.into());
            set("max_relative_positions", 8.into());
            set("pos_att_type", "p2c|c2p".into());
            set("norm_rel_ebd", "layer_norm".into());
        }
        "qwen3" => {
            set("head_dim", 6.into());
            set("num_key_value_heads", 1.into());
            set("attention_dropout", 0.1.into());
            set("rope_theta", 50.0.into());
        }
        other => panic!("{other}"),
    }
    cfg.model_type = Some(family.into());
    if family == "mpnet" {
        cfg.pad_token_id = Some(1);
    }
    if family == "qwen3" || family == "nomic_bert" {
        cfg.hidden_act = "silu".into();
    }
    cfg
}

const FAMILIES: [&str; 9] = [
    "bert",
    "distilbert",
    "mpnet",
    "modernbert",
    "qwen3",
    "nomic_bert",
    "gte",
    "jina_embeddings_v3",
    "deberta-v2",
];

/// Rows of different lengths, right-padded.
fn tokens(seed: usize, rows: usize) -> TokenBatch {
    let len = 9;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 7 + seed) % (len - 2);
        for c in 0..len {
            ids.push(if c < real {
                2 + ((r * 31 + c * 17 + seed * 13) % 57) as u32
            } else {
                0
            });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(vec![0; rows * len])).unwrap()
}

fn lora(rank: usize) -> LoraSpec {
    LoraSpec {
        rank,
        alpha: 2.0 * rank as f64,
        targets: vec![],
        rslora: false,
        dropout: 0.0,
    }
}

fn options(family: &str, lora: Option<LoraSpec>, recompute: Recompute) -> BertOptions {
    BertOptions {
        pooling: if family == "qwen3" {
            Pooling::LastToken
        } else {
            Pooling::Mean
        },
        normalize: true,
        recompute,
        lora,
        ..Default::default()
    }
}

/// A shared tower with adapters of rank 2 (B moved off zero, so A gets a gradient too).
fn adapted(family: &str, recompute: Recompute) -> (ParamStore, BertEncoder) {
    adapted_with_dropout(family, 0.0, recompute, true)
}

fn gc(enc: BertEncoder, chunk: usize) -> GradCache<BertEncoder, BertEncoder, InfoNce> {
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    GradCache::shared(enc, chunk, loss).unwrap().with_seed(5)
}

/// Without dropout: a chunk's masks depend on its index, so only dropout-free steps of
/// different chunkings are equal.
fn gc_without_dropout(
    enc: BertEncoder,
    chunk: usize,
) -> GradCache<BertEncoder, BertEncoder, InfoNce> {
    gc(enc, chunk).with_dropout(false)
}

#[test]
fn adapters_alone_train_and_their_gradients_are_the_chain_rule_through_the_merged_weight() {
    let _switches = crate::steady();
    let (q, p) = (tokens(1, 6), tokens(2, 6));
    for family in FAMILIES {
        let (store, enc) = adapted(family, Recompute::Off);
        let names: Vec<String> = enc.params().names().map(String::from).collect();
        assert!(!names.is_empty());
        assert!(
            names
                .iter()
                .all(|n| n.contains(".lora_A.") || n.contains(".lora_B.")),
            "{family}: trainable {names:?}"
        );
        let projections = names.len() / 2;
        let per_layer = match family {
            "qwen3" => 7,
            "nomic_bert" => 5,
            "modernbert" | "gte" | "jina_embeddings_v3" => 4,
            // BERT's six and each layer's own position query and key projections.
            "deberta-v2" => 8,
            _ => 6,
        };
        assert_eq!(projections, 3 * per_layer, "{family}: adapted projections");
        let scale = lora(2).scale();
        let out = gc(enc, 6).full_batch_step(0, &q, &p).unwrap();

        // The same model without adapters, its projections holding W + s B A.
        let plain_store = ParamStore::new(99, DType::F32, &Device::Cpu);
        let plain = BertEncoder::build(
            &plain_store,
            "",
            &config(family),
            &options(family, None, Recompute::Off),
        )
        .unwrap();
        let value = |n: &str| store.get(n).unwrap().as_tensor().clone();
        let adapters: HashMap<String, (Tensor, Tensor)> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .map(|m| {
                let (a, b) = (
                    value(&format!("{m}.lora_A.weight")),
                    value(&format!("{m}.lora_B.weight")),
                );
                (format!("{m}.weight"), (a, b))
            })
            .collect();
        for (name, var) in plain_store.params().iter() {
            let mut w = value(name);
            if let Some((a, b)) = adapters.get(name) {
                w = (w + b.matmul(a).unwrap().affine(scale, 0.0).unwrap()).unwrap();
            }
            var.set(&w).unwrap();
        }
        let want = gc(plain, 6).full_batch_step(0, &q, &p).unwrap();
        assert!(
            ((out.loss - want.loss) / want.loss).abs() <= 1e-5,
            "{family}: loss {} vs {}",
            out.loss,
            want.loss
        );
        let expected: Gradients = adapters
            .iter()
            .flat_map(|(weight, (a, b))| {
                let dw = want.grads.get(weight).unwrap();
                let m = weight.strip_suffix(".weight").unwrap();
                let da = b
                    .t()
                    .unwrap()
                    .matmul(dw)
                    .unwrap()
                    .affine(scale, 0.0)
                    .unwrap();
                let db = dw
                    .matmul(&a.t().unwrap())
                    .unwrap()
                    .affine(scale, 0.0)
                    .unwrap();
                [
                    (format!("{m}.lora_A.weight"), da),
                    (format!("{m}.lora_B.weight"), db),
                ]
            })
            .collect();
        assert_eq!(out.grads.len(), expected.len(), "{family}");
        let err = rel_err_with_zeros(&out.grads, &expected, &[], 1e-5);
        assert!(err <= 1e-4, "{family}: adapter gradients off by {err:e}");
        for (name, g) in out.grads.iter() {
            assert!(max_abs(g) > 1e-7, "{family}: `{name}` got a zero gradient");
        }
    }
}

#[test]
fn cached_and_recomputed_steps_with_adapters_equal_the_full_batch() {
    let _switches = crate::steady();
    let (q, p) = (tokens(3, 6), tokens(4, 6));
    for family in FAMILIES {
        let (_, enc) = adapted(family, Recompute::Off);
        let reference = gc_without_dropout(enc, 6)
            .full_batch_step(0, &q, &p)
            .unwrap();
        for (chunk, policy) in [
            (1, Recompute::EveryLayer),
            (4, Recompute::Off),
            (2, Recompute::Sqrt),
        ] {
            let (_, enc) = adapted(family, policy.clone());
            let cached = gc_without_dropout(enc, chunk)
                .cache_step(0, &q, &p)
                .unwrap();
            assert!(((cached.loss - reference.loss) / reference.loss).abs() <= 1e-5);
            let err = rel_err_with_zeros(&cached.grads, &reference.grads, &[], 1e-5);
            assert!(
                err <= 1e-4,
                "{family} chunk {chunk} {policy:?}: max relative error {err:e}"
            );
        }
    }
}

#[test]
fn frozen_weights_get_no_gradient_and_change_no_other() {
    let _switches = crate::steady();
    let cfg = config("bert");
    let (q, p) = (tokens(5, 6), tokens(6, 6));
    let run = |freeze: &[&str]| {
        let patterns: Vec<String> = freeze.iter().map(|s| s.to_string()).collect();
        let store =
            ParamStore::new(3, DType::F32, &Device::Cpu).with_frozen(Freeze::patterns(&patterns));
        let enc =
            BertEncoder::build(&store, "", &cfg, &options("bert", None, Recompute::Off)).unwrap();
        let frozen: Vec<String> = enc.tower().frozen().names().map(String::from).collect();
        let trainable = enc.params().len();
        (gc(enc, 2).cache_step(0, &q, &p).unwrap(), frozen, trainable)
    };
    let (all, none_frozen, total) = run(&[]);
    assert!(none_frozen.is_empty());
    let (some, frozen, trainable) =
        run(&["embeddings", "encoder.layer.0", "*.output.LayerNorm.bias"]);
    assert_eq!(trainable + frozen.len(), total);
    assert!(frozen
        .iter()
        .any(|n| n == "embeddings.word_embeddings.weight"));
    assert!(frozen
        .iter()
        .any(|n| n == "encoder.layer.0.attention.self.query.weight"));
    assert!(frozen
        .iter()
        .any(|n| n == "encoder.layer.2.output.LayerNorm.bias"));
    assert!(!frozen
        .iter()
        .any(|n| n.starts_with("encoder.layer.1.") && !n.ends_with("LayerNorm.bias")));
    assert!((some.loss - all.loss).abs() <= 1e-6 * all.loss.abs());
    for name in &frozen {
        assert!(
            some.grads.get(name).is_none(),
            "frozen `{name}` got a gradient"
        );
    }
    for (name, g) in some.grads.iter() {
        let want = all.grads.get(name).unwrap();
        let err = common::max_diff(g, want) / max_abs(want).max(1e-12);
        assert!(err <= 1e-5, "`{name}` changed by freezing others: {err:e}");
    }
}

#[test]
fn a_bf16_base_stores_the_projections_narrow_and_gives_the_gradients_of_its_values() {
    let _switches = crate::steady();
    let (q, p) = (tokens(7, 6), tokens(8, 6));
    for family in FAMILIES {
        let cfg = config(family);
        let spec = lora(2);
        let narrow = Freeze::default()
            .all_but_adapters()
            .narrowing(DType::BF16, &spec.targets);
        let store = ParamStore::new(7, DType::F32, &Device::Cpu).with_frozen(narrow);
        let opts = options(family, Some(spec.clone()), Recompute::EveryLayer);
        let enc = BertEncoder::build(&store, "", &cfg, &opts).unwrap();
        let frozen = enc.tower().frozen().clone();
        let (mut narrowed, mut wide) = (0, 0);
        for (name, var) in frozen.iter() {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let projection = name.ends_with(".weight") && spec.targets_module(module);
            let want = if projection { DType::BF16 } else { DType::F32 };
            assert_eq!(var.dtype(), want, "{family}: `{name}`");
            if projection {
                narrowed += 1;
            } else {
                wide += 1;
            }
        }
        assert!(
            narrowed > 0 && wide > 0,
            "{family}: {narrowed} narrowed, {wide} wide"
        );
        let adapters: Vec<(String, Tensor)> = store
            .params()
            .iter()
            .filter(|(n, _)| n.contains(".lora_"))
            .enumerate()
            .map(|(i, (n, var))| {
                let v = common::random(60 + i as u64, var.dims())
                    .affine(0.3, 0.0)
                    .unwrap();
                var.set(&v).unwrap();
                (n.to_string(), v)
            })
            .collect();
        let got = gc(enc, 3).cache_step(0, &q, &p).unwrap();

        // The same model in f32 holding the bf16 values: the same step.
        let wide_store = ParamStore::new(7, DType::F32, &Device::Cpu)
            .with_frozen(Freeze::default().all_but_adapters());
        let wide_enc = BertEncoder::build(&wide_store, "", &cfg, &opts).unwrap();
        for (name, var) in frozen.iter() {
            let f32_value = var.as_tensor().to_dtype(DType::F32).unwrap();
            wide_store.get(name).unwrap().set(&f32_value).unwrap();
        }
        for (name, value) in &adapters {
            wide_store.get(name).unwrap().set(value).unwrap();
        }
        let want = gc(wide_enc, 3).cache_step(0, &q, &p).unwrap();
        assert!(
            ((got.loss - want.loss) / want.loss).abs() <= 1e-6,
            "{family}"
        );
        let err = rel_err_with_zeros(&got.grads, &want.grads, &[], 1e-5);
        assert!(err <= 1e-6, "{family}: adapter gradients off by {err:e}");
    }
}

/// A shared tower with adapters of rank 2 and LoRA dropout `p` on their input (B moved
/// off zero), built with the fused kernels on or off.
fn adapted_with_dropout(
    family: &str,
    p: f64,
    recompute: Recompute,
    fused: bool,
) -> (ParamStore, BertEncoder) {
    gradcache::nn::set_fused_kernels(fused);
    let cfg = config(family);
    let store = ParamStore::new(7, DType::F32, &Device::Cpu)
        .with_frozen(Freeze::default().all_but_adapters());
    let spec = LoraSpec {
        dropout: p,
        ..lora(2)
    };
    let enc =
        BertEncoder::build(&store, "", &cfg, &options(family, Some(spec), recompute)).unwrap();
    for (i, (name, var)) in store.params().iter().enumerate() {
        if name.contains(".lora_B.") {
            var.set(
                &common::random(40 + i as u64, var.dims())
                    .affine(0.3, 0.0)
                    .unwrap(),
            )
            .unwrap();
        }
    }
    (store, enc)
}

#[test]
fn lora_dropout_inside_the_layer_nodes_equals_the_composed_ops() {
    let _switches = crate::switching();
    // The nodes draw each adapter's mask at its rows' padded places; the composed ops
    // (what runs off the CPU) draw it over the padded tensor: the same masks, so the same
    // step. Dropout 0.5 so that most rows see a different mask from none.
    let (q, p) = (tokens(9, 6), tokens(10, 6));
    for family in FAMILIES {
        let step = |fused: bool, p_drop: f64| {
            let (_, enc) = adapted_with_dropout(family, p_drop, Recompute::Off, fused);
            gc(enc, 6).full_batch_step(0, &q, &p).unwrap()
        };
        let fused = step(true, 0.5);
        let composed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(false, 0.5)));
        gradcache::nn::set_fused_kernels(true);
        let composed = composed.unwrap_or_else(|e| std::panic::resume_unwind(e));
        assert!(
            ((fused.loss - composed.loss) / composed.loss).abs() <= 1e-5,
            "{family}: loss {} vs {}",
            fused.loss,
            composed.loss
        );
        let err = rel_err_with_zeros(&fused.grads, &composed.grads, &[], 1e-5);
        assert!(err <= 1e-4, "{family}: node vs composed off by {err:e}");
        // The masks act: without them the step differs.
        let plain = step(true, 0.0);
        assert!(
            (plain.loss - fused.loss).abs() > 1e-4,
            "{family}: LoRA dropout changed nothing ({} vs {})",
            plain.loss,
            fused.loss
        );
        for (name, g) in fused.grads.iter() {
            assert!(max_abs(g) > 1e-7, "{family}: `{name}` got a zero gradient");
        }
    }
}

#[test]
fn lora_dropout_is_replayed_bit_for_bit_in_the_cache_and_under_recompute() {
    let _switches = crate::steady();
    let (q, p) = (tokens(11, 6), tokens(12, 6));
    for family in FAMILIES {
        let cached = |recompute: Recompute| {
            let (_, enc) = adapted_with_dropout(family, 0.1, recompute, true);
            gc(enc, 2).cache_step(0, &q, &p).unwrap()
        };
        // The representation pass and the replay draw the same masks: two runs of the
        // same step agree bit for bit, and recomputing every layer in the backward (a
        // third forward per chunk) changes no bit either.
        let first = cached(Recompute::Off);
        let again = cached(Recompute::Off);
        let recomputed = cached(Recompute::EveryLayer);
        for (other, what) in [(&again, "again"), (&recomputed, "recomputed")] {
            assert_eq!(
                first.loss.to_bits(),
                other.loss.to_bits(),
                "{family} {what}"
            );
            for (name, g) in first.grads.iter() {
                let o = other.grads.get(name).unwrap();
                let diff = max_abs(&(g - o).unwrap());
                assert_eq!(diff, 0.0, "{family} {what}: `{name}` differs by {diff:e}");
            }
        }
        // Evaluation applies no mask: the same embeddings as without LoRA dropout.
        let (_, with) = adapted_with_dropout(family, 0.5, Recompute::Off, true);
        let (_, without) = adapted_with_dropout(family, 0.0, Recompute::Off, true);
        let eval = gradcache::Ctx::eval();
        let e1 = with.encode(&q, &eval).unwrap();
        let e2 = without.encode(&q, &eval).unwrap();
        assert_eq!(max_abs(&(e1 - e2).unwrap()), 0.0, "{family}: eval masked");
    }
}
