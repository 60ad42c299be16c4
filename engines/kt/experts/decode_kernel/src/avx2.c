/* The AVX2 half (compiled with -mavx2 -mfma -mf16c). */
#define DK_WIDTH 8
#include "isa_impl.h"
