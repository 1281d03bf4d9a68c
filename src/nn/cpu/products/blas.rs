//! A BLAS the user already has, loaded at run time for the layer nodes' f32 products.
//!
//! The products come from the gemm crate by default: no system library, AVX-512 kernels
//! chosen at run time, and the fastest choice on the AMD EPYC we measure on. On an Intel
//! Xeon, Intel's MKL runs the same products faster; a user who has MKL (PyTorch's
//! `libtorch_cpu.so` carries it and exports its `sgemm_`; `pip install mkl` gives
//! `libmkl_rt.so.2`) or OpenBLAS can point `GRADCACHE_BLAS` at it, and every f32 product
//! of the layer nodes goes through that library's `sgemm_` instead. Nothing is linked:
//! the library is opened with `dlopen`, so the default build stays free of it.
//!
//! - **What is looked for.** The Fortran `sgemm_` (every BLAS has it; SciPy's bundled
//!   OpenBLAS prefixes it `scipy_`, NumPy's ILP64 one also suffixes it `64_`). Its
//!   integers are passed as 64-bit values whose low half is the 32-bit value, so both the
//!   LP64 and ILP64 interfaces read them right. A small product is checked against a plain
//!   loop before the library is accepted.
//! - **Threads.** The library runs each call on the calling thread only (MKL's and
//!   OpenBLAS's thread-count setters, found by name); the layer's products are split by
//!   rows across this crate's own pool, whose threads have the subnormal guards
//!   ([`crate::denormal`]). In [`crate::nn::cpu::blocks::serial`] mode a product is one call.
//! - **Results.** Another library rounds differently: products agree with the gemm
//!   crate's to float rounding (the tests hold whole steps to 1e-5), cached still equals
//!   the full batch, and a run repeats itself bit for bit as long as the library does
//!   (MKL: set `MKL_CBWR=AUTO,STRICT` for that).
//! - **What it does not change.** f64 and half-precision products, candle's own matmuls
//!   (the composed ops) and the GPU keep their kernels.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::Error;
use crate::nn::cpu::blocks::{in_serial, parallel_ranges, SharedConst, SharedMut};
use crate::Result;

/// The environment variable the binaries read ([`use_blas_from_env`]).
pub const BLAS_ENV: &str = "GRADCACHE_BLAS";

/// Fortran `sgemm_`: `transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc`, every
/// argument by reference, then the hidden lengths of the two character arguments that a
/// gfortran-built BLAS expects (others ignore them).
type Sgemm = unsafe extern "C" fn(
    *const u8,
    *const u8,
    *const i64,
    *const i64,
    *const i64,
    *const f32,
    *const f32,
    *const i64,
    *const f32,
    *const i64,
    *const f32,
    *mut f32,
    *const i64,
    usize,
    usize,
);

/// How the library is told to use one thread.
#[derive(Clone, Copy)]
enum OneThread {
    /// Per calling thread (`MKL_Set_Num_Threads_Local`, `openblas_set_num_threads_local`).
    Local(unsafe extern "C" fn(i32) -> i32),
    /// For the whole library, once (`openblas_set_num_threads`).
    Global(unsafe extern "C" fn(i32)),
}

struct Blas {
    /// Kept open for the life of the process (the function pointers point into it).
    _lib: libloading::Library,
    sgemm: Sgemm,
    one_thread: Option<OneThread>,
    info: BlasInfo,
}

/// The BLAS in use: where it was loaded from and the symbols found in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlasInfo {
    /// The library's path as given.
    pub path: PathBuf,
    /// The product's symbol (`sgemm_` or a prefixed one).
    pub sgemm: String,
    /// The symbol that keeps it on the calling thread, if the library has one of those
    /// this crate knows (otherwise the library's own threading stays as it is).
    pub threads: Option<String>,
}

static BLAS: OnceLock<Blas> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());
static ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// Whether this thread has told a per-thread library to use one thread.
    static ONE_THREAD_SET: Cell<bool> = const { Cell::new(false) };
}

/// The product's names: plain, SciPy's prefix, and the ILP64 builds' suffix (NumPy's
/// OpenBLAS).
const SGEMM_NAMES: [&str; 4] = ["sgemm_", "scipy_sgemm_", "sgemm_64_", "scipy_sgemm_64_"];
const LOCAL_THREADS: [&str; 3] = [
    "MKL_Set_Num_Threads_Local",
    "openblas_set_num_threads_local",
    "scipy_openblas_set_num_threads_local",
];
const GLOBAL_THREADS: [&str; 3] = [
    "openblas_set_num_threads",
    "scipy_openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
];

fn refused(path: &Path, reason: impl Into<String>) -> Error {
    Error::Blas {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Loads the BLAS at `path` and routes the layer nodes' f32 products through it, for the
/// rest of the process. Refused (and nothing changed) when the file cannot be opened, has
/// no `sgemm_`, or computes a small product wrongly, and when another library is already
/// in use. Loading the same path again returns what the first load found.
pub fn use_blas(path: impl AsRef<Path>) -> Result<BlasInfo> {
    let path = path.as_ref();
    let _one_at_a_time = LOADING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(blas) = BLAS.get() {
        if blas.info.path == path {
            return Ok(blas.info.clone());
        }
        return Err(refused(
            path,
            format!(
                "another BLAS is already in use in this process ({})",
                blas.info.path.display()
            ),
        ));
    }
    if !path.is_file() {
        return Err(refused(path, "no such file"));
    }
    // SAFETY: opening a shared library runs its initialisers; the user named it as a BLAS.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| refused(path, format!("cannot open it as a shared library: {e}")))?;
    let (sgemm, sgemm_name) = SGEMM_NAMES
        .iter()
        // SAFETY: the type is the Fortran `sgemm_` every BLAS exports under this name.
        .find_map(|name| {
            unsafe { lib.get::<Sgemm>(name.as_bytes()) }
                .ok()
                .map(|f| (*f, *name))
        })
        .ok_or_else(|| {
            refused(
                path,
                format!("it has no `sgemm_` (looked for {})", SGEMM_NAMES.join(", ")),
            )
        })?;
    // SAFETY (both finds): the types are those of MKL's and OpenBLAS's own headers.
    let local = LOCAL_THREADS.iter().find_map(|name| {
        unsafe { lib.get::<unsafe extern "C" fn(i32) -> i32>(name.as_bytes()) }
            .ok()
            .map(|f| (OneThread::Local(*f), *name))
    });
    let one_thread = local.or_else(|| {
        GLOBAL_THREADS.iter().find_map(|name| {
            unsafe { lib.get::<unsafe extern "C" fn(i32)>(name.as_bytes()) }
                .ok()
                .map(|f| (OneThread::Global(*f), *name))
        })
    });
    let blas = Blas {
        sgemm,
        one_thread: one_thread.map(|(f, _)| f),
        info: BlasInfo {
            path: path.to_path_buf(),
            sgemm: sgemm_name.to_string(),
            threads: one_thread.map(|(_, name)| name.to_string()),
        },
        _lib: lib,
    };
    if let Some(OneThread::Global(set)) = blas.one_thread {
        // SAFETY: the library's own setter, with a valid thread count.
        unsafe { set(1) };
    }
    blas.check().map_err(|reason| refused(path, reason))?;
    let info = blas.info.clone();
    let _ = BLAS.set(blas);
    Ok(info)
}

/// [`use_blas`] with the path in `GRADCACHE_BLAS`, if it is set and not empty; `None`
/// (the gemm crate's products) otherwise. The `gradcache` binaries call it at start.
pub fn use_blas_from_env() -> Result<Option<BlasInfo>> {
    match std::env::var_os(BLAS_ENV) {
        Some(path) if !path.is_empty() => use_blas(PathBuf::from(path)).map(Some),
        _ => Ok(None),
    }
}

/// Whether the f32 products go through a loaded BLAS (not turned off).
pub(in crate::nn) fn products_through_blas() -> bool {
    active().is_some()
}

/// The BLAS the products go through, if one is loaded and not turned off.
pub fn blas_in_use() -> Option<BlasInfo> {
    active().map(|b| b.info.clone())
}

/// Turns a loaded BLAS's products off (the gemm crate's again) or back on, for the whole
/// process, so that a benchmark or a test can set the two side by side in one run.
pub fn set_blas_products(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

fn active() -> Option<&'static Blas> {
    BLAS.get().filter(|_| ENABLED.load(Ordering::Relaxed))
}

/// One operand as the Fortran interface takes it: the matrix `X [rows, cols]` whose
/// element `(i, j)` is at `i * si + j * sj` is either column-major (`N`, leading dimension
/// `sj`) or the transpose of a column-major matrix (`T`, leading dimension `si`). `None`
/// when neither stride is one (the gemm crate takes any strides).
fn fortran(rows: usize, cols: usize, si: usize, sj: usize) -> Option<(u8, usize)> {
    if si == 1 && (sj >= rows.max(1) || cols == 1) {
        Some((b'N', sj.max(rows).max(1)))
    } else if sj == 1 && (si >= cols.max(1) || rows == 1) {
        Some((b'T', si.max(cols).max(1)))
    } else {
        None
    }
}

/// The gemm crate's operand: values, row stride, column stride.
type Raw = (*const f32, usize, usize);

impl Blas {
    /// `dst [m, n] (+)= lhs [m, k] rhs [k, n]` through the library, split by rows across
    /// the pool; `false` (nothing done) when an operand's strides do not fit the Fortran
    /// interface.
    ///
    /// # Safety
    /// As [`crate::nn::cpu::products::gemm::product_raw`].
    unsafe fn product(
        &self,
        (m, n, k): (usize, usize, usize),
        (dst, dst_rs): (*mut f32, usize),
        accumulate: bool,
        (lhs, lhs_rs, lhs_cs): Raw,
        (rhs, rhs_rs, rhs_cs): Raw,
    ) -> bool {
        // Column-major, the library computes `dst^T [n, m] = rhs^T [n, k] lhs^T [k, m]`.
        let (Some(a), Some(b)) = (fortran(n, k, rhs_cs, rhs_rs), fortran(k, m, lhs_cs, lhs_rs))
        else {
            return false;
        };
        if m == 0 || n == 0 {
            return true;
        }
        if k == 0
            || dst_rs < n
            || [m, n, k, a.1, b.1, dst_rs]
                .iter()
                .any(|&v| v > i32::MAX as usize)
        {
            return false;
        }
        let pieces = if in_serial() {
            1
        } else {
            candle_core::utils::get_num_threads().clamp(1, m.div_ceil(16))
        };
        let rows = m.div_ceil(pieces).next_multiple_of(16).min(m);
        let (dst, lhs, rhs) = (SharedMut(dst), SharedConst(lhs), SharedConst(rhs));
        let call = |piece: usize| {
            let first = piece * rows;
            let count = rows.min(m - first);
            // SAFETY: the pieces are disjoint row ranges of `dst`; the operands are read
            // within the extents the caller guarantees.
            unsafe {
                self.call(
                    (count, n, k),
                    (dst.get().add(first * dst_rs), dst_rs),
                    accumulate,
                    (lhs.get().add(first * lhs_rs), b),
                    (rhs.get(), a),
                )
            }
        };
        let used = m.div_ceil(rows);
        if used == 1 {
            call(0);
        } else {
            parallel_ranges(used, |range| range.for_each(call));
        }
        true
    }

    /// One `sgemm_` call on the calling thread: `dst [m, n] (+)= lhs [m, k] rhs [k, n]`,
    /// the operands in their Fortran form ([`fortran`]).
    ///
    /// # Safety
    /// The pointers address the extents the dimensions and leading dimensions give.
    unsafe fn call(
        &self,
        (m, n, k): (usize, usize, usize),
        (dst, dst_rs): (*mut f32, usize),
        accumulate: bool,
        (lhs, (lhs_t, lhs_ld)): (*const f32, (u8, usize)),
        (rhs, (rhs_t, rhs_ld)): (*const f32, (u8, usize)),
    ) {
        if let Some(OneThread::Local(set)) = self.one_thread {
            if !ONE_THREAD_SET.with(|s| s.replace(true)) {
                // SAFETY: the library's own setter, with a valid thread count.
                unsafe { set(1) };
            }
        }
        let int = |v: usize| v as i64;
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // SAFETY: every argument is a valid pointer for the call's duration; the extents
        // are the caller's.
        unsafe {
            (self.sgemm)(
                &rhs_t,
                &lhs_t,
                &int(n),
                &int(m),
                &int(k),
                &alpha,
                rhs,
                &int(rhs_ld),
                lhs,
                &int(lhs_ld),
                &beta,
                dst,
                &int(dst_rs),
                1,
                1,
            )
        };
    }

    /// A few small products, every transpose combination and an accumulation, against a
    /// plain loop: a library that takes its arguments differently fails here, not later.
    fn check(&self) -> std::result::Result<(), String> {
        let (m, n, k) = (5usize, 3usize, 4usize);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 - 7.0) / 4.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (3.0 - i as f32) / 2.0).collect();
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let want: Vec<f32> = (0..m * n)
            .map(|i| (0..k).map(|p| a[(i / n) * k + p] * b[p * n + i % n]).sum())
            .collect();
        for (lhs, rhs) in [
            ((&a, k, 1), (&b, n, 1)),
            ((&at, 1, m), (&bt, 1, k)),
            ((&a, k, 1), (&bt, 1, k)),
        ] {
            for accumulate in [false, true] {
                let mut got = vec![if accumulate { 1f32 } else { f32::NAN }; m * n];
                // SAFETY: every operand holds `rows x cols` at its strides; `got` is `m x n`.
                let done = unsafe {
                    self.product(
                        (m, n, k),
                        (got.as_mut_ptr(), n),
                        accumulate,
                        (lhs.0.as_ptr(), lhs.1, lhs.2),
                        (rhs.0.as_ptr(), rhs.1, rhs.2),
                    )
                };
                let offset = if accumulate { 1.0 } else { 0.0 };
                let wrong = got.iter().zip(&want).any(|(&g, &w)| {
                    let err = (g - offset - w).abs();
                    err.is_nan() || err > 1e-4 * (1.0 + w.abs())
                });
                if !done || wrong {
                    return Err(format!(
                        "its `{}` gave a wrong 5x4 by 4x3 product ({:?} for {:?}): not a BLAS \
                         with the usual Fortran interface",
                        self.info.sgemm, got, want
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Runs `dst [m, n] (+)= lhs [m, k] rhs [k, n]` through the loaded BLAS when there is one
/// and `T` is f32; `false` (nothing done) otherwise.
///
/// # Safety
/// As [`crate::nn::cpu::products::gemm::product_raw`].
pub(super) unsafe fn try_product<T: 'static>(
    dims: (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (*const T, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const T, usize, usize),
) -> bool {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<f32>() {
        return false;
    }
    let Some(blas) = active() else {
        return false;
    };
    // SAFETY: `T` is f32 (checked); the caller's contract is the product's.
    unsafe {
        blas.product(
            dims,
            (dst.cast(), dst_rs),
            accumulate,
            (lhs.cast(), lhs_rs, lhs_cs),
            (rhs.cast(), rhs_rs, rhs_cs),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{fortran, Blas, BlasInfo};

    /// An `sgemm_` that takes its arguments in another order than the Fortran one (here:
    /// writes zeros where the product belongs).
    unsafe extern "C" fn zeros(
        _: *const u8,
        _: *const u8,
        m: *const i64,
        n: *const i64,
        _: *const i64,
        _: *const f32,
        _: *const f32,
        _: *const i64,
        _: *const f32,
        _: *const i64,
        _: *const f32,
        c: *mut f32,
        ldc: *const i64,
        _: usize,
        _: usize,
    ) {
        // SAFETY: the Fortran contract: `c` holds `n` columns of `ldc`, `m` rows used.
        unsafe {
            for j in 0..*n as usize {
                for i in 0..*m as usize {
                    *c.add(j * *ldc as usize + i) = 0.0;
                }
            }
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_library_whose_product_is_wrong_is_refused() {
        let blas = Blas {
            _lib: libloading::os::unix::Library::this().into(),
            sgemm: zeros,
            one_thread: None,
            info: BlasInfo {
                path: "libwrong.so".into(),
                sgemm: "sgemm_".into(),
                threads: None,
            },
        };
        let err = blas.check().unwrap_err();
        assert!(
            err.contains("gave a wrong 5x4 by 4x3 product") && err.contains("sgemm_"),
            "{err}"
        );
    }

    #[test]
    fn operands_take_the_fortran_form_their_strides_allow() {
        // Row-major `[k, n]` read as `X [n, k]` (si = 1, sj = n): column-major, ld n.
        assert_eq!(fortran(3, 4, 1, 3), Some((b'N', 3)));
        // Its transpose stored row-major: `T`, ld = its row length.
        assert_eq!(fortran(3, 4, 4, 1), Some((b'T', 4)));
        // A padded leading dimension is kept.
        assert_eq!(fortran(3, 4, 1, 8), Some((b'N', 8)));
        // One column: any leading dimension will do, the rows' count is given.
        assert_eq!(fortran(3, 1, 1, 0), Some((b'N', 3)));
        // Neither stride one, or a leading dimension shorter than a column: not Fortran.
        assert_eq!(fortran(3, 4, 2, 6), None);
        assert_eq!(fortran(3, 4, 1, 2), None);
    }
}
