//! Retrieval metrics on hand-made rankings.

use candle_core::{Device, Tensor};
use gradcache::train::metrics::{evaluate, rank_of, RetrievalMetrics};
use gradcache::Similarity;

#[test]
fn metrics_from_known_ranks() {
    // Ranks 1, 2, 5, 11: recall@1 = 1/4, @5 = 3/4, @10 = 3/4;
    // MRR@10 = (1 + 1/2 + 1/5 + 0) / 4; nDCG@10 = (1 + 1/log2 3 + 1/log2 6 + 0) / 4.
    let m = RetrievalMetrics::from_ranks(&[1, 2, 5, 11]);
    assert_eq!(m.queries, 4);
    assert_eq!(m.recall_at_1, 0.25);
    assert_eq!(m.recall_at_5, 0.75);
    assert_eq!(m.recall_at_10, 0.75);
    assert!((m.mrr_at_10 - 1.7 / 4.0).abs() < 1e-12);
    let ndcg = (1.0 + 1.0 / 3f64.log2() + 1.0 / 6f64.log2()) / 4.0;
    assert!((m.ndcg_at_10 - ndcg).abs() < 1e-12);
}

#[test]
fn ranks_count_better_scores_and_earlier_ties() {
    let scores = [0.1, 0.9, 0.5, 0.5, 0.2];
    assert_eq!(rank_of(&scores, 1), 1);
    assert_eq!(rank_of(&scores, 2), 2);
    assert_eq!(
        rank_of(&scores, 3),
        3,
        "a tie with an earlier candidate counts against"
    );
    assert_eq!(rank_of(&scores, 0), 5);
}

#[test]
fn evaluate_scores_every_query_against_every_passage() {
    let dev = &Device::Cpu;
    // Query i points along axis i; passage order puts query 1's match last.
    let q = Tensor::new(&[[1f32, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dev).unwrap();
    let p = Tensor::new(&[[2f32, 0.1, 0.0], [0.0, 0.0, 3.0], [0.5, 0.4, 0.0]], dev).unwrap();
    // Dot: query 0 -> passage 0 (rank 1); query 1 -> passage 2 (0.4 > 0.1 > 0: rank 1);
    // query 2 -> passage 1 (rank 1). With a wrong target for query 1 (passage 0): rank 2.
    for block in [1, 2, 8] {
        let m = evaluate(&q, &p, &[0, 2, 1], Similarity::Dot, block).unwrap();
        assert_eq!(m.recall_at_1, 1.0);
        let m = evaluate(&q, &p, &[0, 0, 1], Similarity::Dot, block).unwrap();
        assert!((m.recall_at_1 - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.mrr_at_10 - (1.0 + 0.5 + 1.0) / 3.0).abs() < 1e-12);
    }
    // Cosine ignores the passage norms: for query 0, passage 0 (cos 0.999) beats
    // passage 2 (cos 0.78) either way, but for query 1, passage 2 (cos 0.62) beats 0 (0.05).
    let m = evaluate(&q, &p, &[0, 2, 1], Similarity::Cosine, 2).unwrap();
    assert_eq!(m.recall_at_1, 1.0);

    // Where the two disagree: a long passage that points half-way wins on dot, a short
    // one that points the query's way wins on cosine. Query 0 = x; passage 0 = 10x + 10y
    // (dot 10, cos 0.71), passage 1 = x + 0.1y (dot 1, cos 0.995). Target: passage 1.
    let x = Tensor::new(&[[1f32, 0.0]], dev).unwrap();
    let long_and_short = Tensor::new(&[[10f32, 10.0], [1.0, 0.1]], dev).unwrap();
    let cosine = evaluate(&x, &long_and_short, &[1], Similarity::Cosine, 1).unwrap();
    let dot = evaluate(&x, &long_and_short, &[1], Similarity::Dot, 1).unwrap();
    assert_eq!(
        cosine.recall_at_1, 1.0,
        "cosine ranks the aligned passage first"
    );
    assert_eq!(dot.recall_at_1, 0.0, "dot ranks the long passage first");

    let err = evaluate(&q, &p, &[0, 1], Similarity::Dot, 2).unwrap_err();
    assert!(
        err.to_string().contains("one target passage per query"),
        "{err}"
    );
    let err = evaluate(&q, &p, &[0, 1, 3], Similarity::Dot, 2).unwrap_err();
    assert!(err.to_string().contains("beyond the passages"), "{err}");
}
