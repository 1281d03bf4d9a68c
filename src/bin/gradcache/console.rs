//! The console of `gradcache train`: the progress bar (or plain log lines without a
//! terminal), evaluation and note lines, and `metrics.jsonl`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gradcache::train::metrics::RetrievalMetrics;
use gradcache::train::{Event, Observer};
use indicatif::ProgressBar;

/// `metrics.jsonl`: one JSON line per step and per evaluation, kept in memory and written
/// whole (atomically: a crash never leaves a torn line) after every evaluation and
/// checkpoint, at the end, and in between at most every couple of seconds.
pub struct MetricsFile {
    path: PathBuf,
    lines: Vec<String>,
    unwritten: bool,
    written_at: Instant,
    /// How long the last write took: writes are spaced to at least 20 times that, so that
    /// a long run's growing file costs under 5% of its time.
    cost: Duration,
}

impl MetricsFile {
    /// The metrics of a run in `output_dir`. Resuming at `resumed` updates, the lines of
    /// later steps (which the resumed run does again) are dropped; a fresh run starts
    /// empty.
    pub fn open(output_dir: &Path, resumed: Option<u64>) -> anyhow::Result<Self> {
        let path = output_dir.join("metrics.jsonl");
        let mut lines = Vec::new();
        if let Some(step) = resumed {
            match std::fs::read_to_string(&path) {
                Ok(text) => lines = lines_up_to(&text, step),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
            }
        }
        Ok(Self {
            path,
            lines,
            // Nothing to write until a line comes: a run refused before its first step
            // (another run holds the directory) must not touch that run's file.
            unwritten: false,
            written_at: Instant::now(),
            cost: Duration::ZERO,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn push(&mut self, value: serde_json::Value) {
        self.lines.push(value.to_string());
        self.unwritten = true;
    }

    /// Writes the file now, if anything changed since the last write.
    pub fn flush(&mut self) -> gradcache::Result<()> {
        if !self.unwritten {
            return Ok(());
        }
        let start = Instant::now();
        let mut text = self.lines.join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        gradcache::durable::write(&self.path, text)?;
        self.unwritten = false;
        self.written_at = Instant::now();
        self.cost = start.elapsed();
        Ok(())
    }

    /// Writes the file if the last write is long enough ago.
    fn flush_now_and_then(&mut self) -> gradcache::Result<()> {
        let spacing = (self.cost * 20).max(Duration::from_secs(2));
        if self.written_at.elapsed() >= spacing {
            self.flush()?;
        }
        Ok(())
    }
}

/// The lines of a metrics file that belong to steps up to `step` (a torn or foreign line
/// is dropped).
fn lines_up_to(text: &str, step: u64) -> Vec<String> {
    text.lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(str::to_string)
        .collect()
}

/// Draws the progress bar, logs evaluations and notes, keeps `metrics.jsonl`.
pub struct Console {
    pub bar: ProgressBar,
    pub metrics: MetricsFile,
}

impl Console {
    fn line(&mut self, value: serde_json::Value) {
        self.metrics.push(value);
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
    fn event(&mut self, event: &Event) -> gradcache::Result<()> {
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
                let mut line = serde_json::json!({"type": "step", "step": r.step, "loss": r.loss, "lr": r.lr,
                    "grad_norm": r.grad_norm, "pairs_per_sec": r.pairs_per_sec, "peak_bytes": r.peak_bytes,
                    "heap_peak_bytes": r.heap_peak_bytes,
                    "phases_ms": r.phases, "phase_peak_bytes": r.phase_peaks, "flops": r.flops,
                    "gflops_per_sec": r.flops / seconds.max(1e-9) / 1e9,
                    "loss_scale": r.loss_scaling.map(|s| s.used),
                    "skipped": r.skipped, "gpu_memory": r.gpu_memory});
                if let Some(source) = &r.source {
                    line["source"] = serde_json::json!(source);
                }
                self.line(line);
                if !r.profile.is_empty() {
                    self.line(
                        serde_json::json!({"type": "profile", "step": r.step, "spans": r.profile}),
                    );
                    let table = profile_table(&r.profile);
                    self.bar.suspend(|| {
                        tracing::info!("step {} profile (GRADCACHE_PROFILE):\n{table}", r.step)
                    });
                }
                if let Some(s) = r.loss_scaling.filter(|s| s.skipped) {
                    self.bar.suspend(|| {
                        tracing::warn!(
                            "step {}: inf/NaN at loss scale {}: step skipped (no weight or \
                             optimizer state changed), the scale backs off",
                            r.step,
                            s.used
                        )
                    });
                } else if r.skipped {
                    self.bar.suspend(|| {
                        tracing::warn!(
                            "step {}: non-finite loss ({}) or gradient norm ({}): step skipped \
                             (train.on_nonfinite = \"skip\"; no weight or optimizer state changed)",
                            r.step,
                            r.loss,
                            r.grad_norm
                        )
                    });
                }
                self.metrics.flush_now_and_then()?;
                // Every ~20th of the run, one line of where the step's time and memory went.
                let every = (self.bar.length().unwrap_or(1) / 20).max(1);
                if r.step % every == 0 || r.step == 1 {
                    let line = phase_summary(r);
                    self.bar
                        .suspend(|| tracing::info!("step {}: {line}", r.step));
                }
                if !self.bar.is_hidden() {
                    return Ok(());
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
            Event::Eval {
                step,
                metrics,
                sets,
            } => {
                for (name, m) in sets {
                    let text = describe(m);
                    self.bar
                        .suspend(|| tracing::info!("eval {name} at step {step}: {text}"));
                    self.line(serde_json::json!({
                        "type": "eval", "step": step, "set": name, "metrics": m,
                    }));
                }
                let text = describe(metrics);
                if sets.is_empty() {
                    self.bar
                        .suspend(|| tracing::info!("eval at step {step}: {text}"));
                    self.line(
                        serde_json::json!({"type": "eval", "step": step, "metrics": metrics}),
                    );
                } else {
                    self.bar.suspend(|| {
                        tracing::info!("eval mean of {} sets at step {step}: {text}", sets.len())
                    });
                    self.line(serde_json::json!({
                        "type": "eval", "step": step, "set": "mean", "metrics": metrics,
                    }));
                }
                self.metrics.flush()?;
            }
            Event::Checkpointing(_) => self.metrics.flush()?,
            Event::CheckpointSaved(dir) => {
                self.bar
                    .suspend(|| tracing::info!("checkpoint {}", dir.display()));
                self.metrics.flush()?;
            }
            Event::Note(note) => self.bar.suspend(|| tracing::info!("{note}")),
            Event::Extended(e) => {
                self.line(serde_json::json!({
                    "type": "extended",
                    "step": e.step,
                    "from_steps": e.from_steps,
                    "to_steps": e.to_steps,
                }));
                self.metrics.flush()?;
            }
        }
        Ok(())
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

/// The profile of a step as aligned lines: span, count, total and mean milliseconds, the
/// GPU memory pool's peak, the bytes a counted driver call moved, and the speed of the
/// CPU's matrix products.
pub(crate) fn profile_table(entries: &[gradcache::profile::Entry]) -> String {
    let width = entries
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = format!(
        "  {:width$}  {:>8}  {:>10}  {:>9}  {:>12}  {:>10}  {:>8}",
        "span", "count", "total ms", "mean ms", "GPU peak MiB", "MiB moved", "GFLOP/s"
    );
    for e in entries {
        let speed = if e.flops > 0 && e.total_ms > 0.0 {
            format!("{:.1}", e.flops as f64 / (e.total_ms * 1e6))
        } else {
            String::new()
        };
        out += &format!(
            "\n  {:width$}  {:>8}  {:>10.2}  {:>9.3}  {:>12.1}  {:>10.1}  {:>8}",
            e.name,
            e.count,
            e.total_ms,
            e.total_ms / e.count.max(1) as f64,
            e.gpu_peak_bytes as f64 / 1048576.0,
            e.bytes as f64 / 1048576.0,
            speed
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::lines_up_to;

    #[test]
    fn a_resumed_run_keeps_the_lines_up_to_its_step() {
        let text = "{\"type\":\"step\",\"step\":1}\n{\"type\":\"eval\",\"step\":2}\n\
                    {\"type\":\"step\",\"step\":3}\n{\"type\":\"st";
        let kept = lines_up_to(text, 2);
        assert_eq!(kept.len(), 2);
        assert!(kept[1].contains("eval"));
    }
}
