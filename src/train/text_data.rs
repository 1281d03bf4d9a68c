//! The data of a text-pair run: its training pairs (in memory, or streamed from disk with
//! `data.stream`), what it evaluates on (held-out pairs or a BEIR corpus), and the check
//! that every rank of a distributed run reads the same data with the same configuration.

use std::path::{Path, PathBuf};

use crate::dist::{self, Collective};
use crate::retrieval::BeirSet;
use crate::train::config::Config;
use crate::train::config::{Batches, Sampling, SamplingName};
use crate::train::data::Pair;
use crate::train::formats::{read_pairs, Layout};
use crate::train::mixture::{read_source, Mixture, SourceData};
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

/// One evaluation set of a run.
pub(super) struct Evaluation {
    /// Its name (`[[data.evals]]`), or `None` for the one set of `data.eval_file` or the
    /// held-out pairs.
    pub(super) name: Option<String>,
    /// Its queries and what they are scored against.
    pub(super) data: EvalData,
    /// The prompt before its queries, over the model's.
    pub(super) query_prompt: Option<String>,
}

/// The training data of a run.
pub(super) struct RunData {
    pub(super) mixture: Mixture,
    pub(super) evals: Vec<Evaluation>,
    /// The training split's texts, query then positive of each pair (what a fresh
    /// tokenizer learns from and the memory budget samples lengths from; empty when
    /// neither needs them).
    pub(super) texts: Vec<String>,
}

/// Reads the training and evaluation data (every rank; a failure anywhere stops all),
/// checks that all ranks run the same configuration on the same data, and builds the
/// batches.
pub(super) fn load_data(
    cfg: &Config,
    comm: &dyn Collective,
    notes: &mut Vec<String>,
) -> Result<RunData> {
    let (sources, evals) = dist::agree(comm, load_sources(cfg))?;
    let several = sources.len() > 1;
    for s in &sources {
        if s.source.stream {
            notes.push(format!(
                "streaming {} training pairs from {} (an index of {} MiB; pairs are read when \
                 served)",
                s.pairs.len(),
                s.label(several),
                (s.pairs.len() * 12) >> 20
            ));
        }
    }
    check_same_run(comm, cfg, &sources, &evals)?;
    let batch = cfg.train.batch_size;
    let mixed = several && cfg.batches() == Batches::Mixed;
    for s in sources.iter().filter(|_| !mixed) {
        let n = s.pairs.len();
        if !n.is_multiple_of(batch) {
            notes.push(format!(
                "{n} training pairs{} make {} batches of {batch} per epoch; the last {} pairs \
                 of each (shuffled) epoch are dropped",
                if several {
                    format!(" of source {:?}", s.source.name)
                } else {
                    String::new()
                },
                n / batch,
                n % batch
            ));
        }
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
    // the memory budget samples text lengths from it. A streamed source lends an even
    // sample of at most TEXT_SAMPLE pairs.
    let mut texts: Vec<String> = Vec::new();
    if cfg.model.pretrained.is_empty() || cfg.train.memory_budget.is_some() {
        for s in &sources {
            let n = s.pairs.len();
            let every = if s.source.stream {
                n.div_ceil(TEXT_SAMPLE).max(1)
            } else {
                1
            };
            for i in (0..n).step_by(every) {
                let p = s.pairs.pair(i)?;
                texts.push(p.query);
                texts.push(p.positive);
            }
        }
    }
    let mixture = Mixture::new(cfg, sources)?;
    if several {
        notes.push(mixture_note(cfg, &mixture));
    }
    Ok(RunData {
        mixture,
        evals,
        texts,
    })
}

/// `3 sources, a step's batch from one (proportional): web 62.5%, nli 25.0%, ...`.
fn mixture_note(cfg: &Config, mixture: &Mixture) -> String {
    let p = mixture.picker().probabilities();
    let shares: Vec<String> = mixture
        .sources()
        .iter()
        .zip(&p)
        .map(|(s, p)| {
            format!("{} {} pairs", s.source.name, s.pairs.len())
                + &if mixture.is_mixed() {
                    String::new()
                } else {
                    format!(" ({:.1}% of steps)", p * 100.0)
                }
        })
        .collect();
    let how = if mixture.is_mixed() {
        "their pairs shuffled together".to_string()
    } else {
        let sampling = match cfg.data.sampling {
            None | Some(Sampling::Named(SamplingName::Proportional)) => "by size".to_string(),
            Some(Sampling::Named(SamplingName::RoundRobin)) => "in turn".into(),
            Some(Sampling::Named(SamplingName::Weighted)) => "by weight".into(),
            Some(Sampling::Tempered { temperature }) => format!("by size^(1/{temperature})"),
        };
        format!("a step's batch from one, drawn {sampling}")
    };
    format!(
        "{} sources, {how}: {}",
        mixture.sources().len(),
        shares.join(", ")
    )
}

/// With `data.stream`: the pairs a fresh tokenizer and the memory budget sample at most.
const TEXT_SAMPLE: usize = 200_000;

/// Every source's pairs and the evaluation sets of a run.
fn load_sources(cfg: &Config) -> Result<(Vec<SourceData>, Vec<Evaluation>)> {
    let d = &cfg.data;
    let eval = |path: &Path, split: &str| -> Result<EvalData> {
        Ok(if Layout::of(path) == Layout::Beir {
            EvalData::Corpus(BeirSet::load(path, split)?)
        } else {
            EvalData::Pairs(read_pairs(path, &d.fields, split, &d.title_separator)?)
        })
    };
    let mut evals: Vec<Evaluation> = Vec::new();
    if let Some(path) = &d.eval_file {
        evals.push(Evaluation {
            name: None,
            data: eval(path, &d.eval_split)?,
            query_prompt: None,
        });
    }
    for e in &d.evals {
        evals.push(Evaluation {
            name: Some(e.name.clone()),
            data: eval(&e.path, e.split.as_deref().unwrap_or(&d.eval_split))?,
            query_prompt: e.query_prompt.clone(),
        });
    }
    // Without an evaluation set, the one source's pairs less `eval_pairs` held out.
    let hold_out = if evals.is_empty() { d.eval_pairs } else { 0 };
    let mut sources = Vec::new();
    for source in cfg.sources() {
        if source.stream && evals.is_empty() {
            return Err(Error::InvalidConfig {
                field: "data.stream",
                value: "true".into(),
                reason: "a streamed training file is not held out of: set data.eval_file",
            });
        }
        let local = crate::train::hub_data::local_path(&source.path)?;
        let (data, held) = read_source(cfg, &source, &local, hold_out)?;
        sources.push(data);
        if hold_out > 0 {
            evals.push(Evaluation {
                name: None,
                data: EvalData::Pairs(held),
                query_prompt: None,
            });
        }
    }
    Ok((sources, evals))
}

/// Checks that every rank runs the same configuration on the same data. Data paths may
/// differ between ranks (per-node copies); the data itself may not.
fn check_same_run(
    comm: &dyn Collective,
    cfg: &Config,
    sources: &[SourceData],
    evals: &[Evaluation],
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut shaping = cfg.clone();
    shaping.data.train_file = None;
    shaping.data.eval_file = None;
    for source in &mut shaping.data.sources {
        source.path = String::new();
    }
    for set in &mut shaping.data.evals {
        set.path = PathBuf::new();
    }
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
    let mut pairs = 0;
    for s in sources {
        let train = &s.pairs;
        pairs += train.len();
        for i in 0..train.len() {
            let p = train.pair(i)?;
            for text in [&p.query, &p.positive]
                .into_iter()
                .chain(&p.negatives)
                .chain(&p.prompt)
            {
                hash = hash.rotate_left(5) ^ crate::rng::hash_str(text);
            }
            for score in &p.scores {
                hash = hash.rotate_left(5) ^ u64::from(score.to_bits());
            }
        }
    }
    let mut held = 0;
    for e in evals {
        held += e.data.len();
        for text in e.data.texts() {
            hash = hash.rotate_left(5) ^ crate::rng::hash_str(text);
        }
    }
    let print = format!("{pairs} training pairs, {held} held out, hash {hash:016x}");
    dist::ensure_same(comm, "the data", print.as_bytes(), |b| {
        String::from_utf8_lossy(b).into_owned()
    })
}

fn json_of(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or(serde_json::Value::Null)
}
