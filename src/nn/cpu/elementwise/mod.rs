//! Kernels over rows, element by element or one row at a time, that the layer nodes share
//! and the custom ops expose.
//!
//! - `rows`: LayerNorm and RMSNorm rows, the residual sum under a dropout mask, the
//!   activations with their slopes, on slices;
//! - `norm`: LayerNorm as a custom op, and `LayerNorm(dropout(x) + residual)` as a node;
//! - `activation`: `act(x + b)` with its backward;
//! - `dropout`: inverted dropout from its seed, nothing stored;
//! - `accumulate`: additions in place and a bias gradient's column sums;
//! - `gated`: ModernBERT's gated linear unit and rotary positions as nodes;
//! - `math`: the exponential, tanh, erf and the activations' values and derivatives.
//!
//! The CUDA twin: `crate::nn::cuda`'s `rows.cu` (norms, activations, dropout, in f32,
//! bf16 and f16), launched by `crate::nn::kernels`.

pub(crate) mod accumulate;
pub(crate) mod activation;
pub(crate) mod dropout;
pub(crate) mod gated;
pub(crate) mod math;
pub(crate) mod norm;
pub(crate) mod rows;
