//! A long CPU encoding reads the layers' projection weights from copies transposed in
//! panels (`gradcache::nn::TransposedWeights`, made by `gradcache::hub::embed` from 512
//! texts on): for every encoder and decoder family of the fixtures, for LoRA adapters on
//! two of them and for the ColBERT fixtures' documents, the encoding with the copies has
//! the bits of the encoding with the weights as stored, copies are made and read, and a
//! second encoding reads the same copies. Wider layers of the three kinds of layer node
//! (post-norm, pre-norm, decoder) reach what the tiny fixtures do not: many panels and a
//! narrower last one, an input past 512 on few rows and on many, and more rows than one
//! panel product takes. (That only a thread inside `run` reads the copies is the unit
//! test of `src/nn/cpu/products/transposed.rs`.)

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertEncoder, BertOptions, Pooling};
use gradcache::hub::{EmbeddingModel, LoadOptions, MultiVectorModel, Tokenizer};
use gradcache::nn::{PanelKernel, TransposedWeights};
use gradcache::{Ctx, Encoder, ParamStore, TokenBatch};

use crate::common;
use crate::common::bits;
use crate::common::decoders::perturb;
use crate::common::families::{fixture, reference, refs, DECODERS, ENCODERS};

fn options(base: Option<&Path>) -> LoadOptions {
    LoadOptions {
        max_len: Some(32),
        base: base.map(|b| b.display().to_string()),
        ..Default::default()
    }
}

/// The checks of this file on `encoder` with its `tokenizer`, the texts of `family`'s
/// fixture.
fn same_bits_from_copies(
    (encoder, tokenizer): (&BertEncoder, &Tokenizer),
    family: &str,
    what: &str,
) {
    let r = reference(family);
    // Enough texts for products of several hundred rows.
    let texts: Vec<&str> = refs(&r.texts).into_iter().cycle().take(64).collect();
    let batch = tokenizer.encode(&texts, &Device::Cpu).unwrap();
    let plain = encoder.encode(&batch, &Ctx::eval()).unwrap();
    let copies = TransposedWeights::new();
    let copied = copies.run(|| encoder.encode(&batch, &Ctx::eval())).unwrap();
    assert!(copies.bytes() > 0, "{what}: no weight was copied");
    assert!(copies.reads() > 0, "{what}: no product read a copy");
    assert_eq!(
        bits(&copied),
        bits(&plain),
        "{what}: the copies change the encoding"
    );
    // A second encoding reads the same copies: none made anew (each weight is the same
    // tensor from call to call).
    let (bytes, reads) = (copies.bytes(), copies.reads());
    let again = copies.run(|| encoder.encode(&batch, &Ctx::eval())).unwrap();
    assert_eq!(copies.bytes(), bytes, "{what}: copies made again");
    assert_eq!(copies.reads(), 2 * reads, "{what}");
    assert_eq!(bits(&again), bits(&plain), "{what}");
}

#[test]
fn every_family_encodes_the_same_bits_from_transposed_weights() {
    for family in ENCODERS.into_iter().chain(DECODERS) {
        let dir = fixture(family);
        let model = EmbeddingModel::load(dir.to_str().unwrap(), &options(None)).unwrap();
        same_bits_from_copies((model.encoder(), model.tokenizer()), family, family);
    }
}

#[test]
fn a_lora_adapter_encodes_the_same_bits_from_transposed_base_weights() {
    for family in ["bert", "qwen3"] {
        let adapter = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/lora")
            .join(family)
            .join("adapter");
        let base = fixture(family);
        let model = EmbeddingModel::load(adapter.to_str().unwrap(), &options(Some(&base))).unwrap();
        assert!(
            model.settings().contains("LoRA adapter"),
            "{}",
            model.settings()
        );
        let what = format!("{family} with a LoRA adapter");
        same_bits_from_copies((model.encoder(), model.tokenizer()), family, &what);
    }
}

#[test]
fn a_colbert_encodes_the_same_bits_from_transposed_weights() {
    for layout in ["pylate", "st6"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/colbert")
            .join(layout);
        let model = MultiVectorModel::load(dir.to_str().unwrap(), &Device::Cpu).unwrap();
        let (_, documents) = model.tokenizers();
        let what = format!("ColBERT ({layout}) documents");
        same_bits_from_copies((model.encoder(), documents), "bert", &what);
    }
}

/// `texts` right-padded rows of `len` tokens, each at least `len - 6` long.
fn rows(texts: usize, len: usize) -> TokenBatch {
    let (mut ids, mut mask) = (vec![], vec![]);
    for r in 0..texts {
        let real = len - (r * 5) % 7.min(len);
        for c in 0..len {
            ids.push(if c < real {
                1 + ((r * 31 + c * 17) % 59) as u32
            } else {
                0
            });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v| Tensor::from_vec(v, (texts, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(vec![0; texts * len])).unwrap()
}

#[test]
fn wide_layers_encode_the_same_bits_from_panels() {
    let wide = |mut cfg: gradcache::bert::BertConfig| {
        // 128 outputs: two panels; 600 (1,200 for ModernBERT's GeGLU): eight panels of 64
        // and a last one of 88; the down projection's input, 600, past 512.
        cfg.hidden_size = 128;
        cfg.intermediate_size = 600;
        cfg.num_hidden_layers = 2;
        cfg.max_position_embeddings = 64;
        cfg.extra.remove("head_dim");
        cfg
    };
    for (family, cfg) in [
        ("bert", wide(common::encoders::config("bert"))),
        (
            "modernbert-biased",
            wide(common::encoders::config("modernbert-biased")),
        ),
        ("llama", wide(common::decoders::config("llama"))),
    ] {
        let store = ParamStore::new(5, DType::F32, &Device::Cpu);
        let options = BertOptions {
            pooling: Pooling::Mean,
            normalize: false,
            ..Default::default()
        };
        let encoder = BertEncoder::build(&store, "tower", &cfg, &options).unwrap();
        if family == "llama" {
            perturb(&store);
        }
        // At most 36 rows (the down projection read as stored, the rest from panels),
        // about 300, and about 1,160 (products of two blocks of rows).
        for (texts, len) in [(4, 9), (24, 16), (40, 32)] {
            let batch = rows(texts, len);
            let plain = encoder.encode(&batch, &Ctx::eval()).unwrap();
            let copies = TransposedWeights::new();
            let copied = copies.run(|| encoder.encode(&batch, &Ctx::eval())).unwrap();
            assert!(
                copies.reads() > 0,
                "{family}, {texts} texts: no product read a copy"
            );
            assert_eq!(
                bits(&copied),
                bits(&plain),
                "{family}, {texts} texts of {len} tokens: the panels change the encoding"
            );
            // The blocked panel kernel (GRADCACHE_PANEL_KERNEL; process-wide, but the same
            // bits, so a test beside this one sees no difference either).
            for inputs in [64, 7] {
                PanelKernel::Blocked { inputs }.apply();
                let blocked = copies.run(|| encoder.encode(&batch, &Ctx::eval()));
                PanelKernel::Gemm.apply();
                assert_eq!(
                    bits(&blocked.unwrap()),
                    bits(&plain),
                    "{family}, {texts} texts of {len} tokens: blocks of {inputs} inputs"
                );
            }
        }
    }
}

#[test]
fn a_training_steps_two_passes_read_one_copy_of_each_weight() {
    // A cache step's representation pass runs the model built on detached views of the
    // variables, its replay the one on the variables themselves: two tensors per weight,
    // one storage. Both read one copy of it (found by where its values are), so the
    // copies stay one model's size, inside their budget for a model half of it.
    let store = ParamStore::new(5, DType::F32, &Device::Cpu);
    let options = BertOptions {
        pooling: Pooling::Mean,
        normalize: false,
        ..Default::default()
    };
    let cfg = common::encoders::config("bert");
    let encoder = BertEncoder::build(&store, "tower", &cfg, &options).unwrap();
    let batch = rows(40, 16);
    let copies = TransposedWeights::new();
    let represented = copies.run(|| encoder.encode(&batch, &Ctx::eval())).unwrap();
    let (bytes, reads) = (copies.bytes(), copies.reads());
    assert!(bytes > 0 && reads > 0);
    let replayed = copies
        .run(|| encoder.forward(&batch, &Ctx::eval()))
        .unwrap();
    assert_eq!(copies.bytes(), bytes, "the replay made copies of its own");
    assert_eq!(copies.reads(), 2 * reads);
    assert_eq!(bits(&replayed), bits(&represented));
}
