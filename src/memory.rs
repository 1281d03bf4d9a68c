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

/// Bytes allocated right now (0 unless [`CountingAllocator`] is installed).
pub fn current_bytes() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// Runs `f` and returns its wall time in milliseconds, the peak number of bytes allocated
/// during it above what was allocated before it, and its result.
pub fn measure<T>(f: impl FnOnce() -> T) -> (f64, usize, T) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let start = Instant::now();
    let out = f();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (ms, peak, out)
}
