/* GGUF-quantized linear layers on the CPU (issue 39): y[M, N] = x[M, K] @ W[N, K]^T + bias,
 * with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), built and loaded by
 * gpu/kernels/cpu/quant.py the way gpu/kernels/cpu/ops.c is (cc -O3 -march=native -fopenmp, cached per CPU).
 *
 * How: a thread takes NR weight rows at a time, dequantizes them into an fp32 buffer in L1/L2
 * (exactly gguf-py's values: the same fp32 products and sums, -ffp-contract=off), then
 * multiplies them with MR activation rows at a time in fp32 FMAs (MR x NR vector accumulators
 * over K). The dequantization is paid once per weight row and step, whatever M; the weights
 * are read packed (4.5-8.5 bits a weight). fp32 activations, no Q8 rounding of them: the
 * result is the dequantized fp32 model's up to the order of the sums.
 * For Q4_0, Q4_1 and Q8_0 at few rows (FUSED_MAX_M_DEFAULT) the fused tiles skip the buffer:
 * each block is dequantized into registers and multiplied at once, MR rows of x at a time, with
 * software prefetch; the same values and sums in the same order, so bit-identical results.
 * From GEMM_MIN_M_DEFAULT rows (Q8_0: GEMM_MIN_M_Q8_0) to GEMM_MAX_M_DEFAULT, with AVX-512 or
 * AVX2+FMA, the outer-product GEMM tiles of gpu/kernels/cpu/quant_gemm.c serve instead (every format; not
 * bit-identical to the other tiles: another order of the sums; the same in both builds). With
 * AVX512_VNNI (and AVX2 without AVX-512: vpmaddwd + vpaddd, issue 60), their Q4_0/Q4_1/Q8_0 panels
 * multiply int16 activations (x quantized per 32-element block, ~2^-16 of its largest) with the
 * weights' integers in int32 (vpdpwssd), from
 * GEMM16_MIN_M_DEFAULT rows (Q8_0: GEMM16_MIN_M_Q8_0); TAILRACE_CPU_QUANT_INT16=0: the fp32 tiles.
 * Without AVX-512 (AVX2+FMA), few rows of every format take the int16 GEMV tiles instead (i16tile
 * below: x quantized the same way, the weights' integers widened in registers, vpmaddwd; up to
 * I16V_MAX_M_DEFAULT rows, Q8_0 I16V_MAX_M_Q8_0, the K-quants I16V_MAX_M_KQ); the same switch.
 * Vector width from the build: AVX-512 (16 lanes, 4x4 tile), AVX2+FMA (8 lanes, 2x4), else scalar.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* ggml type ids */

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else {  /* subnormal: normalise */
        int ee = 113;
        uint32_t mm = m;
        while (!(mm & 0x400)) { mm <<= 1; ee--; }
        u = s | ((uint32_t)ee << 23) | ((mm & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* (elements, bytes) of one block */
static int block_elems(int fmt) { return fmt >= Q2_K && fmt <= Q6_K ? 256 : 32; }
static int block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18; case Q4_1: return 20; case Q5_1: return 24; case Q8_0: return 34;
    case Q2_K: return 84; case Q3_K: return 110;
    case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    default: return 0;
    }
}

int cpu_quant_block_bytes(int fmt) { return block_bytes(fmt); }
int cpu_quant_block_elems(int fmt) { return block_bytes(fmt) ? block_elems(fmt) : 0; }

/* the 6-bit scales and mins of a K-quant super-block (gguf-py's Q4_K.get_scale_min) */
static inline void scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

#include "quant_lowbit.c"

#if defined(__AVX512F__)
/* 16 bytes -> 16 int32 lanes (zero- or sign-extended) */
#define U8X16(v) _mm512_cvtepu8_epi32(v)
#define I8X16(v) _mm512_cvtepi8_epi32(v)
#define ST16(o, v) _mm512_storeu_ps(o, v)
#define SET1(f) _mm512_set1_ps(f)
#define CVT(v) _mm512_cvtepi32_ps(v)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define ADD(a, b) _mm512_add_ps(a, b)
#define SUBI(a, i) _mm512_sub_epi32(a, _mm512_set1_epi32(i))
/* The 32-element formats with intrinsics: the same products and sums as the scalar code. */
static int dequant_row_simd(int fmt, const uint8_t *restrict b, int64_t nb, float *restrict out) {
    const __m128i m4 = _mm_set1_epi8(15);
    switch (fmt) {
    case Q4_0:
        for (int64_t i = 0; i < nb; i++, b += 18, out += 32) {
            const __m512 d = SET1(f16(b));
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));
            ST16(out, MUL(d, CVT(SUBI(U8X16(_mm_and_si128(raw, m4)), 8))));
            ST16(out + 16, MUL(d, CVT(SUBI(U8X16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4)), 8))));
        }
        return 1;
    case Q4_1:
        for (int64_t i = 0; i < nb; i++, b += 20, out += 32) {
            const __m512 d = SET1(f16(b)), m = SET1(f16(b + 2));
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4));
            ST16(out, ADD(MUL(d, CVT(U8X16(_mm_and_si128(raw, m4)))), m));
            ST16(out + 16, ADD(MUL(d, CVT(U8X16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4)))), m));
        }
        return 1;
    case Q8_0:
        for (int64_t i = 0; i < nb; i++, b += 34, out += 32) {
            const __m512 d = SET1(f16(b));
            ST16(out, MUL(CVT(I8X16(_mm_loadu_si128((const __m128i *)(b + 2)))), d));
            ST16(out + 16, MUL(CVT(I8X16(_mm_loadu_si128((const __m128i *)(b + 18)))), d));
        }
        return 1;
    }
    return 0;
}
#elif defined(__AVX2__)
/* 8 bytes (the low half of v) -> 8 int32 lanes */
#define U8X8(v) _mm256_cvtepu8_epi32(v)
#define I8X8(v) _mm256_cvtepi8_epi32(v)
#define HI8(v) _mm_srli_si128(v, 8)
static int dequant_row_simd(int fmt, const uint8_t *restrict b, int64_t nb, float *restrict out) {
    const __m128i m4 = _mm_set1_epi8(15);
    switch (fmt) {
    case Q4_0:
    case Q4_1:
        for (int64_t i = 0; i < nb; i++, out += 32) {
            const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(fmt == Q4_1 ? f16(b + 2) : 0.f);
            const int off = fmt == Q4_1 ? 4 : 2;
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + off));
            const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            const __m128i parts[4] = {lo, HI8(lo), hi, HI8(hi)};
            for (int p = 0; p < 4; p++) {
                __m256i q = U8X8(parts[p]);
                if (fmt == Q4_0) {
                    q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                    _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                } else {
                    _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m));
                }
            }
            b += fmt == Q4_1 ? 20 : 18;
        }
        return 1;
    case Q8_0:
        for (int64_t i = 0; i < nb; i++, b += 34, out += 32) {
            const __m256 d = _mm256_set1_ps(f16(b));
            const __m128i r0 = _mm_loadu_si128((const __m128i *)(b + 2)), r1 = _mm_loadu_si128((const __m128i *)(b + 18));
            const __m128i parts[4] = {r0, HI8(r0), r1, HI8(r1)};
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(_mm256_cvtepi32_ps(I8X8(parts[p])), d));
        }
        return 1;
    }
    return 0;
}
#else
static int dequant_row_simd(int fmt, const uint8_t *b, int64_t nb, float *out) {
    (void)fmt; (void)b; (void)nb; (void)out;
    return 0;
}
#endif

/* One row of K elements -> fp32, as gguf-py's dequantize_blocks computes them. */
static void dequant_row(int fmt, const uint8_t *restrict b, int64_t K, float *restrict out) {
    const int64_t nb = K / block_elems(fmt);
    if (dequant_row_simd(fmt, b, nb, out) || dequant_lowbit(fmt, b, nb, out)) return;
    switch (fmt) {
    case Q4_0:
        for (int64_t i = 0; i < nb; i++, b += 18, out += 32) {
            const float d = f16(b);
            const uint8_t *q = b + 2;
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)((int)(q[j] & 15) - 8);
                out[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
            }
        }
        break;
    case Q4_1:
        for (int64_t i = 0; i < nb; i++, b += 20, out += 32) {
            const float d = f16(b), m = f16(b + 2);
            const uint8_t *q = b + 4;
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(q[j] & 15) + m;
                out[j + 16] = d * (float)(q[j] >> 4) + m;
            }
        }
        break;
    case Q8_0:
        for (int64_t i = 0; i < nb; i++, b += 34, out += 32) {
            const float d = f16(b);
            const int8_t *q = (const int8_t *)(b + 2);
            for (int j = 0; j < 32; j++) out[j] = (float)q[j] * d;
        }
        break;
    case Q4_K:
    case Q5_K:
        for (int64_t i = 0; i < nb; i++, out += 256) {
            const float d = f16(b), dmin = f16(b + 2);
            uint8_t sc[8], mn[8];
            scale_min_k4(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = fmt == Q4_K ? b + 16 : b + 48;
            for (int s = 0; s < 8; s++) {   /* sub-block s: 32 values, nibble s & 1 of bytes 32 (s / 2).. */
                const float ds = d * (float)sc[s], ms = dmin * (float)mn[s];
                const uint8_t *q = qs + 32 * (s / 2);
                const int shift = 4 * (s & 1);
                float *o = out + 32 * s;
                if (fmt == Q4_K) {
                    for (int j = 0; j < 32; j++) o[j] = ds * (float)((q[j] >> shift) & 15) - ms;
                } else {
                    for (int j = 0; j < 32; j++)
                        o[j] = ds * (float)(((q[j] >> shift) & 15) | (((qh[j] >> s) & 1) << 4)) - ms;
                }
            }
            b += fmt == Q4_K ? 144 : 176;
        }
        break;
    case Q6_K:
        for (int64_t i = 0; i < nb; i++, b += 210, out += 256) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = f16(b + 208);
            /* element e = 128 h + 32 r + j (h: half, r: 0..3): low nibble from ql[64 h + 32 (r & 1) + j]
             * (shifted by 4 for r >= 2), high 2 bits from qh[32 h + j] >> 2 r */
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < 4; r++) {
                    const uint8_t *l = ql + 64 * h + 32 * (r & 1), *hh = qh + 32 * h;
                    const int lshift = r >= 2 ? 4 : 0;
                    float *o = out + 128 * h + 32 * r;
                    const float d0 = d * (float)sc[8 * h + 2 * r], d1 = d * (float)sc[8 * h + 2 * r + 1];
                    for (int j = 0; j < 32; j++) {
                        const int q = (int)(((l[j] >> lshift) & 15) | (((hh[j] >> (2 * r)) & 3) << 4)) - 32;
                        o[j] = (j < 16 ? d0 : d1) * (float)q;
                    }
                }
        }
        break;
    }
}

/* Rows [r0, r1) of a packed tensor -> fp32 [r1 - r0, K] (a large-M call's GEMM operand, tests). */
int cpu_quant_dequantize(int fmt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t K,
                         float *out) {
    if (!block_bytes(fmt) || K % block_elems(fmt) || row_bytes != K / block_elems(fmt) * block_bytes(fmt))
        return -1;
#pragma omp parallel for schedule(static)
    for (int64_t r = r0; r < r1; r++) dequant_row(fmt, w + r * row_bytes, K, out + (r - r0) * K);
    return 0;
}

#if defined(__AVX512F__)
typedef __m512 vf;
#define VL 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#define MR 4
#define NR 4
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define VL 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define MR 2   /* 2 x 4 accumulators + 4 weight vectors + 1 input: 13 of AVX2's 16 registers */
#define NR 4
#else
typedef float vf;
#define VL 1
#define VZERO() 0.f
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
static inline float vsum(vf v) { return v; }
#define MR 2
#define NR 2
#endif

int cpu_quant_vector_width(void) { return VL; }

/* y[m, n] = sum_k x[m, k] w[n, k] for mr <= MR rows of x and nr <= NR rows of w (fp32, in buf).
 * Always inlined with constant mr and nr (tile_any's switch), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t ldx, const int mr,
                                                       const float *restrict w, int64_t K, const int nr,
                                                       float *restrict y, int64_t ldy) {
    vf acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = VZERO();
    for (int64_t k = 0; k < K; k += VL) {
        vf wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = VLOAD(w + j * K + k);
        for (int i = 0; i < mr; i++) {
            const vf xv = VLOAD(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = vsum(acc[i][j]);
}

static void tile_any(const float *restrict x, int64_t ldx, int mr, const float *restrict w, int64_t K, int nr,
                     float *restrict y, int64_t ldy) {
    if (nr == NR) {
        switch (mr) {
        case 1: tile(x, ldx, 1, w, K, NR, y, ldy); return;
        case 2: tile(x, ldx, 2, w, K, NR, y, ldy); return;
#if MR > 2
        case 3: tile(x, ldx, 3, w, K, NR, y, ldy); return;
#endif
#if MR > 3
        case 4: tile(x, ldx, 4, w, K, NR, y, ldy); return;
#endif
        }
    }
    for (int i = 0; i < mr; i++)   /* the last few rows of W */
        for (int j = 0; j < nr; j++) tile(x + i * ldx, ldx, 1, w + j * K, K, 1, y + i * ldy + j, ldy);
}

/* The fused small-M path: for the 32-element formats (Q4_0, Q4_1, Q8_0) and at most MR rows of x,
 * each weight block is dequantized into registers and multiplied at once, with no fp32 row
 * buffer stored and loaded again. The values are dequant_row_simd's (the same products and
 * sums), and each accumulator adds the same products in the same order as tile() over the
 * buffered row: the results are bit-identical to the buffered path's. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FUSED 1
#define BV (32 / VL)   /* vectors a block */
/* Measured (docs/benchmarks.md, issue 39): with AVX-512 the fused tiles win at every M up to the
 * large-M path's 48 rows in a real decode step (the weights stream from memory); with AVX2 only
 * up to MR = 2 rows (four vectors a block to dequantize again for each group of 2 rows). */
#ifndef FUSED_MAX_M_DEFAULT
#if defined(__AVX512F__)
#define FUSED_MAX_M_DEFAULT 48
#else
#define FUSED_MAX_M_DEFAULT MR
#endif
#endif
#ifndef PF_TILES
#define PF_TILES 2
#endif
static inline __attribute__((always_inline)) void deq_block(const int fmt, const uint8_t *restrict b, vf out[BV]) {
#if defined(__AVX512F__)
    if (fmt == Q8_0) {
        const __m512 d = SET1(f16(b));
        out[0] = MUL(CVT(I8X16(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        out[1] = MUL(CVT(I8X16(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
    } else {   /* the 16 bytes widened first, then the nibbles split in 32-bit lanes: 3 ops, not 5 */
        const __m512i v = U8X16(_mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2))));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
        const __m512 d = SET1(f16(b));
        if (fmt == Q4_0) {
            out[0] = MUL(d, CVT(SUBI(lo, 8)));
            out[1] = MUL(d, CVT(SUBI(hi, 8)));
        } else {
            const __m512 m = SET1(f16(b + 2));
            out[0] = ADD(MUL(d, CVT(lo)), m);
            out[1] = ADD(MUL(d, CVT(hi)), m);
        }
    }
#else
    const __m128i m4 = _mm_set1_epi8(15);
    if (fmt == Q8_0) {
        const __m256 d = _mm256_set1_ps(f16(b));
        const __m128i r0 = _mm_loadu_si128((const __m128i *)(b + 2)), r1 = _mm_loadu_si128((const __m128i *)(b + 18));
        const __m128i parts[4] = {r0, HI8(r0), r1, HI8(r1)};
        for (int p = 0; p < 4; p++) out[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(I8X8(parts[p])), d);
    } else {
        const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(fmt == Q4_1 ? f16(b + 2) : 0.f);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2)));
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m128i parts[4] = {lo, HI8(lo), hi, HI8(hi)};
        for (int p = 0; p < 4; p++) {
            __m256i q = U8X8(parts[p]);
            if (fmt == Q4_0)
                out[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
            else
                out[p] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
        }
    }
#endif
}

static inline int fused_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0; }

/* rows of x a fused tile takes: with AVX-512's 32 registers 6 x 4 accumulators (each weight
 * block dequantized once for 6 rows), with AVX2's 16 registers MR x NR */
#ifndef FMR
#if defined(__AVX512F__)
#define FMR 6
#else
#define FMR MR
#endif
#endif

/* y[m, n] = sum_k x[m, k] w_n[k] for mr <= FMR rows of x and nr <= NR packed rows w[0..nr) */
static inline __attribute__((always_inline)) void ftile(const int fmt, const uint8_t *const *restrict w,
                                                        const float *restrict x, int64_t ldx, const int mr,
                                                        int64_t K, const int nr, float *restrict y, int64_t ldy) {
    vf acc[FMR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = VZERO();
    const int64_t bb = block_bytes(fmt);
    /* The rows of a tile are read block by block, in turn: an order the hardware prefetchers
     * do not follow (3.6x slower than row by row on a 30 MB matrix). Each step prefetches its
     * share of the tile PF_TILES ahead (the rows of a linear are contiguous; a prefetch past
     * the end does not fault). */
    const char *ahead = (const char *)w[0] + PF_TILES * NR * (K / 32 * bb);
    for (int64_t k = 0, off = 0; k < K; k += 32, off += bb) {
        for (int64_t p = 0; p < NR * bb; p += 64) _mm_prefetch(ahead + NR * off + p, _MM_HINT_T0);
        for (int j = 0; j < nr; j++) {
            vf wv[BV];
            deq_block(fmt, w[j] + off, wv);
            for (int v = 0; v < BV; v++)
                for (int i = 0; i < mr; i++) acc[i][j] = VFMA(VLOAD(x + i * ldx + k + v * VL), wv[v], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = vsum(acc[i][j]);
}

#define FTILE_MR(F, MRV)                                                                                       \
    do {                                                                                                       \
        if (nr == NR) ftile(F, w, x, ldx, MRV, K, NR, y, ldy);                                                 \
        else                                                                                                   \
            for (int j_ = 0; j_ < nr; j_++) ftile(F, w + j_, x, ldx, MRV, K, 1, y + j_, ldy);                  \
    } while (0)
#define FTILE_FMT(F)                                                                                           \
    do {                                                                                                       \
        switch (mr) {                                                                                          \
        case 1: FTILE_MR(F, 1); return;                                                                        \
        case 2: FTILE_MR(F, 2); return;                                                                        \
        FTILE_MR3(F) FTILE_MR4(F) FTILE_MR5(F) FTILE_MR6(F) FTILE_MR7(F) FTILE_MR8(F)                          \
        }                                                                                                      \
    } while (0)
#if FMR > 2
#define FTILE_MR3(F) case 3: FTILE_MR(F, 3); return;
#else
#define FTILE_MR3(F)
#endif
#if FMR > 3
#define FTILE_MR4(F) case 4: FTILE_MR(F, 4); return;
#else
#define FTILE_MR4(F)
#endif
#if FMR > 4
#define FTILE_MR5(F) case 5: FTILE_MR(F, 5); return;
#else
#define FTILE_MR5(F)
#endif
#if FMR > 5
#define FTILE_MR6(F) case 6: FTILE_MR(F, 6); return;
#else
#define FTILE_MR6(F)
#endif
#if FMR > 6
#define FTILE_MR7(F) case 7: FTILE_MR(F, 7); return;
#else
#define FTILE_MR7(F)
#endif
#if FMR > 7
#define FTILE_MR8(F) case 8: FTILE_MR(F, 8); return;
#else
#define FTILE_MR8(F)
#endif

/* rows w[0..nr) (all in format fmt, fused_fmt) times mr <= FMR rows of x */
static void ftile_any(int fmt, const uint8_t *const *w, const float *x, int64_t ldx, int mr, int64_t K, int nr,
                      float *y, int64_t ldy) {
    switch (fmt) {
    case Q4_0: FTILE_FMT(Q4_0); break;
    case Q4_1: FTILE_FMT(Q4_1); break;
    case Q8_0: FTILE_FMT(Q8_0); break;
    }
}
#else
#define FUSED 0
#define FUSED_MAX_M_DEFAULT 0
#define FMR MR
static inline int fused_fmt(int fmt) { (void)fmt; return 0; }
static void ftile_any(int fmt, const uint8_t *const *w, const float *x, int64_t ldx, int mr, int64_t K, int nr,
                      float *y, int64_t ldy) {
    (void)fmt; (void)w; (void)x; (void)ldx; (void)mr; (void)K; (void)nr; (void)y; (void)ldy;
}
#endif

/* rows [0, M) of x in groups of FMR, each group's tiles dequantizing the weight blocks again */
static void ftile_rows(int fmt, const uint8_t *const *w, const float *x, int64_t ldx, int64_t M, int64_t K, int nr,
                       float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m += FMR)
        ftile_any(fmt, w, x + m * ldx, ldx, M - m < FMR ? (int)(M - m) : FMR, K, nr, y + m * ldy, ldy);
}

/* Up to fused_max_m rows take the fused tiles (in groups of MR); more, the buffered path.
 * TAILRACE_CPU_QUANT_FUSED=0 in the environment of the first call turns them off. */
static int64_t fused_max_m = -1;
static inline int use_fused(int fmt, int64_t M) {
    if (fused_max_m < 0) {
        const char *e = getenv("TAILRACE_CPU_QUANT_FUSED");
        fused_max_m = e && e[0] == '0' ? 0 : FUSED_MAX_M_DEFAULT;
    }
    return FUSED && M <= fused_max_m && fused_fmt(fmt);
}
int cpu_quant_fused(int fmt, int64_t M) { return use_fused(fmt, M); }
/* the most rows that take the fused tiles now (0: none) */
int cpu_quant_fused_max_m(void) {
    (void)use_fused(Q4_0, 1);
    return FUSED ? (int)fused_max_m : 0;
}
/* max_m: the most rows that take the fused tiles, 0 for none, -1 for the default (tests and
 * A/B runs; not while a product runs); returns whether this build has them */
int cpu_quant_set_fused(int max_m) {
    fused_max_m = max_m < 0 ? FUSED_MAX_M_DEFAULT : max_m;
    return FUSED;
}

#include "quant_gemm.c"

/* The int16 GEMV tiles (builds with AVX2+FMA and no AVX-512; issue 60): for few rows of x and
 * every format, the activations quantized once per call to int16 per row and 32-element block
 * (the int16 GEMM tiles' rounding, gpu/cpu_quant_gemm.c gemm_quantize: dx_b = absmax_b / 32767,
 * round to nearest, ~2^-16 of the block's largest |x|), the weights' integers widened to int16
 * in registers and multiplied with them by _mm256_madd_epi16 (16 products into 8 int32 lanes,
 * exact), then scaled into fp32 once a 32-element block.
 *
 * Why int16 and not int8 activations (llama.cpp's Q8_0/Q8_K blocks, _mm256_maddubs_epi16): on
 * the bundled SmolLM2 int8 activations per 32-element block put the mean KL from fp32 at 2.4e-3
 * (int16: 5e-8), 25x over the bar (a tenth of HF bf16's, 9.7e-5; docs/kernels.md, issue 60).
 * At one to a few rows the tile is bound by the ops that turn packed weights into something to
 * multiply, not by the multiplies: widening a block's nibbles to int16 (two vpmovzxbw) and two
 * vpmaddwd cost about what a maddubs path costs, and less than half of the fp32 tiles' (each
 * weight converted to fp32, scaled and offset before its FMA).
 *
 * Per output (row i of x, row n of W), the sum, the same whatever M, the tiles' split of the rows
 * or the threads (each row of x is quantized alone; a tile only picks which outputs it computes):
 * 8 fp32 lanes, over the 32-element blocks b in k order,
 *   acc = fma(float(sum_k q_k xq_k over lane pairs), d_b * dx_b, acc)
 * (the K-quants: d_b = fl(d sc_s) of the sub-block, Q6_K: sc folded into q as an int16 product
 * and d_b = d); Q4_1: acc = fma(m_b / 8, sx_b, acc) (the min times the exact fp32 sum of x's
 * block, spread over the 8 lanes); Q4_K/Q5_K once a super-block acc = fnma(fl(dmin mn_s), sx_s,
 * acc), a lane a sub-block; then the lanes summed (vsum). Error: that of x's rounding,
 * sum_b sum_{k in b} |w_k - min_k| absmax_b / 65534 * 1.002, plus fp32 rounding (tests/gpu/
 * test_gguf_packed.py test_int16_gemv_tiles_*). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define I16V 1
/* The most rows they take by default, per format. Measured (docs/kernels.md, scripts/
 * bench_cpu_quant_gemm.py --cpu-time, one thread, the 2-core AVX2 EPYC): against the buffered
 * fp32 tiles (the fused ones serve only up to 2 rows) Q4_1 1.5x at 1 row, 1.16x at 2, 1.1x at 3,
 * 0.93x at 4; the Q8_0 LM head 1.7-2.4x at 1-4 rows, 1.18x at 8; Q4_K 3.5x at 1, 1.13x at 6,
 * level at 8. Above them the buffered tiles, from GEMM_MIN_M_DEFAULT (12; Q8_0 16) the GEMM tiles. */
#ifndef I16V_MAX_M_DEFAULT
#define I16V_MAX_M_DEFAULT 3
#endif
#ifndef I16V_MAX_M_Q8_0
#define I16V_MAX_M_Q8_0 11
#endif
#ifndef I16V_MAX_M_KQ
#define I16V_MAX_M_KQ 6
#endif
/* Q2_K/Q3_K (issue 55: their 16-element sub-blocks' scales folded per x-block, Q2_K's mins a second
 * dot) against the buffered tiles, 2048 x 2048, one thread, best of 30: Q2_K 0.57/0.84 ms at 1 row,
 * 0.76/0.94 at 2, 1.32/1.21 at 3; Q3_K 0.77/1.05, 0.85/1.15, 1.64/1.34 */
#ifndef I16V_MAX_M_K23
#define I16V_MAX_M_K23 2
#endif
#define IMR 2   /* rows of x a tile: 2 x NR accumulators + 2 weight vectors + scales of the 16 ymm */

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* rows [0, M) of x [., K] (stride ldx) -> q [M, K] int16, dx and sx [M, K / 32] (gxq's layout):
 * gemm_quantize's values (the same dx and q; sx summed in another order) */
static void i16v_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *q, float *dx, float *sx) {
    const int64_t nb = K / 32;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * ldx + 32 * b;
            const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16),
                         v3 = _mm256_loadu_ps(p + 24);
            const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absm), _mm256_and_ps(v1, absm)),
                                                   _mm256_max_ps(_mm256_and_ps(v2, absm), _mm256_and_ps(v3, absm))));
            /* vmaxps drops a NaN: look for one (a NaN or inf in x gives NaN outputs) */
            const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                           _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
            const int bad = _mm256_movemask_ps(un) || amax == __builtin_inff();
            const float s = amax >= 32767.f * 1.17549435e-38f && !bad ? 32767.f / amax : 0.f;
            dx[m * nb + b] = bad ? __builtin_nanf("") : s > 0.f ? amax / 32767.f : 0.f;
            __m256 t = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
            sx[m * nb + b] = vsum(t);
            const __m256 sv = _mm256_set1_ps(s);
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, sv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, sv));
            const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, sv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, sv));
            /* packs works per 128-bit lane: [q0 0-3, q1 0-3 | q0 4-7, q1 4-7] -> in order */
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b), _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + m * K + 32 * b + 16),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q2, q3), 0xD8));
        }
}

/* sum over 32 elements of w (two int16 vectors: elements 0..15, 16..31) times xq's block at p */
static inline __m256 i16v_dot(__m256i w0, __m256i w1, const int16_t *p) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)p), x1 = _mm256_loadu_si256((const __m256i *)(p + 16));
#if defined(__AVXVNNI__)
    /* AVX-VNNI (a -march=native build on a CPU that has it): vpdpwssd multiplies and adds in one
     * op; the same exact int32 sums, so the same bits */
    const __m256i s = _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
    return _mm256_cvtepi32_ps(s);
}

/* y[i, j] = sum_k x[i, k] w_j[k] for mr <= IMR rows of x (quantized: xq's rows i0..) and nr <= NR
 * packed rows w[0..nr) of format fmt; the order of the sums above */
static inline __attribute__((always_inline)) void i16tile(const int fmt, const uint8_t *const *restrict w,
                                                          const gxq *xq, int64_t i0, const int mr, int64_t K,
                                                          const int nr, float *restrict y, int64_t ldy) {
    __m256 acc[IMR][NR];
    float accm[IMR][NR];   /* Q4_1: sum_b m_b sx_b */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps(), accm[i][j] = 0.f;
    const int64_t nb = K / 32, be = block_elems(fmt), bb = block_bytes(fmt), row_bytes = K / be * bb;
    const int16_t *xr = xq->q + i0 * K;
    const float *dx = xq->dx + i0 * nb, *sx = xq->sx + i0 * nb;
    const __m128i m4 = _mm_set1_epi8(15);
    const __m256i m4y = _mm256_set1_epi8(15);
    /* prefetch as ftile does: the tile's share PF_TILES tiles ahead */
    const char *ahead = (const char *)w[0] + PF_TILES * NR * row_bytes;
    if (be == 32) {
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t p = 0; p < NR * bb; p += 64) _mm_prefetch(ahead + NR * b * bb + p, _MM_HINT_T0);
            for (int j = 0; j < nr; j++) {
                const uint8_t *blk = w[j] + b * bb;
                __m256i w0, w1;
                if (fmt == Q8_0) {
                    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
                    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
                } else if (fmt == Q5_1) {
                    q5_1_codes(blk, &w0, &w1);
                } else {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (fmt == Q4_1 ? 4 : 2)));
                    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
                    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
                    if (fmt == Q4_0) {
                        w0 = _mm256_sub_epi16(w0, _mm256_set1_epi16(8));
                        w1 = _mm256_sub_epi16(w1, _mm256_set1_epi16(8));
                    }
                }
                /* d (and Q4_1's m) converted together: one load, one vcvtph2ps */
                uint32_t dm = 0;
                memcpy(&dm, blk, fmt == Q4_1 || fmt == Q5_1 ? 4 : 2);
                const __m128 dmv = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
                const float d = _mm_cvtss_f32(dmv);
                for (int i = 0; i < mr; i++)
                    acc[i][j] = _mm256_fmadd_ps(i16v_dot(w0, w1, xr + i * K + 32 * b),
                                                _mm256_set1_ps(d * dx[i * nb + b]), acc[i][j]);
                if (fmt == Q4_1 || fmt == Q5_1) {   /* m sx_b, a scalar sum per output */
                    const float m = _mm_cvtss_f32(_mm_movehdup_ps(dmv));
                    for (int i = 0; i < mr; i++) accm[i][j] = __builtin_fmaf(m, sx[i * nb + b], accm[i][j]);
                }
            }
        }
    } else {   /* the K-quants: super-blocks of 256, 8 x-blocks each */
        for (int64_t sb = 0; sb < K / 256; sb++) {
            for (int64_t p = 0; p < NR * bb; p += 64) _mm_prefetch(ahead + NR * sb * bb + p, _MM_HINT_T0);
            const int64_t b0 = 8 * sb;
            for (int j = 0; j < nr; j++) {
                const uint8_t *blk = w[j] + sb * bb;
                if (fmt == Q2_K) {   /* (d sc) q - (dmin mn): the mins' dot over x's integers too */
                    const __m256 dv = _mm256_set1_ps(f16(blk + 80)), mv = _mm256_set1_ps(f16(blk + 82));
                    for (int t = 0; t < 8; t++) {
                        __m256i w0, w1, m0, m1;
                        q2_k_piece(blk, t, &w0, &w1, &m0, &m1);
                        for (int i = 0; i < mr; i++) {
                            const int16_t *xb = xr + i * K + 32 * (b0 + t);
                            const __m256 dxv = _mm256_set1_ps(dx[i * nb + b0 + t]);
                            acc[i][j] = _mm256_fmadd_ps(i16v_dot(w0, w1, xb), _mm256_mul_ps(dv, dxv), acc[i][j]);
                            acc[i][j] = _mm256_fnmadd_ps(i16v_dot(m0, m1, xb), _mm256_mul_ps(mv, dxv), acc[i][j]);
                        }
                    }
                    continue;
                }
                if (fmt == Q3_K) {   /* d ((sc - 32) q): the scale folded into the integers, as Q6_K's */
                    const __m256 dv = _mm256_set1_ps(f16(blk + 108));
                    int8_t sc[16];
                    scales_q3k(blk + 96, sc);
                    for (int t = 0; t < 8; t++) {
                        __m256i w0, w1;
                        q3_k_piece(blk, sc, t, &w0, &w1);
                        for (int i = 0; i < mr; i++)
                            acc[i][j] = _mm256_fmadd_ps(i16v_dot(w0, w1, xr + i * K + 32 * (b0 + t)),
                                                        _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * nb + b0 + t])), acc[i][j]);
                    }
                    continue;
                }
                if (fmt == Q6_K) {
                    const uint8_t *ql = blk, *qh = blk + 128;
                    const int8_t *sc = (const int8_t *)(blk + 192);
                    const __m256 dv = _mm256_set1_ps(f16(blk + 208));
                    const __m256i m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi16(32);
                    for (int h = 0; h < 2; h++) {
                        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
                        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
                        const __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                        for (int r = 0; r < 4; r++) {
                            /* element 32 r + e of the half: low nibble of ql (r & 1), shifted for r >= 2;
                             * bits 2r, 2r + 1 of qh as bits 4, 5 */
                            const __m256i lsrc = r & 1 ? l1 : l0;
                            const __m256i lo = _mm256_and_si256(r >= 2 ? _mm256_srli_epi16(lsrc, 4) : lsrc, m4y);
                            const __m256i hb = _mm256_and_si256(r == 0 ? _mm256_slli_epi16(hv, 4)
                                                                : r == 1 ? _mm256_slli_epi16(hv, 2)
                                                                : r == 2 ? hv : _mm256_srli_epi16(hv, 2), m30);
                            const __m256i q = _mm256_or_si256(lo, hb);
                            const int s = 4 * h + r;
                            __m256i w0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), k32);
                            __m256i w1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), k32);
                            w0 = _mm256_mullo_epi16(w0, _mm256_set1_epi16(sc[2 * s]));
                            w1 = _mm256_mullo_epi16(w1, _mm256_set1_epi16(sc[2 * s + 1]));
                            for (int i = 0; i < mr; i++)
                                acc[i][j] = _mm256_fmadd_ps(i16v_dot(w0, w1, xr + i * K + 32 * (b0 + s)),
                                                            _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * nb + b0 + s])),
                                                            acc[i][j]);
                        }
                    }
                    continue;
                }
                /* Q4_K, Q5_K */
                const float d = f16(blk), dmin = f16(blk + 2);
                uint8_t sc[8], mn[8];
                scale_min_k4(blk + 4, sc, mn);
                uint64_t mn8;
                memcpy(&mn8, mn, 8);
                const __m256 mnv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8))),
                                                 _mm256_set1_ps(dmin));
                for (int i = 0; i < mr; i++)
                    acc[i][j] = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(sx + i * nb + b0), acc[i][j]);
                const uint8_t *qs = fmt == Q4_K ? blk + 16 : blk + 48;
                const __m256i qhv = fmt == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2)));
                    __m256i q = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4y);
                    if (fmt == Q5_K) {
                        const __m256i bit = _mm256_set1_epi8((char)(1 << s));
                        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bit), bit),
                                                                _mm256_set1_epi8(16)));
                    }
                    const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
                    const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
                    const __m256 dv = _mm256_set1_ps(d * (float)sc[s]);
                    for (int i = 0; i < mr; i++)
                        acc[i][j] = _mm256_fmadd_ps(i16v_dot(w0, w1, xr + i * K + 32 * (b0 + s)),
                                                    _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * nb + b0 + s])), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = vsum(acc[i][j]) + accm[i][j];
}

#define I16T_MR(F, MRV)                                                                                        \
    do {                                                                                                       \
        if (nr == NR) i16tile(F, w, xq, i0, MRV, K, NR, y, ldy);                                               \
        else                                                                                                   \
            for (int j_ = 0; j_ < nr; j_++) i16tile(F, w + j_, xq, i0, MRV, K, 1, y + j_, ldy);                \
    } while (0)
#define I16T_FMT(F)                                                                                            \
    do {                                                                                                       \
        if (mr == 1) I16T_MR(F, 1);                                                                            \
        else I16T_MR(F, 2);                                                                                    \
    } while (0)

/* rows w[0..nr) (format fmt) times mr <= IMR rows of x quantized (xq's rows i0..) */
static void i16tile_any(int fmt, const uint8_t *const *w, const gxq *xq, int64_t i0, int mr, int64_t K, int nr,
                        float *y, int64_t ldy) {
    switch (fmt) {
    case Q4_0: I16T_FMT(Q4_0); break;
    case Q4_1: I16T_FMT(Q4_1); break;
    case Q5_1: I16T_FMT(Q5_1); break;
    case Q8_0: I16T_FMT(Q8_0); break;
    case Q2_K: I16T_FMT(Q2_K); break;
    case Q3_K: I16T_FMT(Q3_K); break;
    case Q4_K: I16T_FMT(Q4_K); break;
    case Q5_K: I16T_FMT(Q5_K); break;
    case Q6_K: I16T_FMT(Q6_K); break;
    }
}
#else
#define I16V 0
#define I16V_MAX_M_DEFAULT 0
#define I16V_MAX_M_Q8_0 0
#define I16V_MAX_M_KQ 0
#define I16V_MAX_M_K23 0
#define IMR 1
static void i16v_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *q, float *dx, float *sx) {
    (void)x; (void)ldx; (void)M; (void)K; (void)q; (void)dx; (void)sx;
}
static void i16tile_any(int fmt, const uint8_t *const *w, const gxq *xq, int64_t i0, int mr, int64_t K, int nr,
                        float *y, int64_t ldy) {
    (void)fmt; (void)w; (void)xq; (void)i0; (void)mr; (void)K; (void)nr; (void)y; (void)ldy;
}
#endif

/* rows [0, M) of x (quantized in xq) in groups of IMR, each group's tiles reading the weights again;
 * rows w[0..nr) of formats fmts (a tile of one format, or one row a format where they differ) */
static void i16tile_rows(const int *fmts, const uint8_t *const *w, const gxq *xq, int64_t M, int64_t K, int nr,
                         float *y, int64_t ldy) {
    int same = 1;
    for (int j = 1; j < nr; j++) same &= fmts[j] == fmts[0];
    for (int64_t m = 0; m < M; m += IMR) {
        const int mr = M - m < IMR ? (int)(M - m) : IMR;
        if (same) i16tile_any(fmts[0], w, xq, m, mr, K, nr, y + m * ldy, ldy);
        else
            for (int j = 0; j < nr; j++) i16tile_any(fmts[j], w + j, xq, m, mr, K, 1, y + m * ldy + j, ldy);
    }
}

/* Up to i16v_max(fmt) rows of format fmt take the int16 GEMV tiles. TAILRACE_CPU_QUANT_INT16=0 in
 * the environment of the first call turns them off (as it does the AVX-512 int16 GEMM tiles). */
static int64_t i16v_max_m = -1, i16v_env = -1;   /* max_m -1: each format's default */
static inline int64_t i16v_max(int fmt) {
    if (i16v_env < 0) {
        const char *e = getenv("TAILRACE_CPU_QUANT_INT16");
        i16v_env = !(e && e[0] == '0');
    }
    if (!I16V || !i16v_env) return 0;
    if (i16v_max_m >= 0) return i16v_max_m;
    if (fmt == Q2_K || fmt == Q3_K) return I16V_MAX_M_K23;
    return fmt == Q8_0 ? I16V_MAX_M_Q8_0 : block_elems(fmt) == 256 ? I16V_MAX_M_KQ : I16V_MAX_M_DEFAULT;
}
static inline int use_i16v(int fmt, int64_t M) { return M <= i16v_max(fmt); }
/* whether any format's calls of M rows take them (the C decode stack's scratch) */
static inline int use_i16v_any(int64_t M) {
    return use_i16v(Q4_0, M) || use_i16v(Q8_0, M) || use_i16v(Q4_K, M);
}
/* the most rows of format fmt that take the int16 GEMV tiles now (0: none) */
int cpu_quant_int16_gemv_max_m(int fmt) { return (int)i16v_max(fmt); }
/* max_m: the most rows of every format that take them, 0 for none, -1 for each format's default
 * (both: unless TAILRACE_CPU_QUANT_INT16=0; tests and A/B runs, not while a product runs); returns
 * whether this build has them */
int cpu_quant_set_int16_gemv(int max_m) {
    i16v_max_m = max_m >= 0 ? max_m : -1;
    i16v_env = max_m >= 0 ? 1 : -1;
    return I16V;
}

/* *mem (of *size bytes) grown to at least want bytes, 64-byte aligned; 0 where that fails */
static int xq_grow(void **mem, size_t *size, size_t want) {
    if (want > *size) {
        free(*mem);
        *mem = aligned_alloc(64, (want + 63) & ~(size_t)63);
        *size = *mem ? want : 0;
    }
    return *mem != NULL;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N]), W [N, row_bytes] packed
 * in format fmt. K a multiple of the format's block (and so of the vector width). Returns -1 for
 * arguments it does not take (nothing written). */
int cpu_quant_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                     int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias) {
    if (!block_bytes(fmt) || K % block_elems(fmt) || row_bytes != K / block_elems(fmt) * block_bytes(fmt)
        || K > (1 << 16))
        return -1;
    /* x quantized for the int16 tiles: in this calling thread's scratch, grown and kept (a few
     * MB at most for prefill: no allocation, nor its page faults, per call) */
    static _Thread_local void *xq_mem;
    static _Thread_local size_t xq_size;
    if (use_i16v(fmt, M) && !use_gemm(fmt, M) && xq_grow(&xq_mem, &xq_size, gemm16_bytes(M, K))) {
        const gxq xq = gemm16_at(xq_mem, M, K);
        i16v_quantize(x, ldx, M, K, (int16_t *)xq.q, (float *)xq.dx, (float *)xq.sx);
        const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            const uint8_t *rows[NR];
            int fmts[NR];
            for (int j = 0; j < nr; j++) rows[j] = w + (n0 + j) * row_bytes, fmts[j] = fmt;
            i16tile_rows(fmts, rows, &xq, M, K, nr, y + n0, ldy);
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int j = 0; j < nr; j++) y[m * ldy + n0 + j] += bias[n0 + j];
        }
        return 0;
    }
    if (use_gemm(fmt, M)) {
        const int i16 = use_int16(fmt) && xq_grow(&xq_mem, &xq_size, gemm16_bytes(M, K));   /* else the fp32 tiles */
        const gxq xq = i16 ? gemm16_at(xq_mem, M, K) : (gxq){0};
#pragma omp parallel
        {
            float *buf = aligned_alloc(64, sizeof(float) * GEMM_BUF_FLOATS);
            const uint8_t *rows[NP];
            int fmts[NP];
            if (i16) {
#pragma omp for schedule(static)
                for (int64_t m = 0; m < M; m++)
                    gemm_quantize(x, ldx, m, m + 1, K, (int16_t *)xq.q, (float *)xq.dx, (float *)xq.sx);
            }
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += NP) {
                const int nr = N - n0 < NP ? (int)(N - n0) : NP;
                for (int j = 0; j < nr; j++) rows[j] = w + (n0 + j) * row_bytes, fmts[j] = fmt;
                gemm_panel(rows, fmts, nr, x, ldx, M, K, y + n0, ldy, buf, i16 ? &xq : NULL);
                if (bias)
                    for (int64_t m = 0; m < M; m++)
                        for (int j = 0; j < nr; j++) y[m * ldy + n0 + j] += bias[n0 + j];
            }
            free(buf);
        }
        return 0;
    }
    const int64_t tiles = (N + NR - 1) / NR;
    const int fused = use_fused(fmt, M);
#pragma omp parallel
    {
        float *buf = fused ? NULL : aligned_alloc(64, (size_t)NR * K * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            if (fused) {
                const uint8_t *rows[NR];
                for (int j = 0; j < nr; j++) rows[j] = w + (n0 + j) * row_bytes;
                ftile_rows(fmt, rows, x, ldx, M, K, nr, y + n0, ldy);
            } else {
                for (int j = 0; j < nr; j++) dequant_row(fmt, w + (n0 + j) * row_bytes, K, buf + j * K);
                for (int64_t m = 0; m < M; m += MR) {
                    const int mr = M - m < MR ? (int)(M - m) : MR;
                    tile_any(x + m * ldx, ldx, mr, buf, K, nr, y + m * ldy + n0, ldy);
                }
            }
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int j = 0; j < nr; j++) y[m * ldy + n0 + j] += bias[n0 + j];
        }
        free(buf);
    }
    return 0;
}
