//! Training data: JSONL parsing with errors that name the file and line, the held-out
//! split, seeded shuffling, exact resume positions and hard-negative filling.

use std::fs;

use gradcache::train::data::{split, Fields, Loader, Pair, Position};
use gradcache::train::formats::read_jsonl;
use gradcache::Error;

fn pair(i: usize, negatives: usize) -> Pair {
    Pair {
        query: format!("q{i}"),
        positive: format!("p{i}"),
        negatives: (0..negatives).map(|j| format!("n{i}.{j}")).collect(),
        scores: Vec::new(),
        prompt: None,
    }
}

fn write(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.jsonl");
    fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn reads_pairs_with_optional_negatives_and_custom_fields() {
    let (_d, path) = write(concat!(
        "{\"query\": \"a\", \"positive\": \"b\"}\n",
        "\n",
        "{\"query\": \"c\", \"positive\": \"d\", \"negatives\": [\"e\", \"f\"], \"id\": 7}\n",
    ));
    let pairs = read_jsonl(&path, &Fields::default()).unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[1].negatives, vec!["e", "f"]);

    let (_d, path) = write("{\"anchor\": \"a\", \"pos\": \"b\", \"hard\": [\"c\"]}\n");
    let fields = Fields {
        query: "anchor".into(),
        positive: "pos".into(),
        negatives: "hard".into(),
        ..Fields::default()
    };
    let pairs = read_jsonl(&path, &fields).unwrap();
    assert_eq!(
        pairs[0],
        Pair {
            query: "a".into(),
            positive: "b".into(),
            negatives: vec!["c".into()],
            scores: Vec::new(),
            prompt: None,
        }
    );
}

#[test]
fn malformed_lines_are_named_by_file_and_number() {
    let good = "{\"query\": \"a\", \"positive\": \"b\"}\n";
    let cases = [
        ("{\"query\": \"a\", \"positive\": ", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ("{\"query\": \"a\"}", "missing field `positive`"),
        (
            "{\"query\": 3, \"positive\": \"b\"}",
            "field `query` is not a string",
        ),
        (
            "{\"query\": \" \", \"positive\": \"b\"}",
            "field `query` is empty",
        ),
        (
            "{\"query\": \"a\", \"positive\": \"b\", \"negatives\": \"c\"}",
            "must be a list of strings",
        ),
        (
            "{\"query\": \"a\", \"positive\": \"b\", \"negatives\": [1]}",
            "must be a list of strings",
        ),
    ];
    for (line, reason) in cases {
        let (_d, path) = write(&format!("{good}{good}{line}\n{good}"));
        let err = read_jsonl(&path, &Fields::default()).unwrap_err();
        assert!(matches!(err, Error::Data { line: 3, .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.starts_with(&format!("{}:3: ", path.display())), "{msg}");
        assert!(msg.contains(reason), "{msg} should say {reason}");
    }
    let (_d, path) = write("\n\n");
    assert!(read_jsonl(&path, &Fields::default())
        .unwrap_err()
        .to_string()
        .contains("no pairs"));
    let err = read_jsonl(&path.with_file_name("missing.jsonl"), &Fields::default()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingFile {
                what: "data file",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn held_out_split_is_seeded_and_disjoint() {
    let pairs: Vec<Pair> = (0..50).map(|i| pair(i, 0)).collect();
    let (train, eval) = split(pairs.clone(), 10, 3).unwrap();
    assert_eq!((train.len(), eval.len()), (40, 10));
    assert!(eval.iter().all(|p| !train.contains(p)));
    assert_eq!(
        split(pairs.clone(), 10, 3).unwrap().1,
        eval,
        "same seed, same split"
    );
    assert_ne!(split(pairs.clone(), 10, 4).unwrap().1, eval);
    assert!(split(pairs, 50, 3).is_err());
}

#[test]
fn batches_are_seeded_cover_each_epoch_and_resume_exactly() {
    let pairs: Vec<Pair> = (0..10).map(|i| pair(i, 1)).collect();
    let mut a = Loader::new(pairs.clone(), 3, 1, 9).unwrap();
    assert_eq!(a.batches_per_epoch(), 3);
    let epoch: Vec<_> = (0..3).map(|_| a.next_batch().unwrap()).collect();
    let mut seen: Vec<&String> = epoch.iter().flat_map(|b| &b.queries).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen.len(),
        9,
        "nine distinct pairs; the tenth is the dropped remainder"
    );
    for b in &epoch {
        assert_eq!(b.passages.len(), 6);
        for (i, q) in b.queries.iter().enumerate() {
            assert_eq!(b.passages[2 * i], q.replace('q', "p"), "positive first");
            assert_eq!(b.passages[2 * i + 1], format!("{}.0", q.replace('q', "n")));
        }
    }
    // Next epoch: a new order.
    let next = a.next_batch().unwrap();
    assert_eq!(
        a.position(),
        Position {
            epoch: 1,
            offset: 3
        }
    );

    // Resume: a loader moved to a saved position serves the same batches.
    let mut b = Loader::new(pairs.clone(), 3, 1, 9).unwrap();
    b.seek(Position {
        epoch: 0,
        offset: 6,
    })
    .unwrap();
    assert_eq!(b.next_batch().unwrap(), epoch[2]);
    assert_eq!(b.next_batch().unwrap(), next);
    let mut c = Loader::new(pairs, 3, 1, 10).unwrap();
    assert_ne!(
        c.next_batch().unwrap(),
        epoch[0],
        "another seed, another order"
    );
}

#[test]
fn missing_hard_negatives_are_filled_from_other_pairs() {
    let pairs: Vec<Pair> = (0..6).map(|i| pair(i, usize::from(i % 2 == 0))).collect();
    let mut loader = Loader::new(pairs, 6, 2, 1).unwrap();
    let b = loader.next_batch().unwrap();
    // Each pair asks for 2 negatives: even pairs have 1, odd pairs none: 3*1 + 3*2 filled.
    assert_eq!(b.filled, 9);
    for (i, q) in b.queries.iter().enumerate() {
        let own = q.replace('q', "p");
        for n in &b.passages[3 * i + 1..3 * i + 3] {
            assert_ne!(
                n, &own,
                "a filled negative is never the pair's own positive"
            );
        }
    }
    let err = Loader::new(vec![pair(0, 0)], 2, 0, 1).err().unwrap();
    assert!(err.to_string().contains("train.batch_size"), "{err}");
}

#[test]
fn teacher_scores_are_read_and_served_beside_their_passages() {
    // A `scores` list is read (any field name), a value that is not a list of numbers is
    // refused by line.
    let (_d, path) = write(concat!(
        "{\"query\": \"a\", \"positive\": \"b\", \"negatives\": [\"c\"], \"s\": [2.5, -1]}\n",
        "{\"query\": \"d\", \"positive\": \"e\"}\n",
    ));
    let fields = Fields {
        scores: "s".into(),
        ..Fields::default()
    };
    let pairs = read_jsonl(&path, &fields).unwrap();
    assert_eq!(pairs[0].scores, vec![2.5, -1.0]);
    assert!(pairs[1].scores.is_empty());
    for bad in ["\"high\"", "[1, \"x\"]", "{\"a\": 1}"] {
        let (_d, path) = write(&format!(
            "{{\"query\": \"a\", \"positive\": \"b\", \"scores\": {bad}}}\n"
        ));
        let err = read_jsonl(&path, &Fields::default()).unwrap_err();
        assert!(
            err.to_string().contains("list of numbers") && err.to_string().contains(":1"),
            "{bad}: {err}"
        );
    }

    // Served: each query's k + 1 scores in its passages' order, nothing filled.
    let with_scores = |i: usize| Pair {
        scores: (0..3).map(|j| (10 * i + j) as f32).collect(),
        ..pair(i, 2)
    };
    let pairs: Vec<Pair> = (0..6).map(with_scores).collect();
    let path = std::path::Path::new("train.jsonl");
    let mut loader = Loader::new(pairs, 3, 1, 5)
        .unwrap()
        .with_teacher_scores(path);
    for _ in 0..4 {
        let b = loader.next_batch().unwrap();
        assert_eq!((b.filled, b.scores.len()), (0, 6));
        for (i, q) in b.queries.iter().enumerate() {
            let n: usize = q[1..].parse().unwrap();
            assert_eq!(b.passages[2 * i], format!("p{n}"));
            assert_eq!(b.passages[2 * i + 1], format!("n{n}.0"));
            assert_eq!(
                b.scores[2 * i..2 * i + 2],
                [(10 * n) as f32, (10 * n + 1) as f32]
            );
        }
    }
    // A pair without scores, or with fewer negatives than a batch takes: an error naming
    // the file and the pair's line when it is served.
    let mut pairs: Vec<Pair> = (0..4).map(with_scores).collect();
    pairs[2].scores.clear();
    let mut loader = Loader::new(pairs, 4, 1, 5)
        .unwrap()
        .with_teacher_scores(path);
    let err = loader.next_batch().unwrap_err().to_string();
    assert!(
        err.contains("train.jsonl:3") && err.contains("0 teacher scores"),
        "{err}"
    );
    let pairs: Vec<Pair> = (0..4).map(with_scores).collect();
    let mut loader = Loader::new(pairs, 4, 3, 5)
        .unwrap()
        .with_teacher_scores(path);
    let err = loader.next_batch().unwrap_err().to_string();
    assert!(err.contains("cannot fill"), "{err}");
}
