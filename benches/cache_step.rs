//! Time and peak memory of `cache_step` against a plain full-batch step, side by side in one
//! run (these machines are noisy: compare ratios, not absolute numbers across runs): a toy
//! MLP tower over several batches and chunk sizes, then BERT towers (the quickstart's
//! shape at batch 128, chunk 32; MiniLM's at batch 64, chunk 16).
//!
//! ```text
//! cargo bench --bench cache_step            # full sweep
//! cargo bench --bench cache_step -- --quick # one small configuration
//! ```
//!
//! Peak memory is measured with a counting global allocator: the largest number of bytes
//! allocated at once during the step, above what was allocated before it (CPU tensors live
//! on the heap, so this is the activation memory plus gradients and temporaries).
//! Time is the median of several repetitions, plain and cached alternating.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::memory::{measure, CountingAllocator};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{GradCache, InfoNce, ParamStore, Similarity, StepOutput, Tower};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

mod common;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Times `plain` and `cached` alternating (after one warm-up each) and prints the medians,
/// the peak memory of each and the ratios.
fn compare(
    label: &str,
    reps: usize,
    plain: impl Fn() -> gradcache::Result<StepOutput>,
    cached: impl Fn() -> gradcache::Result<StepOutput>,
) -> anyhow::Result<()> {
    plain()?;
    cached()?;
    let (mut plain_ms, mut cached_ms) = (vec![], vec![]);
    let (mut plain_peak, mut cached_peak) = (0, 0);
    for _ in 0..reps {
        let (ms, peak, out) = measure(&plain);
        out?;
        plain_ms.push(ms);
        plain_peak = plain_peak.max(peak);
        let (ms, peak, out) = measure(&cached);
        out?;
        cached_ms.push(ms);
        cached_peak = cached_peak.max(peak);
    }
    let (plain, cached) = (median(plain_ms), median(cached_ms));
    println!(
        "{label} plain_ms={plain:.1} cached_ms={cached:.1} time_ratio={:.2} \
         plain_peak_mib={:.1} cached_peak_mib={:.1} memory_ratio={:.2}",
        cached / plain,
        mib(plain_peak),
        mib(cached_peak),
        cached_peak as f64 / plain_peak as f64,
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let quick = std::env::args().any(|a| a == "--quick");
    let cfg = MlpConfig {
        input: 256,
        hidden: 1024,
        output: 256,
        dropout: 0.1,
    };
    let (configs, reps): (&[(usize, usize)], usize) = if quick {
        (&[(128, 32)], 3)
    } else {
        (
            &[(256, 32), (512, 32), (1024, 32), (1024, 128), (1024, 512)],
            5,
        )
    };
    println!(
        "# toy MLP tower {}-{}-{}-{}, dropout {}, shared tower, 1 positive per query, \
         loss row blocks of 128 in the cached step, {} cores",
        cfg.input,
        cfg.hidden,
        cfg.hidden,
        cfg.output,
        cfg.dropout,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    for &(batch, chunk) in configs {
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg, vb))?;
        // The cached path computes the loss in row blocks (the plain step cannot: its whole
        // graph must be alive for the one backward).
        let loss = InfoNce::new(0.05)?.with_block_rows(Some(128))?;
        let gc = GradCache::shared(tower, chunk, loss)?.with_seed(1);
        let dev = &Device::Cpu;
        let queries = Tensor::randn(0f32, 1., (batch, cfg.input), dev)?;
        let passages = Tensor::randn(0f32, 1., (batch, cfg.input), dev)?;
        compare(
            &format!("batch={batch} chunk={chunk}"),
            reps,
            || gc.full_batch_step(0, &queries, &passages),
            || gc.cache_step(0, &queries, &passages),
        )?;
    }

    // BERT towers: the quickstart's shape, and MiniLM's (full sweep only).
    let mut berts = vec![(
        "quickstart-shaped BERT",
        BertConfig::new(4000, 128, 2, 4, 256, 64),
        128,
        32,
        64,
    )];
    if !quick {
        berts.push((
            "MiniLM-shaped BERT",
            BertConfig::new(4000, 384, 6, 12, 1536, 128),
            64,
            16,
            128,
        ));
    }
    for (name, bert, batch, chunk, len) in berts {
        println!(
            "# {name} (fresh; hidden {}, {} layers), {len} tokens, dropout on, symmetric loss",
            bert.hidden_size, bert.num_hidden_layers
        );
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let encoder = BertEncoder::build(&store, "", &bert, &BertOptions::default())?;
        let loss = InfoNce::new(0.05)?
            .with_similarity(Similarity::Cosine)
            .with_symmetric(true);
        let gc = GradCache::shared(encoder, chunk, loss)?.with_seed(1);
        let (q, p) = (
            common::random_tokens(1, (batch, len), (5, 4000))?,
            common::random_tokens(2, (batch, len), (5, 4000))?,
        );
        compare(
            &format!("bert batch={batch} chunk={chunk}"),
            3,
            || gc.full_batch_step(0, &q, &p),
            || gc.cache_step(0, &q, &p),
        )?;
    }
    Ok(())
}
