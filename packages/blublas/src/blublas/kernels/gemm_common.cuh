// BluBLAS shared device code: bf16 bit conversions, cp.async helpers, tile loaders and the fused epilogue.
// No CUDA headers are included on purpose: bf16 is handled as raw 16-bit storage (CuPy has no bfloat16)
// so the same source compiles with any NVRTC without include paths.
#pragma once

typedef unsigned short bf16_t;
typedef long long i64;

// Epilogue flag bits (mirrored in blublas/launch.py).
#define BLU_F_BIAS 1        // add bias[n]
#define BLU_F_BIAS_BF16 2   // bias stored as bf16 (else fp32)
#define BLU_F_GELU 4        // apply gelu-tanh after bias
#define BLU_F_PREACT 8      // store the pre-activation (value before gelu) into P
#define BLU_F_OUT_BF16 16   // C (and P) stored as bf16 (else fp32)
#define BLU_F_BETA 32       // read C and add beta * C_old
#define BLU_F_VEC 64        // A and B allow 16-byte cp.async (aligned bases, ld multiple of 16 bytes)
#define BLU_F_PAIR 128      // C (and P) allow paired stores of columns (c, c+1) for even c

__device__ __forceinline__ float blu_bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ bf16_t blu_f32_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                           // round to nearest even
  return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float blu_gelu_tanh(float x) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

__device__ __forceinline__ unsigned blu_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte async copy with zero fill of the bytes past src_bytes (0..16).
__device__ __forceinline__ void blu_cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(blu_smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}

// 4-byte async copy with zero fill when src_bytes == 0.
__device__ __forceinline__ void blu_cp_async4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(blu_smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void blu_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void blu_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Load a ROWS x COLS tile (COLS contiguous in global memory, leading dimension ld elements) starting at
// (r0, c0) into shared memory with row stride SLD elements; rows >= R or cols >= C are zero-filled.
// vec (uniform at run time): 16-byte cp.async chunks (needs a 16-byte aligned base and ld a multiple of
// 16/sizeof(T)); otherwise element-wise synchronous loads (any alignment, any ld).
template <typename T, int ROWS, int COLS, int SLD, int NT>
__device__ __forceinline__ void blu_load_tile(T* s, const T* __restrict__ g, i64 ld, int r0, int c0, int R,
                                              int C, int tid, bool vec) {
  if (vec) {
    constexpr int CH = 16 / (int)sizeof(T);
    constexpr int CPR = COLS / CH;  // chunks per row
    constexpr int TOTAL = ROWS * CPR;
#pragma unroll
    for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
      const int i = tid + it * NT;
      if (TOTAL % NT != 0 && i >= TOTAL) break;
      int r = i / CPR, cc = (i % CPR) * CH;
      int gr = r0 + r, gc = c0 + cc;
      int bytes = 0;
      if (gr < R && gc < C) bytes = (C - gc >= CH ? CH : C - gc) * (int)sizeof(T);
      const T* src = bytes > 0 ? g + (i64)gr * ld + gc : g;
      blu_cp_async16(s + r * SLD + cc, src, bytes);
    }
  } else {
    constexpr int TOTAL = ROWS * COLS;
#pragma unroll 4
    for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
      const int i = tid + it * NT;
      if (TOTAL % NT != 0 && i >= TOTAL) break;
      int r = i / COLS, c = i % COLS;
      int gr = r0 + r, gc = c0 + c;
      T v = T(0);
      if (gr < R && gc < C) v = g[(i64)gr * ld + gc];
      s[r * SLD + c] = v;
    }
  }
}

// Everything the epilogue needs, with batch offsets already applied.
struct BluEpi {
  void* C;
  const void* bias;
  void* P;
  i64 ldc, ldp;
  float alpha, beta;
  int flags, M, N;
};

__device__ __forceinline__ BluEpi blu_make_epi(void* C, const void* bias, void* P, i64 ldc, i64 ldp, i64 sC,
                                               i64 sP, float alpha, float beta, int flags, int M, int N,
                                               int z) {
  BluEpi e;
  const int es = (flags & BLU_F_OUT_BF16) ? 2 : 4;
  e.C = (char*)C + (i64)z * sC * es;
  e.P = P ? (void*)((char*)P + (i64)z * sP * es) : P;
  e.bias = bias;
  e.ldc = ldc;
  e.ldp = ldp;
  e.alpha = alpha;
  e.beta = beta;
  e.flags = flags;
  e.M = M;
  e.N = N;
  return e;
}

// out[r, c] = act(alpha * acc + beta * out_old[r, c] + bias[c]); optionally P[r, c] = pre-activation.
__device__ __forceinline__ void blu_epi_store(const BluEpi& e, int r, int c, float acc) {
  if (r >= e.M || c >= e.N) return;
  const int f = e.flags;
  const bool obf = (f & BLU_F_OUT_BF16) != 0;
  const i64 off = (i64)r * e.ldc + c;
  float v = e.alpha * acc;
  if (f & BLU_F_BETA) {
    float old = obf ? blu_bf16_to_f32(((const bf16_t*)e.C)[off]) : ((const float*)e.C)[off];
    v += e.beta * old;
  }
  if (f & BLU_F_BIAS) {
    v += (f & BLU_F_BIAS_BF16) ? blu_bf16_to_f32(((const bf16_t*)e.bias)[c]) : ((const float*)e.bias)[c];
  }
  if (f & BLU_F_GELU) {
    if (f & BLU_F_PREACT) {
      const i64 po = (i64)r * e.ldp + c;
      if (obf)
        ((bf16_t*)e.P)[po] = blu_f32_to_bf16(v);
      else
        ((float*)e.P)[po] = v;
    }
    v = blu_gelu_tanh(v);
  }
  if (obf)
    ((bf16_t*)e.C)[off] = blu_f32_to_bf16(v);
  else
    ((float*)e.C)[off] = v;
}

// Output tile of this CTA: blockIdx.x/y enumerate (n tiles, m tiles); consecutive CTAs are grouped by
// GROUP_M m-tiles so the A rows and B columns they share stay in L2 (grouped "super-tile" order).
struct BluTile {
  int m0, n0;
};

template <int BM, int BN>
__device__ __forceinline__ BluTile blu_tile_coords() {
  constexpr int GROUP_M = 8;
  const int gx = gridDim.x, gy = gridDim.y;
  const int pid = blockIdx.y * gx + blockIdx.x;
  const int width = GROUP_M * gx;
  const int first_m = (pid / width) * GROUP_M;
  const int gsize = (gy - first_m) < GROUP_M ? (gy - first_m) : GROUP_M;
  const int r = pid % width;
  BluTile t;
  t.m0 = (first_m + r % gsize) * BM;
  t.n0 = (r / gsize) * BN;
  return t;
}

// Two adjacent columns (c even, c + 1) with one paired load/store each when BLU_F_PAIR allows it.
__device__ __forceinline__ void blu_epi_store2(const BluEpi& e, int r, int c, float a0, float a1) {
  const int f = e.flags;
  if (!(f & BLU_F_PAIR) || r >= e.M || c + 1 >= e.N) {
    blu_epi_store(e, r, c, a0);
    blu_epi_store(e, r, c + 1, a1);
    return;
  }
  const bool obf = (f & BLU_F_OUT_BF16) != 0;
  const i64 off = (i64)r * e.ldc + c;
  float v0 = e.alpha * a0, v1 = e.alpha * a1;
  if (f & BLU_F_BETA) {
    if (obf) {
      const unsigned u = *(const unsigned*)((const bf16_t*)e.C + off);
      v0 += e.beta * blu_bf16_to_f32((bf16_t)(u & 0xffffu));
      v1 += e.beta * blu_bf16_to_f32((bf16_t)(u >> 16));
    } else {
      const float2 o = *(const float2*)((const float*)e.C + off);
      v0 += e.beta * o.x;
      v1 += e.beta * o.y;
    }
  }
  if (f & BLU_F_BIAS) {
    if (f & BLU_F_BIAS_BF16) {
      v0 += blu_bf16_to_f32(((const bf16_t*)e.bias)[c]);
      v1 += blu_bf16_to_f32(((const bf16_t*)e.bias)[c + 1]);
    } else {
      v0 += ((const float*)e.bias)[c];
      v1 += ((const float*)e.bias)[c + 1];
    }
  }
  if (f & BLU_F_GELU) {
    if (f & BLU_F_PREACT) {
      const i64 po = (i64)r * e.ldp + c;
      if (obf)
        *(unsigned*)((bf16_t*)e.P + po) = (unsigned)blu_f32_to_bf16(v0) | ((unsigned)blu_f32_to_bf16(v1) << 16);
      else
        *(float2*)((float*)e.P + po) = make_float2(v0, v1);
    }
    v0 = blu_gelu_tanh(v0);
    v1 = blu_gelu_tanh(v1);
  }
  if (obf)
    *(unsigned*)((bf16_t*)e.C + off) = (unsigned)blu_f32_to_bf16(v0) | ((unsigned)blu_f32_to_bf16(v1) << 16);
  else
    *(float2*)((float*)e.C + off) = make_float2(v0, v1);
}

// Split of blockIdx.z into (batch, k split) and the k range of this split.
struct BluKRange {
  int batch, k_begin, k_end;
};

__device__ __forceinline__ BluKRange blu_k_range(int K, int splits, int k_chunk) {
  BluKRange kr;
  const int z = blockIdx.z;
  kr.batch = z / splits;
  const int sp = z % splits;
  kr.k_begin = sp * k_chunk;
  int e = kr.k_begin + k_chunk;
  kr.k_end = e < K ? e : K;
  return kr;
}

// Common kernel parameter list of every GEMM entry point (element strides; sA/sB/sC/sP per batch).
#define BLU_GEMM_PARAMS                                                                                 \
  const void *A, const void *B, void *C, const void *bias, void *P, int M, int N, int K, i64 lda,       \
      i64 ldb, i64 ldc, i64 ldp, i64 sA, i64 sB, i64 sC, i64 sP, float alpha, float beta, int flags,    \
      int splits, int k_chunk
#define BLU_GEMM_ARGS A, B, C, bias, P, M, N, K, lda, ldb, ldc, ldp, sA, sB, sC, sP, alpha, beta, flags, splits, k_chunk
