// bfloat16 as raw 16-bit storage and 128-bit vector loads/stores: the helpers every fused kernel shares.
// Inlined into each kernel file by blutensor/backends/cupy/_loader.py (quoted includes are expanded before NVRTC
// sees the source, so CuPy's cache key covers this header too).
typedef unsigned short bf16_t;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float x) {
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

template <typename T> struct VecN { static constexpr int N = 16 / sizeof(T); };

__device__ __forceinline__ void unpack(const uint4& u, float* o, float) {
    o[0] = __uint_as_float(u.x); o[1] = __uint_as_float(u.y);
    o[2] = __uint_as_float(u.z); o[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4& u, float* o, bf16_t) {
    o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
    o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
    o[4] = __uint_as_float(u.z << 16); o[5] = __uint_as_float(u.z & 0xffff0000u);
    o[6] = __uint_as_float(u.w << 16); o[7] = __uint_as_float(u.w & 0xffff0000u);
}
__device__ __forceinline__ uint4 pack(const float* v, float) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
__device__ __forceinline__ unsigned int pack2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));  // upper half <- b, lower half <- a
    return r;
#else
    return (unsigned int)from_f<bf16_t>(a) | ((unsigned int)from_f<bf16_t>(b) << 16);
#endif
}
__device__ __forceinline__ uint4 pack(const float* v, bf16_t) {
    return make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
}
template <typename T> __device__ __forceinline__ void load_vec(const T* p, float* o) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack(u, o, T());
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float* v) {
    *reinterpret_cast<uint4*>(p) = pack(v, T());
}

// Grid-stride elementwise loop over n elements: chunk(i) for each chunk of V elements starting at element i (when
// vec: every pointer the caller touches starts on a 16-byte boundary), then one(i) for each element past the
// chunks. The shape of every vectorised elementwise kernel (cast.cu, swiglu.cu).
template <int V, typename Chunk, typename One>
__device__ __forceinline__ void blu_elementwise(long long n, int vec, Chunk chunk, One one) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nth = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long nv = n / V;
        for (long long i = tid; i < nv; i += nth) chunk(i * V);
        done = nv * V;
    }
    for (long long i = done + tid; i < n; i += nth) one(i);
}
