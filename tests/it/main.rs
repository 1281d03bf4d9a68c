//! The integration tests that share a process: one test binary (so the suite links the
//! library and candle a few times, not once per file), a module per topic. Each module's
//! own doc says what it holds. The tests that must run in a process of their own are
//! binaries of their own beside this one:
//!
//! - `tests/switches/`: the tests that switch the fused kernels or the GPU nodes for the
//!   whole process;
//! - `tests/memory/`: the tests that measure the heap (the counting allocator is the
//!   binary's global allocator);
//! - `tests/blas.rs`: a BLAS loaded for the whole process;
//! - `tests/distributed.rs`, `tests/distributed_cli.rs`: MPI (`--features mpi`), the
//!   first as each rank of an `mpirun` job, the second starting `mpirun` itself;
//! - `tests/nccl.rs`: the NCCL backend (`--features nccl`; empty otherwise), built and
//!   run alone by `scripts/check-cuda`.
//!
//! Nothing here sets process-wide state: a module's tests run beside every other module's.
//! The command-line tests run the `gradcache` binary (feature `cli`, on by default).

#[path = "../common/mod.rs"]
mod common;

mod bert;
mod cli;
mod colbert;
mod colbert_training;
mod data;
mod densenet;
mod dist_mirror;
mod distilbert;
mod distillation;
mod dropout;
mod encode_passes;
mod encoder;
mod equivalence;
mod errors;
mod export;
mod extend;
mod faults;
mod faults_cli;
mod formats;
mod functional;
mod fused;
mod fuzz_readers;
mod image_text;
mod jina_task_training;
mod loading;
mod lora_peft;
mod lora_training;
mod loss;
mod lstm;
mod merge;
mod metrics;
mod mixed_precision;
mod mixture;
mod nn;
mod optim;
mod pair_tokens;
mod precision;
mod replay;
mod rerank;
mod rerank_cli;
mod rerank_decoder;
mod rerank_training;
mod resnet;
mod resume;
mod retrieval;
mod retrieval_cli;
mod retrieval_losses;
mod sparse;
mod sparse_retrieval;
mod sparse_static;
mod sparse_training;
mod subnormals;
mod task;
mod train_paths;
mod trainer;
mod transposed_weights;
mod vnet;
mod volume_text;
