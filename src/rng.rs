//! Explicit, portable randomness.
//!
//! candle's CPU device cannot be seeded and its CUDA generator starts every process from
//! the same default seed, so nothing in `gradcache` draws from a device RNG. Every random
//! tensor (dropout masks, fresh weights) is a pure function of a 64-bit seed: the seed
//! is derived from a tuple of integers with [`derive_seed`], and the values are drawn
//! from a ChaCha8 stream on the host.

use candle_core::{DType, Device, Shape, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::Result;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser: a bijective 64-bit mixer (Steele et al., 2014).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes an ordered tuple of words into one seed. Order matters: `[1, 2]` and `[2, 1]`
/// give different seeds, and so do tuples of different lengths.
pub fn derive_seed(words: &[u64]) -> u64 {
    let mut h = mix64(words.len() as u64 ^ GOLDEN);
    for (i, &w) in words.iter().enumerate() {
        h = mix64(h ^ mix64(w.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN))));
    }
    h
}

/// A stable 64-bit hash of a string (FNV-1a), for deriving seeds from parameter names.
/// Unlike `std`'s hasher it is fixed across Rust versions and platforms.
pub fn hash_str(s: &str) -> u64 {
    hash_bytes(FNV_OFFSET, s.as_bytes())
}

/// The FNV-1a offset basis: the state [`hash_bytes`] starts from.
pub const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

/// Continues an FNV-1a hash from state `hash` over `bytes` (start from [`FNV_OFFSET`]), so
/// that a long sequence can be hashed piece by piece.
pub fn hash_bytes(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn tensor_from_fn(
    seed: u64,
    shape: &Shape,
    dtype: DType,
    device: &Device,
    mut draw: impl FnMut(&mut ChaCha8Rng) -> f32,
) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let values: Vec<f32> = (0..shape.elem_count()).map(|_| draw(&mut rng)).collect();
    Ok(Tensor::from_vec(values, shape.clone(), device)?.to_dtype(dtype)?)
}

/// Uniform values in `[lo, up)` drawn from the stream of `seed`.
pub fn uniform(
    seed: u64,
    lo: f64,
    up: f64,
    shape: &Shape,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    tensor_from_fn(seed, shape, dtype, device, |rng| {
        (lo + (up - lo) * rng.random::<f64>()) as f32
    })
}

/// Normal values with the given mean and standard deviation drawn from the stream of `seed`.
pub fn normal(
    seed: u64,
    mean: f64,
    std: f64,
    shape: &Shape,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    tensor_from_fn(seed, shape, dtype, device, |rng| {
        let z: f64 = StandardNormal.sample(rng);
        (mean + std * z) as f32
    })
}

/// Whether element `index` survives dropout with probability `p` under the mask of `seed`:
/// a counter-based stream (SplitMix64: output `index / 2` of the generator started at
/// `seed`, whose two 32-bit halves serve two neighbouring elements), so any element's draw
/// is computed directly, in any order, on any thread, and the fused kernel and the mask
/// tensor agree bit for bit.
#[inline]
pub fn keep(seed: u64, index: u64, p: f32) -> bool {
    let z = splitmix(seed, index / 2);
    let half = if index.is_multiple_of(2) {
        high(z)
    } else {
        low(z)
    };
    half >= threshold(p)
}

/// [`keep`] for the `len` elements from `start` on, as `f(j, kept)` for `j` in `0..len`:
/// one generator output per two elements (where [`keep`] computes it for each).
#[inline]
pub fn keep_run(seed: u64, start: u64, len: usize, p: f32, mut f: impl FnMut(usize, bool)) {
    let t = threshold(p);
    let mut j = 0;
    if start % 2 == 1 && len > 0 {
        f(0, keep(seed, start, p));
        j = 1;
    }
    // Eight outputs at a time in a loop of its own, which the compiler vectorises.
    const LANES: usize = 8;
    while j + 2 * LANES <= len {
        let first = (start + j as u64) / 2;
        let mut z = [0u64; LANES];
        for (k, z) in z.iter_mut().enumerate() {
            *z = splitmix(seed, first + k as u64);
        }
        for (k, &z) in z.iter().enumerate() {
            f(j + 2 * k, high(z) >= t);
            f(j + 2 * k + 1, low(z) >= t);
        }
        j += 2 * LANES;
    }
    while j + 1 < len {
        let z = splitmix(seed, (start + j as u64) / 2);
        f(j, high(z) >= t);
        f(j + 1, low(z) >= t);
        j += 2;
    }
    if j < len {
        f(j, keep(seed, start + j as u64, p));
    }
}

/// Output `n` of SplitMix64 started at `seed`.
#[inline(always)]
fn splitmix(seed: u64, n: u64) -> u64 {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = seed.wrapping_add(n.wrapping_add(1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The even element's 24 random bits.
#[inline(always)]
fn high(z: u64) -> u32 {
    (z >> 40) as u32
}

/// The odd element's 24 random bits.
#[inline(always)]
fn low(z: u64) -> u32 {
    ((z >> 8) & 0xFF_FFFF) as u32
}

/// An element survives when its 24 bits `h`, read as the uniform f32 `u = h / 2^24`, have
/// `u >= p`; `u` and `p * 2^24` are exact, so that is `h >= ceil(p * 2^24)`.
#[inline(always)]
fn threshold(p: f32) -> u32 {
    (f64::from(p) * f64::from(1u32 << 24)).ceil() as u32
}

/// A dropout mask: each element is `0` with probability `p` and `1 / (1 - p)` otherwise
/// (inverted dropout, so the expectation is 1 and evaluation needs no rescaling). Element
/// `i` (row-major) is kept when [`keep`]`(seed, i, p)`.
pub fn dropout_mask(
    seed: u64,
    p: f32,
    shape: &Shape,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    // The scale as the fused kernel computes it, so the two agree bit for bit.
    let scale = (1.0 / (1.0 - f64::from(p))) as f32;
    let mut values = vec![0f32; shape.elem_count()];
    keep_run(seed, 0, values.len(), p, |j, kept| {
        if kept {
            values[j] = scale;
        }
    });
    Ok(Tensor::from_vec(values, shape.clone(), device)?.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_run_agrees_with_keep_and_the_float_comparison() {
        for p in [0.0f32, 0.1, 0.25, 0.5, 0.9, 1.0 / 3.0] {
            for (start, len) in [(0u64, 64usize), (1, 64), (7, 33), (4096, 1), (5, 0)] {
                let mut seen = 0;
                keep_run(42, start, len, p, |j, kept| {
                    let i = start + j as u64;
                    assert_eq!(kept, keep(42, i, p), "p {p}, element {i}");
                    // The integer threshold is the comparison `u >= p` of the uniform f32.
                    let z = splitmix(42, i / 2);
                    let h = if i.is_multiple_of(2) { high(z) } else { low(z) };
                    let u = h as f32 * (1.0 / (1u64 << 24) as f32);
                    assert_eq!(kept, u >= p, "p {p}, element {i}");
                    assert_eq!(j, seen);
                    seen += 1;
                });
                assert_eq!(seen, len);
            }
        }
        // At the threshold itself: h = ceil(p * 2^24) survives, h - 1 does not.
        let p = 0.1f32;
        let t = threshold(p);
        assert!((t as f32) / (1u64 << 24) as f32 >= p);
        assert!(((t - 1) as f32) / ((1u64 << 24) as f32) < p);
    }

    #[test]
    fn derive_seed_is_order_and_length_sensitive() {
        let a = derive_seed(&[1, 2, 3]);
        assert_eq!(a, derive_seed(&[1, 2, 3]));
        assert_ne!(a, derive_seed(&[3, 2, 1]));
        assert_ne!(a, derive_seed(&[1, 2, 3, 0]));
        assert_ne!(derive_seed(&[0]), derive_seed(&[0, 0]));
    }

    #[test]
    fn dropout_mask_has_the_requested_rate_and_scale() -> Result<()> {
        let shape = Shape::from((200, 100));
        let mask = dropout_mask(7, 0.25, &shape, DType::F32, &Device::Cpu)?;
        let v = mask.flatten_all()?.to_vec1::<f32>()?;
        let zeros = v.iter().filter(|&&x| x == 0.0).count() as f64 / v.len() as f64;
        assert!((zeros - 0.25).abs() < 0.02, "drop rate {zeros}");
        assert!(v.iter().all(|&x| x == 0.0 || x == 1.0 / 0.75));
        Ok(())
    }
}
