//! The decoder families (qwen3, qwen2, llama, mistral, gemma3_text) against transformers
//! and sentence-transformers, without network: `tests/fixtures/families/<family>/` holds a
//! tiny random model of each saved by sentence-transformers 6.2 as the family's embedding
//! models are saved (a byte-level BPE tokenizer that appends its EOS, the family's padding
//! side, an instruction prompt, last-token or mean pooling, Dense and Normalize modules),
//! with references from `scripts/make_family_fixtures.py`:
//!
//! - the last hidden state of every text's real tokens, <= 1e-5, on the layer node and
//!   op by op (the GPU and half-precision path);
//! - every pooling mode on sentence-transformers' padded batch, <= 1e-5;
//! - `encode` with the query and the document prompt through the whole head, <= 1e-5;
//! - every parameter's gradient of a fixed contrastive loss over prompted queries, <= 1e-4
//!   relative (floored at 1e-3 of the largest entry), in chunks and under recompute, on
//!   the node and op by op; the loss <= 1e-5.
//!
//! And what implementations of these models get wrong: a padded batch stays causal, a
//! text's embedding is the same alone and in a batch padded on either side, last-token
//! pooling goes by the mask (the pad token of these models is their EOS), the loss takes
//! its temperature.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{load_pretrained, BertOptions};
use gradcache::hub::{
    read_sentence_transformers_config, EmbeddingModel, LoadOptions, ModelFiles, Tokenizer,
};
use gradcache::{Ctx, GradCache, InfoNce, ParamStore, Recompute, Similarity};

use crate::common;
use crate::common::families::{fixture, reference, refs, DECODERS};
use crate::common::{copy_dir, max_abs, max_diff};

const MAX_LEN: usize = 32;

fn load(dir: &Path, options: LoadOptions) -> EmbeddingModel {
    EmbeddingModel::load(dir.to_str().unwrap(), &options).unwrap()
}

/// Runs `f` with the fused kernels on, then off (the op-by-op path a GPU or a half dtype
/// takes), restoring them on.
fn both_paths(f: impl Fn(&str)) {
    for fused in [true, false] {
        gradcache::nn::set_fused_kernels(fused);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            f(if fused { "layer node" } else { "op by op" })
        }));
        gradcache::nn::set_fused_kernels(true);
        if let Err(e) = result {
            std::panic::resume_unwind(e);
        }
    }
}

/// The rows of `hidden` `[s, h]` where `mask` (one row) is 1.
fn real_rows(hidden: &Tensor, mask: &[u32]) -> Tensor {
    let rows: Vec<u32> = (0..mask.len() as u32)
        .filter(|&t| mask[t as usize] != 0)
        .collect();
    hidden
        .index_select(&Tensor::new(rows.as_slice(), &Device::Cpu).unwrap(), 0)
        .unwrap()
}

#[test]
fn hidden_states_match_transformers() {
    let _switches = crate::switching();
    both_paths(|path| {
        for family in DECODERS {
            let r = reference(family);
            let model = load(&fixture(family), LoadOptions::default());
            let batch = model
                .tokenizer()
                .encode(&refs(&r.texts), &Device::Cpu)
                .unwrap();
            let bert = model.encoder().tower().detached_model();
            let hidden = bert.hidden_states(&batch, &Ctx::eval()).unwrap();
            let mask: Vec<Vec<u32>> = batch
                .attention_mask
                .to_dtype(DType::U32)
                .unwrap()
                .to_vec2()
                .unwrap();
            for (i, m) in mask.iter().enumerate() {
                let got = real_rows(&hidden.get(i).unwrap(), m);
                let want = &r.tensors[&format!("hidden.{i}")];
                assert_eq!(
                    got.dims(),
                    want.dims(),
                    "{family} ({path}): text {i} tokens"
                );
                let err = max_diff(&got, want);
                assert!(
                    err <= 1e-5,
                    "{family} ({path}): hidden state of text {i} differs by {err:e}"
                );
            }
        }
    });
}

#[test]
fn the_model_files_decide_padding_limit_and_special_tokens() {
    let _switches = crate::steady();
    for family in DECODERS {
        let model = load(&fixture(family), LoadOptions::default());
        let t = model.tokenizer();
        // The limit the files give (model_max_length 32), not a default of ours.
        assert_eq!(t.max_len(), MAX_LEN, "{family}");
        assert!(
            model.settings().contains("max_len 32 (the model's"),
            "{}",
            model.settings()
        );
        let left = matches!(family, "qwen3" | "qwen2" | "llama");
        assert_eq!(t.pads_left(), left, "{family}: padding side");
        // The EOS the post-processor appends survives truncation.
        let long = "And God said, Let there be light: and there was light. ".repeat(8);
        let b = t
            .encode(&[long.as_str(), "Jesus wept."], &Device::Cpu)
            .unwrap();
        let ids: Vec<Vec<u32>> = b.input_ids.to_vec2().unwrap();
        let eos = t
            .inner()
            .token_to_id(match family {
                "qwen3" | "qwen2" => "<|endoftext|>",
                "gemma3_text" => "<eos>",
                _ => "</s>",
            })
            .unwrap();
        assert_eq!(ids[0].len(), MAX_LEN, "{family}: truncated");
        assert_eq!(*ids[0].last().unwrap(), eos, "{family}: EOS kept");
        let mask: Vec<Vec<u32>> = b.attention_mask.to_vec2().unwrap();
        let last_real = mask[1].iter().rposition(|&m| m != 0).unwrap();
        assert_eq!(ids[1][last_real], eos, "{family}: short text ends with EOS");
        // Left padding puts the short text's padding first.
        assert_eq!(mask[1][0] == 0, left, "{family}");
        // A larger limit is capped at the model's, and says so.
        let capped = load(
            &fixture(family),
            LoadOptions {
                max_len: Some(4096),
                ..Default::default()
            },
        );
        assert_eq!(capped.tokenizer().max_len(), MAX_LEN);
        assert!(
            capped
                .settings()
                .contains("max_len 4096 capped at the model's limit of 32"),
            "{}",
            capped.settings()
        );
    }
}

#[test]
fn every_pooling_mode_and_the_prompted_head_match_sentence_transformers() {
    let _switches = crate::switching();
    use gradcache::bert::Pooling;
    both_paths(|path| {
        for family in DECODERS {
            let r = reference(family);
            let texts = refs(&r.texts);
            // The files' own head: pooling, Dense modules, Normalize and the prompts.
            let model = load(&fixture(family), LoadOptions::default());
            for (side, got) in [
                ("query", model.embed_queries(&texts, 4).unwrap()),
                ("document", model.embed_passages(&texts, 4).unwrap()),
            ] {
                let err = max_diff(&got, &r.tensors[&format!("embeddings.{side}")]);
                assert!(
                    err <= 1e-5,
                    "{family} ({path}): {side} embeddings off by {err:e}"
                );
            }
            if family == "gemma3_text" {
                continue; // Its Dense modules make the pooled width the head's input only.
            }
            for mode in Pooling::ALL {
                let plain = load(
                    &fixture(family),
                    LoadOptions {
                        pooling: Some(mode),
                        normalize: Some(false),
                        ..Default::default()
                    },
                );
                let got = plain.embed(&texts, 4).unwrap();
                let want = &r.tensors[&format!("pooled.{}", mode.name())];
                let err = max_diff(&got, want);
                assert!(
                    err <= 1e-5,
                    "{family} ({path}): pooling {} differs by {err:e}",
                    mode.name()
                );
            }
        }
    });
}

/// The gradient-cache step of the reference loss (queries with the query prompt,
/// passages with the document prompt) on the model of `family`.
fn step(family: &str, chunk: usize, recompute: Recompute) -> (f32, gradcache::Gradients) {
    let dir = fixture(family);
    let r = reference(family);
    let files = ModelFiles::from_dir(&dir).unwrap();
    let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
    let options = BertOptions {
        lora: None,
        recompute,
        pooling: head.pooling,
        normalize: head.normalize,
        dense: head.dense.iter().map(|d| d.spec()).collect(),
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, bert, _store) = load_pretrained(&files, "", &options, store).unwrap();
    let loss = InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine);
    let gc = GradCache::shared(encoder, chunk, loss)
        .unwrap()
        .with_dropout(false);
    let (inner, config) = gradcache::hub::load_tokenizer(&files, &bert).unwrap();
    let tokenizer = Tokenizer::new(inner, MAX_LEN).unwrap().with_config(config);
    let pooled = head.include_prompt;
    let q = tokenizer
        .clone()
        .with_prompt(&head.prompts.query)
        .with_prompt_pooled(pooled)
        .encode(&refs(&r.queries), &Device::Cpu)
        .unwrap();
    let p = tokenizer
        .with_prompt(&head.prompts.passage)
        .with_prompt_pooled(pooled)
        .encode(&refs(&r.passages), &Device::Cpu)
        .unwrap();
    let out = gc.cache_step(0, &q, &p).unwrap();
    (out.loss, out.grads)
}

#[test]
fn gradients_match_pytorch_in_chunks_and_under_recompute() {
    let _switches = crate::switching();
    both_paths(|path| {
        for family in DECODERS {
            let r = reference(family);
            let want: HashMap<&str, &Tensor> = r
                .tensors
                .iter()
                .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
                .collect();
            let global = want.values().map(|g| max_abs(g)).fold(0.0, f64::max);
            let policies = if path == "layer node" {
                vec![
                    (4, Recompute::Off),
                    (1, Recompute::Off),
                    (3, Recompute::Attention),
                    (2, Recompute::EveryLayer),
                ]
            } else {
                vec![(2, Recompute::EveryLayer), (3, Recompute::Attention)]
            };
            for (chunk, recompute) in policies {
                let (loss, grads) = step(family, chunk, recompute.clone());
                let what = format!("{family} ({path}), chunk {chunk}, recompute {recompute:?}");
                assert!(
                    (loss as f64 - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0),
                    "{what}: loss {loss} against {}",
                    r.loss
                );
                let mut seen = 0;
                for (name, got) in grads.iter() {
                    let reference = want
                        .get(name)
                        .unwrap_or_else(|| panic!("{what}: no reference gradient for `{name}`"));
                    let err = max_diff(got, reference) / max_abs(reference).max(1e-3 * global);
                    assert!(err <= 1e-4, "{what}: gradient of `{name}` off by {err:e}");
                    seen += 1;
                }
                assert_eq!(seen, want.len(), "{what}: every parameter gets a gradient");
            }
        }
    });
}

/// The fixture's tokenizer (its limit, special tokens) padding on the left or the right.
fn tokenizer_padding(family: &str, left: bool) -> Tokenizer {
    let model = load(&fixture(family), LoadOptions::default());
    let mut inner = model.tokenizer().inner().clone();
    let mut padding = inner.get_padding().cloned().unwrap();
    padding.direction = if left {
        tokenizers::PaddingDirection::Left
    } else {
        tokenizers::PaddingDirection::Right
    };
    inner.with_padding(Some(padding));
    Tokenizer::new(inner, MAX_LEN).unwrap()
}

#[test]
fn a_text_embeds_the_same_alone_and_in_a_batch_padded_on_either_side() {
    let _switches = crate::switching();
    // Left padding with `mask.sum - 1` indexing, pooling by the pad id (the EOS of these
    // models), or positions counted from the first column would all break this.
    both_paths(|path| {
        for family in DECODERS {
            let r = reference(family);
            let texts = refs(&r.texts);
            let model = load(&fixture(family), LoadOptions::default());
            let encoder = model.encoder();
            for left in [true, false] {
                let tokenizer = tokenizer_padding(family, left);
                let batch =
                    gradcache::hub::embed(encoder, &tokenizer, &texts, 8, &Device::Cpu).unwrap();
                for (i, text) in texts.iter().enumerate() {
                    let alone =
                        gradcache::hub::embed(encoder, &tokenizer, &[text], 1, &Device::Cpu)
                            .unwrap();
                    let err = max_diff(&alone, &batch.narrow(0, i, 1).unwrap());
                    assert!(
                        err <= 1e-6,
                        "{family} ({path}), left padding {left}: text {i} differs alone by {err:e}"
                    );
                }
            }
        }
    });
}

#[test]
fn a_padded_batch_stays_causal() {
    let _switches = crate::switching();
    // Changing a text's last token leaves every earlier position's state as it was, with
    // padding in the batch (an implementation that drops the causal triangle when a
    // padding mask is given fails this); Gemma3 here is bidirectional, and changes.
    both_paths(|path| {
        for family in DECODERS {
            let model = load(&fixture(family), LoadOptions::default());
            let batch = model
                .tokenizer()
                .encode(
                    &["Jesus wept.", "In the beginning God created"],
                    &Device::Cpu,
                )
                .unwrap();
            let ids: Vec<Vec<u32>> = batch.input_ids.to_vec2().unwrap();
            let mask: Vec<Vec<u32>> = batch.attention_mask.to_vec2().unwrap();
            let last = mask[0].iter().rposition(|&m| m != 0).unwrap();
            let mut changed = ids.clone();
            changed[0][last] = (changed[0][last] + 7) % 400 + 10;
            let flat: Vec<u32> = changed.into_iter().flatten().collect();
            let other = gradcache::TokenBatch::new(
                Tensor::from_vec(flat, batch.input_ids.shape(), &Device::Cpu).unwrap(),
                batch.attention_mask.clone(),
                batch.token_type_ids.clone(),
            )
            .unwrap();
            let bert = model.encoder().tower().detached_model();
            let a = bert.hidden_states(&batch, &Ctx::eval()).unwrap();
            let b = bert.hidden_states(&other, &Ctx::eval()).unwrap();
            // The real tokens before the last (padding rows compute what they will).
            let real: Vec<u32> = (0..last as u32)
                .filter(|&t| mask[0][t as usize] != 0)
                .collect();
            let real = Tensor::new(real.as_slice(), &Device::Cpu).unwrap();
            let before = |t: &Tensor| t.get(0).unwrap().index_select(&real, 0).unwrap();
            let err = max_diff(&before(&a), &before(&b));
            if family == "gemma3_text" {
                assert!(
                    err > 1e-4,
                    "{family} ({path}): bidirectional, yet unchanged"
                );
            } else {
                assert_eq!(err, 0.0, "{family} ({path}): an earlier position changed");
            }
            // The other text of the batch is untouched either way.
            assert_eq!(
                max_diff(&a.get(1).unwrap(), &b.get(1).unwrap()),
                0.0,
                "{family} ({path})"
            );
        }
    });
}

#[test]
fn the_cached_loss_takes_its_temperature() {
    let _switches = crate::steady();
    // The loss of a cached step is cross-entropy over cos / temperature, whatever the
    // temperature (a gradient-cache loss that ignores it fails this).
    let family = "qwen3";
    let r = reference(family);
    let model = load(&fixture(family), LoadOptions::default());
    let q = model.embed_queries(&refs(&r.queries), 4).unwrap();
    let p = model.embed_passages(&refs(&r.passages), 4).unwrap();
    let cos = q.matmul(&p.t().unwrap()).unwrap();
    let dir = fixture(family);
    let files = ModelFiles::from_dir(&dir).unwrap();
    let head = read_sentence_transformers_config(&dir).unwrap().unwrap();
    let mut losses = Vec::new();
    for temperature in [0.05, 0.02, 0.5] {
        let logits = (&cos / temperature).unwrap();
        let by_hand = candle_nn::loss::cross_entropy(
            &logits,
            &Tensor::arange(0u32, 4, &Device::Cpu).unwrap(),
        )
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
        let options = BertOptions {
            lora: None,
            pooling: head.pooling,
            normalize: head.normalize,
            ..Default::default()
        };
        let store = ParamStore::new(0, DType::F32, &Device::Cpu);
        let (encoder, _, _store) = load_pretrained(&files, "", &options, store).unwrap();
        let loss = InfoNce::new(temperature)
            .unwrap()
            .with_similarity(Similarity::Cosine);
        let gc = GradCache::shared(encoder, 3, loss).unwrap();
        let t = model.tokenizer();
        let qb = t
            .clone()
            .with_prompt(&head.prompts.query)
            .encode(&refs(&r.queries), &Device::Cpu)
            .unwrap();
        let pb = t.encode(&refs(&r.passages), &Device::Cpu).unwrap();
        let out = gc.cache_step(0, &qb, &pb).unwrap();
        assert!(
            (out.loss - by_hand).abs() <= 1e-5 * by_hand.abs().max(1.0),
            "temperature {temperature}: cached loss {} against {by_hand} by hand",
            out.loss
        );
        losses.push(out.loss);
    }
    assert!((losses[0] - r.loss as f32).abs() <= 1e-5 * r.loss as f32);
    assert!(losses[0] != losses[1] && losses[1] != losses[2]);
}

#[test]
fn half_precision_follows_f32() {
    let _switches = crate::steady();
    use gradcache::{Encoder, Precision};
    for family in DECODERS {
        let dir = fixture(family);
        let r = reference(family);
        let files = ModelFiles::from_dir(&dir).unwrap();
        // The embeddings of the texts (the files' pooling, normalised) and a cached step.
        let run = |precision| {
            let options = BertOptions {
                lora: None,
                precision,
                pooling: gradcache::bert::Pooling::LastToken,
                normalize: true,
                ..Default::default()
            };
            let store = ParamStore::new(0, DType::F32, &Device::Cpu);
            let (encoder, bert, _store) = load_pretrained(&files, "", &options, store).unwrap();
            let (inner, _) = gradcache::hub::load_tokenizer(&files, &bert).unwrap();
            let t = Tokenizer::new(inner, MAX_LEN).unwrap();
            let texts = t.encode(&refs(&r.texts), &Device::Cpu).unwrap();
            let embeddings = encoder
                .encode(&texts, &Ctx::eval())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let gc = GradCache::shared(encoder, 2, InfoNce::new(0.05).unwrap())
                .unwrap()
                .with_dropout(false);
            let q = t.encode(&refs(&r.queries), &Device::Cpu).unwrap();
            let p = t.encode(&refs(&r.passages), &Device::Cpu).unwrap();
            (embeddings, gc.cache_step(0, &q, &p).unwrap())
        };
        let (full, full_step) = run(Precision::F32);
        // bf16 keeps 8 bits of mantissa, f16 11: through the layers about 1% and 0.2%.
        for (half, tolerance) in [(Precision::Bf16, 4e-2), (Precision::F16, 1e-2)] {
            let (embeddings, step) = run(half);
            let err = max_diff(&embeddings, &full);
            assert!(
                err <= tolerance,
                "{family} {half:?}: embeddings off by {err:e}"
            );
            assert!(step.loss.is_finite(), "{family} {half:?}");
            assert_eq!(step.grads.len(), full_step.grads.len(), "{family} {half:?}");
            for (name, g) in step.grads.iter() {
                assert_eq!(g.dtype(), DType::F32, "{family}: `{name}` in f32");
            }
        }
    }
}

/// A copy of fixture `family` in `dir`, with `edit` applied to the JSON file `file`.
fn edited(dir: &Path, family: &str, file: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = dir.join(format!("{family}-{n}"));
    copy_dir(&fixture(family), &out);
    let path = out.join(file);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
    out
}

/// Trains `model` for two steps into `out` (nothing else) and returns the error, if any.
fn train(model: &Path, data: &Path, out: &Path) -> gradcache::Result<gradcache::train::Trainer> {
    use gradcache::train::{Config, Quiet, Trainer};
    let config = format!(
        r#"
output_dir = "{out}"
[data]
train_file = "{data}"
eval_pairs = 8
[model]
pretrained = "{model}"
[train]
steps = 2
batch_size = 8
query_chunk = 3
passage_chunk = 5
[loss]
temperature = 0.05
"#,
        out = out.display(),
        data = data.display(),
        model = model.display(),
    );
    let path = out.with_extension("toml");
    std::fs::write(&path, config).unwrap();
    let cfg = Config::load(&path, &[])?;
    let mut trainer = Trainer::new(cfg, None)?;
    trainer.run(&mut Quiet)?;
    Ok(trainer)
}

fn sample_pairs(dir: &Path) -> PathBuf {
    let lines: Vec<String> = std::fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .take(40)
        .map(String::from)
        .collect();
    let data = dir.join("train.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    data
}

#[test]
fn bad_decoder_configs_are_refused_naming_the_field_before_anything_is_written() {
    let _switches = crate::steady();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = sample_pairs(t);
    let cases: Vec<(PathBuf, &[&str])> = vec![
        (
            edited(t, "qwen3", "config.json", |c| c["head_dim"] = 7.into()),
            &["head_dim", "7"],
        ),
        (
            edited(t, "qwen3", "config.json", |c| {
                c["num_key_value_heads"] = 3.into()
            }),
            &["num_key_value_heads", "3"],
        ),
        (
            edited(t, "qwen3", "config.json", |c| {
                c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"])
            }),
            &["layer_types", "2 layers"],
        ),
        (
            edited(t, "qwen3", "config.json", |c| {
                c["layer_types"] =
                    serde_json::json!(["full_attention", "chunked", "full_attention"])
            }),
            &["layer_types", "chunked"],
        ),
        (
            edited(t, "mistral", "config.json", |c| {
                c["sliding_window"] = 0.into()
            }),
            &["sliding_window", "0"],
        ),
        (
            edited(t, "qwen2", "config.json", |c| {
                c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
            }),
            &["rope_type", "yarn"],
        ),
        (
            edited(t, "gemma3_text", "config.json", |c| {
                c["attn_logit_softcapping"] = 50.0.into()
            }),
            &["attn_logit_softcapping"],
        ),
        (
            edited(t, "llama", "config.json", |c| {
                c["hidden_act"] = "mish".into()
            }),
            &["hidden_act", "mish"],
        ),
    ];
    // A tokenizer without a pad token (none in tokenizer.json, none in its config).
    let no_pad = edited(t, "qwen3", "tokenizer_config.json", |c| {
        c.as_object_mut().unwrap().remove("pad_token");
    });
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(no_pad.join("tokenizer.json")).unwrap())
            .unwrap();
    tok["padding"] = serde_json::Value::Null;
    std::fs::write(no_pad.join("tokenizer.json"), tok.to_string()).unwrap();
    let cases: Vec<(PathBuf, &[&str])> = cases
        .into_iter()
        .chain([(no_pad, &["pad token"][..])])
        .collect();
    for (i, (model, needles)) in cases.iter().enumerate() {
        let err = EmbeddingModel::load(model.to_str().unwrap(), &LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{}: loaded", model.display()))
            .to_string();
        for needle in *needles {
            assert!(err.contains(needle), "{}: {err}", model.display());
        }
        let out = t.join(format!("run-{i}"));
        let trained = train(model, &data, &out);
        assert!(trained.is_err(), "{}: trained", model.display());
        assert!(
            !out.exists(),
            "{}: the run wrote {}",
            model.display(),
            out.display()
        );
    }
}

#[test]
fn every_decoder_trains_and_its_export_loads_back_as_the_family() {
    let _switches = crate::steady();
    use gradcache::train::{export_run, Config};
    let tmp = tempfile::tempdir().unwrap();
    let data = sample_pairs(tmp.path());
    for family in DECODERS {
        let out = tmp.path().join(family);
        let trainer = train(&fixture(family), &data, &out).unwrap();
        let live = tmp.path().join(format!("{family}-live"));
        trainer.export(&live, gradcache::Side::Query).unwrap();
        let cfg = Config::load(&out.with_extension("toml"), &[]).unwrap();
        let from_run = tmp.path().join(format!("{family}-export"));
        export_run(&cfg, None, &from_run, gradcache::Side::Query).unwrap();
        let read = |p: PathBuf| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        for dir in [&live, &from_run] {
            let exported = read(dir.join("config.json"));
            let original = read(fixture(family).join("config.json"));
            assert_eq!(exported["model_type"], family);
            assert_eq!(
                exported["architectures"], original["architectures"],
                "{family}"
            );
            // The file's own keys: none of BERT's fields with BERT's defaults.
            for key in ["type_vocab_size", "layer_norm_eps", "hidden_dropout_prob"] {
                assert!(exported.get(key).is_none(), "{family}: `{key}` exported");
            }
            for key in ["pad_token_id", "num_key_value_heads", "rope_parameters"] {
                assert_eq!(exported.get(key), original.get(key), "{family}: `{key}`");
            }
            let tok = read(dir.join("tokenizer_config.json"));
            let own = read(fixture(family).join("tokenizer_config.json"));
            for key in ["padding_side", "pad_token", "eos_token", "model_max_length"] {
                assert_eq!(tok.get(key), own.get(key), "{family}: tokenizer `{key}`");
            }
            let head = read_sentence_transformers_config(dir).unwrap().unwrap();
            let theirs = read_sentence_transformers_config(&fixture(family))
                .unwrap()
                .unwrap();
            assert_eq!(head.pooling, theirs.pooling, "{family}");
            assert_eq!(head.prompts, theirs.prompts, "{family}");
            assert_eq!(head.dense.len(), theirs.dense.len(), "{family}");
        }
        let r = reference(family);
        let texts = refs(&r.texts);
        let a = load(&live, LoadOptions::default())
            .embed_queries(&texts, 4)
            .unwrap();
        let b = load(&from_run, LoadOptions::default())
            .embed_queries(&texts, 4)
            .unwrap();
        assert!(max_diff(&a, &b) <= 1e-6, "{family}");
        let c = load(&fixture(family), LoadOptions::default())
            .embed_queries(&texts, 4)
            .unwrap();
        assert!(
            max_diff(&a, &c) > 1e-4,
            "{family}: the export is the untrained model"
        );
    }
}

#[test]
fn a_sharded_checkpoint_loads_as_one_file() {
    let _switches = crate::steady();
    // The 4B and 8B decoders ship `model.safetensors.index.json` and shards.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    copy_dir(&fixture("qwen3"), &dir);
    let weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let shard: HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), weights[*n].clone()))
            .collect();
        candle_core::safetensors::save(&shard, dir.join(file)).unwrap();
        for n in part.iter() {
            map.insert((*n).clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let r = reference("qwen3");
    let texts = refs(&r.texts);
    let got = load(&dir, LoadOptions::default())
        .embed_queries(&texts, 4)
        .unwrap();
    assert!(max_diff(&got, &r.tensors["embeddings.query"]) <= 1e-5);
    // A shard the index names but the directory lacks is refused, naming it.
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = EmbeddingModel::load(dir.to_str().unwrap(), &LoadOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}

#[test]
fn the_shipped_qwen3_config_runs_and_learns() {
    let _switches = crate::steady();
    // configs/qwen3.toml as shipped, on the tiny Qwen3 fixture instead of the Hub model
    // (no network here), with the fixture's limit of 32 tokens, a learning rate for its
    // size, and a short instruction: its 500-token vocabulary spells the config's in 70
    // tokens, which truncation to 32 would leave nothing of the query after.
    use gradcache::train::{Config, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        format!("output_dir=\"{}\"", tmp.path().join("run").display()),
        format!("model.pretrained=\"{}\"", fixture("qwen3").display()),
        "model.query_max_len=32".into(),
        "model.passage_max_len=32".into(),
        "model.query_prompt=\"Query: \"".into(),
        "train.steps=40".into(),
        "train.batch_size=64".into(),
        "train.eval_every=0".into(),
        "train.checkpoint_every=0".into(),
        "optim.lr=2e-3".into(),
    ];
    let cfg = Config::load(Path::new("configs/qwen3.toml"), &sets).unwrap();
    common::assert_learns(Trainer::new(cfg, None).unwrap());
    // The run trained with the model's head: last-token pooling, normalised.
    let head: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("run").join("head.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(head["pooling"], "lasttoken");
    assert_eq!(head["normalize"], true);
}

#[test]
fn the_shipped_qwen3_lora_config_runs_and_learns() {
    let _switches = crate::steady();
    // configs/qwen3-lora.toml as shipped, on the tiny Qwen3 fixture (as the test above):
    // the adapters alone train, and the model learns.
    use gradcache::train::{Config, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        format!("output_dir=\"{}\"", tmp.path().join("run").display()),
        format!("model.pretrained=\"{}\"", fixture("qwen3").display()),
        "model.query_max_len=32".into(),
        "model.passage_max_len=32".into(),
        "model.query_prompt=\"Query: \"".into(),
        "model.lora.rank=4".into(),
        "model.lora.alpha=8.0".into(),
        "train.steps=40".into(),
        "train.batch_size=64".into(),
        "train.eval_every=0".into(),
        "train.checkpoint_every=0".into(),
        "optim.lr=2e-2".into(),
    ];
    let cfg = Config::load(Path::new("configs/qwen3-lora.toml"), &sets).unwrap();
    let trainer = Trainer::new(cfg, None).unwrap();
    assert!(trainer.params().names().all(|n| n.contains(".lora_")));
    common::assert_learns(trainer);
}

#[test]
fn sentence_transformers_tokenizer_kwargs_win_over_the_tokenizer_config() {
    let _switches = crate::steady();
    // `processor_kwargs` (sentence-transformers 6; `tokenizer_args` before) are passed to
    // the tokenizer over its own config: here the padding side and the limit.
    let tmp = tempfile::tempdir().unwrap();
    for key in ["processor_kwargs", "tokenizer_args"] {
        let dir = edited(tmp.path(), "qwen3", "sentence_bert_config.json", |c| {
            c[key] = serde_json::json!({"padding_side": "right", "model_max_length": 16});
        });
        let model = load(&dir, LoadOptions::default());
        assert!(!model.tokenizer().pads_left(), "{key}");
        assert_eq!(model.tokenizer().max_len(), 16, "{key}");
        // The embeddings do not depend on the side.
        let texts = ["Jesus wept.", "In the beginning"];
        let right = model.embed_queries(&texts, 2).unwrap();
        let left = load(
            &fixture("qwen3"),
            LoadOptions {
                max_len: Some(16),
                ..Default::default()
            },
        )
        .embed_queries(&texts, 2)
        .unwrap();
        assert!(max_diff(&right, &left) <= 1e-6, "{key}");
    }
}

#[test]
fn a_decoder_loads_from_the_hugging_face_cache_offline() {
    let _switches = crate::steady();
    // The cache layout huggingface_hub writes: the tokenizer's config (left padding, its
    // pad token) and the sentence-transformers files come from the snapshot too.
    use gradcache::hub::HubSettings;
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub").join("models--Qwen--tiny-qwen3");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    copy_dir(&fixture("qwen3"), &repo.join("snapshots").join("0123abcd"));
    let vars: HashMap<&str, String> = [
        ("HF_HOME", home.path().to_str().unwrap().to_string()),
        ("HF_HUB_OFFLINE", "1".to_string()),
    ]
    .into();
    let hub = HubSettings::from_lookup(|k| vars.get(k).cloned());
    let files = ModelFiles::resolve("Qwen/tiny-qwen3", &hub).unwrap();
    let model = EmbeddingModel::from_files(&files, &LoadOptions::default()).unwrap();
    assert!(model.tokenizer().pads_left());
    assert_eq!(model.tokenizer().max_len(), MAX_LEN);
    let r = reference("qwen3");
    let got = model.embed_queries(&refs(&r.texts), 4).unwrap();
    assert!(max_diff(&got, &r.tensors["embeddings.query"]) <= 1e-5);
}
