//! Every family's layer on the device against the CPU's own path (`gradcache self-check`):
//! a tiny model of each layout (BERT, MPNet, ModernBERT, Qwen3, Gemma3) takes one cached
//! step with dropout on, on the device through its GPU nodes and on the CPU through the
//! CPU's nodes (packed rows, the gemm crate), from the same weights and batch; in f32 every
//! parameter's gradient must agree within 1e-5 (relative). On the CPU the first side runs
//! the GPU nodes through their kernels' reference forms, so the check holds the GPU nodes'
//! algebra to the CPU's nodes there too.

use candle_core::{DType, Device, Tensor};

use super::{relative_error, CheckResult};
use crate::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use crate::{GradCache, Gradients, InfoNce, ParamStore, Result, TokenBatch};

/// The layouts: name, `config.json`, whether a decoder (left padding, last-token pooling).
const FAMILIES: [(&str, &str, bool); 5] = [
    ("bert", super::TINY_BERT, false),
    (
        "mpnet",
        r#"{"model_type": "mpnet", "vocab_size": 60, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 48, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 40, "relative_attention_num_buckets": 8,
        "pad_token_id": 1, "initializer_range": 0.2}"#,
        false,
    ),
    (
        "modernbert",
        r#"{"model_type": "modernbert", "vocab_size": 60, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 48,
        "max_position_embeddings": 64, "global_attn_every_n_layers": 2,
        "local_attention": 4, "embedding_dropout": 0.1, "attention_dropout": 0.1,
        "mlp_dropout": 0.1, "norm_bias": false, "attention_bias": false, "mlp_bias": false,
        "initializer_range": 0.2}"#,
        false,
    ),
    ("qwen3", super::TINY_QWEN3, true),
    (
        "gemma3_text",
        r#"{"model_type": "gemma3_text", "vocab_size": 60, "hidden_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 24, "hidden_act": "silu",
        "max_position_embeddings": 64, "attention_dropout": 0.1, "rope_theta": 50.0,
        "query_pre_attn_scalar": 12, "use_bidirectional_attention": true,
        "sliding_window": 6,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "initializer_range": 0.2}"#,
        true,
    ),
];

/// An attention key bias: its true gradient is zero (softmax ignores a shift of a row).
fn key_bias(name: &str) -> bool {
    ["key.bias", "attn.k.bias", "k_proj.bias"]
        .iter()
        .any(|k| name.ends_with(k))
}

/// One check per family (see the module's documentation).
pub fn run(device: &Device, out: &mut Vec<CheckResult>) -> Result<()> {
    for (family, json, decoder) in FAMILIES {
        let on_device = step(device, json, decoder, true)?;
        let on_cpu = step(&Device::Cpu, json, decoder, false)?;
        out.push(CheckResult {
            name: format!(
                "{family}, f32: a cached step's gradients on this device's GPU nodes against \
                 the CPU's nodes"
            ),
            value: relative_error(&on_device, &on_cpu, key_bias)?,
            limit: 1e-5,
        });
    }
    Ok(())
}

/// One cached step of the tiny model `json` on `device`: through the GPU nodes with
/// `gpu` (on the CPU: their reference forms), else the CPU's nodes.
fn step(device: &Device, json: &str, decoder: bool, gpu: bool) -> Result<Gradients> {
    let cfg: BertConfig =
        serde_json::from_str(json).map_err(|e| crate::Error::InvalidArgument {
            what: "self-check model config",
            value: e.to_string(),
            reason: "does not parse",
        })?;
    let fused = crate::nn::fused_kernels();
    crate::nn::set_fused_kernels(!gpu);
    crate::nn::run_gpu_nodes_on_cpu(gpu);
    let result = (|| -> Result<Gradients> {
        let store = ParamStore::new(11, DType::F32, device);
        let options = BertOptions {
            pooling: if decoder {
                Pooling::LastToken
            } else {
                Pooling::Mean
            },
            normalize: true,
            ..Default::default()
        };
        let enc = BertEncoder::build(&store, "", &cfg, &options)?;
        let loss = InfoNce::new(0.1)?.with_symmetric(true);
        let gc = GradCache::shared(enc, 3, loss)?.with_seed(5);
        let (q, p) = (rows(1, 6, decoder, device)?, rows(2, 6, decoder, device)?);
        Ok(gc.cache_step(2, &q, &p)?.grads)
    })();
    crate::nn::set_fused_kernels(fused);
    crate::nn::run_gpu_nodes_on_cpu(false);
    result
}

/// Token rows of different lengths, padded on the left for a decoder.
pub(super) fn rows(seed: usize, n: usize, left: bool, device: &Device) -> Result<TokenBatch> {
    let len = 12;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..n {
        let real = 3 + (r * 5 + seed) % (len - 3);
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
    let t = |v: Vec<u32>| Tensor::from_vec(v, (n, len), device);
    TokenBatch::new(t(ids)?, t(mask)?, t(vec![0u32; n * len])?)
}
