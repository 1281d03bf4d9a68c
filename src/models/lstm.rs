//! An LSTM text tower whose backward through time is checkpointed in segments of time
//! steps (Chen et al. 2016, section 4: `ceil(sqrt(T))` segments hold the memory of a
//! recurrent net to `O(sqrt(T))` states plus one segment's activations).
//!
//! Token embeddings, `layers` stacked LSTM layers (PyTorch's `nn.LSTM` cell and parameter
//! names: `weight_ih_l{k}`, `weight_hh_l{k}`, `bias_ih_l{k}`, `bias_hh_l{k}`, gates in the
//! order input, forget, cell, output), masked mean pooling over the real tokens or the
//! state after the last real token, and a linear projection. Padding steps leave the
//! state unchanged.
//!
//! The backward through time is written by hand ([`LstmEncoder::replay`]): the weights are
//! shared by every time step, so an autograd backward per segment would sum each
//! segment's weight gradient on its own and add the sums, a different rounding from one
//! backward over all steps. Here the weight gradients are one running sum, step by step
//! from the last to the first, continued across segments, so every policy gives `Off`'s
//! gradients bit for bit. [`Encoder::forward`] is the same computation composed of candle
//! operations with autograd: the reference the hand-written backward is tested against.

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::batch::TokenBatch;
use crate::dropout::Ctx;
use crate::encoder::{Encoder, Tower};
use crate::nn::Linear;
use crate::params::{Gradients, Params};
use crate::recompute::Recompute;
use crate::replay::replay_with_input;
use crate::{Error, Result};

/// How the per-token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LstmPooling {
    /// Mean of the top layer's states over the real tokens.
    #[default]
    Mean,
    /// The top layer's state after the last real token.
    Last,
}

/// Sizes of an [`Lstm`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LstmConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Token embedding width.
    pub embedding_size: usize,
    /// State width of every layer.
    pub hidden_size: usize,
    /// Stacked LSTM layers.
    pub num_layers: usize,
    /// Mean or last-state pooling.
    pub pooling: LstmPooling,
    /// Representation width (the projection).
    pub output: usize,
}

impl Default for LstmConfig {
    fn default() -> Self {
        Self {
            vocab_size: 1000,
            embedding_size: 64,
            hidden_size: 128,
            num_layers: 1,
            pooling: LstmPooling::Mean,
            output: 64,
        }
    }
}

/// One layer's weights and their names in the store.
struct Cell {
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
    names: [String; 4],
}

/// What the backward of one step of one layer reads.
struct StepCache {
    x: Tensor,
    h_prev: Tensor,
    c_prev: Tensor,
    i: Tensor,
    f: Tensor,
    g: Tensor,
    o: Tensor,
    tanh_c: Tensor,
}

/// The recurrent state between two time steps: per layer `h` and `c` `[rows, hidden]`,
/// and for mean pooling the running masked sum of the top layer's states.
#[derive(Clone)]
struct State {
    h: Vec<Tensor>,
    c: Vec<Tensor>,
    sum: Option<Tensor>,
}

/// The LSTM tower's weights (built over a `VarBuilder`; see [`LstmEncoder`]).
pub struct Lstm {
    cfg: LstmConfig,
    embedding: Tensor,
    embedding_name: String,
    cells: Vec<Cell>,
    proj: Linear,
}

impl Lstm {
    /// Builds the tower with parameters `embedding.weight`, `lstm.*` (PyTorch's names) and
    /// `proj.*` under `vb`, initialised as PyTorch does (uniform in `+-1/sqrt(hidden)`).
    pub fn new(cfg: &LstmConfig, vb: VarBuilder) -> Result<Self> {
        if cfg.vocab_size == 0
            || cfg.embedding_size == 0
            || cfg.hidden_size == 0
            || cfg.num_layers == 0
            || cfg.output == 0
        {
            return Err(Error::InvalidConfig {
                field: "lstm",
                value: format!("{cfg:?}"),
                reason: "every size must be positive",
            });
        }
        let h = cfg.hidden_size;
        let bound = 1.0 / (h as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let lstm = vb.pp("lstm");
        let cells = (0..cfg.num_layers)
            .map(|k| {
                let input = if k == 0 { cfg.embedding_size } else { h };
                let names = [
                    format!("weight_ih_l{k}"),
                    format!("weight_hh_l{k}"),
                    format!("bias_ih_l{k}"),
                    format!("bias_hh_l{k}"),
                ];
                let full = |n: &str| {
                    let p = lstm.prefix();
                    if p.is_empty() {
                        n.to_string()
                    } else {
                        format!("{p}.{n}")
                    }
                };
                Ok(Cell {
                    w_ih: lstm.get_with_hints((4 * h, input), &names[0], init)?,
                    w_hh: lstm.get_with_hints((4 * h, h), &names[1], init)?,
                    b_ih: lstm.get_with_hints(4 * h, &names[2], init)?,
                    b_hh: lstm.get_with_hints(4 * h, &names[3], init)?,
                    names: names.map(|n| full(&n)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embedding_name = match vb.prefix().as_str() {
            "" => "embedding.weight".to_string(),
            p => format!("{p}.embedding.weight"),
        };
        let embedding = vb.pp("embedding").get_with_hints(
            (cfg.vocab_size, cfg.embedding_size),
            "weight",
            Init::Randn {
                mean: 0.,
                stdev: 1.,
            },
        )?;
        Ok(Self {
            cfg: *cfg,
            embedding,
            embedding_name,
            cells,
            proj: Linear::new(h, cfg.output, vb.pp("proj"))?,
        })
    }

    /// Token embeddings, time-major `[steps, rows, embedding]`.
    fn embed(&self, batch: &TokenBatch) -> Result<Tensor> {
        let ids = batch.input_ids.t()?.contiguous()?;
        let (steps, rows) = ids.dims2()?;
        let flat = self.embedding.index_select(&ids.flatten_all()?, 0)?;
        Ok(flat.reshape((steps, rows, self.cfg.embedding_size))?)
    }

    /// The real-token mask, time-major `[steps, rows, 1]`, f32.
    fn mask(batch: &TokenBatch) -> Result<Tensor> {
        Ok(batch
            .attention_mask
            .t()?
            .to_dtype(DType::F32)?
            .unsqueeze(D::Minus1)?
            .contiguous()?)
    }

    fn initial_state(&self, rows: usize, like: &Tensor) -> Result<State> {
        let zero = Tensor::zeros((rows, self.cfg.hidden_size), DType::F32, like.device())?;
        let layers = self.cfg.num_layers;
        Ok(State {
            h: vec![zero.clone(); layers],
            c: vec![zero.clone(); layers],
            sum: (self.cfg.pooling == LstmPooling::Mean).then_some(zero),
        })
    }

    /// One step of layer `k`: the new `h`, `c` (before masking) and what the backward reads.
    fn cell(&self, k: usize, x: &Tensor, h: &Tensor, c: &Tensor) -> Result<(Tensor, StepCache)> {
        let cell = &self.cells[k];
        let hs = self.cfg.hidden_size;
        let gates = x
            .matmul(&cell.w_ih.t()?)?
            .add(&h.matmul(&cell.w_hh.t()?)?)?
            .broadcast_add(&(&cell.b_ih + &cell.b_hh)?)?;
        let i = candle_nn::ops::sigmoid(&gates.narrow(1, 0, hs)?)?;
        let f = candle_nn::ops::sigmoid(&gates.narrow(1, hs, hs)?)?;
        let g = gates.narrow(1, 2 * hs, hs)?.tanh()?;
        let o = candle_nn::ops::sigmoid(&gates.narrow(1, 3 * hs, hs)?)?;
        let c_new = ((&f * c)? + (&i * &g)?)?;
        let tanh_c = c_new.tanh()?;
        let cache = StepCache {
            x: x.clone(),
            h_prev: h.clone(),
            c_prev: c.clone(),
            i,
            f,
            g,
            o,
            tanh_c,
        };
        Ok((c_new, cache))
    }

    /// Advances `state` by step `t` (all layers); returns the step's caches when asked.
    fn step(
        &self,
        state: &mut State,
        x: &Tensor,
        m: &Tensor,
        keep: bool,
    ) -> Result<Vec<StepCache>> {
        let mut caches = Vec::new();
        let mut input = x.clone();
        let stay = m.affine(-1., 1.)?;
        for k in 0..self.cfg.num_layers {
            let (c_new, cache) = self.cell(k, &input, &state.h[k], &state.c[k])?;
            let h_new = (&cache.o * &cache.tanh_c)?;
            // Padding steps leave the state as it was: s = s + m (s_new - s).
            let h = blend(m, &stay, &h_new, &state.h[k])?;
            let c = blend(m, &stay, &c_new, &state.c[k])?;
            state.h[k] = h.clone();
            state.c[k] = c;
            input = h;
            if keep {
                caches.push(cache);
            }
        }
        if let Some(sum) = &state.sum {
            state.sum = Some((sum + input.broadcast_mul(m)?)?);
        }
        Ok(caches)
    }

    /// The pooled top-layer state `[rows, hidden]` of the final state.
    fn pooled(&self, state: &State, count: &Tensor) -> Result<Tensor> {
        Ok(match &state.sum {
            Some(sum) => sum.broadcast_div(count)?,
            None => state.h[self.cfg.num_layers - 1].clone(),
        })
    }

    /// Real tokens per row `[rows, 1]` (at least 1).
    fn count(mask: &Tensor) -> Result<Tensor> {
        Ok(mask.sum(0)?.maximum(1f32)?)
    }

    /// The whole forward, composed of candle operations (a graph when the weights are
    /// variables).
    fn run(&self, batch: &TokenBatch) -> Result<Tensor> {
        let x = self.embed(batch)?;
        let mask = Self::mask(batch)?;
        let mut state = self.initial_state(batch.input_ids.dim(0)?, &x)?;
        for t in 0..x.dim(0)? {
            self.step(&mut state, &x.get(t)?, &mask.get(t)?, false)?;
        }
        self.proj
            .forward(&self.pooled(&state, &Self::count(&mask)?)?)
    }
}

/// `m * new + stay * old` for a 0/1 mask `m` `[rows, 1]` and `stay = 1 - m`.
fn blend(m: &Tensor, stay: &Tensor, new: &Tensor, old: &Tensor) -> Result<Tensor> {
    Ok((new.broadcast_mul(m)? + old.broadcast_mul(stay)?)?)
}

fn add_into(acc: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (a + g)?,
        None => g,
    });
    Ok(())
}

/// The LSTM tower as an [`Encoder`], with its backward through time checkpointed by a
/// segment policy over time steps (`off`, `every_layer` = every step, `every(k)`, `sqrt`,
/// `layers([..])` = before the listed steps).
pub struct LstmEncoder {
    tower: Tower<Lstm>,
    policy: Recompute,
}

impl LstmEncoder {
    /// Wraps a built tower; selective (sub-layer) policies are refused.
    pub fn new(tower: Tower<Lstm>, policy: Recompute) -> Result<Self> {
        policy.recomputed_sites(&[])?;
        Ok(Self { tower, policy })
    }

    /// The policy.
    pub fn policy(&self) -> &Recompute {
        &self.policy
    }

    /// Changes the policy.
    pub fn set_policy(&mut self, policy: Recompute) -> Result<()> {
        policy.recomputed_sites(&[])?;
        self.policy = policy;
        Ok(())
    }

    /// The underlying tower.
    pub fn tower(&self) -> &Tower<Lstm> {
        &self.tower
    }

    /// The hand-written backward through `steps` (descending) of one segment whose step
    /// caches are `caches[t - start]`: updates the running weight gradients, the
    /// recurrent gradients `dh`, `dc`, and writes the input gradients into `dx[t]`.
    #[allow(clippy::too_many_arguments)]
    fn backward_segment(
        &self,
        model: &Lstm,
        start: usize,
        caches: &[Vec<StepCache>],
        mask: &Tensor,
        dsum: Option<&Tensor>,
        back: &mut Backward,
    ) -> Result<()> {
        let layers = model.cfg.num_layers;
        for (offset, step) in caches.iter().enumerate().rev() {
            let t = start + offset;
            let m = mask.get(t)?;
            let keep = m.affine(-1., 1.)?;
            if let Some(dsum) = dsum {
                back.dh[layers - 1] = (&back.dh[layers - 1] + dsum.broadcast_mul(&m)?)?;
            }
            for k in (0..layers).rev() {
                let s = &step[k];
                let cell = &model.cells[k];
                let (dh_out, dc_out) = (&back.dh[k], &back.dc[k]);
                // s = m new + (1 - m) old.
                let dh_new = dh_out.broadcast_mul(&m)?;
                let dc_new = dc_out.broadcast_mul(&m)?;
                let dh_keep = dh_out.broadcast_mul(&keep)?;
                let dc_keep = dc_out.broadcast_mul(&keep)?;
                // h = o tanh(c).
                let d_o = (&dh_new * &s.tanh_c)?;
                let one_minus_tc2 = s.tanh_c.sqr()?.affine(-1., 1.)?;
                let dc = (dc_new + ((&dh_new * &s.o)? * one_minus_tc2)?)?;
                // c = f c_prev + i g.
                let d_f = (&dc * &s.c_prev)?;
                let d_i = (&dc * &s.g)?;
                let d_g = (&dc * &s.i)?;
                let dc_prev = ((&dc * &s.f)? + dc_keep)?;
                let sig = |d: &Tensor, y: &Tensor| -> Result<Tensor> {
                    Ok((d * (y * y.affine(-1., 1.)?)?)?)
                };
                let dgates = Tensor::cat(
                    &[
                        sig(&d_i, &s.i)?,
                        sig(&d_f, &s.f)?,
                        (d_g * s.g.sqr()?.affine(-1., 1.)?)?,
                        sig(&d_o, &s.o)?,
                    ],
                    1,
                )?;
                let dgt = dgates.t()?;
                add_into(&mut back.w_ih[k], dgt.matmul(&s.x)?)?;
                add_into(&mut back.w_hh[k], dgt.matmul(&s.h_prev)?)?;
                add_into(&mut back.b[k], dgates.sum(0)?)?;
                let dx = dgates.matmul(&cell.w_ih)?;
                back.dh[k] = (dgates.matmul(&cell.w_hh)? + dh_keep)?;
                back.dc[k] = dc_prev;
                if k > 0 {
                    back.dh[k - 1] = (&back.dh[k - 1] + dx)?;
                } else {
                    back.dx.slice_set(&dx.unsqueeze(0)?, 0, t)?;
                }
            }
        }
        Ok(())
    }
}

/// The running sums of the backward through time.
struct Backward {
    dh: Vec<Tensor>,
    dc: Vec<Tensor>,
    w_ih: Vec<Option<Tensor>>,
    w_hh: Vec<Option<Tensor>>,
    b: Vec<Option<Tensor>>,
    /// Gradient of the token embeddings, time-major `[steps, rows, embedding]`.
    dx: Tensor,
}

impl Encoder for LstmEncoder {
    type Input = TokenBatch;

    fn params(&self) -> &Params {
        self.tower.params()
    }

    fn encode(&self, input: &TokenBatch, _: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.tower.detached_model().run(input)
    }

    fn forward(&self, input: &TokenBatch, _: &Ctx) -> Result<Tensor> {
        let _flush = crate::denormal::flush();
        self.tower.graph_model().run(input)
    }

    fn replay(&self, input: &TokenBatch, cotangent: &Tensor, _: &Ctx) -> Result<Gradients> {
        let _flush = crate::denormal::flush();
        let (model, graph) = (self.tower.detached_model(), self.tower.graph_model());
        let params = self.tower.params();
        let x = model.embed(input)?;
        let mask = Lstm::mask(input)?;
        let count = Lstm::count(&mask)?;
        let steps = x.dim(0)?;
        let rows = input.input_ids.dim(0)?;
        let segments = match self.policy.segments(steps)? {
            Some(segments) => segments,
            None => std::iter::once(0..steps).collect(),
        };

        // Forward without a graph: with no checkpointing keep every step's caches, else
        // only the state at the start of each segment.
        let off = segments.len() == 1;
        let mut state = model.initial_state(rows, &x)?;
        let mut boundaries = Vec::with_capacity(segments.len());
        let mut kept = Vec::new();
        for segment in &segments {
            boundaries.push(state.clone());
            for t in segment.clone() {
                let caches = model.step(&mut state, &x.get(t)?, &mask.get(t)?, off)?;
                if off {
                    kept.push(caches);
                }
            }
        }

        // The head (pooling is linear in the states and done by hand below).
        let pooled = model.pooled(&state, &count)?;
        let head = replay_with_input(params, &pooled, cotangent, |p| graph.proj.forward(p))?;
        let mut grads = head.params;
        let layers = model.cfg.num_layers;
        let zero = pooled.zeros_like()?;
        let mut back = Backward {
            dh: vec![zero.clone(); layers],
            dc: vec![zero; layers],
            w_ih: vec![None; layers],
            w_hh: vec![None; layers],
            b: vec![None; layers],
            dx: x.zeros_like()?,
        };
        let dsum = match model.cfg.pooling {
            LstmPooling::Mean => Some(head.input.broadcast_div(&count)?),
            LstmPooling::Last => {
                back.dh[layers - 1] = head.input.clone();
                None
            }
        };

        // Backward through time, segment by segment from the last.
        for (segment, start) in segments.iter().zip(boundaries).rev() {
            let caches = if off {
                std::mem::take(&mut kept)
            } else {
                let mut s = start;
                segment
                    .clone()
                    .map(|t| model.step(&mut s, &x.get(t)?, &mask.get(t)?, true))
                    .collect::<Result<Vec<_>>>()?
            };
            self.backward_segment(
                model,
                segment.start,
                &caches,
                &mask,
                dsum.as_ref(),
                &mut back,
            )?;
        }

        for (k, cell) in model.cells.iter().enumerate() {
            let [w_ih, w_hh, b_ih, b_hh] = &cell.names;
            let w = back.w_ih[k].take();
            let u = back.w_hh[k].take();
            let b = back.b[k].take();
            if let (Some(w), Some(u), Some(b)) = (w, u, b) {
                grads.accumulate(Gradients::from_iter([
                    (w_ih.clone(), w),
                    (w_hh.clone(), u),
                    (b_ih.clone(), b.clone()),
                    (b_hh.clone(), b),
                ]))?;
            }
        }
        // The embedding lookup's backward: scatter-add the input gradients into the rows of
        // their tokens (by hand, saving the copies of `[steps, rows, embedding]` an autograd
        // replay of the lookup would make).
        let ids = input.input_ids.t()?.flatten_all()?;
        let dx = back
            .dx
            .reshape((ids.elem_count(), model.cfg.embedding_size))?;
        let d_embedding = model.embedding.zeros_like()?.index_add(&ids, &dx, 0)?;
        grads.accumulate(Gradients::from_iter([(
            model.embedding_name.clone(),
            d_embedding,
        )]))?;
        Ok(grads)
    }
}
