//! Embeds sentences with a pretrained model and prints them as JSON: the crate's one
//! inference path ([`gradcache::hub::EmbeddingModel`]), which reads the pooling,
//! normalisation and similarity from the model's sentence-transformers files (mean pooling
//! and L2 normalisation for all-MiniLM-L6-v2).
//!
//! ```text
//! cargo run --release --example embed -- <model dir or hub id> "first sentence" "second" ...
//! ```
//!
//! A hub id is resolved through the Hugging Face cache (`HF_HOME`, `HF_HUB_OFFLINE=1` for
//! no network). `scripts/bert_reference.py` computes the same embeddings independently.

use gradcache::hub::{EmbeddingModel, LoadOptions};

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    gradcache::memory::keep_freed_memory();
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: embed <model dir or hub id> <text>..."))?;
    let texts: Vec<String> = args.collect();
    let options = LoadOptions {
        max_len: Some(256),
        ..LoadOptions::default()
    };
    let model = EmbeddingModel::load(&model, &options)?;
    eprintln!("{}", model.settings());
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embeddings = model.embed(&refs, 32)?;
    println!("{}", serde_json::to_string(&embeddings.to_vec2::<f32>()?)?);
    Ok(())
}
