//! The rotary post-norm encoders (NomicBERT, GTE, Jina v3), EuroBERT and DeBERTa-v2/v3
//! beyond what `families` holds every family to: NomicBERT's query and document prompts
//! as sentence-transformers encodes them; with dropout on (GTE's on the gated product,
//! DeBERTa's on the relative embeddings too), selective recompute of every site gives
//! keeping's step bit for bit, the cache and the full batch the same step, and the
//! composed ops the fused nodes' step; configs whose arithmetic is not built (rope types,
//! Jina v3's task adapters, DeBERTa's convolution, ...) refused by name.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::{GradCache, Gradients, InfoNce, ParamStore, Recompute, StepOutput, TokenBatch};

use crate::common;
use crate::common::families::{fixture, reference, refs};
use crate::common::{max_abs, max_diff};
use crate::families::{edited, load_err};

const ROTARY: [&str; 3] = ["nomic_bert", "gte", "jina_embeddings_v3"];

/// DeBERTa-v3's layout (the attention's own projections shared with the positions, no
/// absolute positions, no token types) and DeBERTa-v2's (own position projections,
/// absolute positions, token types, `pos_att_type` as a string).
const DEBERTA: [&str; 2] = ["deberta-v3", "deberta-v2"];

#[test]
fn nomic_prompts_embed_as_sentence_transformers_encodes_them() {
    let _switches = crate::steady();
    let r = reference("nomic_bert");
    let options = LoadOptions {
        max_len: Some(32),
        ..Default::default()
    };
    let model = EmbeddingModel::load(fixture("nomic_bert").to_str().unwrap(), &options).unwrap();
    assert!(
        model.settings().contains("search_query: "),
        "{}",
        model.settings()
    );
    let texts = refs(&r.texts);
    for (side, got) in [
        ("query", model.embed_queries(&texts, 4).unwrap()),
        ("document", model.embed_passages(&texts, 4).unwrap()),
    ] {
        let err = max_diff(&got, &r.tensors[&format!("embeddings.{side}")]);
        assert!(err <= 1e-5, "{side} embeddings off by {err:e}");
    }
}

/// A small model of `family` built in code, dropout 0.1 on the hidden states and the
/// attention probabilities.
fn config(family: &str) -> BertConfig {
    let mut cfg = BertConfig::new(60, 16, 2, 2, 24, 48);
    cfg.initializer_range = 0.2;
    cfg.model_type = Some(family.into());
    if family.starts_with("deberta") {
        cfg.model_type = Some("deberta-v2".into());
        let v3 = family == "deberta-v3";
        let mut set = |key: &str, value: serde_json::Value| {
            cfg.extra.insert(key.into(), value);
        };
        set("relative_attention", true.into());
        set("position_buckets", 4.into());
        set("max_relative_positions", 8.into());
        set("norm_rel_ebd", "layer_norm".into());
        set("share_att_key", v3.into());
        set("position_biased_input", (!v3).into());
        match v3 {
            true => set("pos_att_type", serde_json::json!(["p2c", "c2p"])),
            false => set("pos_att_type", "c2p|p2c".into()),
        }
        if v3 {
            cfg.type_vocab_size = 0;
        }
    }
    cfg.hidden_dropout_prob = 0.1;
    cfg.attention_probs_dropout_prob = 0.1;
    cfg.extra.insert("rope_theta".into(), 50.0.into());
    match family {
        "nomic_bert" => cfg.hidden_act = "silu".into(),
        "eurobert" => {
            cfg.hidden_act = "silu".into();
            cfg.extra.insert("attention_dropout".into(), 0.1.into());
            cfg.extra.insert("num_key_value_heads".into(), 1.into());
        }
        _ => {}
    }
    cfg
}

/// Rows of different lengths, right-padded, token types 0 and 1.
fn tokens(seed: usize, rows: usize) -> TokenBatch {
    let len = 9;
    let (mut ids, mut mask, mut types) = (vec![], vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 7 + seed) % (len - 2);
        for c in 0..len {
            ids.push(if c < real {
                2 + ((r * 31 + c * 17 + seed * 13) % 57) as u32
            } else {
                0
            });
            mask.push(u32::from(c < real));
            types.push(u32::from(c < real && c >= real / 2));
        }
    }
    let t = |v| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(types)).unwrap()
}

/// One step of `family` over 6 + 6 rows in chunks of `chunk`, dropout on or off.
fn step(family: &str, chunk: usize, recompute: Recompute, dropout: bool) -> StepOutput {
    let cfg = config(family);
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = BertOptions {
        pooling: Pooling::Mean,
        normalize: true,
        recompute,
        ..Default::default()
    };
    let enc = BertEncoder::build(&store, "", &cfg, &options).unwrap();
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::shared(enc, chunk, loss)
        .unwrap()
        .with_seed(5)
        .with_dropout(dropout);
    gc.cache_step(2, &tokens(1, 6), &tokens(2, 6)).unwrap()
}

fn assert_bitwise(what: &str, got: &StepOutput, want: &StepOutput) {
    assert_eq!(got.loss.to_bits(), want.loss.to_bits(), "{what}: loss");
    assert_eq!(got.grads.len(), want.grads.len(), "{what}");
    for (name, g) in want.grads.iter() {
        assert_eq!(
            common::bits(g),
            common::bits(got.grads.get(name).unwrap()),
            "{what}: `{name}`"
        );
    }
}

/// The largest error of `got` against `want`, each gradient relative to its largest entry
/// (floored at 1e-3 of the largest in the model).
fn gradient_error(got: &Gradients, want: &Gradients) -> f64 {
    let global = want.iter().map(|(_, g)| max_abs(g)).fold(0.0, f64::max);
    assert_eq!(got.len(), want.len(), "the same parameters get gradients");
    want.iter()
        .map(|(name, w)| max_diff(got.get(name).unwrap(), w) / max_abs(w).max(1e-3 * global))
        .fold(0.0, f64::max)
}

#[test]
fn selective_recompute_with_dropout_gives_keepings_step_bit_for_bit() {
    let _switches = crate::steady();
    for family in ROTARY.into_iter().chain(["eurobert"]).chain(DEBERTA) {
        let off = step(family, 3, Recompute::Off, true);
        assert!(off.grads.len() > 10, "{family}");
        let plain = step(family, 3, Recompute::Off, false);
        assert_ne!(off.loss, plain.loss, "{family}: the dropout drops");
        let all = step(family, 3, Recompute::Attention, true);
        assert_bitwise(&format!("{family}, every site recomputed"), &all, &off);
        // One site kept (EuroBERT has the probabilities alone), the others recomputed,
        // inside segments of one layer.
        let keep = match family {
            "eurobert" => vec![],
            f if f.starts_with("deberta") => vec!["attention.output.LayerNorm".into()],
            _ => vec!["post_attention_layernorm".into()],
        };
        let keep = Recompute::Selective {
            segments: Box::new(Recompute::EveryLayer),
            keep,
        };
        let segmented = step(family, 3, keep, true);
        let err = gradient_error(&segmented.grads, &off.grads);
        assert!(err <= 1e-6, "{family}: segments off by {err:e}");
    }
}

#[test]
fn the_cache_with_recompute_gives_the_full_batch_step() {
    let _switches = crate::steady();
    for family in ROTARY.into_iter().chain(DEBERTA) {
        let full = step(family, 6, Recompute::Off, false);
        for (chunk, recompute) in [(1, Recompute::Attention), (4, Recompute::EveryLayer)] {
            let cached = step(family, chunk, recompute.clone(), false);
            let what = format!("{family}, chunk {chunk}, {recompute:?}");
            let loss_err = ((cached.loss - full.loss) / full.loss).abs();
            assert!(
                loss_err <= 1e-5,
                "{what}: loss {} vs {}",
                cached.loss,
                full.loss
            );
            let err = gradient_error(&cached.grads, &full.grads);
            assert!(err <= 1e-5, "{what}: gradients off by {err:e}");
        }
    }
}

#[test]
fn the_composed_ops_give_the_fused_step_with_dropout() {
    let _switches = crate::switching();
    let result = std::panic::catch_unwind(|| {
        for family in ROTARY.into_iter().chain(DEBERTA) {
            for recompute in [Recompute::Off, Recompute::Attention] {
                gradcache::nn::set_fused_kernels(true);
                let fused = step(family, 3, recompute.clone(), true);
                gradcache::nn::set_fused_kernels(false);
                let composed = step(family, 3, recompute.clone(), true);
                let what = format!("{family}, {recompute:?}");
                let loss_err = ((fused.loss - composed.loss) / composed.loss).abs();
                assert!(loss_err <= 1e-6, "{what}: loss");
                let err = gradient_error(&fused.grads, &composed.grads);
                assert!(err <= 1e-5, "{what}: gradients off by {err:e}");
            }
        }
    });
    gradcache::nn::set_fused_kernels(true);
    result.unwrap();
}

#[test]
fn rotary_configs_whose_arithmetic_is_not_built_are_refused_by_name() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let t: &Path = tmp.path();
    // GTE's original NTK scaling, and transformers' dynamic one.
    for (family, kind) in [("gte", "ntk"), ("nomic_bert", "dynamic")] {
        let dir = edited(t, family, "config.json", |c| {
            c["rope_parameters"]["rope_type"] = kind.into();
            c["rope_parameters"]["factor"] = 2.0.into();
        });
        let err = load_err(&dir);
        assert!(err.contains("rope_type") && err.contains(kind), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let dir = edited(t, "nomic_bert", "config.json", |c| c["head_dim"] = 4.into());
    let err = load_err(&dir);
    assert!(err.contains("head_dim"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = edited(t, "jina_embeddings_v3", "config.json", |c| {
        c["num_attention_heads"] = 32.into()
    });
    let err = load_err(&dir);
    assert!(err.contains("even head width"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = edited(t, "gte", "config.json", |c| {
        c["num_attention_heads"] = 5.into()
    });
    let err = load_err(&dir);
    assert!(
        err.contains("num_attention_heads") && err.contains("divide"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = edited(t, "gte", "config.json", |c| c["hidden_act"] = "mish".into());
    let err = load_err(&dir);
    assert!(err.contains("hidden_act") && err.contains("mish"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    // Task adapters: Jina v3's alone, each task named once, a rank of at least 1.
    let tasks = serde_json::json!(["retrieval.query", "retrieval.passage"]);
    let twice = serde_json::json!(["retrieval.query", "retrieval.query"]);
    for (family, key, value, named) in [
        ("gte", "lora_adaptations", tasks.clone(), "Jina v3"),
        ("jina_embeddings_v3", "lora_adaptations", twice, "once"),
        ("jina_embeddings_v3", "lora_rank", 0.into(), "lora_rank"),
        (
            "jina_embeddings_v3",
            "lora_dropout_p",
            1.0.into(),
            "lora_dropout_p",
        ),
    ] {
        let dir = edited(t, family, "config.json", |c| {
            c["lora_adaptations"] = tasks.clone();
            c[key] = value.clone();
        });
        let err = load_err(&dir);
        assert!(err.contains(key) && err.contains(named), "{key}: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let dir = edited(t, "gte", "config.json", |c| {
        c["hidden_dropout_prob"] = 1.0.into()
    });
    let err = load_err(&dir);
    assert!(err.contains("hidden_dropout_prob"), "{err}");
}

#[test]
fn deberta_configs_whose_arithmetic_is_not_built_are_refused_by_name() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let t: &Path = tmp.path();
    let cases: [(&str, serde_json::Value, &str); 6] = [
        ("conv_kernel_size", 3.into(), "conv_kernel_size"),
        ("embedding_size", 16.into(), "embedding_size"),
        ("attention_head_size", 4.into(), "attention_head_size"),
        ("pos_att_type", serde_json::json!(["c2p", "p2p"]), "p2p"),
        ("norm_rel_ebd", "batch_norm".into(), "batch_norm"),
        ("position_buckets", 2.into(), "position_buckets"),
    ];
    for (key, value, named) in cases {
        let dir = edited(t, "deberta-v2", "config.json", |c| c[key] = value.clone());
        let err = load_err(&dir);
        assert!(err.contains(named), "{key}: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // The classification head's activation, on the reranker fixture.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let reranker = t.join("reranker");
    common::copy_dir(&root.join("tests/fixtures/rerank/deberta-v2"), &reranker);
    let path = reranker.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["pooler_hidden_act"] = "mish".into();
    std::fs::write(&path, c.to_string()).unwrap();
    let err = gradcache::rerank::CrossEncoder::load(reranker.to_str().unwrap(), None, &Device::Cpu)
        .err()
        .expect("a head of an unknown activation loaded")
        .to_string();
    assert!(
        err.contains("pooler_hidden_act") && err.contains("mish"),
        "{err}"
    );
    // DeBERTa v1 (`deberta`) is another model type.
    let dir = edited(t, "deberta-v2", "config.json", |c| {
        c["model_type"] = "deberta".into()
    });
    let err = load_err(&dir);
    assert!(
        err.contains("deberta-v2") && err.contains("model_type"),
        "{err}"
    );
}
