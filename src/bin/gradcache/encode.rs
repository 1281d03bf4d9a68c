//! `gradcache encode`: texts to JSONL lines of embeddings (single vectors, sparse vectors
//! by token and index, or a multi-vector model's token vectors), with the encoding's
//! profile under `GRADCACHE_PROFILE=1`.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use gradcache::hub::LoadOptions;

use crate::{console, load_model, refuse_single_vector_options, TowerArg};

/// `encode` on a multi-vector (ColBERT) model: one JSONL line per text with its kept
/// token vectors in order, `{"text", "embeddings": [[...], ...]}`; documents unless
/// `--side query`. The model's own lengths, prefixes and normalisation are used: the
/// single-vector head options are refused.
fn encode_token_vectors(
    model: &str,
    texts: &[String],
    output: Option<&Path>,
    (side, batch): (Option<TowerArg>, usize),
    options: &LoadOptions,
) -> Result<()> {
    refuse_single_vector_options(model, options)?;
    let model = gradcache::hub::MultiVectorModel::load(model, &options.device)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    let matrices = match side {
        Some(TowerArg::Query) => model.query_vectors(&refs, batch)?,
        _ => model.document_vectors(&refs, batch)?,
    };
    tracing::info!(
        "encoded {} texts as token vectors in {:.2} s",
        texts.len(),
        start.elapsed().as_secs_f64()
    );
    let mut lines = String::new();
    for (text, m) in texts.iter().zip(matrices) {
        let embeddings = m.to_vec2::<f32>()?;
        lines += &format!(
            "{}\n",
            serde_json::json!({"text": text, "embeddings": embeddings})
        );
    }
    match output {
        Some(path) => gradcache::durable::write(path, lines)?,
        None => std::io::stdout().lock().write_all(lines.as_bytes())?,
    }
    Ok(())
}

/// With `GRADCACHE_PROFILE=1`: how much of an encoding's `secs` the CPU's matrix products
/// took, and at what speed (the chunks run side by side, one per thread, each product on
/// its chunk's thread alone).
fn log_encode_profile(secs: f64) {
    let entries = gradcache::profile::take();
    let threads = rayon::current_num_threads();
    if let Some(p) = entries
        .iter()
        .find(|e| e.name == gradcache::profile::CPU_PRODUCTS)
    {
        tracing::info!(
            "encode profile: the matrix products took {:.2} of {:.2} thread-seconds ({:.0}%; \
             {threads} threads for {secs:.2} s), {:.1} GFLOP in {} products at {:.1} GFLOP/s \
             per thread",
            p.total_ms / 1e3,
            secs * threads as f64,
            100.0 * p.total_ms / 1e3 / (secs * threads as f64),
            p.flops as f64 / 1e9,
            p.count,
            p.flops as f64 / (p.total_ms * 1e6).max(1e-9),
        );
    }
    tracing::info!("encode profile:\n{}", console::profile_table(&entries));
}

/// Texts per forward pass when `--batch-size` is not given: 16 on the CPU, 32 on a GPU.
/// On the CPU each thread encodes its own pass; a 16-text pass keeps its `[rows, width]`
/// rows in a core's L2 (`gradcache encode`, 4,000 texts, all-MiniLM-L6-v2's shape, 2
/// threads: AMD EPYC 0.991x the wall time of 32 and 332 against 357 MiB peak; Intel Xeon
/// 294.1 against 272.2 texts/s; docs/benchmarks.md).
pub(crate) fn default_batch(device: &candle_core::Device) -> usize {
    if device.is_cpu() {
        16
    } else {
        32
    }
}

pub(crate) fn encode(
    model: &str,
    mut texts: Vec<String>,
    input: Option<&Path>,
    output: Option<&Path>,
    (side, top_k, batch): (Option<TowerArg>, Option<usize>, Option<usize>),
    options: &LoadOptions,
) -> Result<()> {
    let batch = batch.unwrap_or_else(|| default_batch(&options.device));
    if batch == 0 {
        bail!("--batch-size 0 runs no text: give at least 1 (texts per forward pass)");
    }
    if let Some(path) = output {
        gradcache::durable::check_destination(path)?;
    }
    if let Some(path) = input {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line.with_context(|| {
                format!(
                    "{}:{}: cannot read the line (not UTF-8 text?)",
                    path.display(),
                    i + 1
                )
            })?;
            // A blank line is an empty text (embedded as its special tokens alone, as
            // sentence-transformers does): line i of the input is line i of the output.
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
    if top_k == Some(0) {
        bail!("--top-k 0 keeps nothing: give at least 1 (the largest entries of each sparse vector kept)");
    }
    if gradcache::hub::multi_vector::is_multi_vector_model(model) {
        return encode_token_vectors(model, &texts, output, (side, batch), options);
    }
    let model = load_model(model, options)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    let embeddings = match side {
        None => model.embed(&refs, batch)?,
        Some(TowerArg::Query) => model.embed_queries(&refs, batch)?,
        Some(TowerArg::Passage) => model.embed_passages(&refs, batch)?,
    }
    .to_vec2::<f32>()?;
    let secs = start.elapsed().as_secs_f64();
    tracing::info!(
        "encoded {} texts, {batch} per pass, in {secs:.2} s ({:.1} texts/s)",
        texts.len(),
        texts.len() as f64 / secs.max(1e-9)
    );
    if gradcache::profile::enabled() {
        log_encode_profile(secs);
    }
    let mut lines = String::new();
    for (text, e) in texts.iter().zip(embeddings) {
        let line = if model.is_sparse() {
            // A sparse model's vector: its active entries by token and as an inverted
            // index's (indices, values).
            let v = gradcache::hub::sparse::SparseVector::from_dense(&e, top_k)?;
            serde_json::json!({
                "text": text,
                "sparse": v.tokens(model.tokenizer()),
                "indices": v.indices,
                "values": v.values,
            })
        } else {
            serde_json::json!({"text": text, "embedding": e})
        };
        lines += &format!("{line}\n");
    }
    match output {
        Some(path) => gradcache::durable::write(path, lines)?,
        None => std::io::stdout().lock().write_all(lines.as_bytes())?,
    }
    Ok(())
}
