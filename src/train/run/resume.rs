//! A run's state on disk: the output directory's lock, the checkpoints it writes, and
//! restoring one (exact resume, an extension to more steps, the checks that the
//! checkpoint belongs to this run).

use super::*;

impl<T: Task> Run<T> {
    /// Takes the output directory's lock (rank 0; every rank learns the outcome): a second
    /// run on the directory is refused naming the first. Creates the directory. Done by
    /// the first write of a run and by [`Self::run`]; again is a no-op.
    pub fn lock_output_dir(&mut self) -> Result<()> {
        if self.lock.is_some() || self.rank() != 0 {
            return dist::agree(&*self.comm, Ok(()));
        }
        let taken = RunLock::acquire(&self.settings.output_dir);
        let lock = dist::agree(&*self.comm, taken)?;
        if let Some(old) = lock.taken_over() {
            self.notes.push(format!(
                "took over the lock {} left by {old}: the kernel's lock on it was free, so \
                 that run has ended (its process id may live on a moment while it is torn \
                 down, or belong to another program)",
                lock.path().display()
            ));
        }
        if !lock.enforced() {
            self.notes.push(format!(
                "the file system of {} does not enforce flock: a concurrent run on this \
                 directory is told apart by the process id in the lock file only",
                lock.path().display()
            ));
        }
        self.lock = Some(lock);
        Ok(())
    }

    /// Restores weights, buffers, optimizer state, data position, step and loss scaler from
    /// a checkpoint (a `step-N` directory, or a checkpoints root: then the newest) written
    /// with the same configuration. Every rank reads it; a failure on one fails all. A
    /// checkpoint of another configuration is refused before anything changes; after a
    /// later failure (a missing tensor, a data position the task cannot reach) the run is
    /// partly restored and should be dropped.
    pub fn restore(&mut self, path: &Path) -> Result<()> {
        let restored = self.restore_local(path);
        dist::agree(&*self.comm, restored)
    }

    fn restore_local(&mut self, path: &Path) -> Result<()> {
        let ckpt = checkpoint::load(path, &self.device)?;
        for skipped in &ckpt.skipped {
            self.notes.push(skipped.clone());
        }
        let extension = self.check_resumable(&ckpt.dir, &ckpt.state)?;
        checkpoint::restore(&self.gc.state()?, &ckpt.model, &ckpt.dir)?;
        self.optimizer.load_state(&ckpt.optimizer)?;
        self.task
            .seek(ckpt.state.data, ckpt.state.step)
            .map_err(|e| Error::CheckpointMismatch {
                what: format!("the data position of {}", ckpt.dir.display()),
                detail: e.to_string(),
            })?;
        self.step = ckpt.state.step;
        if self.scaler.is_some() {
            self.scaler = ckpt.state.loss_scaler.or(self.scaler);
        }
        let own_root = self.settings.output_dir.join("checkpoints");
        if ckpt.dir.parent() == Some(own_root.as_path()) {
            self.saved = Some((self.step, ckpt.dir.clone()));
        }
        self.notes.push(format!(
            "resumed from {} at step {}",
            ckpt.dir.display(),
            self.step
        ));
        self.extensions = ckpt.state.extensions.clone();
        if let Some(e) = extension {
            self.notes.push(format!(
                "extended from {} to {} steps at step {}: from here the learning rate \
                 follows the schedule of {} steps, so this is no longer the uninterrupted \
                 run of either length (recorded in the checkpoints)",
                e.from_steps, e.to_steps, e.step, e.to_steps
            ));
            self.extensions.push(e);
            self.just_extended = true;
        }
        let world = self.world_size();
        if let Some(written) = ckpt.state.world_size.filter(|&n| n != world) {
            self.notes.push(format!(
                "the checkpoint was written by {written} process(es) and resumes on {world}: \
                 the step's gradient is the full batch's either way{}",
                if self.gc.ctx(0, crate::Side::Query, 0).dropout.is_some() {
                    " (dropout masks are drawn per rank, so the run continues as another \
                     sample of the same training, not bit for bit)"
                } else {
                    ""
                }
            ));
        }
        Ok(())
    }

    /// Whether the checkpoint `state` (in `dir`) may resume this run: written with this
    /// configuration, or, with `--extend`, with this configuration but for fewer steps
    /// (returned: the extension). Refused by name otherwise, before anything changes.
    fn check_resumable(&self, dir: &Path, state: &TrainerState) -> Result<Option<Extension>> {
        let s = &self.settings;
        let same = state.config_fingerprint == s.fingerprint;
        let same_but_length = self.length_free_fingerprint.is_some()
            && state.length_free_fingerprint == self.length_free_fingerprint;
        let mismatch = |detail: String| Error::CheckpointMismatch {
            what: format!("checkpoint {}", dir.display()),
            detail,
        };
        if same || !same_but_length {
            if self.extend && !same && state.length_free_fingerprint.is_none() {
                return Err(mismatch(
                    "it was written before --extend existed (it records no fingerprint \
                     without the run's length), so another train.steps cannot be told apart \
                     from another configuration"
                        .into(),
                ));
            }
            if self.extend && !same {
                return Err(mismatch(format!(
                    "it was written with another configuration, not only another \
                     train.steps: --extend changes the run's length and nothing else (only \
                     {} may change besides)",
                    s.may_change
                )));
            }
            check_fingerprint(&s.fingerprint, s.may_change, dir, state)?;
            return Ok(None);
        }
        let from = state.train_steps.unwrap_or(0);
        if !self.extend {
            return Err(mismatch(format!(
                "it was written for train.steps = {from} and this run has {}: to continue \
                 it to the new length, resume with --extend",
                s.steps
            )));
        }
        if s.steps < from || s.steps <= state.step {
            return Err(mismatch(format!(
                "--extend needs more steps than the checkpoint's run ({from}) and than its \
                 step ({}); train.steps is {}",
                state.step, s.steps
            )));
        }
        Ok(Some(Extension {
            step: state.step,
            from_steps: from,
            to_steps: s.steps,
        }))
    }

    /// Writes a training checkpoint of the current state under `output_dir/checkpoints`.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let state = TrainerState {
            step: self.step,
            data: self.task.position(self.step),
            config_fingerprint: self.settings.fingerprint.clone(),
            loss_scaler: self.scaler,
            world_size: Some(self.world_size()),
            train_steps: Some(self.settings.steps),
            length_free_fingerprint: self.length_free_fingerprint.clone(),
            extensions: self.extensions.clone(),
            files: Default::default(),
        };
        checkpoint::save(
            &self.settings.output_dir.join("checkpoints"),
            &self.gc.state()?,
            &self.optimizer.state()?,
            &state,
            self.settings.keep_checkpoints,
        )
    }

    /// Rank 0 writes a checkpoint of the current step (every rank learns the outcome),
    /// unless this run already wrote or resumed from one of this step; returns its
    /// directory and whether it is new.
    pub(super) fn checkpoint_here(&mut self) -> Result<(PathBuf, bool)> {
        if let Some((step, dir)) = &self.saved {
            if *step == self.step && dir.is_dir() {
                return Ok((dir.clone(), false));
            }
        }
        let saved = if self.rank() == 0 {
            self.save_checkpoint().map(Some)
        } else {
            Ok(None)
        };
        // Every rank runs the same configuration, so names the same directory.
        let root = self.settings.output_dir.join("checkpoints");
        // The other ranks wait while rank 0 writes, as long as that takes.
        let dir = dist::watchdog::patient(|| dist::agree(&*self.comm, saved))?
            .unwrap_or_else(|| checkpoint::step_dir(&root, self.step));
        self.saved = Some((self.step, dir.clone()));
        Ok((dir, true))
    }
}

/// A checkpoint must have been written with this configuration (fingerprint `expected`);
/// `may_change` says what may differ between a run and its resume.
pub(in crate::train) fn check_fingerprint(
    expected: &str,
    may_change: &str,
    dir: &Path,
    state: &TrainerState,
) -> Result<()> {
    if state.config_fingerprint != expected {
        return Err(Error::CheckpointMismatch {
            what: format!("checkpoint {}", dir.display()),
            detail: format!(
                "it was written with another configuration (only {may_change} may change)"
            ),
        });
    }
    Ok(())
}
