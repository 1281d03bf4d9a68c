//! Retrieval with sparse (SPLADE) vectors: the inverted index ranks exactly as the dense
//! dot product does (the same documents, the same scores, ties and zero-score documents
//! placed the same), a corpus evaluation through it gives the dense evaluation's measures,
//! and it reports sentence-transformers' active dimensions and FLOPS.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use gradcache::loss::Similarity;
use gradcache::retrieval::{
    evaluate_corpus, search, BeirSet, CorpusEvalOptions, Document, Query, Scoring, SearchOptions,
    SparseRows,
};

/// `rows` non-negative vectors of `width` with about one entry in `1 / every` active,
/// each a multiple of 1/8 below 4: every product and every sum of the tests' sizes is
/// exact in f32, so any order of addition gives the same score and the two paths must
/// agree bit for bit. Row `i` is empty when `i % 11 == 5`; rows 7 and 8 are equal (a tie).
fn vectors(seed: u64, rows: usize, width: usize, every: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let mut v = vec![0f32; rows * width];
    for r in 0..rows {
        if r % 11 == 5 {
            continue;
        }
        for c in 0..width {
            if next() % every == 0 {
                v[r * width + c] = (1 + next() % 31) as f32 / 8.0;
            }
        }
    }
    if rows > 8 {
        let (a, b) = v.split_at_mut(8 * width);
        b[..width].copy_from_slice(&a[7 * width..]);
    }
    v
}

fn tensor(v: Vec<f32>, rows: usize, width: usize) -> Tensor {
    Tensor::from_vec(v, (rows, width), &Device::Cpu).unwrap()
}

#[test]
fn the_inverted_index_ranks_as_the_dense_dot_product() {
    let (width, docs, queries) = (300, 230, 40);
    let corpus = tensor(vectors(1, docs, width, 12), docs, width);
    // Some queries with a single active entry: fewer documents than k share it, and
    // zero-score documents fill the top-k in corpus order.
    let mut q = vectors(2, queries, width, 15);
    for row in q.chunks_mut(width).step_by(4) {
        let first = row.iter().position(|&x| x != 0.0);
        for (c, x) in row.iter_mut().enumerate() {
            if Some(c) != first {
                *x = 0.0;
            }
        }
    }
    let q = tensor(q, queries, width);
    for (top_k, block) in [(10, 64), (50, 512), (230, 7), (1000, 100)] {
        let options = SearchOptions {
            top_k,
            corpus_block: block,
            ..SearchOptions::default()
        };
        let embed = |r: std::ops::Range<usize>| Ok(corpus.narrow(0, r.start, r.len())?);
        let dense = search(&q, docs, Similarity::Dot, options, embed).unwrap();
        let sparse = search(&q, docs, Scoring::Sparse, options, embed).unwrap();
        assert_eq!(sparse.len(), queries);
        for (i, (s, d)) in sparse.iter().zip(&dense).enumerate() {
            assert_eq!(s.len(), top_k.min(docs), "query {i}, top-{top_k}");
            for (a, b) in s.iter().zip(d) {
                assert_eq!(
                    (a.doc, a.score.to_bits()),
                    (b.doc, b.score.to_bits()),
                    "query {i}, top-{top_k}, blocks of {block}"
                );
            }
        }
    }
}

/// A judged set of `queries` queries over `docs` documents whose texts name their rows.
fn judged_set(queries: usize, docs: usize) -> BeirSet {
    let corpus = (0..docs)
        .map(|d| Document {
            id: format!("d{d}"),
            title: String::new(),
            text: d.to_string(),
        })
        .collect();
    let qs = (0..queries)
        .map(|i| Query {
            id: format!("q{i}"),
            text: i.to_string(),
        })
        .collect();
    let mut qrels = BTreeMap::new();
    for i in 0..queries {
        let judged: BTreeMap<String, i64> = [(format!("d{}", (i * 7) % docs), 1)]
            .into_iter()
            .chain((i % 3 == 0).then(|| (format!("d{}", (i * 13 + 1) % docs), 2)))
            .collect();
        qrels.insert(format!("q{i}"), judged);
    }
    BeirSet {
        corpus,
        queries: qs,
        qrels,
    }
}

#[test]
fn a_corpus_evaluation_through_the_index_equals_the_dense_one_and_counts_active_dims() {
    let (width, docs, queries) = (200, 150, 30);
    let set = judged_set(queries, docs);
    let q = vectors(3, queries, width, 9);
    let d = vectors(4, docs, width, 10);
    let rows = |all: &[f32], texts: &[&str]| {
        let picked: Vec<f32> = texts
            .iter()
            .flat_map(|t| {
                let r: usize = t.trim().parse().unwrap();
                all[r * width..(r + 1) * width].to_vec()
            })
            .collect();
        Ok(tensor(picked, texts.len(), width))
    };
    let options = CorpusEvalOptions::default();
    let dense = evaluate_corpus(
        &set,
        Similarity::Dot,
        &options,
        |t| rows(&q, t),
        |t| rows(&d, t),
    )
    .unwrap();
    let sparse = evaluate_corpus(
        &set,
        Scoring::Sparse,
        &options,
        |t| rows(&q, t),
        |t| rows(&d, t),
    )
    .unwrap();
    assert_eq!(sparse.run, dense.run);
    assert_eq!(sparse.metrics, dense.metrics);
    assert!(dense.sparsity.is_none());

    // The active dimensions and FLOPS, counted here directly.
    let s = sparse
        .sparsity
        .expect("a sparse evaluation reports its sparsity");
    let active = |v: &[f32]| v.iter().filter(|&&x| x != 0.0).count() as f64;
    let (q_dims, d_dims) = (active(&q) / queries as f64, active(&d) / docs as f64);
    assert!((s.query_active_dims - q_dims).abs() < 1e-12);
    assert!((s.corpus_active_dims - d_dims).abs() < 1e-12);
    assert!((s.query_sparsity_ratio - (1.0 - q_dims / width as f64)).abs() < 1e-12);
    let share = |v: &[f32], n: usize, c: usize| {
        (0..n).filter(|r| v[r * width + c] != 0.0).count() as f64 / n as f64
    };
    let flops: f64 = (0..width)
        .map(|c| share(&q, queries, c) * share(&d, docs, c))
        .sum();
    assert!(
        (s.avg_flops - flops).abs() < 1e-9,
        "{} vs {flops}",
        s.avg_flops
    );
}

#[test]
fn rows_of_another_width_or_rank_are_refused() {
    let q = tensor(vectors(5, 4, 20, 3), 4, 20);
    let corpus = tensor(vectors(6, 10, 30, 3), 10, 30);
    let err = search(&q, 10, Scoring::Sparse, SearchOptions::default(), |r| {
        Ok(corpus.narrow(0, r.start, r.len())?)
    })
    .unwrap_err();
    assert!(err.to_string().contains("as wide as the query"), "{err}");
    let cube = Tensor::zeros((2, 3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let err = SparseRows::from_dense(&cube).unwrap_err();
    assert!(err.to_string().contains("[texts, vocabulary]"), "{err}");
}

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sparse/distilbert")
}

/// Writes a small BEIR folder of verses: `queries` judged queries over `docs` documents.
fn beir_folder(dir: &std::path::Path, queries: usize, docs: usize) -> BeirSet {
    let pairs: Vec<serde_json::Value> = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/quickstart/train.jsonl"),
    )
    .unwrap()
    .lines()
    .take(docs)
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    std::fs::create_dir_all(dir.join("qrels")).unwrap();
    let corpus: String = pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "{}\n",
                serde_json::json!({"_id": format!("d{i}"), "title": "", "text": p["positive"]})
            )
        })
        .collect();
    std::fs::write(dir.join("corpus.jsonl"), corpus).unwrap();
    let qs: String = pairs
        .iter()
        .take(queries)
        .enumerate()
        .map(|(i, p)| {
            format!(
                "{}\n",
                serde_json::json!({"_id": format!("q{i}"), "text": p["query"]})
            )
        })
        .collect();
    std::fs::write(dir.join("queries.jsonl"), qs).unwrap();
    let qrels: String = std::iter::once("query-id\tcorpus-id\tscore\n".to_string())
        .chain((0..queries).map(|i| format!("q{i}\td{i}\t1\n")))
        .collect();
    std::fs::write(dir.join("qrels/test.tsv"), qrels).unwrap();
    BeirSet::load(dir, "test").unwrap()
}

#[test]
fn eval_beir_on_a_sparse_model_ranks_through_the_index_and_reports_active_dims() {
    let tmp = tempfile::tempdir().unwrap();
    let beir = tmp.path().join("beir");
    let set = beir_folder(&beir, 24, 90);
    let summary = tmp.path().join("summary.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args(["eval", "--model", fixture().to_str().unwrap(), "--beir"])
        .arg(&beir)
        .args(["--split", "test", "--top-k", "20", "--output"])
        .arg(&summary)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("active dimensions: queries"), "{stderr}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(summary["similarity"], "dot");

    // The same model through the library, ranked by the dense dot product.
    let model =
        gradcache::hub::EmbeddingModel::load(fixture().to_str().unwrap(), &Default::default())
            .unwrap();
    assert!(model.is_sparse());
    let options = CorpusEvalOptions {
        search: SearchOptions {
            top_k: 20,
            ..SearchOptions::default()
        },
        ..CorpusEvalOptions::default()
    };
    let dense = evaluate_corpus(
        &set,
        Similarity::Dot,
        &options,
        |t| model.embed_queries(t, 32),
        |t| model.embed_passages(t, 32),
    )
    .unwrap();
    let got: gradcache::retrieval::CorpusMetrics =
        serde_json::from_value(summary["metrics"].clone()).unwrap();
    for (a, b) in [
        (got.ndcg_at_10, dense.metrics.ndcg_at_10),
        (got.mrr_at_10, dense.metrics.mrr_at_10),
        (got.recall_at_10, dense.metrics.recall_at_10),
        (got.map_at_100, dense.metrics.map_at_100),
    ] {
        assert!(
            (a - b).abs() < 1e-9,
            "{got:?} against the dense {:?}",
            dense.metrics
        );
    }
    // The active dimensions, counted from the model's vectors.
    let texts: Vec<&str> = set.queries.iter().map(|q| q.text.as_str()).collect();
    let q = model.embed_queries(&texts, 32).unwrap();
    let active = q
        .ne(0f32)
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .sum_all()
        .unwrap();
    let want = active.to_scalar::<f64>().unwrap() / texts.len() as f64;
    let reported = summary["sparsity"]["query_active_dims"].as_f64().unwrap();
    assert!((reported - want).abs() < 1e-9, "{reported} vs {want}");
    assert!(summary["sparsity"]["corpus_active_dims"].as_f64().unwrap() > 0.0);
    assert!(summary["sparsity"]["avg_flops"].as_f64().unwrap() > 0.0);
}

#[test]
fn mine_on_a_sparse_model_picks_the_highest_dot_products() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("pairs.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/quickstart/train.jsonl"),
    )
    .unwrap()
    .lines()
    .take(40)
    .map(String::from)
    .collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let mined = tmp.path().join("mined.jsonl");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
        .args(["mine", "--model", fixture().to_str().unwrap(), "--data"])
        .arg(&data)
        .args(["--num-negatives", "2", "--output-scores", "--output"])
        .arg(&mined)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("panicked"),
        "{stderr}"
    );

    // Each row's negatives are the best-scoring passages by the dense dot product, other
    // than the positive, and the scores are those dot products.
    let model =
        gradcache::hub::EmbeddingModel::load(fixture().to_str().unwrap(), &Default::default())
            .unwrap();
    let pairs: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let passages: Vec<&str> = pairs
        .iter()
        .map(|p| p["positive"].as_str().unwrap())
        .collect();
    let docs = model.embed_passages(&passages, 16).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&mined)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!rows.is_empty());
    for row in &rows {
        let q = model
            .embed_queries(&[row["query"].as_str().unwrap()], 1)
            .unwrap();
        let scores = q.matmul(&docs.t().unwrap()).unwrap().flatten_all().unwrap();
        let scores = scores.to_vec1::<f32>().unwrap();
        let mut order: Vec<usize> = (0..passages.len())
            .filter(|&i| passages[i] != row["positive"].as_str().unwrap())
            .collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let negatives = row["negatives"].as_array().unwrap();
        assert_eq!(negatives.len(), 2);
        for (k, n) in negatives.iter().enumerate() {
            let got = row["scores"][k + 1].as_f64().unwrap();
            let want = scores[order[k]] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{got} vs {want}"
            );
            // The k-th best (a tie in score may name either passage).
            let i = passages
                .iter()
                .position(|p| *p == n.as_str().unwrap())
                .unwrap();
            assert!((scores[i] - scores[order[k]]).abs() <= 1e-5 * scores[i].abs().max(1.0));
        }
    }
}
