//! Peak memory of one cached step at the size users train decoder embedders: the shape of
//! Qwen3-Embedding-0.6B built in code (28 layers, hidden 1,024, 16 query heads, 8 KV
//! heads, head_dim 128, feed-forward 3,072, vocabulary 151,669; random weights), batches
//! of 64 and 128 pairs of 128 tokens each (no padding), chunks of 8, recompute every layer,
//! then an AdamW step.
//!
//! ```text
//! cargo bench --bench decoder_memory                 # batches 64 and 128 (about 25 min
//!                                                    # on 2 cores)
//! cargo bench --bench decoder_memory -- --batch 64   # one batch
//! cargo bench --bench decoder_memory -- --layers 2   # a quick look (same widths)
//! cargo bench --bench decoder_memory -- --lora 16     # LoRA r 16 (alpha 32) on every
//!                                                    # projection, the base frozen
//! cargo bench --bench decoder_memory -- --lora 16 --bf16-base   # ... its projections'
//!                                                    # base weights in bf16
//! ```
//!
//! With `--lora R` the weights column is the frozen base and the adapters, the gradients
//! and the optimizer state are the adapters' alone.
//!
//! The heap is counted by a global allocator and split into what a step must hold and
//! what it may not keep: the weights (`4 x parameters` bytes), the gradients (one per
//! parameter, the token table's included: its rows are added into a dense buffer), the
//! optimizer state (AdamW's two moments), and the rest: the peak of the step above the
//! weights and the gradients it ends with (activations, the cache, the recompute
//! boundaries, buffers). The rest should not grow with the batch: the gradient cache holds
//! one chunk's activations whatever the batch. The process's peak resident set
//! (`VmHWM`) is printed too, to set beside sentence-transformers' (`scripts/decoder_peer.py
//! memory`, the same step with `CachedMultipleNegativesRankingLoss`).

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::memory::{current_bytes, human_bytes, measure, CountingAllocator};
use gradcache::train::optim::{Optimizer, OptimizerKind};
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, Similarity};

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Qwen3-Embedding-0.6B's shape with `layers` layers.
fn qwen3_0_6b(layers: usize) -> BertConfig {
    let mut cfg = BertConfig::new(151_669, 1024, layers, 16, 3072, 32_768);
    cfg.model_type = Some("qwen3".into());
    cfg.hidden_act = "silu".into();
    cfg.pad_token_id = Some(151_643);
    for (key, value) in [
        ("num_key_value_heads", 8.into()),
        ("head_dim", 128.into()),
        ("rms_norm_eps", 1e-6.into()),
        ("rope_theta", 1_000_000.0.into()),
        ("attention_dropout", 0.0.into()),
    ] {
        cfg.extra.insert(key.into(), value);
    }
    cfg
}

/// The process's peak resident set (`VmHWM` of `/proc/self/status`), in bytes.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// `--bf16-base`: LoRA's projections' frozen weights in bf16 (`model.base_dtype`).
fn bf16_base() -> bool {
    std::env::args().any(|a| a == "--bf16-base")
}

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let layers = arg("--layers").unwrap_or(28);
    let lora = arg("--lora");
    let Some(batch) = arg("--batch") else {
        // Each batch in a process of its own, so that its peak resident set is its own.
        for batch in [64, 128] {
            let mut args = vec![
                "--batch".to_string(),
                batch.to_string(),
                "--layers".into(),
                layers.to_string(),
            ];
            if let Some(rank) = lora {
                args.extend(["--lora".into(), rank.to_string()]);
            }
            if bf16_base() {
                args.push("--bf16-base".into());
            }
            let status = std::process::Command::new(std::env::current_exe()?)
                .args(&args)
                .arg(if batch == 64 {
                    "--header"
                } else {
                    "--no-header"
                })
                .status()?;
            anyhow::ensure!(status.success(), "the batch-{batch} run failed");
        }
        return Ok(());
    };
    let (len, chunk) = (128, 8);
    let (model, vendor) = common::cpu();
    if std::env::args().any(|a| a == "--no-header") {
        return run(batch, layers, len, chunk, lora);
    }
    let adapters = match lora {
        Some(r) => format!(
            "LoRA r {r} alpha {} on every projection, the base frozen{}; ",
            2 * r,
            if bf16_base() {
                " (the projections' base weights in bf16)"
            } else {
                ""
            }
        ),
        None => String::new(),
    };
    println!(
        "# Qwen3-Embedding-0.6B shape, {layers} layers; {adapters}{len} tokens a text, chunks \
         of {chunk}, recompute every layer, then AdamW; {} ({vendor}), {} threads",
        model,
        candle_core::utils::get_num_threads()
    );
    println!(
        "| batch (pairs) | weights | gradients | optimizer state | rest (activations, cache, \
         buffers) | step s | peak RSS |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    run(batch, layers, len, chunk, lora)
}

/// One step at `batch` pairs (LoRA of rank `lora`, if given): prints its row.
fn run(
    batch: usize,
    layers: usize,
    len: usize,
    chunk: usize,
    lora: Option<usize>,
) -> anyhow::Result<()> {
    {
        let cfg = qwen3_0_6b(layers);
        let before = current_bytes();
        let spec = lora.map(|rank| gradcache::nn::lora::LoraSpec {
            rank,
            alpha: 2.0 * rank as f64,
            targets: vec![],
            rslora: false,
            dropout: 0.0,
        });
        let mut store = ParamStore::new(7, DType::F32, &Device::Cpu);
        if let Some(spec) = &spec {
            let mut frozen = gradcache::params::Freeze::default().all_but_adapters();
            if bf16_base() {
                frozen = frozen.narrowing(DType::BF16, &spec.targets);
            }
            store = store.with_frozen(frozen);
        }
        let options = BertOptions {
            lora: spec.clone(),
            pooling: Pooling::LastToken,
            normalize: true,
            recompute: Recompute::EveryLayer,
            ..Default::default()
        };
        let encoder = BertEncoder::build(&store, "", &cfg, &options)?;
        let weights = current_bytes() - before;
        // What trains: every parameter, or the adapters alone.
        let params = gradcache::Encoder::params(&encoder).clone();
        if lora.is_some() {
            // B starts at zero: move it, so the step's gradients are those of training.
            for (name, var) in params.iter() {
                if name.contains(".lora_B.") {
                    var.set(&var.as_tensor().ones_like()?.affine(1e-3, 0.0)?)?;
                }
            }
        }
        let loss = InfoNce::new(0.05)?.with_similarity(Similarity::Cosine);
        let gc = GradCache::shared(encoder, chunk, loss)?.with_dropout(false);
        let vocab = (0, cfg.vocab_size - 1000);
        let q = common::random_tokens(1, (batch, len), vocab)?;
        let p = common::random_tokens(2, (batch, len), vocab)?;
        let (ms, peak, out) = measure(|| gc.cache_step(0, &q, &p));
        let out = out?;
        let gradients: usize = out.grads.iter().map(|(_, g)| g.elem_count() * 4).sum();
        let rest = peak.saturating_sub(gradients);
        let mut optimizer = Optimizer::new(OptimizerKind::adamw(), params)?;
        let held = current_bytes();
        optimizer.step(0, &out.grads, 1e-5)?;
        let state = current_bytes().saturating_sub(held);
        drop(out);
        println!(
            "| {batch} | {} | {} | {} | {} | {:.0} | {} |",
            human_bytes(weights as u64),
            human_bytes(gradients as u64),
            human_bytes(state as u64),
            human_bytes(rest as u64),
            ms / 1e3,
            human_bytes(peak_rss()),
        );
    }
    Ok(())
}
