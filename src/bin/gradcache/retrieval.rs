//! `gradcache eval --beir` and `gradcache mine`: corpus evaluation and hard-negative
//! mining with a model directory or Hub id, through the library's retrieval module.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::ValueEnum;

use crate::{load_retriever, HeadArgs, SearchArgs};
use gradcache::hub::Retriever;
use gradcache::retrieval::beir::read_corpus;
use gradcache::retrieval::{
    evaluate_corpus, mine, trec_run, BeirSet, CorpusEvalOptions, CorpusMetrics, MineOptions,
    MiningSet,
};
use gradcache::train::data::Fields;
use gradcache::train::formats::read_pairs;

/// `gradcache mine`'s arguments.
#[derive(clap::Args)]
pub struct MineArgs {
    /// A model directory or a Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// Pairs (`query`, `positive`; JSONL, Tevatron, TSV, CSV or Parquet; .gz or .zst):
    /// the corpus is their positives (and `--corpus`).
    #[arg(long, required_unless_present = "beir", conflicts_with = "beir")]
    pub data: Option<PathBuf>,
    /// More corpus documents for `--data` (a BEIR corpus.jsonl, may be compressed).
    #[arg(long, requires = "data")]
    pub corpus: Option<PathBuf>,
    /// A BEIR folder: mine for the queries of `--split` over its corpus.
    #[arg(long)]
    pub beir: Option<PathBuf>,
    /// The qrels split of `--beir`.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// The JSONL file to write (not an input).
    #[arg(long)]
    pub output: PathBuf,
    /// Negatives per query; queries left with fewer are dropped.
    #[arg(long, default_value_t = 3)]
    pub num_negatives: usize,
    /// Skip the best `range_min` candidates (after the positives are removed).
    #[arg(long, default_value_t = 0)]
    pub range_min: usize,
    /// Consider the best `range_max` candidates only.
    #[arg(long, default_value_t = 100)]
    pub range_max: usize,
    /// Drop candidates scoring above this.
    #[arg(long, allow_negative_numbers = true)]
    pub max_score: Option<f32>,
    /// Drop candidates scoring below this.
    #[arg(long, allow_negative_numbers = true)]
    pub min_score: Option<f32>,
    /// Drop candidates scoring above `positive - margin`.
    #[arg(long, allow_negative_numbers = true)]
    pub absolute_margin: Option<f32>,
    /// Drop candidates scoring above `positive * (1 - margin)`.
    #[arg(long, allow_negative_numbers = true)]
    pub relative_margin: Option<f32>,
    /// `top`: the best candidates left; `random`: a seeded sample of them.
    #[arg(long, value_enum, default_value_t = SamplingArg::Top)]
    pub sampling: SamplingArg,
    /// Seed of `--sampling random`.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write each row's `scores`: the model's score of its positive and of each negative
    /// (sentence-transformers' `output_scores`), the teacher scores `[loss.distillation]`
    /// learns from.
    #[arg(long)]
    pub output_scores: bool,
    /// Score each written row's positive and negatives with this cross-encoder (a
    /// directory or Hub id; `predict`'s activation) instead of the mining model: the
    /// reranker's `scores` become the teacher scores distillation reads (implies
    /// `--output-scores`).
    #[arg(long)]
    pub rescore_with: Option<String>,
    /// Token limit (default: the model's own; a larger one is capped at it).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Texts encoded at once.
    #[arg(long, default_value_t = 32)]
    pub chunk: usize,
    #[command(flatten)]
    pub search: SearchArgs,
    #[command(flatten)]
    pub head: HeadArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SamplingArg {
    Top,
    Random,
}

/// `gradcache mine`: the options checked before the model loads, then [`mine_negatives`].
pub fn mine_command(args: MineArgs) -> Result<()> {
    let MineArgs {
        model,
        data,
        corpus,
        beir,
        split,
        output,
        num_negatives,
        range_min,
        range_max,
        max_score,
        min_score,
        absolute_margin,
        relative_margin,
        sampling,
        seed,
        output_scores,
        rescore_with,
        max_len,
        chunk,
        search,
        head,
    } = args;
    let output_scores = output_scores || rescore_with.is_some();
    let mine_options = gradcache::retrieval::MineOptions {
        num_negatives,
        range_min,
        range_max,
        max_score,
        min_score,
        absolute_margin,
        relative_margin,
        sampling: match sampling {
            SamplingArg::Top => gradcache::retrieval::Sampling::Top,
            SamplingArg::Random => gradcache::retrieval::Sampling::Random,
        },
        seed,
        output_scores,
    };
    mine_options.validate()?;
    if search.corpus_block == 0 || chunk == 0 {
        bail!("--corpus-block and --chunk must be at least 1");
    }
    let source = match (data, beir) {
        (_, Some(dir)) => MineSource::Beir { dir, split },
        (Some(data), None) => MineSource::Pairs { data, corpus },
        (None, None) => bail!("give --data or --beir"),
    };
    gradcache::durable::check_destination(&output)?;
    // The reranker is loaded (and a bad one refused) before the mining runs.
    let reranker = match &rescore_with {
        Some(name) => {
            let ce = gradcache::rerank::CrossEncoder::load(name, None, &head.device.open()?)?;
            tracing::info!("rescoring with {}", ce.settings());
            Some(ce)
        }
        None => None,
    };
    let model = load_retriever(&model, &head.load_options(max_len)?)?;
    mine_negatives(
        &*model,
        &source,
        &mine_options,
        (chunk, search.corpus_block),
        &search.title_separator,
        reranker.as_ref(),
        &output,
    )
}

/// Where a corpus evaluation writes.
pub struct EvalOutputs {
    /// The TREC run file.
    pub run_file: Option<PathBuf>,
    /// The JSON summary (the metrics are printed to standard output too).
    pub summary: Option<PathBuf>,
}

impl EvalOutputs {
    /// Each can be written ([`gradcache::durable::check_destination`]): asked before the
    /// model is loaded and the corpus encoded.
    pub fn check(&self) -> Result<()> {
        for path in self.run_file.iter().chain(&self.summary) {
            gradcache::durable::check_destination(path)?;
        }
        Ok(())
    }
}

/// Writes `text` to `path` whole or not at all (a temporary file in the same directory,
/// flushed and renamed when complete; a failed write leaves no partial file).
pub fn write_file(path: &Path, text: &str) -> Result<()> {
    Ok(gradcache::durable::write(path, text)?)
}

/// A line for the log.
pub fn describe_corpus(m: &CorpusMetrics) -> String {
    format!(
        "ndcg@10 {:.4}  mrr@10 {:.4}  recall@1 {:.4}  recall@10 {:.4}  recall@100 {:.4}  map@100 {:.4}  ({} queries)",
        m.ndcg_at_10, m.mrr_at_10, m.recall_at_1, m.recall_at_10, m.recall_at_100, m.map_at_100, m.queries
    )
}

/// `gradcache eval --beir DIR`: every judged query of `split` against the whole corpus.
pub fn eval_beir(
    model: &dyn Retriever,
    dir: &Path,
    split: &str,
    options: &CorpusEvalOptions,
    chunk: usize,
    outputs: &EvalOutputs,
) -> Result<()> {
    let set = BeirSet::load(dir, split)?;
    tracing::info!(
        "{}: {} queries judged in `{split}`, {} documents",
        dir.display(),
        set.queries.len(),
        set.corpus.len()
    );
    let start = std::time::Instant::now();
    let evaluation = evaluate_corpus(
        &set,
        model.scoring(),
        options,
        |texts| model.embed_queries(texts, chunk),
        |texts| model.embed_passages(texts, chunk),
    )?;
    let seconds = start.elapsed().as_secs_f64();
    tracing::info!(
        "encoded and searched in {seconds:.1} s ({:.0} documents/s)",
        set.corpus.len() as f64 / seconds.max(1e-9)
    );
    let m = &evaluation.metrics;
    let mut summary = serde_json::json!({
        "data": dir.display().to_string(),
        "split": split,
        "documents": set.corpus.len(),
        "top_k": options.search.top_k,
        "ignore_identical_ids": options.ignore_identical_ids,
        "similarity": model.scoring().sentence_transformers_name(),
        "prompts": model.prompts(),
        "metrics": m,
    });
    if let Some(sparsity) = &evaluation.sparsity {
        summary["sparsity"] = serde_json::to_value(sparsity)?;
    }
    if let Some(path) = &outputs.run_file {
        write_file(path, &trec_run(&evaluation.run, "gradcache"))?;
        tracing::info!("run file: {}", path.display());
    }
    if let Some(path) = &outputs.summary {
        write_file(path, &(serde_json::to_string_pretty(&summary)? + "\n"))?;
        tracing::info!("summary: {}", path.display());
    }
    println!("{}", serde_json::to_string(m)?);
    tracing::info!("{}", describe_corpus(m));
    if let Some(s) = &evaluation.sparsity {
        tracing::info!("{}", s.describe());
    }
    Ok(())
}

/// What `gradcache mine` reads.
pub enum MineSource {
    /// JSONL pairs (`query`, `positive`), optionally with more corpus documents.
    Pairs {
        data: PathBuf,
        corpus: Option<PathBuf>,
    },
    /// A BEIR folder's split.
    Beir { dir: PathBuf, split: String },
}

/// `gradcache mine`: writes JSONL training pairs with mined negatives to `output`.
pub fn mine_negatives(
    model: &dyn Retriever,
    source: &MineSource,
    options: &MineOptions,
    (chunk, corpus_block): (usize, usize),
    title_separator: &str,
    reranker: Option<&gradcache::rerank::CrossEncoder>,
    output: &Path,
) -> Result<()> {
    options.validate()?;
    let inputs: Vec<&Path> = match source {
        MineSource::Pairs { data, corpus } => std::iter::once(data.as_path())
            .chain(corpus.as_deref())
            .collect(),
        MineSource::Beir { dir, .. } => vec![dir.as_path()],
    };
    if inputs.iter().any(|i| same_file(i, output)) {
        bail!(
            "--output {} is an input; choose another file",
            output.display()
        );
    }
    let set = match source {
        MineSource::Pairs { data, corpus } => {
            let pairs = read_pairs(data, &Fields::default(), "train", " ")?;
            let extra = match corpus {
                Some(path) => read_corpus(path)?
                    .iter()
                    .map(|d| d.joined(title_separator))
                    .collect(),
                None => Vec::new(),
            };
            MiningSet::from_pairs(
                pairs
                    .iter()
                    .map(|p| (p.query.as_str(), p.positive.as_str())),
                extra,
            )
        }
        MineSource::Beir { dir, split } => {
            MiningSet::from_beir(&BeirSet::load(dir, split)?, title_separator)
        }
    };
    if set.queries.is_empty() {
        bail!("no query with a positive to mine for");
    }
    tracing::info!(
        "mining {} negatives for {} queries over {} documents",
        options.num_negatives,
        set.queries.len(),
        set.corpus.len()
    );
    let start = std::time::Instant::now();
    let query_refs: Vec<&str> = set.queries.iter().map(String::as_str).collect();
    let queries = model.embed_queries(&query_refs, chunk)?;
    let mined = mine(
        &queries,
        &set.positives,
        set.corpus.len(),
        model.scoring(),
        options,
        corpus_block,
        |range| {
            let texts: Vec<&str> = set.corpus[range].iter().map(String::as_str).collect();
            model.embed_passages(&texts, chunk)
        },
    )?;
    let mut rows = set.rows(&mined, options.output_scores);
    if rows.is_empty() {
        bail!(
            "no query kept {} negatives after the filters; loosen range_max, the margins or \
             the score limits (nothing written)",
            options.num_negatives
        );
    }
    if let Some(ce) = reranker {
        // Every row's positive and negatives as (query, document) pairs, scored at once.
        let (scores, pairs) = {
            let pairs: Vec<(&str, &str)> = rows
                .iter()
                .flat_map(|r| {
                    std::iter::once(r.positive.as_str())
                        .chain(r.negatives.iter().map(String::as_str))
                        .map(move |d| (r.query.as_str(), d))
                })
                .collect();
            (ce.predict(&pairs, 64)?, pairs.len())
        };
        let mut at = 0;
        for row in &mut rows {
            let n = 1 + row.negatives.len();
            row.scores = Some(scores[at..at + n].to_vec());
            at += n;
        }
        tracing::info!("{pairs} pairs rescored by the cross-encoder");
    }
    let mut text = String::new();
    for row in &rows {
        text += &serde_json::to_string(row)?;
        text.push('\n');
    }
    write_file(output, &text)?;
    let kept = mined.negatives.iter().filter(|n| n.is_some()).count();
    let d = mined.dropped;
    tracing::info!(
        "{} rows for {kept} of {} queries in {:.1} s to {} ({} queries had fewer than {} \
         negatives left; candidates dropped: {} positives, {} outside the rank range, {} \
         above max_score, {} below min_score, {} within the margin)",
        rows.len(),
        set.queries.len(),
        start.elapsed().as_secs_f64(),
        output.display(),
        set.queries.len() - kept,
        options.num_negatives,
        d.positives,
        d.rank,
        d.max_score,
        d.min_score,
        d.margin
    );
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
