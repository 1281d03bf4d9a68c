//! Loading models: local directories, a Hugging Face cache layout in offline mode, the
//! tokenizer, and a clear error for every bad model directory.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions};
use gradcache::hub::files::{HubSettings, ModelFiles};
use gradcache::hub::tokenizer::Tokenizer;
use gradcache::{Error, ParamStore};

use crate::common::{write_bert_dir, write_tokenizer, TINY_BERT};

/// A complete model directory: config, weights (optionally `bert.`-prefixed), tokenizer.
fn write_model(dir: &Path, bert_prefix: bool) -> ParamStore {
    write_bert_dir(dir, TINY_BERT, bert_prefix)
}

fn same_weights(a: &ParamStore, b: &ParamStore) {
    assert_eq!(a.params().len(), b.params().len());
    for (name, var) in a.params().iter() {
        let other = b.get(name).unwrap_or_else(|| panic!("`{name}` not loaded"));
        let d = var
            .as_tensor()
            .sub(other.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "`{name}` differs");
    }
}

fn fresh() -> ParamStore {
    ParamStore::new(99, DType::F32, &Device::Cpu)
}

#[test]
fn loads_a_local_directory_with_or_without_the_bert_prefix() {
    for prefix in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let original = write_model(dir.path(), prefix);
        let files = ModelFiles::resolve(
            dir.path().to_str().unwrap(),
            &HubSettings::from_lookup(|_| None),
        )
        .unwrap();
        assert!(files.tokenizer.is_some());
        let (_, cfg, store) =
            load_pretrained(&files, "", &BertOptions::default(), fresh()).unwrap();
        assert_eq!(cfg.num_hidden_layers, 2);
        same_weights(&original, &store);
        assert!(
            store.get("cls.predictions.bias").is_none(),
            "unused tensors are not loaded"
        );
    }
}

#[test]
fn two_towers_load_from_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let original = write_model(dir.path(), true);
    let files = ModelFiles::from_dir(dir.path()).unwrap();
    let (_, _, store) = load_pretrained(&files, "query", &BertOptions::default(), fresh()).unwrap();
    let (_, _, store) = load_pretrained(&files, "passage", &BertOptions::default(), store).unwrap();
    assert_eq!(store.params().len(), 2 * original.params().len());
    for (name, var) in original.params().iter() {
        for tower in ["query", "passage"] {
            let loaded = store.get(&format!("{tower}.{name}")).unwrap();
            let d = var
                .as_tensor()
                .sub(loaded.as_tensor())
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        }
    }
}

#[test]
fn loads_from_a_hugging_face_cache_offline() {
    let home = tempfile::tempdir().unwrap();
    let repo = home
        .path()
        .join("hub")
        .join("models--sentence-transformers--tiny-bert");
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    let original = write_model(&repo.join("snapshots").join("0123abcd"), false);

    let vars: HashMap<&str, String> = [
        ("HF_HOME", home.path().to_str().unwrap().to_string()),
        ("HF_HUB_OFFLINE", "1".to_string()),
    ]
    .into();
    let hub = HubSettings::from_lookup(|k| vars.get(k).cloned());
    assert!(hub.offline);
    assert_eq!(hub.cache_dir, home.path().join("hub"));

    let files = ModelFiles::resolve("sentence-transformers/tiny-bert", &hub).unwrap();
    assert!(files.weights.starts_with(&repo));
    let (_, _, store) = load_pretrained(&files, "", &BertOptions::default(), fresh()).unwrap();
    same_weights(&original, &store);

    // Not cached, offline: a clear error, no network.
    let err = ModelFiles::resolve("sentence-transformers/not-cached", &hub).unwrap_err();
    assert!(matches!(err, Error::Hub { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("config.json") && msg.contains("HF_HUB_OFFLINE"),
        "{msg}"
    );
}

#[test]
fn hub_settings_follow_the_environment_conventions() {
    let from = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubSettings::from_lookup(|k| map.get(k).cloned())
    };
    assert_eq!(
        from(&[("HOME", "/h")]).cache_dir,
        Path::new("/h/.cache/huggingface/hub")
    );
    assert_eq!(from(&[("HF_HOME", "/x")]).cache_dir, Path::new("/x/hub"));
    assert_eq!(
        from(&[("HF_HOME", "/x"), ("HF_HUB_CACHE", "/c")]).cache_dir,
        Path::new("/c")
    );
    assert!(!from(&[]).offline);
    assert!(from(&[("HF_HUB_OFFLINE", "true")]).offline);
    assert!(!from(&[("HF_HUB_OFFLINE", "0")]).offline);
}

#[test]
fn tokenizer_truncates_and_pads_to_the_longest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    write_tokenizer(&path);
    let tok = Tokenizer::from_file(&path, 6).unwrap();
    let batch = tok
        .encode(
            &[
                "The Lord is my shepherd",
                "light",
                "the lords, the light, the shepherd",
            ],
            &Device::Cpu,
        )
        .unwrap();
    // [CLS]=2 the=4 lord=5 is=6 my=7 shepherd=8 ... truncated to 6 with [SEP]=3 kept.
    assert_eq!(
        batch.input_ids.to_vec2::<u32>().unwrap(),
        vec![
            vec![2, 4, 5, 6, 7, 3],
            vec![2, 10, 3, 0, 0, 0],
            vec![2, 4, 5, 9, 11, 3]
        ]
    );
    assert_eq!(
        batch.attention_mask.to_vec2::<u32>().unwrap(),
        vec![vec![1; 6], vec![1, 1, 1, 0, 0, 0], vec![1; 6]]
    );
    assert_eq!(
        batch.token_type_ids.to_vec2::<u32>().unwrap(),
        vec![vec![0; 6]; 3]
    );

    // A batch of short texts is only as long as its longest text.
    let short = tok.encode(&["light", "my light"], &Device::Cpu).unwrap();
    assert_eq!(
        short.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![2, 10, 3, 0], vec![2, 7, 10, 3]]
    );

    let err = Tokenizer::from_file(&dir.path().join("nope.json"), 6)
        .err()
        .unwrap();
    assert!(matches!(err, Error::MissingFile { .. }), "{err:?}");
}

#[test]
fn missing_config_or_weights() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelFiles::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingFile {
                what: "model config",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("missing model config: "),
        "{err}"
    );
    fs::write(dir.path().join("config.json"), TINY_BERT).unwrap();
    let err = ModelFiles::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingFile {
                what: "safetensors weights",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("model.safetensors"));
}

#[test]
fn pickle_only_directory() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), TINY_BERT).unwrap();
    fs::write(dir.path().join("pytorch_model.bin"), b"not really a pickle").unwrap();
    let err = ModelFiles::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, Error::PickleOnly { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("pytorch_model.bin") && msg.contains("safetensors weights only"),
        "{msg}"
    );
}

#[test]
fn unsupported_activation() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), false);
    fs::write(
        dir.path().join("config.json"),
        TINY_BERT.replace("gelu_new", "mish"),
    )
    .unwrap();
    let files = ModelFiles::from_dir(dir.path()).unwrap();
    let err = load_pretrained(&files, "", &BertOptions::default(), fresh())
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            Error::UnsupportedConfig {
                field: "hidden_act",
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("unsupported `hidden_act` = \"mish\""),
        "{msg}"
    );
    assert!(msg.contains("gelu, gelu_new"), "{msg}");
}

#[test]
fn weight_with_the_wrong_shape_or_missing() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), true);
    // The config now promises a wider intermediate layer than the weights have.
    fs::write(
        dir.path().join("config.json"),
        TINY_BERT.replace("\"intermediate_size\": 16", "\"intermediate_size\": 20"),
    )
    .unwrap();
    let files = ModelFiles::from_dir(dir.path()).unwrap();
    let err = load_pretrained(&files, "", &BertOptions::default(), fresh())
        .err()
        .unwrap();
    assert!(matches!(err, Error::WeightShape { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "weight `bert.encoder.layer.0.intermediate.dense.weight` in {} has shape [16, 8], but the config needs [20, 8]",
            files.weights.display()
        )
    );

    // A config with more layers than the file has.
    fs::write(
        dir.path().join("config.json"),
        TINY_BERT.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"),
    )
    .unwrap();
    let err = load_pretrained(&files, "", &BertOptions::default(), fresh())
        .err()
        .unwrap();
    assert!(matches!(err, Error::MissingWeight { .. }), "{err:?}");
    assert!(
        err.to_string().starts_with("weight `bert.encoder.layer.2."),
        "{err}"
    );
}

#[test]
fn corrupt_files_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), false);
    let files = ModelFiles::from_dir(dir.path()).unwrap();

    fs::write(&files.weights, b"definitely not safetensors").unwrap();
    let err = load_pretrained(&files, "", &BertOptions::default(), fresh())
        .err()
        .unwrap();
    assert!(matches!(err, Error::ModelFile { .. }), "{err:?}");
    assert!(err
        .to_string()
        .starts_with(&format!("cannot read {}", files.weights.display())));

    fs::write(&files.config, "{ not json").unwrap();
    let err = load_pretrained(&files, "", &BertOptions::default(), fresh())
        .err()
        .unwrap();
    assert!(matches!(err, Error::ModelFile { .. }), "{err:?}");
    assert!(err.to_string().contains("config.json"), "{err}");

    let tokenizer = files.tokenizer.unwrap();
    fs::write(&tokenizer, "[]").unwrap();
    let err = Tokenizer::from_file(&tokenizer, 8).err().unwrap();
    assert!(matches!(err, Error::ModelFile { .. }), "{err:?}");
}

#[test]
fn too_short_max_len_and_too_long_sequences() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), false);
    let files = ModelFiles::from_dir(dir.path()).unwrap();
    let tokenizer = files.tokenizer.clone().unwrap();
    let err = Tokenizer::from_file(&tokenizer, 1).err().unwrap();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "max_len",
                ..
            }
        ),
        "{err:?}"
    );

    // The model covers 16 positions; a 20-token batch is refused, not silently indexed.
    let (encoder, _, _) = load_pretrained(&files, "", &BertOptions::default(), fresh()).unwrap();
    let ids = Tensor::ones((1, 20), DType::U32, &Device::Cpu).unwrap();
    let batch =
        gradcache::TokenBatch::new(ids.clone(), ids.clone(), ids.zeros_like().unwrap()).unwrap();
    let err = gradcache::Encoder::encode(&encoder, &batch, &gradcache::Ctx::eval()).unwrap_err();
    assert!(
        matches!(err, Error::SequenceTooLong { len: 20, max: 16 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");
}

#[test]
fn trained_vocabulary_is_deterministic_with_character_fallback() {
    let texts = [
        "The Lord is my shepherd",
        "the lord, my light",
        "THE LIGHT shines",
        "zebra",
    ];
    let train =
        || gradcache::hub::tokenizer::train_wordpiece(texts.iter().copied(), 60, true).unwrap();
    let (a, b) = (train(), train());
    assert_eq!(
        a.to_string(false).unwrap(),
        b.to_string(false).unwrap(),
        "same texts, same tokenizer"
    );
    let tok = Tokenizer::new(a, 16).unwrap();
    let batch = tok.encode(&["the lord zebra"], &Device::Cpu).unwrap();
    let ids = batch.input_ids.to_vec2::<u32>().unwrap()[0].clone();
    let inner = tok.inner();
    let words: Vec<String> = ids.iter().map(|&i| inner.id_to_token(i).unwrap()).collect();
    // Frequent words are whole tokens; `zebra` (seen once) falls back to characters.
    assert_eq!(
        words,
        vec!["[CLS]", "the", "lord", "z", "##e", "##b", "##r", "##a", "[SEP]"]
    );
    assert_eq!(inner.token_to_id("[PAD]"), Some(0));
}

#[test]
fn embedding_in_length_order_returns_each_text_its_own_embedding() {
    use gradcache::hub::{EmbeddingModel, LoadOptions};
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), false);
    let model =
        EmbeddingModel::load(&dir.path().display().to_string(), &LoadOptions::default()).unwrap();
    // Lengths out of order, so sorting moves texts between chunks.
    let texts = [
        "the lord is my shepherd, the light",
        "light",
        "my lords",
        "the lord is my light, my shepherd is the lord",
        "the",
        "shepherds light the lord",
    ];
    let together = model.embed(&texts, 2).unwrap().to_vec2::<f32>().unwrap();
    for (i, text) in texts.iter().enumerate() {
        let alone = model.embed(&[text], 1).unwrap().to_vec2::<f32>().unwrap();
        let diff = together[i]
            .iter()
            .zip(&alone[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff <= 1e-6,
            "text {i}: differs by {diff:e} from its own embedding"
        );
    }
    // Past one block (`chunk * 64` texts are tokenized at a time, the next block while
    // this one is encoded): 150 texts of one chunk each are three blocks, the last
    // partial, and each text's row is its own embedding bit for bit (a chunk of one text
    // is the same computation alone or among others).
    let words = ["the", "lord", "is", "my", "shepherd", "light", "lords"];
    let many: Vec<String> = (0..150)
        .map(|i| {
            (0..1 + (i * 7) % 11)
                .map(|j| words[(i + j * 3) % words.len()])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    let together = model.embed(&refs, 1).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(together.len(), refs.len());
    for (i, text) in refs.iter().enumerate() {
        let alone = model.embed(&[text], 1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(
            together[i], alone[0],
            "text {i} of 150: not its own embedding"
        );
    }
}
