//! Peak memory of a ColBERT (multi-vector) cached step as the batch grows. A
//! representation is a token matrix, not a vector: a BERT-base ColBERT keeps queries of
//! 32 tokens (with expansion) and documents of up to 180 tokens as 128-d vectors, 16 KiB
//! and 90 KiB per text. The cache holds those matrices and their gradients (linear in the
//! batch, as the single-vector cache's vectors); the MaxSim loss computes the token-to-token
//! similarities a block at a time (flat in the batch).
//!
//! ```text
//! cargo bench --bench colbert_memory                 # loss + cache at 256 .. 1,024 pairs,
//!                                                    # then whole steps at 16 and 32 pairs
//! cargo bench --bench colbert_memory -- --loss-only  # the first table alone
//! ```
//!
//! Table 1 (loss and cache): the token matrices of a BERT-base ColBERT's outputs (random
//! unit vectors; documents keep 60 to 180 tokens, the rest absent) for 256 to 1,024
//! (query, positive) pairs, and one hard negative per query at 1,024; the peak of
//! the loss's value and gradients above the matrices themselves (the cached gradients
//! included), split into the cached gradients and the loss's own temporaries.
//!
//! Table 2 (whole steps): a BERT-base ColBERT (12 layers, hidden 768, random weights)
//! at 16 and 32 pairs, chunks of 8, dropout off: each phase's peak (representation pass,
//! loss + cache, replay). A chunk's graph is what a step holds at its peak, whatever the
//! batch; the loss phase grows by the token matrices alone.
//!
//! Peak memory is counted by a global allocator: the most bytes allocated at once during
//! the measured call, above what was allocated before it.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, DenseActivation, DenseSpec};
use gradcache::memory::{measure, CountingAllocator};
use gradcache::{GradCache, Loss, MaxSim, ParamStore, TokenBatch};

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const DIM: usize = 128;
const QUERY: usize = 32;
const DOCUMENT: usize = 180;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `rows` token matrices of `tokens` random unit vectors, row `r` keeping its first
/// `keep(r)` tokens (the rest zero: absent), flattened to `[rows, tokens * DIM]`.
fn matrices(rows: usize, tokens: usize, keep: impl Fn(usize) -> usize) -> anyhow::Result<Tensor> {
    let device = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (rows, tokens, DIM), &device)?;
    let x = gradcache::nn::l2_normalize(&x)?;
    let mask: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let k = keep(r);
            (0..tokens).map(move |t| f32::from(u8::from(t < k)))
        })
        .collect();
    let mask = Tensor::from_vec(mask, (rows, tokens, 1), &device)?;
    Ok(x.broadcast_mul(&mask)?.reshape((rows, tokens * DIM))?)
}

fn loss_and_cache() -> anyhow::Result<()> {
    println!("| pairs | passages | token matrices MiB | peak above them MiB | cached gradients MiB | loss temporaries MiB | s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (pairs, group) in [(256, 1), (512, 1), (1024, 1), (1024, 2)] {
        let q = matrices(pairs, QUERY, |_| QUERY)?;
        let p = matrices(pairs * group, DOCUMENT, |r| 60 + (r * 37) % 121)?;
        let loss = MaxSim::new(DIM)?;
        let held = (q.elem_count() + p.elem_count()) * 4;
        let (ms, peak, value) = measure(|| loss.value_and_grads(&q, &p));
        let value = value?;
        let grads = (value.grad_queries.elem_count() + value.grad_passages.elem_count()) * 4;
        println!(
            "| {pairs} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
            pairs * group,
            mib(held),
            mib(peak),
            mib(grads),
            mib(peak.saturating_sub(grads)),
            ms / 1e3
        );
    }
    Ok(())
}

/// Random token ids of `rows` texts: queries all `len` tokens (expanded), documents 60
/// to `len` real tokens, right-padded.
fn tokens(seed: u64, rows: usize, len: usize, query: bool) -> anyhow::Result<TokenBatch> {
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let real = if query {
            len
        } else {
            60 + (r * 37 + seed as usize) % (len - 59)
        };
        for t in 0..len {
            let id = 1000 + ((r * 7919 + t * 104_729 + seed as usize * 31) % 28_000) as u32;
            ids.push(if t < real { id } else { 0 });
            mask.push(u32::from(t < real));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, len), &Device::Cpu);
    let keep = t(mask.clone())?;
    Ok(TokenBatch::new(t(ids)?, t(mask)?, t(vec![0; rows * len])?)?.with_vectors(keep, len)?)
}

fn whole_steps() -> anyhow::Result<()> {
    let cfg = BertConfig::new(30_522, 768, 12, 12, 3072, 512);
    let options = BertOptions {
        normalize: true,
        multi_vector: true,
        dense: vec![DenseSpec {
            path: "1_Dense".into(),
            in_features: 768,
            out_features: DIM,
            bias: false,
            activation: DenseActivation::Identity,
        }],
        ..Default::default()
    };
    println!();
    println!("| pairs | chunk | step peak MiB | represent MiB | loss + cache MiB | replay MiB | step s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for pairs in [16, 32] {
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let encoder = BertEncoder::build(&store, "", &cfg, &options)?;
        let gc = GradCache::shared(encoder, 8, MaxSim::new(DIM)?)?.with_dropout(false);
        let (q, p) = (
            tokens(1, pairs, QUERY, true)?,
            tokens(2, pairs, DOCUMENT, false)?,
        );
        let (ms, peak, out) = measure(|| gc.cache_step(0, &q, &p));
        let m = out?.peaks;
        println!(
            "| {pairs} | 8 | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
            mib(peak),
            mib(m.represent),
            mib(m.loss),
            mib(m.replay),
            ms / 1e3
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let (model, vendor) = common::cpu();
    println!(
        "# ColBERT: {DIM}-d token vectors, queries {QUERY} tokens, documents up to {DOCUMENT}; \
         {} cores of {model} ({vendor})",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    loss_and_cache()?;
    if !std::env::args().any(|a| a == "--loss-only") {
        whole_steps()?;
    }
    Ok(())
}
