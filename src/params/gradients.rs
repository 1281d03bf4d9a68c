//! Parameter gradients: [`Gradients`] (detached, keyed by name) and [`GradAccumulator`],
//! which sums them across chunks, towers and segments in buffers it owns.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::Params;
use crate::Result;

/// Sums parameter gradients (of chunks, towers, segments) into buffers it owns: the first
/// gradient of a parameter is copied into a fresh buffer, every later one is added into it
/// in place (f32/f64 on the CPU; elsewhere as a new sum), so `n` chunks cost one copy and
/// `n - 1` additions instead of `n - 1` new tensors. The buffers are handed out only by
/// [`GradAccumulator::finish`], so nothing else holds them while they change. The sums are
/// the ones [`Gradients::accumulate`] computes, bit for bit.
#[derive(Default, Debug)]
pub struct GradAccumulator {
    map: BTreeMap<String, Tensor>,
}

impl GradAccumulator {
    /// Adds `grads` into the buffers.
    pub fn add(&mut self, grads: Gradients) -> Result<()> {
        for (name, g) in grads.map {
            match self.map.get_mut(&name) {
                Some(acc) => accumulate(acc, &g)?,
                None => {
                    // A copy of our own: `g` may share its storage with a tensor that
                    // someone else still holds.
                    self.map.insert(name, g.force_contiguous()?);
                }
            }
        }
        Ok(())
    }

    /// The sums.
    pub fn finish(self) -> Gradients {
        Gradients { map: self.map }
    }
}

/// `acc += g` for gradient accumulation: in place for same-shape CPU tensors in f32 or
/// f64 (the caller owns `acc`'s storage), else as a new sum. Each element is the same
/// `acc + g` either way, so the sums are too, bit for bit.
fn accumulate(acc: &mut Tensor, g: &Tensor) -> Result<()> {
    let same = acc.shape() == g.shape() && acc.dtype() == g.dtype();
    let cpu = acc.device().is_cpu() && g.device().is_cpu();
    if same && cpu && matches!(acc.dtype(), DType::F32 | DType::F64) {
        acc.inplace_op2(&g.contiguous()?, &AddInPlace)?;
    } else {
        *acc = acc.add(g)?;
    }
    Ok(())
}

/// `acc += g` element by element over a contiguous `acc`, in parallel blocks on the rayon
/// pool (the elements are independent, so the blocks change no sum).
struct AddInPlace;

impl candle_core::InplaceOp2 for AddInPlace {
    fn name(&self) -> &'static str {
        "gradcache-accumulate"
    }

    fn cpu_fwd(
        &self,
        acc: &mut candle_core::CpuStorage,
        la: &candle_core::Layout,
        g: &candle_core::CpuStorage,
        lg: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage::{F32, F64};
        let (Some((a0, a1)), Some((g0, g1))) = (la.contiguous_offsets(), lg.contiguous_offsets())
        else {
            candle_core::bail!("accumulate: strided gradients");
        };
        match (acc, g) {
            (F32(a), F32(g)) => add_blocks(&mut a[a0..a1], &g[g0..g1]),
            (F64(a), F64(g)) => add_blocks(&mut a[a0..a1], &g[g0..g1]),
            _ => candle_core::bail!("accumulate: f32 or f64 of one dtype"),
        }
        Ok(())
    }
}

fn add_blocks<T: Copy + Send + Sync + std::ops::AddAssign>(acc: &mut [T], g: &[T]) {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 15;
    let add = |a: &mut [T], g: &[T]| {
        for (a, &v) in a.iter_mut().zip(g) {
            *a += v;
        }
    };
    if acc.len() <= BLOCK {
        // One block: on this thread (handing it to the pool would only add a wake-up).
        add(acc, g);
    } else {
        acc.par_chunks_mut(BLOCK)
            .zip(g.par_chunks(BLOCK))
            .for_each(|(a, g)| add(a, g));
    }
}

/// Detached parameter gradients keyed by name, iterated in name order.
#[derive(Clone, Default, Debug)]
pub struct Gradients {
    pub(super) map: BTreeMap<String, Tensor>,
}

impl Gradients {
    /// Sets the gradient of `name`.
    pub(crate) fn insert(&mut self, name: String, grad: Tensor) {
        self.map.insert(name, grad);
    }

    /// Adds `other` in: gradients of a parameter in both are summed (in place where the
    /// fused kernels run), the others moved over.
    pub(crate) fn merge(&mut self, other: Gradients) -> Result<()> {
        for (name, g) in other.map {
            match self.map.get_mut(&name) {
                Some(acc) => {
                    let mut sum = acc.force_contiguous()?;
                    accumulate(&mut sum, &g)?;
                    *acc = sum;
                }
                None => {
                    self.map.insert(name, g);
                }
            }
        }
        Ok(())
    }

    /// The gradient of `name`, if it received one.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.map.get(name)
    }

    /// `(name, gradient)` pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.map.iter().map(|(n, g)| (n.as_str(), g))
    }

    /// Number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no parameter has a gradient.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Adds `other` into `self`: gradients of the same parameter are summed.
    pub fn accumulate(&mut self, other: Gradients) -> Result<()> {
        for (name, g) in other.map {
            match self.map.get_mut(&name) {
                Some(acc) => *acc = acc.add(&g)?,
                None => {
                    self.map.insert(name, g);
                }
            }
        }
        Ok(())
    }

    /// Multiplies every gradient by `factor` (e.g. to average over accumulation steps).
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        for g in self.map.values_mut() {
            *g = g.affine(factor, 0.)?;
        }
        Ok(())
    }

    /// A candle `GradStore` for `params`, so candle-nn optimizers can apply these gradients:
    /// `opt.step(&grads.to_grad_store(&params))`.
    pub fn to_grad_store(&self, params: &Params) -> GradStore {
        let mut store = GradStore::default();
        for (name, var) in params.iter() {
            if let Some(g) = self.map.get(name) {
                store.insert(var.as_tensor(), g.clone());
            }
        }
        store
    }

    /// The largest relative difference from `reference` over all parameters: for each
    /// parameter `max|self - reference| / max(max|reference|, floor)`, where `floor` is
    /// `floor_ratio` times the largest gradient entry of the whole reference. The floor keeps
    /// gradients that are mathematically zero (pure rounding noise) from dominating.
    /// A parameter present in only one of the two counts as an infinite error.
    pub fn max_rel_err(&self, reference: &Gradients, floor_ratio: f64) -> Result<f64> {
        let mut global = 0f64;
        for g in reference.map.values() {
            global = global.max(max_abs(g)?);
        }
        let floor = (global * floor_ratio).max(f64::MIN_POSITIVE);
        let mut worst = 0f64;
        for name in self.map.keys().chain(reference.map.keys()) {
            let (Some(a), Some(b)) = (self.map.get(name), reference.map.get(name)) else {
                return Ok(f64::INFINITY);
            };
            let diff = max_abs(&a.sub(b)?)?;
            let err = diff / max_abs(b)?.max(floor);
            worst = worst.max(if err.is_nan() { f64::INFINITY } else { err });
        }
        Ok(worst)
    }
}

impl IntoIterator for Gradients {
    type Item = (String, Tensor);
    type IntoIter = std::collections::btree_map::IntoIter<String, Tensor>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.into_iter()
    }
}

impl FromIterator<(String, Tensor)> for Gradients {
    fn from_iter<I: IntoIterator<Item = (String, Tensor)>>(iter: I) -> Self {
        Self {
            map: iter.into_iter().collect(),
        }
    }
}

/// The largest absolute entry of a tensor, as f64.
fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?)
}
