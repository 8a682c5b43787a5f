// A software prefetch into L1 that the compiler keeps. GCC at -O3 deleted every _mm_prefetch /
// __builtin_prefetch of the AVX-512 Q4_1 GEMM's tiles and of the AMX Q4_1 path (the built object had no
// prefetch instruction there while the AVX2 and int8 kernels had theirs; with some interprocedural
// passes off they came back): a prefetch has no effect the optimiser must preserve. An asm statement with
// side effects is never removed, so a kernel's prefetches are in the machine code as written.
#pragma once

#include <algorithm>
#include <cstdint>

// Fetches the line holding `p` towards L1 (PREFETCHT0). Any address is allowed: a prefetch never faults.
static inline __attribute__((always_inline)) void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 (%0)" : : "r"(p));
}

// Fetches the line holding `p` towards L2 (PREFETCHT1): data wanted a while later, too much for L1.
static inline __attribute__((always_inline)) void prefetch_l2(const void* p) {
  asm volatile("prefetcht1 (%0)" : : "r"(p));
}

// The weights a GEMM kernel reads next, fetched into L2 while it computes from its caches. A kernel with several
// row blocks over the same columns reads their weights from memory in the first block and from cache in the
// others, which leave the memory idle; `L2Ahead` spreads the fetch of the next columns' weights over those later
// blocks (`passes` of them, `steps` loop steps each), so that the next columns' first block finds them in L2 and
// the weights' stream hides behind the rows' products.
struct L2Stream {
  const char* next = nullptr;  // the next line to fetch
  const char* end = nullptr;
  int64_t per_step = 0;
  inline __attribute__((always_inline)) void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) prefetch_l2(next);
  }
};

struct L2Ahead {
  const char* base = nullptr;  // the region: whole 64-byte lines from here
  int64_t lines = 0;
  int64_t passes = 0;  // the later blocks (0: nothing is fetched)
  int64_t steps = 1;   // loop steps of one pass
  // The stream of later block `pass` (0 .. passes - 1): its share of the region's lines, in order.
  inline L2Stream part(int64_t pass) const {
    L2Stream s;
    if (pass < 0 || pass >= passes || lines <= 0) return s;
    const int64_t share = (lines + passes - 1) / passes;
    const int64_t first = std::min(pass * share, lines), last = std::min(first + share, lines);
    s.next = base + first * 64;
    s.end = base + last * 64;
    s.per_step = (share + steps - 1) / steps;
    return s;
  }
};
