//! A long CPU encoding reads the layers' projection weights from transposed copies
//! (`gradcache::nn::TransposedWeights`, made by `gradcache::hub::embed` from 512 texts
//! on): for every encoder and decoder family of the fixtures, the encoding with the
//! copies has the bits of the encoding with the weights as stored, and copies are made
//! and read.
//! (That only a thread inside `run` reads them is the unit test of
//! `src/nn/cpu/transposed.rs`.)

use candle_core::Device;
use gradcache::hub::{EmbeddingModel, LoadOptions};
use gradcache::nn::TransposedWeights;
use gradcache::{Ctx, Encoder};

mod common;
use common::bits;
use common::families::{fixture, reference, refs};

const FAMILIES: [&str; 11] = [
    "bert",
    "roberta",
    "xlm-roberta",
    "mpnet",
    "modernbert",
    "distilbert",
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "gemma3_text",
];

#[test]
fn every_family_encodes_the_same_bits_from_transposed_weights() {
    for family in FAMILIES {
        let r = reference(family);
        let options = LoadOptions {
            max_len: Some(32),
            ..Default::default()
        };
        let model = EmbeddingModel::load(fixture(family).to_str().unwrap(), &options).unwrap();
        // Enough texts for several tiles of the feed-forward's rows.
        let texts: Vec<&str> = refs(&r.texts).into_iter().cycle().take(64).collect();
        let batch = model.tokenizer().encode(&texts, &Device::Cpu).unwrap();
        let encoder = model.encoder();
        let plain = encoder.encode(&batch, &Ctx::eval()).unwrap();
        let copies = TransposedWeights::new();
        let copied = copies.run(|| encoder.encode(&batch, &Ctx::eval())).unwrap();
        assert!(copies.bytes() > 0, "{family}: no weight was copied");
        assert!(copies.reads() > 0, "{family}: no product read a copy");
        assert_eq!(
            bits(&copied),
            bits(&plain),
            "{family}: the copies change the encoding"
        );
    }
}
