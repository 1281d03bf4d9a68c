//! The BEIR layout: `corpus.jsonl` (`_id`, `title`, `text`), `queries.jsonl` (`_id`,
//! `text`) and `qrels/<split>.tsv` (`query-id`, `corpus-id`, `score`, with a header line),
//! each optionally gzip- or zstd-compressed (`corpus.jsonl.gz`, ...).
//!
//! A document's text is its title and text joined by a separator (`" "`, as BEIR's
//! sentence-transformers model joins them); a document without a title is its text.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::retrieval::files::for_each_line;
use crate::{Error, Result};

/// One corpus document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// Its id (`_id`).
    pub id: String,
    /// Its title (may be empty).
    pub title: String,
    /// Its text.
    pub text: String,
}

impl Document {
    /// Title and text joined by `separator` (the text alone when there is no title).
    pub fn joined(&self, separator: &str) -> String {
        if self.title.trim().is_empty() {
            self.text.trim().to_string()
        } else {
            format!("{}{separator}{}", self.title, self.text)
                .trim()
                .to_string()
        }
    }
}

/// One query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// Its id (`_id`).
    pub id: String,
    /// Its text.
    pub text: String,
}

/// Relevance judgements: query id -> document id -> grade (> 0: relevant).
pub type Qrels = BTreeMap<String, BTreeMap<String, i64>>;

/// A BEIR-layout dataset: the corpus, the queries judged in one split, and its qrels.
#[derive(Debug, Clone)]
pub struct BeirSet {
    /// Every corpus document, in file order.
    pub corpus: Vec<Document>,
    /// The queries that have judgements in the split, in file order.
    pub queries: Vec<Query>,
    /// The split's judgements.
    pub qrels: Qrels,
}

/// `dir/name` or, when that does not exist, `dir/name.gz` or `dir/name.zst`.
pub fn find_file(dir: &Path, name: &str, what: &'static str) -> Result<PathBuf> {
    for suffix in ["", ".gz", ".zst"] {
        let path = dir.join(format!("{name}{suffix}"));
        if path.is_file() {
            return Ok(path);
        }
    }
    Err(Error::MissingFile {
        path: dir.join(name),
        what,
    })
}

/// A string field of a JSON object; `id` fields may also be numbers (some BEIR sets write
/// numeric ids).
fn field(
    object: &serde_json::Map<String, serde_json::Value>,
    name: &str,
    path: &Path,
    line: usize,
    required: bool,
) -> Result<String> {
    match object.get(name) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) if name == "_id" => Ok(n.to_string()),
        None | Some(serde_json::Value::Null) if !required => Ok(String::new()),
        None => Err(Error::data(path, line, format!("missing field `{name}`"))),
        Some(_) => Err(Error::data(
            path,
            line,
            format!("field `{name}` is not a string"),
        )),
    }
}

fn json_object(
    path: &Path,
    line: usize,
    text: &str,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(o)) => Ok(o),
        Ok(_) => Err(Error::data(path, line, "expected a JSON object")),
        Err(e) => Err(Error::data(path, line, format!("not valid JSON ({e})"))),
    }
}

/// Reads a BEIR `corpus.jsonl` (plain or compressed). Ids must be unique.
pub fn read_corpus(path: &Path) -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for_each_line(path, |line, text| {
        if text.trim().is_empty() {
            return Ok(());
        }
        let o = json_object(path, line, text)?;
        let doc = Document {
            id: field(&o, "_id", path, line, true)?,
            title: field(&o, "title", path, line, false)?,
            text: field(&o, "text", path, line, true)?,
        };
        if doc.id.is_empty() {
            return Err(Error::data(path, line, "field `_id` is empty"));
        }
        if let Some(first) = seen.insert(doc.id.clone(), line) {
            return Err(Error::data(
                path,
                line,
                format!("document id `{}` already appears on line {first}", doc.id),
            ));
        }
        docs.push(doc);
        Ok(())
    })?;
    if docs.is_empty() {
        return Err(Error::data(path, 0, "the corpus holds no documents"));
    }
    Ok(docs)
}

/// Reads a BEIR `queries.jsonl` (plain or compressed).
pub fn read_queries(path: &Path) -> Result<Vec<Query>> {
    let mut queries = Vec::new();
    for_each_line(path, |line, text| {
        if text.trim().is_empty() {
            return Ok(());
        }
        let o = json_object(path, line, text)?;
        let query = Query {
            id: field(&o, "_id", path, line, true)?,
            text: field(&o, "text", path, line, true)?,
        };
        if query.text.trim().is_empty() {
            return Err(Error::data(path, line, "field `text` is empty"));
        }
        queries.push(query);
        Ok(())
    })?;
    Ok(queries)
}

/// Reads a qrels TSV: `query-id<TAB>corpus-id<TAB>score`, with or without BEIR's header
/// line; TREC's four-column form (`qid 0 docid grade`, spaces or tabs) is read too.
pub fn read_qrels(path: &Path) -> Result<Qrels> {
    let mut qrels = Qrels::new();
    for_each_line(path, |line, text| {
        if text.trim().is_empty() {
            return Ok(());
        }
        let cols: Vec<&str> = text.split_whitespace().collect();
        let (query, doc, grade) = match cols.as_slice() {
            [q, d, g] => (*q, *d, *g),
            [q, _, d, g] => (*q, *d, *g),
            _ => {
                return Err(Error::data(
                    path,
                    line,
                    format!(
                        "expected `query-id corpus-id score` (3 columns) or TREC's 4, got {}",
                        cols.len()
                    ),
                ))
            }
        };
        let grade: i64 = match grade.parse() {
            Ok(g) => g,
            // BEIR's header line.
            Err(_) if line == 1 => return Ok(()),
            Err(_) => {
                return Err(Error::data(
                    path,
                    line,
                    format!("the score `{grade}` is not an integer"),
                ))
            }
        };
        qrels
            .entry(query.to_string())
            .or_default()
            .insert(doc.to_string(), grade);
        Ok(())
    })?;
    if qrels.is_empty() {
        return Err(Error::data(path, 0, "the qrels hold no judgements"));
    }
    Ok(qrels)
}

impl BeirSet {
    /// Each query (by index) with the corpus indices of its relevant documents (grade >=
    /// 1), in the order of the queries and of the judgements; queries without one are
    /// left out.
    pub fn relevant(&self) -> Vec<(usize, Vec<usize>)> {
        let index: HashMap<&str, usize> = self
            .corpus
            .iter()
            .enumerate()
            .map(|(i, d)| (d.id.as_str(), i))
            .collect();
        self.queries
            .iter()
            .enumerate()
            .filter_map(|(q, query)| {
                let docs: Vec<usize> = self
                    .qrels
                    .get(&query.id)?
                    .iter()
                    .filter(|(_, &g)| g >= 1)
                    .filter_map(|(d, _)| index.get(d.as_str()).copied())
                    .collect();
                (!docs.is_empty()).then_some((q, docs))
            })
            .collect()
    }

    /// Reads `dir/corpus.jsonl`, `dir/queries.jsonl` and `dir/qrels/<split>.tsv` (each
    /// optionally `.gz` or `.zst`). Keeps the queries that have judgements in the split;
    /// a judged query or document missing from the files is an error naming it.
    pub fn load(dir: &Path, split: &str) -> Result<Self> {
        let corpus_path = find_file(dir, "corpus.jsonl", "BEIR corpus")?;
        let queries_path = find_file(dir, "queries.jsonl", "BEIR queries")?;
        let qrels_path = find_file(&dir.join("qrels"), &format!("{split}.tsv"), "BEIR qrels")?;
        let qrels = read_qrels(&qrels_path)?;
        let corpus = read_corpus(&corpus_path)?;
        let all_queries = read_queries(&queries_path)?;
        let ids: std::collections::HashSet<&str> = corpus.iter().map(|d| d.id.as_str()).collect();
        for (q, docs) in &qrels {
            if let Some(d) = docs.keys().find(|d| !ids.contains(d.as_str())) {
                return Err(Error::data(
                    &qrels_path,
                    0,
                    format!(
                        "query `{q}` is judged against document `{d}`, which is not in the corpus"
                    ),
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        let queries: Vec<Query> = all_queries
            .into_iter()
            .filter(|q| qrels.contains_key(&q.id) && seen.insert(q.id.clone()))
            .collect();
        if queries.len() < qrels.len() {
            let known: std::collections::HashSet<&str> =
                queries.iter().map(|q| q.id.as_str()).collect();
            let missing = qrels.keys().find(|q| !known.contains(q.as_str()));
            return Err(Error::data(
                &qrels_path,
                0,
                format!(
                    "query `{}` has judgements but is not in {}",
                    missing.map(String::as_str).unwrap_or("?"),
                    queries_path.display()
                ),
            ));
        }
        Ok(Self {
            corpus,
            queries,
            qrels,
        })
    }
}
