// The float32 GEMM's kernels (csrc/fp32_gemm.cpp), compiled once per instruction set: fp32_gemm.cpp includes this
// file inside a namespace under `#pragma GCC target(...)` with SJ_VEC set to 16 (AVX-512F) or 8 (AVX2 + FMA).
//
// Every output is one chain of fused multiply-adds over k = 0 .. K - 1 in order, from zero, then + bias: a lane of
// either build makes the same operations on the same values, so both builds give the same bits, and no row count,
// blocking or thread split changes a chain. Rows and columns are blocked only to share loads.
//
// The weight comes packed [N / 16, K, 16] (kernels/fp32_gemm.py): a 16-column group's row k is one 64-byte line, so
// each group is one sequential stream. A thread takes its column groups kSet at a time; a set's rows go in blocks of
// at most kRowBlock. With one block (a decode step's call) the block streams the set's weights, prefetching ahead.
// With more (a verify, a prefill), the set's k go in chunks of kChunk: every block takes a chunk in turn while it is
// in L1 (each block's sums parked in memory between chunks) and the first block fetches the next chunk, or the next
// set's first, as it goes, so that the memory streams the weights beside all blocks' products instead of only
// beside the first's.

#if SJ_VEC == 16
using vecf = __m512;
static inline vecf f_zero() { return _mm512_setzero_ps(); }
static inline vecf f_bcast(const float* p) { return _mm512_set1_ps(*p); }
static inline vecf f_fma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vecf f_add(vecf a, vecf b) { return _mm512_add_ps(a, b); }
static inline vecf f_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void f_store(float* p, vecf a) { _mm512_storeu_ps(p, a); }
#else
using vecf = __m256;
static inline vecf f_zero() { return _mm256_setzero_ps(); }
static inline vecf f_bcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline vecf f_fma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vecf f_add(vecf a, vecf b) { return _mm256_add_ps(a, b); }
static inline vecf f_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void f_store(float* p, vecf a) { _mm256_storeu_ps(p, a); }
#endif

constexpr int kVecs = 16 / SJ_VEC;  // vectors of a 16-column group

// The sums acc of rows [0, R) of x (row stride K) with groups wg[0 .. G) over k in [k0, k1): per k, each group's line
// loaded once for all R rows. fetch(k): the caller's prefetches at step k.
template <int R, int G, class Fetch>
inline __attribute__((always_inline)) void chains(vecf (&acc)[R][G * kVecs], const float* x, int64_t K,
                                                  const float* const* wg, int64_t k0, int64_t k1, Fetch&& fetch) {
  for (int64_t k = k0; k < k1; ++k) {
    fetch(k);
    vecf w[G * kVecs];
    for (int j = 0; j < G; ++j)
      for (int v = 0; v < kVecs; ++v) w[j * kVecs + v] = f_load(wg[j] + k * 16 + v * SJ_VEC);
    for (int r = 0; r < R; ++r) {
      const vecf xb = f_bcast(x + r * K + k);
      for (int i = 0; i < G * kVecs; ++i) acc[r][i] = f_fma(xb, w[i], acc[r][i]);
    }
  }
}

// Rows [0, R) with groups wg[0 .. G) (columns cols[j] .. + 16) over k in [k0, k1): the sums start at zero (`first`)
// or from `parked`, and go back to it, or (`last`) + bias to y (row stride ldy).
template <int R, int G, class Fetch>
inline __attribute__((always_inline)) void block(const float* x, int64_t K, const float* const* wg, int64_t k0,
                                                 int64_t k1, float* parked, bool first, bool last, const float* bias,
                                                 const int64_t* cols, float* y, int64_t ldy, Fetch&& fetch) {
  vecf acc[R][G * kVecs];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < G * kVecs; ++i) acc[r][i] = first ? f_zero() : f_load(parked + (r * G * kVecs + i) * SJ_VEC);
  chains<R, G>(acc, x, K, wg, k0, k1, fetch);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < G * kVecs; ++i) {
      if (!last) {
        f_store(parked + (r * G * kVecs + i) * SJ_VEC, acc[r][i]);
        continue;
      }
      const int64_t col = cols[i / kVecs] + (i % kVecs) * SJ_VEC;
      f_store(y + r * ldy + col, bias == nullptr ? acc[r][i] : f_add(acc[r][i], f_load(bias + col)));
    }
}

// Rows [r0, r0 + R) of the call against the set's groups (wg, cols: kSet or fewer), a sub-block of kGroups(R) groups
// at a time; `fetch` prefetches for the whole set at each step of the first sub-block.
template <int R, class Fetch>
inline void row_block(const float* x, int64_t K, const float* const* wg, const int64_t* cols, int64_t set_groups,
                      int64_t k0, int64_t k1, float* parked, bool first, bool last, const float* bias, float* y,
                      int64_t N, Fetch&& fetch) {
  constexpr int G = kGroups(R);
  auto none = [](int64_t) {};
  int64_t j = 0;
  for (; j + G <= set_groups; j += G) {
    float* park = parked + j * R * 16;
    if (j == 0) block<R, G>(x, K, wg, k0, k1, park, first, last, bias, cols, y, N, fetch);
    else block<R, G>(x, K, wg + j, k0, k1, park, first, last, bias, cols + j, y, N, none);
  }
  for (; j < set_groups; ++j) {  // a short set's last groups, one at a time
    float* park = parked + j * R * 16;
    if (j == 0) block<R, 1>(x, K, wg, k0, k1, park, first, last, bias, cols, y, N, fetch);
    else block<R, 1>(x, K, wg + j, k0, k1, park, first, last, bias, cols + j, y, N, none);
  }
}

// Every row against column groups [g0, g1) (this thread's), kSet at a time.
inline void gemm(const float* x, int64_t rows, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                 int64_t g0, int64_t g1) {
  const int64_t group_size = K * 16;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t chunk = blocks > 1 ? kChunk : K;
  // The sums of every block of a slab of rows between chunks; a longer call goes slab by slab.
  constexpr int64_t kSlabBlocks = 8;
  alignas(64) float parked[kSlabBlocks * kRowBlock * kSet * 16];
  for (int64_t g = g0; g < g1; g += kSet) {
    const int64_t set_groups = std::min<int64_t>(kSet, g1 - g);
    const float* wg[kSet];
    int64_t cols[kSet];
    for (int64_t j = 0; j < set_groups; ++j) wg[j] = w + (g + j) * group_size, cols[j] = (g + j) * 16;
    // Where the set's weights end the next set's begin (the groups are contiguous): a prefetch `ahead` k past a
    // group's end reads the next group's first lines. One block: each group's own stream kStreamAhead ahead; more:
    // the next chunk, which past the set's last chunk is the next set's first (this thread's: g1 bounds it).
    const int64_t ahead = blocks > 1 ? chunk : kStreamAhead;
    const float* next_set = g + kSet < g1 ? w + (g + set_groups) * group_size : nullptr;
    for (int64_t slab = 0; slab < blocks; slab += kSlabBlocks) {
      const int64_t slab_end = std::min(blocks, slab + kSlabBlocks);
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t k1 = std::min(K, k0 + chunk);
        const bool first = k0 == 0, last = k1 == K;
        auto fetch = [&](int64_t k) {
          const int64_t at = k + ahead;
          if (at < K) {
            for (int64_t j = 0; j < set_groups; ++j) prefetch_l1(wg[j] + at * 16);
          } else if (next_set != nullptr && slab_end == blocks) {
            for (int64_t j = 0; j < set_groups; ++j) prefetch_l1(next_set + j * group_size + (at - K) * 16);
          }
        };
        for (int64_t b = slab; b < slab_end; ++b) {
          const int64_t r0 = b * kRowBlock, R = std::min(kRowBlock, rows - r0);
          float* park = parked + (b - slab) * kRowBlock * kSet * 16;
          const float* xr = x + r0 * K;
          float* yr = y + r0 * N;
          auto none = [](int64_t) {};
#define SJ_ROWS(RR)                                                                                              \
  (b == slab ? row_block<RR>(xr, K, wg, cols, set_groups, k0, k1, park, first, last, bias, yr, N, fetch)       \
             : row_block<RR>(xr, K, wg, cols, set_groups, k0, k1, park, first, last, bias, yr, N, none))
          switch (R) {
            case 6: SJ_ROWS(6); break;
            case 5: SJ_ROWS(5); break;
            case 4: SJ_ROWS(4); break;
            case 3: SJ_ROWS(3); break;
            case 2: SJ_ROWS(2); break;
            default: SJ_ROWS(1); break;
          }
#undef SJ_ROWS
        }
      }
    }
  }
}

// One row x against the groups listed in gs[0 .. n): each group's 16 sums (no bias) to out[i * 16 ..], the chains a
// full call gives them (a grammar-masked row's allowed columns), kGroups(1) groups at a time.
inline void listed_groups(const float* x, int64_t K, const float* w, const int64_t* gs, int64_t n, float* out) {
  constexpr int G = kGroups(1);
  const int64_t group_size = K * 16;
  const float* wg[G];
  int64_t cols[G];
  auto run = [&](auto groups_of_block, int64_t i) {
    constexpr int B = decltype(groups_of_block)::value;
    for (int j = 0; j < B; ++j) wg[j] = w + gs[i + j] * group_size, cols[j] = (i + j) * 16;
    auto fetch = [&](int64_t k) {
      for (int j = 0; j < B; ++j) prefetch_l1(wg[j] + (k + kStreamAhead) * 16);
    };
    block<1, B>(x, K, wg, 0, K, nullptr, true, true, nullptr, cols, out, 0, fetch);
  };
  int64_t i = 0;
  for (; i + G <= n; i += G) run(std::integral_constant<int, G>{}, i);
  for (; i < n; ++i) run(std::integral_constant<int, 1>{}, i);
}
