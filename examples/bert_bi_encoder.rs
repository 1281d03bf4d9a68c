//! A BERT bi-encoder trained with the gradient cache, the training loop written out in plain
//! Rust (no CLI): the design card's example. Runs on the quickstart data, no download.
//!
//! ```text
//! cargo run --release --example bert_bi_encoder
//! ```
//!
//! The steps: read pairs, train a WordPiece tokenizer, build a small BERT tower, and for
//! each step take a batch of 64 pairs, let `cache_step` compute the loss over all of them in
//! chunks of 16, clip, and apply AdamW. Evaluation: every held-out query against every
//! held-out positive.

use std::path::Path;

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::hub::embed;
use gradcache::hub::tokenizer::{train_wordpiece, Tokenizer};
use gradcache::train::data::{Fields, Loader};
use gradcache::train::formats::read_jsonl;
use gradcache::train::metrics::evaluate;
use gradcache::train::optim::{clip_grad_norm, Optimizer, OptimizerKind, Schedule};
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, Similarity};

const STEPS: u64 = 40;
const BATCH: usize = 64;
const CHUNK: usize = 16;

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let device = Device::Cpu;
    let train = read_jsonl(Path::new("data/quickstart/train.jsonl"), &Fields::default())?;
    let eval = read_jsonl(Path::new("data/quickstart/eval.jsonl"), &Fields::default())?;

    // 1. A tokenizer trained on the training texts.
    let texts: Vec<&str> = train
        .iter()
        .flat_map(|p| [p.query.as_str(), p.positive.as_str()])
        .collect();
    let tokenizer = Tokenizer::new(train_wordpiece(texts.into_iter(), 3000, true)?, 48)?;

    // 2. A small BERT, one tower shared by queries and passages, sqrt checkpointing.
    let cfg: BertConfig = serde_json::from_value(serde_json::json!({
        "vocab_size": tokenizer.inner().get_vocab_size(true),
        "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 192, "max_position_embeddings": 48,
    }))?;
    let options = BertOptions {
        lora: None,
        pooling: Pooling::Mean,
        normalize: true,
        recompute: Recompute::Sqrt,
        ..Default::default()
    };
    let store = ParamStore::new(42, DType::F32, &device);
    let encoder = BertEncoder::build(&store, "", &cfg, &options)?;

    // 3. The gradient cache: one loss over the whole batch, activations of one chunk.
    let loss = InfoNce::new(0.05)?
        .with_similarity(Similarity::Cosine)
        .with_symmetric(true);
    let gc = GradCache::shared(encoder, CHUNK, loss)?.with_seed(42);
    let mut optimizer = Optimizer::new(OptimizerKind::adamw(), gc.params().clone())?;
    let schedule = Schedule {
        lr: 1e-3,
        warmup: 4,
        total: STEPS,
    };
    let mut loader = Loader::new(train, BATCH, 0, 42)?;

    let recall_at_1 = |gc: &GradCache<BertEncoder>| -> anyhow::Result<f64> {
        let q: Vec<&str> = eval.iter().map(|p| p.query.as_str()).collect();
        let p: Vec<&str> = eval.iter().map(|p| p.positive.as_str()).collect();
        let qe = embed(gc.query_encoder(), &tokenizer, &q, 32, &device)?;
        let pe = embed(gc.passage_encoder(), &tokenizer, &p, 32, &device)?;
        let targets: Vec<usize> = (0..q.len()).collect();
        Ok(evaluate(&qe, &pe, &targets, Similarity::Cosine, 128)?.recall_at_1)
    };
    println!("before: recall@1 {:.3}", recall_at_1(&gc)?);

    // 4. The training loop.
    for step in 0..STEPS {
        let batch = loader.next_batch()?;
        let queries = tokenizer.encode(
            &batch.queries.iter().map(String::as_str).collect::<Vec<_>>(),
            &device,
        )?;
        let passages = tokenizer.encode(
            &batch
                .passages
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            &device,
        )?;
        let out = gc.cache_step(step, &queries, &passages)?;
        let mut grads = out.grads;
        clip_grad_norm(&mut grads, 1.0)?;
        optimizer.step(step, &grads, schedule.lr_at(step))?;
        if step % 10 == 0 || step + 1 == STEPS {
            println!("step {:>3}  loss {:.4}", step + 1, out.loss);
        }
    }
    println!("after:  recall@1 {:.3}", recall_at_1(&gc)?);
    Ok(())
}
