//! The data of a text-pair run: its training pairs (in memory, or streamed from disk with
//! `data.stream`), what it evaluates on (held-out pairs or a BEIR corpus), and the check
//! that every rank of a distributed run reads the same data with the same configuration.

use std::path::{Path, PathBuf};

use crate::dist::{self, Collective};
use crate::retrieval::BeirSet;
use crate::train::config::Config;
use crate::train::data::{split, Loader, NumberedPairs, Pair, PairSource};
use crate::train::formats::{read_numbered, read_pairs, Layout};
use crate::train::stream::JsonlIndex;
use crate::{Error, Result};

/// What a run evaluates on.
pub(super) enum EvalData {
    /// Held-out pairs: each query against every held-out positive.
    Pairs(Vec<Pair>),
    /// A BEIR split: each judged query against the whole corpus (exact top-100).
    Corpus(BeirSet),
}

impl EvalData {
    /// Queries evaluated.
    pub(super) fn len(&self) -> usize {
        match self {
            EvalData::Pairs(p) => p.len(),
            EvalData::Corpus(set) => set.queries.len(),
        }
    }

    /// Every text, for comparing ranks' data.
    fn texts(&self) -> Vec<&str> {
        match self {
            EvalData::Pairs(pairs) => pairs
                .iter()
                .flat_map(|p| {
                    [p.query.as_str(), p.positive.as_str()]
                        .into_iter()
                        .chain(p.negatives.iter().map(String::as_str))
                })
                .collect(),
            EvalData::Corpus(set) => set
                .queries
                .iter()
                .map(|q| q.text.as_str())
                .chain(
                    set.corpus
                        .iter()
                        .flat_map(|d| [d.title.as_str(), d.text.as_str()]),
                )
                .collect(),
        }
    }
}

/// The training data of a run.
pub(super) struct RunData {
    pub(super) loader: Loader,
    pub(super) eval: EvalData,
    /// The training split's texts, query then positive of each pair (what a fresh
    /// tokenizer learns from and the memory budget samples lengths from; empty when
    /// neither needs them).
    pub(super) texts: Vec<String>,
}

/// Reads the training and held-out pairs (every rank; a failure anywhere stops all),
/// checks that all ranks run the same configuration on the same data, and builds the
/// loader.
pub(super) fn load_data(
    cfg: &Config,
    comm: &dyn Collective,
    notes: &mut Vec<String>,
) -> Result<RunData> {
    let (train, eval) = dist::agree(comm, load_pairs(cfg))?;
    let distill = cfg.loss.distillation.is_some();
    let source: Box<dyn PairSource> = match train {
        Training::InMemory(pairs) => {
            if distill {
                // Every pair gives its teacher scores, checked before the run starts (a
                // streamed pair is checked when it is served).
                let file = &cfg.data.train_file;
                for (pair, &line) in pairs.pairs.iter().zip(&pairs.lines) {
                    pair.teacher_scores(cfg.train.hard_negatives)
                        .map_err(|reason| Error::data(file, line, reason))?;
                }
            }
            Box::new(pairs)
        }
        Training::Streamed(index) => {
            notes.push(format!(
                "streaming {} training pairs from {} (an index of {} MiB; pairs are read when \
                 served)",
                index.len(),
                cfg.data.train_file.display(),
                (index.len() * 12) >> 20
            ));
            Box::new(index)
        }
    };
    check_same_run(comm, cfg, source.as_ref(), &eval)?;
    let batch = cfg.train.batch_size;
    let n = source.len();
    if !n.is_multiple_of(batch) {
        notes.push(format!(
            "{n} training pairs make {} batches of {batch} per epoch; the last {} pairs of each \
             (shuffled) epoch are dropped",
            n / batch,
            n % batch
        ));
    }
    let world = comm.world_size();
    if world > 1 {
        notes.push(format!(
            "{world} ranks ({} backend): {} pairs per rank, loss over the global batch of {batch}",
            comm.backend(),
            batch / world,
        ));
    }
    // A fresh tokenizer learns from the training split only (never the held-out pairs);
    // the memory budget samples text lengths from it. A streamed file lends an even sample
    // of at most TEXT_SAMPLE pairs.
    let texts: Vec<String> = if cfg.model.pretrained.is_empty() || cfg.train.memory_budget.is_some()
    {
        let every = if cfg.data.stream {
            n.div_ceil(TEXT_SAMPLE).max(1)
        } else {
            1
        };
        let mut texts = Vec::new();
        for i in (0..n).step_by(every) {
            let p = source.pair(i)?;
            texts.push(p.query);
            texts.push(p.positive);
        }
        texts
    } else {
        Vec::new()
    };
    let mut loader = Loader::from_source(source, batch, cfg.train.hard_negatives, cfg.seed)?
        .with_no_duplicates(cfg.train.no_duplicates)?;
    if distill {
        loader = loader.with_teacher_scores(&cfg.data.train_file);
    }
    Ok(RunData {
        loader,
        eval,
        texts,
    })
}

/// With `data.stream`: the pairs a fresh tokenizer and the memory budget sample at most.
const TEXT_SAMPLE: usize = 200_000;

/// The training pairs of a run: in memory, or indexed on disk (`data.stream`).
enum Training {
    InMemory(NumberedPairs),
    Streamed(JsonlIndex),
}

/// The training and held-out pairs of a run.
fn load_pairs(cfg: &Config) -> Result<(Training, EvalData)> {
    let d = &cfg.data;
    let eval = |path: &Path| -> Result<EvalData> {
        Ok(if Layout::of(path) == Layout::Beir {
            EvalData::Corpus(BeirSet::load(path, &d.eval_split)?)
        } else {
            EvalData::Pairs(read_pairs(
                path,
                &d.fields,
                &d.eval_split,
                &d.title_separator,
            )?)
        })
    };
    if d.stream {
        let Some(path) = &d.eval_file else {
            return Err(Error::InvalidConfig {
                field: "data.stream",
                value: "true".into(),
                reason: "a streamed training file is not held out of: set data.eval_file",
            });
        };
        if Layout::of(&d.train_file) != Layout::JsonLines {
            return Err(Error::InvalidConfig {
                field: "data.stream",
                value: d.train_file.display().to_string(),
                reason: "streams JSON lines only (ours, Tevatron's); read other layouts into \
                         memory (data.stream = false)",
            });
        }
        let index = JsonlIndex::build(&d.train_file, &d.fields, &d.title_separator)?;
        return Ok((Training::Streamed(index), eval(path)?));
    }
    let layout = Layout::of(&d.train_file);
    let numbered = read_numbered(
        &d.train_file,
        layout,
        &d.fields,
        &d.train_split,
        &d.title_separator,
    )?;
    match &d.eval_file {
        Some(path) => Ok((Training::InMemory(numbered), eval(path)?)),
        None => {
            let items: Vec<(Pair, usize)> =
                numbered.pairs.into_iter().zip(numbered.lines).collect();
            let (train, held) = split(items, d.eval_pairs, cfg.seed)?;
            let (pairs, lines) = train.into_iter().unzip();
            let held = held.into_iter().map(|(p, _)| p).collect();
            Ok((
                Training::InMemory(NumberedPairs { pairs, lines }),
                EvalData::Pairs(held),
            ))
        }
    }
}

/// Checks that every rank runs the same configuration on the same data. Data paths may
/// differ between ranks (per-node copies); the data itself may not.
fn check_same_run(
    comm: &dyn Collective,
    cfg: &Config,
    train: &dyn PairSource,
    eval: &EvalData,
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut shaping = cfg.clone();
    shaping.data.train_file = PathBuf::new();
    shaping.data.eval_file = None;
    let json = dist::agree(comm, shaping.to_json())?;
    let all = comm.all_gather_bytes(json.to_string().as_bytes())?;
    let differing: Vec<String> = (1..all.len())
        .filter(|&r| all[r] != all[0])
        .map(|r| {
            let keys = crate::train::config::differing_keys(&json_of(&all[0]), &json_of(&all[r]));
            format!("rank {r} differs from rank 0 in {}", keys.join(", "))
        })
        .collect();
    if !differing.is_empty() {
        return Err(Error::RankMismatch {
            what: "the config".into(),
            detail: differing.join("; "),
        });
    }
    let mut hash = crate::rng::hash_str("");
    for i in 0..train.len() {
        let p = train.pair(i)?;
        for text in [&p.query, &p.positive].into_iter().chain(&p.negatives) {
            hash = hash.rotate_left(5) ^ crate::rng::hash_str(text);
        }
        for score in &p.scores {
            hash = hash.rotate_left(5) ^ u64::from(score.to_bits());
        }
    }
    for text in eval.texts() {
        hash = hash.rotate_left(5) ^ crate::rng::hash_str(text);
    }
    let print = format!(
        "{} training pairs, {} held out, hash {hash:016x}",
        train.len(),
        eval.len()
    );
    dist::ensure_same(comm, "the data", print.as_bytes(), |b| {
        String::from_utf8_lossy(b).into_owned()
    })
}

fn json_of(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or(serde_json::Value::Null)
}
