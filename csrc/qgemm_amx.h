// The AMX int8 kernels of qgemm.cpp (included there inside `namespace qgemm_amx`, compiled for AVX-512 VNNI
// plus AMX tiles, after the AVX-512 body whose vector helpers it uses).
//
// Why: with several rows (a speculative verify of 8-64 tokens) the VNNI kernels are bound by their dot-product
// instructions, one per 4 codes, row and 16 columns, not by reading the weights. One AMX tile product
// (TDPBSUD / TDPBSSD) computes a whole block's integer sums for 16 rows and 16 columns: C[row][col] =
// Σ_k xq[row][k] * q[k][col] over the block's 32 codes, the very sums the VNNI kernels build.
//
// The weights' packed layout already is a tile's B operand: a block of a 16-column group is 8 rows of
// 64 bytes, row s holding codes 4s..4s+3 of each column (int8: as stored; Q4_1: the nibbles unpacked into a
// scratch block). The A operand is 16 rows of the block's 32 quantized activations, read in place at stride K
// (the activation buffer is padded with zero rows to a whole tile). The C tile goes to memory and each row of
// it (16 columns' sums, one vector) takes the same float steps, in the same order, as in the VNNI kernels
// (qgemm_body.h), so every output element has the bits of every other build, whatever the row count.

#include "amx_tile_config.h"

constexpr int kTileRows = 16;

// GCC's AMX intrinsics are asm statements that clobber all memory (tile stores) or declare none (tile loads):
// the first makes the compiler keep every accumulator in memory around each block, the second would let it
// move a store after the tile load that reads it. These name the memory each one reads or writes.
struct TileBytes { char b[kTileRows * 64]; };
struct AnyBytes { char b[1 << 30]; };
#define SJ_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%1,%2,1), %%tmm" #t : : "m"(*(const AnyBytes*)(base)), "r"(base), "r"((long)(stride)))
#define SJ_TILE_STORE(t, base) \
  asm volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(TileBytes*)(base)) : "r"(base), "r"(64L))
#define SJ_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define SJ_TILE_DPBSUD(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define SJ_TILE_DPBSSD(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// Tile registers are per thread: each thread of a call loads this configuration before its first product
// and releases the tiles after its last (so a context switch does not save 8 KB of idle tile state).
static inline void configure_tiles() {
  TileConfig cfg;
  for (int slot = 0; slot < 2; ++slot) {
    cfg.rows[3 * slot] = kTileRows, cfg.colsb[3 * slot] = 64;          // C: 16 rows x 16 int32 sums
    cfg.rows[3 * slot + 1] = kTileRows, cfg.colsb[3 * slot + 1] = kBlock;  // A: 16 rows x a block of activations
    cfg.rows[3 * slot + 2] = kBlock / 4, cfg.colsb[3 * slot + 2] = 64;     // B: the block's codes, 4 per column
  }
  load_tile_config(cfg);
}

// One 16-column group of a packed Q4_1 weight. prepare(b, slot) unpacks block b's nibbles to bytes (the B
// operand) into the slot's buffer, a block ahead of the tile load that reads them (a tile load straight
// after the stores waits for them).
struct AmxQ41 {
  static constexpr bool kSignedCodes = false;
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  alignas(64) uint8_t codes[2][8 * 64];
  struct Scales {
    vecf d, m;
  };
  inline __attribute__((always_inline)) void prepare(int64_t b, int slot) {
    prefetch_q41_block(qs, d, m, b);
    for (int c = 0; c < 4; ++c) {
      const veci raw = i_load(qs + (b * 4 + c) * 64);
      _mm512_store_si512(codes[slot] + c * 64, i_low_nibbles(raw));
      _mm512_store_si512(codes[slot] + (c + 4) * 64, i_high_nibbles(raw));
    }
  }
  inline const void* operand(int64_t, int slot) const { return codes[slot]; }
  inline Scales scales(int64_t b) const { return {f_from_half(d + b * kGroup), f_from_half(m + b * kGroup)}; }
  static inline vecf add_block(vecf acc, veci isum, float dx, float sx, const Scales& sc) {
    acc = f_fma(f_from_int(isum), f_mul(sc.d, f_set1(dx)), acc);
    return f_fma(sc.m, f_set1(sx), acc);
  }
};

// One 16-column group of a packed int8 weight: its blocks are B operands as stored.
struct AmxInt8 {
  static constexpr bool kSignedCodes = true;
  const int8_t* q;
  const uint16_t* s;  // [K / group][16] fp16
  int64_t blocks_per_group;
  struct Scales {
    vecf s;
  };
  inline void prepare(int64_t b, int) const {
    prefetch_int8_block(q, b);
  }
  inline const void* operand(int64_t b, int) const { return q + b * 512; }
  inline Scales scales(int64_t b) const { return {f_from_half(s + (b / blocks_per_group) * kGroup)}; }
  static inline vecf add_block(vecf acc, veci isum, float dx, float, const Scales& sc) {
    return f_fma(f_from_int(isum), f_mul(sc.s, f_set1(dx)), acc);
  }
};

// Block `blk`'s sums (in `sums`) into the rows' float accumulators, in the VNNI kernels' order.
template <int R, class Weights>
static inline __attribute__((always_inline)) void finish_block(const Weights& w, const QuantizedRows& x, int64_t r0,
                                                               int64_t blk, const int32_t* sums, vecf* acc) {
  const typename Weights::Scales sc = w.scales(blk);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int64_t rb = (r0 + r) * x.nb + blk;
    acc[r] = Weights::add_block(acc[r], i_load(sums + r * kGroup), x.dx[rb], x.sx[rb], sc);
  }
}

// Block `blk`'s products into tile C of a slot (C, A, B: tiles 0-2 for slot 0, 3-5 for slot 1; GCC's tile
// intrinsics take literal register numbers, hence a macro).
#define SJ_AMX_ISSUE(tc, ta, tb, blk, slot)                                              \
  do {                                                                                   \
    SJ_TILE_LOAD(ta, x.xq + r0 * x.K + (blk) * kBlock, x.K);                             \
    SJ_TILE_LOAD(tb, w.operand(blk, slot), 64);                                          \
    SJ_TILE_ZERO(tc);                                                                    \
    if constexpr (Weights::kSignedCodes) SJ_TILE_DPBSSD(tc, ta, tb); else SJ_TILE_DPBSUD(tc, ta, tb); \
  } while (0)

// Rows [r0, r0 + R) of one column group, every block of K, then the bias; `valid` columns are stored. The
// A tile always reads 16 rows (the padding's zeros past the last row); only R of C's rows are used.
// Three stages overlap, two blocks apart: block b + 1's tile product, block b's sums stored from its tile,
// and block b - 1's sums (stored an iteration earlier, so no load waits on a tile store) finished in the
// vector units. Slots alternate by block parity; the loop takes two blocks per turn to name the tiles.
template <int R, class Weights>
static inline void tile(Weights& w, const QuantizedRows& x, int64_t r0, const float* bias, float* y, int64_t ldy,
                        int valid) {
  alignas(64) int32_t sums[2][kTileRows * kGroup];
  vecf acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = f_zero();
  const int64_t nb = x.nb;
  w.prepare(0, 0);
  if (nb > 1) w.prepare(1, 1);
  SJ_AMX_ISSUE(0, 1, 2, 0, 0);
  for (int64_t b = 0; b < nb; b += 2) {
    if (b + 1 < nb) SJ_AMX_ISSUE(3, 4, 5, b + 1, 1);
    if (b + 2 < nb) w.prepare(b + 2, 0);
    SJ_TILE_STORE(0, sums[0]);
    if (b >= 1) finish_block<R>(w, x, r0, b - 1, sums[1], acc);
    if (b + 1 >= nb) break;
    if (b + 2 < nb) SJ_AMX_ISSUE(0, 1, 2, b + 2, 0);
    if (b + 3 < nb) w.prepare(b + 3, 1);
    SJ_TILE_STORE(3, sums[1]);
    finish_block<R>(w, x, r0, b, sums[0], acc);
  }
  finish_block<R>(w, x, r0, nb - 1, sums[(nb - 1) & 1], acc);
  store_rows<R>(acc, bias, y, r0, ldy, valid);  // the AVX-512 body's (16 lanes: one column group)
}
#undef SJ_AMX_ISSUE

// The rows of one column group: whole 16-row tiles, then the rest on tiles too if there are enough of them
// (else the caller's VNNI kernel takes them: the same bits).
template <class Weights>
static void column_group(Weights& w, const QuantizedRows& x, int64_t tiled_rows, const float* bias, float* y,
                         int64_t ldy, int valid) {
  int64_t r = 0;
  for (; r + kTileRows <= tiled_rows; r += kTileRows) tile<kTileRows>(w, x, r, bias, y, ldy, valid);
  switch (tiled_rows - r) {
#define SJ_AMX_REST(n) case n: tile<n>(w, x, r, bias, y, ldy, valid); break;
    SJ_AMX_REST(1) SJ_AMX_REST(2) SJ_AMX_REST(3) SJ_AMX_REST(4) SJ_AMX_REST(5) SJ_AMX_REST(6) SJ_AMX_REST(7)
    SJ_AMX_REST(8) SJ_AMX_REST(9) SJ_AMX_REST(10) SJ_AMX_REST(11) SJ_AMX_REST(12) SJ_AMX_REST(13)
    SJ_AMX_REST(14) SJ_AMX_REST(15)
#undef SJ_AMX_REST
    default: break;
  }
}

// Fewer rows than these a tile product does not pay for (the tile store and reload of every block's sums
// cost more than the VNNI instructions they replace; Q4_1 also unpacks its nibbles): measured per format,
// bench/RESULTS.md session 39.
constexpr int64_t kQ41MinRows = 12;
constexpr int64_t kInt8MinRows = 8;

// The rows the tiles take: the whole tiles, and the rest if it is `min_rows` or more.
inline int64_t tiled_rows(int64_t rows, int64_t min_rows) {
  const int64_t whole = rows / kTileRows * kTileRows;
  return rows - whole >= min_rows ? rows : whole;
}

// Columns [g0 * 16, g1 * 16) of y (those below N), every row; x.xq padded to a whole number of 16-row tiles.
static void q4_1(const QuantizedRows& x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* bias,
                 float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t tiled = tiled_rows(x.rows, kQ41MinRows);
  const QuantizedRows rest = rows_from(x, tiled);
  configure_tiles();
  AmxQ41 w;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t col = g * kGroup;
    w.qs = qs + g * x.nb * kGroup * 16;
    w.d = d + g * x.nb * kGroup;
    w.m = m + g * x.nb * kGroup;
    column_group(w, x, tiled, bias ? bias + col : nullptr, y + col, N, static_cast<int>(std::min<int64_t>(kGroup, N - col)));
    if (rest.rows > 0) qgemm_avx512::q4_1(rest, qs, d, m, bias, y + tiled * N, N, g, g + 1);
  }
  _tile_release();
}

static void int8(const QuantizedRows& x, const int8_t* q, const uint16_t* s, const int32_t* wsum, int64_t group,
                 const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t tiled = tiled_rows(x.rows, kInt8MinRows);
  const QuantizedRows rest = rows_from(x, tiled);
  configure_tiles();
  AmxInt8 w;
  w.blocks_per_group = group / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t col = g * kGroup;
    w.q = q + g * x.nb * kGroup * kBlock;
    w.s = s + g * (x.K / group) * kGroup;
    column_group(w, x, tiled, bias ? bias + col : nullptr, y + col, N, static_cast<int>(std::min<int64_t>(kGroup, N - col)));
    if (rest.rows > 0) qgemm_avx512::int8(rest, q, s, wsum, group, bias, y + tiled * N, N, g, g + 1);
  }
  _tile_release();
}

// Whether a call of this many rows is worth the tiles at all.
inline bool worth_tiles(bool q4_1, int64_t rows) { return rows >= (q4_1 ? kQ41MinRows : kInt8MinRows); }
