//! The loss phase of a cached step alone: InfoNCE's value and gradients over `[B, 128]`
//! representations (the quickstart model's width; cosine, temperature 0.05, no hard
//! negatives), as the loss kernel computes them (a tile of logits at a time, an online
//! log-sum-exp) and as the composed row blocks do (each block's `rows x B` logits and a
//! dozen temporaries of that size), at row blocks of 64, 256 and 1,024; then the kernel
//! with every direction of `loss.directions`. Peak heap above the start and wall time,
//! one run each.
//!
//! ```text
//! cargo bench --bench loss_kernel              # batches 1,984 and 3,968 (both paths)
//! cargo bench --bench loss_kernel -- --scale   # the kernel at 16,384 and 65,536 too
//!                                              # (256-row blocks, query_to_doc)
//! ```

use std::time::Instant;

use candle_core::{DType, Device};
use gradcache::loss::LossDirection;
use gradcache::memory::{measure, CountingAllocator};
use gradcache::{InfoNce, Loss, Similarity};

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const WIDTH: usize = 128;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let scale = std::env::args().any(|a| a == "--scale");
    let (model, vendor) = common::cpu();
    println!(
        "CPU: {model} ({vendor}), {} threads",
        candle_core::utils::get_num_threads()
    );
    println!("| batch | path | directions | block rows | loss peak MiB | s |");
    println!("|---:|---|---|---:|---:|---:|");
    let mut batches = vec![1984, 3968];
    if scale {
        batches.extend([16384, 65536]);
    }
    let all = [
        LossDirection::QueryToDoc,
        LossDirection::QueryToQuery,
        LossDirection::DocToQuery,
        LossDirection::DocToDoc,
    ];
    for &batch in &batches {
        let reps = |rows, seed| {
            gradcache::rng::normal(
                seed,
                0.0,
                1.0,
                &(rows, WIDTH).into(),
                DType::F32,
                &Device::Cpu,
            )
        };
        let (q, p) = (reps(batch, 1)?, reps(batch, 2)?);
        let composed_too = batch <= 3968;
        for (path, fused) in [("kernel", true), ("composed", false)] {
            if !fused && !composed_too {
                continue;
            }
            for (directions, list) in [("query_to_doc", &all[..1]), ("all four", &all[..])] {
                if (!fused || !composed_too) && list.len() > 1 {
                    continue;
                }
                let blocks: &[usize] = if composed_too {
                    &[64, 256, 1024]
                } else {
                    &[256]
                };
                for &block in blocks {
                    let loss = InfoNce::new(0.05)?
                        .with_similarity(Similarity::Cosine)
                        .with_directions(list)?
                        .with_block_rows(Some(block))?;
                    gradcache::nn::set_fused_kernels(fused);
                    let start = Instant::now();
                    let (_, peak, value) = measure(|| loss.value_and_grads(&q, &p));
                    let secs = start.elapsed().as_secs_f64();
                    gradcache::nn::set_fused_kernels(true);
                    let value = value?;
                    anyhow::ensure!(value.loss.is_finite(), "non-finite loss");
                    println!(
                        "| {batch} | {path} | {directions} | {block} | {:.1} | {secs:.2} |",
                        mib(peak)
                    );
                }
            }
        }
    }
    Ok(())
}
