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

use crate::recompute::Recompute;
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
