//! The CPU's matrix products and the nodes that are little more than one.
//!
//! - `gemm`: the layer nodes' products on slices through the gemm crate (new or
//!   accumulated, the parallelism candle would choose, the packing thresholds), a
//!   bias's rows and a bias gradient's column sums;
//! - `weight_products`: `x W^T (+ b)` from the weight as stored or from its copy in
//!   panels, a long encoding's panel products;
//! - `blas`: a BLAS the user already has (`GRADCACHE_BLAS`), loaded at run time;
//! - [`panel_kernel`]: the L1-blocked kernel for the panel products
//!   (`GRADCACHE_PANEL_KERNEL`, off by default);
//! - `transposed`: projection weights kept transposed, in panels, while a long inference
//!   runs;
//! - `dense`: `x W^T + b` and the feed-forward block as single nodes;
//! - `lora_branch`: a LoRA adapter's low-rank branch inside the layer nodes.
//!
//! The CUDA twin: the device's matrix products (cuBLAS through candle's `matmul`, in the
//! activations' dtype with f32 accumulation) inside the GPU layer nodes
//! (`crate::nn::gpu`).

pub(crate) mod blas;
pub(crate) mod dense;
pub(crate) mod gemm;
pub(crate) mod lora_branch;
pub mod panel_kernel;
pub(crate) mod transposed;
pub(crate) mod weight_products;
