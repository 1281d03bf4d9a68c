//! The layer nodes a GPU runs: each family's layer as one graph node with its backward
//! written out, on the kernels of [`super::kernels`] and the device's matrix products
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
pub mod encoder_layer;
mod lora;
pub mod norms;
pub mod prenorm_layer;

pub use decoder_layer::decoder_layer;
pub use encoder_layer::{encoder_layer, encoder_layer_composed};
pub use norms::{layer_norm, rms_norm};
pub use prenorm_layer::prenorm_layer;
