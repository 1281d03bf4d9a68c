//! Training pairs from every published layout: our JSONL, Tevatron's, TSV and CSV with
//! named columns, BEIR folders; plain, gzip and zstd alike; bad rows named by file, line
//! and field.

use std::io::Write;
use std::path::Path;

use gradcache::train::data::{Fields, Pair};
use gradcache::train::formats::{read_pairs, Layout};
use gradcache::Error;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

fn pair(q: &str, p: &str, n: &[&str]) -> Pair {
    Pair {
        query: q.into(),
        positive: p.into(),
        negatives: n.iter().map(|s| s.to_string()).collect(),
        scores: Vec::new(),
        prompt: None,
    }
}

fn read(path: &Path) -> Vec<Pair> {
    read_pairs(path, &Fields::default(), "train", " ").unwrap()
}

fn data_error(path: &Path, fields: &Fields) -> (usize, String) {
    match read_pairs(path, fields, "train", " ").unwrap_err() {
        Error::Data { line, reason, .. } => (line, reason),
        other => panic!("expected a data error, got {other}"),
    }
}

#[test]
fn every_layout_reads_the_same_pairs_plain_or_compressed() {
    let tmp = tempfile::tempdir().unwrap();
    let want = vec![
        pair("who made light", "God made light", &["the sea", "the land"]),
        pair("a, \"quoted\" query", "its passage", &[]),
    ];
    let jsonl = "{\"query\": \"who made light\", \"positive\": \"God made light\", \"negatives\": [\"the sea\", \"the land\"]}\n\
                 {\"query\": \"a, \\\"quoted\\\" query\", \"positive\": \"its passage\"}\n";
    let tevatron = "{\"query_id\": \"1\", \"query\": \"who made light\", \"positive_passages\": [{\"docid\": \"7\", \"title\": \"God\", \"text\": \"made light\"}, {\"docid\": \"8\", \"text\": \"ignored\"}], \"negative_passages\": [{\"docid\": \"9\", \"title\": \"\", \"text\": \"the sea\"}, {\"docid\": \"10\", \"text\": \"the land\"}]}\n\
                    {\"query_id\": \"2\", \"query\": \"a, \\\"quoted\\\" query\", \"positive_passages\": [{\"docid\": \"3\", \"title\": null, \"text\": \"its passage\"}], \"negative_passages\": []}\n";
    let tsv = "query\tpositive\tnegative_1\tnegative_2\nwho made light\tGod made light\tthe sea\tthe land\na, \"quoted\" query\tits passage\t\t\n";
    let csv = "positive,query,negative_2,negative_1\nGod made light,who made light,the land,the sea\nits passage,\"a, \"\"quoted\"\" query\",,\n";
    for (name, text) in [
        ("pairs.jsonl", jsonl),
        ("tevatron.jsonl", tevatron),
        ("pairs.tsv", tsv),
        ("pairs.csv", csv),
    ] {
        for (suffix, bytes) in [
            ("", text.as_bytes().to_vec()),
            (".gz", gzip(text.as_bytes())),
            (".zst", zstd(text.as_bytes())),
        ] {
            let path = tmp.path().join(format!("{name}{suffix}"));
            std::fs::write(&path, bytes).unwrap();
            assert_eq!(read(&path), want, "{name}{suffix}");
        }
    }
    assert_eq!(Layout::of(&tmp.path().join("x.TSV.gz")), Layout::Tsv);
    assert_eq!(Layout::of(tmp.path()), Layout::Beir);
}

#[test]
fn beir_folders_train_on_every_relevant_document_of_a_split() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("corpus.jsonl"),
        "{\"_id\": \"d1\", \"title\": \"Genesis\", \"text\": \"In the beginning.\"}\n\
         {\"_id\": \"d2\", \"text\": \"Void.\"}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("queries.jsonl"),
        "{\"_id\": \"q1\", \"text\": \"first\"}\n{\"_id\": \"q2\", \"text\": \"second\"}\n",
    )
    .unwrap();
    std::fs::create_dir(dir.join("qrels")).unwrap();
    std::fs::write(
        dir.join("qrels/train.tsv"),
        "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t2\nq2\td1\t0\n",
    )
    .unwrap();
    assert_eq!(
        read(dir),
        vec![
            pair("first", "Genesis In the beginning.", &[]),
            pair("first", "Void.", &[]),
        ],
        "grade 0 is not a positive; every relevant document is"
    );
}

#[test]
fn bad_rows_name_the_line_and_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let fields = Fields::default();
    let path = tmp.path().join("t.tsv");
    std::fs::write(&path, "query\tanswer\nq\tp\n").unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 1);
    assert!(
        reason.contains("no column `positive`") && reason.contains("answer"),
        "{reason}"
    );

    std::fs::write(&path, "query\tpositive\nq\tp\n\tp2\n").unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 3);
    assert!(reason.contains("column `query` is empty"), "{reason}");

    let path = tmp.path().join("t.csv");
    std::fs::write(&path, "query,positive\nq,p\nq2,p2,extra\n").unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 3);
    assert!(reason.contains("malformed row"), "{reason}");

    // Named columns of one's own.
    let own = Fields {
        query: "anchor".into(),
        positive: "answer".into(),
        negatives: "hard".into(),
        ..Fields::default()
    };
    std::fs::write(&path, "anchor,answer,hard\nq,p,n\n").unwrap();
    assert_eq!(
        read_pairs(&path, &own, "train", " ").unwrap(),
        vec![pair("q", "p", &["n"])]
    );

    let path = tmp.path().join("t.jsonl.gz");
    std::fs::write(
        &path,
        gzip(b"{\"query\": \"q\", \"positive_passages\": [{\"docid\": \"1\", \"text\": \"p\"}]}\n{\"query\": \"q\", \"positive_passages\": [{\"docid\": \"1\"}]}\n"),
    )
    .unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 2);
    assert!(
        reason.contains("`positive_passages[0]` has no string `text`"),
        "{reason}"
    );

    std::fs::write(
        &path,
        gzip(b"{\"query\": \"q\", \"positive_passages\": []}\n"),
    )
    .unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 1);
    assert!(reason.contains("`positive_passages` is empty"), "{reason}");

    let path = tmp.path().join("empty.csv");
    std::fs::write(&path, "query,positive\n").unwrap();
    let (line, reason) = data_error(&path, &fields);
    assert_eq!(line, 0);
    assert!(reason.contains("no pairs"), "{reason}");
}

const PARQUET: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/parquet");

/// Parquet as the Hub stores datasets (scripts/make_parquet_fixtures.py wrote them with
/// pyarrow): our layout (snappy, two row groups), Tevatron's (zstd, lists of passage
/// records), sentence-transformers' columns (gzip).
#[test]
fn parquet_files_read_in_every_layout_and_codec() {
    let dir = Path::new(PARQUET);
    assert_eq!(Layout::of(&dir.join("pairs.parquet")), Layout::Parquet);
    assert_eq!(
        read(&dir.join("pairs.parquet")),
        vec![
            pair("who made light", "God made light", &["the sea", "the land"]),
            pair("a, \"quoted\" query", "its passage", &[]),
            pair("third", "third passage", &[]),
        ]
    );
    let want = vec![
        pair("who made light", "God made light", &["the sea", "the land"]),
        pair("a, \"quoted\" query", "its passage", &[]),
    ];
    assert_eq!(read(&dir.join("tevatron.parquet")), want);
    let st = Fields {
        query: "anchor".into(),
        ..Fields::default()
    };
    assert_eq!(
        read_pairs(&dir.join("st-columns.parquet"), &st, "train", " ").unwrap(),
        want
    );
    // The bad row is named with its row group.
    let (line, reason) = data_error(&dir.join("bad.parquet"), &Fields::default());
    assert_eq!(line, 3);
    assert!(
        reason.contains("row 3 (row group 1)") && reason.contains("`query` is empty"),
        "{reason}"
    );
    // A file that is not Parquet.
    let tmp = tempfile::tempdir().unwrap();
    let fake = tmp.path().join("x.parquet");
    std::fs::write(&fake, b"not parquet at all").unwrap();
    let (_, reason) = data_error(&fake, &Fields::default());
    assert!(reason.contains("not a readable Parquet file"), "{reason}");
    // A footer whose column chunk lies outside the file (one bit flipped, as
    // tests/it/fuzz_readers.rs found): the Parquet reader would panic on it.
    let mut bytes = std::fs::read(dir.join("tevatron.parquet")).unwrap();
    let at = (6674773783959323918u64 % bytes.len() as u64) as usize;
    bytes[at] ^= 75;
    let damaged = tmp.path().join("damaged.parquet");
    std::fs::write(&damaged, bytes).unwrap();
    let (_, reason) = data_error(&damaged, &Fields::default());
    assert!(
        reason.contains("not a readable Parquet file (row group 0, column")
            && reason.contains("a chunk of -118 bytes at offset 625 in a file of 2907 bytes"),
        "{reason}"
    );
    // A page whose definition levels exceed the schema's (another flipped bit): the
    // Parquet reader panics inside; the panic becomes an error naming the file.
    let mut bytes = std::fs::read(dir.join("tevatron.parquet")).unwrap();
    let at = (12052021883832747829u64 % bytes.len() as u64) as usize;
    bytes[at] ^= 160;
    std::fs::write(&damaged, bytes).unwrap();
    let (_, reason) = data_error(&damaged, &Fields::default());
    assert!(
        reason.contains("not a readable Parquet file (damaged data: Cannot extract value"),
        "{reason}"
    );
}

#[test]
fn malformed_json_layouts_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.jsonl");
    for (line, want) in [
        ("[1, 2]", "expected a JSON object"),
        (
            "{\"query\": \"q\", \"positive_passages\": [{\"text\": \"p\"}], \"negative_passages\": 3}",
            "`negative_passages` must be a list of passages",
        ),
        (
            "{\"query\": \"q\", \"positive_passages\": [{\"text\": \"p\", \"title\": 5}]}",
            "`positive_passages[0]` has a `title` that is not a string",
        ),
        ("{\"query\": \"q\", \"positive\": \"p\", \"negatives\": \"n\"}", "list of strings"),
        ("{\"query\": 4, \"positive\": \"p\"}", "`query` is not a string"),
    ] {
        std::fs::write(&path, format!("{line}\n")).unwrap();
        let (number, reason) = data_error(&path, &Fields::default());
        assert_eq!(number, 1, "{line}");
        assert!(reason.contains(want), "{line}: {reason}");
    }
}
