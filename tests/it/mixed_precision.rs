//! Mixed precision and devices in the trainer: an f16 step whose gradients overflow is
//! skipped (weights and optimizer state untouched) and halves the loss scale, the scale
//! grows after `growth_interval` good steps, a resumed f16 run continues with the
//! scaler's state exactly as the uninterrupted one, bf16 trains, and a CUDA device that
//! this build or machine cannot open is an error (not a panic).

use std::collections::BTreeMap;

use gradcache::train::config::Config;
use gradcache::train::trainer::Trainer;
use gradcache::Error;

use crate::common::write_tiny_run as setup;

fn config(dir: &std::path::Path, sets: &[&str]) -> Config {
    let path = setup(dir);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Config::load(&path, &sets).unwrap()
}

/// Every parameter's values, as bits.
fn weights(t: &Trainer) -> BTreeMap<String, Vec<u32>> {
    t.params()
        .iter()
        .map(|(n, v)| {
            let flat = v
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (n.to_string(), flat.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

#[test]
fn an_f16_overflow_skips_the_step_and_halves_the_scale() {
    let dir = tempfile::tempdir().unwrap();
    // 2^30 fits the f32 cached gradient, not the f16 backward it is cast into (f16 ends
    // at 65504).
    let cfg = config(
        dir.path(),
        &[
            "precision=f16",
            "loss_scale.init=1073741824",
            "train.steps=40",
        ],
    );
    let mut trainer = Trainer::new(cfg, None).unwrap();
    let before = weights(&trainer);
    let first = trainer.train_step().unwrap();
    let s = first.loss_scaling.expect("f16 reports its loss scale");
    assert!(s.skipped, "a 2^30 loss scale must overflow f16");
    assert_eq!(s.used, 2f64.powi(30));
    assert!(
        first.loss.is_finite(),
        "the loss itself is f32 and unscaled"
    );
    assert_eq!(
        weights(&trainer),
        before,
        "a skipped step changes no weight"
    );
    assert!(
        trainer.optimizer_state().unwrap().is_empty(),
        "nor any optimizer state"
    );
    assert_eq!(
        trainer.step(),
        1,
        "the step still counts (data and schedule move on)"
    );
    // The scale halves after every overflow until the gradients fit.
    let mut scale = s.used;
    let mut skipped = 1;
    loop {
        let r = trainer.train_step().unwrap();
        let s = r.loss_scaling.unwrap();
        assert_eq!(s.used, scale / 2.0, "the scale halves after an overflow");
        scale = s.used;
        if !s.skipped {
            break;
        }
        assert_eq!(
            weights(&trainer),
            before,
            "a skipped step changes no weight"
        );
        skipped += 1;
        assert!(skipped < 30, "still overflowing at scale {scale}");
    }
    assert_ne!(weights(&trainer), before, "a good step updates the weights");
    assert!(!trainer.optimizer_state().unwrap().is_empty());
    eprintln!("{skipped} steps skipped; the first good step ran at loss scale {scale}");
}

#[test]
fn the_scale_grows_and_a_resumed_f16_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &[
            "precision=f16",
            "loss_scale.init=256",
            "loss_scale.growth_interval=2",
        ],
    );
    // The uninterrupted run has a directory of its own (one run per directory).
    let mut uninterrupted = cfg.clone();
    uninterrupted.output_dir = dir.path().join("uninterrupted");
    let mut full = Trainer::new(uninterrupted, None).unwrap();
    let reports: Vec<_> = (0..4).map(|_| full.train_step().unwrap()).collect();
    let scales: Vec<f64> = reports
        .iter()
        .map(|r| r.loss_scaling.unwrap().used)
        .collect();
    assert_eq!(
        scales,
        [256.0, 256.0, 512.0, 512.0],
        "x2 after 2 good steps"
    );
    assert!(reports.iter().all(|r| !r.loss_scaling.unwrap().skipped));

    let mut first = Trainer::new(cfg.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step().unwrap();
    }
    let ckpt = first.save_checkpoint().unwrap();
    drop(first);
    let mut resumed = Trainer::new(cfg, Some(&ckpt)).unwrap();
    for want in &reports[2..] {
        let got = resumed.train_step().unwrap();
        assert_eq!(
            got.loss_scaling, want.loss_scaling,
            "the scaler resumes its state"
        );
        assert_eq!(
            got.loss, want.loss,
            "losses after the resume equal the uninterrupted run's"
        );
    }
    assert_eq!(weights(&resumed), weights(&full));
}

#[test]
fn bf16_trains_without_scaling() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &["precision=bf16", "train.steps=6", "optim.lr=3e-3"],
    );
    let mut trainer = Trainer::new(cfg, None).unwrap();
    let losses: Vec<f32> = (0..6)
        .map(|_| {
            let r = trainer.train_step().unwrap();
            assert!(r.loss_scaling.is_none());
            r.loss
        })
        .collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(
        losses[5] < losses[0],
        "bf16 training should lower the loss: {losses:?}"
    );
}

#[test]
fn an_unavailable_gpu_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["device=cuda:1"]);
    let err = Trainer::new(cfg, None).err().expect("no GPU here");
    assert!(
        matches!(&err, Error::DeviceUnavailable { device, .. } if device == "cuda:1"),
        "{err}"
    );
    assert!(
        err.to_string().contains("device `cuda:1` is unavailable"),
        "{err}"
    );
    assert!(!dir.path().join("run").join("checkpoints").exists());

    let err = Config::load(
        &setup(dir.path()),
        &["dist.backend=nccl".to_string(), "device=cpu".to_string()],
    )
    .unwrap_err();
    assert!(err.to_string().contains("runs on GPUs"), "{err}");
    let err = Config::load(
        &setup(dir.path()),
        &["dist.backend=nccl".to_string(), "device=cuda:1".to_string()],
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("each rank takes its local GPU"),
        "{err}"
    );
}
