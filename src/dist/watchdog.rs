//! A watchdog over the collectives of a distributed run: a collective that has not
//! finished after `dist.timeout_s` seconds means a peer is gone or stuck (stopped, hung
//! in a driver call, on a node that stopped answering). The watchdog then names the
//! collective and ends this process with status 1, and the launcher (`mpirun`) ends the
//! others: the job ends instead of hanging until a scheduler's time limit. NCCL never
//! times out a collective on its own, and MPI does not either.
//!
//! Waits that are long by design are excluded (`patient`): the ranks waiting while
//! rank 0 evaluates or writes a checkpoint. A step's collectives wait only for the other
//! ranks' share of the same step. Collectives run on the training thread; the watchdog is
//! one thread that looks every second.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

/// The timeout in milliseconds (0: off).
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(0);
/// When the watched collective in progress began, in milliseconds since [`epoch`] plus
/// one (0: none in progress).
static STARTED: AtomicU64 = AtomicU64::new(0);
/// This process's rank, for the message.
static RANK: AtomicUsize = AtomicUsize::new(0);
/// The collective in progress.
static OP: Mutex<&'static str> = Mutex::new("");
static START_THREAD: Once = Once::new();

thread_local! {
    /// Collectives in progress on this thread (one may run inside another).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// Inside [`patient`]: waits are not timed.
    static PATIENT: Cell<bool> = const { Cell::new(false) };
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64 + 1
}

/// Times every collective of this process from now on: one that has not finished after
/// `timeout` ends the process (a zero timeout turns the watchdog off).
pub fn set_timeout(rank: usize, timeout: Duration) {
    RANK.store(rank, Ordering::Relaxed);
    TIMEOUT_MS.store(timeout.as_millis() as u64, Ordering::Relaxed);
    if timeout.is_zero() {
        return;
    }
    epoch();
    START_THREAD.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("gradcache-watchdog".into())
            .spawn(watch_loop);
        if let Err(e) = spawned {
            let line = format!("warning: the collective watchdog did not start: {e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
    });
}

fn watch_loop() {
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let (timeout, started) = (
            TIMEOUT_MS.load(Ordering::Relaxed),
            STARTED.load(Ordering::Relaxed),
        );
        if timeout == 0 || started == 0 || now_ms().saturating_sub(started) <= timeout {
            continue;
        }
        let op = OP.lock().map(|o| *o).unwrap_or("a collective");
        let line = format!(
            "error: [rank {}]: the {op} collective has not finished after {} s: a peer \
             process is gone or stuck; ending this process (dist.timeout_s, 0 turns this \
             off)\n",
            RANK.load(Ordering::Relaxed),
            timeout / 1000
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        // The training thread is blocked inside the collective: end the process without
        // running destructors that would wait on it.
        #[cfg(unix)]
        // SAFETY: `_exit` ends the process at once; nothing runs after it.
        unsafe {
            libc::_exit(1)
        };
        #[cfg(not(unix))]
        std::process::exit(1);
    }
}

/// Runs the collective `f` named `op` under the watchdog.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))]
pub(crate) fn watch<R>(op: &'static str, f: impl FnOnce() -> R) -> R {
    let outermost = DEPTH.with(|d| {
        d.set(d.get() + 1);
        d.get() == 1
    });
    let timed = outermost && !PATIENT.with(Cell::get);
    if timed {
        if let Ok(mut o) = OP.lock() {
            *o = op;
        }
        STARTED.store(now_ms(), Ordering::Relaxed);
    }
    let out = f();
    if timed {
        STARTED.store(0, Ordering::Relaxed);
    }
    DEPTH.with(|d| d.set(d.get() - 1));
    out
}

/// Runs `f` with its collectives' waits untimed: a wait that is long by design (the ranks
/// waiting for rank 0's evaluation or checkpoint).
pub(crate) fn patient<R>(f: impl FnOnce() -> R) -> R {
    let before = PATIENT.with(|p| p.replace(true));
    let out = f();
    PATIENT.with(|p| p.set(before));
    out
}
