//! Export round trip: what we export loads back (through the same path a Hugging Face
//! model takes) and gives the same embeddings; the sentence-transformers files describe
//! the pooling; an existing directory is never overwritten.

use std::fs;

use candle_core::{DType, Device};
use gradcache::bert::{load_pretrained, BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::hub::export::{
    export_bert, read_sentence_transformers_config, SentenceTransformersConfig,
};
use gradcache::hub::files::ModelFiles;
use gradcache::hub::tokenizer::Tokenizer;
use gradcache::{Ctx, Encoder, Error, ParamStore, Recompute, Similarity};

mod common;
use common::write_tokenizer;

const CONFIG: &str = r#"{
  "vocab_size": 12, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
  "intermediate_size": 16, "hidden_act": "gelu", "max_position_embeddings": 16,
  "type_vocab_size": 2, "initializer_range": 0.5, "layer_norm_eps": 1e-12,
  "transformers_version": "4.44.0"
}"#;

#[test]
fn exported_models_load_back_with_equal_embeddings() {
    let work = tempfile::tempdir().unwrap();
    let tok_path = work.path().join("tokenizer.json");
    write_tokenizer(&tok_path);
    let tokenizer = Tokenizer::from_file(&tok_path, 8).unwrap();
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let texts = ["the lord is my shepherd", "light", "my lords, the light"];
    let batch = tokenizer.encode(&texts, &Device::Cpu).unwrap();

    for (pooling, normalize) in [(Pooling::Mean, true), (Pooling::Cls, false)] {
        let options = BertOptions {
            pooling,
            normalize,
            recompute: Recompute::Sqrt,
            ..Default::default()
        };
        // Two towers; export the query tower.
        let store = ParamStore::new(3, DType::F32, &Device::Cpu);
        let query = BertEncoder::build(&store, "query", &cfg, &options).unwrap();
        BertEncoder::build(&store, "passage", &cfg, &options).unwrap();
        let dir = work.path().join(format!("export-{pooling:?}"));
        export_bert(
            &dir,
            &cfg,
            &options,
            Similarity::Cosine,
            query.params(),
            "query",
            &tokenizer,
        )
        .unwrap();

        for file in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "modules.json",
            "sentence_bert_config.json",
            "1_Pooling/config.json",
        ] {
            assert!(dir.join(file).is_file(), "{file} missing");
        }
        let config: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["architectures"][0], "BertModel");
        assert_eq!(
            config["transformers_version"], "4.44.0",
            "unknown config fields are kept"
        );
        let head: SentenceTransformersConfig =
            read_sentence_transformers_config(&dir).unwrap().unwrap();
        assert_eq!(head.pooling, pooling);
        assert_eq!(head.normalize, normalize);
        assert_eq!(head.similarity, Some(Similarity::Cosine));
        assert!(head.dense.is_empty() && head.include_prompt);

        let files = ModelFiles::from_dir(&dir).unwrap();
        let loaded_options = BertOptions {
            pooling: head.pooling,
            normalize: head.normalize,
            ..Default::default()
        };
        let (loaded, loaded_cfg, _) = load_pretrained(
            &files,
            "",
            &loaded_options,
            ParamStore::new(0, DType::F32, &Device::Cpu),
        )
        .unwrap();
        assert_eq!(loaded_cfg.hidden_size, 8);
        let loaded_tok = Tokenizer::from_file(files.tokenizer.as_ref().unwrap(), 8).unwrap();
        let again = loaded_tok.encode(&texts, &Device::Cpu).unwrap();
        assert_eq!(
            again.input_ids.to_vec2::<u32>().unwrap(),
            batch.input_ids.to_vec2::<u32>().unwrap()
        );

        let want = query
            .encode(&batch, &Ctx::eval())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let got = loaded
            .encode(&again, &Ctx::eval())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(
            got, want,
            "{pooling:?}: embeddings differ after the round trip"
        );
    }
}

#[test]
fn never_overwrites_an_existing_directory() {
    let work = tempfile::tempdir().unwrap();
    let tok_path = work.path().join("tokenizer.json");
    write_tokenizer(&tok_path);
    let tokenizer = Tokenizer::from_file(&tok_path, 8).unwrap();
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let enc = BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();

    let dir = work.path().join("taken");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("notes.txt"), "mine").unwrap();
    let err = export_bert(
        &dir,
        &cfg,
        &BertOptions::default(),
        Similarity::Dot,
        enc.params(),
        "",
        &tokenizer,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::OutputExists { path } if path == &dir),
        "{err:?}"
    );
    assert_eq!(
        fs::read_dir(&dir).unwrap().count(),
        1,
        "nothing was written"
    );

    let err = export_bert(
        &work.path().join("x"),
        &cfg,
        &BertOptions::default(),
        Similarity::Dot,
        enc.params(),
        "query",
        &tokenizer,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("no parameter has this prefix"),
        "{err}"
    );
    assert!(!work.path().join("x").exists());
}
