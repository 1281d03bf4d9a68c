//! Reading data files as they are published: plain, gzip (`.gz`) or zstd (`.zst`),
//! recognised by their first bytes rather than their names.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use crate::{Error, Result};

/// The compression of a file, from its magic number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain bytes.
    None,
    /// gzip (`1f 8b`).
    Gzip,
    /// zstd (`28 b5 2f fd`).
    Zstd,
}

/// The compression of the file at `path` (from its first four bytes).
pub fn compression(path: &Path) -> Result<Compression> {
    let mut head = [0u8; 4];
    let mut file = open_file(path)?;
    let mut read = 0;
    while read < head.len() {
        match file.read(&mut head[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read", path, e)),
        }
    }
    Ok(if read >= 2 && head[..2] == [0x1f, 0x8b] {
        Compression::Gzip
    } else if read == 4 && head == [0x28, 0xb5, 0x2f, 0xfd] {
        Compression::Zstd
    } else {
        Compression::None
    })
}

/// Opens `path`, a missing file named as a missing data file.
pub(crate) fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: "data file",
        },
        _ => Error::io("open", path, e),
    })
}

/// A buffered reader over the decompressed bytes of `path` (plain, gzip or zstd).
pub fn open_text(path: &Path) -> Result<Box<dyn BufRead>> {
    let kind = compression(path)?;
    let file = open_file(path)?;
    Ok(match kind {
        Compression::None => Box::new(BufReader::with_capacity(1 << 16, file)),
        Compression::Gzip => Box::new(BufReader::with_capacity(
            1 << 16,
            flate2::read::MultiGzDecoder::new(BufReader::new(file)),
        )),
        Compression::Zstd => {
            let decoder =
                ruzstd::decoding::StreamingDecoder::new(BufReader::new(file)).map_err(|e| {
                    Error::Data {
                        path: path.to_path_buf(),
                        line: 0,
                        reason: format!("not a valid zstd stream ({e})"),
                    }
                })?;
            Box::new(BufReader::with_capacity(1 << 16, decoder))
        }
    })
}

/// Calls `each(line_number, line)` for every line of `path` (1-based, decompressed, the
/// line ending removed), stopping at the first error. A read or decompression failure
/// names the file and the line it happened at.
pub fn for_each_line(path: &Path, mut each: impl FnMut(usize, &str) -> Result<()>) -> Result<()> {
    let mut reader = open_text(path)?;
    let mut line = String::new();
    let mut number = 0;
    loop {
        line.clear();
        number += 1;
        let n = reader.read_line(&mut line).map_err(|e| Error::Data {
            path: path.to_path_buf(),
            line: number,
            reason: format!("cannot read ({e})"),
        })?;
        if n == 0 {
            return Ok(());
        }
        let text = line.strip_suffix('\n').unwrap_or(&line);
        let text = text.strip_suffix('\r').unwrap_or(text);
        each(number, text)?;
    }
}
