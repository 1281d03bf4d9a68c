//! Training checkpoints: round trip, keep-last-K, and atomicity (a crash between writing the
//! temporary directory and renaming it never yields a checkpoint that looks complete).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use gradcache::train::checkpoint::{
    latest, list, load, resolve, restore, save, write_files, FileDigest, TrainerState,
};
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
        ..TrainerState::default()
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
    assert_eq!(
        TrainerState {
            files: Default::default(),
            ..ckpt.state.clone()
        },
        state(7)
    );
    // Both tensor files are recorded with their size and SHA-256, as `sha256sum` prints it.
    assert_eq!(ckpt.state.files.len(), 2);
    for (file, digest) in &ckpt.state.files {
        let found = FileDigest::of(&dir.join(file)).unwrap();
        assert_eq!(&found, digest, "{file}");
        assert_eq!(digest.sha256.len(), 64);
    }
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

/// Two checkpoints (steps 1 and 2) under a fresh root.
fn two_checkpoints() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let old = save(root.path(), &params(1.0), &optimizer(), &state(1), 3).unwrap();
    let new = save(root.path(), &params(2.0), &optimizer(), &state(2), 3).unwrap();
    (root, old, new)
}

#[test]
fn a_truncated_checkpoint_is_refused_and_resume_falls_back() {
    let (root, old, new) = two_checkpoints();
    let model = new.join("model.safetensors");
    let len = std::fs::metadata(&model).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap();
    file.set_len(len / 2).unwrap();

    // Named directly: refused, naming the file and what is wrong with it.
    let err = load(&new, &Device::Cpu).err().unwrap().to_string();
    assert!(
        err.contains(&model.display().to_string()) && err.contains("truncated"),
        "{err}"
    );
    // From the root: the newest intact checkpoint, and a note of the one passed over.
    let ckpt = load(root.path(), &Device::Cpu).unwrap();
    assert_eq!(ckpt.dir, old);
    assert_eq!(ckpt.state.step, 1);
    assert_eq!(ckpt.skipped.len(), 1, "{:?}", ckpt.skipped);
    assert!(
        ckpt.skipped[0].contains("step-00000002") && ckpt.skipped[0].contains("truncated"),
        "{:?}",
        ckpt.skipped
    );
    let found = resolve(root.path()).unwrap();
    assert_eq!((found.dir, found.skipped.len()), (old, 1));
}

#[test]
fn an_altered_byte_is_caught_by_the_digest() {
    let (root, old, new) = two_checkpoints();
    let optimizer_file = new.join("optimizer.safetensors");
    let mut bytes = std::fs::read(&optimizer_file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40; // same size, one bit of a tensor value
    std::fs::write(&optimizer_file, bytes).unwrap();
    let err = load(&new, &Device::Cpu).err().unwrap().to_string();
    assert!(
        err.contains("optimizer.safetensors") && err.contains("SHA-256"),
        "{err}"
    );
    assert_eq!(load(root.path(), &Device::Cpu).unwrap().dir, old);
}

#[test]
fn a_damaged_state_file_or_a_missing_tensor_file_is_named() {
    let (root, old, new) = two_checkpoints();
    std::fs::write(new.join("trainer_state.json"), "{\"step\": 2, \"da").unwrap();
    let err = load(&new, &Device::Cpu).err().unwrap().to_string();
    assert!(
        err.contains("trainer_state.json") && err.contains("not a trainer state"),
        "{err}"
    );
    assert_eq!(load(root.path(), &Device::Cpu).unwrap().dir, old);
    std::fs::remove_file(old.join("optimizer.safetensors")).unwrap();
    // Nothing intact is left: the error lists what is wrong with each.
    let err = load(root.path(), &Device::Cpu).err().unwrap().to_string();
    assert!(
        err.contains("no checkpoint under it is intact")
            && err.contains("not a trainer state")
            && err.contains("optimizer.safetensors: the file is missing"),
        "{err}"
    );
}

#[test]
fn a_checkpoint_without_digests_is_read_unverified() {
    // Written before checksums: the state has no `files`.
    let (root, _, new) = two_checkpoints();
    let path = new.join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    state.as_object_mut().unwrap().remove("files");
    std::fs::write(&path, state.to_string()).unwrap();
    let ckpt = load(root.path(), &Device::Cpu).unwrap();
    assert_eq!((ckpt.dir, ckpt.state.step), (new.clone(), 2));
    // Its tensor file must still parse; one that does not is refused and passed over.
    std::fs::write(new.join("model.safetensors"), b"not safetensors").unwrap();
    let ckpt = load(root.path(), &Device::Cpu).unwrap();
    assert_eq!(ckpt.state.step, 1);
    assert!(ckpt.skipped[0].contains("not a readable safetensors file"));
}

#[test]
fn saving_a_step_again_replaces_it_whole() {
    let root = tempfile::tempdir().unwrap();
    save(root.path(), &params(1.0), &optimizer(), &state(3), 3).unwrap();
    let dir = save(root.path(), &params(5.0), &optimizer(), &state(3), 3).unwrap();
    let ckpt = load(&dir, &Device::Cpu).unwrap();
    assert_eq!(
        ckpt.model["a.bias"].to_vec1::<f32>().unwrap(),
        vec![15.0],
        "the second save's values"
    );
    let names: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["step-00000003".to_string()], "no leftovers");
}
