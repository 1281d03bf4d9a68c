//! Subnormal floats: flush-to-zero (FTZ) and denormals-are-zero (DAZ) on every thread
//! that computes.
//!
//! An f32 below `f32::MIN_POSITIVE` (1.18e-38) and above 0 is subnormal. Intel cores run
//! every instruction with a subnormal input or output through a microcode assist of the
//! order of a hundred cycles; AMD Zen cores take most at full speed. A kernel that lets
//! them through can be several times slower on one vendor than on the other with the same
//! code and data (the quickstart, 20 steps on an Intel Xeon: 63 s with them, 14.6 s
//! without; on an AMD EPYC 16 s either way). Two things keep them out:
//!
//! 1. **Exact zeros by construction.** The kernels never produce a subnormal where the
//!    true value is below the normal range: [`crate::nn::cpu::exp`] returns 0 there, the
//!    attention softmax gives masked keys probability 0 without computing them, and small
//!    probabilities are flushed to 0. This holds whatever the floating-point environment.
//! 2. **FTZ and DAZ** (bits 15 and 6 of the x86 `MXCSR` register) for what arithmetic can
//!    still produce (the product of two tiny numbers). `MXCSR` belongs to a thread and is
//!    inherited by nothing, so every thread that computes must set it:
//!    - the worker threads of the pools the computation runs on (candle's barrier pool,
//!      where its element-wise ops and this crate's kernels run; candle's own rayon pool;
//!      and the rayon pool the matrix products run on: the global one, or the pool the
//!      caller runs in) get the bits the first time [`flush`] runs on them and keep them
//!      (they run numeric kernels only; PyTorch's `torch.set_flush_denormal(True)` is the
//!      same trade);
//!    - the calling thread belongs to the user, whose own float code may rely on gradual
//!      underflow: [`flush`] sets the bits there for as long as the returned guard lives
//!      and restores the caller's register when it is dropped.
//!
//! The library's entry points ([`crate::GradCache`]'s phases and the functional
//! [`crate::cached`], every [`crate::Encoder`] built by this crate, [`crate::hub::embed`],
//! the trainers) hold a guard while they compute, so users of `GradCache` get it without
//! doing anything. Code that runs a model's layers directly (`Bert::hidden_states`, a
//! model of one's own on this crate's [`crate::nn`]) can hold one itself:
//!
//! ```
//! let _flush = gradcache::denormal::flush();
//! // ... forward and backward passes: subnormal results read as 0 on every thread ...
//! ```
//!
//! On other architectures the guard does nothing (aarch64 cores handle subnormals in
//! hardware at close to full speed); the exact zeros of point 1 hold everywhere.

use std::marker::PhantomData;
use std::sync::Once;

/// Flush-to-zero (MXCSR bit 15): a subnormal result becomes 0.
#[cfg(target_arch = "x86_64")]
const FTZ: u32 = 1 << 15;
/// Denormals-are-zero (MXCSR bit 6): a subnormal input reads as 0.
#[cfg(target_arch = "x86_64")]
const DAZ: u32 = 1 << 6;

/// The calling thread's floating-point control register (`MXCSR` on x86-64; 0 elsewhere).
#[inline]
fn read_control() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let mut value: u32 = 0;
        // SAFETY: stmxcsr stores the 32-bit MXCSR register to the given address, a live
        // local; it has no other effect.
        unsafe {
            core::arch::asm!(
                "stmxcsr [{ptr}]",
                ptr = in(reg) &mut value as *mut u32,
                options(nostack, preserves_flags)
            );
        }
        value
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Loads `value` into the calling thread's floating-point control register.
#[inline]
fn write_control(value: u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: ldmxcsr loads MXCSR from the given address; `value` was read from MXCSR and
    // only had its FTZ/DAZ bits changed, so no reserved bit is set (which would fault).
    unsafe {
        core::arch::asm!(
            "ldmxcsr [{ptr}]",
            ptr = in(reg) &value as *const u32,
            options(nostack, readonly, preserves_flags)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// Sets FTZ and DAZ on the calling thread, for good.
fn set_on_this_thread() {
    #[cfg(target_arch = "x86_64")]
    write_control(read_control() | FTZ | DAZ);
}

/// Whether FTZ and DAZ are both on in the calling thread (always `false` off x86-64).
pub fn is_on() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        read_control() & (FTZ | DAZ) == FTZ | DAZ
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Sets FTZ and DAZ on every worker of the pools the computation runs on, once per
/// process (the pools' threads live as long as the process).
fn set_on_pools() {
    static POOLS: Once = Once::new();
    POOLS.call_once(|| {
        // The calling thread takes part in each of these; the guard restores it.
        candle_core::utils::barrier_pool().execute(|_| set_on_this_thread());
        candle_core::utils::with_threadpool(|| rayon::broadcast(|_| set_on_this_thread()));
        rayon::broadcast(|_| set_on_this_thread());
    });
    // Called from inside a rayon pool of the user's, the matrix products run on that pool.
    if rayon::current_thread_index().is_some() && !is_on() {
        rayon::broadcast(|_| set_on_this_thread());
    }
}

/// While alive, FTZ and DAZ are on in the calling thread; dropping it restores the
/// thread's register as it was. Not `Send`: it belongs to the thread that made it.
#[must_use = "the calling thread flushes subnormals only while the guard lives"]
pub struct FlushGuard {
    saved: u32,
    _thread: PhantomData<*const ()>,
}

impl Drop for FlushGuard {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if read_control() != self.saved {
            write_control(self.saved);
        }
    }
}

/// Turns on flush-to-zero and denormals-are-zero: on the pools' worker threads for good
/// (once per process), on the calling thread until the returned guard is dropped. Cheap
/// after the first call (two register accesses); guards nest.
pub fn flush() -> FlushGuard {
    let saved = read_control();
    set_on_pools();
    set_on_this_thread();
    FlushGuard {
        saved,
        _thread: PhantomData,
    }
}

/// Whether FTZ and DAZ are on in every worker of the pools a computation runs on
/// (candle's barrier pool and its rayon pool, and the current rayon pool), as
/// [`flush`] leaves them. For tests and diagnostics.
pub fn on_in_pools() -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    let all = AtomicBool::new(true);
    let check = || {
        if !is_on() {
            all.store(false, Ordering::Relaxed);
        }
    };
    // The calling thread takes part in the barrier pool's work; only the workers count.
    let caller = std::thread::current().id();
    candle_core::utils::barrier_pool().execute(|_| {
        if std::thread::current().id() != caller {
            check();
        }
    });
    candle_core::utils::with_threadpool(|| rayon::broadcast(|_| check()));
    rayon::broadcast(|_| check());
    all.load(Ordering::Relaxed)
}

/// The number of subnormal values (neither zero nor normal) in `t`, for f32, f64, f16
/// and bf16 tensors (integer tensors have none).
pub fn count_subnormals(t: &candle_core::Tensor) -> candle_core::Result<usize> {
    use candle_core::DType;
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .filter(|v| v.is_subnormal())
            .count(),
        DType::F64 => flat
            .to_vec1::<f64>()?
            .iter()
            .filter(|v| v.is_subnormal())
            .count(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .filter(|v| v.classify() == std::num::FpCategory::Subnormal)
            .count(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .filter(|v| v.classify() == std::num::FpCategory::Subnormal)
            .count(),
        _ => 0,
    })
}
