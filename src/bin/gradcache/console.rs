//! The console of `gradcache train`: the progress bar (or plain log lines without a
//! terminal), evaluation and note lines, and `metrics.jsonl`.

use std::fs::File;
use std::io::Write;

use gradcache::train::metrics::RetrievalMetrics;
use gradcache::train::{Event, Observer};
use indicatif::ProgressBar;

/// Draws the progress bar, logs evaluations and notes, appends to `metrics.jsonl`.
pub struct Console {
    pub bar: ProgressBar,
    pub metrics: File,
}

impl Console {
    fn line(&mut self, value: serde_json::Value) {
        if let Err(e) = writeln!(self.metrics, "{value}") {
            self.bar
                .suspend(|| tracing::warn!("cannot write metrics.jsonl: {e}"));
        }
    }
}

pub fn describe(m: &RetrievalMetrics) -> String {
    let mut line = format!(
        "recall@1 {:.3}  recall@5 {:.3}  recall@10 {:.3}  mrr@10 {:.3}  ndcg@10 {:.3}",
        m.recall_at_1, m.recall_at_5, m.recall_at_10, m.mrr_at_10, m.ndcg_at_10
    );
    if let (Some(r), Some(map)) = (m.recall_at_100, m.map_at_100) {
        line += &format!("  recall@100 {r:.3}  map@100 {map:.3}");
    }
    line + &format!("  ({} queries)", m.queries)
}

impl Observer for Console {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Step(r) => {
                self.bar.set_position(r.step);
                self.bar.set_message(format!(
                    "loss {:.4}  lr {:.2e}  {:.0} pairs/s  peak {:.0} MiB",
                    r.loss,
                    r.lr,
                    r.pairs_per_sec,
                    r.peak_bytes as f64 / 1048576.0
                ));
                let seconds = r.phases.total_ms() / 1e3;
                self.line(serde_json::json!({"type": "step", "step": r.step, "loss": r.loss, "lr": r.lr,
                    "grad_norm": r.grad_norm, "pairs_per_sec": r.pairs_per_sec, "peak_bytes": r.peak_bytes,
                    "heap_peak_bytes": r.heap_peak_bytes,
                    "phases_ms": r.phases, "phase_peak_bytes": r.phase_peaks, "flops": r.flops,
                    "gflops_per_sec": r.flops / seconds.max(1e-9) / 1e9,
                    "loss_scale": r.loss_scaling.map(|s| s.used),
                    "skipped": r.loss_scaling.is_some_and(|s| s.skipped)}));
                if let Some(s) = r.loss_scaling.filter(|s| s.skipped) {
                    self.bar.suspend(|| {
                        tracing::warn!(
                            "step {}: inf/NaN gradients at loss scale {}: step skipped (no weight \
                             or optimizer state changed), the scale backs off",
                            r.step,
                            s.used
                        )
                    });
                }
                // Every ~20th of the run, one line of where the step's time and memory went.
                let every = (self.bar.length().unwrap_or(1) / 20).max(1);
                if r.step % every == 0 || r.step == 1 {
                    let line = phase_summary(r);
                    self.bar
                        .suspend(|| tracing::info!("step {}: {line}", r.step));
                }
                if !self.bar.is_hidden() {
                    return;
                }
                // No terminal (CI, logs to a file): a line now and then instead of the bar.
                if r.step % every == 0 || r.step == 1 {
                    tracing::info!(
                        "step {}/{}  loss {:.4}  lr {:.2e}  {:.0} pairs/s",
                        r.step,
                        self.bar.length().unwrap_or(0),
                        r.loss,
                        r.lr,
                        r.pairs_per_sec
                    );
                }
            }
            Event::Eval { step, metrics } => {
                let text = describe(metrics);
                self.bar
                    .suspend(|| tracing::info!("eval at step {step}: {text}"));
                self.line(serde_json::json!({"type": "eval", "step": step, "metrics": metrics}));
            }
            Event::CheckpointSaved(dir) => {
                self.bar
                    .suspend(|| tracing::info!("checkpoint {}", dir.display()));
            }
            Event::Note(note) => self.bar.suspend(|| tracing::info!("{note}")),
        }
    }
}

/// `represent 183 ms / 41.2 MiB, loss ..., replay ..., reduce ..., optimizer ..., heap
/// peak 72.4 MiB`: each phase's wall time and peak memory above the step's start, and the
/// heap's peak (what `train.memory_budget` bounds).
fn phase_summary(r: &gradcache::train::trainer::StepReport) -> String {
    let (t, m) = (&r.phases, &r.phase_peaks);
    let mib = |b: usize| b as f64 / 1048576.0;
    [
        ("represent", t.represent_ms, m.represent),
        ("loss", t.loss_ms, m.loss),
        ("replay", t.replay_ms, m.replay),
        ("reduce", t.reduce_ms, m.reduce),
        ("optimizer", t.optimizer_ms, m.optimizer),
    ]
    .iter()
    .map(|(name, ms, bytes)| format!("{name} {ms:.0} ms / {:.1} MiB", mib(*bytes)))
    .chain((r.heap_peak_bytes > 0).then(|| format!("heap peak {:.1} MiB", mib(r.heap_peak_bytes))))
    .collect::<Vec<_>>()
    .join(", ")
}
