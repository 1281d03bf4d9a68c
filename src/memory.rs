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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes currently allocated and their peak.
pub struct CountingAllocator;

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// only bookkeeping.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
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
    CURRENT.load(Ordering::Relaxed)
}

/// Runs `f` and returns its wall time in milliseconds, the peak number of bytes allocated
/// during it above what was allocated before it, and its result. Measurements nest: an
/// enclosing `measure` (or [`PhaseMeter`]) still sees the peak reached inside.
pub fn measure<T>(f: impl FnOnce() -> T) -> (f64, usize, T) {
    let outer = PEAK.load(Ordering::Relaxed);
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let start = Instant::now();
    let out = f();
    let ms = start.elapsed().as_secs_f64() * 1e3;
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
        let base = CURRENT.load(Ordering::Relaxed);
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
        let peak = PEAK.swap(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
        self.outer = self.outer.max(peak);
        (time, peak.saturating_sub(self.base))
    }
}

impl Drop for PhaseMeter {
    fn drop(&mut self) {
        PEAK.fetch_max(self.outer, Ordering::Relaxed);
    }
}
