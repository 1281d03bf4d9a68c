//! Jina v3's task adapters as the layers run them ([`TaskAdapters`] reads what the config
//! declares): each task's low-rank updates of the two embedding tables and of every
//! layer's four projections, held as one variable per task and factor
//! (`<m>.lora_A.task<t>`, read from slice `t` of the release's
//! `<m>.parametrizations.weight.0.lora_A`), so a run trains the tasks it encodes with and
//! leaves the others' values, and their optimizer state, untouched.
//!
//! A batch names its task ([`crate::batch::TokenBatch::task`]); its projections run with
//! that task's adapters through [`Linear::with_adapter`] (the layer nodes take them as
//! they take a LoRA adapter: the update `s B A` is PEFT's), its embedding rows gain
//! `s A[ids] B` (the rows of `E + s A B`).

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::names::task_adapter;
use crate::nn::lora::Adapter;
use crate::nn::Linear;
use crate::{Error, Result};

pub use super::rotary_config::TaskAdapters;

/// An embedding table's update of one task: `E' = E + s A B`, `A` `[rows, r]`, `B`
/// `[r, dim]`.
pub(super) struct TableUpdate {
    a: Tensor,
    b: Tensor,
    scale: f64,
}

impl TableUpdate {
    /// The table's update under `vb` (`[rows, dim]`) for task `t`: the release's
    /// initialisation where the file has none (`A` zeros, `B` standard normal).
    fn new(
        vb: &VarBuilder,
        (rows, dim): (usize, usize),
        t: usize,
        s: &TaskAdapters,
    ) -> Result<Self> {
        let get = |shape: (usize, usize), factor: &str, init: Init| {
            vb.get_with_hints_dtype(shape, &leaf(factor, t), init, DType::F32)
        };
        Ok(Self {
            a: get((rows, s.rank), "lora_A", candle_nn::init::ZERO)?,
            b: get(
                (s.rank, dim),
                "lora_B",
                Init::Randn {
                    mean: 0.0,
                    stdev: 1.0,
                },
            )?,
            scale: s.scale(),
        })
    }

    /// `s A[ids] B` `[len(ids), dim]` for the flat `ids`, in `dtype`; rows of `padding`
    /// carry no gradient (PyTorch's `padding_idx` on the updated table).
    pub(super) fn rows(&self, ids: &Tensor, padding: Option<u32>, dtype: DType) -> Result<Tensor> {
        let picked = self.a.index_select(ids, 0)?;
        let picked = match padding {
            Some(pad) => {
                let frozen = self.a.detach().index_select(ids, 0)?;
                let is_pad = ids.eq(pad)?.unsqueeze(1)?.broadcast_as(picked.shape())?;
                is_pad.where_cond(&frozen, &picked)?
            }
            None => picked,
        };
        let update = picked.matmul(&self.b)?.affine(self.scale, 0.0)?;
        Ok(update.to_dtype(dtype)?)
    }
}

/// The name of task `t`'s factor under a module's builder ([`task_adapter`] relative
/// to the module).
fn leaf(factor: &str, t: usize) -> String {
    task_adapter("", factor, t)[1..].to_string()
}

/// One task's adapters.
pub(super) struct TaskSet {
    /// Each layer's, on its projections in order (qkv, attention output, fc1, fc2).
    pub(super) layers: Vec<[Adapter; 4]>,
    pub(super) words: TableUpdate,
    pub(super) types: Option<TableUpdate>,
}

/// The adapter of task `t` on the projection `layer` (under `vb`): the release's
/// initialisation where the file has none (`A` Kaiming-uniform, `B` zeros).
fn projection(vb: &VarBuilder, layer: &Linear, t: usize, s: &TaskAdapters) -> Result<Adapter> {
    let (out, input) = layer.base_weight().dims2()?;
    let bound = 1.0 / (input as f64).sqrt();
    let a = vb.get_with_hints_dtype(
        (s.rank, input),
        &leaf("lora_A", t),
        Init::Uniform {
            lo: -bound,
            up: bound,
        },
        DType::F32,
    )?;
    let b = vb.get_with_hints_dtype(
        (out, s.rank),
        &leaf("lora_B", t),
        candle_nn::init::ZERO,
        DType::F32,
    )?;
    Ok(Adapter::from_factors(a, b, s.scale()))
}

impl TaskSet {
    /// Task `t`'s adapters: the tables under `words` and `types` (`[rows, dim]` each), each
    /// layer's projections `(builder, layer)` in order.
    pub(super) fn new(
        t: usize,
        s: &TaskAdapters,
        words: (&VarBuilder, (usize, usize)),
        types: Option<(&VarBuilder, (usize, usize))>,
        layers: &[[(VarBuilder, &Linear); 4]],
    ) -> Result<Self> {
        if s.rank > words.1 .1 {
            return Err(Error::InvalidArgument {
                what: "lora_rank",
                value: s.rank.to_string(),
                reason: "exceeds the model's hidden size",
            });
        }
        Ok(Self {
            layers: layers
                .iter()
                .map(|ps| {
                    let a = |k: usize| projection(&ps[k].0, ps[k].1, t, s);
                    Ok([a(0)?, a(1)?, a(2)?, a(3)?])
                })
                .collect::<Result<Vec<_>>>()?,
            words: TableUpdate::new(words.0, words.1, t, s)?,
            types: types
                .map(|(vb, shape)| TableUpdate::new(vb, shape, t, s))
                .transpose()?,
        })
    }
}

/// The modules `weights` hold task adapters of (a run's names, `<m>.lora_A.task<t>`).
fn adapted_modules(
    weights: &std::collections::HashMap<String, Tensor>,
) -> std::collections::BTreeSet<String> {
    weights
        .keys()
        .filter_map(|n| crate::names::task_adapter_name(n).map(|(m, _, _)| m.to_string()))
        .collect()
}

/// `weights` (a run's names: `<m>.weight`, `<m>.lora_A.task<t>`, ...) in the release's
/// layout, as Jina v3's `XLMRobertaLoRA` saves it: under `roberta.`, every adapted
/// module's weight as `<m>.parametrizations.weight.original` and its adapters stacked
/// over the `tasks` as `<m>.parametrizations.weight.0.lora_A` / `lora_B`. A module
/// missing a task's adapter is refused naming it.
pub fn release_layout(
    mut weights: std::collections::HashMap<String, Tensor>,
    tasks: usize,
) -> Result<std::collections::HashMap<String, Tensor>> {
    let modules = adapted_modules(&weights);
    let mut out = std::collections::HashMap::new();
    for module in &modules {
        for factor in ["lora_A", "lora_B"] {
            let parts = (0..tasks)
                .map(|t| {
                    let name = task_adapter(module, factor, t);
                    weights.remove(&name).ok_or_else(|| Error::InvalidArgument {
                        what: "task adapter",
                        value: name,
                        reason: "is missing: every adapted module carries every task's",
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            out.insert(
                format!("roberta.{module}.parametrizations.weight.0.{factor}"),
                Tensor::stack(&parts, 0)?,
            );
        }
        let weight = format!("{module}.weight");
        let base = weights
            .remove(&weight)
            .ok_or_else(|| Error::InvalidArgument {
                what: "task adapter",
                value: weight.clone(),
                reason: "adapts a module the model has no weight of",
            })?;
        out.insert(
            format!("roberta.{module}.parametrizations.weight.original"),
            base,
        );
    }
    out.extend(
        weights
            .into_iter()
            .map(|(n, t)| (format!("roberta.{n}"), t)),
    );
    Ok(out)
}

/// `weights` (a run's names) with task `task`'s updates merged into their weights and
/// every task's adapters dropped: the base model the task encodes with, a plain Jina v3
/// model (its tables `E + s A B`, its projections `W + s B A`).
pub fn merge_task(
    mut weights: std::collections::HashMap<String, Tensor>,
    task: usize,
    tasks: &TaskAdapters,
) -> Result<std::collections::HashMap<String, Tensor>> {
    let modules = adapted_modules(&weights);
    for module in &modules {
        let factor = |f: &str| {
            let name = task_adapter(module, f, task);
            weights
                .get(&name)
                .cloned()
                .ok_or_else(|| Error::InvalidArgument {
                    what: "task adapter",
                    value: name,
                    reason: "is missing: every adapted module carries every task's",
                })
        };
        let (a, b) = (factor("lora_A")?, factor("lora_B")?);
        let weight = format!("{module}.weight");
        let base = weights.get(&weight).ok_or_else(|| Error::InvalidArgument {
            what: "task adapter",
            value: weight.clone(),
            reason: "adapts a module the model has no weight of",
        })?;
        // The tables' update is A B ([rows, r] [r, dim]), the projections' B A.
        let update = if module.starts_with("embeddings.") {
            a.matmul(&b)?
        } else {
            b.matmul(&a)?
        };
        let merged = (base.to_dtype(DType::F32)? + update.affine(tasks.scale(), 0.0)?)?
            .to_dtype(base.dtype())?;
        weights.insert(weight, merged);
    }
    weights.retain(|n, _| crate::names::task_adapter_name(n).is_none());
    Ok(weights)
}

/// A release config (`config`, as read) as transformers 5's `jina_embeddings_v3` writes
/// one, for a model with one task merged: the task adapters' keys and the release's own
/// (its classes, remote code, rotary base) dropped, the rotary base as `rope_parameters`.
pub fn plain_config(config: &mut serde_json::Value) {
    let Some(map) = config.as_object_mut() else {
        return;
    };
    let theta = map
        .get("rotary_emb_base")
        .and_then(|v| v.as_f64())
        .or_else(|| {
            map.get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .and_then(|v| v.as_f64())
        })
        .unwrap_or(20_000.0);
    for key in [
        "lora_adaptations",
        "lora_rank",
        "lora_alpha",
        "lora_dropout_p",
        "lora_main_params_trainable",
        "load_trained_adapters",
        "task_instructions",
        "auto_map",
        "architectures",
        "position_embedding_type",
        "rotary_emb_base",
        "use_flash_attn",
        "emb_pooler",
    ] {
        map.remove(key);
    }
    map.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_type": "default", "rope_theta": theta}),
    );
    map.insert("model_type".into(), "jina_embeddings_v3".into());
}
