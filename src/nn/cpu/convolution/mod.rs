//! The convolutional towers' nodes.
//!
//! - `conv2d`: a 2-D convolution whose backward beats candle's chain rule, and BatchNorm
//!   in training with batch statistics;
//! - `conv3d`: a 3-D convolution with its backward (candle has none), a piece of the
//!   volume at a time;
//! - `conv_unit`: VNet's convolution unit (convolution, BatchNorm, PReLU, residual) as one
//!   node that keeps only its inputs.
//!
//! No CUDA twin: on a GPU the towers run candle's own convolutions and the composed
//! BatchNorm.

pub(crate) mod conv2d;
pub(crate) mod conv3d;
pub(crate) mod conv_unit;
