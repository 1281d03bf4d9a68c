//! `gradcache`: train, evaluate, encode with and export DPR-style bi-encoders with batches
//! far larger than memory. Run `gradcache --help`.

mod console;
mod encode;
mod merge;
mod plot;
mod rerank;
mod retrieval;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gradcache::bert::Pooling;
use gradcache::dist::{self, Backend, Collective};
use gradcache::hub::{EmbeddingModel, LoadOptions, Retriever};
use gradcache::memory::CountingAllocator;
use gradcache::train::data::Fields;
use gradcache::train::formats::read_pairs;
use gradcache::train::image_text::{export_image_text, ImageTextConfig, ImageTextTrainer};
use gradcache::train::metrics::evaluate;
use gradcache::train::{export_run_as, Config, ExportLayout, Quiet, Trainer};
use gradcache::{Side, Similarity};
use indicatif::{ProgressBar, ProgressStyle};

use crate::console::{describe, Console, MetricsFile};

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

/// How a model without sentence-transformers files pools, normalises and compares;
/// given for a model that has them, these override its files.
#[derive(clap::Args)]
struct HeadArgs {
    /// Pooling (default: the model's sentence-transformers files, else mean).
    #[arg(long, value_enum)]
    pooling: Option<PoolingArg>,
    /// L2-normalise embeddings (default: the model's sentence-transformers files, else
    /// false).
    #[arg(long)]
    normalize: Option<bool>,
    /// Similarity for ranking (default: the one the model was trained with, from its
    /// sentence-transformers files, else cosine).
    #[arg(long, value_enum)]
    similarity: Option<SimilarityArg>,
    /// Where to run: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: gradcache::DeviceSpec,
    /// Put before every query, e.g. "query: " (default: the model's `query` prompt from
    /// config_sentence_transformers.json, else its default prompt; "" for none).
    #[arg(long)]
    query_prompt: Option<String>,
    /// Put before every passage, e.g. "passage: " (default: the model's `document`,
    /// `passage` or `corpus` prompt, else its default prompt; "" for none).
    #[arg(long)]
    passage_prompt: Option<String>,
    /// With a PEFT LoRA adapter directory as the model: the base model it adapts
    /// (default: its adapter_config.json's base_model_name_or_path).
    #[arg(long)]
    base: Option<String>,
    /// Encode with this task adapter of a model that carries them (Jina v3:
    /// retrieval.query, retrieval.passage, separation, classification, text-matching),
    /// the task's instruction before every text unless a prompt is given (default: none,
    /// the base weights).
    #[arg(long)]
    task: Option<String>,
}

/// How a corpus is searched.
#[derive(clap::Args)]
struct SearchArgs {
    /// Documents embedded and scored at once (memory is bounded by this block, not by
    /// the corpus).
    #[arg(long, default_value_t = 4096)]
    corpus_block: usize,
    /// Joins a document's title and text (BEIR's convention: a space).
    #[arg(long, default_value = " ")]
    title_separator: String,
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
        /// Continue from a training checkpoint directory (or the run's `checkpoints`
        /// directory: then the newest).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// With --resume: continue a finished or stopped run to a larger `train.steps`
        /// (nothing else may differ); the learning rate follows the new length's schedule
        /// from the checkpoint's step on, and the extension is recorded in the checkpoints
        /// and metrics.jsonl.
        #[arg(long, requires = "resume")]
        extend: bool,
    },
    /// Retrieval metrics of a model: on a BEIR folder (`--beir`: every judged query of a
    /// split against the whole corpus, exact top-k; nDCG@10, MRR@10, recall@1/10/100,
    /// MAP@100 as trec_eval computes them), or on JSONL pairs (`--data`: each query against
    /// all positives of the file).
    Eval {
        /// A model directory (e.g. one written by `export`) or a Hugging Face Hub id.
        #[arg(long)]
        model: String,
        /// Pairs with `query` and `positive`: JSONL (ours or Tevatron's), TSV or CSV with
        /// named columns, Parquet; plain, .gz or .zst.
        #[arg(long, required_unless_present = "beir", conflicts_with = "beir")]
        data: Option<PathBuf>,
        /// A BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv (each may be
        /// .gz or .zst).
        #[arg(long)]
        beir: Option<PathBuf>,
        /// The qrels split of `--beir`.
        #[arg(long, default_value = "test")]
        split: String,
        /// Documents retrieved per query (the run file's depth; recall@100 needs 100).
        #[arg(long, default_value_t = 100)]
        top_k: usize,
        /// Write the run in TREC format (`qid Q0 docid rank score tag`) here (with
        /// `--beir`).
        #[arg(long)]
        run_file: Option<PathBuf>,
        /// Write a JSON summary (data, split, settings, metrics) here (with `--beir`).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Leave out a retrieved document whose id is the query's (BEIR's default, for
        /// sets whose queries are also documents, e.g. Quora); off as pytrec_eval counts.
        #[arg(long)]
        ignore_identical_ids: bool,
        /// Token limit (default: the model's own, from its sentence-transformers or
        /// tokenizer config; a larger one is capped at it).
        #[arg(long)]
        max_len: Option<usize>,
        /// Texts encoded at once.
        #[arg(long, default_value_t = 32)]
        chunk: usize,
        #[command(flatten)]
        search: SearchArgs,
        #[command(flatten)]
        head: HeadArgs,
    },
    /// Mine hard negatives with a model, as sentence-transformers' mine_hard_negatives:
    /// retrieve each query's best candidates from the corpus, drop its positives and the
    /// candidates the filters name, keep `--num-negatives` per query. Writes JSONL pairs
    /// (`query`, `positive`, `negatives`; with `--output-scores`, the model's `scores` of
    /// the positive and each negative) that `gradcache train` reads.
    Mine(retrieval::MineArgs),
    /// Rerank a first-stage run with a cross-encoder: each judged query's top documents
    /// of a TREC run (`gradcache eval --run-file`, or any) scored as (query, document)
    /// pairs; prints nDCG@10, MRR@10 and MAP before and after, as sentence-transformers'
    /// CrossEncoderRerankingEvaluator computes them.
    Rerank(rerank::RerankArgs),
    /// Score (query, document) pairs with a cross-encoder: JSONL rows `{"query",
    /// "document"}` in, `{"score": s}` a line out, in order, with the activation
    /// `CrossEncoder.predict` applies (`--raw`: the logits).
    Score(rerank::ScoreArgs),
    /// Embed texts: `--text` arguments, or a file with one text per line or JSONL with a
    /// `text` field. Writes JSONL `{"text", "embedding"}`; for a sparse (SPLADE) model
    /// `{"text", "sparse": {token: weight}, "indices", "values"}` (its active entries).
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
        /// Embed the texts as queries or passages (with that side's prompt); default:
        /// plain, no prompt.
        #[arg(long, value_enum)]
        side: Option<TowerArg>,
        /// Token limit (default: the model's own, from its sentence-transformers or
        /// tokenizer config; a larger one is capped at it).
        #[arg(long)]
        max_len: Option<usize>,
        /// A sparse model: keep only each vector's k largest entries
        /// (sentence-transformers' `max_active_dims`).
        #[arg(long)]
        top_k: Option<usize>,
        /// Texts per forward pass (sentence-transformers' `batch_size`); on the CPU the
        /// passes run side by side, one per thread. Default on the CPU: passes of up to
        /// 512 tokens (texts times their padded length: about 13 texts of 40 tokens, 64 of
        /// 8, 3 of 150; as fast as 16 texts per pass or faster, short texts or long, with
        /// less memory); on a GPU 32 texts; a multi-vector model 16 texts on the CPU.
        #[arg(long)]
        batch_size: Option<usize>,
        #[command(flatten)]
        head: HeadArgs,
    },
    /// Export a trained run (its newest training checkpoint) as a Hugging Face +
    /// sentence-transformers model directory. Reads the run directory only (no training
    /// data) and writes only the new directory.
    Export {
        /// The run's TOML config.
        #[arg(long)]
        config: PathBuf,
        /// Config overrides used for the run.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// A training checkpoint directory (default: the newest under
        /// `<output_dir>/checkpoints`).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// The new model directory (must not exist or be empty).
        #[arg(long)]
        output: PathBuf,
        /// With two towers: which one.
        #[arg(long, value_enum, default_value_t = TowerArg::Query)]
        tower: TowerArg,
        /// A LoRA run: write the adapters in PEFT's layout (adapter_config.json,
        /// adapter_model.safetensors, for `PeftModel.from_pretrained` over the base model)
        /// instead of the merged model.
        #[arg(long)]
        adapter: bool,
        /// A run of a model with task adapters (Jina v3's): write a plain model with this
        /// task's adapters merged into the base (transformers and sentence-transformers
        /// load it without remote code; the task's instruction as its prompts) instead
        /// of the release's layout with every task.
        #[arg(long, conflicts_with = "adapter")]
        task: Option<String>,
    },
    /// Merge trained models of one architecture into one: the weighted average of their
    /// weights (`--method linear`) or the spherical interpolation of two (`slerp`). Writes
    /// a model directory that loads like any export.
    Merge(merge::MergeArgs),
    /// Check a device before training on it: the gradient cache against a plain
    /// full-batch step, bf16/f16 against f32, f16 overflow detection (a tiny BERT built in
    /// code). Prints one line per check; fails if any is out of its limit.
    SelfCheck {
        /// cpu, cuda (GPU 0) or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: gradcache::DeviceSpec,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum SimilarityArg {
    Cosine,
    Dot,
}

#[derive(Clone, Copy, ValueEnum)]
enum PoolingArg {
    Mean,
    Cls,
    Max,
    #[value(name = "mean_sqrt_len_tokens", alias = "mean_sqrt_len")]
    MeanSqrtLen,
    #[value(name = "weightedmean")]
    WeightedMean,
    #[value(name = "lasttoken")]
    LastToken,
}

#[derive(Clone, Copy, ValueEnum)]
enum TowerArg {
    Query,
    Passage,
}

impl HeadArgs {
    fn load_options(&self, max_len: Option<usize>) -> Result<LoadOptions> {
        Ok(LoadOptions {
            pooling: self.pooling.map(|p| match p {
                PoolingArg::Mean => Pooling::Mean,
                PoolingArg::Cls => Pooling::Cls,
                PoolingArg::Max => Pooling::Max,
                PoolingArg::MeanSqrtLen => Pooling::MeanSqrtLen,
                PoolingArg::WeightedMean => Pooling::WeightedMean,
                PoolingArg::LastToken => Pooling::LastToken,
            }),
            normalize: self.normalize,
            similarity: self.similarity.map(|s| match s {
                SimilarityArg::Cosine => Similarity::Cosine,
                SimilarityArg::Dot => Similarity::Dot,
            }),
            max_len,
            device: self.device.open()?,
            query_prompt: self.query_prompt.clone(),
            passage_prompt: self.passage_prompt.clone(),
            base: self.base.clone(),
            task: self.task.clone(),
        })
    }
}

fn main() -> ExitCode {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    gradcache::memory::keep_freed_memory();
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
            if let Some(signal) = stopped_by(&e) {
                if !other_rank {
                    let _ = std::io::stderr().write_all(format!("{e:#}\n").as_bytes());
                }
                return ExitCode::from(gradcache::stop::exit_code(signal));
            }
            // One write, so that lines of several ranks sharing a terminal do not interleave.
            let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
            ExitCode::FAILURE
        }
    }
}

/// The signal a run stopped on cleanly (checkpoint written), if that is how it ended.
fn stopped_by(e: &anyhow::Error) -> Option<i32> {
    match e.downcast_ref::<gradcache::Error>() {
        Some(gradcache::Error::Stopped { signal, .. }) => Some(*signal),
        _ => None,
    }
}

fn run(command: Command) -> Result<()> {
    if let Some(blas) = gradcache::nn::use_blas_from_env()? {
        tracing::info!(
            "products through the BLAS at {} (`{}`, one thread per call: {})",
            blas.path.display(),
            blas.sgemm,
            blas.threads
                .as_deref()
                .unwrap_or("no setter found, the library's own threading")
        );
    }
    if let Some(set) = gradcache::nn::packing_from_env()? {
        tracing::info!(
            "gemm packing thresholds: rhs {}, lhs {} ({})",
            set.rhs,
            set.lhs,
            gradcache::nn::PACKING_ENV
        );
    }
    if let Some(kernel) = gradcache::nn::panel_kernel_from_env()? {
        tracing::info!(
            "panel products: {kernel:?} ({})",
            gradcache::nn::PANEL_KERNEL_ENV
        );
    }
    match command {
        Command::SelfCheck { device } => self_check(device),
        Command::Merge(args) => merge::merge(&args),
        Command::Train {
            config,
            set,
            resume,
            extend,
        } => train(&config, &set, resume.as_deref(), extend),
        Command::Eval {
            model,
            data,
            beir,
            split,
            top_k,
            run_file,
            output,
            ignore_identical_ids,
            max_len,
            chunk,
            search,
            head,
        } => {
            let options = head.load_options(max_len)?;
            match (data, beir) {
                (_, Some(dir)) => {
                    let search_options = gradcache::retrieval::SearchOptions {
                        top_k,
                        corpus_block: search.corpus_block,
                        ..Default::default()
                    };
                    if top_k == 0 || search.corpus_block == 0 || chunk == 0 {
                        bail!("--top-k, --corpus-block and --chunk must be at least 1");
                    }
                    let outputs = retrieval::EvalOutputs {
                        run_file,
                        summary: output,
                    };
                    outputs.check()?;
                    let eval_options = gradcache::retrieval::CorpusEvalOptions {
                        search: search_options,
                        title_separator: search.title_separator,
                        ignore_identical_ids,
                    };
                    let model = load_retriever(&model, &options)?;
                    retrieval::eval_beir(&*model, &dir, &split, &eval_options, chunk, &outputs)
                }
                (Some(data), None) => {
                    if let Some(flag) = [("--run-file", &run_file), ("--output", &output)]
                        .iter()
                        .find_map(|(flag, path)| path.is_some().then_some(flag))
                    {
                        bail!(
                            "{flag} writes a corpus evaluation's file: it needs --beir (an \
                             evaluation on --data pairs prints its metrics)"
                        );
                    }
                    eval(&model, &data, chunk, &options)
                }
                (None, None) => bail!("give --data or --beir"),
            }
        }
        Command::Mine(args) => retrieval::mine_command(args),
        Command::Rerank(args) => rerank::rerank(args),
        Command::Score(args) => rerank::score(args),
        Command::Encode {
            model,
            text,
            input,
            output,
            side,
            max_len,
            top_k,
            batch_size,
            head,
        } => encode::encode(
            &model,
            text,
            input.as_deref(),
            output.as_deref(),
            (side, top_k, batch_size),
            &head.load_options(max_len)?,
        ),
        Command::Export {
            config,
            set,
            checkpoint,
            output,
            tower,
            adapter,
            task,
        } => {
            let table = gradcache::train::config::read_table(&config)?;
            if ImageTextConfig::is_image_text(&table) {
                let cfg = ImageTextConfig::from_table(table, &config, &set)?;
                let step = export_image_text(&cfg, checkpoint.as_deref(), &output)?;
                tracing::info!(
                    "exported step {step} (image and text towers) to {}",
                    output.display()
                );
                return Ok(());
            }
            let mut cfg = Config::load(&config, &set)?;
            // Exporting reads one checkpoint: one process, whatever the run used.
            cfg.dist.backend = Backend::None;
            if cfg.model.reranker.is_some() {
                let from = checkpoint.unwrap_or_else(|| cfg.output_dir.join("checkpoints"));
                gradcache::durable::refuse_non_empty(&output)?;
                let trainer = gradcache::train::rerank_task::RerankTrainer::reranker(
                    cfg,
                    Some(&from),
                    Rc::new(gradcache::Single),
                )?;
                trainer.export(&output)?;
                tracing::info!(
                    "exported step {} (a cross-encoder) to {}",
                    trainer.step(),
                    output.display()
                );
                return Ok(());
            }
            let side = match tower {
                TowerArg::Query => Side::Query,
                TowerArg::Passage => Side::Passage,
            };
            let layout = match (adapter, task) {
                (true, _) => ExportLayout::Adapter,
                (false, Some(task)) => ExportLayout::Task(task),
                (false, None) => ExportLayout::Merged,
            };
            let found = export_run_as(&cfg, checkpoint.as_deref(), &output, side, layout)?;
            for skipped in &found.skipped {
                tracing::warn!("{skipped}");
            }
            tracing::info!(
                "exported step {} ({}) to {}",
                found.state.step,
                found.dir.display(),
                output.display()
            );
            Ok(())
        }
    }
}

fn train(config: &Path, set: &[String], resume: Option<&Path>, extend: bool) -> Result<()> {
    let table = gradcache::train::config::read_table(config)?;
    if ImageTextConfig::is_image_text(&table) {
        let cfg = ImageTextConfig::from_table(table, config, set)?;
        if extend {
            anyhow::bail!(
                "--extend continues text-pair runs; an image-text or volume-text run resumes \
                 with its own train.steps only"
            );
        }
        return train_image_text(cfg, resume);
    }
    let cfg = Config::load(config, set)?;
    let stop = gradcache::stop::StopSignal::install()?;
    let comm = dist::init(cfg.dist.backend)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    match train_on(cfg, resume, extend, Rc::clone(&comm), stop) {
        Ok(()) => Ok(()),
        Err(e) if world == 1 => Err(e),
        Err(e) => {
            if let Some(signal) = stopped_by(&e) {
                // Every rank stopped at the same step; rank 0 wrote the checkpoint.
                if rank == 0 {
                    let _ = std::io::stderr().write_all(format!("{e:#}\n").as_bytes());
                }
                let _ = comm.barrier();
                drop(comm);
                std::process::exit(gradcache::stop::exit_code(signal).into());
            }
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

fn train_on(
    cfg: Config,
    resume: Option<&Path>,
    extend: bool,
    comm: Rc<dyn Collective>,
    stop: gradcache::stop::StopSignal,
) -> Result<()> {
    if cfg.model.reranker.is_some() {
        if extend {
            bail!("--extend continues text-pair runs; a reranker run resumes with its own train.steps");
        }
        let trainer =
            gradcache::train::rerank_task::RerankTrainer::reranker(cfg.clone(), resume, comm)?;
        return drive(trainer, &cfg, resume, stop);
    }
    let trainer = Trainer::with_options(cfg.clone(), resume, extend, comm)?;
    drive(trainer, &cfg, resume, stop)
}

/// Runs a built trainer with the console (rank 0) and draws its plots.
fn drive<T: gradcache::train::run::Task>(
    mut trainer: gradcache::train::run::Run<T>,
    cfg: &Config,
    resume: Option<&Path>,
    stop: gradcache::stop::StopSignal,
) -> Result<()> {
    trainer.set_stop_signal(stop);
    if trainer.rank() != 0 {
        // One progress bar, one metrics file and one loss curve: rank 0's.
        trainer.run(&mut Quiet)?;
        return Ok(());
    }
    let chunks = match (cfg.train.chunk_tokens, &cfg.model.reranker) {
        (Some(tokens), _) => format!("chunks of at most {tokens} padded tokens"),
        (None, Some(_)) => format!(
            "chunks of {} (query, document) pairs",
            cfg.train
                .pair_chunk
                .unwrap_or(gradcache::train::rerank_task::DEFAULT_PAIR_CHUNK)
        ),
        (None, None) => format!(
            "chunks of {}/{} (query/passage)",
            cfg.train.query_chunk, cfg.train.passage_chunk
        ),
    };
    tracing::info!(
        "training {} steps, batch {} pairs in {chunks}",
        cfg.train.steps,
        cfg.train.batch_size,
    );
    let mut console = open_console(
        &cfg.output_dir,
        cfg.train.steps,
        trainer.step(),
        resume.is_some(),
    )?;
    let ran = trainer.run(&mut console);
    console.bar.finish_and_clear();
    let written = console.metrics.flush();
    let (before, after) = ran?;
    written?;
    let metrics_path = console.metrics.path().to_path_buf();
    if let Some(before) = before {
        tracing::info!("before: {}", describe(&before));
    }
    tracing::info!("after:  {}", describe(&after));
    let png = cfg.output_dir.join("loss.png");
    match plot::plot_losses(&metrics_path, &png) {
        Ok(()) => tracing::info!("loss curve: {}", png.display()),
        Err(e) => tracing::warn!("no loss curve: {e:#}"),
    }
    let png = cfg.output_dir.join("phases.png");
    match plot::plot_phases(&metrics_path, &png) {
        Ok(()) => tracing::info!("time and memory per phase: {}", png.display()),
        Err(e) => tracing::warn!("no phase plot: {e:#}"),
    }
    Ok(())
}

/// The console of a training run: `metrics.jsonl` in `output_dir` (on resume, its lines
/// up to the resumed step are kept) and a progress bar over `steps` starting at `start`.
fn open_console(output_dir: &Path, steps: u64, start: u64, resume: bool) -> Result<Console> {
    let metrics = MetricsFile::open(output_dir, resume.then_some(start))?;
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    Ok(Console { bar, metrics })
}

/// Image-text training (`task = "image-text"` or `"volume-text"`): one process, the
/// console of `train`.
fn train_image_text(cfg: ImageTextConfig, resume: Option<&Path>) -> Result<()> {
    let stop = gradcache::stop::StopSignal::install()?;
    let mut trainer = ImageTextTrainer::new(cfg.clone(), resume)?;
    trainer.set_stop_signal(stop);
    let t = &cfg.train;
    let (task, rows) = match cfg.task {
        gradcache::train::image_text::Task::ImageText => ("image-text", "images"),
        gradcache::train::image_text::Task::VolumeText => ("volume-text", "volumes"),
    };
    tracing::info!(
        "{task} training: {} steps, batch {} pairs in chunks of {} {rows} / {} captions",
        t.steps,
        t.batch_size,
        t.image_chunk,
        t.text_chunk
    );
    let mut console = open_console(&cfg.output_dir, t.steps, trainer.step(), resume.is_some())?;
    let ran = trainer.run(&mut console);
    console.bar.finish_and_clear();
    let written = console.metrics.flush();
    let (before, after) = ran?;
    written?;
    let metrics_path = console.metrics.path().to_path_buf();
    if let Some(before) = before {
        tracing::info!("held-out image->text before: {}", describe(&before));
    }
    tracing::info!("held-out image->text after:  {}", describe(&after));
    let png = cfg.output_dir.join("loss.png");
    match plot::plot_losses(&metrics_path, &png) {
        Ok(()) => tracing::info!("loss curve: {}", png.display()),
        Err(e) => tracing::warn!("no loss curve: {e:#}"),
    }
    Ok(())
}

/// `gradcache self-check`: one line per check, an error if any fails.
fn self_check(device: gradcache::DeviceSpec) -> Result<()> {
    let results = gradcache::selfcheck::run(&device.open()?)?;
    let mut failed = 0;
    for r in &results {
        let verdict = if r.passed() { "ok" } else { "FAIL" };
        failed += usize::from(!r.passed());
        println!(
            "{verdict:4} {}: {:.2e} (limit {:.0e})",
            r.name, r.value, r.limit
        );
    }
    if failed > 0 {
        bail!("{failed} of {} checks failed on {device}", results.len());
    }
    println!("all {} checks passed on {device}", results.len());
    Ok(())
}

/// Loads a model for `eval` or `encode` and logs where its pooling, normalisation and
/// similarity came from.
fn load_model(model: &str, options: &LoadOptions) -> Result<EmbeddingModel> {
    let loaded = EmbeddingModel::load(model, options)?;
    tracing::info!("{model}: {}", loaded.settings());
    Ok(loaded)
}

/// Refuses the single-vector head options on the multi-vector model `model`, by name.
fn refuse_single_vector_options(model: &str, options: &LoadOptions) -> Result<()> {
    let refused = [
        ("--pooling", options.pooling.is_some()),
        ("--normalize", options.normalize.is_some()),
        ("--similarity", options.similarity.is_some()),
        ("--max-len", options.max_len.is_some()),
        ("--query-prompt", options.query_prompt.is_some()),
        ("--passage-prompt", options.passage_prompt.is_some()),
        ("--base", options.base.is_some()),
        ("--task", options.task.is_some()),
    ];
    if let Some((flag, _)) = refused.iter().find(|(_, given)| *given) {
        bail!(
            "{model} is a multi-vector (ColBERT) model: {flag} is a single-vector setting; its \
             lengths, prefixes and normalisation come from its own files"
        );
    }
    Ok(())
}

/// A model for evaluation or mining: a multi-vector (ColBERT) model scored by MaxSim,
/// else a single-vector one with the head `options` set. On a multi-vector model the
/// single-vector head options are refused by name.
fn load_retriever(model: &str, options: &LoadOptions) -> Result<Box<dyn Retriever>> {
    if !gradcache::hub::multi_vector::is_multi_vector_model(model) {
        return Ok(Box::new(load_model(model, options)?));
    }
    refuse_single_vector_options(model, options)?;
    let loaded = gradcache::hub::MultiVectorModel::load(model, &options.device)?;
    let c = loaded.config();
    tracing::info!(
        "{model}: multi-vector ({:?} layout), token vectors of {} values, queries {} tokens \
         (expansion {}, attended {}), documents {} tokens, prefixes {:?} / {:?}, {} skiplist \
         words; scored by MaxSim",
        c.layout,
        loaded.dim(),
        c.head.query_length,
        c.head.query_expansion,
        c.head.attend_to_expansion_tokens,
        c.head.document_length,
        c.head.query_prefix,
        c.head.document_prefix,
        c.head.skiplist_words.len()
    );
    Ok(Box::new(loaded))
}

fn eval(model: &str, data: &Path, chunk: usize, options: &LoadOptions) -> Result<()> {
    let model = load_retriever(model, options)?;
    let pairs = read_pairs(data, &Fields::default(), "train", " ")?;
    let queries: Vec<&str> = pairs.iter().map(|p| p.query.as_str()).collect();
    let passages: Vec<&str> = pairs.iter().map(|p| p.positive.as_str()).collect();
    let q = model.embed_queries(&queries, chunk)?;
    let p = model.embed_passages(&passages, chunk)?;
    let targets: Vec<usize> = (0..pairs.len()).collect();
    let m = evaluate(&q, &p, &targets, model.scoring(), 256)?;
    println!("{}", serde_json::to_string(&m)?);
    tracing::info!("{}", describe(&m));
    Ok(())
}
