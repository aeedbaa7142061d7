// kvpage CPU kernels: the seal of the quantize-on-seal formats (int4, int3, int2) -- kvpage.formats.kivi's
// quantize_searched, pack and the pool write in one call, byte-identical to the Python format.
//
// Bit-exactness rests on doing every float32 operation the Python format does, in its order and rounding:
// true divisions (torch divides by a Python scalar too), round-half-even (nearbyint), no fused multiply-add
// (contraction is turned off for this file: GCC otherwise fuses (u + m) * s - x; the one explicit fused
// multiply-add, add_square's, rounds as its unfused form does). The one reduction whose order could differ, a
// group's summed squared error, is accumulated in float64 on both sides and rounded to float32 before candidates
// are compared: summation order only matters below float64's rounding.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "kv_common.h"

// 512-bit vectors where the CPU has them (GCC's tuning for Intel's AVX-512 parts prefers 256): a strip's 16 groups
// are one float32 vector and their error sums two float64 ones. Measured 1.2x on the seal (Xeon, AVX-512). Set
// after the includes, so torch's headers compile as they do everywhere else.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

using namespace kvpage_cpu;

namespace {

constexpr float kScaleMin = 1.0f / 65536.0f;       // SCALE_MIN = 2^-16
constexpr float kScaleMax = 1.875f * 32768.0f;     // SCALE_MAX = 61440
constexpr float kInfeasible = 1e30f;               // _INFEASIBLE
constexpr int kMaxCandidates = 64;

// Columns sealed side by side: one group per lane of a strip of kLanes columns, so every step below is one vector
// operation across kLanes groups (keys: a block's channels; values: its tokens' channel groups, transposed).
constexpr int kLanes = 16;

// kivi.encode_scale: float32 step -> UE5M3 byte, rounded up, clamped to [2^-16, 61440] (NaN -> 61440). Branch-free
// (it runs in vector lanes): a clamped step is a normal float, so its frexp exponent minus one is the IEEE exponent
// E and (mantissa * 2 - 1) * 8 is its 23 fraction bits / 2^20, whose ceiling is (bits + 2^20 - 1) >> 20.
inline int32_t encode_scale(float s) {
  s = std::isnan(s) ? kScaleMax : s;
  s = s < kScaleMin ? kScaleMin : (s > kScaleMax ? kScaleMax : s);
  const uint32_t b = bits_of(s);
  const int32_t E = static_cast<int32_t>((b >> 23) & 0xFF) - 127;
  const int32_t m = static_cast<int32_t>(((b & 0x7FFFFF) + 0xFFFFF) >> 20);
  const int32_t carry = m == 8 ? 1 : 0;
  return ((E + 16 + carry) << 3) | (carry ? 0 : m);
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

// A rounded code clamped to [0, qmax], a NaN to 0 (the format's clamp(0, qmax), then nan_to_num(0) on the codes it
// keeps), as two selects that vectorise to max / min (v > 0 ? v : 0 is x86's max(v, 0), a NaN giving 0; the
// NaN-keeping clampf compiled to six instructions). The format's clamp keeps a NaN code, but such a code's error is
// NaN anyway: y - m is NaN only for a NaN value or offset (y is a value over a finite step, the offset finite or
// NaN), either of which makes (u + m) * st - x NaN; and -0 and +0 code and err alike.
inline float clamp_code(float v, float qmax) {
  v = v > 0.0f ? v : 0.0f;
  return v < qmax ? v : qmax;
}

// acc + v * v for v a float32 widened to float64: the square is exact there (24-bit mantissas, far inside float64's
// exponent range; inf and NaN alike), so a fused multiply-add rounds once, as the separate multiply and add do --
// the same sum, one instruction fewer. (Not where the CPU lacks FMA: std::fma is then a slow library call.)
inline double add_square(double acc, double v) {
#if defined(__FMA__)
  return std::fma(v, v, acc);
#else
  return acc + v * v;
#endif
}

// Code of one value at step st and offset m.
inline float code_of(float x, float st, float m, float qmax) { return clamp_code(std::nearbyint(x / st - m), qmax); }

// Infeasible candidates (some value moved by more than max_error min/max steps) rank after all others.
inline float ranked(const Search& s, double sum, float worst, float span) {
  const float err = static_cast<float>(sum);
  const float limit = s.max_error * span;
  const float l = limit < kScaleMin ? kScaleMin : limit;  // limit.clamp(min=SCALE_MIN)
  const bool keep = !s.limited || std::isnan(err) || worst <= limit;  // a NaN error (a NaN value) stays NaN
  return keep ? err : kInfeasible * (1.0f + worst / l);
}

inline int8_t offset_byte(float m) { return std::isnan(m) ? 0 : static_cast<int8_t>(m); }

// The summed squared errors (float64, in row order) of K candidates sharing the step st[l], with offsets off[o][l]
// (o < K), over kLanes groups at once (group l: column l of X, [n, ld] float32) into err[o][l], and with kLimited
// their largest errors into worst[o][l] (without, 0: ranked() reads them only with max_error). One pass over
// the rows: each value is divided by its step once, y = x / st (the format's true division), and coded at each
// offset as nearbyint(y - m): y - m rounds to float32 first, as torch's round(x / s - m) does, so it is not
// nearbyint(y) - m at the .5 boundaries. A NaN error is left out of the largest error here (a > w is false), but
// makes the summed error NaN, which ranked() keeps whatever the largest error; without NaN it is the exact maximum.
template <int K, bool kLimited>
void candidate_errors(const float* X, int64_t n, int64_t ld, float qmax, const float* st, const float (*off)[kLanes],
                      double (*err)[kLanes], float (*worst)[kLanes]) {
  alignas(64) double e[K][kLanes] = {};
  alignas(64) float w[K][kLanes] = {};
  for (int64_t t = 0; t < n; ++t) {
    const float* row = X + t * ld;
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float x = row[l], sl = st[l], y = x / sl;
      for (int o = 0; o < K; ++o) {
        const float m = off[o][l];
        const float u = clamp_code(std::nearbyint(y - m), qmax);
        const float diff = (u + m) * sl - x;
        const double dd = static_cast<double>(diff);
        e[o][l] = add_square(e[o][l], dd);
        if (kLimited) {
          const float a = std::fabs(diff);
          w[o][l] = a > w[o][l] ? a : w[o][l];
        }
      }
    }
  }
  for (int o = 0; o < K; ++o) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      err[o][l] = e[o][l];
      worst[o][l] = w[o][l];
    }
  }
}

// quantize_searched over kLanes groups at once: group l is column l of X ([n, ld] float32, rows ld apart). Writes
// the codes to U ([n, ld], the same places), each group's UE5M3 step to scale[l] and offset to zero[l].
// Candidates in quantize_searched's order: (k, centred), (k, floor) for each k, then the covering step with the
// floor offset; the least ranked error wins, the first NaN before all (torch.argmin), ties to the earlier.
void seal_strip(const Search& s, const float* X, int64_t n, int64_t ld, uint8_t* U, uint8_t* scale, int8_t* zero) {
  const int C = s.count();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float* tab = ue5m3().v;
  alignas(64) float mn[kLanes], mx[kLanes], span[kLanes], best_r[kLanes], st_b[kLanes], m_b[kLanes];
  alignas(64) int32_t has_nan[kLanes], best_c[kLanes], found[kLanes], e0[kLanes];
  alignas(64) float step[kMaxCandidates][kLanes], off[kMaxCandidates][kLanes], rank[kMaxCandidates][kLanes];
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = mx[l] = X[l];
    has_nan[l] = std::isnan(X[l]) ? 1 : 0;
  }
  for (int64_t t = 1; t < n; ++t) {  // the first least / greatest in row order; any NaN makes both NaN
    const float* row = X + t * ld;
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float v = row[l];
      has_nan[l] |= std::isnan(v) ? 1 : 0;
      mn[l] = v < mn[l] ? v : mn[l];
      mx[l] = v > mx[l] ? v : mx[l];
    }
  }
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    const float lo = has_nan[l] ? nan : mn[l], hi = has_nan[l] ? nan : mx[l];
    mn[l] = lo;
    mx[l] = hi;
    span[l] = (hi - lo) / s.qmax;
    e0[l] = encode_scale(span[l]);
  }
  int c = 0;
  for (int k = s.lo; k < s.hi; ++k, c += 2) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      int32_t e = e0[l] + k;
      e = e < 0 ? 0 : (e > 255 ? 255 : e);
      const float st = tab[e];
      step[c][l] = step[c + 1][l] = st;
      off[c][l] = clampf(std::nearbyint((mn[l] + mx[l]) / (2.0f * st) - s.qmax / 2.0f), -128.0f, 127.0f);
      off[c + 1][l] = clampf(std::floor(mn[l] / st), -128.0f, 127.0f);
    }
  }
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {  // the covering step: 2 min/max steps, or far enough from zero for the offset
    const float a = std::fabs(mn[l]), b = std::fabs(mx[l]);
    const float big = a > b || std::isnan(mn[l]) ? a : b;
    const float cover_a = 2.0f * (mx[l] - mn[l]) / s.qmax, cover_b = big / (127.0f - s.qmax);
    const float cover = std::isnan(cover_a) || std::isnan(cover_b) ? nan : (cover_a > cover_b ? cover_a : cover_b);
    const float st = tab[encode_scale(cover)];
    step[c][l] = st;
    off[c][l] = clampf(std::floor(mn[l] / st), -128.0f, 127.0f);
  }
  // each candidate's summed squared error (float64) and, with max_error, largest error: the pairs sharing a step
  // in one pass, then the covering candidate
  alignas(64) double err[2][kLanes];
  alignas(64) float worst[2][kLanes];
  for (c = 0; c < C; c += 2) {
    const int k = c + 1 < C ? 2 : 1;
    if (k == 2 && s.limited) candidate_errors<2, true>(X, n, ld, s.qmax, step[c], off + c, err, worst);
    else if (k == 2) candidate_errors<2, false>(X, n, ld, s.qmax, step[c], off + c, err, worst);
    else if (s.limited) candidate_errors<1, true>(X, n, ld, s.qmax, step[c], off + c, err, worst);
    else candidate_errors<1, false>(X, n, ld, s.qmax, step[c], off + c, err, worst);
    for (int o = 0; o < k; ++o) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) rank[c + o][l] = ranked(s, err[o][l], worst[o][l], span[l]);
    }
  }
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    best_c[l] = 0;
    best_r[l] = rank[0][l];
    found[l] = std::isnan(rank[0][l]) ? 1 : 0;
  }
  for (c = 1; c < C; ++c) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float r = rank[c][l];
      const bool take = !found[l] && (std::isnan(r) || r < best_r[l]);
      best_c[l] = take ? c : best_c[l];
      best_r[l] = take ? r : best_r[l];
      found[l] |= std::isnan(r) ? 1 : 0;
    }
  }
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    st_b[l] = step[0][l];
    m_b[l] = off[0][l];
  }
  for (c = 1; c < C; ++c) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      st_b[l] = best_c[l] == c ? step[c][l] : st_b[l];
      m_b[l] = best_c[l] == c ? off[c][l] : m_b[l];
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* row = X + t * ld;
    uint8_t* u = U + t * ld;
    alignas(64) int32_t ci[kLanes];  // via int32 so the lanes convert, then narrow, as vectors
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      ci[l] = static_cast<int32_t>(code_of(row[l], st_b[l], m_b[l], s.qmax));  // NaN already 0
    }
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) u[l] = static_cast<uint8_t>(ci[l]);
  }
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    scale[l] = static_cast<uint8_t>(encode_scale(st_b[l]));
    zero[l] = offset_byte(m_b[l]);
  }
}

// Every group of X ([n, ld] float32, ld a multiple of kLanes: columns past the groups are padding) sealed, strip
// by strip: codes to U ([n, ld]), steps and offsets to scale / zero ([ld]).
void seal_columns(const Search& s, const float* X, int64_t n, int64_t ld, uint8_t* U, uint8_t* scale, int8_t* zero) {
  for (int64_t c0 = 0; c0 < ld; c0 += kLanes) seal_strip(s, X + c0, n, ld, U + c0, scale + c0, zero + c0);
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
  if (bits == 4) {  // two codes a byte: the whole pairs as one vectorised loop, then an odd last code
    const int64_t pairs = n / 2;
#pragma omp simd
    for (int64_t p = 0; p < pairs; ++p) out[p] = static_cast<uint8_t>(codes[2 * p] | (codes[2 * p + 1] << 4));
    if (n % 2) out[pairs] = codes[n - 1];
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
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == m,
              "ids must be contiguous int64 [m]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < NB, "block id ", id[i], " out of range");
  Search s{static_cast<int>(bits), static_cast<float>((1 << bits) - 1), max_error >= 0,
           static_cast<float>(max_error), static_cast<int>(step_lo), static_cast<int>(step_hi)};
  const uint8_t* xs = static_cast<const uint8_t*>(blocks.data_ptr());
  const int64_t xsize = blocks.element_size();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  int8_t* zp = zero.data_ptr<int8_t>();
  // Keys: a head's block [bs, D] as it is, one group per channel (column). Values: a head's block viewed as
  // [W, group] (row c = t * G + j: channel group j of token t) transposed to [group, W], one group per column.
  // Columns padded with zeros to a multiple of kLanes.
  const int64_t n = key ? bs : group, W = key ? D : bs * G, ld = (W + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, m * Hkv, 1, [&](int64_t begin, int64_t end) {
    // the work's sizes and buffers as locals: the byte stores below may alias anything a reference or a vector
    // reaches, which made the compiler reload those in every iteration of the transposes
    const int64_t nr = n, lw = ld, w_cols = W, grp = group, nbs = bs, d = D, hkv = Hkv, p = P;
    std::vector<float> xv(key ? 0 : bs * D), Xv(nr * lw, 0.0f);
    std::vector<uint8_t> Uv(nr * lw), uv(key ? 0 : bs * D), scv(lw);
    std::vector<int8_t> zcv(lw);
    float* const x = xv.data();
    float* const X = Xv.data();
    uint8_t* const U = Uv.data();
    uint8_t* const u = uv.data();
    uint8_t* const sc = scv.data();
    int8_t* const zc = zcv.data();
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / hkv, h = w % hkv, blk = id[b];
      const uint8_t* src = xs + (b * nbs * hkv + h) * d * xsize;  // token t's row: src + t * hkv * d * xsize
      uint8_t* dst = cp + (blk * nbs * hkv + h) * p;                 // token t's packed row: dst + t * hkv * p
      if (key) {  // converted straight into X's rows, packed straight from U's
        for (int64_t t = 0; t < nbs; ++t) rows_to_float(xenc, src + t * hkv * d * xsize, X + t * lw, d);
        seal_columns(s, X, nr, lw, U, sc, zc);
        const int64_t meta = (blk * hkv + h) * d;
        std::memcpy(sp + meta, sc, d);
        std::memcpy(zp + meta, zc, d);
        for (int64_t t = 0; t < nbs; ++t) pack_row(U + t * lw, d, s.bits, dst + t * hkv * p, p);
        continue;
      }
      for (int64_t t = 0; t < nbs; ++t) rows_to_float(xenc, src + t * hkv * d * xsize, x + t * d, d);
      for (int64_t c = 0; c < w_cols; ++c)
        for (int64_t i = 0; i < grp; ++i) X[i * lw + c] = x[c * grp + i];
      seal_columns(s, X, nr, lw, U, sc, zc);
      for (int64_t i = 0; i < grp; ++i)
        for (int64_t c = 0; c < w_cols; ++c) u[c * grp + i] = U[i * lw + c];
      const int64_t g = w_cols / nbs;  // groups per token: G
      for (int64_t t = 0; t < nbs; ++t) {
        const int64_t meta = ((blk * nbs + t) * hkv + h) * g;
        std::memcpy(sp + meta, sc + t * g, g);
        std::memcpy(zp + meta, zc + t * g, g);
        pack_row(u + t * d, d, s.bits, dst + t * hkv * p, p);
      }
    }
  });
}

// The inverse of seal_blocks, as SealedFormat.unseal: pool blocks `ids` ([m] int64) dequantized into out
// ([m, bs, Hkv, D] float32/bfloat16/float16, contiguous): x = (code + zero) * step in float32, then rounded to
// out's dtype (round-half-even, as torch's .to). Arguments as seal_blocks'.
void unseal_blocks(at::Tensor out, at::Tensor codes, at::Tensor scale, at::Tensor zero, at::Tensor ids, bool key,
                   int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4, "bits must be 2, 3 or 4");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 4, "out must be contiguous [m, bs, Hkv, D]");
  const int64_t oenc = float_encoding(out.scalar_type());
  const int64_t m = out.size(0), bs = out.size(1), Hkv = out.size(2), D = out.size(3);
  const int64_t P = (D * bits + 7) / 8;
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(1) == bs &&
                  codes.size(2) == Hkv && codes.size(3) >= P,
              "codes must be contiguous uint8 [NB, bs, Hkv, P]");
  const int64_t NB = codes.size(0), Pc = codes.size(3);
  const int64_t G = key ? D : D / group;
  TORCH_CHECK(key || (group > 0 && D % group == 0), "group must divide head_dim");
  TORCH_CHECK(scale.is_contiguous() && zero.is_contiguous() && scale.scalar_type() == at::kByte &&
                  zero.scalar_type() == at::kChar && scale.numel() == NB * (key ? Hkv * D : bs * Hkv * G) &&
                  zero.numel() == scale.numel(),
              "scale/zero do not match the pool");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == m,
              "ids must be contiguous int64 [m]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < NB, "block id ", id[i], " out of range");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  const int8_t* zp = zero.data_ptr<int8_t>();
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
  const int64_t osize = out.element_size();
  const float* tab = ue5m3().v;
  at::parallel_for(0, m * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D), st(D), off(D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv, blk = id[b];
      if (key) {  // one step and offset per channel, for the whole block
        const int64_t meta = (blk * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          st[d] = tab[sp[meta + d]];
          off[d] = static_cast<float>(zp[meta + d]);
        }
      }
      for (int64_t t = 0; t < bs; ++t) {
        const uint8_t* c = cp + ((blk * bs + t) * Hkv + h) * Pc;
        if (bits == 4) unpack_codes<4>(c, D, row.data());
        else if (bits == 3) unpack_codes<3>(c, D, row.data());
        else unpack_codes<2>(c, D, row.data());
        if (key) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) row[d] = (row[d] + off[d]) * st[d];
        } else {  // one step and offset per group of this token's channels
          const int64_t meta = ((blk * bs + t) * Hkv + h) * G;
          for (int64_t j = 0; j < G; ++j) {
            const float sj = tab[sp[meta + j]], oj = static_cast<float>(zp[meta + j]);
            float* r = row.data() + j * group;
#pragma omp simd
            for (int64_t i = 0; i < group; ++i) r[i] = (r[i] + oj) * sj;
          }
        }
        float_to_rows(oenc, row.data(), op + ((b * bs + t) * Hkv + h) * D * osize, D);
      }
    }
  });
}
