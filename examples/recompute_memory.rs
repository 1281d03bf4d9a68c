//! Activation checkpointing: peak memory, step time and gradient error of every policy, for
//! a 12-layer BERT encoder, a deep residual MLP, a ResNet image tower (BatchNorm), an LSTM
//! over a long sequence (segments of time steps), a DenseNet-BC-121 (the naive
//! concatenation against the memory-efficient bottleneck) and a VNet over 32^3 volumes
//! (plain units against memory-efficient ones), measured side by side in one run.
//!
//! ```text
//! cargo run --release --example recompute_memory
//! cargo run --release --example recompute_memory -- --towers resnet,lstm
//! cargo run --release --example recompute_memory -- --towers lstm --steps 1024
//! cargo run --release --example recompute_memory -- --towers resnet --resnet-stages 8
//! cargo run --release --example recompute_memory -- --towers densenet
//! cargo run --release --example recompute_memory -- --towers vnet
//! cargo run --release --example recompute_memory -- --quick   # smaller models
//! cargo run --release --example recompute_memory -- --len 256 --bert-only
//! cargo run --release --example recompute_memory -- --len 256 --bert-only --composed \
//!     --policies off,attention,sqrt+attention
//! cargo run --release --example recompute_memory -- --len 256 --bert-only --repeats 3 \
//!     --policies off,attention,off,attention   # best of 3, twice, alternated
//! ```
//!
//! A step is one `cache_step` (dropout on) over a batch that fits in one chunk per side, so
//! the replay of that chunk, where checkpointing acts, dominates the peak. `peak_bytes` is
//! the largest number of bytes allocated at once during the step above what was allocated
//! before it (counting allocator); `max_rel_grad_err` compares the step's gradients with
//! those of the first policy run, `off` unless `--policies` says otherwise (same seeds,
//! same dropout masks); the run fails above 1e-6.

use candle_core::{DType, Device, Tensor};
use gradcache::bert::{BertConfig, BertEncoder, BertOptions, Pooling};
use gradcache::densenet::{DenseNet, DenseNetConfig};
use gradcache::lstm::{Lstm, LstmConfig, LstmEncoder, LstmPooling};
use gradcache::memory::{measure, CountingAllocator};
use gradcache::resnet::{Block, ResNet, ResNetConfig};
use gradcache::toy::{DeepMlp, DeepMlpConfig};
use gradcache::vnet::{VNet, VNetConfig};
use gradcache::{
    Batch, Encoder, GradCache, Gradients, InfoNce, ParamStore, Recompute, Recomputed, TokenBatch,
    Tower,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The segment policies, for any stack of layers.
fn segment_policies() -> Vec<(&'static str, Recompute)> {
    vec![
        ("off", Recompute::Off),
        ("every_layer", Recompute::EveryLayer),
        ("every_2", Recompute::Every(2)),
        ("sqrt", Recompute::Sqrt),
        ("layers_6", Recompute::Layers(vec![6])),
    ]
}

/// The segment policies and selective recompute inside the layers (BERT's sub-layer
/// sites), alone, by name and composed with segments.
fn bert_policies() -> Vec<(&'static str, Recompute)> {
    let mut all = segment_policies();
    all.extend([
        ("attention", Recompute::Attention),
        ("keep_intermediate", Recompute::keep(&["intermediate"])),
        (
            "probs_only",
            Recompute::selective(Recompute::Off, &gradcache::bert::SITES[1..]),
        ),
        ("sqrt+attention", Recompute::selective(Recompute::Sqrt, &[])),
        (
            "every_2+attention",
            Recompute::selective(Recompute::Every(2), &[]),
        ),
    ]);
    all
}

/// Runs one cached step per policy, off first, and prints one line each; with
/// `--policies a,b,..` those, in that order (a name may come back, to alternate timings),
/// the gradients compared with those of the first.
fn run<E, F, P>(
    model: &str,
    policies: Vec<(&'static str, P)>,
    build: F,
    queries: &E::Input,
    passages: &E::Input,
) -> anyhow::Result<()>
where
    E: Encoder,
    F: Fn(P) -> gradcache::Result<E>,
    P: Clone,
{
    let mut reference: Option<Gradients> = None;
    let only: Option<Vec<String>> = std::env::args()
        .skip_while(|a| a != "--policies")
        .nth(1)
        .map(|list| list.split(',').map(str::to_string).collect());
    let chosen = match only {
        None => policies,
        Some(names) => names
            .iter()
            .filter_map(|n| {
                let found = policies.iter().find(|(name, _)| name == n).cloned();
                if found.is_none() {
                    println!("# {model}: no policy `{n}`, skipped");
                }
                found
            })
            .collect(),
    };
    for (name, policy) in chosen {
        let chunk = queries.rows().max(passages.rows());
        let loss = InfoNce::new(0.05)?.with_symmetric(true);
        let gc = GradCache::shared(build(policy)?, chunk, loss)?.with_seed(7);
        // Warm up, then measure the same step again (same step index: same dropout masks),
        // `--repeats` times: the fastest time, the largest peak.
        gc.cache_step(0, queries, passages)?;
        let (mut ms, mut peak, mut grads) = (f64::INFINITY, 0, None);
        for _ in 0..repeats() {
            let (t, p, out) = measure(|| gc.cache_step(0, queries, passages));
            grads = Some(out?.grads);
            (ms, peak) = (ms.min(t), peak.max(p));
        }
        let grads = grads.ok_or_else(|| anyhow::anyhow!("--repeats must be at least 1"))?;
        let err = match &reference {
            None => 0.0,
            Some(off) => grads.max_rel_err(off, 1e-4)?,
        };
        println!(
            "model={model} policy={name} peak_bytes={peak} step_ms={ms:.0} \
             max_rel_grad_err={err:.2e}"
        );
        if err > 1e-6 {
            anyhow::bail!(
                "{model} {name}: gradients differ from the first policy's by {err:.2e} (> 1e-6)"
            );
        }
        reference.get_or_insert(grads);
    }
    Ok(())
}

/// `--repeats N`: measured steps per policy (default 1).
fn repeats() -> usize {
    std::env::args()
        .skip_while(|a| a != "--repeats")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

fn tokens(rows: usize, len: usize, vocab: u32, seed: u32) -> anyhow::Result<TokenBatch> {
    let ids: Vec<u32> = (0..rows * len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % (vocab - 1) + 1)
        .collect();
    let ids = Tensor::from_vec(ids, (rows, len), &Device::Cpu)?;
    let mask = ids.ones_like()?;
    let types = ids.zeros_like()?;
    Ok(TokenBatch::new(ids, mask, types)?)
}

/// The value after `flag`, parsed.
fn value<T: std::str::FromStr>(args: &[String], flag: &str) -> anyhow::Result<Option<T>> {
    match args.iter().position(|a| a == flag) {
        None => Ok(None),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .map(Some)
            .ok_or_else(|| anyhow::anyhow!("{flag} needs a value")),
    }
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in main: no other thread exists yet, and no candle op has run.
    unsafe { gradcache::pool::short_spin() };
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--towers bert,mlp,resnet,lstm,densenet,vnet`: which towers to measure (default: all).
    let towers: Vec<String> = value::<String>(&args, "--towers")?
        .map(|list| list.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| {
            let all = ["bert", "mlp", "resnet", "lstm", "densenet", "vnet"];
            let n = if args.iter().any(|a| a == "--bert-only") {
                1
            } else {
                all.len()
            };
            all[..n].iter().map(|s| s.to_string()).collect()
        });
    let wants = |t: &str| towers.iter().any(|x| x == t);
    if wants("resnet") {
        // `--resnet-stages 8`: one stage of 8 blocks at full resolution (default: ResNet-18's
        // layout, [2, 2, 2, 2]).
        let stages = match value::<String>(&args, "--resnet-stages")? {
            Some(list) => list
                .split(',')
                .map(|v| v.trim().parse())
                .collect::<Result<Vec<usize>, _>>()
                .map_err(|_| anyhow::anyhow!("--resnet-stages needs block counts, e.g. 2,2,2,2"))?,
            None => vec![2, 2, 2, 2],
        };
        resnet(quick, stages)?;
    }
    if wants("densenet") {
        densenet(quick)?;
    }
    if wants("vnet") {
        vnet(quick)?;
    }
    if wants("lstm") {
        let steps = value(&args, "--steps")?.unwrap_or(if quick { 64 } else { 1024 });
        lstm(quick, steps)?;
    }
    if wants("bert") || wants("mlp") {
        transformer_and_mlp(&args, quick, wants("bert"), wants("mlp"))?;
    }
    Ok(())
}

/// A ResNet with BatchNorm (basic blocks in `stages`) over 32x32 RGB images,
/// checkpointed at block boundaries.
fn resnet(quick: bool, stages: Vec<usize>) -> anyhow::Result<()> {
    let blocks: usize = stages.iter().sum();
    let cfg = ResNetConfig {
        in_channels: 3,
        width: if quick { 8 } else { 32 },
        stages,
        block: Block::Basic,
        output: 64,
    };
    let rows = if quick { 8 } else { 64 };
    println!(
        "# resnet: basic blocks {:?}, width {}, BatchNorm, {rows} + {rows} images 32x32, one \
         chunk per side",
        cfg.stages, cfg.width
    );
    let store = ParamStore::new(3, DType::F32, &Device::Cpu);
    let build = |policy| {
        let tower = Tower::build(&store, "", |vb| ResNet::new(&cfg, vb))?;
        Recomputed::new(tower, policy)
    };
    let x = |seed| {
        gradcache::rng::normal(
            seed,
            0.0,
            1.0,
            &(rows, 3, 32, 32).into(),
            DType::F32,
            &Device::Cpu,
        )
    };
    let policies = vec![
        ("off", Recompute::Off),
        ("every_layer", Recompute::EveryLayer),
        ("every_2", Recompute::Every(2)),
        ("sqrt", Recompute::Sqrt),
    ];
    let name = format!(
        "resnet{}blocks{}",
        blocks,
        if cfg.stages.len() == 1 {
            "_one_stage"
        } else {
            ""
        }
    );
    run(&name, policies, build, &x(5)?, &x(6)?)
}

/// DenseNet-BC-121's shape (growth 32, blocks 6/12/24/16) over 32 + 32 RGB images of
/// 64x64 (the small-image stem: the first block runs at full resolution): the naive
/// concatenation (each layer's concatenation, BN and ReLU kept) against the memory-efficient
/// bottleneck, each with and without checkpointing at dense-block boundaries.
fn densenet(quick: bool) -> anyhow::Result<()> {
    let cfg = if quick {
        DenseNetConfig {
            growth_rate: 8,
            block_config: vec![3, 3],
            init_features: 16,
            ..DenseNetConfig::default()
        }
    } else {
        DenseNetConfig::densenet121(64)
    };
    let (rows, side) = if quick { (4, 16) } else { (32, 64) };
    println!(
        "# densenet: growth {}, blocks {:?}, BatchNorm, {rows} + {rows} images {side}x{side}, \
         one chunk per side",
        cfg.growth_rate, cfg.block_config
    );
    let store = ParamStore::new(8, DType::F32, &Device::Cpu);
    let build = |(memory_efficient, policy): (bool, Recompute)| {
        let cfg = DenseNetConfig {
            memory_efficient,
            ..cfg.clone()
        };
        let tower = Tower::build(&store, "", |vb| DenseNet::new(&cfg, vb))?;
        Recomputed::new(tower, policy)
    };
    let x = |seed| {
        gradcache::rng::normal(
            seed,
            0.0,
            1.0,
            &(rows, 3, side, side).into(),
            DType::F32,
            &Device::Cpu,
        )
    };
    let policies = vec![
        ("naive", (false, Recompute::Off)),
        ("memory_efficient", (true, Recompute::Off)),
        ("naive+every_layer", (false, Recompute::EveryLayer)),
        (
            "memory_efficient+every_layer",
            (true, Recompute::EveryLayer),
        ),
    ];
    run("densenet121", policies, build, &x(5)?, &x(6)?)
}

/// VNet's down-path (width 16, stages 1/2/3/2, 5x5x5 kernels) over 32 + 32 volumes of
/// 32^3: plain units (convolution, BatchNorm and PReLU nodes, each output kept) and
/// memory-efficient ones (each unit one node recomputed a piece of rows at a time), each
/// without and with checkpointing at stage boundaries. The peak includes the parameters'
/// gradients (125 MiB, most of them the deepest stages' 5x5x5 kernels), the same for
/// every row. The two kinds are different
/// arithmetic (gradients within 4e-4, tests/it/vnet.rs), so each is checked against its own
/// `off`.
fn vnet(quick: bool) -> anyhow::Result<()> {
    let cfg = if quick {
        VNetConfig {
            width: 4,
            stages: vec![1, 1],
            kernel: 3,
            ..VNetConfig::default()
        }
    } else {
        VNetConfig::default()
    };
    let (rows, side) = if quick { (2, 8) } else { (32, 32) };
    println!(
        "# vnet: width {}, stages {:?}, kernel {}, BatchNorm, PReLU, {rows} + {rows} volumes \
         {side}^3, one chunk per side",
        cfg.width, cfg.stages, cfg.kernel
    );
    let store = ParamStore::new(9, DType::F32, &Device::Cpu);
    let x = |seed| {
        gradcache::rng::normal(
            seed,
            0.0,
            1.0,
            &(rows, 1, side, side, side).into(),
            DType::F32,
            &Device::Cpu,
        )
    };
    for memory_efficient in [false, true] {
        let build = |policy| {
            let cfg = VNetConfig {
                memory_efficient,
                ..cfg.clone()
            };
            let tower = Tower::build(&store, "", |vb| VNet::new(&cfg, vb))?;
            Recomputed::new(tower, policy)
        };
        let (name, policies) = if memory_efficient {
            (
                "vnet_memory_efficient",
                vec![
                    ("off", Recompute::Off),
                    ("every_layer", Recompute::EveryLayer),
                ],
            )
        } else {
            (
                "vnet",
                vec![
                    ("off", Recompute::Off),
                    ("every_layer", Recompute::EveryLayer),
                    ("sqrt", Recompute::Sqrt),
                ],
            )
        };
        run(name, policies, build, &x(5)?, &x(6)?)?;
    }
    Ok(())
}

/// A one-layer LSTM over `steps` tokens, its backward through time in segments of steps.
fn lstm(quick: bool, steps: usize) -> anyhow::Result<()> {
    let cfg = LstmConfig {
        vocab_size: 1000,
        embedding_size: if quick { 32 } else { 128 },
        hidden_size: if quick { 32 } else { 256 },
        num_layers: 1,
        pooling: LstmPooling::Mean,
        output: 64,
    };
    let rows = if quick { 4 } else { 16 };
    println!(
        "# lstm: 1 layer, hidden {}, {rows} + {rows} sequences of {steps} tokens, one chunk per \
         side",
        cfg.hidden_size
    );
    let store = ParamStore::new(4, DType::F32, &Device::Cpu);
    let build = |policy| {
        let tower = Tower::build(&store, "", |vb| Lstm::new(&cfg, vb))?;
        LstmEncoder::new(tower, policy)
    };
    let policies = vec![
        ("off", Recompute::Off),
        ("sqrt", Recompute::Sqrt),
        ("every_64", Recompute::Every(64)),
        ("every_256", Recompute::Every(256)),
    ];
    let (q, p) = (tokens(rows, steps, 1000, 1)?, tokens(rows, steps, 1000, 2)?);
    run(&format!("lstm{steps}"), policies, build, &q, &p)
}

fn transformer_and_mlp(args: &[String], quick: bool, bert: bool, mlp: bool) -> anyhow::Result<()> {
    // The composed ops (what runs on a GPU and in half precision) instead of the fused
    // CPU kernels.
    let composed = args.iter().any(|a| a == "--composed");
    gradcache::nn::set_fused_kernels(!composed);
    let (hidden, rows, mut len) = if quick { (64, 4, 32) } else { (256, 16, 128) };
    if let Some(i) = args.iter().position(|a| a == "--len") {
        len = args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("--len needs a sequence length, e.g. --len 256"))?;
    }
    let cfg = BertConfig::new(1000, hidden, 12, 4, 4 * hidden, 512);
    if bert {
        println!(
        "# bert: 12 layers, hidden {hidden}, {rows} queries + {rows} passages of {len} tokens, \
         one chunk per side, {} ops; cores: {}",
        if composed { "composed" } else { "fused" },
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
        let store = ParamStore::new(1, DType::F32, &Device::Cpu);
        let (q, p) = (tokens(rows, len, 1000, 1)?, tokens(rows, len, 1000, 2)?);
        let build = |policy| {
            let options = BertOptions {
                lora: None,
                pooling: Pooling::Mean,
                normalize: false,
                recompute: policy,
                ..Default::default()
            };
            BertEncoder::build(&store, "", &cfg, &options)
        };
        run("bert12", bert_policies(), build, &q, &p)?;
    }
    if !mlp {
        return Ok(());
    }

    let mlp = DeepMlpConfig {
        input: 64,
        hidden: if quick { 64 } else { 512 },
        blocks: 24,
        output: 64,
        dropout: 0.1,
    };
    let rows = if quick { 32 } else { 1024 };
    println!(
        "# deep residual mlp: 24 blocks, hidden {}, {rows} queries + {rows} passages",
        mlp.hidden
    );
    let store = ParamStore::new(2, DType::F32, &Device::Cpu);
    let build = |policy| {
        let tower = Tower::build(&store, "", |vb| DeepMlp::new(&mlp, vb))?;
        Recomputed::new(tower, policy)
    };
    let x =
        |seed| gradcache::rng::normal(seed, 0.0, 1.0, &(rows, 64).into(), DType::F32, &Device::Cpu);
    run("deep_mlp24", segment_policies(), build, &x(3)?, &x(4)?)?;
    Ok(())
}
