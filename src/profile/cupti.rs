//! What a step asks of the CUDA driver, counted through CUPTI's callback API
//! (`GRADCACHE_PROFILE=cupti`): kernel launches, allocations and frees from the memory
//! pool (with their bytes), copies between host and device (with their bytes), and the
//! time the host waits for the device (stream and context synchronisations and copies
//! to the host, from the call to its return, less the profile's own synchronisations).
//!
//! Every call of the driver API by any library in the process (candle's kernels and
//! cuBLAS included) passes the callback, which only adds to atomic counters. CUPTI
//! (`libcupti.so`, from the NVIDIA wheels) is loaded at run time: where it is missing the
//! profile says so and counts nothing. The callback reads the parameter records of the
//! driver's own header (`generated_cuda_meta.h`), whose layout CUPTI keeps stable.

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// CUPTI's callback record (`CUpti_CallbackData`), the fields read here.
#[repr(C)]
struct CallbackData {
    callback_site: u32,
    function_name: *const c_void,
    function_params: *const c_void,
}

/// `CUPTI_CB_DOMAIN_DRIVER_API`, `CUPTI_API_ENTER`.
const DRIVER_API: u32 = 1;
const ENTER: u32 = 0;

/// Driver API callback ids (`cupti_driver_cbid.h`), with each call's `_ptsz` form.
const ALLOC: [u32; 3] = [598, 599, 243]; // cuMemAllocAsync(_ptsz), cuMemAlloc_v2
const FREE: [u32; 3] = [600, 601, 245]; // cuMemFreeAsync(_ptsz), cuMemFree_v2
const H2D: [u32; 3] = [277, 421, 276]; // cuMemcpyHtoDAsync_v2(_ptsz), cuMemcpyHtoD_v2
const D2H: [u32; 3] = [279, 422, 278]; // cuMemcpyDtoHAsync_v2(_ptsz), cuMemcpyDtoH_v2
const LAUNCH: [u32; 4] = [307, 442, 652, 653]; // cuLaunchKernel(Ex)(_ptsz)
const SYNC: [u32; 3] = [126, 440, 17]; // cuStreamSynchronize(_ptsz), cuCtxSynchronize

/// Byte offsets of the size in the calls' parameter records: `bytesize` after the
/// pointer out-parameter; `ByteCount` after a device address and a host pointer.
const ALLOC_BYTES_AT: usize = 8;
const COPY_BYTES_AT: usize = 16;

#[derive(Default)]
struct Counts {
    launches: AtomicU64,
    allocs: AtomicU64,
    alloc_bytes: AtomicU64,
    frees: AtomicU64,
    h2d: AtomicU64,
    h2d_bytes: AtomicU64,
    d2h: AtomicU64,
    d2h_bytes: AtomicU64,
    waits: AtomicU64,
    wait_ns: AtomicU64,
}

fn counts() -> &'static Counts {
    static C: OnceLock<Counts> = OnceLock::new();
    C.get_or_init(Counts::default)
}

thread_local! {
    /// When the host began waiting in the driver call now under way on this thread.
    static WAIT_START: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The profile's own synchronisation is under way (not counted as a wait).
    pub(super) static OWN_SYNC: Cell<bool> = const { Cell::new(false) };
}

/// Reads the `usize` at `offset` of a parameter record.
///
/// # Safety
/// `params` points to a driver parameter record at least `offset + 8` bytes long.
unsafe fn size_at(params: *const c_void, offset: usize) -> u64 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: as the caller promises; the record is 8-byte aligned.
    unsafe { *(params.cast::<u8>().add(offset).cast::<usize>()) as u64 }
}

unsafe extern "C" fn callback(_: *mut c_void, domain: u32, cbid: u32, data: *const c_void) {
    if domain != DRIVER_API || data.is_null() {
        return;
    }
    // SAFETY: CUPTI passes a `CUpti_CallbackData` for the driver API domain.
    let data = unsafe { &*data.cast::<CallbackData>() };
    let c = counts();
    let add = |n: &AtomicU64, v: u64| {
        n.fetch_add(v, Ordering::Relaxed);
    };
    let waits = D2H.contains(&cbid) || SYNC.contains(&cbid);
    if data.callback_site != ENTER {
        if waits && !OWN_SYNC.with(Cell::get) {
            if let Some(start) = WAIT_START.with(|w| w.take()) {
                add(&c.wait_ns, start.elapsed().as_nanos() as u64);
                add(&c.waits, 1);
            }
        }
        return;
    }
    let params = data.function_params;
    if LAUNCH.contains(&cbid) {
        add(&c.launches, 1);
    } else if ALLOC.contains(&cbid) {
        add(&c.allocs, 1);
        // SAFETY: an allocation's record holds its size after the out-pointer.
        add(&c.alloc_bytes, unsafe { size_at(params, ALLOC_BYTES_AT) });
    } else if FREE.contains(&cbid) {
        add(&c.frees, 1);
    } else if H2D.contains(&cbid) {
        add(&c.h2d, 1);
        // SAFETY: a copy's record holds its size after two addresses.
        add(&c.h2d_bytes, unsafe { size_at(params, COPY_BYTES_AT) });
    } else if D2H.contains(&cbid) {
        add(&c.d2h, 1);
        // SAFETY: as above.
        add(&c.d2h_bytes, unsafe { size_at(params, COPY_BYTES_AT) });
    }
    if waits && !OWN_SYNC.with(Cell::get) {
        WAIT_START.with(|w| w.set(Some(Instant::now())));
    }
}

type Subscribe = unsafe extern "C" fn(
    *mut *mut c_void,
    Option<unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void)>,
    *mut c_void,
) -> i32;
type EnableDomain = unsafe extern "C" fn(u32, *mut c_void, u32) -> i32;

/// Subscribes the counters to the driver API once; `Err` says why not (no CUPTI).
pub(super) fn start() -> Result<(), String> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            static LIB: OnceLock<libloading::Library> = OnceLock::new();
            let names = ["libcupti.so", "libcupti.so.13", "libcupti.so.12"];
            let lib = names
                .iter()
                // SAFETY: loading NVIDIA's profiling library runs no code of ours.
                .find_map(|n| unsafe { libloading::Library::new(*n) }.ok())
                .ok_or_else(|| {
                    format!(
                        "no CUPTI library ({}) on the library path",
                        names.join(", ")
                    )
                })?;
            let lib = LIB.get_or_init(|| lib);
            // SAFETY: the symbols' types are CUPTI's own (cupti_callbacks.h).
            unsafe {
                let subscribe = lib
                    .get::<Subscribe>(b"cuptiSubscribe\0")
                    .map_err(|e| format!("CUPTI's cuptiSubscribe: {e}"))?;
                let enable = lib
                    .get::<EnableDomain>(b"cuptiEnableDomain\0")
                    .map_err(|e| format!("CUPTI's cuptiEnableDomain: {e}"))?;
                let mut subscriber: *mut c_void = std::ptr::null_mut();
                let status = subscribe(&mut subscriber, Some(callback), std::ptr::null_mut());
                if status != 0 {
                    return Err(format!("cuptiSubscribe failed (CUPTI status {status})"));
                }
                let status = enable(1, subscriber, DRIVER_API);
                if status != 0 {
                    return Err(format!("cuptiEnableDomain failed (CUPTI status {status})"));
                }
            }
            Ok(())
        })
        .clone()
}

/// The counts since the last call, as profile entries (`count`, and `bytes` where the
/// entry moves memory), and a fresh start.
pub(super) fn take() -> Vec<super::Entry> {
    let c = counts();
    let t = |n: &AtomicU64| n.swap(0, Ordering::Relaxed);
    let entry = |name: &str, count: u64, bytes: u64, ms: f64| super::Entry {
        name: name.into(),
        count,
        total_ms: ms,
        gpu_peak_bytes: 0,
        bytes,
        flops: 0,
    };
    let wait_ms = t(&c.wait_ns) as f64 / 1e6;
    vec![
        entry("cuda.kernel-launches", t(&c.launches), 0, 0.0),
        entry("cuda.allocations", t(&c.allocs), t(&c.alloc_bytes), 0.0),
        entry("cuda.frees", t(&c.frees), 0, 0.0),
        entry("cuda.copies-to-device", t(&c.h2d), t(&c.h2d_bytes), 0.0),
        entry("cuda.copies-to-host", t(&c.d2h), t(&c.d2h_bytes), 0.0),
        entry("cuda.host-waits", t(&c.waits), 0, wait_ms),
    ]
}
