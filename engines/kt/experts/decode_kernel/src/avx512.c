/* The AVX-512 half for CPUs without AVX512-VNNI: the float path for every format
 * (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma). */
#define DK_WIDTH 16
#define DK_VNNI 0
#define ISA_NAME "avx512"
#define OPS dk_ops_avx512
#include "isa_impl.h"
