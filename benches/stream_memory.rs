//! Training files larger than memory (`data.stream`): heap and time of indexing a JSONL
//! file of pairs and of serving batches from it, against reading the file whole.
//!
//! ```text
//! cargo bench --bench stream_memory                    # 1,000,000 pairs (~150 MB file)
//! PAIRS=10000000 cargo bench --bench stream_memory     # 10 million pairs (~1.5 GB file)
//! ```
//!
//! The file is written to a temporary directory first (not timed). The in-memory reading
//! is skipped above 2 million pairs unless `WHOLE=1` (it holds the texts: several GB).

use std::io::Write;
use std::time::Instant;

use gradcache::memory::{measure, CountingAllocator};
use gradcache::train::data::{Fields, Loader};
use gradcache::train::formats::read_jsonl;
use gradcache::train::stream::JsonlIndex;

mod common;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    let pairs: usize = std::env::var("PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let (cpu, _) = common::cpu();
    println!("cpu: {cpu}");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("pairs.jsonl");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        for i in 0..pairs {
            writeln!(
                f,
                "{}",
                serde_json::json!({
                    "query": format!("query {i}: and it came to pass in those days, that a decree went out"),
                    "positive": format!("passage {i}: in those days a decree went out from Caesar Augustus"),
                })
            )?;
        }
    }
    let size = std::fs::metadata(&path)?.len() as usize;
    println!("{pairs} pairs, file {:.0} MiB", mib(size));

    let start = Instant::now();
    let (_, index_peak, index) = measure(|| JsonlIndex::build(&path, &Fields::default(), " "));
    let index = index?;
    let index_s = start.elapsed().as_secs_f64();
    let (_, loader_peak, loader) = measure(|| Loader::from_source(Box::new(index), 1024, 0, 1));
    let mut loader = loader?;
    let start = Instant::now();
    let (_, serve_peak, served) = measure(|| -> anyhow::Result<usize> {
        let mut n = 0;
        for _ in 0..100 {
            n += loader.next_batch()?.queries.len();
        }
        Ok(n)
    });
    let served = served?;
    let serve_s = start.elapsed().as_secs_f64();
    println!(
        "streamed: index {:.1} MiB in {index_s:.1} s, loader (shuffled order) {:.1} MiB, \
         100 batches of 1,024 ({served} pairs) {:.1} MiB in {serve_s:.2} s ({:.0} pairs/s)",
        mib(index_peak),
        mib(loader_peak),
        mib(serve_peak),
        served as f64 / serve_s
    );
    drop(loader);
    if pairs <= 2_000_000 || std::env::var("WHOLE").is_ok() {
        let start = Instant::now();
        let (_, whole_peak, whole) = measure(|| read_jsonl(&path, &Fields::default()));
        let n = whole?.len();
        println!(
            "in memory: {n} pairs read whole, peak {:.1} MiB in {:.1} s",
            mib(whole_peak),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
