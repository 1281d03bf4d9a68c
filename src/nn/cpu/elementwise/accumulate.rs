//! Additions in place: a bias over every row or a gradient element by element (no second
//! full-size tensor), and the column sums of a bias gradient in fixed blocks.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, InplaceOp2, Layout, Shape, Tensor, WithDType};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{
    contiguous, dispatch, for_blocks, parallel_ranges, sum_partials, Float, SharedMut, BLOCK_ROWS,
};

/// `y += b` in place (no second full-size tensor): on every row of `y` (`rows`, a bias
/// `b` of the row width) or element by element (`b` of `y`'s size).
pub(crate) struct AddInPlace {
    pub(crate) rows: bool,
}

impl InplaceOp2 for AddInPlace {
    fn name(&self) -> &'static str {
        "gradcache-add-in-place"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        if self.rows {
            candle_core::bail!("add in place: a row bias on a GPU");
        }
        crate::nn::cuda::add_in_place(s1, l1, s2, l2)
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let Some((start, end)) = l1.contiguous_offsets() else {
            candle_core::bail!("add in place: the output must be contiguous");
        };
        match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(_)) => {
                let b = contiguous::<f32>(s2, l2)?;
                if self.rows {
                    add_rows(&mut y[start..end], b)
                } else {
                    add_elementwise(&mut y[start..end], b)
                }
                Ok(())
            }
            (CpuStorage::F64(y), CpuStorage::F64(_)) => {
                let b = contiguous::<f64>(s2, l2)?;
                if self.rows {
                    add_rows(&mut y[start..end], b)
                } else {
                    add_elementwise(&mut y[start..end], b)
                }
                Ok(())
            }
            _ => candle_core::bail!("add in place: f32 or f64 of one dtype"),
        }
    }
}

wide_fn! {
pub(in crate::nn) fn add_rows<T: Float>(y: &mut [T], b: &[T]) {
    for_blocks(y, b.len(), |_, rows| {
        for row in rows.chunks_mut(b.len()) {
            for (v, &bias) in row.iter_mut().zip(b) {
                *v += bias;
            }
        }
    });
}
}

/// `acc += g` element by element, in place, for same-shape contiguous tensors in f32 or
/// f64 on the CPU, f32 on a GPU (gradient accumulation without a new tensor per
/// addition); the caller must own `acc`'s storage. Each element is the same `acc + g` as
/// [`Tensor::add`] computes.
pub fn add_in_place(acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    if acc.shape() != g.shape() {
        candle_core::bail!("add in place: shapes {:?} and {:?}", acc.dims(), g.dims());
    }
    acc.inplace_op2(&g.contiguous()?, &AddInPlace { rows: false })
}

/// `acc[i, :] += row` for every row `i`, in place, for a contiguous `[rows, w]` tensor and
/// a row of `w`, f32 or f64 on the CPU; the caller must own `acc`'s storage.
pub fn add_row_in_place(acc: &Tensor, row: &Tensor) -> candle_core::Result<()> {
    let w = acc.dim(candle_core::D::Minus1)?;
    if row.elem_count() != w || !acc.device().is_cpu() {
        candle_core::bail!(
            "add a row in place: {:?} to {:?} on the CPU",
            row.dims(),
            acc.dims()
        );
    }
    acc.inplace_op2(
        &row.flatten_all()?.contiguous()?,
        &AddInPlace { rows: true },
    )
}

wide_fn! {
pub(in crate::nn) fn add_elementwise<T: Float>(acc: &mut [T], g: &[T]) {
    const WIDTH: usize = 1024;
    for_blocks(acc, WIDTH, |blk, chunk| {
        let base = blk * BLOCK_ROWS * WIDTH;
        for (a, &v) in chunk.iter_mut().zip(&g[base..]) {
            *a += v;
        }
    });
}
}

/// The sum over rows of a `[rows, w]` matrix (a bias gradient), in fixed blocks.
pub(crate) struct SumRows;

impl CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "gradcache-sum-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = *l.shape().dims().last().unwrap_or(&1);
        dispatch!(s, T => {
            let x = contiguous::<T>(s, l)?;
            let blocks = x.len().div_ceil(BLOCK_ROWS * w.max(1));
            let mut partials = vec![<T as num_traits::Zero>::zero(); blocks * w];
            let shared = SharedMut(partials.as_mut_ptr());
            parallel_ranges(blocks, |range| {
                for blk in range {
                    // SAFETY: block `blk` owns partials `blk * w .. (blk + 1) * w`.
                    let acc = unsafe { std::slice::from_raw_parts_mut(shared.get().add(blk * w), w) };
                    let base = blk * BLOCK_ROWS * w;
                    for row in x[base..x.len().min(base + BLOCK_ROWS * w)].chunks(w) {
                        for (a, &v) in acc.iter_mut().zip(row) {
                            *a += v;
                        }
                    }
                }
            });
            Ok((T::to_cpu_storage_owned(sum_partials(&partials, w)), Shape::from(w)))
        })
    }
}
