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

use crate::common;
use crate::common::write_tokenizer;

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
            lora: None,
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
            &gradcache::hub::export::ExportNotes::default(),
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
            lora: None,
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
        &gradcache::hub::export::ExportNotes::default(),
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
        &gradcache::hub::export::ExportNotes::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("no parameter has this prefix"),
        "{err}"
    );
    assert!(!work.path().join("x").exists());
}

/// Prompts go into `config_sentence_transformers.json` as sentence-transformers reads them,
/// come back as the same two prompts, and are put before the texts: a model's query
/// embedding of `t` is its plain embedding of `prompt + t`. Another model's prompts
/// (`default_prompt_name`, `document`) are read the way `encode_query` /
/// `encode_document` use them, and bad ones are refused naming the file.
#[test]
fn prompts_round_trip_and_are_put_before_the_texts() {
    use gradcache::hub::{EmbeddingModel, LoadOptions, Prompts};
    let work = tempfile::tempdir().unwrap();
    let tok_path = work.path().join("tokenizer.json");
    write_tokenizer(&tok_path);
    let tokenizer = Tokenizer::from_file(&tok_path, 8).unwrap();
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let enc = BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
    let prompts = Prompts {
        query: "lord ".into(),
        passage: "light ".into(),
        ..Default::default()
    };
    let dir = work.path().join("prompted");
    export_bert(
        &dir,
        &cfg,
        &BertOptions::default(),
        Similarity::Cosine,
        enc.params(),
        "",
        &tokenizer,
        &gradcache::hub::export::ExportNotes {
            prompts: prompts.clone(),
            matryoshka_dims: vec![8, 4],
            prompt_left_out: false,
            adapter_of: None,
            multi_vector: None,
            static_query: None,
            merge_task: None,
        },
    )
    .unwrap();
    let st: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(dir.join("config_sentence_transformers.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(st["prompts"]["query"], "lord ");
    assert_eq!(st["prompts"]["passage"], "light ");
    assert!(st["default_prompt_name"].is_null());
    assert_eq!(st["matryoshka_dims"], serde_json::json!([8, 4]));
    let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
    assert_eq!(head.prompts, prompts);

    let model = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert_eq!(model.prompts(), &prompts);
    let q = model.embed_queries(&["the light"], 4).unwrap();
    let plain = model.embed(&["lord the light"], 4).unwrap();
    assert_eq!(q.to_vec2::<f32>().unwrap(), plain.to_vec2::<f32>().unwrap());
    let p = model.embed_passages(&["my lord"], 4).unwrap();
    let plain = model.embed(&["light my lord"], 4).unwrap();
    assert_eq!(p.to_vec2::<f32>().unwrap(), plain.to_vec2::<f32>().unwrap());
    assert_ne!(
        model
            .embed(&["the light"], 4)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap(),
        q.to_vec2::<f32>().unwrap(),
        "the prompt changes the embedding"
    );
    // Given prompts win over the model's.
    let given = LoadOptions {
        query_prompt: Some(String::new()),
        ..LoadOptions::default()
    };
    let model = EmbeddingModel::load(dir.to_str().unwrap(), &given).unwrap();
    assert_eq!(model.prompts().query, "");
    assert_eq!(model.prompts().passage, "light ");

    // Another model's layout: a default prompt, and `document` for passages.
    let st_path = dir.join("config_sentence_transformers.json");
    let write = |v: serde_json::Value| fs::write(&st_path, v.to_string()).unwrap();
    write(serde_json::json!({
        "prompts": {"retrieval": "Represent this: ", "document": "doc: "},
        "default_prompt_name": "retrieval"
    }));
    let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
    assert_eq!(head.prompts.query, "Represent this: ");
    assert_eq!(head.prompts.passage, "doc: ");
    for bad in [
        serde_json::json!({"prompts": {"query": 3}}),
        serde_json::json!({"prompts": {}, "default_prompt_name": "nope"}),
        serde_json::json!({"prompts": ["query: "]}),
    ] {
        write(bad.clone());
        match read_sentence_transformers_config(&dir).unwrap_err() {
            Error::ModelFile { path, .. } => {
                assert!(path.ends_with("config_sentence_transformers.json"), "{bad}")
            }
            other => panic!("{bad}: expected a model file error, got {other}"),
        }
    }
    // A pooling that leaves prompt tokens out (`include_prompt = false`): the prompt and
    // the [CLS] before it still attend, but the mean is over the text's tokens (and the
    // final [SEP]) only, as sentence-transformers computes it.
    write(serde_json::json!({"prompts": {"query": "lord "}}));
    let pooling = dir.join("1_Pooling/config.json");
    let mut cfg_json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&pooling).unwrap()).unwrap();
    cfg_json["include_prompt"] = serde_json::json!(false);
    fs::write(&pooling, cfg_json.to_string()).unwrap();
    let model = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert!(
        model.settings().contains("left out of the pooling"),
        "{}",
        model.settings()
    );
    let got = model.embed_queries(&["the light", "my lord"], 4).unwrap();
    let tok = model.tokenizer();
    for (row, text) in ["the light", "my lord"].iter().enumerate() {
        let batch = tok
            .encode(&[&format!("lord {text}")], &Device::Cpu)
            .unwrap();
        // "[CLS] lord" is the prompt's own tokenization less its [SEP]: 2 positions.
        let states = model
            .encoder()
            .tower()
            .detached_model()
            .hidden_states(&batch, &Ctx::eval())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let len = states.dim(0).unwrap();
        let mean = states
            .narrow(0, 2, len - 2)
            .unwrap()
            .mean(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let want = mean;
        let got_row = got.get(row).unwrap().to_vec1::<f32>().unwrap();
        let err = got_row
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-5, "row {row}: {got_row:?} vs {want:?}");
        let all = states.mean(0).unwrap().to_vec1::<f32>().unwrap();
        assert!(
            all.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-4),
            "leaving the prompt out changes the embedding"
        );
    }
}

/// A run with prompts left out of the pooling trains, and its export says so: the pooling
/// config's `include_prompt` is false and `config_sentence_transformers.json` holds the
/// prompts; the exported model embeds as the trained one.
#[test]
fn a_run_with_prompts_left_out_of_the_pooling_exports_them() {
    use gradcache::hub::{EmbeddingModel, LoadOptions};
    use gradcache::train::{Config, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(tmp.path());
    let sets: Vec<String> = [
        "model.query_prompt=\"query: \"",
        "model.passage_prompt=\"passage: \"",
        "model.include_prompt=false",
        "train.steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cfg = Config::load(&config, &sets).unwrap();
    let mut trainer = Trainer::new(cfg, None).unwrap();
    for _ in 0..2 {
        assert!(trainer.train_step().unwrap().loss.is_finite());
    }
    let out = tmp.path().join("export");
    trainer.export(&out, gradcache::Side::Query).unwrap();
    let head = read_sentence_transformers_config(&out).unwrap().unwrap();
    assert!(!head.include_prompt);
    assert_eq!(head.prompts.query, "query: ");
    assert_eq!(head.prompts.passage, "passage: ");
    let model = EmbeddingModel::load(out.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let left_out = model
        .embed_queries(&["the lord is my shepherd"], 2)
        .unwrap();
    // The same model pooling the prompt too embeds differently.
    fs::write(
        out.join("1_Pooling/config.json"),
        gradcache::hub::export::pooling_config(16, gradcache::bert::Pooling::Mean, true)
            .to_string(),
    )
    .unwrap();
    let with = EmbeddingModel::load(out.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .embed_queries(&["the lord is my shepherd"], 2)
        .unwrap();
    assert!(common::max_diff(&left_out, &with) > 1e-4);
}

/// GISTEmbed through the trainer: a frozen guide model (here an export of the tiny run's
/// initial weights) judges the false-negative mask; the run trains, and its losses differ
/// from the unmasked run's.
#[test]
fn a_run_with_a_guide_model_masks_false_negatives() {
    use gradcache::train::{Config, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(tmp.path());
    let cfg = Config::load(&config, &[]).unwrap();
    let mut plain = Trainer::new(cfg.clone(), None).unwrap();
    let guide_dir = tmp.path().join("guide");
    plain.export(&guide_dir, gradcache::Side::Query).unwrap();
    let want: Vec<f32> = (0..2).map(|_| plain.train_step().unwrap().loss).collect();
    let sets = vec![
        format!("loss.false_negative_guide=\"{}\"", guide_dir.display()),
        "loss.false_negative_margin=0.0".to_string(),
        format!("output_dir=\"{}\"", tmp.path().join("guided").display()),
    ];
    let guided_cfg = Config::load(&config, &sets).unwrap();
    let mut guided = Trainer::new(guided_cfg, None).unwrap();
    let got: Vec<f32> = (0..2).map(|_| guided.train_step().unwrap().loss).collect();
    assert!(got.iter().all(|l| l.is_finite()));
    assert_ne!(got, want, "the guide masks candidates");
    assert!(
        got[0] < want[0],
        "masking candidates can only lower the first loss"
    );
    let missing = vec![
        "loss.false_negative_guide=\"/no/such/guide\"".to_string(),
        format!("output_dir=\"{}\"", tmp.path().join("missing").display()),
    ];
    assert!(Trainer::new(Config::load(&config, &missing).unwrap(), None).is_err());
}

/// Batches tokenized with different prompts left out of the pooling cannot be joined.
#[test]
fn batches_pooling_from_different_positions_do_not_concatenate() {
    use gradcache::{Batch, TokenBatch};
    let t = |v: Vec<u32>| candle_core::Tensor::from_vec(v, (1, 3), &Device::Cpu).unwrap();
    let a = TokenBatch::new(t(vec![1, 2, 3]), t(vec![1, 1, 1]), t(vec![0, 0, 0])).unwrap();
    let b = a.clone().with_pool_from(2);
    assert!(matches!(
        TokenBatch::cat(&[a.clone(), b]),
        Err(Error::Concat(_))
    ));
    assert_eq!(TokenBatch::cat(&[a.clone(), a]).unwrap().pool_from, 0);
}
