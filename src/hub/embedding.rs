//! How texts are embedded: [`embed`] tokenizes a block of texts at a time and encodes
//! each block's chunks in order of length, side by side on the CPU, with the projection
//! weights read from transposed copies for a long encoding; every inference path of
//! [`super`] (and the trainer's evaluation) runs through it.

use candle_core::{DType, Device, Tensor};

use super::Tokenizer;
use crate::batch::{Batch, Chunking, TokenBatch};
use crate::dropout::Ctx;
use crate::encoder::Encoder;
use crate::{Error, Result};

/// Embeds `texts` with `encoder` in evaluation mode (no dropout, no graph), in chunks of
/// `passes`: a number of texts (a plain `usize`, sentence-transformers' `batch_size`) or
/// [`Chunking::Tokens`], as many texts as fit that many padded tokens. Returns `[texts,
/// width]`, in the order of `texts`.
///
/// Texts are tokenized a block at a time ([`block_texts`]) and, within that block,
/// encoded in order of length (as `SentenceTransformer.encode` does), so each chunk is
/// padded only to the longest of texts of similar length: the padding a chunk computes on
/// is small. Masked positions contribute nothing, so a text's embedding does not depend on
/// its neighbours; how the texts are cut into chunks changes at most the rounding of the
/// products, whose row counts it sets (`tests/it/encode_passes.rs`).
///
/// On the CPU the chunks are encoded side by side, one per thread, each on its thread
/// alone ([`crate::nn::serial`]): an inference chunk's ops are too small to split
/// across threads without the threads waiting on one another. A block's chunks are taken
/// longest first, and from [`TRANSPOSED_FROM_TEXTS`] texts on the layers read their
/// projection weights from transposed copies (the same bits, faster products).
pub fn embed<E: Encoder<Input = TokenBatch> + Sync>(
    encoder: &E,
    tokenizer: &Tokenizer,
    texts: &[&str],
    passes: impl Into<Chunking>,
    device: &Device,
) -> Result<Tensor> {
    let _flush = crate::denormal::flush();
    let copies = (device.is_cpu() && texts.len() >= TRANSPOSED_FROM_TEXTS)
        .then(crate::nn::TransposedWeights::new);
    embed_blocks(
        encoder,
        tokenizer,
        texts,
        passes.into(),
        device,
        copies.as_ref(),
    )
}

/// Chunks per block of [`embed`] when its chunks are a number of texts: its texts are
/// tokenized and sorted by length this many chunks at a time, so a text's chunk (and its
/// padding) depends only on the texts of its block. Any run of whole blocks embeds as it
/// would within a longer call.
pub const BLOCK_CHUNKS: usize = 64;

/// Texts per block of [`embed`] when its chunks are counted in tokens: as many as 64
/// chunks of 16 texts.
pub const TOKEN_BLOCK_TEXTS: usize = 1024;

/// Texts per block of [`embed`] (tokenized and sorted by length together) under `passes`.
pub fn block_texts(passes: Chunking) -> usize {
    match passes {
        Chunking::Rows(texts) => texts.max(1) * BLOCK_CHUNKS,
        Chunking::Tokens(_) => TOKEN_BLOCK_TEXTS,
    }
}

/// From this many texts on, a CPU encoding reads the layers' projection weights from
/// transposed copies made as it starts ([`crate::nn::TransposedWeights`]: the same
/// bits, faster products: an encoding of 4,000 texts with all-MiniLM-L6-v2 1.04x as fast
/// on an AMD EPYC). Making them (18 ms for that model's 36 weights) costs about what 200
/// short texts gain, so a few texts at a time (a query, an evaluation's small batches)
/// read the weights as stored.
pub const TRANSPOSED_FROM_TEXTS: usize = 512;

/// [`embed`]'s blocks, each tokenized, sorted by length and encoded chunk by chunk. On
/// the CPU the next block is tokenized on the pool while this one's chunks are encoded:
/// the tokenizer's work shares the threads with the chunks instead of running between
/// blocks with the chunks waiting (4,000 texts with all-MiniLM-L6-v2 on 2 threads of an
/// AMD EPYC: 6.83 s against 6.86, the mean of 6 alternating runs; the embeddings the
/// same bytes).
fn embed_blocks<E: Encoder<Input = TokenBatch> + Sync>(
    encoder: &E,
    tokenizer: &Tokenizer,
    texts: &[&str],
    passes: Chunking,
    device: &Device,
    copies: Option<&crate::nn::TransposedWeights>,
) -> Result<Tensor> {
    let blocks: Vec<&[&str]> = texts.chunks(block_texts(passes)).collect();
    let prepare = |i: usize| -> Result<Option<Block>> {
        blocks
            .get(i)
            .map(|block| Block::new(tokenizer, block, passes, device))
            .transpose()
    };
    let encode_cpu = |pieces: &[TokenBatch]| {
        // `pieces` run from the shortest texts to the longest: taken last first.
        longest_first(pieces, |piece| {
            let _span = crate::profile::span(|| "encode.chunk".into());
            let encode = || crate::nn::serial(|| encoder.encode(piece, &Ctx::eval()));
            match copies {
                Some(copies) => copies.run(encode),
                None => encode(),
            }
        })
    };
    let mut parts = Vec::with_capacity(blocks.len());
    let mut next = prepare(0)?;
    while let Some(block) = next.take() {
        let i = parts.len();
        let reps = if device.is_cpu() {
            let (reps, following) = rayon::join(|| encode_cpu(&block.pieces), || prepare(i + 1));
            next = following?;
            reps?
        } else {
            let reps = block
                .pieces
                .iter()
                .map(|piece| encoder.encode(piece, &Ctx::eval()))
                .collect::<Result<Vec<_>>>()?;
            next = prepare(i + 1)?;
            reps
        };
        let reps = Tensor::cat(&reps, 0)?;
        parts.push(reps.index_select(&Tensor::new(block.inverse.as_slice(), device)?, 0)?);
    }
    if parts.is_empty() {
        return Err(Error::EmptyBatch {
            side: crate::Side::Query,
        });
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// A block of [`embed`]'s texts tokenized: its chunks in order of length, and where each
/// text's row is among them.
struct Block {
    pieces: Vec<TokenBatch>,
    /// `inverse[i]`: the row of the block's text `i` in the chunks taken in order.
    inverse: Vec<u32>,
}

impl Block {
    fn new(
        tokenizer: &Tokenizer,
        texts: &[&str],
        passes: Chunking,
        device: &Device,
    ) -> Result<Self> {
        let _span = crate::profile::span(|| "encode.tokenize".into());
        let batch = tokenizer.encode(texts, device)?;
        let lengths = batch
            .attention_mask
            .to_dtype(DType::U32)?
            .sum(1)?
            .to_vec1::<u32>()?;
        let mut order: Vec<u32> = (0..texts.len() as u32).collect();
        order.sort_by_key(|&i| lengths[i as usize]);
        let mut inverse = vec![0u32; order.len()];
        for (position, &i) in order.iter().enumerate() {
            inverse[i as usize] = position as u32;
        }
        let sorted = batch.select_rows(&order)?;
        // Tokenized text always has its lengths, so a chunking by tokens always applies.
        let pieces = sorted.chunked(passes)?.ok_or(Error::TokensToCount {
            side: crate::Side::Query,
        })?;
        Ok(Self { pieces, inverse })
    }
}

/// `f` of every item, in the order of `items`, computed on the thread pool from the last
/// item to the first: each thread takes the next item when it is free. With the items in
/// ascending order of cost the threads start on the costliest and finish within one cheap
/// item's time of one another, where rayon's halving of the slice could leave the longest
/// chunks of a block to one thread while the other waits (AMD EPYC, 2 threads, 4,000 texts:
/// 0.3 thread-seconds idle of 16.7).
pub(crate) fn longest_first<P: Sync, R: Send>(
    items: &[P],
    f: impl Fn(&P) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let taken = AtomicUsize::new(0);
    let done: Vec<Vec<(usize, Result<R>)>> = (0..rayon::current_num_threads())
        .into_par_iter()
        .map(|_| {
            let mut done = Vec::new();
            loop {
                let next = taken.fetch_add(1, Ordering::Relaxed);
                if next >= items.len() {
                    return done;
                }
                let at = items.len() - 1 - next;
                done.push((at, f(&items[at])));
            }
        })
        .collect();
    let mut done: Vec<(usize, Result<R>)> = done.into_iter().flatten().collect();
    done.sort_by_key(|(at, _)| *at);
    done.into_iter().map(|(_, r)| r).collect()
}
