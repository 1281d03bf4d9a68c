//! A deliberate fault for the tests of what a job does when one of its processes dies:
//! `GRADCACHE_KILL_AT=<rank>:<step>:<chunk>` makes the process of that rank kill itself
//! with SIGKILL in the replay of the cache step it is given as `step` (the steps done
//! before it: 0 for the first), just before replaying chunk `chunk` (chunks counted over
//! both sides, queries first). Nothing else reads it, and without it nothing happens; a
//! value that does not parse is ignored. The same as `kill -9` from outside, at a point a
//! test can name.

/// The chunk before whose replay this process dies in `step`, if `GRADCACHE_KILL_AT` names
/// this rank and step.
pub(crate) fn kill_point(rank: usize, step: u64) -> Option<usize> {
    let value = std::env::var("GRADCACHE_KILL_AT").ok()?;
    let mut parts = value.split(':').map(|p| p.trim().parse::<u64>().ok());
    let (Some(Some(r)), Some(Some(s)), Some(Some(c)), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    (r == rank as u64 && s == step).then_some(c as usize)
}

/// Ends this process at once with SIGKILL, as `kill -9` would.
pub(crate) fn die() {
    #[cfg(unix)]
    // SAFETY: raising a signal on this process; SIGKILL cannot be caught, so it ends here.
    unsafe {
        libc::raise(libc::SIGKILL);
    }
    std::process::abort();
}
