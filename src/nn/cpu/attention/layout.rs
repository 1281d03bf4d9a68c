//! Where the attention kernels read and write ([`HeadLayout`]), which rows of which
//! sequences they compute ([`Rows`], [`Dims`]) and the key mask of a batch ([`KeyMask`]):
//! the shapes shared by the per-head kernel ([`crate::nn::cpu::attention::heads`]) and the grouped
//! one ([`crate::nn::cpu::attention::grouped`]).

use crate::nn::cpu::blocks::Float;

/// A key whose additive bias is at or below this is masked (BERT's padding bias is
/// `-10000`; PyTorch's `finfo.min` and `-inf` count too).
pub const MASKED_BIAS: f64 = -1e4;

/// The key bias of a token that no other attends to but whose own row is computed (a
/// ColBERT query's expansion tokens with `attend_to_expansion_tokens = false`): above
/// [`MASKED_BIAS`], so the packed kernels compute its row, and like it far enough below
/// any real score that its weight `exp(score + bias - max)` is exactly 0 in f32, f16 and
/// bf16 (as the `finfo.min` mask of Hugging Face's attention).
pub const UNATTENDED_BIAS: f64 = -9e3;

/// Where the heads of a batch lie in a flat buffer: element `c` of row `i` of head `h` of
/// sequence `b` is at `offset + start(b) + h * head + i * row + c`, where `start(b)` is
/// `b * seq` for a layout with a sequence stride, else the sequence's first row times
/// `row` (sequences of rows packed one after another, see [`Rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLayout {
    /// Offset of the first element.
    pub offset: usize,
    /// Stride between sequences; `None`: sequences start at the rows of [`Rows::starts`].
    pub seq: Option<usize>,
    /// Stride between heads.
    pub head: usize,
    /// Stride between rows (tokens).
    pub row: usize,
}

impl HeadLayout {
    /// A contiguous `[n, heads, s, d]` tensor.
    pub fn heads_first(heads: usize, s: usize, d: usize) -> Self {
        Self {
            offset: 0,
            seq: Some(heads * s * d),
            head: s * d,
            row: d,
        }
    }

    /// Heads side by side in rows of `width` (head `h` at columns `offset + h d ..`), the
    /// rows of a sequence consecutive from its first row ([`Rows::starts`]): the
    /// merged-heads layout (`width = h`, `offset = 0`), or the query, key or value part of
    /// a packed `[rows, 3h]` projection.
    pub fn in_rows(width: usize, d: usize, offset: usize) -> Self {
        Self {
            offset,
            seq: None,
            head: d,
            row: width,
        }
    }

    pub(in crate::nn) fn at(&self, rows: &Rows, b: usize, h: usize) -> usize {
        let start = match self.seq {
            Some(stride) => b * stride,
            None => rows.starts[b] * self.row,
        };
        self.offset + start + h * self.head
    }
}

/// Which rows of each sequence the attention computes: the first row of every sequence
/// (for layouts without a sequence stride) and its number of query rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rows {
    /// The first row of each sequence.
    pub starts: Vec<usize>,
    /// The query rows computed for each sequence.
    pub queries: Vec<usize>,
}

impl Rows {
    /// `n` sequences of `s` rows each, every row a query.
    pub fn padded(n: usize, s: usize) -> Self {
        Self {
            starts: (0..n).map(|b| b * s).collect(),
            queries: vec![s; n],
        }
    }

    /// Sequences of `lengths` rows packed one after another, every row a query.
    pub fn packed(lengths: &[usize]) -> Self {
        let mut at = 0;
        let starts = lengths
            .iter()
            .map(|&l| {
                let s = at;
                at += l;
                s
            })
            .collect();
        Self {
            starts,
            queries: lengths.to_vec(),
        }
    }
}

/// The shape of an attention: `n` sequences of `s` tokens, `heads` heads of `d` dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Sequences.
    pub n: usize,
    /// Heads.
    pub heads: usize,
    /// Tokens per sequence (queries and keys).
    pub s: usize,
    /// Dimensions per head.
    pub d: usize,
}

/// The key mask of a batch: the additive bias `[n, s]`, and for every sequence the
/// number of keys up to its last unmasked one (`s` and no masking for a sequence whose
/// every key is masked, which then attends as if none were).
#[derive(Debug, Clone)]
pub struct KeyMask<T> {
    pub(in crate::nn) bias: Vec<T>,
    lengths: Vec<usize>,
    pub(in crate::nn) masking: Vec<bool>,
    /// A bias per head and (query, key) pair, `[heads, s, s]`, shared by the sequences,
    /// or one per sequence, `[n, heads, s, s]` (see [`Self::scores_at`]).
    pub(in crate::nn) scores: Option<Vec<T>>,
    /// The scores' stride between sequences: 0 when shared.
    scores_stride: usize,
}

impl<T: Float> KeyMask<T> {
    /// The mask of `bias` (`n * s` values).
    pub fn new(bias: &[T], n: usize, s: usize) -> Self {
        let masked = T::of(MASKED_BIAS);
        let mut lengths = Vec::with_capacity(n);
        let mut masking = Vec::with_capacity(n);
        for b in 0..n {
            let row = &bias[b * s..(b + 1) * s];
            match row.iter().rposition(|&v| v > masked) {
                Some(last) => {
                    lengths.push(last + 1);
                    masking.push(true);
                }
                None => {
                    lengths.push(s);
                    masking.push(false);
                }
            }
        }
        Self {
            bias: bias.to_vec(),
            lengths,
            masking,
            scores: None,
            scores_stride: 0,
        }
    }

    /// The mask with `scores` `[heads, s, s]` added to the scaled scores of every sequence
    /// besides the key bias (MPNet's relative position bias): `softmax(scale q k^T +
    /// scores[h] + bias)`.
    pub fn with_scores(mut self, scores: &[T]) -> Self {
        self.scores = Some(scores.to_vec());
        self.scores_stride = 0;
        self
    }

    /// The mask with a bias of each sequence's own, `scores` `[n, heads, s, s]` (DeBERTa's
    /// disentangled terms), added as [`Self::with_scores`] adds a shared one.
    pub(in crate::nn) fn with_sequence_scores(mut self, scores: Vec<T>, heads: usize) -> Self {
        let s = self.bias.len() / self.lengths.len().max(1);
        self.scores_stride = heads * s * s;
        self.scores = Some(scores);
        self
    }

    /// Where the score bias of sequence `b` starts.
    pub(in crate::nn) fn scores_at(&self, b: usize) -> usize {
        b * self.scores_stride
    }

    /// Keys computed for sequence `b`.
    pub fn len(&self, b: usize) -> usize {
        self.lengths[b]
    }

    /// Whether sequence `b` has masked keys to skip (it has at least one that is not).
    pub fn masking(&self, b: usize) -> bool {
        self.masking[b]
    }

    /// The probabilities kept: `heads * queries_b * L_b` summed over the sequences.
    pub(in crate::nn) fn kept_len(&self, dims: Dims, rows: &Rows) -> usize {
        self.lengths
            .iter()
            .zip(&rows.queries)
            .map(|(&l, &q)| dims.heads * q * l)
            .sum()
    }

    /// Offset of sequence `b`'s kept probabilities.
    pub(in crate::nn) fn kept_offsets(&self, dims: Dims, rows: &Rows) -> Vec<usize> {
        let mut at = 0;
        self.lengths
            .iter()
            .zip(&rows.queries)
            .map(|(&l, &q)| {
                let o = at;
                at += dims.heads * q * l;
                o
            })
            .collect()
    }
}
