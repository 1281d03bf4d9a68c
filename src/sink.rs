//! Where parameter gradients accumulate: a per-thread sink that the crate's hand-written
//! nodes write their parameter gradients into, in place, instead of handing them to
//! candle's backward.
//!
//! candle's backward meets every gradient a node returns with a zero-filled accumulator
//! and an addition (`or_insert` then `add`), and the gradient cache then adds each chunk's
//! gradient into the step's sum: three passes over every parameter gradient per chunk, and
//! for a word-embedding table (30,522 x 384 for MiniLM) a dense table-sized gradient per
//! chunk of which a few hundred rows are not zero. With a sink active, a node adds its
//! parameter gradients straight into the sink's buffer for that parameter (the first
//! moved in, later ones added in place, the order of the chunks: the sums the gradient
//! accumulator computes, bit for bit), and an embedding adds only the rows its tokens
//! touched.
//!
//! [`crate::replay::replay`] and [`crate::replay::replay_with_input`] open a sink for
//! their backward pass when none is open and merge it into the gradients they return;
//! [`crate::GradientCache::replay`] opens one around the replay of every chunk, so the
//! step's parameter gradients are summed where they are written. With no sink open (a
//! plain `backward()` of the caller's own), the nodes hand their gradients to candle as
//! usual.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Tensor, TensorId};

use crate::params::{Gradients, Params};
use crate::Result;

/// The element types a gradient is summed in.
pub trait Grad: candle_core::WithDType + std::ops::AddAssign {}

impl Grad for f32 {}
impl Grad for f64 {}

/// One parameter's accumulated gradient: values on the CPU (the CPU nodes write slices),
/// or a tensor on any device (the GPU nodes hand over tensors, added in place).
struct Buffer {
    values: Values,
    shape: candle_core::Shape,
}

enum Values {
    Cpu(CpuStorage),
    Tensor(Tensor),
}

thread_local! {
    static SINKS: RefCell<Vec<HashMap<TensorId, Buffer>>> = const { RefCell::new(Vec::new()) };
}

/// An open sink; closing it (drop) discards what it holds unless [`Sink::take`] ran.
pub(crate) struct Sink {
    depth: usize,
}

impl Sink {
    /// Opens a sink on this thread.
    pub(crate) fn open() -> Self {
        let depth = SINKS.with(|s| {
            let mut s = s.borrow_mut();
            s.push(HashMap::new());
            s.len()
        });
        Self { depth }
    }

    /// Opens a sink unless one is open already (then the gradients go there).
    pub(crate) fn open_if_none() -> Option<Self> {
        (!is_open()).then(Self::open)
    }

    /// The gradients of `params` held by the sink, moved out of it.
    pub(crate) fn take(&self, params: &Params) -> Result<Gradients> {
        let mut held = SINKS.with(|s| {
            let mut s = s.borrow_mut();
            s.get_mut(self.depth - 1)
                .map(std::mem::take)
                .unwrap_or_default()
        });
        let mut grads = Gradients::default();
        for (name, var) in params.iter() {
            if let Some(b) = held.remove(&var.id()) {
                let t = match b.values {
                    Values::Tensor(t) => t,
                    Values::Cpu(CpuStorage::F32(v)) => {
                        Tensor::from_vec(v, b.shape, &candle_core::Device::Cpu)?
                    }
                    Values::Cpu(CpuStorage::F64(v)) => {
                        Tensor::from_vec(v, b.shape, &candle_core::Device::Cpu)?
                    }
                    Values::Cpu(other) => {
                        return Err(crate::Error::Candle(candle_core::Error::Msg(format!(
                            "gradient sink: a {:?} gradient",
                            other.dtype()
                        ))))
                    }
                };
                grads.insert(name.to_string(), t);
            }
        }
        Ok(grads)
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        SINKS.with(|s| {
            let mut s = s.borrow_mut();
            s.truncate(self.depth - 1);
        });
    }
}

/// Whether a sink is open on this thread.
pub(crate) fn is_open() -> bool {
    SINKS.with(|s| !s.borrow().is_empty())
}

/// Hands `f` the innermost open sink's buffer for `param` (`Some`), or `None` when it has
/// none yet, in which case what `f` returns becomes the buffer. `false` when no sink is
/// open (`f` does not run).
fn with_buffer<T: Grad>(
    param: &Tensor,
    f: impl FnOnce(Option<&mut [T]>) -> Option<Vec<T>>,
) -> candle_core::Result<bool> {
    SINKS.with(|s| {
        let mut s = s.borrow_mut();
        let Some(sink) = s.last_mut() else {
            return Ok(false);
        };
        match sink.get_mut(&param.id()) {
            Some(b) => {
                let acc: &mut [T] = match (&mut b.values, T::DTYPE) {
                    // SAFETY: T is f32 (checked by the dtype).
                    (Values::Cpu(CpuStorage::F32(v)), candle_core::DType::F32) => unsafe {
                        std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut T, v.len())
                    },
                    // SAFETY: T is f64 (checked by the dtype).
                    (Values::Cpu(CpuStorage::F64(v)), candle_core::DType::F64) => unsafe {
                        std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut T, v.len())
                    },
                    _ => candle_core::bail!(
                        "gradient sink: the dtypes of one parameter's gradients differ"
                    ),
                };
                f(Some(acc));
            }
            None => {
                if let Some(values) = f(None) {
                    sink.insert(
                        param.id(),
                        Buffer {
                            values: Values::Cpu(T::to_cpu_storage_owned(values)),
                            shape: param.shape().clone(),
                        },
                    );
                }
            }
        }
        Ok(true)
    })
}

/// Adds `grad` (dense, `param`'s shape) to the open sink's buffer for `param`: `None`
/// when it did, `Some(tensor)` for candle's backward when no sink is open.
pub(crate) fn deposit<T: Grad>(
    param: &Tensor,
    grad: Vec<T>,
) -> candle_core::Result<Option<Tensor>> {
    if grad.len() != param.elem_count() {
        candle_core::bail!(
            "gradient sink: {} values for a {:?} parameter",
            grad.len(),
            param.dims()
        );
    }
    if !param.is_variable() {
        // A frozen weight gets none; a weight computed from variables (a LoRA-adapted
        // one) hands its gradient back through the graph that made it.
        return match param.track_op() {
            true => Tensor::from_vec(grad, param.shape(), &candle_core::Device::Cpu).map(Some),
            false => Ok(None),
        };
    }
    let mut grad = Some(grad);
    let added = with_buffer::<T>(param, |acc| match acc {
        Some(acc) => {
            if let Some(g) = &grad {
                for (a, &v) in acc.iter_mut().zip(g) {
                    *a += v;
                }
            }
            None
        }
        None => grad.take(),
    })?;
    if added {
        return Ok(None);
    }
    let grad = grad.unwrap_or_default();
    Tensor::from_vec(grad, param.shape(), &candle_core::Device::Cpu).map(Some)
}

/// Adds the tensor `grad` (`param`'s shape and dtype, on any device) to the open sink's
/// buffer for `param`, in place (the first one is kept as it is): `None` when it did,
/// `Some(grad)` for candle's backward when no sink is open or `param` is not a variable
/// (a weight computed from variables; a frozen one gets `None`). Where a GPU node's
/// gradients go: candle's backward would meet each with a zero-filled accumulator and an
/// addition, and the gradient cache add each chunk's into the step's sum again.
pub(crate) fn deposit_tensor(param: &Tensor, grad: Tensor) -> candle_core::Result<Option<Tensor>> {
    if grad.shape() != param.shape() || grad.dtype() != param.dtype() {
        candle_core::bail!(
            "gradient sink: a {:?} {:?} gradient for a {:?} {:?} parameter",
            grad.dims(),
            grad.dtype(),
            param.dims(),
            param.dtype()
        );
    }
    if !param.is_variable() {
        return Ok(param.track_op().then_some(grad));
    }
    SINKS.with(|s| {
        let mut s = s.borrow_mut();
        let Some(sink) = s.last_mut() else {
            return Ok(Some(grad));
        };
        match sink.get_mut(&param.id()) {
            Some(Buffer {
                values: Values::Tensor(acc),
                ..
            }) => {
                crate::nn::cpu::add_in_place(acc, &grad)?;
            }
            Some(_) => candle_core::bail!(
                "gradient sink: one parameter's gradients come as values and as tensors"
            ),
            None => {
                // The buffer is added to in place: it must own its storage.
                let owned = grad.contiguous()?.copy()?;
                sink.insert(
                    param.id(),
                    Buffer {
                        values: Values::Tensor(owned),
                        shape: param.shape().clone(),
                    },
                );
            }
        }
        Ok(None)
    })
}

/// Whether `param` takes a gradient: a variable, or a tensor computed from one (a frozen
/// weight takes none, and a node need not compute it).
pub(crate) fn wants(param: &Tensor) -> bool {
    param.is_variable() || param.track_op()
}

/// [`deposit`] of a gradient a node computed only where `param` [`wants`] one (`None`:
/// not computed).
pub(crate) fn deposit_wanted<T: Grad>(
    param: &Tensor,
    grad: Option<Vec<T>>,
) -> candle_core::Result<Option<Tensor>> {
    match grad {
        Some(g) => deposit(param, g),
        None => Ok(None),
    }
}

/// Adds the gradient of an embedding table `param` `[rows, width]` whose row `ids[i]`
/// received `values[i * width..]`: into the open sink's buffer only the touched rows, in
/// the order of `ids` (`None`); without a sink the dense gradient for candle (`Some`).
pub(crate) fn deposit_rows<T: Grad>(
    param: &Tensor,
    ids: &[u32],
    values: &[T],
) -> candle_core::Result<Option<Tensor>> {
    let (rows, width) = param.dims2()?;
    if values.len() != ids.len() * width {
        candle_core::bail!(
            "gradient sink: {} ids for {} values",
            ids.len(),
            values.len()
        );
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("embedding: id {bad} is outside the table of {rows} rows");
    }
    if !param.is_variable() && !param.track_op() {
        return Ok(None);
    }
    let scatter = |acc: &mut [T]| {
        for (&id, row) in ids.iter().zip(values.chunks_exact(width)) {
            let at = id as usize * width;
            for (a, &v) in acc[at..at + width].iter_mut().zip(row) {
                *a += v;
            }
        }
    };
    // Only variables are summed in the sink; a computed table's gradient goes back
    // through its graph.
    let added = param.is_variable()
        && with_buffer::<T>(param, |acc| match acc {
            Some(acc) => {
                scatter(acc);
                None
            }
            None => {
                let mut fresh = vec![T::from_f64(0.0); rows * width];
                scatter(&mut fresh);
                Some(fresh)
            }
        })?;
    if added {
        return Ok(None);
    }
    let mut dense = vec![T::from_f64(0.0); rows * width];
    scatter(&mut dense);
    Tensor::from_vec(dense, (rows, width), &candle_core::Device::Cpu).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn tensors_deposited_in_a_sink_are_summed_there_in_order() {
        let param =
            Var::from_tensor(&Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap())
                .unwrap();
        let g = |v: [f32; 3]| Tensor::new(&v, &Device::Cpu).unwrap();
        // No sink: the gradient goes back to candle.
        let back = deposit_tensor(param.as_tensor(), g([1.0, 2.0, 3.0])).unwrap();
        assert!(back.is_some());
        let sink = Sink::open();
        assert!(deposit_tensor(param.as_tensor(), g([1.0, 2.0, 3.0]))
            .unwrap()
            .is_none());
        assert!(deposit_tensor(param.as_tensor(), g([0.5, -2.0, 1.0]))
            .unwrap()
            .is_none());
        // A frozen weight gets none, a computed one hands its gradient back.
        let frozen = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(deposit_tensor(&frozen, g([1.0, 1.0, 1.0]))
            .unwrap()
            .is_none());
        let computed = (param.as_tensor() * 2.0).unwrap();
        assert!(deposit_tensor(&computed, g([1.0, 1.0, 1.0]))
            .unwrap()
            .is_some());
        // The wrong shape is refused.
        assert!(deposit_tensor(
            param.as_tensor(),
            g([1.0, 1.0, 1.0]).reshape((3, 1)).unwrap()
        )
        .is_err());
        let params = Params::new([("w".to_string(), param.clone())]);
        let grads = sink.take(&params).unwrap();
        let sum: Vec<f32> = grads.get("w").unwrap().to_vec1().unwrap();
        assert_eq!(sum, vec![1.5, 0.0, 4.0]);
    }
}
