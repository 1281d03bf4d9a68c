//! What a training checkpoint costs to write and to read back verified, at BERT-base's
//! size: 110 M f32 parameters (440 MB) and AdamW's two moments (880 MB). The write is
//! atomic (temporary directory, fsync of every file and of the directory, rename) and
//! records each tensor file's SHA-256; the read verifies both digests before parsing.
//! Prints the time of each part and the share of the digests.
//!
//! `cargo bench --bench checkpoint_io` (`-- --params 22000000` for a MiniLM-sized state).

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use gradcache::train::checkpoint::{self, FileDigest, TrainerState};
use gradcache::Params;

mod common;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let params: usize = args
        .iter()
        .position(|a| a == "--params")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(110_000_000), |s| s.parse())?;
    // 100 tensors of equal size, as a model holds many.
    let per = params / 100;
    let device = Device::Cpu;
    let mut named = Vec::new();
    let mut moments = BTreeMap::new();
    for i in 0..100 {
        let t = Tensor::randn(0f32, 1.0, per, &device)?;
        moments.insert(format!("m.p{i:03}"), t.clone());
        moments.insert(format!("v.p{i:03}"), t.sqr()?);
        named.push((format!("p{i:03}"), Var::from_tensor(&t)?));
    }
    let params = Params::new(named);
    let state = TrainerState {
        step: 1000,
        config_fingerprint: "bench".into(),
        ..TrainerState::default()
    };
    let root = tempfile::tempdir_in(".")?;
    let (cpu, _) = common::cpu();
    println!(
        "cpu: {cpu}; {} parameters ({:.0} MB) + optimizer ({:.0} MB), f32",
        per * 100,
        (per * 100 * 4) as f64 / 1e6,
        (per * 200 * 4) as f64 / 1e6
    );
    for round in 0..2 {
        let start = Instant::now();
        let dir = checkpoint::save(root.path(), &params, &moments, &state, 1)?;
        let save = start.elapsed().as_secs_f64();
        let start = Instant::now();
        for f in ["model.safetensors", "optimizer.safetensors"] {
            FileDigest::of(&dir.join(f))?;
        }
        let digests = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let loaded = checkpoint::load(&dir, &device)?;
        let load = start.elapsed().as_secs_f64();
        assert_eq!(loaded.model.len(), 100);
        println!(
            "round {round}: save {save:.2} s (of which the two digests ~{digests:.2} s), \
             load verified {load:.2} s"
        );
    }
    Ok(())
}
