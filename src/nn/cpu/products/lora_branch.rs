//! A LoRA adapter inside the layer nodes: the low-rank branch of a projection,
//!
//! ```text
//! y  += s t B^T              t = dropout(x) A^T   [rows, r]
//! dB  = s dy^T t             dt = s dy B           [rows, r]
//! dA  = dt^T dropout(x)      dx += mask (dt A)
//! ```
//!
//! on the node's packed rows, the dropout mask of each row that of its place in the padded
//! `[n s, in]` input (the composed branch's mask, element for element). The forward keeps
//! nothing: the backward draws the mask again and recomputes `t` (`rows x in x r`, a
//! small product) with the forward's arithmetic, so its values are the forward's bit for
//! bit. The frozen base weight's own gradient `dy^T x`, the largest product of a
//! projection's backward, is not computed at all.

use std::borrow::Cow;

use candle_core::Tensor;

use crate::nn::cpu::blocks::Float;
use crate::nn::cpu::elementwise::rows::dropped;
use crate::nn::cpu::layers::packing::View;
use crate::nn::cpu::products::gemm::{product, product_new, Operand};

/// An adapter as a node takes it: `A` `[r, in]` and `B` `[out, r]` (variables: the node
/// deposits their gradients), the scale, and the dropout mask of its input this forward.
#[derive(Debug, Clone)]
pub struct LoraInput {
    /// `lora_A` `[r, in]`.
    pub a: Tensor,
    /// `lora_B` `[out, r]`.
    pub b: Tensor,
    /// `alpha / r` (or rsLoRA's `alpha / sqrt(r)`).
    pub scale: f64,
    /// The seed and drop probability of the mask on the adapter's input, `None` without
    /// dropout.
    pub dropout: Option<(u64, f32)>,
}

impl LoraInput {
    /// Whether the adapter fits a projection `in -> out`.
    pub(in crate::nn) fn fits(&self, input: usize, output: usize) -> bool {
        match (self.a.dims2(), self.b.dims2()) {
            (Ok((r, i)), Ok((o, r2))) => r == r2 && i == input && o == output,
            _ => false,
        }
    }

    /// The adapter's values, copied (`r (in + out)` numbers: the node's own, whatever
    /// happens to the variables before its backward).
    pub(in crate::nn) fn values<T: Float>(&self) -> candle_core::Result<Held<T>> {
        let read = |t: &Tensor| -> candle_core::Result<Vec<T>> {
            let t = t.detach().to_dtype(T::DTYPE)?.contiguous()?;
            let view = View::new(&t)?;
            Ok(view.values::<T>()?.to_vec())
        };
        Ok(Held {
            a: read(&self.a)?,
            b: read(&self.b)?,
            rank: self.a.dim(0)?,
            scale: self.scale,
            dropout: self.dropout,
        })
    }
}

/// An adapter's values held by a node between its forward and backward.
pub(in crate::nn) struct Held<T> {
    a: Vec<T>,
    b: Vec<T>,
    rank: usize,
    scale: f64,
    dropout: Option<(u64, f32)>,
}

impl<T: Float> Held<T> {
    /// The branch on the held values.
    pub(in crate::nn) fn branch(&self) -> Branch<'_, T> {
        Branch {
            a: &self.a,
            b: &self.b,
            rank: self.rank,
            scale: T::of(self.scale),
            dropout: self.dropout,
        }
    }
}

/// The low-rank branch of one projection on a node's values.
pub(in crate::nn) struct Branch<'a, T> {
    a: &'a [T],
    b: &'a [T],
    rank: usize,
    scale: T,
    dropout: Option<(u64, f32)>,
}

impl<T: Float> Branch<'_, T> {
    /// `t = dropout(x) A^T` `[rows, r]` from the dropped input `xd` `[rows, in]`.
    fn down(&self, xd: &[T], input: usize) -> Vec<T> {
        let rows = xd.len() / input.max(1);
        product_new((rows, self.rank, input), (xd, input, 1), (self.a, 1, input))
    }

    /// `dropout(x)` for `x` `[rows, in]`, each row's mask that of its padded place
    /// `places[row]` (`x` itself without dropout).
    fn dropped<'x>(&self, x: &'x [T], input: usize, places: &[usize]) -> Cow<'x, [T]> {
        dropped(x, self.dropout, input, Some(places))
    }

    /// Adds `s dropout(x) A^T B^T` to `dst` `[rows, out]` (row stride `dst_rs`).
    pub(in crate::nn) fn forward(
        &self,
        x: &[T],
        input: usize,
        places: &[usize],
        (dst, dst_rs): (&mut [T], usize),
    ) {
        let rows = x.len() / input.max(1);
        let out = self.b.len() / self.rank;
        let t = self.down(&self.dropped(x, input, places), input);
        let sb: Vec<T> = self.b.iter().map(|&v| v * self.scale).collect();
        product(
            (rows, out, self.rank),
            (dst, dst_rs),
            true,
            (&t, self.rank, 1),
            (&sb, 1, self.rank),
        );
    }

    /// The backward from `dy` `[rows, out]` (an operand: values and row stride): adds the
    /// input's gradient into `dx` `[rows, in]` and returns `(dA, dB)`.
    pub(in crate::nn) fn backward(
        &self,
        x: &[T],
        input: usize,
        places: &[usize],
        (dy, dy_rs): (&[T], usize),
        dx: &mut [T],
    ) -> (Vec<T>, Vec<T>) {
        let rows = x.len() / input.max(1);
        let (r, out) = (self.rank, self.b.len() / self.rank);
        let dy: Operand<T> = (dy, dy_rs, 1);
        let xd = self.dropped(x, input, places);
        let t = self.down(&xd, input);
        // dB [out, r] = s dy^T t
        let mut db = product_new((out, r, rows), (dy.0, 1, dy_rs), (&t, r, 1));
        for v in &mut db {
            *v *= self.scale;
        }
        drop(t);
        // dt [rows, r] = s dy B
        let mut dt = product_new((rows, r, out), dy, (self.b, r, 1));
        for v in &mut dt {
            *v *= self.scale;
        }
        // dA [r, in] = dt^T dropout(x)
        let da = product_new((r, input, rows), (&dt, 1, r), (&xd, input, 1));
        drop(xd);
        // dx += mask (dt A)
        match self.dropout.filter(|&(_, p)| p > 0.0) {
            None => product(
                (rows, input, r),
                (dx, input),
                true,
                (&dt, r, 1),
                (self.a, input, 1),
            ),
            Some(mask) => {
                let dxd = product_new((rows, input, r), (&dt, r, 1), (self.a, input, 1));
                let masked = dropped(&dxd, Some(mask), input, Some(places));
                for (d, &m) in dx.iter_mut().zip(masked.iter()) {
                    *d += m;
                }
            }
        }
        (da, db)
    }
}

/// A layer node's weights, held from its forward to its backward: `S` slots (detached,
/// contiguous, in the node's dtype: views of the variables, a base stored narrower read
/// widened), which of them take a gradient (a frozen one's is not computed), and the
/// values of its `P` projections' adapters.
pub(in crate::nn) struct NodeWeights<T, const S: usize, const P: usize> {
    pub(in crate::nn) slots: [Option<Tensor>; S],
    /// The ids of the tensors the slots were given (a variable's own, which its detached
    /// view does not keep) and whether the slot holds their values in place (no
    /// conversion): what a transposed copy is found by
    /// ([`crate::nn::cpu::products::transposed`]).
    pub(in crate::nn) ids: [Option<(candle_core::TensorId, bool)>; S],
    pub(in crate::nn) wants: [bool; S],
    lora: [Option<Held<T>>; P],
}

impl<T: Float, const S: usize, const P: usize> NodeWeights<T, S, P> {
    pub(in crate::nn) fn new(
        slots: [Option<&Tensor>; S],
        lora: &[Option<LoraInput>; P],
    ) -> candle_core::Result<Self> {
        let mut held: [Option<Tensor>; S] = std::array::from_fn(|_| None);
        for (o, t) in held.iter_mut().zip(slots) {
            *o = t
                .map(|t| t.detach().to_dtype(T::DTYPE)?.contiguous())
                .transpose()?;
        }
        let mut adapters: [Option<Held<T>>; P] = std::array::from_fn(|_| None);
        for (a, input) in adapters.iter_mut().zip(lora) {
            *a = input.as_ref().map(|l| l.values()).transpose()?;
        }
        Ok(Self {
            slots: held,
            ids: slots.map(|t| t.map(|t| (t.id(), t.dtype() == T::DTYPE && t.is_contiguous()))),
            wants: slots.map(|t| t.is_some_and(crate::sink::wants)),
            lora: adapters,
        })
    }

    /// Transposed copies (`[in, out]`) of the projection weights in `slots`, each
    /// `[out, in]` with its values in `values`, where this thread runs inside a
    /// [`crate::nn::cpu::products::transposed::TransposedWeights`]; `None` for each elsewhere.
    pub(in crate::nn) fn transposed<const N: usize>(
        &self,
        slots: [usize; N],
        values: &[&[T]],
    ) -> [Option<std::sync::Arc<crate::nn::cpu::products::transposed::PanelCopy<T>>>; N] {
        slots.map(|i| {
            let ((id, in_place), t) = (self.ids[i]?, self.slots[i].as_ref()?);
            let source = if in_place { Ok(t) } else { Err(id) };
            crate::nn::cpu::products::transposed::transposed(source, values[i], t.dims2().ok()?)
        })
    }

    /// The adapters' branches.
    pub(in crate::nn) fn branches(&self) -> Branches<'_, T, P> {
        Branches(std::array::from_fn(|p| {
            self.lora[p].as_ref().map(Held::branch)
        }))
    }
}

/// A node's inputs after `x`: its slots, then each adapter's `A` and `B` (absent where the
/// projection has none).
pub(in crate::nn) fn node_inputs<'a>(
    slots: &[Option<&'a Tensor>],
    lora: &'a [Option<LoraInput>],
) -> Vec<Option<&'a Tensor>> {
    let mut all = slots.to_vec();
    for l in lora {
        all.extend([l.as_ref().map(|l| &l.a), l.as_ref().map(|l| &l.b)]);
    }
    all
}

/// The branches of a node's `P` projections (`None` where a projection has no adapter).
pub(in crate::nn) struct Branches<'a, T, const P: usize>([Option<Branch<'a, T>>; P]);

impl<T: Float, const P: usize> Branches<'_, T, P> {
    /// [`Branch::forward`] of projection `p`'s adapter, if it has one.
    pub(in crate::nn) fn forward(
        &self,
        p: usize,
        (x, input): (&[T], usize),
        places: &[usize],
        dst: (&mut [T], usize),
    ) {
        if let Some(branch) = &self.0[p] {
            branch.forward(x, input, places, dst);
        }
    }

    /// [`Branch::backward`] of projection `p`'s adapter, if it has one, its `(dA, dB)`
    /// into `grads`.
    pub(in crate::nn) fn backward(
        &self,
        p: usize,
        (x, input): (&[T], usize),
        places: &[usize],
        (dout, dx): ((&[T], usize), &mut [T]),
        grads: &mut AdapterGrads<T, P>,
    ) {
        if let Some(branch) = &self.0[p] {
            let (da, db) = branch.backward(x, input, places, dout, dx);
            grads.0[p] = Some([da, db]);
        }
    }
}

/// The adapters' `(dA, dB)` of a node's backward, by projection.
pub(in crate::nn) struct AdapterGrads<T, const P: usize>([Option<[Vec<T>; 2]>; P]);

impl<T, const P: usize> Default for AdapterGrads<T, P> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| None))
    }
}

impl<T, const P: usize> AdapterGrads<T, P> {
    /// Two gradients per projection in the order of [`node_inputs`] (empty where it has
    /// no adapter).
    pub(in crate::nn) fn flat(self) -> impl Iterator<Item = Vec<T>> {
        self.0.into_iter().flat_map(|g| g.unwrap_or_default())
    }
}
