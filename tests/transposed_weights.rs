//! A long CPU encoding reads the layers' projection weights from transposed copies
//! (`gradcache::nn::TransposedWeights`, made by `gradcache::hub::embed` from 512 texts
//! on): for every encoder and decoder family of the fixtures, for LoRA adapters on two of
//! them and for the ColBERT fixtures' documents, the encoding with the copies has the bits of the encoding with the
//! weights as stored, copies are made and read, and a second encoding reads the same
//! copies. (That only a thread inside `run` reads them is the unit test of
//! `src/nn/cpu/transposed.rs`.)

use std::path::Path;

use candle_core::Device;
use gradcache::bert::BertEncoder;
use gradcache::hub::{EmbeddingModel, LoadOptions, MultiVectorModel, Tokenizer};
use gradcache::nn::TransposedWeights;
use gradcache::{Ctx, Encoder};

mod common;
use common::bits;
use common::families::{fixture, reference, refs, DECODERS, ENCODERS};

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
