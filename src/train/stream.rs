//! Training files larger than memory: an index of where each line of a JSONL file starts
//! (one pass over the file, 12 bytes a pair), and each pair read from disk when a batch
//! needs it. The loader shuffles indices, not pairs, so the order is the same as in memory
//! and a resume seeks to the same position exactly; the heap holds the index, not the
//! texts (a 10-million-pair file of 1.6 GB: 114 MiB of index, 193 MiB while it is built,
//! and 76 MiB of shuffled order, against 2.5 GiB read whole; `benches/stream_memory.rs`).
//!
//! Any JSON-lines layout of [`crate::train::formats`] (ours, Tevatron's, sentence-
//! transformers' columns) streams; the file must be uncompressed (a gzip or zstd stream
//! cannot be entered in the middle): decompress it once.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::retrieval::files::{compression, open_file, Compression};
use crate::train::data::{Fields, Pair, PairSource};
use crate::train::formats::pair_from_object;
use crate::{Error, Result};

/// A JSONL file of pairs, indexed by line.
pub struct JsonlIndex {
    path: PathBuf,
    file: File,
    fields: Fields,
    title_separator: String,
    /// Byte offset of each non-blank line.
    offsets: Vec<u64>,
    /// Its 1-based line number (for errors).
    lines: Vec<u32>,
    /// The file's length when indexed.
    length: u64,
}

impl JsonlIndex {
    /// Indexes `path` (one sequential pass; the lines are not parsed until served).
    pub fn build(path: &Path, fields: &Fields, title_separator: &str) -> Result<Self> {
        if compression(path)? != Compression::None {
            return Err(Error::data(
                path,
                0,
                "data.stream reads uncompressed JSONL only (a compressed stream cannot be \
                 entered in the middle): decompress it once, or turn data.stream off",
            ));
        }
        let mut file = open_file(path)?;
        let mut offsets = Vec::new();
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        let (mut at, mut line, mut start, mut blank) = (0u64, 1u32, 0u64, true);
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| Error::io("read", path, e))?;
            if n == 0 {
                break;
            }
            for &b in &buf[..n] {
                if b == b'\n' {
                    if !blank {
                        offsets.push(start);
                        lines.push(line);
                    }
                    line = line
                        .checked_add(1)
                        .ok_or_else(|| Error::data(path, 0, "more than 4 billion lines"))?;
                    start = at + 1;
                    blank = true;
                } else if !b.is_ascii_whitespace() {
                    blank = false;
                }
                at += 1;
            }
        }
        if !blank {
            offsets.push(start);
            lines.push(line);
        }
        if offsets.is_empty() {
            return Err(Error::data(path, 0, "the file holds no pairs"));
        }
        offsets.shrink_to_fit();
        lines.shrink_to_fit();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            fields: fields.clone(),
            title_separator: title_separator.to_string(),
            offsets,
            lines,
            length: at,
        })
    }

    /// The bytes of line `i` (without its line ending).
    fn line_bytes(&self, i: usize) -> Result<Vec<u8>> {
        let start = self.offsets[i];
        let end = self.offsets.get(i + 1).copied().unwrap_or(self.length);
        let mut bytes = vec![0u8; (end - start) as usize];
        self.file.read_exact_at(&mut bytes, start).map_err(|e| {
            Error::data(
                &self.path,
                self.lines[i] as usize,
                format!("cannot read the line ({e}); was the file changed after it was indexed?"),
            )
        })?;
        // The next indexed line may follow blank lines: cut at the first line ending.
        if let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            bytes.truncate(end);
        }
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        Ok(bytes)
    }

    /// A digest of the index (the file's length and every line's offset): equal on every
    /// rank that reads the same file.
    pub fn digest(&self) -> u64 {
        let mut h = crate::rng::hash_str(&self.length.to_string());
        for &o in &self.offsets {
            h = h.rotate_left(5) ^ o;
        }
        h
    }
}

impl PairSource for JsonlIndex {
    fn len(&self) -> usize {
        self.offsets.len()
    }

    fn origin(&self, i: usize) -> usize {
        self.lines[i] as usize
    }

    fn pair(&self, i: usize) -> Result<Pair> {
        let line = self.lines[i] as usize;
        let bytes = self.line_bytes(i)?;
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| Error::data(&self.path, line, format!("not valid JSON ({e})")))?;
        let object = value
            .as_object()
            .ok_or_else(|| Error::data(&self.path, line, "expected a JSON object"))?;
        pair_from_object(object, &self.fields, &self.title_separator, &|reason| {
            Error::data(&self.path, line, reason)
        })
    }
}
