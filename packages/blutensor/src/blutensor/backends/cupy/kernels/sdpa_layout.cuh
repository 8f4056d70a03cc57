// Strided layouts of flash attention's tensors, shared by kernels/sdpa.cu (SIMT) and kernels/sdpa_mma.cu (matrix
// units); inlined into each by blutensor/backends/cupy/_loader.py.
// Element (b, h, row, :) of a tensor is at  b * sb + h * sh + row * st  with bh = b * H + h (contiguous (BH, n, HD):
// H = 1, sb = n * HD, st = HD). q/dq share one layout, k/v/dk/dv one, o/dO one, so q, k, v may be views of one fused
// (B, T, 3, H, HD) qkv tensor and o may be written as (B, T, H, HD). Rows must stay 16-byte aligned
// (st * sizeof(T) % 16 == 0, 16-byte aligned bases).
struct Lay {
    long long sb, sh;
    int st, H;
    __device__ __forceinline__ long long base(int bh) const { return (long long)(bh / H) * sb + (long long)(bh % H) * sh; }
};
__device__ __forceinline__ Lay dense(int n, int HD) { Lay l; l.sb = (long long)n * HD; l.sh = 0; l.st = HD; l.H = 1; return l; }
__device__ __forceinline__ Lay lay(long long sb, long long sh, int st, int H) { Lay l; l.sb = sb; l.sh = sh; l.st = st; l.H = H; return l; }
