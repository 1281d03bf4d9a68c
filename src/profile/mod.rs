//! Where a step's time goes on a GPU (`GRADCACHE_PROFILE=1`; off by default, and then
//! nothing here costs more than a flag read).
//!
//! A GPU runs the kernels a step queues while the host goes on queueing, so the host's
//! clock says when work was queued, not when it ran. With profiling on, the device is
//! synchronised at the boundary of every span and phase, and the time between two
//! synchronisations is the device's time for what was queued between them (plus the
//! host's own work, which the spans also show when the device waits for it): the
//! phases of a step (the representation pass, the loss, the replay's forward and
//! backward, the gradient reduction, the optimizer), every layer node's forward and
//! backward summed over layers and chunks, and the peak of the GPU memory pool in each
//! phase. The synchronisations slow the step a little; the profile is for finding the
//! largest costs, the benchmark (profiling off) for the speed.
//!
//! The trainer prints the spans after each step and writes them into `metrics.jsonl`
//! (a `"profile"` line per step). With `GRADCACHE_PROFILE=cupti` on a GPU the step's
//! driver calls are counted too (`cupti`): kernel launches, allocations, copies each way
//! with their bytes, and the time the host waited for the device.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use candle_core::Device;

#[cfg(feature = "cuda")]
mod cupti;

/// Whether `GRADCACHE_PROFILE` is set to something other than `0` (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("GRADCACHE_PROFILE").is_ok_and(|v| !matches!(v.trim(), "" | "0"))
    })
}

/// Whether `GRADCACHE_PROFILE=cupti`: the driver calls are counted too.
fn counting() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("GRADCACHE_PROFILE").is_ok_and(|v| v.trim() == "cupti"))
}

/// One span's totals over the spans of that name since [`take`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Entry {
    /// What was timed.
    pub name: String,
    /// How many spans of that name ended.
    pub count: u64,
    /// Their total time, milliseconds.
    pub total_ms: f64,
    /// The most GPU memory in use (the pool's high mark, bytes) from the start of the
    /// phase each of them ran in to its end; 0 off a GPU.
    pub gpu_peak_bytes: u64,
    /// The bytes a counted driver call moved (allocations, copies); 0 for a span.
    pub bytes: u64,
    /// The arithmetic of the CPU's matrix products counted under the name (`2 m n k`
    /// each; see [`record_product`]); 0 for a span.
    pub flops: u64,
}

struct State {
    device: Option<Device>,
    entries: BTreeMap<String, Entry>,
    /// Why the driver calls are not counted, when they were asked for.
    uncounted: Option<String>,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(|| {
        Mutex::new(State {
            device: None,
            entries: BTreeMap::new(),
            uncounted: None,
        })
    })
}

/// The device whose queue the spans wait for (the trainer's).
pub fn set_device(device: &Device) {
    let uncounted = if counting() {
        start_counting(device).err()
    } else {
        None
    };
    if let Ok(mut s) = state().lock() {
        s.device = Some(device.clone());
        s.uncounted = uncounted;
    }
}

/// Starts counting the driver calls on a GPU.
fn start_counting(device: &Device) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cupti::start();
    }
    let _ = device;
    Err("needs a GPU".into())
}

fn device() -> Option<Device> {
    state().lock().ok().and_then(|s| s.device.clone())
}

/// Waits for the device's queue when profiling (a no-op otherwise).
pub fn sync() {
    if !enabled() {
        return;
    }
    if let Some(d) = device() {
        #[cfg(feature = "cuda")]
        cupti::OWN_SYNC.with(|o| o.set(true));
        let _ = d.synchronize();
        #[cfg(feature = "cuda")]
        cupti::OWN_SYNC.with(|o| o.set(false));
    }
}

/// A timed span: the device's queue is drained when it starts and when it ends.
#[must_use]
pub struct Span {
    name: String,
    start: Instant,
}

/// Starts a span named `name` when profiling; `None` (nothing timed) otherwise.
pub fn span(name: impl FnOnce() -> String) -> Option<Span> {
    if !enabled() {
        return None;
    }
    sync();
    Some(Span {
        name: name(),
        start: Instant::now(),
    })
}

impl Drop for Span {
    fn drop(&mut self) {
        sync();
        record(std::mem::take(&mut self.name), self.start.elapsed());
    }
}

/// Starts a phase of a step: a [`span`] from which the GPU memory pool's high mark
/// starts afresh (the spans inside it report the phase's peak so far).
pub fn phase(name: &'static str) -> Option<Span> {
    let s = span(|| name.to_string())?;
    if let Some(d) = device() {
        crate::device::reset_pool_peaks(&d);
    }
    Some(s)
}

/// Adds `elapsed` to the entry `name`, with the pool's high mark since the phase began.
pub fn record(name: String, elapsed: Duration) {
    if !enabled() {
        return;
    }
    let peak = device()
        .and_then(|d| crate::device::pool_memory(&d))
        .map_or(0, |m| m.used_high);
    if let Ok(mut s) = state().lock() {
        let e = s.entries.entry(name.clone()).or_insert_with(|| Entry {
            name,
            ..Entry::default()
        });
        e.count += 1;
        e.total_ms += elapsed.as_secs_f64() * 1e3;
        e.gpu_peak_bytes = e.gpu_peak_bytes.max(peak);
    }
}

/// The CPU's matrix products since the last [`take`]: calls, nanoseconds inside them,
/// arithmetic (counted without a lock: a layer runs thousands).
static PRODUCTS: [std::sync::atomic::AtomicU64; 3] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 3];

/// The name of the entry of the CPU's matrix products.
pub const CPU_PRODUCTS: &str = "cpu.products";

/// Adds one CPU matrix product `[m, k] x [k, n]` that took `elapsed` to the entry
/// [`CPU_PRODUCTS`], when profiling: its time is that of the calls (on as many threads as
/// each was given), its `flops` their `2 m n k`. Against a step's or an encoding's wall time
/// it says how much of it the products are, and at what speed they ran.
pub fn record_product(elapsed: Duration, (m, n, k): (usize, usize, usize)) {
    use std::sync::atomic::Ordering::Relaxed;
    if !enabled() {
        return;
    }
    PRODUCTS[0].fetch_add(1, Relaxed);
    PRODUCTS[1].fetch_add(elapsed.as_nanos() as u64, Relaxed);
    PRODUCTS[2].fetch_add(2 * (m * n * k) as u64, Relaxed);
}

/// The entries since the last call, in name order (the driver's counts last), and a
/// fresh start.
pub fn take() -> Vec<Entry> {
    let (mut entries, uncounted) = match state().lock() {
        Ok(mut s) => (
            std::mem::take(&mut s.entries)
                .into_values()
                .collect::<Vec<_>>(),
            s.uncounted.clone(),
        ),
        Err(_) => return Vec::new(),
    };
    let [count, nanos, flops] = PRODUCTS
        .each_ref()
        .map(|c| c.swap(0, std::sync::atomic::Ordering::Relaxed));
    if count > 0 {
        entries.push(Entry {
            name: CPU_PRODUCTS.into(),
            count,
            total_ms: nanos as f64 / 1e6,
            flops,
            ..Entry::default()
        });
        entries.sort_by(|a, b| a.name.cmp(&b.name));
    }
    if counting() {
        if let Some(why) = uncounted {
            entries.push(Entry {
                name: format!("cuda.not-counted ({why})"),
                ..Entry::default()
            });
        } else {
            #[cfg(feature = "cuda")]
            entries.extend(cupti::take());
        }
    }
    entries
}
