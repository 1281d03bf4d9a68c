//! The layer nodes a GPU runs: each family's layer as one graph node with its backward
//! written out, on the kernels of `super::kernels` and the device's matrix products
//! (cuBLAS on CUDA, in the activations' dtype with f32 accumulation).
//!
//! The CPU trains through its own nodes ([`super::cpu`]: packed rows, the gemm crate,
//! threads over fixed blocks); these are the same layers for a device that runs the
//! padded chunk as a few large launches. They keep the node's inputs and a few tensors
//! per token (see each node's table), not the chunk's intermediates that candle's autograd
//! would keep op by op, and nothing at all when no input is tracked (the gradient cache's
//! graph-free first pass). On CPU tensors they run through the kernels' reference forms,
//! which is how the tests prove their algebra without a GPU.

mod attention;
pub mod decoder_layer;
mod decoder_passes;
pub mod encoder_layer;
mod lora;
pub mod norms;
pub mod prenorm_layer;

pub use decoder_layer::decoder_layer;
pub use encoder_layer::{encoder_layer, encoder_layer_composed};
pub use norms::{layer_norm, rms_norm};
pub use prenorm_layer::prenorm_layer;

use candle_core::Tensor;

/// Moves a node's parameter gradients into the open gradient sink ([`crate::sink`]):
/// each input's after the first (`inputs` in node-input order) that is a variable is
/// added there in place and handed to candle as `None`; the first input's (the layer's
/// activation, which may be a variable: a checkpointed segment's input) and a computed
/// tensor's stay for candle's backward, as does every gradient without a sink.
pub(super) fn into_sink(
    grads: &mut [Option<Tensor>],
    inputs: &[Tensor],
) -> candle_core::Result<()> {
    for (g, input) in grads.iter_mut().zip(inputs).skip(1) {
        if let Some(grad) = g.take() {
            *g = crate::sink::deposit_tensor(input, grad)?;
        }
    }
    Ok(())
}
