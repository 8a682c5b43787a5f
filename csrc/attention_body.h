// The kernels of attention.cpp, compiled once per instruction set: attention.cpp includes this file
// inside a namespace under `#pragma GCC target(...)`. Lanes stay independent and no product is fused
// with its sum (-ffp-contract=off), so every build gives the same bits; only the speed differs.

// Query tokens of one request handled together, with all the query heads of one KV head: each key is
// loaded and widened once for all of them.
constexpr int64_t kQueryTile = 8;
// Rows whose sums advance together (independent chains of adds).
constexpr int kRowBlock = 4;

// A score q . k is summed in kLanes float32 lanes, lane i adding the products of d = i, i + kLanes, ...
// in order, then the lanes in one fixed tree. The lane count is fixed, not the register width: a lanes_d
// is one AVX-512 register, two AVX2 or four SSE2 ones, and every build adds the same numbers in the
// same order. (Keys are used as they lie in the pool: no transposition.)
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
// acc += x * y, lane by lane (a product, then a sum: never fused).
SJ_INLINE void mul_add(lanes_d& acc, const lanes_d& x, const lanes_d& y) {
  for (int i = 0; i < kParts; ++i) acc.part[i] += x.part[i] * y.part[i];
}
SJ_INLINE void scale_add(lanes_d& acc, float w, const lanes_d& x) {
  for (int i = 0; i < kParts; ++i) acc.part[i] += w * x.part[i];
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
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

// exp(x) for x <= 0 (a score minus its row's maximum), exp_float.h's; below -87 the weight is under
// 2e-38 of the row's largest and is taken as 0.
inline float exp_nonpositive(float x) { return x < -87.0f ? 0.0f : exp_float(x); }

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
  if constexpr (std::is_same<T, float>::value) return load_lanes(src);  // no trip through a stack copy
  float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(src[i]);
  return load_lanes(tmp);
}

// acc[r][c0 .. c0 + kPvDims) for rows r0 .. r0 + R: the sums over keys p = 0, 1, ... of w[r][p] * v_p.
template <int R, class T, class Visible>
SJ_INLINE void weigh_values(const Batch& bt, const T* v_cache, const int64_t* slots, int64_t kvh, int64_t kv_end,
                         int64_t prefix, int64_t r0, int64_t c0, const float* scores, int64_t ld_scores,
                         const Visible& visible, float* acc) {
  const int64_t D = bt.head_dim, KV = bt.num_kv_heads;
  lanes_d sum[R][kPvVecs];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kPvVecs; ++i) sum[r][i] = zero_lanes();
  constexpr int64_t kAhead = 8;
  for (int64_t p = 0; p < kv_end; ++p) {
    if (p + kAhead < kv_end) prefetch_row(v_cache + (slots[p + kAhead] * KV + kvh) * D + c0, kPvDims);
    const T* v = v_cache + (slots[p] * KV + kvh) * D + c0;
    lanes_d vl[kPvVecs];
    for (int i = 0; i < kPvVecs; ++i) vl[i] = widen_lanes(v + i * kLanes);
    const bool all = p < prefix;
    for (int r = 0; r < R; ++r) {
      if (!all && !visible(r0 + r, p)) continue;
      const float w = scores[(r0 + r) * ld_scores + p];
      for (int i = 0; i < kPvVecs; ++i) scale_add(sum[r][i], w, vl[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kPvVecs; ++i) store_lanes(acc + (r0 + r) * D + c0 + i * kLanes, sum[r][i]);
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

constexpr int kSumRows = 8;
// row_sum[r] for rows r0 .. r0 + R: the weights of the row's visible keys added in position order.
template <int R, class Visible>
SJ_INLINE void sum_weights(const float* scores, int64_t ld_scores, int64_t r0, int64_t prefix, int64_t kv_end,
                           const Visible& visible, float* row_sum) {
  float sum[R];
  for (int r = 0; r < R; ++r) sum[r] = 0.0f;
  const float* s = scores + r0 * ld_scores;
  for (int64_t p = 0; p < prefix; ++p)  // seen by every row
    for (int r = 0; r < R; ++r) sum[r] += s[r * ld_scores + p];
  for (int64_t p = prefix; p < kv_end; ++p)
    for (int r = 0; r < R; ++r)
      if (visible(r0 + r, p)) sum[r] += s[r * ld_scores + p];
  for (int r = 0; r < R; ++r) row_sum[r0 + r] = sum[r];
}

// A thread's scratch, reused across its tiles (local to the parallel region: thread_local storage in a
// shared library costs a lookup per access in the inner loops).
struct Workspace {
  std::vector<float> qd, scores, acc, kd, row_max, row_sum;
  std::vector<int64_t> row_end;
  std::vector<const bool*> row_mask;
};

// One (request, KV head, tile of the request's new tokens, query heads h0 .. h1 of the KV head's group):
// rows r = token j0 + r / heads, query head kvh * group + h0 + r % heads. A row's arithmetic is its own,
// so how rows are grouped into tiles never changes a bit.
template <class T>
void attend_tile(const Batch& bt, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t b, int64_t kvh,
                 int64_t j0, int64_t j1, int64_t h0, int64_t h1, Workspace& ws) {
  const int64_t D = bt.head_dim, H = bt.num_heads, KV = bt.num_kv_heads, group = H / KV, heads = h1 - h0;
  const int64_t kv_len = bt.kv_lens[b], q_len = bt.q_lens[b], prefix = kv_len - q_len;
  const int64_t rows = (j1 - j0) * heads;
  // Causal rows see nothing past their own token; a custom mask may allow any new token.
  const int64_t kv_end = bt.mask ? kv_len : prefix + j1;
  const int64_t* slots = bt.kv_indices + b * bt.max_kv;
  const bool* mask = bt.mask ? bt.mask + b * bt.max_q * bt.max_q : nullptr;
  // Keys before `prefix` are seen by every row; a new token's key by the rows its mask (or causality) allows:
  // a causal row sees nothing from row_end on; a masked row, what its mask row allows.
  ws.row_end.resize(rows);
  ws.row_mask.resize(rows);
  int64_t* row_end = ws.row_end.data();
  const bool** row_mask = ws.row_mask.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = j0 + r / heads;
    row_end[r] = mask ? kv_end : prefix + j + 1;
    row_mask[r] = mask ? mask + j * bt.max_q - prefix : nullptr;  // indexed by key position p >= prefix
  }
  auto visible = [&](int64_t r, int64_t p) {
    return p < row_end[r] && (p < prefix || row_mask[r] == nullptr || row_mask[r][p]);
  };

  const int64_t ld_scores = kv_end;  // a row's scores, one per key position
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  ws.qd.assign(rows * Dp, 0.0);
  ws.scores.resize(rows * ld_scores);
  ws.acc.assign(rows * D, 0.0);
  ws.kd.assign(kKeyBlock * Dp, 0.0);
  ws.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  ws.row_sum.assign(rows, 0.0);
  float *qd = ws.qd.data(), *scores = ws.scores.data(), *acc = ws.acc.data(), *kd = ws.kd.data(),
        *row_max = ws.row_max.data(), *row_sum = ws.row_sum.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / heads, h = kvh * group + h0 + r % heads;
    widen(q + (t * H + h) * D, qd + r * Dp, D);
    for (int64_t d = 0; d < D; ++d) qd[r * Dp + d] *= static_cast<float>(bt.scale);
  }
  constexpr int64_t kAhead = 8;
  for (int64_t p = 0; p < std::min(kv_end, kAhead); ++p) prefetch_row(k_cache + (slots[p] * KV + kvh) * D, D);
  int64_t p0 = 0;
#if SJ_VEC_BYTES >= 32
  for (; p0 + kKeyBlock <= kv_end; p0 += kKeyBlock) {  // whole blocks of keys, then key by key
    for (int64_t p = p0 + kKeyBlock; p < std::min(kv_end, p0 + 2 * kKeyBlock); ++p)
      prefetch_row(k_cache + (slots[p] * KV + kvh) * D, D);
    for (int64_t j = 0; j < kKeyBlock; ++j) widen(k_cache + (slots[p0 + j] * KV + kvh) * D, kd + j * Dp, D);
    for (int64_t r = 0; r < rows; ++r) score_keys(qd + r * Dp, Dp, kd, scores + r * ld_scores + p0);
  }
#endif
  for (int64_t p = p0; p < kv_end; ++p) {
    if (p + kAhead < kv_end) prefetch_row(k_cache + (slots[p + kAhead] * KV + kvh) * D, D);
    widen(k_cache + (slots[p] * KV + kvh) * D, kd, D);  // kd[D .. Dp) stay zero
    int64_t r = 0;
    float* sp = scores + p;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      score_key<kRowBlock>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores);
    switch (rows - r) {
      case 3: score_key<3>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      case 2: score_key<2>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      case 1: score_key<1>(qd + r * Dp, Dp, kd, sp + r * ld_scores, ld_scores); break;
      default: break;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scores + r * ld_scores;
    // A maximum is exact in any order, so the shared keys' part goes a vector at a time.
    float m = max_of(s, std::min(prefix, row_end[r]), row_max[r]);
    for (int64_t p = prefix; p < row_end[r]; ++p)
      if (visible(r, p) && s[p] > m) m = s[p];
    row_max[r] = m;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld_scores;
    const float m = row_max[r];
    // Every score of the row is replaced by its weight; masked positions hold garbage and are skipped below.
    for (int64_t p = 0; p < row_end[r]; ++p) s[p] = exp_nonpositive(s[p] - m);
  }
  // Weights x V: acc[r][d] adds w_p * v_p[d] over the row's visible keys in position order (the same
  // for every d, whether the sum sits in a register or in memory), kPvRows rows and kPvDims dims at a
  // time in registers; a head_dim tail that does not fill kPvDims goes through memory.
  int64_t c0 = 0;
  for (; c0 + kPvDims <= D; c0 += kPvDims) {
    int64_t r = 0;
    for (; r + kPvRows <= rows; r += kPvRows) weigh_values<kPvRows>(bt, v_cache, slots, kvh, kv_end, prefix, r, c0, scores, ld_scores, visible, acc);
    for (; r < rows; ++r) weigh_values<1>(bt, v_cache, slots, kvh, kv_end, prefix, r, c0, scores, ld_scores, visible, acc);
  }
  if (c0 < D) {
    for (int64_t p = 0; p < kv_end; ++p) {
      widen(v_cache + (slots[p] * KV + kvh) * D, kd, D);
      const bool all = p < prefix;
      for (int64_t r = 0; r < rows; ++r) {
        if (!all && !visible(r, p)) continue;
        const float w = scores[r * ld_scores + p];
        float* o = acc + r * D;
        for (int64_t d = c0; d < D; ++d) o[d] += w * kd[d];
      }
    }
  }
  // The softmax denominators, each a sum in position order; kSumRows rows' sums advance together in
  // registers (one row's chain of dependent adds alone waits on each add's latency).
  {
    int64_t r = 0;
    for (; r + kSumRows <= rows; r += kSumRows) sum_weights<kSumRows>(scores, ld_scores, r, prefix, kv_end, visible, row_sum);
    for (; r < rows; ++r) sum_weights<1>(scores, ld_scores, r, prefix, kv_end, visible, row_sum);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / heads, h = kvh * group + h0 + r % heads;
    T* dst = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(acc[r * D + d] / row_sum[r]));
  }
}

// Every (request, KV head, query tile) of the batch, spread over the threads. When those are too few
// to share out evenly (a decode step of one request: as many items as KV heads), each is split by
// query head: each key is then read once per head instead of once per group, but no thread idles.
// Threads take runs of consecutive items of about equal cost (rows x keys seen), not equal counts:
// a verify of 26 nodes has tiles of 8, 8, 8 and 2 tokens. A KV head's tiles are consecutive, so a
// thread taking two of them reads that head's keys and values from memory once.
template <class T>
void attend_all(const Batch& bt, const T* q, const T* k, const T* v, T* out, int64_t batch) {
  const int64_t group = bt.num_heads / bt.num_kv_heads;
  int64_t items = 0;
  for (int64_t b = 0; b < batch; ++b) items += bt.num_kv_heads * ((bt.q_lens[b] + kQueryTile - 1) / kQueryTile);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = (threads > 1 && items % threads != 0 && items < 4 * threads) ? std::min(group, threads) : 1;
  struct Unit {
    int64_t b, kvh, j0, j1, h0, h1;
  };
  std::vector<Unit> units;
  units.reserve(items * parts);
  std::vector<double> cost_end;  // cumulative cost of units [0, i]
  cost_end.reserve(items * parts);
  double total = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t tiles = (bt.q_lens[b] + kQueryTile - 1) / kQueryTile;
    for (int64_t kvh = 0; kvh < bt.num_kv_heads; ++kvh)
      for (int64_t tile = 0; tile < tiles; ++tile)
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t j0 = tile * kQueryTile, j1 = std::min(bt.q_lens[b], j0 + kQueryTile);
          const int64_t h0 = part * group / parts, h1 = (part + 1) * group / parts;
          units.push_back({b, kvh, j0, j1, h0, h1});
          total += static_cast<double>((j1 - j0) * (h1 - h0)) * static_cast<double>(bt.kv_lens[b]) + 1.0;
          cost_end.push_back(total);
        }
  }
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t shares = std::max<int64_t>(1, std::min(threads, n));
  // Share s runs the units whose cumulative cost ends in (s / shares, (s + 1) / shares] of the total.
  auto share_start = [&](int64_t s) -> int64_t {
    if (s <= 0) return 0;
    if (s >= shares) return n;
    const double bound = total * static_cast<double>(s) / static_cast<double>(shares);
    return std::upper_bound(cost_end.begin(), cost_end.end(), bound) - cost_end.begin();
  };
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    Workspace ws;
    for (int64_t i = share_start(s0); i < share_start(s1); ++i) {
      const Unit& u = units[i];
      attend_tile(bt, q, k, v, out, u.b, u.kvh, u.j0, u.j1, u.h0, u.h1, ws);
    }
  });
}
