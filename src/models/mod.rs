//! Models that the gradient cache trains: [`bert`], the trainable BERT-family encoder, and
//! [`toy`], tiny towers for tests, examples and benchmarks. New towers land here; each
//! is built from a `VarBuilder` over a [`ParamStore`](crate::ParamStore) and exposed as an
//! [`Encoder`](crate::Encoder), usually a [`LayerStack`](crate::LayerStack) wrapped in
//! [`Recomputed`](crate::Recomputed) so activation checkpointing comes with it.

pub mod bert;
pub mod toy;
