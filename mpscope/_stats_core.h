// mpscope's statistics kernel, without PyTorch: one read of each float32 / float16 / bfloat16 array
// computes every count, min/max and the exponent histogram (see span_rows at the end).
//
// Each element is classified by the bits of |x| (a float16 / bfloat16 threshold rounded up to the
// element's own format is exact): for non-negative IEEE numbers the order of the bit patterns is the
// order of the values, so "x rounds to 0 / a subnormal / inf when cast" is a comparison with the bit
// pattern of the exact rounding threshold (passed in from Python, computed from torch.finfo). On
// AVX-512BW CPUs those counts come from per-exponent-field counts (one_pass); elsewhere from one
// compare per threshold (scan_f32 / scan_bf16 / scan_f16).
//
// Two binaries include it: the PyTorch extension built at run time (_kernel.cpp: tensors in, its
// chunks on PyTorch's intra-op threads) and mpscope._core (_core.cpp: compiled when mpscope is
// installed, needs only Python's headers, so it is there from a run's first step). Both call
// span_rows; mpscope/kernel.py says which one runs.
#pragma once
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MPSCOPE_WINDOW 1
#endif

// An invariant of constants computed here (never of the data): abort when it does not hold.
#define MPSCOPE_CHECK(cond) do { if (!(cond)) std::abort(); } while (0)

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
inline bool bf16_thresholds_ok(const uint32_t* T) {
  uint16_t T16[NGE];
  for (int j = 0; j < NGE; ++j) T16[j] = static_cast<uint16_t>((T[j] + 0xFFFFu) >> 16);
  return T16[0] == 1 && T16[1] == 1 && T16[2] == 0x0080 && T16[3] == 0x0080 && T16[7] == 0x7F80 &&
         T16[8] == 0x7F80 && T16[9] == 0x7F81;
}

// (Those the bfloat16 paths take as fixed: a bfloat16 array's own smallest normal is float32's, and
// bfloat16's overflow threshold lies above its max; span_rows' callers check it: bf16_thresholds_ok.)
void bf16_thresholds(const uint32_t* T, uint16_t* T16) {
  for (int j = 0; j < NGE; ++j) T16[j] = static_cast<uint16_t>((T[j] + 0xFFFFu) >> 16);
  MPSCOPE_CHECK(bf16_thresholds_ok(T));
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

// A float16 bit pattern's value (exact: every float16 is a float32; subnormals are man * 2^-24).
inline float half_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, field = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (field == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return from_bits(sign | (field == 0x1F ? 0x7F800000u | (man << 13) : ((field + 112u) << 23) | (man << 13)));
}

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


// One array to read: its first element, its length and its format.
enum Kind : int { KF32 = 0, KF16 = 1, KBF16 = 2 };
struct Span {
  const void* p;
  int64_t n;
  int kind;
};

// One chunk (at most GRAIN elements) of one array: classify and fold, then count exponents (the
// chunk has subnormals when ge[0] - ge[3], the non-zero elements below its smallest normal, > 0).
constexpr int64_t GRAIN = 1 << 15;
inline void scan_chunk(const Span& x, int64_t lo, int64_t len, const uint32_t* T, bool hist, Acc& acc,
                       RunState& run) {
  Chunk c;
  const auto* p32 = static_cast<const uint32_t*>(x.p) + lo;
  const auto* p16 = static_cast<const uint16_t*>(x.p) + lo;
#ifdef MPSCOPE_WINDOW
  if (run.use_one_pass && have_avx512bw()) {  // the histogram comes at no extra cost here
    if (x.kind == KF32) one_pass_f32(p32, len, T, run, acc.hist, &c);
    else if (x.kind == KBF16) one_pass_16<true>(p16, len, T, run, acc.hist, &c);
    else one_pass_16<false>(p16, len, T, run, acc.hist, &c);
    fold(c, x.kind == KF16, acc);
    return;
  }
#endif
  if (x.kind == KF32) {
    scan_f32(p32, len, T, &c);
    if (hist) chunk_exp<uint32_t, 23, 0xFF, 127, 23>(p32, len, c.ge[0] > c.ge[3], run, acc.hist);
  } else if (x.kind == KBF16) {
    scan_bf16(p16, len, T, &c);
    if (hist) chunk_exp<uint16_t, 7, 0xFF, 127, 7>(p16, len, c.ge[0] > c.ge[3], run, acc.hist);
  } else {
    scan_f16(p16, len, &c);
    if (hist) chunk_exp<uint16_t, 10, 0x1F, 15, 10>(p16, len, c.ge[0] > c.ge[3], run, acc.hist);
  }
  fold(c, x.kind == KF16, acc);
}

// End of a run of chunks of one array: its exponent tables into the accumulator's binades.
inline void fold_run(const Span& x, bool hist, RunState& run, Acc& acc) {
  if (hist) {
    if (x.kind == KF16) fold_exp<0x1F, 15>(run.tab, acc.hist);
    else fold_exp<0xFF, 127>(run.tab, acc.hist);
  }
  run.reset();
}

// An array's ascending thresholds of the cumulative counts (see Chunk): tiny = its own smallest
// normal's pattern; cast = fp16 under/normal/overflow, bf16 under/normal/overflow bit patterns,
// "under" being the largest value that rounds to 0.
inline std::array<uint32_t, NGE> thresholds_of(int64_t tiny, const int64_t* cast) {
  return {1u, static_cast<uint32_t>(cast[3]) + 1u, static_cast<uint32_t>(cast[4]), static_cast<uint32_t>(tiny),
          static_cast<uint32_t>(cast[0]) + 1u, static_cast<uint32_t>(cast[1]), static_cast<uint32_t>(cast[2]),
          static_cast<uint32_t>(cast[5]), INF_BITS, INF_BITS + 1u};
}

// The stats of the arrays `xs` into rows 0..n-1 of cp (int64, row stride `width`: the 10 counts,
// then with `hist` the NHIST bins) and ep (float64, row stride 3: max, min, absmin_nonzero); max/min
// are -inf/+inf and absmin is +inf when an array has no finite (non-zero) element. tiny_bits[i]: bit
// pattern of array i's own smallest normal; cast: the six fp16/bf16 threshold bit patterns.
//
// All arrays' chunks form one list that `threads` workers share (parallel_for(begin, end, grain, f)
// calls f(chunk_begin, chunk_end, worker) over a partition of [begin, end), workers numbered below
// `threads`), so a batch of many small arrays (a model's parameters) is spread over the workers as
// well as one large one. Each worker folds consecutive chunks of an array into one accumulator and
// hands it over when the array changes; the partial accumulators are combined per array at the end.
template <typename ParallelFor>
void span_rows(const std::vector<Span>& xs, const int64_t* tiny_bits, const int64_t* cast, bool hist, int64_t* cp,
               int64_t width, double* ep, int threads, ParallelFor&& parallel_for) {
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<std::array<uint32_t, NGE>> thresholds(n);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (array, first element)
  for (int64_t i = 0; i < n; ++i) {
    thresholds[i] = thresholds_of(tiny_bits[i], cast);
    for (int64_t lo = 0; lo < xs[i].n; lo += GRAIN) chunks.emplace_back(i, lo);
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
        fold_run(xs[cur], hist, run, acc);
        emit(cur, acc);
        reset(acc);
        cur = i;
      }
      scan_chunk(xs[i], lo, std::min(xs[i].n, lo + GRAIN) - lo, thresholds[i].data(), hist, acc, run);
    }
    fold_run(xs[cur], hist, run, acc);
    emit(cur, acc);
  };
  // >= 4 chunks (128K elements, tens of microseconds) per task; fewer run on the calling thread
  if (nchunks <= 4 || threads <= 1) {
    if (nchunks) scan_range(0, nchunks, [&](int64_t i, const Acc& a) { combine(total[i], a, hist); });
  } else {
    std::vector<std::vector<std::pair<int64_t, Acc>>> partial(threads + 1);
    parallel_for(0, nchunks, 4, [&](int64_t cb, int64_t ce, int worker) {
      auto& mine = partial[worker];
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
