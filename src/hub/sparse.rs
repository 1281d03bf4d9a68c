//! A sparse model's vectors as an inverted index and a reader want them: the non-zero
//! entries of a vocabulary-wide vector as `(index, value)` pairs (optionally the `k`
//! largest only, sentence-transformers' `max_active_dims`) and as `{token: weight}` by the
//! tokenizer's vocabulary.

use crate::hub::Tokenizer;
use crate::{Error, Result};

/// The non-zero entries of one sparse vector, by increasing vocabulary index.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseVector {
    /// The vocabulary indices of the active entries, increasing.
    pub indices: Vec<u32>,
    /// Their weights.
    pub values: Vec<f32>,
}

impl SparseVector {
    /// The active entries of `dense` (exact zeros left out); with `top_k`, only the `k`
    /// largest (ties by the lower index). `top_k` of 0 is refused.
    pub fn from_dense(dense: &[f32], top_k: Option<usize>) -> Result<Self> {
        if top_k == Some(0) {
            return Err(Error::InvalidArgument {
                what: "top-k",
                value: "0".into(),
                reason: "keeps the k largest entries of each vector: at least 1",
            });
        }
        let mut active: Vec<(u32, f32)> = dense
            .iter()
            .enumerate()
            .filter(|(_, &v)| v != 0.0)
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if let Some(k) = top_k.filter(|&k| k < active.len()) {
            active.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            active.truncate(k);
            active.sort_by_key(|&(i, _)| i);
        }
        Ok(Self {
            indices: active.iter().map(|&(i, _)| i).collect(),
            values: active.iter().map(|&(_, v)| v).collect(),
        })
    }

    /// The entries as `{token: weight}` by `tokenizer`'s vocabulary (an index outside it
    /// as `[index]`).
    pub fn tokens(&self, tokenizer: &Tokenizer) -> serde_json::Map<String, serde_json::Value> {
        self.indices
            .iter()
            .zip(&self.values)
            .map(|(&i, &v)| {
                let token = tokenizer
                    .inner()
                    .id_to_token(i)
                    .unwrap_or_else(|| format!("[{i}]"));
                (token, serde_json::json!(v))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_entries_and_the_k_largest() {
        let dense = [0.0, 0.5, 0.0, 2.0, 0.25, 2.0, 0.0];
        let all = SparseVector::from_dense(&dense, None).unwrap();
        assert_eq!(all.indices, [1, 3, 4, 5]);
        assert_eq!(all.values, [0.5, 2.0, 0.25, 2.0]);
        let top = SparseVector::from_dense(&dense, Some(3)).unwrap();
        assert_eq!(
            (top.indices, top.values),
            (vec![1, 3, 5], vec![0.5, 2.0, 2.0])
        );
        let more = SparseVector::from_dense(&dense, Some(10)).unwrap();
        assert_eq!(more, all);
        assert!(SparseVector::from_dense(&dense, Some(0)).is_err());
    }
}
