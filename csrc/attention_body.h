// The kernels of attention.cpp, compiled once per instruction set: attention.cpp includes this file
// inside a namespace under `#pragma GCC target(...)`. Lanes stay independent and every product-and-sum is
// one explicit fused multiply-add (nothing else is fused: -ffp-contract=off), so every build gives the same
// bits; only the speed differs. (Two builds give a bf16 pool their own bits: `amx`, SJ_AMX_SCORES, its scores on AMX
// tiles, asked for by name; `bf16dp`, SJ_BF16_SCORES, its scores and weights x V by VDPBF16PS, the default on CPUs
// with AVX-512 BF16. Within each, every path still computes alike.)

// Query tokens of one request handled together, with all the query heads of one KV head: each key is
// loaded and widened once for all of them.
constexpr int64_t kQueryTile = 8;
// Rows whose sums advance together (independent chains of adds).
constexpr int kRowBlock = 4;

// A score q . k is summed in kLanes float32 lanes, lane i adding the products of d = i, i + kLanes, ...
// in order, then the lanes in one fixed tree. The lane count is fixed, not the register width: a lanes_d
// is one AVX-512 register, two AVX2 or four SSE2 ones, and every build adds the same numbers in the
// same order. (Keys are read as they lie in the pool; a tile of many rows scores a block of them from a
// transposed copy in its scratch: score_keys_transposed.)
constexpr int kLanes = 16;
// Inlined always: these pass vectors around, which a call would put through memory.
#ifndef SJ_INLINE
#define SJ_INLINE inline __attribute__((always_inline))
#endif
typedef float vec_d __attribute__((vector_size(SJ_VEC_BYTES)));
constexpr int kVecLanes = SJ_VEC_BYTES / 4;
constexpr int kParts = kLanes / kVecLanes;
struct lanes_d {
  vec_d part[kParts];
};
SJ_INLINE lanes_d zero_lanes() {
  lanes_d a;
  for (int i = 0; i < kParts; ++i) a.part[i] = vec_d{};
  return a;
}
// Part by part: one copy of the whole struct goes through the stack in pieces that stall the reload.
SJ_INLINE lanes_d load_lanes(const float* p) {
  lanes_d a;
  for (int i = 0; i < kParts; ++i) std::memcpy(&a.part[i], p + i * kVecLanes, sizeof(vec_d));
  return a;
}
SJ_INLINE void store_lanes(float* p, const lanes_d& a) {
  for (int i = 0; i < kParts; ++i) std::memcpy(p + i * kVecLanes, &a.part[i], sizeof(vec_d));
}
// acc = fma(x, y, acc), lane by lane: one rounding per step in every build (the FMA instruction of the
// AVX-512 and AVX2 builds, std::fma's exact fused result in the base one), at half the vector operations of
// a product and a sum.
SJ_INLINE vec_d fused(vec_d x, vec_d y, vec_d acc) {
#if SJ_VEC_BYTES == 64
  return (vec_d)_mm512_fmadd_ps((__m512)x, (__m512)y, (__m512)acc);
#elif SJ_VEC_BYTES == 32
  return (vec_d)_mm256_fmadd_ps((__m256)x, (__m256)y, (__m256)acc);
#else
  for (int l = 0; l < kVecLanes; ++l) acc[l] = std::fma(x[l], y[l], acc[l]);
  return acc;
#endif
}
SJ_INLINE void mul_add(lanes_d& acc, const lanes_d& x, const lanes_d& y) {
  for (int i = 0; i < kParts; ++i) acc.part[i] = fused(x.part[i], y.part[i], acc.part[i]);
}
// The lanes of a vector, each x: a broadcast (vec_d{} + x would be an addition, kept under IEEE rules).
SJ_INLINE vec_d splat(float x) {
#if SJ_VEC_BYTES == 64
  return (vec_d)_mm512_set1_ps(x);
#elif SJ_VEC_BYTES == 32
  return (vec_d)_mm256_set1_ps(x);
#else
  return (vec_d)_mm_set1_ps(x);
#endif
}
// acc += w * x lane by lane, w a softmax weight's broadcast (never -0, so splat gives what vec_d{} + w did).
SJ_INLINE void scale_add(lanes_d& acc, vec_d w, const lanes_d& x) {
  for (int i = 0; i < kParts; ++i) acc.part[i] = fused(w, x.part[i], acc.part[i]);
}
SJ_INLINE float lane(const lanes_d& a, int i) { return a.part[i / kVecLanes][i % kVecLanes]; }
// Lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3): a halving tree, so each step is one
// vector add in every build (the lane extraction it replaces cost more than the dot product itself).
SJ_INLINE float sum_lanes(const lanes_d& a) {
  __m128 h4;
#if SJ_VEC_BYTES == 64
  const __m512 v = (__m512)a.part[0];
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
#elif SJ_VEC_BYTES == 32
  const __m256 h8 = _mm256_add_ps((__m256)a.part[0], (__m256)a.part[1]);
  h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
#else
  h4 = _mm_add_ps(_mm_add_ps((__m128)a.part[0], (__m128)a.part[2]), _mm_add_ps((__m128)a.part[1], (__m128)a.part[3]));
#endif
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));  // [h0 + h2, h1 + h3, ...]
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

// Keys scored together by score_keys: their lane sums go through one transposed tree of vector
// shuffles and adds that makes, for each key, the additions sum_lanes makes for it alone (the same
// bits, a quarter of the instructions). The base build scores key by key.
#if SJ_VEC_BYTES == 64
constexpr int64_t kKeyBlock = 16;
#elif SJ_VEC_BYTES == 32
constexpr int64_t kKeyBlock = 8;
#else
constexpr int64_t kKeyBlock = 1;
#endif

#if SJ_VEC_BYTES >= 32
// out[j] = sum_lanes(acc[j]) for j < kKeyBlock.
SJ_INLINE void sum_lanes_of_keys(const lanes_d* acc, float* out) {
#if SJ_VEC_BYTES == 64
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // lanes i + (i + 8): keys 2i | 2i + 1, 8 lanes each
    const __m512 a = (__m512)acc[2 * i].part[0], b = (__m512)acc[2 * i + 1].part[0];
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // lanes i + (i + 4): keys 4i .. 4i + 3, one 128-bit quarter each
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lanes i + (i + 2): quarter L holds keys 8i + L and 8i + 4 + L
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 0 + lane 1: quarter L holds keys L, 4 + L, 8 + L, 12 + L; then key order.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s));
#else
  __m256 h[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) h[i] = _mm256_add_ps((__m256)acc[i].part[0], (__m256)acc[i].part[1]);
  for (int i = 0; i < 4; ++i)  // lanes i + (i + 4): keys 2i | 2i + 1, one 128-bit half each
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // lanes i + (i + 2): half L holds keys 4i + L and 4i + 2 + L
    w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 0 + lane 1: half L holds keys L, 2 + L, 4 + L, 6 + L; then key order.
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
}

// out[j] = q . k_j for the kKeyBlock keys of kb (rows Dp apart, zero-padded like q).
SJ_INLINE void score_keys(const float* q, int64_t Dp, const float* kb, float* out) {
  lanes_d acc[kKeyBlock];
  for (int j = 0; j < kKeyBlock; ++j) acc[j] = zero_lanes();
  for (int64_t c = 0; c < Dp; c += kLanes) {
    const lanes_d ql = load_lanes(q + c);
    for (int j = 0; j < kKeyBlock; ++j) mul_add(acc[j], ql, load_lanes(kb + j * Dp + c));
  }
  sum_lanes_of_keys(acc, out);
}
#endif

#if SJ_VEC_BYTES == 64

// Tiles of at least this many rows score a block of keys from its transpose (`transpose_keys`): each lane of a
// score then sums key-parallel, one vector per lane, and the lanes' tree is kLanes - 1 vector additions per
// row and block, where score_keys shuffles every row's lanes across registers. The transpose, made once per
// block of keys, pays for itself over a few rows (a verify's or a prefill's tile; a decode step's 3 rows
// of a KV head stay with score_keys). Both make the same operations on every score: the same bits. Only the
// AVX-512 build has it: at 8 lanes a vector the transpose costs the AVX2 build more than its tree did.
constexpr int64_t kTransposedRows = 8;

// kt[d * kKeyBlock + j] = kd[j * Dp + d]: dimension d of the block's kKeyBlock keys in one vector (Dp a
// multiple of kKeyBlock), by square transposes of kKeyBlock keys x kKeyBlock dimensions in registers.
SJ_INLINE void transpose_keys(const float* kd, int64_t Dp, float* kt) {
  for (int64_t c = 0; c < Dp; c += 16) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane: elements 0, 1 (lo) or 2, 3 (hi) of keys 2i, 2i + 1
      const __m512 a = _mm512_loadu_ps(kd + (2 * i) * Dp + c), b = _mm512_loadu_ps(kd + (2 * i + 1) * Dp + c);
      t[2 * i] = _mm512_unpacklo_ps(a, b);
      t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
    }
    for (int a = 0; a < 4; ++a) {  // u[4a + e], lane L: dimension 4L + e of keys 4a .. 4a + 3
      u[4 * a] = _mm512_shuffle_ps(t[4 * a], t[4 * a + 2], 0x44);
      u[4 * a + 1] = _mm512_shuffle_ps(t[4 * a], t[4 * a + 2], 0xEE);
      u[4 * a + 2] = _mm512_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0x44);
      u[4 * a + 3] = _mm512_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0xEE);
    }
    for (int e = 0; e < 4; ++e) {  // dimensions e, 4 + e, 8 + e, 12 + e: lanes 0 .. 3 of u[e], u[4 + e], ...
      const __m512 v = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), w = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
      const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88), w2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
      _mm512_storeu_ps(kt + (c + e) * 16, _mm512_shuffle_f32x4(v, v2, 0x88));
      _mm512_storeu_ps(kt + (c + 8 + e) * 16, _mm512_shuffle_f32x4(v, v2, 0xDD));
      _mm512_storeu_ps(kt + (c + 4 + e) * 16, _mm512_shuffle_f32x4(w, w2, 0x88));
      _mm512_storeu_ps(kt + (c + 12 + e) * 16, _mm512_shuffle_f32x4(w, w2, 0xDD));
    }
  }
}

// Rows scored together from one transpose: each dimension's vector of keys is loaded once for them.
constexpr int kTransposedRowBlock = 4;

// out[r * ld_out + j] = q_r . k_j for R rows and the kKeyBlock keys of the block's transpose kt: lane i of a
// score adds q[i + kLanes c] * k_j[i + kLanes c] over c in order (one fused multiply-add each, from 0), as
// score_keys does; then the lanes' tree of sum_lanes: T_i = L_i + L_(i+8), U_i = T_i + T_(i+4), W_i = U_i +
// U_(i+2), W_0 + W_1. The four lanes of one U_i advance together (4 R independent chains of fused
// multiply-adds), so few lane sums are alive at once.
template <int R>
SJ_INLINE void score_keys_transposed(const float* q, int64_t Dp, const float* kt, float* out, int64_t ld_out) {
  auto quarter = [&](int i, vec_d* u) {  // U_i of the R rows
    constexpr int kOffsets[4] = {0, 8, 4, 12};  // L_i, L_(i+8), L_(i+4), L_(i+12)
    vec_d acc[4][R];
    for (int g = 0; g < 4; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = vec_d{};
    for (int64_t c = 0; c < Dp; c += kLanes)
      for (int g = 0; g < 4; ++g) {
        const int64_t d = c + i + kOffsets[g];
        vec_d k;
        std::memcpy(&k, kt + d * kKeyBlock, sizeof k);
        for (int r = 0; r < R; ++r) acc[g][r] = fused(splat(q[r * Dp + d]), k, acc[g][r]);
      }
    for (int r = 0; r < R; ++r) u[r] = (acc[0][r] + acc[1][r]) + (acc[2][r] + acc[3][r]);
  };
  vec_d w[2][R];
  for (int h = 0; h < 2; ++h) {
    vec_d u0[R], u2[R];
    quarter(h, u0);
    quarter(h + 2, u2);
    for (int r = 0; r < R; ++r) w[h][r] = u0[r] + u2[r];
  }
  for (int r = 0; r < R; ++r) {
    const vec_d sum = w[0][r] + w[1][r];
    std::memcpy(out + r * ld_out, &sum, sizeof sum);
  }
}

// The lane tree of two blocks' scores side by side, over n steps (dimensions, or bf16dp's pairs of them): lane chains
// L_l adding steps l, l + 16, .. from 0 (add(s, a): step s into the chains a[r][b] of every row and block), T =
// L_i + L_(i+8) and L_(i+4) + L_(i+12), U_i their sum, then (U_0 + U_2) + (U_1 + U_3): sum_lanes' additions for each
// score. A quarter's four lanes go in two halves, so 2 x R x 2 chains are alive at once.
template <int R, class AddStep>
SJ_INLINE void lane_tree_of_pairs(int64_t n, const AddStep& add, float* out, int64_t ld_out) {
  auto half = [&](int64_t i, int64_t o0, int64_t o1, vec_d (*t)[2]) {  // t[r][b] = L_(i+o0) + L_(i+o1), block b
    vec_d a0[R][2], a1[R][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b) a0[r][b] = a1[r][b] = vec_d{};
    for (int64_t c = 0; c < n; c += kLanes) {
      add(c + i + o0, a0);
      add(c + i + o1, a1);
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b) t[r][b] = a0[r][b] + a1[r][b];
  };
  vec_d u[4][R][2];
  for (int64_t i = 0; i < 4; ++i) {
    vec_d t0[R][2], t1[R][2];
    half(i, 0, 8, t0);
    half(i, 4, 12, t1);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b) u[i][r][b] = t0[r][b] + t1[r][b];
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 2; ++b) {
      const vec_d sum = (u[0][r][b] + u[2][r][b]) + (u[1][r][b] + u[3][r][b]);
      std::memcpy(out + r * ld_out + b * kKeyBlock, &sum, sizeof sum);
    }
}

// score_keys_transposed for two blocks of keys side by side (kt and kt + kKeyBlock * Dp; scores to out[r * ld_out
// + 0 .. 2 * kKeyBlock)): each broadcast q element serves both blocks. With one block the broadcast loads, one per
// multiply-add, bound the loop well below the multiply-add rate; here one serves two. The same operations on every
// score as score_keys_transposed (lane_tree_of_pairs).
template <int R>
SJ_INLINE void score_key_pairs_transposed(const float* q, int64_t Dp, const float* kt, float* out, int64_t ld_out) {
  const float* kt2 = kt + kKeyBlock * Dp;
  auto add_dim = [&](int64_t d, vec_d (*a)[2]) {  // lane chains of dimension d, both blocks, every row
    vec_d k, kb;
    std::memcpy(&k, kt + d * kKeyBlock, sizeof k);
    std::memcpy(&kb, kt2 + d * kKeyBlock, sizeof kb);
    for (int r = 0; r < R; ++r) {
      const vec_d qb = splat(q[r * Dp + d]);
      a[r][0] = fused(qb, k, a[r][0]);
      a[r][1] = fused(qb, kb, a[r][1]);
    }
  };
  lane_tree_of_pairs<R>(Dp, add_dim, out, ld_out);
}
#endif

#ifdef SJ_BF16_SCORES
// The bf16dp build: a bf16 pool's scores from VDPBF16PS on q rounded to bf16 (RNE). A key and a q row are read as
// words, pairs of dimensions (2w, 2w + 1); lane l of a score adds the steps of words l, l + 16, l + 32, .. in order,
// each step the instruction's (the odd dimension's exact product added, then the even one's), then the lanes go
// through sum_lanes' tree. Half the products' instructions of the float lanes, no widening of the keys.
// W: words a row (head_dim / 2, a multiple of 16).
SJ_INLINE lanes_d word_lanes(const uint32_t* qw, const void* key, int64_t W) {
  const auto* k = static_cast<const char*>(key);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < W; c += 16)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + c * 4), (__m512bh)_mm512_loadu_si512(qw + c));
  lanes_d a;
  a.part[0] = (vec_d)acc;
  return a;
}

// out[r * ld_out + 0 .. 2 * kKeyBlock) for R rows from two blocks of keys transposed as words (kt[w * kKeyBlock + j]:
// word w of key j; kt2 the second block): score_key_pairs_transposed's order of lane sums, words for dimensions.
template <int R>
SJ_INLINE void score_word_pairs_transposed(const uint32_t* qw, int64_t W, const float* kt, const float* kt2, float* out,
                                           int64_t ld_out) {
  auto add_word = [&](int64_t w, vec_d (*a)[2]) {
    const __m512bh k = (__m512bh)_mm512_loadu_ps(kt + w * kKeyBlock), kb = (__m512bh)_mm512_loadu_ps(kt2 + w * kKeyBlock);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * W + w]));
      a[r][0] = (vec_d)_mm512_dpbf16_ps((__m512)a[r][0], k, qb);
      a[r][1] = (vec_d)_mm512_dpbf16_ps((__m512)a[r][1], kb, qb);
    }
  };
  lane_tree_of_pairs<R>(W, add_word, out, ld_out);
}

// Whether a tile's products (its scores from the transposed keys, its weights x V from scratch) take two fused
// multiply-adds in place of each VDPBF16PS: acc + high(a) high(b), rounded, then + low(a) low(b), rounded, as the
// instruction adds them, each product of two bf16 values exact in float32. With subnormals as zero, as the
// instruction takes them (attend_all sets that for every float operation on a bf16 pool: SubnormalsAsZero), the
// same bits, so a tile's rows keep their decode steps' bits, whose few rows stay with the instruction. Where
// VDPBF16PS issues at half the FMAs' multiply-add rate (Intel's cores), the FMAs take half its time. Chosen once per
// process (attention.cpp choose_tile_products), or by a test.
inline int tile_products_by_fma = 0;

SJ_INLINE __m512 high_halves(__m512i words) {
  return _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
SJ_INLINE __m512 low_halves(__m512i words) { return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)); }

// score_word_pairs_transposed by fused multiply-adds: kt[(2 w + {0, 1}) * 16 + j] word w of key j's high and low halves
// as float32 (the block kept so), qh[r * 2 W + w] and qh[r * 2 W + W + w] row r's; the same lane chains and tree, the
// same bits.
template <int R>
SJ_INLINE void score_word_pairs_transposed_fma(const float* qh, int64_t W, const float* kt, const float* kt2,
                                               float* out, int64_t ld_out) {
  auto add_word = [&](int64_t w, vec_d (*a)[2]) {
    const __m512 kh = _mm512_loadu_ps(kt + w * 2 * kKeyBlock), kl = _mm512_loadu_ps(kt + (w * 2 + 1) * kKeyBlock);
    const __m512 kbh = _mm512_loadu_ps(kt2 + w * 2 * kKeyBlock), kbl = _mm512_loadu_ps(kt2 + (w * 2 + 1) * kKeyBlock);
    for (int r = 0; r < R; ++r) {
      const __m512 qhi = _mm512_set1_ps(qh[r * 2 * W + w]), qlo = _mm512_set1_ps(qh[r * 2 * W + W + w]);
      a[r][0] = (vec_d)_mm512_fmadd_ps(kl, qlo, _mm512_fmadd_ps(kh, qhi, (__m512)a[r][0]));
      a[r][1] = (vec_d)_mm512_fmadd_ps(kbl, qlo, _mm512_fmadd_ps(kbh, qhi, (__m512)a[r][1]));
    }
  };
  lane_tree_of_pairs<R>(W, add_word, out, ld_out);
}

// Subnormal inputs and results of every float operation as zero (MXCSR DAZ and FTZ) while it lives, as VDPBF16PS
// takes them: on this thread, for one call's work on a bf16 pool.
struct SubnormalsAsZero {
  unsigned saved = _mm_getcsr();
  SubnormalsAsZero() { _mm_setcsr(saved | 0x8040u); }
  ~SubnormalsAsZero() { _mm_setcsr(saved); }
  SubnormalsAsZero(const SubnormalsAsZero&) = delete;
  SubnormalsAsZero& operator=(const SubnormalsAsZero&) = delete;
};
#endif

// out[r * ld_out] = q_r . k for rows r0 .. r0 + R; q rows and k zero-padded to Dp, a multiple of kLanes.
template <int R>
SJ_INLINE void score_key(const float* q, int64_t Dp, const float* k, float* out, int64_t ld_out) {
  lanes_d acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero_lanes();
  for (int64_t c = 0; c < Dp; c += kLanes) {
    const lanes_d kv = load_lanes(k + c);
    for (int r = 0; r < R; ++r) mul_add(acc[r], load_lanes(q + r * Dp + c), kv);
  }
  for (int r = 0; r < R; ++r) out[r * ld_out] = sum_lanes(acc[r]);
}

// Cache lines of a key or value row, fetched ahead: the rows of a request sit wherever the pool put them.
template <class T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64)
    prefetch_l1(reinterpret_cast<const char*>(row) + i);
}

// exp(x) for x <= 0 (a score minus its row's maximum), exp_float.h's; below -87 the weight is under
// 2e-38 of the row's largest and is taken as 0, so the polynomial is only kept on [-87, 0], where exp_float's
// clamps change nothing (without them: the same bits, fewer operations in the softmax's inner loop).
inline float exp_nonpositive(float x) { return x < -87.0f ? 0.0f : exp_float_in_range(x); }

template <class T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}


// Register blocking of the weights x V sums (rows x dims per block): as many accumulators as the
// build's registers hold. Blocking decides where a sum lives, never its order, so all builds agree.
#if SJ_VEC_BYTES == 64
constexpr int kPvRows = 4;
constexpr int64_t kPvDims = 64;
#elif SJ_VEC_BYTES == 32
constexpr int kPvRows = 2;
constexpr int64_t kPvDims = 32;
#else
constexpr int kPvRows = 1;
constexpr int64_t kPvDims = 16;
#endif
constexpr int kPvVecs = kPvDims / kLanes;

template <class T>
SJ_INLINE lanes_d widen_lanes(const T* src) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value,
                "the CPU attention's pools are float32 or bf16");
  if constexpr (std::is_same<T, float>::value) {
    return load_lanes(src);  // no trip through a stack copy
  } else {
    // A bf16 value is the top half of its float: each part's 16-bit lanes widened and shifted in registers
    // (the exact floats the scalar conversion gives, without its trip through a stack copy).
    lanes_d a;
    for (int i = 0; i < kParts; ++i) {
#if SJ_VEC_BYTES == 64
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * 16)));
      a.part[i] = (vec_d)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif SJ_VEC_BYTES == 32
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * 8)));
      a.part[i] = (vec_d)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
      const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i * 4));
      a.part[i] = (vec_d)_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
#endif
    }
    return a;
  }
}

// acc[r][c0 .. c0 + kPvDims) for rows r0 .. r0 + R: the sums over keys p = p_from, p_from + 1, .. p_end - 1 of
// w[r][p] * v_p (a row's weights at scores[r * ld_scores + p - p_lo]; v_p's D values at value_row(p)), started
// from zero, or with `resume` from the sums that acc (and row_sum) hold for the keys before p_from; keys before
// seen_by_all are seen by every row, the others by the rows `visible` says. With kSums, also row_sum[r]: the
// softmax denominator, the same weights added in the same position order (a chain per row, riding along the
// multiply-adds instead of a pass of its own over the scores). The chain adds the weight's broadcast, every lane the
// same sum, in a register of its own: kept as floats, the compiler packed the rows' sums into one vector that it
// parked on the stack, a store and a reload on every key's path.
// Values read from the pool (a decode step's rows, a float32 pool's verify) are fetched this many keys ahead
// (`fetch_ahead`; up to `fetch_end`, the whole range's end, so a chunk's last keys fetch the next chunk's first):
// like the keys, one row of num_kv_heads a slot, which the hardware's prefetchers left the loads waiting for on a
// long context.
constexpr int64_t kValuesAhead = 32;
// A verify's tile widens its chunk's values into its scratch in one tight loop: those rows are fetched this far ahead.
constexpr int64_t kWidenAhead = 64;
template <int R, bool kSums, class ValueRow, class Visible>
SJ_INLINE void weigh_values(const ValueRow& value_row, int64_t p_lo, int64_t p_from, int64_t p_end, bool resume,
                            int64_t seen_by_all, int64_t D, int64_t r0, int64_t c0, const float* scores,
                            int64_t ld_scores, const Visible& visible, float* acc, float* row_sum, bool fetch_ahead,
                            int64_t fetch_end) {
  lanes_d sum[R][kPvVecs];
  vec_d weights[R];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < kPvVecs; ++i)
      sum[r][i] = resume ? load_lanes(acc + (r0 + r) * D + c0 + i * kLanes) : zero_lanes();
    weights[r] = splat(resume && kSums ? row_sum[r0 + r] : 0.0f);
  }
  // Key p's value times each row's weight; the keys every row sees (before seen_by_all) go without a test per row.
  auto add_key = [&](int64_t p, auto all) {
    if (fetch_ahead && p + kValuesAhead < fetch_end) prefetch_row(value_row(p + kValuesAhead) + c0, kPvDims);
    const auto* v = value_row(p) + c0;
    lanes_d vl[kPvVecs];
    for (int i = 0; i < kPvVecs; ++i) vl[i] = widen_lanes(v + i * kLanes);
    for (int r = 0; r < R; ++r) {
      if (!decltype(all)::value && !visible(r0 + r, p)) continue;
      const vec_d w = splat(scores[(r0 + r) * ld_scores + p - p_lo]);
      if constexpr (kSums) weights[r] = weights[r] + w;
      for (int i = 0; i < kPvVecs; ++i) scale_add(sum[r][i], w, vl[i]);
    }
  };
  const int64_t shared_end = std::max(p_from, std::min(p_end, seen_by_all));
  int64_t p = p_from;
  for (; p < shared_end; ++p) add_key(p, std::true_type{});
  for (; p < p_end; ++p) add_key(p, std::false_type{});
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < kPvVecs; ++i) store_lanes(acc + (r0 + r) * D + c0 + i * kLanes, sum[r][i]);
    if constexpr (kSums) row_sum[r0 + r] = weights[r][0];
  }
}

template <int R, class ValueRow, class Visible>
SJ_INLINE void weigh_values_of_chunk(const ValueRow& value_row, int64_t p_lo, int64_t p_from, int64_t p_end,
                                     bool resume, int64_t seen_by_all, int64_t D, int64_t r0, int64_t c0,
                                     const float* scores, int64_t ld_scores, const Visible& visible, float* acc,
                                     float* row_sum, bool fetch_ahead, int64_t fetch_end) {
  if (c0 == 0)  // the first block of dims also makes the rows' denominators
    weigh_values<R, true>(value_row, p_lo, p_from, p_end, resume, seen_by_all, D, r0, c0, scores, ld_scores, visible,
                          acc, row_sum, fetch_ahead, fetch_end);
  else
    weigh_values<R, false>(value_row, p_lo, p_from, p_end, resume, seen_by_all, D, r0, c0, scores, ld_scores, visible,
                           acc, row_sum, fetch_ahead, fetch_end);
}

// Several blocks of rows take the keys kPvKeyChunk at a time, every block through a chunk before the next chunk, their
// sums parked in acc and row_sum in between: the chunk's values (kPvKeyChunk x kPvDims floats) then stay in L1 for
// all the blocks, where each block's pass over the whole range read them from L2 (or further) again. Each sum still
// adds its keys in position order: the same bits.
constexpr int64_t kPvKeyChunk = 64;

// The weights x V sums of every row (acc[r][0 .. D)) and its softmax denominator (row_sum[r], zero on entry),
// the values' rows at value_row(p): up to kPvRows rows and kPvDims dims at a time in registers (each value
// loaded once for them); a head_dim tail that does not fill kPvDims goes through memory (`scratch`: D floats).
// `from_pool`: value_row reads the pool (fetched ahead), not a widened copy already in the caches.
template <class ValueRow, class Visible>
void weigh_all_values(const ValueRow& value_row, int64_t p_lo, int64_t p_end, int64_t seen_by_all, int64_t D, int64_t rows,
                      const float* scores, int64_t ld_scores, const Visible& visible, float* acc, float* row_sum,
                      float* scratch, bool from_pool) {
  const int64_t chunk = rows > kPvRows ? kPvKeyChunk : std::max<int64_t>(1, p_end - p_lo);
  int64_t c0 = 0;
  for (; c0 + kPvDims <= D; c0 += kPvDims) {
    int64_t from = p_lo;
    do {  // at least once: an empty range still writes its zero sums
      const int64_t to = std::min(p_end, from + chunk);
      const bool resume = from > p_lo;
      auto block = [&](auto rows_of_block, int64_t r) {
        // The first block of rows fetches the chunk's values ahead; the later blocks find them in the caches.
        weigh_values_of_chunk<decltype(rows_of_block)::value>(value_row, p_lo, from, to, resume, seen_by_all, D, r, c0,
                                                              scores, ld_scores, visible, acc, row_sum,
                                                              from_pool && r == 0, p_end);
      };
      int64_t r = 0;
      for (; r + kPvRows <= rows; r += kPvRows) block(std::integral_constant<int, kPvRows>{}, r);
      if constexpr (kPvRows >= 4) {
        if (rows - r == 3) {
          block(std::integral_constant<int, 3>{}, r);
          r += 3;
        } else if (rows - r == 2) {
          block(std::integral_constant<int, 2>{}, r);
          r += 2;
        }
      }
      for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
      from = to;
    } while (from < p_end);
  }
  if (c0 < D) {
    const bool sums = c0 == 0;  // no whole block of dims made the denominators
    for (int64_t p = p_lo; p < p_end; ++p) {
      widen(value_row(p), scratch, D);
      const bool all = p < seen_by_all;
      for (int64_t r = 0; r < rows; ++r) {
        if (!all && !visible(r, p)) continue;
        const float w = scores[r * ld_scores + p - p_lo];
        if (sums) row_sum[r] += w;
        float* o = acc + r * D;
        for (int64_t d = c0; d < D; ++d) o[d] = std::fma(w, scratch[d], o[d]);  // as scale_add
      }
    }
  }
}

// The largest of m and s[0 .. n).
SJ_INLINE float max_of(const float* s, int64_t n, float m) {
  vec_d mv = vec_d{} + m;
  int64_t p = 0;
  for (; p + kVecLanes <= n; p += kVecLanes) {
    vec_d x;
    std::memcpy(&x, s + p, sizeof x);
    mv = x > mv ? x : mv;
  }
  for (int i = 0; i < kVecLanes; ++i) m = mv[i] > m ? mv[i] : m;
  for (; p < n; ++p) m = s[p] > m ? s[p] : m;
  return m;
}

// A thread's scratch, reused across its tiles and from call to call (a thread_local one, taken by reference once
// a call: thread_local storage in a shared library costs a lookup per access, which the inner loops must not pay),
// so a call allocates and zero-fills nothing its thread's earlier calls already sized.
struct Workspace {
  std::vector<float> qd, scores, acc, kd, vd, row_max, row_sum;
  std::vector<int64_t> row_start, row_end;
  std::vector<const bool*> row_mask;
  // What a tile leaves for the thread's next tile when that reads the same keys and values (a KV head's next query
  // tile, or its other query heads): whose they are (the request's slot table, the KV head, the chunk's first
  // position); its whole blocks of keys in `keys` (kKeyBlock x Dp floats each), widened or, for tiles of
  // kTransposedRows rows or more, transposed (kept_transposed), kept_blocks of them; and how many positions' values
  // vd holds widened. Only within one attend_all call, whose pools do not change under it.
  const int64_t* kept_slots = nullptr;
  int64_t kept_kvh = -1, kept_lo = -1, kept_blocks = 0, kept_values = 0;
  bool kept_transposed = false;
  std::vector<float> keys;
  // The AMX scores' buffers (score_chunk_amx): q's bf16 pairs, gathered blocks of keys, a block of scores and its
  // transpose.
  std::vector<uint32_t> q_pairs;
  // bf16dp's q words as float32 halves for a tile's scores by fused multiply-adds: a row's W high halves, then its
  // W low ones.
  std::vector<float> q_halves;
  // bf16dp's weights x V (weigh_value_pairs): every row's weight words, and a group of 16 rows' transposed.
  std::vector<uint32_t> pair_weights, pair_rows;
  // ... and, for a tile's products by FMAs, each row's weights rounded to bf16, as float32 ([row][key]).
  std::vector<float> key_weights;
  std::vector<uint16_t> key_rows;
  std::vector<float> tile_scores;
};

#ifdef SJ_AMX_SCORES
// Scores from AMX tiles (the `amx` build, bf16 pools only; float32 pools take the lanes below): a block of 16 keys is a tile's 16 rows (A: 32 dimensions a step, read
// from the pool where the 16 slots follow each other, else from a gathered copy), the rows' q a tile's columns (B:
// each q split into bf16 hi + lo, q - hi rounded again, so the pair carries q to ~16 bits). Every score
// accumulates, in this order, step 0's hi and lo products, step 1's, ..: the sum of one key and one q row, whatever
// else shares the tiles, so how rows and keys are grouped changes no bit. Tiles 0-2: three blocks' scores (16 keys
// x 16 rows each); 3-5: their keys; 6, 7: a group of 16 rows' hi and lo pairs. A subnormal bf16 key or q part is
// taken as zero by the tile products, as in every AMX kernel.
constexpr int64_t kAmxKeys = 16, kAmxDepth = 32, kAmxBlocks = 3;

// q_pairs for group g (rows 16 g ..), step s, part (0 hi, 1 lo): a B tile, row kp = dimensions 2 kp and 2 kp + 1 of
// step s, column n = row 16 g + n (zero past the rows and past D).
inline void pack_q_pairs(const float* qd, int64_t Dp, int64_t D, int64_t rows, int64_t steps, uint32_t* out) {
  const int64_t groups = (rows + 15) / 16;
  std::memset(out, 0, groups * steps * 2 * 256 * sizeof(uint32_t));
  alignas(64) uint32_t hi_pairs[16], lo_pairs[16];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / 16, n = r % 16;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t d0 = s * kAmxDepth, left = std::min<int64_t>(kAmxDepth, D - d0);
      const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
      const __m512 x0 = _mm512_maskz_loadu_ps(m0, qd + r * Dp + d0), x1 = _mm512_maskz_loadu_ps(m1, qd + r * Dp + d0 + 16);
      const __m512bh hi = _mm512_cvtne2ps_pbh(x1, x0);  // bf16 of x0 in the low half, x1 in the high
      _mm512_store_si512(hi_pairs, (__m512i)hi);
      const auto* hi_values = reinterpret_cast<const c10::BFloat16*>(hi_pairs);
      const __m512 h0 = (__m512)widen_lanes(hi_values).part[0], h1 = (__m512)widen_lanes(hi_values + 16).part[0];
      const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
      _mm512_store_si512(lo_pairs, (__m512i)lo);
      uint32_t* tile_hi = out + ((g * steps + s) * 2) * 256;
      for (int64_t kp = 0; kp < 16; ++kp) tile_hi[kp * 16 + n] = hi_pairs[kp], tile_hi[256 + kp * 16 + n] = lo_pairs[kp];
    }
  }
}

// Step s of block B (tiles: sums B, keys A = 3 + B): its keys loaded, then its product with the group's hi pairs (6);
// SJ_SCORE_LO adds the lo pairs (7). The blocks' products interleave, so no product waits on the one before it.
#define SJ_SCORE_HI(B, A)                              \
  do {                                                 \
    _tile_loadd(A, a[B] + s * kAmxDepth, a_stride[B]); \
    _tile_dpbf16ps(B, A, 6);                           \
  } while (0)
#define SJ_SCORE_LO(B, A) _tile_dpbf16ps(B, A, 7)

// scores[r * ld_scores + p - c_lo] = q_r . k_p for every row r < rows and key c_lo <= p < c_end (qd: the rows'
// scaled q, Dp floats apart). Three blocks of keys go at once: a tile product waits for the one before it into
// the same sums, so one block's chain alone would leave the tile unit idle most of the time.
inline void score_chunk_amx(const Batch& bt, const float* qd, int64_t Dp, int64_t rows, const at::BFloat16* k_cache,
                            const int64_t* slots, int64_t kvh, int64_t c_lo, int64_t c_end, float* scores,
                            int64_t ld_scores, Workspace& ws) {
  const int64_t D = bt.head_dim, steps = (D + kAmxDepth - 1) / kAmxDepth, Dk = steps * kAmxDepth;
  const int64_t groups = (rows + 15) / 16;
  ws.q_pairs.resize(groups * steps * 2 * 256);
  ws.key_rows.resize(kAmxBlocks * kAmxKeys * Dk);
  ws.tile_scores.resize(2 * kAmxKeys * 16);
  uint32_t* q_pairs = ws.q_pairs.data();
  float *tile = ws.tile_scores.data(), *by_row = tile + kAmxKeys * 16;
  pack_q_pairs(qd, Dp, D, rows, steps, q_pairs);
  configure_full_tiles();
  const auto* pool = reinterpret_cast<const uint16_t*>(k_cache);
  auto key_row = [&](int64_t p) { return pool + slots[p] * bt.slot_stride + kvh * bt.head_stride; };
  const uint16_t* a[kAmxBlocks];
  int64_t a_stride[kAmxBlocks];
  for (int64_t p0 = c_lo; p0 < c_end; p0 += kAmxBlocks * kAmxKeys) {
    const int64_t blocks = std::min(kAmxBlocks, (c_end - p0 + kAmxKeys - 1) / kAmxKeys);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t q0 = p0 + b * kAmxKeys, n = std::min(kAmxKeys, c_end - q0);
      bool in_place = n == kAmxKeys && D == Dk;
      for (int64_t j = 1; in_place && j < n; ++j) in_place = slots[q0 + j] == slots[q0] + j;
      if (in_place) {
        a[b] = key_row(q0), a_stride[b] = bt.slot_stride * 2;
        continue;
      }
      uint16_t* rows_b = ws.key_rows.data() + b * kAmxKeys * Dk;
      for (int64_t j = 0; j < kAmxKeys; ++j) {
        uint16_t* dst = rows_b + j * Dk;
        if (j < n) {
          std::memcpy(dst, key_row(q0 + j), D * sizeof(uint16_t));
          std::fill(dst + D, dst + Dk, uint16_t{0});
        } else {
          std::fill(dst, dst + Dk, uint16_t{0});
        }
      }
      a[b] = rows_b, a_stride[b] = Dk * 2;
    }
    for (int64_t g = 0; g < groups; ++g) {
      _tile_zero(0);
      if (blocks > 1) _tile_zero(1);
      if (blocks > 2) _tile_zero(2);
      for (int64_t s = 0; s < steps; ++s) {
        const uint32_t* qp = q_pairs + ((g * steps + s) * 2) * 256;
        _tile_loadd(6, qp, 64);
        _tile_loadd(7, qp + 256, 64);
        if (blocks == 3) {
          SJ_SCORE_HI(0, 3); SJ_SCORE_HI(1, 4); SJ_SCORE_HI(2, 5);
          SJ_SCORE_LO(0, 3); SJ_SCORE_LO(1, 4); SJ_SCORE_LO(2, 5);
        } else if (blocks == 2) {
          SJ_SCORE_HI(0, 3); SJ_SCORE_HI(1, 4);
          SJ_SCORE_LO(0, 3); SJ_SCORE_LO(1, 4);
        } else {
          SJ_SCORE_HI(0, 3);
          SJ_SCORE_LO(0, 3);
        }
      }
      const int64_t r0 = 16 * g, r1 = std::min(rows, r0 + 16);
      for (int64_t b = 0; b < blocks; ++b) {
        if (b == 0) _tile_stored(0, tile, 64);
        else if (b == 1) _tile_stored(1, tile, 64);
        else _tile_stored(2, tile, 64);
        // tile[key * 16 + n]: key p0 + 16 b + key, row r0 + n; transposed, a row's 16 scores side by side
        transpose_keys(tile, 16, by_row);
        float* dst = scores + (p0 - c_lo) + b * kAmxKeys;
        for (int64_t r = r0; r < r1; ++r) std::memcpy(dst + r * ld_scores, by_row + (r - r0) * 16, 16 * sizeof(float));
      }
    }
  }
}
#undef SJ_SCORE_HI
#undef SJ_SCORE_LO
#endif

#ifdef SJ_BF16_SCORES
// The bf16dp build's weights x V for a bf16 pool: each softmax weight rounded to bf16 (RNE) and the values' bf16
// dims taken by VDPBF16PS two keys a step. A word (pair of keys, dim) holds key p's value in its high half and key
// p + 1's in its low half, the weights' words alike; the instruction adds the high half's exact product, then the
// low half's, each step rounded once (subnormal inputs and results as zero). So each dim's sum adds the row's keys
// in position order, one rounding a key, and a key the row does not see adds an exact zero (weight 0): how keys pair
// up changes no bit, and a tree node's row gets its decode step's bits. The denominator is the same sum of the
// rounded weights (times 1.0), 16 rows a vector. Half the products' instructions of the float lanes, no widening.
// (The pairing rests on the instruction's definition, two fused steps, the odd half's first: attention.cpp runs this
// build only on a CPU whose instruction passes dpbf16_order.h's check, once per process. An unseen key's value is
// multiplied by 0: a non-finite one, which only a model that overflowed writes, would reach the row.)
constexpr uint32_t kOnePair = 0x3F803F80u;  // bf16 1.0 in both halves
constexpr int64_t kPairChunk = 32;          // pairs of keys a tile's rows go through together (values in L1)

// Word j: bf16(x[2j]) << 16 | bf16(x[2j + 1]), 16 words from the first n of 32 floats (the rest as 0).
SJ_INLINE __m512i weight_pairs(const float* x, int64_t n) {
  const __mmask16 m0 = n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  // cvtne2ps: elements 0-15 from its second operand, so word j holds key 2j low, 2j + 1 high; the rotation swaps them.
  const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + 16), _mm512_maskz_loadu_ps(m0, x));
  return _mm512_ror_epi32((__m512i)w, 16);
}

// The words of keys a (high halves) and b (low) for 32 dims: out[0] dims 0-15, out[1] dims 16-31.
SJ_INLINE void value_pairs(const void* a, const void* b, __m512i* out) {
  alignas(64) static const uint16_t kIndex[2][32] = {
      {32, 0, 33, 1, 34, 2, 35, 3, 36, 4, 37, 5, 38, 6, 39, 7, 40, 8, 41, 9, 42, 10, 43, 11, 44, 12, 45, 13, 46, 14, 47, 15},
      {48, 16, 49, 17, 50, 18, 51, 19, 52, 20, 53, 21, 54, 22, 55, 23, 56, 24, 57, 25, 58, 26, 59, 27, 60, 28, 61, 29, 62,
       30, 63, 31}};
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  out[0] = _mm512_permutex2var_epi16(va, _mm512_load_si512(kIndex[0]), vb);
  out[1] = _mm512_permutex2var_epi16(va, _mm512_load_si512(kIndex[1]), vb);
}

// acc[r][c0 .. c0 + 16 NV) for rows r0 .. r0 + R over pairs j0 .. j1 (from zero when j0 == 0, else resumed from acc):
// values(j, c0, v) gives pair j's NV vectors of words; wp[r * ldw + j] row r's weight word. kSums: also row_sum[r],
// the weights times 1.0 by the same instruction (all lanes alike), riding along the products.
template <int R, int NV, bool kSums, class Values>
SJ_INLINE void weigh_pairs_block(const Values& values, const uint32_t* wp, int64_t ldw, int64_t j0, int64_t j1,
                                 int64_t r0, int64_t c0, int64_t D, float* acc, float* row_sum) {
  __m512 sum[R][NV], weights[R];
  const __m512bh ones = (__m512bh)_mm512_set1_epi32(static_cast<int>(kOnePair));
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) sum[r][v] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r0 + r) * D + c0 + 16 * v);
    weights[r] = _mm512_setzero_ps();
  }
  for (int64_t j = j0; j < j1; ++j) {
    __m512i vals[NV];
    values(j, c0, vals);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[(r0 + r) * ldw + j]));
      for (int v = 0; v < NV; ++v) sum[r][v] = _mm512_dpbf16_ps(sum[r][v], (__m512bh)vals[v], w);
      if constexpr (kSums) weights[r] = _mm512_dpbf16_ps(weights[r], ones, w);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r0 + r) * D + c0 + 16 * v, sum[r][v]);
    if constexpr (kSums) row_sum[r0 + r] = _mm512_cvtss_f32(weights[r]);
  }
}

// Rows in blocks of kPvRows and dims in blocks of 64 (32 for a last half block: D is a multiple of 32), each block
// given its row count R, vector count NV and whether it makes the denominators S (the first block of dims, where
// `sums`) as constants: block(R, NV, S, r, c0).
template <class Block>
SJ_INLINE void for_each_pv_block(int64_t rows, int64_t D, bool sums, const Block& block) {
  for (int64_t r = 0; r < rows; r += kPvRows) {
    const int64_t left = std::min<int64_t>(kPvRows, rows - r);
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      auto with_rows = [&](auto nv, auto s) {
        if (left == 4) block(std::integral_constant<int, 4>{}, nv, s, r, c0);
        else if (left == 3) block(std::integral_constant<int, 3>{}, nv, s, r, c0);
        else if (left == 2) block(std::integral_constant<int, 2>{}, nv, s, r, c0);
        else block(std::integral_constant<int, 1>{}, nv, s, r, c0);
      };
      auto with_dims = [&](auto s) {
        if (c0 + 64 <= D) with_rows(std::integral_constant<int, 4>{}, s);
        else with_rows(std::integral_constant<int, 2>{}, s);
      };
      if (sums && c0 == 0) with_dims(std::true_type{});
      else with_dims(std::false_type{});
    }
  }
}

// A tile's weights x V by FMAs (tile_products_by_fma): acc[r][c0 .. c0 + 16 NV) for rows r0 .. r0 + R over pairs j0 ..
// j1, each pair's first key (vf[2j]: its D values widened) times the row's weight of it (wf[r * ldk + 2j], rounded to
// bf16), then its second key times its weight: VDPBF16PS's two steps a word, one FMA each, the same bits. kSums: also
// the denominators row_sum[r], the same weights added in the same order (the instruction's products with 1.0).
template <int R, int NV, bool kSums>
SJ_INLINE void weigh_keys_block_fma(const float* vf, const float* wf, int64_t ldk, int64_t j0, int64_t j1, int64_t r0,
                                    int64_t c0, int64_t D, float* acc, float* row_sum) {
  __m512 sum[R][NV];
  float weights[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) sum[r][v] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r0 + r) * D + c0 + 16 * v);
    weights[r] = j0 == 0 ? 0.0f : row_sum[r0 + r];
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* first = vf + 2 * j * D + c0;
    const float* second = first + D;
    __m512 va[NV], vb[NV];
    for (int v = 0; v < NV; ++v) va[v] = _mm512_loadu_ps(first + 16 * v), vb[v] = _mm512_loadu_ps(second + 16 * v);
    for (int r = 0; r < R; ++r) {
      const float wa = wf[(r0 + r) * ldk + 2 * j], wb = wf[(r0 + r) * ldk + 2 * j + 1];
      const __m512 a = _mm512_set1_ps(wa), b = _mm512_set1_ps(wb);
      for (int v = 0; v < NV; ++v) sum[r][v] = _mm512_fmadd_ps(vb[v], b, _mm512_fmadd_ps(va[v], a, sum[r][v]));
      if constexpr (kSums) weights[r] = (weights[r] + wa) + wb;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r0 + r) * D + c0 + 16 * v, sum[r][v]);
    if constexpr (kSums) row_sum[r0 + r] = weights[r];
  }
}

// Row r's softmax weights `s` (key p at s[p - p_lo]) with those of the keys it does not see, garbage until now, set
// to 0 (keys before seen_by_all every row sees).
template <class Visible>
SJ_INLINE float* visible_weights(float* s, int64_t r, int64_t p_lo, int64_t p_end, int64_t seen_by_all,
                                 const Visible& visible) {
  for (int64_t p = std::max(p_lo, seen_by_all); p < p_end; ++p)
    if (!visible(r, p)) s[p - p_lo] = 0.0f;
  return s;
}

// weigh_value_pairs for a tile whose products take FMAs (tile_products_by_fma), with its bits: each row's weights
// rounded to bf16 as weight_pairs rounds them (0 past the last key: a lone last key's partner is the key again with
// weight 0, as in the pairs), the keys' values widened into scratch key by key (the keys an earlier tile of the
// thread widened kept, as the pairs are), then the pairs in chunks as weigh_value_pairs takes them, the
// denominators riding along the first block of dims.
template <class ValueRow, class Visible>
void weigh_tile_by_fma(const ValueRow& value_row, int64_t p_lo, int64_t p_end, int64_t seen_by_all, int64_t D,
                       int64_t rows, float* scores, int64_t ld_scores, const Visible& visible, const float* row_max,
                       float* acc, float* row_sum, Workspace& ws) {
  const int64_t n = p_end - p_lo, pairs = (n + 1) / 2, ldk = (2 * pairs + 15) / 16 * 16;
  ws.key_weights.resize(rows * ldk);
  float* wf = ws.key_weights.data();
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = wf + r * ldk;
    if (row_max[r] == -std::numeric_limits<float>::infinity()) {
      std::fill(dst, dst + ldk, 0.0f);
      continue;
    }
    float* s = visible_weights(scores + r * ld_scores, r, p_lo, p_end, seen_by_all, visible);
    for (int64_t i = 0; i < ldk; i += 16) {
      const int64_t left = n - i;
      const __mmask16 m = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + i));  // weight_pairs' rounding
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)));
    }
  }
  if (ws.vd.size() < static_cast<size_t>(2 * pairs * D)) ws.vd.resize(2 * pairs * D);
  float* vf = ws.vd.data();
  for (int64_t p = p_lo + ws.kept_values; p < p_end; ++p) {
    if (p + kWidenAhead < p_end) prefetch_row(value_row(p + kWidenAhead), D);
    const auto* src = value_row(p);
    float* out = vf + (p - p_lo) * D;
    for (int64_t d = 0; d < D; d += kLanes) store_lanes(out + d, widen_lanes(src + d));  // D is a multiple of 32
  }
  ws.kept_values = std::max(ws.kept_values, n);
  if (n % 2 == 1) std::memcpy(vf + n * D, vf + (n - 1) * D, D * sizeof(float));  // made again by each tile
  for (int64_t j0 = 0; j0 < pairs; j0 += kPairChunk) {
    const int64_t j1 = std::min(pairs, j0 + kPairChunk);
    for_each_pv_block(rows, D, true, [&](auto R, auto NV, auto S, int64_t r, int64_t c0) {
      weigh_keys_block_fma<decltype(R)::value, decltype(NV)::value, decltype(S)::value>(vf, wf, ldk, j0, j1, r, c0, D,
                                                                                       acc, row_sum);
    });
  }
}

// Every row's weights x V (acc[r][0 .. D)) and denominator (row_sum[r]) over keys p_lo .. p_end - 1, value_row(p)
// their bf16 values; scores[r * ld_scores + p - p_lo] the row's softmax weights where visible(r, p) (garbage
// elsewhere: zeroed here). A tile of more than kPvRows rows interleaves the keys' values once into its scratch
// (kept for the thread's next tile of them, as the widened values are) and sums 16 rows' weights a vector from their
// words transposed (or, where tile_products_by_fma, takes weigh_tile_by_fma: the same bits); a decode step's rows
// read the pool in place and sum their weights beside the products.
template <class ValueRow, class Visible>
void weigh_value_pairs(const ValueRow& value_row, int64_t p_lo, int64_t p_end, int64_t seen_by_all, int64_t D,
                       int64_t rows, float* scores, int64_t ld_scores, const Visible& visible, const float* row_max,
                       float* acc, float* row_sum, Workspace& ws) {
  const int64_t n = p_end - p_lo, pairs = (n + 1) / 2, ldw = std::max<int64_t>(16, (pairs + 15) / 16 * 16);
  const bool tile = rows > kPvRows;
  if (tile && tile_products_by_fma) {
    weigh_tile_by_fma(value_row, p_lo, p_end, seen_by_all, D, rows, scores, ld_scores, visible, row_max, acc, row_sum,
                      ws);
    return;
  }
  const int64_t padded_rows = tile ? (rows + 15) / 16 * 16 : rows;  // whole groups of 16 for the transposed sums
  ws.pair_weights.resize(padded_rows * ldw);
  uint32_t* wp = ws.pair_weights.data();
  for (int64_t r = 0; r < padded_rows; ++r) {
    uint32_t* dst = wp + r * ldw;
    if (r >= rows || row_max[r] == -std::numeric_limits<float>::infinity()) {
      std::fill(dst, dst + ldw, 0u);
      continue;
    }
    float* s = visible_weights(scores + r * ld_scores, r, p_lo, p_end, seen_by_all, visible);
    for (int64_t j = 0; j < ldw; j += 16) _mm512_storeu_si512(dst + j, weight_pairs(s + 2 * j, n - 2 * j));
  }
  auto pair_keys = [&](int64_t j) {
    const int64_t p = p_lo + 2 * j;
    const auto* a = value_row(p);
    return std::make_pair(a, p + 1 < p_end ? value_row(p + 1) : a);  // a lone last key pairs with itself, weight 0
  };
  auto blocks_of_rows = [&](auto values, auto sums, int64_t j0, int64_t j1) {
    for_each_pv_block(rows, D, decltype(sums)::value, [&](auto R, auto NV, auto S, int64_t r, int64_t c0) {
      weigh_pairs_block<decltype(R)::value, decltype(NV)::value, decltype(S)::value>(values, wp, ldw, j0, j1, r, c0, D,
                                                                                    acc, row_sum);
    });
  };
  if (tile) {
    ws.pair_rows.resize(16 * ldw);
    float* by_pair = reinterpret_cast<float*>(ws.pair_rows.data());
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(static_cast<int>(kOnePair));
    for (int64_t g = 0; g < padded_rows; g += 16) {  // lane l: row g + l, the same steps as kSums' sums
      transpose_keys(reinterpret_cast<const float*>(wp + g * ldw), ldw, by_pair);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t j = 0; j < pairs; ++j) sums = _mm512_dpbf16_ps(sums, (__m512bh)_mm512_loadu_ps(by_pair + j * 16), ones);
      alignas(64) float lane_sums[16];
      _mm512_store_ps(lane_sums, sums);
      for (int64_t l = 0; l < 16 && g + l < rows; ++l) row_sum[g + l] = lane_sums[l];
    }
    // The keys' words in scratch, pair j's D words at vp[j * D]; the pairs a previous tile made are kept (a lone
    // last key's pair is made again once its partner has come).
    if (ws.vd.size() < static_cast<size_t>(pairs * D)) ws.vd.resize(pairs * D);
    uint32_t* vp = reinterpret_cast<uint32_t*>(ws.vd.data());
    for (int64_t j = ws.kept_values / 2; j < pairs; ++j) {
      const int64_t p = p_lo + 2 * j;
      if (p + kWidenAhead + 1 < p_end) {
        prefetch_row(value_row(p + kWidenAhead), D);
        prefetch_row(value_row(p + kWidenAhead + 1), D);
      }
      const auto keys = pair_keys(j);
      for (int64_t c = 0; c < D; c += 32) {
        __m512i words[2];
        value_pairs(keys.first + c, keys.second + c, words);
        _mm512_storeu_si512(vp + j * D + c, words[0]);
        _mm512_storeu_si512(vp + j * D + c + 16, words[1]);
      }
    }
    ws.kept_values = std::max(ws.kept_values, n);
    auto from_scratch = [&](int64_t j, int64_t c0, __m512i* out) {
      for (int v = 0; v < 4 && c0 + 16 * v < D; ++v) out[v] = _mm512_loadu_si512(vp + j * D + c0 + 16 * v);
    };
    for (int64_t j0 = 0; j0 < pairs; j0 += kPairChunk)
      blocks_of_rows(from_scratch, std::false_type{}, j0, std::min(pairs, j0 + kPairChunk));
  } else {
    auto from_pool = [&](int64_t j, int64_t c0, __m512i* out) {
      const int64_t p = p_lo + 2 * j;
      if (c0 == 0 && p + kValuesAhead + 1 < p_end) {
        prefetch_row(value_row(p + kValuesAhead), D);
        prefetch_row(value_row(p + kValuesAhead + 1), D);
      }
      const auto keys = pair_keys(j);
      value_pairs(keys.first + c0, keys.second + c0, out);
      if (c0 + 32 < D) value_pairs(keys.first + c0 + 32, keys.second + c0 + 32, out + 2);
    };
    blocks_of_rows(from_pool, std::true_type{}, 0, pairs);
  }
}
#endif

// Keys are taken in chunks of kKeyChunk of the keys a row sees, by their rank among them (0 .. kKeyChunk - 1, then
// the next ..), the same chunks for every row whatever the batch, so a long context's chunks can go to different
// threads without changing a bit: a chunk's softmax is taken against its own maximum, and the chunks are merged in
// position order (merge_chunks). A row that sees kKeyChunk keys or fewer has one chunk, and the arithmetic of a
// single pass. The rank is the position, except among a masked request's new tokens: a tree node skips its
// non-ancestors there, so it is chunked as the same token decoded after its ancestors alone (a chunk whose
// boundary fell between a tree's nodes by position gave such a row other bits).
constexpr int64_t kKeyChunk = 512;
// What a chunk leaves for the merge, per row: its maximum, its weights' sum, its weights x V ([D]).
inline int64_t partial_width(int64_t D) { return D + 2; }

// One (request, KV head, tile of the request's new tokens, query heads h0 .. h1 of the KV head's group,
// keys c_lo .. c_hi - 1): rows r = token j0 + r / heads, query head kvh * group + h0 + r % heads. A row's
// arithmetic is its own, so how rows are grouped into tiles never changes a bit. With `partial` null the
// keys are all the rows see and the output is written; else the chunk's part goes to `partial` (rows x
// partial_width).
template <class T, class C>
void attend_tile(const Batch& bt, const T* q, const C* k_cache, const C* v_cache, T* out, int64_t b, int64_t kvh,
                 int64_t j0, int64_t j1, int64_t h0, int64_t h1, int64_t c_lo, int64_t c_hi, float* partial,
                 Workspace& ws) {
  const int64_t D = bt.head_dim, H = bt.num_heads, KV = bt.num_kv_heads, group = H / KV, heads = h1 - h0;
  const int64_t kv_len = bt.kv_lens[b], q_len = bt.q_lens[b], prefix = kv_len - q_len;
  const int64_t rows = (j1 - j0) * heads;
  // Causal rows see nothing past their own token; a custom mask may allow any new token.
  const int64_t kv_end = bt.mask ? kv_len : prefix + j1;
  const int64_t c_end = std::min(kv_end, c_hi);  // this unit's keys: c_lo .. c_end - 1
  const int64_t* slots = bt.kv_indices + b * bt.max_kv;
  const bool* mask = bt.mask ? bt.mask + b * bt.max_q * bt.max_q : nullptr;
  // Keys before `prefix` are seen by every row; a new token's key by the rows its mask (or causality) allows:
  // a causal row sees nothing from row_end on; a masked row, what its mask row allows.
  ws.row_start.resize(rows);
  ws.row_end.resize(rows);
  ws.row_mask.resize(rows);
  int64_t *row_start = ws.row_start.data(), *row_end = ws.row_end.data();
  const bool** row_mask = ws.row_mask.data();
  // A chunk holds the keys a row sees with rank c_lo .. c_lo + kKeyChunk - 1 among those it sees (attend_all). Under
  // a mask a new token's rank is not its position: a tree node skips its non-ancestors, and must be chunked as the
  // same token decoded after its ancestors, where they are contiguous. So a masked row's new keys in this chunk are
  // those of ranks [c_lo, rank_hi), found on its mask row; causal rows see every key, so rank == position.
  const int64_t rank_hi = partial != nullptr ? c_lo + kKeyChunk : std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = j0 + r / heads;
    row_start[r] = c_lo;
    row_end[r] = std::min(mask ? kv_end : prefix + j + 1, c_end);
    row_mask[r] = mask ? mask + j * bt.max_q - prefix : nullptr;  // indexed by key position p >= prefix
    if (mask && (c_lo > prefix || rank_hi < kv_end)) {
      int64_t rank = prefix, p = prefix;
      if (c_lo > prefix) {
        for (; p < kv_end && rank < c_lo; ++p) rank += row_mask[r][p];
        row_start[r] = p;  // the next key this row sees has rank c_lo
      }
      for (; p < kv_end && rank < rank_hi; ++p) rank += row_mask[r][p];
      row_end[r] = std::min(row_end[r], p);
    }
  }
  auto visible = [&](int64_t r, int64_t p) {
    return p >= row_start[r] && p < row_end[r] && (p < prefix || row_mask[r] == nullptr || row_mask[r][p]);
  };
  // Keys every row of the tile sees, so their sums skip the per-row test: the cached ones, and under causality
  // also the new tokens' up to the tile's first (a prefill chunk's tile sees most of its keys so).
  const int64_t seen_by_all = mask ? prefix : std::min(prefix + j0 + 1, c_end);

  // A row's scores, one per key position of the chunk, the row padded to whole vectors so the softmax's exp runs
  // on whole vectors (what it makes past a row's visible keys is never read).
  const int64_t ld_scores = (c_end - c_lo + kVecLanes - 1) / kVecLanes * kVecLanes;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  // Sized, not cleared: every element read is written first. Only what no write covers is zeroed: q and key rows'
  // padding past head_dim, and the accumulators of a head_dim tail the weights x V pass adds to in memory.
  ws.qd.resize(rows * Dp);
  ws.scores.resize(rows * ld_scores);
  if (D % kPvDims != 0) ws.acc.assign(rows * D, 0.0);
  else ws.acc.resize(rows * D);
  ws.kd.resize(kKeyBlock * Dp);
  if (D != Dp) {
    for (int64_t r = 0; r < rows; ++r) std::fill(ws.qd.begin() + r * Dp + D, ws.qd.begin() + (r + 1) * Dp, 0.0f);
    for (int64_t j = 0; j < kKeyBlock; ++j) std::fill(ws.kd.begin() + j * Dp + D, ws.kd.begin() + (j + 1) * Dp, 0.0f);
  }
  ws.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  ws.row_sum.assign(rows, 0.0);
  float *qd = ws.qd.data(), *scores = ws.scores.data(), *acc = ws.acc.data(), *kd = ws.kd.data(),
        *row_max = ws.row_max.data(), *row_sum = ws.row_sum.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / heads, h = kvh * group + h0 + r % heads;
    widen(q + (t * H + h) * D, qd + r * Dp, D);
    for (int64_t d = 0; d < D; ++d) qd[r * Dp + d] *= static_cast<float>(bt.scale);
  }
#ifdef SJ_BF16_SCORES
  constexpr bool kWords = std::is_same<C, at::BFloat16>::value;  // a bf16 pool: scores by VDPBF16PS (word_lanes)
  const bool tiles_by_fma = tile_products_by_fma != 0;
  const int64_t W = D / 2;
  const uint32_t* qw = nullptr;
  if constexpr (kWords) {
    ws.q_pairs.resize(rows * W);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < D; c += 32) {
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qd + r * Dp + c + 16), _mm512_loadu_ps(qd + r * Dp + c));
        _mm512_storeu_si512(ws.q_pairs.data() + r * W + c / 2, (__m512i)h);
      }
    qw = ws.q_pairs.data();
    if (tiles_by_fma && rows >= kTransposedRows) {  // the transposed scores' rows, by FMAs
      ws.q_halves.resize(rows * W * 2);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t w = 0; w < W; w += 16) {  // row r's W high halves, then its W low ones
          const __m512i words = _mm512_loadu_si512(qw + r * W + w);
          _mm512_storeu_ps(ws.q_halves.data() + r * 2 * W + w, high_halves(words));
          _mm512_storeu_ps(ws.q_halves.data() + r * 2 * W + W + w, low_halves(words));
        }
    }
  }
#else
  constexpr bool kWords = false;
  constexpr int64_t W = 0;
  const uint32_t* qw = nullptr;
#endif
  // The thread's previous tile may have left this tile's keys and values (Workspace): the blocks it kept are not
  // read from the pool again. The same floats, so the same bits.
  if (ws.kept_slots != slots || ws.kept_kvh != kvh || ws.kept_lo != c_lo) {
    ws.kept_slots = slots, ws.kept_kvh = kvh, ws.kept_lo = c_lo;
    ws.kept_blocks = ws.kept_values = 0;
  }
#ifdef SJ_AMX_SCORES
  if constexpr (std::is_same<C, at::BFloat16>::value) {
    score_chunk_amx(bt, qd, Dp, rows, k_cache, slots, kvh, c_lo, c_end, scores, ld_scores, ws);
  } else
#endif
  {
  const int64_t whole_blocks = SJ_VEC_BYTES >= 32 ? (c_end - c_lo) / kKeyBlock : 0;  // the base build goes key by key
#if SJ_VEC_BYTES == 64
  const bool transposed = rows >= kTransposedRows;
#else
  const bool transposed = false;
#endif
  if (ws.kept_transposed != transposed) ws.kept_transposed = transposed, ws.kept_blocks = 0;  // kept in the other form
  const int64_t kept_blocks = ws.kept_blocks;
  if (ws.keys.size() < static_cast<size_t>(whole_blocks * kKeyBlock * Dp))
    ws.keys.resize(whole_blocks * kKeyBlock * Dp);  // a larger vector keeps the blocks already in it
  float* kept_keys = ws.keys.data();
  constexpr int64_t kAhead = 8;  // keys fetched ahead where they go one by one
  // Whole blocks of keys are fetched kKeyBlocksAhead blocks ahead of the one widened: a KV head's key is one row of
  // num_kv_heads in each slot (the default model: 2 of every 6 cache lines), which the hardware's prefetchers alone
  // did not fetch early enough (a long context's decode step and verify waited on the widening's loads).
  constexpr int64_t kKeyBlocksAhead = 4;
  const int64_t fresh_from = c_lo + kept_blocks * kKeyBlock;  // the first key not kept from the previous tile
  const int64_t fetched_first = std::max(kAhead, whole_blocks > kept_blocks ? kKeyBlocksAhead * kKeyBlock : 0);
  for (int64_t p = fresh_from; p < std::min(c_end, fresh_from + fetched_first); ++p)
    prefetch_row(k_cache + slots[p] * bt.slot_stride + kvh * bt.head_stride, D);
  int64_t p0 = c_lo;
#if SJ_VEC_BYTES >= 32
  for (; p0 + kKeyBlock <= c_end; p0 += kKeyBlock) {  // whole blocks of keys, then key by key
    const int64_t block = (p0 - c_lo) / kKeyBlock;
    float* kept_block = kept_keys + block * kKeyBlock * Dp;
    if (block >= kept_blocks) {
      for (int64_t p = p0 + kKeyBlocksAhead * kKeyBlock; p < std::min(c_end, p0 + (kKeyBlocksAhead + 1) * kKeyBlock); ++p)
        prefetch_row(k_cache + slots[p] * bt.slot_stride + kvh * bt.head_stride, D);
      // Widened into kd (its padding zeroed above) and transposed into the kept block, or widened there. (bf16dp:
      // a tile of many rows transposes the keys' words, unwidened; a decode step's rows read the keys in place.)
      float* dst = transposed ? kd : kept_block;
      if constexpr (kWords) {
#if SJ_VEC_BYTES == 64
        if (transposed) {
          for (int64_t j = 0; j < kKeyBlock; ++j)
            std::memcpy(kd + j * W, k_cache + slots[p0 + j] * bt.slot_stride + kvh * bt.head_stride, W * 4);
#ifdef SJ_BF16_SCORES
          if (tiles_by_fma) {  // kept as each word's high and low halves in float32, 16 keys each
            alignas(64) float words[kKeyBlock * 64];
            transpose_keys(kd, W, words);
            for (int64_t w = 0; w < W; ++w) {
              const __m512i k = _mm512_load_si512(words + w * kKeyBlock);
              _mm512_storeu_ps(kept_block + w * 2 * kKeyBlock, high_halves(k));
              _mm512_storeu_ps(kept_block + (w * 2 + 1) * kKeyBlock, low_halves(k));
            }
          } else
#endif
          transpose_keys(kd, W, kept_block);
        }
#endif
      } else {
        for (int64_t j = 0; j < kKeyBlock; ++j) {
          widen(k_cache + slots[p0 + j] * bt.slot_stride + kvh * bt.head_stride, dst + j * Dp, D);
          if (!transposed) std::fill(dst + j * Dp + D, dst + (j + 1) * Dp, 0.0f);
        }
#if SJ_VEC_BYTES == 64
        if (transposed) transpose_keys(kd, Dp, kept_block);
#endif
      }
    }
#if SJ_VEC_BYTES == 64
    if (transposed) {  // blocks scored in pairs once both are ready (an even block waits for its partner)
      const bool pair = block % 2 == 1, last = p0 + 2 * kKeyBlock > c_end;
      if (!pair && !last) continue;
      const int64_t first = pair ? p0 - kKeyBlock : p0;
      const float* kt = pair ? kept_block - kKeyBlock * Dp : kept_block;
      float* sp = scores + first - c_lo;
      int64_t r = 0;
#ifdef SJ_BF16_SCORES
      if constexpr (kWords) {
        const float* kt2 = pair ? kt + kKeyBlock * Dp : kt;  // a lone block is scored twice, its 16 scores kept
        alignas(64) float lone[kTransposedRowBlock * 2 * kKeyBlock];
        for (; r < rows; r += kTransposedRowBlock) {
          const int64_t n = std::min<int64_t>(kTransposedRowBlock, rows - r);
          float* o = pair ? sp + r * ld_scores : lone;
          const int64_t ld = pair ? ld_scores : 2 * kKeyBlock;
          const float* qh = ws.q_halves.data();
          if (n == kTransposedRowBlock) {
            if (tiles_by_fma) score_word_pairs_transposed_fma<kTransposedRowBlock>(qh + r * W * 2, W, kt, kt2, o, ld);
            else score_word_pairs_transposed<kTransposedRowBlock>(qw + r * W, W, kt, kt2, o, ld);
          } else {
            for (int64_t i = 0; i < n; ++i) {
              if (tiles_by_fma) score_word_pairs_transposed_fma<1>(qh + (r + i) * W * 2, W, kt, kt2, o + i * ld, ld);
              else score_word_pairs_transposed<1>(qw + (r + i) * W, W, kt, kt2, o + i * ld, ld);
            }
          }
          if (!pair)
            for (int64_t i = 0; i < n; ++i) std::memcpy(sp + (r + i) * ld_scores, lone + i * ld, kKeyBlock * sizeof(float));
        }
        continue;
      }
#endif
      for (; r + kTransposedRowBlock <= rows; r += kTransposedRowBlock) {
        if (pair) score_key_pairs_transposed<kTransposedRowBlock>(qd + r * Dp, Dp, kt, sp + r * ld_scores, ld_scores);
        else score_keys_transposed<kTransposedRowBlock>(qd + r * Dp, Dp, kt, sp + r * ld_scores, ld_scores);
      }
      for (; r < rows; ++r)
        for (int64_t b = 0; b < (pair ? 2 : 1); ++b)
          score_keys_transposed<1>(qd + r * Dp, Dp, kt + b * kKeyBlock * Dp, sp + r * ld_scores + b * kKeyBlock, ld_scores);
      continue;
    }
#endif
#ifdef SJ_BF16_SCORES
    if constexpr (kWords) {
      for (int64_t r = 0; r < rows; ++r) {
        lanes_d a[kKeyBlock];
        if (W == 32) {  // head_dim 64: the row's two steps of q held in registers across the block's keys
          const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qw + r * W), q1 = (__m512bh)_mm512_loadu_si512(qw + r * W + 16);
          for (int64_t j = 0; j < kKeyBlock; ++j) {
            const auto* k = reinterpret_cast<const char*>(k_cache + slots[p0 + j] * bt.slot_stride + kvh * bt.head_stride);
            const __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), q0);
            a[j].part[0] = (vec_d)_mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(k + 64), q1);
          }
        } else {
          for (int64_t j = 0; j < kKeyBlock; ++j)
            a[j] = word_lanes(qw + r * W, k_cache + slots[p0 + j] * bt.slot_stride + kvh * bt.head_stride, W);
        }
        sum_lanes_of_keys(a, scores + r * ld_scores + p0 - c_lo);
      }
      continue;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) score_keys(qd + r * Dp, Dp, kept_block, scores + r * ld_scores + p0 - c_lo);
  }
#endif
  ws.kept_blocks = std::max(kept_blocks, whole_blocks);
  for (int64_t p = p0; p < c_end; ++p) {
    if (p + kAhead < c_end) prefetch_row(k_cache + slots[p + kAhead] * bt.slot_stride + kvh * bt.head_stride, D);
#ifdef SJ_BF16_SCORES
    if constexpr (kWords) {
      for (int64_t r = 0; r < rows; ++r)
        scores[r * ld_scores + p - c_lo] = sum_lanes(word_lanes(qw + r * W, k_cache + slots[p] * bt.slot_stride + kvh * bt.head_stride, W));
      continue;
    }
#endif
    widen(k_cache + slots[p] * bt.slot_stride + kvh * bt.head_stride, kd, D);  // kd[D .. Dp) stay zero
    int64_t r = 0;
    float* sp = scores + p - c_lo;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      score_key<kRowBlock>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores);
    switch (rows - r) {
      case 3: score_key<3>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      case 2: score_key<2>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      case 1: score_key<1>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      default: break;
    }
  }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scores + r * ld_scores;  // position p at s[p - c_lo]
    // A maximum is exact in any order, so the shared keys' part goes a vector at a time.
    const int64_t shared_end = std::max(c_lo, std::min(seen_by_all, row_end[r]));
    float m = max_of(s, shared_end - c_lo, row_max[r]);
    for (int64_t p = shared_end; p < row_end[r]; ++p)
      if (visible(r, p) && s[p - c_lo] > m) m = s[p - c_lo];
    row_max[r] = m;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld_scores;
    const float m = row_max[r];
    if (m == -std::numeric_limits<float>::infinity()) continue;  // no key of this chunk is visible to the row
    // Every score of the row is replaced by its weight; masked positions hold garbage and are skipped below.
    const int64_t n = std::min(ld_scores, (row_end[r] - c_lo + kVecLanes - 1) / kVecLanes * kVecLanes);
    for (int64_t v = 0; v < n; v += kVecLanes)
      for (int64_t l = 0; l < kVecLanes; ++l) s[v + l] = exp_nonpositive(s[v + l] - m);
  }
  // Weights x V: acc[r][d] adds w_p * v_p[d] over the row's visible keys in position order (the same
  // for every d, whether the sum sits in a register or in memory), and row_sum[r] the w_p themselves. A bf16
  // pool's values are widened to float once for the chunk where several blocks of rows read them (a verify's
  // or a prefill's tile), not once per block: the same floats, so the same bits.
  auto pool_row = [&](int64_t p) { return v_cache + slots[p] * bt.slot_stride + kvh * bt.head_stride; };
#ifdef SJ_BF16_SCORES
  if constexpr (kWords) {
    weigh_value_pairs(pool_row, c_lo, c_end, seen_by_all, D, rows, scores, ld_scores, visible, row_max, acc, row_sum, ws);
  } else
#endif
  if (!std::is_same<C, float>::value && rows > kPvRows) {
    if (ws.vd.size() < static_cast<size_t>((c_end - c_lo) * D)) ws.vd.resize((c_end - c_lo) * D);
    float* vd = ws.vd.data();
    // A value row's widening is a few instructions, so its loads are fetched far ahead (kWidenAhead keys).
    for (int64_t p = c_lo + ws.kept_values; p < c_end; ++p) {
      if (p + kWidenAhead < c_end) prefetch_row(pool_row(p + kWidenAhead), D);
      widen(pool_row(p), vd + (p - c_lo) * D, D);
    }
    ws.kept_values = std::max(ws.kept_values, c_end - c_lo);
    weigh_all_values([&](int64_t p) -> const float* { return vd + (p - c_lo) * D; }, c_lo, c_end, seen_by_all, D, rows,
                     scores, ld_scores, visible, acc, row_sum, kd, false);
  } else {
    weigh_all_values(pool_row, c_lo, c_end, seen_by_all, D, rows, scores, ld_scores, visible, acc, row_sum, kd, true);
  }
  if (partial != nullptr) {
    const int64_t width = partial_width(D);
    for (int64_t r = 0; r < rows; ++r) {
      float* part = partial + r * width;
      part[0] = row_max[r];
      part[1] = row_sum[r];
      std::memcpy(part + 2, acc + r * D, D * sizeof(float));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / heads, h = kvh * group + h0 + r % heads;
    T* dst = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(acc[r * D + d] / row_sum[r]));
  }
}

// The rows of one (request, KV head, tile, query heads h0 .. h1) from its `chunks` parts (chunk c's at
// partials + c * rows * partial_width): m = the largest chunk maximum; each chunk's sum and weights x V
// scaled by exp(its maximum - m) and added in chunk order; the output their quotient.
template <class T>
void merge_chunks(const Batch& bt, T* out, int64_t b, int64_t kvh, int64_t j0, int64_t j1, int64_t h0, int64_t h1,
                  int64_t chunks, const float* partials, std::vector<float>& acc) {
  const int64_t D = bt.head_dim, H = bt.num_heads, group = H / bt.num_kv_heads, heads = h1 - h0;
  const int64_t rows = (j1 - j0) * heads, width = partial_width(D), stride = rows * width;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  acc.resize(D);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNone;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, partials[c * stride + r * width]);
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = partials + c * stride + r * width;
      if (part[0] == kNone) continue;  // the row sees no key of this chunk
      const float f = exp_nonpositive(part[0] - m);
      sum += f * part[1];
      for (int64_t d = 0; d < D; ++d) acc[d] += f * part[2 + d];
    }
    const int64_t t = bt.q_starts[b] + j0 + r / heads, h = kvh * group + h0 + r % heads;
    T* dst = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(acc[d] / sum));
  }
}

#ifndef SJ_BF16_SCORES
struct SubnormalsAsZero {};  // only the bf16dp build changes the subnormal mode
#endif
// Sets `flush` (SubnormalsAsZero for the calling thread until it goes) where the bf16dp build works on a bf16 pool.
template <class C>
SJ_INLINE void flush_subnormals_for(std::optional<SubnormalsAsZero>& flush) {
#ifdef SJ_BF16_SCORES
  if constexpr (std::is_same<C, at::BFloat16>::value) flush.emplace();
#endif
}

// Every (request, KV head, query tile, key chunk) of the batch, spread over the threads. When those are too
// few to share out evenly (a decode step of one request with a short context: as many items as KV heads),
// each is split by query head: each key is then read once per head instead of once per group, but no thread
// idles. Threads take runs of consecutive items of about equal cost (rows x keys seen), not equal counts:
// a verify of 26 nodes has tiles of 8, 8, 8 and 2 tokens. Within a request the units go chunk by chunk, a
// KV head's tiles of a chunk back to back, so a thread taking two of them reads those keys and values from
// memory once. Rows whose keys span several chunks are then merged (merge_chunks), again spread over the
// threads. C: the KV pool's element type, T's or bf16 beside float rows (kv_cache_dtype).
template <class T, class C>
void attend_all(const Batch& bt, const T* q, const C* k, const C* v, T* out, int64_t batch) {
  const int64_t group = bt.num_heads / bt.num_kv_heads, D = bt.head_dim;
  // The keys the rows of request b's tile [j0, j1) see: causal rows up to their own token.
  auto keys_seen = [&](int64_t b, int64_t j1) { return bt.mask ? bt.kv_lens[b] : bt.kv_lens[b] - bt.q_lens[b] + j1; };
  auto chunks_of = [&](int64_t keys) { return std::max<int64_t>(1, (keys + kKeyChunk - 1) / kKeyChunk); };
  int64_t items = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j0 = 0; j0 < bt.q_lens[b]; j0 += kQueryTile)
      items += bt.num_kv_heads * chunks_of(keys_seen(b, std::min(bt.q_lens[b], j0 + kQueryTile)));
  const int64_t threads = at::get_num_threads();
  const int64_t parts = (threads > 1 && items % threads != 0 && items < 4 * threads) ? std::min(group, threads) : 1;
  struct Unit {
    int64_t b, kvh, j0, j1, h0, h1, c_lo, c_hi, partial;  // partial: offset in `partials`, or -1 (write out)
  };
  struct Merge {
    int64_t b, kvh, j0, j1, h0, h1, chunks, partial;
  };
  // Each (request, KV head, tile, query heads) group's chunks; a group of several keeps its parts for a merge.
  std::vector<Merge> groups, merges;
  int64_t partial_floats = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t tiles = (bt.q_lens[b] + kQueryTile - 1) / kQueryTile;
    for (int64_t kvh = 0; kvh < bt.num_kv_heads; ++kvh)
      for (int64_t tile = 0; tile < tiles; ++tile)
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t j0 = tile * kQueryTile, j1 = std::min(bt.q_lens[b], j0 + kQueryTile);
          const int64_t h0 = part * group / parts, h1 = (part + 1) * group / parts;
          const int64_t chunks = chunks_of(keys_seen(b, j1));
          groups.push_back({b, kvh, j0, j1, h0, h1, chunks, chunks > 1 ? partial_floats : -1});
          if (chunks > 1) {
            merges.push_back(groups.back());
            partial_floats += chunks * (j1 - j0) * (h1 - h0) * partial_width(D);
          }
        }
  }
  // Units in chunk order within a request, every group's part of a chunk together (a thread's share is a
  // stretch of the request's slots, whose KV heads lie side by side in the pool).
  std::vector<Unit> units;
  units.reserve(items * parts);
  std::vector<double> cost_end;  // cumulative cost of units [0, i]
  cost_end.reserve(items * parts);
  double total = 0.0;
  for (size_t g0 = 0; g0 < groups.size();) {
    size_t g1 = g0;
    int64_t most = 0;
    for (; g1 < groups.size() && groups[g1].b == groups[g0].b; ++g1) most = std::max(most, groups[g1].chunks);
    for (int64_t c = 0; c < most; ++c)
      for (size_t g = g0; g < g1; ++g) {
        const Merge& m = groups[g];
        if (c >= m.chunks) continue;
        const int64_t keys = keys_seen(m.b, m.j1), rows = (m.j1 - m.j0) * (m.h1 - m.h0);
        // A masked request's chunk that ends among its new tokens spans them all: its rows' ranks, not positions,
        // say which of them it holds (attend_tile).
        const int64_t prefix = bt.kv_lens[m.b] - bt.q_lens[m.b], c_lo = c * kKeyChunk;
        const int64_t c_hi = m.chunks > 1 && !(bt.mask && c_lo + kKeyChunk > prefix) ? std::min(keys, c_lo + kKeyChunk) : keys;
        units.push_back({m.b, m.kvh, m.j0, m.j1, m.h0, m.h1, c_lo, c_hi,
                         m.partial < 0 ? -1 : m.partial + c * rows * partial_width(D)});
        total += static_cast<double>(rows) * static_cast<double>(c_hi - c_lo) + 1.0;
        cost_end.push_back(total);
      }
    g0 = g1;
  }
  std::vector<float> partials(partial_floats);
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t shares = std::max<int64_t>(1, std::min(threads, n));
  const std::vector<int64_t> starts = specjet_cpu::cost_share_starts(cost_end, shares);
  auto share_start = [&](int64_t s) -> int64_t { return starts[std::clamp<int64_t>(s, 0, shares)]; };
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    std::optional<SubnormalsAsZero> flush;  // a bf16 pool's every operation, decode rows and tiles alike
    flush_subnormals_for<C>(flush);
    static thread_local Workspace thread_ws;  // looked up once a call, then passed by reference
    Workspace& ws = thread_ws;
    ws.kept_slots = nullptr;  // nothing kept from the last call: the pools may have changed since
    for (int64_t i = share_start(s0); i < share_start(s1); ++i) {
      const Unit& u = units[i];
      attend_tile(bt, q, k, v, out, u.b, u.kvh, u.j0, u.j1, u.h0, u.h1, u.c_lo, u.c_hi,
                  u.partial < 0 ? nullptr : partials.data() + u.partial, ws);
    }
  });
  if (merges.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t m0, int64_t m1) {
    std::optional<SubnormalsAsZero> flush;
    flush_subnormals_for<C>(flush);
    std::vector<float> acc;
    for (int64_t i = m0; i < m1; ++i) {
      const Merge& m = merges[i];
      merge_chunks(bt, out, m.b, m.kvh, m.j0, m.j1, m.h0, m.h1, m.chunks, partials.data() + m.partial, acc);
    }
  });
}
