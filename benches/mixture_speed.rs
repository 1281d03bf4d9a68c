//! What drawing batches from a mixture costs: the same pairs trained as one source
//! (`data.train_file`) and as three sources (`[[data.sources]]`, a step's batch from one,
//! drawn by size), side by side in one process, steps alternating between the two runs.
//! The pairs are the quickstart's 4,000 dealt into sources of 2,000, 1,200 and 800 (line
//! `i` by `i % 10`: each source a sample of the same texts; the one-source run reads the
//! three files concatenated, so both runs train the same tokenizer and model from the same
//! seed, and their batches have the same shape): what differs is the sampler, a loader per
//! source and the per-source tokenizers.
//!
//! ```text
//! cargo bench --bench mixture_speed               # 24 steps each after 2 of warm-up
//! cargo bench --bench mixture_speed -- --steps 8
//! ```
//!
//! Prints the CPU, each run's median step time and pairs/s and their ratio, and the data
//! path alone (a batch drawn and served, median of 2,000) of each: what the mixture adds
//! to a step, as a share of the pairs/s.

use std::fs;
use std::path::Path;
use std::time::Instant;

use gradcache::train::{Config, Task, Trainer};

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
    // Line i of every ten goes to `a` (5 of them), `b` (3) or `c` (2): each source a sample
    // of the same texts, so that a step costs the same whichever source it draws.
    let cuts = [(0..5, "a"), (5..8, "b"), (8..10, "c")];
    let mut all = Vec::new();
    for (keep, name) in &cuts {
        let part: Vec<&str> = lines[..4000]
            .iter()
            .enumerate()
            .filter(|(i, _)| keep.contains(&(i % 10)))
            .map(|(_, l)| l.as_str())
            .collect();
        fs::write(d.join(format!("{name}.jsonl")), part.join("\n")).unwrap();
        all.extend(part);
    }
    fs::write(d.join("all.jsonl"), all.join("\n")).unwrap();
    let eval = "eval_file = \"data/quickstart/eval.jsonl\"";
    let one = config(
        d,
        &format!("[data]\ntrain_file = \"{}/all.jsonl\"\n{eval}", d.display()),
        "one",
    );
    let sources: String = cuts
        .iter()
        .map(|(_, n)| {
            format!(
                "[[data.sources]]\nname = \"{n}\"\npath = \"{}/{n}.jsonl\"\n",
                d.display()
            )
        })
        .collect();
    let three = config(d, &format!("[data]\n{eval}\n{sources}"), "three");
    let mut runs = [
        (
            "one source",
            Trainer::new(one, None).unwrap(),
            Vec::<(f64, f64)>::new(),
        ),
        (
            "three sources",
            Trainer::new(three, None).unwrap(),
            Vec::new(),
        ),
    ];
    for k in 0..steps + 2 {
        // The two runs in turn, which goes first alternating: neither always follows the
        // other.
        for i in [k % 2, 1 - k % 2] {
            let (_, trainer, times) = &mut runs[i];
            let start = Instant::now();
            let report = trainer.train_step().unwrap();
            assert!(report.loss.is_finite());
            if k >= 2 {
                times.push((start.elapsed().as_secs_f64(), report.flops));
            }
        }
    }
    let mut speeds = Vec::new();
    let mut rates = Vec::new();
    let mut step_s = Vec::new();
    for (name, _, times) in runs.iter_mut() {
        let mut secs: Vec<f64> = times.iter().map(|t| t.0).collect();
        let mut gflops: Vec<f64> = times.iter().map(|t| t.1 / t.0 / 1e9).collect();
        let m = median(&mut secs);
        let rate = median(&mut gflops);
        let pairs = 128.0 / m;
        println!(
            "{name:>14}: median step {:.1} ms, {pairs:.0} pairs/s, {rate:.2} GFLOP/s of the \
             step's products ({steps} steps)",
            m * 1e3
        );
        speeds.push(pairs);
        rates.push(rate);
        step_s.push(m);
    }
    // Each source shuffles by itself, so the two runs' batches differ and with them the
    // texts' lengths: the work done per second (the products' FLOPs over the real tokens)
    // compares them at equal work, the pairs/s as they come.
    println!(
        "three sources / one source: {:.3}x the pairs/s, {:.3}x the work per second",
        speeds[1] / speeds[0],
        rates[1] / rates[0]
    );
    // The data path alone, what the mixture adds to a step: drawing the source and
    // serving its batch (the same pairs, the same batch size), timed over many batches.
    let mut served = Vec::new();
    for (name, trainer, _) in runs.iter_mut() {
        let mut times = Vec::new();
        for step in 0..2000u64 {
            let start = Instant::now();
            let batch = trainer.task_mut().next_batch(1000 + step).unwrap();
            times.push(start.elapsed().as_secs_f64());
            assert_eq!(batch.queries.len(), 128);
        }
        let m = median(&mut times);
        println!(
            "{name:>14}: a batch drawn and served in {:.1} us (median of 2,000)",
            m * 1e6
        );
        served.push(m);
    }
    let extra = (served[1] - served[0]).max(0.0);
    println!(
        "the mixture's data path adds {:.1} us to a step of {:.0} ms: {:.5}x the pairs/s of one \
         source from the sampler's cost",
        extra * 1e6,
        step_s[0] * 1e3,
        step_s[0] / (step_s[0] + extra)
    );
}
