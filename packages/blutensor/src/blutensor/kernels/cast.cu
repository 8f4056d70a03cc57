// float32 <-> bfloat16 (raw 16-bit storage) conversion in one pass: the casts autocast inserts (activations
// into bf16 GEMMs, bf16 GEMM outputs widened into the float32 residual stream, and their gradients).
// Vectorised: 8 elements a thread (two 128-bit float loads, one 128-bit bf16 store), scalar tail.
#include "bf16_vec.cuh"

extern "C" __global__ void blu_cast_f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long long n,
                                                int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / 8;
        for (long long i = tid; i < nv; i += nth) {
            float v[8];
            load_vec(x + i * 8, v);
            load_vec(x + i * 8 + 4, v + 4);
            store_vec(y + i * 8, v);
        }
        done = nv * 8;
    }
    for (long long i = done + tid; i < n; i += nth) y[i] = from_f<bf16_t>(x[i]);
}

extern "C" __global__ void blu_cast_bf16_to_f32(const bf16_t* __restrict__ x, float* __restrict__ y, long long n,
                                                int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / 8;
        for (long long i = tid; i < nv; i += nth) {
            float v[8];
            load_vec(x + i * 8, v);
            store_vec(y + i * 8, v);
            store_vec(y + i * 8 + 4, v + 4);
        }
        done = nv * 8;
    }
    for (long long i = done + tid; i < n; i += nth) y[i] = to_f(x[i]);
}
