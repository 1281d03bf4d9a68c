//! The losses' kernels.
//!
//! - [`infonce`]: InfoNCE's value and gradients a `block x tile` piece of the logits at a
//!   time, for every direction of the loss (`crate::loss::InfoNce`);
//! - `maxsim`: a MaxSim block's scores and their gradient (`crate::loss::MaxSim`).
//!
//! No CUDA twin: on a GPU the losses run composed, in blocks of rows (`crate::loss`).

pub mod infonce;
pub(crate) mod maxsim;
