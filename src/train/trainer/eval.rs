//! A text-pair run's evaluation of one set: held-out pairs (each query against every
//! held-out positive) or a BEIR split (each judged query against the whole corpus), with
//! the set's own query prompt, dense, multi-vector or sparse scoring.

use candle_core::Tensor;

use super::TextPairs;
use crate::hub::embed;
use crate::retrieval::{evaluate_corpus, CorpusEvalOptions, Scoring};
use crate::train::metrics::{evaluate, RetrievalMetrics};
use crate::train::run::TaskCache;
use crate::train::text_data::{EvalData, Evaluation};
use crate::Result;

impl TextPairs {
    /// One evaluation set: every held-out query against every held-out positive, or every
    /// judged query of a BEIR split against its whole corpus (dropout off).
    pub(super) fn evaluate_set(
        &self,
        gc: &TaskCache<Self>,
        set: &Evaluation,
    ) -> Result<RetrievalMetrics> {
        let t = &self.cfg.train;
        // A multi-vector model's rows are token matrices, scored by MaxSim.
        let (scoring, dim): (Scoring, Option<usize>) = match gc.loss().maxsim() {
            Some(l) => (Scoring::MaxSim, Some(l.dim())),
            // A sparse model's vectors are vocabulary-wide: an inverted index scores them.
            None if self.cfg.model.sparse.is_some() => (Scoring::Sparse, None),
            None => (self.cfg.similarity().into(), None),
        };
        let shaped = |x: Tensor| -> Result<Tensor> {
            match dim {
                Some(d) => Ok(x.reshape((x.dim(0)?, (), d))?),
                None => Ok(x),
            }
        };
        let prompted;
        let query_tokenizer = match &set.query_prompt {
            Some(prompt) => {
                prompted = self.query_tokenizer.clone().with_prompt(prompt);
                &prompted
            }
            None => &self.query_tokenizer,
        };
        let embed_queries = |texts: &[&str]| {
            shaped(embed(
                gc.query_encoder(),
                query_tokenizer,
                texts,
                t.query_chunk,
                &self.device,
            )?)
        };
        let embed_passages = |texts: &[&str]| {
            shaped(embed(
                gc.passage_encoder(),
                &self.passage_tokenizer,
                texts,
                t.passage_chunk,
                &self.device,
            )?)
        };
        match &set.data {
            EvalData::Pairs(pairs) => {
                let queries: Vec<&str> = pairs.iter().map(|p| p.query.as_str()).collect();
                let passages: Vec<&str> = pairs.iter().map(|p| p.positive.as_str()).collect();
                let q = embed_queries(&queries)?;
                let p = embed_passages(&passages)?;
                let targets: Vec<usize> = (0..queries.len()).collect();
                evaluate(&q, &p, &targets, scoring, 256)
            }
            EvalData::Corpus(set) => {
                let options = CorpusEvalOptions {
                    title_separator: self.cfg.data.title_separator.clone(),
                    ..CorpusEvalOptions::default()
                };
                let evaluation =
                    evaluate_corpus(set, scoring, &options, embed_queries, embed_passages)?;
                Ok(RetrievalMetrics::from(&evaluation.metrics))
            }
        }
    }
}
