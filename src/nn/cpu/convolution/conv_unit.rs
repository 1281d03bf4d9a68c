//! VNet's convolution unit as one memory-efficient node: a 3-D convolution, BatchNorm in
//! training, PReLU, and optionally a residual sum and a second PReLU,
//! `y = prelu_out(prelu_in?(bn(conv(h))) + skip?)`, that keeps nothing but its inputs.
//! Its backward recomputes the convolution over pieces of rows, twice (once for the
//! normalisation's per-channel sums, once for the gradients), so the backward of a unit
//! holds one piece of its activations at a time, never the whole chunk's: the lever that
//! takes a volume tower below the memory of its first, full-resolution stage, which
//! segment checkpointing alone cannot (every segment recomputes it whole).

use candle_core::Tensor;

use crate::nn::cpu::convolution::conv2d::{channel_stats, ChannelStats};
use crate::nn::cpu::convolution::conv3d::{read, Geometry, VOL2COL_BYTES};
use crate::nn::node::node_n;

/// Where a unit's residual comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// No residual sum.
    None,
    /// The unit's own input, its channels repeated to the output's (VNet's input
    /// transition: the volume's channels tiled over the first stage's width).
    Repeat,
    /// A tensor of the output's shape (the input of the stage).
    Tensor,
}

/// What a unit computes around its convolution.
#[derive(Debug, Clone, Copy)]
struct Unit {
    g: Geometry,
    eps: f64,
    /// A PReLU before the residual sum.
    prelu_in: bool,
    skip: Skip,
}

/// Per-channel values of the forward: batch mean and 1 / std.
struct Stats {
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

/// The unit's inputs, read as slices.
struct Values<'a> {
    h: &'a [f32],
    skip: Option<&'a [f32]>,
    w: &'a [f32],
    gamma: &'a [f32],
    beta: &'a [f32],
    a_in: Option<&'a [f32]>,
    a_out: &'a [f32],
}

#[inline(always)]
fn prelu(v: f32, a: f32) -> f32 {
    if v > 0.0 {
        v
    } else {
        a * v
    }
}

impl Unit {
    /// Output voxels of one channel of one row.
    fn voxels(&self) -> usize {
        self.g.out.iter().product()
    }

    /// Rows per piece of the backward: a piece's convolution output fits [`VOL2COL_BYTES`].
    fn rows_per_piece(&self) -> usize {
        let per_row = self.g.c_out * self.voxels() * 4;
        (VOL2COL_BYTES / per_row.max(1)).clamp(1, self.g.n.max(1))
    }

    /// The geometry of `rows` rows.
    fn rows(&self, rows: usize) -> Geometry {
        Geometry { n: rows, ..self.g }
    }

    /// The residual of output value `o` of a piece starting at row `row0` (`o` counted
    /// within the piece).
    #[inline(always)]
    fn skip_value(&self, v: &Values, row0: usize, o: usize) -> f32 {
        let (c_out, vox) = (self.g.c_out, self.voxels());
        match self.skip {
            Skip::None => 0.0,
            Skip::Tensor => v.skip.map_or(0.0, |s| s[row0 * c_out * vox + o]),
            Skip::Repeat => {
                let (row, c, i) = (o / (c_out * vox), o / vox % c_out, o % vox);
                v.h[((row0 + row) * self.g.c_in + c % self.g.c_in) * vox + i]
            }
        }
    }

    /// The unit's pre-activation pieces for output value `o` of channel `c`: the normalised
    /// `xhat`, the BN output `s1`, the residual sum `u`.
    #[inline(always)]
    fn values(&self, v: &Values, st: &Stats, z: f32, c: usize, skip: f32) -> (f32, f32, f32) {
        let xhat = (z - st.mean[c]) * st.rstd[c];
        let s1 = xhat * v.gamma[c] + v.beta[c];
        let t = match v.a_in {
            Some(a) if self.prelu_in => prelu(s1, a[c]),
            _ => s1,
        };
        (xhat, s1, t + skip)
    }

    /// The forward over every row: the output and the batch statistics (mean, biased
    /// variance; [`channel_stats`]).
    fn forward(&self, v: &Values) -> (Vec<f32>, Vec<f32>, Stats) {
        let z = self.g.forward(v.h, v.w);
        let (c_out, vox, n) = (self.g.c_out, self.voxels(), self.g.n);
        // BatchNorm's node takes the same statistics the same way.
        let ChannelStats { mean, var, rstd } = channel_stats(&z, n, c_out, self.eps);
        let st = Stats { mean, rstd };
        let mut y = z;
        for (o, out) in y.iter_mut().enumerate() {
            let c = o / vox % c_out;
            let (_, _, u) = self.values(v, &st, *out, c, self.skip_value(v, 0, o));
            *out = prelu(u, v.a_out[c]);
        }
        (y, var, st)
    }

    /// The gradients of every input from the output gradient `dy`, recomputing the
    /// convolution a piece of rows at a time: pass 1 sums, per channel, the gradient
    /// reaching the BN output and its product with `xhat`; pass 2 turns them into the
    /// convolution's output gradient and runs the convolution's backward on the piece.
    fn backward(&self, v: &Values, st: &Stats, dy: &[f32], want_dh: bool) -> Grads {
        let (c_out, vox, n) = (self.g.c_out, self.voxels(), self.g.n);
        let per_row_out = c_out * vox;
        let step = self.rows_per_piece();
        let m = (n * vox) as f64;
        let mut sum_ds = vec![0f64; c_out];
        let mut sum_ds_xhat = vec![0f64; c_out];
        let mut d_in = vec![0f64; c_out];
        let mut d_out = vec![0f64; c_out];
        // The gradients reaching `u` (the residual sum) and `s1` (the BN output).
        let chain = |z: f32, c: usize, g: f32, skip: f32| {
            let (xhat, s1, u) = self.values(v, st, z, c, skip);
            let du = if u > 0.0 { g } else { g * v.a_out[c] };
            let ds1 = match v.a_in {
                Some(a) if self.prelu_in && s1 <= 0.0 => du * a[c],
                _ => du,
            };
            (xhat, s1, u, du, ds1)
        };
        let h_row = self.g.c_in * self.g.size.iter().product::<usize>();
        // With one piece for every row, pass 1's convolution serves pass 2 as well.
        let mut whole: Option<Vec<f32>> = None;
        for row0 in (0..n).step_by(step) {
            let rows = step.min(n - row0);
            let g = self.rows(rows);
            let z = g.forward(&v.h[row0 * h_row..][..rows * h_row], v.w);
            let dyp = &dy[row0 * per_row_out..][..rows * per_row_out];
            for (o, (&zo, &go)) in z.iter().zip(dyp).enumerate() {
                let c = o / vox % c_out;
                let (xhat, s1, u, du, ds1) = chain(zo, c, go, self.skip_value(v, row0, o));
                if u <= 0.0 {
                    d_out[c] += f64::from(go) * f64::from(u);
                }
                if self.prelu_in && s1 <= 0.0 {
                    d_in[c] += f64::from(du) * f64::from(s1);
                }
                sum_ds[c] += f64::from(ds1);
                sum_ds_xhat[c] += f64::from(ds1) * f64::from(xhat);
            }
            if rows == n {
                whole = Some(z);
            }
        }
        let mut dw = vec![0f32; v.w.len()];
        let mut dh = want_dh.then(|| vec![0f32; v.h.len()]);
        let mut dskip = (self.skip == Skip::Tensor).then(|| vec![0f32; dy.len()]);
        for row0 in (0..n).step_by(step) {
            let rows = step.min(n - row0);
            let g = self.rows(rows);
            let hp = &v.h[row0 * h_row..][..rows * h_row];
            let mut z = match whole.take() {
                Some(z) => z,
                None => g.forward(hp, v.w),
            };
            let dyp = &dy[row0 * per_row_out..][..rows * per_row_out];
            // The tiled input's share of its gradient: output channel `c` read input
            // channel `c % c_in` (input-sized, summed here in output order).
            let mut tiled = (want_dh && self.skip == Skip::Repeat).then(|| vec![0f32; hp.len()]);
            for (o, (zo, &go)) in z.iter_mut().zip(dyp).enumerate() {
                let c = o / vox % c_out;
                let (xhat, _, _, du, ds1) = chain(*zo, c, go, self.skip_value(v, row0, o));
                match self.skip {
                    Skip::Tensor => {
                        if let Some(d) = dskip.as_mut() {
                            d[row0 * per_row_out + o] = du;
                        }
                    }
                    Skip::Repeat => {
                        if let Some(t) = tiled.as_mut() {
                            let (row, ch, i) = (o / per_row_out, c % self.g.c_in, o % vox);
                            t[(row * self.g.c_in + ch) * vox + i] += du;
                        }
                    }
                    Skip::None => {}
                }
                let k = v.gamma[c] * st.rstd[c];
                let (mean_ds, mean_ds_xhat) = ((sum_ds[c] / m) as f32, (sum_ds_xhat[c] / m) as f32);
                // The convolution's output gradient, in place of its output.
                *zo = k * (ds1 - mean_ds - xhat * mean_ds_xhat);
            }
            let (dhp, dwp) = g.backward(hp, v.w, &z, want_dh);
            for (a, b) in dw.iter_mut().zip(&dwp) {
                *a += b;
            }
            if let (Some(dh), Some(dhp)) = (dh.as_mut(), dhp) {
                let dst = &mut dh[row0 * h_row..][..rows * h_row];
                dst.copy_from_slice(&dhp);
                if let Some(t) = &tiled {
                    for (d, t) in dst.iter_mut().zip(t) {
                        *d += t;
                    }
                }
            }
        }
        let to32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        Grads {
            dh,
            dskip,
            dw,
            dgamma: to32(sum_ds_xhat),
            dbeta: to32(sum_ds),
            da_in: to32(d_in),
            da_out: to32(d_out),
        }
    }
}

struct Grads {
    dh: Option<Vec<f32>>,
    dskip: Option<Vec<f32>>,
    dw: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    da_in: Vec<f32>,
    da_out: Vec<f32>,
}

/// The parameters of a unit: the kernel `[c_out, c_in, k, k, k]`, BatchNorm's scale and
/// shift and `eps`, the PReLU slopes `[c_out]` before the residual sum (if any) and after.
pub struct UnitParams<'a> {
    /// The convolution's kernel.
    pub weight: &'a Tensor,
    /// Its padding.
    pub padding: usize,
    /// Its stride.
    pub stride: usize,
    /// BatchNorm's scale.
    pub gamma: &'a Tensor,
    /// BatchNorm's shift.
    pub beta: &'a Tensor,
    /// BatchNorm's `eps`.
    pub eps: f64,
    /// A PReLU's slopes between the BatchNorm and the residual sum.
    pub prelu_in: Option<&'a Tensor>,
    /// The last PReLU's slopes.
    pub prelu_out: &'a Tensor,
}

/// `prelu_out(prelu_in?(batch_norm(conv3d(h))) + skip)` in training (batch statistics),
/// f32 on the CPU, as one node that keeps only its inputs: `skip` is `None` with
/// [`Skip::None`] and [`Skip::Repeat`] (the input's channels tiled), the stage input with
/// [`Skip::Tensor`]. Returns the output and the batch's mean and biased variance `[c_out]`
/// (for the running statistics).
pub fn conv_unit(
    h: &Tensor,
    skip_kind: Skip,
    skip: Option<&Tensor>,
    p: &UnitParams,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let g = Geometry::new(h.dims(), p.weight.dims(), p.padding, p.stride)?;
    let unit = Unit {
        g,
        eps: p.eps,
        prelu_in: p.prelu_in.is_some(),
        skip: skip_kind,
    };
    let out_dims = [g.n, g.c_out, g.out[0], g.out[1], g.out[2]];
    if skip_kind == Skip::Repeat && (g.c_out % g.c_in != 0 || g.out != g.size) {
        candle_core::bail!(
            "conv_unit: a repeated input needs the output's size and a channel count dividing it"
        );
    }
    let skip_tensor = skip;
    let skip = match (skip_kind, skip) {
        (Skip::Tensor, Some(s)) if s.dims() == out_dims => Some(s.detach().contiguous()?),
        (Skip::Tensor, _) => candle_core::bail!("conv_unit: the residual must be {out_dims:?}"),
        _ => None,
    };
    let det = |t: &Tensor| t.detach().contiguous();
    let inputs = Inputs {
        h: det(h)?,
        w: det(p.weight)?,
        gamma: det(p.gamma)?,
        beta: det(p.beta)?,
        a_out: det(p.prelu_out)?,
        a_in: p.prelu_in.map(det).transpose()?,
        skip,
        empty: Tensor::zeros(0, candle_core::DType::F32, h.device())?,
    };
    let (y, var, st) = inputs.with(|v| unit.forward(v))?;
    let device = h.device().clone();
    let mean = Tensor::from_vec(st.mean.clone(), g.c_out, &device)?;
    let var = Tensor::from_vec(var, g.c_out, &device)?;
    let y = Tensor::from_vec(y, out_dims.to_vec(), &device)?;
    let mut tracked = vec![h, p.weight, p.gamma, p.beta, p.prelu_out];
    tracked.extend(p.prelu_in);
    if let (Skip::Tensor, Some(s)) = (skip_kind, skip_tensor) {
        tracked.push(s);
    }
    let want_dh = h.track_op();
    let backward = move |dy: &Tensor| -> candle_core::Result<Vec<Option<Tensor>>> {
        let dy = dy.contiguous()?;
        let gr = read(&dy, |dyv| {
            inputs.with(|v| unit.backward(v, &st, dyv, want_dh))
        })??;
        let t = |v: Vec<f32>, dims: &[usize]| Tensor::from_vec(v, dims, dy.device());
        let c = unit.g.c_out;
        let mut out = vec![
            gr.dh.map(|v| t(v, inputs.h.dims())).transpose()?,
            Some(t(gr.dw, inputs.w.dims())?),
            Some(t(gr.dgamma, &[c])?),
            Some(t(gr.dbeta, &[c])?),
            Some(t(gr.da_out, &[c])?),
        ];
        if unit.prelu_in {
            out.push(Some(t(gr.da_in, &[c])?));
        }
        if let Some(ds) = gr.dskip {
            out.push(Some(t(ds, &out_dims)?));
        }
        Ok(out)
    };
    let y = node_n("gradcache-vnet-unit", &tracked, y, Box::new(backward))?;
    Ok((y, mean, var))
}

/// A unit's inputs, detached and contiguous, kept by its node for the backward.
struct Inputs {
    h: Tensor,
    w: Tensor,
    gamma: Tensor,
    beta: Tensor,
    a_out: Tensor,
    a_in: Option<Tensor>,
    skip: Option<Tensor>,
    empty: Tensor,
}

impl Inputs {
    /// Runs `f` on the inputs' values, read in place.
    fn with<R>(&self, f: impl FnOnce(&Values) -> R) -> candle_core::Result<R> {
        let or = |t: &Option<Tensor>| t.clone().unwrap_or_else(|| self.empty.clone());
        let (a_in, skip) = (or(&self.a_in), or(&self.skip));
        read(&self.h, |h| {
            read(&self.w, |w| {
                read(&self.gamma, |gamma| {
                    read(&self.beta, |beta| {
                        read(&self.a_out, |a_out| {
                            read(&a_in, |a_in_v| {
                                read(&skip, |skip_v| {
                                    f(&Values {
                                        h,
                                        skip: self.skip.as_ref().map(|_| skip_v),
                                        w,
                                        gamma,
                                        beta,
                                        a_in: self.a_in.as_ref().map(|_| a_in_v),
                                        a_out,
                                    })
                                })
                            })
                        })
                    })
                })
            })
        })??????
    }
}
