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

/// One parameter's accumulated gradient.
struct Buffer {
    values: CpuStorage,
    shape: candle_core::Shape,
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
                    CpuStorage::F32(v) => Tensor::from_vec(v, b.shape, &candle_core::Device::Cpu)?,
                    CpuStorage::F64(v) => Tensor::from_vec(v, b.shape, &candle_core::Device::Cpu)?,
                    other => {
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
                    (CpuStorage::F32(v), candle_core::DType::F32) => unsafe {
                        std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut T, v.len())
                    },
                    // SAFETY: T is f64 (checked by the dtype).
                    (CpuStorage::F64(v), candle_core::DType::F64) => unsafe {
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
                            values: T::to_cpu_storage_owned(values),
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
