// blucompiler generated reduction kernel {name}: domain {domain}, reduce {kind} over axes {axes}
// one block per output element; threads stride over the reduced elements, then a tree reduction
extern "C" __global__ void {name}({params}) {{
  __shared__ {acc_t} smem[32];
  for (long long o = blockIdx.x; o < {nout}LL; o += gridDim.x) {{
    {acc_t} acc = {init};
    for (long long r = threadIdx.x; r < {nred}LL; r += blockDim.x) {{
{coords}{body}
      {combine}
    }}
    for (int s = 16; s > 0; s >>= 1) {{
      {acc_t} other = __shfl_down_sync(0xffffffffu, acc, s);
      {combine_other}
    }}
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {{
      acc = (threadIdx.x < (blockDim.x >> 5)) ? smem[threadIdx.x] : {init};
      for (int s = 16; s > 0; s >>= 1) {{
        {acc_t} other = __shfl_down_sync(0xffffffffu, acc, s);
        {combine_other}
      }}
      if (threadIdx.x == 0) out0[o] = {finalize};
    }}
    __syncthreads();
  }}
}}
