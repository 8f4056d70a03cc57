// blucompiler: compile check of the helpers every generated kernel includes (tests/test_nvrtc_compile.py
// builds it for each supported architecture). Not launched at run time: generated kernels embed
// blu_math.cuh verbatim.
#include "blu_math.cuh"

extern "C" __global__ void blu_math_check_forward(const float* __restrict__ x, const double* __restrict__ y,
                                                  const blu_i64* __restrict__ n, float* __restrict__ out,
                                                  long long count) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += (long long)gridDim.x * blockDim.x) {
    const float a = blu_max_float(x[i], (float)BLU_NAN) + blu_min_float(x[i], -(float)BLU_INF);
    const double b = blu_max_double(y[i], 0.0) * blu_sign_double(y[i]);
    const blu_i64 c = blu_max_blu_i64(n[i], 0LL);
    const blu_bool d = blu_max_blu_bool((blu_bool)(a > 0.f), (blu_bool)0);
    out[i] = a + (float)b + (float)c + (float)d + blu_sign_float(x[i]);
  }
}
