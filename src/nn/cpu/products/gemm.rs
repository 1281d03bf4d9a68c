//! The matrix products of the layer nodes, on slices through the gemm crate: into a new
//! buffer or accumulated into one (the residual gradients, a pre-filled bias), with the
//! parallelism candle itself would choose (none in serial mode), a product with its bias,
//! and the column sums of a bias gradient in fixed blocks. f32 products go to the user's
//! BLAS instead where one is loaded ([`super::blas`]).

use super::blocks::wide_fn;
use super::blocks::{in_serial, parallel_ranges, sum_partials, Float, SharedMut, BLOCK_ROWS};

/// The gemm crate's parallelism for the layer's large products (candle's own choice).
pub(in crate::nn) fn parallelism() -> gemm::Parallelism {
    if in_serial() {
        return gemm::Parallelism::None;
    }
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// The environment variable the binaries read for the gemm crate's packing thresholds
/// ([`packing_from_env`]).
pub const PACKING_ENV: &str = "GRADCACHE_GEMM_PACKING";

/// The gemm crate's packing thresholds, process-wide: when it packs the right-hand
/// operand (internally; the activations of a layer's `x W^T`) and, on one thread, the
/// left-hand one (the weight). Packing moves values without reordering a sum, so every
/// setting gives the same bits; only the speed changes, and by CPU (`cargo bench --bench
/// train_step -- --packing` times them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackingThresholds {
    /// The right-hand operand is packed past this many of the kernel's row blocks (1 to
    /// 256; the crate's default 128).
    pub rhs: usize,
    /// On one thread, the left-hand operand is packed past this many (1 to 256; the
    /// crate's default 8).
    pub lhs: usize,
}

impl PackingThresholds {
    /// The thresholds in force now.
    pub fn current() -> Self {
        Self {
            rhs: gemm::get_rhs_packing_threshold(),
            lhs: gemm::get_lhs_packing_threshold_single_thread(),
        }
    }

    /// Puts these in force for the whole process.
    pub fn apply(self) {
        gemm::set_rhs_packing_threshold(self.rhs);
        gemm::set_lhs_packing_threshold_single_thread(self.lhs);
    }

    /// `rhs=N`, `lhs=N` or both, comma-separated; what is left out keeps its value in
    /// `self`. Each `N` from 1 to 256 (the crate's own range).
    pub fn parse_over(self, text: &str) -> crate::Result<Self> {
        let refuse = |reason| crate::error::invalid(PACKING_ENV, text, reason);
        let mut out = self;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| refuse("expected rhs=N and/or lhs=N, comma-separated"))?;
            let value: usize = value
                .trim()
                .parse()
                .map_err(|_| refuse("a threshold is a whole number from 1 to 256"))?;
            if !(1..=256).contains(&value) {
                return Err(refuse("a threshold is a whole number from 1 to 256"));
            }
            match name.trim() {
                "rhs" => out.rhs = value,
                "lhs" => out.lhs = value,
                _ => return Err(refuse("the thresholds are named rhs and lhs")),
            }
        }
        Ok(out)
    }
}

/// The thresholds in `GRADCACHE_GEMM_PACKING` (see [`PackingThresholds::parse_over`]),
/// put in force, if it is set and not empty; `None` otherwise. A value refused changes
/// nothing.
pub fn packing_from_env() -> crate::Result<Option<PackingThresholds>> {
    let expected = "expected rhs=N and/or lhs=N, comma-separated";
    let Some(text) = crate::error::env_setting(PACKING_ENV, expected)? else {
        return Ok(None);
    };
    let set = PackingThresholds::current().parse_over(&text)?;
    set.apply();
    Ok(Some(set))
}

/// A matrix operand: its values, row stride and column stride.
pub(in crate::nn) type Operand<'a, T> = (&'a [T], usize, usize);

/// The index of the last element `rows x cols` with these strides reach.
pub(in crate::nn) fn last(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs
}

/// `dst [m, n] (+)= lhs [m, k] rhs [k, n]`, `dst` with row stride `dst_rs`; with
/// `accumulate` the product is added to what `dst` holds.
pub(in crate::nn) fn product<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [T], usize),
    accumulate: bool,
    lhs: Operand<T>,
    rhs: Operand<T>,
) {
    let Some(dst) = destination(dst, (m, n), dst_rs) else {
        return;
    };
    // SAFETY: `dst` covers the destination (checked), borrowed mutably.
    unsafe { product_raw((m, n, k), dst, accumulate, lhs, rhs) }
}

/// `dst` as the pointer and row stride of an `m x n` destination, checked to cover it;
/// `None` for an empty one (nothing to compute).
fn destination<T>(dst: &mut [T], (m, n): (usize, usize), dst_rs: usize) -> Option<(*mut T, usize)> {
    if m == 0 || n == 0 {
        return None;
    }
    assert!(
        dst.len() > last(m, n, dst_rs, 1),
        "product: destination too small"
    );
    Some((dst.as_mut_ptr(), dst_rs))
}

/// `lhs [m, k] rhs [k, n]` into a new `[m, n]` buffer.
pub(in crate::nn) fn product_new<T: Float>(
    (m, n, k): (usize, usize, usize),
    lhs: Operand<T>,
    rhs: Operand<T>,
) -> Vec<T> {
    if k == 0 {
        return vec![T::zero(); m * n];
    }
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the product writes every element of the `m * n` it was given room for
    // (`accumulate` off, `k > 0`), before the length is set.
    unsafe {
        product_raw((m, n, k), (out.as_mut_ptr(), n), false, lhs, rhs);
        out.set_len(m * n);
    }
    out
}

/// Outputs per panel of a weight copy ([`WeightRhs::Panels`]): the rows of the gemm
/// crate's AVX-512 f32 kernel (four vectors of 16), four of its AVX2 kernel's. Of the
/// sizes tried on an AMD EPYC (64, 128, 256, 512; an encoding of 4,000 texts with
/// all-MiniLM-L6-v2), the fastest.
pub const PANEL: usize = 64;

/// The panels of a weight of `out` outputs: `(first output, width)`, [`PANEL`] wide but
/// the last, which takes the rest (`PANEL` to `2 * PANEL - 1` wide; all of `out` when it is
/// narrower than a panel), so no product of a panel is thin enough for the gemm crate's
/// special paths (see [`super::transposed::weight_rhs`]).
pub(in crate::nn) fn panel_spans(out: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = (out / PANEL).max(1);
    (0..count).map(move |p| {
        let first = p * PANEL;
        let width = if p + 1 == count { out - first } else { PANEL };
        (first, width)
    })
}

/// `W^T`, the right operand of a layer's `x W^T` ([`weight_product`]), as
/// [`super::transposed::weight_rhs`] gives it.
#[derive(Clone, Copy)]
pub(in crate::nn) enum WeightRhs<'a, T> {
    /// A matrix with strides: the weight as stored, `(1, input)`.
    Strided(Operand<'a, T>),
    /// A copy transposed in panels ([`panel_spans`]; `super::transposed` makes them), read
    /// one product per panel.
    Panels(&'a [T]),
}

/// `dst [m, n] (+)= lhs [m, k] W^T`, `W^T` `[k, n]` as [`super::transposed::weight_rhs`]
/// gives it: a strided operand as [`product`], or a copy in panels, one product per panel
/// read in place ([`panel_products`]).
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
/// [`super::transposed::weight_rhs`]). The products of the blocks and panels are shared
/// out across the threads (one thread each: a panel's product is too small to split
/// well), or run in turn on a [`super::blocks::serial`] thread.
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
    let blocked = super::panel_kernel::PanelKernel::current().blocked_inputs();
    parallel_ranges(jobs.len(), |range| {
        for &(first_row, rows, first, width) in &jobs[range] {
            // SAFETY: the block's rows and the panel's columns of `dst`, no other job's;
            // the rows of `lhs` and the panel's values (`k * width` from `first * k`,
            // checked above).
            unsafe {
                let ran = super::panel_kernel::try_blocked(
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
    kernel: super::panel_kernel::PanelKernel,
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
        if !super::panel_kernel::try_blocked(inputs, (rows, 64, k), dst, false, x, panel) {
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

/// The gemm call behind [`product`] and [`product_new`].
///
/// # Safety
/// `dst` addresses `m x n` elements with row stride `dst_rs`, overlapping no operand.
pub(in crate::nn) unsafe fn product_raw<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): Operand<T>,
    (rhs, rhs_rs, rhs_cs): Operand<T>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 {
        assert!(
            lhs.len() > last(m, k, lhs_rs, lhs_cs) && rhs.len() > last(k, n, rhs_rs, rhs_cs),
            "product: operand too small"
        );
    }
    let timer = crate::profile::enabled().then(std::time::Instant::now);
    let (lhs_raw, rhs_raw) = (
        (lhs.as_ptr(), lhs_rs, lhs_cs),
        (rhs.as_ptr(), rhs_rs, rhs_cs),
    );
    // SAFETY: the caller's contract is the product's.
    let through_blas =
        unsafe { super::blas::try_product((m, n, k), (dst, dst_rs), accumulate, lhs_raw, rhs_raw) };
    if !through_blas {
        // SAFETY: as above.
        unsafe {
            gemm_call(
                (m, n, k),
                (dst, dst_rs),
                accumulate,
                lhs_raw,
                rhs_raw,
                parallelism(),
            )
        }
    }
    if let Some(start) = timer {
        crate::profile::record_product(start.elapsed(), (m, n, k));
    }
}

/// The gemm crate's product `dst [m, n] (+)= lhs [m, k] rhs [k, n]`, operands as
/// (pointer, row stride, column stride), with parallelism `par`: [`product_raw`]'s and
/// the attention kernels' (single-threaded, one task's at a time).
///
/// # Safety
/// Every pointer must address the elements its strides reach; `dst`'s must not overlap
/// the inputs' or another thread's.
pub(in crate::nn) unsafe fn gemm_call<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut T, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (*const T, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const T, usize, usize),
    par: gemm::Parallelism,
) {
    // SAFETY: the caller's contract is the gemm crate's.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            if accumulate { T::one() } else { T::zero() },
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}

/// Rows of `width` holding the biases side by side, `rows` times (the destination of
/// products that add to them).
pub(in crate::nn) fn bias_rows<T: Float>(biases: &[&[T]], rows: usize) -> Vec<T> {
    let _span = crate::profile::span(|| "cpu.bias-rows".into());
    let width: usize = biases.iter().map(|b| b.len()).sum();
    let mut y = Vec::with_capacity(rows * width);
    for _ in 0..rows {
        for b in biases {
            y.extend_from_slice(b);
        }
    }
    y
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

wide_fn! {
/// Column sums of `[rows, width]` (a bias gradient), in a fixed order.
pub(in crate::nn) fn column_sums<T: Float>(x: &[T], width: usize) -> Vec<T> {
    let rows = x.len() / width.max(1);
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let mut partials = vec![T::zero(); blocks * width];
    let shared = SharedMut(partials.as_mut_ptr());
    parallel_ranges(blocks, |range| {
        for blk in range {
            // SAFETY: block `blk` owns partials `blk * width .. (blk + 1) * width`.
            let acc =
                unsafe { std::slice::from_raw_parts_mut(shared.get().add(blk * width), width) };
            let end = rows.min((blk + 1) * BLOCK_ROWS);
            for row in x[blk * BLOCK_ROWS * width..end * width].chunks_exact(width) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
        }
    });
    sum_partials(&partials, width)
}
}

#[cfg(test)]
mod tests {
    use super::super::panel_kernel::try_blocked;
    use super::{gemm_call, PackingThresholds};

    /// `x [rows, input] W^T` with `W^T` given transposed (`[input, out]`), on one thread.
    fn layer_product(x: &[f32], wt: &[f32], (rows, input, out): (usize, usize, usize)) -> Vec<f32> {
        let mut y = vec![0.0f32; rows * out];
        // SAFETY: the buffers hold the shapes' elements.
        unsafe {
            gemm_call(
                (rows, out, input),
                (y.as_mut_ptr(), out),
                false,
                (x.as_ptr(), input, 1),
                (wt.as_ptr(), out, 1),
                gemm::Parallelism::None,
            )
        };
        y
    }

    #[test]
    fn every_packing_threshold_gives_the_same_bits_at_the_encoders_shapes() {
        let default = PackingThresholds::current();
        let value = |i: usize| ((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0;
        for (rows, input, out) in [
            (296, 384, 1536),
            (296, 1536, 384),
            (592, 384, 384),
            (70, 768, 3072),
        ] {
            let x: Vec<f32> = (0..rows * input).map(value).collect();
            let wt: Vec<f32> = (0..input * out).map(|i| value(i + 7)).collect();
            let reference = layer_product(&x, &wt, (rows, input, out));
            for (rhs, lhs) in [(1, 8), (128, 256), (1, 256), (256, 1)] {
                PackingThresholds { rhs, lhs }.apply();
                let y = layer_product(&x, &wt, (rows, input, out));
                default.apply();
                assert!(
                    y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "rhs {rhs}, lhs {lhs} changed the bits of [{rows} x {input}] x [{input} x {out}]"
                );
            }
        }
    }

    #[test]
    fn packing_thresholds_parse_what_is_named_and_refuse_the_rest() {
        let base = PackingThresholds { rhs: 128, lhs: 8 };
        let both = base.parse_over("rhs=1, lhs=256").unwrap();
        assert_eq!(both, PackingThresholds { rhs: 1, lhs: 256 });
        assert_eq!(
            base.parse_over("lhs=16").unwrap(),
            PackingThresholds { rhs: 128, lhs: 16 }
        );
        for bad in ["rhs", "rhs=0", "lhs=257", "rhs=x", "mc=4", "rhs=-1"] {
            let err = base.parse_over(bad).unwrap_err().to_string();
            assert!(
                err.contains("GRADCACHE_GEMM_PACKING") && err.contains(bad),
                "{err}"
            );
        }
    }

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
        let avx512 = cfg!(target_arch = "x86_64")
            && super::super::blocks::vectors() == super::super::blocks::Vectors::Avx512;
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
