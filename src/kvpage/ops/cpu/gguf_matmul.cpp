// GGUF block-quantized weights multiplied as shipped: y = x @ W.T from ggml's Q4_0 / Q4_1 / Q8_0 blocks.
//
// ggml's blocks (block_q4_0 / block_q4_1 / block_q8_0) hold 32 weights along K: a float16 step d (Q4_1: and a
// float16 minimum m), then the codes -- Q4_0 / Q4_1 code j in the low nibble of byte j and code j + 16 in its high
// nibble, Q8_0 32 int8 codes. Every weight is w = d * q + mn with mn = -8d (Q4_0), m (Q4_1) or 0 (Q8_0, q signed);
// d * q is exact in float32 (an 11-bit step times a code of at most 8 bits), so w is gguf-py's dequantized weight
// bit for bit.
//
// Tile layout (the same bytes, reordered once at load by kvpage.model.quantized_linear.to_tiles): weight rows in
// groups of four (N padded with zero rows); per group, block after block, the four rows' steps (float16), then for
// Q4_1 their four minimums, then the four rows' codes one after another. A block of a group then needs one load
// and one conversion for all its scales.
//
// The product (small M: decode steps): each row of x is coded once per call as int16 with one scale
// (x ~ xs * xi, |xi| <= 32767 -- the error, half of max|x| / 32767, is 1/128 of rounding x to bfloat16), and
// y[m, n] = xs * sum_b (d_b * sum_j q_j * xi_j + mn_b * sum_j xi_j): the code products in int32 (VNNI's
// vpdpwssd where the CPU has it, exact: |q * xi| sums stay below 2^31), scaled per block in float32. Weights are
// read in their 4.5-8.5 bits and expanded in registers; each tile of four weight rows is read once per four rows
// of x. Larger inputs decode W to a dense matrix (gguf_dequantize) for the BLAS instead.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kv_common.h"

#if defined(__AVX2__) && defined(__F16C__)
#define KVPAGE_GGUF_SIMD 1  // (kv_common.h includes immintrin.h on these CPUs)
#endif

using namespace kvpage_cpu;

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids (gguf.GGMLQuantizationType)
constexpr int64_t kBlock = 32;                       // weights per block
constexpr int64_t kTileRows = 4;                     // weight rows per tile
// How far ahead of the block being multiplied its lines are prefetched. A decode step streams every weight
// from the last-level cache or memory once, with little arithmetic per byte, and the hardware prefetcher
// alone keeps too few lines in flight: measured on the bundled model's 121 projections (one token, one
// thread, 90 MB of blocks), 14.3 ms without, 8.8 ms at 4 KiB ahead (2 KiB 9.3, 8 KiB 9.3); the copy bound
// of those bytes was 7.5 ms.
constexpr int64_t kPrefetchBytes = 4096;

// Bytes of one row's scales and of its codes in a block.
constexpr int64_t scale_bytes(int64_t t) { return t == kQ4_1 ? 4 : 2; }
constexpr int64_t code_bytes(int64_t t) { return t == kQ8_0 ? 32 : 16; }
constexpr int64_t tile_block_bytes(int64_t t) { return kTileRows * (scale_bytes(t) + code_bytes(t)); }

void check_type(int64_t type) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0, "gguf tiles: ggml type ", type,
              " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
}

inline float half_bits(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Row j of a tile's block: its step d, offset mn (w = d * q + mn) and codes.
template <int64_t T>
inline void row_of_block(const uint8_t* blk, int64_t j, float& d, float& mn, const uint8_t*& codes) {
  uint16_t h;
  std::memcpy(&h, blk + 2 * j, 2);
  d = half_bits(h);
  if constexpr (T == kQ4_1) {
    std::memcpy(&h, blk + 2 * kTileRows + 2 * j, 2);
    mn = half_bits(h);
  } else {
    mn = T == kQ4_0 ? -8.0f * d : 0.0f;
  }
  codes = blk + kTileRows * scale_bytes(T) + j * code_bytes(T);
}

// Row j of a tile's block decoded: w[0..31] = d * q + mn.
template <int64_t T>
inline void decode_row_block(const uint8_t* blk, int64_t j, float* w) {
  float d, mn;
  const uint8_t* q;
  row_of_block<T>(blk, j, d, mn, q);
  if constexpr (T == kQ8_0) {
#pragma omp simd
    for (int k = 0; k < 32; ++k) w[k] = std::fma(static_cast<float>(static_cast<int8_t>(q[k])), d, mn);
  } else {
#pragma omp simd
    for (int k = 0; k < 16; ++k) {
      w[k] = std::fma(static_cast<float>(q[k] & 15), d, mn);
      w[k + 16] = std::fma(static_cast<float>(q[k] >> 4), d, mn);
    }
  }
}

// x rows coded as int16 with one scale per row (see the top), and each block's sum of codes.
struct CodedRows {
  std::vector<int16_t> xi;  // [M, K]
  std::vector<float> xs;    // [M]
  std::vector<float> sx;    // [M, K / 32]: sum of a block's codes (exact in float32: |sum| <= 32 * 32767)
};

CodedRows code_rows(const float* x, int64_t M, int64_t K) {
  CodedRows c{std::vector<int16_t>(M * K), std::vector<float>(M), std::vector<float>(M * (K / kBlock))};
  for (int64_t i = 0; i < M; ++i) {
    const float* r = x + i * K;
    if (!std::all_of(r, r + K, [](float v) { return std::isfinite(v); })) {
      // a NaN or infinite input makes its whole output row NaN (as a float matmul would, at least)
      c.xs[i] = std::numeric_limits<float>::quiet_NaN();
      continue;  // codes and sums stay 0
    }
    quantize_rows_i16(r, 1, K, c.xi.data() + i * K, c.xs.data() + i);
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const int16_t* v = c.xi.data() + i * K + b * kBlock;
      c.sx[i * (K / kBlock) + b] = static_cast<float>(std::accumulate(v, v + kBlock, int32_t{0}));
    }
  }
  return c;
}

#ifdef KVPAGE_GGUF_SIMD
#if defined(__AVX512VL__)
constexpr int kMaxXRows = 4;  // 32 vector registers: 16 accumulators, 8 expanded weight halves, x
#else
constexpr int kMaxXRows = 2;  // 16 registers
#endif

// y[i * ldy + j] = xs[i] * (x_i . W_row_j) for MR rows of x and the tile's four weight rows (j < nt written).
template <int64_t T, int MR>
inline void tile_rows(const uint8_t* tile, int64_t nb, const CodedRows& c, int64_t i0, int64_t K, float* y,
                      int64_t ldy, int64_t nt) {
  constexpr int64_t tb = tile_block_bytes(T);
  __m256 acc[MR][kTileRows];
  __m128 macc[MR];  // lane j: sum_b mn_b(j) * sx_b
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    macc[i] = _mm_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < kTileRows; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const __m128i nib = _mm_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * tb;
    if (i0 == 0) prefetch_lines<3>(blk + kPrefetchBytes, tb);  // later passes over the tile find it in cache
    __m128 d4, m4;
    if constexpr (T == kQ4_1) {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      d4 = _mm256_castps256_ps128(dm);
      m4 = _mm256_extractf128_ps(dm, 1);
    } else {
      d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
      m4 = T == kQ4_0 ? _mm_mul_ps(d4, _mm_set1_ps(-8.0f)) : _mm_setzero_ps();
    }
    const uint8_t* codes = blk + kTileRows * scale_bytes(T);
    __m256i wl[kTileRows], wh[kTileRows];  // codes 0..15 and 16..31 of each row as int16
    __m256 dj[kTileRows];
#pragma GCC unroll 4
    for (int j = 0; j < kTileRows; ++j) {
      if constexpr (T == kQ8_0) {
        wl[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * j)));
        wh[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * j + 16)));
      } else {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j));
        wl[j] = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
        wh[j] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
      }
      dj[j] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), _mm256_set1_epi32(j));
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int16_t* xr = c.xi.data() + (i0 + i) * K + b * kBlock;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
#pragma GCC unroll 4
      for (int j = 0; j < kTileRows; ++j) {
        const __m256i p = dot_i16(dot_i16(_mm256_setzero_si256(), wl[j], x0), wh[j], x1);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dj[j], acc[i][j]);
      }
      if constexpr (T != kQ8_0) macc[i] = _mm_fmadd_ps(m4, _mm_set1_ps(c.sx[(i0 + i) * nb + b]), macc[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    alignas(16) float mz[4];
    _mm_store_ps(mz, macc[i]);
    for (int64_t j = 0; j < nt; ++j) y[i * ldy + j] = c.xs[i0 + i] * (hsum(acc[i][j]) + mz[j]);
  }
}
#endif

// The same sums, portably: the tile's rows decoded to float32, one block at a time, against the coded rows.
template <int64_t T>
void tile_rows_portable(const uint8_t* tile, int64_t nb, const CodedRows& c, int64_t i0, int64_t mr, int64_t K,
                        float* y, int64_t ldy, int64_t nt) {
  constexpr int64_t tb = tile_block_bytes(T);
  float w[32];
  for (int64_t j = 0; j < nt; ++j) {
    for (int64_t i = 0; i < mr; ++i) {
      double s = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        decode_row_block<T>(tile + b * tb, j, w);
        const int16_t* xr = c.xi.data() + (i0 + i) * K + b * kBlock;
        float p = 0.0f;
        for (int k = 0; k < 32; ++k) p += w[k] * static_cast<float>(xr[k]);
        s += p;
      }
      y[i * ldy + j] = c.xs[i0 + i] * static_cast<float>(s);
    }
  }
}

template <int64_t T>
void matmul_t(const uint8_t* tiles, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t nb = K / kBlock, tiles_n = (N + kTileRows - 1) / kTileRows, tile_bytes = nb * tile_block_bytes(T);
  const CodedRows c = code_rows(x, M, K);
  // tasks of about 64 K-wide row products, so that a call splits over threads without tiny tasks
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * kTileRows * M));
  at::parallel_for(0, tiles_n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = tiles + t * tile_bytes;
      const int64_t n0 = t * kTileRows, nt = std::min(kTileRows, N - n0);
#ifdef KVPAGE_GGUF_SIMD
      int64_t i0 = 0;
      for (; i0 + kMaxXRows <= M; i0 += kMaxXRows) tile_rows<T, kMaxXRows>(tile, nb, c, i0, K, y + i0 * N + n0, N, nt);
      switch (M - i0) {
        case 3: tile_rows<T, 3>(tile, nb, c, i0, K, y + i0 * N + n0, N, nt); break;
        case 2: tile_rows<T, 2>(tile, nb, c, i0, K, y + i0 * N + n0, N, nt); break;
        case 1: tile_rows<T, 1>(tile, nb, c, i0, K, y + i0 * N + n0, N, nt); break;
        default: break;
      }
#else
      tile_rows_portable<T>(tile, nb, c, 0, M, K, y + n0, N, nt);
#endif
    }
  });
}


template <class F>
void by_type(int64_t type, F&& f) {
  check_type(type);
  if (type == kQ4_0) return f(std::integral_constant<int64_t, kQ4_0>{});
  if (type == kQ4_1) return f(std::integral_constant<int64_t, kQ4_1>{});
  return f(std::integral_constant<int64_t, kQ8_0>{});
}

void check_tiles(const at::Tensor& w, int64_t type, int64_t N, int64_t K) {
  check_type(type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf tiles: a contiguous uint8 CPU tensor is needed");
  TORCH_CHECK(N > 0 && K > 0 && K % kBlock == 0, "gguf tiles: N must be positive and K a positive multiple of 32, "
              "got N = ", N, ", K = ", K);
  const int64_t want = (N + kTileRows - 1) / kTileRows * (K / kBlock) * tile_block_bytes(type);
  TORCH_CHECK(w.numel() == want, "gguf tiles: ", w.numel(), " bytes do not hold [", N, ", ", K,
              "] weights of ggml type ", type, " (", want, " bytes)");
}

}  // namespace

// y [M, N] = x [M, K] @ W.T, W given as tiles (see the top) of ggml type `type`; x float32, bfloat16 or float16
// (converted to float32, then coded as int16), y in x's dtype, accumulated in int32 per block and float32 across.
at::Tensor gguf_matmul(at::Tensor x, at::Tensor w, int64_t type, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gguf_matmul: x must be a 2-D CPU tensor [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_tiles(w, type, N, K);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    by_type(type, [&](auto t) {
      matmul_t<decltype(t)::value>(w.data_ptr<uint8_t>(), N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
    });
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// W [N, K] decoded from tiles, in float32, or with bf16 in bfloat16 (each float32 weight rounded to nearest even).
at::Tensor gguf_dequantize(at::Tensor w, int64_t type, int64_t N, int64_t K, bool bf16) {
  check_tiles(w, type, N, K);
  at::Tensor out = at::empty({N, K}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  const int64_t nb = K / kBlock, tiles_n = (N + kTileRows - 1) / kTileRows;
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    const int64_t tile_bytes = nb * tile_block_bytes(T);
    at::parallel_for(0, tiles_n, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t tt = begin; tt < end; ++tt) {
        for (int64_t j = 0; j < kTileRows && tt * kTileRows + j < N; ++j) {
          const int64_t n = tt * kTileRows + j;
          float* dst = bf16 ? row.data() : out.data_ptr<float>() + n * K;
          for (int64_t b = 0; b < nb; ++b)
            decode_row_block<T>(src + tt * tile_bytes + b * tile_block_bytes(T), j, dst + b * kBlock);
          if (bf16)  // rounded while in cache
            float_to_bf16(row.data(), reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + n * K, K);
        }
      }
    });
  });
  return out;
}
