//! An experiment beside the gemm crate, off unless chosen: a long encoding's panel
//! products (`weight_products::panel_products`, `dst [rows, 64] (+)= x [rows, k] panel
//! [k, 64]` for each 64-output panel of a weight copy) by a kernel that reads the panel
//! from L1 in blocks of `inputs` rows across [`BLOCK_ROWS`] rows of `x` at a time. The
//! gemm crate's 64 x 6 kernel streams the whole `[k, 64]` panel (96 KiB at k = 384, past
//! a 48 KiB L1) from L2 for each 6 rows of `x`; on the AMD EPYC of these machines both
//! run at the core's peak, and on an Intel Xeon the encoding's products ran 10-20% below
//! MKL's (docs/benchmarks.md): this is there to be measured against it
//! (`GRADCACHE_PANEL_KERNEL=blocked`, `train_step --panels` through
//! [`crate::nn::panel_product`]).
//!
//! Each output is the gemm crate's sum, so the same bits (a unit test holds them at the
//! edges of its rules): one chain of fused multiply-adds over each of its blocks of
//! inputs, in order, carried through a scratch tile between this kernel's smaller blocks
//! (a store and a load change no value), the blocks' sums added to the destination in
//! order. AVX-512 F and f32 only, panels exactly 64 wide; anything else goes to the gemm
//! crate.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::nn::cpu::blocks::Float;

/// The environment variable the binaries read for [`PanelKernel`].
pub const PANEL_KERNEL_ENV: &str = "GRADCACHE_PANEL_KERNEL";

/// What a refused [`PANEL_KERNEL_ENV`] is told.
const EXPECTED: &str = "expected gemm, blocked or blocked=N";

/// Rows of `x` a block of the panel is read across.
pub const BLOCK_ROWS: usize = 48;

/// Which kernel multiplies a long encoding's panel copies, process-wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanelKernel {
    /// The gemm crate's (the default).
    Gemm,
    /// This module's, the panel read in blocks of `inputs` of its rows.
    Blocked {
        /// Panel rows (inputs) per block, 1 to 4,096.
        inputs: usize,
    },
}

/// The blocked kernel's `inputs`, 0 for the gemm crate's.
static BLOCKED_INPUTS: AtomicUsize = AtomicUsize::new(0);

impl PanelKernel {
    /// The kernel in force now.
    pub fn current() -> Self {
        match BLOCKED_INPUTS.load(Ordering::Relaxed) {
            0 => Self::Gemm,
            inputs => Self::Blocked { inputs },
        }
    }

    /// The blocked kernel's inputs per block, 0 for the gemm crate's.
    pub(in crate::nn) fn blocked_inputs(self) -> usize {
        match self {
            Self::Gemm => 0,
            Self::Blocked { inputs } => inputs,
        }
    }

    /// Puts this kernel in force for the whole process (the same bits either way).
    pub fn apply(self) {
        BLOCKED_INPUTS.store(self.blocked_inputs(), Ordering::Relaxed);
    }

    /// `gemm`, `blocked` (blocks of 128 inputs) or `blocked=N` (1 to 4,096).
    pub fn parse(text: &str) -> crate::Result<Self> {
        let refuse = |reason| crate::error::invalid(PANEL_KERNEL_ENV, text, reason);
        let blocks = "blocked=N takes a whole number of inputs from 1 to 4096";
        match text.trim().split_once('=') {
            None if text.trim() == "gemm" => Ok(Self::Gemm),
            None if text.trim() == "blocked" => Ok(Self::Blocked { inputs: 128 }),
            Some((name, n)) if name.trim() == "blocked" => match n.trim().parse() {
                Ok(inputs @ 1..=4096) => Ok(Self::Blocked { inputs }),
                _ => Err(refuse(blocks)),
            },
            _ => Err(refuse(EXPECTED)),
        }
    }
}

/// The kernel in `GRADCACHE_PANEL_KERNEL` ([`PanelKernel::parse`]), put in force, if it
/// is set and not empty; `None` otherwise. A value refused changes nothing.
pub fn panel_kernel_from_env() -> crate::Result<Option<PanelKernel>> {
    let Some(text) = crate::error::env_setting(PANEL_KERNEL_ENV, EXPECTED)? else {
        return Ok(None);
    };
    let kernel = PanelKernel::parse(&text)?;
    kernel.apply();
    Ok(Some(kernel))
}

/// The gemm crate's block of inputs for a one-thread product of a 64-output panel by
/// `rows` rows: `k` up to 512 for a product of at most 64 by 64, else its cache-sized
/// blocks for its 64 x 6 AVX-512 kernel (split evenly).
fn gemm_block(rows: usize, k: usize) -> usize {
    if rows <= 64 {
        k.min(512)
    } else {
        gemm_common::cache::kernel_params(64, rows, k, 64, 6, 4).kc
    }
}

/// The panel product by the blocked kernel of `inputs` per block, if it applies (f32,
/// AVX-512, a panel 64 wide, `x` read along its rows, at least 2 rows and 3 inputs: the
/// gemm crate's own paths for fewer sum otherwise); whether it ran.
///
/// # Safety
/// `dst` addresses `rows x 64` elements with row stride `dst_rs`, overlapping no operand;
/// `x` `rows x k` with strides `(x_rs, x_cs)`; `panel` `k x 64` contiguous.
pub(in crate::nn) unsafe fn try_blocked<T: Float>(
    inputs: usize,
    (rows, width, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (x, x_rs, x_cs): (*const T, usize, usize),
    panel: *const T,
) -> bool {
    let applies = inputs > 0
        && T::DTYPE == candle_core::DType::F32
        && width == 64
        && x_cs == 1
        && rows >= 2
        && k >= 3;
    #[cfg(target_arch = "x86_64")]
    if applies && crate::nn::cpu::blocks::vectors() == crate::nn::cpu::blocks::Vectors::Avx512 {
        // SAFETY: T is f32 (its dtype, checked); AVX-512 F (checked); the extents are
        // the caller's.
        unsafe {
            avx512::panel_product(
                (rows, k, gemm_block(rows, k)),
                (x.cast::<f32>(), x_rs),
                panel.cast::<f32>(),
                (dst.cast::<f32>(), dst_rs),
                accumulate,
                inputs,
            )
        };
        return true;
    }
    let _ = (applies, dst, dst_rs, accumulate, x, x_rs, panel);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::BLOCK_ROWS;

    /// Rows of `x` per tile and vectors of 16 outputs per tile (the gemm crate's 6 x 64).
    const ROWS: usize = 6;
    const VECS: usize = 4;
    const WIDTH: usize = 16 * VECS;

    /// `acc += x [R, steps] panel [steps, 64]` for one tile, a chain per output.
    ///
    /// # Safety
    /// AVX-512 F; `x` covers R rows of `steps` values `xs` apart, `p` `steps` rows of 64.
    #[inline(always)]
    unsafe fn chain<const R: usize>(
        steps: usize,
        (x, xs): (*const f32, usize),
        p: *const f32,
        acc: &mut [[__m512; VECS]; R],
    ) {
        for s in 0..steps {
            // SAFETY (the loads): within the extents above.
            let w: [__m512; VECS] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(p.add(s * WIDTH + 16 * v)) });
            for (r, acc) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(unsafe { *x.add(r * xs + s) });
                for v in 0..VECS {
                    acc[v] = _mm512_fmadd_ps(w[v], b, acc[v]);
                }
            }
        }
    }

    /// One tile's inputs `s0..s1` of the gemm block `block`: its sums start at zero (`s0`
    /// the block's first) or from `scratch`, and go to `scratch` or, at the block's end,
    /// to `dst` (`dst + sum` where `add`).
    ///
    /// # Safety
    /// AVX-512 F; `scratch` holds R x 64; `dst` R rows of 64 `ds` apart; `x` and `panel`
    /// as [`chain`]'s over the inputs `s0..s1`.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        (s0, s1): (usize, usize),
        block: (usize, usize),
        (x, xs): (*const f32, usize),
        panel: *const f32,
        scratch: *mut f32,
        (dst, ds, add): (*mut f32, usize, bool),
    ) {
        let mut acc = [[_mm512_setzero_ps(); VECS]; R];
        // SAFETY (every access): within the extents above.
        unsafe {
            if s0 != block.0 {
                for (r, acc) in acc.iter_mut().enumerate() {
                    for (v, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_loadu_ps(scratch.add(r * WIDTH + 16 * v));
                    }
                }
            }
            chain::<R>(s1 - s0, (x.add(s0), xs), panel.add(s0 * WIDTH), &mut acc);
            for (r, acc) in acc.iter().enumerate() {
                for (v, a) in acc.iter().enumerate() {
                    if s1 == block.1 {
                        let d = dst.add(r * ds + 16 * v);
                        let sum = if add {
                            _mm512_add_ps(_mm512_loadu_ps(d), *a)
                        } else {
                            *a
                        };
                        _mm512_storeu_ps(d, sum);
                    } else {
                        _mm512_storeu_ps(scratch.add(r * WIDTH + 16 * v), *a);
                    }
                }
            }
        }
    }

    /// See the module: `dst [rows, 64] (+)= x [rows, k] panel [k, 64]`, the gemm crate's
    /// blocks of `kc` inputs, the panel read in blocks of `inputs`.
    ///
    /// # Safety
    /// AVX-512 F; `x` covers `rows x k` (rows `xs` apart), `panel` `k x 64`, `dst` `rows x
    /// 64` (rows `ds` apart), overlapping neither.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn panel_product(
        (rows, k, kc): (usize, usize, usize),
        (x, xs): (*const f32, usize),
        panel: *const f32,
        (dst, ds): (*mut f32, usize),
        accumulate: bool,
        inputs: usize,
    ) {
        let mut scratch = [0f32; BLOCK_ROWS * WIDTH];
        let mut start = 0;
        while start < k {
            let block = (start, (start + kc).min(k));
            // The first block writes `dst` (unless accumulating), the later ones add.
            let add = accumulate || start > 0;
            for r0 in (0..rows).step_by(BLOCK_ROWS) {
                let r_end = (r0 + BLOCK_ROWS).min(rows);
                for s0 in (block.0..block.1).step_by(inputs) {
                    let s = (s0, (s0 + inputs).min(block.1));
                    for r in (r0..r_end).step_by(ROWS) {
                        let n = (r_end - r).min(ROWS);
                        // SAFETY: rows `r..r + n` of `x` and `dst`, the tile's own
                        // scratch (`(r - r0) / ROWS` of at most `BLOCK_ROWS / ROWS`).
                        unsafe {
                            let sc = scratch.as_mut_ptr().add((r - r0) * WIDTH);
                            let xr = (x.add(r * xs), xs);
                            let d = (dst.add(r * ds), ds, add);
                            match n {
                                6 => tile::<6>(s, block, xr, panel, sc, d),
                                5 => tile::<5>(s, block, xr, panel, sc, d),
                                4 => tile::<4>(s, block, xr, panel, sc, d),
                                3 => tile::<3>(s, block, xr, panel, sc, d),
                                2 => tile::<2>(s, block, xr, panel, sc, d),
                                _ => tile::<1>(s, block, xr, panel, sc, d),
                            }
                        }
                    }
                }
            }
            start = block.1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_parses_what_it_names_and_refuses_the_rest() {
        assert_eq!(PanelKernel::parse("gemm").unwrap(), PanelKernel::Gemm);
        assert_eq!(
            PanelKernel::parse(" blocked ").unwrap(),
            PanelKernel::Blocked { inputs: 128 }
        );
        assert_eq!(
            PanelKernel::parse("blocked=64").unwrap(),
            PanelKernel::Blocked { inputs: 64 }
        );
        for bad in [
            "blocked=0",
            "blocked=5000",
            "blocked=x",
            "fast",
            "gemm=2",
            "",
        ] {
            let err = PanelKernel::parse(bad).unwrap_err().to_string();
            assert!(err.contains(PANEL_KERNEL_ENV), "{bad}: {err}");
        }
    }
}
