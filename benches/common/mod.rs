//! What the benches share.

/// The CPU's model name and vendor, from `/proc/cpuinfo` (`unknown` elsewhere): every
/// figure names the CPU it comes from.
#[allow(dead_code)] // Each bench uses a part of this module.
pub fn cpu() -> (String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    };
    (field("model name"), field("vendor_id"))
}

/// `rows` sequences of `len` token ids drawn from the seed in `[low, high)`, no padding.
#[allow(dead_code)] // Each bench uses a part of this module.
pub fn random_tokens(
    seed: u64,
    (rows, len): (usize, usize),
    (low, high): (usize, usize),
) -> anyhow::Result<gradcache::TokenBatch> {
    use candle_core::{DType, Device, Tensor};
    let noise = gradcache::rng::uniform(
        seed,
        low as f64,
        high as f64,
        &(rows, len).into(),
        DType::F32,
        &Device::Cpu,
    )?;
    let mask = Tensor::ones((rows, len), DType::U32, &Device::Cpu)?;
    Ok(gradcache::TokenBatch::new(
        noise.to_dtype(DType::U32)?,
        mask.clone(),
        mask.zeros_like()?,
    )?)
}
