/* The outer-product GEMM tiles of gpu/kernels/cpu/quant.c (issue 39), #included by it: for batches of
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
 *
 * With AVX512_VNNI, or AVX2+FMA+F16C without AVX-512 (issue 60: vpmaddwd + vpaddd, or AVX-VNNI's
 * vpdpwssd, for AVX512_VNNI's vpdpwssd), Q4_0/Q4_1/Q8_0 panels take the int16 tiles instead
 * (gemm_panel16, GEMM16):
 * x quantized once per call to int16 per row and 32-element block, the weights' integers as
 * int16 pairs, vpdpwssd into int32 per block, then scaled into fp32 (error ~2^-16 of each
 * block's largest |x|; the order of the sums below, at gkern16). TAILRACE_CPU_QUANT_INT16=0
 * or cpu_quant_set_int16(0): the fp32 tiles.
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
 * dequantize + torch's fp32 GEMM 1.4-4x, so gpu/kernels/cpu/quant.py takes them for prefill too. */
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GEMM16 1      /* the int16 tiles (gemm_panel16 below) */
#define GEMM16_AVX2 0
#elif !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMM16 1      /* the same tiles in AVX2 (issue 60): vpmaddwd + vpaddd for vpdpwssd */
#define GEMM16_AVX2 1
#endif
#if GEMM16
#ifndef GKC16
#define GKC16 512     /* their K-chunk: a multiple of 32; stage + panel 2 x 32 KB of int16 */
#endif
/* stage [NP][GKC16] int16, panel [GKC16 / 2][NP] int16 pairs, d and m [GKC16 / 32][NP] */
#define GEMM16_BUF_FLOATS (NP * GKC16 + 2 * NP * (GKC16 / 32) + 16)
#else
#define GEMM16 0
#define GEMM16_AVX2 0
#define GEMM16_BUF_FLOATS 0
#endif
#define GEMM_BUF_FLOATS (2 * NP * GKC + 16 > GEMM16_BUF_FLOATS ? 2 * NP * GKC + 16 : GEMM16_BUF_FLOATS)

/* x [M, K] quantized for the int16 tiles (gemm_quantize): q [M, K] int16 (row stride K), and
 * per row and 32-element block its scale dx and the fp32 sum sx of its x ([M, K / 32] each) */
typedef struct {
    const int16_t *q;
    const float *dx, *sx;
} gxq;

/* rows[j] (j < nr, format fmts[j]) over [k0, k0 + kc) -> panel [kc][NP] (columns nr.. zero) */
static void gemm_fill(const uint8_t *const *rows, const int *fmts, int nr, int64_t k0, int64_t kc,
                      float *restrict stage, float *restrict panel) {
    for (int j = 0; j < nr; j++)
        dequant_row(fmts[j], rows[j] + k0 / block_elems(fmts[j]) * block_bytes(fmts[j]), kc, stage + j * GKC);
    for (int j = nr; j < NP; j++) memset(stage + j * GKC, 0, sizeof(float) * (size_t)kc);
    for (int64_t kk = 0; kk < kc; kk += GV)
        for (int j0 = 0; j0 < NP; j0 += GV) transpose_sq(stage + j0 * GKC + kk, GKC, panel + kk * NP + j0, NP);
}

/* rows i < mr of a kernel's two accumulator vectors a0, a1 into y[i, 0..NP): stored (the first
 * K-chunk) or added to what y holds (the chunks' sums in order); m0, m1: the columns stored */
static inline __attribute__((always_inline)) void gstore(gvec *a0, gvec *a1, const int mr, float *restrict y,
                                                         int64_t ldy, int first, gmask m0, gmask m1) {
    for (int i = 0; i < mr; i++) {
        if (!first) {
            a0[i] = gv_add(gv_loadm(m0, y + i * ldy), a0[i]);
            a1[i] = gv_add(gv_loadm(m1, y + i * ldy + GV), a1[i]);
        }
        gv_storem(m0, y + i * ldy, a0[i]);
        gv_storem(m1, y + i * ldy + GV, a1[i]);
    }
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
    gstore(a0, a1, mr, y, ldy, first, m0, m1);
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

/* The formats the int16 tiles take: 32-weight blocks of one f16 scale d (Q4_1: and a min m)
 * whose integer values (Q4_0: q - 8, Q4_1: q in 0..15, Q8_0: int8 q) are exact in int16. The
 * K-quants keep the fp32 tiles (Q6_K's sub-block scales times q could overflow int32 in a block). */
static inline int gemm16_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0; }

#if GEMM16
#if GEMM16_AVX2
typedef __m256i givec;   /* int32 lanes (int16 pairs in the panel) */
#define gi_zero() _mm256_setzero_si256()
#define gi_load(p) _mm256_load_si256((const __m256i *)(p))
#define gi_bcast(v) _mm256_set1_epi32(v)
#define gi_cvt(a) _mm256_cvtepi32_ps(a)
#define gv_mul(a, b) _mm256_mul_ps(a, b)
/* a + the products of w's and x's int16 pairs, summed per pair: exact in int32 as vpdpwssd's */
#if defined(__AVXVNNI__)
#define gi_dot(a, w, x) _mm256_dpwssd_avx_epi32(a, w, x)
#else
/* the empty asm pins the sum in a register: without it GCC reassociates the unrolled loop's integer
 * adds, keeps every vpmaddwd product on the stack and sums them after (measured 1.4x slower) */
static inline __attribute__((always_inline)) __m256i gi_dot(__m256i a, __m256i w, __m256i x) {
    a = _mm256_add_epi32(a, _mm256_madd_epi16(w, x));
    __asm__("" : "+x"(a));
    return a;
}
#endif
#else
typedef __m512i givec;
#define gi_zero() _mm512_setzero_si512()
#define gi_load(p) _mm512_load_si512(p)
#define gi_bcast(v) _mm512_set1_epi32(v)
#define gi_cvt(a) _mm512_cvtepi32_ps(a)
#define gv_mul(a, b) _mm512_mul_ps(a, b)
#define gi_dot(a, w, x) _mm512_dpwssd_epi32(a, w, x)
#endif
/* The int16 tiles (AVX512_VNNI; and AVX2, issue 60, where vpmaddwd + vpaddd stand for vpdpwssd: the
 * same exact int32 sums, so the same outputs bit for bit, GMR16 aside): vpdpwssd multiplies 32 int16 pairs and adds them to 16 int32
 * lanes in one instruction, at the throughput of vfmadd231ps (16 products) on Zen 5: twice the
 * MACs per cycle of the fp32 tiles' inner loop.
 *
 * x is quantized once per call (gemm_quantize), per row and 32-element block b, to int16 with
 * the scale dx_b = absmax_b / 32767 (round to nearest): |x - dx_b xq| <= absmax_b / 65534 (plus
 * fp32 rounding of x / dx_b, < 1e-3 of that), ~2^-16 of the block's largest, far below bf16's
 * 2^-9. The weights are exact integers q with w = d q (+ m for Q4_1), so a block's sum
 * sum_k q_k xq_k is exact in int32 (|.| <= 32 * 128 * 32767 < 2^28) and
 *   sum_k w_k x_k ~= (d dx_b) sum_k q_k xq_k + m sx_b,  sx_b = the exact fp32 sum of x's block
 * (Q4_1's min term uses x itself, not xq). Error of an output: <= sum_b sum_{k in b} |d q_k| *
 * absmax_b / 65534 * 1.002 + fp32 rounding (tests/gpu/test_gguf_packed.py checks it).
 *
 * Summation order of each output (the same whatever M, the group split or the threads, since
 * each row of x is quantized alone and a group only picks which rows a call computes): per
 * K-chunk of GKC16, blocks in k order: acc = fma(float(isum_b), d_b * dx_b, acc) then, for a
 * panel with a Q4_1 row, acc = fma(m_b, sx_b, acc) (m_b = 0 for the other formats); the chunk's
 * acc stored (first chunk) or added to y's, chunks in order. */
#ifndef GMR16
/* rows of x a group: 12 int32 accumulators + 2 weight vectors + the broadcast in the inner loop
 * (the fp32 ones, touched once a block, may live in memory); 4-7 rows measured alike, 10 slower.
 * AVX2: the same 12 + 2 + 1 of its 16 ymm */
#define GMR16 6
#endif

#if GEMM16_AVX2
/* rows [m0, m1) of x [., K] (stride ldx) -> q, dx, sx (gxq's layout, for M rows of K): the AVX-512
 * gemm_quantize's values, sx summed in its order ((v0 + v2) + (v1 + v3), then halves) */
static void gemm_quantize(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int16_t *q, float *dx,
                          float *sx) {
    const int64_t nb = K / 32;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * ldx + 32 * b;
            const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16),
                         v3 = _mm256_loadu_ps(p + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absm), _mm256_and_ps(v2, absm)),
                                      _mm256_max_ps(_mm256_and_ps(v1, absm), _mm256_and_ps(v3, absm)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
            const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                           _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
            const int bad = _mm256_movemask_ps(un) || amax == __builtin_inff();
            const float s = amax >= 32767.f * 1.17549435e-38f && !bad ? 32767.f / amax : 0.f;
            dx[m * nb + b] = bad ? __builtin_nanf("") : s > 0.f ? amax / 32767.f : 0.f;
            /* _mm512_reduce_add_ps's order: 256-bit halves, 128-bit halves, 64-bit halves, then the pair */
            const __m256 t = _mm256_add_ps(_mm256_add_ps(v0, v2), _mm256_add_ps(v1, v3));
            __m128 a = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            a = _mm_add_ps(a, _mm_shuffle_ps(a, a, 0x4E));
            a = _mm_add_ps(a, _mm_shuffle_ps(a, a, 0xB1));
            sx[m * nb + b] = _mm_cvtss_f32(a);
            const __m256 sv = _mm256_set1_ps(s);
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, sv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, sv));
            const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, sv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, sv));
            /* packs saturates as vpmovsdw does; it works per 128-bit lane, so the qwords reordered */
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b), _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b + 16),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q2, q3), 0xD8));
        }
}

/* one block of a gemm16_fmt row -> its 32 integers (int16) in out; its d (and m) */
static inline void deq16_block(int fmt, const uint8_t *restrict b, int16_t *restrict out, float *d, float *m) {
    *d = f16(b);
    *m = fmt == Q4_1 ? f16(b + 2) : 0.f;
    if (fmt == Q8_0) {
        _mm256_storeu_si256((__m256i *)out, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2))));
        _mm256_storeu_si256((__m256i *)(out + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2))), m4 = _mm_set1_epi8(15);
    __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
    __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    if (fmt == Q4_0) lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8)), hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
    _mm256_storeu_si256((__m256i *)out, lo);
    _mm256_storeu_si256((__m256i *)(out + 16), hi);
}
#else

/* rows [m0, m1) of x [., K] (stride ldx) -> q, dx, sx (gxq's layout, for M rows of K) */
static void gemm_quantize(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int16_t *q, float *dx,
                          float *sx) {
    const int64_t nb = K / 32;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * ldx + 32 * b;
            const __m512 a = _mm512_loadu_ps(p), c = _mm512_loadu_ps(p + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            /* vmaxps drops a NaN: look for one, so a NaN or inf in x gives NaN outputs (as the fp32
             * tiles give NaN or inf) rather than a finite answer */
            const int bad = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q)
                            || amax == __builtin_inff();
            /* a block below 32767 x FLT_MIN (~4e-34) is taken as zero (its dx would be subnormal and
             * 32767 / amax could overflow): it adds < 32 x 4e-34 |w| to an output */
            const float s = amax >= 32767.f * 1.17549435e-38f && !bad ? 32767.f / amax : 0.f;
            dx[m * nb + b] = bad ? __builtin_nanf("") : s > 0.f ? amax / 32767.f : 0.f;
            sx[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
            /* round to nearest (MXCSR's default), then saturate: |x| s <= 32767 (1 + 2^-23) */
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(s)));
            const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(s)));
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b), _mm512_cvtsepi32_epi16(qa));
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b + 16), _mm512_cvtsepi32_epi16(qc));
        }
}

/* one block of a gemm16_fmt row -> its 32 integers (int16) in out; its d (and m) */
static inline void deq16_block(int fmt, const uint8_t *restrict b, int16_t *restrict out, float *d, float *m) {
    *d = f16(b);
    *m = fmt == Q4_1 ? f16(b + 2) : 0.f;
    if (fmt == Q8_0) {
        _mm512_storeu_si512(out, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2))));
        return;
    }
    /* element j < 16: byte j's low nibble, element 16 + j: its high one */
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2))), m4 = _mm_set1_epi8(15);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    __m512i v = _mm512_cvtepu8_epi16(nib);
    if (fmt == Q4_0) v = _mm512_sub_epi16(v, _mm512_set1_epi16(8));
    _mm512_storeu_si512(out, v);
}
#endif

/* rows[j] (j < nr) over [k0, k0 + kc) -> panel [kc / 2][NP] int16 pairs (lane c of pair p:
 * w[c, 2p], w[c, 2p + 1]: a dword, so the fp32 tiles' 16 x 16 transpose serves), pd, pm
 * [kc / 32][NP] each block's d and m (columns nr..: zero) */
static void gemm_fill16(const uint8_t *const *rows, const int *fmts, int nr, int64_t k0, int64_t kc,
                        int16_t *restrict stage, int32_t *restrict panel, float *restrict pd, float *restrict pm) {
    const int64_t nb = kc / 32;
    for (int j = 0; j < NP; j++) {
        if (j >= nr) {
            memset(stage + j * GKC16, 0, sizeof(int16_t) * (size_t)kc);
            for (int64_t b = 0; b < nb; b++) pd[b * NP + j] = pm[b * NP + j] = 0.f;
            continue;
        }
        const int bb = block_bytes(fmts[j]);
        const uint8_t *r = rows[j] + k0 / 32 * bb;
        for (int64_t b = 0; b < nb; b++) deq16_block(fmts[j], r + b * bb, stage + j * GKC16 + 32 * b, pd + b * NP + j,
                                                     pm + b * NP + j);
    }
    for (int64_t kk = 0; kk < kc / 2; kk += GV)
        for (int j0 = 0; j0 < NP; j0 += GV)
            transpose_sq((const float *)(stage + j0 * GKC16) + kk, GKC16 / 2, (float *)(panel + kk * NP + j0), NP);
}

/* y[i, 0..NP) (+)= the chunk's sum (the order above) for i < mr rows (mr, min: constants in each
 * instantiation; min: the panel has a Q4_1 row). xq, dx, sx: the group's first row at the chunk's
 * start (strides ldq, lds); p, pd, pm: the chunk's panel. */
static inline __attribute__((always_inline)) void gkern16(const int16_t *restrict xq, int64_t ldq,
                                                          const float *restrict dx, const float *restrict sx,
                                                          int64_t lds, const int mr, const int min,
                                                          const int32_t *restrict p, const float *restrict pd,
                                                          const float *restrict pm, int64_t kc, float *restrict y,
                                                          int64_t ldy, int first, gmask m0, gmask m1) {
    gvec f0[GMR16], f1[GMR16];
    for (int i = 0; i < mr; i++) f0[i] = f1[i] = gv_zero();
    for (int64_t b = 0; b < kc / 32; b++) {
        givec a0[GMR16], a1[GMR16];
        for (int i = 0; i < mr; i++) a0[i] = a1[i] = gi_zero();
        const int32_t *pb = p + b * 16 * NP;
        /* unrolled: as a loop, GCC 12 copies each int32 accumulator to another register and
         * back every iteration (24 vmovdqa a step of 12 vpdpwssd; 1.6x slower, measured) */
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const givec w0 = gi_load(pb + t * NP), w1 = gi_load(pb + t * NP + GV);
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xq + i * ldq + 32 * b + 2 * t, 4);
                const givec xb = gi_bcast(pair);
                a0[i] = gi_dot(a0[i], w0, xb);
                a1[i] = gi_dot(a1[i], w1, xb);
            }
        }
        const gvec d0 = gv_load(pd + b * NP), d1 = gv_load(pd + b * NP + GV);
        for (int i = 0; i < mr; i++) {
            const gvec s = gv_bcast(dx[i * lds + b]);
            f0[i] = gv_fma(gi_cvt(a0[i]), gv_mul(d0, s), f0[i]);
            f1[i] = gv_fma(gi_cvt(a1[i]), gv_mul(d1, s), f1[i]);
        }
        if (min) {
            const gvec n0 = gv_load(pm + b * NP), n1 = gv_load(pm + b * NP + GV);
            for (int i = 0; i < mr; i++) {
                const gvec s = gv_bcast(sx[i * lds + b]);
                f0[i] = gv_fma(n0, s, f0[i]);
                f1[i] = gv_fma(n1, s, f1[i]);
            }
        }
    }
    gstore(f0, f1, mr, y, ldy, first, m0, m1);
}

#define GK16(MRV)                                                                                              \
    case MRV:                                                                                                  \
        if (min) gkern16(xq, ldq, dx, sx, lds, MRV, 1, p, pd, pm, kc, y, ldy, first, m0, m1);                  \
        else gkern16(xq, ldq, dx, sx, lds, MRV, 0, p, pd, pm, kc, y, ldy, first, m0, m1);                      \
        return;
static void gkern16_any(const int16_t *xq, int64_t ldq, const float *dx, const float *sx, int64_t lds, int mr,
                        int min, const int32_t *p, const float *pd, const float *pm, int64_t kc, float *y,
                        int64_t ldy, int first, gmask m0, gmask m1) {
    switch (mr) {
    GK16(1) GK16(2) GK16(3) GK16(4)
#if GMR16 > 4
    GK16(5) GK16(6)
#endif
#if GMR16 > 6
    GK16(7) GK16(8)
#endif
#if GMR16 > 8
    GK16(9) GK16(10)
#endif
#if GMR16 > 10
    GK16(11) GK16(12)
#endif
#if GMR16 > 12
    GK16(13) GK16(14)
#endif
    }
}

/* gemm_panel for nr rows all of gemm16_fmt formats, x quantized in q */
static void gemm_panel16(const uint8_t *const *rows, const int *fmts, int nr, const gxq *q, int64_t M, int64_t K,
                         float *y, int64_t ldy, float *buf) {
    int16_t *stage = (int16_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    int32_t *panel = (int32_t *)(stage + NP * GKC16);
    float *pd = (float *)(panel + GKC16 / 2 * NP), *pm = pd + GKC16 / 32 * NP;
    const gmask m0 = gv_mask(nr), m1 = gv_mask(nr - GV);
    const int64_t groups = (M + GMR16 - 1) / GMR16, nb = K / 32;
    int min = 0;
    for (int j = 0; j < nr; j++) min |= fmts[j] == Q4_1;
    for (int64_t k0 = 0; k0 < K; k0 += GKC16) {
        const int64_t kc = K - k0 < GKC16 ? K - k0 : GKC16;
        gemm_fill16(rows, fmts, nr, k0, kc, stage, panel, pd, pm);
        for (int64_t g = 0, m = 0; g < groups; g++) {   /* groups of (nearly) equal rows */
            const int mr = (int)((M - m + (groups - g) - 1) / (groups - g));
            gkern16_any(q->q + m * K + k0, K, q->dx + m * nb + k0 / 32, q->sx + m * nb + k0 / 32, nb, mr, min, panel,
                        pd, pm, kc, y + m * ldy, ldy, k0 == 0, m0, m1);
            m += mr;
        }
    }
}
#endif

/* y [M, nr] (stride ldy) = x [M, K] (stride ldx) @ rows^T for nr <= NP packed rows (any formats);
 * buf: GEMM_BUF_FLOATS floats of this thread's. Nothing of y outside [M, nr] is read or written.
 * q: x quantized (gemm_quantize) for the int16 tiles, which then take a panel whose rows are all
 * gemm16_fmt formats; NULL: the fp32 tiles. */
static void gemm_panel(const uint8_t *const *rows, const int *fmts, int nr, const float *x, int64_t ldx, int64_t M,
                       int64_t K, float *y, int64_t ldy, float *buf, const gxq *q) {
#if GEMM16
    if (q) {
        int all = 1;
        for (int j = 0; j < nr; j++) all &= gemm16_fmt(fmts[j]);
        if (all) {
            gemm_panel16(rows, fmts, nr, q, M, K, y, ldy, buf);
            return;
        }
    }
#else
    (void)q;
#endif
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
#define GEMM16 0
typedef struct {
    const int16_t *q;
    const float *dx, *sx;
} gxq;
static inline int gemm16_fmt(int fmt) { (void)fmt; return 0; }
static void gemm_panel(const uint8_t *const *rows, const int *fmts, int nr, const float *x, int64_t ldx, int64_t M,
                       int64_t K, float *y, int64_t ldy, float *buf, const gxq *q) {
    (void)rows; (void)fmts; (void)nr; (void)x; (void)ldx; (void)M; (void)K; (void)y; (void)ldy; (void)buf; (void)q;
}
#endif
#if !GEMM16
static void gemm_quantize(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int16_t *q, float *dx,
                          float *sx) {
    (void)x; (void)ldx; (void)m0; (void)m1; (void)K; (void)q; (void)dx; (void)sx;
}
#endif

/* Calls of gemm_min(fmt)..gemm_max_m rows take the GEMM tiles. TAILRACE_CPU_QUANT_GEMM in the
 * environment of the first call: 0 turns them off, a number sets the most rows. */
/* The int16 tiles (GEMM16 builds) serve the gemm16_fmt formats' GEMM calls unless
 * TAILRACE_CPU_QUANT_INT16=0 in the environment of the first call (or cpu_quant_set_int16(0)):
 * then the fp32 tiles, as in every other build. */
static int gemm16_on = -1;
static inline int use_int16(int fmt) {
    if (gemm16_on < 0) {
        const char *e = getenv("TAILRACE_CPU_QUANT_INT16");
        gemm16_on = GEMM16 && !(e && e[0] == '0');
    }
    return gemm16_on && gemm16_fmt(fmt);
}
/* Measured (docs/kernels.md; decode steps by profile_cpu_step.py --gemm on 1-2048, 2 threads, Zen
 * 5): with the int16 tiles the GEMM tiles beat the fused ones from 9-10 rows of Q4_1 (a step of
 * 8: 14.5 against 13.8 ms, of 10: 17.8 against 18.8, of 16: 21.9 against 26.2); Q8_0's LM head,
 * streamed from memory, from 16-20 rows (bench_cpu_quant_gemm.py: level at 16, 1.18x at 20). */
/* AVX2 (issue 60; scripts/bench_cpu_quant_gemm.py --cpu-time, one thread, the 2-core AVX2 EPYC,
 * against the int16 GEMV tiles): Q4_1 576 x 3072 level at 3 rows, 1.18x at 4, 1.69x at 8; 1536 x
 * 576 level at 3-4, 1.41x at 8; the Q8_0 LM head (49152 x 576) level at 12, 1.19x at 16. */
#if GEMM16_AVX2
#ifndef GEMM16_MIN_M_DEFAULT
#define GEMM16_MIN_M_DEFAULT 4
#endif
#ifndef GEMM16_MIN_M_Q8_0
#define GEMM16_MIN_M_Q8_0 12
#endif
#endif
#ifndef GEMM16_MIN_M_DEFAULT
#define GEMM16_MIN_M_DEFAULT 10
#endif
#ifndef GEMM16_MIN_M_Q8_0
#define GEMM16_MIN_M_Q8_0 20
#endif
static int64_t gemm_min_m = -1, gemm_max_m = -1;   /* min -1: each format's default */
static inline int64_t gemm_min(int fmt) {
    if (gemm_min_m >= 0) return gemm_min_m;
    if (use_int16(fmt)) return fmt == Q8_0 ? GEMM16_MIN_M_Q8_0 : GEMM16_MIN_M_DEFAULT;
    return fmt == Q8_0 ? GEMM_MIN_M_Q8_0 : GEMM_MIN_M_DEFAULT;
}
static inline int use_gemm(int fmt, int64_t M) {
    if (gemm_max_m < 0) {
        const char *e = getenv("TAILRACE_CPU_QUANT_GEMM");
        gemm_max_m = e && e[0] >= '0' && e[0] <= '9' ? atoi(e) : GEMM_MAX_M_DEFAULT;
    }
    return GEMM && M >= gemm_min(fmt) && M <= gemm_max_m;
}
/* whether the int16 tiles take format fmt's GEMM calls now */
int cpu_quant_int16(int fmt) { return use_int16(fmt); }
/* the int16 tiles on (1), off (0: the fp32 tiles) or as the environment says (-1); tests and A/B
 * runs, not while a product runs. Returns whether this build has them (AVX512_VNNI, or AVX2 without
 * AVX-512). */
int cpu_quant_set_int16(int on) {
    gemm16_on = -1;
    if (on >= 0) gemm16_on = GEMM16 && on;
    else (void)use_int16(Q4_0);
    return GEMM16;
}
/* bytes of scratch x quantized for the int16 tiles takes (gxq: q, dx, sx) for M rows of K */
static inline size_t gemm16_bytes(int64_t M, int64_t K) {
    return (size_t)(M * K) * sizeof(int16_t) + 2 * (size_t)(M * (K / 32)) * sizeof(float) + 64;
}
/* that scratch at mem (64-byte aligned) as a gxq */
static inline gxq gemm16_at(void *mem, int64_t M, int64_t K) {
    int16_t *q = (int16_t *)mem;
    float *dx = (float *)(q + M * K);
    gxq r = {q, dx, dx + M * (K / 32)};
    return r;
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
