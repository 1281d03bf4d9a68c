//! Training pairs from datasets as they are published, each file plain, gzip or zstd:
//!
//! - **JSONL pairs** (`.jsonl`, `.json`): `{"query", "positive", "negatives": [..]}`, the
//!   field names set by [`Fields`];
//! - **Tevatron / DPR JSONL**: `{"query", "positive_passages": [{docid, title, text}],
//!   "negative_passages": [..]}` (recognised by `positive_passages`); the first positive
//!   passage is the pair's positive, the negative passages its hard negatives, each
//!   passage's title and text joined by `title_separator`;
//! - **TSV / CSV with named columns** (`.tsv`, `.csv`, a header line): the query and
//!   positive columns named by [`Fields`], negatives in a column named as
//!   `fields.negatives`, `negative`, or `negative_1`, `negative_2`, ... (the
//!   sentence-transformers layout), in that order;
//! - **Parquet** (`.parquet`, as the Hugging Face Hub stores datasets; snappy, zstd or
//!   gzip pages): each row read as a JSON object, so any of the JSON layouts above;
//! - **a BEIR folder** (a directory): every judged query of `split` with each relevant
//!   document (grade >= 1), title and text joined.
//!
//! A bad row is an error naming the file, the line and the field.

use std::path::Path;

use crate::retrieval::beir::BeirSet;
use crate::retrieval::files::{for_each_line, open_file, open_text};
use crate::train::data::{Fields, NumberedPairs, Pair};
use crate::{Error, Result};

/// How a data file is laid out, from its name (a `.gz` / `.zst` suffix aside) or, for a
/// directory, the BEIR layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// JSON lines: pairs or Tevatron (told apart line by line).
    JsonLines,
    /// Tab-separated with a header.
    Tsv,
    /// Comma-separated with a header.
    Csv,
    /// Apache Parquet.
    Parquet,
    /// A BEIR folder.
    Beir,
}

impl Layout {
    /// The layout of `path`: a directory is a BEIR folder, a file is read by its name
    /// ([`Layout::of_name`]), JSON lines when the name says nothing.
    pub fn of(path: &Path) -> Self {
        if path.is_dir() {
            return Layout::Beir;
        }
        Self::of_name(path).unwrap_or(Layout::JsonLines)
    }

    /// The layout a file's name names (`.jsonl`, `.json`, `.tsv`, `.csv`, `.parquet`, each
    /// plain or `.gz` / `.zst`), if it names one.
    pub fn of_name(path: &Path) -> Option<Self> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        let name = name
            .strip_suffix(".gz")
            .or_else(|| name.strip_suffix(".zst"))
            .unwrap_or(&name);
        [
            (".tsv", Layout::Tsv),
            (".csv", Layout::Csv),
            (".parquet", Layout::Parquet),
            (".jsonl", Layout::JsonLines),
            (".json", Layout::JsonLines),
        ]
        .into_iter()
        .find(|(ext, _)| name.ends_with(ext))
        .map(|(_, layout)| layout)
    }
}

/// Reads training pairs from `path` in its layout (see the module docs). `split` names the
/// qrels of a BEIR folder; `title_separator` joins titles and texts.
pub fn read_pairs(
    path: &Path,
    fields: &Fields,
    split: &str,
    title_separator: &str,
) -> Result<Vec<Pair>> {
    read_pairs_as(path, Layout::of(path), fields, split, title_separator)
}

/// Reads a JSONL file of pairs (plain, gzip or zstd). Blank lines are skipped; any other
/// line must be an object with string `query` and `positive` fields and, optionally, a list
/// of strings `negatives` (or a Tevatron line; [`read_pairs`] reads every other layout too).
pub fn read_jsonl(path: &Path, fields: &Fields) -> Result<Vec<Pair>> {
    read_pairs_as(path, Layout::JsonLines, fields, "", " ")
}

/// [`read_pairs`] in a given layout.
pub fn read_pairs_as(
    path: &Path,
    layout: Layout,
    fields: &Fields,
    split: &str,
    title_separator: &str,
) -> Result<Vec<Pair>> {
    Ok(read_numbered(path, layout, fields, split, title_separator)?.pairs)
}

/// [`read_pairs_as`] with where each pair was read from: its 1-based line (JSONL, TSV and
/// CSV), row (Parquet), or place among the pairs (BEIR), for messages that name a
/// training example.
pub fn read_numbered(
    path: &Path,
    layout: Layout,
    fields: &Fields,
    split: &str,
    title_separator: &str,
) -> Result<NumberedPairs> {
    let mut numbered = NumberedPairs {
        pairs: Vec::new(),
        lines: Vec::new(),
    };
    let mut push = |pair: Pair, line: usize| {
        numbered.pairs.push(pair);
        numbered.lines.push(line);
    };
    match layout {
        Layout::Beir => beir_pairs(path, split, title_separator, &mut push)?,
        Layout::Tsv => table_pairs(path, fields, b'\t', &mut push)?,
        Layout::Csv => table_pairs(path, fields, b',', &mut push)?,
        Layout::Parquet => parquet_pairs(path, fields, title_separator, &mut push)?,
        Layout::JsonLines => json_pairs(path, fields, title_separator, &mut push)?,
    }
    if numbered.pairs.is_empty() {
        return Err(Error::data(path, 0, "the file holds no pairs"));
    }
    Ok(numbered)
}

/// What the numbers of [`read_numbered`] count in a file of `layout`.
pub fn origin_unit(layout: Layout) -> &'static str {
    match layout {
        Layout::JsonLines | Layout::Tsv | Layout::Csv => "lines",
        Layout::Parquet => "rows",
        Layout::Beir => "training pairs",
    }
}

/// Receives each pair read with its 1-based line (or row, or place).
type Push<'a> = dyn FnMut(Pair, usize) + 'a;

fn beir_pairs(dir: &Path, split: &str, title_separator: &str, push: &mut Push) -> Result<()> {
    let set = BeirSet::load(dir, split)?;
    let mut n = 0;
    for (q, docs) in set.relevant() {
        for d in docs {
            n += 1;
            push(
                Pair {
                    query: set.queries[q].text.clone(),
                    positive: set.corpus[d].joined(title_separator),
                    ..Pair::default()
                },
                n,
            );
        }
    }
    Ok(())
}

/// Tevatron's passages: a list of objects with `text` and an optional `title`.
fn passages(
    value: Option<&serde_json::Value>,
    name: &str,
    separator: &str,
    error: &dyn Fn(String) -> Error,
) -> Result<Vec<String>> {
    let items = match value {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items,
        Some(_) => return Err(error(format!("field `{name}` must be a list of passages"))),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let bad = |what: &str| error(format!("`{name}[{i}]` {what}"));
            let o = item.as_object().ok_or_else(|| bad("is not an object"))?;
            let text = o
                .get("text")
                .and_then(|t| t.as_str())
                .ok_or_else(|| bad("has no string `text`"))?;
            let title = match o.get("title") {
                None | Some(serde_json::Value::Null) => "",
                Some(serde_json::Value::String(t)) => t.as_str(),
                Some(_) => return Err(bad("has a `title` that is not a string")),
            };
            let doc = crate::retrieval::Document {
                id: String::new(),
                title: title.to_string(),
                text: text.to_string(),
            };
            Ok(doc.joined(separator))
        })
        .collect()
}

fn json_pairs(path: &Path, fields: &Fields, separator: &str, push: &mut Push) -> Result<()> {
    for_each_line(path, |number, line| {
        if line.trim().is_empty() {
            return Ok(());
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::data(path, number, format!("not valid JSON ({e})")))?;
        let object = value
            .as_object()
            .ok_or_else(|| Error::data(path, number, "expected a JSON object"))?;
        let pair = pair_from_object(object, fields, separator, &|reason| {
            Error::data(path, number, reason)
        })?;
        push(pair, number);
        Ok(())
    })
}

/// One pair from a JSON object (a JSONL line or a Parquet row): Tevatron's layout when it
/// has `positive_passages`, else the fields of `fields`, with negatives in
/// `fields.negatives` (a list) or in `negative`, `negative_1`, ... columns.
pub(crate) fn pair_from_object(
    object: &serde_json::Map<String, serde_json::Value>,
    fields: &Fields,
    separator: &str,
    error: &dyn Fn(String) -> Error,
) -> Result<Pair> {
    let text = |name: &str| -> Result<String> {
        match object.get(name) {
            Some(serde_json::Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
            Some(serde_json::Value::String(_)) => Err(error(format!("field `{name}` is empty"))),
            Some(_) => Err(error(format!("field `{name}` is not a string"))),
            None => Err(error(format!("missing field `{name}`"))),
        }
    };
    let bad_scores = || {
        error(format!(
            "field `{}` must be a list of numbers (a teacher's score of the positive and of \
             each hard negative)",
            fields.scores
        ))
    };
    let scores = match object.get(&fields.scores) {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(bad_scores)?,
        Some(_) => return Err(bad_scores()),
    };
    let prompt = match object.get(&fields.prompt) {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) if s.is_empty() => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(error(format!(
                "field `{}` (the row's instruction) is not a string",
                fields.prompt
            )))
        }
    };
    if object.contains_key("positive_passages") {
        let positives = passages(
            object.get("positive_passages"),
            "positive_passages",
            separator,
            error,
        )?;
        let positive = positives
            .into_iter()
            .next()
            .ok_or_else(|| error("field `positive_passages` is empty".into()))?;
        return Ok(Pair {
            query: text(&fields.query)?,
            positive,
            negatives: passages(
                object.get("negative_passages"),
                "negative_passages",
                separator,
                error,
            )?,
            scores,
            prompt,
        });
    }
    let list_error = || {
        error(format!(
            "field `{}` must be a list of strings",
            fields.negatives
        ))
    };
    let negatives = match object.get(&fields.negatives) {
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(list_error))
            .collect::<Result<Vec<_>>>()?,
        Some(serde_json::Value::Null) => Vec::new(),
        Some(_) => return Err(list_error()),
        None => {
            // sentence-transformers' columns: `negative`, `negative_1`, `negative_2`, ...
            let mut columns: Vec<(u32, &String)> = object
                .iter()
                .filter_map(|(k, v)| match (negative_column(k, fields), v) {
                    (Some(order), serde_json::Value::String(s)) => Some((order, s)),
                    _ => None,
                })
                .collect();
            columns.sort_by_key(|&(order, _)| order);
            columns
                .into_iter()
                .filter(|(_, s)| !s.trim().is_empty())
                .map(|(_, s)| s.clone())
                .collect()
        }
    };
    Ok(Pair {
        query: text(&fields.query)?,
        positive: text(&fields.positive)?,
        negatives,
        scores,
        prompt,
    })
}

/// Pairs from a Parquet file (the Hugging Face Hub's dataset storage), each row read as a
/// JSON object ([`pair_from_object`]): string columns, list columns, Tevatron's lists of
/// passages. An error names the row (1-based) and its row group.
fn parquet_pairs(path: &Path, fields: &Fields, separator: &str, push: &mut Push) -> Result<()> {
    // The Parquet crate panics on some damaged pages instead of returning an error (its
    // record reader asserts on definition levels; tests/it/fuzz_readers.rs found it): such a
    // panic becomes an error naming the file.
    without_panics(path, || read_parquet(path, fields, separator, push))
}

/// Runs `read` on this thread, turning a panic inside it into an error naming `path`
/// (its message kept for the error, not printed; a panic on another thread meanwhile is
/// reported as usual).
fn without_panics(path: &Path, read: impl FnOnce() -> Result<()>) -> Result<()> {
    use std::cell::RefCell;
    use std::sync::Arc;
    thread_local! {
        static MESSAGE: RefCell<Option<String>> = const { RefCell::new(None) };
    }
    let reader = std::thread::current().id();
    let previous: Arc<dyn Fn(&std::panic::PanicHookInfo<'_>) + Send + Sync> =
        Arc::from(std::panic::take_hook());
    let others = Arc::clone(&previous);
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().id() == reader {
            let text = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            MESSAGE.with(|m| *m.borrow_mut() = Some(text));
        } else {
            others(info);
        }
    }));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    std::panic::set_hook(Box::new(move |info| previous(info)));
    outcome.unwrap_or_else(|_| {
        let message = MESSAGE.with(|m| m.borrow_mut().take()).unwrap_or_default();
        Err(Error::data(
            path,
            0,
            format!("not a readable Parquet file (damaged data: {message})"),
        ))
    })
}

fn read_parquet(path: &Path, fields: &Fields, separator: &str, push: &mut Push) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = open_file(path)?;
    check_parquet_footer(path, &file)?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| Error::data(path, 0, format!("not a readable Parquet file ({e})")))?;
    // Where each row group starts, to name the group of a bad row.
    let mut starts = Vec::new();
    let mut total = 0usize;
    for g in reader.metadata().row_groups() {
        starts.push(total);
        total += g.num_rows().max(0) as usize;
    }
    let group_of = |row: usize| starts.partition_point(|&s| s <= row).saturating_sub(1);
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| Error::data(path, 0, format!("cannot read rows ({e})")))?;
    for (i, row) in rows.enumerate() {
        let at = |reason: String| {
            Error::data(
                path,
                i + 1,
                format!("row {} (row group {}): {reason}", i + 1, group_of(i)),
            )
        };
        let row = row.map_err(|e| at(format!("cannot decode ({e})")))?;
        let value = row.to_json_value();
        let object = value
            .as_object()
            .ok_or_else(|| at("a row is not a record".into()))?;
        push(pair_from_object(object, fields, separator, &at)?, i + 1);
    }
    Ok(())
}

/// Checks what the Parquet reader takes on trust in a file's footer: every column chunk
/// must lie inside the file (the reader panics on a negative offset or size, which a
/// damaged file can hold; `tests/it/fuzz_readers.rs` found it).
fn check_parquet_footer(path: &Path, file: &std::fs::File) -> Result<()> {
    use parquet::file::metadata::ParquetMetaDataReader;
    let bad =
        |reason: String| Error::data(path, 0, format!("not a readable Parquet file ({reason})"));
    let metadata = ParquetMetaDataReader::new()
        .parse_and_finish(file)
        .map_err(|e| bad(e.to_string()))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("read", path, e))?
        .len();
    for (g, group) in metadata.row_groups().iter().enumerate() {
        for column in group.columns() {
            let start = column
                .dictionary_page_offset()
                .unwrap_or(column.data_page_offset());
            let size = column.compressed_size();
            let inside = start >= 0
                && size >= 0
                && (start as u64)
                    .checked_add(size as u64)
                    .is_some_and(|end| end <= len);
            if !inside {
                return Err(bad(format!(
                    "row group {g}, column {}: a chunk of {size} bytes at offset {start} in a \
                     file of {len} bytes",
                    column.column_path()
                )));
            }
        }
    }
    Ok(())
}

/// Whether a column holds a hard negative, and its place among them.
fn negative_column(name: &str, fields: &Fields) -> Option<u32> {
    if name == fields.negatives || name == "negative" {
        return Some(0);
    }
    let rest = name.strip_prefix("negative")?;
    let rest = rest.strip_prefix('_').unwrap_or(rest);
    rest.parse::<u32>().ok()
}

fn table_pairs(path: &Path, fields: &Fields, delimiter: u8, push: &mut Push) -> Result<()> {
    let reader = open_text(path)?;
    let mut table = csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .has_headers(true)
        .flexible(false)
        .from_reader(reader);
    let headers = table
        .headers()
        .map_err(|e| Error::data(path, 1, format!("cannot read the header line ({e})")))?
        .clone();
    let column = |name: &str| -> Result<usize> {
        headers.iter().position(|h| h == name).ok_or_else(|| {
            Error::data(
                path,
                1,
                format!(
                    "no column `{name}` in the header (columns: {})",
                    headers.iter().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    };
    let (query, positive) = (column(&fields.query)?, column(&fields.positive)?);
    let mut negatives: Vec<(u32, usize)> = headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| negative_column(h, fields).map(|order| (order, i)))
        .collect();
    negatives.sort_unstable();
    for record in table.records() {
        let record = record.map_err(|e| {
            let line = e.position().map_or(0, |p| p.line() as usize);
            Error::data(path, line, format!("malformed row ({e})"))
        })?;
        let line = record.position().map_or(0, |p| p.line() as usize);
        let cell = |i: usize, name: &str| -> Result<String> {
            let text = record.get(i).unwrap_or("");
            if text.trim().is_empty() {
                Err(Error::data(path, line, format!("column `{name}` is empty")))
            } else {
                Ok(text.to_string())
            }
        };
        let pair = Pair {
            query: cell(query, &fields.query)?,
            positive: cell(positive, &fields.positive)?,
            negatives: negatives
                .iter()
                .filter_map(|&(_, i)| record.get(i))
                .filter(|t| !t.trim().is_empty())
                .map(str::to_string)
                .collect(),
            scores: Vec::new(),
            prompt: headers
                .iter()
                .position(|h| h == fields.prompt.as_str())
                .and_then(|i| record.get(i))
                .filter(|t| !t.is_empty())
                .map(str::to_string),
        };
        push(pair, line);
    }
    Ok(())
}
