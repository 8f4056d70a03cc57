/* blutensor CPU kernels of the training step: float32, vectorised by the compiler, threaded with OpenMP.
 *
 * Built by backends/numpy/_build.py at first use (cc -O3 -march=native -fopenmp -ffp-contract=off) and cached.
 * Every kernel has a NumPy reference in blutensor.ops (nn_ops, optim) and a test against it.
 *
 * Determinism: elementwise and per-row work is independent of the thread count; reductions across rows
 * (LayerNorm weight/bias gradients, gradient norms) sum fixed-size blocks, then the blocks in index order,
 * so results do not depend on how many threads ran (nor on scheduling).
 *
 * Vectorisation without -ffast-math: sums use explicit lanes (acc[LANES]) combined in a fixed order, and exp
 * is a polynomial (blu_exp) the compiler vectorises; NaN propagates through it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define LANES 16
/* below this much work (elements) a kernel runs on the calling thread: waking the sleeping threads and the barrier
 * at the end cost ~20 us on the 2-core machine, as much as half of a 64K-element GELU; results do not depend on it */
#define PAR_MIN 65536

void blu_set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }
int blu_get_num_threads(void) { return omp_get_max_threads(); }

/* exp(x) for float32: Cephes range reduction + degree-6 polynomial, ~1 ulp; NaN in, NaN out. */
static inline float blu_exp(float x) {
    float xc = x > 88.3762626647949f ? 88.3762626647949f : x;
    xc = xc < -87.33654475f ? -87.33654475f : xc;
    float fx = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rint by 1.5 * 2^23 (vectorises) */
    float r = xc - fx * 0.693359375f;
    r = r + fx * 2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500E-4f;
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * z + r + 1.0f;
    int32_t n = (int32_t)fx + 127;
    union { int32_t i; float f; } u;
    u.i = n << 23;
    return y * u.f;
}

static inline float blu_tanh(float u) { return 1.0f - 2.0f / (blu_exp(2.0f * u) + 1.0f); }

static inline float lane_sum(const float *acc) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

static inline float row_sum(const float *x, long n) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[j + l];
    float s = lane_sum(acc);
    for (; j < n; j++) s += x[j];
    return s;
}

static inline float row_dot(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    float s = lane_sum(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline float row_max(const float *x, long n, int *nan) {
    float acc[LANES];
    int bad = 0;
    for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = x[j + l];
            bad |= v != v;
            acc[l] = v > acc[l] ? v : acc[l];
        }
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    for (; j < n; j++) {
        bad |= x[j] != x[j];
        m = x[j] > m ? x[j] : m;
    }
    *nan = bad;
    return m;
}

/* ---------------------------------------------------------------- GELU (tanh approximation) */
#define GELU_C 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_K 0.044715f
#define CHUNK 4096

void blu_gelu_tanh_forward(const float *x, float *y, long n) {
#pragma omp parallel for schedule(static) if(n >= PAR_MIN)
    for (long c = 0; c < n; c += CHUNK) {
        long e = c + CHUNK < n ? c + CHUNK : n;
        for (long i = c; i < e; i++) {
            float v = x[i];
            float t = blu_tanh(GELU_C * (v + GELU_K * v * v * v));
            y[i] = 0.5f * v * (1.0f + t);
        }
    }
}

void blu_gelu_tanh_backward(const float *g, const float *x, float *dx, long n) {
#pragma omp parallel for schedule(static) if(n >= PAR_MIN)
    for (long c = 0; c < n; c += CHUNK) {
        long e = c + CHUNK < n ? c + CHUNK : n;
        for (long i = c; i < e; i++) {
            float v = x[i];
            float t = blu_tanh(GELU_C * (v + GELU_K * v * v * v));
            float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_K * v * v);
            dx[i] = g[i] * d;
        }
    }
}

/* ---------------------------------------------------------------- LayerNorm over the last dim */
/* One row of LayerNorm: mean and variance (two passes, lane-split sum of squares), y = (x - mean) * rstd * w + b
 * (w, b may be NULL); shared by blu_layer_norm_forward and blu_add_layer_norm_forward, so the two agree bitwise. */
static inline void ln_row(const float *xr, const float *w, const float *b, float *yr, float *mean, float *rstd,
                          long C, float eps) {
    float mu = row_sum(xr, C) / (float)C;
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= C; j += LANES)
        for (int l = 0; l < LANES; l++) {
            float d = xr[j + l] - mu;
            acc[l] += d * d;
        }
    float var = lane_sum(acc);
    for (; j < C; j++) var += (xr[j] - mu) * (xr[j] - mu);
    float rs = 1.0f / sqrtf(var / (float)C + eps);
    *mean = mu;
    *rstd = rs;
    if (w && b)
        for (j = 0; j < C; j++) yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
    else if (w)
        for (j = 0; j < C; j++) yr[j] = (xr[j] - mu) * rs * w[j];
    else if (b)
        for (j = 0; j < C; j++) yr[j] = (xr[j] - mu) * rs + b[j];
    else
        for (j = 0; j < C; j++) yr[j] = (xr[j] - mu) * rs;
}

/* One row of LayerNorm's backward: xh = (x - mean) * rstd and gw = g * w into the scratch rows, the row's
 * dweight/dbias terms added into pw/pb (when want_p), and the input gradient rstd * (gw - mean(gw) - xh *
 * mean(gw * xh)) (+ add, when not NULL) written to o (when not NULL). */
static inline void ln_row_backward(const float *gr, const float *xr, const float *w, float mu, float rs, float *xh,
                                   float *gw, float *pw, float *pb, int want_p, const float *add, float *o, long C) {
    for (long j = 0; j < C; j++) {
        xh[j] = (xr[j] - mu) * rs;
        gw[j] = w ? gr[j] * w[j] : gr[j];
    }
    if (want_p)
        for (long j = 0; j < C; j++) {
            pw[j] += gr[j] * xh[j];
            pb[j] += gr[j];
        }
    if (!o) return;
    float a = row_sum(gw, C) / (float)C;
    float bb = row_dot(gw, xh, C) / (float)C;
    if (add)
        for (long j = 0; j < C; j++) o[j] = rs * (gw[j] - a - xh[j] * bb) + add[j];
    else
        for (long j = 0; j < C; j++) o[j] = rs * (gw[j] - a - xh[j] * bb);
}

/* dw/db (either may be NULL) = the per-block partials part[nblk][2][C] summed over the blocks in order (zero when
 * there are none: have_p = 0). */
static void ln_sum_partials(const float *part, long nblk, long C, int have_p, float *dw, float *db) {
#pragma omp parallel for schedule(static) if(nblk * C >= PAR_MIN)
    for (long j = 0; j < C; j++) {
        float sw = 0.0f, sb = 0.0f;
        if (have_p)
            for (long k = 0; k < nblk; k++) {
                sw += part[k * 2 * C + j];
                sb += part[k * 2 * C + C + j];
            }
        if (dw) dw[j] = sw;
        if (db) db[j] = sb;
    }
}

void blu_layer_norm_forward(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                            long N, long C, float eps) {
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long r = 0; r < N; r++) ln_row(x + r * C, w, b, y + r * C, mean + r, rstd + r, C, eps);
}

#define LN_BLOCK 32 /* rows per partial sum of dweight/dbias */

/* gx (may be NULL), and per-block partials part[nblk][2][C] of dweight (g * xhat) and dbias (g), then
 * dw/db (may be NULL) summed over the blocks in order. */
void blu_layer_norm_backward(const float *g, const float *x, const float *w, const float *mean, const float *rstd,
                             float *gx, float *part, float *dw, float *db, long N, long C) {
    long nblk = (N + LN_BLOCK - 1) / LN_BLOCK;
    int want_p = dw != NULL || db != NULL;
#pragma omp parallel if(N * C >= PAR_MIN)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * C));
#pragma omp for schedule(static)
        for (long k = 0; k < nblk; k++) {
            float *pw = part + k * 2 * C, *pb = pw + C;
            if (want_p)
                for (long j = 0; j < 2 * C; j++) pw[j] = 0.0f;
            long r1 = (k + 1) * LN_BLOCK < N ? (k + 1) * LN_BLOCK : N;
            for (long r = k * LN_BLOCK; r < r1; r++)
                ln_row_backward(g + r * C, x + r * C, w, mean[r], rstd[r], buf, buf + C, pw, pb, want_p, NULL,
                                gx ? gx + r * C : NULL, C);
        }
        free(buf);
    }
    if (want_p) ln_sum_partials(part, nblk, C, 1, dw, db);
}

/* ---------------------------------------------------------------- RMSNorm over the last dim */
/* One row of RMSNorm: rstd = 1 / sqrt(mean(x^2) + eps) (lane-split sum of squares), y = x * rstd * w (w may be
 * NULL); shared by blu_rms_norm_forward and blu_add_rms_norm_forward, so the two agree bitwise. */
static inline void rms_row(const float *xr, const float *w, float *yr, float *rstd, long C, float eps) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= C; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += xr[j + l] * xr[j + l];
    float ss = lane_sum(acc);
    for (; j < C; j++) ss += xr[j] * xr[j];
    float rs = 1.0f / sqrtf(ss / (float)C + eps);
    *rstd = rs;
    if (w)
        for (j = 0; j < C; j++) yr[j] = xr[j] * rs * w[j];
    else
        for (j = 0; j < C; j++) yr[j] = xr[j] * rs;
}

/* One row of RMSNorm's backward: o[j] += rstd * (gw - xhat * mean(gw * xhat)) (when o is not NULL), gw = g * w
 * (w may be NULL), xhat = x * rstd; the row's dweight terms g * xhat added into pw (when want_p). Shared by
 * blu_rms_norm_backward and blu_add_rms_norm_backward. */
static inline void rms_row_backward(const float *gr, const float *xr, const float *w, float rs, float *o, float *pw,
                                    int want_p, long C) {
    long j;
    if (o) {
        float acc[LANES] = {0};
        j = 0;
        for (; j + LANES <= C; j += LANES)
            for (int l = 0; l < LANES; l++)
                acc[l] += (w ? gr[j + l] * w[j + l] : gr[j + l]) * xr[j + l] * rs;
        float dot = lane_sum(acc);
        for (; j < C; j++) dot += (w ? gr[j] * w[j] : gr[j]) * xr[j] * rs;
        float m = dot / (float)C;
        for (j = 0; j < C; j++) {
            float gw = w ? gr[j] * w[j] : gr[j];
            o[j] += rs * (gw - xr[j] * rs * m);
        }
    }
    if (want_p)
        for (j = 0; j < C; j++) pw[j] += gr[j] * xr[j] * rs;
}

/* dw[j] = the per-block partials part[nblk][C] summed over the blocks in order (zero when have_p = 0). */
static void rms_sum_partials(const float *part, long nblk, long C, int have_p, float *dw) {
#pragma omp parallel for schedule(static) if(nblk * C >= PAR_MIN)
    for (long j = 0; j < C; j++) {
        float sw = 0.0f;
        if (have_p)
            for (long k = 0; k < nblk; k++) sw += part[k * C + j];
        dw[j] = sw;
    }
}

void blu_rms_norm_forward(const float *x, const float *w, float *y, float *rstd, long N, long C, float eps) {
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long i = 0; i < N; i++) rms_row(x + i * C, w, y + i * C, rstd + i, C, eps);
}

/* gx (may be NULL) = rstd * (g*w - xhat * mean(g*w*xhat)), and per-block partials part[nblk][C] of dweight
 * (g * xhat), then dw (may be NULL) summed over the blocks in order. */
void blu_rms_norm_backward(const float *g, const float *x, const float *w, const float *rstd, float *gx,
                           float *part, float *dw, long N, long C) {
    long nblk = (N + LN_BLOCK - 1) / LN_BLOCK;
    int want_p = dw != NULL;
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long k = 0; k < nblk; k++) {
        float *pw = part + k * C;
        if (want_p)
            for (long j = 0; j < C; j++) pw[j] = 0.0f;
        long r1 = (k + 1) * LN_BLOCK < N ? (k + 1) * LN_BLOCK : N;
        for (long i = k * LN_BLOCK; i < r1; i++) {
            float *o = gx ? gx + i * C : NULL;
            if (o)
                for (long j = 0; j < C; j++) o[j] = 0.0f;
            rms_row_backward(g + i * C, x + i * C, w, rstd[i], o, pw, want_p, C);
        }
    }
    if (dw) rms_sum_partials(part, nblk, C, want_p, dw);
}

/* ---------------------------------------------------------------- residual add + RMSNorm */
/* h = x + r, then RMSNorm of h exactly as blu_rms_norm_forward computes it (rstd[i] = 1 / sqrt(mean(h^2) + eps),
 * y = h * rstd * w; w may be NULL): the fused op's values are bitwise add + rms_norm's. */
void blu_add_rms_norm_forward(const float *x, const float *r, const float *w, float *h, float *y, float *rstd,
                              long N, long C, float eps) {
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long i = 0; i < N; i++) {
        const float *xr = x + i * C, *rr = r + i * C;
        float *hr = h + i * C;
        for (long j = 0; j < C; j++) hr[j] = xr[j] + rr[j];
        rms_row(hr, w, y + i * C, rstd + i, C, eps);
    }
}

/* dsum = gh + rstd * (gy*w - hhat * mean(gy*w*hhat)), hhat = h * rstd, as blu_rms_norm_backward computes it
 * followed by the add of gh (gy or gh may be NULL: no such gradient); per-block partials part[nblk][C] of dweight
 * (gy * hhat), then dw (may be NULL) summed over the blocks in order. */
void blu_add_rms_norm_backward(const float *gy, const float *gh, const float *h, const float *w, const float *rstd,
                               float *dsum, float *part, float *dw, long N, long C) {
    long nblk = (N + LN_BLOCK - 1) / LN_BLOCK;
    int want_p = dw != NULL && gy != NULL;
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long k = 0; k < nblk; k++) {
        float *pw = part + k * C;
        if (want_p)
            for (long j = 0; j < C; j++) pw[j] = 0.0f;
        long r1 = (k + 1) * LN_BLOCK < N ? (k + 1) * LN_BLOCK : N;
        for (long i = k * LN_BLOCK; i < r1; i++) {
            float *o = dsum + i * C;
            for (long j = 0; j < C; j++) o[j] = gh ? gh[i * C + j] : 0.0f;
            if (gy) rms_row_backward(gy + i * C, h + i * C, w, rstd[i], o, pw, want_p, C);
        }
    }
    if (dw) rms_sum_partials(part, nblk, C, want_p, dw);
}

/* ---------------------------------------------------------------- softmax cross-entropy (class dim last) */
/* loss[r] (0 for ignored rows) and lse[r]; label smoothing ls mixes in lse - mean(z). */
void blu_cross_entropy_forward(const float *z, const int64_t *t, float *loss, float *lse, long N, long C,
                               int64_t ignore_index, float ls) {
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long r = 0; r < N; r++) {
        const float *zr = z + r * C;
        int nan;
        float m = row_max(zr, C, &nan);
        float acc[LANES] = {0};
        long j = 0;
        for (; j + LANES <= C; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += blu_exp(zr[j + l] - m);
        float s = lane_sum(acc);
        for (; j < C; j++) s += blu_exp(zr[j] - m);
        float lr = nan ? NAN : m + logf(s);
        lse[r] = lr;
        if (t[r] == ignore_index) {
            loss[r] = 0.0f;
            continue;
        }
        float l = lr - zr[t[r]];
        if (ls != 0.0f) l = (1.0f - ls) * l + ls * (lr - row_sum(zr, C) / (float)C);
        loss[r] = l;
    }
}

/* dz = (softmax(z) - ls/C - (1-ls) onehot(t)) * scale[r * sstride], 0 for ignored rows: one pass. */
void blu_cross_entropy_backward(const float *z, const int64_t *t, const float *lse, const float *scale, long sstride,
                                float *dz, long N, long C, int64_t ignore_index, float ls) {
#pragma omp parallel for schedule(static) if(N * C >= PAR_MIN)
    for (long r = 0; r < N; r++) {
        const float *zr = z + r * C;
        float *o = dz + r * C;
        if (t[r] == ignore_index) {
            memset(o, 0, sizeof(float) * (size_t)C);
            continue;
        }
        float sc = scale[r * sstride], lr = lse[r], off = ls / (float)C;
        for (long j = 0; j < C; j++) o[j] = (blu_exp(zr[j] - lr) - off) * sc;
        o[t[r]] = (blu_exp(zr[t[r]] - lr) - off - (1.0f - ls)) * sc;
    }
}

/* ---------------------------------------------------------------- embedding backward */
/* gw (V, D) = 0, then gw[idx[n]] += g[n] in token order; threads own column slices (race-free, ordered). */
void blu_embedding_backward(const int64_t *idx, const float *g, float *gw, long Ntok, long V, long D) {
#pragma omp parallel if(Ntok * D >= PAR_MIN)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        long step = ((D + nt - 1) / nt + 15) / 16 * 16;
        long c0 = id * step, c1 = c0 + step < D ? c0 + step : D;
        if (c0 < c1) {
            for (long v = 0; v < V; v++) memset(gw + v * D + c0, 0, sizeof(float) * (size_t)(c1 - c0));
            for (long n = 0; n < Ntok; n++) {
                float *dst = gw + idx[n] * D;
                const float *src = g + n * D;
                for (long c = c0; c < c1; c++) dst[c] += src[c];
            }
        }
    }
}

/* ---------------------------------------------------------------- flash-style attention */
/* q (BH, L, E), k (BH, S, E), v (BH, S, Ev) contiguous; o (BH, L, Ev), lse (BH, L) = log sum exp of the
 * scaled scores. One (batch, head) per task, RB query rows at a time: their scores live in an RB x S buffer
 * (no L x S matrix); the small products are register-blocked (each loaded vector of K^T / V feeds RB
 * multiply-adds). causal: key j <= query i. */
#define RB 8
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
static inline v16 ld16(const float *p) { return *(const v16u *)p; }
static inline void st16(float *p, v16 x) { *(v16u *)p = x; }
/* the attention products may use fused multiply-add (the rest of the file rounds every operation) */
#define CONTRACT __attribute__((optimize("fp-contract=fast")))

/* C[r][c] = sum_k A[r][k] * B[k][c] for r < R, c < N (C overwritten). */
CONTRACT static void mm_rows(const float *A, long lda, long R, const float *B, long ldb, long K, long N, float *C,
                             long ldc) {
    long c = 0;
    if (R == RB) {
        for (; c + LANES <= N; c += LANES) {
            v16 acc[RB];
            for (int r = 0; r < RB; r++) acc[r] = (v16){0};
            for (long k = 0; k < K; k++) {
                v16 b = ld16(B + k * ldb + c);
                for (int r = 0; r < RB; r++) acc[r] += A[r * lda + k] * b;
            }
            for (int r = 0; r < RB; r++) st16(C + r * ldc + c, acc[r]);
        }
    }
    for (long r = 0; r < R; r++) {
        long c2 = c;
        for (; c2 + LANES <= N; c2 += LANES) {
            v16 acc = {0};
            for (long k = 0; k < K; k++) acc += A[r * lda + k] * ld16(B + k * ldb + c2);
            st16(C + r * ldc + c2, acc);
        }
        for (; c2 < N; c2++) {
            float s = 0.0f;
            for (long k = 0; k < K; k++) s += A[r * lda + k] * B[k * ldb + c2];
            C[r * ldc + c2] = s;
        }
    }
}

/* C[j][c] += sum_r A[r][j] * B[r][c] for j < N, c < D, r < R (the transposed-A update of dK, dV). */
CONTRACT static void mm_tn_acc(const float *A, long lda, long R, const float *B, long ldb, long N, long D, float *C,
                               long ldc) {
    long j = 0;
    for (; j + 4 <= N; j += 4) {
        long c = 0;
        for (; c + LANES <= D; c += LANES) {
            v16 acc[4];
            for (int jj = 0; jj < 4; jj++) acc[jj] = ld16(C + (j + jj) * ldc + c);
            for (long r = 0; r < R; r++) {
                v16 b = ld16(B + r * ldb + c);
                for (int jj = 0; jj < 4; jj++) acc[jj] += A[r * lda + j + jj] * b;
            }
            for (int jj = 0; jj < 4; jj++) st16(C + (j + jj) * ldc + c, acc[jj]);
        }
        for (; c < D; c++)
            for (int jj = 0; jj < 4; jj++) {
                float s = C[(j + jj) * ldc + c];
                for (long r = 0; r < R; r++) s += A[r * lda + j + jj] * B[r * ldb + c];
                C[(j + jj) * ldc + c] = s;
            }
    }
    for (; j < N; j++)
        for (long c = 0; c < D; c++) {
            float s = C[j * ldc + c];
            for (long r = 0; r < R; r++) s += A[r * lda + j] * B[r * ldb + c];
            C[j * ldc + c] = s;
        }
}

static void transpose(const float *a, float *aT, long R, long Cc) {
    for (long r = 0; r < R; r++)
        for (long c = 0; c < Cc; c++) aT[c * R + r] = a[r * Cc + c];
}

/* keys row i of a block may see: i + 1 (causal) or all S */
static inline long keys_of(long i, long S, int causal) { return causal ? (i + 1 < S ? i + 1 : S) : S; }
/* keys a block computes: its last row's, rounded up to whole vectors where the keys exist (extra ones zeroed) */
static inline long block_keys(long i, long S, int causal) {
    long n = keys_of(i, S, causal), n16 = (n + LANES - 1) / LANES * LANES;
    return n16 < S ? n16 : S;
}

void blu_sdpa_forward(const float *q, const float *k, const float *v, float *o, float *lse, long BH, long L, long S,
                      long E, long Ev, float scale, int causal) {
#pragma omp parallel if(BH > 1)
    {
        float *kT = (float *)malloc(sizeof(float) * (size_t)(E * S));
        float *s = (float *)malloc(sizeof(float) * (size_t)(RB * S));
#pragma omp for schedule(static)
        for (long bh = 0; bh < BH; bh++) {
            const float *qb = q + bh * L * E, *kb = k + bh * S * E, *vb = v + bh * S * Ev;
            transpose(kb, kT, S, E);
            for (long i0 = 0; i0 < L; i0 += RB) {
                long R = L - i0 < RB ? L - i0 : RB;
                long n = block_keys(i0 + R - 1, S, causal);
                mm_rows(qb + i0 * E, E, R, kT, S, E, n, s, S);
                for (long r = 0; r < R; r++) {
                    float *sr = s + r * S;
                    long nr = keys_of(i0 + r, S, causal);
                    for (long j = 0; j < nr; j++) sr[j] *= scale;
                    int nan;
                    float m = row_max(sr, nr, &nan);
                    float acc[LANES] = {0};
                    long j = 0;
                    for (; j + LANES <= nr; j += LANES)
                        for (int l = 0; l < LANES; l++) {
                            float p = blu_exp(sr[j + l] - m);
                            sr[j + l] = p;
                            acc[l] += p;
                        }
                    float sum = lane_sum(acc);
                    for (; j < nr; j++) {
                        sr[j] = blu_exp(sr[j] - m);
                        sum += sr[j];
                    }
                    float inv = 1.0f / sum;
                    for (j = 0; j < nr; j++) sr[j] *= inv;
                    for (; j < n; j++) sr[j] = 0.0f;
                    lse[bh * L + i0 + r] = nan ? NAN : m + logf(sum);
                }
                mm_rows(s, S, R, vb, Ev, n, Ev, o + (bh * L + i0) * Ev, Ev);
            }
        }
        free(kT);
        free(s);
    }
}

/* dq, dk, dv from do, o and lse (probabilities recomputed block by block; dk/dv of a head summed over query
 * blocks in order by the one task that owns the head). */
void blu_sdpa_backward(const float *q, const float *k, const float *v, const float *o, const float *go,
                       const float *lse, float *dq, float *dk, float *dv, long BH, long L, long S, long E, long Ev,
                       float scale, int causal) {
#pragma omp parallel if(BH > 1)
    {
        float *kT = (float *)malloc(sizeof(float) * (size_t)(E * S));
        float *vT = (float *)malloc(sizeof(float) * (size_t)(Ev * S));
        float *p = (float *)malloc(sizeof(float) * (size_t)(RB * S));
        float *ds = (float *)malloc(sizeof(float) * (size_t)(RB * S));
#pragma omp for schedule(static)
        for (long bh = 0; bh < BH; bh++) {
            const float *qb = q + bh * L * E, *kb = k + bh * S * E, *vb = v + bh * S * Ev;
            float *dkb = dk + bh * S * E, *dvb = dv + bh * S * Ev;
            transpose(kb, kT, S, E);
            transpose(vb, vT, S, Ev);
            memset(dkb, 0, sizeof(float) * (size_t)(S * E));
            memset(dvb, 0, sizeof(float) * (size_t)(S * Ev));
            for (long i0 = 0; i0 < L; i0 += RB) {
                long R = L - i0 < RB ? L - i0 : RB;
                long n = block_keys(i0 + R - 1, S, causal);
                const float *qi = qb + i0 * E, *gi = go + (bh * L + i0) * Ev;
                mm_rows(qi, E, R, kT, S, E, n, p, S);
                mm_rows(gi, Ev, R, vT, S, Ev, n, ds, S); /* dp = do . v^T */
                for (long r = 0; r < R; r++) {
                    float *pr = p + r * S, *dr = ds + r * S;
                    long nr = keys_of(i0 + r, S, causal);
                    float Di = row_dot(gi + r * Ev, o + (bh * L + i0 + r) * Ev, Ev);
                    float li = lse[bh * L + i0 + r];
                    long j = 0;
                    for (; j < nr; j++) {
                        float pj = blu_exp(pr[j] * scale - li);
                        pr[j] = pj;
                        dr[j] = pj * (dr[j] - Di) * scale;
                    }
                    for (; j < n; j++) pr[j] = dr[j] = 0.0f;
                }
                mm_rows(ds, S, R, kb, E, n, E, dq + (bh * L + i0) * E, E);
                mm_tn_acc(ds, S, R, qi, E, n, E, dkb, E);
                mm_tn_acc(p, S, R, gi, Ev, n, Ev, dvb, Ev);
            }
        }
        free(kT);
        free(vT);
        free(p);
        free(ds);
    }
}

/* ---------------------------------------------------------------- AdamW (PyTorch's order of operations) */
/* The same float32 operations, in the same order, as blutensor.optim.adamw.adamw_update (bit-identical with
 * -ffp-contract=off); the coefficients come from the caller already rounded to float32. */
void blu_adamw(float *x, const float *g, float *m, float *v, long n, float decay, float one_m_b1, float b2,
               float one_m_b2, float bc2_sqrt, float eps, float neg_step) {
#pragma omp parallel for schedule(static) if(n >= PAR_MIN)
    for (long c = 0; c < n; c += CHUNK) {
        long e = c + CHUNK < n ? c + CHUNK : n;
        for (long i = c; i < e; i++) {
            float gi = g[i];
            float xi = x[i] * decay;
            float mi = m[i] + one_m_b1 * (gi - m[i]);
            float vi = v[i] * b2;
            vi = vi + one_m_b2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            x[i] = xi + (neg_step * mi) / denom;
            m[i] = mi;
            v[i] = vi;
        }
    }
}

/* ---------------------------------------------------------------- gradient norm over many tensors */
#define NORM_BLOCK 16384

/* out[t] = sum of squares of tensor t (float64), over fixed blocks summed in order. ptrs/lens: T tensors;
 * part: one double per block (nblk = sum of ceil(len / NORM_BLOCK)). */
void blu_sum_squares(const int64_t *ptrs, const int64_t *lens, long T, double *part, double *out) {
    long nblk = 0;
    for (long t = 0; t < T; t++) nblk += (lens[t] + NORM_BLOCK - 1) / NORM_BLOCK;
#pragma omp parallel for schedule(static) if(nblk > 1)
    for (long b = 0; b < nblk; b++) {
        long t = 0, first = 0;
        for (;; t++) { /* the tensor of block b */
            long nb = (lens[t] + NORM_BLOCK - 1) / NORM_BLOCK;
            if (b < first + nb) break;
            first += nb;
        }
        const float *x = (const float *)(intptr_t)ptrs[t];
        long i0 = (b - first) * NORM_BLOCK, i1 = i0 + NORM_BLOCK < lens[t] ? i0 + NORM_BLOCK : lens[t];
        double acc[8] = {0};
        long i = i0;
        for (; i + 8 <= i1; i += 8)
            for (int l = 0; l < 8; l++) acc[l] += (double)x[i + l] * (double)x[i + l];
        double s = 0.0;
        for (int l = 0; l < 8; l++) s += acc[l];
        for (; i < i1; i++) s += (double)x[i] * (double)x[i];
        part[b] = s;
    }
    long b = 0;
    for (long t = 0; t < T; t++) {
        long nb = (lens[t] + NORM_BLOCK - 1) / NORM_BLOCK;
        double s = 0.0;
        for (long j = 0; j < nb; j++) s += part[b + j];
        b += nb;
        out[t] = s;
    }
}

/* x *= c for every tensor (the clip of clip_grad_norm_). */
void blu_scale_(const int64_t *ptrs, const int64_t *lens, long T, float c) {
    for (long t = 0; t < T; t++) {
        float *x = (float *)(intptr_t)ptrs[t];
        long n = lens[t];
#pragma omp parallel for schedule(static) if(n >= PAR_MIN)
        for (long i = 0; i < n; i++) x[i] *= c;
    }
}

/* ---------------------------------------------------------------- residual add + LayerNorm */
/* h = x + r, then LayerNorm of h exactly as blu_layer_norm_forward computes it (y = (h - mean) * rstd * w + b;
 * w, b may be NULL), in one pass over each row: the fused op's values are bitwise add + layer_norm's. */
void blu_add_layer_norm_forward(const float *x, const float *r, const float *w, const float *b, float *h, float *y,
                                float *mean, float *rstd, long N, long C, float eps) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        const float *xr = x + i * C, *rr = r + i * C;
        float *hr = h + i * C, *yr = y + i * C;
        for (long j = 0; j < C; j++) hr[j] = xr[j] + rr[j];
        ln_row(hr, w, b, yr, mean + i, rstd + i, C, eps);
    }
}

/* dsum = rstd * (gy*w - mean(gy*w) - hhat * mean(gy*w*hhat)) + gh, hhat = (h - mean) * rstd, as
 * blu_layer_norm_backward computes it followed by the add of gh (gy or gh may be NULL: no such gradient);
 * per-block partials part[nblk][2][C] of dweight (gy * hhat) and dbias (gy), then dw/db (may be NULL) summed
 * over the blocks in order. */
void blu_add_layer_norm_backward(const float *gy, const float *gh, const float *h, const float *w, const float *mean,
                                 const float *rstd, float *dsum, float *part, float *dw, float *db, long N, long C) {
    long nblk = (N + LN_BLOCK - 1) / LN_BLOCK;
    int want_p = (dw != NULL || db != NULL) && gy != NULL;
#pragma omp parallel
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * C));
#pragma omp for schedule(static)
        for (long k = 0; k < nblk; k++) {
            float *pw = part + k * 2 * C, *pb = pw + C;
            if (want_p)
                for (long j = 0; j < 2 * C; j++) pw[j] = 0.0f;
            long r1 = (k + 1) * LN_BLOCK < N ? (k + 1) * LN_BLOCK : N;
            for (long i = k * LN_BLOCK; i < r1; i++) {
                float *o = dsum + i * C;
                if (!gy) {
                    for (long j = 0; j < C; j++) o[j] = gh ? gh[i * C + j] : 0.0f;
                    continue;
                }
                ln_row_backward(gy + i * C, h + i * C, w, mean[i], rstd[i], buf, buf + C, pw, pb, want_p,
                                gh ? gh + i * C : NULL, o, C);
            }
        }
        free(buf);
    }
    if (dw || db) ln_sum_partials(part, nblk, C, want_p, dw, db);
}

/* ---------------------------------------------------------------- threaded GEMM over the BLAS NumPy uses */
/* The row blocks of a host GEMM run on the OpenMP threads of the kernels above (one pool for the whole step:
 * no hand-off to other threads, no interpreter lock), each block one single-threaded cblas_sgemm call of the
 * BLAS library NumPy is linked with (the pointer comes from backends/numpy/gemm.py), with the same arguments NumPy's
 * matmul passes for that block: results equal np.matmul's on the same blocks. */
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                           int64_t, float, float *, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                           float *, int);
static void *blu_sgemm_ptr = NULL;
static int blu_sgemm_ilp64 = 0;

void blu_set_sgemm(void *fn, int ilp64) {
    blu_sgemm_ptr = fn;
    blu_sgemm_ilp64 = ilp64;
}

static void sgemm_block(int ta, int tb, long M, long N, long K, const float *A, long lda, const float *B, long ldb,
                        float *C, long ldc) {
    const int row_major = 101, no_trans = 111, trans = 112;
    if (blu_sgemm_ilp64)
        ((sgemm64_fn)blu_sgemm_ptr)(row_major, ta ? trans : no_trans, tb ? trans : no_trans, M, N, K, 1.0f, A, lda,
                                    B, ldb, 0.0f, C, ldc);
    else
        ((sgemm32_fn)blu_sgemm_ptr)(row_major, ta ? trans : no_trans, tb ? trans : no_trans, (int)M, (int)N, (int)K,
                                    1.0f, A, (int)lda, B, (int)ldb, 0.0f, C, (int)ldc);
}

/* C (M, N), row stride ldc = op(A) @ op(B) (+ bias[N] on every row), op(X) = X or X^T (ta/tb); row blocks of
 * `step` rows, block p on thread p of `nthreads` (the row split, hence the results, depend on step only). */
void blu_gemm_rows(int ta, int tb, long M, long N, long K, const float *A, long lda, const float *B, long ldb,
                   float *C, long ldc, const float *bias, long step, int nthreads) {
    long nparts = (M + step - 1) / step;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long p = 0; p < nparts; p++) {
        long r0 = p * step, r1 = r0 + step < M ? r0 + step : M;
        sgemm_block(ta, tb, r1 - r0, N, K, ta ? A + r0 : A + r0 * lda, lda, B, ldb, C + r0 * ldc, ldc);
        if (bias)
            for (long r = r0; r < r1; r++) {
                float *cr = C + r * ldc;
                for (long j = 0; j < N; j++) cr[j] += bias[j];
            }
    }
}

/* ---------------------------------------------------------------- strided copy, column sums */
/* dst (contiguous, shape[0..ndim)) = src read at element strides sstride: the transposing copies around the
 * attention kernels, one row of the last dim per iteration, rows split over the threads. */
void blu_copy_strided(const float *src, float *dst, int ndim, const int64_t *shape, const int64_t *sstride) {
    long rows = 1;
    for (int d = 0; d < ndim - 1; d++) rows *= shape[d];
    long n = shape[ndim - 1], s_last = sstride[ndim - 1];
#pragma omp parallel for schedule(static)
    for (long r = 0; r < rows; r++) {
        long rem = r, off = 0;
        for (int d = ndim - 2; d >= 0; d--) {
            off += (rem % shape[d]) * sstride[d];
            rem /= shape[d];
        }
        const float *s = src + off;
        float *o = dst + r * n;
        if (s_last == 1)
            memcpy(o, s, sizeof(float) * (size_t)n);
        else
            for (long j = 0; j < n; j++) o[j] = s[j * s_last];
    }
}

/* out[j] = sum over rows i of x[i][j] (x (N, C) contiguous), rows added in order (NumPy's axis-0 sum of a
 * C-contiguous array adds whole rows in order: the same float32 results); column blocks split over threads. */
void blu_col_sum(const float *x, float *out, long N, long C) {
    long nblk = (C + 63) / 64;
#pragma omp parallel for schedule(static)
    for (long k = 0; k < nblk; k++) {
        long c0 = k * 64, c1 = c0 + 64 < C ? c0 + 64 : C;
        float acc[64];
        for (long j = c0; j < c1; j++) acc[j - c0] = 0.0f;
        for (long i = 0; i < N; i++) {
            const float *xr = x + i * C;
            for (long j = c0; j < c1; j++) acc[j - c0] += xr[j];
        }
        for (long j = c0; j < c1; j++) out[j] = acc[j - c0];
    }
}
