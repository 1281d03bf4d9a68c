//! Chat templates: a decoder reranker reads a (query, document) pair as its tokenizer's
//! Jinja chat template renders it, as sentence-transformers 6 feeds a causal-LM
//! `CrossEncoder` (Qwen3-Reranker's layout).
//!
//! The pair becomes two messages with the roles `query` and `document` (an instruction a
//! `system` message before them); the template renders them as transformers'
//! `apply_chat_template` does (Jinja with `trim_blocks` and `lstrip_blocks`, the
//! tokenizer's special tokens as variables, no generation prompt; Python's string methods
//! through minijinja-contrib's `pycompat`), and the text is tokenized without added
//! special tokens. A text longer than the limit keeps its first tokens, and the
//! template's tail, which the cut removed, is written back over the last ones, as
//! sentence-transformers restores it: the tail is the longest run of tokens two renders
//! with different contents end in.

use std::path::{Path, PathBuf};

use serde::Serialize;

pub use crate::hub::files::CHAT_TEMPLATE;
use crate::hub::files::TOKENIZER_CONFIG;
use crate::{Error, Result};

/// The special tokens transformers passes a template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One message of a conversation.
#[derive(Debug, Clone, Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

/// A tokenizer's chat template, ready to render.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    /// Where it was read, for errors.
    path: PathBuf,
    /// The special tokens by name, as the template sees them.
    specials: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Python's `json.dumps` separators without an indent: `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        writer.write_all(if first { b"" } else { b", " })
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// transformers' `tojson`: `json.dumps` (keys in their order, non-ASCII kept, Python's
/// separators, optionally indented), where Jinja's own escapes HTML characters.
fn tojson(
    value: minijinja::Value,
    indent: Option<usize>,
) -> std::result::Result<String, minijinja::Error> {
    let mut out = Vec::new();
    let written = match indent {
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
    };
    written.map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

impl ChatTemplate {
    /// Compiles `source` (read from `path`), with the special tokens of the tokenizer
    /// config `config`.
    pub fn new(
        source: String,
        path: &Path,
        config: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| Error::ModelFile {
                path: path.to_path_buf(),
                reason: format!("the chat template does not parse: {e}"),
            })?;
        let specials = config.map_or_else(Vec::new, |config| {
            SPECIAL_TOKENS
                .iter()
                .filter_map(|&key| special_token(config, key).map(|t| (key.to_string(), t)))
                .collect()
        });
        Ok(Self {
            env,
            source,
            path: path.to_path_buf(),
            specials,
        })
    }

    /// The chat template of the tokenizer in `dir`: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
    /// which the `default` one); `None` for a tokenizer without one.
    pub fn read(
        dir: &Path,
        config: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<Option<Self>> {
        let file = dir.join(CHAT_TEMPLATE);
        if file.is_file() {
            let source = std::fs::read_to_string(&file).map_err(|e| Error::io("read", &file, e))?;
            return Self::new(source, &file, config).map(Some);
        }
        let path = dir.join(TOKENIZER_CONFIG);
        let source = match config.and_then(|c| c.get("chat_template")) {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(String::from)
                .ok_or_else(|| Error::ModelFile {
                    path: path.clone(),
                    reason: "`chat_template` is a list without a template named \"default\"".into(),
                })?,
            Some(other) => {
                return Err(Error::ModelFile {
                    path,
                    reason: format!("`chat_template` is neither a string nor a list: {other}"),
                })
            }
        };
        Self::new(source, &path, config).map(Some)
    }

    /// The template's text (an export writes it back).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a pair: an instruction (`system`) when given, the query, the document.
    pub fn render_pair(&self, system: Option<&str>, query: &str, document: &str) -> Result<String> {
        let mut messages = Vec::with_capacity(3);
        if let Some(system) = system {
            messages.push(Message {
                role: "system",
                content: system,
            });
        }
        messages.push(Message {
            role: "query",
            content: query,
        });
        messages.push(Message {
            role: "document",
            content: document,
        });
        let template = self.env.get_template("chat").map_err(|e| self.error(e))?;
        let mut ctx: std::collections::BTreeMap<&str, minijinja::Value> = self
            .specials
            .iter()
            .map(|(k, v)| (k.as_str(), minijinja::Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", minijinja::Value::from_serialize(&messages));
        ctx.insert("add_generation_prompt", false.into());
        template.render(&ctx).map_err(|e| self.error(e))
    }

    fn error(&self, e: minijinja::Error) -> Error {
        Error::ModelFile {
            path: self.path.clone(),
            reason: format!("the chat template does not render a (query, document) pair: {e}"),
        }
    }

    /// The token ids of each pair as the model reads it: rendered, tokenized by `bare`
    /// (no truncation, no padding) without added special tokens, cut to `max_len` with the
    /// template's tail written back over the last tokens. Returns the ids and how many
    /// pairs were cut.
    pub fn pair_ids(
        &self,
        bare: &tokenizers::Tokenizer,
        system: Option<&str>,
        queries: &[&str],
        documents: &[&str],
        max_len: usize,
    ) -> Result<(Vec<Vec<u32>>, usize)> {
        let tokenize = |text: String| -> Result<Vec<u32>> {
            bare.encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer(e.to_string()))
        };
        let mut tail: Option<Vec<u32>> = None;
        let mut cut = 0;
        let mut rows = Vec::with_capacity(queries.len());
        for (&q, &d) in queries.iter().zip(documents) {
            let mut ids = tokenize(self.render_pair(system, q, d)?)?;
            if ids.len() > max_len {
                cut += 1;
            }
            if ids.len() >= max_len {
                ids.truncate(max_len);
                if tail.is_none() {
                    // Two renders whose contents tokenize differently share only the
                    // template's own tokens at their end.
                    let a = tokenize(self.render_pair(system, "0", "0")?)?;
                    let b = tokenize(self.render_pair(system, "1 2 3 4", "1 2 3 4")?)?;
                    let common = a
                        .iter()
                        .rev()
                        .zip(b.iter().rev())
                        .take_while(|(x, y)| x == y)
                        .count();
                    tail = Some(if common > 0 && common < a.len().min(b.len()) {
                        a[a.len() - common..].to_vec()
                    } else {
                        Vec::new()
                    });
                }
                let tail = tail.as_deref().unwrap_or(&[]);
                let keep = tail.len().min(ids.len());
                let at = ids.len() - keep;
                ids[at..].copy_from_slice(&tail[tail.len() - keep..]);
            }
            rows.push(ids);
        }
        Ok((rows, cut))
    }
}

/// A special token of a tokenizer config: a string, or an added-token object
/// (`{"content": ...}`).
pub(crate) fn special_token(
    settings: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Option<String> {
    match settings.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let mut config = serde_json::Map::new();
        config.insert("eos_token".into(), "</s>".into());
        ChatTemplate::new(source.into(), Path::new("t.jinja"), Some(&config)).unwrap()
    }

    #[test]
    fn renders_roles_with_python_methods_and_special_tokens() {
        let t = template(
            "{% for m in messages %}{{ m.role | upper }}={{ m.content.strip() }};{% endfor %}\n\
             {{ eos_token }}{{ messages | selectattr('role', 'eq', 'system') | map(attribute='content') | first | default('none') }}\n",
        );
        assert_eq!(
            t.render_pair(None, " q ", "d").unwrap(),
            "QUERY=q;DOCUMENT=d;</s>none"
        );
        assert_eq!(
            t.render_pair(Some("be brief"), "q", "d").unwrap(),
            "SYSTEM=be brief;QUERY=q;DOCUMENT=d;</s>be brief"
        );
    }

    #[test]
    fn a_raised_exception_is_an_error_naming_the_file() {
        let t = template("{{ raise_exception('only pairs') }}");
        let e = t.render_pair(None, "q", "d").unwrap_err().to_string();
        assert!(e.contains("only pairs") && e.contains("t.jinja"), "{e}");
        let bad = ChatTemplate::new("{% for %}".into(), Path::new("x.jinja"), None);
        assert!(bad.unwrap_err().to_string().contains("x.jinja"));
    }

    #[test]
    fn tojson_keeps_text_as_written() {
        let t = template("{{ messages[0] | tojson }}");
        assert_eq!(
            t.render_pair(None, "<é>", "d").unwrap(),
            r#"{"role": "query", "content": "<é>"}"#
        );
    }
}
