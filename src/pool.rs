//! candle's CPU thread pool, tuned for few cores.
//!
//! candle runs its element-wise ops (and this crate's fused kernels) on a barrier pool
//! whose workers spin for 25,000 pause instructions (about half a millisecond) after every
//! op before they park, while the matrix products run on rayon's threads. On a machine
//! with as many compute threads as cores, a worker still spinning takes a core from the
//! product that follows: with two cores the quickstart step measured 11% faster with a
//! spin of 200 (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, read once when the pool starts;
//! alternating runs, AMD EPYC, 32 steps each: median 212 -> 235 pairs/s).
//!
//! The `gradcache` binary, the examples and the benchmarks call [`short_spin`] first thing
//! in `main`; a program of one's own can do the same, or set the variable itself.

/// The spin of candle's pool workers that [`short_spin`] sets.
pub const SHORT_SPIN: &str = "200";

/// Sets `CANDLE_BARRIER_POOL_SPIN_LIMIT` to [`SHORT_SPIN`] unless it is set already.
/// Returns whether it set it.
///
/// # Safety
/// It changes the process environment: call it before any other thread exists (first
/// thing in `main`), as `std::env::set_var` requires, and before candle's pool starts
/// (any candle op on the CPU starts it).
pub unsafe fn short_spin() -> bool {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_some() {
        return false;
    }
    std::env::set_var(VAR, SHORT_SPIN);
    true
}
