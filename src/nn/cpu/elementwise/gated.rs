//! Two element-wise nodes of ModernBERT-style layers, each one pass forward and one pass
//! backward where the composed forms record half a dozen ops (narrows, a negation, a
//! concatenation, products and sums, each with a zero-filled accumulator in the backward):
//!
//! - the gated linear unit `act(a) * g` over the two halves `[a, g]` of the up projection
//!   (GeGLU with GELU), which keeps its input only;
//! - rotary position embeddings `x cos + rotate_half(x) sin` on queries or keys, which
//!   keeps nothing (the tables are constants).
//!
//! ```text
//! glu:    y = act(a) g               da = dy g act'(a),   dg = dy act(a)
//! rotary: y = x c + R(x) s           dx = dy c + R^T(dy s)
//!         R([u, v]) = [-v, u]        R^T([u, v]) = [v, -u]
//! ```

use candle_core::{DType, Tensor};

use crate::nn::cpu::blocks::wide_fn;
use crate::nn::cpu::blocks::{for_blocks, Float, BLOCK_ROWS};
use crate::nn::cpu::elementwise::math::Act;
use crate::nn::cpu::layers::packing::View;
use crate::nn::node::node_n_owned;

/// `act(a) * g` where `x = [a, g]` over its last dimension (`2 w` wide): `[.., w]`. One
/// node over `x` (CPU, f32 or f64) keeping `x`; the plain forward when `x` is not tracked.
pub fn glu(x: &Tensor, act: Act) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let Some(&last) = dims.last() else {
        candle_core::bail!("glu: a scalar input");
    };
    if last % 2 != 0 {
        candle_core::bail!("glu: the last dimension ({last}) must split into two halves");
    }
    let mut out_dims = dims;
    *out_dims.last_mut().unwrap_or(&mut 0) = last / 2;
    match x.dtype() {
        DType::F32 => glu_node::<f32>(x, act, out_dims),
        DType::F64 => glu_node::<f64>(x, act, out_dims),
        other => candle_core::bail!("glu: run in f32 or f64, not {other:?}"),
    }
}

fn glu_node<T: Float>(x: &Tensor, act: Act, out_dims: Vec<usize>) -> candle_core::Result<Tensor> {
    let w = *out_dims.last().unwrap_or(&0);
    let detached = x.detach().contiguous()?;
    let y = {
        let view = View::new(&detached)?;
        glu_rows(view.values::<T>()?, act, w)
    };
    node_n_owned(
        "gradcache-glu",
        &[x],
        y,
        out_dims.as_slice().into(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let dview = View::new(&dy)?;
            let dys = dview.values::<T>()?;
            let view = View::new(&detached)?;
            let dx = glu_rows_backward(view.values::<T>()?, dys, act, w);
            Ok(vec![Some(Tensor::from_vec(
                dx,
                detached.shape(),
                &candle_core::Device::Cpu,
            )?)])
        }),
    )
}

/// Runs `$body` with `$a` bound to the activation `$act` as a constant, so that the element
/// loop inside is compiled once per activation and vectorises (a `match` per element
/// would stop it).
macro_rules! with_act {
    ($act:expr, $a:ident => $body:expr) => {
        match $act {
            Act::GeluErf => {
                let $a = Act::GeluErf;
                $body
            }
            Act::GeluTanh => {
                let $a = Act::GeluTanh;
                $body
            }
            Act::Relu => {
                let $a = Act::Relu;
                $body
            }
            Act::Silu => {
                let $a = Act::Silu;
                $body
            }
        }
    };
}

/// `act(a) g` of the rows `[a, g]` of `x` (`[rows, 2w]` into `[rows, w]`).
pub(in crate::nn) fn glu_rows<T: Float>(x: &[T], act: Act, w: usize) -> Vec<T> {
    glu_rows_ordered(x, act, w, false)
}

wide_fn! {
/// [`glu_rows`] with the halves in either order: `gate_second`, the rows are `[g, a]`
/// (GTE's `up_gate_proj` puts the input first).
pub(in crate::nn) fn glu_rows_ordered<T: Float>(x: &[T], act: Act, w: usize, gate_second: bool) -> Vec<T> {
    let mut y = vec![T::zero(); x.len() / 2];
    for_blocks(&mut y, w, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, out) in chunk.chunks_exact_mut(w).enumerate() {
            let row = &x[(first + r) * 2 * w..(first + r + 1) * 2 * w];
            let (left, right) = row.split_at(w);
            let (a, g) = if gate_second { (right, left) } else { (left, right) };
            with_act!(act, f => {
                for ((o, &a), &g) in out.iter_mut().zip(a).zip(g) {
                    *o = f.value(a) * g;
                }
            });
        }
    });
    y
}
}

/// The gradient `[rows, 2w]` of the rows of `x` from that of [`glu_rows`]'s output `dy`.
pub(in crate::nn) fn glu_rows_backward<T: Float>(x: &[T], dy: &[T], act: Act, w: usize) -> Vec<T> {
    glu_rows_backward_ordered(x, dy, act, w, false)
}

wide_fn! {
/// [`glu_rows_backward`] with the halves in either order (see [`glu_rows_ordered`]).
pub(in crate::nn) fn glu_rows_backward_ordered<T: Float>(
    x: &[T],
    dy: &[T],
    act: Act,
    w: usize,
    gate_second: bool,
) -> Vec<T> {
    let mut dx = vec![T::zero(); x.len()];
    for_blocks(&mut dx, 2 * w, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, d) in chunk.chunks_exact_mut(2 * w).enumerate() {
            let row = first + r;
            let (left, right) = x[row * 2 * w..(row + 1) * 2 * w].split_at(w);
            let gy = &dy[row * w..(row + 1) * w];
            let (dleft, dright) = d.split_at_mut(w);
            let (a, g, da, dg) = if gate_second {
                (right, left, dright, dleft)
            } else {
                (left, right, dleft, dright)
            };
            with_act!(act, f => {
                for i in 0..w {
                    let (value, slope) = f.value_and_derivative(a[i]);
                    da[i] = gy[i] * g[i] * slope;
                    dg[i] = gy[i] * value;
                }
            });
        }
    });
    dx
}
}

/// One head's `d` values rotated in place with its place's tables `c`, `sn` (`transpose`:
/// `R^T`, the backward).
#[inline(always)]
pub(in crate::nn) fn rotate_head<T: Float>(x: &mut [T], c: &[T], sn: &[T], transpose: bool) {
    let half = x.len() / 2;
    for i in 0..half {
        let (u, v) = (x[i], x[i + half]);
        if transpose {
            // R^T([u s1, v s2]) = [v s2, -u s1].
            x[i] = u * c[i] + v * sn[i + half];
            x[i + half] = v * c[i + half] - u * sn[i];
        } else {
            // R([u, v]) = [-v, u].
            x[i] = u * c[i] - v * sn[i];
            x[i + half] = v * c[i + half] + u * sn[i + half];
        }
    }
}

/// Rotary position embedding of `x` `[.., s, d]` with tables `cos`, `sin` `[s, d]` (each
/// half of a row repeats the frequencies): `x cos + rotate_half(x) sin`. One node over `x`
/// (CPU, f32 or f64) keeping nothing; the plain forward when `x` is not tracked.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 2 {
        candle_core::bail!("rotary: input {dims:?} has no [s, d] rows");
    }
    let (s, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    if cos.dims() != [s, d] || sin.dims() != [s, d] || d % 2 != 0 {
        candle_core::bail!(
            "rotary: input {dims:?} and tables {:?}, {:?} do not fit (even d, tables [s, d])",
            cos.dims(),
            sin.dims()
        );
    }
    match x.dtype() {
        DType::F32 => rotary_node::<f32>(x, cos, sin, (s, d)),
        DType::F64 => rotary_node::<f64>(x, cos, sin, (s, d)),
        other => candle_core::bail!("rotary: run in f32 or f64, not {other:?}"),
    }
}

wide_fn! {
/// `out = x c + R(x) s` row by row (`transpose`: `out = x c + R^T(x s)`, the backward).
fn rotate<T: Float>(
    xs: &[T],
    c: &[T],
    sn: &[T],
    (s, d): (usize, usize),
    transpose: bool,
) -> Vec<T> {
    let mut out = xs.to_vec();
    for_blocks(&mut out, d, |blk, chunk| {
        let first = blk * BLOCK_ROWS;
        for (r, o) in chunk.chunks_exact_mut(d).enumerate() {
            let t = (first + r) % s;
            let (c, sn) = (&c[t * d..(t + 1) * d], &sn[t * d..(t + 1) * d]);
            rotate_head(o, c, sn, transpose);
        }
    });
    out
}
}

fn rotary_node<T: Float>(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (s, d): (usize, usize),
) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let c: Vec<T> = cos.to_dtype(dtype)?.flatten_all()?.to_vec1()?;
    let sn: Vec<T> = sin.to_dtype(dtype)?.flatten_all()?.to_vec1()?;
    let detached = x.detach().contiguous()?;
    let y = {
        let view = View::new(&detached)?;
        rotate(view.values::<T>()?, &c, &sn, (s, d), false)
    };
    let shape = detached.shape().clone();
    drop(detached);
    node_n_owned(
        "gradcache-rotary",
        &[x],
        y,
        shape.clone(),
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let view = View::new(&dy)?;
            let dx = rotate(view.values::<T>()?, &c, &sn, (s, d), true);
            Ok(vec![Some(Tensor::from_vec(
                dx,
                shape.clone(),
                &candle_core::Device::Cpu,
            )?)])
        }),
    )
}
