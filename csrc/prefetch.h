// A software prefetch into L1 that the compiler keeps. GCC at -O3 deleted every _mm_prefetch /
// __builtin_prefetch of the AVX-512 Q4_1 GEMM's tiles and of the AMX Q4_1 path (the built object had no
// prefetch instruction there while the AVX2 and int8 kernels had theirs; with some interprocedural
// passes off they came back): a prefetch has no effect the optimiser must preserve. An asm statement with
// side effects is never removed, so a kernel's prefetches are in the machine code as written.
#pragma once

#include <cstdint>

// Fetches the line holding `p` towards L1 (PREFETCHT0). Any address is allowed: a prefetch never faults.
static inline __attribute__((always_inline)) void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 (%0)" : : "r"(p));
}
