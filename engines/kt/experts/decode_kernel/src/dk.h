/* The routed-expert decode kernel: shared declarations of the dispatcher (dk.c) and the ISA files.
 *
 * A call computes, for T rows of activations and their top-k experts,
 *   out[t] = sum_{slot in order} w[t, slot] * down_e(swiglu(gate_e(x_t), up_e(x_t)))
 * streaming each chosen expert's weights once for all rows routed to it. Every row's arithmetic is fixed:
 * a dot product's lanes and reduction tree depend only on the ISA and the format, the weighted sum runs in
 * slot order, and work is split over experts and output rows, never over a reduction. */
#ifndef KTSERVE_DK_H
#define KTSERVE_DK_H
#include <stddef.h>
#include <stdint.h>

enum { DK_MXFP4 = 0, DK_FP8 = 1, DK_INT8 = 2, DK_INT4 = 3, DK_Q8_0 = 4, DK_Q4_0 = 5, DK_Q4_K = 6, DK_Q6_K = 7 };
#define DK_LAST_FORMAT DK_Q6_K
/* the halves, best first where the CPU has several (dk.c: choose_isa) */
enum { DK_ISA_NONE = 0, DK_ISA_AVX2 = 1, DK_ISA_AVX512 = 2, DK_ISA_AVX2_VNNI = 3, DK_ISA_AVX512_VNNI = 4 };

/* One projection of every expert of a layer: rows x cols weights per expert, at per-expert addresses.
 *   MXFP4: w [rows, cols/2] E2M1 pairs (earlier column low), s [rows, cols/32] UE8M0 exponents (uint8)
 *   FP8:   w [rows, cols] e4m3fn, s: the layer's own [ceil(rows/128), ceil(cols/128)] float multipliers x 2^8
 *   INT8:  w [rows, cols] int8, s [rows] float (value = q * s)
 *   INT4:  w [rows, cols/2] (q + 8, earlier column low), s [rows, cols/32] bf16 (value = q * s)
 *   Q8_0:  w [rows, cols/32 blocks of 34 bytes], ggml's: per 32 columns an fp16 scale d then 32 int8 q
 *          (value = d * q), read where they lie (a GGUF's mapped file); s unused
 *   Q4_0:  w [rows, cols/32 blocks of 18 bytes], ggml's: per 32 columns an fp16 d then 16 bytes whose low
 *          nibbles are columns 0..15 and high nibbles 16..31 (value = d * (q - 8)); s unused
 *   Q4_K:  w [rows, cols/256 blocks of 144 bytes], ggml's super-blocks of 8 sub-blocks of 32: fp16 d, fp16 dmin,
 *          12 bytes of 6-bit scales sc[j] and mins m[j] (j < 4: byte j / j + 4 low 6 bits; j >= 4: byte j + 4's
 *          low / high nibble, with bits 4-5 from byte j - 4's / j's top 2), 128 bytes of nibbles: sub-blocks
 *          2i and 2i + 1 are the low and high nibbles of bytes 32i..32i + 31 (value = d sc[j] q - dmin m[j]); s unused
 *   Q6_K:  w [rows, cols/256 blocks of 210 bytes], ggml's: 128 bytes ql (low 4 bits), 64 bytes qh (high 2), 16 int8
 *          scales (one per 16 columns), fp16 d; per half h of 128 columns, quarter c of 32, column l < 32:
 *          low bits ql[64h + 32(c & 1) + l] >> 4(c >> 1), high bits qh[32h + l] >> 2c
 *          (value = d * scale[8h + 2c + l / 16] * (q - 32)); s unused
 * Q4_K and Q6_K need cols a multiple of 256. A layer's down projection may have a format of its own
 * (down_fmt: a GGUF "Q4_K_M" keeps gate and up in Q4_K and down, in some layers, in Q6_K). */
typedef struct dk_mat {
    const uint8_t **w;
    const void **s;
    int rows, cols;
} dk_mat;

typedef struct dk_layer {
    int fmt, down_fmt, experts, hidden, inter; /* fmt: gate's and up's format */
    float limit; /* SwiGLU clamp: gate <= limit, -limit <= up <= limit; 0: none */
    dk_mat gate, up, down;
    float *fp8_scales; /* FP8: the multipliers x 2^8, owned by the layer */
} dk_layer;

/* What one ISA file provides. x / h: activation rows in the form `prepare` makes (see isa_impl.h: float in
 * `natural_index` order, or the integer path's int8 groups), act_bytes(fmt, cols) bytes a row: x in gate's and
 * up's format's form, h in the down projection's. */
typedef struct dk_isa_ops {
    const char *name;
    /* h[r] gets swiglu(gate_i . x[r], up_i . x[r]) for rows i in [i0, i1) of expert e, r < R, in the form
     * down reads; i0, i1 are multiples of gateup_rows(fmt, down_fmt) (i1 may be inter) */
    void (*gateup)(const dk_layer *L, int e, int i0, int i1, const void *const *x, int R, void *const *h);
    /* y[r][n] = down_n . h[r] for rows n in [n0, n1) of expert e, r < R */
    void (*down)(const dk_layer *L, int e, int n0, int n1, const void *const *h, int R, float *const *y);
    /* one activation row, cols bf16 (bf16 != 0) or float values, into dst (act_bytes(fmt, cols) bytes) */
    void (*prepare)(int fmt, const void *src, int bf16, int cols, void *dst);
    size_t (*act_bytes)(int fmt, int cols);
    int (*gateup_rows)(int fmt, int down_fmt);
    /* how many int8 passes the format's dot products take the activations in: 0 float (no rounding), 1 int8
     * groups (the integer path), 2 the groups and what they leave (MXFP4 on the integer path: isa_impl.h) */
    int (*activation_passes)(int fmt);
} dk_isa_ops;

extern const dk_isa_ops dk_ops_avx512_vnni, dk_ops_avx512, dk_ops_avx2_vnni, dk_ops_avx2;
extern float dk_e8m0[256]; /* 2^(e - 127) */
#endif
