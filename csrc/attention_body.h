// The kernels of attention.cpp, compiled once per instruction set: attention.cpp includes this file
// inside a namespace under `#pragma GCC target(...)`. Lanes stay independent and no product is fused
// with its sum (-ffp-contract=off), so every build gives the same bits; only the speed differs.

// Query tokens of one request handled together, with all the query heads of one KV head: each key is
// loaded and widened once for all of them.
constexpr int64_t kQueryTile = 8;
// Keys per block: a block's keys are widened into a [head_dim][kKeys] buffer, and one row's scores
// against them are kKeys independent lanes, each summing its head_dim products in order d = 0, 1, ...
constexpr int kKeys = 16;
// Rows whose sums advance together (independent chains of adds).
constexpr int kRowBlock = 4;

// One register of float64 lanes (SJ_VEC_BYTES: 64 AVX-512, 32 AVX2, 16 SSE2), as a GCC vector extension.
// Lanes are independent, so every build computes the same values.
typedef double vec_d __attribute__((vector_size(SJ_VEC_BYTES)));
constexpr int kVecLanes = SJ_VEC_BYTES / 8;
constexpr int kKeyVecs = kKeys / kVecLanes;
inline vec_d load_vec(const double* p) { vec_d v; std::memcpy(&v, p, sizeof v); return v; }
inline void store_vec(double* p, vec_d v) { std::memcpy(p, &v, sizeof v); }

// scores[r][0 .. kKeys) = sum_d q[r][d] * kt[d][.] for rows r0 .. r0 + R, each sum in d order.
template <int R>
inline void score_rows(const double* q, int64_t D, const double* kt, double* out, int64_t ld_out) {
  vec_d acc[R][kKeyVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kKeyVecs; ++v) acc[r][v] = vec_d{};
  for (int64_t d = 0; d < D; ++d) {
    vec_d k[kKeyVecs];
    for (int v = 0; v < kKeyVecs; ++v) k[v] = load_vec(kt + d * kKeys + v * kVecLanes);
    for (int r = 0; r < R; ++r) {
      const double qv = q[r * D + d];
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] += qv * k[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kKeyVecs; ++v) store_vec(out + r * ld_out + v * kVecLanes, acc[r][v]);
}

// Cache lines of a key or value row, fetched ahead: the rows of a request sit wherever the pool put them.
template <class T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

// exp(x) for x <= 0 (a score minus its row's maximum): Cody-Waite reduction by ln 2, a degree-12 Taylor
// polynomial on |r| <= ln(2)/2 (truncation ~2e-16 relative), and the power of two put into the exponent
// bits. Below -708 the weight is under 1e-307 of the row's largest and is taken as 0. Written without
// calls or branches so the compiler vectorises the loop that calls it.
inline double exp_nonpositive(double x) {
  const double magic = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer in the low bits
  const double kx = x * 1.4426950408889634;
  const double t = kx + magic;
  const double n = t - magic;
  const double r = (x - n * 0.6931471803691238) - n * 1.9082149292705877e-10;
  double p = 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t tb, mb;
  std::memcpy(&tb, &t, sizeof tb);
  std::memcpy(&mb, &magic, sizeof mb);
  const int64_t bits = (tb - mb + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -708.0 ? 0.0 : p * scale;
}

template <class T>
inline void widen(const T* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(static_cast<float>(src[i]));
}


// A thread's scratch, reused across its tiles (local to the parallel region: thread_local storage in a
// shared library costs a lookup per access in the inner loops).
struct Workspace {
  std::vector<double> qd, scores, acc, kd, kt, row_max, row_sum;
  std::vector<int64_t> row_end;
  std::vector<const bool*> row_mask;
};

// One (request, KV head, tile of the request's new tokens): rows r = token j0 + r / group, query head
// kvh * group + r % group.
template <class T>
void attend_tile(const Batch& bt, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t b, int64_t kvh,
                 int64_t j0, int64_t j1, Workspace& ws) {
  const int64_t D = bt.head_dim, H = bt.num_heads, KV = bt.num_kv_heads, group = H / KV;
  const int64_t kv_len = bt.kv_lens[b], q_len = bt.q_lens[b], prefix = kv_len - q_len;
  const int64_t rows = (j1 - j0) * group;
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
    const int64_t j = j0 + r / group;
    row_end[r] = mask ? kv_end : prefix + j + 1;
    row_mask[r] = mask ? mask + j * bt.max_q - prefix : nullptr;  // indexed by key position p >= prefix
  }
  auto visible = [&](int64_t r, int64_t p) {
    return p < row_end[r] && (p < prefix || row_mask[r] == nullptr || row_mask[r][p]);
  };

  const int64_t padded_end = (kv_end + kKeys - 1) / kKeys * kKeys;
  ws.qd.resize(rows * D);
  ws.scores.resize(rows * padded_end);
  ws.acc.assign(rows * D, 0.0);
  ws.kd.resize(D);
  ws.kt.resize(D * kKeys);
  ws.row_max.assign(rows, -std::numeric_limits<double>::infinity());
  ws.row_sum.assign(rows, 0.0);
  double *qd = ws.qd.data(), *scores = ws.scores.data(), *acc = ws.acc.data(), *kd = ws.kd.data(),
         *kt = ws.kt.data(), *row_max = ws.row_max.data(), *row_sum = ws.row_sum.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / group, h = kvh * group + r % group;
    widen(q + (t * H + h) * D, qd + r * D, D);
    for (int64_t d = 0; d < D; ++d) qd[r * D + d] *= bt.scale;
  }
  for (int64_t p0 = 0; p0 < kv_end; p0 += kKeys) {
    for (int64_t p = p0 + kKeys; p < std::min(kv_end, p0 + 2 * kKeys); ++p)
      prefetch_row(k_cache + (slots[p] * KV + kvh) * D, D);
    // The block's keys, transposed; past kv_end, zeros (their scores are never used).
    for (int l = 0; l < kKeys; ++l) {
      if (p0 + l < kv_end) widen(k_cache + (slots[p0 + l] * KV + kvh) * D, kd, D);
      else std::fill(kd, kd + D, 0.0);
      for (int64_t d = 0; d < D; ++d) kt[d * kKeys + l] = kd[d];
    }
    int64_t r = 0;
    double* sp = scores + p0;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      score_rows<kRowBlock>(qd + r * D, D, kt, sp + r * padded_end, padded_end);
    switch (rows - r) {
      case 3: score_rows<3>(qd + r * D, D, kt, sp + r * padded_end, padded_end); break;
      case 2: score_rows<2>(qd + r * D, D, kt, sp + r * padded_end, padded_end); break;
      case 1: score_rows<1>(qd + r * D, D, kt, sp + r * padded_end, padded_end); break;
      default: break;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const double* s = scores + r * padded_end;
    double m = row_max[r];
    for (int64_t p = 0; p < std::min(prefix, row_end[r]); ++p) m = s[p] > m ? s[p] : m;
    for (int64_t p = prefix; p < row_end[r]; ++p)
      if (visible(r, p) && s[p] > m) m = s[p];
    row_max[r] = m;
  }
  for (int64_t r = 0; r < rows; ++r) {
    double* s = scores + r * padded_end;
    const double m = row_max[r];
    // Every score of the row is replaced by its weight; masked positions hold garbage and are skipped below.
    for (int64_t p = 0; p < row_end[r]; ++p) s[p] = exp_nonpositive(s[p] - m);
  }
  constexpr int64_t kAhead = 8;
  for (int64_t p = 0; p < std::min(kv_end, kAhead); ++p) prefetch_row(v_cache + (slots[p] * KV + kvh) * D, D);
  for (int64_t p = 0; p < kv_end; ++p) {
    if (p + kAhead < kv_end) prefetch_row(v_cache + (slots[p + kAhead] * KV + kvh) * D, D);
    widen(v_cache + (slots[p] * KV + kvh) * D, kd, D);
    const bool all = p < prefix;
    for (int64_t r = 0; r < rows; ++r) {
      if (!all && !visible(r, p)) continue;
      const double w = scores[r * padded_end + p];
      row_sum[r] += w;
      double* o = acc + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * kd[d];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = bt.q_starts[b] + j0 + r / group, h = kvh * group + r % group;
    T* dst = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(acc[r * D + d] / row_sum[r]));
  }
}

// Every (request, KV head, query tile) of the batch, spread over the threads.
template <class T>
void attend_all(const Batch& bt, const T* q, const T* k, const T* v, T* out, int64_t batch) {
  std::vector<int64_t> item_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    item_start[b + 1] = item_start[b] + bt.num_kv_heads * ((bt.q_lens[b] + kQueryTile - 1) / kQueryTile);
  at::parallel_for(0, item_start[batch], 1, [&](int64_t i0, int64_t i1) {
    Workspace ws;
    int64_t b = 0;
    for (int64_t i = i0; i < i1; ++i) {
      while (item_start[b + 1] <= i) ++b;
      const int64_t local = i - item_start[b];
      const int64_t kvh = local % bt.num_kv_heads, tile = local / bt.num_kv_heads;
      const int64_t j0 = tile * kQueryTile;
      attend_tile(bt, q, k, v, out, b, kvh, j0, std::min(bt.q_lens[b], j0 + kQueryTile), ws);
    }
  });
}
