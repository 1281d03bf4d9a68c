//! Embeds sentences with a pretrained BERT-family model (mean pooling, L2-normalised, as
//! sentence-transformers models such as all-MiniLM-L6-v2 do) and prints them as JSON.
//!
//! ```text
//! cargo run --release --example embed -- <model dir or hub id> "first sentence" "second" ...
//! ```
//!
//! A hub id is resolved through the Hugging Face cache (`HF_HOME`, `HF_HUB_OFFLINE=1` for
//! no network). `scripts/bert_reference.py` computes the same embeddings independently.

use candle_core::{DType, Device};
use gradcache::bert::{load_pretrained, BertOptions, Pooling};
use gradcache::pretrained::{HubSettings, ModelFiles};
use gradcache::tokenizer::Tokenizer;
use gradcache::{Ctx, Encoder, ParamStore};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: embed <model dir or hub id> <text>..."))?;
    let texts: Vec<String> = args.collect();
    let files = ModelFiles::resolve(&model, &HubSettings::from_env())?;
    let options = BertOptions {
        pooling: Pooling::Mean,
        normalize: true,
        ..Default::default()
    };
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let (encoder, cfg, _) = load_pretrained(&files, "", &options, store)?;
    let tokenizer_file = files
        .tokenizer
        .ok_or_else(|| anyhow::anyhow!("{model} has no tokenizer.json"))?;
    let tokenizer = Tokenizer::from_file(&tokenizer_file, cfg.max_position_embeddings.min(256))?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let batch = tokenizer.encode(&refs, &Device::Cpu)?;
    let embeddings = encoder.encode(&batch, &Ctx::eval())?;
    println!("{}", serde_json::to_string(&embeddings.to_vec2::<f32>()?)?);
    Ok(())
}
