/* The AVX2 half on CPUs with AVX-VNNI (VEX VPDPBUSD) and no AVX-512: as avx2.c, the int8 dot products
 * one instruction each (compiled with -mavx2 -mfma -mf16c -mavxvnni). */
#define DK_WIDTH 8
#define DK_VNNI 1
#define ISA_NAME "avx2-vnni"
#define OPS dk_ops_avx2_vnni
#include "isa_impl.h"
