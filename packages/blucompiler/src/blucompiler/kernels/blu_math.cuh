// blucompiler: scalar helpers shared by generated CUDA and C kernels (NumPy semantics).
// Included verbatim at the top of every generated translation unit.
#ifndef BLU_MATH_CUH
#define BLU_MATH_CUH
#ifdef __CUDACC__
#define BLU_FN __device__ __forceinline__
#define BLU_INF __longlong_as_double(0x7ff0000000000000LL)
#define BLU_NAN __longlong_as_double(0x7ff8000000000000LL)
#else
#define BLU_FN static inline
#define BLU_INF __builtin_huge_val()
#define BLU_NAN __builtin_nan("")
#endif
typedef long long blu_i64;
typedef int blu_i32;
typedef unsigned char blu_bool;
// NumPy's maximum/minimum propagate NaN (fmax/fmin would drop it)
#define BLU_MINMAX(T)                                                                           \
  BLU_FN T blu_max_##T(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a >= b ? a : b)); } \
  BLU_FN T blu_min_##T(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a <= b ? a : b)); }
BLU_MINMAX(float)
BLU_MINMAX(double)
BLU_MINMAX(blu_i64)
BLU_MINMAX(blu_i32)
BLU_MINMAX(blu_bool)
BLU_FN float blu_sign_float(float x) { return (float)((x > 0.f) - (x < 0.f)); }
BLU_FN double blu_sign_double(double x) { return (double)((x > 0.0) - (x < 0.0)); }
#endif
