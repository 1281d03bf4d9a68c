//! The thread-block helpers every CPU kernel runs on: the float types, rows split into
//! fixed blocks on candle's thread pool (reductions summed per block in block order, so
//! nothing depends on the thread count), the kernels' copies compiled for AVX2 + FMA and
//! AVX-512 ([`wide_fn`]), and the serial mode for data parallelism across independent
//! pieces of work.

/// Rows handled by one parallel task; also the granularity of cross-row reductions.
pub(crate) const BLOCK_ROWS: usize = 32;

/// The float types the kernels run in.
pub trait Float:
    num_traits::Float
    + Send
    + Sync
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::ops::DivAssign
    + candle_core::WithDType
    + crate::sink::Grad
{
    /// From an f64 constant.
    fn of(x: f64) -> Self;
}

impl Float for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
}

impl Float for f64 {
    fn of(x: f64) -> Self {
        x
    }
}

/// A pointer that may cross threads; each task derives a disjoint slice from it.
pub(crate) struct SharedMut<T>(pub(crate) *mut T);

impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: only used by `for_blocks`, whose tasks write disjoint ranges.
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

/// A read-only pointer that may cross threads.
#[derive(Clone, Copy)]
pub(crate) struct SharedConst<T>(pub(crate) *const T);

impl<T> SharedConst<T> {
    pub(crate) fn get(self) -> *const T {
        self.0
    }
}

// SAFETY: only read, by tasks that run while the buffer is borrowed by the caller.
unsafe impl<T: Sync> Send for SharedConst<T> {}
unsafe impl<T: Sync> Sync for SharedConst<T> {}

/// Runs `f(range)` over `0..items` split into ranges, on candle's own CPU thread pool (the
/// one its element-wise ops use: a second pool would compete with candle's workers, which
/// spin between ops), the calling thread taking part.
pub(crate) fn parallel_ranges(items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if in_serial() {
        f(0..items);
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(items, f);
}

thread_local! {
    static SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread runs the kernels serially ([`serial`]).
pub(crate) fn in_serial() -> bool {
    SERIAL.with(|s| s.get())
}

/// Runs `f` with every fused kernel and the encoder layer's products on this thread
/// alone: for data parallelism across independent pieces of work (inference chunks on
/// several threads at once), where splitting each small op across threads would only
/// add synchronisation. Same arithmetic, same results.
pub fn serial<R>(f: impl FnOnce() -> R) -> R {
    let before = SERIAL.with(|s| s.replace(true));
    let out = f();
    SERIAL.with(|s| s.set(before));
    out
}

/// Runs `f(block, rows)` for every block of `BLOCK_ROWS` rows of width `width` of `out`
/// ([`parallel_ranges`]).
pub(crate) fn for_blocks<T: Send + Sync>(
    out: &mut [T],
    width: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let block = BLOCK_ROWS * width.max(1);
    let (len, ptr) = (out.len(), SharedMut(out.as_mut_ptr()));
    let blocks = len.div_ceil(block);
    parallel_ranges(blocks, |range| {
        for b in range {
            let start = b * block;
            let end = len.min(start + block);
            // SAFETY: blocks are disjoint ranges of `out`, which outlives the call (the
            // pool returns only when every task is done).
            let rows = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), end - start) };
            f(b, rows);
        }
    });
}

/// The widest vectors a kernel copy may use on this CPU (detected once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Vectors {
    /// The build's baseline: SSE2, four f32 lanes.
    Baseline = 0,
    /// AVX2 + FMA: eight.
    Avx2 = 1,
    /// AVX-512 (F) with AVX2 + FMA: sixteen.
    Avx512 = 2,
}

/// The widest copy this CPU runs ([`Vectors`]); in tests, at most [`WIDEST`].
#[cfg(target_arch = "x86_64")]
pub(crate) fn vectors() -> Vectors {
    static HAS: std::sync::OnceLock<Vectors> = std::sync::OnceLock::new();
    let has = *HAS.get_or_init(|| {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match (avx2, is_x86_feature_detected!("avx512f")) {
            (true, true) => Vectors::Avx512,
            (true, false) => Vectors::Avx2,
            _ => Vectors::Baseline,
        }
    });
    #[cfg(test)]
    {
        let cap = match WIDEST.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Vectors::Baseline,
            1 => Vectors::Avx2,
            _ => Vectors::Avx512,
        };
        return has.min(cap);
    }
    #[allow(unreachable_code)]
    has
}

/// Defines a kernel function three times: as written, and copies compiled for AVX2 + FMA
/// and for AVX-512, the widest the CPU has running ([`vectors`]; the build targets
/// baseline x86-64, whose SSE2 vectors hold four f32). The copies matter for the closures
/// a kernel hands to [`for_blocks`]: a closure is compiled with the target features of the
/// function it is written in, and the compiler will not inline a large one into a wider
/// caller, so wrapping the closure's call in a wider function leaves its loops at SSE2
/// width (this crate did, and its kernels ran at SSE2 width until the copies moved here).
/// Nothing is reassociated or fused by a wider copy (Rust never contracts `a * b + c` into
/// an FMA, and reductions keep their order): every copy gives the same bits. An explicit
/// `mul_add` (the exponential and GELU of [`crate::nn::cpu::elementwise::math`]) is one rounding
/// in every copy: an FMA instruction in the wide ones, libm's exact `fma` in the baseline one
/// (slow, for CPUs without AVX2 and FMA alone); any function that takes one must run inside a copy
/// (`#[inline(always)]` down from it), not compiled for the baseline on its own.
///
/// The function's generics are `T: Float` (after any lifetimes) and each argument a name
/// or a tuple of names (passed on as written).
macro_rules! wide_fn {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<$($lt:lifetime,)* T: Float>($($arg:tt: $ty:ty),* $(,)?)
            $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($lt,)* T: Float>($($arg: $ty),*) $(-> $ret)? {
            $crate::nn::cpu::blocks::wide_fn!(@copies ($($lt,)*) ($($arg: $ty),*) ($($ret)?) $body);
            $body
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis unsafe fn $name:ident<$($lt:lifetime,)* T: Float>($($arg:tt: $ty:ty),* $(,)?)
            $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis unsafe fn $name<$($lt,)* T: Float>($($arg: $ty),*) $(-> $ret)? {
            // The caller keeps this function's contract, which the copies share.
            $crate::nn::cpu::blocks::wide_fn!(@copies ($($lt,)*) ($($arg: $ty),*) ($($ret)?) $body);
            $body
        }
    };
    // The wider copies, and the return through the widest this CPU runs.
    (@copies ($($lt:lifetime,)*) ($($arg:tt: $ty:ty),*) ($($ret:ty)?) $body:block) => {
        #[cfg(target_arch = "x86_64")]
        {
            use $crate::nn::cpu::blocks::{vectors, Vectors};
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx2<$($lt,)* T: Float>($($arg: $ty),*) $(-> $ret)? $body
            #[target_feature(enable = "avx512f,avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx512<$($lt,)* T: Float>($($arg: $ty),*) $(-> $ret)? $body
            match vectors() {
                // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (checked).
                Vectors::Avx512 => return unsafe { avx512::<T>($($arg),*) },
                // SAFETY: the CPU has AVX2 and FMA (checked).
                Vectors::Avx2 => return unsafe { avx2::<T>($($arg),*) },
                Vectors::Baseline => {}
            }
        }
    };
}
pub(crate) use wide_fn;

/// `len` zeros with room for `extra` more: a backward kernel appends its parameter
/// gradients to its input gradient, and a vector grown past its capacity would double it,
/// a copy and an activation-sized allocation that the output would then hold.
pub(crate) fn zeros_with_room<T: Float>(len: usize, extra: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(len + extra);
    v.resize(len, T::zero());
    v
}

/// Like [`for_blocks`], with one partial vector of `partial_len` per block (for reductions
/// across rows), returned one after another in block order.
pub(crate) fn for_blocks_with_partials<T: Float>(
    out: &mut [T],
    width: usize,
    partial_len: usize,
    f: impl Fn(usize, &mut [T], &mut [T]) + Sync,
) -> Vec<T> {
    let blocks = out.len().div_ceil(BLOCK_ROWS * width.max(1));
    let mut partials = vec![T::zero(); blocks * partial_len];
    let shared = SharedMut(partials.as_mut_ptr());
    for_blocks(out, width, |b, rows| {
        // SAFETY: block `b` owns partials `b * partial_len .. (b + 1) * partial_len`.
        let partial = unsafe {
            std::slice::from_raw_parts_mut(shared.get().add(b * partial_len), partial_len)
        };
        f(b, rows, partial);
    });
    partials
}

/// Sums per-block partial vectors of `width` (one after another) in block order
/// (deterministic).
pub(crate) fn sum_partials<T: Float>(partials: &[T], width: usize) -> Vec<T> {
    let mut total = vec![T::zero(); width];
    for p in partials.chunks(width.max(1)) {
        for (t, &v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

/// The widest copy the kernels may take in tests (0 baseline, 1 AVX2, 2 AVX-512).
#[cfg(test)]
pub(crate) static WIDEST: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Held by a unit test that lowers [`WIDEST`], and by one that expects [`vectors`] to
/// answer the CPU's own widest copy: the cap is the whole test process's.
#[cfg(test)]
pub(crate) fn widest_held() -> std::sync::MutexGuard<'static, ()> {
    static HELD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<T>()?[start..end]),
        None => candle_core::bail!("fused kernels need contiguous inputs"),
    }
}

/// Checks that a per-feature vector (`what`: a bias, a LayerNorm scale) has the length of
/// `x`'s last dimension; the row kernels would read out of bounds otherwise.
pub(crate) fn check_width(
    op: &str,
    what: &str,
    x: &candle_core::Layout,
    v: &candle_core::Layout,
) -> candle_core::Result<()> {
    let last = x.shape().dims().last().copied().unwrap_or(1);
    if v.shape().elem_count() != last {
        candle_core::bail!(
            "{op}: {what} {:?} does not fit input {:?} (last dimension {last})",
            v.shape().dims(),
            x.shape().dims()
        );
    }
    Ok(())
}

/// Calls `$body` with the element type of `$storage` bound to `$t` (f32 or f64).
macro_rules! dispatch {
    ($storage:expr, $t:ident => $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(_) => {
                type $t = f32;
                $body
            }
            candle_core::CpuStorage::F64(_) => {
                type $t = f64;
                $body
            }
            other => candle_core::bail!("fused kernels run in f32 or f64, not {:?}", other.dtype()),
        }
    };
}
pub(crate) use dispatch;

/// The values of a contiguous CPU tensor of `T`, read in place, handed to `f` (the
/// attention kernels read their inputs this way).
pub(crate) fn with_values<T: Float, R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("attention: a non-contiguous input".into()))?;
    match &*storage {
        candle_core::Storage::Cpu(s) => f(&s.as_slice::<T>()?[start..end]),
        _ => candle_core::bail!("attention: a tensor off the CPU"),
    }
}
