//! `loss.png`: the loss curve of a run with its evaluations below it, and `phases.png`:
//! the time and peak memory of each phase of its steps, from its `metrics.jsonl`. Each is
//! drawn under a temporary name and renamed when complete.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// The retrieval metrics drawn over the steps, as `metrics.jsonl` names them.
const EVAL_METRICS: [(&str, &str); 3] = [
    ("recall_at_1", "recall@1"),
    ("mrr_at_10", "MRR@10"),
    ("ndcg_at_10", "nDCG@10"),
];

/// The loss of every step recorded in `metrics.jsonl` (a resumed run appends to it) and,
/// when the run evaluated, a second panel below it: the retrieval metrics of every
/// evaluation over the steps.
pub fn plot_losses(metrics: &Path, png: &Path) -> Result<()> {
    gradcache::durable::write_with(png, |tmp| draw_losses(metrics, tmp))
}

fn draw_losses(metrics: &Path, png: &Path) -> Result<()> {
    use plotters::prelude::*;
    let mut points: Vec<(u64, f32)> = Vec::new();
    let mut evals: Vec<(u64, [f32; 3])> = Vec::new();
    for line in BufReader::new(File::open(metrics)?).lines() {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        let Some(s) = v["step"].as_u64() else {
            continue;
        };
        if v["type"] == "step" {
            if let Some(l) = v["loss"].as_f64() {
                points.retain(|(step, _)| *step < s);
                points.push((s, l as f32));
            }
        } else if v["type"] == "eval" {
            let m = &v["metrics"];
            let values = EVAL_METRICS.map(|(key, _)| m[key].as_f64().unwrap_or(f64::NAN) as f32);
            evals.retain(|(step, _)| *step < s);
            evals.push((s, values));
        }
    }
    if points.is_empty() {
        bail!("no steps recorded");
    }
    register_font()?;
    let max_step = points.last().map_or(1, |p| p.0).max(1);
    let max_loss = points.iter().map(|p| p.1).fold(0f32, f32::max).max(1e-3);
    let height = if evals.is_empty() { 480 } else { 880 };
    let root = BitMapBackend::new(png, (800, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = if evals.is_empty() {
        (root.clone(), None)
    } else {
        let (top, bottom) = root.split_vertically(480);
        (top, Some(bottom))
    };
    let mut chart = ChartBuilder::on(&top)
        .caption("training loss", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0u64..max_step, 0f32..max_loss * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()?;
    chart.draw_series(LineSeries::new(points, &BLUE))?;
    if let Some(area) = bottom {
        let mut chart = ChartBuilder::on(&area)
            .caption("evaluation (held-out pairs)", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0u64..max_step, 0f32..1.0f32)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("score")
            .draw()?;
        for (i, (_, label)) in EVAL_METRICS.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let series: Vec<(u64, f32)> = evals
                .iter()
                .map(|(s, v)| (*s, v[i]))
                .filter(|(_, v)| v.is_finite())
                .collect();
            chart
                .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart.draw_series(
                series
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Registers the DejaVu font for the labels (once per process is enough; again is harmless).
fn register_font() -> Result<()> {
    use plotters::prelude::*;
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .context("no font for the plot labels (install fonts-dejavu-core)")?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("the font file is not a valid font"))?;
    Ok(())
}

/// The phases of a step, as `metrics.jsonl` names them (`phases_ms`, `phase_peak_bytes`).
const PHASES: [(&str, &str); 5] = [
    ("represent_ms", "represent"),
    ("loss_ms", "loss"),
    ("replay_ms", "replay"),
    ("reduce_ms", "reduce"),
    ("optimizer_ms", "optimizer"),
];

/// Two panels over the steps: each phase's wall time (ms) and its peak memory (MiB).
pub fn plot_phases(metrics: &Path, png: &Path) -> Result<()> {
    gradcache::durable::write_with(png, |tmp| draw_phases(metrics, tmp))
}

fn draw_phases(metrics: &Path, png: &Path) -> Result<()> {
    use plotters::prelude::*;
    // step -> ([ms; 5], [MiB; 5]); a resumed run's repeated steps keep the last record.
    let mut rows: Vec<(u64, [f64; 5], [f64; 5])> = Vec::new();
    for line in BufReader::new(File::open(metrics)?).lines() {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        let Some(step) = v["step"].as_u64().filter(|_| v["type"] == "step") else {
            continue;
        };
        let mut ms = [0.0; 5];
        let mut mib = [0.0; 5];
        for (i, (key, name)) in PHASES.iter().enumerate() {
            ms[i] = v["phases_ms"][key].as_f64().unwrap_or(0.0);
            mib[i] = v["phase_peak_bytes"][name].as_f64().unwrap_or(0.0) / 1048576.0;
        }
        rows.retain(|(s, _, _)| *s < step);
        rows.push((step, ms, mib));
    }
    if rows.is_empty() {
        bail!("no steps recorded");
    }
    register_font()?;
    let max_step = rows.last().map_or(1, |r| r.0).max(1);
    let root = BitMapBackend::new(png, (800, 720)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 1));
    let colors = [&BLUE, &RED, &GREEN, &MAGENTA, &BLACK];
    for (panel, (title, unit, pick)) in panels.iter().zip([
        ("time per phase", "ms", 0usize),
        ("peak memory per phase (above the step's start)", "MiB", 1),
    ]) {
        let value =
            |r: &(u64, [f64; 5], [f64; 5]), i: usize| if pick == 0 { r.1[i] } else { r.2[i] };
        let top = rows
            .iter()
            .flat_map(|r| (0..5).map(move |i| (r, i)))
            .map(|(r, i)| value(r, i))
            .fold(0f64, f64::max)
            .max(1e-3);
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0u64..max_step, 0f64..top * 1.1)?;
        chart.configure_mesh().x_desc("step").y_desc(unit).draw()?;
        for (i, (_, name)) in PHASES.iter().enumerate() {
            let color = colors[i];
            chart
                .draw_series(LineSeries::new(
                    rows.iter().map(|r| (r.0, value(r, i))),
                    color,
                ))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
