/* The AVX2 half: MXFP4 and INT4 by int8 dot products (PMADDUBSW + PMADDWD), the others in float
 * (compiled with -mavx2 -mfma -mf16c). */
#define DK_WIDTH 8
#define DK_VNNI 0
#define ISA_NAME "avx2"
#define OPS dk_ops_avx2
#include "isa_impl.h"
