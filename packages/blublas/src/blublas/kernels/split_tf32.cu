// Split-TF32 operands for the "3xtf32" GEMM precision (fp32-accurate GEMMs on the TF32 tensor cores).
//
// x = hi + lo with hi = tf32_rna(x), lo = tf32_rna(x - hi) (x - hi is exact in fp32). Both parts are exact
// TF32 values, so a TF32 GEMM multiplies them exactly and accumulates in fp32:
//   A @ B ~= hi(A) @ hi(B) + hi(A) @ lo(B) + lo(A) @ hi(B)       (lo @ lo is below fp32 precision)
// which one TF32 GEMM computes over a K three times as long: [A_hi | A_lo | A_hi] @ [B_hi ; B_hi ; B_lo].
//
// The kernel reads one stored operand (rows x cols, leading dimension ld, batch stride sbs, nb entries) and
// writes P parts of it, densely, per batch entry (batch stride P * rows * cols):
//   horiz = 1 (K runs along the stored columns): entry = rows x (P*cols) = [part0 | part1 | part2]
//   horiz = 0 (K runs along the stored rows):    entry = (P*rows) x cols = [part0 ; part1 ; part2]
// Bit j of lo_mask set: part j holds lo, else hi. So a transposed view stays a flag of the GEMM: nothing
// is transposed, only the K axis of the operand as stored is lengthened.
// Rounding is round-to-nearest, ties away from zero (= cvt.rna.tf32.f32), emulated with integer ops so the
// low 13 bits are zero whatever the PTX version. Inf/NaN pass through as hi with lo = 0 (an inf input may
// give NaN outputs, as in any split-precision GEMM); a finite value that would round to inf is truncated.

__device__ __forceinline__ float blu_tf32_rna(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf / nan
    unsigned r = (u + 0x1000u) & 0xffffe000u;
    if ((r & 0x7f800000u) == 0x7f800000u) r = u & 0xffffe000u;  // would overflow to inf: truncate
    return __uint_as_float(r);
}

__device__ __forceinline__ void blu_tf32_split(float x, float& hi, float& lo) {
    hi = blu_tf32_rna(x);
    unsigned u = __float_as_uint(x);
    lo = ((u & 0x7f800000u) == 0x7f800000u) ? 0.0f : blu_tf32_rna(x - hi);
}

struct blu_f4 {
    float x, y, z, w;
};

template <int VEC>
__device__ __forceinline__ void blu_split_tf32_body(const float* __restrict__ src, float* __restrict__ dst, int rows,
                                                    int cols, long long ld, long long sbs, int nb, int parts,
                                                    int lo_mask, int horiz) {
    // cols, ld and sbs are in floats; with VEC == 4 they are multiples of 4 and pointers 16-byte aligned.
    const long long nrows = (long long)nb * rows;
    const long long entry = (long long)parts * rows * cols;
    const long long pstride = horiz ? (long long)cols : (long long)rows * cols;
    const long long drow = horiz ? (long long)parts * cols : (long long)cols;
    const int nvec = cols / VEC;
    for (long long rr = blockIdx.y; rr < nrows; rr += gridDim.y) {
        const long long b = rr / rows;
        const long long r = rr - b * rows;
        const float* s = src + b * sbs + r * ld;
        float* d = dst + b * entry + r * drow;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < nvec; c += gridDim.x * blockDim.x) {
            if (VEC == 4) {
                const blu_f4 v = reinterpret_cast<const blu_f4*>(s)[c];
                blu_f4 h, l;
                blu_tf32_split(v.x, h.x, l.x);
                blu_tf32_split(v.y, h.y, l.y);
                blu_tf32_split(v.z, h.z, l.z);
                blu_tf32_split(v.w, h.w, l.w);
                for (int j = 0; j < parts; ++j)
                    reinterpret_cast<blu_f4*>(d + j * pstride)[c] = ((lo_mask >> j) & 1) ? l : h;
            } else {
                float h, l;
                blu_tf32_split(s[c], h, l);
                for (int j = 0; j < parts; ++j) d[j * pstride + c] = ((lo_mask >> j) & 1) ? l : h;
            }
        }
    }
}

extern "C" __global__ void blu_split_tf32_concat(const float* __restrict__ src, float* __restrict__ dst, int rows,
                                                 int cols, long long ld, long long sbs, int nb, int parts,
                                                 int lo_mask, int horiz) {
    blu_split_tf32_body<1>(src, dst, rows, cols, ld, sbs, nb, parts, lo_mask, horiz);
}

extern "C" __global__ void blu_split_tf32_concat_v4(const float* __restrict__ src, float* __restrict__ dst, int rows,
                                                    int cols, long long ld, long long sbs, int nb, int parts,
                                                    int lo_mask, int horiz) {
    blu_split_tf32_body<4>(src, dst, rows, cols, ld, sbs, nb, parts, lo_mask, horiz);
}
