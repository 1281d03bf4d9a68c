//! Towers: what the gradient cache runs, chunk by chunk.
//!
//! An [`Encoder`] maps a chunk of inputs to representations `[rows, width]` in two ways:
//! a graph-free [`Encoder::encode`] for the representation pass, and a
//! [`Encoder::replay`] that back-propagates a cotangent into parameter gradients. The
//! default replay re-runs the graph-recording [`Encoder::forward`] under the crate's one
//! [`replay`] primitive; an encoder that checkpoints overrides it.
//!
//! candle has no no-grad mode: an op is recorded whenever an input is a `Var`. A
//! graph-free pass therefore has to run on *detached* weights. [`Tower`] does that for any
//! model built from a candle `VarBuilder`: it builds the model twice over one
//! [`ParamStore`], once on the trainable variables and once on detached views that share
//! their storage (zero copy, and optimizer updates are visible to both).

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::batch::Batch;
use crate::dropout::Ctx;
use crate::params::{is_buffer, Gradients, ParamStore, Params, Recorder, Views};
use crate::replay::replay;
use crate::Result;

/// A tower of a bi-encoder, as the gradient cache sees it.
pub trait Encoder {
    /// What one chunk of inputs looks like.
    type Input: Batch;

    /// The trainable parameters this encoder uses, sorted by name.
    fn params(&self) -> &Params;

    /// Non-trainable state the encoder reads and updates (BatchNorm's running statistics;
    /// see [`crate::params::is_buffer`]): saved and restored with the parameters, never
    /// given a gradient. None by default.
    fn buffers(&self) -> Params {
        Params::default()
    }

    /// Graph-free forward: runs on detached weights, records no op and keeps no graph.
    /// Used for the representation pass.
    fn encode(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor>;

    /// Forward on the trainable variables, recording the graph (a plain training forward).
    fn forward(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor>;

    /// Back-propagates `cotangent` (dL/d representations of this chunk) and returns the
    /// detached parameter gradients. `ctx` must be the one the representation pass used,
    /// so dropout masks replay bit for bit.
    fn replay(&self, input: &Self::Input, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        replay(self.params(), cotangent, || self.forward(input, ctx))
    }
}

/// A model that [`Tower`] can run: a forward over one input type, written once with
/// plain tensors.
pub trait Network {
    /// What one chunk of inputs looks like.
    type Input: Batch;

    /// Maps a chunk to representations `[rows, width]`.
    fn forward(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor>;
}

/// A [`Network`] built twice over one set of parameters: on the trainable variables (for
/// the graph-recording forward) and on detached views of them (for the graph-free pass).
pub struct Tower<M> {
    graph: M,
    detached: M,
    params: Params,
    buffers: Params,
    frozen: Params,
}

impl<M> Tower<M> {
    /// Builds the model with `build`, creating any missing parameters in `store` (seeded
    /// initialisation). `prefix` namespaces the parameter names (`""` for none); two towers
    /// sharing one store need distinct prefixes.
    ///
    /// `build` must request the same names when called twice: it is run once on the
    /// variables and once on detached views of exactly the names it asked for the first time.
    pub fn build<F>(store: &ParamStore, prefix: &str, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder<'static>) -> Result<M>,
    {
        let names = Arc::new(Mutex::new(Vec::new()));
        let recorder = Recorder {
            store: store.clone(),
            names: Arc::clone(&names),
        };
        let vb =
            VarBuilder::from_backend(Box::new(recorder), store.dtype(), store.device().clone());
        let vb = if prefix.is_empty() { vb } else { vb.pp(prefix) };
        let graph = build(vb).map_err(|e| store.take_failure().unwrap_or(e))?;

        let names = names.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (buffers, rest): (Vec<_>, Vec<_>) = names
            .into_iter()
            .filter_map(|n| store.get(&n).map(|v| (n, v)))
            .partition(|(n, _)| is_buffer(n));
        let (frozen, params): (Vec<_>, Vec<_>) =
            rest.into_iter().partition(|(n, _)| store.is_frozen(n));
        let (params, buffers) = (Params::new(params), Params::new(buffers));
        let frozen = Params::new(frozen);
        // The detached build sees buffers as views of the same storage, so running
        // statistics written by either build are seen by both.
        let mut views = params.detached();
        views.extend(buffers.detached());
        views.extend(frozen.detached());
        let vb = VarBuilder::from_backend(
            Box::new(Views(views)),
            store.dtype(),
            store.device().clone(),
        );
        let vb = if prefix.is_empty() { vb } else { vb.pp(prefix) };
        let detached = build(vb)?;
        Ok(Self {
            graph,
            detached,
            params,
            buffers,
            frozen,
        })
    }

    /// The parameters the model asked for, sorted by name (buffers and frozen weights
    /// excluded).
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The frozen weights the model asked for (see [`crate::params::Freeze`]), sorted by
    /// name: read, never trained.
    pub fn frozen(&self) -> &Params {
        &self.frozen
    }

    /// The buffers (non-trainable state, e.g. BatchNorm running statistics) the model
    /// asked for, sorted by name.
    pub fn buffers(&self) -> &Params {
        &self.buffers
    }

    /// The instance built on the trainable variables.
    pub fn graph_model(&self) -> &M {
        &self.graph
    }

    /// The instance built on detached views of the variables.
    pub fn detached_model(&self) -> &M {
        &self.detached
    }
}

impl<M: Network> Encoder for Tower<M> {
    type Input = M::Input;

    fn params(&self) -> &Params {
        &self.params
    }

    fn buffers(&self) -> Params {
        self.buffers.clone()
    }

    fn encode(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.detached.forward(input, ctx)
    }

    fn forward(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.graph.forward(input, ctx)
    }

    fn replay(&self, input: &Self::Input, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        let _flush = crate::denormal::flush();
        replay(self.params(), cotangent, || self.forward(input, ctx))
    }
}
