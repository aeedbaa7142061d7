// kvpage CPU kernels: what the attention and write kernels share -- element encodings, their decoding to
// float32, the softmax's exp. Header-only (inline), included by paged_attention.cpp and write_rows.cpp.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvpage_cpu {


// Storage encodings of one element (token-wise formats and tail rows).
enum Enc : int64_t { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, E4M3 = 4 };

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float exp_neg(float x0) {
  // e^x for x <= 0 (a score minus the running max; SiLU's e^-|x|), Cephes expf's polynomial (relative error
  // ~2e-7); 0 below -87, where float32's exp underflows too (torch's SiLU gives exactly that). Vectorizes.
  const float x = x0 < -87.0f ? -87.0f : x0;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x0 < -87.0f ? 0.0f : p * scale;
}

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float e4m3_to_float(uint8_t c) {
  // float8_e4m3fn: bias 7, no inf; 0x7f / 0xff are NaN. Exact, in integer ops that vectorize (a float16
  // route and a lookup table both measured slower here).
  // magnitude = m * 2^-9 (subnormal) or (8 + m) * 2^(e - 1) * 2^-9
  const int32_t e = (c >> 3) & 15, m = c & 7;
  const int32_t mag = e ? ((8 + m) << (e - 1)) : m;
  float v = static_cast<float>(mag) * (1.0f / 512.0f);
  v = (c & 0x80) ? -v : v;
  return ((c & 0x7f) == 0x7f) ? std::numeric_limits<float>::quiet_NaN() : v;
}

struct Ue5m3Table {
  float v[256];
  Ue5m3Table() {
    for (int c = 0; c < 256; ++c) v[c] = std::ldexp(1.0f + (c & 7) / 8.0f, (c >> 3) - 16);
  }
};
inline const Ue5m3Table& ue5m3() {
  static const Ue5m3Table t;
  return t;
}

// One row of D elements of encoding E at p, times `scale` -> out (float32). DC > 0 fixes D at compile time.
template <int E, int DC = 0, bool SCALED = true>
inline void decode_row(const uint8_t* p, float scale, float* out, int64_t Drt) {
  if constexpr (!SCALED) scale = 1.0f;  // constant-folded: the multiply below disappears
  const int64_t D = DC ? DC : Drt;
  if constexpr (E == F32) {
    const float* s = reinterpret_cast<const float*>(p);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = s[d] * scale;
  } else if constexpr (E == BF16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = bf16_bits_to_float(s[d]) * scale;
  } else if constexpr (E == F16) {
    const c10::Half* s = reinterpret_cast<const c10::Half*>(p);
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(s[d]) * scale;
  } else if constexpr (E == I8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(p);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(s[d]) * scale;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = e4m3_to_float(p[d]) * scale;
  }
}

inline int64_t elem_size(int64_t enc) { return enc == F32 ? 4 : (enc == BF16 || enc == F16) ? 2 : 1; }

// float rows of encoding enc (F32 / BF16 / F16) <-> float32
inline void rows_to_float(int64_t enc, const void* src, float* dst, int64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  if (enc == F32) std::memcpy(dst, p, n * 4);
  else if (enc == BF16) decode_row<BF16>(p, 1.0f, dst, n);
  else decode_row<F16>(p, 1.0f, dst, n);
}
inline void float_to_rows(int64_t enc, const float* src, void* dst, int64_t n) {
  if (enc == F32) {
    std::memcpy(dst, src, n * 4);
  } else if (enc == BF16) {
    c10::BFloat16* o = static_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = c10::BFloat16(src[i]);
  } else {
    c10::Half* o = static_cast<c10::Half*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = c10::Half(src[i]);
  }
}
inline int64_t float_encoding(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "q and out must be float32, bfloat16 or float16");
  return t == at::kFloat ? F32 : (t == at::kBFloat16 ? BF16 : F16);
}

}  // namespace kvpage_cpu
