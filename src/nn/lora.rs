//! LoRA (low-rank adaptation, Hu et al. 2021) as PEFT defines it: a projection
//! `y = x W^T + b` of a frozen `W` `[out, in]` gains a trainable low-rank update,
//!
//! ```text
//! y = x W^T + b + s (dropout(x) A^T) B^T        A [r, in], B [out, r]
//! s = alpha / r   (rsLoRA: alpha / sqrt(r))
//! ```
//!
//! with `A` Kaiming-uniform (PEFT's `a = sqrt(5)`: uniform in `+-1/sqrt(in)`, drawn from
//! the run's seed) and `B` zero, so training starts from the base model. The adapters are
//! stored under PEFT's names, `<module>.lora_A.weight` and `<module>.lora_B.weight`. The
//! dropout (PEFT's `lora_dropout`) is seeded like every dropout here: one mask per
//! projection, layer and chunk, drawn again bit for bit by every replay.
//!
//! How it runs. On the CPU the fused layer nodes ([`super::cpu::encoder_layer`],
//! [`super::cpu::prenorm_layer`], [`super::cpu::decoder_layer`]) take the frozen `W` as stored (a
//! bf16 or f16 base read widened) and each adapter beside it: the low-rank branch
//! `s (dropout(x) A^T) B^T` is added inside the node and its backward written out
//! (`super::cpu::products::lora_branch`: `dB = s dy^T t`, `dA = (s dy B)^T dropout(x)`), and the
//! frozen `W`'s own gradient is never computed. Elsewhere (off the CPU, or a node that does not
//! take the layer) the projection runs as composed ops: without a dropout mask on the
//! merged weight `W + s B A` (on the CPU one node, [`Adapter::merged`]), whose gradient
//! `dW'` candle's autograd turns into `dA = s B^T dW'` and `dB = s dW' A^T`; with one,
//! `x W^T + b` plus the branch on the masked input. Both draw the mask of an adapter's
//! input at the same element places ([`site`] names it), so they give the same step.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

pub use super::cpu::products::lora_branch::LoraInput;
use crate::names::targets_module;
pub use crate::names::{is_adapter, target_matches, DEFAULT_TARGETS};
use crate::{Error, Result};

/// The LoRA settings of a run (`[model.lora]`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// `alpha`: the update is scaled by `alpha / r` (rsLoRA: `alpha / sqrt(r)`).
    pub alpha: f64,
    /// Module names as PEFT's `target_modules` matches them (a name matches a module whose
    /// path is that name or ends with `.` + that name; with `*`, the whole path); empty:
    /// every linear projection of attention and feed-forward.
    pub targets: Vec<String>,
    /// rsLoRA's scale `alpha / sqrt(r)`.
    pub rslora: bool,
    /// Dropout on the adapters' input (PEFT's `lora_dropout`), in `[0, 1)`: seeded like
    /// every dropout here, one mask per projection and chunk (see [`site`]).
    pub dropout: f64,
}

impl LoraSpec {
    /// The scale `s` of the update.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Whether the projection at `path` (a module path, with or without its tower's
    /// prefix) gets an adapter.
    pub fn targets_module(&self, path: &str) -> bool {
        targets_module(&self.targets, path)
    }
}

/// The dropout site (of a mask seed) of the adapter on a layer's `projection`-th
/// projection (in the order of the layer's module list), above every other site.
pub fn site(projection: u32) -> u32 {
    16 + projection
}

/// A projection's adapter: `A` `[r, in]`, `B` `[out, r]`, the scale, its dropout, and
/// the mask of this forward (set by [`super::Linear::at`]).
#[derive(Debug, Clone)]
pub struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f64,
    mask: Option<(u64, f32)>,
}

impl Adapter {
    /// The adapter of the projection under `vb` (`in` -> `out`) when `spec` targets it:
    /// `lora_A` Kaiming-uniform from the store's seed (or read from the store's weights),
    /// `lora_B` zeros. A rank above the projection's narrower side is refused.
    pub fn build(
        spec: Option<&LoraSpec>,
        input: usize,
        output: usize,
        vb: &VarBuilder,
    ) -> Result<Option<Self>> {
        let Some(spec) = spec else {
            return Ok(None);
        };
        let path = vb.prefix();
        if !spec.targets_module(&path) {
            return Ok(None);
        }
        if spec.rank == 0 || spec.rank > input.min(output) {
            return Err(Error::InvalidConfig {
                field: "model.lora.rank",
                value: spec.rank.to_string(),
                reason: if spec.rank == 0 {
                    "an adapter needs a rank of at least 1"
                } else {
                    "exceeds the width of a targeted projection (a rank above min(in, out) \
                     adds nothing a full update would not)"
                },
            });
        }
        let bound = 1.0 / (input as f64).sqrt();
        let a = vb.pp("lora_A").get_with_hints_dtype(
            (spec.rank, input),
            "weight",
            candle_nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
            DType::F32,
        )?;
        let b = vb.pp("lora_B").get_with_hints_dtype(
            (output, spec.rank),
            "weight",
            candle_nn::init::ZERO,
            DType::F32,
        )?;
        Ok(Some(Self {
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout,
            mask: None,
        }))
    }

    /// An adapter of the factors `a` `[r, in]` and `b` `[out, r]` (variables of the
    /// store, or views of them), scaled by `scale`, without dropout: a task adapter of
    /// Jina v3 (see [`crate::models::bert::TaskAdapters`]), whose update `s B A` is
    /// PEFT's.
    pub fn from_factors(a: Tensor, b: Tensor, scale: f64) -> Self {
        Self {
            a,
            b,
            scale,
            dropout: 0.0,
            mask: None,
        }
    }

    /// This adapter with the dropout mask of `seed` (the chunk's seed of its layer and
    /// [`site`]; `None` in evaluation: no mask).
    pub fn at(&self, seed: Option<u64>) -> Self {
        let mask = seed
            .filter(|_| self.dropout > 0.0)
            .map(|seed| (seed, self.dropout as f32));
        Self {
            mask,
            ..self.clone()
        }
    }

    /// Whether the adapter reaches the layer as a merged weight `W + s B A` this forward
    /// (no dropout mask on its input).
    pub fn merges(&self) -> bool {
        self.mask.is_none()
    }

    /// The adapter as a layer node takes it (the low-rank branch inside the node).
    pub fn input(&self) -> super::cpu::products::lora_branch::LoraInput {
        super::cpu::products::lora_branch::LoraInput {
            a: self.a.clone(),
            b: self.b.clone(),
            scale: self.scale,
            dropout: self.mask,
        }
    }

    /// The branch `s (dropout(x) A^T) B^T` as composed ops (any device and dtype; the
    /// mask is the layer nodes' element for element).
    pub fn branch(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.mask {
            Some((seed, p)) => super::dropout(x, seed, p)?,
            None => x.clone(),
        };
        let a = self.a.to_dtype(x.dtype())?;
        let b = self.b.to_dtype(x.dtype())?;
        let t = super::linear(&x, &a, None)?;
        Ok(super::linear(&t, &b, None)?.affine(self.scale, 0.0)?)
    }

    /// `W + s B A` in f32 (the base weight widened when it is stored narrower): on the
    /// CPU one node (see `Self::merged_on_cpu`), elsewhere composed ops.
    pub fn merged(&self, base: &Tensor) -> Result<Tensor> {
        if let Some(w) = self.merged_on_cpu(base)? {
            return Ok(w);
        }
        let update = self.b.matmul(&self.a)?.affine(self.scale, 0.0)?;
        let base = match base.dtype() {
            DType::F32 | DType::F64 => base.clone(),
            _ => base.to_dtype(DType::F32)?,
        };
        Ok(base.add(&update.to_dtype(base.dtype())?)?)
    }
}

impl Adapter {
    /// `W + s B A` as one node on the CPU (f32 adapters, a frozen base in f32, bf16 or
    /// f16): the base read in its own dtype straight into the result and `s B A` added by
    /// one product; the backward turns `dW'` into `dA = s B^T dW'` and `dB = s dW' A^T` by
    /// two products, into the gradient sink. One `[out, in]` buffer (the result) where the
    /// composed ops held four (the widened base, `B A`, its scaled copy, the sum) and the
    /// scaled `dW'` of their backward. `None` where it does not run.
    fn merged_on_cpu(&self, base: &Tensor) -> Result<Option<Tensor>> {
        if base.track_op()
            || !base.device().is_cpu()
            || !super::fused_ok(&[&self.a, &self.b])
            || self.a.dtype() != DType::F32
        {
            return Ok(None);
        }
        let (out, input) = base.dims2()?;
        let rank = self.a.dim(0)?;
        let Some(mut w) = widened(base)? else {
            return Ok(None);
        };
        let s = self.scale as f32;
        let (a, b) = (self.a.detach().contiguous()?, self.b.detach().contiguous()?);
        let a_vals: Vec<f32> = a.flatten_all()?.to_vec1()?;
        let b_scaled: Vec<f32> = b
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v * s)
            .collect();
        // W' [out, in] += (s B) [out, r] A [r, in]
        super::cpu::products::gemm::product(
            (out, input, rank),
            (&mut w, input),
            true,
            (&b_scaled, rank, 1),
            (&a_vals, input, 1),
        );
        let params = [self.a.clone(), self.b.clone()];
        let backward: super::node::BackwardN = Box::new(move |dw| {
            let dw = dw.contiguous()?.to_dtype(DType::F32)?;
            let view = super::cpu::layers::packing::View::new(&dw)?;
            let dw = view.values::<f32>()?;
            // dA [r, in] = (s B)^T [r, out] dW' [out, in]
            let mut da = vec![0f32; rank * input];
            super::cpu::products::gemm::product(
                (rank, input, out),
                (&mut da, input),
                false,
                (&b_scaled, 1, rank),
                (dw, input, 1),
            );
            // dB [out, r] = dW' [out, in] (s A)^T [in, r]
            let a_scaled: Vec<f32> = a_vals.iter().map(|v| v * s).collect();
            let mut db = vec![0f32; out * rank];
            super::cpu::products::gemm::product(
                (out, rank, input),
                (&mut db, rank),
                false,
                (dw, input, 1),
                (&a_scaled, 1, input),
            );
            Ok(vec![
                crate::sink::deposit(&params[0], da)?,
                crate::sink::deposit(&params[1], db)?,
            ])
        });
        Ok(Some(super::node::node_n_owned(
            "gradcache-lora-merged",
            &[&self.a, &self.b],
            w,
            (out, input).into(),
            backward,
        )?))
    }
}

/// A stored base weight's values widened to f32 (a copy), read from its storage whatever
/// its dtype; `None` for a strided or non-float one.
fn widened(base: &Tensor) -> Result<Option<Vec<f32>>> {
    let (storage, layout) = base.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    Ok(match &*storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => Some(v[start..end].to_vec()),
        candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(v)) => {
            Some(v[start..end].iter().map(|x| x.to_f32()).collect())
        }
        candle_core::Storage::Cpu(candle_core::CpuStorage::F16(v)) => {
            Some(v[start..end].iter().map(|x| x.to_f32()).collect())
        }
        _ => None,
    })
}

/// Folds every adapter of `weights` into its projection (`<m>.weight` becomes
/// `W + s B A` in W's dtype) and removes the adapters: the model as PEFT's
/// `merge_and_unload` leaves it.
pub fn merge_into(
    weights: &mut std::collections::HashMap<String, Tensor>,
    spec: &LoraSpec,
) -> Result<()> {
    let modules: Vec<String> = weights
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .map(String::from)
        .collect();
    for m in modules {
        let take = |weights: &mut std::collections::HashMap<String, Tensor>, name: String| {
            weights.remove(&name).ok_or(Error::MissingWeight {
                name,
                path: "the run's adapters".into(),
            })
        };
        let a = take(weights, format!("{m}.lora_A.weight"))?;
        let b = take(weights, format!("{m}.lora_B.weight"))?;
        let name = format!("{m}.weight");
        let base = weights.get(&name).ok_or_else(|| Error::MissingWeight {
            name: name.clone(),
            path: "the run's weights".into(),
        })?;
        let adapter = Adapter {
            a,
            b,
            scale: spec.scale(),
            dropout: 0.0,
            mask: None,
        };
        // In f32 (a base stored narrower for training is exported at full width).
        let merged = adapter.merged(base)?;
        weights.insert(name, merged);
    }
    Ok(())
}

/// PEFT's files for the adapters among `weights` (names as the base model's own): the
/// `adapter_config.json` value and the tensors of `adapter_model.safetensors`, keyed
/// `base_model.model.<module>.lora_{A,B}.weight`, so that
/// `PeftModel.from_pretrained(AutoModel.from_pretrained(base), dir)` rebuilds the
/// adapted model.
pub fn peft_files(
    weights: &std::collections::HashMap<String, Tensor>,
    spec: &LoraSpec,
    base: &str,
) -> Result<(serde_json::Value, std::collections::HashMap<String, Tensor>)> {
    let tensors: std::collections::HashMap<String, Tensor> = weights
        .iter()
        .filter(|(n, _)| is_adapter(n))
        .map(|(n, t)| (format!("base_model.model.{n}"), t.clone()))
        .collect();
    let mut modules: Vec<&str> = weights
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .collect();
    modules.sort_unstable();
    if modules.is_empty() {
        return Err(Error::InvalidArgument {
            what: "--adapter",
            value: base.to_string(),
            reason: "the tower holds no LoRA adapter",
        });
    }
    // The modules' last two names (`self_attn.q_proj`, `attention.output.dense`) where
    // they pick out exactly the adapted projections of the model; else every path.
    let tail = |m: &str| -> String {
        let parts: Vec<&str> = m.rsplitn(3, '.').collect();
        match parts.as_slice() {
            [last, second, _] => format!("{second}.{last}"),
            _ => m.to_string(),
        }
    };
    let mut tails: Vec<String> = modules.iter().map(|m| tail(m)).collect();
    tails.sort_unstable();
    tails.dedup();
    let matching = weights
        .keys()
        .filter_map(|n| n.strip_suffix(".weight"))
        .filter(|m| !is_adapter(m) && tails.iter().any(|t| target_matches(t, m)))
        .count();
    let targets: Vec<String> = if matching == modules.len() {
        tails
    } else {
        modules.iter().map(|m| m.to_string()).collect()
    };
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": false,
        "revision": null,
    });
    Ok((config, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_as_peft_matches_them() {
        let path = "encoder.layer.0.attention.self.query";
        assert!(target_matches("query", path));
        assert!(target_matches("self.query", path));
        assert!(target_matches(path, path));
        assert!(!target_matches("uery", path));
        assert!(!target_matches("attention", path));
        assert!(target_matches("encoder.layer.*.query", path));
        assert!(!target_matches("encoder.layer.1.*", path));
        assert!(is_adapter("layers.0.mlp.up_proj.lora_A.weight"));
        assert!(!is_adapter("layers.0.mlp.up_proj.weight"));
    }

    #[test]
    fn the_scale_is_alpha_over_rank_or_its_root() {
        let mut spec = LoraSpec {
            rank: 16,
            alpha: 64.0,
            targets: vec![],
            rslora: false,
            dropout: 0.0,
        };
        assert_eq!(spec.scale(), 4.0);
        spec.rslora = true;
        assert_eq!(spec.scale(), 16.0);
    }
}
