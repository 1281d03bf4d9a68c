//! Bytes a distributed step moves, per step, and what that means for NCCL on one node of
//! 8 GPUs, on paper (no GPU here to measure). The parameter counts come from building the
//! models with this crate; the formula ([`StepVolume`]) is checked against the bytes a real
//! MPI step moves in `tests/distributed.rs`.
//!
//! ```text
//! cargo bench --bench comm_volume
//! ```
//!
//! Per step: one all-gather of the representations (queries and passages of the global
//! batch) and one all-reduce of every parameter's gradient (in 25 MiB buckets). Ring
//! algorithms move `(N-1)/N` of the all-gather result and `2(N-1)/N` of the all-reduce
//! buffer through each GPU's link. Implementations that all-reduce after every chunk (the
//! reference GradCache under DDP without `no_sync`) multiply the second term by the
//! number of chunks.

use candle_core::{DType, Device};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions};
use gradcache::dist::StepVolume;
use gradcache::ParamStore;

/// NVLink bandwidth per GPU and direction, bytes/s: A100 (NVLink 3, 600 GB/s total) and
/// H100 (NVLink 4, 900 GB/s total). NCCL reaches roughly 75-90% of it on large messages.
const LINKS: [(&str, f64); 2] = [("A100 NVLink3", 300e9), ("H100 NVLink4", 450e9)];
const GPUS: u64 = 8;

struct Setup {
    name: &'static str,
    bert: BertConfig,
    batch: u64,
    passages_per_query: u64,
    chunk: u64,
}

fn params(cfg: &BertConfig) -> anyhow::Result<u64> {
    let store = ParamStore::new(0, DType::F32, &Device::Cpu);
    let encoder = BertEncoder::build(&store, "", cfg, &BertOptions::default())?;
    Ok(gradcache::Encoder::params(&encoder).elem_count() as u64)
}

fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

fn main() -> anyhow::Result<()> {
    let setups = [
        Setup {
            name: "quickstart (2-layer BERT, hidden 128, vocab 4000)",
            bert: BertConfig::new(4000, 128, 2, 4, 256, 64),
            batch: 128,
            passages_per_query: 1,
            chunk: 32,
        },
        Setup {
            name: "BERT-base (12 layers, hidden 768, vocab 30522)",
            bert: BertConfig::new(30522, 768, 12, 12, 3072, 512),
            batch: 4096,
            passages_per_query: 1,
            chunk: 32,
        },
    ];
    for s in &setups {
        let p = params(&s.bert)?;
        let v = StepVolume::of(
            s.batch,
            s.passages_per_query,
            s.bert.hidden_size as u64,
            p,
            4,
        );
        let ring = v.ring_bytes_per_rank(GPUS);
        println!("{}: {p} parameters, global batch {}", s.name, s.batch);
        println!(
            "  per step: all-gather {} ({} B), all-reduce {} ({} B); through each GPU's link \
             with {GPUS} GPUs (ring): {}",
            mb(v.all_gather_bytes as f64),
            v.all_gather_bytes,
            mb(v.all_reduce_bytes as f64),
            v.all_reduce_bytes,
            mb(ring)
        );
        // Chunks per rank per step when reducing after every chunk (both sides).
        let per_rank = s.batch / GPUS;
        let chunks = 2 * per_rank.div_ceil(s.chunk);
        let per_chunk = StepVolume {
            all_gather_bytes: v.all_gather_bytes,
            all_reduce_bytes: v.all_reduce_bytes * chunks,
        }
        .ring_bytes_per_rank(GPUS);
        for (link, bw) in LINKS {
            println!(
                "  {link}: {:.3} ms per step on paper; reducing after each of the {chunks} \
                 chunks instead: {:.3} ms",
                ring / bw * 1e3,
                per_chunk / bw * 1e3
            );
        }
    }
    Ok(())
}
