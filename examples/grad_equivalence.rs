//! Gradient equivalence, printed: for each configuration, the largest relative difference
//! between the parameter gradients of `cache_step` and of one plain forward/backward over
//! the whole batch (f32, dropout off). Exits non-zero if any exceeds 1e-5.
//!
//! ```text
//! cargo run --release --example grad_equivalence
//! ```
//!
//! The configurations avoid parameters whose true gradient is exactly zero (whose relative
//! error is meaningless rounding noise); `tests/it/equivalence.rs` covers those separately.

use candle_core::{DType, Device, Tensor};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{Encoder, GradCache, InfoNce, Loss, ParamStore, Similarity, Tower};

const BATCH: usize = 16;
const TOLERANCE: f64 = 1e-5;

fn features(seed: u64, rows: usize) -> gradcache::Result<Tensor> {
    gradcache::rng::normal(seed, 0.0, 1.0, &(rows, 32).into(), DType::F32, &Device::Cpu)
}

/// Runs a full-batch step and a cached step on the same batch, returns the gradient error.
fn compare<Q: Encoder<Input = Tensor>, P: Encoder<Input = Tensor>, L: Loss>(
    gc: GradCache<Q, P, L>,
    hard_negatives: usize,
) -> gradcache::Result<f64> {
    let queries = features(1, BATCH)?;
    let passages = features(2, BATCH * (hard_negatives + 1))?;
    let plain = gc.full_batch_step(0, &queries, &passages)?;
    let cached = gc.cache_step(0, &queries, &passages)?;
    cached.grads.max_rel_err(&plain.grads, 0.0)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let cfg = MlpConfig {
        input: 32,
        hidden: 64,
        output: 32,
        dropout: 0.0,
    };
    let mut worst = 0f64;
    let mut report = |name: &str, chunk: usize, err: f64| {
        println!("config={name} chunk={chunk} max_rel_err={err:.3e}");
        worst = worst.max(err);
    };
    for chunk in [1, 3, BATCH - 1, BATCH, 2 * BATCH] {
        for (name, hard, symmetric, block, similarity) in [
            ("shared", 0, false, None, Similarity::Dot),
            ("shared-hard3", 3, false, None, Similarity::Dot),
            ("shared-symmetric", 0, true, None, Similarity::Dot),
            (
                "shared-hard3-symmetric-blocks4",
                3,
                true,
                Some(4),
                Similarity::Dot,
            ),
            (
                "shared-cosine-blocks5",
                1,
                false,
                Some(5),
                Similarity::Cosine,
            ),
        ] {
            let loss = InfoNce::new(0.05)?
                .with_symmetric(symmetric)
                .with_similarity(similarity)
                .with_block_rows(block)?;
            let store = ParamStore::new(7, DType::F32, &Device::Cpu);
            let tower = Tower::build(&store, "", |vb| Mlp::new(&cfg, vb))?;
            let gc = GradCache::shared(tower, chunk, loss)?.with_dropout(false);
            report(name, chunk, compare(gc, hard)?);
        }
        // Two towers with different chunk sizes (symmetric, so no gradient is exactly zero).
        let store = ParamStore::new(8, DType::F32, &Device::Cpu);
        let q = Tower::build(&store, "query", |vb| Mlp::new(&cfg, vb))?;
        let p = Tower::build(&store, "passage", |vb| Mlp::new(&cfg, vb))?;
        let loss = InfoNce::new(0.05)?.with_symmetric(true);
        let gc = GradCache::two_towers(q, p, chunk, chunk + 2, loss)?.with_dropout(false);
        report("two-towers-hard1-symmetric", chunk, compare(gc, 1)?);
    }
    if worst > TOLERANCE {
        anyhow::bail!("max_rel_err {worst:.3e} exceeds {TOLERANCE:e}");
    }
    Ok(())
}
