//! Time and peak memory of `cache_step` against a plain full-batch step, side by side in one
//! run (these machines are noisy: compare ratios, not absolute numbers across runs).
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
use gradcache::memory::{measure, CountingAllocator};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{GradCache, InfoNce, ParamStore, Tower};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
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
        // Warm up both paths once.
        gc.full_batch_step(0, &queries, &passages)?;
        gc.cache_step(0, &queries, &passages)?;

        let (mut plain_ms, mut cached_ms) = (vec![], vec![]);
        let (mut plain_peak, mut cached_peak) = (0, 0);
        for _ in 0..reps {
            let (ms, peak, out) = measure(|| gc.full_batch_step(0, &queries, &passages));
            out?;
            plain_ms.push(ms);
            plain_peak = plain_peak.max(peak);
            let (ms, peak, out) = measure(|| gc.cache_step(0, &queries, &passages));
            out?;
            cached_ms.push(ms);
            cached_peak = cached_peak.max(peak);
        }
        let (plain, cached) = (median(plain_ms), median(cached_ms));
        println!(
            "batch={batch} chunk={chunk} plain_ms={plain:.1} cached_ms={cached:.1} \
             time_ratio={:.2} plain_peak_mib={:.1} cached_peak_mib={:.1} memory_ratio={:.2}",
            cached / plain,
            mib(plain_peak),
            mib(cached_peak),
            cached_peak as f64 / plain_peak as f64,
        );
    }
    Ok(())
}
