// mpscope's fused CPU stats kernel: one read of each tensor computes every count, min/max and the
// exponent histogram. Built on first use with torch.utils.cpp_extension.load (see mpscope/kernel.py);
// mpscope falls back to the equivalent torch-op path (mpscope/stats.py) when it cannot be built.
//
// Each element is widened to float32 (exact for float16 / bfloat16) and classified by the bits of
// |x|: for non-negative IEEE numbers the order of the bit patterns is the order of the values, so
// "x rounds to 0 / a subnormal / inf when cast" is a comparison with the bit pattern of the exact
// rounding threshold (passed in from Python, computed from torch.finfo).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <vector>
#include <limits>
#include <cmath>

namespace {

constexpr int NCOUNT = 10;      // zero, subnormal, fp16 under/sub/over, bf16 under/sub/over, nan, inf
constexpr int EXP_MIN = -150;   // histogram bins floor(log2|x|) in [EXP_MIN, EXP_MAX]
constexpr int EXP_MAX = 128;
constexpr int NHIST = EXP_MAX - EXP_MIN + 1;
constexpr uint32_t INF_BITS = 0x7F800000u;

struct Thresholds {
  uint32_t tiny;     // own dtype's smallest normal: |x| < tiny is subnormal
  uint32_t u16, n16, o16;   // fp16: |x| <= u16 -> 0, < n16 -> subnormal, >= o16 -> inf
  uint32_t ub, nb, ob;      // bf16 likewise
};

struct Acc {
  int64_t c[NCOUNT];
  float hi, lo;
  uint32_t amin;
  int64_t hist[NHIST];
};

inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void scan(const T* data, int64_t begin, int64_t end, const Thresholds& th, bool hist, Acc& a) {
  int64_t c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0, c7 = 0, c8 = 0, c9 = 0;
  float hi = -std::numeric_limits<float>::infinity();
  float lo = std::numeric_limits<float>::infinity();
  uint32_t amin = 0xFFFFFFFFu;
  for (int64_t i = begin; i < end; ++i) {
    const float f = widen(data[i]);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t b = bits & 0x7FFFFFFFu;
    const bool fin = b < INF_BITS;
    const bool fnz = (b - 1u) < (INF_BITS - 1u);  // finite and non-zero
    c0 += (b == 0);
    c1 += fnz & (b < th.tiny);
    c2 += fnz & (b <= th.u16);
    c3 += (b > th.u16) & (b < th.n16);
    c4 += fin & (b >= th.o16);
    c5 += fnz & (b <= th.ub);
    c6 += (b > th.ub) & (b < th.nb);
    c7 += fin & (b >= th.ob);
    c8 += (b > INF_BITS);
    c9 += (b == INF_BITS);
    const float fv = fin ? f : lo;  // keeps lo unchanged for non-finite elements
    const float gv = fin ? f : hi;
    lo = fv < lo ? fv : lo;
    hi = gv > hi ? gv : hi;
    const uint32_t bm = fnz ? b : 0xFFFFFFFFu;
    amin = bm < amin ? bm : amin;
  }
  if (hist) {
    for (int64_t i = begin; i < end; ++i) {
      const float f = widen(data[i]);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint32_t b = bits & 0x7FFFFFFFu;
      if (b == 0 || b >= INF_BITS) continue;
      const uint32_t e = b >> 23;
      // normal: floor(log2|x|) = e - 127; float32 subnormal: -149 + floor(log2(mantissa))
      const int ex = e ? static_cast<int>(e) - 127 : -149 + (31 - __builtin_clz(b));
      a.hist[ex - EXP_MIN] += 1;
    }
  }
  a.c[0] += c0; a.c[1] += c1; a.c[2] += c2; a.c[3] += c3; a.c[4] += c4;
  a.c[5] += c5; a.c[6] += c6; a.c[7] += c7; a.c[8] += c8; a.c[9] += c9;
  a.hi = hi > a.hi ? hi : a.hi;
  a.lo = lo < a.lo ? lo : a.lo;
  a.amin = amin < a.amin ? amin : a.amin;
}

template <typename T>
Acc reduce(const at::Tensor& x, const Thresholds& th, bool hist) {
  const T* data = x.data_ptr<T>();
  const int64_t n = x.numel();
  const int64_t grain = 1 << 16;
  const int64_t nchunks = (n + grain - 1) / grain;
  std::vector<Acc> parts(nchunks);
  for (auto& p : parts) {
    std::memset(&p, 0, sizeof(Acc));
    p.hi = -std::numeric_limits<float>::infinity();
    p.lo = std::numeric_limits<float>::infinity();
    p.amin = 0xFFFFFFFFu;
  }
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t k = cb; k < ce; ++k) {
      scan<T>(data, k * grain, std::min(n, (k + 1) * grain), th, hist, parts[k]);
    }
  });
  Acc out = parts[0];
  for (int64_t k = 1; k < nchunks; ++k) {
    const Acc& p = parts[k];
    for (int j = 0; j < NCOUNT; ++j) out.c[j] += p.c[j];
    out.hi = p.hi > out.hi ? p.hi : out.hi;
    out.lo = p.lo < out.lo ? p.lo : out.lo;
    out.amin = p.amin < out.amin ? p.amin : out.amin;
    if (hist) for (int j = 0; j < NHIST; ++j) out.hist[j] += p.hist[j];
  }
  return out;
}

}  // namespace

// tensors: CPU float32 / float16 / bfloat16 tensors (any shape). tiny_bits[i]: bit pattern of
// tensor i's own smallest normal. cast: the six fp16/bf16 threshold bit patterns.
// Returns (counts int64 [n, 10 + (hist ? 279 : 0)], extrema float64 [n, 3] = max, min, absmin_nonzero);
// max/min are -inf/+inf and absmin is +inf when a tensor has no finite (non-zero) element.
std::vector<at::Tensor> fused_stats(std::vector<at::Tensor> tensors, std::vector<int64_t> tiny_bits,
                                    std::vector<int64_t> cast, bool hist) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t width = NCOUNT + (hist ? NHIST : 0);
  auto counts = at::zeros({n, width}, at::kLong);
  auto ext = at::empty({n, 3}, at::kDouble);
  auto* cp = counts.data_ptr<int64_t>();
  auto* ep = ext.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor x = tensors[i].contiguous();
    Thresholds th{static_cast<uint32_t>(tiny_bits[i]),
                  static_cast<uint32_t>(cast[0]), static_cast<uint32_t>(cast[1]), static_cast<uint32_t>(cast[2]),
                  static_cast<uint32_t>(cast[3]), static_cast<uint32_t>(cast[4]), static_cast<uint32_t>(cast[5])};
    Acc a;
    switch (x.scalar_type()) {
      case at::kFloat: a = reduce<float>(x, th, hist); break;
      case at::kHalf: a = reduce<c10::Half>(x, th, hist); break;
      case at::kBFloat16: a = reduce<c10::BFloat16>(x, th, hist); break;
      default: TORCH_CHECK(false, "mpscope fused_stats: unsupported dtype ", x.scalar_type());
    }
    for (int j = 0; j < NCOUNT; ++j) cp[i * width + j] = a.c[j];
    if (hist) for (int j = 0; j < NHIST; ++j) cp[i * width + NCOUNT + j] = a.hist[j];
    ep[i * 3 + 0] = a.hi;
    ep[i * 3 + 1] = a.lo;
    float am;
    std::memcpy(&am, &a.amin, 4);
    ep[i * 3 + 2] = a.amin == 0xFFFFFFFFu ? std::numeric_limits<double>::infinity() : static_cast<double>(am);
  }
  return {counts, ext};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &fused_stats, "mpscope fused stats (CPU)");
}
