//! Late interaction (ColBERT) under the gradient cache: the blocked MaxSim loss and the
//! distillation loss against autograd and a plain loop, and a multi-vector BERT tower
//! whose cached steps equal a full-batch step for every chunking, with hard negatives,
//! uneven lengths, query expansion tokens no one attends to and skiplisted document tokens.

use candle_core::{DType, Device, Tensor, Var};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, DenseActivation, DenseSpec};
use gradcache::recompute::Recompute;
use gradcache::{
    Ctx, Encoder, GradCache, Loss, MaxSim, MaxSimDistillation, ParamStore, TeacherScores,
    TokenBatch,
};

use crate::common;
use crate::common::{max_abs, max_diff, random, rel_err_with_zeros};

const DIM: usize = 6;

/// `rows` token matrices of `tokens` vectors, some of them zero (absent), row `r`
/// keeping its first `3 + r % (tokens - 2)` tokens less every fifth.
fn token_matrices(seed: u64, rows: usize, tokens: usize) -> Tensor {
    let x = random(seed, &[rows, tokens, DIM]);
    let keep: Vec<f32> = (0..rows)
        .flat_map(|r| {
            (0..tokens)
                .map(move |t| f32::from(u8::from(t < 3 + r % (tokens - 2) && (t + r) % 5 != 4)))
        })
        .collect();
    let keep = Tensor::from_vec(keep, (rows, tokens, 1), &Device::Cpu).unwrap();
    x.broadcast_mul(&keep)
        .unwrap()
        .reshape((rows, tokens * DIM))
        .unwrap()
}

/// The MaxSim score written as loops.
fn loop_scores(q: &Tensor, p: &Tensor) -> Vec<Vec<f32>> {
    let split = |x: &Tensor| -> Vec<Vec<Vec<f32>>> {
        let (rows, width) = x.dims2().unwrap();
        x.reshape((rows, width / DIM, DIM))
            .unwrap()
            .to_vec3()
            .unwrap()
    };
    let (q, p) = (split(q), split(p));
    let kept = |v: &Vec<f32>| v.iter().any(|&x| x != 0.0);
    q.iter()
        .map(|qi| {
            p.iter()
                .map(|pj| {
                    qi.iter()
                        .filter(|s| kept(s))
                        .map(|s| {
                            pj.iter()
                                .filter(|t| kept(t))
                                .map(|t| s.iter().zip(t).map(|(a, b)| a * b).sum::<f32>())
                                .fold(None, |m: Option<f32>, v| Some(m.map_or(v, |m| m.max(v))))
                                .unwrap_or(0.0)
                        })
                        .sum()
                })
                .collect()
        })
        .collect()
}

#[test]
fn maxsim_scores_equal_a_loop() {
    let _switches = crate::switching();
    for fused in [true, false] {
        gradcache::nn::set_fused_kernels(fused);
        maxsim_scores_equal_a_loop_on_this_path();
    }
    gradcache::nn::set_fused_kernels(true);
}

fn maxsim_scores_equal_a_loop_on_this_path() {
    let (q, p) = (token_matrices(1, 5, 4), token_matrices(2, 10, 7));
    for block in [1, 40, 1 << 22] {
        let loss = MaxSim::new(DIM).unwrap().with_block_similarities(block);
        let got = loss.scores(&q, &p).unwrap().to_vec2::<f32>().unwrap();
        let want = loop_scores(&q, &p);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() <= 1e-5, "block {block}: score {g} vs {w}");
        }
    }
    // A passage with no kept token scores 0, and a negative best similarity is kept (the
    // absent tokens take no part in the max).
    let q = Tensor::new(&[[1f32, 0., 0., 0., 0., 0.]], &Device::Cpu).unwrap();
    let p = Tensor::new(
        &[
            [-1f32, 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0.],
            [0.; 12],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let s = MaxSim::new(DIM).unwrap().scores(&q, &p).unwrap();
    assert_eq!(s.to_vec2::<f32>().unwrap(), vec![vec![-1.0, 0.0]]);
}

#[test]
fn maxsim_gradients_equal_autograd_in_every_blocking() {
    let _switches = crate::switching();
    // The CPU kernels, then the composed ops other devices run.
    for fused in [true, false] {
        gradcache::nn::set_fused_kernels(fused);
        maxsim_gradients_equal_autograd();
    }
    gradcache::nn::set_fused_kernels(true);
}

fn maxsim_gradients_equal_autograd() {
    for (group, temperature) in [(1, 1.0), (3, 0.05)] {
        let (q, p) = (token_matrices(3, 6, 5), token_matrices(4, 6 * group, 8));
        let reference = MaxSim::new(DIM)
            .unwrap()
            .with_temperature(temperature)
            .unwrap();
        let (qv, pv) = (Var::from_tensor(&q).unwrap(), Var::from_tensor(&p).unwrap());
        let loss = reference.forward(qv.as_tensor(), pv.as_tensor()).unwrap();
        let store = loss.backward().unwrap();
        let want_q = store.get(qv.as_tensor()).unwrap();
        let want_p = store.get(pv.as_tensor()).unwrap();
        let want = loss.to_scalar::<f32>().unwrap();
        for block in [1, 40, 1 << 22] {
            let got = reference
                .clone()
                .with_block_similarities(block)
                .value_and_grads(&q, &p)
                .unwrap();
            assert!(
                ((got.loss - want) / want).abs() <= 1e-5,
                "{} vs {want}",
                got.loss
            );
            let scale = max_abs(want_q).max(max_abs(want_p));
            assert!(max_diff(&got.grad_queries, want_q) <= 1e-5 * scale);
            assert!(max_diff(&got.grad_passages, want_p) <= 1e-5 * scale);
            // Absent tokens get no gradient.
            let absent = q
                .abs()
                .unwrap()
                .eq(0.0)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let leak = max_abs(&got.grad_queries.mul(&absent).unwrap());
            assert!(leak <= 1e-7 * scale, "group {group} block {block}: {leak}");
        }
    }
}

/// The distillation loss written out: each query's scores of its own `group` passages
/// (min-max normalised or not), the KL divergence from the softmax of the teacher's
/// scores over `t` to theirs, the mean over queries.
fn loop_distillation(
    q: &Tensor,
    p: &Tensor,
    teacher: &[Vec<f32>],
    (normalize, t): (bool, f64),
) -> f64 {
    let scores = loop_scores(q, p);
    let group = teacher[0].len();
    let softmax = |v: &[f64]| -> Vec<f64> {
        let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = v.iter().map(|x| (x - max).exp()).sum();
        v.iter().map(|x| (x - max).exp() / sum).collect()
    };
    let mut total = 0.0;
    for (i, teacher_row) in teacher.iter().enumerate() {
        let s: Vec<f64> = (0..group)
            .map(|j| scores[i][i * group + j] as f64)
            .collect();
        let (lo, hi) = s
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        let x: Vec<f64> = match normalize {
            true => s.iter().map(|v| (v - lo) / (hi - lo + 1e-8)).collect(),
            false => s,
        };
        let scaled: Vec<f64> = teacher_row.iter().map(|&v| v as f64 / t).collect();
        let (student, teacher) = (softmax(&x), softmax(&scaled));
        total += teacher
            .iter()
            .zip(&student)
            .map(|(t, s)| t * (t.ln() - s.ln()))
            .sum::<f64>();
    }
    total / teacher.len() as f64
}

#[test]
fn distillation_equals_a_loop_and_autograd_on_both_paths() {
    let _switches = crate::switching();
    for fused in [true, false] {
        gradcache::nn::set_fused_kernels(fused);
        distillation_equals_a_loop_and_autograd(fused);
    }
    gradcache::nn::set_fused_kernels(true);
}

fn distillation_equals_a_loop_and_autograd(fused: bool) {
    let group = 4;
    let (q, p) = (token_matrices(11, 5, 4), token_matrices(12, 5 * group, 7));
    let teacher = (random(13, &[5, group]) * 4.0).unwrap();
    let rows = teacher.to_vec2::<f32>().unwrap();
    let cell = TeacherScores::new();
    cell.set(&teacher).unwrap();
    for (normalize, t) in [(true, 1.0), (false, 1.0), (true, 0.25)] {
        let what = format!("fused {fused}, normalize {normalize}, teacher temperature {t}");
        let loss = MaxSimDistillation::new(DIM, cell.clone())
            .unwrap()
            .with_normalized_scores(normalize)
            .with_teacher_temperature(t)
            .unwrap();
        let want = loop_distillation(&q, &p, &rows, (normalize, t));
        let got = loss.value_and_grads(&q, &p).unwrap();
        assert!(want > 1e-3, "{what}: a loss that can be compared ({want})");
        let rel = ((got.loss as f64 - want) / want).abs();
        assert!(rel <= 1e-5, "{what}: loss {} vs {want}", got.loss);
        let (qv, pv) = (Var::from_tensor(&q).unwrap(), Var::from_tensor(&p).unwrap());
        let graph = loss.forward(qv.as_tensor(), pv.as_tensor()).unwrap();
        let rel = ((graph.to_scalar::<f32>().unwrap() as f64 - want) / want).abs();
        assert!(rel <= 1e-5, "{what}: forward {rel:e}");
        let store = graph.backward().unwrap();
        let (want_q, want_p) = (
            store.get(qv.as_tensor()).unwrap(),
            store.get(pv.as_tensor()).unwrap(),
        );
        let scale = max_abs(want_q).max(max_abs(want_p));
        assert!(scale > 1e-4, "{what}: gradients that can be compared");
        let (dq, dp) = (
            max_diff(&got.grad_queries, want_q),
            max_diff(&got.grad_passages, want_p),
        );
        assert!(
            dq.max(dp) <= 1e-5 * scale,
            "{what}: gradients {dq:e} {dp:e}"
        );
    }
    // A teacher temperature that is not positive; teacher scores that are not one per
    // passage of each group, and none at all.
    for t in [0.0, -1.0, f64::INFINITY] {
        let err = MaxSimDistillation::new(DIM, cell.clone())
            .unwrap()
            .with_teacher_temperature(t)
            .unwrap_err();
        assert!(err.to_string().contains("teacher_temperature"), "{err}");
    }
    let loss = MaxSimDistillation::new(DIM, cell.clone()).unwrap();
    let err = loss
        .value_and_grads(&q, &p.narrow(0, 0, 10).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("one score per passage"), "{err}");
    let unset = MaxSimDistillation::new(DIM, TeacherScores::new()).unwrap();
    let err = unset.value_and_grads(&q, &p).unwrap_err();
    assert!(err.to_string().contains("teacher's scores"), "{err}");
}

const CONFIG: &str = r#"{
  "architectures": ["BertModel"],
  "model_type": "bert",
  "vocab_size": 60,
  "hidden_size": 16,
  "num_hidden_layers": 3,
  "num_attention_heads": 2,
  "intermediate_size": 24,
  "hidden_act": "gelu",
  "hidden_dropout_prob": 0.0,
  "attention_probs_dropout_prob": 0.0,
  "max_position_embeddings": 32,
  "type_vocab_size": 2,
  "initializer_range": 0.2,
  "layer_norm_eps": 1e-12,
  "pad_token_id": 0
}"#;

const MASK_ID: u32 = 4;
const QUERY_LENGTH: usize = 8;
const DOCUMENT_LENGTH: usize = 11;

/// Queries of 3..6 real tokens, expanded with the mask token to the query length: the
/// expansion tokens are kept and scored but not attended to.
fn queries(seed: u64, rows: usize) -> TokenBatch {
    let mut ids = vec![];
    let mut mask = vec![];
    for r in 0..rows {
        let real = 3 + (r * 5 + seed as usize) % 4;
        for c in 0..QUERY_LENGTH {
            let id = 5 + ((r * 31 + c * 17 + seed as usize * 13) % 55) as u32;
            ids.push(if c < real { id } else { MASK_ID });
            mask.push(u32::from(c < real));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, QUERY_LENGTH), &Device::Cpu).unwrap();
    let keep = t(vec![1; rows * QUERY_LENGTH]);
    TokenBatch::new(t(ids.clone()), t(mask), t(vec![0; ids.len()]))
        .unwrap()
        .with_vectors(keep, QUERY_LENGTH)
        .unwrap()
}

/// Documents of 3..9 real tokens, right-padded to the longest; tokens whose id is a
/// multiple of 7 are skiplisted (attended to, not kept).
fn documents(seed: u64, rows: usize) -> TokenBatch {
    let len = 9;
    let (mut ids, mut mask, mut keep) = (vec![], vec![], vec![]);
    for r in 0..rows {
        let real = 3 + (r * 7 + seed as usize) % (len - 2);
        for c in 0..len {
            let id = 5 + ((r * 29 + c * 11 + seed as usize * 7) % 55) as u32;
            ids.push(if c < real { id } else { 0 });
            mask.push(u32::from(c < real));
            keep.push(u32::from(c < real && !id.is_multiple_of(7)));
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, len), &Device::Cpu).unwrap();
    TokenBatch::new(t(ids), t(mask), t(vec![0; rows * len]))
        .unwrap()
        .with_vectors(t(keep), DOCUMENT_LENGTH)
        .unwrap()
}

fn colbert_options(recompute: Recompute) -> BertOptions {
    BertOptions {
        normalize: true,
        multi_vector: true,
        recompute,
        dense: vec![DenseSpec {
            path: "1_Dense".into(),
            in_features: 16,
            out_features: DIM,
            bias: false,
            activation: DenseActivation::Identity,
        }],
        ..Default::default()
    }
}

fn tower(seed: u64, recompute: Recompute) -> (ParamStore, BertEncoder) {
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let store = ParamStore::new(seed, DType::F32, &Device::Cpu);
    let encoder = BertEncoder::build(&store, "", &cfg, &colbert_options(recompute)).unwrap();
    (store, encoder)
}

/// Each token vector's squared norm, `[rows][tokens]`, of representations `[rows, tokens * DIM]`.
fn squared_norms(reps: &Tensor) -> Vec<Vec<f32>> {
    let (rows, width) = reps.dims2().unwrap();
    let tokens = reps.reshape((rows, width / DIM, DIM)).unwrap();
    tokens.sqr().unwrap().sum(2).unwrap().to_vec2().unwrap()
}

#[test]
fn the_head_writes_normalised_kept_token_vectors_padded_to_the_side_width() {
    let _switches = crate::steady();
    let (_store, enc) = tower(7, Recompute::Off);
    let q = queries(1, 3);
    let reps = enc.encode(&q, &Ctx::eval()).unwrap();
    assert_eq!(reps.dims(), &[3, QUERY_LENGTH * DIM]);
    let norms = squared_norms(&reps);
    // Every query token, expansion tokens included, is a unit vector.
    assert!(
        norms.iter().flatten().all(|n| (n - 1.0).abs() <= 1e-5),
        "{norms:?}"
    );
    let d = documents(2, 4);
    let reps = enc.encode(&d, &Ctx::eval()).unwrap();
    assert_eq!(reps.dims(), &[4, DOCUMENT_LENGTH * DIM]);
    let norms = squared_norms(&reps);
    let keep = d.vectors.as_ref().unwrap().keep.to_vec2::<u32>().unwrap();
    for (r, row) in norms.iter().enumerate() {
        for (t, n) in row.iter().enumerate() {
            let kept = keep[r].get(t).copied().unwrap_or(0) == 1;
            let want = if kept { 1.0 } else { 0.0 };
            assert!(
                (n - want).abs() <= 1e-5,
                "doc {r} token {t}: norm {n}, kept {kept}"
            );
        }
    }
}

#[test]
fn expansion_tokens_are_computed_and_change_no_real_token() {
    let _switches = crate::switching();
    let (_store, enc) = tower(8, Recompute::Off);
    let q = queries(3, 4);
    // The same queries without their expansion tokens (padding instead).
    let plain = TokenBatch::new(
        q.input_ids.clone(),
        q.attention_mask.clone(),
        q.token_type_ids.clone(),
    )
    .unwrap()
    .with_vectors(q.attention_mask.clone(), QUERY_LENGTH)
    .unwrap();
    let expanded = enc.encode(&q, &Ctx::eval()).unwrap();
    let alone = enc.encode(&plain, &Ctx::eval()).unwrap();
    let real = q
        .attention_mask
        .to_dtype(DType::F32)
        .unwrap()
        .unsqueeze(2)
        .unwrap()
        .broadcast_as((4, QUERY_LENGTH, DIM))
        .unwrap()
        .reshape((4, QUERY_LENGTH * DIM))
        .unwrap();
    let diff = max_diff(&expanded.mul(&real).unwrap(), &alone);
    assert!(diff <= 1e-6, "real tokens moved by {diff:e}");
    // The packed kernels and the op-by-op layers give the expansion tokens the same
    // vectors.
    gradcache::nn::set_fused_kernels(false);
    let composed = enc.encode(&q, &Ctx::eval());
    gradcache::nn::set_fused_kernels(true);
    let diff = max_diff(&expanded, &composed.unwrap());
    assert!(diff <= 1e-5, "fused vs composed: {diff:e}");
}

#[test]
fn cached_multi_vector_steps_equal_a_full_batch_step() {
    let _switches = crate::steady();
    let b = 6;
    let (q, p) = (queries(5, b), documents(6, 2 * b));
    cached_steps_equal_a_full_batch_step(&q, &p, "MaxSim", || {
        MaxSim::new(DIM).unwrap().with_temperature(0.5).unwrap()
    });
}

#[test]
fn cached_distillation_steps_equal_a_full_batch_step() {
    let _switches = crate::steady();
    let (b, group) = (6, 3);
    let (q, p) = (queries(15, b), documents(16, group * b));
    let cell = TeacherScores::new();
    cell.set(&(random(17, &[b, group]) * 5.0).unwrap()).unwrap();
    for normalize in [true, false] {
        let what = format!("distillation, normalize {normalize}");
        cached_steps_equal_a_full_batch_step(&q, &p, &what, || {
            MaxSimDistillation::new(DIM, cell.clone())
                .unwrap()
                .with_normalized_scores(normalize)
        });
    }
}

/// Cached steps of the loss `make` builds, in several chunkings, with recompute off and
/// on, equal a full-batch step to 1e-5 (loss and every gradient).
fn cached_steps_equal_a_full_batch_step<L: Loss>(
    q: &TokenBatch,
    p: &TokenBatch,
    what: &str,
    make: impl Fn() -> L,
) {
    use gradcache::Batch;
    let (b, np) = (q.rows(), p.rows());
    for recompute in [Recompute::Off, Recompute::EveryLayer] {
        let (store, enc) = tower(9, recompute.clone());
        let mut gc = GradCache::shared(enc, 1, make()).unwrap();
        let reference = gc.full_batch_step(0, q, p).unwrap();
        assert_eq!(reference.grads.len(), store.params().len());
        for (qc, pc) in [(1, 1), (2, 5), (3, 4), (b, np), (100, 100)] {
            gc = gc.with_chunk_sizes(qc, pc).unwrap();
            let cached = gc.cache_step(0, q, p).unwrap();
            let rel = ((cached.loss - reference.loss) / reference.loss).abs();
            assert!(
                rel <= 1e-5,
                "{what}, {recompute:?} chunks {qc}/{pc}: loss {rel:e}"
            );
            let zero: Vec<String> = (0..3)
                .map(|i| format!("encoder.layer.{i}.attention.self.key.bias"))
                .collect();
            let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
            let err = rel_err_with_zeros(&cached.grads, &reference.grads, &zero, 1e-5);
            assert!(
                err <= 1e-5,
                "{what}, {recompute:?} chunks {qc}/{pc}: gradients {err:e}"
            );
        }
    }
}

#[test]
fn recompute_changes_no_bit_of_a_multi_vector_step() {
    let _switches = crate::steady();
    let (q, p) = (queries(7, 4), documents(8, 8));
    let step = |recompute| {
        let (_store, enc) = tower(10, recompute);
        let loss = MaxSim::new(DIM).unwrap();
        let gc = GradCache::shared(enc, 2, loss).unwrap();
        gc.cache_step(0, &q, &p).unwrap()
    };
    let (off, on) = (step(Recompute::Off), step(Recompute::EveryLayer));
    assert_eq!(off.loss.to_bits(), on.loss.to_bits());
    for (name, g) in off.grads.iter() {
        let other = on.grads.get(name).unwrap();
        assert_eq!(common::bits(g), common::bits(other), "{name}");
    }
}

#[test]
fn bad_multi_vector_inputs_are_refused() {
    let _switches = crate::steady();
    // The loss: a width of 0, a temperature that is not positive, rows that are not whole
    // token vectors.
    assert!(MaxSim::new(0).unwrap_err().to_string().contains("dim"));
    for t in [0.0, -1.0, f64::NAN] {
        let err = MaxSim::new(DIM).unwrap().with_temperature(t).unwrap_err();
        assert!(err.to_string().contains("temperature"), "{err}");
    }
    let odd = random(1, &[2, DIM * 3 + 1]);
    let err = MaxSim::new(DIM)
        .unwrap()
        .value_and_grads(&odd, &odd)
        .unwrap_err();
    assert!(err.to_string().contains("whole token vectors"), "{err}");
    // The batch: kept tokens of another shape, more tokens than the width, single- and
    // multi-vector rows in one batch.
    let q = queries(1, 2);
    let plain = TokenBatch::new(
        q.input_ids.clone(),
        q.attention_mask.clone(),
        q.token_type_ids.clone(),
    )
    .unwrap();
    let short = q.attention_mask.narrow(1, 0, 3).unwrap();
    assert!(plain.clone().with_vectors(short, QUERY_LENGTH).is_err());
    let err = plain
        .clone()
        .with_vectors(q.attention_mask.clone(), QUERY_LENGTH - 1)
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let err = <TokenBatch as gradcache::Batch>::cat(&[plain.clone(), q.clone()]).unwrap_err();
    assert!(err.to_string().contains("multi-vector"), "{err}");
    // The model: a ColBERT given a plain batch, a pooled model given a multi-vector one.
    let (_store, colbert) = tower(3, Recompute::Off);
    let err = colbert.encode(&plain, &Ctx::eval()).unwrap_err();
    assert!(err.to_string().contains("multi-vector"), "{err}");
    let cfg: BertConfig = serde_json::from_str(CONFIG).unwrap();
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let pooled = BertEncoder::build(&store, "", &cfg, &BertOptions::default()).unwrap();
    let err = pooled.encode(&q, &Ctx::eval()).unwrap_err();
    assert!(err.to_string().contains("multi-vector"), "{err}");
    // Retrieval: single vectors handed to MaxSim scoring.
    let err = gradcache::retrieval::search(
        &random(2, &[2, DIM]),
        1,
        gradcache::retrieval::Scoring::MaxSim,
        Default::default(),
        |_| Ok(random(3, &[1, DIM])),
    )
    .unwrap_err();
    assert!(err.to_string().contains("token matrices"), "{err}");
}
