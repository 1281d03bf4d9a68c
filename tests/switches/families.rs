//! Every supported model family against transformers and sentence-transformers, without
//! network: `tests/fixtures/families/<family>/` holds a tiny random model of the family
//! (weights perturbed away from their initialisation, a tokenizer trained on the repo's
//! sample text), saved by sentence-transformers 6.2, with reference outputs written by
//! `scripts/make_family_fixtures.py` (versions in each `reference.json`):
//!
//! - the last hidden state of every text (real tokens), <= 1e-5;
//! - the sentence embedding under each of the six pooling modes, <= 1e-5;
//! - the gradient of every parameter under a fixed contrastive loss (cosine x 20,
//!   cross-entropy over in-batch passages), <= 1e-4 relative (floored at 1e-3 of the
//!   largest entry), with and without chunking and recompute;
//! - an export of ours loads back to the same embeddings.
//!
//! The texts include an empty string and one longer than the model's 32-token limit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions, Pooling};
use gradcache::hub::{
    export_bert, read_sentence_transformers_config, EmbeddingModel, LoadOptions, ModelFiles,
    Tokenizer,
};
use gradcache::{Ctx, Encoder, Error, GradCache, InfoNce, ParamStore, Recompute, Similarity};

use crate::common;
use crate::common::families::{assert_step_matches, fixture, reference, refs, ENCODERS};
use crate::common::max_diff;

const MAX_LEN: usize = 32;

fn load(dir: &Path, pooling: Option<Pooling>) -> EmbeddingModel {
    let options = LoadOptions {
        pooling,
        max_len: Some(MAX_LEN),
        ..Default::default()
    };
    EmbeddingModel::load(dir.to_str().unwrap(), &options).unwrap()
}

#[test]
fn hidden_states_match_transformers_for_every_family() {
    let _switches = crate::steady();
    for family in ENCODERS {
        let r = reference(family);
        let model = load(&fixture(family), None);
        let batch = model
            .tokenizer()
            .encode(&refs(&r.texts), &Device::Cpu)
            .unwrap();
        let bert = model.encoder().tower().detached_model();
        let hidden = bert.hidden_states(&batch, &Ctx::eval()).unwrap();
        let lengths: Vec<u32> = batch
            .attention_mask
            .to_dtype(DType::U32)
            .unwrap()
            .sum(1)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, &len) in lengths.iter().enumerate() {
            let want = &r.tensors[&format!("hidden.{i}")];
            assert_eq!(
                want.dim(0).unwrap(),
                len as usize,
                "{family}: text {i} tokens"
            );
            let got = hidden.get(i).unwrap().narrow(0, 0, len as usize).unwrap();
            let err = max_diff(&got, want);
            assert!(
                err <= 1e-5,
                "{family}: hidden state of text {i} differs by {err:e}"
            );
        }
    }
}

#[test]
fn every_pooling_mode_matches_sentence_transformers() {
    let _switches = crate::steady();
    for family in ENCODERS {
        let r = reference(family);
        // The files say mean pooling, in the current package's layout (`pooling_mode`).
        let model = load(&fixture(family), None);
        assert!(
            model.settings().starts_with("pooling mean (from"),
            "{}",
            model.settings()
        );
        for mode in Pooling::ALL {
            let model = load(&fixture(family), Some(mode));
            let got = model.embed(&refs(&r.texts), 4).unwrap();
            let want = &r.tensors[&format!("pooled.{}", mode.name())];
            let err = max_diff(&got, want);
            assert!(
                err <= 1e-5,
                "{family}: pooling {} differs by {err:e}",
                mode.name()
            );
        }
    }
}

/// The gradient-cache step of the reference loss on the model of `family`.
fn step(family: &str, chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture(family);
    let r = reference(family);
    let files = ModelFiles::from_dir(&dir).unwrap();
    // A model's Dense modules train with it.
    let dense = read_sentence_transformers_config(&dir)
        .unwrap()
        .map(|head| head.dense.iter().map(|d| d.spec()).collect())
        .unwrap_or_default();
    let options = BertOptions {
        lora: None,
        recompute,
        dense,
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let loss = InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine);
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), MAX_LEN).unwrap();
    let q = tokenizer.encode(&refs(&r.queries), &Device::Cpu).unwrap();
    let p = tokenizer.encode(&refs(&r.passages), &Device::Cpu).unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn gradients_match_pytorch_with_and_without_chunks_and_recompute() {
    let _switches = crate::steady();
    // bert-dense: BERT with a Dense (tanh) and a Normalize module after the pooling, the
    // Dense weights trained too.
    for family in ENCODERS.into_iter().chain(["bert-dense"]) {
        let r = reference(family);
        let want: HashMap<String, &Tensor> = r
            .tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n.to_string(), v)))
            .collect();
        for (chunk, recompute) in [
            (4, Recompute::Off),
            (1, Recompute::Off),
            (3, Recompute::Attention),
            (2, Recompute::EveryLayer),
        ] {
            let (loss, grads) = step(family, chunk, recompute.clone());
            let what = format!("{family}, chunk {chunk}, recompute {recompute:?}");
            let seen = assert_step_matches(&what, (loss, &grads), r.loss, &want);
            assert_eq!(seen, want.len(), "{what}: every parameter gets a gradient");
        }
    }
}

#[test]
fn an_export_loads_back_to_the_same_embeddings_and_family() {
    let _switches = crate::steady();
    for family in ENCODERS {
        let r = reference(family);
        let model = load(&fixture(family), None);
        let before = model.embed(&refs(&r.texts), 8).unwrap();
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("export");
        export_bert(
            &dir,
            model.config(),
            model.options(),
            Similarity::Cosine,
            model.encoder().params(),
            "",
            model.tokenizer(),
            &gradcache::hub::export::ExportNotes {
                prompts: model.prompts().clone(),
                matryoshka_dims: Vec::new(),
                prompt_left_out: false,
                adapter_of: None,
                multi_vector: None,
                static_query: None,
                merge_task: None,
            },
        )
        .unwrap();
        // The tokenizer config names the family's own special tokens (sentence-transformers
        // pads with `pad_token`).
        let read = |p: PathBuf| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        let ours = read(dir.join("tokenizer_config.json"));
        let theirs = read(fixture(family).join("tokenizer_config.json"));
        for key in [
            "pad_token",
            "cls_token",
            "sep_token",
            "unk_token",
            "mask_token",
        ] {
            assert_eq!(ours[key], theirs[key], "{family}: {key}");
        }
        let again = load(&dir, None);
        let after = again.embed(&refs(&r.texts), 8).unwrap();
        assert!(
            max_diff(&before, &after) <= 1e-6,
            "{family}: {}",
            max_diff(&before, &after)
        );
        assert_eq!(again.config().model_type, model.config().model_type);
        assert!(again.settings().starts_with("pooling mean (from"));
    }
}

#[test]
fn a_dense_and_a_normalize_module_after_the_pooling_are_applied() {
    let _switches = crate::steady();
    let dir = fixture("bert-dense");
    let r = reference("bert-dense");
    let model = load(&dir, None);
    assert_eq!(model.dense().len(), 1);
    assert!(
        model.settings().contains("Dense 32 -> 16"),
        "{}",
        model.settings()
    );
    let got = model.embed(&refs(&r.texts), 4).unwrap();
    let want = &r.tensors["embeddings"];
    assert_eq!(got.dims(), want.dims());
    let err = max_diff(&got, want);
    assert!(err <= 1e-5, "Dense + Normalize differ by {err:e}");
}

/// A copy of the BERT fixture's files with the pooling config replaced by `pooling` and
/// `modules.json` by `modules`.
fn with_head(dir: &Path, pooling: &str, modules: Option<&str>) -> PathBuf {
    let src = fixture("bert");
    let out = dir.join("model");
    std::fs::create_dir_all(out.join("1_Pooling")).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "modules.json",
    ] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    std::fs::write(out.join("1_Pooling/config.json"), pooling).unwrap();
    if let Some(m) = modules {
        std::fs::write(out.join("modules.json"), m).unwrap();
    }
    out
}

#[test]
fn sentence_transformers_files_of_every_version_are_read() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let old_modules = r#"[
      {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
      {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
      {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    ]"#;
    let cases = [
        // The layout of sentence-transformers before 5.x: booleans.
        (
            r#"{"word_embedding_dimension": 32, "pooling_mode_cls_token": false,
               "pooling_mode_mean_tokens": false, "pooling_mode_max_tokens": true,
               "pooling_mode_mean_sqrt_len_tokens": false}"#,
            Some(old_modules),
            Pooling::Max,
            true,
        ),
        // The current layout: one string, `embedding_dimension`, `include_prompt`.
        (
            r#"{"embedding_dimension": 32, "pooling_mode": "lasttoken", "include_prompt": false}"#,
            None,
            Pooling::LastToken,
            false,
        ),
        (
            r#"{"embedding_dimension": 32, "pooling_mode": ["weightedmean"]}"#,
            None,
            Pooling::WeightedMean,
            false,
        ),
    ];
    for (i, (pooling, modules, mode, normalize)) in cases.into_iter().enumerate() {
        let dir = with_head(&tmp.path().join(i.to_string()), pooling, modules);
        let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
        assert_eq!(head.pooling, mode, "{pooling}");
        assert_eq!(head.normalize, normalize, "{pooling}");
        assert_eq!(head.include_prompt, i != 1);
    }
    // Refused, naming what is wrong.
    for (pooling, modules, needle) in [
        (
            r#"{"embedding_dimension": 32, "pooling_mode": ["cls", "mean"]}"#,
            None,
            "several modes",
        ),
        (
            r#"{"word_embedding_dimension": 32, "pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#,
            None,
            "pooling_mode_cls_token + pooling_mode_mean_tokens",
        ),
        (r#"{"pooling_mode": "median"}"#, None, "median"),
        (
            r#"{"pooling_mode": "mean"}"#,
            Some(
                r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
                   {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]"#,
            ),
            "sentence_transformers.models.LayerNorm",
        ),
    ] {
        let dir = with_head(&tmp.path().join("bad"), pooling, modules);
        let err = read_sentence_transformers_config(&dir).unwrap_err();
        assert!(
            matches!(err, Error::UnsupportedConfig { .. }) && err.to_string().contains(needle),
            "{pooling}: {err}"
        );
        std::fs::remove_dir_all(tmp.path().join("bad")).unwrap();
    }
}

#[test]
fn another_model_type_is_refused_naming_the_supported_families() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let dir = with_head(tmp.path(), r#"{"pooling_mode": "mean"}"#, None);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = "electra".into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let err = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(
        text.contains("electra")
            && text.contains("distilbert")
            && text.contains("xlm-roberta")
            && text.contains("qwen3"),
        "{text}"
    );
}

#[test]
fn every_family_trains_and_its_export_loads_back_as_the_family() {
    let _switches = crate::steady();
    use gradcache::train::{export_run, Config, Quiet, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let lines: Vec<String> = std::fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, lines[..40].join("\n")).unwrap();
    for family in ENCODERS {
        let out = tmp.path().join(family);
        let config = format!(
            r#"
output_dir = "{out}"
[data]
train_file = "{data}"
eval_pairs = 8
[model]
pretrained = "{model}"
query_max_len = 24
passage_max_len = 32
[train]
steps = 2
batch_size = 8
query_chunk = 3
passage_chunk = 5
"#,
            out = out.display(),
            data = data.display(),
            model = fixture(family).display(),
        );
        let path = tmp.path().join(format!("{family}.toml"));
        std::fs::write(&path, config).unwrap();
        let cfg = Config::load(&path, &[]).unwrap();
        let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
        let before: Vec<f32> = trainer
            .params()
            .iter()
            .map(|(_, v)| common::max_abs(v.as_tensor()) as f32)
            .collect();
        trainer.run(&mut Quiet).unwrap();
        let moved = trainer
            .params()
            .iter()
            .zip(&before)
            .filter(|((_, v), b)| common::max_abs(v.as_tensor()) as f32 != **b)
            .count();
        assert!(moved > 0, "{family}: training moved no weight");
        let export = tmp.path().join(format!("{family}-export"));
        export_run(&cfg, None, &export, gradcache::Side::Query).unwrap();
        let exported: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(exported["model_type"], family, "{family}");
        let live = tmp.path().join(format!("{family}-live"));
        trainer.export(&live, gradcache::Side::Query).unwrap();
        let r = reference(family);
        let a = load(&export, None).embed(&refs(&r.texts), 4).unwrap();
        let b = load(&live, None).embed(&refs(&r.texts), 4).unwrap();
        assert!(max_diff(&a, &b) <= 1e-6, "{family}");
        // Trained: no longer the fixture's embeddings.
        let c = load(&fixture(family), None)
            .embed(&refs(&r.texts), 4)
            .unwrap();
        assert!(
            max_diff(&a, &c) > 1e-4,
            "{family}: the export is the untrained model"
        );
    }
}

#[test]
fn the_composed_ops_match_transformers_too() {
    let _switches = crate::switching();
    // The path a GPU or a half dtype takes (the fused CPU kernels off).
    gradcache::nn::set_fused_kernels(false);
    let result = std::panic::catch_unwind(|| {
        for family in [
            "roberta",
            "xlm-roberta",
            "mpnet",
            "modernbert",
            "distilbert",
        ] {
            let r = reference(family);
            let model = load(&fixture(family), None);
            let got = model.embed(&refs(&r.texts), 4).unwrap();
            let err = max_diff(&got, &r.tensors["pooled.mean"]);
            assert!(
                err <= 1e-5,
                "{family}: composed embeddings differ by {err:e}"
            );
            let (loss, _) = step(family, 2, Recompute::EveryLayer);
            assert!(
                (loss as f64 - r.loss).abs() <= 1e-5,
                "{family}: loss {loss}"
            );
        }
    });
    gradcache::nn::set_fused_kernels(true);
    result.unwrap();
}

/// A copy of fixture `family` in `dir` with its `file` (JSON) edited by `edit`.
pub(crate) fn edited(
    dir: &Path,
    family: &str,
    file: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> PathBuf {
    let out = dir.join(format!("{family}-{}", file.replace('/', "-")));
    crate::common::families::edited_copy(&fixture(family), &out, file, edit)
}

pub(crate) fn load_err(dir: &Path) -> String {
    EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
        .err()
        .expect("refused")
        .to_string()
}

#[test]
fn bad_family_configs_and_module_files_are_refused_naming_the_problem() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    // ModernBERT's own fields.
    let dir = edited(t, "modernbert", "config.json", |c| {
        c["layer_types"] = serde_json::json!(["full_attention", "local"])
    });
    assert!(load_err(&dir).contains("layer_types"));
    let dir = edited(t, "modernbert", "config.json", |c| {
        c["rope_parameters"]["sliding_attention"]["rope_type"] = "yarn".into()
    });
    let err = load_err(&dir);
    assert!(err.contains("rope_type") && err.contains("yarn"), "{err}");
    let dir = edited(t, "modernbert", "config.json", |c| {
        c["mlp_dropout"] = 1.5.into()
    });
    assert!(load_err(&dir).contains("mlp_dropout"));
    // MPNet needs room for its relative position buckets.
    let dir = edited(t, "mpnet", "config.json", |c| {
        c["relative_attention_num_buckets"] = 2.into()
    });
    assert!(load_err(&dir).contains("relative_attention_num_buckets"));
    // Dense modules: an activation this crate does not run, weights of another shape.
    let dir = edited(t, "bert-dense", "2_Dense/config.json", |c| {
        c["activation_function"] = "torch.nn.modules.activation.Softplus".into()
    });
    assert!(load_err(&dir).contains("Softplus"));
    let dir = edited(t, "bert-dense", "2_Dense/config.json", |c| {
        c["out_features"] = 8.into()
    });
    assert!(load_err(&dir).contains("linear.weight"));
    // A Dense module whose input is not the pooled width (its files agree with each
    // other, not with the model).
    let dir = edited(t, "bert-dense", "2_Dense/config.json", |c| {
        c["in_features"] = 31.into()
    });
    let weights = HashMap::from([
        (
            "linear.weight".to_string(),
            Tensor::zeros((16, 31), DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "linear.bias".to_string(),
            Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap(),
        ),
    ]);
    candle_core::safetensors::save(&weights, dir.join("2_Dense/model.safetensors")).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("Dense module") && err.contains("31"), "{err}");
    // A Dense directory whose name cannot name parameters.
    let dir = edited(t, "bert-dense", "modules.json", |m| {
        m[2]["path"] = "2.Dense".into()
    });
    std::fs::rename(dir.join("2_Dense"), dir.join("2.Dense")).unwrap();
    let err = load_err(&dir);
    assert!(
        err.contains("Dense module") && err.contains("2.Dense"),
        "{err}"
    );
    // Modules out of order, and no pooling at all.
    let dir = edited(t, "bert-dense", "modules.json", |m| {
        let list = m.as_array_mut().unwrap();
        list.swap(1, 3);
    });
    assert!(load_err(&dir).contains("Normalize"), "{}", load_err(&dir));
    let dir = edited(t, "bert", "modules.json", |m| {
        m.as_array_mut().unwrap().truncate(1);
    });
    assert!(load_err(&dir).contains("no Pooling module"));
}

#[test]
fn a_dense_module_trains_with_the_model_and_is_exported_back() {
    let _switches = crate::steady();
    use gradcache::train::{export_run, Config, Quiet, Trainer, DENSE_FILE};
    let tmp = tempfile::tempdir().unwrap();
    let lines: Vec<String> = std::fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .take(40)
        .map(String::from)
        .collect();
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out = tmp.path().join("run");
    let sets = [
        format!("output_dir=\"{}\"", out.display()),
        format!("data.train_file=\"{}\"", data.display()),
        "data.eval_file=\"data/quickstart/eval.jsonl\"".into(),
        "train.batch_size=8".into(),
        "train.steps=3".into(),
        "train.eval_every=0".into(),
        "model.normalize=true".into(),
        format!("model.pretrained=\"{}\"", fixture("bert-dense").display()),
        "model.query_max_len=32".into(),
        "model.passage_max_len=32".into(),
    ];
    let cfg = Config::load(Path::new("configs/quickstart.toml"), &sets).unwrap();
    let mut trainer = Trainer::new(cfg.clone(), None).unwrap();
    let dense: Vec<(String, Tensor)> = trainer
        .params()
        .iter()
        .filter(|(n, _)| n.contains("2_Dense.linear."))
        .map(|(n, v)| (n.to_string(), v.as_tensor().copy().unwrap()))
        .collect();
    assert_eq!(dense.len(), 2, "the Dense weight and bias are trained");
    let original = candle_core::safetensors::load(
        fixture("bert-dense").join("2_Dense/model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    for (name, value) in &dense {
        let file_name = &name[name.find("linear.").unwrap()..];
        assert_eq!(
            max_diff(value, &original[file_name]),
            0.0,
            "`{name}` loaded"
        );
    }
    trainer.run(&mut Quiet).unwrap();
    for (name, before) in &dense {
        let now = trainer.params().get(name).unwrap();
        assert!(max_diff(now.as_tensor(), before) > 0.0, "`{name}` moved");
    }
    assert!(
        out.join(DENSE_FILE).is_file(),
        "the run records its Dense modules"
    );

    // The export (live and from the run directory) writes the module back, and loads
    // back to the trained model's embeddings.
    let live = tmp.path().join("live");
    trainer.export(&live, gradcache::Side::Query).unwrap();
    let from_run = tmp.path().join("from-run");
    export_run(&cfg, None, &from_run, gradcache::Side::Query).unwrap();
    let modules = std::fs::read_to_string(live.join("modules.json")).unwrap();
    assert!(
        modules.contains("2_Dense") && modules.contains("3_Normalize"),
        "{modules}"
    );
    let texts = ["In the beginning", "", "And God said"];
    let a = load(&live, None);
    assert_eq!(a.dense().len(), 1);
    assert_eq!(
        a.dense()[0].spec(),
        read_sentence_transformers_config(&fixture("bert-dense"))
            .unwrap()
            .unwrap()
            .dense[0]
            .spec()
    );
    let exported = a.encoder().params();
    let trained = trainer.params();
    let suffix = |n: &str| n[n.find("2_Dense").unwrap()..].to_string();
    for (name, _) in &dense {
        let got = exported.get(&suffix(name)).expect("exported Dense weight");
        assert_eq!(
            max_diff(got.as_tensor(), trained.get(name).unwrap().as_tensor()),
            0.0
        );
    }
    let ea = a.embed(&texts, 2).unwrap();
    let eb = load(&from_run, None).embed(&texts, 2).unwrap();
    assert!(max_diff(&ea, &eb) <= 1e-6);
    let original = load(&fixture("bert-dense"), None).embed(&texts, 2).unwrap();
    assert!(
        max_diff(&ea, &original) > 1e-4,
        "the export holds the trained model"
    );
    assert_eq!(ea.dims(), [3, 16]);

    // A damaged record of the run's Dense modules is refused, naming the file; nothing
    // is written.
    std::fs::write(
        out.join(DENSE_FILE),
        r#"[{"path": "2_Dense", "config": {"in_features": 32}}]"#,
    )
    .unwrap();
    let again = tmp.path().join("again");
    let err = export_run(&cfg, None, &again, gradcache::Side::Query)
        .unwrap_err()
        .to_string();
    assert!(err.contains(DENSE_FILE), "{err}");
    assert!(!again.exists());
}
