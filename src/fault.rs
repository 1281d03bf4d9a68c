//! Deliberate faults for the tests of what a job does when one of its processes dies or
//! hangs: `GRADCACHE_KILL_AT=<rank>:<step>:<chunk>` makes the process of that rank kill
//! itself with SIGKILL, and `GRADCACHE_HANG_AT=...` stop itself with SIGSTOP (a process
//! that stays but answers nothing), in the replay of the cache step it is given as `step`
//! (the steps done before it: 0 for the first), just before replaying chunk `chunk`
//! (chunks counted over both sides, queries first). Nothing else reads them, and without
//! them nothing happens; a value that does not parse is ignored. The same as `kill -9` or
//! `kill -STOP` from outside, at a point a test can name.

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Hang,
}

/// The chunk before whose replay this process meets a fault in `step`, and the fault, if
/// `GRADCACHE_KILL_AT` or `GRADCACHE_HANG_AT` names this rank and step.
pub(crate) fn fault_point(rank: usize, step: u64) -> Option<(usize, Fault)> {
    [
        ("GRADCACHE_KILL_AT", Fault::Kill),
        ("GRADCACHE_HANG_AT", Fault::Hang),
    ]
    .into_iter()
    .find_map(|(var, fault)| Some((point(&std::env::var(var).ok()?, rank, step)?, fault)))
}

/// The chunk of `rank:step:chunk` when it names this rank and step.
fn point(value: &str, rank: usize, step: u64) -> Option<usize> {
    let mut parts = value.split(':').map(|p| p.trim().parse::<u64>().ok());
    let (Some(Some(r)), Some(Some(s)), Some(Some(c)), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    (r == rank as u64 && s == step).then_some(c as usize)
}

/// Meets `fault`: ends this process at once (SIGKILL), or stops it (SIGSTOP) until it is
/// continued or killed.
pub(crate) fn meet(fault: Fault) {
    #[cfg(unix)]
    // SAFETY: raising a signal on this process: SIGKILL cannot be caught and ends it;
    // SIGSTOP cannot be caught and stops it.
    unsafe {
        libc::raise(match fault {
            Fault::Kill => libc::SIGKILL,
            Fault::Hang => libc::SIGSTOP,
        });
    }
    if fault == Fault::Kill {
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_point_names_a_rank_a_step_and_a_chunk() {
        assert_eq!(point("1:5:2", 1, 5), Some(2));
        assert_eq!(point("1:5:2", 0, 5), None);
        assert_eq!(point("1:5:2", 1, 4), None);
        for bad in ["", "1:5", "1:5:2:3", "a:5:2", "1:-5:2"] {
            assert_eq!(point(bad, 1, 5), None, "{bad}");
        }
    }
}
