//! The replay primitive: back-propagate a given cotangent through a re-run computation.
//!
//! The gradient cache and activation checkpointing are the same move: run a piece of the
//! computation without a graph, keep only its input, and later re-run it *with* a graph and
//! back-propagate the gradient arriving from above (the cotangent `g`). candle's
//! `backward()` always seeds with ones, so the vector-Jacobian product is taken through the
//! surrogate scalar `sum(f(x) * g)`: its gradient with respect to every parameter (and to
//! `x`) is exactly `J^T g`. The candle `GradStore` is dropped before returning, so nothing
//! of the re-run graph outlives the call.
//!
//! The crate's hand-written nodes add their parameter gradients into a sink
//! (`crate::sink`) rather than handing them to candle; a replay opens one for its
//! backward pass unless one is open already (the gradient cache's, for a whole step).
//!
//! The gradient cache calls [`replay`] once per batch chunk (cotangent = cached dL/d rep);
//! checkpointing calls [`replay_with_input`] once per encoder segment (cotangent = gradient
//! arriving from the segment above, and the input gradient goes to the segment below).

use candle_core::{Tensor, Var};

use crate::params::{Gradients, Params};
use crate::sink::Sink;
use crate::{Error, Result};

/// What a replay with an input returns.
#[derive(Debug)]
pub struct Replayed {
    /// Detached gradients of the parameters that the computation used.
    pub params: Gradients,
    /// Detached gradient with respect to the input `x`, `J_x^T g`.
    pub input: Tensor,
}

/// Re-runs `f` with a graph and returns the detached gradients of `sum(f() * cotangent)`
/// with respect to `params`. Parameters that `f` does not use are absent from the result.
pub fn replay<F>(params: &Params, cotangent: &Tensor, f: F) -> Result<Gradients>
where
    F: FnOnce() -> Result<Tensor>,
{
    let sink = Sink::open_if_none();
    let output = {
        let _s = crate::profile::span(|| "replay.forward".into());
        f()?
    };
    let store = {
        let _s = crate::profile::span(|| "replay.backward".into());
        surrogate(&output, cotangent)?.backward()?
    };
    let grads = params.grads_from(&store);
    drop((store, output));
    // `store` (and with it every activation of the re-run graph) is dropped here.
    with_sink(grads, sink.as_ref(), params)
}

/// `grads` and, when the replay opened its own sink, what the nodes wrote into it.
fn with_sink(mut grads: Gradients, sink: Option<&Sink>, params: &Params) -> Result<Gradients> {
    if let Some(sink) = sink {
        grads.merge(sink.take(params)?)?;
    }
    Ok(grads)
}

/// Like [`replay`], and also returns the gradient with respect to the input `x`.
///
/// `x` is copied into a fresh `Var` so that autograd tracks it (a plain detached tensor
/// would lose its gradient at the first reshape); `f` receives that tracked copy.
pub fn replay_with_input<F>(
    params: &Params,
    x: &Tensor,
    cotangent: &Tensor,
    f: F,
) -> Result<Replayed>
where
    F: FnOnce(&Tensor) -> Result<Tensor>,
{
    let sink = Sink::open_if_none();
    let x = Var::from_tensor(&x.detach())?;
    let output = {
        let _s = crate::profile::span(|| "checkpoint.recompute-forward".into());
        f(x.as_tensor())?
    };
    let store = {
        let _s = crate::profile::span(|| "checkpoint.backward".into());
        surrogate(&output, cotangent)?.backward()?
    };
    let input = match store.get(x.as_tensor()) {
        Some(g) => g.detach(),
        // The output does not depend on x: its gradient is zero.
        None => x.as_tensor().zeros_like()?.detach(),
    };
    let grads = params.grads_from(&store);
    drop((store, output));
    Ok(Replayed {
        params: with_sink(grads, sink.as_ref(), params)?,
        input,
    })
}

/// `sum(output * cotangent)`, whose gradient with respect to `output` is `cotangent`.
fn surrogate(output: &Tensor, cotangent: &Tensor) -> Result<Tensor> {
    if output.shape() != cotangent.shape() {
        return Err(Error::CotangentShape {
            output: output.dims().to_vec(),
            cotangent: cotangent.dims().to_vec(),
        });
    }
    let cotangent = cotangent.detach().to_dtype(output.dtype())?;
    Ok(output.mul(&cotangent)?.sum_all()?)
}
