//! Tiny decoders of every family's layout (tests/switches/fused_decoder.rs, tests/switches/gpu_nodes.rs):
//! the configs, left- or right-padded token rows, and parameters moved off their
//! initialisation.

use candle_core::{Device, Tensor};
use gradcache::bert::BertConfig;
use gradcache::{ParamStore, TokenBatch};

/// A tiny decoder of `family`'s layout, dropout 0.1 on the attention probabilities.
pub fn config(family: &str) -> BertConfig {
    let mut cfg = BertConfig::new(60, 16, 3, 4, 24, 64);
    cfg.initializer_range = 0.2;
    cfg.hidden_act = "silu".into();
    let model_type = family.split('-').next().unwrap_or(family);
    cfg.model_type = Some(model_type.into());
    let mut set = |key: &str, value: serde_json::Value| {
        cfg.extra.insert(key.into(), value);
    };
    set("attention_dropout", 0.1.into());
    set("rope_theta", 50.0.into());
    match family {
        // q/k norms, head_dim 6 (not 16 / 4), 2 KV heads, a windowed last layer.
        "qwen3" => {
            set("head_dim", 6.into());
            set("num_key_value_heads", 2.into());
            set("use_sliding_window", true.into());
            set("sliding_window", 3.into());
            set("max_window_layers", 2.into());
        }
        // One KV head, q/k/v biases.
        "qwen2" => set("num_key_value_heads", 1.into()),
        "llama" => {
            set("num_key_value_heads", 2.into());
            set("attention_bias", true.into());
            set("mlp_bias", true.into());
        }
        "mistral" => {
            set("num_key_value_heads", 2.into());
            set("sliding_window", 4.into());
        }
        // Gemma3: bidirectional, a sliding layer between two global ones.
        "gemma3_text" => {
            set("head_dim", 8.into());
            set("num_key_value_heads", 2.into());
            set("query_pre_attn_scalar", 12.into());
            set("use_bidirectional_attention", true.into());
            set("sliding_window", 6.into());
            set(
                "layer_types",
                serde_json::json!(["full_attention", "sliding_attention", "full_attention"]),
            );
        }
        // Qwen3's layout run bidirectionally (`is_causal = false`, as gte-Qwen2).
        "qwen3-bidirectional" => {
            set("head_dim", 6.into());
            set("num_key_value_heads", 2.into());
            set("is_causal", false.into());
        }
        other => panic!("{other}"),
    }
    cfg
}

pub const FAMILIES: [&str; 6] = [
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "gemma3_text",
    "qwen3-bidirectional",
];

/// Rows of different lengths padded on the left (`left`) or the right; longer than a
/// block of queries of the grouped kernel (32), so causal rows span several blocks.
pub fn tokens(seed: usize, rows: usize, left: bool) -> TokenBatch {
    let len = 40;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 13 + seed * 7) % (len - 2);
        for c in 0..len {
            let at = if left { c + real >= len } else { c < real };
            ids.push(if at {
                1 + ((r * 31 + c * 17 + seed * 13) % 59) as u32
            } else {
                0
            });
            mask.push(u32::from(at));
        }
    }
    let t = |v| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(vec![0; rows * len])).unwrap()
}

/// Every parameter of `store` moved off its initialisation (norm scales of exactly 1 or
/// 0 would hide a wrong norm gradient).
pub fn perturb(store: &ParamStore) {
    for (i, (_, var)) in store.params().iter().enumerate() {
        let noise = super::random(100 + i as u64, var.dims())
            .affine(0.1, 0.0)
            .and_then(|t| t.to_dtype(var.dtype()))
            .unwrap();
        var.set(&(var.as_tensor() + noise).unwrap()).unwrap();
    }
}
