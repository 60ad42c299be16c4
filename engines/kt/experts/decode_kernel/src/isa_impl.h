/* The per-ISA half of the decode kernel, included by avx512vnni.c, avx512.c, avx2vnni.c and avx2.c, each
 * compiled with its own target flags (DK_WIDTH: 16 or 8 floats a vector; DK_VNNI: the unit may use VPDPBUSD,
 * AVX512-VNNI or AVX-VNNI). Only intrinsics and libm here (no inline library code that another file could
 * share), and everything static but the ops table, so no instruction of one half leaks into code another
 * half runs.
 *
 * A group is 32 consecutive weights of a row. Two ways to take a dot product with it:
 *
 * - float (FP8 and INT8 everywhere; every format on the AVX-512 half without VNNI): dequantizing a
 *   group gives NV vectors of fp32 weights (FP8: times its block multiplier, rounded once; Q8_0's d x q,
 *   Q4_0's d x (q - 8) and Q6_K's (d x scale) x (q - 32) are exact; Q4_K's (d x sc) x q - dmin x m is rounded
 *   once, at the subtraction, as the gguf package's float32 dequantization rounds it), in the order
 *   `natural_index` gives; a row's dot product keeps one accumulator per vector position, in group order, and
 *   ends in a fixed reduction tree.
 *
 * - integer (MXFP4, INT4, Q8_0, Q4_0, Q4_K and Q6_K on avx512-vnni, avx2-vnni and avx2): each activation row is quantized once per
 *   call to int8 per group, symmetric, q = rint(x * 127 / amax), the group's scale amax / 127 (for the down
 *   projection, the SwiGLU output likewise, one group per gate/up item). A weight nibble becomes an unsigned
 *   byte by a table (MXFP4: 2 x E2M1 + 12, in 0..24, exact; INT4, Q4_0: the stored q + 8 itself), so
 *   u8 x s8 products summed four at a time (VPDPBUSD, or PMADDUBSW + PMADDWD on AVX2) give
 *   sum (w + off) * q exactly in int32; the offset's part, off x sum q, is the row's own and is subtracted
 *   by starting the accumulator at its negative. One float FMA per group and row then adds
 *   int_sum x weight scale x activation scale (MXFP4's weight scale is 2^(e - 127) / 2, the half put in
 *   the activation scale). Q8_0's signed bytes go in as q + 128 (VPDPBUSD, the offset subtracted likewise) or,
 *   on AVX2 without VNNI, as |q| against the activations given q's sign (PSIGNB: a signed byte pair's
 *   products fit PMADDUBSW's int16 there, q + 128's would not). The ggml formats' scale is each block's
 *   fp16 d, and their activation groups take the block's column order (halves_layout). Q4_K's
 *   sub-blocks of 32 are groups: its nibbles q (offset 0) give sum q x exactly, scaled by d x sc, and the mins'
 *   part, -dmin x m x the activations' sum, is one more FMA per group and row (the sum, times the activation
 *   scale, made once per call in quantize_group). Q6_K's codes go in as q + 32, in 0..63 (offset 32), and its
 *   scales of 16 columns each are per int32 lane (eighths_layout), d x scale exact in float. Integer sums are
 *   exact and the float ones run in a fixed order, so a row's result depends on its own activations only, as in
 *   the float path. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "dk.h"

#define AI static inline __attribute__((always_inline))

#if DK_WIDTH == 16
typedef __m512 V;
#define NV 2
#define RT 4 /* activation rows a dequantized group is used for before the next group */
#define vzero() _mm512_setzero_ps()
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vset1(a) _mm512_set1_ps(a)
#define vload(p) _mm512_loadu_ps(p)
AI float vsum(V a, V b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#else
typedef __m256 V;
#define NV 4
#define RT 1
#define vzero() _mm256_setzero_ps()
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vset1(a) _mm256_set1_ps(a)
#define vload(p) _mm256_loadu_ps(p)
AI float vsum4(V a, V b, V c, V d) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
#endif

#define Q8_0_BLOCK 34 /* ggml's blocks: fp16 d, 32 int8 */
#define Q4_0_BLOCK 18 /* fp16 d, 16 bytes of nibbles */
#define Q4_K_BLOCK 144 /* 256 columns: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
#define Q6_K_BLOCK 210 /* 256 columns: 128 bytes ql, 64 qh, 16 int8 scales, fp16 d (dk.h) */

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static const float INT4V[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

AI float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Where row `row`'s data starts, and what a group of it needs besides its bytes. */
typedef struct rowref {
    const uint8_t *w;
    const uint8_t *s8;   /* MXFP4 exponents */
    const uint16_t *s16; /* INT4 bf16 scales */
    const float *sf;     /* FP8 block multipliers of this row's block row */
    float rs;            /* INT8 row scale */
} rowref;

AI rowref row_of(const dk_layer *L, const dk_mat *m, int e, int row, int fmt) {
    rowref r;
    int k = m->cols;
    r.s8 = 0; r.s16 = 0; r.sf = 0; r.rs = 1.f;
    switch (fmt) {
    case DK_MXFP4:
        r.w = m->w[e] + (size_t)row * (k / 2);
        r.s8 = (const uint8_t *)m->s[e] + (size_t)row * (k / 32);
        break;
    case DK_INT4:
        r.w = m->w[e] + (size_t)row * (k / 2);
        r.s16 = (const uint16_t *)m->s[e] + (size_t)row * (k / 32);
        break;
    case DK_INT8:
        r.w = m->w[e] + (size_t)row * k;
        r.rs = ((const float *)m->s[e])[row];
        break;
    case DK_Q8_0: /* the scales lie in the blocks */
        r.w = m->w[e] + (size_t)row * (k / 32) * Q8_0_BLOCK;
        break;
    case DK_Q4_0:
        r.w = m->w[e] + (size_t)row * (k / 32) * Q4_0_BLOCK;
        break;
    case DK_Q4_K:
        r.w = m->w[e] + (size_t)row * (k / 256) * Q4_K_BLOCK;
        break;
    case DK_Q6_K:
        r.w = m->w[e] + (size_t)row * (k / 256) * Q6_K_BLOCK;
        break;
    default: /* DK_FP8 */
        r.w = m->w[e] + (size_t)row * k;
        r.sf = (const float *)m->s[e] + (size_t)(row / 128) * ((k + 127) / 128);
        break;
    }
    (void)L;
    return r;
}

AI size_t row_bytes(int fmt, int k) {
    if (fmt == DK_Q8_0) return (size_t)k / 32 * Q8_0_BLOCK;
    if (fmt == DK_Q4_0) return (size_t)k / 32 * Q4_0_BLOCK;
    if (fmt == DK_Q4_K) return (size_t)k / 256 * Q4_K_BLOCK;
    if (fmt == DK_Q6_K) return (size_t)k / 256 * Q6_K_BLOCK;
    return (fmt == DK_MXFP4 || fmt == DK_INT4) ? (size_t)k / 2 : (size_t)k;
}

AI uint16_t half_at(const uint8_t *p) { /* a ggml block's fp16 scale (blocks are 2-byte aligned at best) */
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

AI void prefetch_row(const rowref *r, int fmt, int k) {
    size_t n = row_bytes(fmt, k);
    for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)r->w + o, _MM_HINT_T0);
    if (fmt == DK_MXFP4) for (int o = 0; o < k / 32; o += 64) _mm_prefetch((const char *)r->s8 + o, _MM_HINT_T0);
    if (fmt == DK_INT4) for (int o = 0; o < k / 16; o += 64) _mm_prefetch((const char *)r->s16 + o / 2, _MM_HINT_T0);
}

/* Q4_K sub-block j's 6-bit scale and min from its super-block's 12 bytes s (dk.h) */
AI void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Group g of a Q4_K / Q6_K row (32 columns, sub-block g % 8 of super-block g / 8): where its bits lie */
typedef struct kgroup {
    const uint8_t *q;  /* Q4_K: the 32 bytes whose nibbles (low or high) hold it; Q6_K: its 32 ql bytes */
    const uint8_t *qh; /* Q6_K: its 32 qh bytes */
    __m128i shift;     /* Q4_K / Q6_K ql: 0 or 4 (low or high nibbles) */
    __m128i hshift;    /* Q6_K qh: 0, 2, 4 or 6 */
    float s[2];        /* Q4_K: sc and m; Q6_K: the scales of columns 0..15 and 16..31 */
    uint16_t d, dmin;  /* fp16 */
} kgroup;

AI kgroup kgroup_of(const rowref *r, int fmt, int g) {
    kgroup k;
    int j = g & 7;
    if (fmt == DK_Q4_K) {
        const uint8_t *b = r->w + (size_t)Q4_K_BLOCK * (g >> 3);
        int sc, mn;
        q4_k_scale_min(b + 4, j, &sc, &mn);
        k.q = b + 16 + 32 * (j >> 1);
        k.qh = 0;
        k.shift = _mm_cvtsi32_si128(4 * (j & 1));
        k.hshift = _mm_setzero_si128();
        k.s[0] = (float)sc;
        k.s[1] = (float)mn;
        k.d = half_at(b);
        k.dmin = half_at(b + 2);
    } else { /* half h = j / 4 of 128 columns, quarter c = j % 4 */
        const uint8_t *b = r->w + (size_t)Q6_K_BLOCK * (g >> 3);
        int h = j >> 2, c = j & 3;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * c;
        k.q = b + 64 * h + 32 * (c & 1);
        k.qh = b + 128 + 32 * h;
        k.shift = _mm_cvtsi32_si128(4 * (c >> 1));
        k.hshift = _mm_cvtsi32_si128(2 * c);
        k.s[0] = (float)sc[0];
        k.s[1] = (float)sc[1];
        k.d = half_at(b + 208);
        k.dmin = 0;
    }
    return k;
}

/* Dequantize group g of a row into w[0..NV). */
#if DK_WIDTH == 16
AI void dequant(const rowref *r, int fmt, int g, V *w) {
    switch (fmt) {
    case DK_MXFP4: {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->w + 16 * g)));
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(dk_e8m0[r->s8[g]]));
        w[0] = _mm512_permutexvar_ps(c, t);                         /* low nibbles: even columns */
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);   /* high nibbles: odd columns */
        break;
    }
    case DK_INT4: {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->w + 16 * g)));
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(INT4V), _mm512_set1_ps(bf16_to_float(r->s16[g])));
        w[0] = _mm512_permutexvar_ps(c, t);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);
        break;
    }
    case DK_INT8:
        for (int j = 0; j < 2; j++)
            w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r->w + 32 * g + 16 * j))));
        break;
    case DK_Q8_0: { /* d x q: 11 by 8 significant bits, exact in float */
        const uint8_t *b = r->w + (size_t)Q8_0_BLOCK * g;
        __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)half_at(b)));
        for (int j = 0; j < 2; j++)
            w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * j)))), d);
        break;
    }
    case DK_Q4_0: { /* low nibbles columns 0..15, high ones 16..31: d x (q - 8), exact */
        const uint8_t *b = r->w + (size_t)Q4_0_BLOCK * g;
        __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)half_at(b)));
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))), eight = _mm512_set1_epi32(8);
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(c, _mm512_set1_epi32(15)), eight)), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(c, 4), eight)), d);
        break;
    }
    case DK_Q4_K: { /* (d x sc) x q exact, minus dmin x m (exact): one rounding */
        kgroup k = kgroup_of(r, fmt, g);
        __m512 ds = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_set1_epi16((short)k.d)), _mm512_set1_ps(k.s[0]));
        __m512 dm = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_set1_epi16((short)k.dmin)), _mm512_set1_ps(k.s[1]));
        for (int j = 0; j < 2; j++) {
            __m512i c = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.q + 16 * j))), k.shift);
            c = _mm512_and_si512(c, _mm512_set1_epi32(15));
            w[j] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(c), ds, dm); /* the product exact: as mul, sub */
        }
        break;
    }
    case DK_Q6_K: { /* (d x scale) x (q - 32): 18 by 6 significant bits, exact */
        kgroup k = kgroup_of(r, fmt, g);
        __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)k.d));
        for (int j = 0; j < 2; j++) {
            __m512i lo = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.q + 16 * j))), k.shift);
            __m512i hi = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k.qh + 16 * j))), k.hshift);
            __m512i q = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(15)),
                                        _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
            q = _mm512_sub_epi32(q, _mm512_set1_epi32(32));
            w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(d, _mm512_set1_ps(k.s[j])));
        }
        break;
    }
    default: { /* FP8 e4m3 as fp16 bits (value x 2^-8, the 2^8 is in the multiplier): exact, subnormals too,
                  and no float subnormal ever meets an arithmetic unit (those cost a microcode assist) */
        __m512 s = _mm512_set1_ps(r->sf[g >> 2]);
        for (int j = 0; j < 2; j++) {
            __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r->w + 32 * g + 16 * j)));
            __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7),
                                        _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
            w[j] = _mm512_mul_ps(_mm512_cvtph_ps(h), s);
        }
        break;
    }
    }
}

static int natural_index(int fmt, int p) {
    if (fmt == DK_MXFP4 || fmt == DK_INT4) {
        int g = p & ~31, q = p & 31;
        return g + (q < 16 ? 2 * q : 2 * (q - 16) + 1);
    }
    return p;
}
#else
AI __m256 signed_from(__m256 mag, __m256i code, int shift) {
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, shift), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

AI void dequant(const rowref *r, int fmt, int g, V *w) {
    switch (fmt) {
    case DK_MXFP4: {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(E2M1), _mm256_set1_ps(dk_e8m0[r->s8[g]])); /* magnitudes */
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(r->w + 16 * g + 8 * h)));
            __m256i hi = _mm256_srli_epi32(c, 4);
            w[2 * h] = signed_from(_mm256_permutevar8x32_ps(t, c), c, 28);
            w[2 * h + 1] = signed_from(_mm256_permutevar8x32_ps(t, hi), hi, 28);
        }
        break;
    }
    case DK_INT4: {
        __m256 s = _mm256_set1_ps(bf16_to_float(r->s16[g]));
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(r->w + 16 * g + 8 * h)));
            __m256i eight = _mm256_set1_epi32(8);
            __m256i lo = _mm256_sub_epi32(_mm256_and_si256(c, _mm256_set1_epi32(15)), eight);
            __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(c, 4), eight);
            w[2 * h] = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), s);
            w[2 * h + 1] = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), s);
        }
        break;
    }
    case DK_INT8:
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r->w + 32 * g + 8 * j))));
        break;
    case DK_Q8_0: { /* not reached while the AVX2 halves take Q8_0 on the integer path; kept for completeness */
        const uint8_t *b = r->w + (size_t)Q8_0_BLOCK * g;
        __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)half_at(b)));
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j)))), d);
        break;
    }
    case DK_Q4_0: { /* likewise not reached; columns 8h.. from low nibbles, 16 + 8h.. from high ones */
        const uint8_t *b = r->w + (size_t)Q4_0_BLOCK * g;
        __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)half_at(b)));
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * h))), eight = _mm256_set1_epi32(8);
            w[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, _mm256_set1_epi32(15)), eight)), d);
            w[2 + h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(c, 4), eight)), d);
        }
        break;
    }
    case DK_Q4_K: { /* not reached while the AVX2 halves take Q4_K / Q6_K on the integer path; as in the AVX-512
                     * half, 8 columns a vector */
        kgroup k = kgroup_of(r, fmt, g);
        __m256 ds = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)k.d)), _mm256_set1_ps(k.s[0]));
        __m256 dm = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)k.dmin)), _mm256_set1_ps(k.s[1]));
        for (int j = 0; j < 4; j++) {
            __m256i c = _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k.q + 8 * j))), k.shift);
            c = _mm256_and_si256(c, _mm256_set1_epi32(15));
            w[j] = _mm256_fmsub_ps(_mm256_cvtepi32_ps(c), ds, dm);
        }
        break;
    }
    case DK_Q6_K: {
        kgroup k = kgroup_of(r, fmt, g);
        __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)k.d));
        for (int j = 0; j < 4; j++) {
            __m256i lo = _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k.q + 8 * j))), k.shift);
            __m256i hi = _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k.qh + 8 * j))), k.hshift);
            __m256i q = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                        _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
            q = _mm256_sub_epi32(q, _mm256_set1_epi32(32));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(d, _mm256_set1_ps(k.s[j >> 1])));
        }
        break;
    }
    default: { /* FP8 as fp16 bits, as in the AVX-512 half */
        __m256 s = _mm256_set1_ps(r->sf[g >> 2]);
        for (int j = 0; j < 4; j++) {
            __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(r->w + 32 * g + 8 * j)));
            __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), 7),
                                     _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
            w[j] = _mm256_mul_ps(_mm256_cvtph_ps(h), s);
        }
        break;
    }
    }
}

static int natural_index(int fmt, int p) {
    if (fmt == DK_MXFP4 || fmt == DK_INT4) {
        int g = p & ~15, q = p & 15;
        return g + (q < 8 ? 2 * q : 2 * (q - 8) + 1);
    }
    return p;
}
#endif

/* Dot products of two weight rows a, b with `rt` activation rows (rt <= RT, a constant once inlined). */
AI void dot2(const rowref *a, const rowref *b, int fmt, int k, const float *const *x, int rt, float *oa, float *ob) {
    V acc_a[RT][NV], acc_b[RT][NV];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < NV; j++) acc_a[r][j] = acc_b[r][j] = vzero();
    for (int g = 0; g < k / 32; g++) {
        V w[NV];
        dequant(a, fmt, g, w);
        for (int r = 0; r < rt; r++)
            for (int j = 0; j < NV; j++) acc_a[r][j] = vfma(w[j], vload(x[r] + 32 * g + DK_WIDTH * j), acc_a[r][j]);
        dequant(b, fmt, g, w);
        for (int r = 0; r < rt; r++)
            for (int j = 0; j < NV; j++) acc_b[r][j] = vfma(w[j], vload(x[r] + 32 * g + DK_WIDTH * j), acc_b[r][j]);
    }
    for (int r = 0; r < rt; r++) {
#if DK_WIDTH == 16
        oa[r] = vsum(acc_a[r][0], acc_a[r][1]) * a->rs;
        ob[r] = vsum(acc_b[r][0], acc_b[r][1]) * b->rs;
#else
        oa[r] = vsum4(acc_a[r][0], acc_a[r][1], acc_a[r][2], acc_a[r][3]) * a->rs;
        ob[r] = vsum4(acc_b[r][0], acc_b[r][1], acc_b[r][2], acc_b[r][3]) * b->rs;
#endif
    }
}

/* All R activation rows against rows a and b, RT at a time. */
AI void dot2_rows(const rowref *a, const rowref *b, int fmt, int k, const float *const *x, int R, float *oa, float *ob) {
    int r0 = 0;
    for (; r0 + RT <= R; r0 += RT) dot2(a, b, fmt, k, x + r0, RT, oa + r0, ob + r0);
#if RT > 1
    switch (R - r0) {
    case 1: dot2(a, b, fmt, k, x + r0, 1, oa + r0, ob + r0); break;
    case 2: dot2(a, b, fmt, k, x + r0, 2, oa + r0, ob + r0); break;
    case 3: dot2(a, b, fmt, k, x + r0, 3, oa + r0, ob + r0); break;
    default: break;
    }
#endif
}

/* position of natural column i in an activation vector, for the down projection's input */
static int position_of(int fmt, int i) {
    if (fmt != DK_MXFP4 && fmt != DK_INT4) return i;
#if DK_WIDTH == 16
    int g = i & ~31, q = i & 31;
    return g + ((q & 1) ? 16 + q / 2 : q / 2);
#else
    int g = i & ~15, q = i & 15;
    return g + ((q & 1) ? 8 + q / 2 : q / 2);
#endif
}

AI float swiglu(float g, float u, float limit) {
    if (limit > 0.f) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
    }
    return g / (1.f + expf(-g)) * u;
}

/* ------------------------------------------------------------------------------- the integer path */
#if DK_WIDTH == 16
#define INT_PATH DK_VNNI /* AVX-512 without VNNI keeps the float path */
#else
#define INT_PATH 1
#endif
#define GPC (DK_WIDTH / 4)                   /* groups one weight load holds: 4 int32 lanes a group */
#define CHUNK_COLS (32 * GPC)
#define CHUNK_BYTES (32 * GPC + 8 * DK_WIDTH) /* an activation row's form, per chunk of CHUNK_COLS columns */

AI int int_path(int fmt) {
    return INT_PATH && fmt != DK_FP8 && fmt != DK_INT8;
}

/* MXFP4's weights are the checkpoint's values exactly, so one int8 rounding of the activations would be the
 * layer's only error (1.3-1.6% of its output against float64: enough to move a served model's logprobs past
 * transformers' by 0.17 in the tiny V4's greedy decode). Its activation rows, and its SwiGLU outputs, are taken in
 * two int8 passes instead: the groups as for every format (q1, step d), then what they leave (v - q1 x d, rounded
 * once) in steps of d / 256 (q2, saturated to int8: the remainder is at most d / 2). A group's value is then
 * (256 q1 + q2) x d / 256, so one int32 sum takes both passes (the first pass's products shifted left by 8, well
 * within int32) and one scale: ~8 bits more, for twice the integer products and no more weight reads or float
 * work. The other formats' weights carry their own quantization error (INT4's, the ggml blocks'), larger than one
 * rounding of the activations, and keep one pass. */
AI int two_pass(int fmt) { return int_path(fmt) && fmt == DK_MXFP4; }

/* ggml's blocks hold a group's columns in order (Q8_0), or its columns 0..15 in low nibbles and 16..31 in high
 * ones (Q4_0): the low and high halves of a chunk's group take its columns 0..15 and 16..31, where MXFP4's and
 * INT4's take the even and the odd ones */
AI int halves_layout(int fmt) { return fmt == DK_Q8_0 || fmt == DK_Q4_0 || fmt == DK_Q4_K; }

/* Q6_K's scales cover 16 columns each, so no int32 lane may mix a group's two halves: its low half takes columns
 * 0..7 and 16..23, its high half 8..15 and 24..31, and lanes 0, 1 sum columns 0..15, lanes 2, 3 columns 16..31 */
AI int eighths_layout(int fmt) { return fmt == DK_Q6_K; }

#if DK_VNNI
#define Q8_0_OFFSET 128 /* VPDPBUSD's weights are unsigned bytes: q + 128 (q ^ 0x80), and 128 x sum x subtracted */
#else
#define Q8_0_OFFSET 0 /* PMADDUBSW takes |q| against x with q's sign (idot_fmt): nothing to subtract */
#endif

/* what the weight bytes the dot products read exceed the values by (INT4 and Q4_0: their stored codes, q + 8) */
AI int weight_offset(int fmt) {
    return fmt == DK_MXFP4 ? 12 : fmt == DK_Q8_0 ? Q8_0_OFFSET : fmt == DK_Q6_K ? 32 : fmt == DK_Q4_K ? 0 : 8;
}

/* An activation row in the integer path's form, chunk after chunk; chunk c holds groups GPC*c + j, j < GPC:
 *   int8  lo[16 * GPC]: lo[16j + b] = q of column 32(GPC c + j) + 2b (the columns low nibbles hold; Q8_0:
 *         column 32(GPC c + j) + b, the group's first half)
 *   int8  hi[16 * GPC]: hi[16j + b] = q of column 32(GPC c + j) + 2b + 1 (high nibbles; Q8_0: + 16 + b)
 *   int32 start[DK_WIDTH]: lane 4j + l = -off x the sum of the 8 q's lane 4j + l multiplies (lo and hi
 *         bytes 16j + 4l .. 16j + 4l + 3), where off is the format's weight offset (weight_offset: MXFP4 12,
 *         INT4 8, Q8_0 128 where VPDPBUSD takes it, else 0)
 *         (Q4_K, offset 0: in its place a float, the lane's sum of q's x the group's scale, for the mins)
 *   float scale[DK_WIDTH]: lane 4j + l = the group's scale (MXFP4: halved)
 * Groups past the row's end are all zero. A group of values v: amax = max |v| (NaN if one is), and where
 * 0 < amax < inf, q = rint(v * (127 / amax)) and the scale amax / 127; else q = 0 and the scale 0 (amax 0) or
 * NaN, which the products then carry. A two_pass format's row holds a second pass's lo and hi pass_bytes on
 * (quantize_row_group: q = rint(v * (256 / d)) of what the first pass left, saturated), and the first pass's
 * start and scale are the two passes' together: -off x (256 x the first's sum + the second's), d / 256.
 * `step`: 0, or the second pass's step d / 256 (whose q's only are written, their lane sums returned in *sums).
 * Returns the group's step d (unhalved). */
AI float quantize_group(const float *v, int fmt, uint8_t *chunk, int j, float *left, float step, __m128i *sums) {
    /* AVX2 ops only (every half has them), computing the definition above: rounding by
     * cvtps2dq is to nearest even under the workers' MXCSR, as rintf */
    __m256 x[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(x[i], abs));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float amax = _mm_movemask_ps(_mm_or_ps(_mm256_castps256_ps128(nan), _mm256_extractf128_ps(nan, 1))) ? (float)NAN
                                                                                                       : _mm_cvtss_f32(h);
    __m256i q[4];
    float d;
    if (step != 0.f) { /* a second pass: a finite, non-zero step (else NaN, and q = 0) */
        __m256 inv = _mm256_set1_ps(step > 0.f && step <= 3.4028234e38f ? 1.f / step : 0.f);
        for (int i = 0; i < 4; i++) /* saturated here, so that the lane sums are those of the bytes: a remainder
                                     * of exactly d / 2 (a tie, common in bf16 rows) gives +-128 */
            q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv)),
                                                     _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
        d = step;
    } else if (amax > 0.f && amax <= 3.4028234e38f) { /* a NaN fails both */
        __m256 inv = _mm256_set1_ps(127.f / amax);
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
        d = amax / 127.f;
    } else { /* all zero, or not finite: the group's products come out 0 x NaN */
        for (int i = 0; i < 4; i++) q[i] = _mm256_setzero_si256();
        d = amax == 0.f ? 0.f : (float)NAN;
    }
    if (left) /* what the group leaves, v - q x d rounded once (q = 0: v itself, NaN or zero) */
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(left + 8 * i, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(d), x[i]));
    float step_d = d;
    if (fmt == DK_MXFP4) d *= 0.5f;
    int off = weight_offset(fmt);
    /* the 32 q's as bytes in order, then even ones (low nibbles' columns) to lo, odd ones to hi */
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi16(_mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8),
                                                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8)),
                                         0xD8);
    if (eighths_layout(fmt)) {
        w = _mm256_permute4x64_epi64(w, 0xD8); /* columns 0..7, 16..23 | 8..15, 24..31 */
    } else if (!halves_layout(fmt)) {
        w = _mm256_shuffle_epi8(w, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        w = _mm256_permute4x64_epi64(w, 0xD8);
    }
    _mm_storeu_si128((__m128i *)(chunk + 16 * j), _mm256_castsi256_si128(w));
    _mm_storeu_si128((__m128i *)(chunk + 16 * GPC + 16 * j), _mm256_extracti128_si256(w, 1));
    __m128i sum;
    if (halves_layout(fmt)) {
        /* lane l multiplies columns 4l .. 4l + 3 and 16 + 4l .. 16 + 4l + 3: with s = q[0] + q[2] and
         * t = q[1] + q[3], the sums of s[0..3], s[4..7], t[0..3], t[4..7] */
        __m256i u = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[2]), _mm256_add_epi32(q[1], q[3]));
        u = _mm256_hadd_epi32(u, u); /* [s0-3, t0-3, s0-3, t0-3 | s4-7, t4-7, s4-7, t4-7] */
        sum = _mm_unpacklo_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    } else if (eighths_layout(fmt)) { /* likewise with s = q[0] + q[1] (columns 0..15), t = q[2] + q[3] */
        __m256i u = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        u = _mm256_hadd_epi32(u, u);
        sum = _mm_unpacklo_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    } else { /* lane l multiplies q[8l .. 8l + 7] */
        __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
        sum = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    }
    if (step != 0.f) { /* the first pass's start and scale take this one's */
        *sums = sum;
        return step_d;
    }
    if (fmt == DK_Q4_K) /* the mins' part: the lane's sum times the scale, a float (ichunk) */
        _mm_storeu_ps((float *)(chunk + 32 * GPC + 16 * j), _mm_mul_ps(_mm_cvtepi32_ps(sum), _mm_set1_ps(d)));
    else /* start = -off x the lane's sum */
        _mm_storeu_si128((__m128i *)(chunk + 32 * GPC + 16 * j), _mm_mullo_epi32(sum, _mm_set1_epi32(-off)));
    _mm_storeu_ps((float *)(chunk + 32 * GPC + 4 * DK_WIDTH + 16 * j), _mm_set1_ps(d));
    return step_d;
}

AI void zero_group(uint8_t *chunk, int j) {
    memset(chunk + 16 * j, 0, 16);
    memset(chunk + 16 * GPC + 16 * j, 0, 16);
    memset(chunk + 32 * GPC + 16 * j, 0, 16);
    memset(chunk + 32 * GPC + 4 * DK_WIDTH + 16 * j, 0, 16);
}

#if DK_WIDTH == 16
typedef __m512i VI;
#define iload(p) _mm512_loadu_si512((const void *)(p))
#define izero() _mm512_setzero_si512()
#define iand(a, b) _mm512_and_si512(a, b)
#define ixor(a, b) _mm512_xor_si512(a, b)
#define isrl4(a) _mm512_srli_epi16(a, 4)
#define isll8(a) _mm512_slli_epi32(a, 8)
#define iadd(a, b) _mm512_add_epi32(a, b)
#define ishuf(t, a) _mm512_shuffle_epi8(t, a)
#define iset1_8(a) _mm512_set1_epi8(a)
#define icvt(a) _mm512_cvtepi32_ps(a)
#define ibcast16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
AI VI idot(VI acc, VI wlo, VI whi, const uint8_t *lo, const uint8_t *hi) {
#if DK_VNNI
    acc = _mm512_dpbusd_epi32(acc, wlo, iload(lo));
    return _mm512_dpbusd_epi32(acc, whi, iload(hi));
#else /* not used: without VNNI this half keeps the float path (INT_PATH 0) */
    __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(wlo, iload(lo)), _mm512_maddubs_epi16(whi, iload(hi)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}
AI float hsum(V a) { return _mm512_reduce_add_ps(a); }
#else
typedef __m256i VI;
#define iload(p) _mm256_loadu_si256((const __m256i *)(p))
#define izero() _mm256_setzero_si256()
#define iand(a, b) _mm256_and_si256(a, b)
#define ixor(a, b) _mm256_xor_si256(a, b)
#define isrl4(a) _mm256_srli_epi16(a, 4)
#define isll8(a) _mm256_slli_epi32(a, 8)
#define iadd(a, b) _mm256_add_epi32(a, b)
#define ishuf(t, a) _mm256_shuffle_epi8(t, a)
#define iset1_8(a) _mm256_set1_epi8(a)
#define icvt(a) _mm256_cvtepi32_ps(a)
#define ibcast16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
AI VI idot(VI acc, VI wlo, VI whi, const uint8_t *lo, const uint8_t *hi) {
#if DK_VNNI
    acc = _mm256_dpbusd_avx_epi32(acc, wlo, iload(lo));
    return _mm256_dpbusd_avx_epi32(acc, whi, iload(hi));
#else /* byte pairs to int16 (at most 2 x 63 x 127, Q6_K's, and twice that, 32004, summed: no saturation), then
       * to int32 */
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wlo, iload(lo)), _mm256_maddubs_epi16(whi, iload(hi)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
AI float hsum(V a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
#endif

/* idot for format fmt: on AVX2 without VNNI, Q8_0's signed weights go in as |q| against x with q's sign
 * (PSIGNB; a byte pair is then at most 2 x 128 x 127, within int16, so each half is widened on its own) */
AI VI idot_fmt(int fmt, VI acc, VI wlo, VI whi, const uint8_t *lo, const uint8_t *hi) {
#if DK_WIDTH == 8 && !DK_VNNI
    if (fmt == DK_Q8_0) {
        __m256i one = _mm256_set1_epi16(1);
        __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wlo), _mm256_sign_epi8(iload(lo), wlo)), one);
        __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(whi), _mm256_sign_epi8(iload(hi), whi)), one);
        return _mm256_add_epi32(acc, _mm256_add_epi32(a, b));
    }
#endif
    (void)fmt;
    return idot(acc, wlo, whi, lo, hi);
}

/* Chunk c of a Q8_0 or Q4_0 row: its ng (<= GPC) blocks' columns 0..15 and 16..31, one 16-byte lane a group
 * (bytes past ng zero, and read no further than the row goes): Q8_0's q's, as VPDPBUSD reads them (q + 128) on
 * the VNNI halves; Q4_0's low and high nibbles. Per int32 lane its group's d (zero past ng). */
AI void ggml_chunk(const rowref *r, int fmt, int c, int ng, VI *lo, VI *hi, V *ws) {
    int bs = fmt == DK_Q8_0 ? Q8_0_BLOCK : Q4_0_BLOCK;
    const uint8_t *p = r->w + (size_t)bs * GPC * c;
    __m128i l[GPC], h[GPC];
    uint16_t d[GPC];
    for (int j = 0; j < GPC; j++) {
        const uint8_t *b = p + bs * j;
        d[j] = j < ng ? half_at(b) : 0;
        l[j] = j < ng ? _mm_loadu_si128((const __m128i *)(b + 2)) : _mm_setzero_si128();
        h[j] = j < ng && fmt == DK_Q8_0 ? _mm_loadu_si128((const __m128i *)(b + 18)) : _mm_setzero_si128();
    }
#if DK_WIDTH == 16
    *lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(l[1], l[0])), _mm256_set_m128i(l[3], l[2]), 1);
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(h[1], h[0])), _mm256_set_m128i(h[3], h[2]), 1);
    *ws = _mm512_cvtph_ps(_mm256_setr_epi16((short)d[0], (short)d[0], (short)d[0], (short)d[0], (short)d[1],
                                            (short)d[1], (short)d[1], (short)d[1], (short)d[2], (short)d[2],
                                            (short)d[2], (short)d[2], (short)d[3], (short)d[3], (short)d[3],
                                            (short)d[3]));
#else
    *lo = _mm256_set_m128i(l[1], l[0]);
    *hi = _mm256_set_m128i(h[1], h[0]);
    *ws = _mm256_cvtph_ps(_mm_setr_epi16((short)d[0], (short)d[0], (short)d[0], (short)d[0], (short)d[1],
                                         (short)d[1], (short)d[1], (short)d[1]));
#endif
    if (fmt == DK_Q4_0) {
        VI m = iset1_8(0x0F);
        *hi = iand(isrl4(*lo), m);
        *lo = iand(*lo, m);
        return;
    }
#if DK_VNNI
    *lo = ixor(*lo, iset1_8((char)0x80));
    *hi = ixor(*hi, iset1_8((char)0x80));
#endif
}

AI float half_to_float(uint16_t h) {
#if DK_WIDTH == 16 /* the AVX-512 halves' flags have no F16C of their own */
    return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)h)));
#else
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
#endif
}

/* GPC 16-byte lanes (one a group) as one vector */
AI VI join_lanes(const __m128i *l) {
#if DK_WIDTH == 16
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(l[1], l[0])), _mm256_set_m128i(l[3], l[2]), 1);
#else
    return _mm256_set_m128i(l[1], l[0]);
#endif
}

/* Chunk c of a Q4_K or Q6_K row (whole: rows are super-blocks of 256 columns, chunks of 128 columns, 4 groups,
 * on AVX-512 and 64, 2 groups, on AVX2), one 16-byte lane a group as the activations' layout has it: Q4_K's
 * nibbles q (columns 0..15, 16..31), Q6_K's q + 32 in 0..63 (eighths_layout). Per int32 lane the scale of its
 * columns: Q4_K d x sc, Q6_K d x scale (both exact in float); wm (Q4_K) per lane -dmin x m, zero for Q6_K.
 * The super-block's scales are unpacked a chunk at a time, by integer ops on its bytes (dk.h's layout). */
AI void k_chunk(const rowref *r, int fmt, int c, VI *lo, VI *hi, V *ws, V *wm) {
#if DK_WIDTH == 16
    const int per = 2; /* chunks a super-block */
#else
    const int per = 4;
#endif
    int i = c % per; /* which chunk of its super-block */
    if (fmt == DK_Q4_K) {
        const uint8_t *b = r->w + (size_t)Q4_K_BLOCK * (c / per);
        uint32_t u[3], half2;
        memcpy(u, b + 4, 12);
        memcpy(&half2, b, 4); /* d, dmin */
        /* 6-bit scales and mins of sub-blocks 0..3 and 4..7, a byte each */
        uint32_t sc = (i * GPC < 4) ? (u[0] & 0x3f3f3f3fu) : ((u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4);
        uint32_t mn = (i * GPC < 4) ? (u[1] & 0x3f3f3f3fu) : (((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4);
#if DK_WIDTH == 16
        const uint8_t *q = b + 16 + 64 * i;
        __m512 dd = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi32_si128((int)half2)));
        __m512 d = _mm512_permutexvar_ps(_mm512_setzero_si512(), dd), dm = _mm512_permutexvar_ps(_mm512_set1_epi32(1), dd);
        __m512i lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        __m512 scv = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lane, _mm512_castsi128_si512(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)sc)))));
        __m512 mnv = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lane, _mm512_castsi128_si512(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)mn)))));
        *ws = _mm512_mul_ps(d, scv);
        *wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dm, mnv));
        /* groups: low, high nibbles of bytes 0..31, then of 32..63; their columns 0..15 from bytes 0..15 / 32..47 */
        __m512i z = _mm512_loadu_si512((const void *)q);
        __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4), m = _mm512_set1_epi8(0x0F);
        *lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_i64x2(z, z, 0xA0), sh), m); /* 128-bit lanes 0, 0, 2, 2 */
        *hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_i64x2(z, z, 0xF5), sh), m); /* 1, 1, 3, 3 */
#else
        const uint8_t *q = b + 16 + 32 * i; /* groups 2i, 2i + 1: low and high nibbles of bytes 32i..32i + 31 */
        int k0 = (2 * i) & 3; /* their bytes in sc / mn */
        __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)half2));
        __m128 sc2 = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)(sc >> (8 * k0)))));
        __m128 mn2 = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)(mn >> (8 * k0)))));
        __m128 s2 = _mm_mul_ps(_mm_shuffle_ps(dd, dd, 0x00), sc2);
        __m128 m2 = _mm_sub_ps(_mm_setzero_ps(), _mm_mul_ps(_mm_shuffle_ps(dd, dd, 0x55), mn2));
        *ws = _mm256_setr_m128(_mm_shuffle_ps(s2, s2, 0x00), _mm_shuffle_ps(s2, s2, 0x55));
        *wm = _mm256_setr_m128(_mm_shuffle_ps(m2, m2, 0x00), _mm_shuffle_ps(m2, m2, 0x55));
        __m256i y = _mm256_loadu_si256((const __m256i *)q);
        __m256i sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), m = _mm256_set1_epi8(0x0F);
        *lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permute4x64_epi64(y, 0x44), sh), m);
        *hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permute4x64_epi64(y, 0xEE), sh), m);
#endif
        return;
    }
    /* Q6_K: chunk i covers quarters of half h of 128 columns */
    const uint8_t *b = r->w + (size_t)Q6_K_BLOCK * (c / per);
    *wm = vzero();
#if DK_WIDTH == 16
    int h = i; /* the whole half: quarters 0..3 */
    __m512i a = _mm512_loadu_si512((const void *)(b + 64 * h));                              /* ql, quads Q0..Q7 */
    __m512i qh = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h))); /* P0..P3 */
    __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
    __m512i sh4 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    __m512i sh2 = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    /* quarter j's ql: bytes 32(j & 1).., nibble j >> 1; low half columns 0..7, 16..23, high half 8..15, 24..31 */
    __m512i l4 = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6), a), sh4), m4);
    __m512i h4 = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi64(_mm512_setr_epi64(1, 3, 5, 7, 1, 3, 5, 7), a), sh4), m4);
    __m512i l2 = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 0, 2, 0, 2, 0, 2), qh), sh2), m2);
    __m512i h2 = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi64(_mm512_setr_epi64(1, 3, 1, 3, 1, 3, 1, 3), qh), sh2), m2);
    *lo = _mm512_or_si512(l4, _mm512_slli_epi16(l2, 4));
    *hi = _mm512_or_si512(h4, _mm512_slli_epi16(h2, 4));
    /* lane L takes scale 8h + L / 2 */
    __m128i sc = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h)),
                                  _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)half_at(b + 208)));
    *ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
#else
    int h = i >> 1, q0 = 2 * (i & 1); /* half h, quarters q0 (ql bytes 0..31) and q0 + 1 (32..63), nibble i & 1 */
    __m256i x = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(b + 64 * h)), 0xD8);
    __m256i y = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)), 0xD8);
    __m256i p = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 0xD8);
    __m128i s4 = _mm_cvtsi32_si128(4 * (i & 1));
    __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256i sh2 = _mm256_setr_epi32(2 * q0, 2 * q0, 2 * q0, 2 * q0, 2 * q0 + 2, 2 * q0 + 2, 2 * q0 + 2, 2 * q0 + 2);
    __m256i l4 = _mm256_and_si256(_mm256_srl_epi16(_mm256_permute2x128_si256(x, y, 0x20), s4), m4);
    __m256i h4 = _mm256_and_si256(_mm256_srl_epi16(_mm256_permute2x128_si256(x, y, 0x31), s4), m4);
    __m256i l2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permute2x128_si256(p, p, 0x00), sh2), m2);
    __m256i h2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permute2x128_si256(p, p, 0x11), sh2), m2);
    *lo = _mm256_or_si256(l4, _mm256_slli_epi16(l2, 4));
    *hi = _mm256_or_si256(h4, _mm256_slli_epi16(h2, 4));
    /* lane L takes scale 8h + 2 q0 + L / 2 = 4i + L / 2 */
    int32_t s32;
    memcpy(&s32, b + 192 + 4 * i, 4);
    __m128i sc = _mm_shuffle_epi8(_mm_cvtsi32_si128(s32), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0));
    __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)half_at(b + 208)));
    *ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
#endif
}

static const uint8_t MXFP4_U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}; /* 2 E2M1 + 12 */

/* Chunk c of a weight row: its ng (<= GPC) groups' low and high nibbles as unsigned bytes, and per int32
 * lane its group's scale (zero past ng, where the weight bytes are zero too). */
AI void weight_chunk(const rowref *r, int fmt, int c, int ng, VI *lo, VI *hi, V *ws, V *wm) {
    *wm = vzero();
    if (fmt == DK_Q4_K || fmt == DK_Q6_K) {
        k_chunk(r, fmt, c, lo, hi, ws, wm);
        return;
    }
    if (fmt == DK_Q8_0 || fmt == DK_Q4_0) {
        ggml_chunk(r, fmt, c, ng, lo, hi, ws);
        return;
    }
    const uint8_t *p = r->w + 16 * GPC * c;
    VI b;
#if DK_WIDTH == 16
    b = ng == GPC ? iload(p) : _mm512_maskz_loadu_epi8((1ULL << (16 * ng)) - 1, p);
#else
    b = ng == GPC ? iload(p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
#endif
    VI m = iset1_8(0x0F);
    *lo = iand(b, m);
    *hi = iand(isrl4(b), m);
    if (fmt == DK_MXFP4) {
        VI t = ibcast16(MXFP4_U8);
        *lo = ishuf(t, *lo);
        *hi = ishuf(t, *hi);
        uint32_t e = 0; /* exponents 2^(e - 127) as float bits e << 23: e = 0 gives 0, not 2^-127 */
        memcpy(&e, r->s8 + GPC * c, ng == GPC ? GPC : ng);
        __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)e), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
#if DK_WIDTH == 16
        *ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(v), 23));
#else
        *ws = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(v), 23));
#endif
    } else { /* INT4: bf16 scales, one per group */
        uint64_t s = 0;
        memcpy(&s, r->s16 + GPC * c, 2 * (ng == GPC ? GPC : ng));
        __m128i v = _mm_cvtsi64_si128((long long)s);
#if DK_WIDTH == 16
        __m512i t = _mm512_castsi128_si512(_mm_cvtepu16_epi32(v));
        t = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), t);
        *ws = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
#else
        v = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3));
        *ws = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
#endif
    }
}

#if DK_WIDTH == 16
#define IRT 4
#else
#define IRT 2
#endif

/* One chunk of rows a, b against `rt` activation rows in the integer form (a two_pass format's second pass p2
 * bytes on). */
AI void ichunk(const rowref *a, const rowref *b, int fmt, int c, int ng, const uint8_t *const *x, int rt,
               size_t p2, V *fa, V *fb) {
    VI alo, ahi, blo, bhi;
    V aws, bws, awm, bwm;
    weight_chunk(a, fmt, c, ng, &alo, &ahi, &aws, &awm);
    weight_chunk(b, fmt, c, ng, &blo, &bhi, &bws, &bwm);
    for (int r = 0; r < rt; r++) {
        const uint8_t *ch = x[r] + (size_t)CHUNK_BYTES * c;
        V xs = vload((const float *)(ch + 32 * GPC + 4 * DK_WIDTH));
        if (fmt == DK_Q4_K) { /* sum q x: from zero; then -dmin m x the lane's activation sum (quantize_group) */
            V xm = vload((const float *)(ch + 32 * GPC));
            fa[r] = vfma(xm, awm, vfma(icvt(idot_fmt(fmt, izero(), alo, ahi, ch, ch + 16 * GPC)), vmul(aws, xs), fa[r]));
            fb[r] = vfma(xm, bwm, vfma(icvt(idot_fmt(fmt, izero(), blo, bhi, ch, ch + 16 * GPC)), vmul(bws, xs), fb[r]));
            continue;
        }
        VI start = iload(ch + 32 * GPC);
        if (two_pass(fmt)) { /* 256 x the first pass's sum + start, then the second pass's products */
            const uint8_t *c2 = ch + p2;
            VI ia = isll8(idot_fmt(fmt, izero(), alo, ahi, ch, ch + 16 * GPC));
            VI ib = isll8(idot_fmt(fmt, izero(), blo, bhi, ch, ch + 16 * GPC));
            fa[r] = vfma(icvt(idot_fmt(fmt, iadd(ia, start), alo, ahi, c2, c2 + 16 * GPC)), vmul(aws, xs), fa[r]);
            fb[r] = vfma(icvt(idot_fmt(fmt, iadd(ib, start), blo, bhi, c2, c2 + 16 * GPC)), vmul(bws, xs), fb[r]);
            continue;
        }
        fa[r] = vfma(icvt(idot_fmt(fmt, start, alo, ahi, ch, ch + 16 * GPC)), vmul(aws, xs), fa[r]);
        fb[r] = vfma(icvt(idot_fmt(fmt, start, blo, bhi, ch, ch + 16 * GPC)), vmul(bws, xs), fb[r]);
    }
}

/* one pass's bytes of a k-column activation row in the integer form (two_pass formats hold two of them) */
AI size_t pass_bytes(int k) { return (size_t)(k + CHUNK_COLS - 1) / CHUNK_COLS * CHUNK_BYTES; }

AI void idot2(const rowref *a, const rowref *b, int fmt, int k, const uint8_t *const *x, int rt, float *oa,
              float *ob) {
    V fa[IRT], fb[IRT];
    for (int r = 0; r < rt; r++) fa[r] = fb[r] = vzero();
    int full = k / CHUNK_COLS, tail = (k % CHUNK_COLS) / 32;
    size_t p2 = two_pass(fmt) ? pass_bytes(k) : 0;
    for (int c = 0; c < full; c++) ichunk(a, b, fmt, c, GPC, x, rt, p2, fa, fb);
    if (tail) ichunk(a, b, fmt, full, tail, x, rt, p2, fa, fb);
    for (int r = 0; r < rt; r++) {
        oa[r] = hsum(fa[r]);
        ob[r] = hsum(fb[r]);
    }
}

/* All R rows (R <= MAXR) against rows a and b */
#define MAXR 256
AI void idot2_rows(const rowref *a, const rowref *b, int fmt, int k, const uint8_t *const *x, int R, float *oa,
                   float *ob) {
    int r0 = 0;
    for (; r0 + IRT <= R; r0 += IRT) idot2(a, b, fmt, k, x + r0, IRT, oa + r0, ob + r0);
    switch (R - r0) {
    case 1: idot2(a, b, fmt, k, x + r0, 1, oa + r0, ob + r0); break;
#if IRT > 2
    case 2: idot2(a, b, fmt, k, x + r0, 2, oa + r0, ob + r0); break;
    case 3: idot2(a, b, fmt, k, x + r0, 3, oa + r0, ob + r0); break;
#endif
    default: break;
    }
}

static size_t act_bytes(int fmt, int k) {
    return int_path(fmt) ? (two_pass(fmt) ? 2 : 1) * pass_bytes(k) : (size_t)k * sizeof(float);
}

/* group g of a k-column row's form dst from its values v (32 floats; a two_pass format's second pass from what
 * the first leaves, its start and scale merged into the first's: quantize_group) */
AI void quantize_row_group(const float *v, int fmt, int k, uint8_t *dst, int g) {
    float left[32];
    uint8_t *chunk = dst + (size_t)CHUNK_BYTES * (g / GPC);
    int j = g % GPC;
    float d = quantize_group(v, fmt, chunk, j, two_pass(fmt) ? left : 0, 0.f, 0); /* the first pass's step */
    if (!two_pass(fmt)) return;
    int32_t *start = (int32_t *)(chunk + 32 * GPC + 16 * j);
    float *scale = (float *)(chunk + 32 * GPC + 4 * DK_WIDTH + 16 * j);
    __m128i sums;
    quantize_group(left, fmt, chunk + pass_bytes(k), j, 0, d == 0.f ? 0.f : d / 256.f, &sums);
    if (d == 0.f) sums = _mm_setzero_si128(); /* an all-zero group: no second pass */
    __m128i s1 = _mm_loadu_si128((const __m128i *)start);
    __m128i s2 = _mm_mullo_epi32(sums, _mm_set1_epi32(-weight_offset(fmt)));
    _mm_storeu_si128((__m128i *)start, _mm_add_epi32(_mm_slli_epi32(s1, 8), s2));
    _mm_storeu_ps(scale, _mm_mul_ps(_mm_loadu_ps(scale), _mm_set1_ps(1.f / 256.f)));
}

/* the groups past a k-column row's end, zero in each pass */
AI void zero_tail(int fmt, int k, uint8_t *dst) {
    for (int p = 0; p < (two_pass(fmt) ? 2 : 1); p++)
        for (int g = k / 32; g % GPC; g++) zero_group(dst + p * pass_bytes(k) + (size_t)CHUNK_BYTES * (g / GPC), g % GPC);
}

AI float load_one(const void *src, int bf16, int i) {
    return bf16 ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

/* One activation row (k bf16 or float values) into the form the dot products read. */
static void prepare(int fmt, const void *src, int bf16, int k, void *dst) {
    if (!int_path(fmt)) {
        float *d = dst;
        for (int i = 0; i < k; i++) d[i] = load_one(src, bf16, natural_index(fmt, i));
        return;
    }
    uint8_t *d = dst;
    int groups = k / 32;
    for (int g = 0; g < groups; g++) {
        float v[32];
        if (bf16) {
            const uint16_t *s16 = (const uint16_t *)src + 32 * g;
            for (int i = 0; i < 32; i++) {
                uint32_t u = (uint32_t)s16[i] << 16;
                memcpy(v + i, &u, 4);
            }
        } else {
            memcpy(v, (const float *)src + 32 * g, sizeof v);
        }
        quantize_row_group(v, fmt, k, d, g);
    }
    zero_tail(fmt, k, d);
}

static int gateup_rows(int fmt, int down_fmt) { return int_path(fmt) || int_path(down_fmt) ? 32 : 16; }

/* ------------------------------------------------------------------------------- gate/up and down */
/* Rows [i0, i1) of expert e's gate and up (format fmt; x in its form) and their SwiGLU outputs into h, in the
 * form the down projection's format reads: floats at position_of(down_fmt, i), or, where down takes int8
 * activations, quantized per group of 32 (i0 a multiple of 32 and i1 = i0 + 32: gateup_rows; the sizes are
 * multiples of 32), the item ending with one whole group of each row's SwiGLU output. */
AI void gateup_fmt(const dk_layer *L, int fmt, int e, int i0, int i1, const void *const *x, int R, void *const *h) {
    float g[MAXR], u[MAXR], hv[MAXR][32];
    int k = L->hidden, dfmt = L->down_fmt, quantize = int_path(dfmt);
    for (int i = i0; i < i1; i++) {
        rowref a = row_of(L, &L->gate, e, i, fmt), b = row_of(L, &L->up, e, i, fmt);
        if (i + 2 < L->inter) {
            rowref pa = row_of(L, &L->gate, e, i + 2, fmt), pb = row_of(L, &L->up, e, i + 2, fmt);
            prefetch_row(&pa, fmt, k);
            prefetch_row(&pb, fmt, k);
        }
        if (int_path(fmt)) idot2_rows(&a, &b, fmt, k, (const uint8_t *const *)x, R, g, u);
        else dot2_rows(&a, &b, fmt, k, (const float *const *)x, R, g, u);
        if (quantize) {
            for (int r = 0; r < R; r++) hv[r][i - i0] = swiglu(g[r], u[r], L->limit);
        } else {
            int p = position_of(dfmt, i);
            for (int r = 0; r < R; r++) ((float *)h[r])[p] = swiglu(g[r], u[r], L->limit);
        }
    }
    if (!quantize) return;
    int grp = i0 / 32, groups = L->inter / 32;
    for (int r = 0; r < R; r++) {
        quantize_row_group(hv[r], dfmt, L->inter, h[r], grp);
        if (grp == groups - 1) zero_tail(dfmt, L->inter, h[r]);
    }
}

/* rows [n0, n1) of expert e's down projection; DOT: dot2_rows (float) or idot2_rows (the integer path) */
#define DOWN_BODY(DOT, XT)                                                                                      \
    float ya[MAXR], yb[MAXR];                                                                                  \
    int k = L->inter;                                                                                          \
    for (int n = n0; n < n1; n += 2) {                                                                         \
        int m = n + 1 < n1 ? n + 1 : n; /* an odd row count computes its last row twice */                     \
        rowref a = row_of(L, &L->down, e, n, fmt), b = row_of(L, &L->down, e, m, fmt);                         \
        for (int d = 2; d < 4; d++)                                                                            \
            if (n + d < L->hidden) {                                                                           \
                rowref p = row_of(L, &L->down, e, n + d, fmt);                                                 \
                prefetch_row(&p, fmt, k);                                                                      \
            }                                                                                                  \
        DOT(&a, &b, fmt, k, (XT)h, R, ya, yb);                                                                 \
        for (int r = 0; r < R; r++) {                                                                          \
            y[r][n] = ya[r];                                                                                   \
            y[r][m] = yb[r];                                                                                   \
        }                                                                                                      \
    }
static void down_float(const dk_layer *L, int fmt, int e, int n0, int n1, const void *const *h, int R,
                       float *const *y) { DOWN_BODY(dot2_rows, const float *const *) }
static void down_int(const dk_layer *L, int fmt, int e, int n0, int n1, const void *const *h, int R,
                     float *const *y) { DOWN_BODY(idot2_rows, const uint8_t *const *) }

AI void down_fmt(const dk_layer *L, int fmt, int e, int n0, int n1, const void *const *h, int R, float *const *y) {
    if (int_path(fmt)) down_int(L, fmt, e, n0, n1, h, R, y);
    else down_float(L, fmt, e, n0, n1, h, R, y);
}

/* One specialization per format, so that the format is a constant inside the loops (gate/up's by the layer's
 * fmt, down's by its down_fmt; gate/up's form of the SwiGLU output, down's format, is chosen per row). */
#define SPECIALIZE(NAME, FMT)                                                                                   \
    static void gateup_##NAME(const dk_layer *L, int e, int i0, int i1, const void *const *x, int R,           \
                              void *const *h) { gateup_fmt(L, FMT, e, i0, i1, x, R, h); }                      \
    static void down_##NAME(const dk_layer *L, int e, int n0, int n1, const void *const *h, int R,             \
                            float *const *y) { down_fmt(L, FMT, e, n0, n1, h, R, y); }
SPECIALIZE(mxfp4, DK_MXFP4)
SPECIALIZE(fp8, DK_FP8)
SPECIALIZE(int8, DK_INT8)
SPECIALIZE(int4, DK_INT4)
SPECIALIZE(q8_0, DK_Q8_0)
SPECIALIZE(q4_0, DK_Q4_0)
SPECIALIZE(q4_k, DK_Q4_K)
SPECIALIZE(q6_k, DK_Q6_K)

static void gateup(const dk_layer *L, int e, int i0, int i1, const void *const *x, int R, void *const *h) {
    switch (L->fmt) {
    case DK_MXFP4: gateup_mxfp4(L, e, i0, i1, x, R, h); break;
    case DK_FP8: gateup_fp8(L, e, i0, i1, x, R, h); break;
    case DK_INT8: gateup_int8(L, e, i0, i1, x, R, h); break;
    case DK_Q8_0: gateup_q8_0(L, e, i0, i1, x, R, h); break;
    case DK_Q4_0: gateup_q4_0(L, e, i0, i1, x, R, h); break;
    case DK_Q4_K: gateup_q4_k(L, e, i0, i1, x, R, h); break;
    case DK_Q6_K: gateup_q6_k(L, e, i0, i1, x, R, h); break;
    default: gateup_int4(L, e, i0, i1, x, R, h); break;
    }
}

static void down(const dk_layer *L, int e, int n0, int n1, const void *const *h, int R, float *const *y) {
    switch (L->down_fmt) {
    case DK_MXFP4: down_mxfp4(L, e, n0, n1, h, R, y); break;
    case DK_FP8: down_fp8(L, e, n0, n1, h, R, y); break;
    case DK_INT8: down_int8(L, e, n0, n1, h, R, y); break;
    case DK_Q8_0: down_q8_0(L, e, n0, n1, h, R, y); break;
    case DK_Q4_0: down_q4_0(L, e, n0, n1, h, R, y); break;
    case DK_Q4_K: down_q4_k(L, e, n0, n1, h, R, y); break;
    case DK_Q6_K: down_q6_k(L, e, n0, n1, h, R, y); break;
    default: down_int4(L, e, n0, n1, h, R, y); break;
    }
}

static int activation_passes(int fmt) { return int_path(fmt) ? (two_pass(fmt) ? 2 : 1) : 0; }

const dk_isa_ops OPS = {ISA_NAME, gateup, down, prepare, act_bytes, gateup_rows, activation_passes};
