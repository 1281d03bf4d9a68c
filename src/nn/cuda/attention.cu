// Attention kernels of the GPU layer nodes (src/nn/gpu): the scaled, masked softmax of
// the scores with dropout on the probabilities, its backward, and the moves between the
// packed projections `[n s, width]` and the heads `[n, heads, s, d]` that the batched
// products take. CPU reference forms: src/nn/cpu/reference.rs.
#include "common.cuh"

// Whether query `q` sees key `k` under a decoder's pattern (`causal`: k <= q, and with a
// window w >= 0 also q - k <= w; else a window keeps |q - k| <= w; no window: every key).
__device__ __forceinline__ bool sees(int q, int k, int causal, int window) {
    if (causal) return k <= q && (window < 0 || q - k <= window);
    return window < 0 || abs(q - k) <= window;
}

// One warp per row of scores `[n, heads, s, s]` (rows = n heads s): `z = scale x +
// key_bias[b, k] (+ score_bias[head, q, k]) (- 10000 where the pattern hides the key)`,
// `p = softmax(z)` into `probs`, and, with dropout, `p * mask * scale` into `dropped` (the
// mask of each element's index in the scores, from the stored probability, so the
// backward regenerates the same values).
#define SOFTMAX_FWD(name, T)                                                                    \
    extern "C" __global__ void softmax_fwd_##name(                                              \
        const T *scores, const float *key_bias, const float *score_bias, T *probs, T *dropped,  \
        int rows, int s, int heads, float scale, unsigned long long seed,                       \
        unsigned int threshold, float keep_scale, int causal, int window) {                     \
        const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;                           \
        const int lane = threadIdx.x & 31;                                                      \
        if (row >= rows) return;                                                                \
        const int b = row / (heads * s);                                                        \
        const int q = row % s;                                                                  \
        const int head = (row / s) % heads;                                                     \
        const size_t base = (size_t)row * s;                                                    \
        const float *kb = key_bias + (size_t)b * s;                                             \
        const float *sb = score_bias ? score_bias + ((size_t)head * s + q) * s : nullptr;       \
        float mx = -INFINITY;                                                                   \
        for (int k = lane; k < s; k += 32) {                                                    \
            float z = __fmul_rn(scale, ld(scores + base + k)) + kb[k];                          \
            if (sb) z += sb[k];                                                                 \
            if (!sees(q, k, causal, window)) z -= 10000.0f;                                     \
            mx = fmaxf(mx, z);                                                                  \
        }                                                                                       \
        mx = warp_max(mx);                                                                      \
        float total = 0.0f;                                                                     \
        for (int k = lane; k < s; k += 32) {                                                    \
            float z = __fmul_rn(scale, ld(scores + base + k)) + kb[k];                          \
            if (sb) z += sb[k];                                                                 \
            if (!sees(q, k, causal, window)) z -= 10000.0f;                                     \
            total += expf(z - mx);                                                              \
        }                                                                                       \
        const float inv = 1.0f / warp_sum(total);                                               \
        for (int k = lane; k < s; k += 32) {                                                    \
            float z = __fmul_rn(scale, ld(scores + base + k)) + kb[k];                          \
            if (sb) z += sb[k];                                                                 \
            if (!sees(q, k, causal, window)) z -= 10000.0f;                                     \
            st(probs + base + k, expf(z - mx) * inv);                                           \
            if (dropped) {                                                                      \
                const float p = ld(probs + base + k);                                           \
                st(dropped + base + k,                                                          \
                   __fmul_rn(p, drop_factor(seed, base + k, threshold, keep_scale)));           \
            }                                                                                   \
        }                                                                                       \
    }
FOR_TYPES(SOFTMAX_FWD)

// The backward, one warp per row: `dp = d * mask * scale` (the gradient `d` of the dropped
// probabilities; of the probabilities themselves without dropout), then
// `dz = p (dp - sum(p dp))`, the gradient of the logits `z` (not yet times the scale).
#define SOFTMAX_BWD(name, T)                                                                    \
    extern "C" __global__ void softmax_bwd_##name(                                              \
        const T *probs, const T *d, T *dz, int rows, int s, unsigned long long seed,            \
        unsigned int threshold, float keep_scale) {                                             \
        const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;                           \
        const int lane = threadIdx.x & 31;                                                      \
        if (row >= rows) return;                                                                \
        const size_t base = (size_t)row * s;                                                    \
        float dot = 0.0f;                                                                       \
        for (int k = lane; k < s; k += 32) {                                                    \
            const float dp =                                                                    \
                __fmul_rn(ld(d + base + k), drop_factor(seed, base + k, threshold, keep_scale)); \
            dot += ld(probs + base + k) * dp;                                                   \
        }                                                                                       \
        dot = warp_sum(dot);                                                                    \
        for (int k = lane; k < s; k += 32) {                                                    \
            const float dp =                                                                    \
                __fmul_rn(ld(d + base + k), drop_factor(seed, base + k, threshold, keep_scale)); \
            st(dz + base + k, ld(probs + base + k) * (dp - dot));                               \
        }                                                                                       \
    }
FOR_TYPES(SOFTMAX_BWD)

// Columns `first .. first + heads d` of `src` `[n s, width]`, plus `bias[first + c]` when
// given, as heads `dst` `[n, heads, s, d]`: one thread per element of `dst`.
#define TO_HEADS(name, T)                                                                       \
    extern "C" __global__ void to_heads_##name(const T *src, const T *bias, T *dst, int s,      \
                                               int heads, int d, int width, int first,          \
                                               size_t total) {                                  \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const int e = (int)(i % d);                                                         \
            const int t = (int)((i / d) % s);                                                   \
            const size_t bh = i / ((size_t)d * s);                                              \
            const int head = (int)(bh % heads);                                                 \
            const size_t b = bh / heads;                                                        \
            const int c = first + head * d + e;                                                 \
            float v = ld(src + (b * s + t) * width + c);                                        \
            if (bias) v += ld(bias + c);                                                        \
            st(dst + i, v);                                                                     \
        }                                                                                       \
    }
FOR_TYPES(TO_HEADS)

// Heads `src` `[n, heads, s, d]` times `mult` into columns `first .. first + heads d` of
// `dst` `[n s, width]`: one thread per element of `src`.
#define FROM_HEADS(name, T)                                                                     \
    extern "C" __global__ void from_heads_##name(const T *src, T *dst, int s, int heads, int d, \
                                                 int width, int first, float mult,              \
                                                 size_t total) {                                \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const int e = (int)(i % d);                                                         \
            const int t = (int)((i / d) % s);                                                   \
            const size_t bh = i / ((size_t)d * s);                                              \
            const int head = (int)(bh % heads);                                                 \
            const size_t b = bh / heads;                                                        \
            const float v = ld(src + i);                                                        \
            st(dst + (b * s + t) * width + first + head * d + e,                                \
               mult == 1.0f ? v : __fmul_rn(v, mult));                                          \
        }                                                                                       \
    }
FOR_TYPES(FROM_HEADS)

// Rotary position embedding of `x` `[n, heads, s, d]`: each token's row of the tables
// `cos`, `sin` `[positions, d]` (f32) is its position `pos[b s + t]`; `y = x cos +
// rotate_half(x) sin`, `rotate_half([u, v]) = [-v, u]` over the two halves of d.
#define ROTARY_FWD(name, T)                                                                     \
    extern "C" __global__ void rotary_fwd_##name(const T *x, const float *cos_t,              \
                                                 const float *sin_t, const unsigned int *pos,   \
                                                 T *y, int s, int heads, int d, size_t total) { \
        const int half = d / 2;                                                                 \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const int e = (int)(i % d);                                                         \
            const int t = (int)((i / d) % s);                                                   \
            const size_t b = i / ((size_t)d * s * heads);                                       \
            const size_t row = (size_t)pos[b * s + t] * d;                                      \
            const float other = e < half ? -ld(x + i + half) : ld(x + i - half);                \
            st(y + i, __fmul_rn(ld(x + i), cos_t[row + e]) + __fmul_rn(other, sin_t[row + e]));  \
        }                                                                                       \
    }
FOR_TYPES(ROTARY_FWD)

// Its backward, times `mult`: `dx_u = dy_u cos_u + dy_v sin_v`, `dx_v = dy_v cos_v -
// dy_u sin_u` (u the first half of d, v the second, index by index).
#define ROTARY_BWD(name, T)                                                                     \
    extern "C" __global__ void rotary_bwd_##name(const T *dy, const float *cos_t,             \
                                                 const float *sin_t, const unsigned int *pos,   \
                                                 T *dx, int s, int heads, int d, float mult,    \
                                                 size_t total) {                                \
        const int half = d / 2;                                                                 \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const int e = (int)(i % d);                                                         \
            const int t = (int)((i / d) % s);                                                   \
            const size_t b = i / ((size_t)d * s * heads);                                       \
            const size_t row = (size_t)pos[b * s + t] * d;                                      \
            float v;                                                                            \
            if (e < half)                                                                       \
                v = ld(dy + i) * cos_t[row + e] + ld(dy + i + half) * sin_t[row + e + half];    \
            else                                                                                \
                v = ld(dy + i) * cos_t[row + e] - ld(dy + i - half) * sin_t[row + e - half];    \
            st(dx + i, mult * v);                                                               \
        }                                                                                       \
    }
FOR_TYPES(ROTARY_BWD)
