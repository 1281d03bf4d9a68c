//! Unpadding: the rows of each sequence up to its last real token, packed one after
//! another, gathered from and scattered back to the padded `[n, s, h]` layout; and
//! [`View`], a contiguous CPU tensor's values read in place.

use candle_core::Tensor;

use crate::nn::cpu::attention::heads::{KeyMask, Rows};
use crate::nn::cpu::blocks::Float;

/// The rows a layer computes: each sequence's tokens up to its last unmasked one, packed
/// one after another (no work on padding: text-embeddings-inference's and ModernBERT's
/// unpadding). Padding rows take no part in the real rows' results (they are masked keys,
/// and no gradient reaches them), so the real rows are what they would be padded; the
/// layer's output is 0 at padding. Dropout masks are those of each element's place in the
/// padded `[n, s, h]` tensor, so packing changes no mask.
pub(crate) struct Packing {
    pub(in crate::nn) rows: Rows,
    /// The padded row of every packed row.
    pub(in crate::nn) padded: Vec<usize>,
    /// Every row is real: packed and padded are the same.
    identity: bool,
}

impl Packing {
    pub(in crate::nn) fn new<T: Float>(mask: &KeyMask<T>, n: usize, s: usize) -> Self {
        let lengths: Vec<usize> = (0..n).map(|b| mask.len(b)).collect();
        let padded = lengths
            .iter()
            .enumerate()
            .flat_map(|(b, &l)| (0..l).map(move |t| b * s + t))
            .collect::<Vec<_>>();
        Self {
            identity: padded.len() == n * s,
            rows: Rows::packed(&lengths),
            padded,
        }
    }

    /// The real tokens alone, wherever the padding is (a decoder's batches are padded on
    /// the left): each sequence's unmasked rows of the key bias `[n, s]`, packed in order.
    pub(in crate::nn) fn real<T: Float>(bias: &[T], n: usize, s: usize) -> Self {
        let masked = T::of(crate::nn::cpu::attention::heads::MASKED_BIAS);
        let mut lengths = Vec::with_capacity(n);
        let mut padded = Vec::with_capacity(n * s);
        for b in 0..n {
            let before = padded.len();
            padded.extend(
                (0..s)
                    .filter(|&t| bias[b * s + t] > masked)
                    .map(|t| b * s + t),
            );
            lengths.push(padded.len() - before);
        }
        Self {
            identity: padded.len() == n * s,
            rows: Rows::packed(&lengths),
            padded,
        }
    }

    pub(in crate::nn) fn total(&self) -> usize {
        self.padded.len()
    }

    /// The packed rows of `x` (`[n s, width]`).
    pub(in crate::nn) fn gather<'a, T: Float>(
        &self,
        x: &'a [T],
        width: usize,
    ) -> std::borrow::Cow<'a, [T]> {
        if self.identity {
            return std::borrow::Cow::Borrowed(x);
        }
        let mut out = Vec::with_capacity(self.total() * width);
        for &r in &self.padded {
            out.extend_from_slice(&x[r * width..(r + 1) * width]);
        }
        std::borrow::Cow::Owned(out)
    }

    /// The packed rows `y` put back at their padded places, 0 elsewhere.
    pub(in crate::nn) fn scatter<T: Float>(
        &self,
        y: Vec<T>,
        padded_rows: usize,
        width: usize,
    ) -> Vec<T> {
        if self.identity {
            return y;
        }
        let mut out = vec![T::zero(); padded_rows * width];
        for (row, &r) in y.chunks_exact(width).zip(&self.padded) {
            out[r * width..(r + 1) * width].copy_from_slice(row);
        }
        out
    }
}

/// A contiguous CPU tensor's values, read in place for as long as the view (its storage's
/// read lock) lives.
pub(crate) struct View<G> {
    guard: G,
    range: (usize, usize),
}

impl View<()> {
    #[allow(clippy::new_ret_no_self)]
    pub(crate) fn new(
        t: &Tensor,
    ) -> candle_core::Result<View<impl std::ops::Deref<Target = candle_core::Storage> + '_>> {
        let (guard, layout) = t.storage_and_layout();
        let range = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("encoder layer: a strided input".into()))?;
        Ok(View { guard, range })
    }
}

impl<G: std::ops::Deref<Target = candle_core::Storage>> View<G> {
    pub(crate) fn values<T: Float>(&self) -> candle_core::Result<&[T]> {
        match &*self.guard {
            candle_core::Storage::Cpu(s) => Ok(&s.as_slice::<T>()?[self.range.0..self.range.1]),
            _ => candle_core::bail!("encoder layer: a tensor off the CPU"),
        }
    }
}

/// The packed input gradient and one gradient per weight of a [`packed_layer`]'s backward.
pub(in crate::nn) type LayerGrads<T> = (Vec<T>, Vec<Vec<T>>);

/// A whole layer as one graph node on the packed real rows of `x` `[n, s, h]`: the plumbing
/// the pre-norm and decoder layer nodes share. `forward` gets the packed input rows and
/// returns the packed output rows and, where something is tracked, what its backward keeps;
/// `backward` gets the packed input rows, the packed output gradient and what was kept, and
/// returns the packed input gradient and one gradient per entry of `weights` (an absent
/// weight's is ignored). The weights' gradients go into the open gradient sink (or to
/// candle when none is open); a weight that is neither a variable nor computed from one (a
/// frozen weight) gets none. Without a kept state the output is a plain tensor.
pub(in crate::nn) fn packed_layer<T: Float, K: Send + Sync + 'static>(
    name: &'static str,
    x: &Tensor,
    weights: &[Option<&Tensor>],
    packing: Packing,
    forward: impl FnOnce(&[T], &Packing) -> candle_core::Result<(Vec<T>, Option<K>)>,
    backward: impl Fn(&[T], &[T], &Packing, &K) -> candle_core::Result<LayerGrads<T>>
        + Send
        + Sync
        + 'static,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = x.dims3()?;
    let xd = x.detach().contiguous()?;
    let (out, kept) = {
        let xv = View::new(&xd)?;
        forward(&packing.gather(xv.values::<T>()?, h), &packing)?
    };
    let out = packing.scatter(out, n * s, h);
    let Some(kept) = kept else {
        return Tensor::from_vec(out, (n, s, h), x.device());
    };
    let params: Vec<Option<Tensor>> = weights.iter().map(|t| t.cloned()).collect();
    let mut inputs = vec![x];
    inputs.extend(weights.iter().flatten());
    crate::nn::node::node_n_owned(
        name,
        &inputs,
        out,
        (n, s, h).into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let (xv, dyv) = (View::new(&xd)?, View::new(&dy)?);
            let xp = packing.gather(xv.values::<T>()?, h);
            let dyp = packing.gather(dyv.values::<T>()?, h);
            let (dx, grads) = backward(&xp, &dyp, &packing, &kept)?;
            let dx = packing.scatter(dx, n * s, h);
            let mut out = vec![Some(Tensor::from_vec(
                dx,
                (n, s, h),
                &candle_core::Device::Cpu,
            )?)];
            for (param, g) in params.iter().zip(grads) {
                if let Some(param) = param {
                    out.push(match param.is_variable() || param.track_op() {
                        true => crate::sink::deposit(param, g)?,
                        false => None,
                    });
                }
            }
            Ok(out)
        }),
    )
}
