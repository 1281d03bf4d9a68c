//! Counting heap allocations, to measure peak memory of a step on the CPU.
//!
//! CPU tensors live on the heap, so the largest number of bytes allocated at once during a
//! step is its peak memory (activations, gradients and temporaries). Install
//! [`CountingAllocator`] as the global allocator of a binary, then wrap the work in
//! [`measure`]:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOC: gradcache::memory::CountingAllocator = gradcache::memory::CountingAllocator;
//!
//! let (ms, peak_bytes, _out) = gradcache::memory::measure(|| vec![0u8; 1 << 20]);
//! ```
//!
//! Without the allocator installed, `measure` reports a peak of 0.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The bytes allocated, kept in [`SLOTS`] counters that the threads share out (each
/// thread adds to one, round-robin), each on its own cache line: the count is their sum.
/// One counter for all threads cost every allocation a trip of its cache line between
/// the cores, and where threads allocate at full speed they took turns on it. The
/// tokenizer's small strings and vectors, 4,000 texts on 2 threads of an AMD EPYC:
/// 120-127 ms with one counter, 97-103 with no count kept, 99-112 with these (4 rounds
/// each, alternating). On a lent GPU's host, 16 threads sharing the one counter, a
/// training step's 8,192 texts took 0.7 s to tokenize (docs/gpu.md; not yet measured
/// with these). A slot may go below zero (bytes freed on another thread than the one
/// that allocated them): each counts modulo 2^64, and so does their sum, which is exact.
static COUNTS: [Slot; SLOTS] = [const { Slot(AtomicUsize::new(0)) }; SLOTS];
const SLOTS: usize = 32;
/// The largest sum seen where it was looked at (see [`PEAK_CHECK`]).
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The slot the next thread to allocate takes.
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);
/// Allocations of this many bytes and more look at the sum for a new peak (as
/// [`measure`] and [`PhaseMeter`] do when they read it): a sum of
/// `SLOTS` counters is too costly for every small allocation, and memory peaks come
/// from buffers. What small allocations alone add between two looks and free again
/// before the next is not seen as a peak (the bytes they hold when a look comes are).
pub const PEAK_CHECK: usize = 16 << 10;

/// A counter alone on its cache line (two lines: Intel cores fetch them in pairs).
#[repr(align(128))]
struct Slot(AtomicUsize);

thread_local! {
    /// This thread's slot in [`COUNTS`], taken at its first allocation.
    static MY_SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The system allocator, counting the bytes currently allocated and their peak.
pub struct CountingAllocator;

#[inline(always)]
fn slot() -> &'static AtomicUsize {
    let i = MY_SLOT.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
            s.set(i);
        }
        i
    });
    &COUNTS[i].0
}

/// The bytes allocated now: the sum of the slots. The slots are read one after another
/// while the threads go on, so a sum may see a buffer freed on one thread and the next
/// allocated on another both at once, or neither (by one buffer, in the nanoseconds the
/// reads take); a sum that would be below zero reads 0.
fn total() -> usize {
    let sum = COUNTS.iter().fold(0usize, |sum, c| {
        sum.wrapping_add(c.0.load(Ordering::Relaxed))
    });
    if sum > isize::MAX as usize {
        0
    } else {
        sum
    }
}

/// The sum now, raising the peak to it.
fn look() -> usize {
    let now = total();
    // A read first: `fetch_max` is a compare-and-swap loop that takes the cache line for
    // writing on every call, even when the peak stands.
    if now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
    now
}

#[inline(always)]
fn grew(bytes: usize, size: usize) {
    slot().fetch_add(bytes, Ordering::Relaxed);
    if size >= PEAK_CHECK {
        look();
    }
}

#[inline(always)]
fn shrank(bytes: usize) {
    slot().fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// only bookkeeping.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size(), layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size(), layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size(), new_size);
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// The largest buffer glibc's malloc serves from its heaps once [`keep_freed_memory`] ran
/// (larger ones get their own mapping, given back when freed).
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// The free memory a heap keeps at its top for reuse once [`keep_freed_memory`] ran,
/// before it gives the rest back to the system.
pub const TRIM_THRESHOLD: usize = 64 << 20;

/// Has glibc's malloc keep freed buffers for the next ones instead of giving their pages
/// back to the system at once. Returns whether it changed anything.
///
/// A layer's forward and backward allocate and free buffers of a few MiB by the dozen;
/// by default glibc maps the largest afresh and trims freed memory off its heaps, so each
/// such buffer costs page faults and the kernel zeroing its pages again (most of the
/// system time of `gradcache encode` and of a small model's training step). With buffers
/// up to [`MMAP_THRESHOLD`] served from the heaps and up to [`TRIM_THRESHOLD`] of free
/// memory kept at each heap's top, the pages are reused: on 2 cores of an AMD EPYC the
/// quickstart's steps took 0.82x the time, `encode` of 4,000 texts with all-MiniLM-L6-v2
/// 0.96x-1.00x and its training 0.99x, for a peak resident memory 2%, 6-10% and 6% higher
/// (freed memory kept, at most the threshold per heap; docs/benchmarks.md). The
/// allocations counted by [`CountingAllocator`] do not change.
///
/// It leaves malloc as it is where the user has tuned it (a `MALLOC_*_` variable or
/// `GLIBC_TUNABLES` naming `glibc.malloc`), and off glibc. The `gradcache` binary calls it
/// first thing in `main`; a program of one's own can too (it may run at any time).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if malloc_tuned(std::env::vars_os()) {
            return false;
        }
        // SAFETY: mallopt only sets two of malloc's thresholds (it takes malloc's own
        // lock); both values fit a c_int.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether these environment variables set glibc malloc's thresholds: a `MALLOC_*_`
/// variable (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TOP_PAD_`, ...)
/// or `GLIBC_TUNABLES` naming a `glibc.malloc` tunable.
fn malloc_tuned(vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>) -> bool {
    vars.into_iter().any(|(name, value)| {
        let name = name.to_string_lossy();
        (name.starts_with("MALLOC_") && name.ends_with('_'))
            || (name == "GLIBC_TUNABLES" && value.to_string_lossy().contains("glibc.malloc"))
    })
}

/// `bytes` for people: `1.50 GiB`, `312.0 MiB`, `12.0 KiB`, `900 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            let digits = if unit == "GiB" { 2 } else { 1 };
            return format!("{:.*} {unit}", digits, bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// Bytes allocated right now (0 unless [`CountingAllocator`] is installed).
pub fn current_bytes() -> usize {
    total()
}

/// Runs `f` and returns its wall time in milliseconds, the peak number of bytes allocated
/// during it above what was allocated before it, and its result. Measurements nest: an
/// enclosing `measure` (or [`PhaseMeter`]) still sees the peak reached inside.
pub fn measure<T>(f: impl FnOnce() -> T) -> (f64, usize, T) {
    let outer = PEAK.load(Ordering::Relaxed);
    let base = total();
    PEAK.store(base, Ordering::Relaxed);
    let start = Instant::now();
    let out = f();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    look();
    let peak = PEAK
        .fetch_max(outer, Ordering::Relaxed)
        .saturating_sub(base);
    (ms, peak, out)
}

/// Wall time and peak memory of consecutive phases of one piece of work (a training step),
/// every peak counted from the bytes allocated when the meter started, so the phases of a
/// step compare directly. Nests inside [`measure`] like `measure` itself.
pub struct PhaseMeter {
    base: usize,
    outer: usize,
    lap_start: Instant,
}

impl PhaseMeter {
    /// Starts the first phase.
    pub fn start() -> Self {
        let outer = PEAK.load(Ordering::Relaxed);
        let base = total();
        PEAK.store(base, Ordering::Relaxed);
        Self {
            base,
            outer,
            lap_start: Instant::now(),
        }
    }

    /// Ends the current phase and starts the next: the phase's wall time and its peak bytes
    /// above the meter's start.
    pub fn lap(&mut self) -> (std::time::Duration, usize) {
        let now = Instant::now();
        let time = now - self.lap_start;
        self.lap_start = now;
        let now = look();
        let peak = PEAK.swap(now, Ordering::Relaxed);
        self.outer = self.outer.max(peak);
        (time, peak.saturating_sub(self.base))
    }
}

impl Drop for PhaseMeter {
    fn drop(&mut self) {
        PEAK.fetch_max(self.outer, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
        list.iter().map(|(n, v)| (n.into(), v.into())).collect()
    }

    #[test]
    fn a_users_malloc_settings_are_left_alone() {
        assert!(!malloc_tuned(vars(&[
            ("PATH", "/bin"),
            ("MALLOC_ARENA_MAX", "2")
        ])));
        assert!(malloc_tuned(vars(&[("MALLOC_TRIM_THRESHOLD_", "0")])));
        assert!(malloc_tuned(vars(&[("MALLOC_TOP_PAD_", "1")])));
        assert!(malloc_tuned(vars(&[(
            "GLIBC_TUNABLES",
            "glibc.rtld.optional_static_tls=1:glibc.malloc.trim_threshold=0"
        )])));
        assert!(!malloc_tuned(vars(&[(
            "GLIBC_TUNABLES",
            "glibc.rtld.optional_static_tls=1"
        )])));
    }

    #[test]
    fn glibc_takes_both_thresholds() {
        // mallopt refuses a value it cannot take (returns 0): both must be accepted here,
        // unless this process's environment tunes malloc itself.
        let expected = cfg!(all(target_os = "linux", target_env = "gnu"))
            && !malloc_tuned(std::env::vars_os());
        assert_eq!(keep_freed_memory(), expected);
    }
}
