//! Peak memory of one cached BERT step as the batch grows into the thousands: the promise
//! of the gradient cache is the memory of one chunk whatever the batch. The tower is the
//! quickstart's shape (fresh BERT, hidden 128, 2 layers, 4 heads, feed-forward 256,
//! vocabulary 4,000), sequences of 64 tokens, chunks of 32, dropout off, the loss in row
//! blocks of 256, with and without the symmetric term.
//!
//! ```text
//! cargo bench --bench batch_memory            # batches 512 .. 4096 (a few minutes)
//! cargo bench --bench batch_memory -- --quick # 256 and 512
//! cargo bench --bench batch_memory -- --scale # 1,024 .. 65,536 pairs of 32 tokens
//! cargo bench --bench batch_memory -- --batches 1984,3968   # those batches
//! ```
//!
//! `--scale` is the gradient cache's point: sequences of 32 tokens, global batches of
//! 1,024, 4,096, 16,384 and 65,536 pairs, the loss as the trainer computes it by default
//! (on the CPU the loss kernel: 256-row blocks by a tile of 512 columns; the full
//! `65,536 x 65,536` logits would be 16 GiB). It also prints each phase's peak (representation pass, loss + cache, replay).
//!
//! Peak memory is counted by a global allocator: the largest number of bytes allocated at
//! once during the step (representation pass, loss and cache, replay), above what was
//! allocated before it. What grows with the batch is the `[B, d]` representations, their
//! gradients and one row block of logits (`256 x B`): linear and small next to a chunk's
//! activations.

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::loss::KERNEL_BLOCK_ROWS;
use gradcache::memory::{measure, CountingAllocator};
use gradcache::{GradCache, InfoNce, ParamStore, Similarity};

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = std::env::args().any(|a| a == "--scale");
    // `--batches 1984,3968`: those batches (64 tokens, 256-row blocks), no symmetric term.
    let args: Vec<String> = std::env::args().collect();
    let chosen: Vec<(usize, bool)> = args
        .iter()
        .position(|a| a == "--batches")
        .and_then(|i| args.get(i + 1))
        .map(|list| {
            list.split(',')
                .filter_map(|b| b.trim().parse().ok())
                .map(|b| (b, false))
                .collect()
        })
        .unwrap_or_default();
    let len = if scale { 32 } else { 64 };
    // (batch, symmetric): the sweep, then the symmetric term at the largest batch.
    let runs: &[(usize, bool)] = if !chosen.is_empty() {
        &chosen
    } else if scale {
        &[(1024, false), (4096, false), (16384, false), (65536, false)]
    } else if quick {
        &[(256, false), (512, false), (512, true)]
    } else {
        &[
            (512, false),
            (1024, false),
            (2048, false),
            (4096, false),
            (4096, true),
        ]
    };
    let cfg = BertConfig::new(4000, 128, 2, 4, 256, len);
    let blocks = if scale {
        format!(
            "the trainer's default loss blocks (the CPU kernel's {KERNEL_BLOCK_ROWS} rows by a \
             tile)"
        )
    } else {
        "loss blocks of 256".to_string()
    };
    let (model, vendor) = common::cpu();
    println!(
        "# quickstart-shaped BERT, {len} tokens, chunk 32, {blocks}, dropout off, {} cores \
         of {model} ({vendor})",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| batch | symmetric | block rows | peak MiB | represent MiB | loss + cache MiB | replay MiB | reps + cached grads MiB | step s |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &(batch, symmetric) in runs {
        // The trainer's default (`loss.block_rows = 0`): the loss chooses.
        let block_rows = if scale { None } else { Some(256) };
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let encoder = BertEncoder::build(&store, "", &cfg, &BertOptions::default())?;
        let loss = InfoNce::new(0.05)?
            .with_similarity(Similarity::Cosine)
            .with_symmetric(symmetric)
            .with_block_rows(block_rows)?;
        let gc = GradCache::shared(encoder, 32, loss)?.with_dropout(false);
        let (q, p) = (
            common::random_tokens(1, (batch, len), (5, 4000))?,
            common::random_tokens(2, (batch, len), (5, 4000))?,
        );
        let (ms, peak, out) = measure(|| gc.cache_step(0, &q, &p));
        let m = out?.peaks;
        // Representations of both sides and their cached gradients, f32, d = 128.
        let reps = 2 * 2 * batch * 128 * 4;
        println!(
            "| {batch} | {symmetric} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
            block_rows.map_or(format!("auto ({KERNEL_BLOCK_ROWS})"), |b| b.to_string()),
            mib(peak),
            mib(m.represent),
            mib(m.loss),
            mib(m.replay),
            mib(reps),
            ms / 1e3
        );
    }
    Ok(())
}
