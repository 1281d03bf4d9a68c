//! `gradcache merge`: the linear merge is the weighted average of every tensor (the model's
//! and its Dense modules'), slerp keeps the norm of tensors of equal norm and falls back to
//! the average for parallel ones, the result loads and embeds like an export, and every
//! bad input is refused naming it before anything is written.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::hub::merge::{merge_models, MergeMethod};
use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::Error;

use crate::common::families::fixture;

/// A copy of fixture `family` without its references: a model directory.
fn model(family: &str, dest: &Path) -> PathBuf {
    copy(&fixture(family), dest);
    dest.to_path_buf()
}

fn copy(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("reference") {
            continue;
        }
        if path.is_dir() {
            copy(&path, &to.join(&name));
        } else {
            fs::copy(&path, to.join(&name)).unwrap();
        }
    }
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// Rewrites every float tensor of `file` with `f`.
fn rewrite(file: &Path, f: impl Fn(&Tensor) -> Tensor) {
    let tensors: HashMap<String, Tensor> = load(file)
        .into_iter()
        .map(|(k, t)| {
            let t = if t.dtype().is_float() { f(&t) } else { t };
            (k, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, file).unwrap();
}

/// The tensor's values in reverse order: the same norm, another direction.
fn reversed(t: &Tensor) -> Tensor {
    let flat = t.flatten_all().unwrap();
    let n = flat.dims1().unwrap() as u32;
    let idx = Tensor::new((0..n).rev().collect::<Vec<u32>>(), &Device::Cpu).unwrap();
    flat.index_select(&idx, 0)
        .unwrap()
        .reshape(t.shape())
        .unwrap()
}

fn norm(t: &Tensor) -> f64 {
    let t = t.to_dtype(DType::F64).unwrap();
    t.sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
        .sqrt()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Two models of `family`: the fixture and the fixture with every float tensor reversed.
fn pair(family: &str, root: &Path) -> (PathBuf, PathBuf) {
    let a = model(family, &root.join("a"));
    let b = model(family, &root.join("b"));
    for file in weight_files(&b) {
        rewrite(&b.join(file), reversed);
    }
    (a, b)
}

fn weight_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = vec![PathBuf::from("model.safetensors")];
    for entry in fs::read_dir(dir).unwrap() {
        let sub = entry.unwrap().path();
        if sub.join("model.safetensors").is_file() {
            files.push(sub.strip_prefix(dir).unwrap().join("model.safetensors"));
        }
    }
    files
}

#[test]
fn a_linear_merge_is_the_weighted_average_and_loads_like_an_export() {
    for family in ["bert", "gemma3_text"] {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = pair(family, dir.path());
        let out = dir.path().join("merged");
        let report = merge_models(
            &[a.clone(), b.clone()],
            &[3.0, 1.0],
            MergeMethod::Linear,
            &out,
        )
        .unwrap();
        assert_eq!(report.weights, vec![0.75, 0.25]);
        let files = weight_files(&a);
        // gemma3_text's two Dense modules are merged too.
        assert_eq!(
            files.len(),
            if family == "bert" { 1 } else { 3 },
            "{files:?}"
        );
        let mut count = 0;
        for file in &files {
            let (ta, tb, tm) = (
                load(&a.join(file)),
                load(&b.join(file)),
                load(&out.join(file)),
            );
            assert_eq!(tm.len(), ta.len(), "{family} {file:?}");
            for (name, m) in &tm {
                let want = ((&ta[name] * 0.75).unwrap() + (&tb[name] * 0.25).unwrap()).unwrap();
                let err = max_diff(m, &want);
                assert!(err <= 1e-6, "{family} `{name}`: {err:e}");
                assert_eq!(m.dtype(), ta[name].dtype());
            }
            count += tm.len();
        }
        assert_eq!(report.tensors, count);
        // Every other file is the first model's.
        for file in ["tokenizer.json", "config.json", "modules.json"] {
            assert_eq!(
                fs::read(a.join(file)).unwrap(),
                fs::read(out.join(file)).unwrap()
            );
        }
        let merged = EmbeddingModel::load(out.to_str().unwrap(), &LoadOptions::default()).unwrap();
        let e = merged
            .embed(&["In the beginning", "Jesus wept."], 2)
            .unwrap();
        let e = e.to_vec2::<f32>().unwrap();
        assert!(e.iter().flatten().all(|x| x.is_finite()));
        assert!(!dir.path().join(".tmp-merge-merged").exists());
    }
}

#[test]
fn all_weight_on_one_model_gives_that_model_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair("bert", dir.path());
    let out = dir.path().join("merged");
    merge_models(&[a.clone(), b], &[1.0, 0.0], MergeMethod::Linear, &out).unwrap();
    let (ta, tm) = (
        load(&a.join("model.safetensors")),
        load(&out.join("model.safetensors")),
    );
    for (name, t) in &ta {
        assert_eq!(max_diff(t, &tm[name]), 0.0, "`{name}`");
    }
}

#[test]
fn slerp_keeps_the_norm_between_equal_norms_and_averages_parallel_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair("bert", dir.path());
    let (slerped, linear) = (dir.path().join("slerp"), dir.path().join("linear"));
    merge_models(&[a.clone(), b.clone()], &[], MergeMethod::Slerp, &slerped).unwrap();
    merge_models(&[a.clone(), b.clone()], &[], MergeMethod::Linear, &linear).unwrap();
    let ta = load(&a.join("model.safetensors"));
    let tb = load(&b.join("model.safetensors"));
    let ts = load(&slerped.join("model.safetensors"));
    let tl = load(&linear.join("model.safetensors"));
    let mut checked = 0;
    for (name, x) in &ta {
        let (na, nb) = (norm(x), norm(&tb[name]));
        let cos = {
            let x64 = x.to_dtype(DType::F64).unwrap();
            let y64 = tb[name].to_dtype(DType::F64).unwrap();
            let dot = (x64 * y64)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            dot / (na * nb)
        };
        if na == 0.0 || cos.abs() > 0.9 {
            continue;
        }
        // |a| = |b|: the arc keeps the norm; the chord between them is shorter.
        assert!((norm(&ts[name]) - na).abs() <= 1e-5 * na, "`{name}`");
        assert!(norm(&tl[name]) < norm(&ts[name]), "`{name}`");
        checked += 1;
    }
    assert!(checked > 10, "only {checked} tensors compared");

    // Parallel tensors (b = 2a): slerp is the linear average.
    let c = model("bert", &dir.path().join("c"));
    rewrite(&c.join("model.safetensors"), |t| (t * 2.0).unwrap());
    let out = dir.path().join("parallel");
    merge_models(
        &[a.clone(), c.clone()],
        &[1.0, 3.0],
        MergeMethod::Slerp,
        &out,
    )
    .unwrap();
    let tc = load(&c.join("model.safetensors"));
    for (name, m) in load(&out.join("model.safetensors")) {
        let want = ((&ta[&name] * 0.25).unwrap() + (&tc[&name] * 0.75).unwrap()).unwrap();
        assert!(max_diff(&m, &want) <= 1e-6, "`{name}`");
    }
}

#[test]
fn bad_merges_are_refused_naming_the_problem_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = pair("bert", dir.path());
    let out = dir.path().join("merged");
    let refused = |models: &[PathBuf], weights: &[f64], method: MergeMethod, want: &str| {
        let err = merge_models(models, weights, method, &out).unwrap_err();
        assert!(
            err.to_string().contains(want),
            "`{err}` should say `{want}`"
        );
        assert!(!out.exists(), "{want}: something was written");
    };
    let ab = [a.clone(), b.clone()];
    refused(&ab[..1], &[], MergeMethod::Linear, "two models or more");
    refused(
        &[a.clone(), b.clone(), a.clone()],
        &[],
        MergeMethod::Slerp,
        "exactly two",
    );
    refused(&ab, &[1.0], MergeMethod::Linear, "one weight per model");
    refused(&ab, &[1.0, -1.0], MergeMethod::Linear, "not negative");
    refused(&ab, &[0.0, 0.0], MergeMethod::Linear, "must not all be 0");

    // Another family.
    let other = model("roberta", &dir.path().join("roberta"));
    refused(
        &[a.clone(), other],
        &[],
        MergeMethod::Linear,
        "model_type `roberta`",
    );

    // A tensor of another shape, a missing one, a checkpoint.
    let wrong = model("bert", &dir.path().join("wrong"));
    let file = wrong.join("model.safetensors");
    let mut tensors = load(&file);
    let (name, t) = tensors.iter().find(|(_, t)| t.rank() == 2).unwrap();
    let (name, cut) = (name.clone(), t.narrow(0, 0, 1).unwrap());
    tensors.insert(name.clone(), cut);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    refused(
        &[a.clone(), wrong.clone()],
        &[],
        MergeMethod::Linear,
        &format!("`{name}`"),
    );
    tensors.remove(&name);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    refused(
        &[a.clone(), wrong],
        &[],
        MergeMethod::Linear,
        &format!("`{name}` is missing"),
    );
    // A tensor only the second model has, and integer tensors that differ.
    let extra = model("bert", &dir.path().join("extra"));
    let file = extra.join("model.safetensors");
    let mut tensors = load(&file);
    let ids = |v: Vec<i64>| Tensor::new(v, &Device::Cpu).unwrap();
    tensors.insert("surplus.weight".into(), ids(vec![1, 2]));
    candle_core::safetensors::save(&tensors, &file).unwrap();
    refused(
        &[a.clone(), extra.clone()],
        &[],
        MergeMethod::Linear,
        "`surplus.weight` is not in",
    );
    let with_ids = model("bert", &dir.path().join("with_ids"));
    let file = with_ids.join("model.safetensors");
    let mut tensors = load(&file);
    tensors.insert("surplus.weight".into(), ids(vec![1, 3]));
    candle_core::safetensors::save(&tensors, &file).unwrap();
    refused(
        &[with_ids, extra],
        &[],
        MergeMethod::Linear,
        "integer tensor that differs",
    );
    let empty = dir.path().join("no-model");
    fs::create_dir_all(&empty).unwrap();
    refused(&[a.clone(), empty], &[], MergeMethod::Linear, "config.json");
    let checkpoint = dir.path().join("checkpoint");
    fs::create_dir_all(&checkpoint).unwrap();
    fs::write(checkpoint.join("trainer_state.json"), "{}").unwrap();
    refused(
        &[a.clone(), checkpoint],
        &[],
        MergeMethod::Linear,
        "gradcache export",
    );

    // An output that holds files is left alone.
    fs::create_dir_all(&out).unwrap();
    fs::write(out.join("keep.txt"), "mine").unwrap();
    let err = merge_models(&ab, &[], MergeMethod::Linear, &out).unwrap_err();
    assert!(matches!(err, Error::OutputExists { .. }), "{err:?}");
    assert_eq!(fs::read_dir(&out).unwrap().count(), 1);
}
