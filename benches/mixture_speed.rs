//! What drawing batches from a mixture costs: the same pairs trained as one source
//! (`data.train_file`) and as three sources (`[[data.sources]]`, a step's batch from one,
//! drawn by size), side by side in one process, steps alternating between the two runs.
//! The pairs are the quickstart's 4,000 cut into sources of 2,000, 1,200 and 800 (the
//! one-source run reads the three files concatenated, so both runs train the same
//! tokenizer and model from the same seed, and their batches have the same shape): what
//! differs is the sampler, a loader per source and the per-source tokenizers.
//!
//! ```text
//! cargo bench --bench mixture_speed               # 24 steps each after 2 of warm-up
//! cargo bench --bench mixture_speed -- --steps 8
//! ```
//!
//! Prints the CPU, each run's median step time and pairs/s, and their ratio.

use std::fs;
use std::path::Path;
use std::time::Instant;

use gradcache::train::{Config, Trainer};

mod common;
use common::cpu;

fn config(dir: &Path, data: &str, name: &str) -> Config {
    let text = format!(
        r#"
seed = 42
output_dir = "{dir}/{name}"
{data}
[model]
query_max_len = 64
passage_max_len = 64
[model.fresh]
vocab_size = 4000
hidden_size = 128
num_layers = 2
num_heads = 4
intermediate_size = 256
[loss]
temperature = 0.05
similarity = "cosine"
symmetric = true
[train]
steps = 1000
batch_size = 128
query_chunk = 32
passage_chunk = 32
[optim]
lr = 1e-3
"#,
        dir = dir.display()
    );
    let path = dir.join(format!("{name}.toml"));
    fs::write(&path, text).unwrap();
    Config::load(&path, &[]).unwrap()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let (model, vendor) = cpu();
    println!(
        "CPU: {model} ({vendor}), {} threads",
        rayon::current_num_threads()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let lines: Vec<String> = fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let cuts = [(0, 2000, "a"), (2000, 3200, "b"), (3200, 4000, "c")];
    for (from, to, name) in cuts {
        fs::write(d.join(format!("{name}.jsonl")), lines[from..to].join("\n")).unwrap();
    }
    fs::write(d.join("all.jsonl"), lines[..4000].join("\n")).unwrap();
    let eval = "eval_file = \"data/quickstart/eval.jsonl\"";
    let one = config(
        d,
        &format!("[data]\ntrain_file = \"{}/all.jsonl\"\n{eval}", d.display()),
        "one",
    );
    let sources: String = cuts
        .iter()
        .map(|(_, _, n)| {
            format!(
                "[[data.sources]]\nname = \"{n}\"\npath = \"{}/{n}.jsonl\"\n",
                d.display()
            )
        })
        .collect();
    let three = config(d, &format!("[data]\n{eval}\n{sources}"), "three");
    let mut runs = [
        ("one source", Trainer::new(one, None).unwrap(), Vec::new()),
        (
            "three sources",
            Trainer::new(three, None).unwrap(),
            Vec::new(),
        ),
    ];
    for k in 0..steps + 2 {
        for (_, trainer, times) in runs.iter_mut() {
            let start = Instant::now();
            let report = trainer.train_step().unwrap();
            assert!(report.loss.is_finite());
            if k >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let mut speeds = Vec::new();
    for (name, _, times) in runs.iter_mut() {
        let m = median(times);
        let pairs = 128.0 / m;
        println!(
            "{name:>14}: median step {:.1} ms, {pairs:.0} pairs/s ({steps} steps)",
            m * 1e3
        );
        speeds.push(pairs);
    }
    println!(
        "three sources / one source: {:.3}x the pairs/s",
        speeds[1] / speeds[0]
    );
}
