//! Graph nodes with an explicit backward: the forward computed without a graph, one candle
//! node over the inputs whose backward is written by hand (and relays past candle's three
//! inputs), and [`recomputed`], a node that keeps only its inputs.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::cpu::blocks::Float;

/// The hand-written backward of a [`Node`]: the gradient of the node's output in, the
/// gradients of its (up to three) inputs out. Runs on detached tensors, so it records no
/// graph of its own.
pub(crate) type Backward =
    Box<dyn Fn(&Tensor) -> candle_core::Result<[Option<Tensor>; 3]> + Send + Sync + 'static>;

/// A node's precomputed output: a tensor (handed to candle as a copy, since a tensor's
/// storage cannot be moved out of it), or an owned CPU buffer (handed over as it is).
enum Precomputed {
    Tensor(Tensor),
    Cpu(CpuStorage, Shape),
}

/// A graph node whose forward was computed without a graph and whose backward is written
/// by hand: candle's autograd sees one node where the composed form records a dozen, each
/// with a zero-filled accumulator and an addition in the backward pass. The forward
/// kernel hands back the precomputed output: an owned buffer as it is, a tensor as a copy
/// (the original dropped: the node lives as long as its output does, since candle keeps
/// the op with the tensor, so holding the original would keep every fused output twice).
struct Node {
    name: &'static str,
    output: std::sync::Mutex<Option<Precomputed>>,
    backward: Backward,
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let output = match self.take_output()? {
            Precomputed::Cpu(storage, shape) => return Ok((storage, shape)),
            Precomputed::Tensor(t) => t,
        };
        let (storage, layout) = output.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(s), Some((0, end)))
                if end == layout.shape().elem_count() =>
            {
                Ok((s.try_clone(layout)?, layout.shape().clone()))
            }
            _ => candle_core::bail!(
                "{}: the precomputed output must be a contiguous CPU tensor",
                self.name
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let output = match self.take_output()? {
            Precomputed::Tensor(t) => t,
            Precomputed::Cpu(..) => {
                candle_core::bail!("{}: the precomputed output must be on the GPU", self.name)
            }
        };
        let (storage, layout) = output.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: the precomputed output must be on the GPU", self.name),
        }
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [a, b, c] = (self.backward)(&grad.detach())?;
        Ok((a, b, c))
    }
}

impl Node {
    /// The precomputed output, handed over once.
    fn take_output(&self) -> candle_core::Result<Precomputed> {
        self.output
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: poisoned output", self.name)))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: the forward ran twice", self.name)))
    }
}

/// Records `output` (computed from detached copies of `inputs`) as one node over the
/// inputs with the given backward; when no input is tracked, `output` is returned as is.
pub(crate) fn node(
    name: &'static str,
    inputs: [&Tensor; 3],
    output: Tensor,
    backward: Backward,
) -> candle_core::Result<Tensor> {
    if !inputs.iter().any(|t| t.track_op()) {
        return Ok(output);
    }
    let output = output.contiguous()?;
    let output = if output.layout().start_offset() == 0 {
        output
    } else {
        output.force_contiguous()?
    };
    node_with(name, inputs, Precomputed::Tensor(output), backward)
}

/// The node itself, over three inputs, whatever the output.
fn node_with(
    name: &'static str,
    inputs: [&Tensor; 3],
    output: Precomputed,
    backward: Backward,
) -> candle_core::Result<Tensor> {
    inputs[0].apply_op3(
        inputs[1],
        inputs[2],
        Node {
            name,
            output: std::sync::Mutex::new(Some(output)),
            backward,
        },
    )
}

/// The backward of a node over any number of inputs: one gradient (or `None`) per input.
pub(crate) type BackwardN =
    Box<dyn Fn(&Tensor) -> candle_core::Result<Vec<Option<Tensor>>> + Send + Sync + 'static>;

/// [`node`] over any number of inputs. candle's custom ops take at most three, so inputs
/// beyond the second hang off a *relay*: a node over them whose output is a one-element
/// token, passed as the main node's third input. The main node's backward computes every
/// gradient at once, leaves those of the relayed inputs in a shared cell and hands the
/// token a zero; candle then reaches the relay (its output has a gradient), which gives
/// the relayed inputs their gradients from the cell.
pub(crate) fn node_n(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    backward: BackwardN,
) -> candle_core::Result<Tensor> {
    if !inputs.iter().any(|t| t.track_op()) {
        return Ok(output);
    }
    let output = output.contiguous()?;
    let output = if output.layout().start_offset() == 0 {
        output
    } else {
        output.force_contiguous()?
    };
    node_n_with(name, inputs, Precomputed::Tensor(output), backward)
}

/// [`node_n`] whose output is an owned CPU buffer (`values` of `shape`), handed to candle
/// without a copy; when no input is tracked, it becomes a tensor as it is.
pub(crate) fn node_n_owned<T: Float>(
    name: &'static str,
    inputs: &[&Tensor],
    values: Vec<T>,
    shape: Shape,
    backward: BackwardN,
) -> candle_core::Result<Tensor> {
    if !inputs.iter().any(|t| t.track_op()) {
        return Tensor::from_vec(values, shape, &candle_core::Device::Cpu);
    }
    node_n_with(
        name,
        inputs,
        Precomputed::Cpu(T::to_cpu_storage_owned(values), shape),
        backward,
    )
}

fn node_n_with(
    name: &'static str,
    inputs: &[&Tensor],
    output: Precomputed,
    backward: BackwardN,
) -> candle_core::Result<Tensor> {
    let count = inputs.len();
    if count == 0 {
        candle_core::bail!("{name}: a node needs at least one input");
    }
    if count <= 3 {
        // Pad with the first input; the padding gets no gradient.
        let padded = [
            inputs[0],
            inputs[1.min(count - 1)],
            inputs[2.min(count - 1)],
        ];
        return node_with(
            name,
            padded,
            output,
            Box::new(move |dy| {
                let mut grads = backward(dy)?.into_iter();
                let mut next = |i: usize| {
                    if i < count {
                        grads.next().flatten()
                    } else {
                        None
                    }
                };
                Ok([next(0), next(1), next(2)])
            }),
        );
    }
    let cell: Arc<Mutex<Vec<Option<Tensor>>>> = Arc::default();
    let token = Tensor::zeros(1, DType::F32, &candle_core::Device::Cpu)?;
    let token = match &output {
        Precomputed::Tensor(t) => Tensor::zeros(1, t.dtype(), t.device())?,
        Precomputed::Cpu(..) => token,
    };
    let relayed = {
        let cell = cell.clone();
        node_n(
            "gradcache-relay",
            &inputs[2..],
            token.clone(),
            Box::new(move |_| {
                let grads = std::mem::take(
                    &mut *cell
                        .lock()
                        .map_err(|_| candle_core::Error::Msg("relay: poisoned cell".into()))?,
                );
                if grads.is_empty() {
                    candle_core::bail!("relay: the main node's backward has not run");
                }
                Ok(grads)
            }),
        )?
    };
    let zero = token;
    node_with(
        name,
        [inputs[0], inputs[1], &relayed],
        output,
        Box::new(move |dy| {
            let mut grads = backward(dy)?;
            if grads.len() != count {
                candle_core::bail!("{name}: {} gradients for {count} inputs", grads.len());
            }
            let rest = grads.split_off(2);
            *cell
                .lock()
                .map_err(|_| candle_core::Error::Msg("relay: poisoned cell".into()))? = rest;
            let mut head = grads.into_iter();
            Ok([
                head.next().flatten(),
                head.next().flatten(),
                Some(zero.clone()),
            ])
        }),
    )
}

/// `f(inputs)` as one graph node that keeps nothing but its inputs (selective
/// recompute): the forward runs `f` without a graph; the backward runs it again with a
/// graph over fresh copies of the inputs and back-propagates the output's gradient through
/// it, handing each input its gradient. The recomputation is the same arithmetic (and the
/// same dropout masks, which come from seeds) as the forward, so the gradients are those
/// of `f` recorded directly, bit for bit. Every tensor `f` reads that needs a gradient
/// must be one of `inputs`; anything else it captures is a constant.
pub fn recomputed<F>(name: &'static str, inputs: &[&Tensor], f: F) -> candle_core::Result<Tensor>
where
    F: Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync + 'static,
{
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let output = f(&detached)?.detach();
    node_n(
        name,
        inputs,
        output,
        Box::new(move |dy| {
            let vars = detached
                .iter()
                .map(candle_core::Var::from_tensor)
                .collect::<candle_core::Result<Vec<_>>>()?;
            let tracked: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let out = f(&tracked)?;
            let store = out.mul(&dy.to_dtype(out.dtype())?)?.sum_all()?.backward()?;
            Ok(tracked.iter().map(|t| store.get(t).cloned()).collect())
        }),
    )
}
