// kvpage CPU kernels: the seal of the quantize-on-seal formats (int4, int3, int2) -- kvpage.formats.kivi's
// quantize_searched, pack and the pool write in one call, byte-identical to the Python format.
//
// Bit-exactness rests on doing every float32 operation the Python format does, in its order and rounding:
// true divisions (torch divides by a Python scalar too), round-half-even (nearbyint), no fused multiply-add
// (contraction is turned off for this file: GCC otherwise fuses (u + m) * s - x). The one reduction whose
// order could differ, a group's summed squared error, is accumulated in float64 on both sides and rounded to
// float32 before candidates are compared: summation order only matters below float64's rounding.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/Parallel.h>

#include <vector>

#include "kv_common.h"

using namespace kvpage_cpu;

namespace {

constexpr float kScaleMin = 1.0f / 65536.0f;       // SCALE_MIN = 2^-16
constexpr float kScaleMax = 1.875f * 32768.0f;     // SCALE_MAX = 61440
constexpr float kInfeasible = 1e30f;               // _INFEASIBLE
constexpr int kMaxCandidates = 64;

// kivi.encode_scale: float32 step -> UE5M3 byte, rounded up, clamped to [2^-16, 61440] (NaN -> 61440).
inline int32_t encode_scale(float s) {
  if (std::isnan(s)) s = kScaleMax;
  s = s < kScaleMin ? kScaleMin : (s > kScaleMax ? kScaleMax : s);
  int exp = 0;
  const float mant = std::frexp(s, &exp);
  const float m = std::ceil((mant * 2.0f - 1.0f) * 8.0f);
  const int32_t carry = m == 8.0f ? 1 : 0;
  const int32_t e = exp - 1 + 16 + carry;
  const int32_t mi = carry ? 0 : static_cast<int32_t>(m);
  return (e << 3) | mi;
}

inline float clampf(float v, float lo, float hi) {  // torch.clamp: NaN stays NaN
  return v < lo ? lo : (v > hi ? hi : v);
}

// A group's search: its candidates (step, offset) and the inputs of the error and feasibility tests.
struct Search {
  int bits;
  float qmax;
  bool limited;       // max_error given
  float max_error;
  int lo, hi;         // candidate UE5M3 codes relative to the min/max step's: lo .. hi - 1
  int count() const { return 2 * (hi - lo) + 1; }
};

// The candidates of a group with minimum mn and maximum mx, in quantize_searched's order: (k, centred),
// (k, floor) for each k, then the covering step with the floor offset. Returns the min/max step (span).
inline float candidates(const Search& s, float mn, float mx, float* step, float* off) {
  const float span = (mx - mn) / s.qmax;
  const int32_t e0 = encode_scale(span);
  const float big = std::fabs(mn) > std::fabs(mx) || std::isnan(mn) ? std::fabs(mn) : std::fabs(mx);
  const float cover_a = 2.0f * (mx - mn) / s.qmax, cover_b = big / (127.0f - s.qmax);
  // torch.maximum propagates NaN
  const float cover = std::isnan(cover_a) || std::isnan(cover_b) ? std::numeric_limits<float>::quiet_NaN()
                                                                  : (cover_a > cover_b ? cover_a : cover_b);
  int c = 0;
  for (int k = s.lo; k < s.hi; ++k) {
    int32_t e = e0 + k;
    e = e < 0 ? 0 : (e > 255 ? 255 : e);
    const float st = ue5m3().v[e];
    step[c] = st;
    off[c++] = clampf(std::nearbyint((mn + mx) / (2.0f * st) - s.qmax / 2.0f), -128.0f, 127.0f);
    step[c] = st;
    off[c++] = clampf(std::floor(mn / st), -128.0f, 127.0f);
  }
  const float st = ue5m3().v[encode_scale(cover)];
  step[c] = st;
  off[c] = clampf(std::floor(mn / st), -128.0f, 127.0f);
  return span;
}

// Error of one value at step st and offset m: (code, dequantized - x).
inline float code_of(float x, float st, float m, float qmax) {
  return clampf(std::nearbyint(x / st - m), 0.0f, qmax);
}

// torch.argmin over candidate errors: the first NaN if any, else the first least.
inline int pick(const float* err, int n) {
  int best = 0;
  for (int c = 0; c < n; ++c) {
    if (std::isnan(err[c])) return c;
    if (err[c] < err[best]) best = c;
  }
  return best;
}

// Infeasible candidates (some value moved by more than max_error min/max steps) rank after all others.
inline float ranked(const Search& s, double sum, float worst, float span) {
  const float err = static_cast<float>(sum);
  if (!s.limited || std::isnan(err)) return err;  // a NaN error (a NaN value in the group) stays NaN
  const float limit = s.max_error * span;
  if (worst <= limit) return err;
  const float l = limit < kScaleMin ? kScaleMin : limit;  // limit.clamp(min=SCALE_MIN)
  return kInfeasible * (1.0f + worst / l);
}

inline uint8_t code_byte(float u) { return std::isnan(u) ? 0 : static_cast<uint8_t>(u); }
inline int8_t offset_byte(float m) { return std::isnan(m) ? 0 : static_cast<int8_t>(m); }

// Keys: one group per channel over the block's bs tokens. x [bs, D] (one head), codes [bs, D] unpacked.
// The candidates' arrays are [C, D] (candidate-major), so the token loop runs over contiguous channels.
void seal_keys(const Search& s, const float* x, int64_t bs, int64_t D, uint8_t* codes, uint8_t* scale,
               int8_t* zero, std::vector<float>& step, std::vector<float>& off, std::vector<double>& err,
               std::vector<float>& rank, std::vector<float>& worst, std::vector<float>& span) {
  const int C = s.count();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float cs[kMaxCandidates], co[kMaxCandidates];
  for (int64_t d = 0; d < D; ++d) {
    float mn = x[d], mx = x[d];
    for (int64_t t = 1; t < bs; ++t) {
      const float v = x[t * D + d];
      mn = (v < mn || std::isnan(v) || std::isnan(mn)) ? (std::isnan(mn) ? nan : v) : mn;
      mx = (v > mx || std::isnan(v) || std::isnan(mx)) ? (std::isnan(mx) ? nan : v) : mx;
    }
    span[d] = candidates(s, mn, mx, cs, co);
    for (int c = 0; c < C; ++c) {
      step[c * D + d] = cs[c];
      off[c * D + d] = co[c];
    }
  }
  std::fill(err.begin(), err.begin() + D * C, 0.0);
  std::fill(worst.begin(), worst.begin() + D * C, 0.0f);
  for (int c = 0; c < C; ++c) {
    const float* sc = &step[c * D];
    const float* oc = &off[c * D];
    double* ec = &err[c * D];
    float* wc = &worst[c * D];
    for (int64_t t = 0; t < bs; ++t) {
      const float* row = x + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const float st = sc[d], m = oc[d];
        const float u = code_of(row[d], st, m, s.qmax);
        const float xh = (u + m) * st;
        const float diff = xh - row[d];
        const double dd = static_cast<double>(diff);
        ec[d] += dd * dd;
        const float a = std::fabs(diff);
        wc[d] = (a > wc[d] || std::isnan(a)) ? a : wc[d];
      }
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    float* r = &rank[d * C];
    for (int c = 0; c < C; ++c) r[c] = ranked(s, err[c * D + d], worst[c * D + d], span[d]);
    const int b = pick(r, C);
    const float st = step[b * D + d], m = off[b * D + d];
    for (int64_t t = 0; t < bs; ++t) codes[t * D + d] = code_byte(code_of(x[t * D + d], st, m, s.qmax));
    scale[d] = static_cast<uint8_t>(encode_scale(st));
    zero[d] = offset_byte(m);
  }
}

// Values: one group per g channels of one token. x [n] (one group), codes [n] unpacked.
void seal_group(const Search& s, const float* x, int64_t n, uint8_t* codes, uint8_t* scale, int8_t* zero) {
  float step[kMaxCandidates], off[kMaxCandidates], err[kMaxCandidates];
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float mn = x[0], mx = x[0];
  for (int64_t i = 1; i < n; ++i) {
    const float v = x[i];
    mn = (v < mn || std::isnan(v) || std::isnan(mn)) ? (std::isnan(mn) ? nan : v) : mn;
    mx = (v > mx || std::isnan(v) || std::isnan(mx)) ? (std::isnan(mx) ? nan : v) : mx;
  }
  const float span = candidates(s, mn, mx, step, off);
  const int C = s.count();
  for (int c = 0; c < C; ++c) {
    const float st = step[c], m = off[c];
    double e = 0.0;
    float w = 0.0f;
#pragma omp simd reduction(+ : e) reduction(max : w)
    for (int64_t i = 0; i < n; ++i) {
      const float u = code_of(x[i], st, m, s.qmax);
      const float diff = (u + m) * st - x[i];
      const double dd = static_cast<double>(diff);
      e += dd * dd;
      const float a = std::fabs(diff);
      w = a > w ? a : w;
    }
    err[c] = ranked(s, e, w, span);
  }
  const int b = pick(err, C);
  for (int64_t i = 0; i < n; ++i) codes[i] = code_byte(code_of(x[i], step[b], off[b], s.qmax));
  *scale = static_cast<uint8_t>(encode_scale(step[b]));
  *zero = offset_byte(off[b]);
}

// [n] codes of `bits` bits -> ceil(n * bits / 8) bytes: one little-endian bit stream, code j at bit bits * j
// (kivi.pack). 2 and 4 bits: value i of byte p at bit bits * i (no code straddles a byte); 3 bits: eight codes per
// three bytes, code 8p + i at bit 3i of the 24-bit little-endian word of bytes 3p .. 3p+2, the last word cut to
// the row's P bytes. (One loop over the bit stream for every width measured 5-10% slower seals of int4/int2.)
inline void pack_row(const uint8_t* codes, int64_t n, int bits, uint8_t* out, int64_t P) {
  if (bits == 3) {
    for (int64_t p = 0; 8 * p < n; ++p) {
      uint32_t w = 0;
      for (int i = 0; i < 8; ++i) {
        const int64_t j = 8 * p + i;
        if (j < n) w |= static_cast<uint32_t>(codes[j]) << (3 * i);
      }
      for (int k = 0; k < 3 && 3 * p + k < P; ++k) out[3 * p + k] = static_cast<uint8_t>(w >> (8 * k));
    }
    return;
  }
  const int per = 8 / bits;
  for (int64_t p = 0; p < P; ++p) {
    uint8_t byte = 0;
    for (int i = 0; i < per; ++i) {
      const int64_t j = p * per + i;
      if (j < n) byte |= static_cast<uint8_t>(codes[j] << (bits * i));
    }
    out[p] = byte;
  }
}

}  // namespace

// Seal whole blocks of keys or values into pool blocks `ids` (in place), as SealedFormat.seal followed by
// index_copy_ into the pool. blocks [m, bs, Hkv, D] float32/bfloat16/float16 (contiguous); codes
// [NB, bs, Hkv, P] uint8; keys: scale/zero [NB, Hkv, D] uint8/int8; values: [NB, bs, Hkv, G] with groups of
// `group` channels. max_error < 0: unlimited. Candidate steps: UE5M3 codes step_lo .. step_hi - 1 around the
// min/max step's.
void seal_blocks(at::Tensor codes, at::Tensor scale, at::Tensor zero, at::Tensor blocks, at::Tensor ids, bool key,
                 int64_t bits, int64_t group, double max_error, int64_t step_lo, int64_t step_hi) {
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4, "bits must be 2, 3 or 4");
  TORCH_CHECK(blocks.is_contiguous() && blocks.dim() == 4, "blocks must be contiguous [m, bs, Hkv, D]");
  TORCH_CHECK(step_hi > step_lo && 2 * (step_hi - step_lo) + 1 <= kMaxCandidates, "step search range too wide");
  const int64_t xenc = float_encoding(blocks.scalar_type());
  const int64_t m = blocks.size(0), bs = blocks.size(1), Hkv = blocks.size(2), D = blocks.size(3);
  const int64_t P = (D * bits + 7) / 8;
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(1) == bs &&
                  codes.size(2) == Hkv && codes.size(3) == P,
              "codes must be contiguous uint8 [NB, bs, Hkv, P]");
  const int64_t NB = codes.size(0);
  TORCH_CHECK(scale.is_contiguous() && zero.is_contiguous() && scale.scalar_type() == at::kByte &&
                  zero.scalar_type() == at::kChar,
              "scale must be contiguous uint8 and zero int8");
  const int64_t G = key ? D : D / group;
  TORCH_CHECK(key || (group > 0 && D % group == 0), "group must divide head_dim");
  TORCH_CHECK(scale.numel() == NB * (key ? Hkv * D : bs * Hkv * G) && zero.numel() == scale.numel(),
              "scale/zero do not match the pool");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.numel() == m, "ids must be int64 [m]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < NB, "block id ", id[i], " out of range");
  Search s{static_cast<int>(bits), static_cast<float>((1 << bits) - 1), max_error >= 0,
           static_cast<float>(max_error), static_cast<int>(step_lo), static_cast<int>(step_hi)};
  const int C = s.count();
  const uint8_t* xs = static_cast<const uint8_t*>(blocks.data_ptr());
  const int64_t xsize = blocks.element_size();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  int8_t* zp = zero.data_ptr<int8_t>();
  at::parallel_for(0, m * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(bs * D), stepv(D * C), offv(D * C), rank(D * C), worst(D * C), span(D);
    std::vector<double> err(D * C);
    std::vector<uint8_t> u(bs * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv, blk = id[b];
      for (int64_t t = 0; t < bs; ++t)
        rows_to_float(xenc, xs + ((b * bs + t) * Hkv + h) * D * xsize, x.data() + t * D, D);
      if (key) {
        const int64_t meta = (blk * Hkv + h) * D;
        seal_keys(s, x.data(), bs, D, u.data(), sp + meta, zp + meta, stepv, offv, err, rank, worst, span);
      } else {
        for (int64_t t = 0; t < bs; ++t) {
          const int64_t meta = ((blk * bs + t) * Hkv + h) * G;
          for (int64_t j = 0; j < G; ++j)
            seal_group(s, x.data() + t * D + j * group, group, u.data() + t * D + j * group, sp + meta + j,
                       zp + meta + j);
        }
      }
      for (int64_t t = 0; t < bs; ++t) pack_row(u.data() + t * D, D, s.bits, cp + ((blk * bs + t) * Hkv + h) * P, P);
    }
  });
}
