/* Gemma 3's decoder stack of a decode step in one call (issue 55; gpu/kernels/cpu/layer_gemma.py):
 * layer.c's stack (included below, its GEMV/GEMM tiles, norms, q/k norm + RoPE + the KV write,
 * its arena discipline) with Gemma's layer around them:
 *   h = norm(x) * ln1;  a = o(attn(qkv(h)));  r += norm(a) * post_attn;  h = norm(r) * pre_ff;
 *   m = down(gelu_tanh(gate(h)) * up(h));  x = norm(m) * post_ff  (added into r by the next layer)
 * - the norms' weights hold (1 + w) already (the loader adds 1, as transformers' Gemma3RMSNorm);
 * - GeGLU with GELU's tanh approximation, tanh from exp_neg (vectorisable; torch's within ~1 ulp);
 * - QK-norm, a RoPE table per layer (sliding layers: rope_local_base_freq's; global: rope_theta's),
 *   attention scaled by query_pre_attn_scalar ** -0.5;
 * - sliding layers see the last `window` keys only, and may live in the hybrid cache's sliding
 *   pool (their own block count, block tables and slots: KVCache.sliding_view's, per step).
 * The √hidden embedding scale is the caller's (layer_gemma.py, in the table's dtype as torch does).
 * Built like layer.c (cc -O3 -march=native: the ISA is this machine's, AVX-512, AVX2+FMA or scalar
 * through quant.c's tiles; everything here is plain C the compiler vectorises). Separate entry
 * point and structs: layer.c's Llama/Qwen stack is untouched.
 */
#include "layer.c"

typedef struct {
    Lin qkv, o, gate_up, down;
    const float *ln1, *post_attn, *pre_ff, *post_ff, *q_norm, *k_norm;  /* [D] x 4, [Dh] x 2 */
    float *k_cache, *v_cache;  /* [num_blocks, bs, Hkv, Dh] */
    const float *cos_sin;      /* [P, Dh] this layer's table */
    int64_t window;            /* keys a query sees (itself included); 0: all */
    int64_t pool;              /* 0: the step's tables/slots, 1: the sliding pool's */
    int64_t num_blocks;        /* its cache's blocks */
} GLayer;

typedef struct {
    int64_t n_layers, D, Hq, Hkv, Dh, I, bs, P;
    float eps, scale;          /* scale: query_pre_attn_scalar ** -0.5 */
    const float *final_norm;
    const GLayer *layers;
} GModel;

typedef struct {
    int64_t M;
    const float *x;            /* [M, D] the scaled token embeddings */
    float *hidden;             /* [M, D] out: the final norm's output */
    const int64_t *positions;  /* [M] */
    const int64_t *slots[2];   /* [M] per pool (the step's, the sliding pool's or NULL) */
    const int32_t *tables[2];  /* [M, table_stride] per pool */
    int64_t table_stride;
    const int32_t *seq_lens;   /* [M] */
    int64_t chunked;
} GStep;

static float *garena;
static size_t garena_floats;

/* gelu_tanh(g) * u: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u, tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) */
static inline float gelu_tanh_mul(float g, float u) {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_neg(-2.f * __builtin_fabsf(y));
    const float t = (1.f - e) / (1.f + e);
    return 0.5f * g * (1.f + __builtin_copysignf(t, y)) * u;
}

/* row m's KV head kh over the keys [t0, len) of its sequence (the window's), scores scaled by scale */
static void gemma_attend(const GModel *md, const GLayer *L, const int32_t *table, int64_t len, int64_t t0, int64_t m,
                         int64_t kh, const float *q, float *out, float *scores) {
    const int64_t Dh = md->Dh, Hkv = md->Hkv, G = md->Hq / Hkv, bs = md->bs, n = len - t0;
    const float *qh = q + (m * md->Hq + kh * G) * Dh;
    float mx[64];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t t = t0; t < len; t++) {
        const float *k = cache_row(L->k_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len) prefetch_row(cache_row(L->k_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * Dh;
            float sc = 0.f;
#pragma omp simd reduction(+ : sc)
            for (int64_t d = 0; d < Dh; d++) sc += qg[d] * k[d];
            sc *= md->scale;
            scores[g * n + t - t0] = sc;
            mx[g] = sc > mx[g] ? sc : mx[g];
        }
    }
    softmax_rows(scores, n, G, mx);
    float *o = out + (m * md->Hq + kh * G) * Dh;
    memset(o, 0, sizeof(float) * (size_t)(G * Dh));
    for (int64_t t = t0; t < len; t++) {
        const float *v = cache_row(L->v_cache, table, t, bs, Hkv, kh, Dh);
        if (t + KV_AHEAD < len) prefetch_row(cache_row(L->v_cache, table, t + KV_AHEAD, bs, Hkv, kh, Dh), Dh);
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * n + t - t0];
            float *og = o + g * Dh;
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) og[d] += p * v[d];
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < Dh; d++) o[g * Dh + d] *= mx[g];
}

/* layer.c's Model/Layer/Step views of one Gemma layer, for qkv_item (q/k norm, RoPE, the KV write) */
static inline void views(const GModel *md, const GLayer *L, const GStep *st, Model *vm, Layer *vl, Step *vs) {
    memset(vm, 0, sizeof *vm);
    memset(vl, 0, sizeof *vl);
    memset(vs, 0, sizeof *vs);
    vm->D = md->D, vm->Hq = md->Hq, vm->Hkv = md->Hkv, vm->Dh = md->Dh, vm->bs = md->bs;
    vm->num_blocks = L->num_blocks, vm->P = md->P, vm->eps = md->eps, vm->scale = md->scale;
    vm->cos_sin = L->cos_sin;
    vl->q_norm = L->q_norm, vl->k_norm = L->k_norm, vl->k_cache = L->k_cache, vl->v_cache = L->v_cache;
    vs->M = st->M, vs->positions = st->positions, vs->slots = st->slots[L->pool];
}

/* each thread: h = norm(add) * w into its own h; residual (+)= h; h = norm(residual) * w2. The
 * sandwich's "norm the sublayer's output, add it, norm the sum" (add: the shared [M, D] output). */
static void sandwich(float *residual, const float *add, const float *w, const float *w2, int64_t M, int64_t D,
                     float eps, float *h) {
    for (int64_t m = 0; m < M; m++) norm_row(add + m * D, w, D, eps, h + m * D);
    add_norm(residual, h, 0, w2, M, D, eps, h);
}

/* gate_up's [M, 2I] -> act [M, I] = gelu_tanh(gate) * up, this thread's share of each row's columns */
static void geglu(const float *gu, int64_t M, int64_t I, float *act, int tid, int nt) {
    const int64_t per = (I + nt - 1) / nt, j0 = tid * per, j1 = j0 + per < I ? j0 + per : I;
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *a = act + m * I;
#pragma omp simd
        for (int64_t j = j0; j < j1; j++) a[j] = gelu_tanh_mul(g[j], u[j]);
    }
}

int cpu_gemma_vector_width(void) { return VL; }

/* 0, or -1 (nothing written) for arguments it does not take; the caller's torch path then runs */
int cpu_gemma_decode(const GModel *md, const GStep *st) {
    const int64_t M = st->M, D = md->D, Hq = md->Hq, Hkv = md->Hkv, Dh = md->Dh, I = md->I, bs = md->bs;
    if (M < 1 || Dh > MAX_HEAD_DIM || Dh % 2 || Hkv < 1 || Hq % Hkv || Hq / Hkv > 64 || bs < 1 || md->n_layers < 1)
        return -1;
    int uses[2] = {0, 0};
    int64_t pool_blocks[2] = {-1, -1};
    for (int64_t i = 0; i < md->n_layers; i++) {
        const GLayer *L = md->layers + i;
        if (L->pool < 0 || L->pool > 1 || !st->slots[L->pool] || !st->tables[L->pool] || L->num_blocks < 1
            || L->window < 0 || !L->cos_sin)
            return -1;
        if (pool_blocks[L->pool] < 0 || L->num_blocks < pool_blocks[L->pool]) pool_blocks[L->pool] = L->num_blocks;
        uses[L->pool] = 1;
    }
    int64_t max_len = 0, kmax = 0;
    for (int64_t m = 0; m < M; m++) {
        const int64_t len = st->seq_lens[m], nblk = (len + bs - 1) / bs;
        if (len < 1 || nblk > st->table_stride || st->positions[m] < 0 || st->positions[m] >= md->P) return -1;
        for (int p = 0; p < 2; p++) {
            if (!uses[p]) continue;
            if (st->slots[p][m] < 0 || st->slots[p][m] >= pool_blocks[p] * bs) return -1;
            for (int64_t j = 0; j < nblk; j++) {
                const int32_t b = st->tables[p][m * st->table_stride + j];
                if (b < 0 || b >= pool_blocks[p]) return -1;
            }
        }
        max_len = len > max_len ? len : max_len;
    }
    for (int64_t i = 0; i < md->n_layers; i++) {
        const GLayer *L = md->layers + i;
        const Lin *ls[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        const int64_t k_want[4] = {D, Hq * Dh, D, I}, n_want[4] = {(Hq + 2 * Hkv) * Dh, D, 2 * I, D};
        for (int j = 0; j < 4; j++) {
            if (!lin_ok(ls[j]) || ls[j]->K != k_want[j] || ls[j]->N != n_want[j]) return -1;
            kmax = ls[j]->K > kmax ? ls[j]->K : kmax;
        }
        if (!L->ln1 || !L->post_attn || !L->pre_ff || !L->post_ff) return -1;
    }
    const int nt = omp_get_max_threads();
    const int64_t G = Hq / Hkv, nqkv = (Hq + 2 * Hkv) * Dh;
    const int64_t nbuf = 2 * NR * kmax > GEMM_BUF_FLOATS ? 2 * NR * kmax : GEMM_BUF_FLOATS;
    (void)i16v_max(Q4_0);   /* read the environment once, before the threads do */
    const int64_t xqv_floats = use_i16v_any(M) ? (int64_t)(gemm16_bytes(M, kmax) + sizeof(float) - 1) / 4 + 16 : 0;
    /* per thread: the dequantized rows (or GEMM stage), scores, its residual and h, x quantized */
    const int64_t per_thread = nbuf + G * max_len + 2 * M * D + xqv_floats + 16;
    const size_t xq_floats = GEMM16 ? (gemm16_bytes(M, kmax) + sizeof(float) - 1) / sizeof(float) + 16 : 0;
    /* shared: the sublayers' outputs, qkv, q, the attention's output, gate|up, the activation */
    const size_t need = (size_t)(M * (D + nqkv + 2 * Hq * Dh + 3 * I) + nt * per_thread + 64) + xq_floats;
    if (need > garena_floats) {
        float *a = realloc(garena, need * sizeof(float));
        if (!a) return -1;
        garena = a;
        garena_floats = need;
    }
    float *xb = garena, *qkv = xb + M * D, *q = qkv + M * nqkv, *att = q + M * Hq * Dh, *gu = att + M * Hq * Dh;
    float *act = gu + 2 * M * I, *thread_base = act + M * I;
    void *xqm = (void *)(((uintptr_t)(thread_base + nt * per_thread) + 63) & ~(uintptr_t)63);
    (void)use_fused(Q4_0, 1);   /* read the environment once, before the threads do */
    (void)use_gemm(Q4_0, 1);
    (void)use_int16(Q4_0);
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        float *buf = thread_base + tid * per_thread, *scores = buf + nbuf;
        float *residual = scores + G * max_len, *h = residual + M * D, *xqv_at = h + M * D;
        void *xqv = xqv_floats ? (void *)(((uintptr_t)xqv_at + 63) & ~(uintptr_t)63) : NULL;
        for (int64_t i = 0; i < md->n_layers; i++) {
            const GLayer *L = md->layers + i;
            if (i == 0) add_norm(residual, st->x, 1, L->ln1, M, D, md->eps, h);
            else sandwich(residual, xb, md->layers[i - 1].post_ff, L->ln1, M, D, md->eps, h);
            lin_apply(&L->qkv, h, M, qkv, buf, xqm, xqv);
            Model vm;
            Layer vl;
            Step vs;
            views(md, L, st, &vm, &vl, &vs);
            const int32_t *tables = st->tables[L->pool];
            if (st->chunked) {
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hkv; it++) qkv_item(&vm, &vl, &vs, it / Hkv, it % Hkv, qkv, q);
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < M * Hkv; it++) {
                const int64_t m = it / Hkv, len = st->seq_lens[m];
                const int64_t t0 = L->window && len > L->window ? len - L->window : 0;
                if (!st->chunked) qkv_item(&vm, &vl, &vs, m, it % Hkv, qkv, q);
                gemma_attend(md, L, tables + m * st->table_stride, len, t0, m, it % Hkv, q, att, scores);
            }
            lin_apply(&L->o, att, M, xb, buf, xqm, xqv);
            sandwich(residual, xb, L->post_attn, L->pre_ff, M, D, md->eps, h);
            lin_apply(&L->gate_up, h, M, gu, buf, xqm, xqv);
            geglu(gu, M, I, act, tid, nt);
#pragma omp barrier
            lin_apply(&L->down, act, M, xb, buf, xqm, xqv);
        }
        if (tid == 0) sandwich(residual, xb, md->layers[md->n_layers - 1].post_ff, md->final_norm, M, D, md->eps,
                               st->hidden);
    }
    return 0;
}
