//! How token states become one vector per sequence: the pooling modes of
//! sentence-transformers ([`Pooling`]), with its names and its arithmetic.

use candle_core::Tensor;

use crate::Result;

/// How token states become one vector per sequence: the pooling modes of
/// sentence-transformers, with its names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The first token's state (`[CLS]`), as DPR.
    Cls,
    /// The mean over real (unmasked) tokens, as sentence-transformers.
    #[default]
    Mean,
    /// The maximum of each dimension over the real tokens.
    Max,
    /// The sum over the real tokens divided by the square root of their number.
    #[serde(rename = "mean_sqrt_len_tokens", alias = "mean_sqrt_len")]
    MeanSqrtLen,
    /// The mean over real tokens weighted by position (the first token 1, the second 2,
    /// ...), as SGPT.
    #[serde(rename = "weightedmean")]
    WeightedMean,
    /// The last real token's state (decoder-style embedding models).
    #[serde(rename = "lasttoken")]
    LastToken,
}

impl Pooling {
    /// Every mode, in the order sentence-transformers lists them.
    pub const ALL: [Pooling; 6] = [
        Pooling::Cls,
        Pooling::Max,
        Pooling::Mean,
        Pooling::MeanSqrtLen,
        Pooling::WeightedMean,
        Pooling::LastToken,
    ];

    /// The name used in configs and by sentence-transformers' `pooling_mode`.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len_tokens",
            Pooling::WeightedMean => "weightedmean",
            Pooling::LastToken => "lasttoken",
        }
    }

    /// The mode named `name` ([`Self::name`], or `mean_sqrt_len`).
    pub fn from_name(name: &str) -> Option<Self> {
        if name == "mean_sqrt_len" {
            return Some(Pooling::MeanSqrtLen);
        }
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The key of the mode among the booleans of sentence-transformers' older
    /// `1_Pooling/config.json` (`pooling_mode_mean_tokens`, ...).
    pub fn legacy_key(self) -> &'static str {
        match self {
            Pooling::Cls => "pooling_mode_cls_token",
            Pooling::Mean => "pooling_mode_mean_tokens",
            Pooling::Max => "pooling_mode_max_tokens",
            Pooling::MeanSqrtLen => "pooling_mode_mean_sqrt_len_tokens",
            Pooling::WeightedMean => "pooling_mode_weightedmean_tokens",
            Pooling::LastToken => "pooling_mode_lasttoken",
        }
    }

    /// Pools token states `x` `[n, s, h]` over the tokens `mask` `[n, s]` keeps (1 for a
    /// real token, 0 for padding on either side and for a prompt left out of the
    /// pooling), as sentence-transformers does; `first[i]` is the first real token of
    /// sequence `i` (past its padding on the left), where weighted-mean positions count
    /// from; `kept[i]` is the first and the last position the mask keeps in sequence `i`
    /// (`(0, 0)` for a row it keeps none of; read on the host, so no pooling waits for a
    /// GPU): `cls` takes the first, `lasttoken` the last.
    /// Mean pooling runs as one node (see [`crate::nn::mean_pool`]); the others are
    /// composed of differentiable ops. Normalises the result with `normalize`.
    pub fn pool(
        self,
        x: &Tensor,
        mask: &Tensor,
        first: &[usize],
        kept: &[(usize, usize)],
        normalize: bool,
    ) -> Result<Tensor> {
        let (n, s, h) = x.dims3()?;
        let pick = |rows: Vec<u32>| -> Result<Tensor> {
            let rows = Tensor::new(rows.as_slice(), x.device())?;
            Ok(x.reshape((n * s, h))?.index_select(&rows, 0)?)
        };
        let pooled = match self {
            Pooling::Mean => return crate::nn::mean_pool(x, mask, normalize),
            Pooling::Cls => {
                // The first position the mask keeps (position 0 for a row it keeps none
                // of), as sentence-transformers' argmax of the mask.
                let rows: Vec<u32> = (0..n)
                    .map(|i| (i * s + kept.get(i).map_or(0, |k| k.0)) as u32)
                    .collect();
                pick(rows)?
            }
            Pooling::Max => {
                let keep = mask.unsqueeze(2)?.broadcast_as((n, s, h))?.ne(0.0)?;
                let floor =
                    Tensor::full(f32::NEG_INFINITY, (n, s, h), x.device())?.to_dtype(x.dtype())?;
                keep.where_cond(x, &floor)?.max(1)?
            }
            Pooling::MeanSqrtLen => {
                let sum = x.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
                let count = mask.sum_keepdim(1)?.clamp(1e-9, f64::MAX)?;
                sum.broadcast_div(&count.sqrt()?)?
            }
            Pooling::WeightedMean => {
                // Position 1 at each sequence's first real token.
                let positions: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        let f = first.get(i).copied().unwrap_or(0);
                        (0..s).map(move |t| t as f32 + 1.0 - f as f32)
                    })
                    .collect();
                let positions =
                    Tensor::from_vec(positions, (n, s), x.device())?.to_dtype(mask.dtype())?;
                let weights = (mask * positions)?;
                let sum = x.broadcast_mul(&weights.unsqueeze(2)?)?.sum(1)?;
                let total = weights.sum_keepdim(1)?.clamp(1e-9, f64::MAX)?;
                sum.broadcast_div(&total)?
            }
            Pooling::LastToken => {
                // The last position the mask keeps (position 0 for a row it keeps none of).
                let rows: Vec<u32> = (0..n)
                    .map(|i| (i * s + kept.get(i).map_or(0, |k| k.1)) as u32)
                    .collect();
                let rows = Tensor::new(rows.as_slice(), x.device())?;
                let masked = x.broadcast_mul(&mask.unsqueeze(2)?)?;
                masked.reshape((n * s, h))?.index_select(&rows, 0)?
            }
        };
        if normalize {
            crate::nn::l2_normalize(&pooled)
        } else {
            Ok(pooled)
        }
    }
}
