/* CPU kernels for the decode step, built by gpu/kernels/cpu/ops.py with the system C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes. No torch headers: it compiles in
 * about a second. OpenMP resolves to the libgomp torch has already loaded (same soname), so
 * these loops share torch's thread pool instead of oversubscribing the cores.
 *
 * Tensors arrive as raw pointers with their dtype as a flag (0: fp32, 1: bf16) and are read
 * in place; all arithmetic is fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n elements of a row of dtype `bf16` (0/1) starting at element `off` -> fp32 dst. */
static inline void load_row(const void *base, int64_t off, int n, int bf16, float *restrict dst) {
#if defined(__AVX512F__)
    if (bf16 && n % 16 == 0) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        return;
    }
#endif
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * 4);
    }
}

static inline void store_row(void *base, int64_t off, int n, int bf16, const float *restrict src) {
    if (bf16) {  /* f32_to_bf16 without branches, so that it vectorises */
        uint16_t *restrict dst = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, src + i, 4);
            const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            dst[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
        }
    } else {
        memcpy((float *)base + off, src, (size_t)n * 4);
    }
}

/* exp(x) for x <= 0 (a score minus its row's max), vectorisable (glibc's expf is not
 * without -ffast-math, whose finite-math assumption the -inf of an empty max breaks):
 * Cephes' expf, 2^n * p(r) with r = x - n ln 2, about 1 ulp; below -87 it returns
 * exp(-87) ~ 1.6e-38, nothing against a denominator >= 1. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(__AVX512F__)
#define VECTOR_WIDTH 16

/* exp_nonpos on 16 lanes */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load16(const void *base, int64_t off, int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + off);
}

/* The sums of four vectors' lanes, in one vector (a reduction each would cost twice). */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define HALVES(a) _mm256_add_ps(_mm512_castps512_ps256(a), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)))
    const __m256 h01 = _mm256_hadd_ps(HALVES(a0), HALVES(a1)), h23 = _mm256_hadd_ps(HALVES(a2), HALVES(a3));
#undef HALVES
    const __m256 h = _mm256_hadd_ps(h01, h23);  /* per 128-bit lane: the four rows' partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Row-major passes: each token's [hper, D] row of k (then of v) is read once, whole and in
 * order, for all of the item's query heads. Measured (SmolLM2's shapes, 30 layers' caches, one
 * thread): 0.81 ms a layer, against 0.98 for register tiles of 4 heads x 64 dims that walked
 * the tokens once per KV head, reading 128 of every 384 bytes each time; software prefetch of
 * the next block changed nothing. */
static inline __attribute__((always_inline)) void dot_rows(const void *k_cache, int bf16, int64_t e,
        const float *q, int64_t D, float *r, const int GN) {
    __m512 a[4];
    for (int g = 0; g < 4; g++) a[g] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const __m512 k0 = load16(k_cache, e + d0, bf16), k1 = load16(k_cache, e + d0 + 16, bf16);
        const __m512 k2 = load16(k_cache, e + d0 + 32, bf16), k3 = load16(k_cache, e + d0 + 48, bf16);
        for (int g = 0; g < GN; g++) {
            const float *qg = q + g * D + d0;
            a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), k0, a[g]);
            a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), k1, a[g]);
            a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, a[g]);
            a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, a[g]);
        }
    }
    _mm_storeu_ps(r, reduce4(a[0], a[1], a[2], a[3]));
}

static void qk_rows(const void *k_cache, int bf16, const int32_t *table, int64_t bs, int64_t t0, int64_t len,
                    int64_t row, int64_t col, int64_t hper, int64_t G, const float *q, int64_t D, float *s,
                    int64_t max_len, float *mx) {
    float r[4];
    for (int64_t t = t0; t < len;) {
        const int64_t off = t % bs, n = (bs - off < len - t) ? bs - off : len - t;
        const int64_t base = (int64_t)table[t / bs] * bs + off;
        for (int64_t j = 0; j < n; j++, t++) {
            const int64_t e = (base + j) * row + col;
            for (int64_t h = 0, i = 0; h < hper; h++)
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    const int64_t gn = G - g0 < 4 ? G - g0 : 4;
                    const float *qi = q + (h * G + g0) * D;
                    switch (gn) {
                    case 1: dot_rows(k_cache, bf16, e + h * D, qi, D, r, 1); break;
                    case 2: dot_rows(k_cache, bf16, e + h * D, qi, D, r, 2); break;
                    case 3: dot_rows(k_cache, bf16, e + h * D, qi, D, r, 3); break;
                    default: dot_rows(k_cache, bf16, e + h * D, qi, D, r, 4); break;
                    }
                    for (int64_t g = 0; g < gn; g++, i++) {
                        s[i * max_len + t] = r[g];
                        if (r[g] > mx[i]) mx[i] = r[g];
                    }
                }
        }
    }
}

/* acc [nq, D] = sum_t p[i][t] v[t][head of i] (acc zeroed here) */
static void pv_rows(const void *v_cache, int bf16, const int32_t *table, int64_t bs, int64_t t0, int64_t len,
                    int64_t row, int64_t col, int64_t hper, int64_t G, const float *p, int64_t max_len,
                    float *acc, int64_t D) {
    memset(acc, 0, sizeof(float) * (size_t)(hper * G * D));
    for (int64_t t = t0; t < len;) {
        const int64_t off = t % bs, n = (bs - off < len - t) ? bs - off : len - t;
        const int64_t base = (int64_t)table[t / bs] * bs + off;
        for (int64_t j = 0; j < n; j++, t++) {
            const int64_t e = (base + j) * row + col;
            for (int64_t h = 0; h < hper; h++)
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    const __m512 v0 = load16(v_cache, e + h * D + d0, bf16);
                    const __m512 v1 = load16(v_cache, e + h * D + d0 + 16, bf16);
                    const __m512 v2 = load16(v_cache, e + h * D + d0 + 32, bf16);
                    const __m512 v3 = load16(v_cache, e + h * D + d0 + 48, bf16);
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t i = h * G + g;
                        const __m512 pb = _mm512_set1_ps(p[i * max_len + t]);
                        float *ai = acc + i * D + d0;
                        _mm512_storeu_ps(ai, _mm512_fmadd_ps(pb, v0, _mm512_loadu_ps(ai)));
                        _mm512_storeu_ps(ai + 16, _mm512_fmadd_ps(pb, v1, _mm512_loadu_ps(ai + 16)));
                        _mm512_storeu_ps(ai + 32, _mm512_fmadd_ps(pb, v2, _mm512_loadu_ps(ai + 32)));
                        _mm512_storeu_ps(ai + 48, _mm512_fmadd_ps(pb, v3, _mm512_loadu_ps(ai + 48)));
                    }
                }
        }
    }
}

#else
#define VECTOR_WIDTH 0
#endif

/* 16 when the hot loops below are AVX-512 (the only ones measured faster than torch's
 * gather + SDPA; the caller keeps torch otherwise), else 0. */
int cpu_kernels_vector_width(void) { return VECTOR_WIDTH; }

/* Decode attention over a paged KV cache, one query token per sequence, read in place.
 *
 * q, out:        [T, Hq, D], q's rows q_stride elements apart, out contiguous; sequence i's
 *                query is row q_rows[i]
 * k_cache, v_cache: [num_blocks, bs, Hkv, D]
 * tables:        [B, table_stride] int32 block ids; seq_lens [B] int64 (context incl. the new token)
 * new_k, new_v:  [T, Hkv, D] this step's k/v, rows k_stride, v_stride elements apart (NULL: already
 *                in the cache); sequence i's written first to slot slots[i] (< 0: not written)
 * sinks:         [Hq] fp32 logits joining each softmax denominator, or NULL
 * window:        > 0: a query at position p sees keys p - window + 1 .. p only
 * Returns 0, or -1 when a block id or slot is out of range or scratch memory runs out
 * (nothing is read or written out of bounds: the caller falls back to torch).
 *
 * A work item is one sequence and a range of its KV heads: it walks the sequence's tokens
 * block by block, reading each token's [heads, D] row once and contiguously (a head per
 * item instead read 128 of every 384 bytes and ran at a third of the speed). Two passes:
 * scores and their max, then exp, sum and the weighted values.
 */
int paged_decode_attention(const void *q, int64_t q_stride, const int64_t *q_rows, void *out,
                           void *k_cache, void *v_cache, int64_t num_blocks,
                           const int32_t *tables, int64_t table_stride, const int64_t *seq_lens,
                           const void *new_k, const void *new_v, int64_t k_stride, int64_t v_stride,
                           const int64_t *slots,
                           const float *sinks, int64_t window,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                           float scale, int bf16) {
    const int64_t G = Hq / Hkv;
    if (G * Hkv != Hq || D < 1 || bs < 1) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        if (len < 1 || (len + bs - 1) / bs > table_stride) return -1;
        for (int64_t j = 0; j < (len + bs - 1) / bs; j++)
            if (tables[b * table_stride + j] < 0 || tables[b * table_stride + j] >= num_blocks) return -1;
        if (slots && slots[b] >= num_blocks * bs) return -1;
        if (len > max_len) max_len = len;
    }
    /* few sequences: split their heads too, so that every thread has work */
    const int64_t parts = B >= 16 ? 1 : Hkv, hper = Hkv / parts;
    const size_t esz = bf16 ? 2 : 4;
    const int vec = VECTOR_WIDTH && D % 16 == 0;  /* whole vectors per head */
    (void)vec;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t nq = hper * G;  /* query heads per item */
        float *scores = malloc(sizeof(float) * (size_t)(nq * max_len));
        float *qf = malloc(sizeof(float) * (size_t)(nq * D));
        float *acc = malloc(sizeof(float) * (size_t)(nq * D));
        float *row = malloc(sizeof(float) * (size_t)(hper * D));
        float *mx = malloc(sizeof(float) * (size_t)nq);
        const int ok = scores && qf && acc && row && mx;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * parts; item++) {
            if (!ok) continue;
            const int64_t b = item / parts, h0 = (item % parts) * hper;
            const int64_t len = seq_lens[b], qrow = q_rows[b];
            const int32_t *table = tables + b * table_stride;
            if (slots && slots[b] >= 0) {  /* this step's k/v into the cache */
                const int64_t dst = (slots[b] * Hkv + h0) * D;
                memcpy((char *)k_cache + dst * esz, (const char *)new_k + (qrow * k_stride + h0 * D) * esz,
                       hper * D * esz);
                memcpy((char *)v_cache + dst * esz, (const char *)new_v + (qrow * v_stride + h0 * D) * esz,
                       hper * D * esz);
            }
            const int64_t t0 = (window > 0 && len > window) ? len - window : 0;
            load_row(q, qrow * q_stride + h0 * G * D, nq * D, bf16, qf);
            for (int64_t i = 0; i < nq * D; i++) qf[i] *= scale;
            for (int64_t i = 0; i < nq; i++) mx[i] = sinks ? sinks[h0 * G + i] : -INFINITY;
            /* pass 1: scores and their running max */
#if VECTOR_WIDTH
            if (D % 64 == 0)
                qk_rows(k_cache, bf16, table, bs, t0, len, Hkv * D, h0 * D, hper, G, qf, D, scores, max_len, mx);
#endif
            for (int64_t t = t0; t < len && !(VECTOR_WIDTH && D % 64 == 0);) {
                const int64_t off = t % bs, n = (bs - off < len - t) ? bs - off : len - t;
                const int64_t base = (int64_t)table[t / bs] * bs + off;
                for (int64_t j = 0; j < n; j++, t++) {
                    load_row(k_cache, ((base + j) * Hkv + h0) * D, hper * D, bf16, row);
                    for (int64_t h = 0, i = 0; h < hper; h++) {   /* no divisions: i = h * G + g */
                        const float *kh = row + h * D;
                        for (int64_t g = 0; g < G; g++, i++) {
                            const float *qi = qf + i * D;
                            float s = 0.f;
#if VECTOR_WIDTH
                            if (vec) {
                                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), _mm512_loadu_ps(kh));
                                for (int64_t d = 16; d < D; d += 16)
                                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + d), _mm512_loadu_ps(kh + d), a);
                                s = _mm512_reduce_add_ps(a);
                            } else
#endif
                            for (int64_t d = 0; d < D; d++) s += qi[d] * kh[d];
                            scores[i * max_len + t] = s;
                            if (s > mx[i]) mx[i] = s;
                        }
                    }
                }
            }
            /* softmax numerators; 1/denominator kept in mx */
            for (int64_t i = 0; i < nq; i++) {
                float sum = sinks ? expf(sinks[h0 * G + i] - mx[i]) : 0.f;
                float *si = scores + i * max_len;
                const float m = mx[i];
                int64_t t = t0;
#if VECTOR_WIDTH
                if (vec) {
                    __m512 vs = _mm512_setzero_ps();
                    const __m512 vm = _mm512_set1_ps(m);
                    for (; t < len; t += 16) {
                        const __mmask16 k = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
                        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, si + t), vm));
                        _mm512_mask_storeu_ps(si + t, k, e);
                        vs = _mm512_mask_add_ps(vs, k, vs, e);
                    }
                    sum += _mm512_reduce_add_ps(vs);
                }
#endif
                for (; t < len; t++) {
                    si[t] = exp_nonpos(si[t] - m);
                    sum += si[t];
                }
                mx[i] = 1.f / sum;
            }
            /* pass 2: probabilities x values */
#if VECTOR_WIDTH
            if (D % 64 == 0) {
                pv_rows(v_cache, bf16, table, bs, t0, len, Hkv * D, h0 * D, hper, G, scores, max_len, acc, D);
            } else
#endif
            memset(acc, 0, sizeof(float) * (size_t)(nq * D));
            for (int64_t t = t0; t < len && !(VECTOR_WIDTH && D % 64 == 0);) {
                const int64_t off = t % bs, n = (bs - off < len - t) ? bs - off : len - t;
                const int64_t base = (int64_t)table[t / bs] * bs + off;
                for (int64_t j = 0; j < n; j++, t++) {
                    load_row(v_cache, ((base + j) * Hkv + h0) * D, hper * D, bf16, row);
                    for (int64_t h = 0, i = 0; h < hper; h++) {
                        const float *vh = row + h * D;
                        for (int64_t g = 0; g < G; g++, i++) {
                            const float p = scores[i * max_len + t];
                            float *ai = acc + i * D;
#if VECTOR_WIDTH
                            if (vec) {
                                const __m512 vp = _mm512_set1_ps(p);
                                for (int64_t d = 0; d < D; d += 16)
                                    _mm512_storeu_ps(ai + d, _mm512_fmadd_ps(vp, _mm512_loadu_ps(vh + d),
                                                                             _mm512_loadu_ps(ai + d)));
                                continue;
                            }
#endif
                            for (int64_t d = 0; d < D; d++) ai[d] += p * vh[d];
                        }
                    }
                }
            }
            for (int64_t i = 0; i < nq; i++)
                for (int64_t d = 0; d < D; d++) acc[i * D + d] *= mx[i];
            store_row(out, (qrow * Hq + h0 * G) * D, nq * D, bf16, acc);
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
        free(mx);
    }
    return failed ? -1 : 0;
}

/* ---- The decoder's elementwise ops (gpu/layers/ops.py's CPU path): one call for what torch runs
 * as eight to twenty small ops. Compiled with -ffp-contract=off, each product and sum is
 * rounded as torch's separate ops round it; rows are split among threads only when large
 * (a parallel region costs more than a decode step's few rows). */

#define PARALLEL_MIN 65536  /* elements */
#define MAX_ROPE_DIM 1024  /* head_dim; the caller keeps torch beyond */

/* sum_out = x + residual (residual may be NULL: sum_out = x), out = rms_norm(sum_out) * weight;
 * N rows of D, contiguous. dtypes: 0 fp32, 1 bf16. sum_out may be NULL (no residual).
 * The statistics use the sum as stored (rounded to bf16 when o_bf16), as torch's two ops do. */
void add_rms_norm(const void *x, int x_bf16, const void *residual, int r_bf16, const void *weight,
                  int w_bf16, void *out, void *sum_out, int o_bf16, int64_t N, int64_t D, float eps) {
#pragma omp parallel if (N * D >= PARALLEL_MIN)
    {
    float *buf = malloc(sizeof(float) * 3 * (size_t)D), *tmp = buf + D, *w = buf + 2 * D;
    if (buf) load_row(weight, 0, (int)D, w_bf16, w);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (!buf) continue;  /* cannot happen for any sane D; out keeps garbage rather than crash */
        load_row(x, n * D, (int)D, x_bf16, buf);
        if (residual) {
            load_row(residual, n * D, (int)D, r_bf16, tmp);
            for (int64_t d = 0; d < D; d++) buf[d] += tmp[d];
        }
        if (sum_out) {
            store_row(sum_out, n * D, (int)D, o_bf16, buf);
            if (o_bf16) load_row(sum_out, n * D, (int)D, 1, buf);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) ss += buf[d] * buf[d];
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < D; d++) buf[d] = (buf[d] * inv) * w[d];
        store_row(out, n * D, (int)D, o_bf16, buf);
    }
    free(buf);
    }
}

/* NeoX rotary embedding of q [T, Hq, D] and k [T, Hkv, D] (rows q_stride / k_stride elements
 * apart, heads contiguous) into q_out / k_out (contiguous): with c, s the first and second
 * halves of cos_sin[positions[t]] (fp32 [P, D]), x = [x1, x2] -> [x1 c - x2 s, x2 c + x1 s].
 * bf16: dtype of q, k and the outputs. -1 (nothing written) for a position outside cos_sin's P rows. */
int rope(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const int64_t *positions,
         const float *cos_sin, int64_t P, void *q_out, void *k_out, int64_t T, int64_t Hq, int64_t Hkv,
         int64_t D, int bf16) {
    const int64_t half = D / 2;
    if (D > MAX_ROPE_DIM) return -1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= P) return -1;
#pragma omp parallel for schedule(static) if (T * (Hq + Hkv) * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        float x[2 * MAX_ROPE_DIM];
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const int is_q = h < Hq;
            const int64_t src = is_q ? t * q_stride + h * D : t * k_stride + (h - Hq) * D;
            const int64_t dst = is_q ? (t * Hq + h) * D : (t * Hkv + h - Hq) * D;
            load_row(is_q ? q : k, src, (int)D, bf16, x);
            float *y = x + MAX_ROPE_DIM;
            for (int64_t i = 0; i < half; i++) {
                y[i] = x[i] * c[i] - x[i + half] * s[i];
                y[i + half] = x[i + half] * c[i] + x[i] * s[i];
            }
            store_row(is_q ? q_out : k_out, dst, (int)D, bf16, y);
        }
    }
    return 0;
}

/* gpu/model.exact_top_logits in place: in each row of logits [N, V] (fp32), the entries at or
 * above top - |top| * margin are recomputed as hidden[n] . weight[v] in fp32 (hidden [N, D]
 * fp32, weight [V, D] of dtype w_bf16). One pass for the max, one for the candidates: torch's
 * amax, ge, nonzero and gathers took 2-3 ms a decode step of 32 rows of 49k. */
void exact_top_logits(float *logits, const float *hidden, const void *weight, int w_bf16, int64_t N,
                      int64_t V, int64_t D, float margin) {
#pragma omp parallel for schedule(static) if (N * V >= PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++) {
        float *row = logits + n * V;
        const float *h = hidden + n * D;
        float top = -INFINITY;
        int64_t v = 0;
#if VECTOR_WIDTH
        __m512 vt = _mm512_set1_ps(-INFINITY);
        for (; v + 16 <= V; v += 16) vt = _mm512_max_ps(vt, _mm512_loadu_ps(row + v));
        top = _mm512_reduce_max_ps(vt);
#endif
        for (; v < V; v++) top = row[v] > top ? row[v] : top;
        const float thr = top - fabsf(top) * margin;
        float *w = malloc(sizeof(float) * (size_t)D);
        if (!w) continue;
        for (v = 0; v < V; v++) {
#if VECTOR_WIDTH
            if (v % 16 == 0 && v + 16 <= V &&
                !_mm512_cmp_ps_mask(_mm512_loadu_ps(row + v), _mm512_set1_ps(thr), _CMP_GE_OQ)) {
                v += 15;  /* none of these 16 */
                continue;
            }
#endif
            if (!(row[v] >= thr)) continue;
            load_row(weight, v * D, (int)D, w_bf16, w);
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += h[d] * w[d];
            row[v] = s;
        }
        free(w);
    }
}

/* out[n] = the first index of row n's maximum in logits [N, V] (fp32), a NaN counting as the
 * maximum (the first NaN), as torch's max(dim=-1).indices gives: one vectorised pass for the max
 * (and whether there is a NaN), then a scan for its first position. torch's row-wise max took
 * 1.0-1.4 ms a row of Gemma 3's 262k logits on one AVX2 core, 40 ms for 32 rows (issue 55). */
void argmax_rows(const float *logits, int64_t N, int64_t V, int64_t *out) {
#pragma omp parallel for schedule(static) if (N > 1 && N * V >= PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *row = logits + n * V;
        float top = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
        for (int64_t v = 0; v < V; v++) {
            top = row[v] > top ? row[v] : top;
            nan |= row[v] != row[v];
        }
        int64_t at = 0;
        if (nan) {
            while (row[at] == row[at]) at++;
        } else {   /* 64 at a time, vectorised, to the chunk that holds it (all -inf: index 0) */
            for (int64_t c = 0; c < V; c += 64) {
                const int64_t e = c + 64 < V ? c + 64 : V;
                int hit = 0;
#pragma omp simd reduction(| : hit)
                for (int64_t v = c; v < e; v++) hit |= row[v] == top;
                if (hit) {
                    at = c;
                    while (row[at] != top) at++;
                    break;
                }
            }
        }
        out[n] = at;
    }
}
