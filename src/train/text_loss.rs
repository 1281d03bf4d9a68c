//! The loss of a text-pair run: InfoNCE over single vectors (with its Matryoshka
//! widths); over MaxSim scores of token matrices for a multi-vector model; or, with
//! `[loss.distillation]`, the KL divergence from the data's teacher scores to a
//! multi-vector model's; or, for a sparse model, InfoNCE on dot products plus the FLOPS
//! regularisers of `[loss.splade]`.

use candle_core::{Device, Tensor};

use crate::dist::Collective;
use crate::hub::multi_vector::MultiVectorHead;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::loss::{
    Flops, GroupObjective, GroupScores, Guide, InfoNce, Loss, LossValue, Matryoshka, MaxSim,
    MaxSimDistillation, SpladeLoss, TeacherScores, WeightScale, Weighted,
};
use crate::params::Params;
use crate::train::config::Config;
use crate::train::config::DistillKind;
use crate::train::config::SpladeConfig;
use crate::train::data::TextBatch;
use crate::train::sources::Source;
use crate::Result;
use crate::Similarity;

/// What a text-pair run minimises.
pub enum TextLoss {
    /// Single vectors.
    InfoNce(Matryoshka<InfoNce>),
    /// Single vectors with a distillation term or without in-batch negatives: a weighted
    /// sum of InfoNCE (over the batch, or over each query's own passages) and the
    /// distillation of the teacher's scores.
    Scores(Weighted),
    /// Token matrices (ColBERT).
    MaxSim(MaxSim),
    /// Token matrices learning a teacher's scores (PyLate's distillation).
    Distillation(MaxSimDistillation),
    /// Sparse (SPLADE) vectors: InfoNCE on dot products (or distillation) plus the FLOPS
    /// regularisers.
    Splade(SpladeLoss<Weighted>),
    /// A mixture whose sources train with different losses: the loss of the source of the
    /// batch at hand ([`ActiveSource`]).
    PerSource(Vec<TextLoss>, ActiveSource),
}

/// The source of the batch being trained on (its index among the run's sources), set by
/// the task before each step; a [`TextLoss::PerSource`] reads it. Clones share it.
#[derive(Clone, Default, Debug)]
pub struct ActiveSource(Arc<AtomicUsize>);

impl ActiveSource {
    /// Sets the source of the next step.
    pub fn set(&self, source: usize) {
        self.0.store(source, Ordering::Relaxed);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

impl TextLoss {
    /// The loss of a run over `sources`: one loss when every source trains alike, else one
    /// per source behind the returned [`ActiveSource`]. Over `multi_vector`'s token
    /// matrices when the model is one, judging false negatives by the `guide` cell's
    /// embeddings when it has one.
    pub(super) fn for_sources(
        cfg: &Config,
        sources: &[&Source],
        multi_vector: Option<&MultiVectorHead>,
        guide: Option<Guide>,
        inference_free: bool,
    ) -> Result<(Self, ActiveSource)> {
        let active = ActiveSource::default();
        let teacher = TeacherScores::new();
        let scale = WeightScale::new();
        let alike = sources.windows(2).all(|w| {
            (
                w[0].symmetric,
                &w[0].directions,
                w[0].in_batch,
                w[0].distill,
            ) == (
                w[1].symmetric,
                &w[1].directions,
                w[1].in_batch,
                w[1].distill,
            )
        });
        if alike || sources.len() < 2 {
            let source = sources.first().ok_or(crate::Error::EmptyBatch {
                side: crate::Side::Query,
            })?;
            let loss = Self::for_source(
                cfg,
                source,
                multi_vector,
                guide,
                inference_free,
                (&teacher, &scale),
            )?;
            return Ok((loss, active));
        }
        let losses = sources
            .iter()
            .map(|s| {
                Self::for_source(
                    cfg,
                    s,
                    multi_vector,
                    guide.clone(),
                    inference_free,
                    (&teacher, &scale),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((TextLoss::PerSource(losses, active.clone()), active))
    }

    /// The loss `cfg` asks for on the batches of `source` (its symmetric term, directions,
    /// in-batch negatives and distillation), reading teacher scores from `teacher`.
    fn for_source(
        cfg: &Config,
        source: &Source,
        multi_vector: Option<&MultiVectorHead>,
        guide: Option<Guide>,
        inference_free: bool,
        (teacher, scale): (&TeacherScores, &WeightScale),
    ) -> Result<Self> {
        let l = &cfg.loss;
        let distillation = l.distillation.as_ref().filter(|_| source.distill);
        // A multi-vector source's loss settings are refused by `Config::validate`.
        if let Some(head) = multi_vector {
            return Ok(match distillation {
                Some(d) => TextLoss::Distillation(
                    MaxSimDistillation::new(head.dim, teacher.clone())?
                        .with_normalized_scores(d.normalize_scores)
                        .with_teacher_temperature(d.teacher_temperature)?,
                ),
                None => TextLoss::MaxSim(MaxSim::new(head.dim)?.with_temperature(l.temperature)?),
            });
        }
        let sparse = cfg.model.sparse.is_some();
        let similarity = if sparse {
            Similarity::Dot
        } else {
            l.similarity
        };
        // Unset: the loss chooses (the CPU kernel's blocks, or the composed path's that
        // fit).
        let block = (l.block_rows > 0).then_some(l.block_rows);
        let in_batch = InfoNce::new(l.temperature)?
            .with_similarity(similarity)
            .with_symmetric(source.symmetric)
            .with_directions(&source.directions)?
            .with_block_rows(block)?
            .with_false_negative_margin(l.false_negative_margin)?
            .with_guide(guide);
        let contrastive: Box<dyn Loss> = if !source.in_batch {
            Box::new(GroupScores::new(
                GroupObjective::InfoNce {
                    temperature: l.temperature,
                },
                similarity,
                teacher.clone(),
            )?)
        } else if sparse {
            Box::new(in_batch.clone())
        } else {
            Box::new(Matryoshka::new(
                in_batch.clone(),
                l.matryoshka_dims.clone(),
                l.matryoshka_weights.clone(),
            )?)
        };
        let parts: Vec<(f64, Box<dyn Loss>)> = match distillation {
            None => vec![(1.0, contrastive)],
            Some(d) => {
                let objective = match d.kind.unwrap_or(DistillKind::Kl) {
                    DistillKind::Kl => GroupObjective::Kl {
                        student_temperature: d.student_temperature,
                        teacher_temperature: d.teacher_temperature,
                    },
                    DistillKind::MarginMse => GroupObjective::MarginMse,
                };
                let mut parts: Vec<(f64, Box<dyn Loss>)> = vec![(
                    d.weight,
                    Box::new(GroupScores::new(objective, similarity, teacher.clone())?),
                )];
                if d.infonce_weight > 0.0 {
                    parts.push((d.infonce_weight, contrastive));
                }
                parts
            }
        };
        let weighted = match distillation {
            Some(_) => Weighted::new(parts)?.with_teacher(teacher.clone()),
            None => Weighted::new(parts)?,
        };
        if sparse {
            let s = l.splade.clone().unwrap_or_default();
            let documents = Flops::new(s.document_weight)?.with_threshold(s.document_threshold);
            let queries = match s.effective_query_weight(inference_free) {
                Some(w) => Some(Flops::new(w)?.with_threshold(s.query_threshold)),
                None => None,
            };
            return Ok(TextLoss::Splade(
                SpladeLoss::new(weighted, documents)
                    .with_weight_scale(scale.clone())
                    .with_queries(queries)
                    .with_documents_only(s.documents_only)?,
            ));
        }
        if distillation.is_none() && source.in_batch {
            return Ok(TextLoss::InfoNce(Matryoshka::new(
                in_batch,
                l.matryoshka_dims.clone(),
                l.matryoshka_weights.clone(),
            )?));
        }
        Ok(TextLoss::Scores(weighted))
    }

    /// The MaxSim scoring, on a multi-vector run.
    pub fn maxsim(&self) -> Option<&MaxSim> {
        match self {
            TextLoss::MaxSim(m) => Some(m),
            TextLoss::Distillation(d) => Some(d.maxsim()),
            TextLoss::PerSource(losses, _) => losses.first().and_then(TextLoss::maxsim),
            TextLoss::InfoNce(_) | TextLoss::Scores(_) | TextLoss::Splade(_) => None,
        }
    }

    /// A sparse run's regulariser weights' scale (their warm-up) and its settings.
    pub fn splade(&self, cfg: &Config) -> Option<(WeightScale, SpladeConfig)> {
        match self {
            TextLoss::Splade(l) => Some((
                l.weight_scale().clone(),
                cfg.loss.splade.clone().unwrap_or_default(),
            )),
            // Every source's regularisers share one scale (see `for_sources`).
            TextLoss::PerSource(losses, _) => losses.iter().find_map(|l| l.splade(cfg)),
            _ => None,
        }
    }

    /// The cell of the teacher's scores, with distillation.
    pub fn teacher(&self) -> Option<&TeacherScores> {
        match self {
            TextLoss::Distillation(d) => Some(d.teacher()),
            TextLoss::Scores(w) => w.teacher(),
            TextLoss::Splade(l) => l.inner().teacher(),
            TextLoss::PerSource(losses, _) => losses.iter().find_map(TextLoss::teacher),
            _ => None,
        }
    }

    fn inner(&self) -> &dyn Loss {
        match self {
            TextLoss::InfoNce(l) => l,
            TextLoss::MaxSim(l) => l,
            TextLoss::Distillation(l) => l,
            TextLoss::Splade(l) => l,
            TextLoss::Scores(l) => l,
            TextLoss::PerSource(losses, active) => {
                losses[active.get().min(losses.len() - 1)].inner()
            }
        }
    }
}

impl Loss for TextLoss {
    fn forward(&self, queries: &Tensor, passages: &Tensor) -> Result<Tensor> {
        self.inner().forward(queries, passages)
    }

    fn params(&self) -> Params {
        self.inner().params()
    }

    fn value_and_grads(&self, queries: &Tensor, passages: &Tensor) -> Result<LossValue> {
        self.inner().value_and_grads(queries, passages)
    }

    fn requires_equal_widths(&self) -> bool {
        self.inner().requires_equal_widths()
    }
}

/// Sets the teacher's scores of the global batch on `cell` in the order the loss sees the
/// passages: this rank's queries (its share from query `first`) in `order`, the ranks in
/// rank order.
pub(super) fn set_teacher_scores(
    cell: &TeacherScores,
    batch: &TextBatch,
    first: usize,
    order: &[usize],
    comm: &dyn Collective,
    device: &Device,
) -> Result<()> {
    let group = batch.passages.len() / batch.queries.len().max(1);
    if batch.scores.len() != batch.passages.len() {
        return Err(crate::Error::InvalidArgument {
            what: "teacher scores",
            value: format!(
                "{} for {} passages",
                batch.scores.len(),
                batch.passages.len()
            ),
            reason: "distillation needs the batch's teacher score of every passage (a loader \
                     with_teacher_scores)",
        });
    }
    let scores: Vec<f32> = order
        .iter()
        .flat_map(|&i| &batch.scores[(first + i) * group..(first + i + 1) * group])
        .copied()
        .collect();
    let mut scores = Tensor::from_vec(scores, (order.len(), group), device)?;
    if comm.world_size() > 1 {
        scores = comm.all_gather(&scores)?;
    }
    cell.set(&scores)
}
