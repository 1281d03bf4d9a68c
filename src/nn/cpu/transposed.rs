//! Projection weights kept transposed while a long inference runs.
//!
//! A checkpoint stores a projection's weight as `W [out, in]`, and a layer computes
//! `x W^T`: the gemm crate packs `W^T` for its microkernels by gathering a scalar at a
//! time from rows `in` apart. Stored `[in, out]`, the same product packs contiguous
//! panels and gives the same bits (the sums run in the same order), 1-9% faster by shape
//! (`cargo bench --bench train_step -- --layout`; most for the feed-forward's down
//! projection, whose `in` is the widest).
//!
//! The model's own weights stay as they are (training, the graph and the exported files
//! share them). A [`TransposedWeights`] holds copies: while a thread runs inside
//! [`TransposedWeights::run`], the CPU layer nodes it runs ask it for a copy of each
//! projection weight, made on first use and reused by every later chunk, on any thread
//! of the same `TransposedWeights`; the copies go when it is dropped. Threads outside
//! `run` (a training step beside it) never see them. The weights must not change while
//! it lives: `crate::hub::embed` makes one for a long encoding, where nothing trains.
//! Copies stop at [`TRANSPOSED_BUDGET`] bytes in all (a weight past it is read as
//! stored), so a large model does not double its memory for a few percent.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use candle_core::TensorId;

use super::blocks::Float;
use super::gemm::Operand;

/// The most bytes one [`TransposedWeights`] holds in copies.
pub const TRANSPOSED_BUDGET: usize = 512 << 20;

/// One copy: the weight it is of, the element type, the values `[in, out]`.
type Copy = (TensorId, TypeId, Arc<dyn Any + Send + Sync>);

#[derive(Default)]
struct Copies {
    bytes: usize,
    copies: Vec<Copy>,
    /// Products that read a copy.
    reads: usize,
}

/// Transposed copies of the projection weights a CPU inference reads (see the module).
#[derive(Clone, Default)]
pub struct TransposedWeights(Arc<Mutex<Copies>>);

thread_local! {
    /// The copies the layer nodes of this thread read, inside [`TransposedWeights::run`].
    static ACTIVE: RefCell<Option<TransposedWeights>> = const { RefCell::new(None) };
}

impl TransposedWeights {
    /// No copies yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on this thread with the layer nodes' projection weights read from these
    /// copies (made as they are first wanted). The weights must not change while the
    /// copies live.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<TransposedWeights>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                ACTIVE.with(|a| *a.borrow_mut() = previous);
            }
        }
        let previous = ACTIVE.with(|a| a.borrow_mut().replace(self.clone()));
        let _restore = Restore(previous);
        f()
    }

    /// The bytes the copies take.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// How many products have read a copy (those of shapes that keep the bits: see
    /// `weight_rhs`).
    pub fn reads(&self) -> usize {
        self.lock().reads
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Copies> {
        // The bookkeeping stays consistent whatever a panicking holder did.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get<T: Float>(
        &self,
        id: TensorId,
        w: &[T],
        (out, input): (usize, usize),
    ) -> Option<Arc<Vec<T>>> {
        let mut c = self.lock();
        let ty = TypeId::of::<T>();
        if let Some((_, _, copy)) = c.copies.iter().find(|(i, t, _)| *i == id && *t == ty) {
            return copy.clone().downcast::<Vec<T>>().ok();
        }
        let bytes = std::mem::size_of_val(w);
        if c.bytes + bytes > TRANSPOSED_BUDGET {
            return None;
        }
        // Made under the lock: a second thread wanting the same weight waits for it rather
        // than making its own (once per weight).
        let copy = Arc::new(transpose(w, out, input));
        c.bytes += bytes;
        c.copies.push((id, ty, copy.clone()));
        Some(copy)
    }
}

/// The copy `[input, out]` of weight `id` (`w`, `[out, input]`) from the copies this
/// thread runs inside, made on first use; `None` outside [`TransposedWeights::run`] or
/// past the budget.
pub(in crate::nn) fn transposed<T: Float>(
    id: TensorId,
    w: &[T],
    (out, input): (usize, usize),
) -> Option<Arc<Vec<T>>> {
    if w.len() != out * input {
        return None;
    }
    let active = ACTIVE.with(|a| a.borrow().clone())?;
    active.get(id, w, (out, input))
}

/// `w [rows, cols]` as `[cols, rows]`, in tiles that stay in cache.
fn transpose<T: Float>(w: &[T], rows: usize, cols: usize) -> Vec<T> {
    const TILE: usize = 32;
    let mut t = vec![T::zero(); w.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    t[c * rows + r] = w[r * cols + c];
                }
            }
        }
    }
    t
}

/// `W^T` as the right operand of `x W^T`, `x` `[rows, input]`, `W` `[out, input]`: the
/// transposed copy where there is one and it gives the same bits, else the weight as
/// stored.
///
/// The gemm crate's blocked kernels give both layouts the same bits (packing moves the
/// values, the sums keep their order); its special paths for thin or tiny products do
/// not: a product of at most 256 outputs takes dot-product kernels that read the stored
/// layout along `input`, one with a single row or fewer than 16 outputs, or an `input`
/// of 2 or less, kernels of its own. Those read the weight as stored (all small: nothing
/// to gain). Checked for every shape of rows 1-140, `input` 1-384, `out` 1-200 and the
/// encoders' large ones, on AVX-512 and on an emulated Haswell (AVX2), single-threaded
/// and on two threads. A user's BLAS ([`super::blas`]) reads the weight as stored.
pub(in crate::nn) fn weight_rhs<'a, T>(
    w: &'a [T],
    copy: Option<&'a [T]>,
    rows: usize,
    (out, input): (usize, usize),
) -> Operand<'a, T> {
    let same_bits = rows >= 2 && out >= 16 && rows * out > 256 && input > 2;
    match copy {
        Some(t) if same_bits && !super::blas::products_through_blas() => {
            ACTIVE.with(|a| {
                if let Some(active) = &*a.borrow() {
                    active.lock().reads += 1;
                }
            });
            (t, out, 1)
        }
        _ => (w, 1, input),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn id() -> TensorId {
        Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .id()
    }

    #[test]
    fn copies_are_read_only_inside_run_and_transpose() {
        let w: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let key = id();
        let copies = TransposedWeights::new();
        assert!(transposed(key, &w, (2, 3)).is_none());
        let t = copies.run(|| {
            let t = transposed(key, &w, (2, 3)).unwrap();
            assert_eq!(*t, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
            // The same copy again, not a second one; nested, the inner copies are read.
            assert!(Arc::ptr_eq(&t, &transposed(key, &w, (2, 3)).unwrap()));
            let inner = TransposedWeights::new();
            let other = inner.run(|| transposed(key, &w, (2, 3)).unwrap());
            assert!(!Arc::ptr_eq(&t, &other));
            assert!(Arc::ptr_eq(&t, &transposed(key, &w, (2, 3)).unwrap()));
            t
        });
        assert_eq!(copies.bytes(), 24);
        assert!(transposed(key, &w, (2, 3)).is_none());
        // Another thread outside `run` sees nothing; inside, the same copy.
        std::thread::scope(|s| {
            s.spawn(|| assert!(transposed(key, &w, (2, 3)).is_none()));
            s.spawn(|| {
                let again = copies.run(|| transposed(key, &w, (2, 3)).unwrap());
                assert!(Arc::ptr_eq(&t, &again));
            });
        });
    }

    #[test]
    fn a_tile_edge_transposes_like_the_rest() {
        let (rows, cols) = (45, 70);
        let w: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();
        let t = transpose(&w, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t[c * rows + r], w[r * cols + c]);
            }
        }
    }
}
