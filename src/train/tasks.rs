//! Which of a model's task adapters (Jina v3's `lora_adaptations`) a run encodes its
//! queries and passages with (`model.task`, `model.query_task`, `model.passage_task`),
//! and what that trains: the adapters of the tasks in use, the base and the other tasks
//! frozen (as the release trains them: `lora_main_params_trainable = false`). A model
//! with adapters and no task asked trains its base, its adapters frozen.

use crate::hub::{HubSettings, ModelFiles};
use crate::models::bert::{BertConfig, TaskAdapters};
use crate::names::task_adapter;
use crate::{Error, Result};

use super::config::Config;

/// The tasks of a run, by index into the model's adapters.
#[derive(Debug, Clone)]
pub(super) struct RunTasks {
    pub(super) adapters: TaskAdapters,
    pub(super) query: Option<usize>,
    pub(super) passage: Option<usize>,
}

impl RunTasks {
    /// The tasks whose adapters train.
    fn used(&self) -> Vec<usize> {
        let mut used: Vec<usize> = self.query.into_iter().chain(self.passage).collect();
        used.dedup();
        used
    }

    /// The instruction of `task` (empty for none).
    pub(super) fn instruction(&self, task: Option<usize>) -> &str {
        task.map_or("", |t| &self.adapters.instructions[t])
    }
}

/// The tasks a run asks for, checked against the pretrained model's adapters: `None` for
/// a model without them when none is asked. A task asked of a model without adapters, a
/// task it lacks, a setting the tasks do not go with, refused by name.
pub(super) fn run_tasks(cfg: &Config) -> Result<Option<RunTasks>> {
    let m = &cfg.model;
    let query = m.query_task.as_ref().or(m.task.as_ref());
    let passage = m.passage_task.as_ref().or(m.task.as_ref());
    let asked = query.or(passage);
    let adapters = if m.pretrained.is_empty() {
        None
    } else {
        let files = ModelFiles::resolve(&m.pretrained, &HubSettings::from_env())?;
        BertConfig::from_file(&files.config)?.task_adapters(&files.config)?
    };
    let Some(adapters) = adapters else {
        return match asked {
            Some(task) => Err(Error::InvalidConfig {
                field: "model.task",
                value: format!("{task:?} (model {:?})", m.pretrained),
                reason: "the model has no task adapters (its config.json names no \
                         lora_adaptations): only Jina v3's release carries them",
            }),
            None => Ok(None),
        };
    };
    let index = |task: Option<&String>, field| task.map(|t| adapters.index(t, field)).transpose();
    let query_field = if m.query_task.is_some() {
        "model.query_task"
    } else {
        "model.task"
    };
    let passage_field = if m.passage_task.is_some() {
        "model.passage_task"
    } else {
        "model.task"
    };
    let tasks = RunTasks {
        query: index(query, query_field)?,
        passage: index(passage, passage_field)?,
        adapters,
    };
    if asked.is_some() {
        let refused = [
            ("model.lora", m.lora.is_some()),
            ("model.multi_vector", m.multi_vector.is_some()),
            ("model.sparse", m.sparse.is_some()),
            ("model.reranker", m.reranker.is_some()),
            ("model.shared = false", !m.shared),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, on)| *on) {
            return Err(Error::InvalidConfig {
                field: "model.task",
                value: format!("with {field}"),
                reason: "task adapters train on one shared embedding model (their tasks \
                         choose the adapters per side)",
            });
        }
        if tasks.adapters.dropout > 0.0 && m.dropout {
            return Err(Error::InvalidConfig {
                field: "model.task",
                value: format!("lora_dropout_p = {}", tasks.adapters.dropout),
                reason: "the release's dropout on its adapters (one mask over the input \
                         features, shared by every token) is not built: set model.dropout = \
                         false, or lora_dropout_p = 0 in the model's config.json",
            });
        }
    }
    Ok(Some(tasks))
}

/// What the tasks freeze (`model.freeze` patterns): the adapters of every task not in
/// use; with a task in use, the base too (through LoRA's rule: all but adapters).
pub(super) fn frozen(tasks: &RunTasks) -> (Vec<String>, bool) {
    let used = tasks.used();
    let patterns = (0..tasks.adapters.names.len())
        .filter(|t| !used.contains(t))
        .flat_map(|t| ["lora_A", "lora_B"].map(|f| task_adapter("*", f, t)))
        .collect();
    (patterns, !used.is_empty())
}
