//! The training batches of a run over its sources ([`crate::train::sources`]): each
//! source's pairs (in memory, streamed, from shards), each with its own seeded loader that
//! shuffles by its own epochs, and the [`SourcePicker`] that chooses the source of each
//! step. Which source a step draws is a pure function of the seed and the step, and each
//! source's place is the number of batches it has served, so a resume at step `n`
//! recounts the first `n` draws and continues exactly (on every rank alike).
//!
//! Under `data.batches = "mixed"` the sources' pairs are shuffled together into one
//! loader, each row carrying its source's query prompt.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::train::config::{Batches, Config};
use crate::train::data::{split, Loader, NumberedPairs, Pair, PairSource, Position, TextBatch};
use crate::train::formats::{read_numbered, Layout};
use crate::train::sources::{Source, SourcePicker};
use crate::train::stream::JsonlIndex;
use crate::{Error, Result};

/// One source's pairs as a run serves them.
pub(super) struct SourceData {
    /// Its settings.
    pub(super) source: Source,
    /// The files its pairs were read from (one, or its shards in order).
    pub(super) files: Vec<PathBuf>,
    /// Its pairs, or (streamed) an index of them.
    pub(super) pairs: Rc<dyn PairSource>,
}

impl SourceData {
    /// What error messages call the source: its path, and its name in a mixture.
    pub(super) fn label(&self, mixture: bool) -> String {
        if mixture {
            format!("{} (source {:?})", self.source.path, self.source.name)
        } else {
            self.source.path.clone()
        }
    }
}

/// Pairs of several sources one after another: a source's shards, or under
/// `data.batches = "mixed"` every source's pairs, each part's rows without a prompt of
/// their own given that part's (its source's query prompt). Nothing is copied: each pair
/// is read from its part when served.
pub(super) struct Shards {
    parts: Vec<(Rc<dyn PairSource>, Option<String>)>,
    starts: Vec<usize>,
    len: usize,
}

impl Shards {
    /// `parts` in order, each with the prompt its rows take when they have none.
    pub(super) fn new(parts: Vec<(Rc<dyn PairSource>, Option<String>)>) -> Self {
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for (p, _) in &parts {
            starts.push(len);
            len += p.len();
        }
        Self { parts, starts, len }
    }

    fn locate(&self, i: usize) -> (usize, usize) {
        let part = self.starts.partition_point(|&s| s <= i) - 1;
        (part, i - self.starts[part])
    }
}

impl PairSource for Shards {
    fn len(&self) -> usize {
        self.len
    }

    fn pair(&self, i: usize) -> Result<Pair> {
        let (part, j) = self.locate(i);
        let (pairs, prompt) = &self.parts[part];
        let mut pair = pairs.pair(j)?;
        if pair.prompt.is_none() {
            pair.prompt.clone_from(prompt);
        }
        Ok(pair)
    }

    fn origin(&self, i: usize) -> usize {
        let (part, j) = self.locate(i);
        self.parts[part].0.origin(j)
    }
}

/// The files of a local source path: a file; a BEIR folder (it has `qrels/`); a folder of
/// shards (its data files in name order); or a glob over file names (`dir/*.jsonl`).
pub(super) fn source_files(path: &Path) -> Result<Vec<PathBuf>> {
    let text = path.to_string_lossy();
    if text.contains('*') || text.contains('?') {
        let mut files: Vec<PathBuf> = glob::glob(&text)
            .map_err(|e| Error::data(path, 0, format!("not a valid glob ({e})")))?
            .filter_map(std::result::Result::ok)
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::data(path, 0, "the glob matches no file"));
        }
        return Ok(files);
    }
    if path.is_dir() && !path.join("qrels").is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::io("read", path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && Layout::of_name(p).is_some())
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::data(
                path,
                0,
                "the folder holds no data file (.jsonl, .json, .tsv, .csv, .parquet, plain or \
                 .gz/.zst) and is not a BEIR folder (no qrels/)",
            ));
        }
        return Ok(files);
    }
    if !path.exists() {
        return Err(Error::MissingFile {
            path: path.to_path_buf(),
            what: "data file",
        });
    }
    Ok(vec![path.to_path_buf()])
}

/// Reads one source (every rank; the caller agrees on the outcome): its files in memory,
/// or with `stream` an index of each. With `hold_out` pairs to hold out for evaluation (the
/// one source of a run without an evaluation set: in memory), those pairs, chosen by a
/// seeded shuffle, are returned apart and kept out of the source.
pub(super) fn read_source(
    cfg: &Config,
    source: &Source,
    local: &Path,
    hold_out: usize,
) -> Result<(SourceData, Vec<Pair>)> {
    let files = source_files(local)?;
    let separator = &cfg.data.title_separator;
    let mut parts: Vec<Box<dyn PairSource>> = Vec::with_capacity(files.len());
    let mut numbered_parts: Vec<NumberedPairs> = Vec::new();
    for file in &files {
        if source.stream {
            if Layout::of(file) != Layout::JsonLines {
                return Err(Error::InvalidConfig {
                    field: "data.stream",
                    value: file.display().to_string(),
                    reason: "streams JSON lines only (ours, Tevatron's); read other layouts \
                             into memory (data.stream = false)",
                });
            }
            parts.push(Box::new(JsonlIndex::build(
                file,
                &source.fields,
                separator,
            )?));
        } else {
            let numbered = read_numbered(
                file,
                Layout::of(file),
                &source.fields,
                &source.split,
                separator,
            )?;
            if source.distill {
                // Every pair gives its teacher scores, checked before the run starts (a
                // streamed pair is checked when it is served).
                for (pair, &line) in numbered.pairs.iter().zip(&numbered.lines) {
                    pair.teacher_scores(source.hard_negatives)
                        .map_err(|reason| Error::data(file, line, reason))?;
                }
            }
            numbered_parts.push(numbered);
        }
    }
    let mut held = Vec::new();
    if hold_out > 0 {
        // One list of the files' pairs (in order), split without copying a text.
        let mut all = NumberedPairs {
            pairs: Vec::new(),
            lines: Vec::new(),
        };
        for part in numbered_parts.drain(..) {
            all.pairs.extend(part.pairs);
            all.lines.extend(part.lines);
        }
        let items: Vec<(Pair, usize)> = all.pairs.into_iter().zip(all.lines).collect();
        let (train, out) = split(items, hold_out, cfg.seed)?;
        let (pairs, lines) = train.into_iter().unzip();
        held = out.into_iter().map(|(p, _)| p).collect();
        numbered_parts.push(NumberedPairs { pairs, lines });
    }
    parts.extend(
        numbered_parts
            .into_iter()
            .map(|p| Box::new(p) as Box<dyn PairSource>),
    );
    let pairs: Rc<dyn PairSource> = match parts.len() {
        1 => Rc::from(parts.pop().expect("one part")),
        _ => Rc::new(Shards::new(
            parts.into_iter().map(|p| (Rc::from(p), None)).collect(),
        )),
    };
    let data = SourceData {
        source: source.clone(),
        files,
        pairs,
    };
    Ok((data, held))
}

/// Steps and pairs a source has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    /// Steps drawn from it.
    pub steps: u64,
    /// Pairs served (its steps times the global batch).
    pub pairs: u64,
}

/// A run's batches over its sources.
pub(super) struct Mixture {
    sources: Vec<SourceData>,
    loaders: Vec<Loader>,
    picker: SourcePicker,
    batch_size: usize,
    served: Vec<Served>,
    /// `mixed`: one loader over every source's pairs.
    mixed: bool,
}

impl Mixture {
    /// Loaders over `sources` (seeded per source when there are several) and the picker
    /// of `data.sampling`.
    pub(super) fn new(cfg: &Config, sources: Vec<SourceData>) -> Result<Self> {
        let batch = cfg.train.batch_size;
        let several = sources.len() > 1;
        if several && cfg.batches() == Batches::Mixed {
            return Self::mixed(cfg, sources);
        }
        let mut loaders = Vec::with_capacity(sources.len());
        for s in &sources {
            let seed = if several {
                crate::rng::derive_seed(&[cfg.seed, crate::rng::hash_str(&s.source.name)])
            } else {
                cfg.seed
            };
            let pairs = s.pairs.len();
            if several && pairs < batch {
                return Err(Error::InvalidConfig {
                    field: "train.batch_size",
                    value: format!("{batch} (source {:?} holds {pairs} pairs)", s.source.name),
                    reason: "a step's global batch comes from one source: every source must \
                             hold at least one batch of pairs (lower the batch size, or draw \
                             batches mixed)",
                });
            }
            let mut loader = Loader::from_source(
                Box::new(Shared(s.pairs.clone())),
                batch,
                s.source.hard_negatives,
                seed,
            )?
            .with_no_duplicates(cfg.train.no_duplicates)?;
            if s.source.distill {
                loader = loader.with_teacher_scores(&s.files[0]);
            }
            loaders.push(loader);
        }
        let sizes: Vec<usize> = sources.iter().map(|s| s.pairs.len()).collect();
        let weights: Vec<f64> = sources.iter().map(|s| s.source.weight).collect();
        let picker = SourcePicker::new(cfg.data.sampling, &sizes, &weights, cfg.seed);
        Ok(Self {
            served: vec![Served::default(); sources.len()],
            sources,
            loaders,
            picker,
            batch_size: batch,
            mixed: false,
        })
    }

    /// One loader over every source's pairs, each pair without its own prompt given its
    /// source's query prompt (read from the sources when served, not copied).
    fn mixed(cfg: &Config, sources: Vec<SourceData>) -> Result<Self> {
        let all = Shards::new(
            sources
                .iter()
                .map(|s| (Rc::clone(&s.pairs), s.source.query_prompt.clone()))
                .collect(),
        );
        let first = &sources[0].source;
        let mut loader = Loader::from_source(
            Box::new(all),
            cfg.train.batch_size,
            first.hard_negatives,
            cfg.seed,
        )?
        .with_no_duplicates(cfg.train.no_duplicates)?;
        if first.distill {
            loader = loader.with_teacher_scores(&sources[0].files[0]);
        }
        Ok(Self {
            served: vec![Served::default(); 1],
            sources,
            loaders: vec![loader],
            picker: SourcePicker::RoundRobin(1),
            batch_size: cfg.train.batch_size,
            mixed: true,
        })
    }

    /// The sources.
    pub(super) fn sources(&self) -> &[SourceData] {
        &self.sources
    }

    /// Whether the run draws from several sources per step (`mixed`).
    pub(super) fn is_mixed(&self) -> bool {
        self.mixed
    }

    /// The picker (which source each step draws).
    pub(super) fn picker(&self) -> &SourcePicker {
        &self.picker
    }

    /// The source index step `step` draws from.
    pub(super) fn source_of(&self, step: u64) -> usize {
        self.picker.pick(step)
    }

    /// The batch of step `step` (0-based): the next of its source's loader.
    pub(super) fn next_batch(&mut self, step: u64) -> Result<TextBatch> {
        let s = self.source_of(step);
        let mut batch = self.loaders[s].next_batch()?;
        batch.source = s;
        self.served[s].steps += 1;
        self.served[s].pairs += self.batch_size as u64;
        Ok(batch)
    }

    /// Where the data stands after `step` steps: the one loader's position (a mixture's
    /// positions follow from the step, see [`Mixture::seek`]).
    pub(super) fn position(&self) -> Position {
        if self.loaders.len() == 1 {
            self.loaders[0].position()
        } else {
            Position::default()
        }
    }

    /// Puts the data where it stands after `step` steps: the one loader at `position`, or
    /// each source's loader past the batches the first `step` draws took from it.
    pub(super) fn seek(&mut self, position: Position, step: u64) -> Result<()> {
        let mut counts = vec![0u64; self.loaders.len()];
        for k in 0..step {
            counts[self.source_of(k)] += 1;
        }
        for (s, &c) in counts.iter().enumerate() {
            self.served[s] = Served {
                steps: c,
                pairs: c * self.batch_size as u64,
            };
        }
        if self.loaders.len() == 1 {
            return self.loaders[0].seek(position);
        }
        for (loader, &c) in self.loaders.iter_mut().zip(&counts) {
            loader.seek(Position::default())?;
            loader.skip_batches(c)?;
        }
        Ok(())
    }

    /// Steps and pairs each source has served since step 0.
    pub(super) fn served(&self) -> &[Served] {
        &self.served
    }

    /// What messages call the file a batch of source `source` was read from: its file,
    /// its path and number of shards, or the mixed sources' names.
    pub(super) fn describe_source(&self, source: usize) -> String {
        if self.mixed {
            let names: Vec<&str> = self
                .sources
                .iter()
                .map(|s| s.source.name.as_str())
                .collect();
            return format!("the mixed sources {}", names.join(", "));
        }
        let s = &self.sources[source];
        if s.files.len() > 1 {
            format!("{} ({} shards)", s.source.path, s.files.len())
        } else {
            s.files[0].display().to_string()
        }
    }
}

/// A loader's handle on pairs a [`SourceData`] also holds.
struct Shared(Rc<dyn PairSource>);

impl PairSource for Shared {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn pair(&self, i: usize) -> Result<Pair> {
        self.0.pair(i)
    }

    fn origin(&self, i: usize) -> usize {
        self.0.origin(i)
    }
}
