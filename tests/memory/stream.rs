//! Training files larger than memory (`data.stream`): the streamed loader serves the same
//! batches as the in-memory one (hard-negative filling and no-duplicate batches included)
//! and resumes at the same place; its heap is the line index, not the texts; a streamed run
//! trains the same losses as an in-memory one; bad input is named.

use std::io::Write;
use std::path::Path;

use gradcache::memory::current_bytes;
use gradcache::train::data::{Fields, Loader, PairSource};
use gradcache::train::formats::{read_numbered, read_pairs, Layout};
use gradcache::train::stream::JsonlIndex;
use gradcache::train::{Config, Trainer};
use gradcache::Error;

use crate::alone;
use crate::common;

/// `n` pairs; queries repeat every 37 (so that no-duplicate batches have work to do), some
/// with hard negatives; blank lines and a CRLF ending in between.
fn write_pairs(path: &Path, n: usize) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..n {
        let negatives: Vec<String> = (0..i % 3).map(|k| format!("negative {i} {k}")).collect();
        let line = serde_json::json!({
            "query": format!("query number {} with some words to make it longer", i % 37 + 37 * (i / 500)),
            "positive": format!("the positive passage of pair {i}, a sentence of a certain length"),
            "negatives": negatives,
        });
        write!(f, "{line}{}", if i % 10 == 3 { "\r\n" } else { "\n" }).unwrap();
        if i % 97 == 0 {
            writeln!(f, "   ").unwrap();
        }
    }
}

#[test]
fn streamed_batches_equal_in_memory_batches_and_resume_exactly() {
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pairs.jsonl");
    write_pairs(&path, 2_000);
    let fields = Fields::default();
    for no_duplicates in [false, true] {
        let memory = read_numbered(&path, Layout::JsonLines, &fields, "train", " ").unwrap();
        let index = JsonlIndex::build(&path, &fields, " ").unwrap();
        assert_eq!(index.len(), memory.len());
        assert_eq!(
            read_pairs(&path, &fields, "train", " ").unwrap(),
            memory.pairs
        );
        // Both name each pair by its line in the file (blank lines counted).
        assert_eq!((index.origin(0), index.origin(1)), (1, 3));
        assert_eq!(memory.lines[..2], [1, 3]);
        let mut a = Loader::from_source(Box::new(memory), 64, 2, 5)
            .unwrap()
            .with_no_duplicates(no_duplicates)
            .unwrap();
        let mut b = Loader::from_source(Box::new(index), 64, 2, 5)
            .unwrap()
            .with_no_duplicates(no_duplicates)
            .unwrap();
        let mut positions = Vec::new();
        let mut batches = Vec::new();
        // Past the end of the first epoch.
        for _ in 0..40 {
            positions.push(b.position());
            let (x, y) = (a.next_batch().unwrap(), b.next_batch().unwrap());
            assert_eq!(x, y, "no_duplicates={no_duplicates}");
            batches.push(y);
        }
        let index = JsonlIndex::build(&path, &fields, " ").unwrap();
        let mut resumed = Loader::from_source(Box::new(index), 64, 2, 5)
            .unwrap()
            .with_no_duplicates(no_duplicates)
            .unwrap();
        resumed.seek(positions[33]).unwrap();
        for want in &batches[33..] {
            assert_eq!(&resumed.next_batch().unwrap(), want);
        }
    }
}

#[test]
fn the_index_holds_offsets_not_texts() {
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("big.jsonl");
    write_pairs(&path, 100_000);
    let size = std::fs::metadata(&path).unwrap().len() as usize;
    let before = current_bytes();
    let index = JsonlIndex::build(&path, &Fields::default(), " ").unwrap();
    let held = current_bytes().saturating_sub(before);
    let mut loader = Loader::from_source(Box::new(index), 256, 1, 1).unwrap();
    for _ in 0..5 {
        loader.next_batch().unwrap();
    }
    let after_batches = current_bytes().saturating_sub(before);
    // 12 bytes a pair (offset and line number; vectors may hold up to twice that) plus the
    // shuffled order (8 bytes a pair), against ~140 bytes a pair of text.
    assert!(
        after_batches < size / 4,
        "streaming holds {after_batches} bytes for a file of {size} (index alone {held})"
    );
    let memory = read_pairs(&path, &Fields::default(), "train", " ").unwrap();
    let in_memory = current_bytes().saturating_sub(before);
    assert!(
        in_memory > size,
        "reading the file whole holds {in_memory} bytes"
    );
    drop(memory);
}

#[test]
fn streaming_refuses_what_it_cannot_read_and_names_bad_lines() {
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let fields = Fields::default();
    let path = tmp.path().join("pairs.jsonl.gz");
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b"{\"query\": \"q\", \"positive\": \"p\"}\n")
        .unwrap();
    std::fs::write(&path, e.finish().unwrap()).unwrap();
    match JsonlIndex::build(&path, &fields, " ").err().unwrap() {
        Error::Data { reason, .. } => assert!(reason.contains("uncompressed"), "{reason}"),
        other => panic!("{other}"),
    }
    // A bad line is found when it is served, named by its line number.
    let path = tmp.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"query\": \"q\", \"positive\": \"p\"}\n\n{\"query\": \"q2\"}\n",
    )
    .unwrap();
    let index = JsonlIndex::build(&path, &fields, " ").unwrap();
    assert_eq!(index.len(), 2);
    index.pair(0).unwrap();
    match index.pair(1).unwrap_err() {
        Error::Data { line, reason, .. } => {
            assert_eq!(line, 3);
            assert!(reason.contains("missing field `positive`"), "{reason}");
        }
        other => panic!("{other}"),
    }
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "\n  \n").unwrap();
    assert!(JsonlIndex::build(&empty, &fields, " ").is_err());
}

#[test]
fn a_streamed_run_trains_the_in_memory_losses() {
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let config = common::write_tiny_run(tmp.path());
    let cfg = Config::load(&config, &[]).unwrap();
    let mut memory = Trainer::new(cfg.clone(), None).unwrap();
    let want: Vec<f32> = (0..3).map(|_| memory.train_step().unwrap().loss).collect();
    let streamed_cfg = Config::load(
        &config,
        &[
            "data.stream=true".into(),
            format!("output_dir={}", tmp.path().join("streamed").display()),
        ],
    )
    .unwrap();
    assert_eq!(
        streamed_cfg.fingerprint().unwrap(),
        cfg.fingerprint().unwrap()
    );
    let mut streamed = Trainer::new(streamed_cfg.clone(), None).unwrap();
    let got: Vec<f32> = (0..3)
        .map(|_| streamed.train_step().unwrap().loss)
        .collect();
    assert_eq!(got, want);
    // Without an eval file there is nothing to hold out of a stream.
    let mut no_eval = streamed_cfg;
    no_eval.data.eval_file = None;
    no_eval.data.eval_pairs = 4;
    match Trainer::new(no_eval, None).err().unwrap() {
        Error::InvalidConfig { field, .. } => assert_eq!(field, "data.stream"),
        other => panic!("{other}"),
    }
}

#[test]
fn a_file_changed_after_indexing_and_a_layout_that_cannot_stream_are_refused() {
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pairs.jsonl");
    write_pairs(&path, 50);
    let index = JsonlIndex::build(&path, &Fields::default(), " ").unwrap();
    // The file shrinks under the index: the last lines cannot be read any more.
    let text = std::fs::read(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    match index.pair(index.len() - 1).unwrap_err() {
        Error::Data { reason, .. } => assert!(reason.contains("was the file changed"), "{reason}"),
        other => panic!("{other}"),
    }
    // data.stream with a TSV training file.
    let config = common::write_tiny_run(tmp.path());
    let tsv = tmp.path().join("train.tsv");
    std::fs::write(&tsv, "query\tpositive\nq\tp\n").unwrap();
    let sets = vec![
        "data.stream=true".to_string(),
        format!("data.train_file=\"{}\"", tsv.display()),
    ];
    match Trainer::new(Config::load(&config, &sets).unwrap(), None)
        .err()
        .unwrap()
    {
        Error::InvalidConfig { field, .. } => assert_eq!(field, "data.stream"),
        other => panic!("{other}"),
    }
}

#[test]
fn a_streamed_source_of_a_mixture_holds_its_index_not_its_texts() {
    // A mixture of a 100,000-pair source and a small one, on a tiny pretrained model (no
    // tokenizer to train, so no texts sampled): with the big source streamed, the run as
    // built holds about the index and the shuffled order; read into memory, the texts.
    let _alone = alone();
    let tmp = tempfile::tempdir().unwrap();
    let big = tmp.path().join("big.jsonl");
    write_pairs(&big, 100_000);
    let size = std::fs::metadata(&big).unwrap().len() as usize;
    let small = tmp.path().join("small.jsonl");
    common::vocab_pairs(&small);
    let model = tmp.path().join("model");
    common::write_bert_dir(&model, common::TINY_BERT, false);
    let held = |stream: bool| -> usize {
        let config = tmp.path().join("mix.toml");
        std::fs::write(
            &config,
            format!(
                r#"
output_dir = "{out}"
[data]
eval_file = "{small}"
[[data.sources]]
name = "big"
path = "{big}"
stream = {stream}
[[data.sources]]
name = "small"
path = "{small}"
[model]
pretrained = "{model}"
[train]
batch_size = 8
"#,
                out = tmp.path().join(format!("run-{stream}")).display(),
                small = small.display(),
                big = big.display(),
                model = model.display(),
            ),
        )
        .unwrap();
        let cfg = Config::load(&config, &[]).unwrap();
        let before = current_bytes();
        let mut trainer = Trainer::new(cfg, None).unwrap();
        trainer.train_step().unwrap();
        let held = current_bytes().saturating_sub(before);
        drop(trainer);
        held
    };
    let streamed = held(true);
    let whole = held(false);
    println!("a file of {size} bytes: streamed {streamed} bytes held, in memory {whole}");
    assert!(
        streamed < size / 4,
        "streamed: {streamed} bytes held for a file of {size}"
    );
    assert!(
        whole > size,
        "in memory: {whole} bytes held for a file of {size}"
    );
}
