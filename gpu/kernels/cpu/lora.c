/* Multi-LoRA on the CPU (issue 60): one call per patched linear adds every adapter's term,
 *   out[perm[m]] += (x[perm[m]] A_g^T) (scale_g B_g)^T      for each row m of group g,
 * where the step's LoRA rows are sorted by adapter (perm) and group g is the run
 * perm[bounds[g] .. bounds[g+1]). Built by gpu/kernels/cpu/lora.py with gpu/kernels/cpu/ops.py's
 * builder (-O3 -march=native -fopenmp, cached per CPU's flags), called through ctypes.
 *
 * Weights: A^T [K, R] and (scale B)^T [R, N] of gpu/lora/adapters.py, packed by lora.py into
 * panels of CW columns (A^T as [ceil(R / CW), K, CW], B^T as [ceil(N / CW), R, CW], the last
 * panel zero-padded), so both GEMMs are outer products over a panel's rows: shrink
 * h[m, c..] += x[m, k] A^T[k, c..], expand acc[m, c..] += h[m, j] B^T[j, c..]. A work item is
 * (group, panel), read as one contiguous stream (row-major B^T would be a 64-byte strip a
 * row, N * 4 bytes apart: a cache miss each; 1.8x as long on SmolLM2's gate_up), then from L1/L2 for the
 * group's further row blocks: each adapter reads only its own bytes, once. The per-row shrink h stays fp32 (torch's bf16 path rounds it to
 * bf16); out is read, summed and rounded once.
 *
 * Vector paths: AVX-512F (16 lanes), AVX2+FMA (8 lanes), chosen when the build's -march has
 * them (ops.py keys the cached object by the CPU's flags); a chunk narrower than a vector, and
 * a build without either, takes the scalar loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define MR 6     /* rows per block: MR x NV accumulators */
#define NV 2     /* vectors per column chunk: 64 bytes of a row (AVX2), 128 (AVX-512) */

static inline float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vec;
static inline vec vload(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#define vzero() _mm512_setzero_ps()
#define vset1(f) _mm512_set1_ps(f)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vstoref(p, v) _mm512_storeu_ps(p, v)
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vec;
static inline vec vload(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}
#define vzero() _mm256_setzero_ps()
#define vset1(f) _mm256_set1_ps(f)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vstoref(p, v) _mm256_storeu_ps(p, v)
#else
#define VL 0
#endif

#define CW (VL ? VL * NV : 32)   /* columns per work item: the width of a weight panel */

/* dst[i * ldd + c] (c < cw) = sum_k src_i[k] * panel[k * CW + c], for the block's mr rows,
 * where src_i[k] = src[rows[i] * lds + k] (dtype src_bf16) and the panel [K, CW] starts at
 * element `off` of w (its columns past the weight's width are zeros). */
static void block(const void *src, int src_bf16, const int64_t *rows, int64_t lds, int mr,
                  const void *w, int w_bf16, int64_t off, int64_t K, float *dst, int64_t ldd,
                  int64_t cw) {
    float tmp[MR][CW] __attribute__((aligned(64)));
#if VL
    vec acc[MR][NV];
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = vzero();
    for (int64_t k = 0; k < K; k++) {
        vec b[NV];
        for (int v = 0; v < NV; v++) b[v] = vload(w, off + k * CW + v * VL, w_bf16);
        for (int i = 0; i < MR; i++) {
            if (i >= mr) break;
            const vec a = vset1(ld(src, rows[i] * lds + k, src_bf16));
            for (int v = 0; v < NV; v++) acc[i][v] = vfma(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) vstoref(tmp[i] + v * VL, acc[i][v]);
#else
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < CW; c++) tmp[i][c] = 0.f;
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < mr; i++) {
            const float a = ld(src, rows[i] * lds + k, src_bf16);
            for (int c = 0; c < CW; c++) tmp[i][c] += a * ld(w, off + k * CW + c, w_bf16);
        }
#endif
    for (int i = 0; i < mr; i++) memcpy(dst + i * ldd, tmp[i], (size_t)cw * 4);
}

/* Work items of every group, cw-column chunks of width `width[g]`: item -> (group, chunk). */
static int64_t items(const int64_t *width, int64_t G, int64_t *first) {
    int64_t n = 0;
    for (int64_t g = 0; g < G; g++) {
        first[g] = n;
        n += (width[g] + CW - 1) / CW;
    }
    first[G] = n;
    return n;
}

/* table: per group, at g * table_stride: (A^T pointer, B^T pointer, rank R); R 0: the group's
 * adapter does not patch this linear (skipped). Returns 0, or -1 without memory. */
int cpu_lora_apply(const void *x, int64_t x_stride, int x_bf16, void *out, int64_t out_stride,
                   int out_bf16, const int64_t *perm, const int64_t *bounds, const int64_t *table,
                   int64_t table_stride, int64_t G, int w_bf16, int64_t K, int64_t N) {
    const int64_t rows = bounds[G];
    int64_t rmax = 0, *rank = malloc(sizeof(int64_t) * (size_t)(4 * G + 2));
    if (!rank) return -1;
    int64_t *nwide = rank + G, *first_s = rank + 2 * G, *first_e = first_s + G + 1;
    for (int64_t g = 0; g < G; g++) {
        rank[g] = table[g * table_stride + 2];
        rmax = rank[g] > rmax ? rank[g] : rmax;
        nwide[g] = rank[g] ? N : 0;
    }
    if (!rmax) {   /* no adapter of the step patches this linear */
        free(rank);
        return 0;
    }
    float *h = malloc(sizeof(float) * (size_t)(rows * (rmax + N)));
    if (!h) {
        free(rank);
        return -1;
    }
    float *delta = h + rows * rmax;    /* [rows, N]: each row's term, then added into out */
    const int64_t ns = items(rank, G, first_s), ne = items(nwide, G, first_e);
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < ns; it++) {   /* shrink: h[m, c..] = x[perm[m]] A^T[:, c..] */
            int64_t g = 0;
            while (first_s[g + 1] <= it) g++;
            const int64_t c0 = (it - first_s[g]) * CW, R = rank[g];
            const int64_t cw = R - c0 < CW ? R - c0 : CW;
            const void *at = (const void *)(intptr_t)table[g * table_stride];
            for (int64_t m = bounds[g]; m < bounds[g + 1]; m += MR) {
                const int mr = (int)(bounds[g + 1] - m < MR ? bounds[g + 1] - m : MR);
                block(x, x_bf16, perm + m, x_stride, mr, at, w_bf16, c0 * K, K, h + m * rmax + c0, rmax, cw);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < ne; it++) {   /* expand: delta[m, c..] = h[m] (sB)^T[:, c..] */
            int64_t g = 0;
            while (first_e[g + 1] <= it) g++;
            const int64_t c0 = (it - first_e[g]) * CW, R = rank[g];
            const int64_t cw = N - c0 < CW ? N - c0 : CW;
            const void *bt = (const void *)(intptr_t)table[g * table_stride + 1];
            int64_t local[MR];
            for (int64_t m = bounds[g]; m < bounds[g + 1]; m += MR) {
                const int mr = (int)(bounds[g + 1] - m < MR ? bounds[g + 1] - m : MR);
                for (int i = 0; i < mr; i++) local[i] = m + i;
                block(h, 0, local, rmax, mr, bt, w_bf16, c0 * R, R, delta + m * N + c0, N, cw);
                for (int i = 0; i < mr; i++) {   /* out[perm[m]] += delta, rounded once */
                    const float *d = delta + (m + i) * N + c0;
                    const int64_t o = perm[m + i] * out_stride + c0;
                    if (out_bf16) {
                        uint16_t *po = (uint16_t *)out + o;
                        for (int64_t c = 0; c < cw; c++) po[c] = f32_bf16(bf16f(po[c]) + d[c]);
                    } else {
                        float *po = (float *)out + o;
                        for (int64_t c = 0; c < cw; c++) po[c] += d[c];
                    }
                }
            }
        }
    }
    free(h);
    free(rank);
    return 0;
}

int cpu_lora_vector_width(void) { return VL; }

int cpu_lora_panel(void) { return CW; }
