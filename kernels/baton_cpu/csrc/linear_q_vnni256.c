/* linear_q.c built with its 256-bit VNNI path (AVX-VNNI or AVX512-VL): the tests run it. */
#define BATON_Q_ISA 2
#include "linear_q.c"
