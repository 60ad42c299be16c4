/* The AVX-512 half (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma). */
#define DK_WIDTH 16
#include "isa_impl.h"
