// kvpage CPU kernels: paged attention that reads KV codes and scales straight from the blocks.
//
// Attention (decode rows and short query runs, e.g. speculative verification): one call per layer for
// the whole batch. Work items are (request, context split); each walks its blocks through the
// block table, decodes a chunk of up to 32 tokens at a time into a small float buffer (never a float
// copy of the context), and folds it into an online softmax (Milakov & Gimelshein 2018; FlashAttention's
// running max / running sum) for every query head of its GQA group, up to three query heads per pass over a
// kv head's rows (register blocking: each row is loaded once for all of them). int8 keys and values are not
// decoded: their scores are integer dot products of the codes with q coded as int16 (scores_i8), and the
// value codes are converted in registers as they are accumulated. Nor are the sealed (KIVI) pool blocks of
// int4/int3/int2: a chunk of them is scored from the packed key codes with q times the block's per-channel
// steps, and its values accumulated from the packed codes with the weights times the tokens' per-group steps,
// the offsets' terms added once (packed_update); chunks holding 16-bit tail rows or int8 sink copies are
// decoded. Long contexts are split over the context when there are fewer work items than threads and merged
// afterwards (flash-decoding); threads take the items largest first, each the next one left when it is free.
// Threads come from ATen's pool (at::parallel_for), so torch.set_num_threads governs them.
//
// Numerics: float32 throughout (but int8 keys' q . k: exact in int32, q rounded to 16 bits; sealed pool blocks:
// the dequantization (code + z) * step distributed over the sums, another rounding order; with int_dots, AVX-512
// and head_dim 64 or 128 their q' = q * step * sm_scale is coded as int16 per (block, query head) and the weights
// times the value steps as int16 per (chunk, query head, value group), each with one scale max / 32767, for integer
// dot products: scores_packed_i16, accumulate_packed_i16); exp is a Cephes-style
// polynomial (relative error ~2e-7) so the compiler can vectorize it; dot products are vectorized reductions
// (another summation order than SDPA's, within float32 rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVPAGE_SIMD 1  // the AVX2 micro-kernels below; other CPUs take the portable loops
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVPAGE_AVX512 1  // wider registers, and twice as many, where the CPU has them
#endif
#endif

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv_common.h"

using namespace kvpage_cpu;

namespace {

#ifdef KVPAGE_SIMD
// Float lanes of the SIMD paths: 8 (ymm) and, where AVX-512 is, 16 (zmm), with int8 codes converted on load.
struct VecF8 {
  using T = __m256;
  static constexpr int N = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // UE5M3 steps (ue5m3()'s values) by bit placement: (1 + m/8) * 2^(e-16) is the float32 with exponent field
  // e + 111 and mantissa m << 20, i.e. the bits (c << 20) + (111 << 23) of the byte c = (e << 3) | m.
  static T ue5m3(const uint8_t* p) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(c, 20), _mm256_set1_epi32(111 << 23)));
  }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static __m256 fold(T v) { return v; }
  static __m256 hsum8(const T* a);  // [sum(a[0]), ..., sum(a[7])] (below)
};

#ifdef KVPAGE_AVX512
struct VecF16 {
  using T = __m512;
  static constexpr int N = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static T ue5m3(const uint8_t* p) {  // (VecF8::ue5m3)
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(c, 20), _mm512_set1_epi32(111 << 23)));
  }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // the sums of lanes i and i + 8, eight lanes
  static __m256 fold(T v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // [sum(a[0]), ..., sum(a[7])]: the eight registers' quarters, then lanes, added pairwise in a transpose (23
  // instructions, where folding each to eight lanes and adding those horizontally took about 37 uops).
  static __m256 hsum8(const T* a) {
    __m512 x[4], y[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // x[i]: quarters (0+2, 1+3) of a[2i], then of a[2i+1]
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {  // y[i]: quarter k holds four partial sums of a[4i + k]
      y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));  // lane 4k: sum(a[k]), 4k+1: sum(a[k+4])
    return _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z));
  }
};
#endif
#endif  // KVPAGE_SIMD

// ---- sources: a request's logical block `blk`, tokens off .. off+nt-1 of it, every kv head ----
// load() fills kb / vb with float32 rows laid out [nt][Hkv][D], as the pool stores them, so each block is
// read once, front to back, for all heads.

// Token-wise formats: every block from the pool through the block table.
template <int E>
struct TokenSource {
  const uint8_t* key;
  const uint8_t* value;        // == key for key-only layers
  const c10::Half* key_scale;  // [NB, bs, Hkv] or nullptr
  const c10::Half* value_scale;
  const float* key_chan;       // [Hkv, D] static per-channel scale or nullptr
  const float* value_chan;
  const int64_t* tables;       // [B, W]
  int64_t W, bs, Hkv, D, esize;

  // int8 codes with per-(token, head) scales can be read as codes by the attention (see int8_rows).
  static constexpr bool kInt8Codes = E == I8;
  static constexpr int kPackedBits = 0;  // (SealedSource's packed path)

  // Whether int8_rows may serve this layer: int8 codes, per-row key and value scales, no static channel scales.
  bool int8_codes_ok(bool has_value) const {
    return E == I8 && has_value && key_scale && value_scale && !key_chan && !value_chan;
  }

  // The int8 path (int8_codes_ok): the key and value scales of the block's rows into ksb / vsb; returns the
  // block's first key and value code rows ([nt][Hkv][D] int8 from there, read as codes by the attention).
  std::pair<const int8_t*, const int8_t*> int8_rows(int64_t r, int64_t blk, int64_t off, int64_t nt, float* ksb,
                                                    float* vsb) const {
    const int64_t first = (tables[r * W + blk] * bs + off) * Hkv;
    for (int64_t i = 0; i < nt * Hkv; ++i) {
      ksb[i] = static_cast<float>(key_scale[first + i]);
      vsb[i] = static_cast<float>(value_scale[first + i]);
    }
    return {reinterpret_cast<const int8_t*>(key + first * D), reinterpret_cast<const int8_t*>(value + first * D)};
  }

  // Asks the caches for kv head h's key and value rows of tokens off .. off+nt-1 of logical block blk of request
  // r, and with h == 0 for their scales, without waiting (see attend_range's prefetch_next). 8-bit rows only:
  // 16- and 32-bit rows are left to the hardware prefetchers, which stream their longer runs well enough; asked
  // for too (two lines and more per row), bf16's attention ran 8-14% slower from memory and 20% slower from
  // cache (batch 32, depth 1,024, one thread).
  void prefetch_rows(int64_t r, int64_t blk, int64_t off, int64_t nt, int64_t h) const {
    if (esize != 1) return;
    const int64_t first = (tables[r * W + blk] * bs + off) * Hkv, row_bytes = D * esize;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t at = (first + i * Hkv + h) * row_bytes;
      prefetch_lines(key + at, row_bytes);
      prefetch_lines(value + at, row_bytes);
    }
    if (h == 0 && key_scale) prefetch_lines(key_scale + first, nt * Hkv * 2);
    if (h == 0 && value_scale) prefetch_lines(value_scale + first, nt * Hkv * 2);
  }

  // With ksb / vsb given, per-(token, head) scales go there instead of into the rows (the attention applies
  // them to scores and weights: two multiplies per token and query head instead of one per element);
  // returns whether it did so.
  template <int DC>
  bool load(int64_t r, int64_t blk, int64_t off, int64_t nt, float* kb, float* vb, bool has_value, float* ksb,
            float* vsb) const {
    const int64_t D = DC ? DC : this->D;
    const int64_t first = (tables[r * W + blk] * bs + off) * Hkv;  // first (token, head) row
    if (ksb && key_scale && (value_scale || !has_value)) {
      for (int64_t i = 0; i < nt * Hkv; ++i) {
        const int64_t row = first + i;
        ksb[i] = static_cast<float>(key_scale[row]);
        decode_row<E, DC, false>(key + row * D * esize, 1.0f, kb + i * D, D);
        if (!has_value) continue;
        vsb[i] = static_cast<float>(value_scale[row]);
        decode_row<E, DC, false>(value + row * D * esize, 1.0f, vb + i * D, D);
      }
      return true;
    }
    if (!key_scale && !key_chan && !value_chan) {  // float rows: nothing to scale
      for (int64_t i = 0; i < nt * Hkv; ++i) {
        const int64_t row = first + i;
        decode_row<E, DC, false>(key + row * D * esize, 1.0f, kb + i * D, D);
        if (has_value) decode_row<E, DC, false>(value + row * D * esize, 1.0f, vb + i * D, D);
      }
      return false;
    }
    for (int64_t i = 0; i < nt * Hkv; ++i) {
      const int64_t row = first + i;
      decode_row<E, DC>(key + row * D * esize, key_scale ? static_cast<float>(key_scale[row]) : 1.0f, kb + i * D, D);
      if (key_chan) {
        const float* c = key_chan + (i % Hkv) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kb[i * D + d] *= c[d];
      }
      if (!has_value) continue;
      decode_row<E, DC>(value + row * D * esize, value_scale ? static_cast<float>(value_scale[row]) : 1.0f, vb + i * D, D);
      if (value_chan) {
        const float* c = value_chan + (i % Hkv) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vb[i * D + d] *= c[d];
      }
    }
    return false;
  }
};

#ifdef KVPAGE_AVX512
// vpshufb indices that gather, into dword lane i, the byte(s) holding int3 code i of 16 (bits 3i .. 3i+2 of six
// bytes: byte 3i/8, and the next one when the code straddles it) from a 16-byte window broadcast to every 128-bit
// lane. idx[o][h]: the 16 codes start at byte 4*o + 6*h of the window (o: the window starts 4 bytes early).
struct Int3Gather {
  alignas(64) int8_t idx[2][2][64];
  constexpr Int3Gather() : idx{} {
    for (int o = 0; o < 2; ++o) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 16; ++i) {
          const int k = 4 * o + 6 * h + (3 * i) / 8;
          idx[o][h][4 * i] = static_cast<int8_t>(k);
          idx[o][h][4 * i + 1] = static_cast<int8_t>((3 * i) % 8 > 5 ? k + 1 : -128);  // -128: a zero byte
          idx[o][h][4 * i + 2] = idx[o][h][4 * i + 3] = -128;
        }
      }
    }
  }
};
constexpr Int3Gather kInt3Gather{};

// Int3Gather for 16-bit lanes: idx[h] gathers into word j of 128-bit lane L the byte holding int3 code 8L + j of
// 32 (bits 3i .. 3i+2 from byte 3i/8) and, when the code straddles it, the next one, from a 16-byte window
// broadcast to every lane; the codes start at byte 4*h of the window (the second window starts 4 bytes early).
struct Int3Gather16 {
  alignas(64) int8_t idx[2][64];
  constexpr Int3Gather16() : idx{} {
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 32; ++i) {
        const int k = 4 * h + (3 * i) / 8, L = i / 8, j = i % 8;
        idx[h][16 * L + 2 * j] = static_cast<int8_t>(k);
        idx[h][16 * L + 2 * j + 1] = static_cast<int8_t>((3 * i) % 8 > 5 ? k + 1 : -128);  // -128: a zero byte
      }
    }
  }
};
constexpr Int3Gather16 kInt3Gather16{};
#endif

#ifdef KVPAGE_SIMD
// The packed codes of the quantize-on-seal formats (BITS = 4, 3 or 2 per code, code c at bit BITS * c of a row's
// little-endian bit stream, as kivi.unpack and unpack_codes read it) brought into float32 lanes.
// SPLIT (int4 only): load() leaves channels c .. c+2*V::N-1 in the order they are stored, the V::N even channels
// (low nibbles) in x[0] and the odd ones (high nibbles) in x[1]; whoever reads them holds q or the accumulators in
// that order too (split / merge), which saves interleaving the nibbles of every row.
template <int BITS, bool SPLIT = false>
struct PackedRows {
  static_assert(!SPLIT || BITS == 4, "split order is int4's");
  using R = uint8_t;
  static constexpr int kVecs = 2;  // vectors load() fills per call
  static constexpr bool kSplit = SPLIT;

  // Codes c .. c+7 of a packed row (c % 8 == 0) as float32: the 4 (8 x 4 bits), 3 (8 x 3 bits) or 2 (8 x 2 bits)
  // bytes that hold them broadcast to eight lanes and shifted right by each lane's bit offset (code i sits at bit BITS * i of the
  // little-endian word, as unpack_codes reads it).
  static inline __m256 codes8(const uint8_t* row, int64_t c) {
    if constexpr (BITS == 4) {
      uint32_t w;
      std::memcpy(&w, row + c / 2, 4);
      const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
      return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    } else if constexpr (BITS == 3) {
      // the 3 bytes of codes c .. c+7 start at byte 3c/8: read as a 2-byte and a 1-byte load and combined in
      // registers, so no byte past them (nor past the row end) is read. (A 3-byte memcpy into a zeroed word
      // went through the stack and stalled on store forwarding: the int3 decode step ran 5-10x int4's.)
      const uint8_t* b = row + 3 * c / 8;
      uint16_t lo;
      std::memcpy(&lo, b, 2);
      const uint32_t w = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(b[2]) << 16);
      const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                                          _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21));
      return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(7)));
    } else {
      uint16_t w;
      std::memcpy(&w, row + c / 4, 2);
      const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
      return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(3)));
    }
  }

#ifdef KVPAGE_AVX512
  // Codes c .. c+15 of a packed row (c % 16 == 0) as float32, in one 512-bit register: int4 as the 8 bytes' low
  // and high nibbles interleaved, int3 as two 24-bit words (8 codes each) shifted per lane, int2 as one 32-bit
  // word shifted per lane (codes8's layout, twice as many per instruction).
  static inline __m512 codes16(const uint8_t* row, int64_t c) {
    if constexpr (BITS == 4) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
      const __m128i m = _mm_set1_epi8(15);
      const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
    } else if constexpr (BITS == 3) {
      const uint8_t* b = row + 3 * c / 8;
      uint16_t lo0, lo1;
      std::memcpy(&lo0, b, 2);
      std::memcpy(&lo1, b + 3, 2);
      const uint32_t w0 = static_cast<uint32_t>(lo0) | (static_cast<uint32_t>(b[2]) << 16);
      const uint32_t w1 = static_cast<uint32_t>(lo1) | (static_cast<uint32_t>(b[5]) << 16);
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w0))),
                                           _mm256_set1_epi32(static_cast<int>(w1)), 1);
      const __m512i x = _mm512_srlv_epi32(w, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
      return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(7)));
    } else {
      uint32_t w;
      std::memcpy(&w, row + c / 4, 4);
      const __m512i x = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)),
                                          _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
      return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(3)));
    }
  }
#endif

  // Codes c .. c+V::N-1 of a packed row as float32 lanes of V (codes8 or codes16).
  template <class V>
  static inline typename V::T codes(const uint8_t* row, int64_t c) {
#ifdef KVPAGE_AVX512
    if constexpr (V::N == 16) return codes16(row, c);
#endif
    if constexpr (V::N == 8) return codes8(row, c);
  }

  // Codes c .. c+2*V::N-1 into x[0], x[1] (c % (2 * V::N) == 0; no byte past them is read). int4 as one load of
  // the V::N bytes, split into low and high nibbles and widened (SPLIT), or with the nibbles first interleaved
  // bytewise (codes 2p, 2p+1 of byte p): 4 or 5 instructions per V::N codes where codes16 takes 7; int3 and int2 as
  // two codes() each.
  template <class V>
  static inline void load(const uint8_t* row, int64_t c, typename V::T* x) {
    if constexpr (BITS == 4) {
      const __m128i m = _mm_set1_epi8(15);
#ifdef KVPAGE_AVX512
      if constexpr (V::N == 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        x[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(SPLIT ? lo : _mm_unpacklo_epi8(lo, hi)));
        x[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(SPLIT ? hi : _mm_unpackhi_epi8(lo, hi)));
        return;
      }
#endif
      if constexpr (V::N == 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        if constexpr (SPLIT) {
          x[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
          x[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        } else {
          const __m128i y = _mm_unpacklo_epi8(lo, hi);
          x[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(y));
          x[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(y, 8)));
        }
      }
    } else {
#ifdef KVPAGE_AVX512
      if constexpr (BITS == 3 && V::N == 16) {
        // the 12 bytes of the 32 codes in a 16-byte window (starting 4 bytes early past the row's first codes, so
        // that it ends inside the row: 3c/8 + 12 <= P), broadcast to the four 128-bit lanes; each lane's dwords
        // gather their code's bytes (Int3Gather) and shift it down: 4 vector instructions per 16 codes where
        // codes16 takes 6 and 8 scalar ones
        const int o = c ? 1 : 0;
        const __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 3 * c / 8 - 4 * o)));
        const __m512i sh = _mm512_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5), m = _mm512_set1_epi32(7);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i b = _mm512_shuffle_epi8(w, _mm512_load_si512(kInt3Gather.idx[o][h]));
          x[h] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, sh), m));
        }
        return;
      }
#endif
      x[0] = codes<V>(row, c);
      x[1] = codes<V>(row, c + V::N);
    }
  }

  // Channels c .. c+2*V::N-1 held as a (c ..) and b (c+V::N ..) -> the SPLIT order (a: even, b: odd channels).
  template <class V>
  static inline void split(typename V::T& a, typename V::T& b) {
#ifdef KVPAGE_AVX512
    if constexpr (V::N == 16) {
      const __m512 e = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
      b = _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
      a = e;
    }
#endif
    if constexpr (V::N == 8) {  // [a0 a2 b0 b2 | a4 a6 b4 b6], then its 64-bit pairs as 0, 2, 1, 3
      const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
      b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
    }
  }

  // split's inverse: even channels a, odd channels b -> channels c .. in a, c+V::N .. in b.
  template <class V>
  static inline void merge(typename V::T& a, typename V::T& b) {
#ifdef KVPAGE_AVX512
    if constexpr (V::N == 16) {
      const __m512 lo = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), b);
      b = _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), b);
      a = lo;
    }
#endif
    if constexpr (V::N == 8) {  // [e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7], lanes regrouped
      const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
      a = _mm256_permute2f128_ps(lo, hi, 0x20);
      b = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
  }
};
#endif  // KVPAGE_SIMD

// Quantize-on-seal formats (KIVI int4/int3/int2): sealed pool blocks, 16-bit tail rows (window copies and the
// open block), sealed first blocks whose first sink_n rows come from their int8 (sink) copy (the copy's slot: src_sink)
// and window blocks read from their int8 copy (formats whose copies hold whole blocks: sink_n == bs), chosen per
// logical block by src_kind / src_idx.
template <int BITS, int TAIL>
struct SealedSource {
  const uint8_t* key;          // [NB, bs, Hkv, P]
  const uint8_t* key_scale;    // [NB, Hkv, D] UE5M3
  const int8_t* key_zero;      // [NB, Hkv, D] offset in steps: x = (code + zero) * scale
  const uint8_t* value;        // [NB, bs, Hkv, P]
  const uint8_t* value_scale;  // [NB, bs, Hkv, Gv]
  const int8_t* value_zero;    // [NB, bs, Hkv, Gv] offset in steps
  const uint8_t* tail_key;     // [S*bs, Hkv, D] TAIL encoding
  const uint8_t* tail_value;
  const uint8_t* sink_key;     // [K*sink_n, Hkv, D] int8
  const c10::Half* sink_key_scale;  // [K*sink_n, Hkv]
  const uint8_t* sink_value;
  const c10::Half* sink_value_scale;
  const uint8_t* src_kind;     // [B, W]: 0 pool, 1 tail slot, 2 pool block with its first sink_n rows from the copy,
                               // 3 all rows from an int8 copy (a window copy)
  const int64_t* src_idx;      // [B, W] pool block id (0, 2), tail slot (1) or int8 copy slot (3)
  const int64_t* src_sink;     // [B] sink slot of the request's first block (read where its kind is 2)
  int64_t W, bs, Hkv, D, P, Gv, sink_n;  // sink_n: rows per sink copy (slot s: rows s*sink_n ..)
  bool int_dots;               // pool blocks' dot products on int16-coded q' and weights where the build has them

  static constexpr bool kInt8Codes = false;  // (TokenSource<I8>'s int8_rows path)
  // Sealed pool blocks can be read as packed codes by the attention (attend_range's packed path).
  static constexpr int kPackedBits = BITS;

  // Whether logical block blk of request r is a sealed pool block; if so, its pool block id into idx.
  bool pool_block(int64_t r, int64_t blk, int64_t& idx) const {
    idx = src_idx[r * W + blk];
    return src_kind[r * W + blk] == 0;
  }

  // prefetch_rows of TokenSource for a sealed pool block: kv head h's packed key and value rows, with h == 0 the
  // block's key steps and offsets and the rows' value steps and offsets. (Tail and sink slots, a request's last
  // and first blocks, are left to the hardware prefetchers.)
  void prefetch_rows(int64_t r, int64_t blk, int64_t off, int64_t nt, int64_t h) const {
    if (src_kind[r * W + blk] != 0) return;
    const int64_t idx = src_idx[r * W + blk], first = (idx * bs + off) * Hkv;
    for (int64_t i = 0; i < nt; ++i) {
      prefetch_lines(key + (first + i * Hkv + h) * P, P);
      prefetch_lines(value + (first + i * Hkv + h) * P, P);
    }
    if (h != 0) return;
    prefetch_lines(key_scale + idx * Hkv * D, Hkv * D);
    prefetch_lines(key_zero + idx * Hkv * D, Hkv * D);
    prefetch_lines(value_scale + first * Gv, nt * Hkv * Gv);
    prefetch_lines(value_zero + first * Gv, nt * Hkv * Gv);
  }

#ifdef KVPAGE_SIMD
  // Pool rows first .. first+nt*Hkv-1 decoded V::N codes at a time, unpacked, converted and scaled in registers
  // (each output row written once: a loop that stores the float codes and reads them back to scale them stalled
  // on those stores, over half of the int4 load's time in a profile): keys by their channels' steps ks and
  // offsets kz ([Hkv, D]), values by their rows' groups of gs channels. Returns false (load's contract).
  template <int DC, class V>
  bool scaled_rows(int64_t first, int64_t nt, const float* ks, const float* kz, int64_t gs, float* kb, float* vb,
                   bool has_value) const {
    const float* lut = ue5m3().v;
    for (int64_t i = 0; i < nt * Hkv; ++i) {
      const int64_t row = first + i, h = i % Hkv;
      const uint8_t* kc = key + row * P;
      const float* s = ks + h * DC;
      const float* z = kz + h * DC;
      float* kr = kb + i * DC;
#pragma GCC unroll 16
      for (int64_t c = 0; c < DC; c += V::N) {
        V::store(kr + c, V::fma(PackedRows<BITS>::template codes<V>(kc, c), V::load(s + c), V::load(z + c)));
      }
      if (!has_value) continue;
      const uint8_t* vc = value + row * P;
      float* vr = vb + i * DC;
      for (int64_t g = 0; g < Gv; ++g) {
        const float st = lut[value_scale[row * Gv + g]];
        const typename V::T vs = V::set1(st);
        const typename V::T vz = V::set1(st * static_cast<float>(value_zero[row * Gv + g]));
        for (int64_t c = g * gs; c < (g + 1) * gs; c += V::N) V::store(vr + c, V::fma(PackedRows<BITS>::template codes<V>(vc, c), vs, vz));
      }
    }
    return false;
  }
#endif

  // Rows come out fully scaled (ksb / vsb are not used); returns false.
  template <int DC>
  bool load(int64_t r, int64_t blk, int64_t off, int64_t nt, float* kb, float* vb, bool has_value, float*,
            float*) const {
    const int64_t D = DC ? DC : this->D;
    const uint8_t kind = src_kind[r * W + blk];
    const int64_t idx = src_idx[r * W + blk];
    const int64_t first = (idx * bs + off) * Hkv;
    if (kind == 1) {
      for (int64_t i = 0; i < nt * Hkv; ++i) {
        decode_row<TAIL, DC>(tail_key + (first + i) * D * 2, 1.0f, kb + i * D, D);
        if (has_value) decode_row<TAIL, DC>(tail_value + (first + i) * D * 2, 1.0f, vb + i * D, D);
      }
      return false;
    }
    // a window copy (kind 3): every row from the int8 copy in slot idx; the first block (kind 2): its first sink_n
    // rows from the request's int8 copy, only the rows after them from the pool
    const int64_t copied = kind == 3 ? nt : kind == 2 ? std::clamp<int64_t>(sink_n - off, 0, nt) : 0;
    if (copied < nt) {
      float* vrest = has_value ? vb + copied * Hkv * D : vb;
      load_pool<DC>(idx, first + copied * Hkv, nt - copied, kb + copied * Hkv * D, vrest, has_value);
    }
    if (copied) {
      const int64_t base = (kind == 3 ? idx : src_sink[r]) * sink_n;
      for (int64_t t = off; t < off + copied; ++t) {
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t row = (base + t) * Hkv + h, i = (t - off) * Hkv + h;
          decode_row<I8, DC>(sink_key + row * D, static_cast<float>(sink_key_scale[row]), kb + i * D, D);
          if (has_value) decode_row<I8, DC>(sink_value + row * D, static_cast<float>(sink_value_scale[row]), vb + i * D, D);
        }
      }
    }
    return false;
  }

  // Pool block idx's rows first .. first+nt*Hkv-1 (flat [token][kv head]) decoded into kb / vb, fully scaled.
  template <int DC>
  void load_pool(int64_t idx, int64_t first, int64_t nt, float* kb, float* vb, bool has_value) const {
    const int64_t D = DC ? DC : this->D;
    // keys: one step and zero point per (kv head, channel) of the block
    const float* lut = ue5m3().v;
    float ks[8 * 512], kz[8 * 512];
    const bool fits = Hkv * D <= 8 * 512;
    if (fits) {
      for (int64_t c = 0; c < Hkv * D; ++c) {
        ks[c] = lut[key_scale[idx * Hkv * D + c]];
        kz[c] = ks[c] * static_cast<float>(key_zero[idx * Hkv * D + c]);
      }
    }
    const int64_t gs = D / Gv;
#ifdef KVPAGE_SIMD
    // the widest lanes the head size and the value groups allow (scaled_rows; the loop below is the portable one)
#ifdef KVPAGE_AVX512
    if constexpr (DC > 0 && DC % 16 == 0) {
      if (fits && gs % 16 == 0) {
        scaled_rows<DC, VecF16>(first, nt, ks, kz, gs, kb, vb, has_value);
        return;
      }
    }
#endif
    if constexpr (DC > 0 && DC % 8 == 0) {
      if (fits && gs % 8 == 0) {
        scaled_rows<DC, VecF8>(first, nt, ks, kz, gs, kb, vb, has_value);
        return;
      }
    }
#endif
    for (int64_t i = 0; i < nt * Hkv; ++i) {
      const int64_t row = first + i, h = i % Hkv;
      float* kr = kb + i * D;
      unpack_codes<BITS, DC>(key + row * P, D, kr);
      if (fits) {
        const float* s = ks + h * D;
        const float* z = kz + h * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) kr[c] = kr[c] * s[c] + z[c];
      } else {
        const int64_t kh = (idx * Hkv + h) * D;
        for (int64_t c = 0; c < D; ++c) {
          const float st = lut[key_scale[kh + c]];
          kr[c] = kr[c] * st + st * static_cast<float>(key_zero[kh + c]);
        }
      }
      if (!has_value) continue;
      // values: one step and zero point per (token, kv head, group of gs channels)
      float* vr = vb + i * D;
      unpack_codes<BITS, DC>(value + row * P, D, vr);
      for (int64_t g = 0; g < Gv; ++g) {
        const float s = lut[value_scale[row * Gv + g]];
        const float z = s * static_cast<float>(value_zero[row * Gv + g]);
        float* x = vr + g * gs;
#pragma omp simd
        for (int64_t c = 0; c < gs; ++c) x[c] = x[c] * s + z;
      }
    }
  }
};

struct Batch {
  const void* q;                // [T, H, D] in q_enc
  void* out;                    // [T, H, D] in out_enc
  int64_t q_enc, out_enc;
  const int64_t* seq_lens;      // [B]
  const int64_t* qsl;           // [B + 1]
  int64_t H, Hkv, D, bs;
  float sm_scale;
};

// The online-softmax step for one query row and one block (Milakov & Gimelshein 2018): scores sc[0..lim)
// with maximum mx become weights exp(sc - m_new) in place; the running max m and sum l are updated and the
// factor the row's accumulator must be rescaled by (exp(m_old - m_new), 0 on the first block) is returned.
inline float sum_floats(const float* x, int64_t n);

inline float softmax_update(float* sc, int64_t lim, float mx, float& m, float& l) {
  const float mnew = std::max(m, mx);
  // exp_neg(0) is exactly 1, so a running max that did not move skips the call (most blocks after the first).
  const float corr = m == NEG_INF ? 0.0f : (m == mnew ? 1.0f : exp_neg(m - mnew));
#pragma omp simd
  for (int64_t t = 0; t < lim; ++t) sc[t] = exp_neg(sc[t] - mnew);
  // Summed apart from the exp loop: a reduction inside it compiled to a chain of scalar adds over a spilled
  // vector (18% of the decode kernel's time in a profile).
  l = l * corr + sum_floats(sc, lim);
  m = mnew;
  return corr;
}

// x[0] + ... + x[n-1], eight lanes at a time where AVX2 is there.
inline float sum_floats(const float* x, int64_t n) {
  int64_t t = 0;
  float r = 0.0f;
#ifdef KVPAGE_SIMD
  __m256 a = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + t));
  r = hsum(a);
#endif
  for (; t < n; ++t) r += x[t];
  return r;
}

// Tokens the SIMD paths gather before attending to them (whole blocks: at least one). 32 measured best at
// SmolLM2's shape (batch 32, depth 1,024 / 4,096, one thread, against 16 and 64): int8 1.09-1.11x, bf16
// 1.05-1.06x one block of 16 at a time; int4's blocks of 32 unchanged; 64 tokens of float rows (48 KiB
// each for K and V) no longer fit L1 and cost int4 5%.
constexpr int64_t kChunkTokens = 32;
inline int64_t chunk_blocks(int64_t bs) { return std::max<int64_t>(1, kChunkTokens / bs); }
// Floats between the score rows of a query-head group (a chunk's tokens rounded up to 8).
inline int64_t score_ld(int64_t bs) { return chunk_blocks(bs) * bs + 8; }

#ifdef KVPAGE_SIMD
// ---- SIMD micro-kernels over a gathered chunk: GB query heads of one kv head against its rows ----
// GQA register blocking: each key or value row is loaded (and, for int8 codes, converted) once for the GB
// query heads that read it, instead of once per query head. GB is what the register file holds: up to 3 with
// AVX-512's 32 registers (8 tokens x 3 heads of score accumulators; head_dim / 16 x 3 output accumulators up to
// head_dim 128), 1 with AVX2's 16.

#ifdef KVPAGE_AVX512
constexpr int kMaxGroup = 3;
using VecF = VecF16;  // the micro-kernels' float lanes
#else
constexpr int kMaxGroup = 1;
using VecF = VecF8;
#endif

// Calls f(std::integral_constant<int, gb>{}) for a run-time group size 1 <= gb <= kMaxGroup.
template <class F>
inline void with_group(int64_t gb, F&& f) {
  if constexpr (kMaxGroup >= 3) {
    if (gb == 3) return f(std::integral_constant<int, 3>{});
  }
  if constexpr (kMaxGroup >= 2) {
    if (gb == 2) return f(std::integral_constant<int, 2>{});
  }
  f(std::integral_constant<int, 1>{});
}

// [sum(a0), ..., sum(a7)]: eight horizontal sums at once.
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline __m256 VecF8::hsum8(const __m256* a) { return ::hsum8(a); }

// max(v[0], ..., v[7]).
inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The key scales of tokens t0 .. t0+7 (ks[t * sstride]; lanes past lim - 1 repeat the last token's) times f.
inline __m256 scaled_lanes(const float* ks, int64_t sstride, int64_t t0, int64_t lim, __m256 f) {
  if (!ks) return f;
  alignas(32) float tmp[8];
  const int64_t last = lim - 1 - t0;
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) tmp[u] = ks[(t0 + std::min<int64_t>(u, last)) * sstride];
  return _mm256_mul_ps(f, _mm256_load_ps(tmp));
}

// Row readers of the micro-kernels: load<V>(row, d, x) brings channels d .. d + kVecs*V::N - 1 of a key or value
// row into float lanes x[0 .. kVecs-1]. PlainRows: float32 rows, or int8 codes converted on load; PackedRows<BITS>
// (above): the quantize-on-seal formats' packed codes.
template <class T>
struct PlainRows {
  using R = T;
  static constexpr int kVecs = 1;
  static constexpr bool kSplit = false;
  template <class V>
  static inline void load(const T* row, int64_t d, typename V::T* x) { x[0] = V::load(row + d); }
};

// Scores of GB query rows q + g*DC against key rows kbase + t*stride, t < lim, eight tokens at a time, read through
// K: sc[g*ldsc + t] = (q_g . k_t) * scale (times the token's key scale ks[t*sstride] if ks) + add[g] (if add), with
// vmax[g] the lanewise maximum so far (the caller folds it with hmax8: a score row may be filled by several calls).
// All eight lanes are stored (a score row holds lim rounded up to 8): lanes past lim repeat the last token's
// score, so the maximum is unchanged and nothing reads them.
template <int DC, int GB, class K>
inline void score_rows(const float* q, const typename K::R* kbase, int64_t stride, int64_t lim, float scale,
                       const float* ks, int64_t sstride, const float* add, float* sc, int64_t ldsc, __m256* vmax) {
  using V = VecF;
  constexpr int KV = K::kVecs;
  __m256 c[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) c[g] = add ? _mm256_set1_ps(add[g]) : _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < lim; t0 += 8) {
    typename V::T a[GB][8];
    const typename K::R* rows[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      rows[u] = kbase + (t0 + std::min<int64_t>(u, lim - 1 - t0)) * stride;  // past the end: the last row again
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) a[g][u] = V::zero();
    }
#pragma GCC unroll 16
    for (int64_t d = 0; d < DC; d += KV * V::N) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        typename V::T k[KV];
        K::template load<V>(rows[u], d, k);
#pragma GCC unroll 2
        for (int i = 0; i < KV; ++i) {
#pragma GCC unroll 4
          for (int g = 0; g < GB; ++g) a[g][u] = V::fma(V::load(q + g * DC + d + i * V::N), k[i], a[g][u]);
        }
      }
    }
    const __m256 f = scaled_lanes(ks, sstride, t0, lim, _mm256_set1_ps(scale));
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m256 v = _mm256_fmadd_ps(V::hsum8(a[g]), f, c[g]);  // (+ 0 when add is null: the product, rounded once)
      _mm256_storeu_ps(sc + g * ldsc + t0, v);
      vmax[g] = _mm256_max_ps(vmax[g], v);
    }
  }
}

// score_rows over float key rows (scaled by sm_scale and ks), mx[g] the maxima of the GB score rows.
template <int DC, int GB>
inline void scores_f32(const float* q, const float* kbase, int64_t stride, int64_t lim, float sm_scale,
                       const float* ks, int64_t sstride, float* sc, int64_t ldsc, float* mx) {
  __m256 vmax[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) vmax[g] = _mm256_set1_ps(NEG_INF);
  score_rows<DC, GB, PlainRows<float>>(q, kbase, stride, lim, sm_scale, ks, sstride, nullptr, sc, ldsc, vmax);
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) mx[g] = hmax8(vmax[g]);
}

// ac_g = ac_g * corr[g] + sum_{t < lim} w_g[t] * v_t (+ add[g*NG + j] over channel group j, if add) for the GB
// accumulator rows ac + g*DC, held in registers across the tokens. Value rows vbase + t*stride are read through K;
// their channels come in NG = DC / GS groups of GS, each with its own weights: w_g[t] of group j is
// w[(g*NG + j)*ldw + t] (times the token's value scale vs[t*sstride] if vs).
template <int DC, int GB, class K, int GS = DC>
inline void accumulate(float* ac, const float* corr, const typename K::R* vbase, int64_t stride, int64_t lim,
                       const float* w, int64_t ldw, const float* vs, int64_t sstride, const float* add = nullptr) {
  using V = VecF;
  constexpr int NV = DC / V::N, KV = K::kVecs, NG = DC / GS;
  static_assert(GS % V::N == 0 && DC % (KV * V::N) == 0, "a vector of channels in one group; whole loads");
  static_assert(!K::kSplit || GS % (2 * V::N) == 0, "a split pair of vectors in one group");
  typename V::T acc[GB][NV];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    const typename V::T c = V::set1(corr[g]);
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) acc[g][i] = V::mul(V::load(ac + g * DC + V::N * i), c);
    if constexpr (K::kSplit) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; i += 2) K::template split<V>(acc[g][i], acc[g][i + 1]);
    }
  }
  for (int64_t t = 0; t < lim; ++t) {
    const float s = vs ? vs[t * sstride] : 1.0f;
    typename V::T wt[GB][NG];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j) wt[g][j] = V::set1(w[(g * NG + j) * ldw + t] * s);
    }
    const typename K::R* row = vbase + t * stride;
#pragma GCC unroll 16
    for (int i = 0; i < NV; i += KV) {
      typename V::T v[KV];
      K::template load<V>(row, V::N * i, v);
#pragma GCC unroll 2
      for (int x = 0; x < KV; ++x) {
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) acc[g][i + x] = V::fma(wt[g][(i + x) * V::N / GS], v[x], acc[g][i + x]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    if constexpr (K::kSplit) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; i += 2) K::template merge<V>(acc[g][i], acc[g][i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      if (add) acc[g][i] = V::add(acc[g][i], V::set1(add[g * NG + i * V::N / GS]));
      V::store(ac + g * DC + V::N * i, acc[g][i]);
    }
  }
}

// A chunk of one request's context, tokens a .. e-1: every query row (j, qh) gets its scores and its
// online-softmax update, GB query heads of a kv head at a time (groups as even as kMaxGroup allows: a group of 4
// is 2 + 2). scores(GB constant, first row, kv head, lim, mx) fills the score rows sc + g*ldsc and their maxima
// mx[g]; values(GB constant, first row, kv head, lim, corr) folds the weights sc + g*ldsc into the accumulator
// rows (accumulate).
template <class Scores, class Values>
inline void block_update(int64_t n, int64_t H, int64_t G, int64_t s, int64_t a, int64_t e, int64_t Hkv, float* m,
                         float* l, float* sc, int64_t ldsc, Scores&& scores, Values&& values) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t lim = std::min(e, s - n + j + 1) - a;  // query j sees keys 0 .. s-n+j
    if (lim <= 0) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t g0 = 0; g0 < G;) {
        const int64_t left = G - g0, groups = (left + kMaxGroup - 1) / kMaxGroup, gb = (left + groups - 1) / groups;
        with_group(gb, [&](auto group) {
          constexpr int GB = decltype(group)::value;
          const int64_t row = j * H + h * G + g0;  // query head h*G + g0 + g reads kv head h
          float mx[GB], corr[GB];
          scores(group, row, h, lim, mx);
#pragma GCC unroll 4
          for (int g = 0; g < GB; ++g) corr[g] = softmax_update(sc + g * ldsc, lim, mx[g], m[row + g], l[row + g]);
          values(group, row, h, lim, corr);
        });
        g0 += gb;
      }
    }
  }
}

// ---- int8 keys read in place: q . k as an integer dot product ----
// Each query row is coded once per work item as int16 with one scale (q_hat = qs * qi, |qi| <= 32767; the
// error, half a step of max|q| / 32767, is 1/258 of the int8 keys' own), and its scores are
// qs * k_scale * sum_d qi[d] * k_code[d]: 16 (32 with AVX-512) channels per instruction on the codes as stored
// (sign-extended to 16 bits), exact in int32 for head_dim <= 512, instead of decoding the keys to float32 first.
// llama.cpp's q8_0 x q8_0 path codes q to 8 bits; 16 keeps q's rounding far below the cache's.

// 16 int16 lanes: int8 codes sign-extended on load.
struct VecI16x16 {
  using T = __m256i;
  static constexpr int N = 16;
  static T zero() { return _mm256_setzero_si256(); }
  static T codes(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static T load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static T dot(T acc, T a, T b) { return dot_i16(acc, a, b); }
  static __m256i hsum8(const T* a);  // [sum(a[0]), ..., sum(a[7])] of eight int32 registers
};

#ifdef KVPAGE_AVX512
// 32 int16 lanes (zmm).
struct VecI16x32 {
  using T = __m512i;
  static constexpr int N = 32;
  static T zero() { return _mm512_setzero_si512(); }
  static T codes(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static T load(const int16_t* p) { return _mm512_loadu_si512(p); }
  static T dot(T acc, T a, T b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  }
  static __m256i hsum8(const T* a);  // [sum(a[0]), ..., sum(a[7])] of eight int32 registers
};
template <int DC>
using VecI16 = std::conditional_t<DC % 32 == 0, VecI16x32, VecI16x16>;
#else
template <int DC>
using VecI16 = VecI16x16;
#endif

// [sum(a0), ..., sum(a7)] of eight int32 vectors (hsum8's integer twin).
inline __m256i hsum8_i32(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20), _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

inline __m256i VecI16x16::hsum8(const __m256i* a) { return hsum8_i32(a); }

#ifdef KVPAGE_AVX512
// [sum(a[0]), ..., sum(a[7])] of eight 16-lane int32 registers: VecF16::hsum8's transpose on integers (single-uop
// shuffles, where folding to eight lanes and hsum8_i32's vphaddd took about 29 uops).
inline __m256i hsum8_i32x16(const __m512i* a) {
  __m512i x[4], y[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    y[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  __m512i z = _mm512_add_epi32(_mm512_unpacklo_epi32(y[0], y[1]), _mm512_unpackhi_epi32(y[0], y[1]));
  z = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2))));
  return _mm512_castsi512_si256(
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z));
}
inline __m256i VecI16x32::hsum8(const __m512i* a) { return hsum8_i32x16(a); }
#endif

// scores_f32 for int8 key rows (`stride` bytes apart, per-token scales ks) and int16-coded query rows qi + g*DC
// with scales qs[g]: sc[g*ldsc + t] = qs[g] * ks[t*sstride] * sm_scale * (qi_g . k_t). The eight tokens' sums are
// reduced by V::hsum8 (with AVX-512 the 16-lane registers transposed directly: the op 2-4% faster at batch 32,
// depth 1,024 and 4,096 than folding each to eight lanes first; tried and dropped: the int8 values summed with
// int16-coded weights as the sealed blocks' are, 3-7% slower at that shape; and (2026-12-06, AMD EPYC Zen 4) summed
// with VNNI byte dot products, the weights times the value scales coded as 16 bits split into two byte planes,
// four tokens' codes interleaved per channel, one vpdpbusd per 16 channels, plane and query head: outputs within
// 4e-6 of the float path's, but 1.03-1.27x slower in the same process (batch 32, depth 1,024: 1,690 against
// 1,642 µs with the codes interleaved once into L1 for every query head, 1,635 against 1,492 with 24 accumulators
// in registers, which spilled; batch 8, depth 4,096: 1,922 against 1,516). An ablation of the op there (a build
// skipping one part at a time; the in-place reads of attend_range's note, as fast hot; batch 8, depth 1,024: 15.5 ns
// per token and kv head) put 4.8 ns in the value loop, 4.3 in these scores, 1.7 in the prefetches and 4.1 in the
// rest (softmax, chunk set-up, the call; converting the scales 16 at a time gained nothing measurable). Not built:
// the query coded as int8 for vpdpbusd (llama.cpp's q8_0 x q8_0; at most half these instructions): +26-56% KLD
// for int8 and +40-46% for int8_rotated in benchmarks/ACCURACY.md's screen, where the int16 query costs nothing.
template <int DC, int GB>
inline void scores_i8(const int16_t* qi, const float* qs, const int8_t* kbase, int64_t stride, int64_t lim,
                      float sm_scale, const float* ks, int64_t sstride, float* sc, int64_t ldsc, float* mx) {
  using V = VecI16<DC>;
  __m256 vmax[GB], f[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    vmax[g] = _mm256_set1_ps(NEG_INF);
    f[g] = _mm256_set1_ps(qs[g] * sm_scale);
  }
  for (int64_t t0 = 0; t0 < lim; t0 += 8) {
    typename V::T a[GB][8];
    const int8_t* rows[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      rows[u] = kbase + (t0 + std::min<int64_t>(u, lim - 1 - t0)) * stride;
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) a[g][u] = V::zero();
    }
#pragma GCC unroll 8
    for (int64_t d = 0; d < DC; d += V::N) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const typename V::T k = V::codes(rows[u] + d);
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) a[g][u] = V::dot(a[g][u], k, V::load(qi + g * DC + d));
      }
    }
    const __m256 kscale = scaled_lanes(ks, sstride, t0, lim, _mm256_set1_ps(1.0f));
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(V::hsum8(a[g])), f[g]), kscale);
      _mm256_storeu_ps(sc + g * ldsc + t0, v);
      vmax[g] = _mm256_max_ps(vmax[g], v);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) mx[g] = hmax8(vmax[g]);
}

// ---- quantize-on-seal pool blocks read as packed codes ----
// A key channel's codes share one step and offset over the block (x = (code + z[d]) * step[d]), so
// (q . k_t) * sm_scale = sum_d q'[d] * code[t, d] + c with q' = q * step * sm_scale and c = sum_d q'[d] * z[d],
// both once per (block, query head). A value group's share them over its channels (x = (code + z) * step, per
// token and group), so sum_t w_t * v_t = sum_t (w_t * step_t) * code_t + sum_t w_t * step_t * z_t, the second one
// number per group and query head. Scores and accumulators read the codes through PackedRows, unpacked and
// converted in registers once for the GB query heads of a pass; no decoded key or value row is stored (decoding
// into float rows first, then reading them back, cost int4 about twice its read-as-codes time).

// Channels per value group of the quantize-on-seal formats at head_dim d: the largest divisor of d that is at
// most 64 (kivi.value_group_size).
constexpr int value_group(int d) {
  for (int g = d < 64 ? d : 64; g > 1; --g) {
    if (d % g == 0) return g;
  }
  return 1;
}

// Whether head_dim DC takes the packed path: whole PackedRows loads, and no vector of channels across two value
// groups (AVX-512: 64, 96, 128; AVX2: 64, 80, 96, 128).
template <int DC>
constexpr bool packed_fits() {
  return DC > 0 && DC % (2 * VecF::N) == 0 && value_group(DC) % VecF::N == 0;
}

// A chunk's sealed pool blocks: segment i is the chunk's tokens at[i] .. at[i]+n[i]-1, from pool block blk[i]
// (its key steps and offsets), whose first (token, kv head 0) row is row[i].
struct PackedChunk {
  int64_t count;
  int64_t at[kChunkTokens], n[kChunkTokens], blk[kChunkTokens], row[kChunkTokens];
};

// q' = q * step * sm_scale (qp + g*DC) and c[g] = sum_d q'[d] * z[d] for the GB query rows q + g*DC against one
// block's key channels: UE5M3 steps step[0 .. DC-1], offsets z.
template <int DC, int GB, class K>
inline void packed_query(const float* q, float sm_scale, const uint8_t* step, const int8_t* z, float* qp, float* c) {
  using V = VecF;
  constexpr int NV = DC / V::N;
  typename V::T st[NV];
  const typename V::T sm = V::set1(sm_scale);
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) st[i] = V::mul(V::ue5m3(step + V::N * i), sm);
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    typename V::T cz = V::zero(), x[NV];
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      x[i] = V::mul(V::load(q + g * DC + V::N * i), st[i]);
      cz = V::fma(x[i], V::load(z + V::N * i), cz);
    }
    if constexpr (K::kSplit) {  // q' in the order K reads the codes
#pragma GCC unroll 8
      for (int i = 0; i < NV; i += 2) K::template split<V>(x[i], x[i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) V::store(qp + g * DC + V::N * i, x[i]);
    c[g] = hsum(V::fold(cz));
  }
}

#ifdef KVPAGE_AVX512
// ---- sealed pool blocks' keys read in place: q' . code as an integer dot product ----
// Per (block, query head) q' = q * step * sm_scale (packed_query's) is coded as int16 with one scale,
// qs = max|q'| / 32767, rounded to nearest (quantize_rows_i16's coding), and a token's score is
// qs * sum_d qi[d] * code[t, d] + c, c = sum_d q'[d] * z[d] kept in float from the uncoded q': the codes are
// zero-extended to 16-bit lanes and multiplied pairwise into int32 (vpdpwssd, or vpmaddwd + add without VNNI),
// 32 channels per instruction, exact in int32 (head_dim 128 * 15 * 32767 < 2^31). Each score moves by at most
// (qs / 2) * sum_d code[t, d] from the float path's (q' rounded to half a step), 1/65534 of max|q'| per unit of
// code. Replaces unpacking every code to float32 (measured on int4 at SmolLM2's shape in the commit that added
// it); the int8 keys' scores_i8 is the same idea on int8 codes.

// 64 channels of a packed row as two registers of 32 int16 codes, in the lane order channel() gives (the order
// the codes unpack in cheaply; qi is stored in that order too, so the dot product needs no reshuffling of codes).
template <int BITS>
struct PackedCodes16 {
  // Tokens accumulate_packed_i16 sums exactly in int32: tokens * 32767 * (2^BITS - 1) < 2^31.
  static constexpr int64_t kMaxTokens = ((int64_t{1} << 31) - 1) / (32767 * ((1 << BITS) - 1));
  // Channel (0 .. 63, relative to the unit's first) of lane p of the pair (register p / 32, lane p % 32).
  //   int4: byte i of the 32 holds channels 2i (low nibble, register 0) and 2i+1 (high nibble, register 1);
  //   int2: byte i of the 16 holds channels 4i + k at bits 2k: register x, half h (16 lanes each) holds k = 2x + h;
  //   int3: channel order (each lane gathers the two bytes its code straddles).
  static constexpr int channel(int p) {
    if (BITS == 4) return p < 32 ? 2 * p : 2 * (p - 32) + 1;
    if (BITS == 2) return 4 * (p % 16) + 2 * (p / 32) + (p % 32) / 16;
    return p;
  }

  // Channels c .. c+63 (c % 64 == 0) of a packed row into x[0], x[1]; reads only the row's bytes of those codes.
  static inline void load(const uint8_t* row, int64_t c, __m512i* x) {
    if constexpr (BITS == 4) {  // the 32 bytes widened to 16-bit lanes: low nibble, then high nibble
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2)));
      x[0] = _mm512_and_si512(w, _mm512_set1_epi16(15));
      x[1] = _mm512_srli_epi16(w, 4);
    } else if constexpr (BITS == 2) {  // the 16 bytes twice, widened, each half shifted by its pair of bit offsets
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 4))));
      const __m512i m = _mm512_set1_epi16(3);
      x[0] = _mm512_and_si512(_mm512_srlv_epi16(w, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1)), m);
      x[1] = _mm512_and_si512(_mm512_srlv_epi16(w, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)), m);
    } else {
      // codes 32h .. 32h+31 are the 12 bytes from 3c/8 + 12h: a 16-byte window (the second starting 4 bytes
      // early, so that it ends inside the row) broadcast to the four 128-bit lanes; lane L's words gather the
      // byte(s) of codes 8L .. 8L+7 (Int3Gather16) and shift them down
      const uint8_t* b = row + 3 * c / 8;
      const __m512i sh = _mm512_set4_epi32(0x00050002, 0x0007'0004, 0x0001'0006, 0x0003'0000);  // 3j % 8, j = 0..7
      const __m512i m = _mm512_set1_epi16(7);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 12 * h - 4 * h)));
        const __m512i g = _mm512_shuffle_epi8(w, _mm512_load_si512(kInt3Gather16.idx[h]));
        x[h] = _mm512_and_si512(_mm512_srlv_epi16(g, sh), m);
      }
    }
  }
};

// q' = q * step * sm_scale for the GB query rows q + g*DC against one block's key channels (UE5M3 steps step,
// offsets z), coded as packed_query does not: qi + g*DC holds round(q' / qs[g]) in PackedCodes16<BITS>'s lane
// order (per 64 channels), qs[g] = max|q'| / 32767 (0 for a zero row), and c[g] = sum_d q'[d] * z[d] (float).
template <int DC, int GB, int BITS>
inline void packed_query_i16(const float* q, float sm_scale, const uint8_t* step, const int8_t* z, int16_t* qi,
                             float* qs, float* c) {
  using V = VecF16;
  constexpr int NV = DC / 16;
  static_assert(DC % 64 == 0, "whole 64-channel units");
  __m512 st[NV];
  const __m512 sm = V::set1(sm_scale);
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) st[i] = V::mul(V::ue5m3(step + 16 * i), sm);
  // lane p of a unit's pair takes natural channel channel(p): vpermt2w indices into [channels 0..31, 32..63]
  alignas(64) static constexpr struct Perm {
    int16_t idx[64];
    constexpr Perm() : idx{} {
      for (int p = 0; p < 64; ++p) idx[p] = static_cast<int16_t>(PackedCodes16<BITS>::channel(p));
    }
  } perm{};
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    __m512 x[NV], cz = V::zero(), mx = V::zero();
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      x[i] = V::mul(V::load(q + g * DC + 16 * i), st[i]);
      cz = V::fma(x[i], V::load(z + 16 * i), cz);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(x[i]));
    }
    const float m = _mm512_reduce_max_ps(mx);
    qs[g] = m / 32767.0f;
    const __m512 inv = V::set1(m > 0.0f ? 32767.0f / m : 0.0f);
    int16_t* out = qi + g * DC;
#pragma GCC unroll 2
    for (int u = 0; u < DC / 64; ++u) {
      __m512i nat[2];  // channels 64u .. 64u+31, 64u+32 .. 64u+63 as int16 (|x * inv| <= 32767: no clamp needed)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i lo = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(V::mul(x[4 * u + 2 * h], inv)));
        const __m256i hi = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(V::mul(x[4 * u + 2 * h + 1], inv)));
        nat[h] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      if constexpr (BITS == 3) {
        _mm512_storeu_si512(out + 64 * u, nat[0]);
        _mm512_storeu_si512(out + 64 * u + 32, nat[1]);
      } else {
        _mm512_storeu_si512(out + 64 * u, _mm512_permutex2var_epi16(nat[0], _mm512_loadu_si512(perm.idx), nat[1]));
        _mm512_storeu_si512(out + 64 * u + 32,
                            _mm512_permutex2var_epi16(nat[0], _mm512_loadu_si512(perm.idx + 32), nat[1]));
      }
    }
    c[g] = _mm512_reduce_add_ps(cz);
  }
}

// score_rows for a sealed pool block's packed key rows (kbase + t*stride, t < lim) and the GB int16-coded query
// rows of packed_query_i16: sc[g*ldsc + t] = qs[g] * (qi_g . code_t) + c[g], vmax as score_rows.
template <int DC, int GB, int BITS>
inline void scores_packed_i16(const int16_t* qi, const float* qs, const float* c, const uint8_t* kbase,
                              int64_t stride, int64_t lim, float* sc, int64_t ldsc, __m256* vmax) {
  using V = VecI16x32;
  __m256 f[GB], add[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    f[g] = _mm256_set1_ps(qs[g]);
    add[g] = _mm256_set1_ps(c[g]);
  }
  for (int64_t t0 = 0; t0 < lim; t0 += 8) {
    __m512i a[GB][8];
    const uint8_t* rows[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      rows[u] = kbase + (t0 + std::min<int64_t>(u, lim - 1 - t0)) * stride;  // past the end: the last row again
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) a[g][u] = V::zero();
    }
#pragma GCC unroll 2
    for (int64_t d = 0; d < DC; d += 64) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        __m512i k[2];
        PackedCodes16<BITS>::load(rows[u], d, k);
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x) {
#pragma GCC unroll 4
          for (int g = 0; g < GB; ++g) a[g][u] = V::dot(a[g][u], k[x], V::load(qi + g * DC + d + 32 * x));
        }
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_i32x16(a[g])), f[g], add[g]);
      _mm256_storeu_ps(sc + g * ldsc + t0, v);
      vmax[g] = _mm256_max_ps(vmax[g], v);
    }
  }
}

// Where accumulate_packed_i16's int32 lanes land in channel order: register k = 2x + hh (unpacklo / unpackhi (hh)
// of PackedCodes16's register x of two tokens), dword m holds the pair of word 8*(m/4) + 4*hh + m%4 of register x.
// Output vector o (channels 16o .. 16o+15 of the unit) = blend(mask[o], permutex2var(r0, idx[0][o], r1),
// permutex2var(r2, idx[1][o], r3)).
template <int BITS>
struct PairLanes {
  alignas(64) int32_t idx[2][4][16];
  uint16_t mask[4];
  constexpr PairLanes() : idx{}, mask{} {
    for (int k = 0; k < 4; ++k) {
      for (int m = 0; m < 16; ++m) {
        const int x = k / 2, hh = k % 2, ch = PackedCodes16<BITS>::channel(32 * x + 8 * (m / 4) + 4 * hh + m % 4);
        idx[x][ch / 16][ch % 16] = m + 16 * hh;
        if (x) mask[ch / 16] = static_cast<uint16_t>(mask[ch / 16] | (1u << (ch % 16)));
      }
    }
  }
};

// accumulate for a sealed pool block's packed value rows (vbase + t*stride, t < lim) with integer weights: the
// weights times the tokens' steps coded as int16 per (chunk, query head, value group of 64 channels), wi + (g*NU
// + u)*ldw (wi[t] ~ w'[t] / ws[g*NU + u]), two tokens per vpdpwssd (their codes interleaved per channel, the
// weights as one int32 pair), exact in int32 for lim <= PackedCodes16<BITS>::kMaxTokens (the caller takes float
// weights past it: blocks of more tokens than that); then ac_g = ac_g * corr[g] + ws * sums (+ add[g*NU + u] over
// unit u, if add).
template <int DC, int GB, int BITS>
inline void accumulate_packed_i16(float* ac, const float* corr, const uint8_t* vbase, int64_t stride, int64_t lim,
                                  const int16_t* wi, int64_t ldw, const float* ws, const float* add) {
  using V = VecI16x32;
  constexpr int NU = DC / 64;
  static constexpr PairLanes<BITS> lanes{};
#pragma GCC unroll 2
  for (int u = 0; u < NU; ++u) {
    __m512i a[GB][4];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) a[g][k] = V::zero();
    }
    for (int64_t t = 0; t < lim; t += 2) {
      const bool two = t + 1 < lim;
      const uint8_t* r0 = vbase + t * stride;
      __m512i x0[2], x1[2];
      PackedCodes16<BITS>::load(r0, 64 * u, x0);
      PackedCodes16<BITS>::load(two ? r0 + stride : r0, 64 * u, x1);
      __m512i wt[GB];
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) {
        const int16_t* wr = wi + (g * NU + u) * ldw + t;
        int32_t pair;
        if (two) {
          std::memcpy(&pair, wr, 4);
        } else {
          pair = static_cast<uint16_t>(wr[0]);  // the odd last token: its partner weighs 0
        }
        wt[g] = _mm512_set1_epi32(pair);
      }
#pragma GCC unroll 2
      for (int x = 0; x < 2; ++x) {
        const __m512i lo = _mm512_unpacklo_epi16(x0[x], x1[x]), hi = _mm512_unpackhi_epi16(x0[x], x1[x]);
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) {
          a[g][2 * x] = V::dot(a[g][2 * x], lo, wt[g]);
          a[g][2 * x + 1] = V::dot(a[g][2 * x + 1], hi, wt[g]);
        }
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m512 f = _mm512_set1_ps(ws[g * NU + u]), cr = _mm512_set1_ps(corr[g]);
      __m512 r[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) r[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(a[g][k]), f);
      const __m512 ad = _mm512_set1_ps(add ? add[g * NU + u] : 0.0f);
      float* o = ac + g * DC + 64 * u;
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512 e = _mm512_permutex2var_ps(r[0], _mm512_load_si512(lanes.idx[0][v]), r[1]);
        const __m512 d = _mm512_permutex2var_ps(r[2], _mm512_load_si512(lanes.idx[1][v]), r[3]);
        const __m512 sum = _mm512_add_ps(_mm512_mask_blend_ps(lanes.mask[v], e, d), ad);
        _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * v), cr, sum));
      }
    }
  }
}
#endif  // KVPAGE_AVX512

// Whether packed_update can take integer dot products over sealed pool blocks (scores_packed_i16,
// accumulate_packed_i16) at head_dim DC; SealedSource::int_dots chooses them.
template <int DC>
constexpr bool packed_int_scores() {
#ifdef KVPAGE_AVX512
  return DC > 0 && DC % 64 == 0;
#else
  return false;
#endif
}

// One chunk of pool blocks (pc) through block_update for request rows as attend_range describes them: scores
// from the key codes with each block's q' and c, values accumulated from the codes with weights w_t * step_t per
// value group, their offsets' sums added once. Scratch: w (GB * NG score rows of ldsc floats), bytes (2 * NG rows
// of ldsc).
template <int DC, class Src, class Prefetch>
void packed_update(const Src& src, const PackedChunk& pc, const float* qf, float sm_scale, int64_t n, int64_t H,
                   int64_t G, int64_t s, int64_t a, int64_t e, float* m, float* l, float* acc, float* sc,
                   int64_t ldsc, float* w, void* bytes, Prefetch&& prefetch_next) {
  constexpr int BITS = Src::kPackedBits, GS = value_group(DC), NG = DC / GS;
  using Kk = PackedRows<BITS, BITS == 4>;                               // keys: q' is stored split
  using Kv = PackedRows<BITS, BITS == 4 && GS % (2 * VecF::N) == 0>;  // values: unless a pair spans two groups
  const int64_t Hkv = src.Hkv, P = src.P, stride = Hkv * P;
  block_update(
      n, H, G, s, a, e, Hkv, m, l, sc, ldsc,
      [&](auto group, int64_t row, int64_t h, int64_t lim, float* mx) {
        constexpr int GB = decltype(group)::value;
        prefetch_next(row, h);
        alignas(64) float qp[GB * DC];
        float c[GB];
        __m256 vmax[GB];
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) vmax[g] = _mm256_set1_ps(NEG_INF);
        for (int64_t i = 0; i < pc.count && pc.at[i] < lim; ++i) {  // in token order: a segment's padding lanes
          const int64_t kh = (pc.blk[i] * Hkv + h) * DC;             // are overwritten by the next one's scores
          const int64_t cnt = std::min(pc.n[i], lim - pc.at[i]);
#ifdef KVPAGE_AVX512
          if constexpr (packed_int_scores<DC>()) {
            if (src.int_dots) {
              alignas(64) int16_t qi[GB * DC];
              float qs[GB];
              packed_query_i16<DC, GB, BITS>(qf + row * DC, sm_scale, src.key_scale + kh, src.key_zero + kh, qi, qs,
                                             c);
              scores_packed_i16<DC, GB, BITS>(qi, qs, c, src.key + (pc.row[i] + h) * P, stride, cnt, sc + pc.at[i],
                                              ldsc, vmax);
              continue;
            }
          }
#endif
          packed_query<DC, GB, Kk>(qf + row * DC, sm_scale, src.key_scale + kh, src.key_zero + kh, qp, c);
          score_rows<DC, GB, Kk>(qp, src.key + (pc.row[i] + h) * P, stride, cnt, 1.0f, nullptr, 0, c,
                                 sc + pc.at[i], ldsc, vmax);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) mx[g] = hmax8(vmax[g]);
      },
      [&](auto group, int64_t row, int64_t h, int64_t lim, const float* corr) {
        constexpr int GB = decltype(group)::value;
        // the UE5M3 step bytes of the chunk's tokens' value groups (sb[j*ldsc + t]) and their offsets (zb), copied
        // together: they are Hkv * NG bytes apart in the pool
        uint8_t* sb = static_cast<uint8_t*>(bytes);
        int8_t* zb = reinterpret_cast<int8_t*>(sb + NG * ldsc);
        for (int64_t i = 0; i < pc.count && pc.at[i] < lim; ++i) {
          const int64_t cnt = std::min(pc.n[i], lim - pc.at[i]), vstride = Hkv * NG;
          const uint8_t* sp = src.value_scale + (pc.row[i] + h) * NG;
          const int8_t* zp = src.value_zero + (pc.row[i] + h) * NG;
#pragma GCC unroll 4
          for (int j = 0; j < NG; ++j) {
            uint8_t* so = sb + j * ldsc + pc.at[i];
            int8_t* zo = zb + j * ldsc + pc.at[i];
            for (int64_t t = 0; t < cnt; ++t) {
              so[t] = sp[t * vstride + j];
              zo[t] = zp[t * vstride + j];
            }
          }
        }
        // the weights times the steps (w), and the sums of the weights times the steps times the offsets (add):
        // eight tokens at a time, the last lim % 8 one by one
        const float* lut = ue5m3().v;
        float add[GB * NG], one[GB];
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) {
          one[g] = 1.0f;
#pragma GCC unroll 4
          for (int j = 0; j < NG; ++j) {
            const float* p = sc + g * ldsc;
            const uint8_t* sj = sb + j * ldsc;
            const int8_t* zj = zb + j * ldsc;
            float* wj = w + (g * NG + j) * ldsc;
            __m256 acc8 = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= lim; t += 8) {
              const __m256 wt = _mm256_mul_ps(_mm256_loadu_ps(p + t), VecF8::ue5m3(sj + t));
              _mm256_storeu_ps(wj + t, wt);
              acc8 = _mm256_fmadd_ps(wt, VecF8::load(zj + t), acc8);
            }
            float sum = hsum(acc8);
            for (; t < lim; ++t) {
              wj[t] = p[t] * lut[sj[t]];
              sum += wj[t] * static_cast<float>(zj[t]);
            }
            add[g * NG + j] = sum;
          }
        }
#ifdef KVPAGE_AVX512
        if constexpr (packed_int_scores<DC>()) {
          if (src.int_dots && lim <= PackedCodes16<BITS>::kMaxTokens) {
            static_assert(GS == 64, "one value group per 64-channel unit");
            // the weights w' coded in place as int16 (row (g, j) of w read as 2*ldsc int16: code t is written over
            // bytes of floats already read), one scale per (query head, group) of the chunk
            float ws[GB * NG];
#pragma GCC unroll 4
            for (int gj = 0; gj < GB * NG; ++gj) {
              float* wj = w + gj * ldsc;
              int16_t* qj = reinterpret_cast<int16_t*>(wj);
              __m256 mx8 = _mm256_setzero_ps();
              int64_t t = 0;
              for (; t + 8 <= lim; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(wj + t));
              float mx = hmax8(mx8);
              for (; t < lim; ++t) mx = std::max(mx, wj[t]);
              ws[gj] = mx / 32767.0f;
              const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
              const __m256 iv = _mm256_set1_ps(inv);
              for (t = 0; t + 8 <= lim; t += 8) {
                const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(wj + t), iv));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(qj + t),
                                 _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
              }
              for (; t < lim; ++t) qj[t] = static_cast<int16_t>(std::nearbyint(std::min(wj[t] * inv, 32767.0f)));
            }
            const int16_t* wi = reinterpret_cast<const int16_t*>(w);
            for (int64_t i = 0; i < pc.count && pc.at[i] < lim; ++i) {
              accumulate_packed_i16<DC, GB, BITS>(acc + row * DC, i ? one : corr, src.value + (pc.row[i] + h) * P,
                                                  stride, std::min(pc.n[i], lim - pc.at[i]), wi + pc.at[i], 2 * ldsc,
                                                  ws, i ? nullptr : add);
            }
            return;
          }
        }
#endif
        for (int64_t i = 0; i < pc.count && pc.at[i] < lim; ++i) {
          accumulate<DC, GB, Kv, GS>(acc + row * DC, i ? one : corr, src.value + (pc.row[i] + h) * P, stride,
                                    std::min(pc.n[i], lim - pc.at[i]), w + pc.at[i], ldsc, nullptr, 0,
                                    i ? nullptr : add);
        }
      });
}

#endif  // KVPAGE_SIMD

// Online-softmax attention of request r's queries (all n of them) over context tokens [t0, t1), every
// head. State rows are (query j, head qh) -> j * H + qh: m/l [n*H], acc [n*H, D], updated in place.
// GQA: query head qh reads kv head qh / G, as SDPA's enable_gqa does. The SIMD paths gather chunks of
// kChunkTokens: sealed pool blocks are read as packed codes (packed_update) when a whole chunk is made of them,
// any chunk holding a tail or sink block is decoded into float rows (SealedSource::load).

template <int DC, class Src>
void attend_range(const Src& src, const Batch& b, const float* qf, const int16_t* qi, const float* qs, int64_t r,
                  int64_t t0, int64_t t1, float* m, float* l, float* acc, float* kb, float* vb, float* ksb, float* vsb,
                  float* sc, bool has_value) {
  const int64_t D = DC ? DC : b.D, bs = b.bs, H = b.H, Hkv = b.Hkv, G = H / Hkv;
  const int64_t s = b.seq_lens[r], q0 = b.qsl[r], n = b.qsl[r + 1] - q0;
  const int64_t stride = Hkv * D;  // between one token's rows of a head
#ifdef KVPAGE_SIMD
  if constexpr (DC > 0 && DC % VecF::N == 0) {
    // Blocks gathered into chunks of up to kChunkTokens tokens: the per-(block, query head) costs of the
    // online softmax (its rescale, the accumulator's load and store) are paid once per chunk.
    const int64_t per = chunk_blocks(bs);
    for (int64_t blk = t0 / bs; blk * bs < t1; blk += per) {
      const int64_t a = std::max(t0, blk * bs), e = std::min(t1, (blk + per) * bs);
      // The next chunk's rows are asked for while this one is computed on, a kv head at a time (the first query
      // row's first group of each kv head calls it): the block table scatters a request's blocks over the pool,
      // where the hardware prefetchers cannot follow, and a decode step's context comes from memory, not cache.
      const int64_t na = std::min(t1, (blk + per) * bs), ne = std::min(t1, (blk + 2 * per) * bs);
      auto prefetch_next = [&](int64_t row, int64_t h) {
        if (row != h * G) return;
        for (int64_t k = na / bs; k * bs < ne; ++k) {
          const int64_t x = std::max(na, k * bs), y = std::min(ne, (k + 1) * bs);
          src.prefetch_rows(r, k, x - k * bs, y - x, h);
        }
      };
      // block k's tokens [k*bs + off, +nt) go to rows `at` .. of the chunk's buffers
      auto each_block = [&](auto&& f) {
        for (int64_t k = a / bs; k * bs < e; ++k) {
          const int64_t x = std::max(a, k * bs), y = std::min(e, (k + 1) * bs);
          f(k, x - k * bs, y - x, x - a);
        }
      };
      const int64_t ldsc = score_ld(bs);
      if constexpr (Src::kInt8Codes && DC % 16 == 0) {
        if (qi) {  // int8 keys and values read as codes (run_d coded q as int16 for it)
          int8_t* kc = reinterpret_cast<int8_t*>(kb);
          int8_t* vc = reinterpret_cast<int8_t*>(vb);
          each_block([&](int64_t k, int64_t off, int64_t nt, int64_t at) {
            const auto [kr, vr] = src.int8_rows(r, k, off, nt, ksb + at * Hkv, vsb + at * Hkv);
            // copied front to back (the prefetchers stream them), then read by every query head from L1. Tried
            // and dropped (2026-12-06, AMD EPYC Zen 4, one thread): reading each block's rows in place instead
            // (segments, as packed_update does): hot at batch 32, depth 1,024 no faster (1,492-1,546 µs against
            // 1,467-1,613), cold at depth 4,096 slower (7,705-8,264 µs against 6,278-8,273, attention.py).
            std::memcpy(kc + at * stride, kr, nt * stride);
            std::memcpy(vc + at * stride, vr, nt * stride);
          });
          block_update(n, H, G, s, a, e, Hkv, m, l, sc, ldsc,
                       [&](auto group, int64_t row, int64_t h, int64_t lim, float* mx) {
                         prefetch_next(row, h);
                         scores_i8<DC, decltype(group)::value>(qi + row * DC, qs + row, kc + h * DC, stride, lim,
                                                               b.sm_scale, ksb + h, Hkv, sc, ldsc, mx);
                       },
                       [&](auto group, int64_t row, int64_t h, int64_t lim, const float* corr) {
                         accumulate<DC, decltype(group)::value, PlainRows<int8_t>>(
                             acc + row * DC, corr, vc + h * DC, stride, lim, sc, ldsc, vsb + h, Hkv);
                       });
          continue;
        }
      }
      if constexpr (Src::kPackedBits > 0 && packed_fits<DC>()) {
        if (has_value && src.Gv * value_group(DC) == DC) {  // (a key-only layer's values are its keys)
          PackedChunk pc;
          pc.count = 0;
          bool pool = true;
          each_block([&](int64_t k, int64_t off, int64_t nt, int64_t at) {
            int64_t idx = 0;
            pool = pool && src.pool_block(r, k, idx);
            pc.at[pc.count] = at;
            pc.n[pc.count] = nt;
            pc.blk[pc.count] = idx;
            pc.row[pc.count++] = (idx * bs + off) * Hkv;
          });
          if (pool) {  // kb / vb serve as scratch: nothing is decoded
            packed_update<DC>(src, pc, qf, b.sm_scale, n, H, G, s, a, e, m, l, acc, sc, ldsc, kb, vb, prefetch_next);
            continue;
          }
        }
      }
      bool folded = false;
      each_block([&](int64_t k, int64_t off, int64_t nt, int64_t at) {
        folded = src.template load<DC>(r, k, off, nt, kb + at * stride, vb + at * stride, has_value, ksb + at * Hkv,
                                       vsb + at * Hkv);
      });
      const float* ks = folded ? ksb : nullptr;
      const float* vals = has_value ? vb : kb;
      const float* vs = folded ? (has_value ? vsb : ksb) : nullptr;
      block_update(n, H, G, s, a, e, Hkv, m, l, sc, ldsc,
                   [&](auto group, int64_t row, int64_t h, int64_t lim, float* mx) {
                     prefetch_next(row, h);
                     scores_f32<DC, decltype(group)::value>(qf + row * DC, kb + h * DC, stride, lim, b.sm_scale,
                                                            ks ? ks + h : nullptr, Hkv, sc, ldsc, mx);
                   },
                   [&](auto group, int64_t row, int64_t h, int64_t lim, const float* corr) {
                     accumulate<DC, decltype(group)::value, PlainRows<float>>(
                         acc + row * DC, corr, vals + h * DC, stride, lim, sc, ldsc, vs ? vs + h : nullptr, Hkv);
                   });
    }
    return;
  }
#endif
  for (int64_t blk = t0 / bs; blk * bs < t1; ++blk) {
    const int64_t a = std::max(t0, blk * bs), e = std::min(t1, (blk + 1) * bs);
    const int64_t nt = e - a;
    src.template load<DC>(r, blk, a - blk * bs, nt, kb, vb, has_value, nullptr, nullptr);
    const float* vals = has_value ? vb : kb;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t lim = std::min(e, s - n + j + 1) - a;  // query j sees keys 0 .. s-n+j
      if (lim <= 0) continue;
      for (int64_t qh = 0; qh < H; ++qh) {
        const int64_t row = j * H + qh, h = qh / G;
        const float* qv = qf + (j * H + qh) * D;  // the request's queries in float32
        const float* kh = kb + h * D;
        float mx = NEG_INF;
        for (int64_t t = 0; t < lim; ++t) {
          const float* kr = kh + t * stride;
          float dsum = 0.0f;
#pragma omp simd reduction(+ : dsum)
          for (int64_t d = 0; d < D; ++d) dsum += qv[d] * kr[d];
          sc[t] = dsum * b.sm_scale;
          mx = std::max(mx, sc[t]);
        }
        const float corr = softmax_update(sc, lim, mx, m[row], l[row]);
        float* ac = acc + row * D;
        const float* vh = vals + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ac[d] *= corr;
        for (int64_t t = 0; t < lim; ++t) {
          const float p = sc[t];
          const float* vr = vh + t * stride;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ac[d] += p * vr[d];
        }
      }
    }
  }
}

#ifdef KVPAGE_SIMD
constexpr int64_t kScoreRows = kMaxGroup;  // score rows a work item holds: one query-head group's
#else
constexpr int64_t kScoreRows = 1;
#endif

template <int DC, class Src>
void run_d(const Src& src, const Batch& b, const int64_t* reqs, int64_t nreq, bool has_value) {
  const int64_t D = b.D, H = b.H;
  const int64_t threads = at::get_num_threads();
  // Work items: (request, context split). Decode rows of long contexts split when items are scarce.
  struct Item { int64_t r, t0, t1, slot; };
  std::vector<Item> items;
  std::vector<int64_t> first(nreq + 1, 0);
  const int64_t min_split = 256;
  int64_t max_rows = H;
  for (int64_t i = 0; i < nreq; ++i) {
    const int64_t r = reqs[i], s = b.seq_lens[r], n = b.qsl[r + 1] - b.qsl[r];
    max_rows = std::max(max_rows, n * H);
    int64_t splits = 1;
    if (n == 1 && nreq < 2 * threads && s >= 2 * min_split) {
      splits = std::min<int64_t>((2 * threads + nreq - 1) / nreq, s / min_split);
    }
    int64_t chunk = (s + splits - 1) / splits;
    chunk = (chunk + b.bs - 1) / b.bs * b.bs;
    splits = (s + chunk - 1) / chunk;
    first[i + 1] = first[i] + splits;
    for (int64_t p = 0; p < splits; ++p) items.push_back({r, p * chunk, std::min(s, (p + 1) * chunk), first[i] + p});
  }
  const int64_t nslots = first[nreq];
  bool int8_keys = false;
#ifdef KVPAGE_SIMD
  if constexpr (Src::kInt8Codes && DC > 0 && DC % VecF::N == 0) int8_keys = src.int8_codes_ok(has_value);
#endif
  std::vector<float> M(nslots * max_rows, NEG_INF), L(nslots * max_rows, 0.0f), A(nslots * max_rows * D, 0.0f);
  // Items are taken largest first by whichever thread is free (a shared counter over the list sorted by tokens x
  // query rows: longest-processing-time-first, scheduled dynamically). A batch's contexts differ in length, and
  // at::parallel_for's one contiguous range per thread left a thread idle for part of each step (the 32-request
  // mix of vs_vllm.py: the op 1.66x faster on two threads than on one, 1.8x with this).
  const int64_t nitems = static_cast<int64_t>(items.size());
  std::vector<int64_t> order(nitems);
  for (int64_t w = 0; w < nitems; ++w) order[w] = w;
  auto cost = [&](const Item& it) { return (it.t1 - it.t0 + b.bs) * (b.qsl[it.r + 1] - b.qsl[it.r]); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost(items[x]) > cost(items[y]); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, nitems), 1, [&](int64_t, int64_t) {
    const int64_t ct = chunk_blocks(b.bs) * b.bs;  // tokens per chunk (attend_range)
    std::vector<float> kb(ct * b.Hkv * D), vb(ct * b.Hkv * D), ksb(ct * b.Hkv), vsb(ct * b.Hkv), sc(score_ld(b.bs) * kScoreRows),
        qf(max_rows * D), qs(int8_keys ? max_rows : 0);
    std::vector<int16_t> qi(int8_keys ? max_rows * D : 0);
    const uint8_t* q = static_cast<const uint8_t*>(b.q);
    const int64_t qsize = b.q_enc == F32 ? 4 : 2;
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < nitems;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[order[k]];
      const int64_t q0 = b.qsl[it.r], n = b.qsl[it.r + 1] - q0;
      rows_to_float(b.q_enc, q + q0 * H * D * qsize, qf.data(), n * H * D);
      if (int8_keys) quantize_rows_i16(qf.data(), n * H, D, qi.data(), qs.data());
      attend_range<DC>(src, b, qf.data(), int8_keys ? qi.data() : nullptr, qs.data(), it.r, it.t0, it.t1,
                       M.data() + it.slot * max_rows, L.data() + it.slot * max_rows, A.data() + it.slot * max_rows * D,
                       kb.data(), vb.data(), ksb.data(), vsb.data(), sc.data(), has_value);
    }
  });
  // merge the splits of each request and write out
  at::parallel_for(0, nreq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    uint8_t* out = static_cast<uint8_t*>(b.out);
    const int64_t osize = b.out_enc == F32 ? 4 : 2;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = reqs[i], q0 = b.qsl[r], n = b.qsl[r + 1] - q0, splits = first[i + 1] - first[i];
      for (int64_t row = 0; row < n * H; ++row) {
        float mx = NEG_INF;
        for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, M[(first[i] + p) * max_rows + row]);
        float lsum = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t p = 0; p < splits; ++p) {
          const int64_t slot = first[i] + p;
          const float mp = M[slot * max_rows + row];
          if (mp == NEG_INF) continue;
          const float f = splits == 1 ? 1.0f : exp_neg(mp - mx);
          lsum += L[slot * max_rows + row] * f;
          const float* a = A.data() + (slot * max_rows + row) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += a[d] * f;
        }
        const float inv = 1.0f / lsum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        float_to_rows(b.out_enc, o.data(), out + (q0 * H + row) * D * osize, D);  // row = j * H + qh
      }
    }
  });
}

// Dispatch to a compile-time head_dim where it is a common one (unrolled, fixed-width loops).
template <class Src>
void run(const Src& src, const Batch& b, const int64_t* reqs, int64_t nreq, bool has_value) {
  switch (b.D) {
    case 64: run_d<64>(src, b, reqs, nreq, has_value); break;
    case 128: run_d<128>(src, b, reqs, nreq, has_value); break;
    case 96: run_d<96>(src, b, reqs, nreq, has_value); break;
    case 80: run_d<80>(src, b, reqs, nreq, has_value); break;
    default: run_d<0>(src, b, reqs, nreq, has_value);
  }
}

const float* opt_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }
const c10::Half* opt_half(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const c10::Half*>(t->data_ptr()) : nullptr;
}

Batch make_batch(const at::Tensor& out, const at::Tensor& q, const at::Tensor& seq_lens, const at::Tensor& qsl,
                 int64_t Hkv, int64_t bs, double sm_scale) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3, "q must be contiguous [T, H, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && qsl.scalar_type() == at::kLong, "seq_lens/query_start_loc must be int64");
  TORCH_CHECK(q.size(1) % Hkv == 0, "query heads must be a multiple of kv heads");
  return Batch{q.data_ptr(), out.data_ptr(), float_encoding(q.scalar_type()), float_encoding(out.scalar_type()),
               seq_lens.data_ptr<int64_t>(), qsl.data_ptr<int64_t>(), q.size(1), Hkv, q.size(2), bs,
               static_cast<float>(sm_scale)};
}

}  // namespace

// Whether paged_attention reads int8 keys and values (with per-row scales) as codes at this head_dim in this
// build: q is then coded as int16 per (token, head) row (scores_i8), which tests reproduce to compare with the
// reference.
bool int8_keys_as_codes(int64_t head_dim) {
#ifdef KVPAGE_SIMD
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;  // run()'s fixed widths
#else
  (void)head_dim;
  return false;
#endif
}

// Attention over token-wise format blocks (float32/bf16/fp16 rows, int8/e4m3 codes with optional float16
// per-(token, head) scales and optional float32 per-channel static scales [Hkv, D]).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor key, at::Tensor value,
                     c10::optional<at::Tensor> key_scale, c10::optional<at::Tensor> value_scale,
                     c10::optional<at::Tensor> key_chan, c10::optional<at::Tensor> value_chan,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs,
                     int64_t enc, double sm_scale) {
  TORCH_CHECK(key.dim() == 4 && key.is_contiguous() && value.is_contiguous(), "key/value must be contiguous [NB, bs, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables must be int64");
  TORCH_CHECK(elem_size(enc) == key.element_size(), "encoding does not match the key tensor's dtype");
  const int64_t bs = key.size(1), Hkv = key.size(2), D = key.size(3);
  Batch b = make_batch(out, q, seq_lens, query_start_loc, Hkv, bs, sm_scale);
  TORCH_CHECK(b.D == D, "head_dim of q and the cache differ");
  const bool has_value = true;
  auto go = [&](auto tag) {
    constexpr int E = decltype(tag)::value;
    TokenSource<E> src{static_cast<const uint8_t*>(key.data_ptr()), static_cast<const uint8_t*>(value.data_ptr()),
                       opt_half(key_scale), opt_half(value_scale), opt_ptr(key_chan), opt_ptr(value_chan),
                       block_tables.data_ptr<int64_t>(), block_tables.size(1), bs, Hkv, D, elem_size(enc)};
    run(src, b, reqs.data_ptr<int64_t>(), reqs.numel(), has_value);
  };
  switch (enc) {
    case F32: go(std::integral_constant<int, F32>{}); break;
    case BF16: go(std::integral_constant<int, BF16>{}); break;
    case F16: go(std::integral_constant<int, F16>{}); break;
    case I8: go(std::integral_constant<int, I8>{}); break;
    case E4M3: go(std::integral_constant<int, E4M3>{}); break;
    default: TORCH_CHECK(false, "unknown encoding ", enc);
  }
}

// Whether sealed_attention with int_dots takes integer dot products over sealed pool blocks at this head_dim in
// this build (scores_packed_i16, accumulate_packed_i16); elsewhere int_dots changes nothing.
bool sealed_int_dots(int64_t head_dim) {
#ifdef KVPAGE_AVX512
  return head_dim == 64 || head_dim == 128;  // packed_int_scores over run()'s fixed widths
#else
  (void)head_dim;
  return false;
#endif
}

// Attention over quantize-on-seal (KIVI) layers: see SealedSource. Key-only layers pass has_value=false
// (value tensors are then not read; pass the key tensors in their place). int_dots: SealedSource's.
void sealed_attention(at::Tensor out, at::Tensor q, at::Tensor key, at::Tensor key_scale, at::Tensor key_zero,
                      at::Tensor value, at::Tensor value_scale, at::Tensor value_zero, at::Tensor tail_key,
                      at::Tensor tail_value, at::Tensor sink_key, at::Tensor sink_key_scale, at::Tensor sink_value,
                      at::Tensor sink_value_scale, at::Tensor src_kind, at::Tensor src_idx, at::Tensor src_sink,
                      int64_t sink_rows, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs, int64_t bits,
                      int64_t tail_enc, bool has_value, double sm_scale, bool int_dots) {
  const int64_t bs = key.size(1), Hkv = key.size(2), P = key.size(3), D = key_scale.size(2);
  TORCH_CHECK(D <= 512, "head_dim above 512");
  TORCH_CHECK(src_kind.scalar_type() == at::kByte && src_idx.scalar_type() == at::kLong, "src_kind uint8, src_idx int64");
  TORCH_CHECK(src_sink.scalar_type() == at::kLong && src_sink.numel() == src_kind.size(0), "src_sink: int64 [B]");
  TORCH_CHECK(sink_rows >= 1 && sink_rows <= bs, "sink_rows must be in 1 .. block_size");
  TORCH_CHECK(tail_key.element_size() == 2, "tail rows must be 16-bit");
  TORCH_CHECK(key_zero.scalar_type() == at::kChar && value_zero.scalar_type() == at::kChar,
              "zero points must be int8 offsets (format version 2)");
  Batch b = make_batch(out, q, seq_lens, query_start_loc, Hkv, bs, sm_scale);
  TORCH_CHECK(b.D == D, "head_dim of q and the cache differ");
  const int64_t Gv = has_value ? value_scale.size(3) : 1;
  auto go = [&](auto bt, auto tt) {
    constexpr int BITS = decltype(bt)::value;
    constexpr int TAIL = decltype(tt)::value;
    SealedSource<BITS, TAIL> src{
        key.data_ptr<uint8_t>(), key_scale.data_ptr<uint8_t>(), key_zero.data_ptr<int8_t>(),
        value.data_ptr<uint8_t>(), value_scale.data_ptr<uint8_t>(), value_zero.data_ptr<int8_t>(),
        static_cast<const uint8_t*>(tail_key.data_ptr()), static_cast<const uint8_t*>(tail_value.data_ptr()),
        sink_key.data_ptr<uint8_t>(), reinterpret_cast<const c10::Half*>(sink_key_scale.data_ptr()),
        sink_value.data_ptr<uint8_t>(), reinterpret_cast<const c10::Half*>(sink_value_scale.data_ptr()),
        src_kind.data_ptr<uint8_t>(), src_idx.data_ptr<int64_t>(), src_sink.data_ptr<int64_t>(), src_kind.size(1), bs,
        Hkv, D, P, Gv, sink_rows, int_dots};
    run(src, b, reqs.data_ptr<int64_t>(), reqs.numel(), has_value);
  };
  TORCH_CHECK(bits == 4 || bits == 3 || bits == 2, "bits must be 4, 3 or 2");
  TORCH_CHECK(P == (D * bits + 7) / 8, "packed rows of ", P, " bytes do not hold ", D, " codes of ", bits, " bits");
  TORCH_CHECK(tail_enc == F16 || tail_enc == BF16, "tail rows must be float16 or bfloat16");
  if (bits == 4 && tail_enc == F16) go(std::integral_constant<int, 4>{}, std::integral_constant<int, F16>{});
  else if (bits == 4) go(std::integral_constant<int, 4>{}, std::integral_constant<int, BF16>{});
  else if (bits == 3 && tail_enc == F16) go(std::integral_constant<int, 3>{}, std::integral_constant<int, F16>{});
  else if (bits == 3) go(std::integral_constant<int, 3>{}, std::integral_constant<int, BF16>{});
  else if (tail_enc == F16) go(std::integral_constant<int, 2>{}, std::integral_constant<int, F16>{});
  else go(std::integral_constant<int, 2>{}, std::integral_constant<int, BF16>{});
}

