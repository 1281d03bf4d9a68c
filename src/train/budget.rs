//! A memory budget for cached steps: measure what the encoder's replay costs per row at
//! start-up (a probe), then pick the largest chunk sizes and the cheapest recompute policy
//! whose predicted peak fits, or refuse before any step runs.
//!
//! The model of a cached step's heap peak (every term measured or counted, none assumed):
//!
//! ```text
//! peak = base + max(loss, resident + replay(policy, chunk), optimizer)
//! ```
//!
//! - `base`: the heap in use before the step (weights, optimizer moments, data).
//! - `resident`: what lives through the replay: both sides' representations and cached
//!   gradients, the running gradient sums, the step's token batches.
//! - `replay(policy, chunk) = fixed + per_row * chunk`: one chunk's replay at the longest
//!   sequence length, measured by replaying probe chunks of two sizes with the policy.
//! - `loss`: the loss and its gradients at the full batch, measured on stand-in
//!   representations of the real shapes (with the loss's row blocks).
//! - `optimizer`: the step's gradients and the optimizer's temporaries, counted.
//!
//! Measurements use [`crate::memory::CountingAllocator`], which must be the global
//! allocator (the `gradcache` binary installs it).

use candle_core::{DType, Device, Tensor};

use crate::batch::TokenBatch;
use crate::encoder::Encoder;
use crate::hub::Tokenizer;
use crate::loss::InfoNce;
use crate::memory;
use crate::models::bert::BertEncoder;
use crate::recompute::Recompute;
use crate::train::config::Config;
use crate::train::model::Model;
use crate::{Error, Result};

/// Parses a byte size: `2GiB`, `512 MiB`, `1.5GB`, `64KiB`, `1000000` (bytes).
/// Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024, decimal ones (`KB`,
/// `MB`, `GB`, `TB`) powers of 1000.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let bad = |reason| Error::InvalidConfig {
        field: "train.memory_budget",
        value: format!("{text:?}"),
        reason,
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (t[..split].trim(), t[split..].trim());
    let value: f64 = number
        .parse()
        .map_err(|_| bad("a size is a number and a unit, e.g. 2GiB or 512MiB"))?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(
                "unknown unit (B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)",
            ))
        }
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0) {
        return Err(bad("the budget must be at least one byte"));
    }
    Ok(bytes as u64)
}

/// One side's replay cost under one policy: `fixed + per_row * rows` bytes above the
/// replay's start, for chunks of `rows` rows at the longest sequence length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCost {
    /// Bytes independent of the chunk (parameter gradients, per-layer constants).
    pub fixed: u64,
    /// Bytes per row of the chunk (its activations).
    pub per_row: u64,
}

impl ReplayCost {
    /// The cost from two measured replays: `small` bytes at `rows_small` rows and `large`
    /// bytes at `rows_large` rows (a straight line through both, never below zero).
    pub fn from_probes(rows_small: usize, small: u64, rows_large: usize, large: u64) -> Self {
        let span = rows_large.saturating_sub(rows_small).max(1) as u64;
        let per_row = large.saturating_sub(small).div_ceil(span);
        let fixed = small.saturating_sub(per_row * rows_small as u64);
        Self { fixed, per_row }
    }

    /// Predicted bytes of a replay of `rows` rows.
    pub fn at(&self, rows: usize) -> u64 {
        self.fixed + self.per_row * rows as u64
    }
}

/// What a policy costs on each side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyCost {
    /// The recompute policy.
    pub policy: Recompute,
    /// The query tower's replay.
    pub query: ReplayCost,
    /// The passage tower's replay.
    pub passage: ReplayCost,
}

/// The parts of a step's peak that do not depend on the chunk size or the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepShape {
    /// Heap bytes in use before a step.
    pub base: u64,
    /// Bytes held through the replay (representations, cached gradients, gradient sums,
    /// token batches).
    pub resident: u64,
    /// Peak of the loss phase above the step's start.
    pub loss: u64,
    /// Peak of the optimizer phase above the step's start.
    pub optimizer: u64,
    /// Rows per step on the query side (this process's share).
    pub query_rows: usize,
    /// Rows per step on the passage side (this process's share).
    pub passage_rows: usize,
    /// Token lengths of the queries of batches like the run's (drawn from a sample of the
    /// data, each shortest first), and the length the replays were probed at. A step
    /// chunks its rows in order of length and pads each chunk to its longest text only, so
    /// a chunk of `c` rows costs what `c * padded / probed` rows at the probed length cost
    /// (a bound: attention grows faster than the length), and the run's peak is the
    /// costliest chunk of its costliest batch. No batches: every chunk at the probed
    /// length.
    pub query_lengths: (Vec<Vec<usize>>, usize),
    /// The same for the passages.
    pub passage_lengths: (Vec<Vec<usize>>, usize),
}

/// [`equivalent_rows`] of the costliest of `batches` (each shortest first); `chunk` when
/// there are none.
pub fn costliest_rows(batches: &[Vec<usize>], probed: usize, chunk: usize) -> usize {
    batches
        .iter()
        .map(|lengths| equivalent_rows(lengths, probed, chunk))
        .max()
        .unwrap_or(chunk)
}

/// Rows at `probed` tokens that the costliest chunk of `chunk` rows weighs, when the
/// rows have `lengths` (shortest first) and each chunk is padded to its longest.
pub fn equivalent_rows(lengths: &[usize], probed: usize, chunk: usize) -> usize {
    if lengths.is_empty() || probed == 0 {
        return chunk;
    }
    lengths
        .chunks(chunk.max(1))
        .map(|c| {
            let padded = c.iter().copied().max().unwrap_or(0).min(probed);
            (c.len() * padded).div_ceil(probed)
        })
        .max()
        .unwrap_or(0)
}

/// The chosen settings and the peak they are predicted to reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Recompute policy.
    pub policy: Recompute,
    /// Query chunk size.
    pub query_chunk: usize,
    /// Passage chunk size.
    pub passage_chunk: usize,
    /// Predicted heap peak of a step, in bytes (base included).
    pub predicted: u64,
}

/// Chunks smaller than this lose more matrix-product speed than a recompute policy costs
/// (the policies cost 1.0-1.4x a step; a chunk of 4 rows runs the products at a fraction
/// of their speed), so a cheaper policy is taken only if it fits chunks this large (or the
/// whole batch, when smaller).
pub const MIN_EFFICIENT_CHUNK: usize = 16;

impl StepShape {
    /// Predicted heap peak with `cost` at chunks `(query, passage)`.
    pub fn predict(&self, cost: &PolicyCost, query: usize, passage: usize) -> u64 {
        let (lq, lp) = (&self.query_lengths, &self.passage_lengths);
        let replay = cost
            .query
            .at(costliest_rows(&lq.0, lq.1, query))
            .max(cost.passage.at(costliest_rows(&lp.0, lp.1, passage)));
        self.base + self.loss.max(self.resident + replay).max(self.optimizer)
    }

    /// The largest chunk of at most `rows` rows whose replay fits `room` bytes (0: none).
    fn largest(
        rows: usize,
        lengths: &(Vec<Vec<usize>>, usize),
        cost: &ReplayCost,
        room: u64,
    ) -> usize {
        let fits = |c: usize| cost.at(costliest_rows(&lengths.0, lengths.1, c)) <= room;
        if !fits(1) {
            return 0;
        }
        // Binary search: the costliest chunk grows with the chunk size.
        let (mut lo, mut hi) = (1, rows.max(1));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Picks the policy and chunk sizes for `budget` bytes among `costs`, listed from the
    /// fastest policy to the leanest: the first policy that fits efficient chunks
    /// ([`MIN_EFFICIENT_CHUNK`]) on both sides, else the one that fits the largest chunks,
    /// each side's chunk as large as fits. Refuses when even the leanest policy cannot fit
    /// chunks of one row, or the loss or the optimizer alone exceed the budget.
    pub fn choose(&self, budget: u64, costs: &[PolicyCost]) -> Result<Plan> {
        let over = |needed: u64, what: String| Error::MemoryBudget {
            budget,
            needed,
            what,
        };
        let floor = self.base + self.loss.max(self.optimizer);
        if floor > budget {
            let what = if self.loss >= self.optimizer {
                "the loss over the whole batch (lower loss.block_rows or train.batch_size)"
            } else {
                "the optimizer step"
            };
            return Err(over(floor, what.into()));
        }
        let room = budget.saturating_sub(self.base + self.resident);
        let want_q = self.query_rows.min(MIN_EFFICIENT_CHUNK);
        let want_p = self.passage_rows.min(MIN_EFFICIENT_CHUNK);
        let mut best: Option<(usize, Plan)> = None;
        for cost in costs {
            let q = Self::largest(self.query_rows, &self.query_lengths, &cost.query, room);
            let p = Self::largest(
                self.passage_rows,
                &self.passage_lengths,
                &cost.passage,
                room,
            );
            if q == 0 || p == 0 {
                continue;
            }
            let plan = Plan {
                policy: cost.policy.clone(),
                query_chunk: q,
                passage_chunk: p,
                predicted: self.predict(cost, q, p),
            };
            if q >= want_q && p >= want_p {
                return Ok(plan);
            }
            if best.as_ref().is_none_or(|(size, _)| q.min(p) > *size) {
                best = Some((q.min(p), plan));
            }
        }
        match best {
            Some((_, plan)) => Ok(plan),
            None => {
                let leanest = costs
                    .last()
                    .ok_or_else(|| over(floor, "no recompute policy to choose from".to_string()))?;
                Err(over(
                    self.predict(leanest, 1, 1),
                    format!(
                        "a chunk of one row with the leanest policy ({:?})",
                        leanest.policy
                    ),
                ))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The trainer's plan: the probes behind `train.memory_budget`

/// A memory plan with the line the log shows.
pub(super) struct MemoryPlan {
    pub(super) policy: Recompute,
    pub(super) query_chunk: usize,
    pub(super) passage_chunk: usize,
    pub(super) predicted: u64,
    pub(super) note: String,
}

/// Rows of the two probe replays per side and policy.
const PROBE_ROWS: (usize, usize) = (2, 6);

/// `train.memory_budget`: measures one replay of each side at the longest text's length
/// for each policy from the fastest to the leanest (off, attention, sqrt + attention,
/// every layer + attention), and the loss at the full batch, then picks the chunk sizes
/// and the policy (above) and sets the policy on the towers. Runs before any
/// file is written; an impossible budget is an error.
pub(super) fn plan_memory(
    cfg: &Config,
    model: &mut Model,
    texts: &[String],
    device: &Device,
    world: usize,
    budget: &str,
) -> Result<MemoryPlan> {
    let budget = parse_bytes(budget)?;
    let invalid = |reason| Error::InvalidConfig {
        field: "train.memory_budget",
        value: memory::human_bytes(budget),
        reason,
    };
    if !device.is_cpu() {
        return Err(invalid(
            "the budget is measured on the CPU heap; on a GPU set train.query_chunk, \
             train.passage_chunk and model.recompute",
        ));
    }
    if memory::current_bytes() == 0 {
        return Err(invalid(
            "measuring needs gradcache::memory::CountingAllocator as the global allocator \
             (the gradcache binary installs it)",
        ));
    }
    let t = &cfg.train;
    let width = model.bert.hidden_size;
    // A mixture's steps are planned for its widest source (the most passages a query).
    let hard_negatives = cfg.widest_hard_negatives();
    let (q_rows, p_rows) = (
        t.batch_size / world,
        t.batch_size / world * (1 + hard_negatives),
    );
    // Chunks are padded to their longest text, so the probes run at the longest text of
    // the training data (a sample of up to 10,000 pairs), within each side's max_len.
    // `texts` holds each pair's query, then its positive.
    let every = (texts.len() / 2).div_ceil(10_000).max(1);
    let side = |first: usize| -> Vec<&str> {
        texts
            .iter()
            .skip(first)
            .step_by(2 * every)
            .map(String::as_str)
            .collect()
    };
    let (q_sample, p_sample) = (side(0), side(1));
    // Every sampled text's token length on one side (within its max_len).
    let sample_lengths = |sample: &[&str], max_len: usize| -> Result<Vec<usize>> {
        let mut all = Vec::with_capacity(sample.len());
        for texts in sample.chunks(1024) {
            let b = Tokenizer::new(model.tokenizer.clone(), max_len)?.encode(texts, device)?;
            let m = b
                .attention_mask
                .to_dtype(DType::U32)?
                .sum(1)?
                .to_vec1::<u32>()?;
            all.extend(m.into_iter().map(|l| l as usize));
        }
        Ok(all)
    };
    let (q_all, p_all) = (
        sample_lengths(&q_sample, model.query_max_len)?,
        sample_lengths(&p_sample, model.passage_max_len)?,
    );
    let longest = |all: &[usize], max_len| all.iter().copied().max().unwrap_or(max_len);
    let (q_len, p_len) = (
        longest(&q_all, model.query_max_len),
        longest(&p_all, model.passage_max_len),
    );
    // Batches like the run's, each shortest first: `rows` lengths drawn from the sample,
    // as many batches as the run has steps (at most 1,000), from the run's seed. The
    // run's peak is its costliest chunk, in its batch with the most long texts.
    let batches = |all: &[usize], rows: usize, side: u64| -> Vec<Vec<usize>> {
        use rand::{Rng, SeedableRng};
        if all.is_empty() {
            return Vec::new();
        }
        let mut rng =
            rand_chacha::ChaCha8Rng::seed_from_u64(crate::rng::derive_seed(&[cfg.seed, side]));
        (0..t.steps.clamp(1, 1000))
            .map(|_| {
                let mut batch: Vec<usize> = (0..rows)
                    .map(|_| all[rng.random_range(0..all.len())])
                    .collect();
                batch.sort_unstable();
                batch
            })
            .collect()
    };
    let vocab = model.bert.vocab_size as u32;
    let probe_batch = |rows: usize, len: usize| -> Result<TokenBatch> {
        let ids: Vec<u32> = (0..rows * len)
            .map(|i| 1 + (i as u32).wrapping_mul(2_654_435_761) % (vocab - 1).max(1))
            .collect();
        let ids = Tensor::from_vec(ids, (rows, len), device)?;
        TokenBatch::new(ids.clone(), ids.ones_like()?, ids.zeros_like()?)
    };
    let ctx = crate::Ctx::train(crate::ChunkSeed {
        run: cfg.seed,
        step: 0,
        rank: 0,
        tower: 0,
        chunk: 0,
    });
    // Peak bytes of one replay of `rows` rows of `len` tokens (with `warm`, the second of
    // two runs, so that one-time allocations are not counted).
    let replay_bytes = |enc: &BertEncoder, rows: usize, len: usize, warm: bool| -> Result<u64> {
        let batch = probe_batch(rows, len)?;
        let cot = Tensor::ones((rows, width), DType::F32, device)?;
        if warm {
            enc.replay(&batch, &cot, &ctx)?;
        }
        let (_, peak, grads) = memory::measure(|| enc.replay(&batch, &cot, &ctx));
        grads?;
        Ok(peak as u64)
    };
    let policies = [
        Recompute::Off,
        Recompute::Attention,
        Recompute::selective(Recompute::Sqrt, &[]),
        Recompute::selective(Recompute::EveryLayer, &[]),
    ];
    let (small, large) = PROBE_ROWS;
    let mut costs = Vec::new();
    for policy in &policies {
        model.query.set_policy(policy.clone())?;
        if let Some(p) = &mut model.passage {
            p.set_policy(policy.clone())?;
        }
        let side = |enc: &BertEncoder, len| -> Result<ReplayCost> {
            let a = replay_bytes(enc, small, len, true)?;
            let b = replay_bytes(enc, large, len, false)?;
            Ok(ReplayCost::from_probes(small, a, large, b))
        };
        let query = side(&model.query, q_len)?;
        let passage = side(model.passage.as_ref().unwrap_or(&model.query), p_len)?;
        costs.push(PolicyCost {
            policy: policy.clone(),
            query,
            passage,
        });
    }
    // The loss at the full (global) batch on stand-in representations of its shapes.
    let global_q = t.batch_size;
    let global_p = global_q * (1 + cfg.widest_hard_negatives());
    let reps =
        |rows, seed| crate::rng::normal(seed, 0.0, 1.0, &(rows, width).into(), DType::F32, device);
    let (rq, rp) = (reps(global_q, 1)?, reps(global_p, 2)?);
    let loss = InfoNce::new(cfg.loss.temperature)?
        .with_similarity(cfg.loss.similarity)
        .with_symmetric(cfg.loss.symmetric)
        .with_directions(&cfg.loss.directions)?
        .with_block_rows((cfg.loss.block_rows > 0).then_some(cfg.loss.block_rows))?;
    let (_, loss_peak, value) = memory::measure(|| {
        use crate::loss::Loss;
        loss.value_and_grads(&rq, &rp)
    });
    value?;
    drop((rq, rp));
    let rep_bytes = ((global_q + global_p) * width * 4) as u64;
    let param_bytes = (model.store.params().elem_count() * 4) as u64;
    let moments = match cfg.optim.kind() {
        crate::train::optim::OptimizerKind::AdamW { .. } => 2 * param_bytes,
        crate::train::optim::OptimizerKind::Sgd => 0,
    };
    let tokens = ((q_rows * q_len + p_rows * p_len) * 3 * 4) as u64;
    let shape = StepShape {
        base: memory::current_bytes() as u64 + moments,
        // Representations and cached gradients of the whole batch, the running gradient
        // sums, the token batches.
        resident: 2 * rep_bytes + param_bytes + tokens,
        loss: rep_bytes + loss_peak as u64,
        // The step's gradients and the update's temporaries.
        optimizer: 3 * param_bytes,
        query_rows: q_rows,
        passage_rows: p_rows,
        query_lengths: (batches(&q_all, q_rows, 0), q_len),
        passage_lengths: (batches(&p_all, p_rows, 1), p_len),
    };
    // The line through the probes is a prediction; a replay at the chosen chunk sizes is
    // a measurement. Shrink a side whose replay does not fit, and measure again; a policy
    // that still does not fit gives way to the next leaner one.
    let room = budget.saturating_sub(shape.base + shape.resident);
    let mut candidates = costs.clone();
    let plan = loop {
        let mut plan = shape.choose(budget, &candidates)?;
        model.query.set_policy(plan.policy.clone())?;
        if let Some(p) = &mut model.passage {
            p.set_policy(plan.policy.clone())?;
        }
        let passage_enc = model.passage.as_ref().unwrap_or(&model.query);
        for _ in 0..6 {
            let (lq, lp) = (&shape.query_lengths, &shape.passage_lengths);
            let rows_q = costliest_rows(&lq.0, lq.1, plan.query_chunk).max(1);
            let rows_p = costliest_rows(&lp.0, lp.1, plan.passage_chunk).max(1);
            let q = replay_bytes(&model.query, rows_q, q_len, false)?;
            let p = replay_bytes(passage_enc, rows_p, p_len, false)?;
            let at = |fixed| ReplayCost { fixed, per_row: 0 };
            let measured = PolicyCost {
                policy: plan.policy.clone(),
                query: at(q),
                passage: at(p),
            };
            plan.predicted = shape.predict(&measured, 0, 0);
            if plan.predicted <= budget {
                break;
            }
            let shrink = |chunk: usize, bytes: u64| -> usize {
                if bytes <= room {
                    chunk
                } else {
                    ((chunk as u64 * room / bytes.max(1)) as usize).clamp(1, chunk.max(2) - 1)
                }
            };
            let (qc, pc) = (shrink(plan.query_chunk, q), shrink(plan.passage_chunk, p));
            if (qc, pc) == (plan.query_chunk, plan.passage_chunk) {
                break;
            }
            (plan.query_chunk, plan.passage_chunk) = (qc, pc);
        }
        if plan.predicted <= budget {
            break plan;
        }
        if candidates.len() <= 1 {
            return Err(Error::MemoryBudget {
                budget,
                needed: plan.predicted,
                what: format!(
                    "a step with recompute {} at chunks {}/{}",
                    plan.policy, plan.query_chunk, plan.passage_chunk
                ),
            });
        }
        candidates.retain(|c| c.policy != plan.policy);
    };
    let cost = costs
        .iter()
        .find(|c| c.policy == plan.policy)
        .map_or(0, |c| c.query.per_row.max(c.passage.per_row));
    let note = format!(
        "memory budget {}: recompute {}, chunks {}/{}, predicted peak {} (weights and \
         optimizer {}, replay {} per row at {} tokens, loss {})",
        memory::human_bytes(budget),
        plan.policy,
        plan.query_chunk,
        plan.passage_chunk,
        memory::human_bytes(plan.predicted),
        memory::human_bytes(shape.base),
        memory::human_bytes(cost),
        q_len.max(p_len),
        memory::human_bytes(shape.loss),
    );
    Ok(MemoryPlan {
        policy: plan.policy,
        query_chunk: plan.query_chunk,
        passage_chunk: plan.passage_chunk,
        predicted: plan.predicted,
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_weigh_their_padded_length() {
        // Ten rows, shortest first; probed at 10 tokens.
        let lengths = [2, 2, 3, 3, 4, 4, 5, 8, 10, 10];
        assert_eq!(equivalent_rows(&lengths, 10, 10), 10);
        // Chunks of 4: [2,2,3,3] -> 4*3/10 = 2, [4,4,5,8] -> 4*8/10 = 4, [10,10] -> 2.
        assert_eq!(equivalent_rows(&lengths, 10, 4), 4);
        assert_eq!(equivalent_rows(&lengths, 10, 1), 1);
        assert_eq!(equivalent_rows(&[], 10, 7), 7);
        // The costliest batch counts: one with longer texts weighs more.
        let long = [6, 6, 7, 7, 8, 9, 9, 10, 10, 10];
        assert_eq!(costliest_rows(&[lengths.to_vec()], 10, 4), 4);
        assert_eq!(costliest_rows(&[lengths.to_vec(), long.to_vec()], 10, 8), 8);
        assert_eq!(equivalent_rows(&lengths, 10, 8), 7);
        assert_eq!(costliest_rows(&[], 10, 8), 8);
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes(" 512 MiB ").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("64kib").unwrap(), 64 << 10);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        for bad in ["", "GiB", "2 GiBs", "-1GiB", "0", "1e9"] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("train.memory_budget"), "{bad}: {e}");
        }
    }

    fn cost(policy: Recompute, fixed: u64, per_row: u64) -> PolicyCost {
        let side = ReplayCost { fixed, per_row };
        PolicyCost {
            policy,
            query: side,
            passage: side,
        }
    }

    #[test]
    fn the_fastest_policy_that_fits_efficient_chunks_wins() {
        let shape = StepShape {
            base: 100,
            resident: 50,
            loss: 40,
            optimizer: 30,
            query_rows: 64,
            passage_rows: 64,
            query_lengths: (vec![], 0),
            passage_lengths: (vec![], 0),
        };
        let costs = [
            cost(Recompute::Off, 10, 10),
            cost(Recompute::Attention, 10, 5),
            cost(Recompute::EveryLayer, 10, 1),
        ];
        // Room 1000 - 150 = 850: off fits 84 rows -> the whole batch of 64.
        let plan = shape.choose(1000, &costs).unwrap();
        assert_eq!(
            (plan.policy.clone(), plan.query_chunk),
            (Recompute::Off, 64)
        );
        assert_eq!(plan.predicted, 100 + 50 + 10 + 640);
        // Room 250 - 150 = 100: off fits 9 rows, attention 18 -> attention.
        let plan = shape.choose(250, &costs).unwrap();
        assert_eq!(
            (plan.policy.clone(), plan.query_chunk),
            (Recompute::Attention, 18)
        );
        assert!(plan.predicted <= 250);
        // Room 40: off 3, attention 6, every layer 30 -> every layer.
        let plan = shape.choose(190, &costs).unwrap();
        assert_eq!(
            (plan.policy.clone(), plan.query_chunk),
            (Recompute::EveryLayer, 30)
        );
        // Room 15: only every layer fits, at 5 rows (below the efficient size).
        let plan = shape.choose(165, &costs).unwrap();
        assert_eq!(
            (plan.policy.clone(), plan.query_chunk),
            (Recompute::EveryLayer, 5)
        );
        // Nothing fits one row.
        let e = shape.choose(155, &costs).unwrap_err().to_string();
        assert!(e.contains("a chunk of one row"), "{e}");
        // The loss alone is over the budget: base 100 + loss 40 > 135.
        let e = shape.choose(135, &costs).unwrap_err();
        assert!(matches!(e, Error::MemoryBudget { needed: 140, .. }), "{e}");
        assert!(e.to_string().contains("the loss"), "{e}");
    }
}
