/* linear_q.c built with its scalar path only: the tests run it. */
#define BATON_Q_ISA 0
#include "linear_q.c"
