// The optimiser's updates on the GPU (src/train/optim.rs): AdamW's moments and weights,
// and SGD, each one pass over a parameter in f32. The arithmetic is the CPU kernels' in
// the same order with every product and sum rounded on its own (`__fmul_rn` and kin are
// never fused into an FMA), so an update gives the CPU's bits.
#include "common.cuh"

// `[m'; v']` from `[m; v]` and the gradient: `m' = b1 m + (1 - b1) g`,
// `v' = b2 v + (1 - b2) g^2`.
extern "C" __global__ void adamw_moments(const float *mv, const float *g, float *out, size_t n,
                                         float b1, float b2, float c1, float c2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = g[i];
        out[i] = __fadd_rn(__fmul_rn(mv[i], b1), __fmul_rn(gi, c1));
        out[n + i] = __fadd_rn(__fmul_rn(mv[n + i], b2), __fmul_rn(__fmul_rn(gi, gi), c2));
    }
}

// The weight from the new moments, in place:
// `w' = w decay - lr (m / mc) / (sqrt(v / vc) + eps)` (`decay` applied when `decays`).
extern "C" __global__ void adamw_weights(float *w, const float *mv, size_t n, float lr, float eps,
                                         float mc, float vc, float decay, int decays) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float decayed = decays ? __fmul_rn(w[i], decay) : w[i];
        const float update =
            __fdiv_rn(__fdiv_rn(mv[i], mc), __fadd_rn(__fsqrt_rn(__fdiv_rn(mv[n + i], vc)), eps));
        w[i] = __fsub_rn(decayed, __fmul_rn(update, lr));
    }
}

// `w -= lr g`, in place.
extern "C" __global__ void sgd(float *w, const float *g, size_t n, float lr) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        w[i] = __fsub_rn(w[i], __fmul_rn(g[i], lr));
}
