// What every kernel of src/nn/cuda shares: loads and stores that widen half floats to
// f32, the dropout mask of crate::rng::keep bit for bit, and block reductions.
//
// Every kernel exists once per element type, named `<kernel>_<type>` (f32, bf16, f16):
// the launchers in mod.rs pick the name from the tensor's dtype. Arithmetic is f32
// whatever the storage type (the statistics of a norm, a softmax's sums, GELU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const f16 *p) { return __half2float(*p); }

__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(f16 *p, float v) { *p = __float2half_rn(v); }

// crate::rng::splitmix: output `n` of SplitMix64 started at `seed`.
__device__ __forceinline__ uint64_t splitmix(uint64_t seed, uint64_t n) {
    uint64_t z = seed + (n + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// crate::rng::keep: element `index` survives when its 24 random bits (the high half of
// the generator's output `index / 2` for an even index, the low half for an odd one)
// reach `threshold` = ceil(p * 2^24). A threshold of 0 keeps everything.
__device__ __forceinline__ bool keep(uint64_t seed, uint64_t index, uint32_t threshold) {
    uint64_t z = splitmix(seed, index >> 1);
    uint32_t bits = (index & 1ull) ? (uint32_t)((z >> 8) & 0xFFFFFFull) : (uint32_t)(z >> 40);
    return bits >= threshold;
}

// The dropout factor of element `index`: `scale` (= 1 / (1 - p), rounded to f32 as the
// CPU kernels round it) where kept, 0 where dropped; 1 without dropout (threshold 0).
__device__ __forceinline__ float drop_factor(uint64_t seed, uint64_t index, uint32_t threshold,
                                             float scale) {
    if (threshold == 0u) return 1.0f;
    return keep(seed, index, threshold) ? scale : 0.0f;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), returned to
// every thread; `scratch` holds 32 floats of shared memory. The order of the additions is
// fixed by the block size alone, so a result does not change from run to run.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (lane < warps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Instantiates `KERNEL(name, type)` for every element type.
#define FOR_TYPES(KERNEL) KERNEL(f32, float) KERNEL(bf16, bf16) KERNEL(f16, f16)
