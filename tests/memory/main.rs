//! The tests that measure the heap: one binary with the counting allocator
//! (`gradcache::memory::CountingAllocator`) as its global allocator. The count is the
//! whole process's, so every test here holds [`alone`] while it runs: no other test
//! allocates beside a measurement.
//!
//! - `counting`: the count stays exact when many threads allocate at once;
//! - `loss_memory`: the row-block loss's peak grows linearly with the batch;
//! - `lora_memory`: a LoRA model holds its weights once, in their stored dtype;
//! - `memory_budget`: `train.memory_budget` picks chunks and a policy that fit;
//! - `stream`: streamed training files hold their line index, not their texts.

use gradcache::memory::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[path = "../common/mod.rs"]
mod common;

mod counting;
mod lora_memory;
mod loss_memory;
mod memory_budget;
mod stream;

/// The tests of this binary one at a time: the counting allocator counts the whole
/// process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Held by every test of this binary for as long as it runs.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}
