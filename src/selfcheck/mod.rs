//! The checks a new device must pass before it is trusted with training (`gradcache
//! self-check --device cuda`): the gradient cache's equivalence with a plain full-batch
//! step, mixed precision against f32, and the f16 loss scaler's overflow detection, on a
//! tiny BERT built in code (no files, no download). The same checks run on the CPU in the
//! test suite, so the GPU run compares a device against what CI holds.

use candle_core::{DType, Device, Tensor};

mod families;
mod kernels;

use crate::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use crate::precision::{all_finite, LossScaler, Precision};
use crate::{GradCache, Gradients, InfoNce, ParamStore, Recompute, Result, TokenBatch};

/// One check: a measured value against its limit.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckResult {
    /// What was checked.
    pub name: String,
    /// The measured value (a relative error, or 0/1 for a yes/no property).
    pub value: f64,
    /// The largest value that passes.
    pub limit: f64,
}

impl CheckResult {
    /// Whether the value is within the limit.
    pub fn passed(&self) -> bool {
        self.value <= self.limit
    }
}

/// The tiny BERT the checks train (3 layers, hidden 32, 4 heads, dropout 0.1).
pub const TINY_BERT: &str = r#"{
  "model_type": "bert", "vocab_size": 60, "hidden_size": 32, "num_hidden_layers": 3,
  "num_attention_heads": 4, "intermediate_size": 48, "hidden_act": "gelu",
  "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
  "max_position_embeddings": 32, "type_vocab_size": 2, "initializer_range": 0.2
}"#;

/// A tiny Qwen3-layout decoder (q/k norms, two key-value heads for four query heads,
/// a windowed layer, dropout on the probabilities), two towers, left-padded rows.
pub const TINY_QWEN3: &str = r#"{
  "model_type": "qwen3", "vocab_size": 60, "hidden_size": 32, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "intermediate_size": 48, "hidden_act": "silu", "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6, "rope_theta": 50.0, "attention_dropout": 0.1,
  "use_sliding_window": true, "sliding_window": 3, "max_window_layers": 1,
  "initializer_range": 0.2
}"#;

/// `rows` right-padded token rows of different lengths (ids below 60) on `device`.
pub fn tokens(seed: u64, rows: usize, device: &Device) -> Result<TokenBatch> {
    let len = 10;
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 5 + seed as usize) % (len - 3);
        for c in 0..len {
            let id = 1 + ((r * 31 + c * 17 + seed as usize * 13) % 59) as u32;
            ids.push(if c < real { id } else { 0 });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, len), device);
    TokenBatch::new(t(ids)?, t(mask)?, t(vec![0u32; rows * len])?)
}

/// The largest `||got - want|| / ||want||` over the parameters of `want`, leaving out
/// those `skip` names (e.g. attention key biases, whose true gradient is zero: softmax
/// ignores a shift of a whole row, so only rounding noise is there). A parameter missing
/// from `got` counts as infinitely wrong. The two may live on different devices (a GPU's
/// gradients against the CPU's): both are compared on the CPU, in f64.
pub fn relative_error(
    got: &Gradients,
    want: &Gradients,
    skip: impl Fn(&str) -> bool,
) -> Result<f64> {
    let norm = |t: &Tensor| -> Result<f64> { Ok(t.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt()) };
    let mut worst = 0f64;
    for (name, w) in want.iter().filter(|(n, _)| !skip(n)) {
        let Some(g) = got.get(name) else {
            return Ok(f64::INFINITY);
        };
        let on_cpu =
            |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?) };
        let (g, w) = (on_cpu(g)?, on_cpu(w)?);
        if g.dims() != w.dims() {
            return Ok(f64::INFINITY);
        }
        let rel = norm(&(g - &w)?)? / norm(&w)?.max(f64::MIN_POSITIVE);
        worst = worst.max(if rel.is_nan() { f64::INFINITY } else { rel });
    }
    Ok(worst)
}

/// Whether `name` is an attention key bias (zero true gradient).
pub fn is_key_bias(name: &str) -> bool {
    name.ends_with("attention.self.key.bias")
}

fn encoder(
    store: &ParamStore,
    prefix: &str,
    precision: Precision,
    recompute: Recompute,
) -> Result<BertEncoder> {
    let cfg: BertConfig =
        serde_json::from_str(TINY_BERT).map_err(|e| crate::Error::InvalidArgument {
            what: "self-check model config",
            value: e.to_string(),
            reason: "does not parse",
        })?;
    let options = BertOptions {
        lora: None,
        pooling: Pooling::Mean,
        normalize: true,
        recompute,
        precision,
        dense: Vec::new(),
        multi_vector: false,
        sparse: None,
        classifier: None,
    };
    BertEncoder::build(store, prefix, &cfg, &options)
}

/// Runs every check on `device` and returns the results (failures are results, not
/// errors; an error means a check could not run at all).
pub fn run(device: &Device) -> Result<Vec<CheckResult>> {
    let mut out = Vec::new();
    let (q, p) = (tokens(1, 8, device)?, tokens(2, 8, device)?);

    // The gradient cache equals the plain full-batch step (dropout off: the plain step
    // draws other masks), f32, one shared tower in chunks of 3.
    let store = ParamStore::new(3, DType::F32, device);
    let loss = InfoNce::new(0.05)?.with_symmetric(true);
    let gc = GradCache::shared(
        encoder(&store, "", Precision::F32, Recompute::Off)?,
        3,
        loss,
    )?
    .with_seed(5)
    .with_dropout(false);
    let (cached, full) = (gc.cache_step(0, &q, &p)?, gc.full_batch_step(0, &q, &p)?);
    out.push(CheckResult {
        name: "f32 cached == full batch, shared tower, chunks of 3".into(),
        value: relative_error(&cached.grads, &full.grads, is_key_bias)?,
        limit: 1e-5,
    });

    // Two towers, checkpointed every layer, chunks of 2 and 5, dot similarity.
    let store = ParamStore::new(4, DType::F32, device);
    let loss = InfoNce::new(0.1)?.with_similarity(crate::Similarity::Dot);
    let gc = GradCache::two_towers(
        encoder(&store, "query", Precision::F32, Recompute::EveryLayer)?,
        encoder(&store, "passage", Precision::F32, Recompute::Sqrt)?,
        2,
        5,
        loss,
    )?
    .with_seed(6)
    .with_dropout(false);
    let (cached, full) = (gc.cache_step(0, &q, &p)?, gc.full_batch_step(0, &q, &p)?);
    out.push(CheckResult {
        name: "f32 cached + checkpointed == full batch, two towers, chunks of 2/5".into(),
        value: relative_error(&cached.grads, &full.grads, is_key_bias)?,
        limit: 1e-5,
    });

    // Mixed precision against f32 on the same weights and batch, dropout on.
    let store = ParamStore::new(5, DType::F32, device);
    let step = |precision, scale| -> Result<Gradients> {
        let loss = InfoNce::new(0.05)?.with_symmetric(true);
        let gc = GradCache::shared(encoder(&store, "", precision, Recompute::Off)?, 3, loss)?
            .with_seed(9);
        Ok(gc.cache_step_scaled(0, &q, &p, scale)?.grads)
    };
    let reference = step(Precision::F32, 1.0)?;
    for (precision, limit, name) in [
        (Precision::Bf16, 5e-2, "bf16 cached step against f32"),
        (Precision::F16, 1e-2, "f16 cached step against f32"),
    ] {
        out.push(CheckResult {
            name: name.into(),
            value: relative_error(&step(precision, 1.0)?, &reference, is_key_bias)?,
            limit,
        });
    }
    let scaler = LossScaler {
        scale: 1024.0,
        ..LossScaler::default()
    };
    let mut scaled = step(Precision::F16, scaler.scale)?;
    let finite = scaler.unscale(&mut scaled)?;
    out.push(CheckResult {
        name: "f16 at loss scale 2^10, unscaled, against f32".into(),
        value: if finite {
            relative_error(&scaled, &reference, is_key_bias)?
        } else {
            f64::INFINITY
        },
        limit: 1e-2,
    });
    let overflowed = step(Precision::F16, 2f64.powi(30))?;
    out.push(CheckResult {
        name: "f16 at loss scale 2^30 overflows and is detected (1: missed)".into(),
        value: f64::from(u8::from(all_finite(&overflowed)?)),
        limit: 0.0,
    });
    out.extend(kernels::run(device)?);
    families::run(device, &mut out)?;
    Ok(out)
}
