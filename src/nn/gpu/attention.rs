//! The attention core the GPU layer nodes share: from queries `[n, heads, s, d]` and keys
//! and values `[n, kv_heads, s, d]` (grouped: each key-value head serves `heads /
//! kv_heads` consecutive query heads, whose rows are stacked into one batched product, so
//! no key or value is copied per query head), the probabilities through one fused
//! masked-softmax kernel (key mask, a score bias, a decoder's causal or windowed
//! pattern, dropout), the context, and the backward to `dq`, `dk`, `dv` (and the score
//! bias's gradient).

use candle_core::Tensor;

use crate::nn::kernels as k;

/// What the attention computes with besides `q`, `k`, `v`.
pub(super) struct Attention {
    /// The key mask `[n, s]` (in the norms' dtype).
    pub(super) key_bias: Tensor,
    /// A bias added to every text's scores `[heads, s, s]` (MPNet's relative positions).
    pub(super) score_bias: Option<Tensor>,
    pub(super) scale: f64,
    pub(super) dropout: Option<(u64, f32)>,
    /// A decoder's pattern: causal, and a sliding window.
    pub(super) pattern: (bool, Option<usize>),
    pub(super) n: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) s: usize,
    pub(super) d: usize,
}

/// The gradients of the attention's inputs; `dq` and `dk` not yet times the scale (the
/// caller folds it into its next kernel: the merge of the heads, or rotary's backward).
pub(super) struct AttentionGrads {
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    /// The score bias's gradient `[heads, s, s]` (summed over the texts), when asked for.
    pub(super) score_bias: Option<Tensor>,
}

impl Attention {
    /// `t` `[n, heads, s, x]` as each key-value head's stacked query rows
    /// `[n, kv_heads, group s, x]` (a view: a group's heads are consecutive).
    fn grouped(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let rows = self.heads / self.kv_heads * self.s;
        t.reshape((self.n, self.kv_heads, rows, t.dim(3)?))
    }

    /// The probabilities `[n, heads, s, s]` and, with dropout, the probabilities after it.
    pub(super) fn probabilities(
        &self,
        q: &Tensor,
        kk: &Tensor,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let scores = self
            .grouped(q)?
            .matmul(&kk.t()?)?
            .reshape((self.n, self.heads, self.s, self.s))?;
        k::softmax_forward(
            &scores,
            &self.key_bias,
            self.score_bias.as_ref(),
            self.scale,
            self.dropout,
            self.pattern,
        )
    }

    /// The context `[n s, heads d]` from the probabilities (after dropout) and `v`.
    pub(super) fn context(&self, p: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        let ctx = self
            .grouped(p)?
            .matmul(v)?
            .reshape((self.n, self.heads, self.s, self.d))?;
        k::from_heads(&[(&ctx, 0, 1.0)], self.heads * self.d)
    }

    /// The gradients of `q`, `k`, `v` from the context's `dctx` `[n s, heads d]`, with the
    /// probabilities as kept (`None`: recomputed from `q` and `k`).
    pub(super) fn backward(
        &self,
        dctx: &Tensor,
        (q, kk, v): (&Tensor, &Tensor, &Tensor),
        probs: Option<&Tensor>,
        want_score_bias: bool,
    ) -> candle_core::Result<AttentionGrads> {
        let dctx = k::to_heads(dctx, 0, (self.n, self.heads, self.s, self.d), None)?;
        let probs = match probs {
            Some(p) => p.clone(),
            None => self.probabilities(q, kk)?.0,
        };
        let dropped = match self.dropout.filter(|&(_, p)| p > 0.0) {
            Some((seed, p)) => k::dropout(&probs, seed, p)?,
            None => probs.clone(),
        };
        let dctx_g = self.grouped(&dctx)?;
        let dv = self.grouped(&dropped)?.t()?.matmul(&dctx_g)?;
        drop(dropped);
        let dd = dctx_g
            .matmul(&v.t()?)?
            .reshape((self.n, self.heads, self.s, self.s))?;
        drop((dctx, dctx_g));
        let dz = k::softmax_backward(&probs, &dd, self.dropout)?;
        drop((dd, probs));
        let score_bias = match (&self.score_bias, want_score_bias) {
            (Some(_), true) => {
                let per_text = dz.reshape((self.n, self.heads * self.s * self.s))?;
                Some(k::column_sums(&per_text)?.reshape((self.heads, self.s, self.s))?)
            }
            _ => None,
        };
        let dz_g = self.grouped(&dz)?;
        let dq = dz_g
            .matmul(kk)?
            .reshape((self.n, self.heads, self.s, self.d))?;
        let dk = dz_g.t()?.matmul(&self.grouped(q)?)?;
        Ok(AttentionGrads {
            q: dq,
            k: dk,
            v: dv,
            score_bias,
        })
    }
}
