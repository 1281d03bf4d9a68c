//! Optimisers, learning-rate schedule and gradient clipping for the trainer.
//!
//! candle-nn's `AdamW` applies one weight decay to every variable and keeps its moments
//! private, so a run could not be saved and resumed exactly. [`Optimizer`] is ours: AdamW
//! with decoupled weight decay (Loshchilov & Hutter 2019, as `torch.optim.AdamW`) that skips
//! biases and LayerNorm weights (the BERT recipe), or plain SGD; its state (the moments) is a
//! set of named tensors that a checkpoint can write and read back. The optimiser does not
//! count steps: the trainer's one step counter is passed to every update (AdamW's bias
//! correction uses it), as it is to the gradient cache (dropout seeds) and the schedule.
//! Parameters are visited in name order.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use crate::params::{Gradients, Params};
use crate::{Error, Result};

/// Which optimiser, with its hyper-parameters (the learning rate comes from the schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay.
    AdamW {
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the root of the second moment.
        eps: f64,
        /// Decoupled weight decay, not applied to biases and LayerNorm weights.
        weight_decay: f64,
    },
    /// Plain stochastic gradient descent: `w -= lr * g`.
    Sgd,
}

impl OptimizerKind {
    /// AdamW with the usual BERT fine-tuning values (0.9, 0.999, 1e-8, decay 0.01).
    pub fn adamw() -> Self {
        OptimizerKind::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Checks the hyper-parameters.
    pub fn validate(&self) -> Result<()> {
        if let OptimizerKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = *self
        {
            for (field, v) in [("optim.beta1", beta1), ("optim.beta2", beta2)] {
                if !(0.0..1.0).contains(&v) {
                    return Err(Error::InvalidConfig {
                        field,
                        value: v.to_string(),
                        reason: "must be in [0, 1)",
                    });
                }
            }
            if eps.is_nan() || eps <= 0.0 {
                return Err(Error::InvalidConfig {
                    field: "optim.eps",
                    value: eps.to_string(),
                    reason: "must be greater than 0",
                });
            }
            if weight_decay.is_nan() || weight_decay < 0.0 {
                return Err(Error::InvalidConfig {
                    field: "optim.weight_decay",
                    value: weight_decay.to_string(),
                    reason: "must be 0 or more",
                });
            }
        }
        Ok(())
    }
}

/// Whether weight decay applies to the parameter `name`: not to biases, not to LayerNorm
/// weights (Hugging Face names `LayerNorm.weight`, ours `norm.weight`). AdamW also skips
/// every tensor of fewer than two dimensions whatever its name (BatchNorm weights, CLIP's
/// logit scale), which for BERT is the same set.
pub fn decays(name: &str) -> bool {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    let owner = name.rsplit('.').nth(1).unwrap_or("");
    leaf != "bias" && !owner.eq_ignore_ascii_case("layernorm") && !owner.ends_with("norm")
}

/// An optimiser over a fixed set of parameters, with saveable state.
pub struct Optimizer {
    kind: OptimizerKind,
    params: Params,
    moments: BTreeMap<String, Moments>,
    /// Parameters updated at a multiple of the learning rate (see
    /// [`Optimizer::with_lr_scales`]).
    lr_scales: BTreeMap<String, f64>,
}

/// AdamW's moments of one parameter.
enum Moments {
    /// `[m; v]` stacked `[2, ..]`, made anew by the fused CPU update (never changed in
    /// place, so a state handed out stays as it was).
    Stacked(Tensor),
    /// `(m, v)` of the composed update (other devices and dtypes).
    Pair(Tensor, Tensor),
}

impl Moments {
    fn pair(&self) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            Moments::Stacked(mv) => (mv.get(0)?, mv.get(1)?),
            Moments::Pair(m, v) => (m.clone(), v.clone()),
        })
    }
}

/// Whether the fused update runs on this weight and gradient: contiguous, the same dtype,
/// f32 or f64 on the CPU, f32 on a GPU (one kernel each for the moments and the weight,
/// `src/nn/cuda/optim.cu`, giving the CPU's bits).
fn fused_update(w: &Tensor, g: &Tensor) -> bool {
    let dtype = w.dtype();
    let device = if w.device().is_cpu() {
        matches!(dtype, DType::F32 | DType::F64)
    } else {
        w.device().is_cuda() && dtype == DType::F32
    };
    device
        && w.device().same_device(g.device())
        && g.dtype() == dtype
        && w.is_contiguous()
        && g.is_contiguous()
        && w.shape() == g.shape()
}

impl Optimizer {
    /// An optimiser for `params`.
    pub fn new(kind: OptimizerKind, params: Params) -> Result<Self> {
        kind.validate()?;
        Ok(Self {
            kind,
            params,
            moments: BTreeMap::new(),
            lr_scales: BTreeMap::new(),
        })
    }

    /// The same optimiser updating each named parameter at its own multiple of the
    /// learning rate (a parameter group of its own on the run's schedule, as
    /// sentence-transformers' `learning_rate_mapping`).
    pub fn with_lr_scales(mut self, scales: impl IntoIterator<Item = (String, f64)>) -> Self {
        self.lr_scales.extend(scales);
        self
    }

    /// The optimiser.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// Applies update number `step` (0-based: AdamW's bias correction uses `step + 1`) with
    /// learning rate `lr`. Parameters without a gradient are left untouched (and their
    /// moments do not advance).
    pub fn step(&mut self, step: u64, grads: &Gradients, lr: f64) -> Result<()> {
        let t = i32::try_from(step.saturating_add(1)).unwrap_or(i32::MAX);
        for (name, var) in self.params.iter() {
            let Some(g) = grads.get(name) else { continue };
            let lr = lr * self.lr_scales.get(name).copied().unwrap_or(1.0);
            let w = var.as_tensor();
            let g = g.to_dtype(w.dtype())?.contiguous()?;
            let fused = fused_update(w, &g);
            match self.kind {
                OptimizerKind::Sgd if fused => {
                    w.inplace_op2(&g, &kernels::Sgd { lr })?;
                }
                OptimizerKind::Sgd => var.set(&(w - (g * lr)?)?.detach())?,
                OptimizerKind::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    // Tensors of fewer than two dimensions never decay (OpenCLIP's rule):
                    // BatchNorm gains, CLIP's logit scale, any bias.
                    let decay = if decays(name) && w.rank() >= 2 && weight_decay > 0.0 {
                        Some(1.0 - lr * weight_decay)
                    } else {
                        None
                    };
                    let moments = self.moments.remove(name);
                    let moments = if fused {
                        // One pass for the moments (a new [m; v]), one for the weight, in
                        // place (the composed form below takes sixteen passes and as
                        // many temporaries).
                        let mv = match moments {
                            Some(Moments::Stacked(mv)) => mv,
                            Some(Moments::Pair(m, v)) => Tensor::stack(&[m, v], 0)?,
                            None => {
                                Tensor::zeros([&[2], g.dims()].concat(), g.dtype(), g.device())?
                            }
                        };
                        let mv = mv
                            .contiguous()?
                            .apply_op2_no_bwd(&g, &kernels::AdamWMoments { beta1, beta2 })?;
                        w.inplace_op2(
                            &mv,
                            &kernels::AdamWWeights {
                                lr,
                                eps,
                                decay,
                                m_correction: 1.0 - beta1.powi(t),
                                v_correction: 1.0 - beta2.powi(t),
                            },
                        )?;
                        Moments::Stacked(mv)
                    } else {
                        let (m, v) = match moments {
                            Some(mv) => mv.pair()?,
                            None => (g.zeros_like()?, g.zeros_like()?),
                        };
                        let m = ((m * beta1)? + (&g * (1.0 - beta1))?)?;
                        let v = ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                        let m_hat = (&m / (1.0 - beta1.powi(t)))?;
                        let v_hat = (&v / (1.0 - beta2.powi(t)))?;
                        let decayed = match decay {
                            Some(factor) => (w * factor)?,
                            None => w.clone(),
                        };
                        let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
                        var.set(&(decayed - (update * lr)?)?.detach())?;
                        Moments::Pair(m, v)
                    };
                    self.moments.insert(name.to_string(), moments);
                }
            }
        }
        Ok(())
    }

    /// The state as named tensors (`m.<param>`, `v.<param>`), for checkpoints.
    pub fn state(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for (name, moments) in &self.moments {
            let (m, v) = moments.pair()?;
            out.insert(format!("m.{name}"), m);
            out.insert(format!("v.{name}"), v);
        }
        Ok(out)
    }

    /// Restores a state written by [`Self::state`]. Moments of unknown parameters or of the
    /// wrong shape are an error ([`Error::CheckpointMismatch`]); other entries are ignored.
    pub fn load_state(&mut self, state: &BTreeMap<String, Tensor>) -> Result<()> {
        let bad = |what: String| Error::CheckpointMismatch {
            what: "optimizer state".into(),
            detail: format!("{what} does not match the model's parameters"),
        };
        let mut moments = BTreeMap::new();
        for (key, m) in state {
            let Some(name) = key.strip_prefix("m.") else {
                continue;
            };
            let var = self.params.get(name).ok_or_else(|| bad(key.clone()))?;
            let v = state
                .get(&format!("v.{name}"))
                .ok_or_else(|| bad(format!("v.{name}")))?;
            if m.shape() != var.shape() || v.shape() != var.shape() {
                return Err(bad(format!("{key} has shape {:?}", m.dims())));
            }
            moments.insert(name.to_string(), Moments::Pair(m.clone(), v.clone()));
        }
        self.moments = moments;
        Ok(())
    }
}

/// Linear warmup from 0 to the base rate over `warmup` steps, then linear decay to 0 at
/// `total` steps: exactly `transformers.get_linear_schedule_with_warmup` (so the first
/// update of a run with warmup has learning rate 0, as there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup: u64,
    /// Total steps of the run.
    pub total: u64,
}

impl Schedule {
    /// The learning rate of the update at `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * step as f64 / self.warmup as f64;
        }
        let remaining = self.total.saturating_sub(step) as f64;
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        self.lr * (remaining / span).clamp(0.0, 1.0)
    }
}

/// Scales all gradients so that their global L2 norm is at most `max_norm` (as
/// `torch.nn.utils.clip_grad_norm_`). Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Gradients, max_norm: f64) -> Result<f64> {
    let mut total = 0f64;
    // Gradients off the CPU: each one's sum of squares stays on its device, and all of
    // them are read back at once (one wait for the device per step, not one per tensor).
    let mut on_device: Vec<Tensor> = Vec::new();
    for (_, g) in grads.iter() {
        match kernels::sum_of_squares(g)? {
            Some(sum) => total += sum,
            None if g.device().is_cpu() => {
                total += g
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?
            }
            None => on_device.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?),
        }
    }
    if !on_device.is_empty() {
        let sums = Tensor::stack(&on_device, 0)?.to_dtype(DType::F64)?;
        total += sums.to_vec1::<f64>()?.iter().sum::<f64>();
    }
    let norm = total.sqrt();
    if norm.is_finite() && norm > max_norm && norm > 0.0 {
        grads.scale(max_norm / (norm + 1e-6))?;
    }
    Ok(norm)
}

/// The fused CPU updates: one pass over each tensor (f32 or f64, contiguous).
mod kernels {
    use candle_core::{CpuStorage, CustomOp2, InplaceOp2, Layout, Shape, Tensor, WithDType};
    use num_traits::Zero;

    use crate::nn::cpu::{for_blocks, parallel_ranges, Float, BLOCK_ROWS};

    /// Elements per parallel block.
    const WIDTH: usize = 1024;

    fn slice<'a, T: Float>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [T]> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
            None => candle_core::bail!("optimizer: a strided tensor"),
        }
    }

    fn slice_mut<'a, T: Float>(
        s: &'a mut CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<&'a mut [T]> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("optimizer: a strided tensor")
        };
        match (s, T::DTYPE) {
            (CpuStorage::F32(v), candle_core::DType::F32) => {
                let v = &mut v[a..b];
                // SAFETY: T is f32 (checked by the dtype).
                Ok(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut T, v.len()) })
            }
            (CpuStorage::F64(v), candle_core::DType::F64) => {
                let v = &mut v[a..b];
                // SAFETY: T is f64 (checked by the dtype).
                Ok(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut T, v.len()) })
            }
            _ => candle_core::bail!("optimizer: runs on f32 or f64"),
        }
    }

    /// Calls `$body` with `$t` bound to the float type of `$storage`.
    macro_rules! float {
        ($storage:expr, $t:ident => $body:expr) => {
            match $storage {
                CpuStorage::F32(_) => {
                    type $t = f32;
                    $body
                }
                CpuStorage::F64(_) => {
                    type $t = f64;
                    $body
                }
                _ => candle_core::bail!("optimizer: runs on f32 or f64"),
            }
        };
    }

    /// `w -= lr * g`, in place.
    pub struct Sgd {
        pub lr: f64,
    }

    impl InplaceOp2 for Sgd {
        fn name(&self) -> &'static str {
            "gradcache-sgd"
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            w: &mut candle_core::CudaStorage,
            wl: &Layout,
            g: &candle_core::CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<()> {
            use crate::nn::cuda;
            let n = wl.shape().elem_count();
            let args = (
                cuda::storage_ptr_f32(w, wl)?,
                cuda::storage_ptr_f32(g, gl)?,
                n,
            );
            cuda::sgd(&w.device, args, self.lr as f32)
        }

        fn cpu_fwd(
            &self,
            w: &mut CpuStorage,
            wl: &Layout,
            g: &CpuStorage,
            gl: &Layout,
        ) -> candle_core::Result<()> {
            float!(g, T => {
                let g = slice::<T>(g, gl)?;
                let w = slice_mut::<T>(w, wl)?;
                let lr = T::of(self.lr);
                for_blocks(w, WIDTH, |blk, chunk| {
                    let base = blk * BLOCK_ROWS * WIDTH;
                    for (wv, &gv) in chunk.iter_mut().zip(&g[base..]) {
                        *wv -= gv * lr;
                    }
                });
                Ok(())
            })
        }
    }

    /// The new `[m; v]` from the old and the gradient `g`:
    /// `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`.
    pub struct AdamWMoments {
        pub beta1: f64,
        pub beta2: f64,
    }

    impl CustomOp2 for AdamWMoments {
        fn name(&self) -> &'static str {
            "gradcache-adamw-moments"
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            mv: &candle_core::CudaStorage,
            ml: &Layout,
            g: &candle_core::CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
            use crate::nn::cuda;
            let n = gl.shape().elem_count();
            if ml.shape().elem_count() != 2 * n {
                candle_core::bail!(
                    "optimizer: moments of {:?} for a gradient of {n}",
                    ml.shape()
                );
            }
            let args = (
                cuda::storage_ptr_f32(mv, ml)?,
                cuda::storage_ptr_f32(g, gl)?,
                n,
            );
            let out = cuda::adamw_moments(
                &g.device,
                args,
                (self.beta1 as f32, self.beta2 as f32),
                ((1.0 - self.beta1) as f32, (1.0 - self.beta2) as f32),
            )?;
            Ok((out, ml.shape().clone()))
        }

        fn cpu_fwd(
            &self,
            mv: &CpuStorage,
            ml: &Layout,
            g: &CpuStorage,
            gl: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            float!(g, T => {
                let (mv, g) = (slice::<T>(mv, ml)?, slice::<T>(g, gl)?);
                let n = g.len();
                if mv.len() != 2 * n {
                    candle_core::bail!("optimizer: moments of {} for a gradient of {n}", mv.len());
                }
                let (b1, b2) = (T::of(self.beta1), T::of(self.beta2));
                let (c1, c2) = (T::of(1.0 - self.beta1), T::of(1.0 - self.beta2));
                let mut out = vec![T::zero(); 2 * n];
                let (m_out, v_out) = out.split_at_mut(n);
                let v_ptr = crate::nn::cpu::SharedMut(v_out.as_mut_ptr());
                for_blocks(m_out, WIDTH, |blk, chunk| {
                    let base = blk * BLOCK_ROWS * WIDTH;
                    let len = chunk.len();
                    // SAFETY: block `blk` owns the same elements of v as of m.
                    let v_new = unsafe { std::slice::from_raw_parts_mut(v_ptr.get().add(base), len) };
                    let (m, v, g) = (&mv[base..base + len], &mv[n + base..n + base + len], &g[base..base + len]);
                    for j in 0..len {
                        chunk[j] = m[j] * b1 + g[j] * c1;
                        v_new[j] = v[j] * b2 + g[j] * g[j] * c2;
                    }
                });
                Ok((T::to_cpu_storage_owned(out), ml.shape().clone()))
            })
        }
    }

    /// The weight from the new moments, in place:
    /// `w' = w decay - lr (m / c1) / (sqrt(v / c2) + eps)`.
    pub struct AdamWWeights {
        pub lr: f64,
        pub eps: f64,
        pub decay: Option<f64>,
        pub m_correction: f64,
        pub v_correction: f64,
    }

    impl InplaceOp2 for AdamWWeights {
        fn name(&self) -> &'static str {
            "gradcache-adamw-weights"
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            w: &mut candle_core::CudaStorage,
            wl: &Layout,
            mv: &candle_core::CudaStorage,
            ml: &Layout,
        ) -> candle_core::Result<()> {
            use crate::nn::cuda;
            let n = wl.shape().elem_count();
            if ml.shape().elem_count() != 2 * n {
                candle_core::bail!("optimizer: moments of {:?} for a weight of {n}", ml.shape());
            }
            let args = (
                cuda::storage_ptr_f32(w, wl)?,
                cuda::storage_ptr_f32(mv, ml)?,
                n,
            );
            cuda::adamw_weights(
                &w.device,
                args,
                (self.lr as f32, self.eps as f32),
                (self.m_correction as f32, self.v_correction as f32),
                self.decay.map(|d| d as f32),
            )
        }

        fn cpu_fwd(
            &self,
            w: &mut CpuStorage,
            wl: &Layout,
            mv: &CpuStorage,
            ml: &Layout,
        ) -> candle_core::Result<()> {
            float!(mv, T => {
                let mv = slice::<T>(mv, ml)?;
                let w = slice_mut::<T>(w, wl)?;
                let n = w.len();
                if mv.len() != 2 * n {
                    candle_core::bail!("optimizer: moments of {} for a weight of {n}", mv.len());
                }
                let (lr, eps) = (T::of(self.lr), T::of(self.eps));
                let (c1, c2) = (T::of(self.m_correction), T::of(self.v_correction));
                let decay = self.decay.map(T::of);
                for_blocks(w, WIDTH, |blk, chunk| {
                    let base = blk * BLOCK_ROWS * WIDTH;
                    let len = chunk.len();
                    let (m, v) = (&mv[base..base + len], &mv[n + base..n + base + len]);
                    for j in 0..len {
                        let decayed = match decay {
                            Some(f) => chunk[j] * f,
                            None => chunk[j],
                        };
                        let update = (m[j] / c1) / ((v[j] / c2).sqrt() + eps);
                        chunk[j] = decayed - update * lr;
                    }
                });
                Ok(())
            })
        }
    }

    /// `sum(g^2)` in f64 for a contiguous f32/f64 CPU tensor (blocks summed in a fixed
    /// order); `None` for any other tensor.
    pub fn sum_of_squares(g: &Tensor) -> candle_core::Result<Option<f64>> {
        if !g.device().is_cpu() || !g.is_contiguous() {
            return Ok(None);
        }
        let (storage, layout) = g.storage_and_layout();
        let candle_core::Storage::Cpu(s) = &*storage else {
            return Ok(None);
        };
        let sum = match s {
            CpuStorage::F32(_) => blocked_sum::<f32>(slice(s, layout)?),
            CpuStorage::F64(_) => blocked_sum::<f64>(slice(s, layout)?),
            _ => return Ok(None),
        };
        Ok(Some(sum))
    }

    fn blocked_sum<T: Float>(x: &[T]) -> f64 {
        const BLOCK: usize = 1 << 14;
        let blocks = x.len().div_ceil(BLOCK);
        let partials: Vec<std::sync::atomic::AtomicU64> = (0..blocks)
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        parallel_ranges(blocks, |range| {
            for b in range {
                let mut acc = 0f64;
                for &v in &x[b * BLOCK..x.len().min((b + 1) * BLOCK)] {
                    let v = num_traits::ToPrimitive::to_f64(&v).unwrap_or(f64::NAN);
                    acc += v * v;
                }
                partials[b].store(acc.to_bits(), std::sync::atomic::Ordering::Relaxed);
            }
        });
        partials
            .iter()
            .map(|p| f64::from_bits(p.load(std::sync::atomic::Ordering::Relaxed)))
            .sum()
    }
}
