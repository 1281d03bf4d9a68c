//! Peak memory of a sparse (SPLADE) model's loss phase as the batch grows. A
//! representation is as wide as the vocabulary (30,522 entries at BERT's, 119 KiB per text
//! in f32), so the cache of a large batch is large: the loss should add nothing that grows
//! with the batch beyond the cached gradients (as wide as the vectors, one per text).
//!
//! ```text
//! cargo bench --bench splade_memory
//! ```
//!
//! For 1,024 and 4,096 (query, positive) pairs: vocabulary-wide vectors as a SPLADE model
//! gives them (non-negative, 200 active entries per query and 400 per document, the rest
//! exactly zero), `SpladeLoss` over InfoNCE on dot products (temperature 1) with both FLOPS
//! regularisers (sentence-transformers' default weights): the peak of the loss's value and
//! gradients above the vectors themselves, split into the cached gradients and the loss's
//! own temporaries, which should stay flat.
//!
//! Peak memory is counted by a global allocator: the most bytes allocated at once during
//! the measured call, above what was allocated before it.

use candle_core::{Device, Tensor};
use gradcache::loss::{Flops, SpladeLoss};
use gradcache::memory::{measure, CountingAllocator};
use gradcache::{InfoNce, Loss, Similarity};

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const VOCAB: usize = 30_522;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `rows` vectors of `VOCAB` entries with `active` of them non-zero (spread by a stride),
/// values in (0, 3).
fn vectors(seed: usize, rows: usize, active: usize) -> anyhow::Result<Tensor> {
    let mut v = vec![0f32; rows * VOCAB];
    for r in 0..rows {
        for k in 0..active {
            let j = (r * 7919 + k * 104_729 + seed * 31) % VOCAB;
            v[r * VOCAB + j] = 0.1 + ((r * 13 + k * 7 + seed) % 29) as f32 / 10.0;
        }
    }
    Ok(Tensor::from_vec(v, (rows, VOCAB), &Device::Cpu)?)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let loss = SpladeLoss::new(
        InfoNce::new(1.0)?.with_similarity(Similarity::Dot),
        Flops::new(3e-5)?,
    )
    .with_queries(Some(Flops::new(5e-5)?));
    println!("| pairs | vectors MiB | peak above them MiB | cached gradients MiB | loss temporaries MiB | s |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for pairs in [1024, 4096] {
        let q = vectors(1, pairs, 200)?;
        let p = vectors(2, pairs, 400)?;
        let held = (q.elem_count() + p.elem_count()) * 4;
        let (ms, peak, value) = measure(|| loss.value_and_grads(&q, &p));
        let value = value?;
        let grads = (value.grad_queries.elem_count() + value.grad_passages.elem_count()) * 4;
        println!(
            "| {pairs} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
            mib(held),
            mib(peak),
            mib(grads),
            mib(peak.saturating_sub(grads)),
            ms / 1e3
        );
    }
    Ok(())
}
