// The tile kernels of qgemm.cpp, compiled once per instruction set: qgemm.cpp includes this file
// inside a namespace under `#pragma GCC target(...)` with SJ_VEC set to 16 (AVX-512) or 8 (AVX2).
//
// Batch invariance: every output element y[r, n] is one vector accumulator that takes the products
// of its K inputs in the same order (block by block, sub-vector by sub-vector, one FMA each), then
// one horizontal sum and the bias. The tile sizes only decide which accumulators share a register
// file, never the arithmetic of one accumulator, so a row gets the same bits in a call of any
// number of rows (and under any thread count: one element is computed by one thread).

#if SJ_VEC == 16
using vec = __m512;
static inline vec v_zero() { return _mm512_setzero_ps(); }
static inline vec v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline vec v_set1(float a) { return _mm512_set1_ps(a); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline float v_hsum(vec a) {
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
// 16 nibbles: `bytes` holds 16 bytes, `shift` picks the low (0) or high (4) nibble of each.
static inline vec v_nibbles(const uint8_t* bytes, int shift) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  b = _mm_and_si128(_mm_srli_epi16(b, shift), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}
static inline vec v_int8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#else
using vec = __m256;
static inline vec v_zero() { return _mm256_setzero_ps(); }
static inline vec v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline vec v_set1(float a) { return _mm256_set1_ps(a); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec v_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline float v_hsum(vec a) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
static inline vec v_nibbles(const uint8_t* bytes, int shift) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  b = _mm_and_si128(_mm_srli_epi16(b, shift), _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
static inline vec v_int8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
#endif

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

constexpr int kVec = SJ_VEC;
constexpr int kSub = kBlock / kVec;  // sub-vectors per 32-weight block

// Q4_1 block of one column: weight i of the block is d * q_i + m, q_i the low nibble of byte i for
// i < 16 and the high nibble of byte i - 16 otherwise (llama.cpp's layout).
struct Q41Col {
  const uint8_t* qs;     // the column's K / 2 bytes
  const uint16_t* d;     // its K / 32 fp16 scales
  const uint16_t* m;     // its K / 32 fp16 minimums
  int64_t kb;            // block index set by begin()
  vec dv, mv;
  inline void begin(int64_t b) { kb = b; dv = v_set1(half_to_float(d[b])); mv = v_set1(half_to_float(m[b])); }
  // Sub-vector j covers weights j * kVec .. j * kVec + kVec - 1 of the block.
  inline vec sub(int j) const {
    const int half = j / (16 / kVec), part = j % (16 / kVec);
    return v_fma(v_nibbles(qs + kb * 16 + part * kVec, 4 * half), dv, mv);
  }
};

// int8 block of one column: weight i is s * q_i, one fp16 scale per `group` weights.
struct Int8Col {
  const int8_t* q;       // the column's K weights
  const uint16_t* s;     // its K / group fp16 scales
  int64_t blocks_per_group;
  int64_t kb;
  vec sv;
  inline void begin(int64_t b) { kb = b; sv = v_set1(half_to_float(s[b / blocks_per_group])); }
  inline vec sub(int j) const { return v_mul(v_int8(q + kb * kBlock + j * kVec), sv); }
};

// y[r0 .. r0 + R, n0 .. n0 + C] for R rows and C columns, every block of K.
template <int R, int C, class Col>
static inline void tile(const float* x, int64_t ldx, Col* cols, int64_t nblocks, const float* bias,
                        float* y, int64_t ldy) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v_zero();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int c = 0; c < C; ++c) cols[c].begin(b);
    for (int j = 0; j < kSub; ++j) {
      vec w[C];
      for (int c = 0; c < C; ++c) w[c] = cols[c].sub(j);
      for (int r = 0; r < R; ++r) {
        const vec xv = v_load(x + r * ldx + b * kBlock + j * kVec);
        for (int c = 0; c < C; ++c) acc[r][c] = v_fma(xv, w[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = v_hsum(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

// Rows of one column tile: full row tiles, then the remainder with the same per-element arithmetic.
template <int C, class Col>
static void column_tile(const float* x, int64_t rows, int64_t ldx, Col* cols, int64_t nblocks, const float* bias,
                        float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) tile<kRows, C>(x + r * ldx, ldx, cols, nblocks, bias, y + r * ldy, ldy);
  switch (rows - r) {
    case 0: break;
    case 1: tile<1, C>(x + r * ldx, ldx, cols, nblocks, bias, y + r * ldy, ldy); break;
    case 2: tile<2, C>(x + r * ldx, ldx, cols, nblocks, bias, y + r * ldy, ldy); break;
    case 3: tile<3, C>(x + r * ldx, ldx, cols, nblocks, bias, y + r * ldy, ldy); break;
  }
}

template <class MakeCol>
static void run_columns(const float* x, int64_t rows, int64_t ldx, int64_t n_begin, int64_t n_end, int64_t nblocks,
                        const float* bias, float* y, int64_t ldy, const MakeCol& make) {
  using Col = decltype(make(0));
  int64_t n = n_begin;
  for (; n + kCols <= n_end; n += kCols) {
    Col cols[kCols];
    for (int c = 0; c < kCols; ++c) cols[c] = make(n + c);
    column_tile<kCols>(x, rows, ldx, cols, nblocks, bias ? bias + n : nullptr, y + n, ldy);
  }
  for (; n < n_end; ++n) {
    Col col = make(n);
    column_tile<1>(x, rows, ldx, &col, nblocks, bias ? bias + n : nullptr, y + n, ldy);
  }
}

static void q4_1(const float* x, int64_t rows, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                 const float* bias, float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t nb = K / kBlock;
  run_columns(x, rows, K, n_begin, n_end, nb, bias, y, N, [&](int64_t n) {
    Q41Col col;
    col.qs = qs + n * (K / 2);
    col.d = d + n * nb;
    col.m = m + n * nb;
    return col;
  });
}

static void int8(const float* x, int64_t rows, int64_t K, const int8_t* q, const uint16_t* s, int64_t group,
                 const float* bias, float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t nb = K / kBlock;
  run_columns(x, rows, K, n_begin, n_end, nb, bias, y, N, [&](int64_t n) {
    Int8Col col;
    col.q = q + n * K;
    col.s = s + n * (K / group);
    col.blocks_per_group = group / kBlock;
    return col;
  });
}
