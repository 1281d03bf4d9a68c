//! Compiles the CUDA kernels of `src/nn/cuda/*.cu` to PTX with nvcc when the `cuda`
//! feature is on (candle's own kernels are built the same way); without it, nothing.
//!
//! The PTX is embedded in the binary (`include_str!` from `OUT_DIR`) and loaded by the
//! driver at the first launch, which compiles it for the GPU at hand: one build serves
//! every GPU from `CUDA_COMPUTE_CAP` (default 80, Ampere) on. A kernel that does not
//! compile fails the build, on any machine with nvcc, GPU or not (CI compiles them in
//! `scripts/check-cuda`). nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc` (or `$CUDA_PATH`),
//! else the one on `PATH`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let dir = Path::new("src/nn/cuda");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = nvcc();
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("src/nn/cuda exists")
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu" || e == "cuh"))
        .collect();
    sources.sort();
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    for source in sources
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
    {
        let stem = source.file_stem().expect("a file name").to_string_lossy();
        let ptx = out.join(format!("{stem}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-I")
            .arg(dir)
            .arg("-o")
            .arg(&ptx)
            .arg(source)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run nvcc ({}): {e}; the `cuda` feature compiles the kernels of \
                     src/nn/cuda with it (set NVCC or CUDA_HOME, or see scripts/cuda-env)",
                    nvcc.display()
                )
            });
        if !status.success() {
            panic!("nvcc could not compile {} ({status})", source.display());
        }
    }
}

/// The nvcc to run: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, or `nvcc`.
fn nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let candidate = Path::new(&root).join("bin/nvcc");
            if candidate.exists() {
                return candidate;
            }
        }
    }
    "nvcc".into()
}
