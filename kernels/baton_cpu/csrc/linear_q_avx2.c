/* linear_q.c built with its AVX2 path only (vpmaddubsw, no VNNI): the tests run it. */
#define BATON_Q_ISA 1
#include "linear_q.c"
