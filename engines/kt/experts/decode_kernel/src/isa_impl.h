/* The per-ISA half of the decode kernel, included once by avx512.c and once by avx2.c, each compiled with
 * its own target flags. Only intrinsics and libm here (no inline library code that another file could
 * share), and everything static but the ops table, so no AVX-512 instruction leaks into code the AVX2 path
 * runs.
 *
 * A group is 32 consecutive weights of a row. Dequantizing one gives NV vectors of exact fp32 weights (FP8:
 * times its block multiplier, rounded once), in the order `natural_index` gives; a row's dot product keeps
 * one accumulator per vector position, in group order, and ends in a fixed reduction tree. */
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
#define ISA_NAME "avx512"
#define OPS dk_ops_avx512
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
#define ISA_NAME "avx2"
#define OPS dk_ops_avx2
#endif

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
    default: /* DK_FP8 */
        r.w = m->w[e] + (size_t)row * k;
        r.sf = (const float *)m->s[e] + (size_t)(row / 128) * ((k + 127) / 128);
        break;
    }
    (void)L;
    return r;
}

AI size_t row_bytes(int fmt, int k) { return (fmt == DK_MXFP4 || fmt == DK_INT4) ? (size_t)k / 2 : (size_t)k; }

AI void prefetch_row(const rowref *r, int fmt, int k) {
    size_t n = row_bytes(fmt, k);
    for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)r->w + o, _MM_HINT_T0);
    if (fmt == DK_MXFP4) for (int o = 0; o < k / 32; o += 64) _mm_prefetch((const char *)r->s8 + o, _MM_HINT_T0);
    if (fmt == DK_INT4) for (int o = 0; o < k / 16; o += 64) _mm_prefetch((const char *)r->s16 + o / 2, _MM_HINT_T0);
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

#define MAXR 256
static void gateup_fmt(const dk_layer *L, int fmt, int e, int i0, int i1, const float *const *x, int R,
                       float *const *h) {
    float g[MAXR], u[MAXR];
    int k = L->hidden;
    for (int i = i0; i < i1; i++) {
        rowref a = row_of(L, &L->gate, e, i, fmt), b = row_of(L, &L->up, e, i, fmt);
        if (i + 2 < L->inter) {
            rowref pa = row_of(L, &L->gate, e, i + 2, fmt), pb = row_of(L, &L->up, e, i + 2, fmt);
            prefetch_row(&pa, fmt, k);
            prefetch_row(&pb, fmt, k);
        }
        dot2_rows(&a, &b, fmt, k, x, R, g, u);
        int p = position_of(fmt, i);
        for (int r = 0; r < R; r++) h[r][p] = swiglu(g[r], u[r], L->limit);
    }
}

static void down_fmt(const dk_layer *L, int fmt, int e, int n0, int n1, const float *const *h, int R,
                     float *const *y) {
    float ya[MAXR], yb[MAXR];
    int k = L->inter;
    for (int n = n0; n < n1; n += 2) {
        int m = n + 1 < n1 ? n + 1 : n; /* an odd row count computes its last row twice */
        rowref a = row_of(L, &L->down, e, n, fmt), b = row_of(L, &L->down, e, m, fmt);
        for (int d = 2; d < 4; d++)
            if (n + d < L->hidden) {
                rowref p = row_of(L, &L->down, e, n + d, fmt);
                prefetch_row(&p, fmt, k);
            }
        dot2_rows(&a, &b, fmt, k, h, R, ya, yb);
        for (int r = 0; r < R; r++) {
            y[r][n] = ya[r];
            y[r][m] = yb[r];
        }
    }
}

/* One specialization per format, so that the format is a constant inside the loops. */
#define SPECIALIZE(NAME, FMT)                                                                                   \
    static void gateup_##NAME(const dk_layer *L, int e, int i0, int i1, const float *const *x, int R,          \
                              float *const *h) { gateup_fmt(L, FMT, e, i0, i1, x, R, h); }                     \
    static void down_##NAME(const dk_layer *L, int e, int n0, int n1, const float *const *h, int R,            \
                            float *const *y) { down_fmt(L, FMT, e, n0, n1, h, R, y); }
SPECIALIZE(mxfp4, DK_MXFP4)
SPECIALIZE(fp8, DK_FP8)
SPECIALIZE(int8, DK_INT8)
SPECIALIZE(int4, DK_INT4)

static void gateup(const dk_layer *L, int e, int i0, int i1, const float *const *x, int R, float *const *h) {
    switch (L->fmt) {
    case DK_MXFP4: gateup_mxfp4(L, e, i0, i1, x, R, h); break;
    case DK_FP8: gateup_fp8(L, e, i0, i1, x, R, h); break;
    case DK_INT8: gateup_int8(L, e, i0, i1, x, R, h); break;
    default: gateup_int4(L, e, i0, i1, x, R, h); break;
    }
}

static void down(const dk_layer *L, int e, int n0, int n1, const float *const *h, int R, float *const *y) {
    switch (L->fmt) {
    case DK_MXFP4: down_mxfp4(L, e, n0, n1, h, R, y); break;
    case DK_FP8: down_fp8(L, e, n0, n1, h, R, y); break;
    case DK_INT8: down_int8(L, e, n0, n1, h, R, y); break;
    default: down_int4(L, e, n0, n1, h, R, y); break;
    }
}

const dk_isa_ops OPS = {ISA_NAME, gateup, down, natural_index};
