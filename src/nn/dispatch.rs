//! Where each op runs: the process-wide switches (the fused CPU kernels, the GPU layer
//! nodes, and those nodes on CPU tensors for the tests) and the checks every op of
//! [`crate::nn`] makes before it picks a fused kernel, a GPU node or the composed ops.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Tensor};

use super::lora::LoraInput;

static FUSED: AtomicBool = AtomicBool::new(true);

/// Turns the fused kernels on (the default) or off for the whole process, so that a
/// benchmark can time the composed versions side by side in one run. Results agree either
/// way (to float rounding; the tests hold them to 1e-6).
pub fn set_fused_kernels(on: bool) {
    FUSED.store(on, Ordering::Relaxed);
}

/// Whether the fused CPU kernels are on ([`set_fused_kernels`]).
pub fn fused_kernels() -> bool {
    FUSED.load(Ordering::Relaxed)
}

/// Whether the fused CPU kernels can run on these tensors: all on the CPU, all f32 or all
/// f64 (and not turned off with [`set_fused_kernels`]).
pub(crate) fn fused_ok(ts: &[&Tensor]) -> bool {
    let dtype = ts[0].dtype();
    FUSED.load(Ordering::Relaxed)
        && matches!(dtype, DType::F32 | DType::F64)
        && ts.iter().all(|t| t.device().is_cpu() && t.dtype() == dtype)
}

/// Whether the f32-only CPU kernels (the 3-D convolution and VNet's units) can run on
/// these tensors: [`fused_ok`], in f32.
pub(crate) fn fused_f32(ts: &[&Tensor]) -> bool {
    fused_ok(ts) && ts[0].dtype() == DType::F32
}

/// Whether a layer node that runs in `x`'s dtype (see [`fused_ok`]) takes these projection
/// weights: in that dtype, or frozen base weights stored narrower on the CPU (bf16, f16:
/// the node reads them widened), and LoRA adapters on the CPU.
pub(crate) fn frozen_base_ok(x: &Tensor, bases: &[&Tensor], lora: &[Option<LoraInput>]) -> bool {
    let cpu = |t: &Tensor| t.device().is_cpu();
    bases.iter().all(|t| {
        cpu(t)
            && (t.dtype() == x.dtype()
                || (matches!(t.dtype(), DType::BF16 | DType::F16) && !t.track_op()))
    }) && lora.iter().flatten().all(|l| cpu(&l.a) && cpu(&l.b))
}

/// Whether a GPU layer node ([`gpu`](super::gpu)) runs a layer on `x`: a CUDA tensor in f32, bf16 or
/// f16, and the GPU nodes not turned off with `GRADCACHE_GPU_NODES=0` (which runs every
/// layer op by op, for a side-by-side measurement).
pub(crate) fn gpu_node_ok(x: &Tensor) -> bool {
    x.rank() == 3 && gpu_op_ok(x)
}

/// [`gpu_node_ok`] for a GPU node over a tensor of any rank (a norm).
pub(crate) fn gpu_op_ok(x: &Tensor) -> bool {
    let device = if x.device().is_cuda() {
        matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
    } else {
        GPU_NODES_ON_CPU.load(Ordering::Relaxed)
    };
    device && x.rank() >= 1 && gpu_nodes_enabled()
}

static GPU_NODES_ON_CPU: AtomicBool = AtomicBool::new(false);

/// Runs the GPU layer nodes ([`gpu`](super::gpu)) on CPU tensors too, through the reference forms of
/// their kernels, wherever the CPU's own nodes do not run (turn those off with
/// [`set_fused_kernels`]): how the tests and the self-check prove the GPU nodes' algebra
/// on a machine without a GPU. Off by default; slow (the reference forms loop in f64).
pub fn run_gpu_nodes_on_cpu(on: bool) {
    GPU_NODES_ON_CPU.store(on, Ordering::Relaxed);
}

/// The GPU nodes are on: not turned off by [`set_gpu_nodes`] nor by
/// `GRADCACHE_GPU_NODES=0` (read once).
fn gpu_nodes_enabled() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    GPU_NODES.load(Ordering::Relaxed)
        && *ENV
            .get_or_init(|| std::env::var("GRADCACHE_GPU_NODES").map_or(true, |v| v.trim() != "0"))
}

static GPU_NODES: AtomicBool = AtomicBool::new(true);

/// Turns the GPU layer nodes on (the default) or off for the whole process: off, a GPU
/// runs every layer op by op through candle's kernels and autograd, which the self-check
/// and the benchmarks set side by side with the nodes.
pub fn set_gpu_nodes(on: bool) {
    GPU_NODES.store(on, Ordering::Relaxed);
}
