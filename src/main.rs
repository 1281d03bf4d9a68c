//! `gradcache`: train, evaluate, encode with and export DPR-style bi-encoders with batches
//! far larger than memory. Run `gradcache --help`.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, Subcommand, ValueEnum};
use gradcache::bert::{load_pretrained, BertOptions, Pooling};
use gradcache::config::Config;
use gradcache::data::{read_jsonl, Fields};
use gradcache::dist::{self, Collective};
use gradcache::export::sentence_transformers_options;
use gradcache::memory::CountingAllocator;
use gradcache::metrics::{evaluate, RetrievalMetrics};
use gradcache::pretrained::{HubSettings, ModelFiles};
use gradcache::tokenizer::Tokenizer;
use gradcache::trainer::{embed, Event, Observer, Quiet, Trainer};
use gradcache::{ParamStore, Side, Similarity};
use indicatif::{ProgressBar, ProgressStyle};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(
    name = "gradcache",
    version,
    about = "Contrastive training of bi-encoders with batches far larger than memory (gradient cache + activation checkpointing)."
)]
struct Cli {
    /// Log level: error, warn, info, debug, trace.
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a bi-encoder from a TOML config.
    ///
    /// Batch size vs chunk size: `train.batch_size` is how many query/positive pairs form
    /// one optimizer step (all of them are negatives for each other); it is not limited by
    /// memory. `train.query_chunk` / `train.passage_chunk` are how many texts are encoded
    /// with a graph at once: they set activation memory. Results do not depend on the
    /// chunk sizes.
    Train {
        /// The TOML config (see configs/).
        #[arg(long)]
        config: PathBuf,
        /// Override a config value, e.g. `--set train.steps=10 --set optim.name=sgd`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Continue from a checkpoint directory (or the run's `checkpoints` directory:
        /// then the newest).
        #[arg(long)]
        resume: Option<PathBuf>,
    },
    /// Retrieval metrics of a model on JSONL pairs (each query against all positives).
    Eval {
        /// A model directory (e.g. one written by `export`) or a Hugging Face Hub id.
        #[arg(long)]
        model: String,
        /// JSONL pairs with `query` and `positive`.
        #[arg(long)]
        data: PathBuf,
        /// Token limit.
        #[arg(long, default_value_t = 128)]
        max_len: usize,
        /// Texts encoded at once.
        #[arg(long, default_value_t = 32)]
        chunk: usize,
        /// Similarity used for ranking.
        #[arg(long, value_enum, default_value_t = Sim::Cosine)]
        similarity: Sim,
    },
    /// Embed texts: `--text` arguments, or a file with one text per line or JSONL with a
    /// `text` field. Writes JSONL `{"text", "embedding"}`.
    Encode {
        /// A model directory or a Hugging Face Hub id.
        #[arg(long)]
        model: String,
        /// A text to embed (repeatable).
        #[arg(long)]
        text: Vec<String>,
        /// A file of texts (plain lines, or JSONL with a `text` field).
        #[arg(long)]
        input: Option<PathBuf>,
        /// Where to write the JSONL (default: standard output).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Token limit.
        #[arg(long, default_value_t = 128)]
        max_len: usize,
    },
    /// Export a trained run (its newest checkpoint) as a Hugging Face + sentence-transformers
    /// model directory.
    Export {
        /// The run's TOML config.
        #[arg(long)]
        config: PathBuf,
        /// Config overrides used for the run.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// A checkpoint directory (default: the newest under `<output_dir>/checkpoints`).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// The new model directory (must not exist or be empty).
        #[arg(long)]
        output: PathBuf,
        /// With two towers: which one.
        #[arg(long, value_enum, default_value_t = Tower::Query)]
        tower: Tower,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Sim {
    Cosine,
    Dot,
}

#[derive(Clone, Copy, ValueEnum)]
enum Tower {
    Query,
    Passage,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Under mpirun only rank 0 logs progress; the other ranks log warnings and errors.
    let other_rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .is_some_and(|r| r > 0);
    let level = if other_rank {
        "warn"
    } else {
        cli.log_level.as_str()
    };
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One write, so that lines of several ranks sharing a terminal do not interleave.
            let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Train {
            config,
            set,
            resume,
        } => train(&config, &set, resume.as_deref()),
        Command::Eval {
            model,
            data,
            max_len,
            chunk,
            similarity,
        } => eval(&model, &data, max_len, chunk, similarity),
        Command::Encode {
            model,
            text,
            input,
            output,
            max_len,
        } => encode(&model, text, input.as_deref(), output.as_deref(), max_len),
        Command::Export {
            config,
            set,
            checkpoint,
            output,
            tower,
        } => {
            let mut cfg = Config::load(&config, &set)?;
            // Exporting reads one checkpoint: one process, whatever the run used.
            cfg.dist.backend = dist::Backend::None;
            let ckpt = checkpoint.unwrap_or_else(|| cfg.output_dir.join("checkpoints"));
            let trainer = Trainer::new(cfg, Some(&ckpt))?;
            let side = match tower {
                Tower::Query => Side::Query,
                Tower::Passage => Side::Passage,
            };
            trainer.export(&output, side)?;
            tracing::info!("exported step {} to {}", trainer.step(), output.display());
            Ok(())
        }
    }
}

/// Draws the progress bar, logs evaluations and notes, appends to `metrics.jsonl`.
struct Console {
    bar: ProgressBar,
    metrics: File,
}

impl Console {
    fn line(&mut self, value: serde_json::Value) {
        if let Err(e) = writeln!(self.metrics, "{value}") {
            self.bar
                .suspend(|| tracing::warn!("cannot write metrics.jsonl: {e}"));
        }
    }
}

fn describe(m: &RetrievalMetrics) -> String {
    format!(
        "recall@1 {:.3}  recall@5 {:.3}  recall@10 {:.3}  mrr@10 {:.3}  ndcg@10 {:.3}  ({} queries)",
        m.recall_at_1, m.recall_at_5, m.recall_at_10, m.mrr_at_10, m.ndcg_at_10, m.queries
    )
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
                self.line(serde_json::json!({"type": "step", "step": r.step, "loss": r.loss, "lr": r.lr,
                    "grad_norm": r.grad_norm, "pairs_per_sec": r.pairs_per_sec, "peak_bytes": r.peak_bytes}));
                if !self.bar.is_hidden() {
                    return;
                }
                // No terminal (CI, logs to a file): a line now and then instead of the bar.
                let every = (self.bar.length().unwrap_or(1) / 20).max(1);
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
            Event::Checkpoint(dir) => {
                self.bar
                    .suspend(|| tracing::info!("checkpoint {}", dir.display()));
            }
            Event::Note(note) => self.bar.suspend(|| tracing::info!("{note}")),
        }
    }
}

fn train(config: &Path, set: &[String], resume: Option<&Path>) -> Result<()> {
    let cfg = Config::load(config, set)?;
    let comm = dist::init(cfg.dist.backend)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    match train_on(cfg, resume, Rc::clone(&comm)) {
        Ok(()) => Ok(()),
        Err(e) if world == 1 => Err(e),
        Err(e) => {
            let agreed = matches!(
                e.downcast_ref::<gradcache::Error>(),
                Some(gradcache::Error::RankFailed { .. } | gradcache::Error::RankMismatch { .. })
            );
            let line = format!("error: [rank {rank}/{world}]: {e:#}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            if agreed {
                // Every rank stops here with the same error. Wait until all have printed it:
                // mpirun ends the job at the first non-zero exit.
                let _ = comm.barrier();
                drop(comm);
                std::process::exit(1);
            }
            // This rank alone failed outside a step (the others may be waiting in a
            // collective): stop the whole job now instead of leaving them hanging.
            comm.abort(1)
        }
    }
}

fn train_on(cfg: Config, resume: Option<&Path>, comm: Rc<dyn Collective>) -> Result<()> {
    let mut trainer = Trainer::with_collective(cfg.clone(), resume, comm)?;
    if trainer.rank() != 0 {
        // One progress bar, one metrics file and one loss curve: rank 0's.
        trainer.run(&mut Quiet)?;
        return Ok(());
    }
    tracing::info!(
        "training {} steps, batch {} pairs in chunks of {}/{} (query/passage)",
        cfg.train.steps,
        cfg.train.batch_size,
        cfg.train.query_chunk,
        cfg.train.passage_chunk
    );
    let metrics_path = cfg.output_dir.join("metrics.jsonl");
    let metrics = OpenOptions::new()
        .create(true)
        .append(resume.is_some())
        .write(true)
        .truncate(resume.is_none())
        .open(&metrics_path)
        .with_context(|| format!("cannot open {}", metrics_path.display()))?;
    let bar = ProgressBar::new(cfg.train.steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(trainer.step());
    let mut console = Console { bar, metrics };
    let (before, after) = trainer.run(&mut console)?;
    console.bar.finish_and_clear();
    if let Some(before) = before {
        tracing::info!("before: {}", describe(&before));
    }
    tracing::info!("after:  {}", describe(&after));
    let png = cfg.output_dir.join("loss.png");
    match plot_losses(&metrics_path, &png) {
        Ok(()) => tracing::info!("loss curve: {}", png.display()),
        Err(e) => tracing::warn!("no loss curve: {e:#}"),
    }
    Ok(())
}

/// The loss of every step recorded in `metrics.jsonl` (a resumed run appends to it).
fn plot_losses(metrics: &Path, png: &Path) -> Result<()> {
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

fn load_model(
    model: &str,
    max_len: usize,
) -> Result<(gradcache::bert::BertEncoder, Tokenizer, Similarity)> {
    let files = ModelFiles::resolve(model, &HubSettings::from_env())?;
    let dir = files
        .config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let (pooling, normalize) =
        sentence_transformers_options(&dir)?.unwrap_or((Pooling::Mean, true));
    let options = BertOptions {
        pooling,
        normalize,
        ..Default::default()
    };
    let (encoder, cfg, _) = load_pretrained(
        &files,
        "",
        &options,
        ParamStore::new(0, DType::F32, &Device::Cpu),
    )?;
    let tok = files.tokenizer.context("the model has no tokenizer.json")?;
    let tokenizer = Tokenizer::from_file(&tok, max_len.min(cfg.max_position_embeddings))?;
    let similarity = if normalize {
        Similarity::Cosine
    } else {
        Similarity::Dot
    };
    Ok((encoder, tokenizer, similarity))
}

fn eval(model: &str, data: &Path, max_len: usize, chunk: usize, similarity: Sim) -> Result<()> {
    let (encoder, tokenizer, _) = load_model(model, max_len)?;
    let pairs = read_jsonl(data, &Fields::default())?;
    let queries: Vec<&str> = pairs.iter().map(|p| p.query.as_str()).collect();
    let passages: Vec<&str> = pairs.iter().map(|p| p.positive.as_str()).collect();
    let q = embed(&encoder, &tokenizer, &queries, chunk, &Device::Cpu)?;
    let p = embed(&encoder, &tokenizer, &passages, chunk, &Device::Cpu)?;
    let sim = match similarity {
        Sim::Cosine => Similarity::Cosine,
        Sim::Dot => Similarity::Dot,
    };
    let m = evaluate(&q, &p, &(0..pairs.len()).collect::<Vec<_>>(), sim, 256)?;
    println!("{}", serde_json::to_string(&m)?);
    tracing::info!("{}", describe(&m));
    Ok(())
}

fn encode(
    model: &str,
    mut texts: Vec<String>,
    input: Option<&Path>,
    output: Option<&Path>,
    max_len: usize,
) -> Result<()> {
    if let Some(path) = input {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            if line.trim_start().starts_with('{') {
                let v: serde_json::Value = serde_json::from_str(&line)
                    .with_context(|| format!("{}:{}: not valid JSON", path.display(), i + 1))?;
                let text = v["text"].as_str().with_context(|| {
                    format!("{}:{}: missing string field `text`", path.display(), i + 1)
                })?;
                texts.push(text.to_string());
            } else {
                texts.push(line);
            }
        }
    }
    if texts.is_empty() {
        bail!("nothing to encode: give --text or --input");
    }
    let (encoder, tokenizer, _) = load_model(model, max_len)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embeddings = embed(&encoder, &tokenizer, &refs, 32, &Device::Cpu)?.to_vec2::<f32>()?;
    let mut out: Box<dyn Write> = match output {
        Some(p) => {
            Box::new(File::create(p).with_context(|| format!("cannot create {}", p.display()))?)
        }
        None => Box::new(std::io::stdout().lock()),
    };
    for (text, e) in texts.iter().zip(embeddings) {
        writeln!(out, "{}", serde_json::json!({"text": text, "embedding": e}))?;
    }
    Ok(())
}
