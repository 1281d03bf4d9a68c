//! The tests that switch the kernels for the whole process: the fused CPU kernels off
//! (`gradcache::nn::set_fused_kernels`) to hold them to the composed ops, and the GPU
//! layer nodes on for CPU tensors (`gradcache::nn::run_gpu_nodes_on_cpu`). One binary of
//! their own, so that no other test sees a switch; inside it, a test that switches holds
//! [`switching`] and every other test [`steady`], so that no computation sees a switch in
//! its middle.
//!
//! - `decoders`: the decoder embedders against transformers and sentence-transformers;
//! - `families`: every encoder family against transformers and sentence-transformers;
//! - `fused_bert`, `fused_decoder`, `fused_resnet`: the layer nodes against the composed
//!   steps and finite differences;
//! - `gpu_nodes`: the GPU layer nodes' algebra on the CPU;
//! - `lora`: adapters inside the layer nodes;
//! - `loss_directions`: the loss kernel's directions against sentence-transformers;
//! - `multi_vector`: MaxSim and distillation on both paths;
//! - `newer_encoders`: NomicBERT, GTE, Jina v3, EuroBERT and DeBERTa under dropout,
//!   recompute and the composed ops, their prompts and refusals.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

#[path = "../common/mod.rs"]
mod common;

mod decoders;
mod families;
mod fused_bert;
mod fused_decoder;
mod fused_resnet;
mod gpu_nodes;
mod jina_tasks;
mod lora;
mod loss_directions;
mod multi_vector;
mod newer_encoders;

/// Taken for writing by a test that switches the kernels, for reading by every other.
static SWITCHES: RwLock<()> = RwLock::new(());

/// Held by a test that switches the kernels (and switches them back before it ends): it
/// runs alone in this binary.
fn switching() -> RwLockWriteGuard<'static, ()> {
    SWITCHES.write().unwrap_or_else(|p| p.into_inner())
}

/// Held by a test that leaves the switches as they are: it runs beside others like it,
/// never beside one that switches.
fn steady() -> RwLockReadGuard<'static, ()> {
    SWITCHES.read().unwrap_or_else(|p| p.into_inner())
}
