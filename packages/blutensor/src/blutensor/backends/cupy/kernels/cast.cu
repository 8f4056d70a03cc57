// float32 <-> bfloat16 (raw 16-bit storage) conversion in one pass: the casts autocast inserts (activations
// into bf16 GEMMs, bf16 GEMM outputs widened into the float32 residual stream, and their gradients).
// Vectorised: 8 elements a thread (two 128-bit float loads, one 128-bit bf16 store), scalar tail.
#include "bf16_vec.cuh"

extern "C" __global__ void blu_cast_f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long long n,
                                                int vec) {
    blu_elementwise<8>(n, vec, [=](long long i) {
        float v[8];
        load_vec(x + i, v);
        load_vec(x + i + 4, v + 4);
        store_vec(y + i, v);
    }, [=](long long i) { y[i] = from_f<bf16_t>(x[i]); });
}

extern "C" __global__ void blu_cast_bf16_to_f32(const bf16_t* __restrict__ x, float* __restrict__ y, long long n,
                                                int vec) {
    blu_elementwise<8>(n, vec, [=](long long i) {
        float v[8];
        load_vec(x + i, v);
        store_vec(y + i, v);
        store_vec(y + i + 4, v + 4);
    }, [=](long long i) { y[i] = to_f(x[i]); });
}

// Many float32 tensors -> bfloat16 copies in ONE launch (autocast's weight casts at the start of a step).
// Block b converts chunk b of the chunk table: tensor chunk_tensor[b], elements [chunk_start[b], +chunk).
// The copies are packed into one buffer: tensor i lands at dst + dst_off[i] (offsets padded to 64 elements,
// so every copy starts on a 128-byte boundary); vectorised when the source is 16-byte aligned.
extern "C" __global__ void blu_cast_multi_f32_to_bf16(const unsigned long long* __restrict__ src_ptr,
                                                      const long long* __restrict__ dst_off,
                                                      const long long* __restrict__ numel,
                                                      const int* __restrict__ chunk_tensor,
                                                      const long long* __restrict__ chunk_start, long long chunk,
                                                      bf16_t* __restrict__ dst) {
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk < n ? start + chunk : n;
    const float* __restrict__ x = reinterpret_cast<const float*>(src_ptr[ti]);
    bf16_t* __restrict__ y = dst + dst_off[ti];
    long long first = start;
    if ((src_ptr[ti] & 15ull) == 0 && (dst_off[ti] & 7) == 0 && (start & 7) == 0) {
        const long long nv = (end - start) / 8;
        for (long long i = threadIdx.x; i < nv; i += blockDim.x) {
            float v[8];
            load_vec(x + start + i * 8, v);
            load_vec(x + start + i * 8 + 4, v + 4);
            store_vec(y + start + i * 8, v);
        }
        first = start + nv * 8;
    }
    for (long long i = first + threadIdx.x; i < end; i += blockDim.x) y[i] = from_f<bf16_t>(x[i]);
}

// acc (float32) += widen(g) (bfloat16): the backward of an autocast weight cast added straight into the
// float32 master's gradient buffer (one pass instead of widen-to-a-new-array + accumulate).
extern "C" __global__ void blu_cast_accumulate_bf16_into_f32(const bf16_t* __restrict__ g, float* __restrict__ acc,
                                                             long long n, int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / 8;
        for (long long i = tid; i < nv; i += nth) {
            float v[8], a[8];
            load_vec(g + i * 8, v);
            load_vec(acc + i * 8, a);
            load_vec(acc + i * 8 + 4, a + 4);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] += v[k];
            store_vec(acc + i * 8, a);
            store_vec(acc + i * 8 + 4, a + 4);
        }
        done = nv * 8;
    }
    for (long long i = done + tid; i < n; i += nth) acc[i] += to_f(g[i]);
}

// out (float32) = x (float32) + widen(y) (bfloat16), same shape: a bf16 GEMM output added to the float32 residual
// stream under autocast in one pass (instead of widening y into a new array, then adding).
extern "C" __global__ void blu_add_bf16_widen_forward(const float* __restrict__ x, const bf16_t* __restrict__ y,
                                                      float* __restrict__ out, long long n, int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / 8;
        for (long long i = tid; i < nv; i += nth) {
            float v[8], a[8];
            load_vec(y + i * 8, v);
            load_vec(x + i * 8, a);
            load_vec(x + i * 8 + 4, a + 4);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] += v[k];
            store_vec(out + i * 8, a);
            store_vec(out + i * 8 + 4, a + 4);
        }
        done = nv * 8;
    }
    for (long long i = done + tid; i < n; i += nth) out[i] = x[i] + to_f(y[i]);
}

// out = bf16(widen(a) + widen(b)), same shape: two bfloat16 gradients of one tensor (its consumers' contributions,
// summed by the autograd engine) added in float32 and rounded to nearest even in one pass, instead of two widenings,
// a float32 add and a narrowing.
extern "C" __global__ void blu_add_bf16_forward(const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,
                                                bf16_t* __restrict__ out, long long n, int vec) {
    blu_elementwise<8>(n, vec, [=](long long i) {
        float x[8], y[8];
        load_vec(a + i, x);
        load_vec(b + i, y);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] += y[k];
        store_vec(out + i, x);
    }, [=](long long i) { out[i] = from_f<bf16_t>(to_f(a[i]) + to_f(b[i])); });
}

// out[i] = bf16(sum over g < G of widen(parts[g * n + i])), the slices added in order in float32: the G slices of
// grouped-query attention's dK or dV (one per query head of a group) reduced to the key/value heads' gradient in
// one pass. vec: every slice starts on a 16-byte boundary (parts and out aligned, n a multiple of 8).
extern "C" __global__ void blu_sum_slices_bf16_forward(const bf16_t* __restrict__ parts, bf16_t* __restrict__ out,
                                                       int G, long long n, int vec) {
    blu_elementwise<8>(n, vec, [=](long long i) {
        float s[8], y[8];
        load_vec(parts + i, s);
        for (int g = 1; g < G; ++g) {
            load_vec(parts + g * n + i, y);
#pragma unroll
            for (int k = 0; k < 8; ++k) s[k] += y[k];
        }
        store_vec(out + i, s);
    }, [=](long long i) {
        float s = to_f(parts[i]);
        for (int g = 1; g < G; ++g) s += to_f(parts[g * n + i]);
        out[i] = from_f<bf16_t>(s);
    });
}
