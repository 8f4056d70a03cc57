// blucompiler generated column reduction {name}: domain {domain}, reduce {kind} over leading axes {axes}
// phase 1: block (32 x 8) = 32 consecutive outputs (coalesced reads) x a chunk of {chunk} reduced rows;
// phase 2 ({name}_fin) combines the {splits} partial results per output in a fixed order (deterministic)
extern "C" __global__ void {name}({params}{part_param}) {{
  __shared__ {acc_t} sm[8][33];
  const long long o = (long long)blockIdx.x * 32 + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * {chunk}LL;
  const long long r1 = (r0 + {chunk}LL < {nred}LL) ? r0 + {chunk}LL : {nred}LL;
  {acc_t} acc = {init};
  if (o < {nout}LL) {{
    for (long long r = r0 + threadIdx.y; r < r1; r += 8) {{
{coords}{body}
      {combine}
    }}
  }}
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && o < {nout}LL) {{
    for (int k = 1; k < 8; k++) {{
      {acc_t} other = sm[k][threadIdx.x];
      {combine_other}
    }}
    {store}
  }}
}}
{fin}
