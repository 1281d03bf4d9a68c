//! Projection weights kept transposed, in panels, while a long inference runs.
//!
//! A checkpoint stores a projection's weight as `W [out, in]`, and a layer computes
//! `x W^T`. For each product the gemm crate packs `W^T` into panels of its kernel's
//! outputs (gathering a scalar at a time from rows `in` apart) and throws the packing
//! away after. A copy made once in the layout the kernel reads, `W^T` in panels of
//! [`PANEL`](crate::nn::cpu::products::weight_products::PANEL) outputs, each panel `[in, width]` contiguous,
//! is read in place by every product of the encoding: one product per panel, no packing
//! ([`crate::nn::cpu::products::weight_products::weight_product`]), the same bits (the sums run in the
//! same order and the same blocks of `in`: see [`weight_rhs`]). An encoding of 4,000 texts with
//! all-MiniLM-L6-v2 on an AMD EPYC: the products 238.8-246.1 GFLOP/s per thread with the
//! weights transposed whole and packed by each product, 248.6-252.4 from the panels
//! (docs/benchmarks.md).
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

use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::products::weight_products::{panel_spans, WeightRhs};

/// The most bytes one [`TransposedWeights`] holds in copies.
pub const TRANSPOSED_BUDGET: usize = 512 << 20;

/// What a copy is found by: where the weight's values are (a weight read in place, the
/// copy holding its tensor so that no other values take that place while the copies
/// live), or the id of the tensor a weight read converted came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::nn) enum CopyKey {
    /// The address of the first value and the number of values.
    Values(usize, usize),
    /// The tensor the values were converted from.
    Tensor(TensorId),
}

/// One copy: what it is found by, the element type, the values (a [`PanelCopy`]), and
/// the weight read in place, held.
type Copy = (
    CopyKey,
    TypeId,
    Arc<dyn Any + Send + Sync>,
    Option<candle_core::Tensor>,
);

/// Bytes to which a copy's first value is aligned: a cache line, and an AVX-512 vector.
pub(in crate::nn) const COPY_ALIGN: usize = 64;

/// A weight's copy, `[in, out]` in panels ([`panel_spans`]), its first value on a
/// [`COPY_ALIGN`] boundary, so that each 64-output panel row the products read (256 bytes
/// of f32) is four whole cache lines. (A large `Vec` from the system allocator starts 16
/// bytes past one: every 64-byte vector load of such a copy would then span two lines,
/// which Intel cores pay for on each load; the same bits either way.)
pub(in crate::nn) struct PanelCopy<T> {
    /// The values, with up to `COPY_ALIGN` bytes unused before them.
    buf: Vec<T>,
    /// Where the values start in `buf`.
    start: usize,
    /// How many values.
    len: usize,
}

impl<T: Float> PanelCopy<T> {
    /// `len` zeros, the first aligned.
    fn zeros(len: usize) -> Self {
        let pad = COPY_ALIGN / std::mem::size_of::<T>().max(1);
        let buf = vec![T::zero(); len + pad];
        // `align_offset` may decline (usize::MAX): the copy is then as the allocator gave it.
        let start = buf.as_ptr().align_offset(COPY_ALIGN).min(pad);
        Self { buf, start, len }
    }

    fn values_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::Deref for PanelCopy<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

#[derive(Default)]
struct Copies {
    bytes: usize,
    copies: Vec<Copy>,
    /// Products that read a copy.
    reads: usize,
}

/// Copies of the projection weights a CPU inference reads, transposed in panels (see the
/// module).
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
        (key, held): (CopyKey, Option<&candle_core::Tensor>),
        w: &[T],
        (out, input): (usize, usize),
    ) -> Option<Arc<PanelCopy<T>>> {
        let mut c = self.lock();
        let ty = TypeId::of::<T>();
        if let Some((_, _, copy, _)) = c.copies.iter().find(|(k, t, ..)| *k == key && *t == ty) {
            return copy.clone().downcast::<PanelCopy<T>>().ok();
        }
        let bytes = std::mem::size_of_val(w);
        if c.bytes + bytes > TRANSPOSED_BUDGET {
            return None;
        }
        // Made under the lock: a second thread wanting the same weight waits for it rather
        // than making its own (once per weight).
        let copy = Arc::new(panels(w, out, input));
        c.bytes += bytes;
        c.copies.push((key, ty, copy.clone(), held.cloned()));
        Some(copy)
    }
}

/// The copy of a weight (`w`, `[out, input]`; the copy `[input, out]` in panels) from the
/// copies this thread runs inside, made on first use; `None` outside
/// [`TransposedWeights::run`] or past the budget. `source`: the weight's tensor where
/// `w` are its values in place (found by their address: one copy for a variable and
/// every view of it, as the representation pass's detached model and the replay's
/// tracked one read it), else the id of the tensor `w` was converted from.
pub(in crate::nn) fn transposed<T: Float>(
    source: Result<&candle_core::Tensor, TensorId>,
    w: &[T],
    (out, input): (usize, usize),
) -> Option<Arc<PanelCopy<T>>> {
    if w.len() != out * input {
        return None;
    }
    let key = match source {
        Ok(held) => (CopyKey::Values(w.as_ptr() as usize, w.len()), Some(held)),
        Err(id) => (CopyKey::Tensor(id), None),
    };
    let active = ACTIVE.with(|a| a.borrow().clone())?;
    active.get(key, w, (out, input))
}

/// `w [out, input]` transposed in panels: the panel of outputs `first..first + width` is
/// `[input, width]` (its element `(i, o)` at `first * input + i * width + o - first`),
/// the panels one after another. Each panel is made a tile of 32 inputs at a time, so
/// the rows it reads and the columns it writes stay in cache.
fn panels<T: Float>(w: &[T], out: usize, input: usize) -> PanelCopy<T> {
    const TILE: usize = 32;
    let mut copy = PanelCopy::zeros(w.len());
    let t = copy.values_mut();
    for (first, width) in panel_spans(out) {
        let panel = &mut t[first * input..(first + width) * input];
        for i0 in (0..input).step_by(TILE) {
            for o in 0..width {
                let row = &w[(first + o) * input..(first + o + 1) * input];
                for i in i0..(i0 + TILE).min(input) {
                    panel[i * width + o] = row[i];
                }
            }
        }
    }
    copy
}

/// `W^T` as the right operand of `x W^T`, `x` `[rows, input]`, `W` `[out, input]`: the
/// copy in panels where there is one and it gives the same bits, else the weight as
/// stored.
///
/// The gemm crate's blocked kernels give every layout the same bits (packing moves the
/// values, each output's sum keeps its order and its blocks of `input`, whose size comes
/// from the cache sizes alone); its special paths for thin or tiny products do not: a
/// product of at most 256 outputs takes dot-product kernels that read the stored layout
/// along `input`, one with a single row or fewer than 16 outputs, or an `input` of 2 or
/// less, kernels of its own. Those read the weight as stored (all small: nothing to gain).
/// So does a product of at most 64 rows with an `input` past 512: a product that small
/// on both sides (a panel's) sums `input` in blocks of 512, a larger one in equal blocks
/// sized from the L1 cache (an `input` of 600: 512 and 88 against 300 and 300 on AVX-512,
/// against one block of 600 on AVX2). Checked for the encoders' shapes and the edges of these
/// rules, on AVX-512 and on an emulated Haswell (AVX2; tests/it/transposed_weights.rs). A user's
/// BLAS ([`crate::nn::cpu::products::blas`]) reads the weight as stored.
pub(in crate::nn) fn weight_rhs<'a, T>(
    w: &'a [T],
    copy: Option<&'a [T]>,
    rows: usize,
    (out, input): (usize, usize),
) -> WeightRhs<'a, T> {
    let same_bits =
        rows >= 2 && out >= 16 && rows * out > 256 && input > 2 && (rows > 64 || input <= 512);
    match copy {
        Some(t) if same_bits && !crate::nn::cpu::products::blas::products_through_blas() => {
            ACTIVE.with(|a| {
                if let Some(active) = &*a.borrow() {
                    active.lock().reads += 1;
                }
            });
            WeightRhs::Panels(t)
        }
        _ => WeightRhs::Strided((w, 1, input)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::cpu::products::weight_products::PANEL;
    use candle_core::{Device, Tensor};

    fn id() -> TensorId {
        Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .id()
    }

    #[test]
    fn copies_are_read_only_inside_run_and_transpose() {
        let w: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let key = Err(id());
        let copies = TransposedWeights::new();
        assert!(transposed(key, &w, (2, 3)).is_none());
        let t = copies.run(|| {
            let t = transposed(key, &w, (2, 3)).unwrap();
            // Two outputs: one panel, the whole weight transposed.
            assert_eq!(t[..], [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
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
    fn a_variable_and_its_views_share_one_copy_held_while_the_copies_live() {
        use crate::nn::cpu::layers::packing::View;
        let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let var = candle_core::Var::from_vec(values, (2, 3), &Device::Cpu).unwrap();
        // The replay's tracked weight and the representation pass's detached view of it:
        // two tensors (two ids), one storage.
        let (tracked, detached) = (var.as_tensor().clone(), var.as_detached_tensor());
        assert_ne!(tracked.id(), detached.id());
        let copies = TransposedWeights::new();
        copies.run(|| {
            let read = |t: &Tensor| {
                let view = View::new(t).unwrap();
                transposed(Ok(t), view.values::<f32>().unwrap(), (2, 3)).unwrap()
            };
            let first = read(&tracked);
            assert!(Arc::ptr_eq(&first, &read(&detached)));
            assert_eq!(first[..], [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        });
        assert_eq!(copies.bytes(), 24, "one copy");
        // The copy holds the weight: its storage outlives the tensors given.
        let held = copies.lock().copies[0].3.clone().unwrap();
        drop((tracked, detached, var));
        assert_eq!(held.to_vec2::<f32>().unwrap()[1], [3.0, 4.0, 5.0]);
    }

    #[test]
    fn panels_hold_every_element_once_where_the_products_read_it() {
        for (out, input) in [(45, 70), (64, 33), (130, 40), (200, 3), (384, 64)] {
            let spans: Vec<_> = panel_spans(out).collect();
            // Panels one after another over every output, none thinner than a panel
            // but where the whole weight is.
            assert_eq!(spans.first().map(|s| s.0), Some(0));
            assert_eq!(spans.iter().map(|s| s.1).sum::<usize>(), out);
            for pair in spans.windows(2) {
                assert_eq!(pair[0].0 + pair[0].1, pair[1].0);
            }
            assert!(spans
                .iter()
                .all(|&(_, w)| w >= PANEL.min(out) && w < 2 * PANEL));
            let w: Vec<f64> = (0..out * input).map(|i| i as f64).collect();
            let t = panels(&w, out, input);
            assert_eq!(t.len(), w.len());
            assert_eq!(
                t.as_ptr() as usize % COPY_ALIGN,
                0,
                "the copy starts on a line"
            );
            let f32_copy = panels(&vec![0f32; out * input], out, input);
            assert_eq!(f32_copy.as_ptr() as usize % COPY_ALIGN, 0);
            for (first, width) in spans {
                for i in 0..input {
                    for o in first..first + width {
                        assert_eq!(t[first * input + i * width + o - first], w[o * input + i]);
                    }
                }
            }
        }
    }
}
