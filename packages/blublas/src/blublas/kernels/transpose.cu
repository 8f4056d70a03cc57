// BluBLAS fp32 batched transpose: dst[b][c][r] = src[b][r][c] (src: rows x cols, leading dimension lds;
// dst: cols x rows, leading dimension ldd). The TF32 wgmma kernels read both operands K-major only, so
// launch.py turns the M/N-major operands of NN/TN problems into K-major copies with this first.
// 32 x 32 tiles through shared memory (one padding column: no bank conflicts), 32 x 8 threads, coalesced
// reads and writes; blockIdx.z is the batch entry.
typedef long long i64;

extern "C" __global__ void blu_transpose_f32(const float* __restrict__ src, float* __restrict__ dst, int rows,
                                             int cols, i64 lds, i64 ldd, i64 sbs, i64 dbs) {
  __shared__ float tile[32][33];
  const float* s = src + (i64)blockIdx.z * sbs;
  float* d = dst + (i64)blockIdx.z * dbs;
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
  for (int j = 0; j < 32; j += 8) {
    const int r = r0 + ty + j, c = c0 + tx;
    if (r < rows && c < cols) tile[ty + j][tx] = s[(i64)r * lds + c];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 32; j += 8) {
    const int c = c0 + ty + j, r = r0 + tx;
    if (r < rows && c < cols) d[(i64)c * ldd + r] = tile[tx][ty + j];
  }
}
