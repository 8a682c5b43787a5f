// Quantized GEMM for CPU: y[M, N] = x[M, K] @ W^T (+ bias), W in 32-weight blocks (Q4_1: d * q + m with
// 4-bit q; int8: s * q with one scale per group of 32k weights), x quantized per row and 32-block to
// int8 (scale dx = max|x| / 127, round half to even; llama.cpp's Q8 activations) so that the block
// sums run on integer dot-product instructions. Few rows (decode, speculative verify) are bound by
// reading W; many rows by the multiply-adds, where int8 dot products do 4x (VNNI) or 2x (AVX2) the
// work of fp32 FMAs per instruction. The weights come packed by kernels/dot_layout.py.
//
// One code path per instruction set (AVX-512 VNNI, AVX2 + FMA + F16C, scalar; and AVX-512 VNNI with AMX
// tiles for calls of many rows, qgemm_amx.h), chosen by the caller (specjet/kernels/qgemm.py); all give the
// same bits (qgemm_body.h), so a row's result does not depend on how many rows share the call, which
// speculative decoding's exactness rests on.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "prefetch.h"
#include "token_bitmask.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;  // columns per packed group
// kAmx: the AVX-512 VNNI kernels, and AMX tile products for calls of enough rows (qgemm_amx.h; the same bits).
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// Whether a Q4_1 call of many rows takes the AVX-512 kernel's tiles of 3 column groups x 4 rows (qgemm_body.h
// q4_1_multi_tile) or the one-group tiles of 8 rows; the same bits either way. The wide tile shares each
// broadcast among three groups and measured faster on a Zen 5, but slower on a Zen 4 (AMD family 25), which
// splits every 512-bit instruction into two 256-bit halves (bench/RESULTS.md, sessions 73 and 90). CPUs not
// measured keep the wide tile. SPECJET_QGEMM_WIDE_TILES=0 or 1 overrides the choice.
bool wide_tiles_by_cpu() {
  if (const char* forced = std::getenv("SPECJET_QGEMM_WIDE_TILES"); forced && *forced) return forced[0] == '1';
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
  const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return true;
  const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
  return !(amd && family == 25);
}

// -1 until first asked: CPUID is a trap to the hypervisor on a virtual machine, so it is asked once.
std::atomic<int> wide_tiles_setting{-1};

bool wide_tiles() {
  int on = wide_tiles_setting.load(std::memory_order_relaxed);
  if (on < 0) {
    on = wide_tiles_by_cpu() ? 1 : 0;
    wide_tiles_setting.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

// The activations of one call, quantized once before the columns are split across threads.
struct QuantizedRows {
  int64_t rows, K, nb;
  const int8_t* xq;   // [rows, K] round(x / dx), in [-127, 127]
  const uint8_t* xu;  // [rows, K] xq + 128
  const float* dx;    // [rows, nb] max|x| / 127 of each block (0 for an all-zero block)
  const float* sx;    // [rows, nb] dx * Σ xq: the quantized block's sum (for Q4_1's minimum)
};

// The rows past `from` as a QuantizedRows of their own (a kernel's leftover rows after its wide tiles).
inline QuantizedRows rows_from(const QuantizedRows& x, int64_t from) {
  return {x.rows - from, x.K, x.nb, x.xq + from * x.K, x.xu + from * x.K, x.dx + from * x.nb, x.sx + from * x.nb};
}

struct RowBuffers {
  std::vector<int8_t> xq;
  std::vector<uint8_t> xu;
  std::vector<float> dx, sx;
  QuantizedRows view;
  // Which codes the call's kernels read: xq (signed), xu (unsigned: the AVX-512 int8 kernel's), or both (an AMX
  // int8 call whose rows past its tiles go to the AVX-512 kernel). Only those are written: with a team of threads,
  // every line a thread quantizes into was last read by the other threads, so each line written costs a transfer
  // between cores.
  bool signed_codes = true;
  bool unsigned_codes = false;
};

// A call's quantized activations: the calling thread's buffers, kept from call to call, where they are small (a
// decode step's or a verify's: no allocation and zero fill per projection, of which a step makes ~120); a larger
// call's (a prefill chunk's) its own, so no thread keeps megabytes. A call's buffers are read only inside it.
constexpr int64_t kKeptActivations = 1 << 17;  // rows x K

struct CallBuffers {
  RowBuffers own;
  RowBuffers* buf;
  CallBuffers(int64_t rows, int64_t K) {
    static thread_local RowBuffers kept;
    buf = rows * K <= kKeptActivations ? &kept : &own;
  }
};

void set_view(RowBuffers& buf, int64_t rows, int64_t K) {
  buf.view = {rows, K, K / kBlock, buf.xq.data(), buf.xu.data(), buf.dx.data(), buf.sx.data()};
}

// Grows, never shrinks: a step's calls alternate between K = hidden and K = intermediate, and a vector resized
// down and up again would zero its elements on every call (the kept buffers' contents are written before use).
template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Sizes a call's buffers for `rows` rows (before any block is quantized: the threads then write their blocks in
// place), for signed codes (a kernel reading xu sets the codes after).
void prepare(RowBuffers& buf, int64_t rows, int64_t K) {
  grow(buf.xq, rows * K);
  grow(buf.xu, rows * K);
  grow(buf.dx, rows * (K / kBlock));
  grow(buf.sx, rows * (K / kBlock));
  buf.signed_codes = true;
  buf.unsigned_codes = false;
  set_view(buf, rows, K);
}

// The same arithmetic as kernels/dot_layout.py's quantize_activations (its tests hold them equal):
// inv = 127 / max|x| in float, q = round_half_even(x * inv), dx = max|x| / 127, sx = dx * Σ q.
// Q4_1's minimum multiplies sx, the quantized inputs' sum, not the exact one: then the block computes
// Σ (d q + m) x̂ for one x̂, whose rounding errors meet the centred weights; with the exact sum they
// would meet d q = w - m, which is all of one sign, and add up (measured: top-1 agreement with the
// float model drops by 14 points). Row blocks rb0 .. rb1 - 1 (block rb: x[rb * 32 ..]), into prepared buffers.
void quantize_blocks_scalar(const float* x, int64_t rb0, int64_t rb1, RowBuffers& buf) {
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    const float* xb = x + rb * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t qsum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * inv)));
      if (buf.unsigned_codes) buf.xu[rb * kBlock + i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
      if (buf.signed_codes) buf.xq[rb * kBlock + i] = static_cast<int8_t>(q);
      qsum += static_cast<int32_t>(q);
    }
    buf.dx[rb] = amax / 127.0f;
    buf.sx[rb] = buf.dx[rb] * static_cast<float>(qsum);
  }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace qgemm_avx512 {
constexpr int kRows = 8;  // 8 accumulators + 8 weight vectors + scales of the 32 registers
#define SJ_VEC 16
#include "qgemm_body.h"
#undef SJ_VEC

// quantize_blocks_scalar with 16 lanes: the same operations on every element (a maximum is exact in any order).
static void quantize_blocks(const float* x, int64_t rb0, int64_t rb1, RowBuffers& buf) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    const float* xb = x + rb * kBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    auto codes = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
    };
    const __m512i q0 = codes(v0), q1 = codes(v1);
    const __m256i q8 = _mm256_set_m128i(_mm512_cvtsepi32_epi8(q1), _mm512_cvtsepi32_epi8(q0));
    if (buf.unsigned_codes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.xu.data() + rb * kBlock),
                          _mm256_xor_si256(q8, _mm256_set1_epi8(static_cast<char>(0x80))));
    if (buf.signed_codes) _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.xq.data() + rb * kBlock), q8);
    buf.dx[rb] = amax / 127.0f;
    buf.sx[rb] = buf.dx[rb] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}
}  // namespace qgemm_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
namespace qgemm_amx {
using namespace qgemm_avx512;
#include "qgemm_amx.h"
}  // namespace qgemm_amx
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace qgemm_avx2 {
constexpr int kRows = 4;  // of the 16 registers
#define SJ_VEC 8
#include "qgemm_body.h"
#undef SJ_VEC

// quantize_blocks_scalar with 8 lanes: the same operations on every element.
static void quantize_blocks(const float* x, int64_t rb0, int64_t rb1, RowBuffers& buf) {
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    const float* xb = x + rb * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    }
    // packs work per 128-bit half: the permutation puts the 32 bytes back in element order.
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), order);
    if (buf.unsigned_codes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.xu.data() + rb * kBlock),
                          _mm256_xor_si256(q8, _mm256_set1_epi8(static_cast<char>(0x80))));
    if (buf.signed_codes) _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.xq.data() + rb * kBlock), q8);
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    buf.dx[rb] = amax / 127.0f;
    buf.sx[rb] = buf.dx[rb] * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}
}  // namespace qgemm_avx2
#pragma GCC pop_options

namespace qgemm_scalar {

static inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Each element as one lane of the vector kernels: an exact integer block sum, then the same fmas.
static void q4_1(const QuantizedRows& x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* bias,
                 float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t n = g0 * kGroup; n < std::min(N, g1 * kGroup); ++n) {
    const int64_t g = n / kGroup, j = n % kGroup;
    for (int64_t r = 0; r < x.rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* chunk = qs + ((g * x.nb + b) * 4) * 64 + j * 4;
        const int8_t* xb = x.xq + r * x.K + b * kBlock;
        int32_t isum = 0;
        for (int c = 0; c < 4; ++c)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = chunk[c * 64 + t];
            isum += (byte & 0x0F) * xb[4 * c + t] + (byte >> 4) * xb[16 + 4 * c + t];
          }
        const int64_t at = (g * x.nb + b) * kGroup + j;
        acc = std::fma(static_cast<float>(isum), half_to_float(d[at]) * x.dx[r * x.nb + b], acc);
        acc = std::fma(half_to_float(m[at]), x.sx[r * x.nb + b], acc);
      }
      y[r * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

// y[r, n] of an int8 weight.
static float int8_element(const QuantizedRows& x, const int8_t* q, const uint16_t* s, int64_t group, const float* bias,
                          int64_t r, int64_t n) {
  const int64_t g = n / kGroup, j = n % kGroup;
  float acc = 0.0f;
  for (int64_t b = 0; b < x.nb; ++b) {
    const int8_t* steps = q + ((g * x.nb + b) * 8) * 64 + j * 4;
    const int8_t* xb = x.xq + r * x.K + b * kBlock;
    int32_t isum = 0;
    for (int st = 0; st < 8; ++st)
      for (int t = 0; t < 4; ++t) isum += steps[st * 64 + t] * xb[4 * st + t];
    const float scale = half_to_float(s[(g * (x.K / group) + b * kBlock / group) * kGroup + j]);
    acc = std::fma(static_cast<float>(isum), scale * x.dx[r * x.nb + b], acc);
  }
  return acc + (bias ? bias[n] : 0.0f);
}

static void int8(const QuantizedRows& x, const int8_t* q, const uint16_t* s, const int32_t*, int64_t group,
                 const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t n = g0 * kGroup; n < std::min(N, g1 * kGroup); ++n)
    for (int64_t r = 0; r < x.rows; ++r) y[r * N + n] = int8_element(x, q, s, group, bias, r, n);
}

}  // namespace qgemm_scalar

namespace {

// AMX int8 tiles: the CPU's AMX-INT8 (CPUID leaf 7: EDX bit 25) and the tile state (amx_permitted).
// Asked once: CPUID is a trap to the hypervisor on a virtual machine (tens of microseconds), and every call
// checks its instruction set.
bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1) && specjet_cpu::amx_permitted();
  }();
  return ready;
}

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && isa_supported(kAvx2);
    case kAmx: return isa_supported(kAvx512) && amx_ready();
    default: return false;
  }
}

int64_t check_common(const torch::Tensor& x, int64_t N, int64_t K, const c10::optional<torch::Tensor>& bias,
                     int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "qgemm: instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "qgemm: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "qgemm: x has ", x.size(1), " columns, the weight takes K = ", K);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "qgemm: K = ", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(N > 0, "qgemm: N must be positive");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "qgemm: bias must be a contiguous float32 tensor of ", N, " elements");
  }
  return (N + kGroup - 1) / kGroup;
}

void check_packed(const torch::Tensor& t, c10::ScalarType type, std::initializer_list<int64_t> shape,
                  const char* what) {
  // Compared in place: the checks run on every call, ~120 calls a decode step.
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.sizes().equals(c10::IntArrayRef(shape)),
              "qgemm: ", what, " must be a contiguous ", c10::toString(type), " tensor of shape ",
              c10::IntArrayRef(shape), ", got ", t.scalar_type(), " ", t.sizes());
}

// Row blocks rb0 .. rb1 - 1 of x into prepared buffers, on the instruction set's quantizer (all give the same bits).
void quantize_blocks(const float* x, int64_t rb0, int64_t rb1, RowBuffers& buf, int64_t isa) {
  if (isa == kAvx512 || isa == kAmx) qgemm_avx512::quantize_blocks(x, rb0, rb1, buf);
  else if (isa == kAvx2) qgemm_avx2::quantize_blocks(x, rb0, rb1, buf);
  else quantize_blocks_scalar(x, rb0, rb1, buf);
}

void quantize(const float* x, int64_t rows, int64_t K, RowBuffers& buf, int64_t isa) {
  prepare(buf, rows, K);
  quantize_blocks(x, 0, rows * (K / kBlock), buf, isa);
}

// Whether a call runs on AMX tiles; if so its activations get zero rows up to a whole tile (the A operand
// reads 16 rows).
bool use_amx(int64_t isa, bool q4_1, RowBuffers& buf, int64_t rows, int64_t K) {
  if (isa != kAmx || !qgemm_amx::worth_tiles(q4_1, rows)) return false;
  const int64_t tiles = (rows + qgemm_amx::kTileRows - 1) / qgemm_amx::kTileRows;
  grow(buf.xq, tiles * qgemm_amx::kTileRows * K);
  std::fill(buf.xq.begin() + rows * K, buf.xq.begin() + tiles * qgemm_amx::kTileRows * K, 0);
  set_view(buf, rows, K);
  return true;
}

// Row blocks below which a call's activations are quantized by the calling thread alone (a decode step's
// projections: 18 to 48 blocks, less work than the barrier a shared quantization needs).
constexpr int64_t kSharedQuantizationBlocks = 64;

// Quantizes x's rows into prepared buffers and runs fn(g0, g1) over the 16-column groups: on one team of
// threads, each quantizing its share of the row blocks, then after a barrier computing its share of the groups
// (~64k weights per thread at least; at::parallel_for's split), so no thread waits while one quantizes a
// verify's rows alone. With fused row ops (cpu_ops.h) each thread takes whole rows: it computes its rows of x
// (`before`) and quantizes them, and after the groups and a barrier runs `after` on its rows of y; the ops' other
// waits (a region each, or a thread idle while the caller computes them alone) go.
template <class Fn>
void quantize_and_run(const float* x, int64_t rows, int64_t K, RowBuffers& buf, int64_t isa, int64_t groups,
                      const specjet_cpu::FusedRows& fused, const Fn& fn) {
  const int64_t nb = K / kBlock, blocks = rows * nb, grain = std::max<int64_t>(1, (1 << 16) / (kGroup * K));
  const int64_t team = std::min<int64_t>(at::get_num_threads(), (groups + grain - 1) / grain);
  if (team <= 1 || blocks < kSharedQuantizationBlocks || at::in_parallel_region()) {
    specjet_cpu::run_around(rows, fused, [&] {
      quantize_blocks(x, 0, blocks, buf, isa);
      at::parallel_for(0, groups, grain, fn);
    });
    return;
  }
  specjet_cpu::run_team(team, rows, groups, fused, [&](int64_t t, int64_t n, int64_t r0, int64_t r1) {
    if (fused.before) quantize_blocks(x, r0 * nb, r1 * nb, buf, isa);  // the rows it just computed
    else quantize_blocks(x, blocks * t / n, blocks * (t + 1) / n, buf, isa);
  }, fn);
}

// int8_gemm's argument checks; returns the weight's column groups.
int64_t check_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& wsum,
                   int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  const int64_t K = q.dim() == 4 ? q.size(1) * kBlock : -1;
  const int64_t groups = check_common(x, N, K, bias, isa);
  TORCH_CHECK(group > 0 && group % kBlock == 0 && K % group == 0,
              "qgemm int8: group must be a multiple of 32 that divides K, got ", group);
  check_packed(q, torch::kInt8, {groups, K / kBlock, 8, 64}, "q");
  check_packed(s, torch::kFloat16, {groups, K / group, kGroup}, "s");
  check_packed(wsum, torch::kInt32, {groups, K / kBlock, kGroup}, "wsum");
  return groups;
}

// y[rows, N] = x[rows, K] @ W^T (+ bias) for a checked int8 weight, on the instruction set's kernels.
void int8_rows(const float* x, int64_t rows, int64_t K, const torch::Tensor& q, const torch::Tensor& s,
               const torch::Tensor& wsum, int64_t group, const float* bias, float* y, int64_t N, int64_t groups,
               int64_t isa, const specjet_cpu::FusedRows& fused) {
  CallBuffers call(rows, K);
  RowBuffers& buf = *call.buf;
  prepare(buf, rows, K);
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const int32_t* wp = wsum.data_ptr<int32_t>();
  const bool amx = use_amx(isa, false, buf, rows, K);
  // The AVX-512 kernel's int8_step reads xu: every row of a call without tiles, and an AMX call's rows past its
  // tiles (qgemm_amx::int8 hands them to that kernel); the tiles read xq.
  const bool avx512 = isa == kAvx512 || isa == kAmx;
  buf.signed_codes = !avx512 || amx;
  buf.unsigned_codes = avx512 && (!amx || qgemm_amx::tiled_rows(rows, qgemm_amx::kInt8MinRows) < rows);
  quantize_and_run(x, rows, K, buf, isa, groups, fused, [&](int64_t g0, int64_t g1) {
    if (amx) qgemm_amx::int8(buf.view, qp, sp, wp, group, bias, y, N, g0, g1);
    else if (isa == kAvx512 || isa == kAmx) qgemm_avx512::int8(buf.view, qp, sp, wp, group, bias, y, N, g0, g1);
    else if (isa == kAvx2) qgemm_avx2::int8(buf.view, qp, sp, wp, group, bias, y, N, g0, g1);
    else qgemm_scalar::int8(buf.view, qp, sp, wp, group, bias, y, N, g0, g1);
  });
}

}  // namespace

namespace specjet_cpu {

namespace {
std::atomic<int64_t> team_calls{0};
}  // namespace

int64_t team_runs() { return team_calls.load(std::memory_order_relaxed); }
void count_team_run() { team_calls.fetch_add(1, std::memory_order_relaxed); }

void q4_1_gemm_into(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m,
                    int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa, torch::Tensor& y,
                    const FusedRows& fused) {
  const int64_t K = qs.dim() == 4 ? qs.size(1) * kBlock : -1;
  const int64_t groups = check_common(x, N, K, bias, isa), rows = x.size(0);
  check_packed(qs, torch::kUInt8, {groups, K / kBlock, 4, 64}, "qs");
  check_packed(d, torch::kFloat16, {groups, K / kBlock, kGroup}, "d");
  check_packed(m, torch::kFloat16, {groups, K / kBlock, kGroup}, "m");
  fit_output(y, {rows, N}, x.options());
  if (rows == 0) return;
  CallBuffers call(rows, K);
  RowBuffers& buf = *call.buf;
  prepare(buf, rows, K);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool amx = use_amx(isa, true, buf, rows, K);
  quantize_and_run(x.data_ptr<float>(), rows, K, buf, isa, groups, fused, [&](int64_t g0, int64_t g1) {
    if (amx) qgemm_amx::q4_1(buf.view, qp, dp, mp, bp, yp, N, g0, g1);
    else if (isa == kAvx512 || isa == kAmx) qgemm_avx512::q4_1(buf.view, qp, dp, mp, bp, yp, N, g0, g1);
    else if (isa == kAvx2) qgemm_avx2::q4_1(buf.view, qp, dp, mp, bp, yp, N, g0, g1);
    else qgemm_scalar::q4_1(buf.view, qp, dp, mp, bp, yp, N, g0, g1);
  });
}

torch::Tensor q4_1_gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  torch::Tensor y;
  q4_1_gemm_into(x, qs, d, m, N, bias, isa, y);
  return y;
}

void int8_gemm_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& wsum,
                    int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa, torch::Tensor& y,
                    const FusedRows& fused) {
  const int64_t groups = check_int8(x, q, s, wsum, group, N, bias, isa), rows = x.size(0);
  fit_output(y, {rows, N}, x.options());
  if (rows == 0) return;
  int8_rows(x.data_ptr<float>(), rows, x.size(1), q, s, wsum, group, bias ? bias->data_ptr<float>() : nullptr,
            y.data_ptr<float>(), N, groups, isa, fused);
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& wsum, int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias,
                        int64_t isa) {
  torch::Tensor y;
  int8_gemm_into(x, q, s, wsum, group, N, bias, isa, y);
  return y;
}

torch::Tensor int8_gemm_masked(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                               const torch::Tensor& wsum, int64_t group, int64_t N,
                               const c10::optional<torch::Tensor>& bias, int64_t isa, const torch::Tensor& bitmask,
                               const torch::Tensor& masked, int64_t max_allowed) {
  const int64_t groups = check_int8(x, q, s, wsum, group, N, bias, isa), rows = x.size(0), K = x.size(1);
  check_head_mask(bitmask, masked, rows, "int8_gemm_masked");
  const MaskedRows split = split_masked_rows(reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()),
                                             bitmask.size(1), masked.data_ptr<bool>(), rows, N, max_allowed);
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y;
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  // The other rows through int8_gemm's kernels: a row's result does not depend on which rows share a call.
  dense_rows_through<float, float>(
      split.dense, xp, K, N, yp,
      [&](const float* xs, int64_t n, float* ys) { int8_rows(xs, n, K, q, s, wsum, group, bp, ys, N, groups, isa, {}); },
      [](float v) { return v; });
  if (!split.sparse.empty()) {
    // Each allowed element as the scalar kernel computes it (the bits of every build's kernels); the rest -inf.
    CallBuffers call(rows, K);
    RowBuffers& buf = *call.buf;
    quantize(xp, rows, K, buf, isa);
    std::vector<int64_t> at_row(split.cols.size());  // each element's row
    for (size_t i = 0; i < split.sparse.size(); ++i) {
      const int64_t r = split.sparse[i];
      std::fill(yp + r * N, yp + (r + 1) * N, -std::numeric_limits<float>::infinity());
      std::fill(at_row.begin() + split.cols_at[i], at_row.begin() + split.cols_at[i + 1], r);
    }
    at::parallel_for(0, static_cast<int64_t>(at_row.size()), 256, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e)
        yp[at_row[e] * N + split.cols[e]] =
            qgemm_scalar::int8_element(buf.view, qp, sp, group, bp, at_row[e], split.cols[e]);
    });
  }
  return y;
}

bool qgemm_isa_supported(int64_t isa) { return isa_supported(isa); }

bool q4_1_wide_tiles() { return wide_tiles(); }

bool set_q4_1_wide_tiles(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "set_q4_1_wide_tiles: mode must be -1 (the CPU's choice), 0 or 1, got ", mode);
  const bool before = wide_tiles();
  wide_tiles_setting.store(mode < 0 ? (wide_tiles_by_cpu() ? 1 : 0) : static_cast<int>(mode), std::memory_order_relaxed);
  return before;
}

// AMX tiles need the CPU's AMX-TILE (CPUID leaf 7: EDX bit 24) and, on Linux, the process's permission to use
// the tile data state, asked for once (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18): without it
// the first tile instruction kills the process with SIGILL.
bool amx_permitted() {
  static const bool ready = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

}  // namespace specjet_cpu
