//! Where a training step's time goes: the real trainer on the quickstart configuration and
//! on a MiniLM-shaped one, per step the pairs/s, the time of each phase (tokenize,
//! representation pass, loss + cache, replay, gradient reduction, optimizer), the
//! matrix-product FLOPs executed and the achieved GFLOP/s, set against candle's own sgemm
//! peak measured in the same run (so the fraction of the machine's matmul peak shows on
//! any machine).
//!
//! It prints the CPU (model and vendor: subnormal floats cost Intel cores a microcode
//! assist each and AMD cores next to nothing, so a figure means little without it) and,
//! for the quickstart, the same batch timed at the first step and again after the run's
//! steps: weights that push activations or gradients into the subnormal range show as
//! a first step several times slower than the last (`gradcache::denormal`).
//!
//! ```text
//! cargo bench --bench train_step                # both configurations, 4 steps each
//! cargo bench --bench train_step -- --quick     # the quickstart, 2 steps
//! cargo bench --bench train_step -- --drift     # only the first-against-last line
//! cargo bench --bench train_step -- --sgemm-shapes  # candle's f32 products at our shapes
//! cargo bench --bench train_step -- --layout        # one thread's encode products, by weight layout
//! cargo bench --bench train_step -- --packing       # the same, by the gemm crate's packing thresholds
//! cargo bench --bench train_step -- --panels        # an encoding's panel products: alignment, blocking
//! cargo bench --bench train_step -- --backward      # a replay's backward products, by operand layout
//! GRADCACHE_MINILM=/path/to/all-MiniLM-L6-v2 cargo bench --bench train_step
//! GRADCACHE_BLAS=/path/to/libmkl_rt.so.2 cargo bench --bench train_step  # the steps through MKL
//! ```
//!
//! Without `GRADCACHE_MINILM` the MiniLM-shaped run is a fresh BERT of MiniLM's size
//! (hidden 384, 6 layers, 12 heads, feed-forward 1536; its own 4,000-word vocabulary, which
//! changes nothing the FLOP count sees). Threads: `RAYON_NUM_THREADS` (default: the
//! physical cores).

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use gradcache::train::data::TextBatch;
use gradcache::train::{Config, PhaseTimes, Quiet, StepReport, Trainer};

mod common;
use common::cpu;

/// The first `rows` pairs of the quickstart's training data as a batch.
fn probe_batch(rows: usize) -> anyhow::Result<TextBatch> {
    let text = std::fs::read_to_string("data/quickstart/train.jsonl")?;
    let mut batch = TextBatch {
        queries: vec![],
        passages: vec![],
        scores: vec![],
        filled: 0,
        lines: vec![],
        prompts: vec![],
        source: 0,
    };
    for (number, line) in text.lines().take(rows).enumerate() {
        batch.lines.push(number + 1);
        let v: serde_json::Value = serde_json::from_str(line)?;
        let field = |k: &str| v[k].as_str().unwrap_or_default().to_string();
        batch.queries.push(field("query"));
        batch.passages.push(field("positive"));
    }
    Ok(batch)
}

/// The same batch timed after the first step and after `steps` more: the replay and
/// representation pass of the same shapes, first against last (subnormal floats slow the
/// first several-fold on Intel cores).
fn drift(steps: usize) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let sets = vec![
        format!("output_dir={}", dir.path().display()),
        format!("train.steps={}", steps + 2),
        "train.eval_every=0".to_string(),
        "train.checkpoint_every=0".to_string(),
    ];
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &sets)?;
    let probe = probe_batch(cfg.train.batch_size)?;
    let mut trainer = Trainer::new(cfg, None)?;
    trainer.train_step()?; // warm up (allocator, thread pool)
                           // Best of five: these shared machines swing by 30% from one second to the next.
    let best_of = |trainer: &Trainer| -> anyhow::Result<PhaseTimes> {
        let mut best = trainer.time_step(&probe)?;
        for _ in 0..4 {
            let t = trainer.time_step(&probe)?;
            if t.total_ms() < best.total_ms() {
                best = t;
            }
        }
        Ok(best)
    };
    let first = best_of(&trainer)?;
    for _ in 0..steps {
        trainer.train_step()?;
    }
    let last = best_of(&trainer)?;
    println!(
        "# the same quickstart batch, step 1 against step {} (best of 5 each): represent \
         {:.0} -> {:.0} ms, replay {:.0} -> {:.0} ms; first/last {:.2}x",
        steps + 1,
        first.represent_ms,
        last.represent_ms,
        first.replay_ms,
        last.replay_ms,
        (first.represent_ms + first.replay_ms) / (last.represent_ms + last.replay_ms).max(1e-9)
    );
    Ok(())
}

/// candle's f32 matmul throughput at `n^3`, best of 5, in GFLOP/s.
fn sgemm_peak(n: usize) -> anyhow::Result<f64> {
    sgemm(n, n, n)
}

/// candle's f32 matmul throughput `[m, k] x [k, n]`, best of 5, in GFLOP/s.
fn sgemm(m: usize, k: usize, n: usize) -> anyhow::Result<f64> {
    let a = Tensor::randn(0f32, 1., (m, k), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1., (k, n), &Device::Cpu)?;
    a.matmul(&b)?; // warm up
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let c = a.matmul(&b)?;
        let _ = c.to_dtype(DType::F32)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e9)
}

/// The products the encoders and decoders run, `(m, k, n)`: 2048^3, a MiniLM chunk's
/// projection and feed-forward, BERT-base's feed-forward, the 0.6B decoder's gate/up.
const SHAPES: [(usize, usize, usize); 5] = [
    (2048, 2048, 2048),
    (8192, 384, 384),
    (2048, 384, 1536),
    (4096, 768, 3072),
    (2048, 1024, 3072),
];

/// The weight `[out, in]` of the layout experiments (values of a trained layer's size)
/// and its transpose `[in, out]`.
fn weight_pair(input: usize, out: usize) -> (Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = (0..out * input)
        .map(|i| ((i % 89) as f32 - 44.0) / 890.0)
        .collect();
    let mut wt = vec![0f32; w.len()];
    for o in 0..out {
        for i in 0..input {
            wt[i * out + o] = w[o * input + i];
        }
    }
    (w, wt)
}

/// GFLOP/s of one thread's `x [rows, in] W^T`, best of `repeats`, the weight's element
/// `(o, i)` at `o * w_rs + i * w_cs`.
fn time_product(
    (rows, input, out): (usize, usize, usize),
    w: &[f32],
    (w_rs, w_cs): (isize, isize),
    repeats: usize,
) -> f64 {
    let x: Vec<f32> = (0..rows * input)
        .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
        .collect();
    let mut y = vec![0f32; rows * out];
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let t = Instant::now();
        // SAFETY: every operand covers the extent its strides give; y overlaps none.
        unsafe {
            gemm::gemm(
                rows,
                out,
                input,
                y.as_mut_ptr(),
                1,
                out as isize,
                false,
                x.as_ptr(),
                1,
                input as isize,
                w.as_ptr(),
                w_cs,
                w_rs,
                0f32,
                1f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        };
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (rows * input * out) as f64 / best / 1e9
}

/// The encoders' projection shapes `(in, out)`: MiniLM's, then BERT-base's.
const LAYER_SHAPES: [(usize, usize); 5] = [
    (384, 384),
    (384, 1536),
    (1536, 384),
    (768, 768),
    (768, 3072),
];

/// One thread's products at an inference chunk's shapes (1,184 packed tokens: 32 texts
/// of the encode row's 37 tokens on average), `x [rows, in] W^T`, with the weight stored
/// as the checkpoints hold it (`[out, in]`: the gemm crate gathers it a scalar at a time
/// while packing) and stored transposed (`[in, out]`: contiguous panels). Prints
/// `rows in out GFLOP/s-as-stored GFLOP/s-transposed`, best of 20 each.
fn weight_layouts() {
    let rows = 1184;
    for (input, out) in LAYER_SHAPES {
        let (w, wt) = weight_pair(input, out);
        // `W^T` element (i, o): `w[o * input + i]` as stored, `wt[i * out + o]` transposed.
        let stored = time_product((rows, input, out), &w, (1, input as isize), 20);
        let transposed = time_product((rows, input, out), &wt, (out as isize, 1), 20);
        println!("{rows} {input} {out} {stored:.1} {transposed:.1}");
    }
}

/// The same products (the weight transposed, as a long encoding reads it), at the rows
/// of 8 and 16 texts of 37 tokens (an encoding's chunks), of a middling and of a long
/// chunk, under the gemm crate's packing thresholds: its
/// defaults, the right-hand operand (the activations) always packed, the left-hand one
/// (the weight) never packed where it need not be, and both. Prints `rows in out` and
/// the four GFLOP/s, best of 10 each; the crate's defaults are restored after.
fn packing_thresholds() {
    let rhs_default = gemm::get_rhs_packing_threshold();
    let lhs_default = gemm::get_lhs_packing_threshold_single_thread();
    for rows in [296, 592, 1184, 3456] {
        for (input, out) in LAYER_SHAPES {
            let (_, wt) = weight_pair(input, out);
            let mut line = format!("{rows} {input} {out}");
            for (rhs, lhs) in [
                (rhs_default, lhs_default),
                (1, lhs_default),
                (rhs_default, 256),
                (1, 256),
            ] {
                gemm::set_rhs_packing_threshold(rhs);
                gemm::set_lhs_packing_threshold_single_thread(lhs);
                let rate = time_product((rows, input, out), &wt, (out as isize, 1), 10);
                line += &format!(" {rate:.1}");
            }
            println!("{line}");
        }
    }
    gemm::set_rhs_packing_threshold(rhs_default);
    gemm::set_lhs_packing_threshold_single_thread(lhs_default);
}

/// `values` in a buffer of their own, the first `skew` bytes past a 64-byte boundary: the
/// buffer and where they start.
fn placed(values: &[f32], skew: usize) -> (Vec<f32>, usize) {
    let mut buf = vec![0f32; values.len() + 32];
    let start = buf.as_ptr().align_offset(64) + skew / 4;
    buf[start..start + values.len()].copy_from_slice(values);
    (buf, start)
}

/// One thread's products as a long encoding runs them (`src/nn/cpu/products/gemm.rs`,
/// `panel_products`): `x [rows, in] W^T` from a copy of `W^T` in panels of 64 outputs,
/// one product per panel reading it in place ([`gradcache::nn::panel_product`]). Prints
/// `rows in out`, then GFLOP/s (best of 10): the gemm crate's kernel with the copy on a
/// 64-byte line (as the encoding makes it now) and 16 bytes past one (where the system
/// allocator put it before), then the blocked kernel of `src/nn/cpu/products/panel_kernel.rs`
/// (`GRADCACHE_PANEL_KERNEL`) at blocks of 64 and of 128 inputs, then `same` if its every
/// output has the gemm crate's bits (`differ` if not; without AVX-512 it is not run and
/// its columns repeat the gemm crate's).
fn panel_products() {
    use gradcache::nn::{panel_product, PanelKernel};
    for rows in [296, 592, 1184] {
        for (input, out) in LAYER_SHAPES {
            let (_, wt) = weight_pair(input, out);
            // Panel `p`: `[input, 64]` contiguous, from `p * 64 * input`.
            let mut panels = Vec::with_capacity(wt.len());
            for first in (0..out).step_by(64) {
                for i in 0..input {
                    panels.extend_from_slice(&wt[i * out + first..i * out + first + 64]);
                }
            }
            let x: Vec<f32> = (0..rows * input)
                .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                .collect();
            let flop = 2.0 * (rows * input * out) as f64;
            let (on_line, at) = placed(&panels, 0);
            let on_line = &on_line[at..at + panels.len()];
            let (off_line, at) = placed(&panels, 16);
            let off_line = &off_line[at..at + panels.len()];
            let run = |kernel, copy: &[f32], y: &mut [f32]| {
                let mut best = f64::MAX;
                for _ in 0..10 {
                    let t = Instant::now();
                    for (p, first) in (0..out).step_by(64).enumerate() {
                        let panel = &copy[p * 64 * input..(p + 1) * 64 * input];
                        panel_product(kernel, (rows, input), &x, panel, (&mut y[first..], out));
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                flop / best / 1e9
            };
            let mut reference = vec![0f32; rows * out];
            let aligned = run(PanelKernel::Gemm, on_line, &mut reference);
            let skewed = run(PanelKernel::Gemm, off_line, &mut vec![0f32; rows * out]);
            let mut line = format!("{rows} {input} {out} {aligned:.1} {skewed:.1}");
            let mut same = true;
            for inputs in [64, 128] {
                let mut y = vec![0f32; rows * out];
                let rate = run(PanelKernel::Blocked { inputs }, on_line, &mut y);
                same &= y
                    .iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                line += &format!(" {rate:.1}");
            }
            println!("{line} {}", if same { "same" } else { "differ" });
        }
    }
}

/// Best seconds of `repeats` runs of `f`.
fn best_of(repeats: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// A replay's backward products at a training chunk's rows (8 texts: 320 and 512 tokens)
/// and base-size shapes, on the threads of the pool (`RAYON_NUM_THREADS`), as the layer
/// nodes run them and in the layouts a copy of the weight would allow. Prints `rows in
/// out`, then GFLOP/s (best of 10) of: the forward `x W^T` from a copy in panels (what
/// a step reads now), the input gradient `dy W` from the weight as stored (now) and from
/// a copy of `W` in panels of 64 input columns (`[out, 64]` each, read in place), the
/// weight gradient `dy^T x` (now, `[out, in]`), and the same sums as `x^T dy`
/// (`[in, out]`, the gradient transposed).
fn backward_products() {
    use gradcache::nn::{panel_product, PanelKernel};
    use rayon::prelude::*;
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let value = |i: usize| ((i % 97) as f32 - 48.0) / 97.0;
    // `dst [m, n] = lhs [m, k] rhs [k, n]`, operands as (values, row stride, col stride).
    let product = |(m, n, k): (usize, usize, usize),
                   dst: &mut [f32],
                   (a, a_rs, a_cs): (&[f32], usize, usize),
                   (b, b_rs, b_cs): (&[f32], usize, usize)| {
        // SAFETY: every operand covers the extent its strides give; dst overlaps none.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                0f32,
                1f32,
                false,
                false,
                false,
                par,
            )
        }
    };
    // Panels of 64 columns of `b [k, n]` (row-major), each `[k, 64]` contiguous.
    let panels_of = |b: &[f32], k: usize, n: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(b.len());
        for first in (0..n).step_by(64) {
            for r in 0..k {
                out.extend_from_slice(&b[r * n + first..r * n + first + 64]);
            }
        }
        out
    };
    // `dst [m, n] = a [m, k] B` from `B`'s panels, the panels shared out across the pool.
    let from_panels =
        |(m, n, k): (usize, usize, usize), dst: &mut [f32], a: &[f32], panels: &[f32]| {
            let dst_ptr = dst.as_mut_ptr() as usize;
            let len = dst.len();
            (0..n / 64).into_par_iter().for_each(|p| {
                // SAFETY: panel `p` writes columns `64 p .. 64 p + 64` of each row alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut f32, len) };
                panel_product(
                    PanelKernel::Gemm,
                    (m, k),
                    a,
                    &panels[p * 64 * k..(p + 1) * 64 * k],
                    (&mut dst[p * 64..], n),
                );
            });
        };
    println!("# rows in out | x W^T panels | dy W stored | dy W panels | dy^T x | x^T dy (GFLOP/s, {threads} threads)");
    for rows in [320, 512] {
        for (input, out) in [(768, 768), (768, 3072), (3072, 768)] {
            let (w, wt) = weight_pair(input, out);
            let x: Vec<f32> = (0..rows * input).map(value).collect();
            let dy: Vec<f32> = (0..rows * out).map(|i| value(i + 3)).collect();
            let flop = 2.0 * (rows * input * out) as f64;
            let rate = |secs: f64| flop / secs / 1e9;
            let forward_panels = panels_of(&wt, input, out);
            let mut y = vec![0f32; rows * out];
            let fwd = best_of(10, || {
                from_panels((rows, out, input), &mut y, &x, &forward_panels)
            });
            let mut dx = vec![0f32; rows * input];
            let dx_stored = best_of(10, || {
                product((rows, input, out), &mut dx, (&dy, out, 1), (&w, input, 1))
            });
            let input_panels = panels_of(&w, out, input);
            let dx_panels = best_of(10, || {
                from_panels((rows, input, out), &mut dx, &dy, &input_panels)
            });
            let mut dw = vec![0f32; out * input];
            let dw_now = best_of(10, || {
                product((out, input, rows), &mut dw, (&dy, 1, out), (&x, input, 1))
            });
            let dw_t = best_of(10, || {
                product((input, out, rows), &mut dw, (&x, 1, input), (&dy, out, 1))
            });
            println!(
                "{rows} {input} {out} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}",
                rate(fwd),
                rate(dx_stored),
                rate(dx_panels),
                rate(dw_now),
                rate(dw_t)
            );
        }
    }
}

fn row(label: &str, r: &StepReport, p: &PhaseTimes, peak: f64) {
    let secs = p.total_ms() / 1e3;
    let gflops = r.flops / secs / 1e9;
    println!(
        "| {label} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0}% |",
        r.pairs_per_sec,
        p.tokenize_ms,
        p.represent_ms,
        p.loss_ms,
        p.replay_ms,
        p.reduce_ms,
        p.optimizer_ms,
        r.flops / 1e9,
        gflops,
        100.0 * gflops / peak
    );
}

fn run(name: &str, sets: &[String], steps: usize, peak: f64) -> anyhow::Result<()> {
    for fused in [true, false] {
        gradcache::nn::set_fused_kernels(fused);
        let label = if fused {
            name.to_string()
        } else {
            format!("{name} (composed)")
        };
        run_one(&label, sets, steps, peak)?;
    }
    gradcache::nn::set_fused_kernels(true);
    Ok(())
}

fn run_one(name: &str, sets: &[String], steps: usize, peak: f64) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut sets = sets.to_vec();
    sets.push(format!("output_dir={}", dir.path().display()));
    sets.push(format!("train.steps={}", steps + 1));
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &sets)?;
    let mut trainer = Trainer::new(cfg, None)?;
    trainer.train_step()?; // warm up (allocator, thread pool)
    let mut mean = PhaseTimes::default();
    let mut reports = Vec::new();
    for step in 1..=steps {
        let r = trainer.train_step()?;
        row(&format!("{name} step {step}"), &r, &r.phases, peak);
        let p = &r.phases;
        mean.tokenize_ms += p.tokenize_ms / steps as f64;
        mean.represent_ms += p.represent_ms / steps as f64;
        mean.loss_ms += p.loss_ms / steps as f64;
        mean.replay_ms += p.replay_ms / steps as f64;
        mean.reduce_ms += p.reduce_ms / steps as f64;
        mean.optimizer_ms += p.optimizer_ms / steps as f64;
        reports.push(r);
    }
    let mut avg = reports[0].clone();
    avg.pairs_per_sec = reports.iter().map(|r| r.pairs_per_sec).sum::<f64>() / steps as f64;
    avg.flops = reports.iter().map(|r| r.flops).sum::<f64>() / steps as f64;
    row(&format!("**{name} mean**"), &avg, &mean, peak);
    let _ = trainer.run(&mut Quiet); // finishes the last step; evaluation not timed
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--sgemm-shapes") {
        // One line per product shape: `m k n GFLOP/s`.
        for (m, k, n) in SHAPES {
            println!("{m} {k} {n} {:.1}", sgemm(m, k, n)?);
        }
        return Ok(());
    }
    if std::env::args().any(|a| a == "--layout") {
        weight_layouts();
        return Ok(());
    }
    if std::env::args().any(|a| a == "--packing") {
        packing_thresholds();
        return Ok(());
    }
    if std::env::args().any(|a| a == "--panels") {
        panel_products();
        return Ok(());
    }
    if std::env::args().any(|a| a == "--backward") {
        backward_products();
        return Ok(());
    }
    let peak = sgemm_peak(2048)?;
    if std::env::args().any(|a| a == "--sgemm") {
        println!("{peak:.1}");
        return Ok(());
    }
    if std::env::args().any(|a| a == "--drift") {
        return drift(20);
    }
    // The steps' layer products through the BLAS in GRADCACHE_BLAS, as the binary does.
    let blas = gradcache::nn::use_blas_from_env()?
        .map(|b| format!("; the layer products through {}", b.path.display()))
        .unwrap_or_default();
    let (model, vendor) = cpu();
    println!(
        "# {model} ({vendor}); candle sgemm 2048^3: {peak:.1} GFLOP/s; {} threads{blas}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    println!(
        "| step | pairs/s | tokenize ms | represent ms | loss ms | replay ms | reduce ms | \
         optimizer ms | GFLOP | GFLOP/s | of sgemm peak |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let steps = if quick { 2 } else { 4 };
    let quickstart: Vec<String> = vec!["train.eval_every=0".into()];
    run("quickstart", &quickstart, steps, peak)?;
    drift(if quick { 10 } else { 30 })?;
    if quick {
        return Ok(());
    }
    let mut minilm: Vec<String> = [
        "train.batch_size=64",
        "train.query_chunk=16",
        "train.passage_chunk=16",
        "model.query_max_len=128",
        "model.passage_max_len=128",
        "loss.symmetric=false",
        "train.eval_every=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    match std::env::var("GRADCACHE_MINILM") {
        Ok(dir) => minilm.push(format!("model.pretrained={dir}")),
        Err(_) => minilm.extend(
            [
                "model.fresh.hidden_size=384",
                "model.fresh.num_layers=6",
                "model.fresh.num_heads=12",
                "model.fresh.intermediate_size=1536",
            ]
            .iter()
            .map(|s| s.to_string()),
        ),
    }
    run("minilm", &minilm, steps, peak)?;
    // These shared machines swing; a peak far from the first says the fractions above are
    // uncertain by as much.
    println!(
        "# candle sgemm 2048^3 after the runs: {:.1} GFLOP/s",
        sgemm_peak(2048)?
    );
    Ok(())
}
