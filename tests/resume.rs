//! Training checkpoints: round trip, keep-last-K, and atomicity (a crash between writing the
//! temporary directory and renaming it never yields a checkpoint that looks complete).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use gradcache::train::checkpoint::{latest, list, load, restore, save, write_files, TrainerState};
use gradcache::train::data::Position;
use gradcache::Params;

fn params(scale: f32) -> Params {
    let t = |v: &[f32]| Var::from_tensor(&Tensor::new(v, &Device::Cpu).unwrap()).unwrap();
    Params::new([
        ("a.weight".to_string(), t(&[1.0 * scale, 2.0])),
        ("a.bias".to_string(), t(&[3.0 * scale])),
    ])
}

fn state(step: u64) -> TrainerState {
    TrainerState {
        step,
        data: Position {
            epoch: 1,
            offset: 12,
        },
        config_fingerprint: "abc".into(),
        loss_scaler: None,
    }
}

fn optimizer() -> BTreeMap<String, Tensor> {
    [(
        "m.a.bias".to_string(),
        Tensor::new(&[0.5f32], &Device::Cpu).unwrap(),
    )]
    .into()
}

#[test]
fn round_trip_restores_weights_optimizer_and_position() {
    let root = tempfile::tempdir().unwrap();
    let saved = params(1.0);
    let dir = save(root.path(), &saved, &optimizer(), &state(7), 3).unwrap();
    assert!(dir.ends_with("step-00000007"));

    let ckpt = load(root.path(), &Device::Cpu).unwrap();
    assert_eq!(ckpt.state, state(7));
    assert_eq!(
        ckpt.optimizer["m.a.bias"].to_vec1::<f32>().unwrap(),
        vec![0.5]
    );
    let fresh = params(9.0);
    restore(&fresh, &ckpt.model, &ckpt.dir).unwrap();
    for (name, var) in saved.iter() {
        let other = fresh.get(name).unwrap();
        assert_eq!(
            var.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            other.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }

    // A checkpoint of another model is refused, naming the parameter.
    let other = Params::new([(
        "b".to_string(),
        Var::zeros(2, DType::F32, &Device::Cpu).unwrap(),
    )]);
    let err = restore(&other, &ckpt.model, &ckpt.dir).unwrap_err();
    assert!(
        err.to_string().starts_with("weight `b` is missing from"),
        "{err}"
    );
}

#[test]
fn keeps_the_last_k() {
    let root = tempfile::tempdir().unwrap();
    for step in 1..=5 {
        save(
            root.path(),
            &params(step as f32),
            &optimizer(),
            &state(step),
            2,
        )
        .unwrap();
    }
    let steps: Vec<u64> = list(root.path())
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![4, 5]);
}

#[test]
fn a_crash_before_the_rename_leaves_the_previous_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    save(root.path(), &params(1.0), &optimizer(), &state(1), 3).unwrap();
    // Step 2 was written to its temporary directory, then the process died.
    let tmp = root.path().join(".tmp-step-00000002");
    write_files(&tmp, &params(2.0), &optimizer(), &state(2)).unwrap();
    // And a directory with the final name but missing files (e.g. copied by hand).
    std::fs::create_dir_all(root.path().join("step-00000003")).unwrap();

    let newest = latest(root.path()).unwrap().unwrap();
    assert!(newest.ends_with("step-00000001"));
    assert_eq!(load(root.path(), &Device::Cpu).unwrap().state.step, 1);

    // The next save clears the leftover temporary directory.
    save(root.path(), &params(4.0), &optimizer(), &state(4), 3).unwrap();
    assert!(!tmp.exists());
    assert_eq!(load(root.path(), &Device::Cpu).unwrap().state.step, 4);

    let empty = tempfile::tempdir().unwrap();
    let err = load(empty.path(), &Device::Cpu).err().unwrap();
    assert!(
        err.to_string().contains("no complete step-* directory"),
        "{err}"
    );
}
