//! An experiment, not the library's path: a long encoding's panel product
//! `dst [rows, 64] = x [rows, k] panel [k, 64]` (a weight copy's panel of 64 outputs, as
//! `src/nn/cpu/transposed.rs` makes them) with the panel read from L1 in blocks of `kb`
//! inputs across `mc` rows of `x` at a time, where the gemm crate streams the whole
//! `[k, 64]` panel (96 KiB at k = 384, past a 48 KiB L1) from L2 for each 6 rows. Each
//! output is the gemm crate's sum: one chain of fused multiply-adds over each of its
//! blocks of `kc` inputs in order (carried through `scratch` between blocks of `kb`),
//! the blocks' sums added in order, so the same bits (the `--panels` table checks them).
//! AVX-512 only; `train_step --panels` times it beside the gemm crate on the CPU it runs on.

// The AVX-512 intrinsics are stable from Rust 1.89: this bench alone needs it (the
// library's `rust-version` stays as it is).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::incompatible_msrv)]
mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of `x` per tile, vectors of 16 outputs per tile (the gemm crate's 6 x 64).
    const ROWS: usize = 6;
    const VECS: usize = 4;
    const WIDTH: usize = 16 * VECS;

    /// `acc (+)= x [R, s1 - s0] panel [s1 - s0, 64]` for one tile.
    #[inline(always)]
    unsafe fn chain<const R: usize>(
        steps: usize,
        x: *const f32,
        xs: usize,
        p: *const f32,
        acc: &mut [[__m512; VECS]; R],
    ) {
        for s in 0..steps {
            // SAFETY (all loads): the caller's extents: `x` covers R rows of `steps`
            // values `xs` apart, `p` `steps` rows of 64.
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

    /// One tile's inputs `s0..s1` of the gemm block that ends at `block_end`: its sums
    /// start at zero (`s0` the block's first) or from `scratch`, and go to `scratch` or,
    /// at the block's end, to `dst` (`dst + sum` past the first block).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize>(
        (s0, s1, block_start, block_end): (usize, usize, usize, usize),
        x: *const f32,
        xs: usize,
        panel: *const f32,
        scratch: *mut f32,
        dst: *mut f32,
        ds: usize,
        add_to_dst: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); VECS]; R];
        // SAFETY (all accesses): `scratch` holds R x 64, `dst` R rows of 64 `ds` apart.
        unsafe {
            if s0 != block_start {
                for (r, acc) in acc.iter_mut().enumerate() {
                    for (v, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_loadu_ps(scratch.add(r * WIDTH + 16 * v));
                    }
                }
            }
            chain::<R>(s1 - s0, x.add(s0), xs, panel.add(s0 * WIDTH), &mut acc);
            for (r, acc) in acc.iter().enumerate() {
                for (v, a) in acc.iter().enumerate() {
                    if s1 == block_end {
                        let d = dst.add(r * ds + 16 * v);
                        let sum = if add_to_dst {
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

    /// See the module. `x [rows, k]` rows `xs` apart, `panel [k, 64]`, `dst [rows, 64]`
    /// rows `ds` apart (written, not added to); `kc` the gemm crate's block of inputs.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; the pointers cover those extents; `dst` overlaps neither.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel_product(
        (rows, k, kc): (usize, usize, usize),
        x: *const f32,
        xs: usize,
        panel: *const f32,
        dst: *mut f32,
        ds: usize,
        (mc, kb): (usize, usize),
    ) {
        let tiles = mc.div_ceil(ROWS);
        let mut scratch = vec![0f32; tiles * ROWS * WIDTH];
        let mut block_start = 0;
        while block_start < k {
            let block_end = (block_start + kc).min(k);
            let mut r0 = 0;
            while r0 < rows {
                let r_end = (r0 + mc).min(rows);
                let mut s0 = block_start;
                while s0 < block_end {
                    let s1 = (s0 + kb).min(block_end);
                    let steps = (s0, s1, block_start, block_end);
                    let mut r = r0;
                    while r < r_end {
                        let n = (r_end - r).min(ROWS);
                        // SAFETY: the rows `r..r + n` of `x` and `dst`, the tile's scratch.
                        unsafe {
                            let sc = scratch.as_mut_ptr().add((r - r0) / ROWS * ROWS * WIDTH);
                            let (xr, dr, add) = (x.add(r * xs), dst.add(r * ds), block_start > 0);
                            match n {
                                6 => tile::<6>(steps, xr, xs, panel, sc, dr, ds, add),
                                5 => tile::<5>(steps, xr, xs, panel, sc, dr, ds, add),
                                4 => tile::<4>(steps, xr, xs, panel, sc, dr, ds, add),
                                3 => tile::<3>(steps, xr, xs, panel, sc, dr, ds, add),
                                2 => tile::<2>(steps, xr, xs, panel, sc, dr, ds, add),
                                _ => tile::<1>(steps, xr, xs, panel, sc, dr, ds, add),
                            }
                        }
                        r += n;
                    }
                    s0 = s1;
                }
                r0 = r_end;
            }
            block_start = block_end;
        }
    }
}

/// Whether [`panel_product`] runs here (x86-64 with AVX-512 F).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The gemm crate's block of inputs for a one-thread product of a 64-output panel by
/// `rows` rows (its rule: `k` up to 512 for a product of at most 64 by 64, else its
/// cache-sized blocks for a 64 x 6 kernel).
pub fn gemm_block(rows: usize, k: usize) -> usize {
    if rows <= 64 {
        k.min(512)
    } else {
        gemm_common::cache::kernel_params(64, rows, k, 64, 6, 4).kc
    }
}

/// See the module; `None` where it does not run (no AVX-512).
///
/// # Safety
/// As the kernel's: the pointers cover `x [rows, k]` (rows `xs` apart), `panel [k, 64]`,
/// `dst [rows, 64]` (rows `ds` apart), `dst` overlapping neither.
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_product(
    (rows, k): (usize, usize),
    x: *const f32,
    xs: usize,
    panel: *const f32,
    dst: *mut f32,
    ds: usize,
    blocking: (usize, usize),
) -> Option<()> {
    if !available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 F checked; the rest is the caller's.
    unsafe {
        avx512::panel_product(
            (rows, k, gemm_block(rows, k)),
            x,
            xs,
            panel,
            dst,
            ds,
            blocking,
        );
        Some(())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, k, x, xs, panel, dst, ds, blocking);
        None
    }
}
