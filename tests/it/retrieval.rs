//! The retrieval workflow's pieces: the measures against pytrec_eval (trec_eval's code) on
//! a fixture run, exact blocked top-k against a full sort, BEIR files plain and
//! compressed, their errors, and hard-negative mining's filters.

use std::io::Write;
use std::path::Path;

use candle_core::{Device, Tensor};
use gradcache::retrieval::beir::{read_corpus, read_qrels, BeirSet};
use gradcache::retrieval::metrics::{corpus_metrics, parse_trec_run};
use gradcache::retrieval::{mine, search, MineOptions, MiningSet, Sampling, SearchOptions};
use gradcache::{Error, Similarity};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/trec");

/// scripts/trec_eval_reference.py wrote a graded qrels file (one query with no relevant
/// document, one judged query missing from the run) and a run with many tied scores, and
/// what pytrec_eval reports on them. Ties are where implementations differ: trec_eval
/// orders them by document id, decreasing.
#[test]
fn measures_equal_pytrec_eval_on_a_run_with_ties() {
    let qrels = read_qrels(&Path::new(FIXTURE).join("qrels.tsv")).unwrap();
    let text = std::fs::read_to_string(Path::new(FIXTURE).join("run.trec")).unwrap();
    let run = parse_trec_run(&text).unwrap();
    let m = corpus_metrics(&run, &qrels);
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(FIXTURE).join("expected.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(m.queries as u64, expected["queries"].as_u64().unwrap());
    let ours = serde_json::to_value(m).unwrap();
    for key in [
        "ndcg_at_10",
        "mrr_at_10",
        "recall_at_1",
        "recall_at_10",
        "recall_at_100",
        "map_at_100",
    ] {
        let (a, b) = (ours[key].as_f64().unwrap(), expected[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-12,
            "{key}: gradcache {a} vs pytrec_eval {b}"
        );
        assert!(
            b > 0.0,
            "{key} is 0 in the reference: the fixture tests nothing"
        );
    }
}

#[test]
fn a_run_ordered_the_other_way_on_ties_scores_differently() {
    // The same run with tied documents in increasing id order would give other measures:
    // the tie order is part of the definition, and the fixture exercises it.
    let qrels = read_qrels(&Path::new(FIXTURE).join("qrels.tsv")).unwrap();
    let text = std::fs::read_to_string(Path::new(FIXTURE).join("run.trec")).unwrap();
    let mut run = parse_trec_run(&text).unwrap();
    let reference = corpus_metrics(&run, &qrels);
    for ranking in run.values_mut() {
        ranking.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    }
    assert_ne!(corpus_metrics(&run, &qrels), reference);
}

fn random_matrix(rows: usize, cols: usize, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // A coarse grid, so that many scores tie.
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-2i32..=2) as f32 / 2.0)
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

#[test]
fn blocked_top_k_equals_a_full_sort_whatever_the_blocks() {
    let (q, c) = (random_matrix(37, 6, 1), random_matrix(503, 6, 2));
    let full = q.matmul(&c.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
    for similarity in [Similarity::Dot] {
        for (corpus_block, query_block, top_k) in [
            (503, 37, 10),
            (64, 5, 10),
            (7, 1, 25),
            (1000, 8, 600),
            (13, 37, 1),
        ] {
            let options = SearchOptions {
                top_k,
                corpus_block,
                query_block,
            };
            let mut calls = Vec::new();
            let hits = search(&q, 503, similarity, options, |range| {
                calls.push(range.clone());
                Ok(c.narrow(0, range.start, range.len())?)
            })
            .unwrap();
            assert_eq!(calls.len(), 503usize.div_ceil(corpus_block));
            for (row, got) in full.iter().zip(&hits) {
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                let want: Vec<usize> = order.into_iter().take(top_k.min(503)).collect();
                let got_docs: Vec<usize> = got.iter().map(|h| h.doc).collect();
                assert_eq!(
                    got_docs, want,
                    "blocks {corpus_block}/{query_block}, k {top_k}"
                );
                for h in got {
                    assert_eq!(h.score, row[h.doc]);
                }
            }
        }
    }
}

#[test]
fn cosine_search_ranks_by_cosine() {
    let q = Tensor::new(&[[1f32, 0.0]], &Device::Cpu).unwrap();
    // Long vector at an angle vs short vector along the query: cosine prefers the short.
    let c = Tensor::new(&[[10f32, 10.0], [0.5, 0.0], [-1.0, 0.0]], &Device::Cpu).unwrap();
    let options = SearchOptions {
        top_k: 3,
        ..SearchOptions::default()
    };
    let cos = search(&q, 3, Similarity::Cosine, options, |_| Ok(c.clone())).unwrap();
    assert_eq!(cos[0].iter().map(|h| h.doc).collect::<Vec<_>>(), [1, 0, 2]);
    assert!((cos[0][0].score - 1.0).abs() < 1e-6);
    let dot = search(&q, 3, Similarity::Dot, options, |_| Ok(c.clone())).unwrap();
    assert_eq!(dot[0].iter().map(|h| h.doc).collect::<Vec<_>>(), [0, 1, 2]);
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

const CORPUS: &str = "{\"_id\": \"d1\", \"title\": \"Genesis\", \"text\": \"In the beginning.\"}\n\
{\"_id\": \"d2\", \"title\": \"\", \"text\": \"And the earth was void.\"}\n\
\n\
{\"_id\": 3, \"text\": \"Let there be light.\"}\n";
const QUERIES: &str = "{\"_id\": \"q1\", \"text\": \"what was first\"}\n\
{\"_id\": \"q2\", \"text\": \"unjudged query\"}\n\
{\"_id\": \"q3\", \"text\": \"light\"}\n";
const QRELS: &str = "query-id\tcorpus-id\tscore\nq1\td1\t1\nq3\t3\t2\nq3\td2\t0\n";

fn beir_dir(dir: &Path, compress: fn(&[u8]) -> Vec<u8>, suffix: &str) {
    write(
        &dir.join(format!("corpus.jsonl{suffix}")),
        &compress(CORPUS.as_bytes()),
    );
    write(
        &dir.join(format!("queries.jsonl{suffix}")),
        &compress(QUERIES.as_bytes()),
    );
    write(
        &dir.join(format!("qrels/test.tsv{suffix}")),
        &compress(QRELS.as_bytes()),
    );
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

#[test]
fn beir_folders_read_the_same_plain_gzip_and_zstd() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = Vec::new();
    for (name, compress, suffix) in [
        ("plain", (|b: &[u8]| b.to_vec()) as fn(&[u8]) -> Vec<u8>, ""),
        ("gzip", gzip, ".gz"),
        ("zstd", zstd, ".zst"),
    ] {
        let dir = tmp.path().join(name);
        beir_dir(&dir, compress, suffix);
        sets.push(BeirSet::load(&dir, "test").unwrap());
    }
    let set = &sets[0];
    assert_eq!(set.corpus.len(), 3);
    assert_eq!(set.corpus[2].id, "3", "numeric ids are read as strings");
    assert_eq!(set.corpus[0].joined(" "), "Genesis In the beginning.");
    assert_eq!(set.corpus[1].joined(" "), "And the earth was void.");
    let ids: Vec<&str> = set.queries.iter().map(|q| q.id.as_str()).collect();
    assert_eq!(ids, ["q1", "q3"], "only judged queries are evaluated");
    assert_eq!(set.qrels["q3"]["d2"], 0);
    for other in &sets[1..] {
        assert_eq!(other.corpus, set.corpus);
        assert_eq!(other.queries, set.queries);
        assert_eq!(other.qrels, set.qrels);
    }
}

fn data_error(e: Error) -> (String, usize, String) {
    match e {
        Error::Data { path, line, reason } => (path.display().to_string(), line, reason),
        other => panic!("expected a data error, got {other}"),
    }
}

#[test]
fn bad_beir_files_are_refused_naming_file_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("corpus.jsonl");
    write(
        &path,
        b"{\"_id\": \"a\", \"text\": \"x\"}\n{\"_id\": \"b\", \"text\": 5}\n",
    );
    let (file, line, reason) = data_error(read_corpus(&path).unwrap_err());
    assert!(file.ends_with("corpus.jsonl"));
    assert_eq!(line, 2);
    assert!(reason.contains("`text`"), "{reason}");

    write(
        &path,
        &gzip(b"{\"_id\": \"a\", \"text\": \"x\"}\n{\"_id\": \"a\", \"text\": \"y\"}\n"),
    );
    let (_, line, reason) = data_error(read_corpus(&path).unwrap_err());
    assert_eq!(line, 2);
    assert!(reason.contains("already appears on line 1"), "{reason}");

    write(&path, b"{\"_id\": \"a\", \"text\": \"x\"}\nnot json\n");
    let (_, line, reason) = data_error(read_corpus(&path).unwrap_err());
    assert_eq!(line, 2);
    assert!(reason.contains("not valid JSON"), "{reason}");

    // A truncated gzip stream: the error names the file.
    let whole = gzip(CORPUS.as_bytes());
    write(&path, &whole[..whole.len() / 2]);
    let (file, _, _) = data_error(read_corpus(&path).unwrap_err());
    assert!(file.ends_with("corpus.jsonl"));

    let qrels = tmp.path().join("q.tsv");
    write(&qrels, b"query-id\tcorpus-id\tscore\nq1\td1\tyes\n");
    let (_, line, reason) = data_error(read_qrels(&qrels).unwrap_err());
    assert_eq!(line, 2);
    assert!(reason.contains("`yes`"), "{reason}");

    // Judgements about a document the corpus does not hold.
    let dir = tmp.path().join("set");
    beir_dir(&dir, |b| b.to_vec(), "");
    write(&dir.join("qrels/dev.tsv"), b"q1\tnope\t1\n");
    let (_, _, reason) = data_error(BeirSet::load(&dir, "dev").unwrap_err());
    assert!(reason.contains("`nope`"), "{reason}");
    // A missing split names the file.
    match BeirSet::load(&dir, "train").unwrap_err() {
        Error::MissingFile { path, .. } => assert!(path.ends_with("qrels/train.tsv")),
        other => panic!("expected a missing file, got {other}"),
    }
}

/// One query along x; corpus documents at known cosines with it.
fn mining_setup() -> (Tensor, Tensor) {
    let q = Tensor::new(&[[1f32, 0.0]], &Device::Cpu).unwrap();
    let angle = |cos: f32| [cos, (1.0 - cos * cos).sqrt()];
    // doc 0: the positive (0.9); then candidates at 0.95, 0.89, 0.85, 0.7, 0.5, 0.3, 0.1
    let docs: Vec<f32> = [0.9, 0.95, 0.89, 0.85, 0.7, 0.5, 0.3, 0.1]
        .into_iter()
        .flat_map(angle)
        .collect();
    (q, Tensor::from_vec(docs, (8, 2), &Device::Cpu).unwrap())
}

fn mined(options: &MineOptions) -> Option<Vec<usize>> {
    let (q, c) = mining_setup();
    let m = mine(&q, &[vec![0]], 8, Similarity::Cosine, options, 3, |range| {
        Ok(c.narrow(0, range.start, range.len())?)
    })
    .unwrap();
    assert!((m.positive_scores[0][0] - 0.9).abs() < 1e-6);
    m.negatives[0].clone()
}

#[test]
fn mined_rows_carry_the_scores_of_each_positive_and_the_negatives() {
    // Two positives (0.9 and 0.85): a row each, the same negatives (0.95, 0.89), each
    // row's scores its own positive's first (sentence-transformers' `output_scores`).
    let (q, c) = mining_setup();
    let options = MineOptions {
        num_negatives: 2,
        ..MineOptions::default()
    };
    let m = mine(
        &q,
        &[vec![0, 3]],
        8,
        Similarity::Cosine,
        &options,
        3,
        |range| Ok(c.narrow(0, range.start, range.len())?),
    )
    .unwrap();
    let set = MiningSet {
        queries: vec!["q".into()],
        positives: vec![vec![0, 3]],
        corpus: (0..8).map(|i| format!("d{i}")).collect(),
    };
    let rows = set.rows(&m, true);
    let want = [[0.9f32, 0.95, 0.89], [0.85, 0.95, 0.89]];
    assert_eq!(rows.len(), 2);
    for (row, want) in rows.iter().zip(want) {
        assert_eq!(row.negatives, vec!["d1", "d2"]);
        let got = row.scores.as_ref().unwrap();
        assert_eq!(got.len(), 3, "{}", row.positive);
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() < 1e-6,
                "{}: {got:?} vs {want:?}",
                row.positive
            );
        }
    }
    // Without scores asked for, a row has none, and its JSON no `scores` field.
    let plain = set.rows(&m, false);
    assert!(plain[0].scores.is_none());
    assert!(!serde_json::to_string(&plain[0]).unwrap().contains("scores"));
}

#[test]
fn mining_applies_sentence_transformers_filters() {
    let base = MineOptions {
        num_negatives: 2,
        ..MineOptions::default()
    };
    assert_eq!(
        mined(&base),
        Some(vec![1, 2]),
        "the positive is never a negative"
    );
    let range = MineOptions {
        range_min: 2,
        ..base.clone()
    };
    assert_eq!(mined(&range), Some(vec![3, 4]));
    let max = MineOptions {
        max_score: Some(0.86),
        ..base.clone()
    };
    assert_eq!(mined(&max), Some(vec![3, 4]));
    let absolute = MineOptions {
        absolute_margin: Some(0.1),
        ..base.clone()
    };
    // positive 0.9: candidates must score <= 0.8
    assert_eq!(mined(&absolute), Some(vec![4, 5]));
    let relative = MineOptions {
        relative_margin: Some(0.05),
        ..base.clone()
    };
    // <= 0.9 * 0.95 = 0.855
    assert_eq!(mined(&relative), Some(vec![3, 4]));
    let min = MineOptions {
        min_score: Some(0.6),
        range_min: 3,
        ..base.clone()
    };
    assert_eq!(mined(&min), None, "fewer than num_negatives left: dropped");
    let narrow = MineOptions {
        range_max: 3,
        num_negatives: 3,
        ..base.clone()
    };
    assert_eq!(mined(&narrow), Some(vec![1, 2, 3]));
    let random = MineOptions {
        sampling: Sampling::Random,
        num_negatives: 3,
        seed: 9,
        ..base.clone()
    };
    let a = mined(&random).unwrap();
    assert_eq!(a, mined(&random).unwrap(), "seeded");
    assert_eq!(a.len(), 3);
    assert!(!a.contains(&0));
    let draws: std::collections::BTreeSet<Vec<usize>> = (0..20)
        .map(|seed| {
            mined(&MineOptions {
                seed,
                ..random.clone()
            })
            .unwrap()
        })
        .collect();
    assert!(
        draws.len() > 1,
        "random sampling draws different negatives per seed"
    );
}

#[test]
fn bad_mining_options_are_refused() {
    for (options, field) in [
        (
            MineOptions {
                num_negatives: 0,
                ..MineOptions::default()
            },
            "num_negatives",
        ),
        (
            MineOptions {
                range_min: 10,
                range_max: 10,
                ..MineOptions::default()
            },
            "range_max",
        ),
        (
            MineOptions {
                relative_margin: Some(1.5),
                ..MineOptions::default()
            },
            "relative_margin",
        ),
        (
            MineOptions {
                max_score: Some(f32::NAN),
                ..MineOptions::default()
            },
            "max_score",
        ),
    ] {
        match options.validate().unwrap_err() {
            Error::InvalidConfig { field: f, .. } => assert_eq!(f, field),
            other => panic!("expected {field} to be refused, got {other}"),
        }
    }
}

/// `evaluate_corpus` over a set whose query `d1` is also a document: by default (as
/// pytrec_eval and sentence-transformers) the document counts; with BEIR's
/// `ignore_identical_ids` it is left out of the run and the top-k is still full.
#[test]
fn corpus_evaluation_can_ignore_identical_ids() {
    use gradcache::retrieval::{evaluate_corpus, CorpusEvalOptions, Document, Query};
    let doc = |id: &str| Document {
        id: id.into(),
        title: String::new(),
        text: id.into(),
    };
    let set = gradcache::retrieval::BeirSet {
        corpus: vec![doc("d1"), doc("d2"), doc("d3")],
        queries: vec![Query {
            id: "d1".into(),
            text: "d1".into(),
        }],
        qrels: [(
            "d1".to_string(),
            [("d2".to_string(), 1i64)].into_iter().collect(),
        )]
        .into_iter()
        .collect(),
    };
    // The query embeds like d1, then d2, then d3.
    let embed = |texts: &[&str]| -> gradcache::Result<Tensor> {
        let rows: Vec<f32> = texts
            .iter()
            .flat_map(|t| match *t {
                "d1" => [1.0f32, 0.0],
                "d2" => [0.8, 0.6],
                _ => [0.0, 1.0],
            })
            .collect();
        Ok(Tensor::from_vec(rows, (texts.len(), 2), &Device::Cpu)?)
    };
    let mut options = CorpusEvalOptions {
        search: SearchOptions {
            top_k: 2,
            ..SearchOptions::default()
        },
        ..CorpusEvalOptions::default()
    };
    let counted = evaluate_corpus(&set, Similarity::Cosine, &options, embed, embed).unwrap();
    let ids: Vec<&str> = counted.run["d1"].iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(ids, ["d1", "d2"]);
    assert_eq!(counted.metrics.recall_at_1, 0.0);
    options.ignore_identical_ids = true;
    let ignored = evaluate_corpus(&set, Similarity::Cosine, &options, embed, embed).unwrap();
    let ids: Vec<&str> = ignored.run["d1"].iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(ids, ["d2", "d3"]);
    assert_eq!(ignored.metrics.recall_at_1, 1.0);
}

/// The remaining refusals of the BEIR reader, the search and the miner, each fed its bad
/// input.
#[test]
fn more_bad_input_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    // A file that starts like zstd but is not.
    let path = tmp.path().join("corpus.jsonl.zst");
    write(&path, &[0x28, 0xb5, 0x2f, 0xfd, 1, 2, 3, 4, 5, 6, 7, 8]);
    let (file, _, reason) = data_error(read_corpus(&path).unwrap_err());
    assert!(file.ends_with("corpus.jsonl.zst"), "{file}");
    assert!(
        reason.contains("zstd") || reason.contains("cannot read"),
        "{reason}"
    );
    // An empty corpus, an empty id.
    let path = tmp.path().join("c.jsonl");
    write(&path, b"\n\n");
    assert!(data_error(read_corpus(&path).unwrap_err())
        .2
        .contains("no documents"));
    write(&path, b"{\"_id\": \"\", \"text\": \"x\"}\n");
    assert!(data_error(read_corpus(&path).unwrap_err())
        .2
        .contains("`_id` is empty"));
    // Qrels of the wrong width, and none at all.
    let qrels = tmp.path().join("q.tsv");
    write(&qrels, b"q1\td1\n");
    let (_, line, reason) = data_error(read_qrels(&qrels).unwrap_err());
    assert_eq!(line, 1);
    assert!(reason.contains("3 columns"), "{reason}");
    write(&qrels, b"query-id\tcorpus-id\tscore\n");
    assert!(data_error(read_qrels(&qrels).unwrap_err())
        .2
        .contains("no judgements"));
    // A judged query that queries.jsonl does not hold.
    let dir = tmp.path().join("set");
    beir_dir(&dir, |b| b.to_vec(), "");
    write(&dir.join("qrels/dev.tsv"), b"q9\td1\t1\n");
    let (_, _, reason) = data_error(BeirSet::load(&dir, "dev").unwrap_err());
    assert!(
        reason.contains("`q9`") && reason.contains("queries.jsonl"),
        "{reason}"
    );

    // Search: no room, and a block of the wrong shape.
    let q = random_matrix(2, 3, 1);
    let c = random_matrix(5, 3, 2);
    let zero = SearchOptions {
        top_k: 0,
        ..SearchOptions::default()
    };
    assert!(matches!(
        search(&q, 5, Similarity::Dot, zero, |_| Ok(c.clone())).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    let wide = random_matrix(5, 4, 3);
    assert!(matches!(
        search(&q, 5, Similarity::Dot, SearchOptions::default(), |_| Ok(
            wide.clone()
        ))
        .unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    // Mining: a query without a positive, a positive beyond the corpus.
    let options = MineOptions {
        num_negatives: 1,
        ..MineOptions::default()
    };
    for positives in [vec![vec![0], vec![]], vec![vec![0], vec![7]]] {
        let err = mine(&q, &positives, 5, Similarity::Dot, &options, 2, |r| {
            Ok(c.narrow(0, r.start, r.len())?)
        })
        .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{positives:?}: {err}"
        );
    }
}
