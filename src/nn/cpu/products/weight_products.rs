//! A layer's products by its weights, `x W^T (+ b)`: from the weight as stored, or from a
//! copy transposed into panels of [`PANEL`] outputs (`crate::nn::cpu::products::transposed`
//! makes them, for a long encoding), each product one call of the gemm crate per panel
//! with the panel read in place, never packed again, the products of the panels and of
//! blocks of rows shared out across the threads.

use crate::nn::cpu::blocks::{parallel_ranges, Float, SharedMut};
use crate::nn::cpu::products::gemm::{
    bias_rows, destination, gemm_call, last, product_new, product_raw, Operand,
};

/// Outputs per panel of a weight copy ([`WeightRhs::Panels`]): the rows of the gemm
/// crate's AVX-512 f32 kernel (four vectors of 16), four of its AVX2 kernel's. Of the
/// sizes tried on an AMD EPYC (64, 128, 256, 512; an encoding of 4,000 texts with
/// all-MiniLM-L6-v2), the fastest.
pub const PANEL: usize = 64;

/// The panels of a weight of `out` outputs: `(first output, width)`, [`PANEL`] wide but
/// the last, which takes the rest (`PANEL` to `2 * PANEL - 1` wide; all of `out` when it is
/// narrower than a panel), so no product of a panel is thin enough for the gemm crate's
/// special paths (see [`crate::nn::cpu::products::transposed::weight_rhs`]).
pub(in crate::nn) fn panel_spans(out: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = (out / PANEL).max(1);
    (0..count).map(move |p| {
        let first = p * PANEL;
        let width = if p + 1 == count { out - first } else { PANEL };
        (first, width)
    })
}

/// `W^T`, the right operand of a layer's `x W^T` ([`weight_product`]), as
/// [`crate::nn::cpu::products::transposed::weight_rhs`] gives it.
#[derive(Clone, Copy)]
pub(in crate::nn) enum WeightRhs<'a, T> {
    /// A matrix with strides: the weight as stored, `(1, input)`.
    Strided(Operand<'a, T>),
    /// A copy transposed in panels ([`panel_spans`]; `crate::nn::cpu::products::transposed` makes
    /// them), read one product per panel.
    Panels(&'a [T]),
}

/// `dst [m, n] (+)= lhs [m, k] W^T`, `W^T` `[k, n]` as
/// [`crate::nn::cpu::products::transposed::weight_rhs`] gives it: a strided operand as
/// [`product`], or a copy in panels, one product per panel read in place ([`panel_products`]).
pub(in crate::nn) fn weight_product<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [T], usize),
    accumulate: bool,
    lhs: Operand<T>,
    rhs: WeightRhs<T>,
) {
    let Some(dst) = destination(dst, (m, n), dst_rs) else {
        return;
    };
    // SAFETY: `dst` covers the destination (checked), borrowed mutably.
    unsafe {
        match rhs {
            WeightRhs::Strided(rhs) => product_raw((m, n, k), dst, accumulate, lhs, rhs),
            WeightRhs::Panels(panels) => panel_products((m, n, k), dst, accumulate, lhs, panels),
        }
    }
}

/// `lhs [m, k] W^T` into a new `[m, n]` buffer, `W^T` as [`weight_product`] takes it.
pub(in crate::nn) fn weight_product_new<T: Float>(
    (m, n, k): (usize, usize, usize),
    lhs: Operand<T>,
    rhs: WeightRhs<T>,
) -> Vec<T> {
    match rhs {
        WeightRhs::Strided(rhs) => product_new((m, n, k), lhs, rhs),
        WeightRhs::Panels(panels) => {
            if m == 0 || n == 0 {
                return Vec::new();
            }
            let mut out = Vec::with_capacity(m * n);
            // SAFETY: the products write every element of the `m * n` they were given room
            // for (`accumulate` off, `k > 0`: checked), before the length is set.
            unsafe {
                panel_products((m, n, k), (out.as_mut_ptr(), n), false, lhs, panels);
                out.set_len(m * n);
            }
            out
        }
    }
}

/// Rows per product of a panel at most: past `256 * NR` columns of its right-hand operand
/// the gemm crate packs a one-thread product's left-hand one (the panel) whatever its
/// threshold (`NR` is 6 on x86, 4 or more elsewhere).
const PANEL_ROWS: usize = 1024;

/// [`weight_product`] from a copy in panels: for each panel, `dst`'s columns of its outputs
/// `(+)= lhs [m, k] panel [k, width]`, the panel read in place (the gemm crate's packing
/// threshold for it raised while these run: [`PanelsInPlace`]). Past [`PANEL_ROWS`] rows,
/// in equal blocks of rows (each over 512 rows: the same sums, see
/// [`crate::nn::cpu::products::transposed::weight_rhs`]). The products of the blocks and panels
/// are shared out across the threads (one thread each: a panel's product is too small to split
/// well), or run in turn on a [`crate::nn::cpu::blocks::serial`] thread.
///
/// # Safety
/// `dst` addresses `m x n` elements with row stride `dst_rs`, overlapping no operand.
unsafe fn panel_products<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): Operand<T>,
    panels: &[T],
) {
    assert!(
        m > 0 && n > 0 && k > 0 && panels.len() == k * n && lhs.len() > last(m, k, lhs_rs, lhs_cs),
        "panel product: an empty shape or an operand too small"
    );
    let timer = crate::profile::enabled().then(std::time::Instant::now);
    let _in_place = PanelsInPlace::new();
    let blocks = m.div_ceil(PANEL_ROWS);
    let block_rows = m.div_ceil(blocks);
    // (first row, rows, first output, width) of each product.
    let jobs: Vec<_> = (0..m)
        .step_by(block_rows)
        .flat_map(|first_row| {
            let rows = block_rows.min(m - first_row);
            panel_spans(n).map(move |(first, width)| (first_row, rows, first, width))
        })
        .collect();
    let dst = SharedMut(dst);
    let blocked = crate::nn::cpu::products::panel_kernel::PanelKernel::current().blocked_inputs();
    parallel_ranges(jobs.len(), |range| {
        for &(first_row, rows, first, width) in &jobs[range] {
            // SAFETY: the block's rows and the panel's columns of `dst`, no other job's;
            // the rows of `lhs` and the panel's values (`k * width` from `first * k`,
            // checked above).
            unsafe {
                let ran = crate::nn::cpu::products::panel_kernel::try_blocked(
                    blocked,
                    (rows, width, k),
                    (dst.get().add(first_row * dst_rs + first), dst_rs),
                    accumulate,
                    (lhs.as_ptr().add(first_row * lhs_rs), lhs_rs, lhs_cs),
                    panels.as_ptr().add(first * k),
                );
                if ran {
                    continue;
                }
                gemm_call(
                    (rows, width, k),
                    (dst.get().add(first_row * dst_rs + first), dst_rs),
                    accumulate,
                    (lhs.as_ptr().add(first_row * lhs_rs), lhs_rs, lhs_cs),
                    (panels.as_ptr().add(first * k), width, 1),
                    gemm::Parallelism::None,
                )
            }
        }
    });
    if let Some(start) = timer {
        crate::profile::record_product(start.elapsed(), (m, n, k));
    }
}

/// One thread's panel product `dst [rows, 64] = x [rows, k] panel [k, 64]` (`x` rows `k`
/// apart, `dst` rows `dst_rs` apart) by `kernel`, as a long encoding runs it: for
/// benchmarks (`train_step --panels`). The blocked kernel where it applies, the gemm
/// crate's (reading the panel in place) otherwise. Panics if a slice is too short.
pub fn panel_product(
    kernel: crate::nn::cpu::products::panel_kernel::PanelKernel,
    (rows, k): (usize, usize),
    x: &[f32],
    panel: &[f32],
    (dst, dst_rs): (&mut [f32], usize),
) {
    assert!(
        rows > 0 && k > 0 && dst_rs >= 64,
        "panel product: an empty shape"
    );
    assert!(
        x.len() >= rows * k && panel.len() >= k * 64 && dst.len() >= (rows - 1) * dst_rs + 64,
        "panel product: an operand too small"
    );
    let inputs = kernel.blocked_inputs();
    let operands = (
        (dst.as_mut_ptr(), dst_rs),
        (x.as_ptr(), k, 1),
        panel.as_ptr(),
    );
    // SAFETY: the extents were checked above; `dst` is borrowed mutably.
    unsafe {
        let (dst, x, panel) = operands;
        if !crate::nn::cpu::products::panel_kernel::try_blocked(
            inputs,
            (rows, 64, k),
            dst,
            false,
            x,
            panel,
        ) {
            let _in_place = PanelsInPlace::new();
            gemm_call(
                (rows, 64, k),
                dst,
                false,
                x,
                (panel, 64, 1),
                gemm::Parallelism::None,
            );
        }
    }
}

/// While one lives (on any thread), the gemm crate reads a one-thread product's left-hand
/// operand in place when its layout allows, whatever the product's size (threshold 256,
/// the most it takes; its own default 8 packs past 48 columns): a panel copy is already
/// in the layout packing would make. The threshold in force before the first comes back
/// when the last goes. Packing moves values without reordering a sum, so a product
/// running beside one (an attention's, on another thread) keeps its bits; only its speed
/// can change.
pub(in crate::nn) struct PanelsInPlace;

/// How many [`PanelsInPlace`] live, and the threshold before the first.
static PANELS_IN_PLACE: std::sync::Mutex<(usize, usize)> = std::sync::Mutex::new((0, 0));

impl PanelsInPlace {
    pub(in crate::nn) fn new() -> Self {
        let mut held = PANELS_IN_PLACE.lock().unwrap_or_else(|e| e.into_inner());
        if held.0 == 0 {
            held.1 = gemm::get_lhs_packing_threshold_single_thread();
            gemm::set_lhs_packing_threshold_single_thread(256);
        }
        held.0 += 1;
        Self
    }
}

impl Drop for PanelsInPlace {
    fn drop(&mut self) {
        let mut held = PANELS_IN_PLACE.lock().unwrap_or_else(|e| e.into_inner());
        held.0 -= 1;
        if held.0 == 0 {
            gemm::set_lhs_packing_threshold_single_thread(held.1);
        }
    }
}

/// `x [rows, k] W^T + b`, `W` `[out, k]` given as `W^T` ([`weight_product`]): the bias
/// pre-filled, the product added to it.
pub(in crate::nn) fn linear<T: Float>(
    x: &[T],
    wt: WeightRhs<T>,
    b: &[T],
    rows: usize,
    k: usize,
) -> Vec<T> {
    let out = b.len();
    let mut y = bias_rows(&[b], rows);
    weight_product((rows, out, k), (&mut y, out), true, (x, k, 1), wt);
    y
}

#[cfg(test)]
mod tests {
    use crate::nn::cpu::products::gemm::gemm_call;
    use crate::nn::cpu::products::panel_kernel::try_blocked;

    /// The panel product by `inputs` per block (0: the gemm crate's), `dst` pre-filled.
    fn panel_product_by(inputs: usize, (rows, k): (usize, usize), accumulate: bool) -> Vec<f32> {
        let value = |i: usize, m: usize| ((i * 7919 % m) as f32 - (m / 2) as f32) / m as f32;
        let x: Vec<f32> = (0..rows * k).map(|i| value(i, 97)).collect();
        let panel: Vec<f32> = (0..k * 64).map(|i| value(i, 89)).collect();
        // Rows 80 apart, the columns past 64 untouched.
        let mut dst: Vec<f32> = (0..rows * 80).map(|i| value(i, 83)).collect();
        let (d, xp, p) = ((dst.as_mut_ptr(), 80), (x.as_ptr(), k, 1), panel.as_ptr());
        // SAFETY: `dst` covers rows x 80, `x` rows x k, `panel` k x 64.
        unsafe {
            if !try_blocked(inputs, (rows, 64, k), d, accumulate, xp, p) {
                let _in_place = super::PanelsInPlace::new();
                gemm_call(
                    (rows, 64, k),
                    d,
                    accumulate,
                    xp,
                    (p, 64, 1),
                    gemm::Parallelism::None,
                );
            }
        }
        dst
    }

    #[test]
    fn the_blocked_kernel_gives_the_gemm_crates_bits() {
        let _widest = crate::nn::cpu::blocks::widest_held();
        let avx512 = cfg!(target_arch = "x86_64")
            && crate::nn::cpu::blocks::vectors() == crate::nn::cpu::blocks::Vectors::Avx512;
        // Rows: the tails of a 6-row tile and of a 48-row block, the gemm crate's switch at
        // 64; inputs: its blocks of 512 (one, split evenly, uneven), below and past them.
        for rows in [2, 5, 7, 47, 49, 64, 65, 100, 296] {
            for k in [3, 17, 384, 511, 512, 513, 1000, 1536] {
                for accumulate in [false, true] {
                    let reference = panel_product_by(0, (rows, k), accumulate);
                    for inputs in [1, 7, 64, 128, 4096] {
                        let got = panel_product_by(inputs, (rows, k), accumulate);
                        let same = got
                            .iter()
                            .zip(&reference)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{rows} rows, {k} inputs, blocks of {inputs}, accumulate {accumulate}"
                        );
                    }
                }
            }
        }
        // It ran (where it can): a product it declines would compare the gemm crate to itself.
        let (mut d, x, p) = (vec![0f32; 2 * 64], vec![1f32; 2 * 3], vec![1f32; 3 * 64]);
        // SAFETY: as above, rows 64 apart.
        let ran = unsafe {
            try_blocked(
                64,
                (2, 64, 3),
                (d.as_mut_ptr(), 64),
                false,
                (x.as_ptr(), 3, 1),
                p.as_ptr(),
            )
        };
        assert_eq!(ran, avx512);
        if ran {
            assert!(d.iter().all(|&v| v == 3.0));
        }
        // Declined: a panel of another width, one row, a strided `x`, off.
        for (inputs, rows, width, x_cs) in [
            (64, 2, 80, 1),
            (64, 1, 64, 1),
            (64, 2, 64, 2),
            (0, 2, 64, 1),
        ] {
            let (mut d, x, p) = (
                vec![0f32; 2 * 80],
                vec![1f32; 2 * 3 * 2],
                vec![1f32; 3 * 80],
            );
            // SAFETY: nothing is read or written when it declines (the shapes fit anyway).
            let ran = unsafe {
                try_blocked(
                    inputs,
                    (rows, width, 3),
                    (d.as_mut_ptr(), 80),
                    false,
                    (x.as_ptr(), 6, x_cs),
                    p.as_ptr(),
                )
            };
            assert!(!ran);
        }
    }
}
