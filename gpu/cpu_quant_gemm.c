/* The outer-product GEMM tiles of gpu/cpu_quant.c (issue 39), #included by it: for batches of
 * rows (from GEMM_MIN_M_DEFAULT, Q8_0 from GEMM_MIN_M_Q8_0, up to GEMM_MAX_M_DEFAULT) and every
 * format, with AVX-512 or AVX2+FMA (without either the fused and buffered tiles serve every M).
 *
 * Written once over a few vector operations (gvec, gmask, gv_*; GV lanes a vector): AVX-512
 * GV = 16, AVX2 GV = 8. A thread takes a panel of NP = 2 GV weight rows (output columns: 32
 * with AVX-512, 16 with AVX2) and, one K-chunk of GKC at a time, dequantizes it (dequant_row:
 * exactly gguf-py's values) into a row-major stage, then transposes it GV x GV in registers
 * (transpose_sq) into a k-major panel [kc][NP] (for each k the NP weights contiguous: two
 * vectors). Then for each group of up to GMR rows of x (14 with AVX-512, 6 with AVX2): for each
 * k, the two panel vectors times x[m, k] broadcast, for each of the group's rows (GMR x 2
 * accumulators, no horizontal sums). Each weight is dequantized once per call whatever M.
 * Every output sums its products in k order within a chunk, one fp32 FMA each, and the chunks'
 * sums in order: not the dot-product tiles' order (lane-wise, then a tree), so equal to them up
 * to fp32 rounding, not bit for bit; but the same order in both builds (the panel's width and
 * the rows a group change which outputs a kernel call computes, not how), so an AVX2 build's
 * outputs equal an AVX-512 build's bit for bit (tests/gpu/test_gguf_packed.py).
 */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define GEMM 1
#if defined(__AVX512F__)
#define GV 16         /* lanes a vector */
typedef __m512 gvec;
typedef __mmask16 gmask;   /* the lanes of a vector a masked load or store touches */
#define gv_zero() _mm512_setzero_ps()
#define gv_load(p) _mm512_load_ps(p)                 /* 64-byte aligned */
#define gv_loadm(m, p) _mm512_maskz_loadu_ps(m, p)   /* lanes outside m: 0, not read */
#define gv_storem(m, p, v) _mm512_mask_storeu_ps(p, m, v)
#define gv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define gv_add(a, b) _mm512_add_ps(a, b)
#define gv_bcast(f) _mm512_set1_ps(f)
/* the first n lanes (n <= 0: none, n >= GV: all) */
static inline gmask gv_mask(int n) { return n >= 16 ? (gmask)0xffff : n <= 0 ? (gmask)0 : (gmask)((1u << n) - 1); }
#ifndef GMR
#define GMR 14        /* rows of x a group: 28 accumulators + 2 weight vectors of the 32 zmm */
#endif
/* Measured (docs/kernels.md, scripts/bench_cpu_quant_gemm.py and profile_cpu_step.py --gemm on
 * Zen 5): below 24 rows the fused tiles win (the panel's dequantize + transpose costs more than
 * re-dequantizing a block in registers per 6 rows); Q8_0's blocks dequantize so cheaply that
 * its fused tiles win up to ~40 rows. Up to 2048 rows (the most measured) the GEMM tiles beat
 * dequantize + torch's fp32 GEMM 1.4-4x, so gpu/cpu_quant.py takes them for prefill too. */
#ifndef GEMM_MIN_M_DEFAULT
#define GEMM_MIN_M_DEFAULT 24
#endif
#ifndef GEMM_MIN_M_Q8_0
#define GEMM_MIN_M_Q8_0 48
#endif
#ifndef GEMM_MAX_M_DEFAULT
#define GEMM_MAX_M_DEFAULT 2048
#endif

/* 16 rows of 16 floats (src, stride lds) -> their transpose (dst, stride ldd) */
static inline void transpose_sq(const float *restrict src, int64_t lds, float *restrict dst, int64_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) {   /* pairs of rows interleaved per 128-bit lane */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int q = 0; q < 16; q += 4) {   /* r[q + s] lane L: column 4 L + s of rows q..q+3 */
        r[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        r[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        r[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
        r[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
    }
    for (int s = 0; s < 4; s++) {       /* column 4 L + s: lane L of r[s], r[4 + s], r[8 + s], r[12 + s] */
        const __m512 v0 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x44), v1 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xEE);
        _mm512_storeu_ps(dst + s * ldd, _mm512_shuffle_f32x4(v0, v2, 0x88));
        _mm512_storeu_ps(dst + (4 + s) * ldd, _mm512_shuffle_f32x4(v0, v2, 0xDD));
        _mm512_storeu_ps(dst + (8 + s) * ldd, _mm512_shuffle_f32x4(v1, v3, 0x88));
        _mm512_storeu_ps(dst + (12 + s) * ldd, _mm512_shuffle_f32x4(v1, v3, 0xDD));
    }
}
#else   /* AVX2 + FMA */
#define GV 8
typedef __m256 gvec;
typedef __m256i gmask;   /* lane i all ones where it is touched */
#define gv_zero() _mm256_setzero_ps()
#define gv_load(p) _mm256_load_ps(p)                 /* 32-byte aligned */
#define gv_loadm(m, p) _mm256_maskload_ps(p, m)      /* lanes outside m: 0, not read (no fault) */
#define gv_storem(m, p, v) _mm256_maskstore_ps(p, m, v)
#define gv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define gv_add(a, b) _mm256_add_ps(a, b)
#define gv_bcast(f) _mm256_set1_ps(f)
/* the first n lanes: lane i where i < n */
static inline gmask gv_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#ifndef GMR
#define GMR 6         /* rows of x a group: 12 accumulators + 2 weight vectors + the broadcast of the 16 ymm */
#endif
/* Measured (docs/kernels.md, scripts/bench_cpu_quant_gemm.py on an AVX2 build of a Zen 5, one
 * and two threads): from 12 rows the GEMM tiles beat the buffered dot-product tiles (AVX2's
 * fused tiles serve only up to 2 rows; at 8-10 rows, groups of 4-5, the buffered ones win by
 * 1-17%), Q8_0 from 16 (level with them there, 11-14% ahead at 24); up to 2048 rows they beat
 * dequantize + torch's fp32 GEMM 1.04-1.3x. */
#ifndef GEMM_MIN_M_DEFAULT
#define GEMM_MIN_M_DEFAULT 12
#endif
#ifndef GEMM_MIN_M_Q8_0
#define GEMM_MIN_M_Q8_0 16
#endif
#ifndef GEMM_MAX_M_DEFAULT
#define GEMM_MAX_M_DEFAULT 2048
#endif

/* 8 rows of 8 floats (src, stride lds) -> their transpose (dst, stride ldd) */
static inline void transpose_sq(const float *restrict src, int64_t lds, float *restrict dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {    /* rows a, b: a0 b0 a1 b1 | a4 b4 a5 b5 and a2 b2 a3 b3 | a6 b6 a7 b7 */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int q = 0; q < 8; q += 4) {    /* r[q + s]: column s of rows q..q+3 | column 4 + s */
        r[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
        r[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
        r[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
        r[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
    }
    for (int s = 0; s < 4; s++) {       /* column s: the low halves of r[s], r[4 + s]; column 4 + s the high */
        _mm256_storeu_ps(dst + s * ldd, _mm256_permute2f128_ps(r[s], r[4 + s], 0x20));
        _mm256_storeu_ps(dst + (4 + s) * ldd, _mm256_permute2f128_ps(r[s], r[4 + s], 0x31));
    }
}
#endif
#define NP (2 * GV)   /* output columns a panel: two vectors */
#ifndef GKC
#define GKC 256       /* K-chunk: a multiple of every block (256); stage + panel 2 x NP KB */
#endif
#define GEMM_BUF_FLOATS (2 * NP * GKC + 16)

/* rows[j] (j < nr, format fmts[j]) over [k0, k0 + kc) -> panel [kc][NP] (columns nr.. zero) */
static void gemm_fill(const uint8_t *const *rows, const int *fmts, int nr, int64_t k0, int64_t kc,
                      float *restrict stage, float *restrict panel) {
    for (int j = 0; j < nr; j++)
        dequant_row(fmts[j], rows[j] + k0 / block_elems(fmts[j]) * block_bytes(fmts[j]), kc, stage + j * GKC);
    for (int j = nr; j < NP; j++) memset(stage + j * GKC, 0, sizeof(float) * (size_t)kc);
    for (int64_t kk = 0; kk < kc; kk += GV)
        for (int j0 = 0; j0 < NP; j0 += GV) transpose_sq(stage + j0 * GKC + kk, GKC, panel + kk * NP + j0, NP);
}

/* y[i, 0..NP) (+)= sum over k < kc of x[i, k] panel[k] for i < mr (constant in each
 * instantiation): the chunk's sum in k order from 0, then stored (first) or added to y's
 * (the chunks' sums added in order: error ~ GKC + K / GKC roundings, not K); m0, m1: the
 * columns stored (of each vector half) */
static inline __attribute__((always_inline)) void gkern(const float *restrict x, int64_t ldx, const int mr,
                                                        const float *restrict p, int64_t kc, float *restrict y,
                                                        int64_t ldy, int first, gmask m0, gmask m1) {
    gvec a0[GMR], a1[GMR];
    for (int i = 0; i < mr; i++) a0[i] = a1[i] = gv_zero();
    for (int64_t k = 0; k < kc; k++) {
        const gvec w0 = gv_load(p + k * NP), w1 = gv_load(p + k * NP + GV);
        for (int i = 0; i < mr; i++) {
            const gvec xb = gv_bcast(x[i * ldx + k]);
            a0[i] = gv_fma(xb, w0, a0[i]);
            a1[i] = gv_fma(xb, w1, a1[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        if (!first) {
            a0[i] = gv_add(gv_loadm(m0, y + i * ldy), a0[i]);
            a1[i] = gv_add(gv_loadm(m1, y + i * ldy + GV), a1[i]);
        }
        gv_storem(m0, y + i * ldy, a0[i]);
        gv_storem(m1, y + i * ldy + GV, a1[i]);
    }
}

#define GK(MRV) case MRV: gkern(x, ldx, MRV, p, kc, y, ldy, first, m0, m1); return;
static void gkern_any(const float *x, int64_t ldx, int mr, const float *p, int64_t kc, float *y, int64_t ldy,
                      int first, gmask m0, gmask m1) {
    switch (mr) {
    GK(1) GK(2) GK(3) GK(4) GK(5) GK(6)
#if GMR > 6
    GK(7) GK(8)
#endif
#if GMR > 8
    GK(9) GK(10)
#endif
#if GMR > 10
    GK(11) GK(12)
#endif
#if GMR > 12
    GK(13) GK(14)
#endif
    }
}

/* y [M, nr] (stride ldy) = x [M, K] (stride ldx) @ rows^T for nr <= NP packed rows (any formats);
 * buf: GEMM_BUF_FLOATS floats of this thread's. Nothing of y outside [M, nr] is read or written. */
static void gemm_panel(const uint8_t *const *rows, const int *fmts, int nr, const float *x, int64_t ldx, int64_t M,
                       int64_t K, float *y, int64_t ldy, float *buf) {
    float *stage = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63), *panel = stage + NP * GKC;
    const gmask m0 = gv_mask(nr), m1 = gv_mask(nr - GV);
    const int64_t groups = (M + GMR - 1) / GMR;
    for (int64_t k0 = 0; k0 < K; k0 += GKC) {
        const int64_t kc = K - k0 < GKC ? K - k0 : GKC;
        gemm_fill(rows, fmts, nr, k0, kc, stage, panel);
        for (int64_t g = 0, m = 0; g < groups; g++) {   /* groups of (nearly) equal rows */
            const int mr = (int)((M - m + (groups - g) - 1) / (groups - g));
            gkern_any(x + m * ldx + k0, ldx, mr, panel, kc, y + m * ldy, ldy, k0 == 0, m0, m1);
            m += mr;
        }
    }
}
#else
#define GEMM 0
#define NP 4
#define GEMM_MIN_M_DEFAULT 0
#define GEMM_MIN_M_Q8_0 0
#define GEMM_MAX_M_DEFAULT 0
#define GEMM_BUF_FLOATS 0
static void gemm_panel(const uint8_t *const *rows, const int *fmts, int nr, const float *x, int64_t ldx, int64_t M,
                       int64_t K, float *y, int64_t ldy, float *buf) {
    (void)rows; (void)fmts; (void)nr; (void)x; (void)ldx; (void)M; (void)K; (void)y; (void)ldy; (void)buf;
}
#endif

/* Calls of gemm_min(fmt)..gemm_max_m rows take the GEMM tiles. TAILRACE_CPU_QUANT_GEMM in the
 * environment of the first call: 0 turns them off, a number sets the most rows. */
static int64_t gemm_min_m = -1, gemm_max_m = -1;   /* min -1: each format's default */
static inline int64_t gemm_min(int fmt) {
    return gemm_min_m >= 0 ? gemm_min_m : fmt == Q8_0 ? GEMM_MIN_M_Q8_0 : GEMM_MIN_M_DEFAULT;
}
static inline int use_gemm(int fmt, int64_t M) {
    if (gemm_max_m < 0) {
        const char *e = getenv("TAILRACE_CPU_QUANT_GEMM");
        gemm_max_m = e && e[0] >= '0' && e[0] <= '9' ? atoi(e) : GEMM_MAX_M_DEFAULT;
    }
    return GEMM && M >= gemm_min(fmt) && M <= gemm_max_m;
}
/* the fewest rows of format fmt and the most rows that take the GEMM tiles now (max 0: none) */
int cpu_quant_gemm_max_m(void) {
    (void)use_gemm(Q4_0, 1);
    return GEMM ? (int)gemm_max_m : 0;
}
int cpu_quant_gemm_min_m(int fmt) { return GEMM ? (int)gemm_min(fmt) : 0; }
/* rows min_m..max_m of every format take the GEMM tiles (min_m -1: each format's default;
 * max_m 0: none, -1: the default); tests and A/B runs, not while a product runs. Returns
 * whether this build has them. */
int cpu_quant_set_gemm(int min_m, int max_m) {
    gemm_min_m = min_m < 0 ? -1 : min_m;
    gemm_max_m = max_m < 0 ? GEMM_MAX_M_DEFAULT : max_m;
    return GEMM;
}
