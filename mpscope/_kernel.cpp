// mpscope's fused CPU stats kernel: one read of each tensor computes every count, min/max and the
// exponent histogram. Built on first use with torch.utils.cpp_extension.load (see mpscope/kernel.py);
// mpscope falls back to the equivalent torch-op path (mpscope/stats.py) when it cannot be built.
//
// Each element is classified by the bits of |x| (a float16 / bfloat16 threshold rounded up to the
// element's own format is exact): for non-negative IEEE numbers the order of the bit patterns is the
// order of the values, so "x rounds to 0 / a subnormal / inf when cast" is a comparison with the bit
// pattern of the exact rounding threshold (passed in from Python, computed from torch.finfo). On
// AVX-512BW CPUs those counts come from per-exponent-field counts (one_pass); elsewhere from one
// compare per threshold (scan_f32 / scan_bf16 / scan_f16).
#include <torch/extension.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/graph_task.h>
#include <pybind11/numpy.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <vector>
#include <limits>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <array>
#include <utility>
#include <climits>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MPSCOPE_WINDOW 1
#endif

namespace {

constexpr int NCOUNT = 10;      // zero, subnormal, fp16 under/sub/over, bf16 under/sub/over, nan, inf
constexpr int EXP_MIN = -150;   // histogram bins floor(log2|x|) in [EXP_MIN, EXP_MAX]
constexpr int EXP_MAX = 128;
constexpr int NHIST = EXP_MAX - EXP_MIN + 1;
constexpr uint32_t INF_BITS = 0x7F800000u;


struct Acc {
  int64_t c[NCOUNT];
  float hi, lo;
  uint32_t amin;
  int64_t hist[NHIST];
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// builds for AVX-512, AVX2 and baseline x86-64, chosen at load time by the dynamic linker
#define MPSCOPE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#if __GNUC__ >= 12  // 16-bit lanes want AVX-512BW, named through the x86-64-v4 level
#define MPSCOPE_CLONES16 __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MPSCOPE_CLONES16 __attribute__((target_clones("avx2", "default")))
#endif
#else
#define MPSCOPE_CLONES
#define MPSCOPE_CLONES16
#endif

inline float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
// Ordered integer key of a float's bits: a < b as floats  <=>  key(a) < key(b) as int32 (an involution).
inline int32_t order_key(int32_t s) { return s ^ ((s >> 31) & 0x7FFFFFFF); }

// Cumulative counts: ge[j] = number of elements with |x| bits >= T[j], for the ascending thresholds
//   T = {1, bf16 under+1, bf16 normal, own normal, fp16 under+1, fp16 normal, fp16 overflow,
//        bf16 overflow, inf, inf+1}
// Every class count is a difference of two of them (see fold). One compare and one add per
// threshold, branch-free, so the compiler vectorises the loop; a chunk holds at most 2^15 elements.
// The main loop compares against the thresholds that ordinary values cross; the ones that only
// subnormals (T[1..3]) or NaN (T[9]) can separate are counted in a second pass over the chunk, run
// only when the first one saw such an element (smallest non-zero |x| below T[3], or any |x| >= inf).
constexpr int NGE = 10;
struct Chunk {
  uint32_t ge[NGE];
  int64_t len;
  int32_t khi, klo;    // ordered keys of the largest / smallest finite element
  uint32_t amin;       // min over elements of (|x| bits - 1): zero wraps to all ones; >= inf-1 if none
};

// Number of elements with |x| pattern >= each of the K thresholds t (U: uint32_t or uint16_t patterns).
template <typename U, int K>
MPSCOPE_CLONES16 void count_ge(const U* __restrict p, int64_t n, const U* __restrict t, uint32_t* __restrict out) {
  constexpr U ABS = static_cast<U>(static_cast<U>(~U(0)) >> 1);  // |x|: all bits but the sign
  U g[K] = {};
  for (int64_t i = 0; i < n; ++i) {
    const U b = p[i] & ABS;
    for (int j = 0; j < K; ++j) g[j] += b >= t[j];
  }
  for (int j = 0; j < K; ++j) out[j] = g[j];
}

MPSCOPE_CLONES void scan_f32_main(const uint32_t* __restrict p, int64_t n, const uint32_t* __restrict T,
                                  Chunk* __restrict out) {
  const uint32_t INF = INF_BITS, t4 = T[4], t5 = T[5], t6 = T[6], t7 = T[7];
  uint32_t g0 = 0, g4 = 0, g5 = 0, g6 = 0, g7 = 0, g8 = 0;
  int32_t khi = INT32_MIN, klo = INT32_MAX;
  uint32_t amin = 0xFFFFFFFFu;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = p[i];
    const uint32_t b = bits & 0x7FFFFFFFu;
    const int32_t k = order_key(static_cast<int32_t>(bits));
    const int32_t m = -static_cast<int32_t>(b < INF);
    khi = std::max(khi, (k & m) | (INT32_MIN & ~m));
    klo = std::min(klo, (k & m) | (INT32_MAX & ~m));
    amin = std::min(amin, b - 1u); /* zero wraps to all ones */
    g0 += b >= 1u; g4 += b >= t4; g5 += b >= t5; g6 += b >= t6; g7 += b >= t7; g8 += b >= INF;
  }
  out->ge[0] = g0; out->ge[4] = g4; out->ge[5] = g5; out->ge[6] = g6; out->ge[7] = g7; out->ge[8] = g8;
  out->len = n; out->khi = khi; out->klo = klo; out->amin = amin;
}

void scan_f32(const uint32_t* p, int64_t n, const uint32_t* T, Chunk* out) {
  scan_f32_main(p, n, T, out);
  if (out->amin < T[3] - 1u) {  // a non-zero element below the smallest normal
    count_ge<uint32_t, 3>(p, n, T + 1, out->ge + 1);
  } else {
    out->ge[1] = out->ge[2] = out->ge[3] = out->ge[0];
  }
  const uint32_t nan_t = INF_BITS + 1u;
  out->ge[9] = 0;
  if (out->ge[8]) count_ge<uint32_t, 1>(p, n, &nan_t, out->ge + 9);
}

// Shared by the 16-bit scans: min/max keys of the finite elements (|x| pattern below `inf`) and the
// smallest (|x| pattern - 1), zero wrapping to all ones. The key s ^ ((s >> 15) & 0x7FFF) orders
// sign-magnitude 16-bit floats as int16 (= -|x| - 1 for negative values).
#define MPSCOPE_KEYS16(INF16)                                                            \
    const uint16_t h = p[i];                                                             \
    const uint16_t b = h & 0x7FFF;                                                       \
    const int16_t s = static_cast<int16_t>(h);                                           \
    const int16_t k = s ^ ((s >> 15) & 0x7FFF);                                          \
    const int16_t m = -static_cast<int16_t>(b < (INF16));                                \
    khi = std::max<int16_t>(khi, (k & m) | (INT16_MIN & ~m));                            \
    klo = std::min<int16_t>(klo, (k & m) | (INT16_MAX & ~m));                            \
    amin = std::min<uint16_t>(amin, static_cast<uint16_t>(b - 1));

// bfloat16 in 16-bit lanes (twice as many per vector): a bfloat16 value's float32 pattern is its
// 16 bits followed by 16 zeros, so |x| bits >= T  <=>  16-bit pattern >= ceil(T / 2^16). Rounded up
// to bfloat16 patterns, three of the ten thresholds coincide (casting bfloat16 to bfloat16 changes
// nothing): bf16 under+1 = 1 (the smallest subnormal), bf16 normal = own normal (0x0080) and
// bf16 overflow = inf (0x7F80). The main loop compares with 1, the three fp16 thresholds and inf;
// own normal and NaN come from the second pass when needed (see Chunk).
MPSCOPE_CLONES16 void scan_bf16_lanes(const uint16_t* __restrict p, int64_t n, uint16_t f_under1, uint16_t f_normal,
                                      uint16_t f_over, uint16_t* __restrict ge5, int16_t* __restrict keys,
                                      uint16_t* __restrict amin_out) {
  uint16_t nz = 0, g4 = 0, g5 = 0, g6 = 0, inf = 0;
  int16_t khi = INT16_MIN, klo = INT16_MAX;
  uint16_t amin = 0xFFFF;
  for (int64_t i = 0; i < n; ++i) {
    MPSCOPE_KEYS16(0x7F80)
    nz += b >= 1; g4 += b >= f_under1; g5 += b >= f_normal; g6 += b >= f_over; inf += b >= 0x7F80;
  }
  ge5[0] = nz; ge5[1] = g4; ge5[2] = g5; ge5[3] = g6; ge5[4] = inf;
  keys[0] = khi; keys[1] = klo; *amin_out = amin;
}

// The rarely needed counts of a 16-bit chunk: elements >= the own smallest normal `nrm` (only when
// some non-zero element lies below it) and NaNs (only when some element is >= inf).
void rare16(const uint16_t* p, int64_t n, uint16_t nz, uint16_t inf, uint16_t amin, uint16_t nrm, uint16_t inf_pat,
            uint32_t* ge_nrm, uint32_t* nan) {
  *ge_nrm = nz;
  if (amin < nrm - 1) count_ge<uint16_t, 1>(p, n, &nrm, ge_nrm);
  *nan = 0;
  const uint16_t nan_t = static_cast<uint16_t>(inf_pat + 1);
  if (inf) count_ge<uint16_t, 1>(p, n, &nan_t, nan);
}

// A bfloat16 chunk's thresholds as bfloat16 patterns (see scan_bf16_lanes).
void bf16_thresholds(const uint32_t* T, uint16_t* T16) {
  for (int j = 0; j < NGE; ++j) T16[j] = static_cast<uint16_t>((T[j] + 0xFFFFu) >> 16);
  TORCH_INTERNAL_ASSERT(T16[0] == 1 && T16[1] == 1 && T16[2] == 0x0080 && T16[3] == 0x0080 &&
                        T16[7] == 0x7F80 && T16[8] == 0x7F80 && T16[9] == 0x7F81);
}

// A bfloat16 chunk's 16-bit extrema keys and smallest (|x| pattern - 1) as float32 keys and
// patterns (see order_key): the 16-bit key maps to the 32-bit one.
void bf16_extrema(const int16_t* keys, uint16_t amin, Chunk* out) {
  auto widen_key = [](int16_t k, int32_t none) {
    if (k == (none < 0 ? INT16_MIN : INT16_MAX)) return none;
    const int16_t s = static_cast<int16_t>(k ^ ((k >> 15) & 0x7FFF));
    return order_key(static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(s)) << 16));
  };
  out->khi = widen_key(keys[0], INT32_MIN);
  out->klo = widen_key(keys[1], INT32_MAX);
  out->amin = amin == 0xFFFF ? 0xFFFFFFFFu : ((static_cast<uint32_t>(amin) + 1u) << 16) - 1u;
}

void scan_bf16(const uint16_t* p, int64_t n, const uint32_t* T, Chunk* out) {
  uint16_t T16[NGE], g[5];
  bf16_thresholds(T, T16);
  int16_t keys[2];
  uint16_t amin;
  scan_bf16_lanes(p, n, T16[4], T16[5], T16[6], g, keys, &amin);
  uint32_t nrm, nan;
  rare16(p, n, g[0], g[4], amin, 0x0080, 0x7F80, &nrm, &nan);
  const uint32_t ge[NGE] = {g[0], g[0], nrm, nrm, g[1], g[2], g[3], g[4], g[4], nan};
  std::memcpy(out->ge, ge, sizeof(ge));
  out->len = n;
  bf16_extrema(keys, amin, out);
}

// float16 in 16-bit lanes. Every float16 value is exact in float16 and inside bfloat16's normal
// range, so casting it to float16 changes nothing (its subnormals stay subnormal, nothing under- or
// overflows) and casting it to bfloat16 can neither underflow, overflow nor be subnormal: four
// cumulative counts fill all ten (non-zero and inf in the main loop; own normal and NaN, when
// needed, in the second pass). Keys and amin stay 16-bit patterns (fold's `half` branch).
MPSCOPE_CLONES16 void scan_f16_lanes(const uint16_t* __restrict p, int64_t n, uint16_t* __restrict ge2,
                                     int16_t* __restrict keys, uint16_t* __restrict amin_out) {
  uint16_t nz = 0, inf = 0;
  int16_t khi = INT16_MIN, klo = INT16_MAX;
  uint16_t amin = 0xFFFF;
  for (int64_t i = 0; i < n; ++i) {
    MPSCOPE_KEYS16(0x7C00)
    nz += b >= 1; inf += b >= 0x7C00;
  }
  ge2[0] = nz; ge2[1] = inf;
  keys[0] = khi; keys[1] = klo; *amin_out = amin;
}

// A float16 chunk's extrema: keys and amin stay 16-bit patterns (fold's `half` branch).
void f16_extrema(const int16_t* keys, uint16_t amin, Chunk* out) {
  out->khi = keys[0] == INT16_MIN ? INT32_MIN : keys[0];
  out->klo = keys[1] == INT16_MAX ? INT32_MAX : keys[1];
  out->amin = amin == 0xFFFF ? 0xFFFFFFFFu : amin;
}

void scan_f16(const uint16_t* p, int64_t n, Chunk* out) {
  uint16_t g[2];
  int16_t keys[2];
  uint16_t amin;
  scan_f16_lanes(p, n, g, keys, &amin);
  uint32_t nrm, nan;
  rare16(p, n, g[0], g[1], amin, 0x0400, 0x7C00, &nrm, &nan);
  const uint32_t ge[NGE] = {g[0], g[0], g[0], nrm, g[0], nrm, g[1], g[1], g[1], nan};
  std::memcpy(out->ge, ge, sizeof(ge));
  out->len = n;
  f16_extrema(keys, amin, out);
}

inline float half_to_float(uint32_t h) { c10::Half v; v.x = static_cast<uint16_t>(h); return static_cast<float>(v); }

// floor(log2|x|) histogram of the non-zero finite elements, in two parts. count_exp adds each
// element's exponent field to one of W interleaved tables (a run of equal exponents spreads over W
// counters, so increments do not wait on each other's stores); fold_exp turns the tables into
// binades once per run of chunks of one tensor. Subnormals (field 0, non-zero) get their exact
// binade from their leading zeros (add_subnormal): one by one in subnormal_pass on the one-pass
// path, or in a scalar pass over their chunk (subnormal_exp) on the classification path.
constexpr int W = 8;
using ExpTables = uint32_t[W][256];

template <typename U, int SHIFT, int MASK>
void count_exp(const U* __restrict p, int64_t n, ExpTables& h) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    for (int w = 0; w < W; ++w) h[w][(p[i + w] >> SHIFT) & MASK]++;
  }
  for (; i < n; ++i) h[0][(p[i] >> SHIFT) & MASK]++;
}

template <int MASK, int BIAS>
void fold_exp(ExpTables& h, int64_t* hist) {
  for (int e = 1; e < MASK; ++e) {  // normal binades (MASK itself is inf / NaN); field 0: see below
    uint32_t c = 0;
    for (int w = 0; w < W; ++w) c += h[w][e];
    if (c) hist[e - BIAS - EXP_MIN] += c;
  }
  std::memset(h, 0, sizeof(ExpTables));
}

// A subnormal's binade from its mantissa's leading zeros: value = mantissa * 2^(1 - BIAS - MANT).
template <typename U, int SHIFT, int BIAS, int MANT>
inline void add_subnormal(U v, int64_t* hist) {
  const uint32_t m = (static_cast<uint32_t>(v) >> (SHIFT - MANT)) & ((1u << MANT) - 1u);
  if (m) hist[(1 - BIAS - MANT) + (31 - __builtin_clz(m)) - EXP_MIN] += 1;
}

template <typename U, int SHIFT, int MASK, int BIAS, int MANT>
void subnormal_exp(const U* __restrict p, int64_t n, int64_t* hist) {
  for (int64_t k = 0; k < n; ++k)
    if (((p[k] >> SHIFT) & MASK) == 0) add_subnormal<U, SHIFT, BIAS, MANT>(p[k], hist);
}

// Fold one chunk into the accumulator: class counts from the cumulative ones, extrema from keys.
void fold(const Chunk& c, bool half, Acc& a) {
  const uint32_t* g = c.ge;
  a.c[0] += c.len - g[0];      // zero
  a.c[1] += g[0] - g[3];       // subnormal in its own dtype
  a.c[2] += g[0] - g[4];       // fp16 underflow
  a.c[3] += g[4] - g[5];       // fp16 subnormal
  a.c[4] += g[6] - g[8];       // fp16 overflow (finite)
  a.c[5] += g[0] - g[1];       // bf16 underflow
  a.c[6] += g[1] - g[2];       // bf16 subnormal
  a.c[7] += g[7] - g[8];       // bf16 overflow (finite)
  a.c[8] += g[9];              // NaN
  a.c[9] += g[8] - g[9];       // inf
  if (half) {
    auto key_to_float = [](int32_t k) { return k < 0 ? -half_to_float(static_cast<uint32_t>(-(k + 1))) : half_to_float(static_cast<uint32_t>(k)); };
    if (c.khi != INT32_MIN) a.hi = std::max(a.hi, key_to_float(c.khi));
    if (c.klo != INT32_MAX) a.lo = std::min(a.lo, key_to_float(c.klo));
    if (c.amin < 0x7C00u - 1u) {
      const float f = half_to_float(c.amin + 1u);
      uint32_t fb; std::memcpy(&fb, &f, 4);
      a.amin = std::min(a.amin, fb);
    }
  } else {
    if (c.khi != INT32_MIN) a.hi = std::max(a.hi, from_bits(static_cast<uint32_t>(order_key(c.khi))));
    if (c.klo != INT32_MAX) a.lo = std::min(a.lo, from_bits(static_cast<uint32_t>(order_key(c.klo))));
    if (c.amin < INF_BITS - 1u) a.amin = std::min(a.amin, c.amin + 1u);
  }
}

void reset(Acc& a) {
  std::memset(&a, 0, sizeof(Acc));
  a.hi = -std::numeric_limits<float>::infinity();
  a.lo = std::numeric_limits<float>::infinity();
  a.amin = 0xFFFFFFFFu;
}

void combine(Acc& out, const Acc& p, bool hist) {
  for (int j = 0; j < NCOUNT; ++j) out.c[j] += p.c[j];
  out.hi = std::max(out.hi, p.hi);
  out.lo = std::min(out.lo, p.lo);
  out.amin = std::min(out.amin, p.amin);
  if (hist) for (int j = 0; j < NHIST; ++j) out.hist[j] += p.hist[j];
}

// The run of chunks of one tensor: the scalar exponent tables, whether the one-pass path is still
// used, and the exponent field of the largest finite |x| of the run's last chunk (-1: none yet).
struct RunState {
  ExpTables tab;
  bool use_one_pass;
  int top;
  void reset() { std::memset(tab, 0, sizeof(tab)); use_one_pass = true; top = -1; }
};

// Exponent fields of one chunk into the run's tables, and its subnormals (when `subnormals`: the
// classification saw some) into hist: the scalar path, for machines without AVX-512BW and for runs
// whose exponents spread too wide for the one-pass path.
template <typename U, int SHIFT, int MASK, int BIAS, int MANT>
void chunk_exp(const U* __restrict p, int64_t n, bool subnormals, RunState& run, int64_t* hist) {
  count_exp<U, SHIFT, MASK>(p, n, run.tab);
  if (subnormals) subnormal_exp<U, SHIFT, MASK, BIAS, MANT>(p, n, hist);
}

// ---------------------------------------------------------------------------------------------------
// The one-pass path (AVX-512BW, with the histogram): one read of a chunk gives its extrema and the
// number of elements of each exponent field, and the cumulative counts of Chunk follow from those
// field counts (count_from_fields) instead of one compare per threshold per element.
//
// Per 64 elements: the exponent fields, packed to bytes (packus); the fields in a window of KWIN
// binades below the chunk's top become one-hot bytes (two vpshufb lookups: binades 0-7 and 8-15 of
// the window), summed by carry-save adders (Harley-Seal) and counted per bit position once per 512
// elements (bits_add8); fields 0 (zero, subnormal) and MASK (inf, NaN) are counted from their masks;
// the rest ("outliers") go one by one into the field table. A run whose chunks have more than 1/16
// outliers although the window sat at the chunk's top goes back to the classification and scalar
// tables (scan_f32 ... + chunk_exp) for the rest of the run.
constexpr int KWIN = 16;

#ifdef MPSCOPE_WINDOW
#define MPSCOPE_AVX512 __attribute__((target("avx512f,avx512bw")))

bool have_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512bw");
  return yes;
}

// Element offset (within the 64-element group) of byte k of the packed exponents. packus packs per
// 128-bit lane: lane L of the result holds lane L of its first operand, then lane L of its second.
struct PackOrder {
  uint8_t from16[64], from32[64];
  constexpr PackOrder() : from16(), from32() {
    for (int k = 0; k < 64; ++k) {
      const int L = k / 16, r = k % 16;
      from16[k] = static_cast<uint8_t>(r < 8 ? L * 8 + r : 32 + L * 8 + (r - 8));
      const int s = r % 8, half = r < 8 ? 0 : 32;  // word s of lane L of (a,b) or (c,d)
      from32[k] = static_cast<uint8_t>(half + (s < 4 ? L * 4 + s : 16 + L * 4 + (s - 4)));
    }
  }
};
constexpr PackOrder PACK_ORDER;

// Carry-save adder on 512 bits: h = majority (the carries), l = parity (the sums) of a, b, c.
MPSCOPE_AVX512 inline void csa(__m512i& h, __m512i& l, __m512i a, __m512i b, __m512i c) {
  h = _mm512_ternarylogic_epi32(a, b, c, 0xE8);
  l = _mm512_ternarylogic_epi32(a, b, c, 0x96);
}

// count[j] += weight * (number of bytes of v with bit j set).
MPSCOPE_AVX512 inline void add_bits(__m512i v, uint64_t weight, uint64_t* count) {
  for (int j = 0; j < 8; ++j)
    count[j] += weight * static_cast<uint64_t>(
                             __builtin_popcountll(_mm512_test_epi8_mask(v, _mm512_set1_epi8(static_cast<char>(1 << j)))));
}

// Positional popcount of bytes: after adding vectors, count[j] + (the pending sums) = the number of
// bytes added with bit j set. Harley-Seal: 7 carry-save adders per 8 vectors, one count of the
// eights per 8 vectors; `flush` counts what is pending.
struct BitCount {
  __m512i ones, twos, fours;
  uint64_t count[8];
};

MPSCOPE_AVX512 inline void bits_reset(BitCount& b) {
  b.ones = b.twos = b.fours = _mm512_setzero_si512();
  std::memset(b.count, 0, sizeof(b.count));
}

MPSCOPE_AVX512 inline void bits_add8(BitCount& b, const __m512i* x) {
  __m512i ta, tb, fa, fb, e8;
  csa(ta, b.ones, b.ones, x[0], x[1]);
  csa(tb, b.ones, b.ones, x[2], x[3]);
  csa(fa, b.twos, b.twos, ta, tb);
  csa(ta, b.ones, b.ones, x[4], x[5]);
  csa(tb, b.ones, b.ones, x[6], x[7]);
  csa(fb, b.twos, b.twos, ta, tb);
  csa(e8, b.fours, b.fours, fa, fb);
  add_bits(e8, 8, b.count);
}

MPSCOPE_AVX512 inline void bits_flush(BitCount& b) {
  add_bits(b.ones, 1, b.count);
  add_bits(b.twos, 2, b.count);
  add_bits(b.fours, 4, b.count);
  b.ones = b.twos = b.fours = _mm512_setzero_si512();
}

// The running state of one_pass: extrema over all elements (inf and NaN included; the caller redoes
// them when the chunk has any) and the smallest |x| pattern - 1 (zero wraps), in 32- or 16-bit lanes
// (see Lanes for what hi / lo / mn hold).
struct PassState {
  __m512i hi, lo, mn, amn;
  uint64_t zeros, tops;
  int64_t outliers;
};

// The per-lane operations of group64 for 32-bit (float32) and 16-bit (float16, bfloat16) elements:
// |x| bits, min of (|x| bits - 1) (zero wraps), the exponent field of |x| bits, and the running
// extrema, which `keys` turns into the ordered keys of the largest and smallest element (see
// order_key) once the lanes are reduced:
// - float32: hi / lo are the float max / min (a NaN operand leaves them as they are);
// - 16-bit: hi is the signed max of the bit patterns (the largest element when one has its sign
//   bit clear), lo the unsigned max (the most negative element when one has its sign bit set) and
//   mn the unsigned min (the smallest element when none is negative, the largest when all are):
//   three compares where ordered keys take four operations.
template <int BYTES> struct Lanes;
template <> struct Lanes<4> {
  MPSCOPE_AVX512 static __m512i abs(__m512i x) { return _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF)); }
  MPSCOPE_AVX512 static __m512i min_dec(__m512i m, __m512i b) {
    return _mm512_min_epu32(m, _mm512_sub_epi32(b, _mm512_set1_epi32(1)));
  }
  MPSCOPE_AVX512 static void start(PassState& s) {
    s.hi = _mm512_set1_epi32(static_cast<int>(0xFF800000u));  // -inf
    s.lo = _mm512_set1_epi32(static_cast<int>(INF_BITS));  // (mn: not used by float32 lanes)
  }
  MPSCOPE_AVX512 static void extrema(PassState& s, __m512i x) {
    const __m512 f = _mm512_castsi512_ps(x);
    s.hi = _mm512_castps_si512(_mm512_max_ps(f, _mm512_castsi512_ps(s.hi)));
    s.lo = _mm512_castps_si512(_mm512_min_ps(f, _mm512_castsi512_ps(s.lo)));
  }
  MPSCOPE_AVX512 static void keys(const PassState& s, int32_t& khi, int32_t& klo, uint32_t& amin) {
    const float hi = _mm512_reduce_max_ps(_mm512_castsi512_ps(s.hi));
    const float lo = _mm512_reduce_min_ps(_mm512_castsi512_ps(s.lo));
    uint32_t hb, lb;
    std::memcpy(&hb, &hi, 4);
    std::memcpy(&lb, &lo, 4);
    khi = order_key(static_cast<int32_t>(hb));
    klo = order_key(static_cast<int32_t>(lb));
    amin = _mm512_reduce_min_epu32(s.amn);
  }
  template <int SHIFT> MPSCOPE_AVX512 static __m512i field(__m512i b) { return _mm512_srli_epi32(b, SHIFT); }
};
template <> struct Lanes<2> {
  MPSCOPE_AVX512 static __m512i abs(__m512i x) { return _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF)); }
  MPSCOPE_AVX512 static __m512i min_dec(__m512i m, __m512i b) {
    return _mm512_min_epu16(m, _mm512_sub_epi16(b, _mm512_set1_epi16(1)));
  }
  MPSCOPE_AVX512 static void start(PassState& s) {
    s.hi = _mm512_set1_epi16(INT16_MIN);
    s.lo = _mm512_setzero_si512();
    s.mn = _mm512_set1_epi32(-1);
  }
  MPSCOPE_AVX512 static void extrema(PassState& s, __m512i x) {
    s.hi = _mm512_max_epi16(s.hi, x);
    s.lo = _mm512_max_epu16(s.lo, x);
    s.mn = _mm512_min_epu16(s.mn, x);
  }
  MPSCOPE_AVX512 static void keys(const PassState& s, int32_t& khi, int32_t& klo, uint32_t& amin) {
    alignas(64) int16_t h[32];
    alignas(64) uint16_t l[32], m[32], a[32];
    _mm512_store_si512(h, s.hi);
    _mm512_store_si512(l, s.lo);
    _mm512_store_si512(m, s.mn);
    _mm512_store_si512(a, s.amn);
    int16_t hs = INT16_MIN;
    uint16_t lu = 0, mu = 0xFFFF, au = 0xFFFF;
    for (int k = 0; k < 32; ++k) {
      hs = std::max(hs, h[k]);
      lu = std::max(lu, l[k]);
      mu = std::min(mu, m[k]);
      au = std::min(au, a[k]);
    }
    auto key16 = [](uint16_t pattern) {
      const int16_t v = static_cast<int16_t>(pattern);
      return static_cast<int32_t>(static_cast<int16_t>(v ^ ((v >> 15) & 0x7FFF)));
    };
    khi = key16(hs >= 0 ? static_cast<uint16_t>(hs) : mu);
    klo = key16(lu >= 0x8000 ? lu : mu);
    amin = au;
  }
  template <int SHIFT> MPSCOPE_AVX512 static __m512i field(__m512i b) { return _mm512_srli_epi16(b, SHIFT); }
};

// 64 elements at q: extrema into s, the window's one-hot bytes into L (binades base..base+7) and H
// (base+8..base+15), fields 0 and MASK into s's counts, the others into fc one by one.
template <typename U, int SHIFT, int MASK>
MPSCOPE_AVX512 __attribute__((always_inline)) inline void group64(const U* __restrict q, __m512i vb, __m512i tlo,
                                                                  __m512i thi, PassState& s, uint32_t* fc,
                                                                  __m512i& L, __m512i& H) {
  using Ln = Lanes<sizeof(U)>;
  constexpr int NV = static_cast<int>(sizeof(U));  // vectors per 64 elements
  __m512i v[NV];
  for (int k = 0; k < NV; ++k) {
    const __m512i x = _mm512_loadu_si512(q + 64 / NV * k);
    const __m512i b = Ln::abs(x);
    s.amn = Ln::min_dec(s.amn, b);
    Ln::extrema(s, x);
    v[k] = Ln::template field<SHIFT>(b);
  }
  __m512i e;  // the 64 fields as bytes (in PACK_ORDER)
  if constexpr (NV == 4) e = _mm512_packus_epi16(_mm512_packus_epi32(v[0], v[1]), _mm512_packus_epi32(v[2], v[3]));
  else e = _mm512_packus_epi16(v[0], v[1]);
  const __m512i d = _mm512_sub_epi8(e, vb);
  const __mmask64 kin = _mm512_cmplt_epu8_mask(d, _mm512_set1_epi8(KWIN));
  const __mmask64 k0 = _mm512_testn_epi8_mask(e, e);
  const __mmask64 km = _mm512_cmpeq_epi8_mask(e, _mm512_set1_epi8(static_cast<char>(MASK)));
  L = _mm512_maskz_shuffle_epi8(kin, tlo, d);
  H = _mm512_maskz_shuffle_epi8(kin, thi, d);
  s.zeros += static_cast<uint64_t>(__builtin_popcountll(k0));
  s.tops += static_cast<uint64_t>(__builtin_popcountll(km));
  uint64_t out = ~static_cast<uint64_t>(kin | k0 | km);
  if (out) {
    const uint8_t* order = sizeof(U) == 2 ? PACK_ORDER.from16 : PACK_ORDER.from32;
    do {
      const int k = __builtin_ctzll(out);
      out &= out - 1;
      fc[(q[order[k]] >> SHIFT) & MASK]++;
      ++s.outliers;
    } while (out);
  }
}

// What one_pass finds in a chunk: the number of elements of each exponent field (fc[0]: zeros and
// subnormals, fc[MASK]: inf and NaN), the ordered keys of the largest and smallest element and the
// smallest |x| pattern - 1 over all elements (see PassState and Lanes::keys; 16-bit keys
// sign-extended), and how many elements fell outside the window and fields 0 and MASK.
struct Pass {
  uint32_t fc[256];
  int32_t khi, klo;
  uint32_t amin;
  int64_t outliers;
};

// Requires 1 <= base <= MASK - KWIN (the window never holds field 0 or MASK).
template <typename U, int SHIFT, int MASK>
MPSCOPE_AVX512 void one_pass(const U* __restrict p, int64_t n, int base, Pass& r) {
  constexpr bool W32 = sizeof(U) == 4;
  const __m512i vb = _mm512_set1_epi8(static_cast<char>(base));
  const __m512i tlo = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m512i thi = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 64, -128));
  using Ln = Lanes<sizeof(U)>;
  PassState s;
  Ln::start(s);
  s.amn = _mm512_set1_epi32(-1);
  s.zeros = s.tops = 0;
  s.outliers = 0;
  std::memset(r.fc, 0, sizeof(r.fc));
  BitCount bl, bh;
  bits_reset(bl);
  bits_reset(bh);
  __m512i L[8], H[8];
  int64_t i = 0;
  for (; i + 512 <= n; i += 512) {
    for (int g = 0; g < 8; ++g) group64<U, SHIFT, MASK>(p + i + 64 * g, vb, tlo, thi, s, r.fc, L[g], H[g]);
    bits_add8(bl, L);
    bits_add8(bh, H);
  }
  for (; i + 64 <= n; i += 64) {
    group64<U, SHIFT, MASK>(p + i, vb, tlo, thi, s, r.fc, L[0], H[0]);
    add_bits(L[0], 1, bl.count);
    add_bits(H[0], 1, bh.count);
  }
  bits_flush(bl);
  bits_flush(bh);
  for (int j = 0; j < 8; ++j) {
    r.fc[base + j] += static_cast<uint32_t>(bl.count[j]);
    r.fc[base + 8 + j] += static_cast<uint32_t>(bh.count[j]);
  }
  r.fc[0] += static_cast<uint32_t>(s.zeros);
  r.fc[MASK] += static_cast<uint32_t>(s.tops);
  int32_t khi = W32 ? INT32_MIN : INT16_MIN, klo = W32 ? INT32_MAX : INT16_MAX;
  uint32_t amin = W32 ? 0xFFFFFFFFu : 0xFFFFu;
  if (i) Ln::keys(s, khi, klo, amin);  // else no element went through the lanes
  for (; i < n; ++i) {  // the last < 64 elements
    const U b = static_cast<U>(p[i] & (W32 ? 0x7FFFFFFFu : 0x7FFFu));
    amin = std::min<uint32_t>(amin, static_cast<U>(b - 1));
    int32_t k;
    if constexpr (W32) {
      k = order_key(static_cast<int32_t>(p[i]));
    } else {
      const int16_t s16 = static_cast<int16_t>(p[i]);
      k = static_cast<int16_t>(s16 ^ ((s16 >> 15) & 0x7FFF));
    }
    khi = std::max(khi, k);
    klo = std::min(klo, k);
    const int f = static_cast<int>(b >> SHIFT);
    r.fc[f]++;
    if (static_cast<unsigned>(f - base) >= static_cast<unsigned>(KWIN) && f != 0 && f != MASK) ++s.outliers;
  }
  r.khi = khi; r.klo = klo; r.amin = amin;
  r.outliers = s.outliers;
}

// The subnormals of a chunk (exponent field 0, non-zero): their binades into hist; returns their number.
template <typename U, int SHIFT, int MASK, int BIAS, int MANT>
MPSCOPE_AVX512 int64_t subnormal_pass(const U* __restrict p, int64_t n, int64_t* hist) {
  constexpr int VL = 64 / static_cast<int>(sizeof(U));
  int64_t count = 0, i = 0;
  for (; i + VL <= n; i += VL) {
    const __m512i x = _mm512_loadu_si512(p + i);
    uint64_t sub;
    if constexpr (sizeof(U) == 4) {
      sub = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(x, _mm512_set1_epi32(MASK << SHIFT)), x,
                                        _mm512_set1_epi32(0x7FFFFFFF));
    } else {
      sub = _mm512_mask_test_epi16_mask(_mm512_testn_epi16_mask(x, _mm512_set1_epi16(static_cast<short>(MASK << SHIFT))), x,
                                        _mm512_set1_epi16(0x7FFF));
    }
    count += __builtin_popcountll(sub);
    while (sub) {
      const int k = __builtin_ctzll(sub);
      sub &= sub - 1;
      add_subnormal<U, SHIFT, BIAS, MANT>(p[i + k], hist);
    }
  }
  for (; i < n; ++i) {
    if (((p[i] >> SHIFT) & MASK) == 0 && (p[i] & static_cast<U>(static_cast<U>(~U(0)) >> 1)) != 0) {
      add_subnormal<U, SHIFT, BIAS, MANT>(p[i], hist);
      ++count;
    }
  }
  return count;
}

// Exponent field of the largest finite |x| of p[0..n) (0 when none is a non-zero normal).
template <typename U, int SHIFT, int MASK>
MPSCOPE_AVX512 int max_field(const U* __restrict p, int64_t n) {
  constexpr U ABS = static_cast<U>(static_cast<U>(~U(0)) >> 1);
  constexpr U INF = static_cast<U>(static_cast<U>(MASK) << SHIFT);
  constexpr int VL = 64 / static_cast<int>(sizeof(U));
  __m512i m = _mm512_setzero_si512();
  int64_t i = 0;
  U top = 0;
  for (; i + VL <= n; i += VL) {
    const __m512i x = _mm512_loadu_si512(p + i);
    if constexpr (sizeof(U) == 4) {
      const __m512i b = _mm512_and_si512(x, _mm512_set1_epi32(ABS));
      m = _mm512_mask_max_epu32(m, _mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(INF)), m, b);
    } else {
      const __m512i b = _mm512_and_si512(x, _mm512_set1_epi16(ABS));
      m = _mm512_mask_max_epu16(m, _mm512_cmplt_epu16_mask(b, _mm512_set1_epi16(static_cast<short>(INF))), m, b);
    }
  }
  alignas(64) U lanes[VL];
  _mm512_store_si512(lanes, m);
  for (int k = 0; k < VL; ++k) top = std::max(top, lanes[k]);
  for (; i < n; ++i) {
    const U b = p[i] & ABS;
    if (b < INF) top = std::max(top, b);
  }
  return static_cast<int>(top >> SHIFT);
}

// One chunk by the one-pass path. t: the chunk's NGE thresholds as patterns of its own dtype (see
// Chunk). Fills c->ge and c->len, adds the chunk's binades to hist, and returns the raw extrema of
// one_pass in keys / amin (the caller converts them, and redoes the keys when c->ge[8] > 0).
//
// Cumulative counts from the field counts: a threshold that starts a binade is a suffix sum of the
// field counts; one inside a binade that holds elements of the chunk costs one counting pass over
// the chunk (count_ge), as do thresholds below the smallest normal when the chunk has subnormals.
template <typename U, int SHIFT, int MASK, int BIAS, int MANT>
void one_pass_chunk(const U* p, int64_t n, const U* t, RunState& run, int64_t* hist, Chunk* c, int32_t* keys,
                    uint32_t* amin) {
  const int top = run.top >= 0 ? run.top : max_field<U, SHIFT, MASK>(p, n);
  const int base = std::min(std::max(1, top - KWIN + 1), MASK - KWIN);
  Pass r;
  one_pass<U, SHIFT, MASK>(p, n, base, r);
  constexpr uint32_t NORMAL = 1u << MANT;  // the own smallest normal's pattern
  const int64_t nsub = r.amin < NORMAL - 1u ? subnormal_pass<U, SHIFT, MASK, BIAS, MANT>(p, n, hist) : 0;
  int actual = -1;  // the chunk's own top field
  for (int f = 1; f < MASK; ++f) {
    if (r.fc[f]) {
      hist[f - BIAS - EXP_MIN] += r.fc[f];
      actual = f;
    }
  }
  uint32_t suffix[MASK + 2];  // suffix[f] = elements with field >= f
  suffix[MASK + 1] = 0;
  for (int f = MASK; f >= 0; --f) suffix[f] = suffix[f + 1] + r.fc[f];
  const uint32_t nz = static_cast<uint32_t>(n) - (r.fc[0] - static_cast<uint32_t>(nsub));
  for (int j = 0; j < NGE; ++j) {
    const U thr = t[j];
    const int f = thr >> MANT;
    const bool starts_binade = (thr & (NORMAL - 1u)) == 0;
    if (f == 0 && (thr <= 1 || nsub == 0)) c->ge[j] = nz;
    else if (f > 0 && starts_binade) c->ge[j] = suffix[f];
    else if (f > 0 && r.fc[f] == 0) c->ge[j] = suffix[f + 1];
    else count_ge<U, 1>(p, n, &thr, &c->ge[j]);
  }
  c->len = n;
  // the next chunk's window starts from this chunk's top; a wide spread around a well-placed window
  // sends the rest of the run to the scalar path
  if (r.outliers * 16 > n && actual >= base && actual < base + KWIN) run.use_one_pass = false;
  run.top = actual;
  keys[0] = r.khi;
  keys[1] = r.klo;
  *amin = r.amin;
}

// The one-pass path for each dtype: one_pass_chunk, then the extrema of the chunk in Chunk's form.
void one_pass_f32(const uint32_t* p, int64_t n, const uint32_t* T, RunState& run, int64_t* hist, Chunk* c) {
  int32_t keys[2];
  uint32_t amin;
  one_pass_chunk<uint32_t, 23, 0xFF, 127, 23>(p, n, T, run, hist, c, keys, &amin);
  if (c->ge[8]) {  // inf or NaN: the extrema of the finite elements
    Chunk f;
    scan_f32_main(p, n, T, &f);
    keys[0] = f.khi;
    keys[1] = f.klo;
  }
  c->khi = keys[0];
  c->klo = keys[1];
  c->amin = amin;
}

template <bool BF16>
void one_pass_16(const uint16_t* p, int64_t n, const uint32_t* T, RunState& run, int64_t* hist, Chunk* c) {
  // float16's thresholds as its own patterns (see scan_f16): 1 for every one below its smallest
  // subnormal, its smallest normal, inf for both overflows (65520 and bfloat16's lie above its max)
  static const uint16_t F16_T[NGE] = {1, 1, 1, 0x0400, 1, 0x0400, 0x7C00, 0x7C00, 0x7C00, 0x7C01};
  uint16_t T16[NGE];
  if constexpr (BF16) bf16_thresholds(T, T16);
  int32_t keys[2];
  uint32_t amin;
  if constexpr (BF16) one_pass_chunk<uint16_t, 7, 0xFF, 127, 7>(p, n, T16, run, hist, c, keys, &amin);
  else one_pass_chunk<uint16_t, 10, 0x1F, 15, 10>(p, n, F16_T, run, hist, c, keys, &amin);
  int16_t k16[2] = {static_cast<int16_t>(keys[0]), static_cast<int16_t>(keys[1])};
  if (c->ge[8]) {  // inf or NaN: the extrema of the finite elements
    uint16_t g[5], a;
    if constexpr (BF16) scan_bf16_lanes(p, n, T16[4], T16[5], T16[6], g, k16, &a);
    else scan_f16_lanes(p, n, g, k16, &a);
  }
  if constexpr (BF16) bf16_extrema(k16, static_cast<uint16_t>(amin), c);
  else f16_extrema(k16, static_cast<uint16_t>(amin), c);
}
#endif

// One chunk (at most GRAIN elements) of one tensor: classify and fold, then count exponents (the
// chunk has subnormals when ge[0] - ge[3], the non-zero elements below its smallest normal, > 0).
constexpr int64_t GRAIN = 1 << 15;
void scan_chunk(const at::Tensor& x, int64_t lo, int64_t len, const uint32_t* T, bool hist, Acc& acc,
                RunState& run) {
  Chunk c;
  const auto st = x.scalar_type();
#ifdef MPSCOPE_WINDOW
  if (run.use_one_pass && have_avx512bw()) {  // the histogram comes at no extra cost here
    if (st == at::kFloat) one_pass_f32(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()) + lo, len, T, run, acc.hist, &c);
    else if (st == at::kBFloat16) one_pass_16<true>(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()) + lo, len, T, run, acc.hist, &c);
    else one_pass_16<false>(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::Half>()) + lo, len, T, run, acc.hist, &c);
    fold(c, st == at::kHalf, acc);
    return;
  }
#endif
  if (st == at::kFloat) {
    const auto* p = reinterpret_cast<const uint32_t*>(x.data_ptr<float>()) + lo;
    scan_f32(p, len, T, &c);
    if (hist) chunk_exp<uint32_t, 23, 0xFF, 127, 23>(p, len, c.ge[0] > c.ge[3], run, acc.hist);
  } else if (st == at::kBFloat16) {
    const auto* p = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()) + lo;
    scan_bf16(p, len, T, &c);
    if (hist) chunk_exp<uint16_t, 7, 0xFF, 127, 7>(p, len, c.ge[0] > c.ge[3], run, acc.hist);
  } else {
    const auto* p = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::Half>()) + lo;
    scan_f16(p, len, &c);
    if (hist) chunk_exp<uint16_t, 10, 0x1F, 15, 10>(p, len, c.ge[0] > c.ge[3], run, acc.hist);
  }
  fold(c, st == at::kHalf, acc);
}

// End of a run of chunks of one tensor: its exponent tables into the accumulator's binades.
void fold_run(const at::Tensor& x, bool hist, RunState& run, Acc& acc) {
  if (hist) {
    if (x.scalar_type() == at::kHalf) fold_exp<0x1F, 15>(run.tab, acc.hist);
    else fold_exp<0xFF, 127>(run.tab, acc.hist);
  }
  run.reset();
}


// The stats of `tensors` into rows 0..n-1 of cp (int64, row stride `width`: the 10 counts, then
// with `hist` the NHIST bins) and ep (float64, row stride 3: max, min, absmin_nonzero); max/min are
// -inf/+inf and absmin is +inf when a tensor has no finite (non-zero) element. tiny_bits[i]: bit
// pattern of tensor i's own smallest normal; cast: the six fp16/bf16 threshold bit patterns.
//
// All tensors' chunks form one list that the intra-op threads (at::parallel_for) share, so a batch
// of many small tensors (a model's parameters) is spread over the threads as well as one large one.
// Each thread folds consecutive chunks of a tensor into one accumulator and hands it over when the
// tensor changes; the partial accumulators are combined per tensor at the end.
void stats_rows(std::vector<at::Tensor>& tensors, const int64_t* tiny_bits, const int64_t* cast, bool hist,
                int64_t* cp, int64_t width, double* ep) {
  at::NoGradGuard no_grad;  // contiguous() copies below are data, not part of any graph
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<std::array<uint32_t, NGE>> thresholds(n);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (tensor, first element)
  for (int64_t i = 0; i < n; ++i) {
    // the stats do not depend on the order of the elements: a tensor whose elements fill one block
    // of memory once each (contiguous, or a transpose / permutation / channels-last of one) is read
    // in memory order from its first element, the lowest address (strides are never negative); only
    // tensors with gaps or repeats (slices, expand) are copied first. A tensor with the negative bit
    // (the imaginary part of a conjugate view) holds its values negated in memory: materialized first
    if (tensors[i].is_neg()) tensors[i] = tensors[i].resolve_neg();
    if (!tensors[i].is_non_overlapping_and_dense()) tensors[i] = tensors[i].contiguous();
    const auto st = tensors[i].scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
                "mpscope fused_stats: unsupported dtype ", st);
    TORCH_CHECK(tensors[i].device().is_cpu(), "mpscope fused_stats: CPU tensors only");
    // ascending thresholds of the cumulative counts (see Chunk); cast = fp16 under/normal/overflow,
    // bf16 under/normal/overflow bit patterns, "under" being the largest value that rounds to 0
    thresholds[i] = {1u, static_cast<uint32_t>(cast[3]) + 1u, static_cast<uint32_t>(cast[4]),
                     static_cast<uint32_t>(tiny_bits[i]), static_cast<uint32_t>(cast[0]) + 1u,
                     static_cast<uint32_t>(cast[1]), static_cast<uint32_t>(cast[2]),
                     static_cast<uint32_t>(cast[5]), INF_BITS, INF_BITS + 1u};
    for (int64_t lo = 0; lo < tensors[i].numel(); lo += GRAIN) chunks.emplace_back(i, lo);
  }
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  std::vector<Acc> total(n);
  for (auto& a : total) reset(a);
  auto scan_range = [&](int64_t cb, int64_t ce, auto&& emit) {
    Acc acc;
    reset(acc);
    RunState run;
    run.reset();
    int64_t cur = chunks[cb].first;
    for (int64_t k = cb; k < ce; ++k) {
      const auto [i, lo] = chunks[k];
      if (i != cur) {
        fold_run(tensors[cur], hist, run, acc);
        emit(cur, acc);
        reset(acc);
        cur = i;
      }
      const at::Tensor& x = tensors[i];
      scan_chunk(x, lo, std::min(x.numel(), lo + GRAIN) - lo, thresholds[i].data(), hist, acc, run);
    }
    fold_run(tensors[cur], hist, run, acc);
    emit(cur, acc);
  };
  // >= 4 chunks (128K elements, tens of microseconds) per task; fewer run on the calling thread
  if (nchunks <= 4) {
    if (nchunks) scan_range(0, nchunks, [&](int64_t i, const Acc& a) { combine(total[i], a, hist); });
  } else {
    std::vector<std::vector<std::pair<int64_t, Acc>>> partial(at::get_num_threads() + 1);
    at::parallel_for(0, nchunks, 4, [&](int64_t cb, int64_t ce) {
      auto& mine = partial[at::get_thread_num()];
      scan_range(cb, ce, [&](int64_t i, const Acc& a) { mine.emplace_back(i, a); });
    });
    for (const auto& mine : partial)
      for (const auto& [i, a] : mine) combine(total[i], a, hist);
  }
  for (int64_t i = 0; i < n; ++i) {
    const Acc& a = total[i];
    for (int j = 0; j < NCOUNT; ++j) cp[i * width + j] = a.c[j];
    if (hist) for (int j = 0; j < NHIST; ++j) cp[i * width + NCOUNT + j] = a.hist[j];
    ep[i * 3 + 0] = a.hi;
    ep[i * 3 + 1] = a.lo;
    float am;
    std::memcpy(&am, &a.amin, 4);
    ep[i * 3 + 2] = a.amin == 0xFFFFFFFFu ? std::numeric_limits<double>::infinity() : static_cast<double>(am);
  }
}

}  // namespace

// tensors: CPU float32 / float16 / bfloat16 tensors (any shape). tiny_bits[i]: bit pattern of
// tensor i's own smallest normal. cast: the six fp16/bf16 threshold bit patterns.
// Returns (counts int64 [n, 10 + (hist ? 279 : 0)], extrema float64 [n, 3] = max, min, absmin_nonzero).
std::vector<at::Tensor> fused_stats(std::vector<at::Tensor> tensors, std::vector<int64_t> tiny_bits,
                                    std::vector<int64_t> cast, bool hist) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(static_cast<int64_t>(tiny_bits.size()) == n && cast.size() == 6, "mpscope fused_stats: bad arguments");
  const int64_t width = NCOUNT + (hist ? NHIST : 0);
  auto counts = at::empty({n, width}, at::kLong);
  auto ext = at::empty({n, 3}, at::kDouble);
  stats_rows(tensors, tiny_bits.data(), cast.data(), hist, counts.data_ptr<int64_t>(), width, ext.data_ptr<double>());
  return {counts, ext};
}

// The same stats written in place into rows row0 .. row0 + n - 1 of preallocated tables: counts
// int64 [rows, 10 + 279] (the histogram columns are left as they are when `hist` is false) and
// extrema float64 [rows, 3], both contiguous CPU tensors. Saves the two allocations per call.
void fused_stats_into(std::vector<at::Tensor> tensors, std::vector<int64_t> tiny_bits, std::vector<int64_t> cast,
                      bool hist, at::Tensor counts, at::Tensor extrema, int64_t row0) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(static_cast<int64_t>(tiny_bits.size()) == n && cast.size() == 6, "mpscope fused_stats_into: bad arguments");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 2 && counts.size(1) == NCOUNT + NHIST &&
              counts.is_contiguous() && counts.device().is_cpu(),
              "mpscope fused_stats_into: counts must be a contiguous CPU int64 [rows, ", NCOUNT + NHIST, "] tensor");
  TORCH_CHECK(extrema.scalar_type() == at::kDouble && extrema.dim() == 2 && extrema.size(1) == 3 &&
              extrema.is_contiguous() && extrema.device().is_cpu(),
              "mpscope fused_stats_into: extrema must be a contiguous CPU float64 [rows, 3] tensor");
  TORCH_CHECK(row0 >= 0 && row0 + n <= counts.size(0) && row0 + n <= extrema.size(0),
              "mpscope fused_stats_into: rows ", row0, "..", row0 + n, " outside the tables");
  stats_rows(tensors, tiny_bits.data(), cast.data(), hist, counts.data_ptr<int64_t>() + row0 * (NCOUNT + NHIST),
             NCOUNT + NHIST, extrema.data_ptr<double>() + row0 * 3);
}

// The non-zero exponent histogram bins of rows of a host count table, for the step's host copy
// (mpscope/recording/step_buffer.py; its NumPy path computes the same): row rows[i] of `counts`
// (int64, C order) holds its bins in columns col0 .. col0 + nbins - 1. Without groups (`group`
// empty) each row is its own entry, in the order of `rows`; else rows[i] adds into entry group[i]
// (0 <= group[i] < ngroups), and entries come in group order. Returns (entry, bin, count) int64
// arrays, one element per non-zero bin, entries in order and bins ascending within each.
// A row's bins are mostly zero (a tensor spans a few dozen binades of 279): blocks of 8 zero bins
// are skipped with one test. Arrays convert to int64 C order only where NumPy casts safely (a float
// table or float rows are refused, not truncated); every bound is checked without int64 overflow.
using I64 = pybind11::array_t<int64_t, pybind11::array::c_style>;

pybind11::tuple hist_nonzero(I64 counts, int64_t col0, int64_t nbins, I64 rows, I64 group, int64_t ngroups) {
  TORCH_CHECK(counts.ndim() == 2 && rows.ndim() == 1 && group.ndim() == 1 && col0 >= 0 && nbins >= 0 &&
              col0 <= counts.shape(1) && nbins <= counts.shape(1) - col0, "mpscope hist_nonzero: bad table or columns");
  const int64_t n = rows.shape(0), width = counts.shape(1), nrows = counts.shape(0);
  const bool grouped = group.shape(0) > 0;
  TORCH_CHECK(!grouped || group.shape(0) == n, "mpscope hist_nonzero: one group per row needed");
  TORCH_CHECK(!grouped || (ngroups >= 0 && ngroups <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(nbins, 1)),
              "mpscope hist_nonzero: bad number of groups");
  const int64_t* table = counts.data();
  const int64_t* r = rows.data();
  const int64_t* g = grouped ? group.data() : nullptr;
  std::vector<int64_t> acc;
  if (grouped) acc.assign(static_cast<size_t>(ngroups * nbins), 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < nrows && (!grouped || (g[i] >= 0 && g[i] < ngroups)),
                "mpscope hist_nonzero: row or group out of range");
    if (grouped) {
      const int64_t* p = table + r[i] * width + col0;
      int64_t* a = acc.data() + g[i] * nbins;
      for (int64_t j = 0; j < nbins; ++j) a[j] += p[j];
    }
  }
  std::vector<int64_t> oe, ob, oc;
  auto emit = [&](int64_t entry, const int64_t* p) {
    int64_t j = 0;
    for (; j + 8 <= nbins; j += 8) {
      if ((p[j] | p[j + 1] | p[j + 2] | p[j + 3] | p[j + 4] | p[j + 5] | p[j + 6] | p[j + 7]) == 0) continue;
      for (int64_t k = j; k < j + 8; ++k)
        if (p[k]) { oe.push_back(entry); ob.push_back(k); oc.push_back(p[k]); }
    }
    for (; j < nbins; ++j)
      if (p[j]) { oe.push_back(entry); ob.push_back(j); oc.push_back(p[j]); }
  };
  if (grouped) for (int64_t k = 0; k < ngroups; ++k) emit(k, acc.data() + k * nbins);
  else for (int64_t i = 0; i < n; ++i) emit(i, table + r[i] * width + col0);
  auto array = [](const std::vector<int64_t>& v) {
    I64 a(static_cast<pybind11::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int64_t));
    return a;
  };
  return pybind11::make_tuple(array(oe), array(ob), array(oc));
}

// The staging copy of a GPU run's observed tensor (mpscope/recording/step_buffer.py StagedRows.stage):
// `tensor` (float16 / bfloat16 / float32, on the buffer's device: the caller checks it, any layout) into elements
// offset .. offset + numel - 1 of `buffer` (float32, 1-D, contiguous), as one copy_ dispatched from
// C++ (about 2 us less host time per tensor than the same two ops dispatched from Python). The
// statistics ignore element order, so a tensor whose elements fill one block of memory once each
// (a transpose, channels-last) is copied in memory order; others in logical order. Dispatched below
// autograd (AutoDispatchBelowADInplaceOrView): the buffer joins no graph and gets no forward-mode
// tangent, whatever the grad mode, and no version counter is bumped (nothing but mpscope reads it).
void stage_copy(at::Tensor buffer, const at::Tensor& tensor, int64_t offset) {
  const int64_t n = tensor.numel();
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.dim() == 1 && buffer.is_contiguous(),
              "mpscope stage_copy: the buffer must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(offset >= 0 && n <= buffer.numel() - offset, "mpscope stage_copy: elements ", offset, "..",
              offset + n, " outside the buffer of ", buffer.numel());
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (tensor.is_non_overlapping_and_dense()) {
    buffer.as_strided(tensor.sizes(), tensor.strides(), buffer.storage_offset() + offset).copy_(tensor);
  } else {
    buffer.narrow(0, offset, n).view(tensor.sizes()).copy_(tensor);
  }
}

// The checks that let a recorded step's end reuse what it worked out the step before
// (mpscope/recording/parameter_batch.py and Recorder._selected_parameters in mpscope/recorder.py),
// in C++: the same answers as their Python forms, which stay for runs without the kernel, without
// making a Python object per tensor or per module (about 0.3 us per tensor in Python, inside a step).

// Whether each of `tensors` (a list) still looks as its entry of `looks` (a list of the
// (class, dtype, shape, layout, device) tuples that parameter_batch._LOOKS took of them): the same
// class object, dtype, sizes, layout and device. False at the first difference, for anything that
// is not a tensor, for a tensor without plain sizes (nested, symbolic) and for a malformed entry.
bool same_looks(pybind11::list tensors, pybind11::list looks) {
  PyObject* ts = tensors.ptr();
  PyObject* ls = looks.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(ts);
  if (PyList_GET_SIZE(ls) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(ts, i);
    PyObject* look = PyList_GET_ITEM(ls, i);
    if (!PyTuple_Check(look) || PyTuple_GET_SIZE(look) != 5 || !THPVariable_Check(o)) return false;
    if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != PyTuple_GET_ITEM(look, 0)) return false;
    const at::Tensor& t = THPVariable_Unpack(o);
    PyObject* dtype = PyTuple_GET_ITEM(look, 1);
    PyObject* shape = PyTuple_GET_ITEM(look, 2);
    PyObject* layout = PyTuple_GET_ITEM(look, 3);
    PyObject* device = PyTuple_GET_ITEM(look, 4);
    if (!THPDtype_Check(dtype) || reinterpret_cast<THPDtype*>(dtype)->scalar_type != t.scalar_type()) return false;
    if (!THPLayout_Check(layout) || reinterpret_cast<THPLayout*>(layout)->layout != t.layout()) return false;
    if (!THPDevice_Check(device) || reinterpret_cast<THPDevice*>(device)->device != t.device()) return false;
    if (!PyTuple_Check(shape) || t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
    const auto sizes = t.sizes();
    if (static_cast<Py_ssize_t>(sizes.size()) != PyTuple_GET_SIZE(shape)) return false;
    for (size_t j = 0; j < sizes.size(); ++j) {
      PyObject* d = PyTuple_GET_ITEM(shape, static_cast<Py_ssize_t>(j));
      if (!PyLong_CheckExact(d)) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(d, &overflow);
      if (overflow || v != sizes[j]) return false;
    }
  }
  return true;
}

// parameter_batch.gather in C++ (the same lists, in the same order): per (module, name, parameter)
// triple of `params`, its .grad when `want_grad` and set (form mark `with_grad`, else `no_grad`; an
// efficient zero tensor, which has no data, as the zeros it stands for),
// the parameter when `want_weight`, then the tensors of its optimizer state `state[p]` with at least
// one dimension, in the state dict's order, "step" left out (each marked by its key). Returns
// (tensors, form), or None when `state` is not a dict or a parameter's state is not a plain dict
// (an OrderedDict's order is not its dict's; a subclass may override items): the Python form then
// takes it, with its own errors. A tensor subclass's dim() is called from Python (it may override
// it or answer through __torch_function__); a plain tensor's is read in C++. `.grad`, a key's ==
// and a subclass's dim() may run Python code that changes these containers: each object in use is
// held, `params` is read as a list iterator reads it, and a state dict that changes size while read
// raises as in Python.
pybind11::object gather(pybind11::list params, bool want_grad, bool want_weight, pybind11::object state,
                        pybind11::object with_grad, pybind11::object no_grad) {
  using pybind11::reinterpret_borrow;
  PyObject* st_all = state.ptr();
  if (!PyDict_Check(st_all)) return pybind11::none();
  static PyObject* grad_name = PyUnicode_InternFromString("grad");
  static PyObject* step_name = PyUnicode_InternFromString("step");
  static PyObject* dim_name = PyUnicode_InternFromString("dim");
  pybind11::list tensors, form;
  PyObject* ts = tensors.ptr();
  PyObject* fs = form.ptr();
  PyObject* ps = params.ptr();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ps); ++i) {
    const auto triple = reinterpret_borrow<pybind11::object>(PyList_GET_ITEM(ps, i));  // (held: p lives)
    if (!PyTuple_Check(triple.ptr()) || PyTuple_GET_SIZE(triple.ptr()) != 3) return pybind11::none();
    PyObject* p = PyTuple_GET_ITEM(triple.ptr(), 2);
    if (want_grad) {
      PyObject* g = PyObject_GetAttr(p, grad_name);
      if (g == nullptr) throw pybind11::error_already_set();
      if (g == Py_None) {
        Py_DECREF(g);
        if (PyList_Append(fs, no_grad.ptr()) < 0) throw pybind11::error_already_set();
      } else {
        if (THPVariable_Check(g) && THPVariable_Unpack(g)._is_zerotensor()) {
          // an efficient zero tensor (no data): the zeros it stands for (stats.zeros_of)
          const at::Tensor& z = THPVariable_Unpack(g);
          PyObject* zeros = THPVariable_Wrap(at::zeros(z.sizes(), z.options()));
          Py_DECREF(g);
          if (zeros == nullptr) throw pybind11::error_already_set();
          g = zeros;
        }
        const int a = PyList_Append(fs, with_grad.ptr()), b = PyList_Append(ts, g);
        Py_DECREF(g);
        if (a < 0 || b < 0) throw pybind11::error_already_set();
      }
    } else if (PyList_Append(fs, no_grad.ptr()) < 0) {
      throw pybind11::error_already_set();
    }
    if (want_weight && PyList_Append(ts, p) < 0) throw pybind11::error_already_set();
    if (PyDict_GET_SIZE(st_all) == 0) continue;
    PyObject* found = PyDict_GetItemWithError(st_all, p);  // (borrowed)
    if (found == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      continue;
    }
    const auto st = reinterpret_borrow<pybind11::object>(found);
    if (!PyDict_CheckExact(st.ptr())) return pybind11::none();
    const Py_ssize_t size = PyDict_GET_SIZE(st.ptr());
    Py_ssize_t pos = 0;
    PyObject *bk, *bv;
    while (PyDict_Next(st.ptr(), &pos, &bk, &bv)) {
      const auto k = reinterpret_borrow<pybind11::object>(bk), v = reinterpret_borrow<pybind11::object>(bv);
      const int is_step = PyObject_RichCompareBool(k.ptr(), step_name, Py_EQ);
      if (is_step < 0) throw pybind11::error_already_set();
      bool take = !is_step && THPVariable_Check(v.ptr());
      if (take && THPVariable_CheckExact(v.ptr())) {
        take = THPVariable_Unpack(v.ptr()).dim() != 0;
      } else if (take) {  // a subclass: its dim() as Python calls it (an override, a __torch_function__)
        PyObject* d = PyObject_CallMethodNoArgs(v.ptr(), dim_name);
        const int truth = d == nullptr ? -1 : PyObject_IsTrue(d);
        Py_XDECREF(d);
        if (truth < 0) throw pybind11::error_already_set();
        take = truth != 0;
      }
      if (PyDict_GET_SIZE(st.ptr()) != size) {
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
        throw pybind11::error_already_set();
      }
      if (take && (PyList_Append(ts, v.ptr()) < 0 || PyList_Append(fs, k.ptr()) < 0)) {
        throw pybind11::error_already_set();
      }
    }
  }
  return pybind11::make_tuple(tensors, form);
}

// Whether each module of `mods` (a list) still has the children and parameters recorded in its
// entry of `tree` (a list of the (child names, child ids, parameter names, parameter ids) tuples
// that Recorder's _module_tree took): its `_modules` and `_parameters` dicts hold the same names,
// in the same order, bound to the same objects (by identity: id() of each, as recorded). False at
// the first difference and for a malformed entry or a module whose dict raises; None (the Python
// form then answers) where one of these is not a plain dict: an OrderedDict iterates in its own
// order, not its dict's (move_to_end), and another kind of object answers as its class says.
pybind11::object same_module_tree(pybind11::list mods, pybind11::list tree) {
  PyObject* ms = mods.ptr();
  PyObject* ts = tree.ptr();
  if (PyList_GET_SIZE(ts) != PyList_GET_SIZE(ms)) return pybind11::bool_(false);
  static PyObject* attrs[2] = {PyUnicode_InternFromString("_modules"), PyUnicode_InternFromString("_parameters")};
  // (the sizes read again on each pass: a `_modules` property may run code)
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ms) && i < PyList_GET_SIZE(ts); ++i) {
    PyObject* entry = PyList_GET_ITEM(ts, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) return pybind11::bool_(false);
    for (int k = 0; k < 2; ++k) {
      PyObject* names = PyTuple_GET_ITEM(entry, 2 * k);
      PyObject* ids = PyTuple_GET_ITEM(entry, 2 * k + 1);
      const auto m = pybind11::reinterpret_borrow<pybind11::object>(PyList_GET_ITEM(ms, i));
      PyObject* d = PyObject_GetAttr(m.ptr(), attrs[k]);
      if (d == nullptr) {
        PyErr_Clear();
        return pybind11::bool_(false);
      }
      if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        return pybind11::none();
      }
      bool same = PyTuple_Check(names) && PyTuple_Check(ids) &&
                  PyDict_GET_SIZE(d) == PyTuple_GET_SIZE(names) && PyTuple_GET_SIZE(ids) == PyTuple_GET_SIZE(names);
      Py_ssize_t pos = 0, j = 0;
      PyObject *key, *value;
      while (same && PyDict_Next(d, &pos, &key, &value)) {
        PyObject* name = PyTuple_GET_ITEM(names, j);
        if (key != name) {
          Py_INCREF(key);  // (a key's == may run code that changes the dict)
          const int eq = PyObject_RichCompareBool(key, name, Py_EQ);
          Py_DECREF(key);
          if (eq == 1 && PyDict_GET_SIZE(d) != PyTuple_GET_SIZE(names)) {
            same = false;
            break;
          }
          if (eq != 1) {
            PyErr_Clear();
            same = false;
            break;
          }
        }
        PyObject* id = PyTuple_GET_ITEM(ids, j);
        if (!PyLong_CheckExact(id) || PyLong_AsVoidPtr(id) != static_cast<void*>(value)) {
          PyErr_Clear();
          same = false;
        }
        ++j;
      }
      Py_DECREF(d);
      if (!same) return pybind11::bool_(false);
    }
  }
  return pybind11::bool_(PyList_GET_SIZE(ts) == PyList_GET_SIZE(ms));
}

// ---------------------------------------------------------------------------------------------
// The hooks' usual path in one C++ call each (mpscope/recorder.py holds the Python form, which
// stays the reference and takes every case this path hands back). Recorder._observe_now's two
// usual branches: a fresh tensor's stats written by the fused kernel into the next host row (a CPU
// run) or its values staged on its device (StagedRows.stage: a run on an accelerator); and
// Recorder._on_forward for a module returning one plain tensor in a forward pass outside any
// torch.func transform: its activation row and the gradient hook GradHooks.add registers. Every
// Python object is read and written as the Python form reads and writes it (the same attributes,
// dicts, lists and calls, in the same order); anything else (a key not made yet, a tensor seen
// before in the step, full tables, the torch-op path) calls the Python form for that part.
// It pays where it avoids the interpreter's frames and generic attribute lookups: plain instance
// attributes are read from the instance's __dict__, references are held without pybind11 objects
// (whose reference counting checks the GIL each time), and the constants are parsed once per step
// into a capsule (hook_state).
namespace hookpath {

struct Ref {  // an owned reference, released at the end of its scope
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    Py_XDECREF(p);
    p = o.p;
    o.p = nullptr;
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
};
Ref own(PyObject* p) {
  if (p == nullptr) throw pybind11::error_already_set();
  return Ref(p);
}
Ref borrowed(PyObject* p) {
  Py_INCREF(p);
  return Ref(p);
}
Ref py_int(int64_t v) { return own(PyLong_FromLongLong(v)); }

// obj.name for an attribute the object's class sets on its instances (read from its __dict__; a
// name not there, as a method, the generic way)
Ref attr(PyObject* o, PyObject* name) {
  PyObject** dp = _PyObject_GetDictPtr(o);
  if (dp != nullptr && *dp != nullptr) {
    PyObject* v = PyDict_GetItemWithError(*dp, name);
    if (v != nullptr) return borrowed(v);
    if (PyErr_Occurred()) throw pybind11::error_already_set();
  }
  return own(PyObject_GetAttr(o, name));
}
// obj.name = v for such an attribute
void set_attr(PyObject* o, PyObject* name, PyObject* v) {
  PyObject** dp = _PyObject_GetDictPtr(o);
  const int rc = (dp != nullptr && *dp != nullptr) ? PyDict_SetItem(*dp, name, v) : PyObject_SetAttr(o, name, v);
  if (rc < 0) throw pybind11::error_already_set();
}
int64_t as_int(PyObject* v) {
  const long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  return x;
}
void check(int rc) {
  if (rc < 0) throw pybind11::error_already_set();
}

struct Names {
  PyObject *pass, *seen, *obs, *grad_tick, *rows, *staged, *hist_now, *n, *capacity, *counts, *extrema, *log,
      *run, *meta, *autocast_dtype, *note_autocast, *observe_now, *backward_hooks, *grad_fn, *register_hook_dict,
      *next_id, *end_id, *tags, *entries, *hookless, *discard, *add, *grad_entry, *grad_hooks, *off, *elements,
      *buffer, *sizes, *fp16, *device, *copier, *stage_slowly, *copy, *take, *names, *key_index, *activation,
      *output, *float64, *fused_stats_into, *unknown;
};
const Names& names() {
  static const Names n = [] {
    auto i = [](const char* s) { return PyUnicode_InternFromString(s); };
    return Names{i("_pass"), i("_seen"), i("_obs"), i("_grad_tick"), i("_rows"), i("_staged"), i("_hist_now"),
                 i("n"), i("capacity"), i("counts"), i("extrema"), i("log"), i("run"), i("meta"),
                 i("autocast_dtype"), i("_note_autocast"), i("_observe_now"), i("_backward_hooks"), i("grad_fn"),
                 i("_register_hook_dict"), i("_next_id"), i("_end_id"), i("_tags"), i("_entries"), i("_hookless"),
                 i("discard"), i("add"), i("_grad_entry"), i("_grad_hooks"), i("_off"), i("elements"), i("buffer"),
                 i("_sizes"), i("_fp16"), i("device"), i("copier"), i("_stage_slowly"), i("_copy"), i("take"),
                 i("_names"), i("_key_index"), i("activation"), i("output"), i("float64"), i("fused_stats_into"),
                 i("?")};
  }();
  return n;
}

// The constants of a recorded step (Recorder._fast_state, parsed once by hook_state): whether
// activations and their gradients are recorded, the fused kernel's tiny and cast bit patterns, the
// mpscope.kernel module's dict and its own fused_stats_into (a replacement found there at a call is
// called instead of the kernel, as the Python form calls whatever is there: a test's failure, the
// benchmarks' stub), this kernel module (that function's argument), functools.partial, OrderedDict.
struct State {
  bool take_activation = false, grad_role = false;
  int64_t tiny[3] = {0, 0, 0};  // float16, bfloat16, float32
  std::vector<int64_t> cast;
  PyObject *kernel_dict = nullptr, *own_stats_into = nullptr, *module = nullptr, *partial = nullptr, *odict = nullptr;
  ~State() {
    Py_XDECREF(kernel_dict);
    Py_XDECREF(own_stats_into);
    Py_XDECREF(module);
    Py_XDECREF(partial);
    Py_XDECREF(odict);
  }
};
PyObject* own_stage_copy = nullptr;  // this module's stage_copy function object (set at import)

const State& state_of(PyObject* capsule) {
  void* p = PyCapsule_GetPointer(capsule, "mpscope.hook_state");
  if (p == nullptr) throw pybind11::error_already_set();
  return *static_cast<const State*>(p);
}

// tensor_facts' answer, as C++ values: kOk, kNone (the stats take no such tensor) or kPython (one
// whose attribute reads could differ from these C++ getters, or that has no plain sizes and
// storage: its Python form, stats.tensor_facts, answers)
struct Facts {
  enum Kind { kNone, kPython, kOk } kind = kNone;
  PyObject* dtype = nullptr;  // (borrowed: an interned name kept for good)
  int64_t numel = 0;
  bool fused_cpu = false;
  Ref ident;  // (id, version, data pointer), or None
};

PyObject* dtype_name(at::ScalarType st) {
  static PyObject* const n[4] = {PyUnicode_InternFromString("float16"), PyUnicode_InternFromString("bfloat16"),
                                 PyUnicode_InternFromString("float32"), PyUnicode_InternFromString("float64")};
  switch (st) {
    case at::kHalf: return n[0];
    case at::kBFloat16: return n[1];
    case at::kFloat: return n[2];
    case at::kDouble: return n[3];
    default: return nullptr;
  }
}

Facts facts_of(PyObject* o) {
  Facts f;
  if (!THPVariable_CheckExact(o)) {  // (Tensor or Parameter, whose attribute reads are these getters)
    f.kind = Facts::kPython;
    return f;
  }
  const at::Tensor& t = THPVariable_Unpack(o);
  f.dtype = dtype_name(t.scalar_type());
  if (f.dtype == nullptr || t.layout() != at::kStrided || t.is_nested() || t.is_meta() || t._is_zerotensor())
    return f;
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !t.has_storage()) {
    f.kind = Facts::kPython;
    return f;
  }
  f.numel = t.numel();
  if (f.numel == 0) return f;
  if (!t.is_inference()) {
    Ref id = own(PyLong_FromVoidPtr(o)), version = py_int(static_cast<int64_t>(t._version())),
        ptr = own(PyLong_FromVoidPtr(t.data_ptr()));
    f.ident = own(PyTuple_Pack(3, id.get(), version.get(), ptr.get()));
  } else {
    f.ident = borrowed(Py_None);
  }
  f.fused_cpu = t.is_cpu() && t.scalar_type() != at::kDouble;
  f.kind = Facts::kOk;
  return f;
}

Ref facts_tuple(const Facts& f) {
  Ref n = py_int(f.numel);
  return own(PyTuple_Pack(4, f.dtype, n.get(), f.ident.get(), f.fused_cpu ? Py_True : Py_False));
}

Ref call_observe_now(PyObject* rec, PyObject* module, PyObject* role, PyObject* name, PyObject* tensor,
                     PyObject* facts, PyObject* scaled, PyObject* pass_id) {
  PyObject* args[] = {rec, module, role, name, tensor, facts, scaled, pass_id};
  return own(PyObject_VectorcallMethod(names().observe_now, args, 8, nullptr));
}

// StagedRows.stage(tensor, n) (mpscope/recording/step_buffer.py); its copier called in C++ when it
// is this module's own stage_copy
Ref stage(PyObject* staged, PyObject* tensor, int64_t n) {
  const Names& N = names();
  const int64_t off = as_int(attr(staged, N.off).get());
  const int64_t r = as_int(attr(staged, N.n).get());
  Ref buffer = attr(staged, N.buffer);
  if (off + n > as_int(attr(staged, N.elements).get()) || r == as_int(attr(staged, N.capacity).get()) ||
      buffer.get() == Py_None) {
    Ref nn = py_int(n);
    return own(PyObject_CallMethodObjArgs(staged, N.stage_slowly, tensor, nn.get(), nullptr));
  }
  Ref row = py_int(r);
  set_attr(staged, N.n, py_int(r + 1).get());
  Ref copier = attr(staged, N.copier);
  if (copier.get() == own_stage_copy && THPVariable_Check(buffer.get())) {
    stage_copy(THPVariable_Unpack(buffer.get()), THPVariable_Unpack(tensor), off);
  } else if (copier.get() == Py_None) {
    Ref o = py_int(off), nn = py_int(n);
    own(PyObject_CallMethodObjArgs(staged, N.copy, tensor, o.get(), nn.get(), nullptr));
  } else {
    Ref o = py_int(off);
    own(PyObject_CallFunctionObjArgs(copier.get(), buffer.get(), tensor, o.get(), nullptr));
  }
  set_attr(staged, N.off, py_int(off + n).get());
  check(PyList_Append(attr(staged, N.sizes).get(), py_int(n).get()));
  check(PyList_Append(attr(staged, N.fp16).get(),
                      THPVariable_Unpack(tensor).scalar_type() == at::kHalf ? Py_True : Py_False));
  return row;
}

// Recorder._observe_now(module, role, name, tensor, facts, scaled, pass_id) for `f` (facts_of's
// answer, kOk); `facts`: the tuple, when the caller has it (else made if the Python form is called)
Ref observe(PyObject* rec, const State& s, PyObject* module, PyObject* role, PyObject* name, PyObject* tensor,
            const Facts& f, PyObject* facts, PyObject* scaled, PyObject* pass_id) {
  const Names& N = names();
  auto python_form = [&]() {
    Ref made;
    if (facts == nullptr) made = facts_tuple(f);
    return call_observe_now(rec, module, role, name, tensor, facts != nullptr ? facts : made.get(), scaled, pass_id);
  };
  Ref k = own(PyTuple_Pack(4, module, role, name, f.dtype));
  Ref index = attr(rec, N.key_index);
  PyObject* key = PyDict_GetItemWithError(index.get(), k.get());
  if (key == nullptr) {
    if (PyErr_Occurred()) throw pybind11::error_already_set();
    return python_form();  // a key not made yet
  }
  Ref keep_key = borrowed(key);
  Ref seen;
  if (f.ident.get() != Py_None) {
    seen = attr(rec, N.seen);
    if (PyDict_GetItemWithError(seen.get(), f.ident.get()) != nullptr) return python_form();  // seen this step
    if (PyErr_Occurred()) throw pybind11::error_already_set();
  }
  Ref tables = attr(rec, N.rows);
  Ref row, log;
  if (tables.get() != Py_None && f.fused_cpu) {
    int64_t r = as_int(attr(tables.get(), N.n).get());
    if (r + 1 > as_int(attr(tables.get(), N.capacity).get())) {  // full: take() grows the tables
      Ref one = py_int(1);
      r = as_int(own(PyObject_CallMethodOneArg(tables.get(), N.take, one.get())).get());
    } else {
      set_attr(tables.get(), N.n, py_int(r + 1).get());
    }
    row = py_int(r);
    Ref counts = attr(tables.get(), N.counts), extrema = attr(tables.get(), N.extrema), hist = attr(rec, N.hist_now);
    PyObject* stats_into = PyDict_GetItemWithError(s.kernel_dict, N.fused_stats_into);
    if (stats_into == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
    if (stats_into != nullptr && stats_into != s.own_stats_into) {  // replaced: called as the Python form calls it
      Ref one = own(PyList_New(1));
      Py_INCREF(tensor);
      PyList_SET_ITEM(one.get(), 0, tensor);
      own(PyObject_CallFunctionObjArgs(stats_into, s.module, one.get(), hist.get(), counts.get(), extrema.get(),
                                       row.get(), nullptr));
    } else {
      const at::Tensor& t = THPVariable_Unpack(tensor);
      const int64_t tiny = t.scalar_type() == at::kHalf ? s.tiny[0] : t.scalar_type() == at::kBFloat16 ? s.tiny[1] : s.tiny[2];
      fused_stats_into({t}, {tiny}, s.cast, hist.get() == Py_True, THPVariable_Unpack(counts.get()),
                       THPVariable_Unpack(extrema.get()), r);
    }
    log = attr(tables.get(), N.log);
  } else {
    Ref staged = attr(rec, N.staged);
    if (staged.get() == Py_None || f.dtype == N.float64) return python_form();
    Ref device = attr(staged.get(), N.device);
    if (!THPDevice_Check(device.get()) ||
        reinterpret_cast<THPDevice*>(device.get())->device != THPVariable_Unpack(tensor).device())
      return python_form();
    row = stage(staged.get(), tensor, f.numel);
    log = attr(staged.get(), N.log);
  }
  Ref obs = attr(rec, N.obs);
  const Py_ssize_t at_obs = PyList_Size(obs.get());
  if (at_obs < 0) throw pybind11::error_already_set();
  Ref numel = py_int(f.numel), at = own(PyLong_FromSsize_t(at_obs));
  Ref entry = own(PyTuple_Pack(6, key, row.get(), numel.get(), scaled, pass_id, at.get()));
  check(PyList_Append(log.get(), entry.get()));
  if (f.ident.get() != Py_None) {
    Ref ref = own(PyWeakref_NewRef(tensor, nullptr));
    Ref tick = attr(rec, N.grad_tick);
    Ref val = own(PyTuple_Pack(5, ref.get(), row.get(), key, pass_id, tick.get()));
    check(PyDict_SetItem(seen.get(), f.ident.get(), val.get()));
  }
  return row;
}

// GradHooks.add(t, hook, tag) (mpscope/recording/grad_hooks.py) for a tensor of class Tensor (a
// Parameter goes through register_hook there) with no hooks dict yet and an id left in the block
// taken; anything else is the Python form's
bool add_grad_hook(PyObject* grad_hooks, PyObject* t, PyObject* hook, PyObject* tag, const State& s) {
  const Names& N = names();
  Ref next = attr(grad_hooks, N.next_id);
  const int64_t hid = as_int(next.get());
  PyObject* existing = reinterpret_cast<THPVariable*>(t)->backward_hooks;  // (t._backward_hooks, None as null)
  if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(THPVariableClass) || (existing != nullptr && existing != Py_None) ||
      hid == as_int(attr(grad_hooks, N.end_id).get())) {
    Ref added = own(PyObject_CallMethodObjArgs(grad_hooks, N.add, t, hook, tag, nullptr));
    const int truth = PyObject_IsTrue(added.get());
    check(truth);
    return truth == 1;
  }
  Ref hooks = own(PyObject_CallNoArgs(s.odict));
  check(PyObject_SetAttr(t, N.backward_hooks, hooks.get()));
  Ref fn = own(PyObject_GetAttr(t, N.grad_fn));
  if (fn.get() != Py_None) own(PyObject_CallMethodOneArg(fn.get(), N.register_hook_dict, t));
  set_attr(grad_hooks, N.next_id, py_int(hid + 1).get());
  // (an OrderedDict keeps its own order: set through its __setitem__, not the dict underneath)
  check(PyObject_SetItem(hooks.get(), next.get(), hook));
  check(PyDict_SetItem(attr(grad_hooks, N.tags).get(), next.get(), tag));
  Ref pair = own(PyTuple_Pack(2, hooks.get(), next.get()));
  check(PyList_Append(attr(grad_hooks, N.entries).get(), pair.get()));
  return true;
}
}  // namespace hookpath

// The facts the recorder's per-tensor path needs about an observed tensor, read in one call
// (mpscope/recorder.py: stats.tensor_facts is the Python form, with the same answers): about ten
// Tensor attribute reads from Python (each a C++ call with its torch-function and warning-handler
// set-up, about 1,000 instructions) become one. For a tensor of class Tensor or Parameter (whose
// attribute reads go to these same C++ getters) with plain sizes and storage; anything else
// (subclasses, tensors without storage or with symbolic sizes) is passed to `fallback`, the Python
// form. None when the stats take no such tensor (stats.recordable_dtype's rules: float16 / bfloat16
// / float32 / float64, strided, not nested, not meta, not empty) and for an efficient zero tensor (no
// data: the recorder takes the zeros it stands for); else (dtype name, numel, ident,
// fused on the CPU): ident is (id, version counter, data pointer) as Python's id(t), t._version and
// t.data_ptr() give them, None for an inference tensor (it has no version counter).
pybind11::object tensor_facts(pybind11::handle obj, pybind11::handle fallback) {
  const hookpath::Facts f = hookpath::facts_of(obj.ptr());
  if (f.kind == hookpath::Facts::kPython) {
    PyObject* r = PyObject_CallOneArg(fallback.ptr(), obj.ptr());
    if (r == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(r);
  }
  if (f.kind == hookpath::Facts::kNone) return pybind11::none();
  hookpath::Ref t = hookpath::facts_tuple(f);
  return pybind11::reinterpret_steal<pybind11::object>(std::exchange(t.p, nullptr));
}

// The constants of a recorded step for forward_hook and observe_now, parsed once (see
// hookpath::State): (take activations, take their gradients, (tiny float16, bfloat16, float32,
// cast 0..5), the mpscope.kernel module, its own fused_stats_into, this kernel module,
// functools.partial, OrderedDict) -> a capsule.
pybind11::object hook_state(pybind11::tuple t) {
  TORCH_CHECK(t.size() == 8, "mpscope hook_state: 8 items expected");
  auto st = std::make_unique<hookpath::State>();
  st->take_activation = t[0].cast<bool>();
  st->grad_role = t[1].cast<bool>();
  auto bits = t[2].cast<std::vector<int64_t>>();
  TORCH_CHECK(bits.size() == 9, "mpscope hook_state: 9 bit patterns expected");
  std::copy(bits.begin(), bits.begin() + 3, st->tiny);
  st->cast.assign(bits.begin() + 3, bits.end());
  PyObject* kd = PyModule_GetDict(t[3].ptr());
  if (kd == nullptr) throw pybind11::error_already_set();
  PyObject* refs[5] = {kd, t[4].ptr(), t[5].ptr(), t[6].ptr(), t[7].ptr()};
  for (PyObject* r : refs) Py_INCREF(r);
  st->kernel_dict = refs[0];
  st->own_stats_into = refs[1];
  st->module = refs[2];
  st->partial = refs[3];
  st->odict = refs[4];
  PyObject* cap = PyCapsule_New(st.get(), "mpscope.hook_state", [](PyObject* c) {
    delete static_cast<hookpath::State*>(PyCapsule_GetPointer(c, "mpscope.hook_state"));
  });
  if (cap == nullptr) throw pybind11::error_already_set();
  st.release();
  return pybind11::reinterpret_steal<pybind11::object>(cap);
}

// Recorder._observe_now with the kernel, its facts read here (its arguments after the recorder and
// hook_state's capsule, but the facts): the row (an int), or what the Python form returns for the
// cases it takes; None for a tensor whose facts this path does not read (see facts_of): the caller
// then reads them itself.
pybind11::object observe_now(pybind11::handle rec, pybind11::handle state, pybind11::handle module, pybind11::handle role,
                             pybind11::handle name, pybind11::handle tensor, pybind11::handle scaled,
                             pybind11::handle pass_id) {
  const hookpath::State& s = hookpath::state_of(state.ptr());
  const hookpath::Facts f = hookpath::facts_of(tensor.ptr());
  if (f.kind != hookpath::Facts::kOk) return pybind11::none();
  hookpath::Ref r = hookpath::observe(rec.ptr(), s, module.ptr(), role.ptr(), name.ptr(), tensor.ptr(), f, nullptr,
                                      scaled.ptr(), pass_id.ptr());
  return pybind11::reinterpret_steal<pybind11::object>(std::exchange(r.p, nullptr));
}

// Recorder._on_forward(module, output) for one plain output tensor, in a forward pass (not a
// re-run inside backward) outside any torch.func transform (functorch includes its front-mode
// dispatch key while one runs; its wrappers, which have no storage, go to the Python form too),
// whose facts this path reads: True when done; False when nothing was done (then the Python form
// takes it; the autocast note the two share is made once either way).
bool forward_hook(pybind11::handle rec_h, pybind11::handle state, pybind11::handle module, pybind11::handle output) {
  using namespace hookpath;
  PyObject* rec = rec_h.ptr();
  PyObject* out = output.ptr();
  if (!THPVariable_CheckExact(out) || torch::autograd::get_current_graph_task_id() != -1 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return false;
  const Facts f = facts_of(out);
  if (f.kind != Facts::kOk) return false;
  const Names& N = names();
  const State& s = state_of(state.ptr());
  Ref meta = attr(attr(rec, N.run).get(), N.meta);
  PyObject* ac = PyDict_Check(meta.get()) ? PyDict_GetItemWithError(meta.get(), N.autocast_dtype) : nullptr;
  if (ac == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
  if (ac == nullptr || ac == Py_None) own(PyObject_CallMethodNoArgs(rec, N.note_autocast));
  Ref pass_id = attr(rec, N.pass);
  Ref names_d = attr(rec, N.names);
  Ref id = own(PyLong_FromVoidPtr(module.ptr()));
  PyObject* mname = PyDict_GetItemWithError(names_d.get(), id.get());
  if (mname == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
  Ref mn = borrowed(mname != nullptr ? mname : N.unknown);
  if (s.take_activation) observe(rec, s, mn.get(), N.activation, N.output, out, f, nullptr, Py_False, pass_id.get());
  const bool positive = PyLong_Check(pass_id.get()) && as_int(pass_id.get()) > 0;
  const bool hook_grads = positive || (pass_id.get() == Py_None && s.grad_role);
  if (hook_grads && THPVariable_Unpack(out).requires_grad()) {
    Ref entry = own(PyObject_GetAttr(rec, N.grad_entry));
    Ref hook = own(PyObject_CallFunctionObjArgs(s.partial, entry.get(), mn.get(), N.output, pass_id.get(), nullptr));
    Ref tag = own(PyTuple_Pack(2, mn.get(), N.output));
    if (add_grad_hook(attr(rec, N.grad_hooks).get(), out, hook.get(), tag.get(), s)) {
      own(PyObject_CallMethodOneArg(attr(rec, N.hookless).get(), N.discard, pass_id.get()));
    }
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &fused_stats, "mpscope fused stats (CPU)");
  m.def("fused_stats_into", &fused_stats_into, "mpscope fused stats (CPU) into preallocated rows");
  m.def("hist_nonzero", &hist_nonzero, "mpscope: the non-zero histogram bins of host count table rows");
  m.def("stage_copy", &stage_copy, "mpscope: a tensor's values into a staging buffer (below autograd)");
  m.def("same_looks", &same_looks, "mpscope: whether tensors keep the class, dtype, shape, layout and device recorded");
  m.def("gather", &gather, "mpscope: the tensors of the step end's batch and their form");
  m.def("tensor_facts", &tensor_facts, "mpscope: what the per-tensor path needs to know of an observed tensor");
  hookpath::own_stage_copy = m.attr("stage_copy").ptr();
  Py_INCREF(hookpath::own_stage_copy);
  m.def("hook_state", &hook_state, "mpscope: the constants of the hooks' C++ path for a recorded step");
  m.def("observe_now", &observe_now, "mpscope: Recorder._observe_now's usual branches in C++");
  m.def("forward_hook", &forward_hook, "mpscope: Recorder._on_forward's usual case in C++");
  m.def("same_module_tree", &same_module_tree, "mpscope: whether modules keep the children and parameters recorded");
}
