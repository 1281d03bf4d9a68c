//! Whole layers as single graph nodes with their backward written out, on the packed real
//! tokens of a padded batch, and the nodes before and after them.
//!
//! - [`encoder_layer`] and `encoder_passes`: a post-norm encoder layer (BERT, RoBERTa, MPNet,
//!   DistilBERT) and the arithmetic of its forward and backward;
//! - [`prenorm_layer`]: a pre-norm encoder layer (ModernBERT);
//! - [`rotary_layer`]: a post-norm rotary encoder layer (NomicBERT, GTE, Jina v3);
//! - [`decoder_layer`] and `decoder_passes`: a decoder layer (Qwen3, Qwen2, Llama,
//!   Mistral, Gemma3) and the arithmetic of its forward and backward;
//! - [`embeddings`]: BERT's embeddings as one node;
//! - `packing`: the real tokens packed, gathered from and scattered back to the padded
//!   layout, and the loop a layer node runs over them;
//! - [`pooling`] and [`splade`]: masked mean pooling and SPLADE's max pooling over a
//!   masked-language-model head.
//!
//! The CUDA twin: `crate::nn::gpu`, the same layers as nodes a GPU runs on the padded
//! chunk (one file per layer kind there too).

pub mod decoder_layer;
pub(crate) mod decoder_passes;
pub mod embeddings;
pub mod encoder_layer;
mod encoder_passes;
pub(crate) mod packing;
pub mod pooling;
pub mod prenorm_layer;
pub mod rotary_layer;
pub mod splade;
