//! Where trainable parameters live, and the gradients computed for them.
//!
//! [`ParamStore`] wraps a candle [`VarMap`] (so candle-nn optimizers and its safetensors
//! save/load keep working) and initialises new variables from a seed instead of candle's
//! unseeded RNG: a parameter's initial value is a pure function of (store seed, name), so
//! two runs with one seed start from identical weights whatever the construction order.
//!
//! [`Params`] is a view of some variables sorted by name; [`Gradients`] maps names to
//! detached gradient tensors and accumulates across chunks, towers and micro-batches.

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

mod gradients;
mod weight_file;

pub use gradients::{GradAccumulator, Gradients};
pub use weight_file::{shards_of, WeightFile};

pub use crate::freeze::Freeze;
use crate::names::is_adapter;
pub use crate::names::is_buffer;
use crate::rng;
use crate::{Error, Result};

/// Trainable variables keyed by name, with seeded initialisation or weights from
/// safetensors files.
#[derive(Clone)]
pub struct ParamStore {
    varmap: VarMap,
    seed: u64,
    dtype: DType,
    device: Device,
    sources: Vec<Source>,
    /// Which names are frozen: served as plain tensors (no gradient, no optimizer state).
    frozen: Freeze,
    /// The typed error behind the last failed request: candle's `VarBuilder` can only carry
    /// its own error type, so the store keeps ours here for [`crate::Tower::build`].
    failure: Arc<Mutex<Option<Error>>>,
}

/// A weights file serving the names under `prefix`.
#[derive(Clone)]
struct Source {
    prefix: String,
    file: Arc<WeightFile>,
    /// Consulted only for names the other sources lack.
    fallback: bool,
}

impl ParamStore {
    /// An empty store; variables are created on first request through [`Self::var_builder`].
    pub fn new(seed: u64, dtype: DType, device: &Device) -> Self {
        Self {
            varmap: VarMap::new(),
            seed,
            dtype,
            device: device.clone(),
            sources: Vec::new(),
            frozen: Freeze::default(),
            failure: Arc::new(Mutex::new(None)),
        }
    }

    /// Freezes the names `frozen` matches: the store keeps them (exports and copies see
    /// them), but hands them to models as plain tensors, so no op on them is recorded,
    /// they receive no gradient and [`crate::Tower`] keeps them out of its parameters.
    pub fn with_frozen(mut self, frozen: Freeze) -> Self {
        self.frozen = frozen;
        self
    }

    /// Whether the variable named `name` is frozen.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.frozen.matches(name)
    }

    /// Serves names under `prefix` (e.g. `"query"`, or `""` for all) from `file`: a
    /// requested variable `prefix.x` is read from the file's tensor `x` instead of being
    /// initialised, and a name missing from the file is an error. Where several prefixes
    /// match a name, the longest serves it.
    pub fn with_weights(mut self, prefix: &str, file: Arc<WeightFile>) -> Self {
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}.")
        };
        self.sources.push(Source {
            prefix,
            file,
            fallback: false,
        });
        self
    }

    /// Like [`Self::with_weights`], for the names the other files lack: a checkpoint that
    /// holds only the trained weights, over the pretrained model that holds the frozen
    /// ones.
    pub fn with_fallback_weights(mut self, prefix: &str, file: Arc<WeightFile>) -> Self {
        self = self.with_weights(prefix, file);
        if let Some(last) = self.sources.last_mut() {
            last.fallback = true;
        }
        self
    }

    /// The typed error behind the last failed variable request, if any (taken).
    pub(crate) fn take_failure(&self) -> Option<Error> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// A `VarBuilder` that returns the store's variables (tracked by autograd), creating
    /// missing ones with the requested `Init` drawn from the store's seed.
    pub fn var_builder(&self) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), self.dtype, self.device.clone())
    }

    /// The underlying candle `VarMap`, e.g. for `candle_nn::AdamW::new(store.varmap().all_vars(), ..)`.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The variable named `name`, if the store has it.
    pub fn get(&self, name: &str) -> Option<Var> {
        self.lock().get(name).cloned()
    }

    /// Every variable in the store, sorted by name.
    pub fn params(&self) -> Params {
        Params::new(self.lock().iter().map(|(n, v)| (n.clone(), v.clone())))
    }

    /// The dtype new variables are created with.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device variables live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Var>> {
        // A poisoned lock only means another thread panicked while holding it; the map
        // itself is still consistent (inserts are single operations).
        self.varmap
            .data()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn init(&self, name: &str, shape: &Shape, init: Init, dtype: DType) -> Result<Tensor> {
        let seed = rng::derive_seed(&[self.seed, rng::hash_str(name)]);
        let dev = &self.device;
        let t = match init {
            Init::Const(v) => Tensor::ones(shape, dtype, dev)?.affine(v, 0.)?,
            Init::Randn { mean, stdev } => rng::normal(seed, mean, stdev, shape, dtype, dev)?,
            Init::Uniform { lo, up } => rng::uniform(seed, lo, up, shape, dtype, dev)?,
            Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        rng::uniform(seed, -bound, bound, shape, dtype, dev)?
                    }
                    NormalOrUniform::Normal => rng::normal(seed, 0., std, shape, dtype, dev)?,
                }
            }
        };
        Ok(t)
    }
}

impl ParamStore {
    /// The weights file that serves `name`, with the name inside it: the longest prefix's
    /// (a Dense module's file under its directory's name, inside the tower the model's
    /// weights file serves); where that file lacks it, the longest fallback that holds it
    /// (the pretrained model a checkpoint's frozen weights come from).
    fn source<'a>(&'a self, name: &'a str) -> Option<(&'a str, &'a Arc<WeightFile>)> {
        let longest = |fallback: bool| {
            self.sources
                .iter()
                .filter(|s| s.fallback == fallback)
                .filter_map(|s| {
                    name.strip_prefix(s.prefix.as_str())
                        .map(|n| (s.prefix.len(), n, &s.file))
                })
                .filter(|(_, n, file)| !fallback || file.holds(n))
                .max_by_key(|&(len, _, _)| len)
                .map(|(_, n, file)| (n, file))
        };
        match longest(false) {
            Some((n, file)) if !file.holds(n) => longest(true).or(Some((n, file))),
            None => longest(true),
            found => found,
        }
    }

    /// Whether the variable `name` is (or would be) read from a weights file rather than
    /// drawn from the seed.
    pub fn reads_from_file(&self, name: &str) -> bool {
        self.source(name)
            .is_some_and(|(rest, file)| file.holds(rest))
    }

    /// What a model gets for the variable `name`: the variable, or a detached view of it
    /// (same storage) when it is frozen.
    fn served(&self, name: &str, var: &Var) -> Tensor {
        if self.is_frozen(name) {
            var.as_detached_tensor()
        } else {
            var.as_tensor().clone()
        }
    }
}

impl SimpleBackend for ParamStore {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(var) = self.get(name) {
            if var.shape() != &s {
                candle_core::bail!(
                    "parameter `{name}` has shape {:?} but shape {:?} was requested",
                    var.shape(),
                    s
                );
            }
            return Ok(self.served(name, &var));
        }
        let value = match self.source(name) {
            // A LoRA adapter a pretrained model does not hold starts fresh.
            Some((rest, file)) if !is_adapter(name) || file.holds(rest) => {
                file.load(rest, &s, dtype, &self.device)
            }
            _ => self.init(name, &s, h, dtype),
        };
        // A LoRA projection's frozen base weight, stored narrower (`model.base_dtype`).
        let value = match (value, self.frozen.narrowed(name)) {
            (Ok(v), Some(narrow)) if v.dtype() != narrow => v.to_dtype(narrow).map_err(Error::from),
            (value, _) => value,
        };
        let value = match value {
            Ok(v) => v,
            Err(e) => {
                let message = e.to_string();
                *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                candle_core::bail!("{message}");
            }
        };
        let var = Var::from_tensor(&value)?;
        let tensor = self.served(name, &var);
        self.lock().insert(name.to_string(), var);
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.get(name) {
            Some(var) => Ok(self.served(name, &var)),
            None => candle_core::bail!("no parameter named `{name}` in the store"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }
}

/// A set of trainable variables sorted by name.
#[derive(Clone, Default)]
pub struct Params {
    vars: Vec<(String, Var)>,
}

impl Params {
    /// Collects `(name, var)` pairs, sorted by name.
    pub fn new(vars: impl IntoIterator<Item = (String, Var)>) -> Self {
        let mut vars: Vec<_> = vars.into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars.dedup_by(|a, b| a.0 == b.0);
        Self { vars }
    }

    /// `(name, var)` pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// Parameter names in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.vars.iter().map(|(n, _)| n.as_str())
    }

    /// The variable named `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| &self.vars[i].1)
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// True when there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Total number of scalar parameters.
    pub fn elem_count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// The union of two sets. A name present in both must refer to the same variable
    /// (a genuinely shared parameter); two different variables under one name are an error,
    /// since their gradients would be summed together.
    pub fn union(&self, other: &Params) -> Result<Params> {
        for (name, var) in other.iter() {
            if let Some(mine) = self.get(name) {
                if mine.as_tensor().id() != var.as_tensor().id() {
                    return Err(Error::DuplicateParameter {
                        name: name.to_string(),
                    });
                }
            }
        }
        Ok(Params::new(
            self.vars.iter().chain(other.vars.iter()).cloned(),
        ))
    }

    /// Detached views of every variable, sharing storage (zero copy): optimizer updates
    /// to the variables are visible through them, but no op on them is recorded.
    pub fn detached(&self) -> std::collections::HashMap<String, Tensor> {
        self.vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_detached_tensor()))
            .collect()
    }

    /// Pulls this set's gradients out of a candle `GradStore`, detached. Parameters that
    /// received no gradient are absent from the result.
    pub fn grads_from(&self, store: &GradStore) -> Gradients {
        let mut grads = Gradients::default();
        for (name, var) in self.iter() {
            if let Some(g) = store.get(var.as_tensor()) {
                grads.map.insert(name.to_string(), g.detach());
            }
        }
        grads
    }
}

impl std::fmt::Debug for Params {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.vars.iter().map(|(n, v)| (n, v.shape())))
            .finish()
    }
}

/// Used by [`crate::encoder::Tower`]: a backend that serves a store's variables and
/// records every name requested, so a tower knows exactly which parameters it owns.
/// Tensors served by name as they are: the detached build of a [`crate::Tower`]. Unlike
/// candle's map backend it converts no dtype, so a base weight stored narrower
/// (`model.base_dtype`) is not copied at full width.
pub(crate) struct Views(pub(crate) std::collections::HashMap<String, Tensor>);

impl SimpleBackend for Views {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, DType::F32, &Device::Cpu)?;
        if t.shape() != &s {
            candle_core::bail!(
                "parameter `{name}` has shape {:?} but shape {:?} was requested",
                t.shape(),
                s
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.0.get(name) {
            Some(t) => Ok(t.clone()),
            None => candle_core::bail!("no parameter named `{name}` in the store"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

pub(crate) struct Recorder {
    pub(crate) store: ParamStore,
    pub(crate) names: Arc<Mutex<Vec<String>>>,
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = SimpleBackend::get(&self.store, s, name, h, dtype, dev)?;
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name.to_string());
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.store.get_unchecked(name, dtype, dev)?;
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name.to_string());
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.store.contains_tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grads(entries: &[(&str, &[f32])]) -> Gradients {
        entries
            .iter()
            .map(|(n, v)| (n.to_string(), Tensor::new(*v, &Device::Cpu).unwrap()))
            .collect()
    }

    #[test]
    fn the_accumulator_sums_bit_for_bit_and_leaves_the_first_gradient_alone() {
        let parts: Vec<Gradients> = (0..5)
            .map(|k| {
                let v: Vec<f32> = (0..3000)
                    .map(|i| ((i * 7 + k * 13) as f32).sin() / 3.0)
                    .collect();
                let w: Vec<f32> = (0..3).map(|i| (i + k) as f32 * 0.1).collect();
                let mut g = grads(&[("w", &w)]);
                g.map
                    .insert("big".into(), Tensor::new(v, &Device::Cpu).unwrap());
                if k == 3 {
                    g.map.insert(
                        "late".into(),
                        Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
                    );
                }
                g
            })
            .collect();
        let first_big = parts[0].get("big").unwrap().clone();
        let before = first_big.to_vec1::<f32>().unwrap();
        let mut reference = Gradients::default();
        let mut acc = GradAccumulator::default();
        for g in &parts {
            reference.accumulate(g.clone()).unwrap();
            acc.add(g.clone()).unwrap();
        }
        let sum = acc.finish();
        assert_eq!(sum.len(), 3);
        for (name, r) in reference.iter() {
            let a = sum
                .get(name)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let r = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&r), "{name}");
        }
        // The caller's tensor was copied, not added into.
        assert_eq!(first_big.to_vec1::<f32>().unwrap(), before);
    }

    #[test]
    fn max_rel_err_is_per_parameter_with_a_floor() -> Result<()> {
        let reference = grads(&[("a", &[10.0, -20.0]), ("b", &[0.001, 0.0])]);
        let same = grads(&[("a", &[10.0, -20.0]), ("b", &[0.001, 0.0])]);
        assert_eq!(same.max_rel_err(&reference, 0.0)?, 0.0);
        // a: 0.2 / 20 = 0.01; b: 0.0005 / 0.001 = 0.5 without floor, 0.0005 / 0.02 with 1e-3.
        let other = grads(&[("a", &[10.2, -20.0]), ("b", &[0.0015, 0.0])]);
        assert!((other.max_rel_err(&reference, 0.0)? - 0.5).abs() < 1e-4);
        assert!((other.max_rel_err(&reference, 1e-3)? - 0.025).abs() < 1e-4);
        let missing = grads(&[("a", &[10.0, -20.0])]);
        assert_eq!(missing.max_rel_err(&reference, 0.0)?, f64::INFINITY);
        Ok(())
    }

    #[test]
    fn seeded_initialisation_is_reproducible_and_name_dependent() -> Result<()> {
        let init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let value = |seed: u64, name: &str| -> Vec<f32> {
            let store = ParamStore::new(seed, DType::F32, &Device::Cpu);
            let vb = store.var_builder();
            let t = vb.get_with_hints((4, 4), name, init).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(value(1, "w"), value(1, "w"));
        assert_ne!(value(1, "w"), value(2, "w"));
        assert_ne!(value(1, "w"), value(1, "v"));
        Ok(())
    }
}
