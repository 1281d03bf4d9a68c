//! Durable writes: a file or a directory appears whole under its name, or not at all.
//!
//! Every file the trainer writes (checkpoints, `metrics.jsonl`, the loss plots, the run's
//! tokenizer and model config, exports) goes through here: it is written under a
//! temporary name in the same directory, flushed to disk (`fsync`), renamed over its
//! final name, and the directory holding it is flushed too, so that the rename survives a
//! power cut. A failed write (a full disk, a read-only directory, a file size limit)
//! removes the temporary file and leaves whatever was under the final name untouched.
//!
//! A reader therefore never sees a half-written file under a final name: after a crash
//! there is at most a leftover temporary (`.NAME.tmp-PID...`), which the next write of
//! the same name replaces.
//!
//! A path that is not a plain file (a device such as `/dev/null`, a named pipe, a link
//! such as `/dev/stdout`) is written in place, as the shell's `>` would: renaming a
//! temporary over it would replace the device or the link with a file (as root,
//! `/dev/null` itself).

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The directory `path` is in (`.` for a bare file name).
fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// A temporary name beside `path` that keeps its extension (the plot writer picks its
/// image format from it): `dir/.loss.tmp-1234.png` for `dir/loss.png`.
pub fn temporary_name(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let pid = std::process::id();
    let name = match path.extension() {
        Some(ext) => format!(".{stem}.tmp-{pid}.{}", ext.to_string_lossy()),
        None => format!(".{stem}.tmp-{pid}"),
    };
    parent_of(path).join(name)
}

/// Flushes a file (or a directory's entries) to disk.
fn sync(path: &Path) -> Result<()> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    match file.sync_all() {
        Ok(()) => Ok(()),
        // Some file systems cannot flush a directory; the data itself was flushed.
        Err(e) if path.is_dir() && e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
        Err(e) => Err(Error::io("flush", path, e)),
    }
}

/// Whether `path` names something other than a plain file or a directory: a device, a
/// named pipe or a symbolic link, written in place.
fn is_special(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Flushes the directory holding `path`, so that a rename or removal in it is durable.
pub fn sync_parent(path: &Path) -> Result<()> {
    sync(parent_of(path))
}

/// Writes `path` whole or not at all: `write` fills a temporary file beside it (the path
/// it is handed), which is then flushed and renamed over `path`; the directory is flushed
/// last. On any failure the temporary file is removed and `path` is as it was.
///
/// `write` may fail with any error that a [`crate::Error`] converts into (e.g.
/// `anyhow::Error` in a binary).
pub fn write_with<E: From<Error>>(
    path: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if is_special(path) {
        return write(path);
    }
    check_destination(path)?;
    let dir = parent_of(path);
    let tmp = temporary_name(path);
    let written = write(&tmp).and_then(|()| {
        sync(&tmp)?;
        fs::rename(&tmp, path).map_err(|e| Error::io("rename into", path, e))?;
        Ok(())
    });
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(sync(dir)?)
}

/// Whether [`write`](fn@write) could put a file at `path`, asked before the work whose output it is
/// (an encoding or an evaluation of hours should not end on a mistyped directory): `path`
/// names a file, not a directory, in a directory that exists; a device or link such as
/// `/dev/null` passes. Nothing is created or changed.
pub fn check_destination(path: &Path) -> Result<()> {
    if is_special(path) {
        return Ok(());
    }
    if path.file_name().is_none() || path.is_dir() {
        return Err(Error::io("write", path, "it is a directory, not a file"));
    }
    let dir = parent_of(path);
    if !dir.is_dir() {
        return Err(Error::io(
            "write",
            path,
            format!("{} is not a directory", dir.display()),
        ));
    }
    Ok(())
}

/// Writes `bytes` to `path` whole or not at all (see [`write_with`]).
pub fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_with::<Error>(path, |tmp| {
        let mut file = File::create(tmp).map_err(|e| Error::io("create", tmp, e))?;
        file.write_all(bytes.as_ref())
            .map_err(|e| Error::io("write", path, e))
    })
}

/// Writes `value` as pretty-printed JSON (with a final newline) to `path`, whole or not
/// at all.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::io("write", path, e))?;
    write(path, text + "\n")
}

/// Flushes every file and directory under `dir` (and `dir` itself) to disk: what a
/// directory written in full under a temporary name needs before it is renamed.
pub fn sync_tree(dir: &Path) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| Error::io("read", &path, e))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            sync(&path)?;
        }
    }
    sync(dir)
}

/// Refuses a directory to be written that already holds files ([`Error::OutputExists`]); a
/// missing or empty one is fine.
pub fn refuse_non_empty(dir: &Path) -> Result<()> {
    let holds_files = dir.exists()
        && fs::read_dir(dir)
            .map_err(|e| Error::io("list", dir, e))?
            .next()
            .is_some();
    if holds_files {
        return Err(Error::OutputExists {
            path: dir.to_path_buf(),
        });
    }
    Ok(())
}

/// An empty temporary directory beside `dir` to write it under (`.tmp-{kind}-{name}`, one
/// left by a failed earlier write removed), its parent created; [`publish_dir`] renames it.
pub fn temporary_dir(dir: &Path, kind: &str) -> Result<PathBuf> {
    let parent = parent_of(dir);
    fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-{kind}-{name}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io("remove", &tmp, e))?;
    }
    Ok(tmp)
}

/// Renames the complete directory `tmp` (flushed by [`sync_tree`]) to `dir`, replacing an
/// empty directory there, and flushes the parent. `dir` must not hold files.
pub fn publish_dir(tmp: &Path, dir: &Path) -> Result<()> {
    sync_tree(tmp)?;
    if dir.exists() {
        fs::remove_dir(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    fs::rename(tmp, dir).map_err(|e| Error::io("rename into", dir, e))?;
    sync_parent(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        write(&path, "old\n").unwrap();
        let failed = write_with::<Error>(&path, |tmp| {
            fs::write(tmp, "half").unwrap();
            Err(Error::io(
                "write",
                tmp,
                "No space left on device (os error 28)",
            ))
        });
        assert!(failed.is_err());
        assert_eq!(fs::read_to_string(&path).unwrap(), "old\n");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("metrics.jsonl")]);
        write(&path, "new\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\n");
    }

    #[cfg(unix)]
    #[test]
    fn pipes_links_and_devices_are_written_in_place_and_stay_what_they_are() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let pipe = dir.path().join("out");
        let made = std::process::Command::new("mkfifo").arg(&pipe).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("no mkfifo here: skipped");
            return;
        }
        let reader = {
            let pipe = pipe.clone();
            std::thread::spawn(move || fs::read_to_string(pipe).unwrap())
        };
        write(&pipe, "line\n").unwrap();
        assert_eq!(reader.join().unwrap(), "line\n");
        assert!(fs::metadata(&pipe).unwrap().file_type().is_fifo());
        // Nothing else appeared beside it (no temporary).
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        // A link (as /dev/stdout is) is written through and stays a link.
        let target = dir.path().join("target.jsonl");
        fs::write(&target, "old\n").unwrap();
        let link = dir.path().join("link.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write(&link, "new\n").unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_to_string(&target).unwrap(), "new\n");
        // A device too: writing /dev/null keeps it the character device it is.
        if Path::new("/dev/null").exists() {
            write(Path::new("/dev/null"), "gone\n").unwrap();
            assert!(fs::metadata("/dev/null")
                .unwrap()
                .file_type()
                .is_char_device());
        }
    }

    #[test]
    fn temporary_names_keep_the_extension() {
        let t = temporary_name(Path::new("run/loss.png"));
        assert_eq!(t.parent(), Some(Path::new("run")));
        assert_eq!(t.extension().unwrap(), "png");
        assert!(t
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".loss.tmp-"));
    }

    #[test]
    fn destinations_are_checked_without_writing() {
        let dir = tempfile::tempdir().unwrap();
        check_destination(&dir.path().join("out.jsonl")).unwrap();
        for (path, want) in [
            (dir.path().join("nope/x.jsonl"), "is not a directory"),
            (dir.path().to_path_buf(), "it is a directory"),
            (dir.path().join(".."), "it is a directory"),
        ] {
            let e = check_destination(&path).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", path.display());
        }
        if Path::new("/dev/null").exists() {
            check_destination(Path::new("/dev/null")).unwrap();
        }
        // Nothing was created.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn writing_into_a_missing_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = write(&dir.path().join("nope/x.json"), "{}").unwrap_err();
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }
}
