//! DeBERTa-v2/v3's `config.json` beyond BERT's fields ([`DebertaSettings`]): whether the
//! attention is disentangled (relative positions in log buckets, content-to-position and
//! position-to-content terms), whether absolute positions are added to the embeddings,
//! and the relative position index the disentangled terms read ([`relative_index`]).

use std::path::Path;

use serde_json::Value;

use crate::{Error, Result};

/// What a `deberta-v2` config says beyond BERT's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct DebertaSettings {
    /// `position_biased_input` (default true): absolute position embeddings added to the
    /// word embeddings (DeBERTa-v3 has none).
    pub absolute_positions: bool,
    /// The disentangled attention (`relative_attention`, default false).
    pub relative: Option<RelativeSettings>,
}

/// The disentangled attention's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelativeSettings {
    /// Half the rows of `encoder.rel_embeddings`: `position_buckets` when positive, else
    /// `max_relative_positions` (itself `max_position_embeddings` when below 1).
    pub span: usize,
    /// `position_buckets` when positive: distances beyond half of them share log buckets.
    pub buckets: Option<usize>,
    /// `max_relative_positions` (or `max_position_embeddings`): the distance the log
    /// buckets reach.
    pub max_relative: usize,
    /// `c2p` in `pos_att_type`: the query's content against the key's relative position.
    pub c2p: bool,
    /// `p2c` in `pos_att_type`: the key's content against the query's relative position.
    pub p2c: bool,
    /// `share_att_key`: the relative embeddings go through the attention's own query and
    /// key projections (else through `pos_query_proj` / `pos_key_proj`).
    pub share_att_key: bool,
    /// `layer_norm` in `norm_rel_ebd`: the relative embeddings are normalised by
    /// `encoder.LayerNorm` before use.
    pub norm: bool,
}

impl RelativeSettings {
    /// The scores' scale `1 / sqrt(d (1 + terms))`, one term each for c2p and p2c.
    pub fn scale(&self, head_dim: usize) -> f64 {
        let factor = 1 + usize::from(self.c2p) + usize::from(self.p2c);
        // transformers: `sqrt(tensor(d, float) * factor)`, in f32.
        1.0 / ((head_dim as f32) * factor as f32).sqrt() as f64
    }
}

impl DebertaSettings {
    /// Reads the fields of `extra` (the config's keys beyond BERT's); `hidden`, `heads`
    /// and `max_positions` are the config's own. A field that changes the arithmetic and
    /// is not built (a convolution layer, an embedding projection, another head width,
    /// an attention term but c2p and p2c) is refused by name.
    pub fn from_config(
        extra: &serde_json::Map<String, Value>,
        (hidden, heads, max_positions): (usize, usize, usize),
        path: &Path,
    ) -> Result<Self> {
        let int =
            |key: &str, default: i64| extra.get(key).and_then(Value::as_i64).unwrap_or(default);
        let flag =
            |key: &str, default: bool| extra.get(key).and_then(Value::as_bool).unwrap_or(default);
        let refuse = |field: &'static str, value: String, supported: &'static str| {
            Err(Error::UnsupportedConfig {
                field,
                value,
                supported,
                path: path.to_path_buf(),
            })
        };
        if int("conv_kernel_size", 0) > 0 {
            return refuse(
                "conv_kernel_size",
                int("conv_kernel_size", 0).to_string(),
                "0 (DeBERTa-v2's convolution beside the first layer is not built)",
            );
        }
        if let Some(e) = extra.get("embedding_size").and_then(Value::as_u64) {
            if e as usize != hidden {
                return refuse(
                    "embedding_size",
                    e.to_string(),
                    "the hidden size (the embedding projection is not built)",
                );
            }
        }
        if let Some(d) = extra.get("attention_head_size").and_then(Value::as_u64) {
            if heads == 0 || d as usize * heads != hidden {
                return refuse(
                    "attention_head_size",
                    d.to_string(),
                    "hidden_size / num_attention_heads",
                );
            }
        }
        let absolute_positions = flag("position_biased_input", true);
        if !flag("relative_attention", false) {
            return Ok(Self {
                absolute_positions,
                relative: None,
            });
        }
        let terms: Vec<String> = match extra.get("pos_att_type") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => s
                .to_lowercase()
                .split('|')
                .map(|t| t.trim().to_string())
                .collect(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|t| t.as_str().unwrap_or("?").trim().to_lowercase())
                .collect(),
            Some(other) => return refuse("pos_att_type", other.to_string(), "c2p, p2c"),
        };
        if let Some(bad) = terms.iter().find(|t| !matches!(t.as_str(), "c2p" | "p2c")) {
            return refuse("pos_att_type", bad.clone(), "c2p, p2c");
        }
        let max_relative = match int("max_relative_positions", -1) {
            m if m < 1 => max_positions,
            m => m as usize,
        };
        let buckets = match int("position_buckets", -1) {
            b if b > 0 => Some(b as usize),
            _ => None,
        };
        if buckets.is_some_and(|b| b < 4 || max_relative <= b / 2 + 1) {
            return Err(Error::InvalidConfig {
                field: "position_buckets",
                value: buckets.unwrap_or(0).to_string(),
                reason: "needs at least 4 buckets and max_relative_positions past half of them",
            });
        }
        let norms: Vec<String> = extra
            .get("norm_rel_ebd")
            .and_then(Value::as_str)
            .unwrap_or("none")
            .to_lowercase()
            .split('|')
            .map(|t| t.trim().to_string())
            .collect();
        if let Some(bad) = norms
            .iter()
            .find(|t| !matches!(t.as_str(), "none" | "layer_norm"))
        {
            return refuse("norm_rel_ebd", bad.clone(), "none, layer_norm");
        }
        Ok(Self {
            absolute_positions,
            relative: Some(RelativeSettings {
                span: buckets.unwrap_or(max_relative),
                buckets,
                max_relative,
                c2p: terms.iter().any(|t| t == "c2p"),
                p2c: terms.iter().any(|t| t == "p2c"),
                share_att_key: flag("share_att_key", false),
                norm: norms.iter().any(|t| t == "layer_norm"),
            }),
        })
    }
}

/// DeBERTa's log bucket of the relative position `relative` (query less key): itself
/// within half the buckets, else `sign * (ceil(ln(|r| / mid) / ln((max - 1) / mid) (mid -
/// 1)) + mid)`; the arithmetic of transformers' `make_log_bucket_position`, in f32 as
/// PyTorch runs it.
pub fn log_bucket(relative: i64, buckets: usize, max_relative: usize) -> i64 {
    let mid = (buckets / 2) as i64;
    if relative.abs() <= mid {
        return relative;
    }
    let ratio = (relative.abs() as f32 / mid as f32).ln()
        / ((((max_relative - 1) as f64) / mid as f64) as f32).ln();
    let log_pos = (ratio * (mid - 1) as f32).ceil() as i64 + mid;
    relative.signum() * log_pos
}

/// The row of the relative embeddings every (query `i`, key `j`) pair of `s` tokens
/// reads, `[s * s]` row-major: `clamp(bucket(i - j) + span, 0, 2 span - 1)`. The
/// content-to-position term of the pair reads row `index[i, j]` of the positions'
/// keys, and so does the position-to-content term of the positions' queries (transformers'
/// `p2c_pos` of the key against the query is the same row, the buckets being odd).
pub fn relative_index(settings: &RelativeSettings, s: usize) -> Vec<u32> {
    let span = settings.span as i64;
    (0..s as i64)
        .flat_map(|i| (0..s as i64).map(move |j| i - j))
        .map(|r| {
            let r = match settings.buckets {
                Some(b) => log_bucket(r, b, settings.max_relative),
                None => r,
            };
            (r + span).clamp(0, 2 * span - 1) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_buckets_are_exact_near_and_logarithmic_far() {
        // transformers' make_log_bucket_position(arange(-31, 32), 8, 32).
        let want: Vec<i64> = vec![
            -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7, -6, -6, -6, -6, -6, -6,
            -6, -6, -5, -5, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7,
            7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
        ];
        let got: Vec<i64> = (-31..32).map(|r| log_bucket(r, 8, 32)).collect();
        assert_eq!(got, want);
        // DeBERTa-v3's own: 256 buckets over 512 positions, every 37th of -600..600.
        let want: Vec<i64> = vec![
            -270, -264, -258, -251, -244, -236, -228, -218, -208, -196, -182, -166, -147, -119,
            -82, -45, -8, 29, 66, 103, 137, 158, 176, 190, 203, 214, 224, 233, 241, 248, 255, 262,
            268,
        ];
        let got: Vec<i64> = (-600..600)
            .step_by(37)
            .map(|r| log_bucket(r, 256, 512))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_index_reads_the_mirrored_bucket_for_the_transposed_pair() {
        let settings = RelativeSettings {
            span: 8,
            buckets: Some(8),
            max_relative: 32,
            c2p: true,
            p2c: true,
            share_att_key: true,
            norm: true,
        };
        let s = 20;
        let index = relative_index(&settings, s);
        for i in 0..s {
            for j in 0..s {
                let (a, b) = (index[i * s + j] as i64, index[j * s + i] as i64);
                assert_eq!(a - 8, -(b - 8), "({i}, {j})");
            }
        }
        assert_eq!(index[0], 8);
        assert_eq!(index[s - 1], 1); // i - j = -19: bucket -7
    }
}
