/* Q5_1, Q2_K and Q3_K for gpu/kernels/cpu/quant.c (issue 55), #included by it: the formats a
 * Q5_K_M file holds where a row is not a multiple of 256 (Q5_1, llama.cpp's fallback for Q5_K), and
 * the low-bit K-quants of Q2_K/Q3_K files. None is an exact repack into a format the tiles already
 * take (Q5_1 is 5-bit codes plus a min, not Q8_0's symmetric int8; Q3_K's products (sc - 32) q
 * reach 128; Q2_K has a min per 16), so they are kept as stored:
 * - dequant_lowbit: one row's blocks -> fp32, exactly gguf-py's dequantize_blocks (the same fp32
 *   products and sums, -ffp-contract=off), for the buffered and GEMM tiles and the loader;
 * - with AVX2, the same values vectorized (dequant_lowbit_avx2), and a 32-element piece of a
 *   block -> its integers as int16 vectors (q5_1_codes, q2_k_piece, q3_k_piece) for the int16
 *   GEMV tiles (gpu/kernels/cpu/quant.c i16tile).
 *
 * Layouts (ggml's block_q5_1, block_q2_K, block_q3_K):
 *   Q5_1 (32 elements, 24 bytes): fp16 d, fp16 m, 32 high bits (element j: bit j), 16 bytes of low
 *     nibbles (element j < 16: low nibble of byte j, j + 16: its high nibble); x = d q + m.
 *   Q2_K (256, 84): 16 bytes of 4-bit scale | 4-bit min << 4 (one a 16 elements), 64 bytes of 2-bit
 *     codes (element 128 h + 32 s + j: bits 2s of byte 32 h + j), fp16 d, fp16 dmin;
 *     x = (d sc) q - (dmin mn).
 *   Q3_K (256, 110): 32 bytes of high bits (element e: bit e / 32 of byte e % 32; a clear bit
 *     subtracts 4), 64 bytes of 2-bit codes as Q2_K's, 12 bytes of 6-bit scales (the low nibbles
 *     in bytes 0..7, scale i >= 8 in the high nibble of byte i - 8; the top 2 bits of scale i are
 *     bits 2 (i / 4) of byte 8 + i % 4), fp16 d; x = (d (sc - 32)) q, q in -4..3.
 */

/* the 16 signed scales (sc - 32) of a Q3_K super-block */
static inline void scales_q3k(const uint8_t *s, int8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
        const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (int8_t)((lo | hi << 4) - 32);
    }
}

#if defined(__AVX2__)
/* 32 bytes: 0xff where bit i of bits is set (byte i), else 0 */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);   /* byte i: byte i / 8 of bits */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);   /* byte i: 1 << i % 8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* Q5_1 block -> its 32 codes (0..31) as int16: elements 0..15 in *w0, 16..31 in *w1 */
static inline void q5_1_codes(const uint8_t *blk, __m256i *w0, __m256i *w1) {
    uint32_t qh;
    memcpy(&qh, blk + 4, 4);
    const __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 8)), m4 = _mm_set1_epi8(15);
    *w0 = _mm256_cvtepu8_epi16(_mm_or_si128(_mm_and_si128(raw, m4), _mm256_castsi256_si128(hb)));
    *w1 = _mm256_cvtepu8_epi16(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), m4),
                                            _mm256_extracti128_si256(hb, 1)));
}

/* x-block t (elements 32 t .. 32 t + 31) of a Q2_K / Q3_K super-block: its 2-bit codes (0..3) as
 * 32 bytes (Q3_K: minus 4 where the high bit is clear, as int8) */
static inline __m256i k2_codes(const uint8_t *qs, int t) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (t / 4)));
    const int s = 2 * (t % 4);
    const __m256i v = s == 0 ? raw : s == 2 ? _mm256_srli_epi16(raw, 2) : s == 4 ? _mm256_srli_epi16(raw, 4)
                                                                                  : _mm256_srli_epi16(raw, 6);
    return _mm256_and_si256(v, _mm256_set1_epi8(3));
}

/* x-block t of a Q2_K super-block: w0, w1 = the codes times their 4-bit scales (0..45, int16);
 * m0, m1 = the two sub-blocks' 4-bit mins broadcast (int16) */
static inline void q2_k_piece(const uint8_t *blk, int t, __m256i *w0, __m256i *w1, __m256i *m0, __m256i *m1) {
    const __m256i q = k2_codes(blk + 16, t);
    const uint8_t s0 = blk[2 * t], s1 = blk[2 * t + 1];
    *w0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(s0 & 15));
    *w1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(s1 & 15));
    *m0 = _mm256_set1_epi16(s0 >> 4);
    *m1 = _mm256_set1_epi16(s1 >> 4);
}

/* x-block t of a Q3_K super-block (its signed scales sc): the codes times (sc - 32), int16 (|.| <= 128) */
static inline void q3_k_piece(const uint8_t *blk, const int8_t *sc, int t, __m256i *w0, __m256i *w1) {
    const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
    const __m256i bit = _mm256_set1_epi8((char)(1 << t));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
    /* codes - 4 where the bit is clear: andnot(set, 4) subtracted */
    const __m256i q = _mm256_sub_epi8(k2_codes(blk + 32, t), _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
    *w0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(sc[2 * t]));
    *w1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(sc[2 * t + 1]));
}
/* The same values with AVX2: the integers unpacked as the int16 tiles unpack them, converted to
 * fp32 and scaled with gguf-py's operations in its order (no FMA), so bit for bit the scalar
 * code's. */
static int dequant_lowbit_avx2(int fmt, const uint8_t *restrict b, int64_t nb, float *restrict out) {
    __m256i w0, w1, m0, m1;
    switch (fmt) {
    case Q5_1:
        for (int64_t i = 0; i < nb; i++, b += 24, out += 32) {
            const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
            q5_1_codes(b, &w0, &w1);
            const __m256i parts[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w0)),
                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w0, 1)),
                                      _mm256_cvtepi16_epi32(_mm256_castsi256_si128(w1)),
                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w1, 1))};
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(parts[p])), m));
        }
        return 1;
    case Q2_K:
    case Q3_K:
        for (int64_t i = 0; i < nb; i++, out += 256) {
            const float d = f16(b + (fmt == Q2_K ? 80 : 108)), dmin = fmt == Q2_K ? f16(b + 82) : 0.f;
            int8_t sc3[16];
            if (fmt == Q3_K) scales_q3k(b + 96, sc3);
            for (int t = 0; t < 8; t++) {
                __m256i q;   /* the codes as int8: Q2_K 0..3, Q3_K -4..3 */
                if (fmt == Q2_K) {
                    q = k2_codes(b + 16, t);
                } else {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << t));
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), bit), bit);
                    q = _mm256_sub_epi8(k2_codes(b + 32, t), _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
                }
                for (int h = 0; h < 2; h++) {   /* sub-block 2t + h: 16 elements */
                    const int sub = 2 * t + h;
                    const __m128i q16 = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
                    const float dl = fmt == Q2_K ? d * (float)(b[sub] & 15) : d * (float)sc3[sub];
                    const __m256 dlv = _mm256_set1_ps(dl);
                    const __m256 lo = _mm256_mul_ps(dlv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q16)));
                    const __m256 hi = _mm256_mul_ps(dlv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q16, 8))));
                    float *o = out + 32 * t + 16 * h;
                    if (fmt == Q2_K) {
                        const __m256 ml = _mm256_set1_ps(dmin * (float)(b[sub] >> 4));
                        _mm256_storeu_ps(o, _mm256_sub_ps(lo, ml));
                        _mm256_storeu_ps(o + 8, _mm256_sub_ps(hi, ml));
                    } else {
                        _mm256_storeu_ps(o, lo);
                        _mm256_storeu_ps(o + 8, hi);
                    }
                }
            }
            b += fmt == Q2_K ? 84 : 110;
        }
        return 1;
    }
    (void)w0; (void)w1; (void)m0; (void)m1;
    return 0;
}
#endif

/* One row's nb blocks of fmt -> fp32 (gguf-py's values); 0 for a format not of this file. */
static int dequant_lowbit(int fmt, const uint8_t *restrict b, int64_t nb, float *restrict out) {
#if defined(__AVX2__)
    if (dequant_lowbit_avx2(fmt, b, nb, out)) return 1;
#endif
    switch (fmt) {
    case Q5_1:
        for (int64_t i = 0; i < nb; i++, b += 24, out += 32) {
            const float d = f16(b), m = f16(b + 2);
            uint32_t qh;
            memcpy(&qh, b + 4, 4);
            const uint8_t *q = b + 8;
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)((q[j] & 15) | ((qh >> j) & 1) << 4) + m;
                out[j + 16] = d * (float)((q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
            }
        }
        return 1;
    case Q2_K:
        for (int64_t i = 0; i < nb; i++, b += 84, out += 256) {
            const float d = f16(b + 80), dmin = f16(b + 82);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, s = (e / 32) % 4, j = e % 32, sub = e / 16;
                const float dl = d * (float)(b[sub] & 15), ml = dmin * (float)(b[sub] >> 4);
                out[e] = dl * (float)((b[16 + 32 * h + j] >> (2 * s)) & 3) - ml;
            }
        }
        return 1;
    case Q3_K:
        for (int64_t i = 0; i < nb; i++, b += 110, out += 256) {
            const float d = f16(b + 108);
            int8_t sc[16];
            scales_q3k(b + 96, sc);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, s = (e / 32) % 4, j = e % 32;
                const int q = ((b[32 + 32 * h + j] >> (2 * s)) & 3) - (((b[j] >> (e / 32)) & 1) ? 0 : 4);
                out[e] = d * (float)sc[e / 16] * (float)q;
            }
        }
        return 1;
    }
    return 0;
}

