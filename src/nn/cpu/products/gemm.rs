//! The matrix products of the layer nodes, on slices through the gemm crate: into a new
//! buffer or accumulated into one (the residual gradients, a pre-filled bias), with the
//! parallelism candle itself would choose (none in serial mode), a product with its bias,
//! and the column sums of a bias gradient in fixed blocks. f32 products go to the user's
//! BLAS instead where one is loaded ([`crate::nn::cpu::products::blas`]).

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{
    in_serial, parallel_ranges, sum_partials, Float, SharedMut, BLOCK_ROWS,
};

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
pub(super) fn destination<T>(
    dst: &mut [T],
    (m, n): (usize, usize),
    dst_rs: usize,
) -> Option<(*mut T, usize)> {
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
    let through_blas = unsafe {
        crate::nn::cpu::products::blas::try_product(
            (m, n, k),
            (dst, dst_rs),
            accumulate,
            lhs_raw,
            rhs_raw,
        )
    };
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
}
