//! Fixtures and helpers shared by the integration tests: seeded random tensors, error
//! measures, a gradient comparison that checks mathematically-zero gradients as noise, an
//! encoder wrapper that watches the cache, and tiny model files written in code.

// Each test binary uses a different subset.
#![allow(dead_code)]

pub mod decoders;
pub mod encoders;
pub mod families;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::{Ctx, Encoder, Gradients, ParamStore, Params};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;

/// A seeded standard-normal f32 tensor on the CPU.
pub fn random(seed: u64, dims: &[usize]) -> Tensor {
    gradcache::rng::normal(seed, 0.0, 1.0, &dims.into(), DType::F32, &Device::Cpu)
        .expect("random tensor")
}

/// The training context of chunk `chunk` (run seed 7, step 0): batch statistics,
/// dropout masks from the seed.
pub fn train_ctx(chunk: u32) -> Ctx {
    Ctx::train(gradcache::ChunkSeed {
        run: 7,
        step: 0,
        rank: 0,
        tower: 0,
        chunk,
    })
}

/// `rows` seeded feature vectors of `width` values.
pub fn features(seed: u64, rows: usize, width: usize) -> Tensor {
    random(seed, &[rows, width])
}

/// The largest absolute entry, as f64 (any float dtype).
pub fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.max(0))
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_scalar::<f64>())
        .expect("max |t|")
}

/// The largest absolute difference of two tensors of one shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs(
        &a.to_dtype(DType::F32)
            .unwrap()
            .sub(&b.to_dtype(DType::F32).unwrap())
            .unwrap(),
    )
}

/// The bit patterns of an f32 tensor (for bit-for-bit comparisons).
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// The largest relative gradient error of `got` against `want` over every parameter
/// except those named in `zero`, whose true gradient is mathematically zero (e.g. a key
/// bias, which adds one constant to every score softmax sees): those have no meaningful
/// relative error, so both sides must instead be rounding noise, at most `zero_tol` of the
/// largest gradient entry of `want` (asserted).
pub fn rel_err_with_zeros(got: &Gradients, want: &Gradients, zero: &[&str], zero_tol: f64) -> f64 {
    let global = want.iter().map(|(_, g)| max_abs(g)).fold(0.0, f64::max);
    for z in zero {
        for (which, grads) in [("computed", got), ("reference", want)] {
            let g = grads
                .get(z)
                .unwrap_or_else(|| panic!("{which}: no gradient for `{z}`"));
            let noise = max_abs(g) / global;
            assert!(
                noise <= zero_tol,
                "{which} gradient of `{z}` should be 0, is {noise:e} of the largest"
            );
        }
    }
    let keep = |g: &Gradients| -> Gradients {
        g.iter()
            .filter(|(n, _)| !zero.contains(n))
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect()
    };
    keep(got).max_rel_err(&keep(want), 0.0).unwrap()
}

/// An encoder that delegates to `inner` and watches what the cache does with it: how
/// many chunks were replayed, and every representation its graph forward produced (what
/// the default replay runs).
pub struct Spy<E> {
    pub inner: E,
    pub replays: Cell<usize>,
    pub forwards: RefCell<Vec<Tensor>>,
}

impl<E> Spy<E> {
    pub fn new(inner: E) -> Self {
        Self {
            inner,
            replays: Cell::new(0),
            forwards: RefCell::new(Vec::new()),
        }
    }
}

impl<E: Encoder> Encoder for Spy<E> {
    type Input = E::Input;
    fn params(&self) -> &Params {
        self.inner.params()
    }
    fn encode(&self, input: &Self::Input, ctx: &Ctx) -> gradcache::Result<Tensor> {
        self.inner.encode(input, ctx)
    }
    fn forward(&self, input: &Self::Input, ctx: &Ctx) -> gradcache::Result<Tensor> {
        let rep = self.inner.forward(input, ctx)?;
        self.forwards.borrow_mut().push(rep.detach());
        Ok(rep)
    }
    fn replay(&self, input: &Self::Input, g: &Tensor, ctx: &Ctx) -> gradcache::Result<Gradients> {
        self.replays.set(self.replays.get() + 1);
        // The default replay, so that `forward` is what runs.
        gradcache::replay::replay(self.params(), g, || self.forward(input, ctx))
    }
}

pub const VOCAB: [&str; 12] = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "lord", "is", "my", "shepherd", "##s", "light", ",",
];

/// A small WordPiece tokenizer with BERT's normaliser, pre-tokenizer and `[CLS] .. [SEP]`.
pub fn write_tokenizer(path: &Path) {
    let vocab: [(String, u32); 12] = std::array::from_fn(|i| (VOCAB[i].to_string(), i as u32));
    let model = WordPiece::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_normalizer(Some(BertNormalizer::default()))
        .unwrap();
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), 3),
        ("[CLS]".into(), 2),
    )));
    tok.save(path, false).unwrap();
}

/// The config of a tiny BERT over [`VOCAB`]: 2 layers of width 8, 16 positions.
pub const TINY_BERT: &str = r#"{
  "model_type": "bert",
  "vocab_size": 12,
  "hidden_size": 8,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "intermediate_size": 16,
  "hidden_act": "gelu_new",
  "max_position_embeddings": 16,
  "type_vocab_size": 2,
  "initializer_range": 0.02,
  "layer_norm_eps": 1e-12
}"#;

/// A complete plain Hugging Face model directory (no sentence-transformers files):
/// `config.json` (`config`), `model.safetensors` with seeded weights (names optionally
/// `bert.`-prefixed, plus a pre-training head an encoder does not use) and
/// `tokenizer.json`. Returns the store holding the weights written.
pub fn write_bert_dir(dir: &Path, config: &str, bert_prefix: bool) -> ParamStore {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("config.json"), config).unwrap();
    let store = ParamStore::new(5, DType::F32, &Device::Cpu);
    let cfg: BertConfig = serde_json::from_str(config).unwrap();
    BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
    let prefix = if bert_prefix { "bert." } else { "" };
    let mut tensors: HashMap<String, Tensor> = store
        .params()
        .iter()
        .map(|(n, v)| (format!("{prefix}{n}"), v.as_tensor().clone()))
        .collect();
    tensors.insert(
        "cls.predictions.bias".into(),
        Tensor::zeros(cfg.vocab_size, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    write_tokenizer(&dir.join("tokenizer.json"));
    store
}

/// Lines `train` and `eval` of the quickstart training pairs, written as
/// `dir/train.jsonl` and `dir/eval.jsonl`.
pub fn quickstart_sample(dir: &Path, train: std::ops::Range<usize>, eval: std::ops::Range<usize>) {
    let lines: Vec<String> = fs::read_to_string("data/quickstart/train.jsonl")
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    fs::write(dir.join("train.jsonl"), lines[train].join("\n")).unwrap();
    fs::write(dir.join("eval.jsonl"), lines[eval].join("\n")).unwrap();
}

/// A tiny fresh-model run over the first 48 pairs of the quickstart data (10 held-out
/// pairs), written as `dir/tiny.toml` with its data; the run directory is `dir/run`.
pub fn write_tiny_run(dir: &Path) -> std::path::PathBuf {
    quickstart_sample(dir, 0..48, 100..110);
    let config = format!(
        r#"
seed = 7
output_dir = "{out}"
[data]
train_file = "{dir}/train.jsonl"
eval_file = "{dir}/eval.jsonl"
[model]
query_max_len = 24
passage_max_len = 24
recompute = "every_layer"
[model.fresh]
vocab_size = 300
hidden_size = 16
num_layers = 2
num_heads = 2
intermediate_size = 32
[loss]
temperature = 0.1
symmetric = true
block_rows = 5
[train]
steps = 4
batch_size = 8
query_chunk = 3
passage_chunk = 5
checkpoint_every = 2
keep_checkpoints = 3
[optim]
lr = 1e-3
warmup_steps = 1
"#,
        out = dir.join("run").display(),
        dir = dir.display()
    );
    let path = dir.join("tiny.toml");
    fs::write(&path, config).unwrap();
    path
}

/// Pairs over the tiny tokenizer's words ([`TINY_BERT`]), 24 of them, as JSONL.
pub fn vocab_pairs(path: &Path) {
    let words = ["the", "lord", "is", "my", "shepherd", "light", "lords"];
    let mut lines = Vec::new();
    for i in 0..24 {
        let pick = |k: usize| words[(i * k + k) % words.len()];
        let query = format!("{} {} {}", pick(1), pick(2), pick(3));
        let positive = format!("{}, {} {}", pick(1), pick(2), pick(5));
        lines.push(serde_json::json!({"query": query, "positive": positive}).to_string());
    }
    fs::write(path, lines.join("\n")).unwrap();
}

/// Runs `trainer` to its end and checks that the held-out nDCG@10 rose by more than 0.05
/// (what a shipped config's test asks).
pub fn assert_learns(mut trainer: gradcache::train::Trainer) {
    let (before, after) = trainer.run(&mut gradcache::train::Quiet).unwrap();
    let before = before.expect("an evaluation before training");
    assert!(
        after.ndcg_at_10 > before.ndcg_at_10 + 0.05,
        "nDCG@10 {} -> {}",
        before.ndcg_at_10,
        after.ndcg_at_10
    );
}

/// The reference a cached step with BatchNorm must equal: each chunk through the graph
/// forward once (updating the statistics), the loss over all rows, one backward.
pub fn chunkwise_reference<E: Encoder<Input = Tensor>>(
    gc: &gradcache::GradCache<E>,
    q: &Tensor,
    p: &Tensor,
    chunk: usize,
) -> (f32, gradcache::Gradients) {
    let enc = gc.query_encoder();
    let side = |x: &Tensor, s: gradcache::Side| -> Tensor {
        let parts: Vec<Tensor> = (0..x.dim(0).unwrap().div_ceil(chunk))
            .map(|i| {
                let rows = chunk.min(x.dim(0).unwrap() - i * chunk);
                let ctx = gc.ctx(0, s, i).updating_stats();
                assert_eq!(ctx.norm, gradcache::NormStats::BatchAndUpdate);
                enc.forward(&x.narrow(0, i * chunk, rows).unwrap(), &ctx)
                    .unwrap()
            })
            .collect();
        Tensor::cat(&parts, 0).unwrap()
    };
    let (qr, pr) = (
        side(q, gradcache::Side::Query),
        side(p, gradcache::Side::Passage),
    );
    let loss = gradcache::Loss::forward(gc.loss(), &qr, &pr).unwrap();
    let value = loss.to_scalar::<f32>().unwrap();
    let grads = gc.params().grads_from(&loss.backward().unwrap());
    (value, grads)
}

/// Every buffer's bits by name (BatchNorm running statistics): what must not move, or
/// must move the same way.
pub fn snapshot(buffers: &Params) -> Vec<(String, Vec<u32>)> {
    buffers
        .iter()
        .map(|(n, v)| (n.to_string(), bits(v.as_tensor())))
        .collect()
}

/// Copies the folder `from` (and its subfolders) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}
