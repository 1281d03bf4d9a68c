//! A 3-D convolution with its backward, which candle lacks: the volume unfolded into
//! columns (vol2col) a piece at a time, one matrix product per piece, and the input
//! gradient folded back (col2vol). Every piece's columns fit [`VOL2COL_BYTES`], so the
//! transient memory of a convolution does not grow with the chunk or the volume.
//!
//! A piece is a run of output *planes*: (row, output depth) pairs in order, each
//! `out_h x out_w` positions. Its columns are laid out `[c_in k^3, positions]`, so that the
//! product with the kernel `[c_out, c_in k^3]` gives each output channel's plane as one
//! contiguous run. Sums over pieces (the kernel gradient) run in piece order and the
//! products are the gemm crate's, so results do not depend on scheduling.

use std::ops::Range;

use candle_core::Tensor;

use crate::nn::cpu::blocks::{contiguous, parallel_ranges, SharedMut};
use crate::nn::cpu::products::gemm::product;
use crate::nn::node::node;

/// The most bytes of columns one piece of a 3-D convolution unfolds (8 MiB): a 5x5x5
/// kernel unfolds each input value 125 times, so pieces are kept small; at 8 MiB a piece
/// still spans hundreds of output positions, enough for the matrix products' speed.
pub const VOL2COL_BYTES: usize = 8 << 20;

/// The geometry of a convolution of `x [n, c_in, d, h, w]` with a cubic kernel
/// `[c_out, c_in, k, k, k]` (no bias, dilation or groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) n: usize,
    pub(crate) c_in: usize,
    pub(crate) c_out: usize,
    /// Input depth, height, width.
    pub(crate) size: [usize; 3],
    /// Output depth, height, width.
    pub(crate) out: [usize; 3],
    pub(crate) k: usize,
    pub(crate) stride: usize,
    pub(crate) padding: usize,
}

impl Geometry {
    /// The geometry of `x` convolved with `weight`, or an error naming the mismatch.
    pub(crate) fn new(
        x: &[usize],
        weight: &[usize],
        padding: usize,
        stride: usize,
    ) -> candle_core::Result<Self> {
        let (&[n, c_in, d, h, w], &[c_out, wc, k, k2, k3]) = (x, weight) else {
            candle_core::bail!(
                "conv3d: the input must be [rows, channels, depth, height, width] and the \
                 kernel [out, in, k, k, k], got {x:?} and {weight:?}"
            );
        };
        if wc != c_in || k != k2 || k != k3 || k == 0 || stride == 0 {
            candle_core::bail!(
                "conv3d: a cubic kernel over the input's {c_in} channels and a positive \
                 stride are needed, got kernel {weight:?}, stride {stride}"
            );
        }
        let side = |s: usize| {
            if s + 2 * padding < k {
                None
            } else {
                Some((s + 2 * padding - k) / stride + 1)
            }
        };
        let (Some(od), Some(oh), Some(ow)) = (side(d), side(h), side(w)) else {
            candle_core::bail!(
                "conv3d: a volume of {d}x{h}x{w} is smaller than the kernel {k} (padding \
                 {padding})"
            );
        };
        Ok(Self {
            n,
            c_in,
            c_out,
            size: [d, h, w],
            out: [od, oh, ow],
            k,
            stride,
            padding,
        })
    }

    /// Values of one input row.
    fn row_len(&self) -> usize {
        self.c_in * self.size.iter().product::<usize>()
    }

    /// Positions of one output plane.
    fn plane(&self) -> usize {
        self.out[1] * self.out[2]
    }

    /// Rows of the columns: `c_in k^3`.
    fn taps(&self) -> usize {
        self.c_in * self.k * self.k * self.k
    }

    /// Output planes in all: rows x output depth.
    fn planes(&self) -> usize {
        self.n * self.out[0]
    }

    /// The output planes of each piece, so that a piece's columns fit [`VOL2COL_BYTES`].
    fn pieces(&self) -> Vec<Range<usize>> {
        let per_plane = self.taps() * self.plane() * 4;
        let step = (VOL2COL_BYTES / per_plane.max(1)).max(1);
        let total = self.planes();
        (0..total)
            .step_by(step)
            .map(|s| s..(s + step).min(total))
            .collect()
    }

    /// The input offset of tap `t` (channel, kd, kh, kw) at output position (row, od, oh,
    /// ow), or `None` in the padding.
    #[inline(always)]
    fn source(&self, row: usize, ci: usize, z: isize, y: isize, x: isize) -> Option<usize> {
        let [d, h, w] = self.size;
        if z < 0 || y < 0 || x < 0 || z as usize >= d || y as usize >= h || x as usize >= w {
            return None;
        }
        Some(((row * self.c_in + ci) * d + z as usize) * h * w + y as usize * w + x as usize)
    }

    /// The columns `[c_in k^3, planes.len() x plane]` of the output planes `planes` of `x`.
    fn vol2col(&self, x: &[f32], planes: &Range<usize>) -> Vec<f32> {
        let (k, plane) = (self.k, self.plane());
        let width = planes.len() * plane;
        let mut cols = vec![0f32; self.taps() * width];
        let out = SharedMut(cols.as_mut_ptr());
        parallel_ranges(self.taps(), |taps| {
            for t in taps {
                let (ci, kz, ky, kx) = (t / (k * k * k), t / (k * k) % k, t / k % k, t % k);
                // SAFETY: tap `t` writes its own row of the columns, which outlive the
                // call; no two tasks share a tap.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out.get().add(t * width), width) };
                for (p, pl) in planes.clone().enumerate() {
                    let (row, oz) = (pl / self.out[0], pl % self.out[0]);
                    let z = (oz * self.stride + kz) as isize - self.padding as isize;
                    for oy in 0..self.out[1] {
                        let y = (oy * self.stride + ky) as isize - self.padding as isize;
                        let base = p * plane + oy * self.out[2];
                        for ox in 0..self.out[2] {
                            let xx = (ox * self.stride + kx) as isize - self.padding as isize;
                            if let Some(i) = self.source(row, ci, z, y, xx) {
                                dst[base + ox] = x[i];
                            }
                        }
                    }
                }
            }
        });
        cols
    }

    /// Adds the column gradients `dcols [c_in k^3, planes.len() x plane]` into `dx`, one
    /// input channel per task (every tap of a channel in order: a fixed summation order).
    fn col2vol(&self, dcols: &[f32], planes: &Range<usize>, dx: &mut [f32]) {
        let (k, plane) = (self.k, self.plane());
        let width = planes.len() * plane;
        let k3 = k * k * k;
        let dst = SharedMut(dx.as_mut_ptr());
        let len = dx.len();
        parallel_ranges(self.c_in, |channels| {
            for ci in channels {
                for tap in 0..k3 {
                    let (kz, ky, kx) = (tap / (k * k), tap / k % k, tap % k);
                    let src = &dcols[(ci * k3 + tap) * width..][..width];
                    for (p, pl) in planes.clone().enumerate() {
                        let (row, oz) = (pl / self.out[0], pl % self.out[0]);
                        let z = (oz * self.stride + kz) as isize - self.padding as isize;
                        for oy in 0..self.out[1] {
                            let y = (oy * self.stride + ky) as isize - self.padding as isize;
                            let base = p * plane + oy * self.out[2];
                            for ox in 0..self.out[2] {
                                let xx = (ox * self.stride + kx) as isize - self.padding as isize;
                                if let Some(i) = self.source(row, ci, z, y, xx) {
                                    debug_assert!(i < len);
                                    // SAFETY: offsets of channel `ci` of some row, which
                                    // only this task writes; `dx` outlives the call.
                                    unsafe { *dst.get().add(i) += src[base + ox] };
                                }
                            }
                        }
                    }
                }
            }
        });
    }

    /// The output `[c_out, planes x plane]` of the columns of `planes` into `y` (the whole
    /// output, `[n, c_out, od, oh, ow]`).
    fn scatter_out(&self, product: &[f32], planes: &Range<usize>, y: &mut [f32]) {
        let (plane, od) = (self.plane(), self.out[0]);
        let width = planes.len() * plane;
        for c in 0..self.c_out {
            for (p, pl) in planes.clone().enumerate() {
                let (row, oz) = (pl / od, pl % od);
                let at = ((row * self.c_out + c) * od + oz) * plane;
                y[at..at + plane].copy_from_slice(&product[c * width + p * plane..][..plane]);
            }
        }
    }

    /// The output gradient of `planes` as `[c_out, planes x plane]` (the layout of the
    /// product), read from `dy [n, c_out, od, oh, ow]`.
    fn gather_out(&self, dy: &[f32], planes: &Range<usize>) -> Vec<f32> {
        let (plane, od) = (self.plane(), self.out[0]);
        let width = planes.len() * plane;
        let mut g = vec![0f32; self.c_out * width];
        for c in 0..self.c_out {
            for (p, pl) in planes.clone().enumerate() {
                let (row, oz) = (pl / od, pl % od);
                let at = ((row * self.c_out + c) * od + oz) * plane;
                g[c * width + p * plane..][..plane].copy_from_slice(&dy[at..at + plane]);
            }
        }
        g
    }

    /// The convolution of `x` (all rows) with the kernel `w [c_out, c_in k^3]`.
    pub(crate) fn forward(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; self.n * self.c_out * self.out.iter().product::<usize>()];
        for planes in self.pieces() {
            let cols = self.vol2col(x, &planes);
            let width = planes.len() * self.plane();
            let mut out = vec![0f32; self.c_out * width];
            let taps = self.taps();
            product(
                (self.c_out, width, taps),
                (&mut out, width),
                false,
                (w, taps, 1),
                (&cols, width, 1),
            );
            self.scatter_out(&out, &planes, &mut y);
        }
        y
    }

    /// The gradients of the input (when `want_dx`) and of the kernel, from the output
    /// gradient `dy`: per piece, `dw += dy_p cols_p^T` and `dcols = w^T dy_p` folded back.
    pub(crate) fn backward(
        &self,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        want_dx: bool,
    ) -> (Option<Vec<f32>>, Vec<f32>) {
        let taps = self.taps();
        let mut dw = vec![0f32; self.c_out * taps];
        let mut dx = want_dx.then(|| vec![0f32; self.n * self.row_len()]);
        for (i, planes) in self.pieces().into_iter().enumerate() {
            let cols = self.vol2col(x, &planes);
            let g = self.gather_out(dy, &planes);
            let width = planes.len() * self.plane();
            // dw [c_out, taps] (+)= g [c_out, width] cols^T [width, taps]
            product(
                (self.c_out, taps, width),
                (&mut dw, taps),
                i > 0,
                (&g, width, 1),
                (&cols, 1, width),
            );
            drop(cols);
            if let Some(dx) = dx.as_mut() {
                // dcols [taps, width] = w^T [taps, c_out] g [c_out, width]
                let mut dcols = vec![0f32; taps * width];
                product(
                    (taps, width, self.c_out),
                    (&mut dcols, width),
                    false,
                    (w, 1, taps),
                    (&g, width, 1),
                );
                self.col2vol(&dcols, &planes, dx);
            }
        }
        (dx, dw)
    }
}

/// A 3-D convolution `x [n, c_in, d, h, w]` * `weight [c_out, c_in, k, k, k]` (cubic
/// kernel, no bias, dilation or groups; f32 on the CPU) as one node with its backward:
/// the input gradient (when the input needs one) and the kernel gradient, both over the
/// same pieces as the forward.
pub fn conv3d(
    x: &Tensor,
    weight: &Tensor,
    padding: usize,
    stride: usize,
) -> candle_core::Result<Tensor> {
    let g = Geometry::new(x.dims(), weight.dims(), padding, stride)?;
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        candle_core::bail!(
            "conv3d runs on f32 CPU tensors (got {:?} on {:?})",
            x.dtype(),
            x.device()
        );
    }
    let (xd, wd) = (x.detach().contiguous()?, weight.detach().contiguous()?);
    let y = read(&xd, |xv| read(&wd, |wv| g.forward(xv, wv)))??;
    let [od, oh, ow] = g.out;
    let y = Tensor::from_vec(y, (g.n, g.c_out, od, oh, ow), x.device())?;
    let want_dx = x.track_op();
    node(
        "gradcache-conv3d",
        [x, weight, weight],
        y,
        Box::new(move |dy| {
            let dy = dy.contiguous()?;
            let (dx, dw) = read(&xd, |xv| {
                read(&wd, |wv| read(&dy, |dyv| g.backward(xv, wv, dyv, want_dx)))
            })???;
            let dx = dx
                .map(|v| Tensor::from_vec(v, xd.dims(), xd.device()))
                .transpose()?;
            let dw = Tensor::from_vec(dw, wd.dims(), wd.device())?;
            Ok([dx, Some(dw), None])
        }),
    )
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, read in place.
pub(crate) fn read<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => Ok(f(contiguous::<f32>(cpu, layout)?)),
        _ => candle_core::bail!("conv3d runs on the CPU"),
    }
}
