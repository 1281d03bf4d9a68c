//! Stopping a run cleanly on SIGINT or SIGTERM.
//!
//! A [`StopSignal`] is a flag that a signal handler (or any code: a test, a scheduler
//! hook) sets with the number of the signal. The gradient cache looks at it between
//! chunks of its representation pass and of its replay: a step that has not reached the
//! optimizer is abandoned there ([`Error::Interrupted`]) and changes nothing. The training
//! loop ([`crate::train::run::Run`]) then writes a checkpoint of the last finished step
//! and returns [`Error::Stopped`]; a stop that arrives after the optimizer has moved the
//! weights lets the step finish first. Resuming from that checkpoint gives the
//! uninterrupted run bit for bit. In a distributed run every rank takes the same decision
//! at the same point (see [`crate::dist::agree`]).
//!
//! [`StopSignal::install`] connects SIGINT, SIGTERM and SIGUSR1 to the flag. A second
//! SIGINT ends the process at once with the conventional code 130 (the first one is still
//! being honoured: a checkpoint may be half written, which the atomic writes of
//! [`crate::durable`] make harmless).
//!
//! Under Open MPI's `mpirun`, send SIGUSR1 to `mpirun`: it forwards that signal to every
//! rank. SIGINT or SIGTERM sent to `mpirun` itself reach the ranks as SIGTERM followed by
//! SIGKILL one second later (its `odls_base_sigkill_timeout`), too soon for a checkpoint
//! of any size. A batch scheduler that signals the ranks themselves (Slurm's `scancel`,
//! its `--signal`) needs nothing special: whichever ranks receive it, all stop at the same
//! step.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::{Error, Result};

/// SIGINT (Ctrl-C).
pub const SIGINT: i32 = 2;
/// SIGTERM (what `kill` and batch schedulers send).
pub const SIGTERM: i32 = 15;
/// SIGUSR1 (what `mpirun` forwards to every rank; Slurm's and Lightning's requeue signal).
#[cfg(unix)]
pub const SIGUSR1: i32 = libc::SIGUSR1;
/// SIGUSR1 (not delivered on this platform).
#[cfg(not(unix))]
pub const SIGUSR1: i32 = 10;

/// A request to stop, shared between a signal handler and the code that honours it.
#[derive(Debug, Clone, Default)]
pub struct StopSignal {
    signal: Arc<AtomicUsize>,
}

impl StopSignal {
    /// A flag no handler sets: only [`Self::request`] does.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop as if `signal` had arrived.
    pub fn request(&self, signal: i32) {
        self.signal.store(signal.max(1) as usize, Ordering::SeqCst);
    }

    /// Forgets a stop request that has been honoured (a library caller that goes on
    /// training in the same process after [`Error::Interrupted`] or [`Error::Stopped`]).
    pub fn clear(&self) {
        self.signal.store(0, Ordering::SeqCst);
    }

    /// The signal that asked to stop, if any.
    pub fn requested(&self) -> Option<i32> {
        match self.signal.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }

    /// `Err(Error::Interrupted)` once a stop was asked for.
    pub fn check(&self) -> Result<()> {
        match self.requested() {
            None => Ok(()),
            Some(signal) => Err(Error::Interrupted { signal }),
        }
    }

    /// The process's stop flag, set by SIGINT, SIGTERM and SIGUSR1 (handlers installed on
    /// the first call; later calls return the same flag). A second SIGINT exits at once with code
    /// 130. SIGXFSZ is caught too, so that a write past a file size limit (`ulimit -f`)
    /// fails with an error naming the file instead of killing the process.
    pub fn install() -> Result<Self> {
        static INSTALLED: OnceLock<std::result::Result<StopSignal, String>> = OnceLock::new();
        INSTALLED
            .get_or_init(|| install_handlers().map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| {
                Error::io(
                    "install signal handlers for",
                    std::path::Path::new("SIGINT and SIGTERM"),
                    reason,
                )
            })
    }
}

#[cfg(unix)]
fn install_handlers() -> std::io::Result<StopSignal> {
    use signal_hook::consts::{SIGINT as INT, SIGTERM as TERM, SIGUSR1 as USR1, SIGXFSZ};
    use signal_hook::flag;
    let stop = StopSignal::new();
    let seen = Arc::new(AtomicBool::new(false));
    // Registered first, so that it runs before `seen` is set: the first SIGINT does not
    // exit, the second does.
    flag::register_conditional_shutdown(INT, 128 + INT, Arc::clone(&seen))?;
    for signal in [INT, TERM, USR1] {
        flag::register(signal, Arc::clone(&seen))?;
        flag::register_usize(signal, Arc::clone(&stop.signal), signal as usize)?;
    }
    flag::register(SIGXFSZ, Arc::new(AtomicBool::new(false)))?;
    Ok(stop)
}

#[cfg(not(unix))]
fn install_handlers() -> std::io::Result<StopSignal> {
    use signal_hook::consts::{SIGINT as INT, SIGTERM as TERM};
    use signal_hook::flag;
    let stop = StopSignal::new();
    for signal in [INT, TERM] {
        flag::register_usize(signal, Arc::clone(&stop.signal), signal as usize)?;
    }
    Ok(stop)
}

/// `SIGINT`, `SIGTERM`, or `signal N`.
pub fn signal_name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGUSR1 => "SIGUSR1".into(),
        n => format!("signal {n}"),
    }
}

/// The exit code a process stopped by `signal` ends with (128 + the signal's number, as
/// shells report it: 130 for SIGINT, 143 for SIGTERM).
pub fn exit_code(signal: i32) -> u8 {
    (128 + signal.clamp(1, 127)) as u8
}
