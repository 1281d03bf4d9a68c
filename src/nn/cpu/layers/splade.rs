//! SPLADE's max pooling over a masked-language-model head's logits as one node with its
//! backward written out (sentence-transformers' `SpladePooling("max")`):
//!
//! ```text
//! logit[i, t, j] = t[i, t] . E[j] + b[j]               (E: the tied word embeddings)
//! w[i, j] = f(max(0, max over kept tokens t of logit[i, t, j]))
//! f(x) = log(1 + x)          (activation relu)
//! f(x) = log(1 + log(1 + x)) (activation log1p_relu)
//! ```
//!
//! `f` rises and is 0 at 0, so pooling `f(relu(logit))` over the tokens (a left-out token
//! counting 0) is `f` of the largest logit. The composed form keeps the logits of every
//! token `[n, s, vocabulary]` several times over (the mask, relu, each log, the max's
//! comparison) and its backward writes as many; here the logits exist for a block of
//! rows at a time and the node keeps, per text and vocabulary entry, the winning token
//! and `f'` there: `[n, vocabulary]` twice. The backward is as sparse as the vector: an
//! entry sends its gradient to its one winning token (the first, on a tie, as torch's
//! `max` does), so `dt` and `dE` are a row update per active entry, not products over
//! every token.

use candle_core::{DType, Tensor};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{parallel_ranges, Float, SharedMut};
use crate::nn::cpu::layers::packing::View;
use crate::nn::cpu::products::gemm::product;
use crate::nn::node::node_n_owned;

/// Rows of logits `[rows, vocabulary]` computed at once (a block of 256 at BERT's
/// vocabulary is 31 MB in f32).
const LOGIT_ROWS: usize = 256;

/// No winning token: every kept logit of the entry is at most 0 (or no token is kept).
const NONE: u32 = u32::MAX;

/// The SPLADE max pooling of hidden states `t` `[n, s, h]` (after the head's transform)
/// through the tied decoder `table` `[vocabulary, h]` and `bias` `[vocabulary]` over the
/// tokens `mask` `[n, s]` keeps (1 kept, 0 not): `[n, vocabulary]`; `twice` for
/// `log1p_relu`. One node over `t`, `table` and `bias` (CPU, f32 or f64).
pub fn max_pool(
    t: &Tensor,
    table: &Tensor,
    bias: &Tensor,
    mask: &Tensor,
    twice: bool,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = t.dims3()?;
    let (vocab, h2) = table.dims2()?;
    if h2 != h || bias.dims1()? != vocab || mask.dims2()? != (n, s) {
        candle_core::bail!(
            "SPLADE pooling: hidden states {:?}, a decoder {:?}, a bias {:?} and a mask {:?} \
             do not fit",
            t.dims(),
            table.dims(),
            bias.dims(),
            mask.dims()
        );
    }
    match t.dtype() {
        DType::F32 => pool::<f32>(t, table, bias, mask, (n, s, h, vocab), twice),
        DType::F64 => pool::<f64>(t, table, bias, mask, (n, s, h, vocab), twice),
        other => candle_core::bail!("SPLADE pooling: run in f32 or f64, not {other:?}"),
    }
}

/// `f` and `f'` at a pooled logit `x > 0`.
fn activation<T: Float>(x: T, twice: bool) -> (T, T) {
    let once = x.ln_1p();
    let d = T::one() / (T::one() + x);
    if twice {
        (once.ln_1p(), d / (T::one() + once))
    } else {
        (once, d)
    }
}

wide_fn! {
fn pool<T: Float>(
    t: &Tensor,
    table: &Tensor,
    bias: &Tensor,
    mask: &Tensor,
    (n, s, h, vocab): (usize, usize, usize, usize),
    twice: bool,
) -> candle_core::Result<Tensor> {
    let kept: Vec<bool> = mask
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|&m| m != 0.0)
        .collect();
    let (t_d, table_d, bias_d) = (
        t.detach().contiguous()?,
        table.detach().contiguous()?,
        bias.detach().contiguous()?,
    );
    // Per text and entry: the pooled value, the winning token and f' there.
    let mut w = vec![T::zero(); n * vocab];
    let mut winner = vec![NONE; n * vocab];
    let mut slope = vec![T::zero(); n * vocab];
    {
        let (tv, ev, bv) = (View::new(&t_d)?, View::new(&table_d)?, View::new(&bias_d)?);
        let (ts, es, bs) = (tv.values::<T>()?, ev.values::<T>()?, bv.values::<T>()?);
        // The kept tokens, as (text, token) in order, a block of rows at a time.
        let rows: Vec<(usize, usize)> = (0..n * s)
            .filter(|&r| kept[r])
            .map(|r| (r / s, r % s))
            .collect();
        let mut gathered = vec![T::zero(); LOGIT_ROWS.min(rows.len().max(1)) * h];
        let mut logits = vec![T::zero(); LOGIT_ROWS.min(rows.len().max(1)) * vocab];
        // The running largest logit of each (text, entry), from -inf.
        let mut best = vec![T::neg_infinity(); n * vocab];
        for block in rows.chunks(LOGIT_ROWS) {
            for (k, &(i, tok)) in block.iter().enumerate() {
                gathered[k * h..(k + 1) * h]
                    .copy_from_slice(&ts[(i * s + tok) * h..(i * s + tok + 1) * h]);
            }
            // Each row starts as the bias, the product added to it.
            for row in logits[..block.len() * vocab].chunks_exact_mut(vocab) {
                row.copy_from_slice(bs);
            }
            product(
                (block.len(), vocab, h),
                (&mut logits[..block.len() * vocab], vocab),
                true,
                (&gathered[..block.len() * h], h, 1),
                (es, 1, h),
            );
            // Fold the block into each text's running maxima, texts in parallel over
            // column ranges (each task owns its columns of every text).
            let best_ptr = SharedMut(best.as_mut_ptr());
            let winner_ptr = SharedMut(winner.as_mut_ptr());
            let logits = &logits;
            parallel_ranges(vocab.div_ceil(1024), |chunks| {
                let cols = chunks.start * 1024..(chunks.end * 1024).min(vocab);
                for (k, &(i, tok)) in block.iter().enumerate() {
                    let row = &logits[k * vocab..(k + 1) * vocab];
                    for j in cols.clone() {
                        let v = row[j];
                        // SAFETY: this task alone writes columns `cols` of every text.
                        unsafe {
                            let b = best_ptr.get().add(i * vocab + j);
                            if v > *b {
                                *b = v;
                                *winner_ptr.get().add(i * vocab + j) = tok as u32;
                            }
                        }
                    }
                }
            });
        }
        for (k, &m) in best.iter().enumerate() {
            if m > T::zero() {
                let (value, derivative) = activation(m, twice);
                w[k] = value;
                slope[k] = derivative;
            } else {
                winner[k] = NONE;
            }
        }
    }
    if ![t, table, bias].iter().any(|x| x.track_op()) {
        return Tensor::from_vec(w, (n, vocab), &candle_core::Device::Cpu);
    }
    node_n_owned(
        "gradcache-splade-max-pool",
        &[t, table, bias],
        w,
        (n, vocab).into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let view = View::new(&dy)?;
            let g = view.values::<T>()?;
            // The gradient of each (text, entry)'s winning logit.
            let coef: Vec<T> = g.iter().zip(&slope).map(|(&g, &d)| g * d).collect();
            let (tv, ev) = (View::new(&t_d)?, View::new(&table_d)?);
            let (ts, es) = (tv.values::<T>()?, ev.values::<T>()?);
            // dt: each text's winning tokens gather their entries' rows of the table.
            let mut dt = vec![T::zero(); n * s * h];
            let dt_ptr = SharedMut(dt.as_mut_ptr());
            parallel_ranges(n, |texts| {
                for i in texts {
                    for j in 0..vocab {
                        let (tok, c) = (winner[i * vocab + j], coef[i * vocab + j]);
                        if tok == NONE || c == T::zero() {
                            continue;
                        }
                        // SAFETY: this task alone writes text `i`'s rows.
                        let out = unsafe {
                            std::slice::from_raw_parts_mut(
                                dt_ptr.get().add((i * s + tok as usize) * h),
                                h,
                            )
                        };
                        for (o, &e) in out.iter_mut().zip(&es[j * h..(j + 1) * h]) {
                            *o += c * e;
                        }
                    }
                }
            });
            // dE and the bias: each entry gathers its winning tokens' hidden states.
            let mut de = vec![T::zero(); vocab * h];
            let mut db = vec![T::zero(); vocab];
            let (de_ptr, db_ptr) = (SharedMut(de.as_mut_ptr()), SharedMut(db.as_mut_ptr()));
            parallel_ranges(vocab.div_ceil(256), |chunks| {
                for j in chunks.start * 256..(chunks.end * 256).min(vocab) {
                    // SAFETY: this task alone writes entries `j` of its range.
                    let (out, bias) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(de_ptr.get().add(j * h), h),
                            &mut *db_ptr.get().add(j),
                        )
                    };
                    for i in 0..n {
                        let (tok, c) = (winner[i * vocab + j], coef[i * vocab + j]);
                        if tok == NONE {
                            continue;
                        }
                        *bias += c;
                        let row = &ts[(i * s + tok as usize) * h..(i * s + tok as usize + 1) * h];
                        for (o, &x) in out.iter_mut().zip(row) {
                            *o += c * x;
                        }
                    }
                }
            });
            let cpu = candle_core::Device::Cpu;
            Ok(vec![
                Some(Tensor::from_vec(dt, (n, s, h), &cpu)?),
                Some(Tensor::from_vec(de, (vocab, h), &cpu)?),
                Some(Tensor::from_vec(db, vocab, &cpu)?),
            ])
        }),
    )
}
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// The composed form: the logits of every token, masked to 0, `log(1 + relu)` (twice
    /// for `log1p_relu`), the largest over the tokens.
    fn composed(t: &Tensor, table: &Tensor, bias: &Tensor, mask: &Tensor, twice: bool) -> Tensor {
        let logits = t
            .broadcast_matmul(&table.t().unwrap())
            .unwrap()
            .broadcast_add(bias)
            .unwrap();
        let masked = logits
            .broadcast_mul(
                &mask
                    .to_dtype(logits.dtype())
                    .unwrap()
                    .unsqueeze(D::Minus1)
                    .unwrap(),
            )
            .unwrap();
        let mut w = (masked.relu().unwrap() + 1.0).unwrap().log().unwrap();
        if twice {
            w = (w + 1.0).unwrap().log().unwrap();
        }
        w.max(1).unwrap()
    }

    /// Forward and the three gradients of the node against the composed form in f64, on
    /// texts with left-out tokens, an entry whose logits are all negative (no winner) and
    /// a text with no kept token at all.
    #[test]
    fn the_node_equals_the_composed_form() {
        let dev = Device::Cpu;
        let (n, s, h, vocab) = (4, 6, 5, 37);
        let t = Var::from_tensor(&Tensor::randn(0f64, 1.0, (n, s, h), &dev).unwrap()).unwrap();
        let table = Var::from_tensor(&Tensor::randn(0f64, 0.7, (vocab, h), &dev).unwrap()).unwrap();
        let mut b: Vec<f64> = (0..vocab).map(|j| (j % 5) as f64 * 0.2 - 0.3).collect();
        b[3] = -50.0;
        let bias = Var::from_tensor(&Tensor::new(b, &dev).unwrap()).unwrap();
        let m: Vec<f64> = (0..n * s)
            .map(|r| {
                if r / s == 2 || r % s >= 4 - r / s % 2 {
                    0.0
                } else {
                    1.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(m, (n, s), &dev).unwrap();
        let weights = Tensor::randn(0f64, 1.0, (n, vocab), &dev).unwrap();
        let max_abs = |x: &Tensor| -> f64 {
            x.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        for twice in [false, true] {
            let want = composed(&t, &table, &bias, &mask, twice);
            let got = max_pool(&t, &table, &bias, &mask, twice).unwrap();
            assert!(
                max_abs(&(&got - &want).unwrap()) < 1e-12,
                "forward, twice {twice}"
            );
            // The text with no kept token pools to zeros.
            assert_eq!(max_abs(&got.get(2).unwrap()), 0.0);
            let loss = |w: &Tensor| (w * &weights).unwrap().sum_all().unwrap();
            let (g_want, g_got) = (
                loss(&want).backward().unwrap(),
                loss(&got).backward().unwrap(),
            );
            for v in [&t, &table, &bias] {
                let (a, b) = (g_got.get(v).unwrap(), g_want.get(v).unwrap());
                let (diff, scale) = (max_abs(&(a - b).unwrap()), max_abs(b));
                assert!(
                    scale > 0.0 && diff < 1e-12 * scale.max(1.0),
                    "gradient {:?}, twice {twice}: {diff}",
                    v.dims()
                );
            }
        }
    }

    /// More kept rows than one block of logits: the running maxima cross blocks.
    #[test]
    fn blocks_of_logits_fold_into_the_same_maxima() {
        let dev = Device::Cpu;
        let (n, s, h, vocab) = (3, 200, 4, 1500);
        let t = Tensor::randn(0f32, 1.0, (n, s, h), &dev).unwrap();
        let table = Tensor::randn(0f32, 1.0, (vocab, h), &dev).unwrap();
        let bias = Tensor::zeros(vocab, DType::F32, &dev).unwrap();
        let mask = Tensor::ones((n, s), DType::F32, &dev).unwrap();
        let want = composed(&t, &table, &bias, &mask, false);
        let got = max_pool(&t, &table, &bias, &mask, false).unwrap();
        let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
    }
}
