//! CLIP-style image-text training in plain Rust: a ResNet image tower (BatchNorm,
//! checkpointed over its blocks) and an LSTM caption tower (its backward through time
//! checkpointed in sqrt segments) under one gradient cache, each side in its own chunk
//! size, CLIP's loss with a learnable temperature, on the Shapes data set generated from
//! a seed. Prints held-out image->text recall before and after.
//!
//! ```text
//! cargo run --release --example image_text
//! cargo run --release --example image_text -- --steps 40   # shorter
//! ```
//!
//! `gradcache train --config configs/image-text.toml` is the same with the trainer's
//! checkpoints, metrics and export (and a BERT for the captions by default).

use candle_core::{DType, Device, Tensor};
use gradcache::hub::tokenizer::{train_wordpiece, Tokenizer};
use gradcache::lstm::{Lstm, LstmConfig, LstmEncoder, LstmPooling};
use gradcache::resnet::{Block, ResNet, ResNetConfig};
use gradcache::train::metrics::{evaluate, RetrievalMetrics};
use gradcache::train::optim::{clip_grad_norm, Optimizer, OptimizerKind};
use gradcache::train::shapes::{generate, Scene, ShapesConfig};
use gradcache::{
    ClipLoss, Ctx, Encoder, GradCache, ParamStore, Recompute, Recomputed, Similarity, Tower,
};

const SIZE: usize = 32;
const WIDTH: usize = 64;

fn images(scenes: &[&Scene]) -> anyhow::Result<Tensor> {
    let pixels: Vec<f32> = scenes
        .iter()
        .flat_map(|s| s.pixels.iter().copied())
        .collect();
    Ok(Tensor::from_vec(
        pixels,
        (scenes.len(), 3, SIZE, SIZE),
        &Device::Cpu,
    )?)
}

/// Every held-out image against every distinct held-out caption.
fn recall(
    image: &impl Encoder<Input = Tensor>,
    text: &impl Encoder<Input = gradcache::TokenBatch>,
    tokenizer: &Tokenizer,
    eval: &[Scene],
) -> anyhow::Result<RetrievalMetrics> {
    let mut captions: Vec<&str> = eval.iter().map(|s| s.caption.as_str()).collect();
    captions.sort_unstable();
    captions.dedup();
    let targets: Vec<usize> = eval
        .iter()
        .map(|s| captions.binary_search(&s.caption.as_str()).unwrap_or(0))
        .collect();
    let scenes: Vec<&Scene> = eval.iter().collect();
    let q = image.encode(&images(&scenes)?, &Ctx::eval())?;
    let p = text.encode(&tokenizer.encode(&captions, &Device::Cpu)?, &Ctx::eval())?;
    Ok(evaluate(&q, &p, &targets, Similarity::Cosine, 256)?)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let args: Vec<String> = std::env::args().collect();
    let steps: u64 = match args.iter().position(|a| a == "--steps") {
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(150),
        None => 150,
    };
    let data = generate(&ShapesConfig {
        size: SIZE,
        train: 4096,
        eval: 256,
        seed: 0,
    })?;
    let tokenizer = Tokenizer::new(
        train_wordpiece(data.train.iter().map(|s| s.caption.as_str()), 100, true)?,
        16,
    )?;

    let store = ParamStore::new(42, DType::F32, &Device::Cpu);
    let resnet = ResNetConfig {
        in_channels: 3,
        width: 16,
        stages: vec![1, 1, 1],
        block: Block::Basic,
        output: WIDTH,
    };
    let image = Tower::build(&store, "image", |vb| ResNet::new(&resnet, vb))?;
    let image = Recomputed::new(image, Recompute::EveryLayer)?;
    let lstm = LstmConfig {
        vocab_size: tokenizer.inner().get_vocab_size(true),
        embedding_size: WIDTH,
        hidden_size: WIDTH,
        num_layers: 1,
        pooling: LstmPooling::Mean,
        output: WIDTH,
    };
    let text = Tower::build(&store, "text", |vb| Lstm::new(&lstm, vb))?;
    let text = LstmEncoder::new(text, Recompute::Sqrt)?;
    let loss = ClipLoss::new(&store, "logit_scale", 0.07, 100.0)?;
    // 32 images per BatchNorm chunk; captions in chunks of 64.
    let gc = GradCache::two_towers(image, text, 32, 64, loss)?.with_seed(42);
    let mut optimizer = Optimizer::new(OptimizerKind::adamw(), gc.params().clone())?;

    let before = recall(
        gc.query_encoder(),
        gc.passage_encoder(),
        &tokenizer,
        &data.eval,
    )?;
    println!(
        "held-out image->text recall@1 before: {:.3}",
        before.recall_at_1
    );
    let batch = 128;
    for step in 0..steps {
        let start = (step as usize * batch) % (data.train.len() - batch);
        let scenes: Vec<&Scene> = data.train[start..start + batch].iter().collect();
        let captions: Vec<&str> = scenes.iter().map(|s| s.caption.as_str()).collect();
        let out = gc.cache_step(
            step,
            &images(&scenes)?,
            &tokenizer.encode(&captions, &Device::Cpu)?,
        )?;
        let mut grads = out.grads;
        clip_grad_norm(&mut grads, 1.0)?;
        let lr = 2e-3 * (1.0 - step as f64 / steps as f64);
        optimizer.step(step, &grads, lr)?;
        gc.loss().clamp()?;
        if step % 25 == 0 {
            println!(
                "step {step}: loss {:.3}, logit scale {:.1}",
                out.loss,
                gc.loss().scale()?
            );
        }
    }
    let after = recall(
        gc.query_encoder(),
        gc.passage_encoder(),
        &tokenizer,
        &data.eval,
    )?;
    println!(
        "held-out image->text recall@1 after {steps} steps: {:.3} (recall@5 {:.3})",
        after.recall_at_1, after.recall_at_5
    );
    Ok(())
}
