//! The towers of a text-pair run: what the trainer builds from the config and the memory
//! budget's probes measure.

use crate::models::bert::{BertConfig, BertEncoder};
use crate::params::ParamStore;

/// The towers of a run and what was built with them.
pub(super) struct Model {
    pub(super) query: BertEncoder,
    /// The passage tower; `None` when one tower is shared.
    pub(super) passage: Option<BertEncoder>,
    pub(super) bert: BertConfig,
    pub(super) tokenizer: tokenizers::Tokenizer,
    pub(super) store: ParamStore,
}
