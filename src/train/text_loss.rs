//! The loss of a text-pair run: InfoNCE over single vectors (with its Matryoshka
//! widths); over MaxSim scores of token matrices for a multi-vector model; or, with
//! `[loss.distillation]`, the KL divergence from the data's teacher scores to a
//! multi-vector model's; or, for a sparse model, InfoNCE on dot products plus the FLOPS
//! regularisers of `[loss.splade]`.

use candle_core::{Device, Tensor};

use crate::dist::Collective;
use crate::hub::multi_vector::MultiVectorHead;
use crate::loss::{
    Flops, Guide, InfoNce, Loss, LossValue, Matryoshka, MaxSim, MaxSimDistillation, SpladeLoss,
    TeacherScores, WeightScale,
};
use crate::params::Params;
use crate::train::config::Config;
use crate::train::config::SpladeConfig;
use crate::train::data::TextBatch;
use crate::Result;
use crate::Similarity;

/// What a text-pair run minimises.
pub enum TextLoss {
    /// Single vectors.
    InfoNce(Matryoshka<InfoNce>),
    /// Token matrices (ColBERT).
    MaxSim(MaxSim),
    /// Token matrices learning a teacher's scores (PyLate's distillation).
    Distillation(MaxSimDistillation),
    /// Sparse (SPLADE) vectors: InfoNCE on dot products plus the FLOPS regularisers.
    Splade(SpladeLoss<InfoNce>),
}

impl TextLoss {
    /// The loss `cfg` asks for: over `multi_vector`'s token matrices when the model is
    /// one, judging false negatives by the `guide` cell's embeddings when it has one.
    pub(super) fn from_config(
        cfg: &Config,
        multi_vector: Option<&MultiVectorHead>,
        guide: Option<Guide>,
        inference_free: bool,
    ) -> Result<Self> {
        let l = &cfg.loss;
        Ok(match (multi_vector, &l.distillation) {
            (Some(head), Some(d)) => TextLoss::Distillation(
                MaxSimDistillation::new(head.dim, TeacherScores::new())?
                    .with_normalized_scores(d.normalize_scores)
                    .with_teacher_temperature(d.teacher_temperature)?,
            ),
            (Some(head), None) => {
                TextLoss::MaxSim(MaxSim::new(head.dim)?.with_temperature(l.temperature)?)
            }
            (None, _) if cfg.model.sparse.is_some() => {
                let block = (l.block_rows > 0).then_some(l.block_rows);
                let base = InfoNce::new(l.temperature)?
                    .with_similarity(Similarity::Dot)
                    .with_symmetric(l.symmetric)
                    .with_directions(&l.directions)?
                    .with_block_rows(block)?
                    .with_false_negative_margin(l.false_negative_margin)?
                    .with_guide(guide);
                let s = l.splade.clone().unwrap_or_default();
                let documents = Flops::new(s.document_weight)?.with_threshold(s.document_threshold);
                let queries = match s.effective_query_weight(inference_free) {
                    Some(w) => Some(Flops::new(w)?.with_threshold(s.query_threshold)),
                    None => None,
                };
                TextLoss::Splade(
                    SpladeLoss::new(base, documents)
                        .with_queries(queries)
                        .with_documents_only(s.documents_only)?,
                )
            }
            (None, _) => {
                // Unset: the loss chooses (the CPU kernel's blocks, or the composed
                // path's that fit).
                let block = (l.block_rows > 0).then_some(l.block_rows);
                let loss = InfoNce::new(l.temperature)?
                    .with_similarity(l.similarity)
                    .with_symmetric(l.symmetric)
                    .with_directions(&l.directions)?
                    .with_block_rows(block)?
                    .with_false_negative_margin(l.false_negative_margin)?
                    .with_guide(guide);
                TextLoss::InfoNce(Matryoshka::new(
                    loss,
                    l.matryoshka_dims.clone(),
                    l.matryoshka_weights.clone(),
                )?)
            }
        })
    }

    /// The MaxSim scoring, on a multi-vector run.
    pub fn maxsim(&self) -> Option<&MaxSim> {
        match self {
            TextLoss::MaxSim(m) => Some(m),
            TextLoss::Distillation(d) => Some(d.maxsim()),
            TextLoss::InfoNce(_) | TextLoss::Splade(_) => None,
        }
    }

    /// A sparse run's regulariser weights' scale (their warm-up) and its settings.
    pub fn splade(&self, cfg: &Config) -> Option<(WeightScale, SpladeConfig)> {
        match self {
            TextLoss::Splade(l) => Some((
                l.weight_scale().clone(),
                cfg.loss.splade.clone().unwrap_or_default(),
            )),
            _ => None,
        }
    }

    /// The cell of the teacher's scores, with distillation.
    pub fn teacher(&self) -> Option<&TeacherScores> {
        match self {
            TextLoss::Distillation(d) => Some(d.teacher()),
            _ => None,
        }
    }

    fn inner(&self) -> &dyn Loss {
        match self {
            TextLoss::InfoNce(l) => l,
            TextLoss::MaxSim(l) => l,
            TextLoss::Distillation(l) => l,
            TextLoss::Splade(l) => l,
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
