//! (query, document) pairs as a cross-encoder reads them: the tokenizer's pair template
//! with `transformers`' longest-first truncation, or a decoder reranker's chat template
//! ([`crate::hub::chat`]).

use candle_core::{DType, Device, Tensor};

use super::Tokenizer;
use crate::batch::TokenBatch;
use crate::{Error, Result};

impl Tokenizer {
    /// How a pair past the limit is cut, for the log.
    pub fn pair_truncation(&self) -> &'static str {
        match self.chat {
            Some(_) => "the first tokens kept, the chat template's tail written back",
            None => "the longer side first",
        }
    }

    /// Tokenizes (query, document) pairs as a cross-encoder reads them, with the
    /// tokenizer's pair template (BERT's `[CLS] q [SEP] d [SEP]`, the second segment's
    /// token types 1; RoBERTa's `<s> q </s></s> d </s>`), truncated to the maximum length
    /// by taking a token from the longer side first, as `transformers` does
    /// (`truncation=True`), and padded to the batch's longest pair; the prompt (an
    /// instruction) before each query, as sentence-transformers puts it. No multi-vector
    /// rows. With a chat template, the pairs are rendered by it ([`crate::hub::chat`]).
    pub fn encode_pairs(
        &self,
        queries: &[&str],
        documents: &[&str],
        device: &Device,
    ) -> Result<TokenBatch> {
        if queries.is_empty() {
            return Err(Error::EmptyBatch {
                side: crate::Side::Query,
            });
        }
        if queries.len() != documents.len() {
            return Err(Error::InvalidArgument {
                what: "pairs",
                value: format!(
                    "{} queries and {} documents",
                    queries.len(),
                    documents.len()
                ),
                reason: "a cross-encoder scores one document per query: give as many of each",
            });
        }
        if let Some(chat) = &self.chat {
            let (rows, _) = chat.pair_ids(
                &self.bare()?,
                self.instruction(),
                queries,
                documents,
                self.max_len,
            )?;
            return self.padded(rows, device);
        }
        let tokenize = |e: tokenizers::Result<tokenizers::Encoding>| {
            e.map_err(|e| Error::Tokenizer(e.to_string()))
        };
        // Each side alone, then cut to its share of the pair's budget (see
        // `pair_lengths`), then the pair template, then the padding.
        let bare = self.bare()?;
        let budget = self.max_len.saturating_sub(
            bare.get_post_processor()
                .map_or(0, |p| tokenizers::PostProcessor::added_tokens(p, true)),
        );
        let mut encodings = Vec::with_capacity(queries.len());
        for (&q, &d) in queries.iter().zip(documents) {
            // An instruction goes before the query, as sentence-transformers prepends a
            // prompt to a pair's first text.
            let q = format!("{}{q}", self.prompt);
            let mut first = tokenize(bare.encode(q, false))?;
            let mut second = tokenize(bare.encode(d, false))?;
            let (n1, n2) = pair_lengths(first.len(), second.len(), budget);
            let right = tokenizers::TruncationDirection::Right;
            first.truncate(n1, 0, right);
            second.truncate(n2, 0, right);
            encodings.push(tokenize(bare.post_process(first, Some(second), true))?);
        }
        if let Some(padding) = self.inner.get_padding() {
            tokenizers::utils::padding::pad_encodings(&mut encodings, padding)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
        }
        self.batch_of(&encodings, device, false)
    }

    /// How many of `pairs` are longer than the maximum length (and so truncated,
    /// longest side first, by [`Self::encode_pairs`]).
    pub fn count_truncated_pairs(&self, queries: &[&str], documents: &[&str]) -> Result<usize> {
        if let Some(chat) = &self.chat {
            let bare = self.bare()?;
            return Ok(chat
                .pair_ids(&bare, self.instruction(), queries, documents, self.max_len)?
                .1);
        }
        let untruncated = self.bare()?;
        let inputs: Vec<tokenizers::EncodeInput> = queries
            .iter()
            .zip(documents)
            .map(|(&q, &d)| (format!("{}{q}", self.prompt), d.to_string()).into())
            .collect();
        let encodings = untruncated
            .encode_batch(inputs, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encodings.iter().filter(|e| e.len() > self.max_len).count())
    }

    /// The tokenizer without truncation or padding.
    fn bare(&self) -> Result<tokenizers::Tokenizer> {
        let mut bare = self.inner.clone();
        bare.with_truncation(None)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        bare.with_padding(None);
        Ok(bare)
    }

    /// The prompt as a chat template's instruction (`None` when empty).
    fn instruction(&self) -> Option<&str> {
        Some(self.prompt.as_str()).filter(|p| !p.is_empty())
    }

    /// One batch of token id rows (a chat template's pairs), padded to the longest on the
    /// tokenizer's side with its pad token; token types all 0.
    fn padded(&self, rows: Vec<Vec<u32>>, device: &Device) -> Result<TokenBatch> {
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let pad = self.inner.get_padding().map_or(0, |p| p.pad_id);
        let left = self.pads_left();
        let (mut ids, mut host_mask) = (Vec::new(), Vec::with_capacity(rows.len()));
        for row in &rows {
            let fill = len - row.len();
            let mut mask = vec![1u32; row.len()];
            if left {
                ids.extend(std::iter::repeat_n(pad, fill).chain(row.iter().copied()));
                mask.splice(0..0, std::iter::repeat_n(0, fill));
            } else {
                ids.extend(row.iter().copied().chain(std::iter::repeat_n(pad, fill)));
                mask.extend(std::iter::repeat_n(0, fill));
            }
            host_mask.push(mask);
        }
        let n = rows.len();
        let mask: Vec<u32> = host_mask.iter().flatten().copied().collect();
        TokenBatch::new(
            Tensor::from_vec(ids, (n, len), device)?,
            Tensor::from_vec(mask, (n, len), device)?,
            Tensor::zeros((n, len), DType::U32, device)?,
        )?
        .with_host_mask(host_mask)
    }
}

/// How many tokens of a pair's two sides (`n1`, `n2` tokens) fit `budget` under
/// `transformers`' longest-first truncation: nothing cut when both fit; else the longer
/// side cut down to what the shorter leaves, but to no less than the shorter; when that
/// still does not fit, half the budget each, the odd token to the longer side (to the
/// second on a tie). What `tokenizers`' Python package and `transformers` give (the Rust
/// crate's `encode` gave the odd token to the shorter side on a fixture's pair of 54 and
/// 53 tokens, so the pairs are cut here).
fn pair_lengths(n1: usize, n2: usize, budget: usize) -> (usize, usize) {
    if n1 + n2 <= budget {
        return (n1, n2);
    }
    let swap = n1 > n2;
    let (short, long) = if swap { (n2, n1) } else { (n1, n2) };
    let mut cut = (short, long.min(budget.saturating_sub(short)).max(short));
    if cut.0 + cut.1 > budget {
        cut = (budget / 2, budget / 2 + budget % 2);
    }
    if swap {
        (cut.1, cut.0)
    } else {
        cut
    }
}
