//! DeBERTa-v2/v3's disentangled attention ([`Disentangled`]): BERT's post-norm layer
//! whose attention scores add, to the content-to-content product, a content-to-position
//! term (the query against the keys of the relative positions) and a position-to-content
//! term (the key against the queries of the relative positions), each over the log
//! buckets of the distance between the tokens:
//!
//! ```text
//! rel   = LayerNorm(rel_embeddings)             ([2 span, h], shared by every layer)
//! Kr    = key_proj(dropout(rel)) ; Qr = query_proj(dropout(rel))   (share_att_key)
//! score = (q_i . k_j + q_i . Kr[idx(i, j)] + k_j . Qr[idx(i, j)]) / sqrt(3 d)
//! idx(i, j) = clamp(bucket(i - j) + span, 0, 2 span - 1)
//! ```
//!
//! transformers' `DisentangledSelfAttention`; the weights keep its names
//! (`encoder.rel_embeddings`, `encoder.LayerNorm`, `attention.self.pos_key_proj`, ...).

use candle_core::{Tensor, D};
use candle_nn::VarBuilder;

pub use super::deberta_config::RelativeSettings;
use crate::dropout::{Ctx, Dropout};
use crate::nn::{LayerNorm, Linear};
use crate::Result;

/// The dropout site of the relative embeddings in a layer (beside BERT's four).
const SITE_RELATIVE_EMBEDDINGS: u32 = 4;

/// The relative embeddings and what every layer's disentangled attention shares.
pub struct Disentangled {
    settings: RelativeSettings,
    /// `encoder.rel_embeddings.weight` `[2 span, h]`.
    table: Tensor,
    /// `encoder.LayerNorm` (`norm_rel_ebd: layer_norm`).
    norm: Option<LayerNorm>,
    /// Per layer, without `share_att_key`: `pos_query_proj` (p2c) and `pos_key_proj`
    /// (c2p).
    own: Vec<(Option<Linear>, Option<Linear>)>,
    /// transformers' `pos_dropout` (the hidden dropout) on the relative embeddings, in
    /// every layer.
    dropout: Dropout,
}

/// The per-chunk index of the relative embeddings' row each (query, key) pair reads,
/// `[s, s]` row-major, counted from the first row a pair of the chunk reads: only the
/// rows `first .. first + rows` of the relative embeddings are projected (a chunk of `s`
/// tokens reads at most `2 s - 1` of them; transformers projects all `2 span`).
pub struct RelativeAux {
    index: std::sync::Arc<Vec<u32>>,
    s: usize,
    first: usize,
    rows: usize,
}

impl Disentangled {
    /// The relative embeddings under `vb` (the model root: `encoder.*`) and, without
    /// `share_att_key`, each layer's own position projections, as transformers
    /// initialises them (normal(0, `std`), zero biases, LayerNorm ones).
    pub fn new(
        settings: RelativeSettings,
        (layers, h, eps, std, dropout): (usize, usize, f64, f64, f32),
        lora: Option<&crate::nn::lora::LoraSpec>,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let e = vb.pp("encoder");
        let table = e.pp("rel_embeddings").get_with_hints(
            (2 * settings.span, h),
            "weight",
            candle_nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        )?;
        let norm = match settings.norm {
            true => Some(LayerNorm::new(h, eps, e.pp("LayerNorm"))?),
            false => None,
        };
        let own = (0..layers)
            .map(|i| {
                if settings.share_att_key {
                    return Ok((None, None));
                }
                let at = e.pp("layer").pp(i).pp("attention").pp("self");
                let projection = |on: bool, name: &str| -> Result<Option<Linear>> {
                    match on {
                        true => Ok(Some(Linear::projection(
                            (h, h, true),
                            std,
                            lora,
                            at.pp(name),
                        )?)),
                        false => Ok(None),
                    }
                };
                Ok((
                    projection(settings.p2c, "pos_query_proj")?,
                    projection(settings.c2p, "pos_key_proj")?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            settings,
            table,
            norm,
            own,
            dropout: Dropout::new(dropout)?,
        })
    }

    /// The scores' scale for heads of width `head_dim`.
    pub fn scale(&self, head_dim: usize) -> f64 {
        self.settings.scale(head_dim)
    }

    /// The relative index of a chunk of sequences of `s` tokens.
    pub fn aux(&self, s: usize) -> RelativeAux {
        let mut index = super::deberta_config::relative_index(&self.settings, s);
        let first = index.iter().copied().min().unwrap_or(0);
        let last = index.iter().copied().max().unwrap_or(0);
        for i in index.iter_mut() {
            *i -= first;
        }
        RelativeAux {
            index: std::sync::Arc::new(index),
            s,
            first: first as usize,
            rows: (last - first) as usize + 1,
        }
    }

    /// The row index each (query, key) pair reads (the layer node's input).
    pub fn index_rows(aux: &RelativeAux) -> std::sync::Arc<Vec<u32>> {
        aux.index.clone()
    }

    /// The index of `aux` (or its transpose) broadcast to the scores' shape `[n, heads,
    /// s, s]`, as `gather` reads it.
    fn index(
        aux: &RelativeAux,
        (n, heads): (usize, usize),
        transposed: bool,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let s = aux.s;
        let index = Tensor::from_vec(aux.index.to_vec(), (s, s), device)?;
        let index = match transposed {
            true => index.t()?,
            false => index,
        };
        Ok(index.broadcast_as((n, heads, s, s))?.contiguous()?)
    }

    /// The relative embeddings `aux` reads of layer `layer` (dropout id `id`) through the
    /// key and the query projections, `Kr` (c2p) and `Qr` (p2c) `[rows, h]` in `dtype`,
    /// for the terms the model has; `query` and `key` are the layer's own projections (the
    /// positions' under `share_att_key`).
    pub fn positions(
        &self,
        (layer, id): (usize, u32),
        (query, key): (&Linear, &Linear),
        (dtype, aux): (candle_core::DType, &RelativeAux),
        ctx: &Ctx,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rel = self.relative_embeddings()?.to_dtype(dtype)?;
        let rel = rel.narrow(0, aux.first, aux.rows)?;
        let rel = self
            .dropout
            .forward(&rel, ctx, id, SITE_RELATIVE_EMBEDDINGS)?;
        let (own_query, own_key) = &self.own[layer];
        let key = match self.settings.c2p {
            true => Some(own_key.as_ref().unwrap_or(key).forward(&rel)?),
            false => None,
        };
        let query = match self.settings.p2c {
            true => Some(own_query.as_ref().unwrap_or(query).forward(&rel)?),
            false => None,
        };
        Ok((key, query))
    }

    /// The relative embeddings as every layer reads them (normalised when the config says).
    fn relative_embeddings(&self) -> Result<Tensor> {
        match &self.norm {
            Some(norm) => norm.forward(&self.table),
            None => Ok(self.table.clone()),
        }
    }

    /// The disentangled terms of layer `layer` (dropout id `id`) added to the scores,
    /// already scaled, `[n, heads, s, s]`, for `q` and `k` `[n, heads, s, d]`; `query`
    /// and `key` are the layer's own projections (the positions' under `share_att_key`).
    pub fn score_bias(
        &self,
        layer: (usize, u32),
        (q, k): (&Tensor, &Tensor),
        projections: (&Linear, &Linear),
        aux: &RelativeAux,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let (n, heads, _, d) = q.dims4()?;
        let (kr, qr) = self.positions(layer, projections, (q.dtype(), aux), ctx)?;
        // [2 span, h] -> [1, heads, 2 span, d].
        let split = |t: Tensor| -> Result<Tensor> {
            let rows = t.dim(0)?;
            Ok(t.reshape((1, rows, heads, d))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let scale = self.scale(d);
        let mut total: Option<Tensor> = None;
        let mut add = |t: Tensor| -> Result<()> {
            total = Some(match total.take() {
                Some(s) => (s + t)?,
                None => t,
            });
            Ok(())
        };
        if let Some(kr) = kr {
            // [n, heads, s, 2 span]: each query against every relative position's key.
            let all = q.broadcast_matmul(&split(kr)?.t()?)?;
            let index = Self::index(aux, (n, heads), false, q.device())?;
            add(all.contiguous()?.gather(&index, D::Minus1)?)?;
        }
        if let Some(qr) = qr {
            // [n, heads, s (key), 2 span]: each key against every relative position's query.
            let all = k.broadcast_matmul(&split(qr)?.t()?)?;
            let index = Self::index(aux, (n, heads), true, q.device())?;
            add(all.contiguous()?.gather(&index, D::Minus1)?.t()?)?;
        }
        match total {
            Some(t) => Ok((t * scale)?),
            None => {
                let s = q.dim(2)?;
                Ok(Tensor::zeros((n, heads, s, s), q.dtype(), q.device())?)
            }
        }
    }
}
