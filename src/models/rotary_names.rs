//! The names transformers 5 gives NomicBERT's, GTE's and Jina v3's weights once loaded
//! (its `conversion_mapping.py`: `layers.{i}.self_attn.{q,k,v,o}_proj`,
//! `mlp.{up,gate,down}_proj`, `post_attention_layernorm`, ...) against the published
//! checkpoints' names this crate keeps (fused `Wqkv` / `qkv_proj`, `fc11`, `emb_ln`, ...).
//!
//! A checkpoint on disk keeps the published names (transformers writes them back on
//! save), but PEFT adapts the loaded model, so a PEFT adapter names the loaded modules: a
//! fused projection's adapter becomes one per part, each with the fused adapter's `A` and
//! its rows of `B` (`W + s B A` split by rows is each part's own update, exactly).
//! [`to_transformers_names`] writes an adapter that way; [`to_checkpoint_names`] reads one
//! back, fusing parts whose `A` is one (as [`to_transformers_names`] writes them) and
//! refusing parts trained apart, which no fused adapter of one rank equals.

use std::collections::HashMap;

use candle_core::Tensor;

use super::rotary_config::RotaryKind;
use crate::{Error, Result};

/// A module of the checkpoint under its loaded name(s): renamed, or split by rows into
/// equal parts.
struct Rule {
    /// The checkpoint's module path inside a layer (or at the top).
    checkpoint: &'static str,
    /// The loaded model's module(s), the rows of the checkpoint's in order.
    loaded: &'static [&'static str],
}

const fn rule(checkpoint: &'static str, loaded: &'static [&'static str]) -> Rule {
    Rule { checkpoint, loaded }
}

const QKV: &[&str] = &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"];

/// The layers' list in the checkpoint (loaded: `layers`), the renamed modules at the top
/// and inside a layer.
fn rules(kind: RotaryKind) -> (&'static str, &'static [Rule], &'static [Rule]) {
    const NOMIC_TOP: &[Rule] = &[rule("emb_ln", &["embeddings.LayerNorm"])];
    const NOMIC: &[Rule] = &[
        rule("attn.Wqkv", QKV),
        rule("attn.out_proj", &["self_attn.o_proj"]),
        rule("mlp.fc11", &["mlp.up_proj"]),
        rule("mlp.fc12", &["mlp.gate_proj"]),
        rule("mlp.fc2", &["mlp.down_proj"]),
        rule("norm1", &["post_attention_layernorm"]),
        rule("norm2", &["post_mlp_layernorm"]),
    ];
    const GTE: &[Rule] = &[
        rule("attention.qkv_proj", QKV),
        rule("attention.o_proj", &["self_attn.o_proj"]),
        rule("mlp.up_gate_proj", &["mlp.up_proj", "mlp.gate_proj"]),
        rule("attn_ln", &["post_attention_layernorm"]),
        rule("mlp_ln", &["post_mlp_layernorm"]),
    ];
    const JINA: &[Rule] = &[
        rule("mixer.Wqkv", QKV),
        rule("mixer.out_proj", &["self_attn.o_proj"]),
        rule("norm1", &["post_attention_layernorm"]),
        rule("norm2", &["post_mlp_layernorm"]),
    ];
    match kind {
        RotaryKind::Nomic => ("encoder.layers", NOMIC_TOP, NOMIC),
        RotaryKind::Gte => ("encoder.layer", &[], GTE),
        RotaryKind::Jina => ("encoder.layers", NOMIC_TOP, JINA),
    }
}

/// A tensor's name split as `(layer index, module inside it, leaf)` (`None` for a module
/// outside the layers) under the checkpoint's layer list `list`.
fn split_name<'a>(name: &'a str, list: &str) -> Option<(Option<&'a str>, &'a str, &'a str)> {
    let leaf_at = if name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") {
        name.len() - ".lora_A.weight".len()
    } else {
        name.rfind('.')?
    };
    let (module, leaf) = (&name[..leaf_at], &name[leaf_at + 1..]);
    match module.strip_prefix(list).and_then(|r| r.strip_prefix('.')) {
        Some(rest) => {
            let (i, inner) = rest.split_once('.')?;
            Some((Some(i), inner, leaf))
        }
        None => Some((None, module, leaf)),
    }
}

/// `weights` (checkpoint names, adapters `*.lora_{A,B}.weight` among them) under the names
/// transformers 5 gives the loaded model: fused projections split by rows (an adapter's
/// `A` copied to every part).
pub fn to_transformers_names(
    kind: RotaryKind,
    weights: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let (list, top, inner) = rules(kind);
    let mut out = HashMap::new();
    for (name, t) in weights {
        let Some((layer, module, leaf)) = split_name(name, list) else {
            out.insert(name.clone(), t.clone());
            continue;
        };
        let (rules, prefix) = match layer {
            Some(i) => (inner, format!("layers.{i}.")),
            None => (top, String::new()),
        };
        let Some(r) = rules.iter().find(|r| r.checkpoint == module) else {
            out.insert(format!("{prefix}{module}.{leaf}"), t.clone());
            continue;
        };
        let parts = r.loaded.len();
        let rows = t.dim(0)? / parts;
        for (p, loaded) in r.loaded.iter().enumerate() {
            let part = match leaf {
                "lora_A.weight" => t.clone(),
                _ if parts == 1 => t.clone(),
                _ => t.narrow(0, p * rows, rows)?.contiguous()?,
            };
            out.insert(format!("{prefix}{loaded}.{leaf}"), part);
        }
    }
    Ok(out)
}

/// A PEFT adapter's tensors (the loaded model's names, `*.lora_{A,B}.weight`) under the
/// checkpoint's names: the parts of a fused projection joined (their `B` rows stacked)
/// when their `A` is one; parts trained with their own `A` are refused naming them.
pub fn to_checkpoint_names(
    kind: RotaryKind,
    adapters: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let (list, top, inner) = rules(kind);
    let mut out = HashMap::new();
    let mut used = std::collections::HashSet::new();
    let renamed = |name: &str| -> Option<(String, &'static Rule, String)> {
        let leaf_at = name.len().checked_sub(".lora_A.weight".len())?;
        let (module, leaf) = (&name[..leaf_at], &name[leaf_at + 1..]);
        let (prefix, module, rules) = match module.strip_prefix("layers.") {
            Some(rest) => {
                let (i, m) = rest.split_once('.')?;
                (format!("{list}.{i}."), m, inner)
            }
            None => (String::new(), module, top),
        };
        let r = rules.iter().find(|r| r.loaded.contains(&module))?;
        Some((prefix, r, leaf.to_string()))
    };
    for name in adapters.keys() {
        if used.contains(name) {
            continue;
        }
        let Some((prefix, r, leaf)) = renamed(name) else {
            let own = match name.strip_prefix("layers.") {
                Some(rest) => format!("{list}.{rest}"),
                None => name.clone(),
            };
            out.insert(own, adapters[name].clone());
            continue;
        };
        let loaded_prefix = prefix.replacen(list, "layers", 1);
        let parts: Vec<String> = r
            .loaded
            .iter()
            .map(|m| format!("{loaded_prefix}{m}.{leaf}"))
            .collect();
        let tensors = parts
            .iter()
            .map(|p| {
                adapters.get(p).ok_or_else(|| Error::InvalidArgument {
                    what: "PEFT adapter",
                    value: p.clone(),
                    reason: "is missing beside the other parts of a projection the checkpoint \
                             keeps fused (q_proj, k_proj and v_proj; up_proj and gate_proj): \
                             all its parts are adapted, or none",
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let fused = if leaf == "lora_A.weight" {
            let first = tensors[0];
            for (other, t) in parts.iter().zip(&tensors).skip(1) {
                let same = first.dims() == t.dims()
                    && (first - *t)?.abs()?.max_all()?.to_scalar::<f32>()? == 0.0;
                if !same {
                    return Err(Error::InvalidArgument {
                        what: "PEFT adapter",
                        value: format!("{} and {other}", parts[0]),
                        reason: "differ, and the checkpoint keeps the projections fused: one \
                                 adapter of one rank over the fused projection has one lora_A \
                                 (as gradcache exports it); adapters trained apart per part are \
                                 not supported",
                    });
                }
            }
            first.clone()
        } else {
            Tensor::cat(&tensors, 0)?
        };
        used.extend(parts);
        out.insert(format!("{prefix}{}.{leaf}", r.checkpoint), fused);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(rows: usize, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * 2).map(|i| seed + i as f32).collect();
        Tensor::from_vec(v, (rows, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn adapters_round_trip_and_split_by_rows() {
        let mut w = HashMap::new();
        w.insert(
            "encoder.layers.0.attn.Wqkv.lora_A.weight".to_string(),
            t(1, 0.0),
        );
        w.insert(
            "encoder.layers.0.attn.Wqkv.lora_B.weight".to_string(),
            t(6, 10.0),
        );
        w.insert(
            "encoder.layers.0.mlp.fc11.lora_A.weight".to_string(),
            t(1, 5.0),
        );
        w.insert("emb_ln.weight".to_string(), t(1, 7.0));
        let loaded = to_transformers_names(RotaryKind::Nomic, &w).unwrap();
        let k = &loaded["layers.0.self_attn.k_proj.lora_B.weight"];
        assert_eq!(
            k.to_vec2::<f32>().unwrap(),
            t(6, 10.0)
                .narrow(0, 2, 2)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        );
        assert!(loaded.contains_key("layers.0.self_attn.v_proj.lora_A.weight"));
        assert!(loaded.contains_key("layers.0.mlp.up_proj.lora_A.weight"));
        assert!(loaded.contains_key("embeddings.LayerNorm.weight"));
        let adapters: HashMap<String, Tensor> = loaded
            .into_iter()
            .filter(|(n, _)| n.contains(".lora_"))
            .collect();
        let back = to_checkpoint_names(RotaryKind::Nomic, &adapters).unwrap();
        assert_eq!(back.len(), 3);
        for (name, v) in &back {
            assert_eq!(
                v.to_vec2::<f32>().unwrap(),
                w[name].to_vec2::<f32>().unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn parts_trained_apart_are_refused_naming_them() {
        let mut a = HashMap::new();
        for (p, seed) in [("q", 0.0), ("k", 1.0), ("v", 0.0)] {
            a.insert(
                format!("layers.1.self_attn.{p}_proj.lora_A.weight"),
                t(1, seed),
            );
            a.insert(
                format!("layers.1.self_attn.{p}_proj.lora_B.weight"),
                t(2, seed),
            );
        }
        let err = to_checkpoint_names(RotaryKind::Gte, &a)
            .unwrap_err()
            .to_string();
        assert!(err.contains("k_proj") || err.contains("q_proj"), "{err}");
        a.remove("layers.1.self_attn.v_proj.lora_B.weight");
        a.insert("layers.1.self_attn.k_proj.lora_A.weight".into(), t(1, 0.0));
        let err = to_checkpoint_names(RotaryKind::Gte, &a)
            .unwrap_err()
            .to_string();
        assert!(err.contains("v_proj"), "{err}");
    }
}
