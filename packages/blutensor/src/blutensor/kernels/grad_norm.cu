// Global L2 norm of many gradient tensors without a host sync, and clipping by it, using the same
// chunk table as the multi-tensor AdamW (tensor index, start element per block; flags bit 0: bf16 bits).
// blu_grad_norm_partial: one fp32 sum of squares per chunk (fixed reduction tree);
// blu_grad_norm_finalize: one block sums the partials in fixed order in double and writes sqrt -> out[0];
// blu_grad_norm_scale: g *= max_norm / (norm + 1e-6) when that is < 1, reading norm from device memory.
// Deterministic: no atomics. Self-contained (no headers) so that NVRTC compiles it anywhere.

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ bf16_t f2bf(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));  // round to nearest even, one instruction
    return (bf16_t)h;
#else
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
#endif
}

extern "C" __global__ void __launch_bounds__(512)
blu_grad_norm_partial(const unsigned long long* __restrict__ g_ptr, const int* __restrict__ flags,
                      const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
                      const long long* __restrict__ chunk_start, long long chunk_size, float* __restrict__ partial) {
    __shared__ float sh[32];
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const bool bf = flags[ti] & 1;
    const float* gf = reinterpret_cast<const float*>(g_ptr[ti]);
    const bf16_t* gb = reinterpret_cast<const bf16_t*>(g_ptr[ti]);
    float s0 = 0.f, s1 = 0.f;
    long long first = start;
    if (!bf && (g_ptr[ti] & 15ull) == 0 && (start & 3) == 0) {  // fp32: 16-byte loads
        const long long nvec = (end - start) >> 2;
        const float4* g4 = reinterpret_cast<const float4*>(gf + start);
        for (long long j = threadIdx.x; j < nvec; j += blockDim.x) {
            const float4 a = g4[j];
            s0 += a.x * a.x + a.y * a.y;
            s1 += a.z * a.z + a.w * a.w;
        }
        first = start + (nvec << 2);
    }
    long long i = first + threadIdx.x;
    for (; i + blockDim.x < end; i += 2LL * blockDim.x) {
        float a = bf ? bf2f(gb[i]) : gf[i];
        float b = bf ? bf2f(gb[i + blockDim.x]) : gf[i + blockDim.x];
        s0 += a * a;
        s1 += b * b;
    }
    if (i < end) { float a = bf ? bf2f(gb[i]) : gf[i]; s0 += a * a; }
    float s = s0 + s1;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
        partial[blockIdx.x] = t;
    }
}

extern "C" __global__ void blu_grad_norm_finalize(const float* __restrict__ partial, int nchunks, float* __restrict__ out) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < nchunks; i += blockDim.x) s += (double)partial[i];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
        out[0] = (float)sqrt(t);
    }
}

extern "C" __global__ void __launch_bounds__(512)
blu_grad_norm_scale(const unsigned long long* __restrict__ g_ptr, const int* __restrict__ flags,
                    const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
                    const long long* __restrict__ chunk_start, long long chunk_size, const float* __restrict__ norm,
                    float max_norm) {
    const float coef = max_norm / (norm[0] + 1e-6f);
    if (!(coef < 1.f)) return;
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const bool bf = flags[ti] & 1;
    float* gf = reinterpret_cast<float*>(g_ptr[ti]);
    bf16_t* gb = reinterpret_cast<bf16_t*>(g_ptr[ti]);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        if (bf) gb[i] = f2bf(bf2f(gb[i]) * coef); else gf[i] *= coef;
    }
}
