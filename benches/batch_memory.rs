//! Peak memory of one cached BERT step as the batch grows into the thousands: the promise
//! of the gradient cache is the memory of one chunk whatever the batch. The tower is the
//! quickstart's shape (fresh BERT, hidden 128, 2 layers, 4 heads, feed-forward 256,
//! vocabulary 4,000), sequences of 64 tokens, chunks of 32, dropout off, the loss in row
//! blocks of 256, with and without the symmetric term.
//!
//! ```text
//! cargo bench --bench batch_memory            # batches 512 .. 4096 (a few minutes)
//! cargo bench --bench batch_memory -- --quick # 256 and 512
//! ```
//!
//! Peak memory is counted by a global allocator: the largest number of bytes allocated at
//! once during the step (representation pass, loss and cache, replay), above what was
//! allocated before it. What grows with the batch is the `[B, d]` representations, their
//! gradients and one row block of logits (`256 x B`): linear and small next to a chunk's
//! activations.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::memory::{measure, CountingAllocator};
use gradcache::{GradCache, InfoNce, ParamStore, Similarity, TokenBatch};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const LEN: usize = 64;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `rows` sequences of `LEN` token ids drawn from the seed, no padding.
fn tokens(seed: u64, rows: usize, vocab: usize) -> anyhow::Result<TokenBatch> {
    let noise = gradcache::rng::uniform(
        seed,
        5.0,
        vocab as f64,
        &(rows, LEN).into(),
        DType::F32,
        &Device::Cpu,
    )?;
    let ids = noise.to_dtype(DType::U32)?;
    let mask = Tensor::ones((rows, LEN), DType::U32, &Device::Cpu)?;
    Ok(TokenBatch::new(ids, mask.clone(), mask.zeros_like()?)?)
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    // (batch, symmetric): the sweep, then the symmetric term at the largest batch.
    let runs: &[(usize, bool)] = if quick {
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
    let cfg = BertConfig::new(4000, 128, 2, 4, 256, LEN);
    println!(
        "# quickstart-shaped BERT, {LEN} tokens, chunk 32, loss blocks of 256, dropout off, {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| batch | symmetric | peak MiB | step s |");
    println!("|---:|---|---:|---:|");
    for &(batch, symmetric) in runs {
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let encoder = BertEncoder::build(&store, "", &cfg, &BertOptions::default())?;
        let loss = InfoNce::new(0.05)?
            .with_similarity(Similarity::Cosine)
            .with_symmetric(symmetric)
            .with_block_rows(Some(256))?;
        let gc = GradCache::shared(encoder, 32, loss)?.with_dropout(false);
        let (q, p) = (tokens(1, batch, 4000)?, tokens(2, batch, 4000)?);
        let (ms, peak, out) = measure(|| gc.cache_step(0, &q, &p));
        out?;
        println!(
            "| {batch} | {symmetric} | {:.0} | {:.1} |",
            mib(peak),
            ms / 1e3
        );
    }
    Ok(())
}
