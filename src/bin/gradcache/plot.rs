//! `loss.png`: the loss curve of a run, from its `metrics.jsonl`.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// The loss of every step recorded in `metrics.jsonl` (a resumed run appends to it).
pub fn plot_losses(metrics: &Path, png: &Path) -> Result<()> {
    use plotters::prelude::*;
    let mut points: Vec<(u64, f32)> = Vec::new();
    for line in BufReader::new(File::open(metrics)?).lines() {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        if v["type"] == "step" {
            if let (Some(s), Some(l)) = (v["step"].as_u64(), v["loss"].as_f64()) {
                points.retain(|(step, _)| *step < s);
                points.push((s, l as f32));
            }
        }
    }
    if points.is_empty() {
        bail!("no steps recorded");
    }
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .context("no font for the plot labels (install fonts-dejavu-core)")?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("the font file is not a valid font"))?;
    let max_step = points.last().map_or(1, |p| p.0).max(1);
    let max_loss = points.iter().map(|p| p.1).fold(0f32, f32::max).max(1e-3);
    let root = BitMapBackend::new(png, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
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
    root.present()?;
    Ok(())
}
