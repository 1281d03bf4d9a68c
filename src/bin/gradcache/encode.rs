//! `gradcache encode`: texts to JSONL lines of embeddings (single vectors, sparse vectors
//! by token and index, or a multi-vector model's token vectors), with the encoding's
//! profile under `GRADCACHE_PROFILE=1`.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use gradcache::hub::LoadOptions;
use gradcache::Chunking;

use crate::{console, load_model, refuse_single_vector_options, TowerArg};

/// Texts encoded and written at a time: whole blocks of the encoding
/// ([`gradcache::hub::block_texts`], tokenized and sorted by length together), so each
/// text embeds as within one call over all the texts, while what is held is one such
/// group's embeddings and lines however long the input (before, every line until the end:
/// 12 KB a text with all-MiniLM-L6-v2, about 12 GB for a million texts).
fn texts_per_write(passes: Chunking) -> usize {
    gradcache::hub::block_texts(passes) * 8
}

/// Runs `write` on the output as its lines come: a file appears whole or not at all (the
/// lines go to a temporary beside it, renamed when complete; a failure leaves whatever was
/// there), standard output takes them as they are written.
fn with_output(
    output: Option<&Path>,
    write: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    match output {
        Some(path) => gradcache::durable::write_with(path, |tmp| -> Result<()> {
            let file =
                File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
            let mut lines = BufWriter::new(file);
            write(&mut lines)?;
            lines
                .flush()
                .with_context(|| format!("cannot write {}", path.display()))
        }),
        None => {
            let mut lines = BufWriter::new(std::io::stdout().lock());
            write(&mut lines)?;
            Ok(lines.flush()?)
        }
    }
}

/// One JSON line.
fn write_line(out: &mut dyn Write, value: &serde_json::Value) -> Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    Ok(out.write_all(b"\n")?)
}

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
    let mut secs = 0.0;
    with_output(output, |out| {
        for group in texts.chunks(texts_per_write(Chunking::Rows(batch))) {
            let refs: Vec<&str> = group.iter().map(String::as_str).collect();
            let start = std::time::Instant::now();
            let matrices = match side {
                Some(TowerArg::Query) => model.query_vectors(&refs, batch)?,
                _ => model.document_vectors(&refs, batch)?,
            };
            let matrices = matrices
                .iter()
                .map(|m| m.to_vec2::<f32>())
                .collect::<candle_core::Result<Vec<_>>>()?;
            secs += start.elapsed().as_secs_f64();
            for (text, embeddings) in group.iter().zip(matrices) {
                write_line(
                    out,
                    &serde_json::json!({"text": text, "embeddings": embeddings}),
                )?;
            }
        }
        Ok(())
    })?;
    tracing::info!(
        "encoded {} texts as token vectors in {secs:.2} s",
        texts.len()
    );
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

/// Texts per forward pass of a multi-vector model when `--batch-size` is not given: 16 on
/// the CPU, 32 on a GPU.
fn default_batch(device: &candle_core::Device) -> usize {
    if device.is_cpu() {
        16
    } else {
        32
    }
}

/// Tokens per forward pass of a CPU encoding when `--batch-size` is not given (texts
/// times their padded length; a longer text is a pass alone). Each thread encodes its own
/// pass: too few rows and the weights are streamed through again for little work, too many
/// and the pass's `[rows, 4 x width]` feed-forward buffer leaves the core's caches. A fixed
/// number of texts errs one way with short texts and the other with long ones; a budget of
/// tokens keeps every pass near the middle. `gradcache encode` with all-MiniLM-L6-v2 on 2
/// threads of an AMD EPYC (family 26), the mean of 3 alternating runs, this budget against
/// 16 texts per pass: texts of 37 tokens 0.996x the speed (559.1 against 561.6 texts/s),
/// of about 8 tokens 1.019x, of 75 tokens 1.019x, of 150 tokens 1.048x (and 303 against 418
/// MiB peak); the same embeddings within the products' rounding (docs/benchmarks.md).
pub(crate) const CPU_PASS_TOKENS: usize = 512;

/// The forward passes of a single-vector or sparse encoding: `--batch-size` texts each if
/// given, else passes of up to [`CPU_PASS_TOKENS`] tokens on the CPU and 32 texts on a
/// GPU (where one pass runs at a time, and larger ones fill the device).
fn passes(batch: Option<usize>, device: &candle_core::Device) -> Chunking {
    match batch {
        Some(texts) => Chunking::Rows(texts),
        None if device.is_cpu() => Chunking::Tokens(CPU_PASS_TOKENS),
        None => Chunking::Rows(default_batch(device)),
    }
}

/// How a log line names `passes`.
fn describe(passes: Chunking) -> String {
    match passes {
        Chunking::Rows(texts) => format!("{texts} per pass"),
        Chunking::Tokens(tokens) => format!("passes of up to {tokens} tokens"),
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
    if batch == Some(0) {
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
        let batch = batch.unwrap_or_else(|| default_batch(&options.device));
        return encode_token_vectors(model, &texts, output, (side, batch), options);
    }
    let passes = passes(batch, &options.device);
    let model = load_model(model, options)?;
    let mut secs = 0.0;
    with_output(output, |out| {
        for group in texts.chunks(texts_per_write(passes)) {
            let refs: Vec<&str> = group.iter().map(String::as_str).collect();
            let start = std::time::Instant::now();
            let embeddings = match side {
                None => model.embed(&refs, passes)?,
                Some(TowerArg::Query) => model.embed_queries(&refs, passes)?,
                Some(TowerArg::Passage) => model.embed_passages(&refs, passes)?,
            }
            .to_vec2::<f32>()?;
            secs += start.elapsed().as_secs_f64();
            for (text, e) in group.iter().zip(embeddings) {
                let line = if model.is_sparse() {
                    // A sparse model's vector: its active entries by token and as an
                    // inverted index's (indices, values).
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
                write_line(out, &line)?;
            }
        }
        Ok(())
    })?;
    tracing::info!(
        "encoded {} texts, {}, in {secs:.2} s ({:.1} texts/s)",
        texts.len(),
        describe(passes),
        texts.len() as f64 / secs.max(1e-9)
    );
    if gradcache::profile::enabled() {
        log_encode_profile(secs);
    }
    Ok(())
}
