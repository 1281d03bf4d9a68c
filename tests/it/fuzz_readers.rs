//! The readers of user input under generated input (proptest): the TOML configs and their
//! `--set` overrides, every training-data layout (JSONL ours and Tevatron's, TSV, CSV,
//! Parquet, gzip and zstd, BEIR folders, the streamed JSONL index), and training
//! checkpoints (their state file and both tensor files, with and without their digests).
//! Each starts from a valid file and damages it: bytes flipped, cut, repeated or
//! inserted, or replaced by arbitrary text. Every case must end in `Ok` or a clear `Err`;
//! a panic fails the test (proptest then shrinks it to the smallest damaging edit).
//!
//! CI runs proptest's default 256 cases per reader. A longer hunt:
//! `PROPTEST_CASES=20000 cargo test --release --test fuzz_readers` (docs/training.md
//! records its minutes).

use std::fs;
use std::io::Write;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use gradcache::train::checkpoint::{self, TrainerState};
use gradcache::train::config::{apply_override, Config};
use gradcache::train::data::{Fields, PairSource, Position};
use gradcache::train::formats::read_pairs;
use gradcache::train::image_text::ImageTextConfig;
use gradcache::train::stream::JsonlIndex;
use gradcache::Params;
use proptest::prelude::*;

/// One way of damaging a file.
#[derive(Debug, Clone)]
enum Edit {
    /// XOR one byte.
    Flip { at: usize, mask: u8 },
    /// Cut the file there.
    Truncate { at: usize },
    /// Insert bytes there.
    Insert { at: usize, bytes: Vec<u8> },
    /// Remove a range.
    Remove { at: usize, len: usize },
    /// Repeat a range right after itself.
    Repeat { at: usize, len: usize },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Edit::Flip { at, mask }),
        any::<usize>().prop_map(|at| Edit::Truncate { at }),
        (
            any::<usize>(),
            prop::collection::vec(
                prop_oneof![
                    any::<u8>(),
                    Just(b'"'),
                    Just(b'\n'),
                    Just(b'\t'),
                    Just(b','),
                    Just(b'{'),
                    Just(b'['),
                    Just(b'=')
                ],
                1..8
            )
        )
            .prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Edit::Remove { at, len }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Edit::Repeat { at, len }),
    ]
}

fn apply(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for e in edits {
        let n = b.len();
        match e {
            Edit::Flip { at, mask } if n > 0 => b[at % n] ^= mask,
            Edit::Truncate { at } => b.truncate(at % (n + 1)),
            Edit::Insert { at, bytes } => {
                let at = at % (n + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Edit::Remove { at, len } if n > 0 => {
                let at = at % n;
                b.drain(at..(at + len).min(n));
            }
            Edit::Repeat { at, len } if n > 0 => {
                let at = at % n;
                let piece: Vec<u8> = b[at..(at + len).min(n)].to_vec();
                let end = at + piece.len();
                b.splice(end..end, piece);
            }
            _ => {}
        }
    }
    b
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..4)
}

const JSONL: &str = concat!(
    r#"{"query": "who wrote it", "positive": "the scribe wrote it", "negatives": ["a fish", "the sea"]}"#,
    "\n",
    r#"{"query": "where is it", "positive_passages": [{"docid": "1", "title": "Place", "text": "over there"}], "negative_passages": [{"text": "nowhere"}]}"#,
    "\n\n",
    r#"{"anchor": "ignored", "query": "q3", "positive": "p3", "negative_1": "n1", "negative_2": ""}"#,
    "\n"
);

const TSV: &str = "query\tpositive\tnegative_1\tnegative_2\nwho\tthe scribe\ta fish\t\nwhere\tover there\tnowhere\tthe sea\n";

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zstd_frame(bytes: &[u8]) -> Vec<u8> {
    // ruzstd compresses too (its fastest level): a real frame to damage.
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

/// Reads `bytes` as a training file named `name`, in every way the trainer does.
fn read_all_ways(dir: &Path, name: &str, bytes: &[u8]) {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    let fields = Fields::default();
    let _ = read_pairs(&path, &fields, "train", " ");
    if name.ends_with(".jsonl") {
        if let Ok(index) = JsonlIndex::build(&path, &fields, " ") {
            for i in 0..index.len() {
                let _ = index.pair(i);
            }
        }
    }
}

proptest! {
    #[test]
    fn data_files_never_panic(e in edits(), layout in 0usize..6) {
        let dir = tempfile::tempdir().unwrap();
        let parquet = fs::read("tests/fixtures/parquet/tevatron.parquet").unwrap();
        let (name, clean): (&str, Vec<u8>) = match layout {
            0 => ("pairs.jsonl", JSONL.as_bytes().to_vec()),
            1 => ("pairs.tsv", TSV.as_bytes().to_vec()),
            2 => ("pairs.csv", TSV.replace('\t', ",").into_bytes()),
            3 => ("pairs.parquet", parquet),
            4 => ("pairs.jsonl.gz", gzip(JSONL.as_bytes())),
            _ => ("pairs.jsonl.zst", zstd_frame(JSONL.as_bytes())),
        };
        read_all_ways(dir.path(), name, &apply(&clean, &e));
        // The edit applied to the text before compressing: a valid stream of bad data.
        if layout >= 4 {
            let bad = apply(JSONL.as_bytes(), &e);
            let packed = if layout == 4 { gzip(&bad) } else { zstd_frame(&bad) };
            read_all_ways(dir.path(), name, &packed);
        }
    }

    #[test]
    fn beir_folders_never_panic(e in edits(), which in 0usize..3) {
        let dir = tempfile::tempdir().unwrap();
        let files = [
            ("corpus.jsonl", "{\"_id\": \"d1\", \"title\": \"T\", \"text\": \"one\"}\n{\"_id\": \"d2\", \"text\": \"two\"}\n"),
            ("queries.jsonl", "{\"_id\": \"q1\", \"text\": \"which one\"}\n"),
            ("qrels/train.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\n"),
        ];
        fs::create_dir_all(dir.path().join("qrels")).unwrap();
        for (i, (name, text)) in files.iter().enumerate() {
            let bytes = if i == which { apply(text.as_bytes(), &e) } else { text.as_bytes().to_vec() };
            fs::write(dir.path().join(name), bytes).unwrap();
        }
        let _ = read_pairs(dir.path(), &Fields::default(), "train", " ");
        let _ = gradcache::retrieval::BeirSet::load(dir.path(), "train");
    }

    #[test]
    fn configs_never_panic(e in edits(), which in 0usize..3) {
        let dir = tempfile::tempdir().unwrap();
        let (source, image_text) = match which {
            0 => ("configs/quickstart.toml", false),
            1 => ("configs/bible-beir-hard-negatives.toml", false),
            _ => ("configs/image-text.toml", true),
        };
        let text = fs::read(source).unwrap();
        let path = dir.path().join("config.toml");
        fs::write(&path, apply(&text, &e)).unwrap();
        if image_text {
            if let Ok(cfg) = ImageTextConfig::load(&path, &[]) {
                let _ = cfg.fingerprint();
            }
        } else if let Ok(cfg) = Config::load(&path, &[]) {
            let _ = cfg.fingerprint();
        }
    }

    #[test]
    fn overrides_never_panic(key in "[a-z_.]{0,24}", value in "\\PC{0,24}") {
        let mut table = gradcache::train::config::read_table(Path::new("configs/quickstart.toml")).unwrap();
        let assignment = format!("{key}={value}");
        if apply_override(&mut table, &assignment).is_ok() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.toml");
            fs::write(&path, toml::to_string(&table).unwrap_or_default()).unwrap();
            let _ = Config::load(&path, &[]);
        }
        let _ = Config::load(Path::new("configs/quickstart.toml"), std::slice::from_ref(&assignment));
        let _ = Config::load(Path::new("configs/quickstart.toml"), &[value]);
    }

    #[test]
    fn checkpoints_never_panic(e in edits(), which in 0usize..3, keep_digests in any::<bool>()) {
        let root = tempfile::tempdir().unwrap();
        let t = |v: &[f32], shape: &[usize]| {
            Var::from_tensor(&Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()).unwrap()
        };
        let params = Params::new([
            ("layer.weight".to_string(), t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])),
            ("layer.bias".to_string(), t(&[0.5, -0.5], &[2])),
        ]);
        let optimizer = [("m.layer.bias".to_string(), Tensor::new(&[0.1f32, 0.2], &Device::Cpu).unwrap())].into();
        let state = TrainerState {
            step: 3,
            data: Position { epoch: 0, offset: 24 },
            config_fingerprint: "fuzz".into(),
            ..TrainerState::default()
        };
        let dir = checkpoint::save(root.path(), &params, &optimizer, &state, 2).unwrap();
        let file = ["model.safetensors", "optimizer.safetensors", "trainer_state.json"][which];
        let path = dir.join(file);
        let damaged = apply(&fs::read(&path).unwrap(), &e);
        fs::write(&path, damaged).unwrap();
        if !keep_digests && which != 2 {
            // A checkpoint written before digests: the tensor files reach the parser.
            let state_path = dir.join("trainer_state.json");
            let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&state_path).unwrap()).unwrap();
            v.as_object_mut().unwrap().remove("files");
            fs::write(&state_path, v.to_string()).unwrap();
        }
        if let Ok(c) = checkpoint::load(root.path(), &Device::Cpu) {
            let _ = checkpoint::restore(&params, &c.model, &c.dir);
        }
        let _ = checkpoint::verify(&dir);
        let _ = checkpoint::resolve(root.path());
    }
}
