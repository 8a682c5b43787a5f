// The tile kernels of qgemm.cpp, compiled once per instruction set: qgemm.cpp includes this file
// inside a namespace under `#pragma GCC target(...)` with SJ_VEC set to 16 (AVX-512 VNNI) or 8 (AVX2).
//
// Layout (kernels/dot_layout.py packs it): a vector lane is one output column; a weight vector holds
// 4 consecutive codes of each of SJ_VEC columns, so one integer dot-product instruction multiplies
// them by 4 broadcast int8 activations and adds the 4 products into each column's int32 lane. Eight
// such steps sum a whole 32-weight block exactly in integers; then, per block, the float part:
//   acc = fma(float(isum), d * dx, acc); acc = fma(m, sx, acc)      (Q4_1: w = d q + m)
//   acc = fma(float(isum), s * dx, acc)                            (int8: w = s q)
// with dx the row's activation scale of the block and sx = dx * Σ xq its quantized inputs' sum.
//
// Batch invariance and one result for every build: the integer sums are exact, and each output
// element then takes the same float operations in the same order (one lane, block by block) in the
// AVX-512 build, the AVX2 build and the scalar one, whatever the row or thread count.

#if SJ_VEC == 16
using vecf = __m512;
using veci = __m512i;
static inline vecf f_zero() { return _mm512_setzero_ps(); }
static inline vecf f_set1(float a) { return _mm512_set1_ps(a); }
static inline vecf f_fma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vecf f_mul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
static inline vecf f_add(vecf a, vecf b) { return _mm512_add_ps(a, b); }
static inline vecf f_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void f_store(float* p, vecf a) { _mm512_storeu_ps(p, a); }
static inline vecf f_from_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline vecf f_from_int(veci a) { return _mm512_cvtepi32_ps(a); }
static inline veci i_load(const void* p) { return _mm512_loadu_si512(p); }
static inline veci i_bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
static inline veci i_low_nibbles(veci b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
static inline veci i_high_nibbles(veci b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }

static inline veci i_zero() { return _mm512_setzero_si512(); }
// A block's Σ q * xq in 8 steps of 4 codes per lane. Q4_1: q the unsigned 4-bit codes times the
// row's int8 activations xq.
static inline veci q41_step(veci acc, veci w, const int8_t* xq, const uint8_t*) {
  return _mm512_dpbusd_epi32(acc, w, i_bcast4(xq));
}
static inline veci q41_finish(veci acc) { return acc; }
// Signed int8 codes: VNNI multiplies unsigned by signed bytes, so the activations go in as xq + 128
// (xu) and 128 * Σ q (wsum128, packed with the weights) comes back off.
static inline veci int8_step(veci acc, veci w, const int8_t*, const uint8_t* xu) {
  return _mm512_dpbusd_epi32(acc, i_bcast4(xu), w);
}
static inline veci int8_finish(veci acc, veci wsum128) { return _mm512_sub_epi32(acc, wsum128); }
static inline veci i_wsum128(const int32_t* p) { return _mm512_slli_epi32(i_load(p), 7); }
#else
using vecf = __m256;
using veci = __m256i;
static inline vecf f_zero() { return _mm256_setzero_ps(); }
static inline vecf f_set1(float a) { return _mm256_set1_ps(a); }
static inline vecf f_fma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vecf f_mul(vecf a, vecf b) { return _mm256_mul_ps(a, b); }
static inline vecf f_add(vecf a, vecf b) { return _mm256_add_ps(a, b); }
static inline vecf f_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void f_store(float* p, vecf a) { _mm256_storeu_ps(p, a); }
static inline vecf f_from_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vecf f_from_int(veci a) { return _mm256_cvtepi32_ps(a); }
static inline veci i_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline veci i_bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
static inline veci i_low_nibbles(veci b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
static inline veci i_high_nibbles(veci b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }

static inline veci i_zero() { return _mm256_setzero_si256(); }
// Without VNNI: maddubs gives 16-bit sums of 2 products (|.| <= 2 * 15 * 127), eight of which still
// fit 16 bits (30480), so the block's 8 steps add in 16 bits and one madd widens them to 32.
static inline veci q41_step(veci acc, veci w, const int8_t* xq, const uint8_t*) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, i_bcast4(xq)));
}
static inline veci q41_finish(veci acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// Signed codes: maddubs(|q|, xq with q's sign) = q * xq per byte pair, <= 2 * 128 * 127 in 16 bits.
static inline veci int8_step(veci acc, veci w, const int8_t* xq, const uint8_t*) {
  const veci prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(i_bcast4(xq), w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}
static inline veci int8_finish(veci acc, veci) { return acc; }
static inline veci i_wsum128(const int32_t*) { return _mm256_setzero_si256(); }
#endif

constexpr int kVec = SJ_VEC;
constexpr int64_t kAhead = 16;  // blocks prefetched ahead (4 KB of Q4_1, 8 KB of int8)
constexpr int kLaneGroups = kGroup / kVec;  // vectors per packed group of 16 columns

// Block b + kAhead of a column group's packed weights (past the group's end: the next group's, which follow
// in memory): with many rows the compute per block is long enough to hide the memory read, if it is
// started early.
static inline void prefetch_q41_block(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t b) {
  for (int line = 0; line < 4; ++line) prefetch_l1(qs + (b + kAhead) * 256 + line * 64);
  if ((b & 1) == 0) {  // 32 bytes of scales and of minima a block: a line per two
    prefetch_l1(d + (b + kAhead) * kGroup);
    prefetch_l1(m + (b + kAhead) * kGroup);
  }
}
static inline void prefetch_int8_block(const int8_t* q, int64_t b) {
  for (int line = 0; line < 8; ++line) prefetch_l1(q + (b + kAhead) * 512 + line * 64);
}

// One lane group (kVec columns) of a packed Q4_1 weight: 4 chunks of 64 bytes per block, chunk c's
// low nibbles the codes of step c, its high nibbles those of step c + 4.
struct Q41Lanes {
  const uint8_t* qs;   // the group's blocks
  const uint16_t* d;   // [nb][16] fp16
  const uint16_t* m;
  int half;            // which kVec columns of the 16
  veci w[8];
  vecf dv, mv;
  inline void load(int64_t b) {
    prefetch_q41_block(qs, d, m, b);
    for (int c = 0; c < 4; ++c) {
      const veci raw = i_load(qs + (b * 4 + c) * 64 + half * kVec * 4);
      w[c] = i_low_nibbles(raw);
      w[c + 4] = i_high_nibbles(raw);
    }
    dv = f_from_half(d + b * kGroup + half * kVec);
    mv = f_from_half(m + b * kGroup + half * kVec);
  }
  inline veci step(veci acc, int s, const int8_t* xq, const uint8_t* xu) const { return q41_step(acc, w[s], xq, xu); }
  inline vecf add_block(vecf acc, veci isum, float dx, float sx) const {
    acc = f_fma(f_from_int(q41_finish(isum)), f_mul(dv, f_set1(dx)), acc);
    return f_fma(mv, f_set1(sx), acc);
  }
};

// Column group g's lanes `half` of a packed Q4_1 weight of nb blocks a group.
static inline Q41Lanes q41_lanes(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t nb, int64_t g, int half) {
  Q41Lanes lanes;
  lanes.qs = qs + g * nb * kGroup * 16;
  lanes.d = d + g * nb * kGroup;
  lanes.m = m + g * nb * kGroup;
  lanes.half = half;
  return lanes;
}

// One lane group of a packed int8 weight: 8 steps of 64 bytes per block, one fp16 scale per column
// and group of `blocks_per_group` blocks.
struct Int8Lanes {
  const int8_t* q;
  const uint16_t* s;        // [K / group][16] fp16
  const int32_t* wsum;      // [nb][16]: Σ q of each column's block
  int64_t blocks_per_group;
  int half;
  veci w[8];
  veci wsum128;
  vecf sv;
  inline void load(int64_t b) {
    prefetch_int8_block(q, b);
    prefetch_l1(wsum + (b + kAhead) * kGroup);  // a line of block sums a block, a stream of its own
    for (int st = 0; st < 8; ++st) w[st] = i_load(q + (b * 8 + st) * 64 + half * kVec * 4);
    wsum128 = i_wsum128(wsum + b * kGroup + half * kVec);
    // GGUF's Q8_0 has a scale a block: no 64-bit division a block then (it stalled the tile's issue).
    const int64_t scale_group = blocks_per_group == 1 ? b : b / blocks_per_group;
    sv = f_from_half(s + scale_group * kGroup + half * kVec);
  }
  inline veci step(veci acc, int s, const int8_t* xq, const uint8_t* xu) const { return int8_step(acc, w[s], xq, xu); }
  inline vecf add_block(vecf acc, veci isum, float dx, float) const {
    return f_fma(f_from_int(int8_finish(isum, wsum128)), f_mul(sv, f_set1(dx)), acc);
  }
};

// Rows r0 .. r0 + R of y from their accumulators plus the bias; `valid` of the kVec columns are stored.
template <int R>
static inline void store_rows(const vecf* acc, const float* bias, float* y, int64_t r0, int64_t ldy, int valid) {
  for (int r = 0; r < R; ++r) {
    float* out = y + (r0 + r) * ldy;
    if (valid == kVec) {
      f_store(out, bias ? f_add(acc[r], f_load(bias)) : acc[r]);
    } else {
      alignas(64) float tmp[kVec];
      f_store(tmp, acc[r]);
      for (int c = 0; c < valid; ++c) out[c] = tmp[c] + (bias ? bias[c] : 0.0f);
    }
  }
}

// R rows of one lane group, every block of K, then the bias; `valid` columns of the kVec are stored.
template <int R, class Lanes>
static inline void tile(Lanes& lanes, const QuantizedRows& x, int64_t r0, const float* bias, float* y, int64_t ldy,
                        int valid) {
  vecf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = f_zero();
  for (int64_t b = 0; b < x.nb; ++b) {
    lanes.load(b);
    // Steps outer, rows inner: the rows' integer chains are independent and interleave.
    veci isum[R];
    for (int r = 0; r < R; ++r) isum[r] = i_zero();
    const int64_t at = r0 * x.K + b * kBlock;
    for (int s = 0; s < 8; ++s)
      for (int r = 0; r < R; ++r) isum[r] = lanes.step(isum[r], s, x.xq + at + r * x.K + 4 * s, x.xu + at + r * x.K + 4 * s);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * x.nb + b;
      acc[r] = lanes.add_block(acc[r], isum[r], x.dx[rb], x.sx[rb]);
    }
  }
  store_rows<R>(acc, bias, y, r0, ldy, valid);
}

template <class Lanes>
static void lane_group(Lanes& lanes, const QuantizedRows& x, const float* bias, float* y, int64_t ldy, int valid) {
  int64_t r = 0;
  for (; r + kRows <= x.rows; r += kRows) tile<kRows>(lanes, x, r, bias, y, ldy, valid);
  switch (x.rows - r) {
    case 0: break;
    case 1: tile<1>(lanes, x, r, bias, y, ldy, valid); break;
    case 2: tile<2>(lanes, x, r, bias, y, ldy, valid); break;
    case 3: tile<3>(lanes, x, r, bias, y, ldy, valid); break;
#if SJ_VEC == 16
    case 4: tile<4>(lanes, x, r, bias, y, ldy, valid); break;
    case 5: tile<5>(lanes, x, r, bias, y, ldy, valid); break;
    case 6: tile<6>(lanes, x, r, bias, y, ldy, valid); break;
    case 7: tile<7>(lanes, x, r, bias, y, ldy, valid); break;
#endif
  }
}

#if SJ_VEC == 16
// A verify's Q4_1 call (kMultiMinRows rows or more) goes kMultiGroups column groups x kMultiRows rows a tile: each
// activation broadcast then feeds a VPDPBUSD per group, where `tile` gives each its own, and the groups' codes stay in
// L1 for the call's later row tiles. Per output element the same integer sums and the same float operations in the
// same order as `tile`: the same bits. Calls of fewer rows measured slower this way (bench/RESULTS.md, session 73).
constexpr int kMultiGroups = 3, kMultiRows = 4;
constexpr int64_t kMultiMinRows = 12;
// With `fetch_next` (a triple's first row tile) the next kMultiGroups groups, next in memory, are fetched a block of
// each per block: `tile`'s per-group prefetch runs past a group's end into the next group, which here is this tile's.
static inline void q4_1_multi_tile(const QuantizedRows& x, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                                   const float* bias, float* y, int64_t N, int64_t g, int64_t r0, bool fetch_next) {
  constexpr int C = kMultiGroups, RR = kMultiRows;
  vecf acc[C][RR];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < RR; ++r) acc[c][r] = f_zero();
  const uint8_t* gq[C];
  const uint16_t *gd[C], *gm[C];
  for (int c = 0; c < C; ++c) {
    gq[c] = qs + (g + c) * x.nb * kGroup * 16;
    gd[c] = d + (g + c) * x.nb * kGroup;
    gm[c] = m + (g + c) * x.nb * kGroup;
  }
  for (int64_t b = 0; b < x.nb; ++b) {
    if (fetch_next) {  // the next tile's groups (they follow these in memory), a block of each per block
      for (int c = 0; c < C; ++c) {
        const uint8_t* nq = gq[c] + C * x.nb * kGroup * 16 + b * 256;
        for (int line = 0; line < 4; ++line) prefetch_l1(nq + line * 64);
        if ((b & 1) == 0) {
          prefetch_l1(gd[c] + C * x.nb * kGroup + b * kGroup);
          prefetch_l1(gm[c] + C * x.nb * kGroup + b * kGroup);
        }
      }
    }
    veci isum[C][RR];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < RR; ++r) isum[c][r] = i_zero();
    const int64_t at = r0 * x.K + b * kBlock;
    for (int ch = 0; ch < 4; ++ch) {
      veci lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const veci raw = i_load(gq[c] + (b * 4 + ch) * 64);
        lo[c] = i_low_nibbles(raw);
        hi[c] = i_high_nibbles(raw);
      }
      for (int r = 0; r < RR; ++r) {
        const veci xl = i_bcast4(x.xq + at + r * x.K + 4 * ch);
        for (int c = 0; c < C; ++c) isum[c][r] = _mm512_dpbusd_epi32(isum[c][r], lo[c], xl);
        const veci xh = i_bcast4(x.xq + at + r * x.K + 4 * (ch + 4));
        for (int c = 0; c < C; ++c) isum[c][r] = _mm512_dpbusd_epi32(isum[c][r], hi[c], xh);
      }
    }
    for (int c = 0; c < C; ++c) {
      const vecf dv = f_from_half(gd[c] + b * kGroup), mv = f_from_half(gm[c] + b * kGroup);
      for (int r = 0; r < RR; ++r) {
        const int64_t rb = (r0 + r) * x.nb + b;
        acc[c][r] = f_fma(f_from_int(isum[c][r]), f_mul(dv, f_set1(x.dx[rb])), acc[c][r]);
        acc[c][r] = f_fma(mv, f_set1(x.sx[rb]), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = (g + c) * kGroup;
    store_rows<RR>(acc[c], bias ? bias + col : nullptr, y + col, r0, N, kVec);  // whole groups below N only
  }
}
#endif

// Columns [g0 * 16, g1 * 16) of y (those below N), every row.
static void q4_1(const QuantizedRows& x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* bias,
                 float* y, int64_t N, int64_t g0, int64_t g1) {
#if SJ_VEC == 16
  if (x.rows >= kMultiMinRows && wide_tiles()) {
    // whole tiles of 3 groups x 4 rows; then the leftover rows of those groups, and the leftover groups, as before
    const int64_t whole_rows = x.rows / kMultiRows * kMultiRows;
    int64_t g = g0;
    for (; g + kMultiGroups <= g1 && (g + kMultiGroups) * kGroup <= N; g += kMultiGroups) {
      for (int64_t r = 0; r < whole_rows; r += kMultiRows) q4_1_multi_tile(x, qs, d, m, bias, y, N, g, r, r == 0);
      if (whole_rows < x.rows) {
        const QuantizedRows rest = rows_from(x, whole_rows);
        for (int64_t gg = g; gg < g + kMultiGroups; ++gg) {  // whole groups below N: every column stored
          Q41Lanes lanes = q41_lanes(qs, d, m, x.nb, gg, 0);
          const int64_t col = gg * kGroup;
          lane_group(lanes, rest, bias ? bias + col : nullptr, y + whole_rows * N + col, N, kVec);
        }
      }
    }
    g0 = g;
  }
#endif
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < kLaneGroups; ++h) {
      const int64_t col = g * kGroup + h * kVec;
      if (col >= N) break;
      Q41Lanes lanes = q41_lanes(qs, d, m, x.nb, g, h);
      lane_group(lanes, x, bias ? bias + col : nullptr, y + col, N, static_cast<int>(std::min<int64_t>(kVec, N - col)));
    }
  }
}

static void int8(const QuantizedRows& x, const int8_t* q, const uint16_t* s, const int32_t* wsum, int64_t group,
                 const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < kLaneGroups; ++h) {
      const int64_t col = g * kGroup + h * kVec;
      if (col >= N) break;
      Int8Lanes lanes;
      lanes.q = q + g * x.nb * kGroup * kBlock;
      lanes.s = s + g * (x.K / group) * kGroup;
      lanes.wsum = wsum + g * x.nb * kGroup;
      lanes.blocks_per_group = group / kBlock;
      lanes.half = h;
      lane_group(lanes, x, bias ? bias + col : nullptr, y + col, N, static_cast<int>(std::min<int64_t>(kVec, N - col)));
    }
  }
}
