// bf16 GEMM for CPU: y[M, N] = x[M, K] @ W (+ bias) with bf16 weights and activations, float32 sums rounded to
// bf16 once (round to nearest even, as torch converts). oneDNN's bf16 matmul picks its kernel and blocking by
// the row count, which speculative decoding cannot have (a row must get the same bits alone and among the 16
// rows of a verify: kernels/linear.py's measured row plans), and its one-row calls are slow. Here every row is
// computed by one code path whatever the call holds, so the kernel is batch-invariant by construction:
//
// - AVX-512 BF16 (VDPBF16PS): each output is one chain of pair products over k = 0, 2, 4, .. in order; rows and
//   columns are blocked only to share weight loads, never to change a chain.
// - AMX (TDPBF16PS): every row, even a lone one, goes through 16-row tiles (the activations padded with zero
//   rows); a tile row's sums depend on that row of A alone, so a row's bits do not depend on the others.
//   A tile product adds its 32 products in an order of its own (not VDPBF16PS's chain: other bits), so a
//   process uses one of the two for every call, never both. On a one-row call the tile does 16 rows' work, but
//   it is still far quicker than reading the weights, which is what a decode step waits for.
//
// W comes packed by specjet/kernels/bf16_gemm.py: [N / 16, K / 2, 16, 2], a 16-column group's k-pairs one
// 64-byte line each (VDPBF16PS's operand, and 16 of them an AMX B tile).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "cpu_ops.h"
#include "prefetch.h"
#include "token_bitmask.h"

namespace {

enum Isa : int64_t { kNone = 0, kAvx512Bf16 = 1, kAmx = 2 };
constexpr int64_t kCols = 16;   // columns of a packed group
constexpr int64_t kDepth = 32;  // k of one AMX tile product (16 pairs)

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace bf16_avx512 {

// 16 float sums (+ bias) rounded to bf16 (to nearest even, by the bits, as c10::BFloat16 rounds a finite value;
// the quiet NaN an instruction makes stays a NaN) and stored.
inline void store_row(__m512 acc, const float* bias, uint16_t* y) {
  if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
  const __m512i u = _mm512_castps_si512(acc);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}

// The sums acc of rows [0, R) of x (stride K) times groups wg[0 .. G), over k-pairs [kp0, kp1): every output one
// VDPBF16PS chain over the k-pairs in order, whatever the blocking around it. fetch(kp): the caller's prefetches
// at k-pair kp.
template <int R, int G, class Fetch>
inline __attribute__((always_inline)) void chains(__m512 (&acc)[R][G], const uint16_t* x, int64_t K,
                                                  const uint16_t* const* wg, int64_t kp0, int64_t kp1, Fetch&& fetch) {
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    fetch(kp);
    __m512bh wv[G];
    for (int j = 0; j < G; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wg[j] + kp * 2 * kCols);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * K + 2 * kp, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < G; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
}

// Rows [0, R) of x (stride K) times column groups gs[0 .. G), all k-pairs. Group j's sums go to columns cols[j] ..
// + 16 of y (row stride ldy). `prefetch`: fetch the groups' weight lines ahead (the first row block of a call reads
// them from memory; the next find them in cache).
template <int R, int G, bool Ahead = false>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, const float* bias, const int64_t* gs,
                  uint16_t* y, int64_t ldy, const int64_t* cols, bool prefetch, L2Stream ahead = {}) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t group_size = K * kCols;  // bf16 elements of one packed group
  const uint16_t* wg[G];
  for (int j = 0; j < G; ++j) wg[j] = w + gs[j] * group_size;
  constexpr int64_t kAhead = 16;  // k-pairs of each group's stream fetched ahead (1 KB)
  chains<R, G>(acc, x, K, wg, 0, K / 2, [&](int64_t kp) {
    if constexpr (Ahead) ahead.step();  // a template flag: a first block's loop carries nothing of it
    if (prefetch)
      for (int j = 0; j < G; ++j) prefetch_l1(wg[j] + (kp + kAhead) * 2 * kCols);
  });
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j)
      store_row(acc[r][j], bias == nullptr ? nullptr : bias + gs[j] * kCols, y + r * ldy + cols[j]);
}

// Rows per register block: 6 x 4 groups of sums, 4 weight vectors and the broadcast take 29 of the 32 registers.
constexpr int64_t kRowBlock = 6;

// Every row against column groups g .. g + G, a row block at a time: the groups' weights (G * K * 32 bytes) are
// read from memory by the first block and from cache by the others, where a loop over all groups per row block
// would read every weight once per block. With more than one block, the blocks after the first (which compute
// from cache, leaving the memory idle) fetch the next groups' weights up to `g_end` into L2, spread evenly over
// their k-pairs, so that the next groups' first block computes from L2 rather than waiting for memory: a verify's
// rows then cost their products, the weights' stream hidden behind them.
template <int G>
inline void groups(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                   int64_t N, int64_t g, int64_t g_end) {
  int64_t gs[G], cols[G];
  for (int j = 0; j < G; ++j) gs[j] = g + j, cols[j] = (g + j) * kCols;
  L2Ahead next;
  const int64_t next_groups = std::min<int64_t>(4, g_end - (g + G));
  if (next_groups > 0) {
    next.base = reinterpret_cast<const char*>(w + (g + G) * K * kCols);
    // As much of them as the later rows' products can cover, a first block's worth (kRowBlock rows) all of it:
    // a short later block that fetched all of it would wait for the memory itself.
    next.lines = next_groups * K * kCols * 2 / 64 * std::min<int64_t>(rows - kRowBlock, kRowBlock) / kRowBlock;
    next.passes = (rows - 1) / kRowBlock;  // the blocks after the first
    next.steps = K / 2;
  }
  int64_t r = 0;
  // The block at row r: the first reads the weights from memory, a later one fetches its share of the next.
  auto run = [&](auto rows_of_block) {
    constexpr int R = decltype(rows_of_block)::value;
    const uint16_t* xr = x + r * K;
    if (r == 0) block<R, G>(xr, K, w, bias, gs, y + r * N, N, cols, true);
    else block<R, G, true>(xr, K, w, bias, gs, y + r * N, N, cols, false, next.part(r / kRowBlock - 1));
  };
  for (; r + kRowBlock <= rows; r += kRowBlock) run(std::integral_constant<int, kRowBlock>{});
  switch (rows - r) {
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 1: run(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// Calls of 7 to 10 rows (a verify's tree, a few requests' decode steps): two row blocks over the same weights. In
// groups() the first block streams the weights while the second waits, then the second computes from cache while
// the memory idles: about the sum of the stream and the second block's products. Here the k-pairs go in chunks of
// kChunk (4 groups: 8 KB), both blocks take a chunk in turn while it is in L1 (their sums parked in memory between
// chunks) and the first block fetches the next chunk into L2, so the stream runs beside both blocks' products.
// Every output is still one VDPBF16PS chain over the k-pairs in order (a parked sum keeps its bits): a row's bits
// do not change. With a second block of 5 or 6 rows the products alone outlast the stream and the parking costs
// more than it hides (measured), so those calls, and all larger ones, stay in groups().
constexpr int64_t kChunk = 32;
constexpr int64_t kInterleavedRows = kRowBlock + 4;

// Rows [0, R) against groups wg[0 .. G) over k-pairs [kp0, kp1): sums from `parked` (zeros on the first chunk), back
// to it after (rounded and stored to y on the last). Fetch: also fetch, per k-pair, each group's line of the next
// chunk at fetch[j] + (kp - kp0) * 64 (into L2).
template <int R, int G, bool Fetch>
inline void block_chunk(const uint16_t* x, int64_t K, const uint16_t* const* wg, int64_t kp0, int64_t kp1,
                        float* parked, bool first, bool last, const float* bias, const int64_t* gs, uint16_t* y,
                        int64_t ldy, const int64_t* cols, const char* const* fetch) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(parked + (r * G + j) * kCols);
  chains<R, G>(acc, x, K, wg, kp0, kp1, [&](int64_t kp) {
    if constexpr (Fetch)
      for (int j = 0; j < G; ++j) prefetch_l2(fetch[j] + (kp - kp0) * 64);
  });
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) {
      if (last) store_row(acc[r][j], bias == nullptr ? nullptr : bias + gs[j] * kCols, y + r * ldy + cols[j]);
      else _mm512_store_ps(parked + (r * G + j) * kCols, acc[r][j]);
    }
}

// Groups g .. g + G of all `rows` (7 to kInterleavedRows), chunk by chunk; during the last chunk the first block
// fetches the first chunk of the next G groups where this thread computes them (g_end: its range's end).
template <int G>
inline void interleaved(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                        int64_t N, int64_t g, int64_t g_end) {
  int64_t gs[G], cols[G];
  const uint16_t* wg[G];
  for (int j = 0; j < G; ++j) gs[j] = g + j, cols[j] = (g + j) * kCols, wg[j] = w + (g + j) * K * kCols;
  alignas(64) float parked[2][kRowBlock * G * kCols];  // each block's sums between chunks
  const uint16_t* x2 = x + kRowBlock * K;  // the second block's rows
  uint16_t* y2 = y + kRowBlock * N;
  const int64_t pairs = K / 2;
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += kChunk) {
    const int64_t kp1 = std::min(pairs, kp0 + kChunk);
    const bool first = kp0 == 0, last = kp1 == pairs;
    const char* fetch[G];
    const bool fetching = !last || g + 2 * G <= g_end;
    for (int j = 0; j < G; ++j)
      fetch[j] = !fetching ? nullptr
                           : reinterpret_cast<const char*>(last ? w + (g + G + j) * K * kCols : wg[j] + kp1 * 2 * kCols);
    if (fetching) block_chunk<kRowBlock, G, true>(x, K, wg, kp0, kp1, parked[0], first, last, bias, gs, y, N, cols, fetch);
    else block_chunk<kRowBlock, G, false>(x, K, wg, kp0, kp1, parked[0], first, last, bias, gs, y, N, cols, fetch);
#define SJ_SECOND(R) block_chunk<R, G, false>(x2, K, wg, kp0, kp1, parked[1], first, last, bias, gs, y2, N, cols, fetch)
    switch (rows - kRowBlock) {
      case 4: SJ_SECOND(4); break;
      case 3: SJ_SECOND(3); break;
      case 2: SJ_SECOND(2); break;
      default: SJ_SECOND(1); break;
    }
#undef SJ_SECOND
  }
}

// Column groups [g0, g1) of every row, four at a time and then the 1-3 left: chunked for 7 to kInterleavedRows
// rows (interleaved()), else in row blocks (groups()).
void gemm(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, const float* bias, uint16_t* y, int64_t N,
          int64_t g0, int64_t g1) {
  const bool chunked = rows > kRowBlock && rows <= kInterleavedRows;
  auto run = [&](auto groups_of_set, int64_t g) {
    constexpr int G = decltype(groups_of_set)::value;
    if (chunked) interleaved<G>(x, rows, K, w, bias, y, N, g, g1);
    else groups<G>(x, rows, K, w, bias, y, N, g, g1);
  };
  int64_t g = g0;
  for (; g + 4 <= g1; g += 4) run(std::integral_constant<int, 4>{}, g);
  switch (g1 - g) {
    case 3: run(std::integral_constant<int, 3>{}, g); break;
    case 2: run(std::integral_constant<int, 2>{}, g); break;
    case 1: run(std::integral_constant<int, 1>{}, g); break;
    default: break;
  }
}

// Groups listed in gs[0 .. n) of one row x, their 16 sums each to out[i * 16 ..]: the chains block() gives
// them in a full call (a grammar-masked row's allowed columns), eight at a time (independent chains hide
// the instruction's latency, which a lone chain would wait for at every k-pair).
void listed_groups(const uint16_t* x, int64_t K, const uint16_t* w, const float* bias, const int64_t* gs, int64_t n,
                   uint16_t* out) {
  constexpr int kListed = 8;
  int64_t cols[kListed];
  for (int j = 0; j < kListed; ++j) cols[j] = j * kCols;
  int64_t i = 0;
  for (; i + kListed <= n; i += kListed) block<1, kListed>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false);
  switch (n - i) {
    case 7: block<1, 7>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 6: block<1, 6>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 5: block<1, 5>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 4: block<1, 4>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 3: block<1, 3>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 2: block<1, 2>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    case 1: block<1, 1>(x, K, w, bias, gs + i, out + i * kCols, 0, cols, false); break;
    default: break;
  }
}

}  // namespace bf16_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace bf16_amx {

constexpr int64_t kTileRows = 16;

#include "amx_tile_config.h"

// Tiles 0-3: the float sums of up to four column groups (four independent chains: one tile product waits
// for the previous one into the same sums, ~40 cycles, which a lone chain would pay in full on a decode
// step's call); 4: 16 rows x 32 k of activations; 5-7: the groups' 32 k (the fourth group reuses 5).
// Every tile is 16 rows of 64 bytes.
constexpr int kGroupsPerPass = 4;

// The 16 lines of a B tile, fetched two tile products ahead of its load (past a group's end: the next group's
// first lines, or beyond the weight, where a prefetch does nothing).
constexpr int64_t kAheadK = 2 * kDepth;
inline void prefetch_block(const uint16_t* b) {
  for (int line = 0; line < 16; ++line) prefetch_l1(b + line * 2 * kCols);
}

// Group J of a pass: its next 32 k into its sums, B through tile B (the intrinsics take tile numbers as
// literals).
#define SJ_PRODUCT(J, B, wg)                                        \
  do {                                                              \
    if (prefetch) prefetch_block((wg) + (kb + kAheadK) * kCols);    \
    _tile_loadd(B, (wg) + kb * kCols, 64);                          \
    _tile_dpbf16ps(J, 4, B);                                        \
  } while (0)

// One 16-row tile of x (xt) against groups g .. g + G: sums[j] = that tile's float sums for group g + j; `l2`: lines
// of the next groups' weights to fetch into L2 as it goes (prefetch.h's L2Ahead; none by default). Step k of the K
// the tile sums over reads column k of xt (rows `lda` apart), or k - wrap_a from k = wrap_a on, and the weight's
// k, or k - wrap_b from k = wrap_b on: bf16x3's [hi | lo] activations and [hi; lo] weights read as [hi | hi | lo]
// and [hi; lo; hi]. A plain call has lda = wrap_a = wrap_b = K.
template <int G>
inline void pass(const uint16_t* xt, int64_t K, const uint16_t* wg, int64_t group_size, bool prefetch,
                 float (*sums)[kTileRows * kCols], L2Stream l2, int64_t lda, int64_t wrap_a, int64_t wrap_b) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kDepth) {
    l2.step();
    const int64_t kb = k < wrap_b ? k : k - wrap_b;
    _tile_loadd(4, xt + (k < wrap_a ? k : k - wrap_a), lda * 2);
    SJ_PRODUCT(0, 5, wg);
    if constexpr (G > 1) SJ_PRODUCT(1, 6, wg + group_size);
    if constexpr (G > 2) SJ_PRODUCT(2, 7, wg + 2 * group_size);
    if constexpr (G > 3) SJ_PRODUCT(3, 5, wg + 3 * group_size);
  }
#undef SJ_PRODUCT
  _tile_stored(0, sums[0], 64);
  if constexpr (G > 1) _tile_stored(1, sums[1], 64);
  if constexpr (G > 2) _tile_stored(2, sums[2], 64);
  if constexpr (G > 3) _tile_stored(3, sums[3], 64);
}

// Two 16-row tiles of x (xt0, xt1) against groups g .. g + G (G <= 2): sums0[j] and sums1[j] their float sums for group
// g + j. Each group's B tile is loaded once for both row tiles, where two passes would load it twice (the second
// time from L2, whose reads then outlast the products: bench/RESULTS.md, session 94). Tiles 0-3 the
// sums (row tile t, group j: tile 2 j + t), 4-5 the row tiles' 32 k, 6-7 the groups'. Every sum is still its tile
// products over k in order from zero, as pass() makes it: a row's bits do not depend on the pairing. (The tile
// intrinsics take tile numbers as literals.)
#define SJ_PAIR_PRODUCT(C0, C1, B, wg)                              \
  do {                                                              \
    if (prefetch) prefetch_block((wg) + (k + kAheadK) * kCols);     \
    _tile_loadd(B, (wg) + k * kCols, 64);                           \
    _tile_dpbf16ps(C0, 4, B);                                       \
    _tile_dpbf16ps(C1, 5, B);                                       \
  } while (0)

template <int G>
inline void pass_pair(const uint16_t* xt0, const uint16_t* xt1, int64_t K, const uint16_t* wg, int64_t group_size,
                      bool prefetch, float (*sums0)[kTileRows * kCols], float (*sums1)[kTileRows * kCols], L2Stream l2) {
  static_assert(G == 1 || G == 2, "two row tiles take at most two groups: 4 sums, 2 row tiles and 2 B tiles");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (G > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kDepth) {
    l2.step();
    _tile_loadd(4, xt0 + k, K * 2);
    _tile_loadd(5, xt1 + k, K * 2);
    SJ_PAIR_PRODUCT(0, 1, 6, wg);
    if constexpr (G > 1) SJ_PAIR_PRODUCT(2, 3, 7, wg + group_size);
  }
  _tile_stored(0, sums0[0], 64);
  _tile_stored(1, sums1[0], 64);
  if constexpr (G > 1) {
    _tile_stored(2, sums0[1], 64);
    _tile_stored(3, sums1[1], 64);
  }
}
#undef SJ_PAIR_PRODUCT

// The next pass's weights (groups [next, end), at most per_pass) for the `passes` tile passes after a pass's first
// tile to fetch into L2 (nothing when there is no next group or no later tile): those passes read the current
// groups from cache and would leave the memory idle, so the next groups' first tile then finds its weights in L2.
inline L2Ahead next_groups_ahead(const uint16_t* w, int64_t next, int64_t end, int64_t group_size, int64_t passes,
                                 int64_t K, int64_t per_pass = kGroupsPerPass) {
  L2Ahead ahead;
  if (next >= end || passes <= 0) return ahead;
  ahead.base = reinterpret_cast<const char*>(w + next * group_size);
  ahead.lines = std::min<int64_t>(per_pass, end - next) * group_size * 2 / 64;
  ahead.passes = passes;
  ahead.steps = K / kDepth;
  return ahead;
}

// Column groups [g0, g1) of every row; xp: the rows padded with zero rows to `tiles` whole 16-row tiles. One tile
// goes against four groups at a time (pass). Two or three (a verify's tree of 17-48 nodes) go against two groups at a
// time, a pair of tiles in one pass (pass_pair) and a third alone, so that each group's weights are loaded once for
// the pair. Four or more keep single passes: pairs there measured no faster (RESULTS, session 94).
void gemm(const uint16_t* xp, int64_t rows, int64_t tiles, int64_t K, const uint16_t* w, const float* bias,
          uint16_t* y, int64_t N, int64_t g0, int64_t g1) {
  configure_full_tiles();
  alignas(64) float sums[kGroupsPerPass][kTileRows * kCols];
  const int64_t group_size = K * kCols;
  const bool paired = tiles == 2 || tiles == 3;
  const int64_t per_pass = paired ? 2 : kGroupsPerPass, passes = paired ? (tiles + 1) / 2 : tiles;
  // Tile t's float sums of its `groups` groups (from sums[first ..]), rounded and stored.
  auto store = [&](int64_t g, int64_t groups, int64_t t, int64_t first) {
    const int64_t valid = std::min(kTileRows, rows - t * kTileRows);
    for (int64_t j = 0; j < groups; ++j) {
      const int64_t col = (g + j) * kCols;
      for (int64_t r = 0; r < valid; ++r)
        bf16_avx512::store_row(_mm512_load_ps(sums[first + j] + r * kCols), bias == nullptr ? nullptr : bias + col,
                               y + (t * kTileRows + r) * N + col);
    }
  };
  for (int64_t g = g0; g < g1; g += per_pass) {
    const int64_t groups = std::min<int64_t>(per_pass, g1 - g);
    const uint16_t* wg = w + g * group_size;
    const L2Ahead ahead = next_groups_ahead(w, g + per_pass, g1, group_size, passes - 1, K, per_pass);
    for (int64_t t = 0, p = 0; t < tiles; ++p) {
      const uint16_t* xt = xp + t * kTileRows * K;
      const bool prefetch = t == 0;  // later passes find the groups' weights in cache, and fetch the next groups'
      const L2Stream l2 = ahead.part(p - 1);
      if (paired && t + 1 < tiles) {
        if (groups == 2) pass_pair<2>(xt, xt + kTileRows * K, K, wg, group_size, prefetch, sums, sums + 2, l2);
        else pass_pair<1>(xt, xt + kTileRows * K, K, wg, group_size, prefetch, sums, sums + 2, l2);
        store(g, groups, t, 0);
        store(g, groups, t + 1, 2);
        t += 2;
        continue;
      }
      switch (groups) {
        case 4: pass<4>(xt, K, wg, group_size, prefetch, sums, l2, K, K, K); break;
        case 3: pass<3>(xt, K, wg, group_size, prefetch, sums, l2, K, K, K); break;
        case 2: pass<2>(xt, K, wg, group_size, prefetch, sums, l2, K, K, K); break;
        default: pass<1>(xt, K, wg, group_size, prefetch, sums, l2, K, K, K); break;
      }
      store(g, groups, t, 0);
      t += 1;
    }
  }
  _tile_release();
}

// bf16x3_gemm's product: gemm's passes over K = 3 K0 with float32 outputs (+ bias). xp: each row's [hi | lo]
// (2 K0 bf16) and w: each group's [hi; lo] (2 K0 k), read as [hi | hi | lo] against [hi; lo; hi], so that neither
// holds a copy (a third fewer bytes to write and to stream). The rows go in blocks whose activations
// (~1 MB) stay in L2 while every column group of [g0, g1) passes over them: these calls are thousands of rows
// long, where gemm's order would fetch all of them once per four column groups. A row's sums are its tile's
// passes over the whole of K in any case, so the blocking changes no bits.
void gemm_float(const uint16_t* xp, int64_t rows, int64_t tiles, int64_t K, const uint16_t* w, const float* bias,
                float* y, int64_t N, int64_t g0, int64_t g1) {
  configure_full_tiles();
  alignas(64) float sums[kGroupsPerPass][kTileRows * kCols];
  const int64_t wrap = K / 3, lda = 2 * wrap, group_size = lda * kCols;
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 20) / (kTileRows * lda * 2));
  for (int64_t t0 = 0; t0 < tiles; t0 += block) {
    const int64_t t1 = std::min(tiles, t0 + block);
    for (int64_t g = g0; g < g1; g += kGroupsPerPass) {
      const int64_t groups = std::min<int64_t>(kGroupsPerPass, g1 - g);
      const uint16_t* wg = w + g * group_size;
      const L2Ahead ahead = next_groups_ahead(w, g + kGroupsPerPass, g1, group_size, t1 - t0 - 1, K);
      for (int64_t t = t0; t < t1; ++t) {
        const uint16_t* xt = xp + t * kTileRows * lda;
        const bool prefetch = t == t0;  // the block's later tiles find the groups' weights in cache
        const L2Stream l2 = ahead.part(t - t0 - 1);
        switch (groups) {
          case 4: pass<4>(xt, K, wg, group_size, prefetch, sums, l2, lda, wrap, 2 * wrap); break;
          case 3: pass<3>(xt, K, wg, group_size, prefetch, sums, l2, lda, wrap, 2 * wrap); break;
          case 2: pass<2>(xt, K, wg, group_size, prefetch, sums, l2, lda, wrap, 2 * wrap); break;
          default: pass<1>(xt, K, wg, group_size, prefetch, sums, l2, lda, wrap, 2 * wrap); break;
        }
        const int64_t valid = std::min(kTileRows, rows - t * kTileRows);
        for (int64_t j = 0; j < groups; ++j) {
          const int64_t col = (g + j) * kCols;
          const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + col);
          for (int64_t r = 0; r < valid; ++r)
            _mm512_storeu_ps(y + (t * kTileRows + r) * N + col, _mm512_add_ps(_mm512_load_ps(sums[j] + r * kCols), b));
        }
      }
    }
  }
  _tile_release();
}

// bf16x3's activations: row i of x (K floats) as [hi | lo] (2K bf16), hi = x rounded to bf16 (to nearest even)
// and lo = x - hi rounded to bf16; lo is 0 where x - hi is not a number (x infinite or NaN: hi carries it).
void split_rows(const float* x, int64_t K, uint16_t* out, int64_t r0, int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* xr = x + i * K;
    uint16_t* o = out + i * 2 * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      const __m256i hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      const __m512 diff = _mm512_sub_ps(v, back);
      const __m512 rest = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(diff, diff, _CMP_ORD_Q), diff);
      const __m256i lo = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + K + k), lo);
    }
  }
}

}  // namespace bf16_amx
#pragma GCC pop_options

namespace {

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bf16");
    case kAmx: {
      // Asked once: CPUID traps to the hypervisor on a virtual machine, and every call checks its isa.
      static const bool ready = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;  // CPUID leaf 7: EDX bit 22 AMX-BF16
        return isa_supported(kAvx512Bf16) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) &&
               specjet_cpu::amx_permitted();
      }();
      return ready;
    }
    default: return false;
  }
}

}  // namespace

namespace specjet_cpu {

bool bf16_gemm_isa_supported(int64_t isa) { return isa_supported(isa); }

bool amx_bf16_supported() { return isa_supported(kAmx); }

namespace {

// bf16_gemm's argument checks; returns the weight's column groups.
int64_t check_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                   int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "bf16_gemm: instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_gemm: x must be a contiguous 2-D bfloat16 CPU tensor");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(2) == kCols &&
                  w.size(3) == 2, "bf16_gemm: w must be a contiguous bfloat16 [N / 16, K / 2, 16, 2] tensor");
  const int64_t K = x.size(1), groups = w.size(0), N = groups * kCols;
  TORCH_CHECK(w.size(1) * 2 == K && K % kDepth == 0, "bf16_gemm: x has ", K, " columns, the weight takes ",
              w.size(1) * 2, " (a multiple of ", kDepth, ")");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bf16_gemm: bias must be a contiguous float32 tensor of ", N, " elements");
  }
  return groups;
}

// y[rows, N] (bf16) = x[rows, K] @ W (+ bias) for checked operands, on the instruction set's kernel; `fused` row ops
// in the VDPBF16PS kernel's team (cpu_ops.h's run_team: each thread its rows of x before, its rows of y after), or
// on the calling thread around a call of fewer rows than threads or on AMX tiles (whose call pads x first).
void gemm_rows(const uint16_t* xp, int64_t rows, int64_t K, const uint16_t* wp, const float* bp, uint16_t* yp,
               int64_t groups, int64_t isa, const FusedRows& fused = {}) {
  const int64_t N = groups * kCols;
  // ~64k weights per thread at least; a thread's groups run four at a time (split by group, not by four: 36
  // groups are 18 and 18, not 20 and 16).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kCols * K));
  if (fused.before || fused.after) {
    const int64_t team = std::min<int64_t>(at::get_num_threads(), (groups + grain - 1) / grain);
    if (isa == kAvx512Bf16 && team > 1 && rows >= team && !at::in_parallel_region()) {
      run_team(team, rows, groups, fused, [](int64_t, int64_t, int64_t, int64_t) {},
               [&](int64_t g0, int64_t g1) { bf16_avx512::gemm(xp, rows, K, wp, bp, yp, N, g0, g1); });
      return;
    }
    run_around(rows, fused, [&] { gemm_rows(xp, rows, K, wp, bp, yp, groups, isa); });
    return;
  }
  if (isa == kAmx) {
    // A tile reads 16 rows: a call whose rows are not whole tiles gets a copy with zero rows after them.
    const int64_t tiles = (rows + bf16_amx::kTileRows - 1) / bf16_amx::kTileRows, padded_rows = tiles * bf16_amx::kTileRows;
    std::unique_ptr<uint16_t[]> padded;
    const uint16_t* xt = xp;
    if (padded_rows != rows) {
      padded.reset(new uint16_t[padded_rows * K]);
      std::memcpy(padded.get(), xp, rows * K * sizeof(uint16_t));
      std::memset(padded.get() + rows * K, 0, (padded_rows - rows) * K * sizeof(uint16_t));
      xt = padded.get();
    }
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      bf16_amx::gemm(xt, rows, tiles, K, wp, bp, yp, N, g0, g1);
    });
  } else {
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      bf16_avx512::gemm(xp, rows, K, wp, bp, yp, N, g0, g1);
    });
  }
}

}  // namespace

void bf16_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                    int64_t isa, torch::Tensor& y, const FusedRows& fused) {
  const int64_t groups = check_gemm(x, w, bias, isa), rows = x.size(0);
  fit_output(y, {rows, groups * kCols}, x.options());
  if (rows == 0) return;
  gemm_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, x.size(1),
            reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bias ? bias->data_ptr<float>() : nullptr,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), groups, isa, fused);
}

void bf16x3_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      torch::Tensor& y) {
  TORCH_CHECK(isa_supported(kAmx), "bf16x3_gemm: needs AMX tiles, which this CPU (or this process) does not have");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "bf16x3_gemm: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(2) == kCols &&
                  w.size(3) == 2, "bf16x3_gemm: w must be a contiguous bfloat16 [N / 16, K, 16, 2] tensor");
  const int64_t rows = x.size(0), K = x.size(1), groups = w.size(0), N = groups * kCols;
  TORCH_CHECK(K % kDepth == 0 && w.size(1) == K, "bf16x3_gemm: x has ", K, " columns (a multiple of ", kDepth,
              " is needed), the weight takes ", w.size(1));
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bf16x3_gemm: bias must be a contiguous float32 tensor of ", N, " elements");
  }
  fit_output(y, {rows, N}, x.options());
  if (rows == 0) return;
  const int64_t tiles = (rows + bf16_amx::kTileRows - 1) / bf16_amx::kTileRows, K2 = 2 * K, K3 = 3 * K;
  std::unique_ptr<uint16_t[]> split(new uint16_t[tiles * bf16_amx::kTileRows * K2]);
  std::memset(split.get() + rows * K2, 0, (tiles * bf16_amx::kTileRows - rows) * K2 * sizeof(uint16_t));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / K), [&](int64_t r0, int64_t r1) {
    bf16_amx::split_rows(xp, K, split.get(), r0, r1);
  });
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kCols * K3));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    bf16_amx::gemm_float(split.get(), rows, tiles, K3, wp, bp, yp, N, g0, g1);
  });
}

torch::Tensor bf16x3_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  torch::Tensor y;
  bf16x3_gemm_into(x, w, bias, y);
  return y;
}

torch::Tensor bf16_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        int64_t isa) {
  torch::Tensor y;
  bf16_gemm_into(x, w, bias, isa, y);
  return y;
}

torch::Tensor bf16_gemm_masked(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               int64_t isa, const torch::Tensor& bitmask, const torch::Tensor& masked,
                               int64_t max_allowed) {
  const int64_t groups = check_gemm(x, w, bias, isa), rows = x.size(0), K = x.size(1), N = groups * kCols;
  TORCH_CHECK(isa == kAvx512Bf16, "bf16_gemm_masked: a row's allowed columns alone are computed on the VDPBF16PS "
              "kernel (instruction set ", static_cast<int64_t>(kAvx512Bf16), "), not ", isa);
  check_head_mask(bitmask, masked, rows, "bf16_gemm_masked");
  const MaskedRows split = split_masked_rows(reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()),
                                             bitmask.size(1), masked.data_ptr<bool>(), rows, N, max_allowed);
  constexpr int64_t kItem = 8;  // groups of a work item: each group's 16 sums made whole (the chains a full call gives)
  const ListedGroups groups_of = listed_groups_of(split, kCols, kItem);
  auto y = torch::empty({rows, N}, x.options().dtype(torch::kFloat32));
  if (rows == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // The other rows through bf16_gemm's kernel: a row's result does not depend on which rows share a call.
  dense_rows_through<uint16_t, uint16_t>(
      split.dense, xp, K, N, yp, [&](const uint16_t* xs, int64_t n, uint16_t* ys) { gemm_rows(xs, n, K, wp, bp, ys, groups, isa); },
      bf16_to_float);
  if (split.sparse.empty()) return y;
  std::vector<uint16_t> sums(groups_of.list.size() * kCols);  // every listed group's 16 sums
  at::parallel_for(0, static_cast<int64_t>(groups_of.item_row.size()), 4, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = groups_of.item_row[e], g = groups_of.item_start[e];
      const int64_t n = std::min(kItem, groups_of.at[i + 1] - g);
      bf16_avx512::listed_groups(xp + split.sparse[i] * K, K, wp, bp, groups_of.list.data() + g, n,
                                 sums.data() + g * kCols);
    }
  });
  fill_sparse_rows(split, groups_of, kCols, yp, N,
                   [&](int64_t g, int64_t c) { return bf16_to_float(sums[g * kCols + c % kCols]); });
  return y;
}

}  // namespace specjet_cpu
