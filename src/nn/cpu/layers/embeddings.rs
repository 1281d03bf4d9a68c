//! BERT's embeddings, `dropout(LayerNorm(words[ids] + types[type_ids] + positions[0..s]))`,
//! as one node with its backward written out.
//!
//! The forward gathers and sums the three rows of every token in one pass and normalises
//! it in the same pass. The backward gives each table only the rows its tokens touched:
//! into the open gradient sink (`crate::sink`) those rows alone are added, where
//! candle's `index_select` backward builds a zero table-sized gradient, copies it, adds
//! the rows, and candle's accumulator zero-fills and adds it once more (for MiniLM's
//! 30,522 x 384 words, 47 MB per pass and chunk). It keeps the sum under the LayerNorm, or
//! with `recompute` (the `embeddings.LayerNorm` site of selective recompute) nothing but
//! the ids: the gather is recomputed, with the same arithmetic, bit for bit.

use candle_core::{DType, Tensor};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{for_blocks, Float, BLOCK_ROWS};
use crate::nn::cpu::elementwise::rows::{dropped, norm_backward, norm_row};
use crate::nn::cpu::layers::packing::View;
use crate::nn::node::node_n_owned;

/// The embeddings of `ids` and `type_ids` `[n, s]` from the tables `[words, types,
/// positions]` (`[rows, h]` each), normalised with `[gamma, beta]`, with dropout `(seed,
/// p)` on the result (masks of each element's place in `[n, s, h]`). One node over the
/// five parameters; the plain forward when none is tracked.
pub fn embeddings(
    ids: [&Tensor; 2],
    tables: [&Tensor; 3],
    norm: [&Tensor; 2],
    eps: f64,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> candle_core::Result<Tensor> {
    embeddings_from(ids, tables, 0, norm, eps, dropout, recompute)
}

/// [`embeddings`] with the positions of a sequence starting at `first` (the RoBERTa
/// family counts them from past the padding index): token `t` reads position row
/// `first + t`.
pub fn embeddings_from(
    [ids, type_ids]: [&Tensor; 2],
    [words, types, positions]: [&Tensor; 3],
    first: usize,
    [gamma, beta]: [&Tensor; 2],
    eps: f64,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> candle_core::Result<Tensor> {
    let (n, s) = ids.dims2()?;
    let h = words.dim(1)?;
    if type_ids.dims2()? != (n, s)
        || types.dim(1)? != h
        || positions.dim(1)? != h
        || gamma.dims1()? != h
        || beta.dims1()? != h
    {
        candle_core::bail!(
            "embeddings: ids {:?} and {:?}, tables {:?}, {:?}, {:?} and LayerNorm {:?} do not fit",
            ids.dims(),
            type_ids.dims(),
            words.dims(),
            types.dims(),
            positions.dims(),
            gamma.dims()
        );
    }
    if first + s > positions.dim(0)? {
        candle_core::bail!(
            "embeddings: {s} tokens from position {first}, {} position embeddings",
            positions.dim(0)?
        );
    }
    let ids: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let type_ids: Vec<u32> = type_ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    for (what, table, list) in [("word", words, &ids), ("token type", types, &type_ids)] {
        let rows = table.dim(0)?;
        if let Some(&bad) = list.iter().find(|&&i| i as usize >= rows) {
            candle_core::bail!("embeddings: {what} id {bad} is outside the table of {rows} rows");
        }
    }
    match words.dtype() {
        DType::F32 => node::<f32>(
            Inputs {
                ids,
                type_ids,
                first,
                n,
                s,
                h,
            },
            [words, types, positions, gamma, beta],
            eps,
            dropout,
            recompute,
        ),
        DType::F64 => node::<f64>(
            Inputs {
                ids,
                type_ids,
                first,
                n,
                s,
                h,
            },
            [words, types, positions, gamma, beta],
            eps,
            dropout,
            recompute,
        ),
        other => candle_core::bail!("embeddings: run in f32 or f64, not {other:?}"),
    }
}

/// The token ids of a chunk and its shape.
struct Inputs {
    ids: Vec<u32>,
    type_ids: Vec<u32>,
    /// The position of each sequence's first token.
    first: usize,
    n: usize,
    s: usize,
    h: usize,
}

impl Inputs {
    /// `words[ids] + types[type_ids] + positions[first + t]`, row by row (`[n s, h]`).
    fn sum<T: Float>(&self, words: &[T], types: &[T], positions: &[T]) -> Vec<T> {
        let h = self.h;
        let mut sum = vec![T::zero(); self.n * self.s * h];
        for_blocks(&mut sum, h, |blk, chunk| {
            let first = blk * BLOCK_ROWS;
            for (r, row) in chunk.chunks_exact_mut(h).enumerate() {
                let token = first + r;
                let w = self.ids[token] as usize * h;
                let k = self.type_ids[token] as usize * h;
                let p = (self.first + token % self.s) * h;
                for (j, o) in row.iter_mut().enumerate() {
                    *o = (words[w + j] + types[k + j]) + positions[p + j];
                }
            }
        });
        sum
    }
}

wide_fn! {
fn node<T: Float>(
    inputs: Inputs,
    tables: [&Tensor; 5],
    eps: f64,
    dropout: Option<(u64, f32)>,
    recompute: bool,
) -> candle_core::Result<Tensor> {
    let (n, s, h) = (inputs.n, inputs.s, inputs.h);
    // Detached views of the tables (no copy), read in place.
    let detached = tables
        .iter()
        .map(|t| t.detach().contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let sum = sum_of::<T>(&inputs, &detached)?;
    let mut y = vec![T::zero(); sum.len()];
    {
        let (g, b) = (View::new(&detached[3])?, View::new(&detached[4])?);
        let (gv, bv) = (g.values::<T>()?, b.values::<T>()?);
        for_blocks(&mut y, h, |blk, chunk| {
            let base = blk * BLOCK_ROWS * h;
            for (srow, yrow) in sum[base..base + chunk.len()]
                .chunks_exact(h)
                .zip(chunk.chunks_exact_mut(h))
            {
                norm_row(srow, gv, bv, eps, yrow);
            }
        });
    }
    let y = match dropped(&y, dropout, h, None) {
        std::borrow::Cow::Owned(d) => d,
        std::borrow::Cow::Borrowed(_) => y,
    };
    if !tables.iter().any(|t| t.track_op()) {
        return Tensor::from_vec(y, (n, s, h), &candle_core::Device::Cpu);
    }
    let kept = (!recompute).then_some(sum);
    let params: Vec<Tensor> = tables.iter().map(|t| (*t).clone()).collect();
    node_n_owned(
        "gradcache-embeddings",
        &tables,
        y,
        (n, s, h).into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let dyv = View::new(&dy)?;
            let sum = match &kept {
                Some(sum) => std::borrow::Cow::Borrowed(sum.as_slice()),
                None => std::borrow::Cow::Owned(sum_of::<T>(&inputs, &detached)?),
            };
            let dnormed = dropped(dyv.values::<T>()?, dropout, h, None);
            let g = View::new(&detached[3])?;
            let (dsum, dgamma, dbeta) = norm_backward(&sum, g.values::<T>()?, &dnormed, eps);
            drop((sum, dnormed));
            let first = inputs.first;
            let positions: Vec<u32> = (0..n * s).map(|r| (first + r % s) as u32).collect();
            Ok(vec![
                crate::sink::deposit_rows(&params[0], &inputs.ids, &dsum)?,
                crate::sink::deposit_rows(&params[1], &inputs.type_ids, &dsum)?,
                crate::sink::deposit_rows(&params[2], &positions, &dsum)?,
                crate::sink::deposit(&params[3], dgamma)?,
                crate::sink::deposit(&params[4], dbeta)?,
            ])
        }),
    )
}
}

/// The sum under the LayerNorm, from the detached tables (read in place).
fn sum_of<T: Float>(inputs: &Inputs, tables: &[Tensor]) -> candle_core::Result<Vec<T>> {
    let (w, t, p) = (
        View::new(&tables[0])?,
        View::new(&tables[1])?,
        View::new(&tables[2])?,
    );
    Ok(inputs.sum(w.values()?, t.values()?, p.values()?))
}

/// BERT's embeddings as one node that keeps nothing but the ids
/// ([`embeddings`] with `recompute`).
pub fn embeddings_recomputed(
    ids: [&Tensor; 2],
    tables: [&Tensor; 3],
    norm: [&Tensor; 2],
    eps: f64,
    dropout: Option<(u64, f32)>,
) -> candle_core::Result<Tensor> {
    embeddings(ids, tables, norm, eps, dropout, true)
}

/// A decoder's token embeddings, `table[ids] * scale` (`scale`: Gemma's `sqrt(hidden)`;
/// `None`: 1), `[n, s]` ids into `[n, s, h]`: one node over the table whose backward adds
/// only the rows the tokens touched (into the open gradient sink), where candle's
/// `index_select` backward builds a zero table-sized gradient per chunk (Qwen3's 151,669 x
/// 1,024 table: 621 MB). Row `padding_idx` gets no gradient, as PyTorch's
/// `nn.Embedding(padding_idx=...)` (a decoder's pad token is often its EOS, a real token
/// of every text). Keeps the ids alone.
pub fn token_embeddings(
    ids: &Tensor,
    table: &Tensor,
    scale: Option<f64>,
    padding_idx: Option<u32>,
) -> candle_core::Result<Tensor> {
    let (n, s) = ids.dims2()?;
    let (rows, h) = table.dims2()?;
    let ids: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("embeddings: token id {bad} is outside the table of {rows} rows");
    }
    match table.dtype() {
        DType::F32 => token_node::<f32>(ids, table, (scale, padding_idx), (n, s, h)),
        DType::F64 => token_node::<f64>(ids, table, (scale, padding_idx), (n, s, h)),
        other => candle_core::bail!("embeddings: run in f32 or f64, not {other:?}"),
    }
}

wide_fn! {
fn token_node<T: Float>(
    ids: Vec<u32>,
    table: &Tensor,
    (scale, padding_idx): (Option<f64>, Option<u32>),
    (n, s, h): (usize, usize, usize),
) -> candle_core::Result<Tensor> {
    let detached = table.detach().contiguous()?;
    let mut y = vec![T::zero(); n * s * h];
    {
        let view = View::new(&detached)?;
        let values = view.values::<T>()?;
        let c = scale.map(T::of);
        for_blocks(&mut y, h, |blk, chunk| {
            let first = blk * BLOCK_ROWS;
            for (r, row) in chunk.chunks_exact_mut(h).enumerate() {
                let at = ids[first + r] as usize * h;
                let src = &values[at..at + h];
                match c {
                    Some(c) => {
                        for (o, &v) in row.iter_mut().zip(src) {
                            *o = v * c;
                        }
                    }
                    None => row.copy_from_slice(src),
                }
            }
        });
    }
    if !table.track_op() {
        return Tensor::from_vec(y, (n, s, h), &candle_core::Device::Cpu);
    }
    let param = table.clone();
    node_n_owned(
        "gradcache-token-embeddings",
        &[table],
        y,
        (n, s, h).into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let view = View::new(&dy)?;
            let dy = view.values::<T>()?;
            // The rows that get a gradient: every token but the padding index.
            let (ids, dy): (Vec<u32>, std::borrow::Cow<[T]>) = match padding_idx {
                Some(pad) if ids.contains(&pad) => {
                    let mut kept_ids = Vec::with_capacity(ids.len());
                    let mut kept = Vec::with_capacity(dy.len());
                    for (&id, row) in ids.iter().zip(dy.chunks_exact(h)) {
                        if id != pad {
                            kept_ids.push(id);
                            kept.extend_from_slice(row);
                        }
                    }
                    (kept_ids, std::borrow::Cow::Owned(kept))
                }
                _ => (ids.clone(), std::borrow::Cow::Borrowed(dy)),
            };
            let grad = match scale {
                Some(c) => std::borrow::Cow::Owned(dy.iter().map(|&v| v * T::of(c)).collect()),
                None => dy,
            };
            Ok(vec![crate::sink::deposit_rows(&param, &ids, &grad)?])
        }),
    )
}
}
