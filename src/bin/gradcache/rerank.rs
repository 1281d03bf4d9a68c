//! `gradcache rerank` and `gradcache score`: a cross-encoder over a first-stage run, and
//! over a file of (query, document) pairs.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::retrieval::write_file;
use gradcache::rerank::evaluate::{rerank_beir, RerankMetrics, RerankOptions};
use gradcache::rerank::CrossEncoder;
use gradcache::retrieval::metrics::{parse_trec_run, trec_run};
use gradcache::retrieval::BeirSet;

/// `gradcache rerank`'s arguments.
#[derive(clap::Args)]
pub struct RerankArgs {
    /// A cross-encoder: a directory (sentence-transformers' CrossEncoder layout or an
    /// AutoModelForSequenceClassification one) or a Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// A BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv.
    #[arg(long)]
    pub beir: PathBuf,
    /// The qrels split of `--beir`.
    #[arg(long, default_value = "test")]
    pub split: String,
    /// The first stage's run in TREC format (`gradcache eval --run-file`, or any).
    #[arg(long)]
    pub run_file: PathBuf,
    /// The first stage's documents reranked per query.
    #[arg(long, default_value_t = 100)]
    pub top_k: usize,
    /// The cutoff of MRR and nDCG.
    #[arg(long, default_value_t = 10)]
    pub at_k: usize,
    /// Put each query's positives among the documents reranked even where the first
    /// stage missed them (sentence-transformers' evaluator's default): measures the
    /// reranker alone, not the pipeline.
    #[arg(long)]
    pub always_rerank_positives: bool,
    /// Pairs per forward pass.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Token limit of a pair (default and ceiling: the model's own).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// An instruction (sentence-transformers' `prompt`): a `system` message for a model
    /// with a chat template (Qwen3-Reranker's `<Instruct>`), else put before the query.
    #[arg(long)]
    pub instruction: Option<String>,
    /// Joins a document's title and text.
    #[arg(long, default_value = " ")]
    pub title_separator: String,
    /// Write the reranked run (TREC format) here.
    #[arg(long)]
    pub output_run: Option<PathBuf>,
    /// Write a JSON summary (the measures before and after) here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Where to run: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: gradcache::DeviceSpec,
}

fn describe(m: &RerankMetrics) -> String {
    format!(
        "ndcg@{k} {:.4}  mrr@{k} {:.4}  map {:.4}",
        m.ndcg,
        m.mrr,
        m.map,
        k = m.at_k
    )
}

/// `gradcache rerank`.
pub fn rerank(args: RerankArgs) -> Result<()> {
    if args.top_k == 0 || args.at_k == 0 || args.batch_size == 0 {
        bail!("--top-k, --at-k and --batch-size must be at least 1");
    }
    for path in args.output_run.iter().chain(&args.output) {
        gradcache::durable::check_destination(path)?;
    }
    let text = std::fs::read_to_string(&args.run_file)
        .with_context(|| format!("reading the run file {}", args.run_file.display()))?;
    let first_stage = parse_trec_run(&text).map_err(|line| {
        anyhow::anyhow!(
            "{}:{line}: not a TREC run line (`qid Q0 docid rank score tag`)",
            args.run_file.display()
        )
    })?;
    let set = BeirSet::load(&args.beir, &args.split)?;
    let mut model = CrossEncoder::load(&args.model, args.max_len, &args.device.open()?)?;
    if let Some(instruction) = &args.instruction {
        model = model.with_instruction(instruction);
    }
    tracing::info!("{}", model.settings());
    let options = RerankOptions {
        top_k: args.top_k,
        at_k: args.at_k,
        always_rerank_positives: args.always_rerank_positives,
        title_separator: args.title_separator.clone(),
    };
    let start = std::time::Instant::now();
    let mut truncated = 0;
    let report = rerank_beir(&set, &first_stage, &options, &mut |pairs| {
        let (q, d): (Vec<&str>, Vec<&str>) = pairs.iter().copied().unzip();
        truncated += model.tokenizer().count_truncated_pairs(&q, &d)?;
        model.predict(pairs, args.batch_size)
    })?;
    let seconds = start.elapsed().as_secs_f64();
    tracing::info!(
        "{} queries judged in `{}`, {} pairs scored in {seconds:.1} s ({:.0} pairs/s)",
        set.queries.len(),
        args.split,
        report.pairs,
        report.pairs as f64 / seconds.max(1e-9)
    );
    if truncated > 0 {
        tracing::info!(
            "{truncated} of {} pairs longer than {} tokens: truncated, {}",
            report.pairs,
            model.tokenizer().max_len(),
            model.tokenizer().pair_truncation()
        );
    }
    if report.missing.0 > 0 {
        let named: Vec<String> = report
            .missing
            .1
            .iter()
            .map(|(q, d)| format!("{d} (query {q})"))
            .collect();
        tracing::warn!(
            "{} documents of {} are not in the corpus of {}, left out: {}{}",
            report.missing.0,
            args.run_file.display(),
            args.beir.display(),
            named.join(", "),
            if report.missing.0 > named.len() {
                ", ..."
            } else {
                ""
            }
        );
    }
    if report.queries_without_run > 0 {
        tracing::warn!(
            "{} judged queries have no documents in {} (they score 0)",
            report.queries_without_run,
            args.run_file.display()
        );
    }
    tracing::info!("first stage: {}", describe(&report.base));
    tracing::info!("reranked:    {}", describe(&report.reranked));
    let summary = serde_json::json!({
        "data": args.beir.display().to_string(),
        "split": args.split,
        "run_file": args.run_file.display().to_string(),
        "model": args.model,
        "top_k": args.top_k,
        "always_rerank_positives": args.always_rerank_positives,
        "base": report.base,
        "reranked": report.reranked,
        "missing_documents": report.missing.0,
        "truncated_pairs": truncated,
    });
    if let Some(path) = &args.output_run {
        write_file(path, &trec_run(&report.run, "gradcache-rerank"))?;
        tracing::info!("reranked run: {}", path.display());
    }
    if let Some(path) = &args.output {
        write_file(path, &(serde_json::to_string_pretty(&summary)? + "\n"))?;
        tracing::info!("summary: {}", path.display());
    }
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

/// `gradcache score`'s arguments.
#[derive(clap::Args)]
pub struct ScoreArgs {
    /// A cross-encoder: a directory or a Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// JSONL rows `{"query", "document"}` (`"passage"` too).
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write `{"score": s}` a line, in the input's order (default: standard
    /// output).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Write the raw logits (no activation).
    #[arg(long)]
    pub raw: bool,
    /// Pairs per forward pass.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Token limit of a pair (default and ceiling: the model's own).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// An instruction (sentence-transformers' `prompt`): a `system` message for a model
    /// with a chat template (Qwen3-Reranker's `<Instruct>`), else put before the query.
    #[arg(long)]
    pub instruction: Option<String>,
    /// Where to run: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: gradcache::DeviceSpec,
}

/// The (query, document) pairs of a JSONL file, each line named in an error.
fn read_score_pairs(path: &Path) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    gradcache::retrieval::files::for_each_line(path, |n, line| {
        if line.trim().is_empty() {
            return Ok(());
        }
        let bad = |reason: &str| gradcache::Error::Data {
            path: path.to_path_buf(),
            line: n,
            reason: reason.to_string(),
        };
        let row: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(&format!("not JSON: {e}")))?;
        let field = |names: &[&str]| {
            names
                .iter()
                .find_map(|k| row.get(*k).and_then(|v| v.as_str()))
                .map(str::to_string)
        };
        let query = field(&["query"]).ok_or_else(|| bad("no `query` text"))?;
        let document = field(&["document", "passage"])
            .ok_or_else(|| bad("no `document` (or `passage`) text"))?;
        pairs.push((query, document));
        Ok(())
    })?;
    if pairs.is_empty() {
        bail!("{}: no pairs to score", path.display());
    }
    Ok(pairs)
}

/// `gradcache score`.
pub fn score(args: ScoreArgs) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if let Some(path) = &args.output {
        gradcache::durable::check_destination(path)?;
    }
    let pairs = read_score_pairs(&args.input)?;
    let mut model = CrossEncoder::load(&args.model, args.max_len, &args.device.open()?)?;
    if let Some(instruction) = &args.instruction {
        model = model.with_instruction(instruction);
    }
    tracing::info!("{}", model.settings());
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(q, d)| (q.as_str(), d.as_str()))
        .collect();
    let (q, d): (Vec<&str>, Vec<&str>) = refs.iter().copied().unzip();
    let truncated = model.tokenizer().count_truncated_pairs(&q, &d)?;
    if truncated > 0 {
        tracing::info!(
            "{truncated} of {} pairs longer than {} tokens: truncated, {}",
            pairs.len(),
            model.tokenizer().max_len(),
            model.tokenizer().pair_truncation()
        );
    }
    let logits = model.logits(&refs, args.batch_size)?;
    let mut out = String::new();
    for row in &logits {
        let line = match (args.raw, row.len()) {
            (true, 1) => serde_json::json!({ "score": row[0] }),
            (true, _) => serde_json::json!({ "scores": row }),
            (false, 1) => serde_json::json!({ "score": model.activation().apply(row[0]) }),
            (false, _) => serde_json::json!({
                "scores": row.iter().map(|&x| model.activation().apply(x)).collect::<Vec<_>>()
            }),
        };
        out.push_str(&line.to_string());
        out.push('\n');
    }
    match &args.output {
        Some(path) => {
            write_file(path, &out)?;
            tracing::info!("{} scores: {}", logits.len(), path.display());
        }
        None => std::io::stdout().write_all(out.as_bytes())?,
    }
    Ok(())
}
