// AdamW over many tensors in ONE launch (multi-tensor apply with a chunk table).
// The host builds, once per parameter list, a table of equal-size chunks (tensor index, start element):
// block b updates chunk b, so large and small tensors spread evenly over the SMs (no tail of one huge
// tensor on a few blocks). Per tensor: pointers to param, grad, exp_avg, exp_avg_sq and flags
// (bit 0: param is bf16 bits, bit 1: grad is bf16 bits; moments are always fp32).
// lr and step are read from device memory when lr_dev / step_dev are non-null, so a captured CUDA graph
// replays with new values; otherwise the scalar arguments are used.
// Update order = PyTorch's AdamW (decoupled decay, then moments, bias-corrected step), fp32 math.
// bf16 conversions: bf16_vec.cuh.

#include "bf16_vec.cuh"


// one element, PyTorch's order: decay, lerp into m, v = b2 v + (1-b2) g^2, p += (-step_size * m) / denom
__device__ __forceinline__ void adam_elem(float& x, float g, float& m, float& v, float decay, float omb1, float b2f,
                                          float omb2, float bc2f, float epsf, float nss) {
    x *= decay;
    m = m + omb1 * (g - m);
    v = v * b2f;
    v = v + omb2 * g * g;
    const float denom = sqrtf(v) / bc2f + epsf;
    x = x + (nss * m) / denom;
}

// COPY: also write the updated fp32 parameter rounded to bf16 into c_ptr[ti] (the bf16 weight copy autocast's
// GEMMs read next step: bt.amp.WeightCopies), so no separate cast pass over the weights is needed.
template <bool COPY>
__device__ __forceinline__ void adamw_impl(
        const unsigned long long* __restrict__ p_ptr, const unsigned long long* __restrict__ g_ptr,
        const unsigned long long* __restrict__ m_ptr, const unsigned long long* __restrict__ v_ptr,
        const unsigned long long* __restrict__ c_ptr, const int* __restrict__ flags,
        const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
        const long long* __restrict__ chunk_start, long long chunk_size, double lr_arg,
        const float* __restrict__ lr_dev, double step_arg, const float* __restrict__ step_dev,
        const float* __restrict__ found_inf, double b1, double b2, double eps, double wd) {
    // found_inf (optional): a device flag set when this step's loss or gradients are not finite; the update
    // is then skipped on the device, so a captured step honours the NaN policy without a host decision
    if (found_inf && found_inf[0] != 0.f) return;
    const int ti = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long n = numel[ti];
    const long long end = start + chunk_size < n ? start + chunk_size : n;
    const int fl = flags[ti];
    // per-launch constants in fp32 (b^step = exp2(step * log2 b): relative error ~1e-6, far below the
    // rounding of the update itself); no double-precision transcendental code, so 2 blocks of 512 fit an SM
    const float lr = lr_dev ? lr_dev[0] : (float)lr_arg;
    const float step = step_dev ? step_dev[0] : (float)step_arg;
    const float bc1 = 1.f - exp2f(step * log2f((float)b1));
    const float bc2f = sqrtf(1.f - exp2f(step * log2f((float)b2)));
    const float decay = 1.f - lr * (float)wd;
    const float omb1 = (float)(1.0 - b1), b2f = (float)b2, omb2 = (float)(1.0 - b2);
    const float epsf = (float)eps, nss = -(lr / bc1);
    float* __restrict__ m = reinterpret_cast<float*>(m_ptr[ti]);
    float* __restrict__ v = reinterpret_cast<float*>(v_ptr[ti]);
    const bool pbf = fl & 1, gbf = fl & 2;
    float* pf = reinterpret_cast<float*>(p_ptr[ti]);
    bf16_t* pb = reinterpret_cast<bf16_t*>(p_ptr[ti]);
    const float* gf = reinterpret_cast<const float*>(g_ptr[ti]);
    const bf16_t* gb = reinterpret_cast<const bf16_t*>(g_ptr[ti]);
    bf16_t* cb = COPY && !pbf ? reinterpret_cast<bf16_t*>(c_ptr[ti]) : nullptr;
    long long first = start;
    const bool aligned = ((p_ptr[ti] | g_ptr[ti] | m_ptr[ti] | v_ptr[ti]) & 15ull) == 0 && (start & 3) == 0
                         && (!COPY || cb == nullptr || (c_ptr[ti] & 7ull) == 0);
    if (!pbf && !gbf && aligned) {  // fp32 everywhere: 16-byte accesses, 2 vectors in flight per thread
        const long long nvec = (end - start) >> 2;
        float4* p4 = reinterpret_cast<float4*>(pf + start);
        const float4* g4 = reinterpret_cast<const float4*>(gf + start);
        float4* m4 = reinterpret_cast<float4*>(m + start);
        float4* v4 = reinterpret_cast<float4*>(v + start);
#pragma unroll 1
        for (long long i = threadIdx.x; i < nvec; i += blockDim.x) {
            float4 X = p4[i], Gr = g4[i], M = m4[i], Vv = v4[i];
            adam_elem(X.x, Gr.x, M.x, Vv.x, decay, omb1, b2f, omb2, bc2f, epsf, nss);
            adam_elem(X.y, Gr.y, M.y, Vv.y, decay, omb1, b2f, omb2, bc2f, epsf, nss);
            adam_elem(X.z, Gr.z, M.z, Vv.z, decay, omb1, b2f, omb2, bc2f, epsf, nss);
            adam_elem(X.w, Gr.w, M.w, Vv.w, decay, omb1, b2f, omb2, bc2f, epsf, nss);
            p4[i] = X; m4[i] = M; v4[i] = Vv;
            if (COPY && cb) reinterpret_cast<uint2*>(cb + start)[i] = make_uint2(pack2(X.x, X.y), pack2(X.z, X.w));
        }
        first = start + (nvec << 2);
    }
    // bf16 params/grads or unaligned views: one element per thread and iteration (coalesced 2/4-byte accesses)
    for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
        float xu = pbf ? to_f(pb[i]) : pf[i];
        const float gu = gbf ? to_f(gb[i]) : gf[i];
        float mu = m[i], vu = v[i];
        adam_elem(xu, gu, mu, vu, decay, omb1, b2f, omb2, bc2f, epsf, nss);
        m[i] = mu;
        v[i] = vu;
        if (pbf) pb[i] = from_f<bf16_t>(xu); else pf[i] = xu;
        if (COPY && cb) cb[i] = from_f<bf16_t>(xu);
    }
}

extern "C" __global__ void __launch_bounds__(512, 2)
blu_adamw_step(const unsigned long long* __restrict__ p_ptr, const unsigned long long* __restrict__ g_ptr,
               const unsigned long long* __restrict__ m_ptr, const unsigned long long* __restrict__ v_ptr,
               const int* __restrict__ flags, const long long* __restrict__ numel,
               const int* __restrict__ chunk_tensor, const long long* __restrict__ chunk_start, long long chunk_size,
               double lr_arg, const float* __restrict__ lr_dev, double step_arg, const float* __restrict__ step_dev,
               const float* __restrict__ found_inf, double b1, double b2, double eps, double wd) {
    adamw_impl<false>(p_ptr, g_ptr, m_ptr, v_ptr, nullptr, flags, numel, chunk_tensor, chunk_start, chunk_size,
                      lr_arg, lr_dev, step_arg, step_dev, found_inf, b1, b2, eps, wd);
}

// the same update, writing each fp32 parameter's bf16 copy too (c_ptr: one bf16 array per parameter)
extern "C" __global__ void __launch_bounds__(512, 2)
blu_adamw_step_bf16_copy(const unsigned long long* __restrict__ p_ptr, const unsigned long long* __restrict__ g_ptr,
                         const unsigned long long* __restrict__ m_ptr, const unsigned long long* __restrict__ v_ptr,
                         const unsigned long long* __restrict__ c_ptr, const int* __restrict__ flags,
                         const long long* __restrict__ numel, const int* __restrict__ chunk_tensor,
                         const long long* __restrict__ chunk_start, long long chunk_size, double lr_arg,
                         const float* __restrict__ lr_dev, double step_arg, const float* __restrict__ step_dev,
                         const float* __restrict__ found_inf, double b1, double b2, double eps, double wd) {
    adamw_impl<true>(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, flags, numel, chunk_tensor, chunk_start, chunk_size,
                     lr_arg, lr_dev, step_arg, step_dev, found_inf, b1, b2, eps, wd);
}

// AdamW of ONE tensor (the per-parameter update of optimizer-in-backward), lr and step count always read from
// device memory, so an update launched inside a captured backward replays with each step's values; no table
// (its pointers would be the capture's gradient addresses, built by a host copy). Same per-element math and
// per-launch constants as blu_adamw_step: the two give bit-identical results. fl: bit 0 param is bf16 bits,
// bit 1 grad is bf16 bits.
extern "C" __global__ void __launch_bounds__(512)
blu_adamw_tensor(void* __restrict__ p_raw, const void* __restrict__ g_raw, float* __restrict__ m,
                 float* __restrict__ v, long long n, int fl, const float* __restrict__ lr_dev,
                 const float* __restrict__ step_dev, double b1, double b2, double eps, double wd) {
    const float lr = lr_dev[0];
    const float step = step_dev[0];
    const float bc1 = 1.f - exp2f(step * log2f((float)b1));
    const float bc2f = sqrtf(1.f - exp2f(step * log2f((float)b2)));
    const float decay = 1.f - lr * (float)wd;
    const float omb1 = (float)(1.0 - b1), b2f = (float)b2, omb2 = (float)(1.0 - b2);
    const float epsf = (float)eps, nss = -(lr / bc1);
    const bool pbf = fl & 1, gbf = fl & 2;
    float* pf = reinterpret_cast<float*>(p_raw);
    bf16_t* pb = reinterpret_cast<bf16_t*>(p_raw);
    const float* gf = reinterpret_cast<const float*>(g_raw);
    const bf16_t* gb = reinterpret_cast<const bf16_t*>(g_raw);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float xu = pbf ? to_f(pb[i]) : pf[i];
        const float gu = gbf ? to_f(gb[i]) : gf[i];
        float mu = m[i], vu = v[i];
        adam_elem(xu, gu, mu, vu, decay, omb1, b2f, omb2, bc2f, epsf, nss);
        m[i] = mu;
        v[i] = vu;
        if (pbf) pb[i] = from_f<bf16_t>(xu); else pf[i] = xu;
    }
}
