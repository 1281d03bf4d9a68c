//! Tiny encoders of the BERT, DistilBERT, MPNet and ModernBERT layouts (tests/switches/fused_bert.rs,
//! tests/switches/gpu_nodes.rs): the configs and right-padded token rows of different lengths.

use candle_core::{Device, Tensor};
use gradcache::bert::BertConfig;
use gradcache::TokenBatch;

/// A tiny encoder of `family`'s layout: `bert`, `distilbert`, `mpnet` (its relative
/// position bias over few buckets), `modernbert` (global and windowed layers, GeGLU, no biases) or
/// `modernbert-biased`.
pub fn config(family: &str) -> BertConfig {
    let mut cfg = BertConfig::new(60, 16, 3, 2, 24, 32);
    cfg.initializer_range = 0.2;
    if family.starts_with("modernbert") {
        cfg.model_type = Some("modernbert".into());
        let biased = family == "modernbert-biased";
        for (key, value) in [
            ("embedding_dropout", 0.1.into()),
            ("attention_dropout", 0.1.into()),
            ("mlp_dropout", 0.1.into()),
            ("global_attn_every_n_layers", 2.into()),
            ("local_attention", 4.into()),
            ("norm_bias", biased.into()),
            ("attention_bias", biased.into()),
            ("mlp_bias", biased.into()),
        ] {
            cfg.extra.insert(key.into(), value);
        }
    }
    if family == "distilbert" {
        // BERT's layer under other names, no token types, no dropout on the attention's
        // output projection.
        cfg.model_type = Some("distilbert".into());
        cfg.type_vocab_size = 1;
    }
    if family == "mpnet" {
        cfg.model_type = Some("mpnet".into());
        cfg.pad_token_id = Some(1);
        // Few buckets, so the short test rows reach the logarithmic ones too.
        cfg.extra
            .insert("relative_attention_num_buckets".into(), 8.into());
    }
    cfg
}

/// Each layer's key bias of `family` (`None`: ModernBERT's is a third of
/// `attn.Wqkv.bias`), whose gradient is rounding noise: softmax ignores a constant added to
/// every score of a row.
pub fn key_bias(family: &str, layer: usize) -> Option<String> {
    match family {
        "mpnet" => Some(format!("encoder.layer.{layer}.attention.attn.k.bias")),
        "distilbert" => Some(format!("transformer.layer.{layer}.attention.k_lin.bias")),
        "bert" => Some(format!("encoder.layer.{layer}.attention.self.key.bias")),
        _ => None,
    }
}

/// The layouts [`config`] builds.
pub const LAYOUTS: [&str; 5] = [
    "bert",
    "distilbert",
    "mpnet",
    "modernbert",
    "modernbert-biased",
];

/// The key biases of both towers (`query.`, `passage.`) over `layers` layers.
pub fn key_biases(family: &str, layers: usize) -> Vec<String> {
    ["query.", "passage."]
        .iter()
        .flat_map(|p| {
            (0..layers).filter_map(move |i| key_bias(family, i).map(|k| format!("{p}{k}")))
        })
        .collect()
}

/// Rows of different lengths, right-padded.
pub fn tokens(seed: usize, rows: usize) -> TokenBatch {
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
