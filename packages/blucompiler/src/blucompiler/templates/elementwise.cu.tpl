// blucompiler generated elementwise kernel {name}: domain {domain}
extern "C" __global__ void {name}({params}) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {numel}LL;
       i += (long long)gridDim.x * blockDim.x) {{
{coords}{body}
  }}
}}
