/* The AVX-512 half with AVX512-VNNI: MXFP4 and INT4 by int8 dot products (VPDPBUSD), the others in float
 * (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma). */
#define DK_WIDTH 16
#define DK_VNNI 1
#define ISA_NAME "avx512-vnni"
#define OPS dk_ops_avx512_vnni
#include "isa_impl.h"
