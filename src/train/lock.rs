//! One run per output directory: the lock file `gradcache.lock`.
//!
//! Two runs writing one directory would overwrite each other's checkpoints and metrics.
//! A run holds an exclusive advisory lock (`flock`) on `output_dir/gradcache.lock` for as
//! long as it lives, and writes its process id, host and start time into it; a second run
//! on the directory is refused with that name. The kernel releases the lock when its
//! process ends however it ends (`kill -9` included), so a lock file left by a run that
//! is gone is found unlocked and taken over with a note naming the old owner.
//!
//! The kernel's lock is trusted first: once `flock` is granted, the previous holder holds
//! it no more, whatever its process id shows (a process still being torn down after
//! `mpirun` killed the job, a zombie, an id reused by another program). Whether the file
//! system enforces `flock` at all is checked by locking the file a second time from this
//! process (a second open file must be refused); where it is not enforced (some network
//! file systems), the lock falls back to the recorded process id: a file naming a live
//! process of this host is refused, and the run says that it relies on that check. A file
//! that names another host is never taken over (that run cannot be checked from here):
//! delete it by hand once that run is known to be gone. In a distributed run rank 0 holds
//! the lock.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The lock file's name in a run directory.
pub const LOCK_FILE: &str = "gradcache.lock";

/// Who holds (or held) a run directory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LockOwner {
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub host: String,
    /// When the run took the lock, in seconds since the Unix epoch.
    #[serde(default)]
    pub started: u64,
}

impl LockOwner {
    /// This process.
    pub fn this_process() -> Self {
        Self {
            pid: std::process::id(),
            host: host_name(),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

impl std::fmt::Display for LockOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "process {} on host {}", self.pid, self.host)
    }
}

/// The lock of a run directory, released (and its file removed) when dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    file: File,
    taken_over: Option<LockOwner>,
    enforced: bool,
}

impl RunLock {
    /// Takes the lock of run directory `dir`, creating the directory. Refused with
    /// [`Error::RunLocked`] while another run holds it; a lock left by a process that is
    /// gone (same host) is taken over ([`RunLock::taken_over`] names it).
    pub fn acquire(dir: &Path) -> Result<Self> {
        Self::acquire_with(dir, flock_enforced)
    }

    /// [`RunLock::acquire`] with `enforced` telling whether the kernel enforces the lock
    /// on a file (the probe; a test stands in a file system that does not).
    fn acquire_with(dir: &Path, enforced: fn(&Path) -> bool) -> Result<Self> {
        if dir.exists() && !dir.is_dir() {
            return Err(Error::io(
                "use",
                dir,
                "it is a file, and a run's output_dir is a directory (a new one, or the run's \
                 own to resume or extend)",
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let path = dir.join(LOCK_FILE);
        // A run that ends removes the file while it still holds the lock; one that opened
        // the file just before may then lock an unlinked file: try again on the new one.
        for _ in 0..16 {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| Error::io("open", &path, e))?;
            match try_lock(&file) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(Error::RunLocked {
                        dir: dir.to_path_buf(),
                        owner: describe(read_owner(&mut file).as_ref()),
                        hint: "wait for it to finish, or give this run another output_dir",
                    })
                }
                Err(e) => return Err(Error::io("lock", &path, e)),
            }
            if !same_file(&file, &path) {
                continue;
            }
            let previous = read_owner(&mut file);
            let me = LockOwner::this_process();
            let enforced = enforced(&path);
            if let Some(prev) = &previous {
                if prev.host != me.host {
                    return Err(Error::RunLocked {
                        dir: dir.to_path_buf(),
                        owner: describe(Some(prev)),
                        hint: "a lock of another host cannot be checked from here; if that run \
                               is gone, delete the lock file",
                    });
                }
                // With the kernel's lock enforced and granted, the previous holder has let
                // go of it, whatever its process id shows. Without it, an unlocked file
                // whose process lives may belong to a running run: refuse rather than guess.
                if !enforced && prev.pid != me.pid && process_alive(prev.pid) {
                    return Err(Error::RunLocked {
                        dir: dir.to_path_buf(),
                        owner: describe(Some(prev)),
                        hint: "that process is still running; if it is not a gradcache run, \
                               delete the lock file",
                    });
                }
            }
            let json = serde_json::to_string(&me).map_err(|e| Error::io("write", &path, e))?;
            file.set_len(0)
                .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
                .and_then(|()| file.write_all(format!("{json}\n").as_bytes()))
                .and_then(|()| file.sync_all())
                .map_err(|e| Error::io("write", &path, e))?;
            return Ok(Self {
                path,
                file,
                taken_over: previous,
                enforced,
            });
        }
        Err(Error::io(
            "lock",
            &path,
            "the lock file kept changing under this run",
        ))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The owner named by a lock file this run found unlocked and took over (its process
    /// had ended without removing it), if any.
    pub fn taken_over(&self) -> Option<&LockOwner> {
        self.taken_over.as_ref()
    }

    /// Whether the file system enforces the kernel's lock on this file; when it does not,
    /// a concurrent run is told apart by its recorded process id only.
    pub fn enforced(&self) -> bool {
        self.enforced
    }
}

/// Whether the kernel enforces `flock` on `path`, whose lock this process holds through
/// another open file: a second open file of it must be refused the lock.
fn flock_enforced(path: &Path) -> bool {
    match File::open(path) {
        Ok(second) => matches!(try_lock(&second), Ok(false)),
        Err(_) => false,
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Removed while still locked, so no other run can have taken it meanwhile; the lock
        // itself goes with the file handle.
        let _ = std::fs::remove_file(&self.path);
        unlock(&self.file);
    }
}

/// Takes an exclusive `flock` on `file` without waiting: `Ok(false)` when another open
/// file (another process, or another run of this one) holds it.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor this process owns for the call's duration.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

#[cfg(unix)]
fn unlock(file: &File) {
    use std::os::unix::io::AsRawFd;
    // SAFETY: as in `try_lock`; closing the file would release the lock too.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
}

#[cfg(not(unix))]
fn unlock(_file: &File) {}

fn read_owner(file: &mut File) -> Option<LockOwner> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

fn describe(owner: Option<&LockOwner>) -> String {
    match owner {
        Some(o) => o.to_string(),
        None => "a process that has not written its name yet".into(),
    }
}

/// Whether the open `file` is still the one named `path` (not removed or replaced).
#[cfg(unix)]
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_file(_file: &File, path: &Path) -> bool {
    path.exists()
}

/// Whether process `pid` exists on this host.
#[cfg(unix)]
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 checks for the process without sending anything.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn process_alive(_pid: u32) -> bool {
    false
}

/// This host's name.
pub fn host_name() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: the buffer is writable for its whole length, which is passed.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            if end > 0 {
                return String::from_utf8_lossy(&buf[..end]).into_owned();
            }
        }
    }
    std::env::var("HOSTNAME")
        .or_else(|_| std::env::var("COMPUTERNAME"))
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock file naming `pid` of this host, as a run killed with `-9` leaves it.
    fn left_by(dir: &Path, pid: u32) {
        let owner = LockOwner {
            pid,
            ..LockOwner::this_process()
        };
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(LOCK_FILE), serde_json::to_string(&owner).unwrap()).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_free_kernel_lock_is_taken_over_whatever_its_process_id_shows() {
        let dir = tempfile::tempdir().unwrap();
        // Process 1 lives (it is never a gradcache run here); its file holds no lock.
        left_by(dir.path(), 1);
        let lock = RunLock::acquire(dir.path()).unwrap();
        assert!(lock.enforced(), "the test's file system enforces flock");
        assert_eq!(lock.taken_over().map(|o| o.pid), Some(1));
        // Held, the directory is refused to a second run of this very process.
        let err = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(err.contains("in use by another training run"), "{err}");
    }

    #[test]
    fn a_file_for_the_run_directory_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("run");
        std::fs::write(&file, "notes\n").unwrap();
        let err = RunLock::acquire(&file).unwrap_err().to_string();
        assert!(
            err.contains("it is a file") && err.contains("output_dir"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "notes\n");
    }

    #[cfg(unix)]
    #[test]
    fn without_an_enforced_lock_a_live_process_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        left_by(dir.path(), 1);
        let err = RunLock::acquire_with(dir.path(), |_| false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("process 1 on host") && err.contains("still running"),
            "{err}"
        );
        // A process that is gone is taken over either way.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        left_by(dir.path(), child.id());
        let lock = RunLock::acquire_with(dir.path(), |_| false).unwrap();
        assert!(!lock.enforced());
        assert_eq!(lock.taken_over().map(|o| o.pid), Some(child.id()));
    }
}
