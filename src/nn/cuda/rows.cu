// Row kernels of the GPU layer nodes (src/nn/gpu): the residual block's tail
// `LayerNorm(dropout(x + bias) + residual)` forward and backward, the feed-forward
// activation with its bias, dropout, and column sums (bias and norm-parameter gradients)
// in a fixed order. Their CPU reference forms are src/nn/cpu/reference.rs; the launchers
// src/nn/cuda/mod.rs.
//
// Shapes are row-major `[rows, width]`. Dropout masks are those of crate::rng::keep at
// each element's row-major index, as on the CPU.
#include "common.cuh"

// `(v - mean) rstd gamma + beta`, every step rounded on its own (no FMA), so that the
// forward and NORM_APPLY give the same bits from the same sum and statistics.
__device__ __forceinline__ float normalized(float v, float mean, float rstd, float gamma,
                                            float beta) {
    const float xhat = __fmul_rn(__fsub_rn(v, mean), rstd);
    return __fadd_rn(__fmul_rn(xhat, gamma), beta);
}

// LayerNorm(dropout(x + bias) + residual) of one row per block (blockDim.x a multiple of
// 32). `bias` and `residual` may be null (a plain LayerNorm of x); `sum_out` (the
// normalised sum, kept for the backward) may be null. `stats` gets (mean, 1 / sqrt(var + eps)) of each row. gamma and beta are f32.
#define ADD_NORM_FWD(name, T)                                                                   \
    extern "C" __global__ void add_norm_fwd_##name(                                             \
        const T *x, const T *bias, const T *residual, const float *gamma, const float *beta,    \
        T *y, float *sum_out, float *stats, int width, float eps, unsigned long long seed,      \
        unsigned int threshold, float scale) {                                                  \
        __shared__ float scratch[32];                                                           \
        const size_t row = blockIdx.x;                                                          \
        const size_t base = row * (size_t)width;                                                \
        float acc = 0.0f;                                                                       \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            float v = ld(x + base + j);                                                         \
            if (bias) v += ld(bias + j);                                                        \
            v = __fmul_rn(v, drop_factor(seed, base + j, threshold, scale)) + (residual ? ld(residual + base + j) : 0.0f); \
            if (sum_out) sum_out[base + j] = v;                                                 \
            acc += v;                                                                           \
        }                                                                                       \
        const float mean = block_sum(acc, scratch) / (float)width;                              \
        acc = 0.0f;                                                                             \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            float v = ld(x + base + j);                                                         \
            if (bias) v += ld(bias + j);                                                        \
            v = __fmul_rn(v, drop_factor(seed, base + j, threshold, scale)) + (residual ? ld(residual + base + j) : 0.0f); \
            acc += (v - mean) * (v - mean);                                                     \
        }                                                                                       \
        const float var = block_sum(acc, scratch) / (float)width;                               \
        const float rstd = rsqrtf(var + eps);                                                   \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            float v = ld(x + base + j);                                                         \
            if (bias) v += ld(bias + j);                                                        \
            v = __fmul_rn(v, drop_factor(seed, base + j, threshold, scale)) + (residual ? ld(residual + base + j) : 0.0f); \
            st(y + base + j, normalized(v, mean, rstd, gamma[j], beta[j]));                     \
        }                                                                                       \
        if (threadIdx.x == 0) {                                                                 \
            stats[2 * row] = mean;                                                              \
            stats[2 * row + 1] = rstd;                                                          \
        }                                                                                       \
    }
FOR_TYPES(ADD_NORM_FWD)

// The normalised rows again from the kept sum and statistics: `y = xhat gamma + beta`
// (the backward's input of the next product, when the forward did not keep it).
#define NORM_APPLY(name, T)                                                                     \
    extern "C" __global__ void norm_apply_##name(const float *sum, const float *stats,         \
                                                 const float *gamma, const float *beta, T *y,   \
                                                 int width, size_t total) {                     \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const size_t row = i / width;                                                       \
            const int j = (int)(i % width);                                                     \
            st(y + i, normalized(sum[i], stats[2 * row], stats[2 * row + 1], gamma[j], beta[j])); \
        }                                                                                       \
    }
FOR_TYPES(NORM_APPLY)

// The backward of ADD_NORM_FWD, one row per block: from `dy` the gradient of the sum
// under the norm, `dsum = rstd (dy gamma - mean(dy gamma) - xhat mean(dy gamma xhat))`
// (the residual's gradient), and `dpre = dsum * mask * scale` (the gradient of
// `x + bias`; not written without dropout, where it is `dsum`).
#define ADD_NORM_BWD(name, T)                                                                   \
    extern "C" __global__ void add_norm_bwd_##name(                                             \
        const T *dy, const float *sum, const float *stats, const float *gamma, T *dsum,         \
        T *dpre, int width, unsigned long long seed, unsigned int threshold, float scale) {     \
        __shared__ float scratch[32];                                                           \
        const size_t row = blockIdx.x;                                                          \
        const size_t base = row * (size_t)width;                                                \
        const float mean = stats[2 * row], rstd = stats[2 * row + 1];                           \
        float a = 0.0f, b = 0.0f;                                                               \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            const float g = ld(dy + base + j) * gamma[j];                                       \
            a += g;                                                                             \
            b += g * (sum[base + j] - mean) * rstd;                                             \
        }                                                                                       \
        const float mean_g = block_sum(a, scratch) / (float)width;                              \
        const float mean_gx = block_sum(b, scratch) / (float)width;                             \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            const float xhat = (sum[base + j] - mean) * rstd;                                   \
            const float d = rstd * (ld(dy + base + j) * gamma[j] - mean_g - xhat * mean_gx);    \
            st(dsum + base + j, d);                                                             \
            if (threshold) st(dpre + base + j, d * drop_factor(seed, base + j, threshold, scale)); \
        }                                                                                       \
    }
FOR_TYPES(ADD_NORM_BWD)

// Partial column sums over `rows_per_chunk` rows at a time, in row order: thread (chunk
// c = blockIdx.y, column j) sums x[r, j] for r in chunk c into partial[c, j]. A second
// pass over the partials (COLUMN_SUMS on f32 with one chunk) finishes the sum, so every
// column's additions have one fixed order.
#define COLUMN_SUMS(name, T)                                                                    \
    extern "C" __global__ void column_sums_##name(const T *x, float *partial, int rows,        \
                                                  int width, int rows_per_chunk) {              \
        const int j = blockIdx.x * blockDim.x + threadIdx.x;                                    \
        if (j >= width) return;                                                                 \
        const int first = blockIdx.y * rows_per_chunk;                                          \
        const int last = min(rows, first + rows_per_chunk);                                     \
        float acc = 0.0f;                                                                       \
        for (int r = first; r < last; ++r) acc += ld(x + (size_t)r * width + j);                \
        partial[(size_t)blockIdx.y * width + j] = acc;                                          \
    }
FOR_TYPES(COLUMN_SUMS)

// The norm parameters' partial gradients, as COLUMN_SUMS: `dgamma = sum_r dy xhat` into
// partial[c, j] and `dbeta = sum_r dy` into partial[chunks + c, j].
#define NORM_PARAM_SUMS(name, T)                                                                \
    extern "C" __global__ void norm_param_sums_##name(const T *dy, const float *sum,           \
                                                      const float *stats, float *partial,       \
                                                      int rows, int width, int rows_per_chunk) { \
        const int j = blockIdx.x * blockDim.x + threadIdx.x;                                    \
        if (j >= width) return;                                                                 \
        const int first = blockIdx.y * rows_per_chunk;                                          \
        const int last = min(rows, first + rows_per_chunk);                                     \
        float dg = 0.0f, db = 0.0f;                                                             \
        for (int r = first; r < last; ++r) {                                                    \
            const size_t i = (size_t)r * width + j;                                             \
            const float d = ld(dy + i);                                                         \
            dg += d * (sum[i] - stats[2 * r]) * stats[2 * r + 1];                               \
            db += d;                                                                            \
        }                                                                                       \
        partial[(size_t)blockIdx.y * width + j] = dg;                                           \
        partial[((size_t)gridDim.y + blockIdx.y) * width + j] = db;                             \
    }
FOR_TYPES(NORM_PARAM_SUMS)

// The activations of crate::nn::Act: 0 GELU (erf), 1 GELU (tanh), 2 ReLU, 3 SiLU.
__device__ __forceinline__ float act_value(int act, float x) {
    switch (act) {
    case 0: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case 1: {
        const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(u));
    }
    case 2: return x > 0.0f ? x : 0.0f;
    default: return x / (1.0f + expf(-x));
    }
}

__device__ __forceinline__ float act_slope(int act, float x) {
    switch (act) {
    case 0: {
        const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        const float pdf = 0.3989422804014327f * expf(-0.5f * x * x);
        return cdf + x * pdf;
    }
    case 1: {
        const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        const float t = tanhf(u);
        const float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    }
    case 2: return x > 0.0f ? 1.0f : 0.0f;
    default: {
        const float s = 1.0f / (1.0f + expf(-x));
        return s * (1.0f + x * (1.0f - s));
    }
    }
}

// `pre = u + bias` (kept for the backward) and `g = act(pre)`, over `[rows, width]`.
#define BIAS_ACT_FWD(name, T)                                                                   \
    extern "C" __global__ void bias_act_fwd_##name(const T *u, const T *bias, T *pre, T *g,    \
                                                   int width, size_t total, int act) {         \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const float p = ld(u + i) + ld(bias + i % width);                                   \
            st(pre + i, p);                                                                     \
            st(g + i, act_value(act, ld(pre + i)));                                             \
        }                                                                                       \
    }
FOR_TYPES(BIAS_ACT_FWD)

// `g = act(pre)` (the activation again in the backward, for the down product's weight).
#define ACT_FWD(name, T)                                                                        \
    extern "C" __global__ void act_fwd_##name(const T *pre, T *g, size_t total, int act) {     \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x)                                               \
            st(g + i, act_value(act, ld(pre + i)));                                             \
    }
FOR_TYPES(ACT_FWD)

// `dpre = dg * act'(pre)`.
#define ACT_BWD(name, T)                                                                        \
    extern "C" __global__ void act_bwd_##name(const T *dg, const T *pre, T *dpre, size_t total, \
                                              int act) {                                        \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x)                                               \
            st(dpre + i, ld(dg + i) * act_slope(act, ld(pre + i)));                             \
    }
FOR_TYPES(ACT_BWD)

// Inverted dropout, `y = x * mask * scale`, element i of the masked tensor being
// element `offset + i`.
#define DROPOUT(name, T)                                                                        \
    extern "C" __global__ void dropout_##name(const T *x, T *y, size_t total,                  \
                                              unsigned long long offset,                        \
                                              unsigned long long seed, unsigned int threshold,  \
                                              float scale) {                                    \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x)                                               \
            st(y + i, ld(x + i) * drop_factor(seed, offset + i, threshold, scale));             \
    }
FOR_TYPES(DROPOUT)

// RMSNorm of one row per block: `y = x r (offset + w)`, `r = 1 / sqrt(mean(x^2) + eps)`
// (the normalised row, then the scale, as transformers multiplies); `rstd` gets r. w is f32.
#define RMS_FWD(name, T)                                                                        \
    extern "C" __global__ void rms_fwd_##name(const T *x, const float *w, T *y, float *rstd,    \
                                              int width, float eps, float offset) {             \
        __shared__ float scratch[32];                                                           \
        const size_t base = (size_t)blockIdx.x * width;                                         \
        float acc = 0.0f;                                                                       \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            const float v = ld(x + base + j);                                                   \
            acc += v * v;                                                                       \
        }                                                                                       \
        const float r = rsqrtf(block_sum(acc, scratch) / (float)width + eps);                   \
        for (int j = threadIdx.x; j < width; j += blockDim.x)                                   \
            st(y + base + j, __fmul_rn(__fmul_rn(ld(x + base + j), r), offset + w[j]));         \
        if (threadIdx.x == 0) rstd[blockIdx.x] = r;                                             \
    }
FOR_TYPES(RMS_FWD)

// The backward of RMS_FWD, one row per block: with `g = dy (offset + w)`,
// `dx = r (g - x r^2 mean(g x))`.
#define RMS_BWD(name, T)                                                                        \
    extern "C" __global__ void rms_bwd_##name(const T *dy, const T *x, const float *rstd,       \
                                              const float *w, T *dx, int width, float offset) { \
        __shared__ float scratch[32];                                                           \
        const size_t base = (size_t)blockIdx.x * width;                                         \
        const float r = rstd[blockIdx.x];                                                       \
        float acc = 0.0f;                                                                       \
        for (int j = threadIdx.x; j < width; j += blockDim.x)                                   \
            acc += ld(dy + base + j) * (offset + w[j]) * ld(x + base + j);                      \
        const float mean_gx = block_sum(acc, scratch) / (float)width;                           \
        for (int j = threadIdx.x; j < width; j += blockDim.x) {                                 \
            const float g = ld(dy + base + j) * (offset + w[j]);                                \
            const float v = ld(x + base + j);                                                   \
            st(dx + base + j, r * (g - v * r * r * mean_gx));                                   \
        }                                                                                       \
    }
FOR_TYPES(RMS_BWD)

// RMSNorm's weight gradient in partial column sums (as COLUMN_SUMS):
// `sum_r dy[r, j] x[r, j] rstd[r]` into partial[c, j].
#define RMS_PARAM_SUMS(name, T)                                                                 \
    extern "C" __global__ void rms_param_sums_##name(const T *dy, const T *x, const float *rstd, \
                                                     float *partial, int rows, int width,       \
                                                     int rows_per_chunk) {                      \
        const int j = blockIdx.x * blockDim.x + threadIdx.x;                                    \
        if (j >= width) return;                                                                 \
        const int first = blockIdx.y * rows_per_chunk;                                          \
        const int last = min(rows, first + rows_per_chunk);                                     \
        float acc = 0.0f;                                                                       \
        for (int r = first; r < last; ++r) {                                                    \
            const size_t i = (size_t)r * width + j;                                             \
            acc += ld(dy + i) * ld(x + i) * rstd[r];                                            \
        }                                                                                       \
        partial[(size_t)blockIdx.y * width + j] = acc;                                          \
    }
FOR_TYPES(RMS_PARAM_SUMS)

// The gated unit over `up` `[rows, 2 width]` (the gate's columns, then the up
// projection's): `out = act(gate) up`, `[rows, width]`.
#define GLU_FWD(name, T)                                                                        \
    extern "C" __global__ void glu_fwd_##name(const T *up, T *out, int width, size_t total,     \
                                              int act) {                                        \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const size_t r = i / width;                                                         \
            const int j = (int)(i % width);                                                     \
            const T *row = up + r * 2 * width;                                                  \
            st(out + i, __fmul_rn(act_value(act, ld(row + j)), ld(row + width + j)));           \
        }                                                                                       \
    }
FOR_TYPES(GLU_FWD)

// Its backward: `dgate = dout up act'(gate)`, `dup = dout act(gate)`, into `[rows, 2 width]`.
#define GLU_BWD(name, T)                                                                        \
    extern "C" __global__ void glu_bwd_##name(const T *dout, const T *up, T *dup, int width,    \
                                              size_t total, int act) {                          \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x) {                                             \
            const size_t r = i / width;                                                         \
            const int j = (int)(i % width);                                                     \
            const T *row = up + r * 2 * width;                                                  \
            const float g = ld(row + j), u = ld(row + width + j), d = ld(dout + i);             \
            st(dup + r * 2 * width + j, d * u * act_slope(act, g));                             \
            st(dup + r * 2 * width + width + j, d * act_value(act, g));                         \
        }                                                                                       \
    }
FOR_TYPES(GLU_BWD)

// `acc += g` element by element, in place (a parameter's gradient summed across chunks
// where it is written).
#define ADD_IN_PLACE(name, T)                                                                   \
    extern "C" __global__ void add_in_place_##name(T *acc, const T *g, size_t total) {          \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;               \
             i += (size_t)gridDim.x * blockDim.x)                                               \
            st(acc + i, ld(acc + i) + ld(g + i));                                               \
    }
FOR_TYPES(ADD_IN_PLACE)
