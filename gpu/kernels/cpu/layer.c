/* The whole decoder stack of a decode step in one call (issue 39): for each layer, add +
 * RMSNorm, the packed QKV GEMV, q/k norm, RoPE and the KV-cache write, decode attention over the
 * paged cache, o_proj, add + RMSNorm, gate_up GEMV, silu * up, down GEMV; then the final norm.
 * Built and loaded by gpu/kernels/cpu/layer.py the way gpu/kernels/cpu/ops.c is (cc -O3 -march=native
 * -fopenmp, cached per source, compiler and CPU flags), so the vector ISA is the machine's own:
 * the GEMV tiles are gpu/kernels/cpu/quant.c's (included below: AVX-512, AVX2+FMA or scalar, chosen by
 * the compiler's target macros); everything else is plain C the compiler vectorises.
 *
 * One OpenMP region for all layers, the phases separated by its barriers: the torch path's
 * hundreds of small ops and their Python frames per layer become a few microseconds of barriers.
 * All scratch memory is one arena kept between calls (grown when a step needs more): no
 * allocation per step. fp32 throughout (the packed path's activations, residual and KV cache).
 */
#include "quant.c"
#include <math.h>
#include <omp.h>

#define MAX_SEG 3
#define MAX_HEAD_DIM 512

typedef struct {          /* a PackedLinear: segments stacked along the output rows */
    int64_t nseg, K, N;
    int64_t fmt[MAX_SEG], rows[MAX_SEG], row_bytes[MAX_SEG];
    const uint8_t *w[MAX_SEG];
    const float *bias;    /* [N] or NULL */
} Lin;

typedef struct {
    Lin qkv, o, gate_up, down;
    const float *ln1, *ln2, *q_norm, *k_norm;   /* [D], [D], [Dh] or NULL, [Dh] or NULL */
    float *k_cache, *v_cache;                   /* [num_blocks, bs, Hkv, Dh] */
} Layer;

typedef struct {
    int64_t n_layers, D, Hq, Hkv, Dh, I, bs, num_blocks, P;
    float eps, scale;
    const float *cos_sin;     /* [P, Dh]: cos in the first half, sin in the second */
    const float *final_norm;  /* [D] */
    const Layer *layers;
} Model;

typedef struct {
    int64_t M;                /* rows: a decode token each (a sequence's, or a verify's row) */
    const float *x;           /* [M, D] the token embeddings */
    float *hidden;            /* [M, D] out: the final norm's output */
    const int64_t *positions; /* [M] */
    const int64_t *slots;     /* [M] the cache slot of each row's new k/v */
    const int32_t *tables;    /* [M, table_stride] block ids */
    int64_t table_stride;
    const int32_t *seq_lens;  /* [M] context incl. the new token */
    int64_t chunked;          /* rows of one sequence in a row (a verify's): each sees the ones
                               * before it, so every row's k/v is written before any attends */
} Step;

static float *arena;
static size_t arena_floats;

static int lin_ok(const Lin *l) {
    int64_t n = 0;
    if (l->nseg < 1 || l->nseg > MAX_SEG || l->K > (1 << 16)) return 0;
    for (int64_t s = 0; s < l->nseg; s++) {
        const int f = (int)l->fmt[s];
        if (!block_bytes(f) || l->K % block_elems(f) || l->row_bytes[s] != l->K / block_elems(f) * block_bytes(f))
            return 0;
        n += l->rows[s];
    }
    return n == l->N;
}

/* row r of the stacked weight (its segment's format in *fmt) */
static inline const uint8_t *lin_row(const Lin *l, int64_t r, int *fmt) {
    int64_t s = 0;
    while (r >= l->rows[s]) r -= l->rows[s++];
    *fmt = (int)l->fmt[s];
    return l->w[s] + r * l->row_bytes[s];
}

/* rows [n0, n0 + nr) of W (in registers by the fused tiles, else dequantized into buf), times x [M, K] -> y (row stride ldy), + bias */
static inline void lin_tile(const Lin *l, int64_t n0, int nr, const float *x, int64_t M, float *y, int64_t ldy,
                            float *buf) {
    const int64_t K = l->K;
    const uint8_t *rows[NR];
    int fmts[NR] = {0}, same = 1;
    for (int j = 0; j < nr; j++) {
        rows[j] = lin_row(l, n0 + j, fmts + j);
        same &= fmts[j] == fmts[0];
    }
    if (same && use_fused(fmts[0], M)) {
        ftile_rows(fmts[0], rows, x, K, M, K, nr, y, ldy);
    } else {
        for (int j = 0; j < nr; j++) dequant_row(fmts[j], rows[j], K, buf + j * K);
        for (int64_t m = 0; m < M; m += MR) {
            const int mr = M - m < MR ? (int)(M - m) : MR;
            tile_any(x + m * K, K, mr, buf, K, nr, y + m * ldy, ldy);
        }
    }
    if (l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < nr; j++) y[m * ldy + j] += l->bias[n0 + j];
}

/* rows [n0, n0 + nr) of W, nr <= NP, by the GEMM tiles (gpu/kernels/cpu/quant_gemm.c) -> y, + bias;
 * q: x quantized for the int16 tiles, or NULL */
static void lin_panel(const Lin *l, int64_t n0, int nr, const float *x, int64_t M, float *y, int64_t ldy,
                      float *buf, const gxq *q) {
    const uint8_t *rows[NP];
    int fmts[NP];
    for (int j = 0; j < nr; j++) rows[j] = lin_row(l, n0 + j, fmts + j);
    gemm_panel(rows, fmts, nr, x, l->K, M, l->K, y, ldy, buf, q);
    if (l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < nr; j++) y[m * ldy + j] += l->bias[n0 + j];
}

/* rows [n0, n0 + nr) of W by the int16 GEMV tiles (gpu/cpu_quant.c i16tile; x quantized in q) -> y, + bias */
static void lin_tile16(const Lin *l, int64_t n0, int nr, const gxq *q, int64_t M, float *y, int64_t ldy) {
    const uint8_t *rows[NR];
    int fmts[NR] = {0};
    for (int j = 0; j < nr; j++) rows[j] = lin_row(l, n0 + j, fmts + j);
    i16tile_rows(fmts, rows, q, M, l->K, nr, y, ldy);
    if (l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < nr; j++) y[m * ldy + j] += l->bias[n0 + j];
}

/* x [M, K] quantized for the int16 GEMV tiles into this thread's scratch xqv (gemm16_bytes(M,
 * kmax)): every thread quantizes all the rows itself (a few hundred ns at their few rows), so no
 * barrier; x is each thread's copy (all equal) or the shared one, complete after the last barrier */
static gxq lin_quantize16(const float *x, int64_t M, int64_t K, void *xqv) {
    const gxq q = gemm16_at(xqv, M, K);
    i16v_quantize(x, K, M, K, (int16_t *)q.q, (float *)q.dx, (float *)q.sx);
    return q;
}

/* x [M, l->K] quantized for the int16 tiles into the shared scratch xqm (gemm16_bytes(M, kmax)), a
 * row a thread at a time (x: each thread's copy, all equal, or the shared one), where a segment
 * of l takes them; else NULL. Its omp for's barrier: every row done before any panel reads them,
 * and (the panels' own barrier before it) none still reading the previous linear's. */
static const gxq *lin_quantize(const Lin *l, const float *x, int64_t M, void *xqm, gxq *q) {
    int any = 0;
    for (int64_t s = 0; s < l->nseg; s++) any |= use_int16((int)l->fmt[s]);
    if (!any) return NULL;
    *q = gemm16_at(xqm, M, l->K);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) gemm_quantize(x, l->K, m, m + 1, l->K, (int16_t *)q->q, (float *)q->dx, (float *)q->sx);
    return q;
}

/* y [M, N] = x [M, K] @ W^T (+ bias), both contiguous; inside the parallel region (its barrier
 * at the end). buf: this thread's 2 NR K floats for the dequantized rows (GEMM_BUF_FLOATS for
 * the GEMM tiles); xqm: the shared scratch for x quantized (the int16 tiles). */
static void lin_apply(const Lin *l, const float *x, int64_t M, float *y, float *buf, void *xqm, void *xqv) {
    if (xqv && use_i16v((int)l->fmt[0], M) && !use_gemm((int)l->fmt[0], M)) {   /* the int16 GEMV tiles */
        const gxq q = lin_quantize16(x, M, l->K, xqv);
        const int64_t tiles = (l->N + NR - 1) / NR;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            lin_tile16(l, t * NR, l->N - t * NR < NR ? (int)(l->N - t * NR) : NR, &q, M, y + t * NR, l->N);
        return;
    }
    if (use_gemm((int)l->fmt[0], M)) {   /* by the first segment's format (a merged qkv's q) */
        gxq qs;
        const gxq *q = lin_quantize(l, x, M, xqm, &qs);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < l->N; n0 += NP)
            lin_panel(l, n0, l->N - n0 < NP ? (int)(l->N - n0) : NP, x, M, y + n0, l->N, buf, q);
        return;
    }
    const int64_t tiles = (l->N + NR - 1) / NR;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR;
        lin_tile(l, n0, l->N - n0 < NR ? (int)(l->N - n0) : NR, x, M, y + n0, l->N, buf);
    }
}

static inline float silu_mul(float g, float u);

/* act [M, I] = silu(x W_gate^T) * (x W_up^T), W = [gate; up] stacked ([2I, K]): a tile's gate
 * and up rows together, so that no [M, 2I] product is stored nor waited for. */
static void glu_apply(const Lin *l, const float *x, int64_t M, float *act, float *buf, float *yg, float *yu,
                      void *xqm, void *xqv) {
    const int64_t I = l->N / 2, K = l->K, tiles = (I + NR - 1) / NR;
    if (xqv && use_i16v((int)l->fmt[0], M) && !use_gemm((int)l->fmt[0], M)) {   /* int16 GEMV tiles; yg, yu: [M, NR] */
        const gxq q = lin_quantize16(x, M, K, xqv);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t j0 = t * NR;
            const int nr = I - j0 < NR ? (int)(I - j0) : NR;
            lin_tile16(l, j0, nr, &q, M, yg, NR);
            lin_tile16(l, I + j0, nr, &q, M, yu, NR);
            for (int64_t m = 0; m < M; m++)
                for (int j = 0; j < nr; j++) act[m * I + j0 + j] = silu_mul(yg[m * NR + j], yu[m * NR + j]);
        }
        return;
    }
    if (use_gemm((int)l->fmt[0], M)) {   /* yg, yu: [M, NP] */
        gxq qs;
        const gxq *q = lin_quantize(l, x, M, xqm, &qs);
#pragma omp for schedule(static)
        for (int64_t j0 = 0; j0 < I; j0 += NP) {
            const int nr = I - j0 < NP ? (int)(I - j0) : NP;
            lin_panel(l, j0, nr, x, M, yg, NP, buf, q);
            lin_panel(l, I + j0, nr, x, M, yu, NP, buf, q);
            for (int64_t m = 0; m < M; m++)
                for (int j = 0; j < nr; j++) act[m * I + j0 + j] = silu_mul(yg[m * NP + j], yu[m * NP + j]);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j0 = t * NR;
        const int nr = I - j0 < NR ? (int)(I - j0) : NR;
        lin_tile(l, j0, nr, x, M, yg, NR, buf);
        lin_tile(l, I + j0, nr, x, M, yu, NR, buf + NR * K);
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < nr; j++) act[m * I + j0 + j] = silu_mul(yg[m * NR + j], yu[m * NR + j]);
    }
}

/* out = rms_norm(v) * w over n values (gpu/kernels/cpu/ops.c add_rms_norm's arithmetic) */
static inline void norm_row(const float *v, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < n; d++) ss += v[d] * v[d];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t d = 0; d < n; d++) out[d] = (v[d] * inv) * w[d];
}

/* rows [0, M): residual (+)= add; h = rms_norm(residual) * w. Every thread computes all rows
 * into its own residual and h (a few microseconds): no barrier before the next GEMV reads h. */
static void add_norm(float *residual, const float *add, int first, const float *w, int64_t M, int64_t D,
                     float eps, float *h) {
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * D;
        if (first) memcpy(r, add + m * D, sizeof(float) * (size_t)D);
        else
            for (int64_t d = 0; d < D; d++) r[d] += add[m * D + d];
        norm_row(r, w, D, eps, h + m * D);
    }
}

/* exp(x) for x <= 0 in a vectorisable form: 2^n p(r), r = x - n ln 2 (a degree-6 polynomial,
 * about 1 ulp); x below -87 gives exp(-87). */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

/* row m's query heads of KV head kh (normed, rotated; into q) and its k (normed, rotated) and
 * v written to the row's slot */
static void qkv_item(const Model *md, const Layer *L, const Step *st, int64_t m, int64_t kh, const float *qkv,
                     float *q) {
    const int64_t Dh = md->Dh, half = Dh / 2, Hq = md->Hq, Hkv = md->Hkv, G = Hq / Hkv;
    const float *row = qkv + m * (Hq + 2 * Hkv) * Dh;
    const float *c = md->cos_sin + st->positions[m] * Dh, *s = c + half;
    float tmp[MAX_HEAD_DIM];
    const int64_t slot = st->slots[m];
    for (int64_t i = 0; i <= G; i++) {   /* G query heads, then the k head */
        const int64_t h = i < G ? kh * G + i : Hq + kh;
        const float *x = row + h * Dh;
        const float *nw = i < G ? L->q_norm : L->k_norm;
        if (nw) {
            norm_row(x, nw, Dh, md->eps, tmp);
            x = tmp;
        }
        float *y = i < G ? q + (m * Hq + h) * Dh : L->k_cache + (slot * Hkv + kh) * Dh;
        for (int64_t j = 0; j < half; j++) {
            y[j] = x[j] * c[j] - x[j + half] * s[j];
            y[j + half] = x[j + half] * c[j] + x[j] * s[j];
        }
    }
    memcpy(L->v_cache + (slot * Hkv + kh) * Dh, row + (Hq + Hkv + kh) * Dh, sizeof(float) * (size_t)Dh);
}

#ifndef KV_AHEAD
#define KV_AHEAD 4   /* tokens */
#endif
/* token t's row of KV head kh in a paged cache [num_blocks, bs, Hkv, Dh] */
static inline const float *cache_row(const float *cache, const int32_t *table, int64_t t, int64_t bs, int64_t Hkv,
                                     int64_t kh, int64_t Dh) {
    return cache + (((int64_t)table[t / bs] * bs + t % bs) * Hkv + kh) * Dh;
}

static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* scores [G, len] -> exp(s - max) in place; mx [G]: each row's max in, 1 / its sum out */
static inline void softmax_rows(float *scores, int64_t len, int64_t G, float *mx) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * len, sum = 0.f;
        const float mg = mx[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_neg(sg[t] - mg);
            sum += sg[t];
        }
        mx[g] = 1.f / sum;
    }
}

/* one row's KV head kh: its G query heads over the sequence's cached tokens -> out */
static void attend(const Model *md, const Layer *L, const Step *st, int64_t m, int64_t kh, const float *q,
                   float *out, float *scores) {
    const int64_t Dh = md->Dh, Hkv = md->Hkv, G = md->Hq / Hkv, bs = md->bs, len = st->seq_lens[m];
    const int32_t *table = st->tables + m * st->table_stride;
    const float *qh = q + (m * md->Hq + kh * G) * Dh;
    float mx[64];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        const float *k = cache_row(L->k_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len)   /* the cache is read in Dh-float pieces, block by block: ahead of the prefetchers */
            prefetch_row(cache_row(L->k_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * Dh;
            float sc = 0.f;
#pragma omp simd reduction(+ : sc)
            for (int64_t d = 0; d < Dh; d++) sc += qg[d] * k[d];
            sc *= md->scale;
            scores[g * len + t] = sc;
            mx[g] = sc > mx[g] ? sc : mx[g];
        }
    }
    softmax_rows(scores, len, G, mx);
    float *o = out + (m * md->Hq + kh * G) * Dh;
    memset(o, 0, sizeof(float) * (size_t)(G * Dh));
    for (int64_t t = 0; t < len; t++) {
        const float *v = cache_row(L->v_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len)
            prefetch_row(cache_row(L->v_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * len + t];
            float *og = o + g * Dh;
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) og[d] += p * v[d];
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < Dh; d++) o[g * Dh + d] *= mx[g];
}

#if defined(__AVX512F__)
/* attend() with each token's K and V rows in registers and the G query heads' outputs kept in
 * registers over the sequence (G x Dh/16 vectors): no output row loaded and stored per token.
 * The same products and sums per element as attend() (mul, then add; -ffp-contract=off), the
 * QK dot products summed lane-wise then reduced as the compiler's simd reduction does. G and
 * NV = Dh / 16 are constants of each instantiation (attend_any's switch). */
static inline __attribute__((always_inline)) void attend_regs(const Model *md, const Layer *L, const Step *st,
                                                              int64_t m, int64_t kh, const float *q, float *out,
                                                              float *scores, const int G, const int NV) {
    const int64_t Dh = 16 * NV, Hkv = md->Hkv, bs = md->bs, len = st->seq_lens[m];
    const int32_t *table = st->tables + m * st->table_stride;
    const float *qh = q + (m * md->Hq + kh * G) * Dh;
    float mx[8];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        const float *k = cache_row(L->k_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len)
            prefetch_row(cache_row(L->k_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        __m512 kv[NV];
        for (int v = 0; v < NV; v++) kv[v] = _mm512_loadu_ps(k + 16 * v);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh + g * Dh), kv[0]);
            for (int v = 1; v < NV; v++) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(qh + g * Dh + 16 * v), kv[v]));
            const float sc = _mm512_reduce_add_ps(a) * md->scale;
            scores[g * len + t] = sc;
            mx[g] = sc > mx[g] ? sc : mx[g];
        }
    }
    softmax_rows(scores, len, G, mx);
    __m512 acc[8 * 8];   /* [G][NV], G * NV <= 24 used */
    for (int i = 0; i < G * NV; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const float *v = cache_row(L->v_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len)
            prefetch_row(cache_row(L->v_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        for (int j = 0; j < NV; j++) {
            const __m512 vv = _mm512_loadu_ps(v + 16 * j);
            for (int g = 0; g < G; g++)
                acc[g * NV + j] = _mm512_add_ps(acc[g * NV + j], _mm512_mul_ps(_mm512_set1_ps(scores[g * len + t]), vv));
        }
    }
    float *o = out + (m * md->Hq + kh * G) * Dh;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++)
            _mm512_storeu_ps(o + g * Dh + 16 * j, _mm512_mul_ps(acc[g * NV + j], _mm512_set1_ps(mx[g])));
}
#define ATTEND_CASE(GQ, NVV) \
    if (G == GQ && NV == NVV) { attend_regs(md, L, st, m, kh, q, out, scores, GQ, NVV); return; }
#endif

/* attend_regs where an instantiation fits (AVX-512; the common head shapes), else attend() */
static void attend_any(const Model *md, const Layer *L, const Step *st, int64_t m, int64_t kh, const float *q,
                       float *out, float *scores) {
#if defined(__AVX512F__)
    const int64_t G = md->Hq / md->Hkv, NV = md->Dh % 16 ? 0 : md->Dh / 16;
    ATTEND_CASE(1, 4) ATTEND_CASE(2, 4) ATTEND_CASE(3, 4) ATTEND_CASE(4, 4) ATTEND_CASE(5, 4) ATTEND_CASE(6, 4)
    ATTEND_CASE(1, 8) ATTEND_CASE(2, 8) ATTEND_CASE(3, 8)
#endif
    attend(md, L, st, m, kh, q, out, scores);
}

static inline float silu_mul(float g, float u) {
    const float e = exp_neg(g >= 0.f ? -g : g);          /* exp(-|g|) */
    const float sig = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return g * sig * u;
}

int cpu_layer_vector_width(void) { return VL; }

/* Returns 0, or -1 (nothing written) for arguments it does not take: a position, slot or block
 * id out of range, a shape beyond its limits, or no memory. The caller's torch path then runs. */
int cpu_layers_decode(const Model *md, const Step *st) {
    const int64_t M = st->M, D = md->D, Hq = md->Hq, Hkv = md->Hkv, Dh = md->Dh, I = md->I, bs = md->bs;
    if (M < 1 || Dh > MAX_HEAD_DIM || Dh % 2 || Hkv < 1 || Hq % Hkv || Hq / Hkv > 64 || bs < 1) return -1;
    int64_t max_len = 0, kmax = 0;
    for (int64_t m = 0; m < M; m++) {
        const int64_t len = st->seq_lens[m], nblk = (len + bs - 1) / bs;
        if (len < 1 || nblk > st->table_stride || st->positions[m] < 0 || st->positions[m] >= md->P
            || st->slots[m] < 0 || st->slots[m] >= md->num_blocks * bs)
            return -1;
        for (int64_t j = 0; j < nblk; j++)
            if (st->tables[m * st->table_stride + j] < 0 || st->tables[m * st->table_stride + j] >= md->num_blocks)
                return -1;
        max_len = len > max_len ? len : max_len;
    }
    for (int64_t i = 0; i < md->n_layers; i++) {
        const Layer *L = md->layers + i;
        const Lin *ls[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        const int64_t k_want[4] = {D, Hq * Dh, D, I}, n_want[4] = {(Hq + 2 * Hkv) * Dh, D, 2 * I, D};
        for (int j = 0; j < 4; j++) {
            if (!lin_ok(ls[j]) || ls[j]->K != k_want[j] || ls[j]->N != n_want[j]) return -1;
            kmax = ls[j]->K > kmax ? ls[j]->K : kmax;
        }
    }
    const int nt = omp_get_max_threads();
    const int64_t G = Hq / Hkv, nqkv = (Hq + 2 * Hkv) * Dh;
    /* per thread: 2 NR kmax dequantized rows (or the GEMM tiles' stage and panel), scores, its
     * residual and h, two [M, NP] tiles */
    const int64_t nbuf = 2 * NR * kmax > GEMM_BUF_FLOATS ? 2 * NR * kmax : GEMM_BUF_FLOATS;
    /* + x quantized for the int16 GEMV tiles (each thread's own: no barrier), where they serve */
    (void)i16v_max(Q4_0);   /* read the environment once, before the threads do */
    const int64_t xqv_floats = use_i16v_any(M) ? (int64_t)(gemm16_bytes(M, kmax) + sizeof(float) - 1) / 4 + 16 : 0;
    const int64_t per_thread = nbuf + G * max_len + 2 * M * D + 2 * M * (NP > NR ? NP : NR) + xqv_floats + 16;
    /* + x quantized for the int16 tiles (shared: each linear's rows quantized once, by all threads) */
    const size_t xq_floats = GEMM16 ? (gemm16_bytes(M, kmax) + sizeof(float) - 1) / sizeof(float) + 16 : 0;
    const size_t need = (size_t)(M * (D + nqkv + 2 * Hq * Dh + I) + nt * per_thread + 64) + xq_floats;
    if (need > arena_floats) {
        float *a = realloc(arena, need * sizeof(float));
        if (!a) return -1;
        arena = a;
        arena_floats = need;
    }
    float *xb = arena, *qkv = xb + M * D, *q = qkv + M * nqkv, *att = q + M * Hq * Dh, *act = att + M * Hq * Dh;
    float *thread_base = act + M * I;
    void *xqm = (void *)(((uintptr_t)(thread_base + nt * per_thread) + 63) & ~(uintptr_t)63);
    (void)use_fused(Q4_0, 1);   /* read the environment once, before the threads do */
    (void)use_gemm(Q4_0, 1);
    (void)use_int16(Q4_0);
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        float *buf = thread_base + tid * per_thread, *scores = buf + nbuf;
        float *residual = scores + G * max_len, *h = residual + M * D, *yg = h + M * D;
        float *yu = yg + M * (NP > NR ? NP : NR), *xqv_at = yu + M * (NP > NR ? NP : NR);
        void *xqv = xqv_floats ? (void *)(((uintptr_t)xqv_at + 63) & ~(uintptr_t)63) : NULL;
        for (int64_t i = 0; i < md->n_layers; i++) {
            const Layer *L = md->layers + i;
            add_norm(residual, i ? xb : st->x, i == 0, L->ln1, M, D, md->eps, h);
            lin_apply(&L->qkv, h, M, qkv, buf, xqm, xqv);
            if (st->chunked) {
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hkv; it++) qkv_item(md, L, st, it / Hkv, it % Hkv, qkv, q);
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hkv; it++) attend_any(md, L, st, it / Hkv, it % Hkv, q, att, scores);
            } else {
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hkv; it++) {
                    qkv_item(md, L, st, it / Hkv, it % Hkv, qkv, q);
                    attend_any(md, L, st, it / Hkv, it % Hkv, q, att, scores);
                }
            }
            lin_apply(&L->o, att, M, xb, buf, xqm, xqv);
            add_norm(residual, xb, 0, L->ln2, M, D, md->eps, h);
            glu_apply(&L->gate_up, h, M, act, buf, yg, yu, xqm, xqv);
            lin_apply(&L->down, act, M, xb, buf, xqm, xqv);
        }
        if (tid == 0) add_norm(residual, xb, 0, md->final_norm, M, D, md->eps, st->hidden);
    }
    return 0;
}
