// Rotary position embedding (rotate-half layout, Hugging Face's Llama) for fp32 and bf16 storage; math in fp32.
// x (B, T, H, D) contiguous, cos/sin (T, D/2) fp32. One thread per rotated pair (i, i + D/2):
//   forward  y[i] = x[i] cos - x[i+D/2] sin,  y[i+D/2] = x[i+D/2] cos + x[i] sin
//   backward the inverse rotation (sin negated): dx from dy; the tables get no gradient.
// *_t_* entries: the same with the output in the other layout (see rope_rotate_t).
// Shared bf16 helpers come from bf16_vec.cuh (inlined by the loader).

#include "bf16_vec.cuh"

template <typename T>
__device__ void rope_rotate(const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                            T* __restrict__ y, long long pairs, int T_, int H, int h2, float sign) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += nth) {
        const int d = (int)(i % h2);
        const long long rest = i / h2;              // (b * T + t) * H + head
        const int t = (int)((rest / H) % T_);
        const long long base = rest * (2LL * h2);
        const float c = cs[(long long)t * h2 + d];
        const float s = sign * sn[(long long)t * h2 + d];
        const float x1 = to_f(x[base + d]);
        const float x2 = to_f(x[base + d + h2]);
        y[base + d] = from_f<T>(x1 * c - x2 * s);
        y[base + d + h2] = from_f<T>(x2 * c + x1 * s);
    }
}

// The transposed variants: forward reads x (B, T, H, D) and writes y as (B, H, T, D) (attention's layout); backward
// reads dy (B, H, T, D) and writes dx as (B, T, H, D). Threads walk the pairs in the order of the array read.
template <typename T>
__device__ void rope_rotate_t(const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                              T* __restrict__ y, long long pairs, int T_, int H, int h2, int backward) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    const float sign = backward ? -1.f : 1.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += nth) {
        const int d = (int)(i % h2);
        const long long rest = i / h2;  // forward: (b * T + t) * H + head; backward: (b * H + head) * T + t
        int t, head;
        long long b;
        if (backward) { t = (int)(rest % T_); head = (int)((rest / T_) % H); b = rest / ((long long)T_ * H); }
        else { head = (int)(rest % H); t = (int)((rest / H) % T_); b = rest / ((long long)T_ * H); }
        const long long in_row = rest * (2LL * h2);
        const long long out_row = (backward ? ((b * T_ + t) * H + head) : ((b * H + head) * T_ + t)) * (2LL * h2);
        const float c = cs[(long long)t * h2 + d];
        const float s = sign * sn[(long long)t * h2 + d];
        const float x1 = to_f(x[in_row + d]);
        const float x2 = to_f(x[in_row + d + h2]);
        y[out_row + d] = from_f<T>(x1 * c - x2 * s);
        y[out_row + d + h2] = from_f<T>(x2 * c + x1 * s);
    }
}

#define ROPE_ENTRIES(SUF, TY)                                                                                      \
extern "C" __global__ void blu_rope_forward_##SUF(const TY* x, const float* cs, const float* sn, TY* y,         \
                                                   long long pairs, int T, int H, int h2) {                      \
    rope_rotate<TY>(x, cs, sn, y, pairs, T, H, h2, 1.f);                                                          \
}                                                                                                                  \
extern "C" __global__ void blu_rope_backward_##SUF(const TY* g, const float* cs, const float* sn, TY* dx,       \
                                                    long long pairs, int T, int H, int h2) {                     \
    rope_rotate<TY>(g, cs, sn, dx, pairs, T, H, h2, -1.f);                                                        \
}                                                                                                                  \
extern "C" __global__ void blu_rope_forward_t_##SUF(const TY* x, const float* cs, const float* sn, TY* y,       \
                                                     long long pairs, int T, int H, int h2) {                    \
    rope_rotate_t<TY>(x, cs, sn, y, pairs, T, H, h2, 0);                                                          \
}                                                                                                                  \
extern "C" __global__ void blu_rope_backward_t_##SUF(const TY* g, const float* cs, const float* sn, TY* dx,     \
                                                      long long pairs, int T, int H, int h2) {                   \
    rope_rotate_t<TY>(g, cs, sn, dx, pairs, T, H, h2, 1);                                                         \
}

ROPE_ENTRIES(f32, float)
ROPE_ENTRIES(bf16, bf16_t)
