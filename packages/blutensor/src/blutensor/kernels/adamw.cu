// AdamW over many tensors in ONE launch (multi-tensor apply with a chunk table).
// The host builds, once per parameter list, a table of equal-size chunks (tensor index, start element):
// block b updates chunk b, so large and small tensors spread evenly over the SMs (no tail of one huge
// tensor on a few blocks). Per tensor: pointers to param, grad, exp_avg, exp_avg_sq and flags
// (bit 0: param is bf16 bits, bit 1: grad is bf16 bits; moments are always fp32).
// lr and step are read from device memory when lr_dev / step_dev are non-null, so a captured CUDA graph
// replays with new values; otherwise the scalar arguments are used.
// Update order = PyTorch's AdamW (decoupled decay, then moments, bias-corrected step), fp32 math.
// Self-contained (no headers) so that NVRTC compiles it anywhere.

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ bf16_t f2bf(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

#define BLU_UNROLL 4

extern "C" __global__ void __launch_bounds__(512)
blu_adamw_step(const unsigned long long* __restrict__ p_ptr, const unsigned long long* __restrict__ g_ptr,
               const unsigned long long* __restrict__ m_ptr, const unsigned long long* __restrict__ v_ptr,
               const int* __restrict__ flags, const long long* __restrict__ numel,
               const int* __restrict__ chunk_tensor, const long long* __restrict__ chunk_start, long long chunk_size,
               double lr_arg, const float* __restrict__ lr_dev, double step_arg, const float* __restrict__ step_dev,
               double b1, double b2, double eps, double wd) {
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const int fl = flags[ti];
    const double lr = lr_dev ? (double)lr_dev[0] : lr_arg;
    const double step = step_dev ? (double)step_dev[0] : step_arg;
    const double bc1 = 1.0 - pow(b1, step);
    const double bc2_sqrt = sqrt(1.0 - pow(b2, step));
    const float decay = (float)(1.0 - lr * wd);
    const float omb1 = (float)(1.0 - b1), b2f = (float)b2, omb2 = (float)(1.0 - b2);
    const float bc2f = (float)bc2_sqrt, epsf = (float)eps, nss = (float)(-(lr / bc1));
    float* __restrict__ m = reinterpret_cast<float*>(m_ptr[ti]);
    float* __restrict__ v = reinterpret_cast<float*>(v_ptr[ti]);
    const bool pbf = fl & 1, gbf = fl & 2;
    float* pf = reinterpret_cast<float*>(p_ptr[ti]);
    bf16_t* pb = reinterpret_cast<bf16_t*>(p_ptr[ti]);
    const float* gf = reinterpret_cast<const float*>(g_ptr[ti]);
    const bf16_t* gb = reinterpret_cast<const bf16_t*>(g_ptr[ti]);
    for (long long base = start + threadIdx.x; base < end; base += (long long)blockDim.x * BLU_UNROLL) {
        float x[BLU_UNROLL], g[BLU_UNROLL], mm[BLU_UNROLL], vv[BLU_UNROLL];
#pragma unroll
        for (int u = 0; u < BLU_UNROLL; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < end) {
                x[u] = pbf ? bf2f(pb[i]) : pf[i];
                g[u] = gbf ? bf2f(gb[i]) : gf[i];
                mm[u] = m[i];
                vv[u] = v[i];
            }
        }
#pragma unroll
        for (int u = 0; u < BLU_UNROLL; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < end) {
                float xu = x[u] * decay;
                float mu = mm[u] + omb1 * (g[u] - mm[u]);
                float vu = vv[u] * b2f;
                vu = vu + omb2 * g[u] * g[u];
                float denom = sqrtf(vu) / bc2f + epsf;
                xu = xu + (nss * mu) / denom;  // addcdiv_(m, denom, value=-step_size) order
                m[i] = mu;
                v[i] = vu;
                if (pbf) pb[i] = f2bf(xu); else pf[i] = xu;
            }
        }
    }
}
