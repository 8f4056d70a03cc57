extern "C" __global__ void {name}_fin(const {acc_t}* __restrict__ part, {out_t}* __restrict__ out0) {{
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < {nout}LL;
       o += (long long)gridDim.x * blockDim.x) {{
    {acc_t} acc = part[o];
    for (int s = 1; s < {splits}; s++) {{
      {acc_t} other = part[(long long)s * {nout}LL + o];
      {combine_other}
    }}
    out0[o] = {finalize};
  }}
}}
