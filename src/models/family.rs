//! The model families a `config.json` names ([`Family`], by its `model_type`) and the
//! feed-forward activations of their configs ([`Activation`]): what the BERT-family config
//! and the decoders' both speak of.

/// The model families this encoder loads, by `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `bert` (or no `model_type`): BERT, MiniLM, bge, e5, gte-small, ...: absolute
    /// positions counted from 0.
    Bert,
    /// `roberta`, `xlm-roberta`, `camembert`: BERT's layers with absolute positions that
    /// start past the padding index (`pad_token_id + 1`), one token type, `<s> .. </s>`.
    Roberta,
    /// `mpnet`: BERT's post-norm layers under other names, no token types, positions past
    /// the padding index 1, and a relative position bias on the attention scores (buckets
    /// of the distance between tokens, one learned value per bucket and head, shared by
    /// every layer).
    MpNet,
    /// `distilbert`: BERT's post-norm layers under other names (`q_lin`, `sa_layer_norm`,
    /// `ffn.lin1`, ...) and config keys (`dim`, `n_layers`, ...), no token types, no
    /// dropout on the attention's output projection; learned positions, or sinusoidal
    /// ones as the starting values of the table (`sinusoidal_pos_embds`).
    DistilBert,
    /// `modernbert`: pre-norm layers without biases, rotary position embeddings (a theta
    /// per layer type), a GeGLU feed-forward, global and sliding-window (local) attention
    /// as the config's layer types say, a final norm; no position table, no token types.
    ModernBert,
    /// `qwen3`: a decoder (Qwen3-Embedding): RMSNorm, q/k norms, grouped KV heads, an
    /// explicit head width, rotary positions, SwiGLU, causal attention.
    Qwen3,
    /// `qwen2`: a decoder (gte-Qwen2): Qwen3's layer with q/k/v biases and no q/k norms.
    Qwen2,
    /// `llama`: a decoder with optional attention and MLP biases.
    Llama,
    /// `mistral`: a decoder (e5-mistral, SFR-Embedding, Linq) with an optional sliding
    /// window.
    Mistral,
    /// `gemma3_text`: a decoder (EmbeddingGemma): scaled embeddings, `(1 + w)` norms
    /// around attention and feed-forward, q/k norms, GELU-tanh GeGLU, sliding and global
    /// layers, bidirectional when the config says so.
    Gemma3,
    /// `nomic_bert`: NomicBERT (nomic-embed-text): post-norm layers with rotary attention,
    /// a SwiGLU feed-forward, no biases in the layers.
    NomicBert,
    /// `gte`: GTE's "new" architecture (gte-base-en-v1.5, gte-multilingual-base): post-norm
    /// rotary layers with biases and a GeGLU feed-forward.
    Gte,
    /// `jina_embeddings_v3`: XLM-R's vocabulary on post-norm rotary layers with biases
    /// and a plain GELU feed-forward.
    JinaV3,
    /// `eurobert`: an encoder on the Llama layer (RMSNorm, rotary positions, grouped KV
    /// heads, SwiGLU, a final norm) with bidirectional attention.
    EuroBert,
    /// `deberta-v2` (DeBERTa-v2 and v3): BERT's post-norm layers with disentangled
    /// attention (content-to-position and position-to-content terms over log-bucketed
    /// relative positions), absolute positions only where the config adds them, token
    /// types only where it has some.
    DebertaV2,
}

impl Family {
    /// Whether the family runs on the decoder layers (Qwen3, Qwen2, Llama, Mistral, Gemma3,
    /// and EuroBERT's bidirectional Llama layer).
    pub fn is_decoder(self) -> bool {
        matches!(
            self,
            Family::Qwen3
                | Family::Qwen2
                | Family::Llama
                | Family::Mistral
                | Family::Gemma3
                | Family::EuroBert
        )
    }

    /// Whether the family runs on the rotary post-norm layers (NomicBERT, GTE, Jina v3).
    pub fn is_rotary_post_norm(self) -> bool {
        matches!(self, Family::NomicBert | Family::Gte | Family::JinaV3)
    }

    /// Whether the family is a causal language model (a decoder but EuroBERT): what a
    /// decoder cross-encoder's heads (`score`, the LM head's logits) need.
    pub fn is_causal_lm(self) -> bool {
        self.is_decoder() && self != Family::EuroBert
    }
}

/// Feed-forward activations of BERT-family configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU (`gelu`).
    Gelu,
    /// Tanh approximation of GELU (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `relu`.
    Relu,
    /// `silu` / `swish` (the decoders' SwiGLU gate).
    Silu,
}

impl Activation {
    /// The activation as [`crate::nn::bias_activation`] names it.
    pub fn fused(self) -> crate::nn::Act {
        match self {
            Activation::Gelu => crate::nn::Act::GeluErf,
            Activation::GeluTanh => crate::nn::Act::GeluTanh,
            Activation::Relu => crate::nn::Act::Relu,
            Activation::Silu => crate::nn::Act::Silu,
        }
    }
}
