//! Models that the gradient cache trains: [`bert`], the trainable BERT-family encoder
//! (whose layer stack is also ModernBERT's and the decoder embedders': Qwen3, Qwen2,
//! Llama, Mistral, Gemma3; with a sparse head, a SPLADE model);
//! [`resnet`], an image tower with BatchNorm; [`lstm`], a recurrent text tower whose
//! backward through time is checkpointed in segments of time steps; and [`toy`], tiny
//! towers for tests, examples and benchmarks. New towers land here; each
//! is built from a `VarBuilder` over a [`ParamStore`](crate::ParamStore) and exposed as an
//! [`Encoder`](crate::Encoder), usually a [`LayerStack`](crate::LayerStack) wrapped in
//! [`Recomputed`](crate::Recomputed) so activation checkpointing comes with it.

pub mod bert;
mod bert_config;
pub mod classifier;
mod deberta;
mod deberta_config;
mod decoder;
mod decoder_config;
mod dense;
pub mod densenet;
mod family;
pub mod lstm;
mod modernbert;
mod pooling;
pub mod resnet;
mod rotary_config;
mod rotary_encoder;
pub(crate) mod rotary_names;
pub(crate) mod sparse;
pub mod sparse_static;
pub mod task_adapters;
pub mod toy;
pub mod vnet;
