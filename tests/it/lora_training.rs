//! LoRA and frozen weights through the trainer: a run on a pretrained directory trains
//! the adapters alone (the base weights stay the file's, bit for bit), resumes exactly
//! from a checkpoint that holds only the adapters, and exports the merged model (from the
//! checkpoint and live, the same embeddings) and the adapters in PEFT's layout; bad
//! settings are refused before anything is written.

use std::fs;
use std::path::{Path, PathBuf};

use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::train::{export_run, export_run_as, Config, ExportLayout, Quiet, Trainer};
use gradcache::{Error, Side};

use crate::common;
use crate::common::{bits, max_diff, vocab_pairs, write_bert_dir, TINY_BERT};

fn load(path: &Path, sets: &[&str]) -> Config {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Config::load(path, &sets).unwrap()
}

/// A LoRA run of 4 steps on a tiny pretrained BERT (checkpoints every 2 steps).
fn lora_run(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-bert");
    write_bert_dir(&model, TINY_BERT, false);
    vocab_pairs(&dir.join("pairs.jsonl"));
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{dir}/pairs.jsonl"
eval_pairs = 6
[model]
pretrained = "{model}"
query_max_len = 10
passage_max_len = 12
recompute = "every_layer"
[model.lora]
rank = 2
alpha = 4.0
[loss]
temperature = 0.1
[train]
steps = 4
batch_size = 6
query_chunk = 2
passage_chunk = 4
checkpoint_every = 2
[optim]
lr = 1e-2
"#,
        out = dir.join("run").display(),
        dir = dir.display(),
        model = model.display(),
    );
    let path = dir.join("lora.toml");
    fs::write(&path, config).unwrap();
    path
}

fn weights(path: &Path) -> std::collections::HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
}

#[test]
fn a_lora_run_trains_the_adapters_alone_resumes_exactly_and_exports_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let path = lora_run(dir.path());
    let cfg = load(&path, &[]);
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    trainer.run(&mut Quiet).unwrap();

    // The adapters alone train: 6 projections of 2 layers, A and B each.
    let names: Vec<&str> = trainer.params().names().collect();
    assert_eq!(names.len(), 24, "{names:?}");
    assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
    let base = weights(&dir.path().join("tiny-bert/model.safetensors"));
    for (name, want) in &base {
        if let Some(var) = trainer.store().get(name) {
            assert_eq!(bits(var.as_tensor()), bits(want), "`{name}` moved");
        }
    }
    for (name, var) in trainer.params().iter() {
        if name.contains(".lora_B.") {
            assert!(
                common::max_abs(var.as_tensor()) > 0.0,
                "`{name}` never moved"
            );
        }
    }

    // A checkpoint holds the adapters (and no base weight); the resume is exact.
    let ckpt = dir.path().join("run/checkpoints/step-00000002");
    let saved = weights(&ckpt.join("model.safetensors"));
    assert!(!saved.is_empty() && saved.keys().all(|n| n.contains(".lora_")));
    let mut elsewhere = cfg.clone();
    elsewhere.output_dir = dir.path().join("resumed");
    let mut resumed = Trainer::new(elsewhere, Some(&ckpt)).unwrap();
    assert_eq!(resumed.step(), 2);
    resumed.run(&mut Quiet).unwrap();
    for (name, var) in trainer.params().iter() {
        let other = resumed.params().get(name).unwrap();
        assert_eq!(
            bits(var.as_tensor()),
            bits(other.as_tensor()),
            "`{name}` differs after the resume"
        );
    }

    // The merged model: from the last checkpoint and live, the same embeddings, and not
    // the base model's.
    let texts = ["the lord is my shepherd", "light", "my lords, the light"];
    let merged = dir.path().join("merged");
    export_run(&cfg, None, &merged, Side::Query).unwrap();
    let live = dir.path().join("live");
    trainer.export(&live, Side::Query).unwrap();
    let embed = |d: &Path| {
        EmbeddingModel::load(&d.display().to_string(), &LoadOptions::default())
            .unwrap()
            .embed(&texts, 2)
            .unwrap()
    };
    let (a, b) = (embed(&merged), embed(&live));
    assert_eq!(max_diff(&a, &b), 0.0, "checkpoint and live exports differ");
    assert!(max_diff(&a, &embed(&dir.path().join("tiny-bert"))) > 1e-6);
    let exported = weights(&merged.join("model.safetensors"));
    assert!(exported.keys().all(|n| !n.contains("lora_")));
    assert_eq!(
        exported.len(),
        base.len() - 1,
        "every weight but the unused head's"
    );

    // The adapters in PEFT's layout, with the sentence-transformers files beside them.
    let adapter = dir.path().join("adapter");
    export_run_as(&cfg, None, &adapter, Side::Query, ExportLayout::Adapter).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(adapter.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 2);
    assert_eq!(config["lora_alpha"], 4.0);
    assert_eq!(
        config["base_model_name_or_path"],
        dir.path().join("tiny-bert").display().to_string()
    );
    let mut targets: Vec<&str> = config["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    targets.sort_unstable();
    assert_eq!(
        targets,
        // `output.dense` names both the attention's and the layer's output projection.
        [
            "intermediate.dense",
            "output.dense",
            "self.key",
            "self.query",
            "self.value"
        ]
    );
    let tensors = weights(&adapter.join("adapter_model.safetensors"));
    assert_eq!(tensors.len(), 24);
    assert!(
        tensors.contains_key("base_model.model.encoder.layer.1.attention.self.value.lora_B.weight")
    );
    assert!(!adapter.join("model.safetensors").exists());
    for file in ["modules.json", "1_Pooling/config.json", "tokenizer.json"] {
        assert!(adapter.join(file).is_file(), "{file}");
    }
}

#[test]
fn bad_lora_and_freeze_settings_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = lora_run(dir.path());
    let out = dir.path().join("run");
    let refused = |sets: &[&str]| -> Error {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let err = match Config::load(&path, &sets) {
            Err(e) => e,
            Ok(cfg) => Trainer::new(cfg, None).err().expect("accepted"),
        };
        assert!(!out.exists(), "{err}: the run directory was created");
        err
    };
    let field = |err: &Error| match err {
        Error::InvalidConfig { field, .. } => *field,
        other => panic!("{other}"),
    };
    let err = refused(&["model.lora.targets=[\"q_proj\"]"]);
    assert_eq!(field(&err), "model.lora.targets");
    assert!(err.to_string().contains("q_proj"), "{err}");
    assert_eq!(field(&refused(&["model.lora.rank=9"])), "model.lora.rank");
    assert_eq!(field(&refused(&["model.lora.rank=0"])), "model.lora.rank");
    assert_eq!(
        field(&refused(&["model.lora.dropout=1.0"])),
        "model.lora.dropout"
    );
    assert_eq!(
        field(&refused(&["model.lora.alpha=-1"])),
        "model.lora.alpha"
    );
    let err = refused(&["model.freeze=[\"encoder.layer.7\"]"]);
    assert_eq!(field(&err), "model.freeze");
    assert!(err.to_string().contains("encoder.layer.7"), "{err}");

    assert_eq!(
        field(&refused(&[
            "model.pretrained=\"\"",
            "model.lora.from=\"some-adapter\""
        ])),
        "model.lora.from"
    );

    // --adapter on a LoRA run of a fresh model: no base to load the adapter onto.
    let mut fresh = load(&path, &[]);
    fresh.model.pretrained.clear();
    let target = dir.path().join("fresh-adapter");
    let err = export_run_as(&fresh, None, &target, Side::Query, ExportLayout::Adapter).unwrap_err();
    assert!(err.to_string().contains("fresh"), "{err}");
    assert!(!target.exists());

    // A narrow base without LoRA.
    let mut cfg = load(&path, &[]);
    cfg.model.lora = None;
    cfg.model.base_dtype = gradcache::train::config::BaseDtype::Bf16;
    let err = cfg.validate().unwrap_err();
    assert_eq!(field(&err), "model.base_dtype");

    // --adapter on a run without LoRA.
    let mut cfg = load(&path, &[]);
    cfg.model.lora = None;
    cfg.train.steps = 1;
    cfg.train.checkpoint_every = 1;
    Trainer::new(cfg.clone(), None)
        .unwrap()
        .run(&mut Quiet)
        .unwrap();
    let target = dir.path().join("adapter");
    let err = export_run_as(&cfg, None, &target, Side::Query, ExportLayout::Adapter).unwrap_err();
    assert!(err.to_string().contains("--adapter"), "{err}");
    assert!(!target.exists());
}

#[test]
fn frozen_layers_stay_as_loaded_and_the_export_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = lora_run(dir.path());
    let mut cfg = load(
        &path,
        &["model.freeze=[\"embeddings\", \"encoder.layer.0\"]"],
    );
    cfg.model.lora = None;
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    trainer.run(&mut Quiet).unwrap();
    let base = weights(&dir.path().join("tiny-bert/model.safetensors"));
    let out = dir.path().join("export");
    export_run(&cfg, None, &out, Side::Query).unwrap();
    let exported = weights(&out.join("model.safetensors"));
    let (mut kept, mut moved) = (0, 0);
    for (name, want) in &base {
        let Some(got) = exported.get(name) else {
            continue;
        };
        let frozen = name.starts_with("embeddings.") || name.starts_with("encoder.layer.0.");
        let same = bits(got) == bits(want);
        assert_eq!(same, frozen, "`{name}`: frozen {frozen}, unchanged {same}");
        if frozen {
            kept += 1;
        } else {
            moved += 1;
        }
    }
    assert!(kept >= 5 + 16 && moved >= 16, "{kept} kept, {moved} moved");
    assert!(trainer
        .params()
        .names()
        .all(|n| !n.starts_with("embeddings.") && !n.starts_with("encoder.layer.0.")));
}

#[test]
fn a_bf16_base_trains_and_exports_at_full_width() {
    let dir = tempfile::tempdir().unwrap();
    let path = lora_run(dir.path());
    let cfg = load(&path, &["model.base_dtype=\"bf16\""]);
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    let query = trainer
        .store()
        .get("encoder.layer.0.attention.self.query.weight")
        .unwrap();
    assert_eq!(query.dtype(), candle_core::DType::BF16);
    let norm = trainer.store().get("embeddings.LayerNorm.weight").unwrap();
    assert_eq!(norm.dtype(), candle_core::DType::F32);
    trainer.run(&mut Quiet).unwrap();
    let out = dir.path().join("merged");
    export_run(&cfg, None, &out, Side::Query).unwrap();
    let exported = weights(&out.join("model.safetensors"));
    assert!(exported
        .values()
        .all(|t| t.dtype() == candle_core::DType::F32));
    EmbeddingModel::load(&out.display().to_string(), &LoadOptions::default())
        .unwrap()
        .embed(&["the lord is my shepherd"], 1)
        .unwrap();
}

#[test]
fn checkpoints_of_a_lora_run_merge_through_the_cli_with_the_runs_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = lora_run(dir.path());
    let cfg = load(&path, &[]);
    Trainer::new(cfg.clone(), None)
        .unwrap()
        .run(&mut Quiet)
        .unwrap();
    let ckpt = |step: u32| dir.path().join(format!("run/checkpoints/step-{step:08}"));
    let gradcache = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (two, four) = (ckpt(2).display().to_string(), ckpt(4).display().to_string());
    let config = path.display().to_string();
    let out = dir.path().join("merged");
    let out_arg = out.display().to_string();

    // Without the run's config a checkpoint is refused, naming the way out.
    let (ok, stderr) = gradcache(&[
        "merge", "--model", &two, "--model", &four, "--output", &out_arg,
    ]);
    assert!(!ok && stderr.contains("--config"), "{stderr}");
    assert!(!out.exists());

    // With it: each checkpoint exported (the merged LoRA model), then slerp'd.
    let (ok, stderr) = gradcache(&[
        "merge", "--config", &config, "--model", &two, "--model", &four, "--method", "slerp",
        "--output", &out_arg,
    ]);
    assert!(ok, "{stderr}");
    let leftovers: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".export"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temporary exports left: {leftovers:?}"
    );
    let merged = weights(&out.join("model.safetensors"));
    assert!(merged.keys().all(|n| !n.contains("lora_")));
    // Between the two exports, tensor by tensor: each merged weight lies within the
    // range the two checkpoints span (slerp of two weights stays between them in norm).
    let (e2, e4) = (dir.path().join("e2"), dir.path().join("e4"));
    export_run(&cfg, Some(&ckpt(2)), &e2, Side::Query).unwrap();
    export_run(&cfg, Some(&ckpt(4)), &e4, Side::Query).unwrap();
    let (w2, w4) = (
        weights(&e2.join("model.safetensors")),
        weights(&e4.join("model.safetensors")),
    );
    let norm = |t: &candle_core::Tensor| {
        let t = t.to_dtype(candle_core::DType::F32).unwrap();
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt()
    };
    let mut moved = 0;
    for (name, m) in &merged {
        let (a, b) = (&w2[name], &w4[name]);
        let (na, nb, nm) = (norm(a), norm(b), norm(m));
        assert!(
            nm <= na.max(nb) * (1.0 + 1e-5),
            "`{name}`: {nm} outside {na}..{nb}"
        );
        if max_diff(a, b) > 0.0 {
            let (da, db) = (max_diff(m, a), max_diff(m, b));
            assert!(da > 0.0 && db > 0.0, "`{name}` is one of the two");
            moved += 1;
        }
    }
    assert!(moved > 0, "the two checkpoints hold the same model");
    let model = EmbeddingModel::load(&out_arg, &LoadOptions::default()).unwrap();
    assert!(model.embed(&["the lord is my shepherd"], 1).is_ok());
}

/// A LoRA run of 2 steps on the tiny `family` fixture (a rotary post-norm family).
fn rotary_lora_run(dir: &Path, family: &str) -> PathBuf {
    let data = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/quickstart/train.jsonl"),
    )
    .unwrap();
    let rows: Vec<&str> = data.lines().take(24).collect();
    fs::write(dir.join("pairs.jsonl"), rows.join("\n") + "\n").unwrap();
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{dir}/pairs.jsonl"
eval_pairs = 8
[model]
pretrained = "{model}"
query_max_len = 16
passage_max_len = 24
[model.lora]
rank = 2
alpha = 4.0
[train]
steps = 2
batch_size = 8
query_chunk = 4
passage_chunk = 4
[optim]
lr = 1e-2
"#,
        out = dir.join(format!("run-{family}")).display(),
        dir = dir.display(),
        model = crate::common::families::fixture(family).display(),
    );
    let path = dir.join(format!("{family}.toml"));
    fs::write(&path, config).unwrap();
    path
}

/// NomicBERT's, GTE's and Jina v3's adapters are written under the names transformers 5
/// gives the loaded model (PEFT adapts it: `layers.{i}.self_attn.q_proj`, ..., a fused
/// projection's adapter split by rows with its `A` on every part), read back fused to the
/// same embeddings as the merged export, continued with `model.lora.from`; an adapter
/// whose parts have their own `A` is refused naming them.
#[test]
fn a_rotary_familys_adapter_is_written_as_peft_names_the_loaded_model_and_read_back() {
    for (family, parts) in [
        ("nomic_bert", ["self_attn.q_proj", "mlp.gate_proj"]),
        ("gte", ["self_attn.v_proj", "mlp.up_proj"]),
        ("jina_embeddings_v3", ["self_attn.k_proj", "mlp.fc1"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = rotary_lora_run(dir.path(), family);
        let cfg = load(&path, &[]);
        Trainer::new(cfg.clone(), None)
            .unwrap()
            .run(&mut Quiet)
            .unwrap();
        let merged = dir.path().join("merged");
        export_run(&cfg, None, &merged, Side::Query).unwrap();
        let adapter = dir.path().join("adapter");
        export_run_as(&cfg, None, &adapter, Side::Query, ExportLayout::Adapter).unwrap();
        let tensors = weights(&adapter.join("adapter_model.safetensors"));
        for part in parts {
            let name = format!("base_model.model.layers.1.{part}.lora_A.weight");
            assert!(tensors.contains_key(&name), "{family}: {name}");
        }
        assert!(
            tensors
                .keys()
                .all(|n| !n.contains("Wqkv") && !n.contains("qkv_proj")),
            "{family}: a fused name in {:?}",
            tensors.keys()
        );
        let config: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(adapter.join("adapter_config.json")).unwrap())
                .unwrap();
        let targets = config["target_modules"].to_string();
        assert!(targets.contains("self_attn.q_proj"), "{family}: {targets}");

        let texts = [
            "In the beginning God created the heaven and the earth.",
            "Jesus wept.",
        ];
        let embed = |dir: &Path| {
            EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
                .unwrap()
                .embed(&texts, 2)
                .unwrap()
        };
        let err = max_diff(&embed(&adapter), &embed(&merged));
        assert!(
            err <= 1e-6,
            "{family}: the adapter embeds {err:e} off the merged model"
        );

        // Continued: the run starts from the adapter's values.
        let sets = [
            format!("model.lora.from=\"{}\"", adapter.display()),
            format!("output_dir=\"{}\"", dir.path().join("again").display()),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let trainer = Trainer::new(load(&path, &sets), None).unwrap();
        let name = match family {
            "gte" => "encoder.layer.0.attention.qkv_proj.lora_B.weight",
            "jina_embeddings_v3" => "encoder.layers.0.mixer.Wqkv.lora_B.weight",
            _ => "encoder.layers.0.attn.Wqkv.lora_B.weight",
        };
        let b = trainer
            .params()
            .iter()
            .find(|(n, _)| n.ends_with(name))
            .map(|(_, v)| v.as_tensor().clone())
            .unwrap_or_else(|| panic!("{family}: no {name}"));
        assert!(
            common::max_abs(&b) > 0.0,
            "{family}: {name} starts from zero"
        );

        // Parts trained apart: no fused adapter of one rank equals them.
        let mut edited = tensors.clone();
        let k = "base_model.model.layers.0.self_attn.k_proj.lora_A.weight";
        edited.insert(k.into(), (edited[k].clone() + 1.0).unwrap());
        candle_core::safetensors::save(&edited, adapter.join("adapter_model.safetensors")).unwrap();
        let err = EmbeddingModel::load(adapter.to_str().unwrap(), &LoadOptions::default())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("k_proj") && err.contains("lora_A"),
            "{family}: {err}"
        );
    }
}
