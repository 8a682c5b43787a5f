// Whether this CPU's VDPBF16PS adds a word's two products as Intel defines the instruction: the odd (high) half's
// exact product to the accumulator first, then the even (low) half's, each step rounded to nearest even. The bf16dp
// attention pairs two keys a word in its weights x V (attention_body.h weigh_value_pairs) and gives a verify's rows
// their decode steps' bits only on such a CPU: one that summed the pair first, or the halves the other way round,
// would let how keys pair up change the rounding. kernels/cpu_ops.py takes the float32 lanes where this fails.
// Included by attention.cpp inside its bf16dp namespace (compiled for AVX-512 BF16).

// out[i] = acc[i] + hi_a[i] * hi_b[i] + lo_a[i] * lo_b[i] by one VDPBF16PS, 16 lanes; the four factors must be bf16
// values (their floats' low 16 bits zero), as the instruction reads only the high 16 bits of each.
inline void dpbf16_words(const float* acc, const float* hi_a, const float* hi_b, const float* lo_a, const float* lo_b,
                         float* out) {
  alignas(64) uint32_t a[16], b[16];
  for (int i = 0; i < 16; ++i) {
    uint32_t ha, hb, la, lb;
    std::memcpy(&ha, hi_a + i, 4);
    std::memcpy(&hb, hi_b + i, 4);
    std::memcpy(&la, lo_a + i, 4);
    std::memcpy(&lb, lo_b + i, 4);
    a[i] = (ha & 0xFFFF0000u) | (la >> 16);
    b[i] = (hb & 0xFFFF0000u) | (lb >> 16);
  }
  const __m512 r =
      _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_load_si512(a), (__m512bh)_mm512_load_si512(b));
  _mm512_storeu_ps(out, r);
}

// The check: lanes built to tell the orders apart (acc 1 and two products of 2^-24: in order 1, the pair first
// 1 + 2^-23; acc 1 with 2^-24 and -1: odd half first 0, even half first 2^-24; a product of 1.5 x 2^-24: rounded to
// nearest, not cut), lanes with zero products (the accumulator unchanged), then pseudo-random normal values, each
// against the definition in scalar float arithmetic (a bf16 x bf16 product is exact in float, so a fused or a plain
// multiply-add gives the same).
inline bool dpbf16_adds_in_order() {
  const float t = std::ldexp(1.0f, -12), t3 = 3.0f * std::ldexp(1.0f, -13);
  std::vector<float> acc = {1.0f, 1.0f, 1.0f, 1.0f, 5.0f, -3.5f}, ha = {t, t, -1.0f, t3, 0.0f, 2.0f},
                     hb = {t, t, 1.0f, t, 7.0f, 0.0f}, la = {t, -1.0f, t, 0.0f, 0.0f, 0.0f},
                     lb = {t, 1.0f, t, 0.0f, 3.0f, -9.0f};
  uint32_t state = 12345u;
  auto next = [&state]() { return state = state * 1664525u + 1013904223u; };
  auto random_bf16 = [&]() {  // sign, exponent in [-8, 8], 7 mantissa bits: normal, exactly a bf16
    const uint32_t r = next();
    const uint32_t bits = ((r >> 31) << 31) | ((127u + (r >> 8) % 17u - 8u) << 23) | (((r >> 1) & 0x7Fu) << 16);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  while (acc.size() < 16 * 65) {
    acc.push_back(std::ldexp(static_cast<float>(static_cast<int32_t>(next())), -28));  // |acc| < 8, any float bits
    ha.push_back(random_bf16());
    hb.push_back(random_bf16());
    la.push_back(random_bf16());
    lb.push_back(random_bf16());
  }
  for (size_t s = 0; s < acc.size(); s += 16) {
    float out[16];
    dpbf16_words(&acc[s], &ha[s], &hb[s], &la[s], &lb[s], out);
    for (size_t i = s; i < s + 16; ++i) {
      float want = acc[i] + ha[i] * hb[i];
      want = want + la[i] * lb[i];
      uint32_t got_bits, want_bits;
      std::memcpy(&got_bits, &out[i - s], 4);
      std::memcpy(&want_bits, &want, 4);
      if (got_bits != want_bits) return false;
    }
  }
  return true;
}

// Whether two fused multiply-adds under SubnormalsAsZero give this CPU's VDPBF16PS bits (attention_body.h
// tile_products_by_fma): over lanes of every kind the products meet (normal values; bf16 subnormals, products and
// accumulators below float32's normal range, exact zeros of either sign, cancellations), the instruction against the
// FMAs on the words' halves, bit for bit. The FMAs are used for a tile's products only on a CPU that passes.
inline bool fma_matches_dpbf16() {
  uint32_t state = 987654321u;
  auto next = [&state]() { return state = state * 1664525u + 1013904223u; };
  auto word_part = [&](int kind) -> uint32_t {  // a bf16's 16 bits: normal, tiny, subnormal or zero
    const uint32_t r = next(), sign = (r >> 31) << 15, mantissa = (r >> 8) & 0x7Fu;
    switch (kind % 4) {
      case 0: return sign | ((120u + (r >> 16) % 16u) << 7) | mantissa;  // around 1
      case 1: return sign | ((1u + (r >> 16) % 40u) << 7) | mantissa;     // products below 2^-126
      case 2: return sign | mantissa;                                     // a subnormal (or zero)
      default: return sign;                                               // +0 or -0
    }
  };
  const SubnormalsAsZero flush;
  for (int round = 0; round < 256; ++round) {
    alignas(64) uint32_t a[16], b[16], acc[16];
    for (int i = 0; i < 16; ++i) {
      const int kind = static_cast<int>(next() >> 29);
      a[i] = (word_part(kind) << 16) | word_part(kind + i);
      b[i] = (word_part(kind + 1) << 16) | word_part(kind + 2 * i);
      const uint32_t r = next();
      acc[i] = (kind % 3 == 0) ? (r & 0x807FFFFFu) : (kind % 3 == 1) ? ((r & 0x80000000u) | ((r >> 8) % 0x00800000u))
                                                                       : ((r & 0x807FFFFFu) | (127u << 23));
    }
    const __m512i va = _mm512_load_si512(a), vb = _mm512_load_si512(b);
    const __m512 c = _mm512_castsi512_ps(_mm512_load_si512(acc));
    const __m512 by_instruction = _mm512_dpbf16_ps(c, (__m512bh)va, (__m512bh)vb);
    const __m512 by_fma = _mm512_fmadd_ps(low_halves(va), low_halves(vb), _mm512_fmadd_ps(high_halves(va), high_halves(vb), c));
    if (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(by_instruction), _mm512_castps_si512(by_fma)) != 0) return false;
  }
  return true;
}
