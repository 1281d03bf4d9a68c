//! Decoder rerankers against sentence-transformers 6.3 on tiny fixtures saved by its
//! `CrossEncoder` (`tests/fixtures/rerank/decoders/`, written by
//! `scripts/make_decoder_rerank_fixtures.py`): Qwen3-Reranker's layout (a causal LM whose
//! score is the LM head's logit of "yes" less that of "no" at the last token, the head
//! tied to the word embeddings), the same on Qwen2 with its own LM head, and the converted
//! `Qwen3ForSequenceClassification`. Each reads the pairs through its chat template: the
//! token ids equal theirs exactly (pairs past the limit cut with the template's tail
//! written back), with and without an instruction, and the scores are within 1e-5 of
//! `CrossEncoder.predict`. One cached step of `CachedMultipleNegativesRankingLoss` on the
//! causal layout (chunks of 4, 1 and 3, the last with recompute, in float64) equals
//! theirs: the loss within 1e-5, every parameter gradient within 1e-4 (the tied
//! embeddings' gradient sums the input and the LM-head paths).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions, ClassifierSpec};
use gradcache::hub::ModelFiles;
use gradcache::rerank::loss::{RerankLoss, RerankObjective};
use gradcache::rerank::{
    head_kind, read_cross_encoder_files, CrossEncoder, RerankCache, ScoreActivation,
};
use gradcache::{ParamStore, Recompute};

use crate::common::families::assert_step_matches;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rerank/decoders")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

/// The real tokens of each row of a batch (padding dropped, on either side).
fn real_ids(batch: &gradcache::TokenBatch) -> Vec<Vec<u32>> {
    let ids = batch.input_ids.to_vec2::<u32>().unwrap();
    let mask = batch.attention_mask.to_vec2::<u32>().unwrap();
    ids.iter()
        .zip(&mask)
        .map(|(r, m)| {
            r.iter()
                .zip(m)
                .filter(|(_, &m)| m != 0)
                .map(|(&t, _)| t)
                .collect()
        })
        .collect()
}

#[test]
fn decoder_rerankers_read_pairs_and_score_as_sentence_transformers() {
    let meta = reference();
    let pairs: Vec<(String, String)> = serde_json::from_value(meta["pairs"].clone()).unwrap();
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(q, d)| (q.as_str(), d.as_str()))
        .collect();
    let instruction = meta["instruction"].as_str().unwrap();
    let models = meta["models"].as_object().unwrap();
    assert_eq!(models.len(), 3);
    for (name, want) in models {
        let path = dir().join(name);
        for (key, instructed) in [("plain", false), ("instructed", true)] {
            let what = format!("{name} {key}");
            let mut model = CrossEncoder::load(path.to_str().unwrap(), None, &Device::Cpu)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            if instructed {
                model = model.with_instruction(instruction);
            }
            assert_eq!(model.labels(), 1, "{what}");
            assert_eq!(model.activation(), ScoreActivation::Sigmoid, "{what}");
            let want = &want[key];
            let want_ids: Vec<Vec<u32>> = serde_json::from_value(want["ids"].clone()).unwrap();
            let (queries, documents): (Vec<&str>, Vec<&str>) = refs.iter().copied().unzip();
            let batch = model.encode_pairs(&queries, &documents).unwrap();
            let got_ids = real_ids(&batch);
            for (i, (got, want)) in got_ids.iter().zip(&want_ids).enumerate() {
                assert_eq!(got, want, "{what} pair {i}: token ids");
            }
            // Some pairs are past the limit (cut, the tail written back), some not.
            let cut = want_ids.iter().filter(|r| r.len() == 160).count();
            assert!(cut >= 1 && cut < want_ids.len(), "{what}: {cut} cut");
            assert_eq!(
                model
                    .tokenizer()
                    .count_truncated_pairs(&queries, &documents)
                    .unwrap(),
                cut,
                "{what}"
            );
            let logits: Vec<f32> = model
                .logits(&refs, 5)
                .unwrap()
                .into_iter()
                .map(|r| r[0])
                .collect();
            let scores = model.predict(&refs, 3).unwrap();
            let want_logits: Vec<f32> = serde_json::from_value(want["logits"].clone()).unwrap();
            let want_scores: Vec<f32> = serde_json::from_value(want["scores"].clone()).unwrap();
            for (i, (got, want)) in logits.iter().zip(&want_logits).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{what} pair {i}: logit {got} against {want}"
                );
            }
            for (i, (got, want)) in scores.iter().zip(&want_scores).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5,
                    "{what} pair {i}: score {got} against {want}"
                );
            }
            let spread = want_logits.iter().fold(f32::MIN, |a, &b| a.max(b))
                - want_logits.iter().fold(f32::MAX, |a, &b| a.min(b));
            assert!(spread > 1e-3, "{what}: logits spread {spread}");
        }
    }
}

#[test]
fn one_cached_step_of_a_causal_reranker_equals_sentence_transformers() {
    let meta = reference();
    let tensors =
        candle_core::safetensors::load(dir().join("reference.safetensors"), &Device::Cpu).unwrap();
    let c = &meta["losses"]["cmnrl"];
    let queries: Vec<String> = serde_json::from_value(c["queries"].clone()).unwrap();
    let groups: Vec<Vec<String>> = serde_json::from_value(c["groups"].clone()).unwrap();
    // Qwen3ForCausalLM's names: the base model under `model.`; the LM head is tied to the
    // word embeddings, so it has no gradient of its own.
    let want: HashMap<String, &Tensor> = tensors
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("cmnrl.grad.model.")
                .map(|n| (n.to_string(), v))
        })
        .collect();
    assert_eq!(
        want.len(),
        tensors.len(),
        "every gradient is the base model's"
    );
    assert!(want.contains_key("embed_tokens.weight"));
    let path = dir().join("qwen3-causal");
    let files = ModelFiles::from_dir(&path).unwrap();
    let model = CrossEncoder::load(path.to_str().unwrap(), None, &Device::Cpu).unwrap();
    let group = groups[0].len();
    let q: Vec<&str> = queries
        .iter()
        .flat_map(|q| std::iter::repeat_n(q.as_str(), group))
        .collect();
    let d: Vec<&str> = groups.iter().flatten().map(String::as_str).collect();
    let batch = model.encode_pairs(&q, &d).unwrap();
    let own = read_cross_encoder_files(&path).unwrap();
    let kind = head_kind(&files, &own, model.tokenizer().inner()).unwrap();
    for (chunk, recompute) in [
        (4, Recompute::Off),
        (1, Recompute::Off),
        (3, Recompute::EveryLayer),
    ] {
        let options = BertOptions {
            recompute,
            classifier: Some(ClassifierSpec { labels: 1, kind }),
            ..Default::default()
        };
        let store = ParamStore::new(0, DType::F64, &Device::Cpu);
        let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
        let loss = RerankLoss::new(RerankObjective::MultipleNegatives { scale: 10.0 }).unwrap();
        let cache = RerankCache::new(encoder, chunk, loss, group)
            .unwrap()
            .with_dropout(false);
        let out = cache.step(0, &batch, None).unwrap();
        let what = format!("qwen3-causal cmnrl chunk {chunk}");
        let seen = assert_step_matches(
            &what,
            (out.loss, &out.grads),
            c["loss"].as_f64().unwrap(),
            &want,
        );
        assert_eq!(seen, want.len(), "{what}: every parameter has its gradient");
    }
}

/// A decoder reranker's files that do not say how to score are refused by name: a
/// `LogitScore` that reads other logits, lacks its token or names one past the vocabulary,
/// a causal LM whose tokenizer has no "yes" (without a `LogitScore`), a `LogitScore` on an
/// encoder.
#[test]
fn bad_logit_score_files_are_refused_by_name() {
    let edit_json = |path: &Path, f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(path, v.to_string()).unwrap();
    };
    type Edit = fn(&Path, &dyn Fn(&Path, &dyn Fn(&mut serde_json::Value)));
    let cases: [(&str, Edit, &str); 5] = [
        (
            "qwen3-causal",
            |d, edit| {
                edit(&d.join("1_LogitScore/config.json"), &|v| {
                    v["module_input_name"] = "logits".into()
                })
            },
            "module_input_name",
        ),
        (
            "qwen3-causal",
            |d, edit| {
                edit(&d.join("1_LogitScore/config.json"), &|v| {
                    v.as_object_mut().unwrap().remove("true_token_id");
                })
            },
            "true_token_id",
        ),
        (
            "qwen3-causal",
            |d, edit| {
                edit(&d.join("1_LogitScore/config.json"), &|v| {
                    v["true_token_id"] = 9999.into()
                })
            },
            "vocab_size",
        ),
        (
            "qwen3-causal",
            |d, edit| {
                edit(&d.join("modules.json"), &|v| {
                    v.as_array_mut().unwrap().truncate(1);
                });
                edit(&d.join("tokenizer.json"), &|v| {
                    for t in v["added_tokens"].as_array_mut().unwrap() {
                        if t["content"] == "yes" {
                            t["content"] = "yea".into();
                        }
                    }
                });
            },
            "\"yes\"",
        ),
        (
            "../bert",
            |d, edit| {
                let logit = d.join("1_LogitScore");
                std::fs::create_dir_all(&logit).unwrap();
                std::fs::write(logit.join("config.json"), r#"{"true_token_id": 5}"#).unwrap();
                edit(&d.join("modules.json"), &|v| {
                    v.as_array_mut().unwrap().push(serde_json::json!({
                        "idx": 1, "name": "1", "path": "1_LogitScore",
                        "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"
                    }));
                });
            },
            "LogitScore head",
        ),
    ];
    for (source, edit, needle) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        crate::common::copy_dir(&dir().join(source), &model);
        edit(&model, &edit_json);
        let err = CrossEncoder::load(model.to_str().unwrap(), None, &Device::Cpu)
            .err()
            .unwrap_or_else(|| panic!("{needle}: loaded"))
            .to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

/// Without a chat template an instruction goes before the query, as sentence-transformers
/// prepends a prompt to a pair's first text.
#[test]
fn without_a_chat_template_an_instruction_prefixes_the_query() {
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rerank/bert");
    let plain = CrossEncoder::load(bert.to_str().unwrap(), None, &Device::Cpu).unwrap();
    let pairs = [
        ("light", "And God said, Let there be light"),
        ("waters", "the deep"),
    ];
    let prefixed: Vec<(String, &str)> = pairs
        .iter()
        .map(|(q, d)| (format!("judge: {q}"), *d))
        .collect();
    let prefixed: Vec<(&str, &str)> = prefixed.iter().map(|(q, d)| (q.as_str(), *d)).collect();
    let want = plain.predict(&prefixed, 2).unwrap();
    let instructed = CrossEncoder::load(bert.to_str().unwrap(), None, &Device::Cpu)
        .unwrap()
        .with_instruction("judge: ");
    assert_eq!(instructed.predict(&pairs, 2).unwrap(), want);
    assert_ne!(
        plain.predict(&pairs, 2).unwrap(),
        want,
        "the instruction is read"
    );
}

/// Each decoder layout trains under the cache (every parameter moves: the tied word
/// embeddings, Qwen2's own LM head, the `score` projection), and its export is its layout
/// again: the causal LM with its `LogitScore` of the same tokens, or the sequence
/// classifier; the chat template beside the tokenizer. The export loads and scores.
#[test]
fn decoder_rerankers_train_and_export_their_layout() {
    use gradcache::train::rerank_task::RerankTrainer;
    let instruction = "Given a question, find the verse";
    for (name, architecture, head) in [
        ("qwen3-causal", "Qwen3ForCausalLM", None),
        ("qwen2-causal", "Qwen2ForCausalLM", Some("lm_head.weight")),
        (
            "qwen3-seq-cls",
            "Qwen3ForSequenceClassification",
            Some("score.weight"),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let source = dir().join(name);
        let mut cfg = crate::rerank_training::config_for(
            tmp.path(),
            &source,
            "[loss.reranker]\nkind = \"multiple_negatives\"\nnum_negatives = 2",
        );
        cfg.train.steps = 3;
        cfg.train.eval_every = 0;
        cfg.train.checkpoint_every = 0;
        cfg.model.reranker.as_mut().unwrap().instruction = Some(instruction.into());
        let mut trainer =
            RerankTrainer::reranker(cfg.clone(), None, std::rc::Rc::new(gradcache::Single))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        let before: Vec<(String, Vec<f32>)> = trainer
            .state()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
                )
            })
            .collect();
        let heads: Vec<&str> = before
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| n.starts_with("lm_head") || n.starts_with("score"))
            .collect();
        assert_eq!(heads, head.into_iter().collect::<Vec<_>>(), "{name}");
        trainer.run(&mut gradcache::train::report::Quiet).unwrap();
        let after = trainer.state().unwrap();
        for (n, values) in &before {
            let now: Vec<f32> = after
                .get(n)
                .unwrap()
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_ne!(&now, values, "{name}: `{n}` did not train");
        }
        let out = cfg.output_dir.join("model");
        let read = |path: PathBuf| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
        };
        assert_eq!(
            read(out.join("config.json"))["architectures"][0],
            architecture,
            "{name}"
        );
        let causal = head != Some("score.weight");
        let modules = read(out.join("modules.json"));
        assert_eq!(
            modules.as_array().unwrap().len(),
            1 + usize::from(causal),
            "{name}"
        );
        if causal {
            let score = read(out.join("1_LogitScore/config.json"));
            let own = read(source.join("1_LogitScore/config.json"));
            assert_eq!(score["true_token_id"], own["true_token_id"], "{name}");
            assert_eq!(score["false_token_id"], own["false_token_id"], "{name}");
        }
        assert_eq!(
            std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(),
            std::fs::read_to_string(source.join("chat_template.jinja")).unwrap(),
            "{name}"
        );
        // The instruction it was trained with is the export's default prompt, which a load
        // applies as sentence-transformers' `predict` does.
        let st = read(out.join("config_sentence_transformers.json"));
        assert_eq!(st["default_prompt_name"], "instruction", "{name}");
        assert_eq!(st["prompts"]["instruction"], instruction, "{name}");
        let pairs = [("light", "And God said, Let there be light")];
        let trained = CrossEncoder::load(out.to_str().unwrap(), None, &Device::Cpu).unwrap();
        assert_eq!(trained.tokenizer().prompt(), instruction, "{name}");
        let original = CrossEncoder::load(source.to_str().unwrap(), None, &Device::Cpu)
            .unwrap()
            .with_instruction(instruction);
        let (a, b) = (
            trained.predict(&pairs, 1).unwrap()[0],
            original.predict(&pairs, 1).unwrap()[0],
        );
        assert!(a > 0.0 && a < 1.0 && a != b, "{name}: {a} {b}");
    }
}
