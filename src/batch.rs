//! Splitting inputs into chunks along the batch dimension and putting them back together.
//!
//! The gradient cache only needs to know how many rows an input has and how to take a
//! contiguous range of rows; the functional helpers also concatenate micro-batches. The
//! [`Batch`] trait says exactly that, and is implemented for plain tensors (rows along
//! dim 0) and for tokenized text ([`TokenBatch`]).

use candle_core::Tensor;

use crate::{Error, Result};

/// An input that can be cut into row ranges and concatenated along the batch dimension.
pub trait Batch: Sized {
    /// Number of examples (rows).
    fn rows(&self) -> usize;

    /// Rows `start..start + len` (a view where the backend allows it, not a copy).
    fn slice(&self, start: usize, len: usize) -> Result<Self>;

    /// Concatenates batches along the batch dimension.
    fn cat(parts: &[Self]) -> Result<Self>;

    /// Splits into consecutive chunks of at most `chunk` rows; the last may be shorter.
    fn chunks(&self, chunk: usize) -> Result<Vec<Self>> {
        let rows = self.rows();
        let chunk = chunk.max(1);
        (0..rows)
            .step_by(chunk)
            .map(|start| self.slice(start, chunk.min(rows - start)))
            .collect()
    }

    /// Splits as `chunking` says; `None` when it counts tokens and the input has none.
    fn chunked(&self, chunking: Chunking) -> Result<Option<Vec<Self>>> {
        let lengths = match chunking {
            Chunking::Tokens(_) => self.token_lengths()?,
            Chunking::Rows(_) => None,
        };
        let Some(ranges) = chunking.ranges(self.rows(), lengths.as_deref()) else {
            return Ok(None);
        };
        let parts = ranges
            .into_iter()
            .map(|(start, len)| self.slice(start, len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(parts))
    }

    /// The tokens of each row, for inputs made of tokens (what [`Chunking::Tokens`] counts);
    /// `None` for inputs without them (tensors of features, images).
    fn token_lengths(&self) -> Result<Option<Vec<usize>>> {
        Ok(None)
    }
}

/// How a tower's rows are cut into chunks: a fixed number of rows (`train.query_chunk`,
/// `train.passage_chunk`) or as many rows as fit in a number of padded tokens
/// (`train.chunk_tokens`, sentence-transformers' `mini_batch_num_tokens`). Either way a
/// chunk is consecutive rows, so the chunking changes memory, never the gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunking {
    /// At most this many rows per chunk.
    Rows(usize),
    /// Consecutive rows while the chunk's rows times its longest text stay within this
    /// many tokens (a chunk is trimmed to its longest text); a text longer than that is a
    /// chunk alone.
    Tokens(usize),
}

/// A number of rows: what a chunk size written as a plain number means.
impl From<usize> for Chunking {
    fn from(rows: usize) -> Self {
        Chunking::Rows(rows)
    }
}

impl Chunking {
    /// The chunks of `rows` rows as `(start, len)` ranges; `lengths` are the rows' tokens,
    /// which [`Chunking::Tokens`] needs (`None` then: there is nothing to count).
    pub fn ranges(self, rows: usize, lengths: Option<&[usize]>) -> Option<Vec<(usize, usize)>> {
        match self {
            Chunking::Rows(chunk) => {
                let chunk = chunk.max(1);
                Some(
                    (0..rows)
                        .step_by(chunk)
                        .map(|start| (start, chunk.min(rows - start)))
                        .collect(),
                )
            }
            Chunking::Tokens(budget) => {
                let lengths = lengths?;
                let mut ranges = Vec::new();
                let (mut start, mut longest) = (0, 0);
                for (i, &len) in lengths.iter().enumerate().take(rows) {
                    let grown = longest.max(len);
                    if i > start && (i + 1 - start) * grown > budget {
                        ranges.push((start, i - start));
                        (start, longest) = (i, len);
                    } else {
                        longest = grown;
                    }
                }
                if start < rows {
                    ranges.push((start, rows - start));
                }
                Some(ranges)
            }
        }
    }
}

impl Batch for Tensor {
    fn rows(&self) -> usize {
        self.dims().first().copied().unwrap_or(0)
    }

    fn slice(&self, start: usize, len: usize) -> Result<Self> {
        Ok(self.narrow(0, start, len)?)
    }

    fn cat(parts: &[Self]) -> Result<Self> {
        if parts.is_empty() {
            return Err(Error::Concat("no tensors to concatenate".into()));
        }
        Ok(Tensor::cat(parts, 0)?)
    }
}

/// A tokenized batch as BERT-style encoders take it: `[rows, seq_len]` integer tensors.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Token ids, `[rows, seq_len]`, u32.
    pub input_ids: Tensor,
    /// 1 for real tokens, 0 for padding, `[rows, seq_len]`, u32.
    pub attention_mask: Tensor,
    /// Segment ids, `[rows, seq_len]`, u32.
    pub token_type_ids: Tensor,
    /// Positions before this one are left out of the pooling (they still attend and are
    /// attended to): the special token and prompt of a model whose pooling has
    /// `include_prompt = false`, as sentence-transformers does. 0: pool every real token.
    pub pool_from: usize,
    /// The task adapter the rows are encoded with (Jina v3's `lora_adaptations`, by
    /// index), `None`: the base weights alone.
    pub task: Option<usize>,
    /// A multi-vector (late-interaction) batch: which token vectors are kept and how
    /// many the output is padded to. `None` for a pooled (single-vector) batch.
    pub vectors: Option<TokenVectors>,
    /// The attention mask's rows on the host, beside the tensor (the tokenizer's own
    /// values, carried through every slice, selection, padding and concatenation), so
    /// that chunking and the models' per-chunk bookkeeping (lengths, positions, the
    /// pooled tokens) never wait for a GPU to read the mask back. `None`: read from the
    /// tensor when needed.
    host_mask: Option<HostMask>,
}

/// Rows of an attention mask on the host.
type HostMask = std::sync::Arc<Vec<Vec<u32>>>;

/// What a multi-vector (ColBERT) batch keeps of its tokens.
///
/// A kept token whose attention mask is 0 is a query-expansion token that the others do
/// not attend to (PyLate's `attend_to_expansion_tokens = false`): it is computed, attends
/// to the real tokens, and is scored.
#[derive(Debug, Clone)]
pub struct TokenVectors {
    /// 1 for a token whose vector is kept (and scored), 0 for padding and skiplisted
    /// document tokens, `[rows, seq_len]`, u32.
    pub keep: Tensor,
    /// The token vectors a row's output is padded to (the query or document length).
    pub width: usize,
}

impl TokenBatch {
    /// Checks that the three tensors are `[rows, seq_len]` of one shape.
    pub fn new(input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> Result<Self> {
        if input_ids.rank() != 2
            || attention_mask.shape() != input_ids.shape()
            || token_type_ids.shape() != input_ids.shape()
        {
            return Err(Error::Concat(format!(
                "a token batch needs three [rows, seq_len] tensors of one shape, got input_ids \
                 {:?}, attention_mask {:?}, token_type_ids {:?}",
                input_ids.dims(),
                attention_mask.dims(),
                token_type_ids.dims()
            )));
        }
        Ok(Self {
            input_ids,
            attention_mask,
            token_type_ids,
            pool_from: 0,
            task: None,
            vectors: None,
            host_mask: None,
        })
    }

    /// The same batch with its attention mask's rows given on the host too (the values
    /// of `attention_mask`, which a tokenizer has before it makes the tensor): later
    /// reads of the mask need not wait for the device.
    pub fn with_host_mask(mut self, rows: Vec<Vec<u32>>) -> Result<Self> {
        let fits = rows.len() == self.rows() && rows.iter().all(|r| r.len() == self.seq_len());
        if !fits {
            return Err(Error::Concat(format!(
                "a host mask of {} rows for a token batch of {:?}",
                rows.len(),
                self.attention_mask.dims()
            )));
        }
        self.host_mask = Some(std::sync::Arc::new(rows));
        Ok(self)
    }

    /// The attention mask's rows (1 real, 0 padding): the host copy when the batch has
    /// one, else read from the tensor (free on the CPU; on a GPU a wait for the device).
    pub fn mask_rows(&self) -> Result<HostMask> {
        if let Some(rows) = &self.host_mask {
            return Ok(rows.clone());
        }
        let rows: Vec<Vec<u32>> = self
            .attention_mask
            .to_dtype(candle_core::DType::U32)?
            .to_vec2()?;
        Ok(std::sync::Arc::new(rows))
    }

    /// The host mask of columns `start..start + len` of rows `rows`, if there is one.
    fn host_part(
        &self,
        rows: impl Iterator<Item = usize>,
        start: usize,
        len: usize,
    ) -> Option<HostMask> {
        self.host_mask
            .as_ref()
            .map(|m| std::sync::Arc::new(rows.map(|r| m[r][start..start + len].to_vec()).collect()))
    }

    /// The same batch as a multi-vector batch keeping the tokens `keep` marks (`[rows,
    /// seq_len]`), its output padded to `width` token vectors.
    pub fn with_vectors(mut self, keep: Tensor, width: usize) -> Result<Self> {
        if keep.shape() != self.input_ids.shape() {
            return Err(Error::Concat(format!(
                "a multi-vector batch's kept tokens {:?} must have the shape of its ids {:?}",
                keep.dims(),
                self.input_ids.dims()
            )));
        }
        if self.seq_len() > width {
            return Err(Error::Concat(format!(
                "a multi-vector batch of {} tokens does not fit its {width} token vectors",
                self.seq_len()
            )));
        }
        self.vectors = Some(TokenVectors { keep, width });
        Ok(self)
    }

    /// Rows `rows` of the batch, in that order (the kept tokens with them).
    pub fn select_rows(&self, rows: &[u32]) -> Result<Self> {
        let idx = Tensor::new(rows, self.input_ids.device())?;
        let pick = |t: &Tensor| t.index_select(&idx, 0);
        Ok(Self {
            input_ids: pick(&self.input_ids)?,
            attention_mask: pick(&self.attention_mask)?,
            token_type_ids: pick(&self.token_type_ids)?,
            pool_from: self.pool_from,
            task: self.task,
            vectors: match &self.vectors {
                Some(v) => Some(TokenVectors {
                    keep: pick(&v.keep)?,
                    width: v.width,
                }),
                None => None,
            },
            host_mask: self.host_part(rows.iter().map(|&r| r as usize), 0, self.seq_len()),
        })
    }

    /// The tokens that take part in the encoder: attended or kept (`[rows, seq_len]`).
    fn used(&self) -> Result<Tensor> {
        Ok(match &self.vectors {
            Some(v) => self.attention_mask.maximum(&v.keep)?,
            None => self.attention_mask.clone(),
        })
    }

    /// The same batch with the first `positions` left out of the pooling.
    pub fn with_pool_from(mut self, positions: usize) -> Self {
        self.pool_from = positions;
        self
    }

    /// The same batch encoded with task adapter `task` (`None`: none).
    pub fn with_task(mut self, task: Option<usize>) -> Self {
        self.task = task;
        self
    }

    /// Sequence length (columns).
    pub fn seq_len(&self) -> usize {
        self.input_ids.dims().get(1).copied().unwrap_or(0)
    }

    /// Whether each column takes part in some row: the host mask's when there is one
    /// and no kept-token mask, else read from the device.
    fn used_columns(&self) -> Result<Vec<u32>> {
        if self.vectors.is_none() {
            if let Some(m) = &self.host_mask {
                let mut used = vec![0u32; self.seq_len()];
                for row in m.iter() {
                    for (u, &v) in used.iter_mut().zip(row) {
                        *u = (*u).max(v);
                    }
                }
                return Ok(used);
            }
        }
        let used = self.used()?.max(0)?.to_dtype(candle_core::DType::U32)?;
        Ok(used.to_vec1::<u32>()?)
    }

    /// Drops the columns at either end where every row is padding (attention mask 0), so
    /// the batch is as long as its longest sequence, whichever side it is padded on.
    pub fn trim_padding(&self) -> Result<Self> {
        let used = self.used_columns()?;
        let end = used.iter().rposition(|&m| m != 0).map_or(0, |i| i + 1);
        let start = used.iter().position(|&m| m != 0).unwrap_or(0).min(end);
        if start == 0 && end == self.seq_len() {
            return Ok(self.clone());
        }
        let len = end - start;
        Ok(Self {
            input_ids: self.input_ids.narrow(1, start, len)?,
            attention_mask: self.attention_mask.narrow(1, start, len)?,
            token_type_ids: self.token_type_ids.narrow(1, start, len)?,
            pool_from: self.pool_from,
            task: self.task,
            vectors: match &self.vectors {
                Some(v) => Some(TokenVectors {
                    keep: v.keep.narrow(1, start, len)?,
                    width: v.width,
                }),
                None => None,
            },
            host_mask: self.host_part(0..self.rows(), start, len),
        })
    }

    /// Whether the batch is padded on the left: some row starts with padding and ends
    /// with a real token (decoder tokenizers as Qwen3-Embedding's).
    pub fn pads_left(&self) -> Result<bool> {
        let s = self.seq_len();
        if s == 0 {
            return Ok(false);
        }
        if let (None, Some(m)) = (&self.vectors, &self.host_mask) {
            return Ok(m.iter().any(|r| r[0] == 0 && r[s - 1] != 0));
        }
        let mask = self.used()?.to_dtype(candle_core::DType::U32)?;
        let first = mask.narrow(1, 0, 1)?.flatten_all()?.to_vec1::<u32>()?;
        let last = mask.narrow(1, s - 1, 1)?.flatten_all()?.to_vec1::<u32>()?;
        Ok(first.iter().zip(&last).any(|(&f, &l)| f == 0 && l != 0))
    }

    /// Padded to `len` columns with id 0, mask 0 and token type 0, on the side the batch
    /// is padded on (`left`).
    fn pad_to(&self, len: usize, left: bool) -> Result<Self> {
        let pad = len - self.seq_len();
        if pad == 0 {
            return Ok(self.clone());
        }
        let side = |t: &Tensor| -> Result<Tensor> {
            let zeros = Tensor::zeros((self.rows(), pad), t.dtype(), t.device())?;
            let parts = if left { [&zeros, t] } else { [t, &zeros] };
            Ok(Tensor::cat(&parts, 1)?)
        };
        Ok(Self {
            input_ids: side(&self.input_ids)?,
            attention_mask: side(&self.attention_mask)?,
            token_type_ids: side(&self.token_type_ids)?,
            pool_from: self.pool_from,
            task: self.task,
            vectors: match &self.vectors {
                Some(v) => Some(TokenVectors {
                    keep: side(&v.keep)?,
                    width: v.width,
                }),
                None => None,
            },
            host_mask: self.host_mask.as_ref().map(|m| {
                let zeros = vec![0u32; pad];
                std::sync::Arc::new(
                    m.iter()
                        .map(|r| match left {
                            true => [&zeros[..], r].concat(),
                            false => [r, &zeros[..]].concat(),
                        })
                        .collect(),
                )
            }),
        })
    }
}

impl Batch for TokenBatch {
    fn rows(&self) -> usize {
        self.input_ids.dims().first().copied().unwrap_or(0)
    }

    /// The real tokens of each row (its attention mask's sum).
    fn token_lengths(&self) -> Result<Option<Vec<usize>>> {
        if let Some(m) = &self.host_mask {
            return Ok(Some(
                m.iter()
                    .map(|r| r.iter().map(|&v| v as usize).sum())
                    .collect(),
            ));
        }
        let lengths = self
            .attention_mask
            .to_dtype(candle_core::DType::U32)?
            .sum(1)?
            .to_vec1::<u32>()?;
        Ok(Some(lengths.into_iter().map(|l| l as usize).collect()))
    }

    /// Rows `start..start + len`, trimmed to their own longest sequence.
    fn slice(&self, start: usize, len: usize) -> Result<Self> {
        Self {
            input_ids: self.input_ids.narrow(0, start, len)?,
            attention_mask: self.attention_mask.narrow(0, start, len)?,
            token_type_ids: self.token_type_ids.narrow(0, start, len)?,
            pool_from: self.pool_from,
            task: self.task,
            vectors: match &self.vectors {
                Some(v) => Some(TokenVectors {
                    keep: v.keep.narrow(0, start, len)?,
                    width: v.width,
                }),
                None => None,
            },
            host_mask: self.host_part(start..start + len, 0, self.seq_len()),
        }
        .trim_padding()
    }

    /// Concatenates along rows. Parts of different sequence lengths are padded to the
    /// longest with id 0, mask 0 and token type 0, which a masked encoder ignores: on the
    /// left when any part is padded on the left, else on the right.
    fn cat(parts: &[Self]) -> Result<Self> {
        let Some(len) = parts.iter().map(TokenBatch::seq_len).max() else {
            return Err(Error::Concat("no token batches to concatenate".into()));
        };
        let mut left = false;
        for p in parts {
            left |= p.pads_left()?;
        }
        let padded = parts
            .iter()
            .map(|p| p.pad_to(len, left))
            .collect::<Result<Vec<_>>>()?;
        let field = |f: fn(&TokenBatch) -> &Tensor| -> Result<Tensor> {
            let ts: Vec<Tensor> = padded.iter().map(|p| f(p).clone()).collect();
            Ok(Tensor::cat(&ts, 0)?)
        };
        if padded.iter().any(|p| p.pool_from != padded[0].pool_from) {
            return Err(Error::Concat(
                "token batches that pool from different positions (different prompts)".into(),
            ));
        }
        if padded.iter().any(|p| p.task != padded[0].task) {
            return Err(Error::Concat(
                "token batches of different task adapters (one batch is encoded with one)".into(),
            ));
        }
        let vectors = match padded
            .iter()
            .map(|p| p.vectors.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(v) if v.iter().all(|t| t.width == v[0].width) => Some(TokenVectors {
                keep: Tensor::cat(&v.iter().map(|t| t.keep.clone()).collect::<Vec<_>>(), 0)?,
                width: v[0].width,
            }),
            None if padded.iter().all(|p| p.vectors.is_none()) => None,
            _ => {
                return Err(Error::Concat(
                    "token batches of single- and multi-vector rows, or of different token \
                     widths"
                        .into(),
                ))
            }
        };
        let host_mask = padded
            .iter()
            .map(|p| p.host_mask.as_ref())
            .collect::<Option<Vec<_>>>()
            .map(|parts| {
                std::sync::Arc::new(parts.iter().flat_map(|m| m.iter().cloned()).collect())
            });
        Ok(Self {
            input_ids: field(|b| &b.input_ids)?,
            attention_mask: field(|b| &b.attention_mask)?,
            token_type_ids: field(|b| &b.token_type_ids)?,
            pool_from: padded[0].pool_from,
            task: padded[0].task,
            vectors,
            host_mask,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Chunking;

    /// Every row once, in order, in non-empty ranges.
    fn covers(ranges: &[(usize, usize)], rows: usize) -> bool {
        let mut next = 0;
        for &(start, len) in ranges {
            if start != next || len == 0 {
                return false;
            }
            next += len;
        }
        next == rows
    }

    #[test]
    fn token_chunks_stay_within_the_budget_and_take_every_row_that_fits() {
        let lengths = [3, 3, 4, 9, 2, 2, 2, 2, 2, 12, 1, 5];
        for budget in [1, 4, 8, 9, 12, 16, 24, 100] {
            let ranges = Chunking::Tokens(budget)
                .ranges(lengths.len(), Some(&lengths))
                .unwrap();
            assert!(covers(&ranges, lengths.len()), "{budget}: {ranges:?}");
            let padded =
                |start: usize, len: usize| len * lengths[start..start + len].iter().max().unwrap();
            for (k, &(start, len)) in ranges.iter().enumerate() {
                // Within the budget, unless a single text is longer than it.
                assert!(
                    len == 1 || padded(start, len) <= budget,
                    "{budget}: {ranges:?}"
                );
                // Greedy: the next row would not have fitted.
                if k + 1 < ranges.len() {
                    assert!(padded(start, len + 1) > budget, "{budget}: {ranges:?}");
                }
            }
        }
        let all = Chunking::Tokens(144).ranges(lengths.len(), Some(&lengths));
        assert_eq!(all, Some(vec![(0, 12)]));
        let one_each = Chunking::Tokens(1).ranges(lengths.len(), Some(&lengths));
        assert_eq!(one_each.unwrap().len(), lengths.len());
    }

    #[test]
    fn row_chunks_ignore_the_lengths_and_tokens_need_them() {
        assert_eq!(
            Chunking::Rows(5).ranges(12, None),
            Some(vec![(0, 5), (5, 5), (10, 2)])
        );
        assert_eq!(Chunking::Tokens(8).ranges(12, None), None);
        assert_eq!(Chunking::Tokens(8).ranges(0, Some(&[])), Some(vec![]));
    }
}
