//! The checkpoint kept as best (`train.best_by`): after an evaluation whose score beats
//! every earlier one of the run, the checkpoint of that step is copied to
//! `checkpoints/best` (in full under a temporary name, then renamed, as every checkpoint),
//! with `best.json` saying its step, what judged it and the score. A resumed run reads the
//! score back, so only a better evaluation replaces it. Rotation (`keep_checkpoints`)
//! never removes it.

use std::fs;

use super::*;

/// The best checkpoint's folder under `checkpoints/`.
pub const BEST_DIR: &str = "best";
/// What `best/` records about itself.
const BEST_FILE: &str = "best.json";

/// `best.json`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Best {
    step: u64,
    by: String,
    score: f64,
}

impl<T: Task> Run<T> {
    /// Keeps this step's checkpoint as `checkpoints/best` when `score` (judged by `by`)
    /// beats the best so far; returns the note to log when it did.
    pub(super) fn keep_if_best(&mut self, by: &str, score: f64) -> Result<Option<String>> {
        if self.step == 0 || !score.is_finite() {
            return Ok(None);
        }
        let root = self.settings.output_dir.join("checkpoints");
        let best = root.join(BEST_DIR);
        let previous = fs::read(best.join(BEST_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<Best>(&b).ok());
        // A tie keeps the earlier checkpoint (the margin covers the JSON round trip).
        if previous.as_ref().is_some_and(|p| score <= p.score + 1e-12) {
            return Ok(None);
        }
        let (dir, _) = self.checkpoint_here()?;
        let written = if self.rank() == 0 {
            copy_best(
                &dir,
                &root,
                &Best {
                    step: self.step,
                    by: by.to_string(),
                    score,
                },
            )
        } else {
            Ok(())
        };
        dist::watchdog::patient(|| dist::agree(&*self.comm, written))?;
        Ok(Some(format!(
            "step {}: best {by} nDCG@10 so far ({score:.4}{}): kept as {}",
            self.step,
            previous
                .map(|p| format!(", was {:.4} at step {}", p.score, p.step))
                .unwrap_or_default(),
            best.display()
        )))
    }
}

/// Copies the checkpoint `dir` to `root/best` with `best.json`: written under a temporary
/// name, then renamed over the old one.
fn copy_best(dir: &Path, root: &Path, best: &Best) -> Result<()> {
    let tmp = root.join(format!(".tmp-{BEST_DIR}"));
    let old = root.join(format!(".old-{BEST_DIR}"));
    let io = |action: &'static str, path: &Path, e: std::io::Error| Error::io(action, path, e);
    for stale in [&tmp, &old] {
        if stale.exists() {
            fs::remove_dir_all(stale).map_err(|e| io("remove", stale, e))?;
        }
    }
    fs::create_dir_all(&tmp).map_err(|e| io("create", &tmp, e))?;
    for entry in fs::read_dir(dir).map_err(|e| io("read", dir, e))? {
        let entry = entry.map_err(|e| io("read", dir, e))?;
        let to = tmp.join(entry.file_name());
        fs::copy(entry.path(), &to).map_err(|e| io("write", &to, e))?;
    }
    let file = tmp.join(BEST_FILE);
    let text = serde_json::to_vec_pretty(best).map_err(|e| Error::InvalidArgument {
        what: "best checkpoint record",
        value: e.to_string(),
        reason: "cannot be serialised",
    })?;
    fs::write(&file, text).map_err(|e| io("write", &file, e))?;
    let best_dir = root.join(BEST_DIR);
    if best_dir.exists() {
        fs::rename(&best_dir, &old).map_err(|e| io("rename", &best_dir, e))?;
    }
    fs::rename(&tmp, &best_dir).map_err(|e| io("rename", &tmp, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io("remove", &old, e))?;
    }
    Ok(())
}
