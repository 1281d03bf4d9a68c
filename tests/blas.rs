//! A BLAS loaded at run time for the layer nodes' f32 products (`GRADCACHE_BLAS`,
//! `src/nn/cpu/products/blas.rs`), with Debian's OpenBLAS (`libopenblas0-pthread`, which `.ci/run`
//! installs; another library with `GRADCACHE_TEST_BLAS=/path/to/lib.so`):
//! - bad libraries are refused with an error naming the file and the reason, and change
//!   nothing (the products stay the gemm crate's);
//! - whole cached steps through the BLAS (every encoder layout and a decoder, dropout on,
//!   with and without recompute) equal the same steps through the gemm crate to 1e-5, the
//!   library's products were really used (the bits differ somewhere), cached still equals
//!   the full batch, and a step repeats itself bit for bit;
//! - the binary with `GRADCACHE_BLAS` set says so and encodes as without it.
//!
//! Its own binary: the first test loads the library for the whole process (the second
//! runs the `gradcache` binary, a process of its own).

use candle_core::{DType, Device};
use gradcache::bert::{BertEncoder, BertOptions, Pooling};
use gradcache::nn::{blas_in_use, set_blas_products, use_blas};
use gradcache::{GradCache, InfoNce, ParamStore, Recompute, StepOutput};

mod common;
use common::{bits, rel_err_with_zeros};

/// The BLAS to test with: `GRADCACHE_TEST_BLAS`, else Debian's OpenBLAS.
fn openblas() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os("GRADCACHE_TEST_BLAS") {
        return path.into();
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    ];
    candidates
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "no OpenBLAS found ({}): install Debian's libopenblas0-pthread (.ci/run does) \
                 or set GRADCACHE_TEST_BLAS to a BLAS shared library",
                candidates.join(", ")
            )
        })
}

/// A cached step of two towers of `family` (an encoder layout, or `decoder:` and a decoder
/// family) with chunks of `chunks`, dropout on or off (its masks are drawn per chunk, so
/// only a step without dropout equals its cached self).
fn step(family: &str, recompute: Recompute, chunks: (usize, usize), dropout: bool) -> StepOutput {
    let (mut cfg, decoder) = match family.strip_prefix("decoder:") {
        Some(f) => (common::decoders::config(f), true),
        None => (common::encoders::config(family), false),
    };
    if !dropout {
        cfg.hidden_dropout_prob = 0.0;
        cfg.attention_probs_dropout_prob = 0.0;
        for key in ["embedding_dropout", "attention_dropout", "mlp_dropout"] {
            if cfg.extra.contains_key(key) {
                cfg.extra.insert(key.into(), 0.0.into());
            }
        }
    }
    let store = ParamStore::new(21, DType::F32, &Device::Cpu);
    let options = |pooling| BertOptions {
        pooling,
        normalize: true,
        recompute: recompute.clone(),
        ..Default::default()
    };
    let query_pooling = if decoder {
        Pooling::LastToken
    } else {
        Pooling::Cls
    };
    let q = BertEncoder::build(&store, "query", &cfg, &options(query_pooling)).unwrap();
    let p = BertEncoder::build(&store, "passage", &cfg, &options(Pooling::Mean)).unwrap();
    if decoder {
        common::decoders::perturb(&store);
    }
    let loss = InfoNce::new(0.1).unwrap().with_symmetric(true);
    let gc = GradCache::two_towers(q, p, chunks.0, chunks.1, loss)
        .unwrap()
        .with_seed(5);
    if decoder {
        let t = common::decoders::tokens;
        gc.cache_step(2, &t(1, 6, true), &t(2, 12, true)).unwrap()
    } else {
        let t = common::encoders::tokens;
        gc.cache_step(2, &t(1, 6), &t(2, 12)).unwrap()
    }
}

/// Chunks of 3 queries and 4 passages, and one chunk per tower holding the whole batch.
const CACHED: (usize, usize) = (3, 4);
const WHOLE: (usize, usize) = (64, 64);

fn zero_gradients(family: &str) -> Vec<String> {
    if family.starts_with("decoder:") {
        return Vec::new();
    }
    let layers = common::encoders::config(family).num_hidden_layers;
    common::encoders::key_biases(family, layers)
}

fn assert_close(got: &StepOutput, want: &StepOutput, what: &str, family: &str) {
    let loss_err = ((got.loss - want.loss) / want.loss).abs();
    assert!(
        loss_err <= 1e-6,
        "{family}, {what}: loss {} vs {}",
        got.loss,
        want.loss
    );
    assert_eq!(got.grads.len(), want.grads.len(), "{family}, {what}");
    let zero = zero_gradients(family);
    let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
    let err = rel_err_with_zeros(&got.grads, &want.grads, &zero, 1e-5);
    assert!(
        err <= 1e-5,
        "{family}, {what}: max relative gradient error {err:e}"
    );
}

fn identical(a: &StepOutput, b: &StepOutput) -> bool {
    a.loss.to_bits() == b.loss.to_bits()
        && a.grads.len() == b.grads.len()
        && a.grads
            .iter()
            .all(|(name, g)| b.grads.get(name).is_some_and(|h| bits(g) == bits(h)))
}

#[test]
fn a_loaded_blas_gives_the_same_steps() {
    // Refusals name the file and the reason, and load nothing.
    let missing = std::path::Path::new("/nonexistent/libblas.so");
    let err = use_blas(missing).unwrap_err().to_string();
    assert!(
        err.contains("/nonexistent/libblas.so") && err.contains("no such file"),
        "{err}"
    );
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let err = use_blas(&manifest).unwrap_err().to_string();
    assert!(err.contains("cannot open it as a shared library"), "{err}");
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("glibc's libm");
    let err = use_blas(libm).unwrap_err().to_string();
    assert!(err.contains("has no `sgemm_`"), "{err}");
    assert_eq!(blas_in_use(), None, "a refused library is not used");

    // The gemm crate's steps, then the library's.
    let families = common::encoders::LAYOUTS
        .iter()
        .map(|f| f.to_string())
        .chain(["decoder:qwen3".to_string(), "decoder:llama".to_string()]);
    let runs: Vec<(String, Recompute)> = families
        .flat_map(|f| [(f.clone(), Recompute::Off), (f, Recompute::EveryLayer)])
        .collect();
    let gemm: Vec<StepOutput> = runs
        .iter()
        .map(|(f, r)| step(f, r.clone(), CACHED, true))
        .collect();

    let path = openblas();
    let info = use_blas(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(blas_in_use(), Some(info.clone()));
    assert_eq!(
        use_blas(&path).unwrap(),
        info,
        "the same library again is the one in use"
    );
    let err = use_blas(libm).unwrap_err().to_string();
    assert!(err.contains("another BLAS is already in use"), "{err}");

    let mut any_different = false;
    for ((family, recompute), want) in runs.iter().zip(&gemm) {
        let what = format!("{recompute:?}");
        let got = step(family, recompute.clone(), CACHED, true);
        assert_close(&got, want, &format!("{what}, BLAS against gemm"), family);
        any_different |= !identical(&got, want);

        // The contract under the BLAS: cached equals one chunk holding the whole batch,
        // and the step repeats itself bit for bit.
        let cached = step(family, recompute.clone(), CACHED, false);
        let whole = step(family, recompute.clone(), WHOLE, false);
        assert_close(
            &cached,
            &whole,
            &format!("{what}, cached against whole"),
            family,
        );
        let again = step(family, recompute.clone(), CACHED, true);
        assert!(
            identical(&got, &again),
            "{family}, {what}: a step through the BLAS does not repeat itself"
        );
    }
    assert!(
        any_different,
        "every step through {} gave the gemm crate's bits: its products were not used",
        path.display()
    );

    // Turned off, the products are the gemm crate's again, bit for bit.
    set_blas_products(false);
    assert_eq!(blas_in_use(), None);
    let off = step(&runs[0].0, runs[0].1.clone(), CACHED, true);
    assert!(
        identical(&off, &gemm[0]),
        "turned off, the gemm crate's bits"
    );
    set_blas_products(true);
}

/// The binary with `GRADCACHE_BLAS` set: it says which library runs the products, and its
/// embeddings are the gemm crate's to float rounding.
#[test]
fn the_binary_encodes_through_the_blas_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("plain-bert");
    common::write_bert_dir(&model, common::TINY_BERT, false);
    let blas = openblas();
    let encode = |blas: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gradcache"))
            .args(["encode", "--model", &model.display().to_string()])
            .args(["--text", "the lord is my shepherd", "--text", "light"])
            .env("GRADCACHE_BLAS", blas)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let rows: Vec<Vec<f64>> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                serde_json::from_value(v["embedding"].clone()).unwrap()
            })
            .collect();
        (rows, stderr)
    };
    let (plain, log) = encode("");
    assert!(!log.contains("products through the BLAS"), "{log}");
    let (through, log) = encode(&blas.display().to_string());
    assert!(
        log.contains(&format!("products through the BLAS at {}", blas.display())),
        "{log}"
    );
    assert_eq!(plain.len(), 2);
    for (a, b) in plain.iter().zip(&through) {
        assert_eq!(a.len(), b.len());
        let err = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(err <= 1e-5, "embeddings differ by {err:e}");
    }
}
