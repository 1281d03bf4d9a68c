//! Activation (gradient) checkpointing for any stack of layers (Chen et al. 2016,
//! "Training Deep Nets with Sublinear Memory Cost"; the OpenAI `gradient-checkpointing`
//! package; `torch.utils.checkpoint`). This crate calls it *recompute*, since
//! "checkpoint" names the training checkpoints of [`crate::train::checkpoint`].
//!
//! A model that exposes itself as a [`LayerStack`] (an input stage, `n` layers, an output
//! stage) can be wrapped in [`Recomputed`], an [`Encoder`] whose replay does not keep the
//! activations of every layer. With a policy on, the replay first runs the stack without a
//! graph and keeps only the inputs of its segments (the boundaries); it then sweeps the
//! segments top-down: recompute a segment from its stored input with a graph,
//! back-propagate the cotangent through it with the crate's one
//! [`replay_with_input`], and hand the input gradient to
//! the segment below. Dropout masks come from explicit seeds, so every recompute sees the
//! masks of the representation pass.
//!
//! Cost: one extra graph-free forward per replay; memory: the boundary activations plus one
//! segment's graph instead of the whole stack's graph.

use std::ops::Range;

use candle_core::Tensor;

use crate::batch::Batch;
use crate::dropout::Ctx;
pub use crate::dropout::Sites;
use crate::encoder::{Encoder, Tower};
use crate::params::{Gradients, Params};
use crate::replay::{replay, replay_with_input};
use crate::{Error, Result};

/// What to recompute in the backward pass instead of keeping it: segments of the layer
/// stack (cut at layer boundaries), pieces inside each layer (selective recompute), or
/// both. Default: off.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every activation the backward pass reads (no recomputation).
    #[default]
    Off,
    /// Selective recompute (Megatron-LM's "selective", the OpenAI package's `speed`):
    /// inside each layer keep the outputs of the matrix products and recompute the cheap
    /// pieces between them in the backward, the attention probabilities above all
    /// (`[heads, tokens, tokens]` per sequence: the scores' softmax and its dropout mask),
    /// also the residual sums under the LayerNorms and the feed-forward activation. Every
    /// sub-layer site of [`LayerStack::sites`] is recomputed; no segments.
    Attention,
    /// Selective recompute of every sub-layer site except those named in `keep`, inside
    /// the segments of `segments` (any other policy; `off` for none). The OpenAI
    /// package's `collection`, for the sites inside a layer.
    Selective {
        /// How the stack is cut into segments.
        #[serde(default)]
        segments: Box<Recompute>,
        /// Sub-layer sites to keep (names from [`LayerStack::sites`]).
        #[serde(default)]
        keep: Vec<String>,
    },
    /// A boundary before every layer.
    EveryLayer,
    /// A boundary every `k` layers.
    Every(usize),
    /// `ceil(sqrt(n))` evenly spaced boundaries, which about minimises boundaries + segment
    /// size (the OpenAI package's `memory` mode).
    Sqrt,
    /// Boundaries before the listed layers (a boundary before layer 0 is implied).
    Layers(Vec<usize>),
}

/// The policy as the config writes it, shortly: `off`, `every_layer`, `every(2)`, `sqrt`,
/// `layers([4, 8])`, `attention`, `sqrt + attention` (every site recomputed inside sqrt
/// segments), `off + selective (keep intermediate)`.
impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::Off => write!(f, "off"),
            Recompute::Attention => write!(f, "attention"),
            Recompute::EveryLayer => write!(f, "every_layer"),
            Recompute::Every(k) => write!(f, "every({k})"),
            Recompute::Sqrt => write!(f, "sqrt"),
            Recompute::Layers(layers) => write!(f, "layers({layers:?})"),
            Recompute::Selective { segments, keep } if keep.is_empty() => {
                write!(f, "{segments} + attention")
            }
            Recompute::Selective { segments, keep } => {
                write!(f, "{segments} + selective (keep {})", keep.join(", "))
            }
        }
    }
}

impl Recompute {
    /// Selective recompute of every sub-layer site except `keep`, inside the segments of
    /// `segments` (`sqrt + attention` is `selective(Recompute::Sqrt, &[])`).
    pub fn selective(segments: Recompute, keep: &[&str]) -> Self {
        Recompute::Selective {
            segments: Box::new(segments),
            keep: keep.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Selective recompute of every sub-layer site except `keep`, with no segments.
    pub fn keep(keep: &[&str]) -> Self {
        Self::selective(Recompute::Off, keep)
    }

    /// The sub-layer sites recomputed in a stack whose layers offer `sites`: none unless
    /// the policy is selective. Fails on a selective policy for a stack without sites and
    /// on a name in `keep` that is not a site.
    pub fn recomputed_sites(&self, sites: &[&str]) -> Result<Sites> {
        let keep: &[String] = match self {
            Recompute::Attention => &[],
            Recompute::Selective { keep, .. } => keep,
            _ => return Ok(Sites::NONE),
        };
        if sites.is_empty() {
            return Err(Error::InvalidConfig {
                field: "recompute",
                value: format!("{self:?}"),
                reason: "selective recompute needs a model with sub-layer sites (BERT has them; \
                         this model has none): use a segment policy",
            });
        }
        if let Some(unknown) = keep.iter().find(|k| !sites.contains(&k.as_str())) {
            return Err(Error::UnknownSite {
                name: unknown.clone(),
                known: sites.iter().map(|s| s.to_string()).collect(),
            });
        }
        let mut set = Sites::NONE;
        for (i, site) in sites.iter().enumerate() {
            if !keep.iter().any(|k| k == site) {
                set = set.with(i);
            }
        }
        Ok(set)
    }

    /// Checks the policy against a stack of `layers` layers.
    pub fn validate(&self, layers: usize) -> Result<()> {
        match self {
            Recompute::Selective { segments, .. } => {
                if matches!(
                    **segments,
                    Recompute::Attention | Recompute::Selective { .. }
                ) {
                    return Err(Error::InvalidConfig {
                        field: "recompute",
                        value: format!("{self:?}"),
                        reason: "`segments` must be a segment policy (off, every_layer, \
                                 every, sqrt, layers)",
                    });
                }
                segments.validate(layers)
            }
            Recompute::Every(0) => Err(Error::InvalidConfig {
                field: "recompute",
                value: "every(0)".into(),
                reason: "a segment must hold at least one layer",
            }),
            Recompute::Layers(list) if list.iter().any(|&i| i >= layers) => {
                Err(Error::InvalidConfig {
                    field: "recompute",
                    value: format!("layers({list:?})"),
                    reason: "every listed layer must be smaller than the number of layers",
                })
            }
            _ => Ok(()),
        }
    }

    /// The segments of a stack of `layers` layers, bottom to top, or `None` when off.
    /// Segments cover `0..layers` without gaps; an empty stack is one empty segment.
    pub fn segments(&self, layers: usize) -> Result<Option<Vec<Range<usize>>>> {
        self.validate(layers)?;
        let mut starts: Vec<usize> = match self {
            Recompute::Off | Recompute::Attention => return Ok(None),
            Recompute::Selective { segments, .. } => return segments.segments(layers),
            Recompute::EveryLayer => (0..layers).collect(),
            Recompute::Every(k) => (0..layers).step_by(*k).collect(),
            Recompute::Sqrt => {
                let count = ((layers as f64).sqrt().ceil() as usize).max(1);
                (0..count).map(|i| i * layers / count).collect()
            }
            Recompute::Layers(list) => list.clone(),
        };
        starts.push(0);
        starts.sort_unstable();
        starts.dedup();
        let ends = starts.iter().skip(1).copied().chain([layers]);
        Ok(Some(
            starts
                .iter()
                .copied()
                .zip(ends)
                .map(|(s, e)| s..e)
                .collect(),
        ))
    }
}

/// A model as an input stage, a stack of layers and an output stage, which activation
/// checkpointing can cut at layer boundaries. Layers may read per-chunk data that does not depend on the
/// parameters ([`LayerStack::Aux`], e.g. an attention mask): it is computed once per pass and
/// receives no gradient.
pub trait LayerStack {
    /// What one chunk of inputs looks like.
    type Input: Batch;
    /// Parameter-free per-chunk data shared by the stages (e.g. attention mask bias).
    type Aux;

    /// Computes the chunk's parameter-free data. Must not use any parameter.
    fn aux(&self, input: &Self::Input) -> Result<Self::Aux>;
    /// The input stage: inputs to the first layer's activations.
    fn embed(&self, input: &Self::Input, aux: &Self::Aux, ctx: &Ctx) -> Result<Tensor>;
    /// Number of layers.
    fn num_layers(&self) -> usize;
    /// Layer `i`.
    fn layer(&self, i: usize, x: &Tensor, aux: &Self::Aux, ctx: &Ctx) -> Result<Tensor>;
    /// The output stage: last activations to representations `[rows, width]`.
    fn head(&self, x: &Tensor, aux: &Self::Aux, ctx: &Ctx) -> Result<Tensor>;

    /// Names of the pieces inside a layer that selective recompute can recompute in the
    /// backward instead of keeping ([`Recompute::Attention`], [`Recompute::Selective`]);
    /// [`LayerStack::layer`] reads which from [`Ctx::recompute`]. None by default.
    fn sites(&self) -> &'static [&'static str] {
        &[]
    }

    /// The whole forward: input stage, the layers in order, output stage.
    fn run(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor> {
        let aux = self.aux(input)?;
        let mut x = self.embed(input, &aux, ctx)?;
        for i in 0..self.num_layers() {
            let _s = crate::profile::span(|| format!("layer.{i:02}.forward"));
            x = self.layer(i, &x, &aux, ctx)?;
        }
        self.head(&x, &aux, ctx)
    }
}

/// A [`LayerStack`] as an [`Encoder`] with a recompute (activation checkpointing) policy.
pub struct Recomputed<M> {
    tower: Tower<M>,
    policy: Recompute,
    sites: Sites,
}

impl<M: LayerStack> Recomputed<M> {
    /// Wraps a tower; fails if the policy does not fit the stack.
    pub fn new(tower: Tower<M>, policy: Recompute) -> Result<Self> {
        let sites = Self::check(&tower, &policy)?;
        Ok(Self {
            tower,
            policy,
            sites,
        })
    }

    fn check(tower: &Tower<M>, policy: &Recompute) -> Result<Sites> {
        let model = tower.graph_model();
        policy.validate(model.num_layers())?;
        policy.recomputed_sites(model.sites())
    }

    /// The policy.
    pub fn policy(&self) -> &Recompute {
        &self.policy
    }

    /// Changes the policy.
    pub fn set_policy(&mut self, policy: Recompute) -> Result<()> {
        self.sites = Self::check(&self.tower, &policy)?;
        self.policy = policy;
        Ok(())
    }

    /// `ctx` with this policy's sub-layer sites.
    fn ctx(&self, ctx: &Ctx) -> Ctx {
        Ctx {
            recompute: self.sites,
            ..*ctx
        }
    }

    /// The underlying tower.
    pub fn tower(&self) -> &Tower<M> {
        &self.tower
    }

    /// Every weight of the model: the trainable parameters and the frozen ones.
    pub fn weights(&self) -> crate::Result<crate::params::Params> {
        self.tower.params().union(self.tower.frozen())
    }

    fn replay_segments(
        &self,
        segments: &[Range<usize>],
        input: &M::Input,
        cotangent: &Tensor,
        ctx: &Ctx,
    ) -> Result<Gradients> {
        let (graph, detached) = (self.tower.graph_model(), self.tower.detached_model());
        let params: &Params = self.tower.params();
        let aux = detached.aux(input)?;

        // Graph-free forward, keeping only the input of every segment.
        let mut x = detached.embed(input, &aux, ctx)?;
        let mut boundaries = Vec::with_capacity(segments.len());
        for segment in segments {
            boundaries.push(x.clone());
            for i in segment.clone() {
                x = detached.layer(i, &x, &aux, ctx)?;
            }
        }
        drop(x);

        // Top-down: recompute each segment with a graph and back-propagate through it.
        let mut grads = Gradients::default();
        let mut g = cotangent.clone();
        let top = segments.len() - 1;
        for (s, segment) in segments.iter().enumerate().rev() {
            let start = boundaries
                .pop()
                .ok_or_else(|| Error::Concat("internal: a segment boundary is missing".into()))?;
            let r = replay_with_input(params, &start, &g, |x| {
                let mut h = x.clone();
                for i in segment.clone() {
                    h = graph.layer(i, &h, &aux, ctx)?;
                }
                if s == top {
                    graph.head(&h, &aux, ctx)
                } else {
                    Ok(h)
                }
            })?;
            grads.accumulate(r.params)?;
            g = r.input;
        }
        grads.accumulate(replay(params, &g, || graph.embed(input, &aux, ctx))?)?;
        Ok(grads)
    }
}

impl<M: LayerStack> Encoder for Recomputed<M> {
    type Input = M::Input;

    fn params(&self) -> &Params {
        self.tower.params()
    }

    fn buffers(&self) -> Params {
        self.tower.buffers().clone()
    }

    fn encode(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.tower.detached_model().run(input, ctx)
    }

    fn forward(&self, input: &Self::Input, ctx: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.tower.graph_model().run(input, &self.ctx(ctx))
    }

    fn replay(&self, input: &Self::Input, cotangent: &Tensor, ctx: &Ctx) -> Result<Gradients> {
        let _flush = crate::denormal::flush();
        let ctx = &self.ctx(ctx);
        let layers = self.tower.graph_model().num_layers();
        match self.policy.segments(layers)? {
            None => replay(self.params(), cotangent, || self.forward(input, ctx)),
            Some(segments) => self.replay_segments(&segments, input, cotangent, ctx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_print_as_the_config_writes_them() {
        assert_eq!(Recompute::Off.to_string(), "off");
        assert_eq!(Recompute::Every(2).to_string(), "every(2)");
        assert_eq!(Recompute::Layers(vec![4, 8]).to_string(), "layers([4, 8])");
        assert_eq!(
            Recompute::selective(Recompute::Sqrt, &[]).to_string(),
            "sqrt + attention"
        );
        assert_eq!(
            Recompute::keep(&["intermediate", "attention.probs"]).to_string(),
            "off + selective (keep intermediate, attention.probs)"
        );
    }

    fn starts(p: Recompute, n: usize) -> Vec<usize> {
        p.segments(n)
            .unwrap()
            .unwrap()
            .iter()
            .map(|r| r.start)
            .collect()
    }

    #[test]
    fn segments_cover_the_stack() {
        assert_eq!(Recompute::Off.segments(12).unwrap(), None);
        assert_eq!(starts(Recompute::EveryLayer, 4), vec![0, 1, 2, 3]);
        assert_eq!(starts(Recompute::Every(5), 12), vec![0, 5, 10]);
        assert_eq!(starts(Recompute::Sqrt, 12), vec![0, 3, 6, 9]);
        assert_eq!(starts(Recompute::Sqrt, 24), vec![0, 4, 9, 14, 19]);
        assert_eq!(starts(Recompute::Sqrt, 6), vec![0, 2, 4]);
        assert_eq!(starts(Recompute::Layers(vec![6, 3, 6]), 12), vec![0, 3, 6]);
        let segs = Recompute::Every(5).segments(12).unwrap().unwrap();
        assert_eq!(segs, vec![0..5, 5..10, 10..12]);
        assert_eq!(Recompute::Sqrt.segments(0).unwrap().unwrap(), vec![0..0]);
    }

    #[test]
    fn bad_policies_are_rejected() {
        let e = Recompute::Every(0).validate(12).unwrap_err();
        assert!(e.to_string().contains("at least one layer"), "{e}");
        let e = Recompute::Layers(vec![3, 12]).validate(12).unwrap_err();
        assert!(
            e.to_string().contains("smaller than the number of layers"),
            "{e}"
        );
    }
}
