//! InfoNCE's interactions in one softmax (`loss.directions`, sentence-transformers'
//! `MultipleNegativesRankingLoss(directions=..., partition_mode="joint")`, the loss of GTE
//! and Qwen3-Embedding) and the loss kernel that computes InfoNCE a tile of logits at a
//! time:
//!
//! - against sentence-transformers 6.2 on fixed embeddings with a hard negative per query
//!   (`tests/fixtures/losses/`, written by `scripts/make_loss_fixtures.py`), every
//!   combination of the four directions: the loss and both gradients <= 1e-5 relative,
//!   through the kernel, the composed row blocks and the autograd forward;
//! - the kernel against the composed row blocks with the symmetric term, the
//!   false-negative mask (judged by the model or a guide), dot and cosine, row blocks of
//!   1, 3 and all, in f32 and f64, over batches wider than a tile;
//! - cached == full batch with every direction, hard negatives and the mask;
//! - a list without `query_to_doc`, or an unknown name, is refused naming the key.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use gradcache::loss::{Guide, LossDirection};
use gradcache::toy::{Mlp, MlpConfig};
use gradcache::{GradCache, InfoNce, Loss, ParamStore, Similarity, Tower};

use crate::common;
use crate::common::{max_abs, max_diff};

use LossDirection::{DocToDoc, DocToQuery, QueryToDoc, QueryToQuery};

fn fixture() -> (HashMap<String, Tensor>, serde_json::Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/losses");
    let tensors =
        candle_core::safetensors::load(dir.join("directions.safetensors"), &Device::Cpu).unwrap();
    let meta = serde_json::from_str(&std::fs::read_to_string(dir.join("directions.json")).unwrap())
        .unwrap();
    (tensors, meta)
}

fn parse(key: &str) -> Vec<LossDirection> {
    key.split('+')
        .map(|name| serde_json::from_value(serde_json::json!(name)).unwrap())
        .collect()
}

fn rel(got: &Tensor, want: &Tensor) -> f64 {
    max_diff(got, want) / max_abs(want).max(1e-12)
}

/// The loss and its gradients through autograd on [`Loss::forward`].
fn autograd(loss: &InfoNce, q: &Tensor, p: &Tensor) -> (f64, Tensor, Tensor) {
    let (qv, pv) = (Var::from_tensor(q).unwrap(), Var::from_tensor(p).unwrap());
    let l = loss.forward(qv.as_tensor(), pv.as_tensor()).unwrap();
    let grads = l.backward().unwrap();
    (
        l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(),
        grads.get(qv.as_tensor()).unwrap().clone(),
        grads.get(pv.as_tensor()).unwrap().clone(),
    )
}

#[test]
fn every_combination_of_directions_matches_sentence_transformers() {
    let _switches = crate::switching();
    let (t, meta) = fixture();
    let (q, p) = (&t["queries"], &t["passages"]);
    let temperature = meta["temperature"].as_f64().unwrap();
    let combos = meta["combinations"].as_array().unwrap();
    assert_eq!(combos.len(), 8);
    for key in combos {
        let key = key.as_str().unwrap();
        let loss = InfoNce::new(temperature)
            .unwrap()
            .with_similarity(Similarity::Cosine)
            .with_directions(&parse(key))
            .unwrap();
        let want_loss = t[&format!("{key}.loss")].to_vec1::<f32>().unwrap()[0] as f64;
        let (want_q, want_p) = (
            &t[&format!("{key}.grad_queries")],
            &t[&format!("{key}.grad_passages")],
        );
        let mut paths: Vec<(&str, (f64, Tensor, Tensor))> = Vec::new();
        for (name, fused) in [("kernel", true), ("row blocks", false)] {
            gradcache::nn::set_fused_kernels(fused);
            let out = loss
                .clone()
                .with_block_rows(Some(4))
                .unwrap()
                .value_and_grads(q, p)
                .unwrap();
            gradcache::nn::set_fused_kernels(true);
            paths.push((name, (out.loss as f64, out.grad_queries, out.grad_passages)));
        }
        paths.push(("autograd", autograd(&loss, q, p)));
        for (name, (l, gq, gp)) in paths {
            assert!(
                ((l - want_loss) / want_loss).abs() <= 1e-5,
                "{key} ({name}): loss {l} against sentence-transformers' {want_loss}"
            );
            let (eq, ep) = (rel(&gq, want_q), rel(&gp, want_p));
            assert!(
                eq <= 1e-5 && ep <= 1e-5,
                "{key} ({name}): gradients off by {eq:e} (queries), {ep:e} (passages)"
            );
        }
    }
}

/// Queries `[n, d]` and passages `[n group, d]` with near-duplicates, so that the mask
/// has something to leave out.
fn batch(n: usize, group: usize, d: usize, dtype: DType) -> (Tensor, Tensor) {
    let q = common::random(3, &[n, d]);
    let p = common::random(4, &[n * group, d]);
    // Query 1 close to query 0; passage 2 (query 1's) close to query 0's positive.
    let q = Tensor::cat(
        &[
            q.narrow(0, 0, 1).unwrap(),
            (q.narrow(0, 0, 1).unwrap() + common::random(5, &[1, d]).affine(0.05, 0.0).unwrap())
                .unwrap(),
            q.narrow(0, 2, n - 2).unwrap(),
        ],
        0,
    )
    .unwrap();
    (q.to_dtype(dtype).unwrap(), p.to_dtype(dtype).unwrap())
}

/// The kernel's loss, gradients against the composed row blocks' (`tol` for the
/// gradients; the loss is reported in f32).
fn kernel_equals_composed(loss: &InfoNce, q: &Tensor, p: &Tensor, tol: f64, what: &str) {
    let kernel = loss.value_and_grads(q, p).unwrap();
    gradcache::nn::set_fused_kernels(false);
    let composed = loss.value_and_grads(q, p);
    gradcache::nn::set_fused_kernels(true);
    let composed = composed.unwrap();
    let l = ((kernel.loss - composed.loss).abs() / composed.loss.abs()) as f64;
    assert!(l <= tol.max(1e-6), "{what}: loss {l:e}");
    let gq = rel(&kernel.grad_queries, &composed.grad_queries);
    let gp = rel(&kernel.grad_passages, &composed.grad_passages);
    assert!(gq <= tol && gp <= tol, "{what}: gradients {gq:e} {gp:e}");
}

#[allow(clippy::too_many_arguments)]
fn infonce(
    directions: &[LossDirection],
    symmetric: bool,
    margin: Option<f64>,
    guide: Option<&Guide>,
    similarity: Similarity,
    block: Option<usize>,
) -> InfoNce {
    InfoNce::new(0.1)
        .unwrap()
        .with_similarity(similarity)
        .with_symmetric(symmetric)
        .with_directions(directions)
        .unwrap()
        .with_false_negative_margin(margin)
        .unwrap()
        .with_guide(guide.cloned())
        .with_block_rows(block)
        .unwrap()
}

fn guide_for(n: usize, group: usize, dtype: DType) -> Guide {
    let guide = Guide::new();
    guide
        .set(
            &common::random(6, &[n, 5]).to_dtype(dtype).unwrap(),
            &common::random(7, &[n * group, 5]).to_dtype(dtype).unwrap(),
        )
        .unwrap();
    guide
}

const ALL: [LossDirection; 4] = [QueryToDoc, QueryToQuery, DocToQuery, DocToDoc];

#[test]
fn the_kernel_equals_the_composed_row_blocks() {
    let _switches = crate::switching();
    for (group, dtype, tol) in [(3, DType::F32, 1e-5), (2, DType::F64, 1e-10)] {
        let n = 9;
        let (q, p) = batch(n, group, 8, dtype);
        let guide = guide_for(n, group, dtype);
        for directions in [&ALL[..1], &ALL[..], &[QueryToDoc, DocToDoc][..]] {
            for symmetric in [false, true] {
                for (margin, judge) in [(None, None), (Some(0.0), None), (Some(0.1), Some(&guide))]
                {
                    for similarity in [Similarity::Cosine, Similarity::Dot] {
                        for block in [Some(1), Some(3), None] {
                            let loss =
                                infonce(directions, symmetric, margin, judge, similarity, block);
                            let what = format!(
                                "{dtype:?} {directions:?} symmetric {symmetric} margin \
                                 {margin:?} guide {} {similarity:?} block {block:?}",
                                judge.is_some()
                            );
                            kernel_equals_composed(&loss, &q, &p, tol, &what);
                        }
                    }
                }
            }
        }
    }
    // A batch wider than a tile of the kernel (512 columns).
    let (n, group) = (700, 2);
    let (q, p) = batch(n, group, 8, DType::F32);
    let guide = guide_for(n, group, DType::F32);
    for loss in [
        infonce(
            &ALL,
            true,
            Some(0.1),
            Some(&guide),
            Similarity::Cosine,
            None,
        ),
        infonce(&ALL, false, Some(0.0), None, Similarity::Dot, Some(64)),
    ] {
        kernel_equals_composed(&loss, &q, &p, 1e-5, &format!("700 queries, {loss:?}"));
    }
}

fn tower(store: &ParamStore, prefix: &str) -> Tower<Mlp> {
    let cfg = MlpConfig {
        input: 12,
        hidden: 24,
        output: 16,
        dropout: 0.0,
    };
    Tower::build(store, prefix, |vb| Mlp::new(&cfg, vb)).unwrap()
}

#[test]
fn cached_equals_the_full_batch_with_every_direction() {
    let _switches = crate::steady();
    let b = 8;
    for hard in [0, 2] {
        for margin in [None, Some(0.05)] {
            for chunk in [1, 3, b] {
                let store = ParamStore::new(1, DType::F32, &Device::Cpu);
                let loss = InfoNce::new(0.1)
                    .unwrap()
                    .with_similarity(Similarity::Cosine)
                    .with_directions(&[QueryToDoc, QueryToQuery, DocToQuery, DocToDoc])
                    .unwrap()
                    .with_false_negative_margin(margin)
                    .unwrap()
                    .with_block_rows(Some(3))
                    .unwrap();
                let gc = GradCache::two_towers(
                    tower(&store, "q"),
                    tower(&store, "p"),
                    chunk,
                    chunk + 1,
                    loss,
                )
                .unwrap()
                .with_dropout(false);
                let q = common::features(10, b, 12);
                let p = common::features(11, b * (hard + 1), 12);
                let reference = gc.full_batch_step(0, &q, &p).unwrap();
                let cached = gc.cache_step(0, &q, &p).unwrap();
                let what = format!("hard {hard} margin {margin:?} chunk {chunk}");
                let l = ((cached.loss - reference.loss) / reference.loss).abs();
                assert!(l as f64 <= 1e-5, "{what}: loss {l:e}");
                let err = cached.grads.max_rel_err(&reference.grads, 0.0).unwrap();
                assert!(err <= 1e-5, "{what}: gradients {err:e}");
            }
        }
    }
}

#[test]
fn directions_without_query_to_doc_or_unknown_are_refused() {
    let _switches = crate::steady();
    let err = InfoNce::new(0.1)
        .unwrap()
        .with_directions(&[QueryToQuery])
        .unwrap_err();
    assert!(
        matches!(
            err,
            gradcache::Error::InvalidConfig {
                field: "loss.directions",
                ..
            }
        ),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_tiny_run(dir.path());
    let load =
        |value: &str| gradcache::train::Config::load(&path, &[format!("loss.directions={value}")]);
    let err = load("[\"doc_to_doc\"]").unwrap_err();
    assert!(err.to_string().contains("loss.directions"), "{err}");
    let err = load("[\"query_to_doc\", \"doc_to_nowhere\"]").unwrap_err();
    assert!(err.to_string().contains("doc_to_nowhere"), "{err}");
    let cfg = load("[\"query_to_passage\", \"passage_to_passage\"]").unwrap();
    assert_eq!(cfg.loss.directions, [QueryToDoc, DocToDoc]);
}
