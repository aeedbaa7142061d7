// kvpage CPU kernels: what the kernel files share -- element encodings, their decoding to float32, the softmax's
// exp, the int16 coding of float rows and its dot product. Header-only (inline), included by every kernel file.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvpage_cpu {


// Asks the caches for the n bytes from p, one request per 64-byte line, without waiting for them, so that a
// stream read with much arithmetic per byte arrives ahead of its use (gguf_matmul's weights; the paged
// attention's next chunk). LOCALITY is __builtin_prefetch's (3: every level, 2: L2 and below). Prefetches never
// fault, so p may point past the end of a buffer.
// The empty volatile asm is there for GCC: prefetches count as free of side effects, so a function that holds
// nothing else (a source's prefetch_rows) was judged const and every call to it deleted (GCC 12, from -O1: no
// prefetch instruction left in paged_attention.o); a volatile asm is a side effect it keeps, and emits nothing.
template <int LOCALITY = 2>
inline void prefetch_lines(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(c + o, 0, LOCALITY);
  asm volatile("");
}

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
  // float8_e4m3fn: bias 7, no inf; 0x7f / 0xff are NaN. Exact, in integer ops. decode_row's vector loops
  // take the float16 route instead (bit placement + the hardware conversion, measured 1.4x faster per layer
  // step); this scalar form serves their remainders and CPUs without F16C.
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
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    // the hardware conversion (exact, as c10::Half's), times the scale rounded once: 16 or 8 lanes at a time
#if defined(__AVX512F__)
    const __m512 vs16 = _mm512_set1_ps(scale);
    for (; d + 16 <= D; d += 16)
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d))), vs16));
#endif
    const __m256 vs8 = _mm256_set1_ps(scale);
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d))), vs8));
#endif
    for (; d < D; ++d) out[d] = static_cast<float>(s[d]) * scale;
  } else if constexpr (E == I8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(p);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(s[d]) * scale;
  } else {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    // e4m3 -> float16 by bit placement: sign to bit 15, exponent and mantissa (7 bits) shifted left by 7 make the
    // float16 of the same value times 2^-8 (biases 7 and 15; e4m3 subnormals land on float16 subnormals), so
    // one hardware conversion and a multiply by 2^8 * scale (exact: a power of two) give e4m3_to_float(c) * scale
    // rounded once. The NaN codes (0x7f, 0xff) would read as 480: they are set to NaN.
    const float s256 = 256.0f * scale;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 vs16 = _mm512_set1_ps(s256), nan16 = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
    for (; d + 16 <= D; d += 16) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d)));
      const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
      const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                        _mm256_slli_epi16(mag, 7));
      const __mmask16 bad = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
      _mm512_storeu_ps(out + d, _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), vs16), bad, nan16));
    }
#endif
    const __m256 vs8 = _mm256_set1_ps(s256), nan8 = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
    for (; d + 8 <= D; d += 8) {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + d)));
      const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
      const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
      const __m256 bad = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
      _mm256_storeu_ps(out + d, _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), vs8), nan8, bad));
    }
#endif
    for (; d < D; ++d) out[d] = e4m3_to_float(p[d]) * scale;
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
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// float32 -> bfloat16 bits, round to nearest even as c10::BFloat16 (bits + 0x7fff + bit 16, shifted down; a NaN
// becomes the quiet NaN 0x7fc0, which the add could otherwise carry to inf). One vectorised loop.
inline void float_to_bf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_of(src[i]);
    const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>(std::isnan(src[i]) ? 0x7fc0u : r);
  }
}
inline void float_to_rows(int64_t enc, const float* src, void* dst, int64_t n) {
  if (enc == F32) {
    std::memcpy(dst, src, n * 4);
  } else if (enc == BF16) {
    float_to_bf16(src, static_cast<uint16_t*>(dst), n);
  } else {
    c10::Half* o = static_cast<c10::Half*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = c10::Half(src[i]);
  }
}
// kivi.unpack of one packed row of the quantize-on-seal formats, as float32: code c of BITS bits at bit BITS * c of
// the row's little-endian bit stream (int4 two a byte, int2 four, int3 eight per three bytes). DC > 0 fixes the
// row's D at compile time; no byte past the row's ceil(D * BITS / 8) is read.
template <int BITS, int DC = 0>
inline void unpack_codes(const uint8_t* row, int64_t Drt, float* codes) {
  const int64_t D = DC ? DC : Drt;
  if constexpr (BITS == 4) {
#pragma omp simd
    for (int64_t p = 0; p < D / 2; ++p) {
      codes[2 * p] = static_cast<float>(row[p] & 15);
      codes[2 * p + 1] = static_cast<float>(row[p] >> 4);
    }
    if (D & 1) codes[D - 1] = static_cast<float>(row[(D - 1) >> 1] & 15);
  } else if constexpr (BITS == 3) {
    // eight codes per three bytes: code 8p + i at bit 3i of the 24-bit little-endian word of bytes 3p .. 3p+2
    for (int64_t p = 0; p < D / 8; ++p) {
      const uint8_t* b = row + 3 * p;
      const uint32_t w = static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
                         (static_cast<uint32_t>(b[2]) << 16);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) codes[8 * p + i] = static_cast<float>((w >> (3 * i)) & 7);
    }
    // the last D % 8 codes: a code whose bits straddle two bytes reads the next one, which the row holds
    // (bit 3c + 2 < 3D <= 8P); no byte past the row end is read
    for (int64_t c = D / 8 * 8; c < D; ++c) {
      const int64_t bit = 3 * c;
      const int sh = static_cast<int>(bit & 7);
      uint32_t v = static_cast<uint32_t>(row[bit >> 3]) >> sh;
      if (sh > 5) v |= static_cast<uint32_t>(row[(bit >> 3) + 1]) << (8 - sh);
      codes[c] = static_cast<float>(v & 7);
    }
  } else {
#pragma omp simd
    for (int64_t p = 0; p < D / 4; ++p) {
      const uint8_t b = row[p];
      codes[4 * p] = static_cast<float>(b & 3);
      codes[4 * p + 1] = static_cast<float>((b >> 2) & 3);
      codes[4 * p + 2] = static_cast<float>((b >> 4) & 3);
      codes[4 * p + 3] = static_cast<float>(b >> 6);
    }
    for (int64_t c = D / 4 * 4; c < D; ++c) codes[c] = static_cast<float>((row[c >> 2] >> (2 * (c & 3))) & 3);
  }
}
inline int64_t float_encoding(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "q and out must be float32, bfloat16 or float16");
  return t == at::kFloat ? F32 : (t == at::kBFloat16 ? BF16 : F16);
}

// Rows [rows, D] float32 -> int16 codes qi and one scale per row qs (qs * qi ~ x): the code of max|x| is 32767,
// rounded to nearest; an all-zero row gets scale 0 and zero codes. (paged_attention's q for int8 keys,
// gguf_matmul's activations.)
inline void quantize_rows_i16(const float* x, int64_t rows, int64_t D, int16_t* qi, float* qs) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * D;
    float mx = 0.0f;
    for (int64_t d = 0; d < D; ++d) mx = std::max(mx, std::fabs(v[d]));
    qs[r] = mx / 32767.0f;
    const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      qi[r * D + d] = static_cast<int16_t>(std::nearbyint(std::min(std::max(v[d] * inv, -32767.0f), 32767.0f)));
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// acc + a[0]*b[0] + a[1]*b[1] per int32 lane (pairs of int16): VNNI's one instruction where the CPU has it.
inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// v[0] + ... + v[7].
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace kvpage_cpu
