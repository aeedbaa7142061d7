// bfloat16 linear layers on AMX tiles: y = x @ W.T with W packed once into the tile layout the TMUL reads.
//
// Why: a decode step multiplies a few rows of x by every weight once, so it streams the weights from the last-level
// cache or memory with little arithmetic per byte. oneDNN's packed bfloat16 linear (model/linear.py's fallback)
// spends ~15 us per call and streams SmolLM2-135M's layers at ~8 GB/s at 32 rows on one core; this kernel takes
// ~1 us per call and, with the weights' lines prefetched 4 KiB ahead and the next k-step's tiles loaded while this
// one's products run, ~10 GB/s (a decode step's 121 projections at 32 rows: 31 ms -> 22 ms, one thread).
//
// AMX (Intel's Advanced Matrix Extensions): eight tile registers of up to 16 rows x 64 bytes; TDPBF16PS
// C[16 x 16 float32] += A[16 x 32 bfloat16] . B, where B holds 16 pairs of k along its rows: B[kp][2n + e] =
// W[n][2kp + e] (Intel's "VNNI" layout). Tile layout of a packed weight W [N, K] (N padded to 16, K to 32 with zeros):
// column block nb (16 outputs), then k-step ks (32 inputs), then the 1 KiB B tile of those: bytes
// ((nb * KS + ks) * 16 + kp) * 64 + n * 4 + e * 2 hold W[16 nb + n][32 ks + 2 kp + e]. One column block's tiles are
// contiguous, so a thread streams its blocks front to back.
//
// The product: x padded to whole tiles (rows to 16, K to 32); output blocks of 32 columns (two B tiles) by 32 rows
// (two A tiles, read straight from x) accumulate in four C tiles over all of K; rows beyond 32 run the same blocks
// again with K in even slices of at most kKSlice steps, the column pair's weight slice staying in L1 while every
// 32-row chunk passes over it (partial sums parked in float32 between slices), and x in blocks of kRowBlock rows,
// each kept in L2 while all the weights pass. Sums are float32 and each output is rounded once to bfloat16 (round
// to nearest even): F.linear's contract in bfloat16 on CPU, up to summation order.
//
// Where it is slower: prefill. Compute-bound at 256-2,048 rows, a product here takes ~40 cycles a TDPBF16PS against
// oneDNN's ~26 (a decoder layer's four projections: 1.0x oneDNN's time at 128 rows, 0.83x at 256-512, 0.72-0.77x at
// 2,048); one packed copy serves both, so prefill pays that (benchmarks/ab_commits.py's mix, prefill included, is the
// check).
//
// Where the CPU or the build has no AMX (or the kernel is denied the tile state), amx_linear_available() is false and
// amx_linear raises (packing and unpacking still work, by scalar loops); model/linear.py then packs for oneDNN.
//
// Two departures from F.linear besides summation order: TDPBF16PS and VCVTNEPS2BF16 treat denormal inputs and
// results as zero. And the tile state: each call configures the tiles on every thread it runs on and releases them
// at the end, so AMX code elsewhere in the process must configure its own tiles per call (torch's brgemm users call
// brgemm_release at the end of their ops, which makes the next call configure again).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVPAGE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileK = 32;       // bfloat16 inputs per k-step (one 64-byte tile row of A)
constexpr int64_t kTileN = 16;       // outputs per B tile
constexpr int64_t kTileBytes = 1024;  // one tile: 16 rows x 64 bytes

#ifdef KVPAGE_AMX
// How far ahead of the tile being multiplied the weights' lines are asked for (into L2). A 32-row step over
// SmolLM2-135M's 121 projections, one thread: none 28.5 ms, 2 KiB 27.6, 4 KiB 26.8, 8 KiB 26.8, 16 KiB 26.9
// (prefetcht0 at 16 KiB: 36 ms).
constexpr int64_t kPrefetchBytes = 4096;
// k-steps per slice when x has more than 32 rows (prefill): measured at 64-512 rows, 8-18 within a few percent.
constexpr int64_t kKSlice = 16;
// Rows of x per pass over the weights (a multiple of 32): 256 rows of 1,536 inputs are 786 KB, inside L2.
constexpr int64_t kRowBlock = 256;

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool tile_state_granted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// r[16] rows of a [16 x 16] matrix of 32-bit lanes -> r[c] = column c (bit patterns moved, not converted): two
// unpack stages within 128-bit lanes, then two stages of 128-bit lane shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // now r[4i + j], 128-bit lane L, holds rows 4i..4i+3 of column 4L + j
  __m512 o[16];
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    o[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    o[8 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);
    o[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    o[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int c = 0; c < 16; ++c) r[c] = o[c];
}

// Every tile 16 rows of 64 bytes (palette 1). Tiles: C 0-3, A 4-5, B 6-7.
void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// C[32 rows (MT = 2) or 16 (MT = 1) x 32 columns] += x rows . the k-steps [0, KS) of two column blocks' tiles w0, w1
// (w1 == nullptr: one block, C tiles 0 and 2 only). x: A tiles at row stride xs bytes, 64 bytes per k-step.
// cbuf: [MT * 2][16][16] float32, read first when load_c (a later K slice), written at the end.
// Tiles are not renamed by the hardware, so each load of the next k-step sits right after the last product that
// reads the tile it replaces: the loads then overlap the remaining products.
template <int MT, bool PAIR>
void multiply_block(const char* x, int64_t xs, const char* w0, const char* w1, int64_t KS, float* cbuf, bool load_c,
                    bool prefetch) {
  if (load_c) {
    _tile_loadd(0, cbuf, 64);
    if constexpr (PAIR) _tile_loadd(1, cbuf + 256, 64);
    if constexpr (MT > 1) _tile_loadd(2, cbuf + 512, 64);
    if constexpr (MT > 1 && PAIR) _tile_loadd(3, cbuf + 768, 64);
  } else {
    _tile_zero(0);
    if constexpr (PAIR) _tile_zero(1);
    if constexpr (MT > 1) _tile_zero(2);
    if constexpr (MT > 1 && PAIR) _tile_zero(3);
  }
  _tile_loadd(4, x, xs);
  _tile_loadd(6, w0, 64);
  if constexpr (PAIR) _tile_loadd(7, w1, 64);
  if constexpr (MT > 1) _tile_loadd(5, x + 16 * xs, xs);
  for (int64_t ks = 0; ks < KS; ++ks) {
    const bool more = ks + 1 < KS;
    const char* b0 = w0 + (ks + 1) * kTileBytes;
    const char* b1 = PAIR ? w1 + (ks + 1) * kTileBytes : nullptr;
    const char* a = x + (ks + 1) * 64;
    if (prefetch) {
      for (int64_t o = 0; o < kTileBytes; o += 64) __builtin_prefetch(b0 + kPrefetchBytes + o, 0, 2);
      if constexpr (PAIR) {
        for (int64_t o = 0; o < kTileBytes; o += 64) __builtin_prefetch(b1 + kPrefetchBytes + o, 0, 2);
      }
    }
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PAIR) _tile_dpbf16ps(1, 4, 7);
    if (more) _tile_loadd(4, a, xs);
    if constexpr (MT > 1) {
      _tile_dpbf16ps(2, 5, 6);
      if (more) _tile_loadd(6, b0, 64);
      if constexpr (PAIR) _tile_dpbf16ps(3, 5, 7);
      if (more) {
        if constexpr (PAIR) _tile_loadd(7, b1, 64);
        _tile_loadd(5, a + 16 * xs, xs);
      }
    } else if (more) {
      _tile_loadd(6, b0, 64);
      if constexpr (PAIR) _tile_loadd(7, b1, 64);
    }
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (PAIR) _tile_stored(1, cbuf + 256, 64);
  if constexpr (MT > 1) _tile_stored(2, cbuf + 512, 64);
  if constexpr (MT > 1 && PAIR) _tile_stored(3, cbuf + 768, 64);
}

// Dispatch on the rows (16 or 32) and on whether the second column block exists.
void multiply(int64_t rows, bool pair, const char* x, int64_t xs, const char* w0, const char* w1, int64_t KS,
              float* cbuf, bool load_c, bool prefetch) {
  if (rows == 32) {
    if (pair) multiply_block<2, true>(x, xs, w0, w1, KS, cbuf, load_c, prefetch);
    else multiply_block<2, false>(x, xs, w0, w1, KS, cbuf, load_c, prefetch);
  } else {
    if (pair) multiply_block<1, true>(x, xs, w0, w1, KS, cbuf, load_c, prefetch);
    else multiply_block<1, false>(x, xs, w0, w1, KS, cbuf, load_c, prefetch);
  }
}

// y rows [0, rows) (at most 32, of which `valid` exist), columns [n0, n0 + 32) clipped to N, from cbuf's tiles
// (C tile (m / 16) * 2 + column block), each float rounded to bfloat16 (nearest even).
void store_rows(const float* cbuf, int64_t valid, c10::BFloat16* y, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < valid; ++m) {
    for (int64_t t = 0; t < 2 && n0 + t * 16 < N; ++t) {
      const float* c = cbuf + ((m / 16) * 2 + t) * 256 + (m % 16) * 16;
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c));
      const int64_t nc = n0 + t * 16, width = std::min<int64_t>(16, N - nc);
      c10::BFloat16* dst = y + m * N + nc;
      if (width == 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
      } else {
        _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << width) - 1), v);
      }
    }
  }
}
#endif  // KVPAGE_AMX

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "amx_pack_linear: the weight must be a 2-D bfloat16 CPU tensor [N, K], got ", w.scalar_type(), " ",
              w.sizes());
}

int64_t blocks(int64_t n, int64_t b) { return (n + b - 1) / b; }

}  // namespace

bool amx_linear_available() {
#ifdef KVPAGE_AMX
  return tile_state_granted();
#else
  return false;
#endif
}

at::Tensor amx_pack_linear(at::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), NB = blocks(N, kTileN), KS = blocks(K, kTileK);
  at::Tensor dense = w.contiguous();
  at::Tensor out = at::zeros({NB * KS * kTileBytes / 2}, w.options());
  const c10::BFloat16* s = dense.data_ptr<c10::BFloat16>();
  c10::BFloat16* d = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
#ifdef KVPAGE_AMX
      if (K % kTileK == 0) {  // 16 rows' 64 bytes of a k-step, transposed as 32-bit pairs, are the tile
        const int64_t nn = std::min<int64_t>(kTileN, N - nb * kTileN);
        for (int64_t ks = 0; ks < KS; ++ks) {
          __m512 r[16];
          for (int64_t n = 0; n < 16; ++n) {
            r[n] = n < nn ? _mm512_loadu_ps(reinterpret_cast<const float*>(s + (nb * kTileN + n) * K + ks * kTileK))
                          : _mm512_setzero_ps();
          }
          transpose16(r);
          float* t = reinterpret_cast<float*>(d + (nb * KS + ks) * (kTileBytes / 2));
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(t + 16 * i, r[i]);
        }
        continue;
      }
#endif
      for (int64_t n = nb * kTileN; n < std::min(N, (nb + 1) * kTileN); ++n) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t ks = k / kTileK, kp = (k % kTileK) / 2, e = k % 2;
          d[(nb * KS + ks) * (kTileBytes / 2) + kp * 32 + (n % kTileN) * 2 + e] = s[n * K + k];
        }
      }
    }
  });
  return out;
}

at::Tensor amx_unpack_linear(at::Tensor packed, int64_t N, int64_t K) {
  const int64_t NB = blocks(N, kTileN), KS = blocks(K, kTileK);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == NB * KS * kTileBytes / 2,
              "amx_unpack_linear: packed holds ", packed.numel(), " elements, not the tiles of a [", N, ", ", K,
              "] weight");
  at::Tensor out = at::empty({N, K}, packed.options());
  const c10::BFloat16* s = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* d = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t nn = std::min<int64_t>(kTileN, N - nb * kTileN);
#ifdef KVPAGE_AMX
      if (K % kTileK == 0) {  // a tile is [16 kp][16 n] pairs of bfloat16: its transpose is 16 rows' 64 bytes
        for (int64_t ks = 0; ks < KS; ++ks) {
          const float* t = reinterpret_cast<const float*>(s + (nb * KS + ks) * (kTileBytes / 2));
          __m512 r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(t + 16 * i);
          transpose16(r);
          for (int64_t n = 0; n < nn; ++n) {
            _mm512_storeu_ps(reinterpret_cast<float*>(d + (nb * kTileN + n) * K + ks * kTileK), r[n]);
          }
        }
        continue;
      }
#endif
      for (int64_t n = nb * kTileN; n < nb * kTileN + nn; ++n) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t ks = k / kTileK, kp = (k % kTileK) / 2, e = k % 2;
          d[n * K + k] = s[(nb * KS + ks) * (kTileBytes / 2) + kp * 32 + (n % kTileN) * 2 + e];
        }
      }
    }
  });
  return out;
}

at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t N, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "amx_linear: x must be a 2-D bfloat16 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "amx_linear: x has ", x.size(1), " inputs, the packed weight ", K);
  const int64_t M = x.size(0), NB = blocks(N, kTileN), KS = blocks(K, kTileK);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == NB * KS * kTileBytes / 2,
              "amx_linear: packed holds ", packed.numel(), " elements, not the tiles of a [", N, ", ", K, "] weight");
#ifdef KVPAGE_AMX
  TORCH_CHECK(tile_state_granted(), "amx_linear: the OS did not grant this process the AMX tile state");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0 || K == 0) return y.zero_();  // (K == 0: empty sums)
  const int64_t Mp = blocks(M, 16) * 16, Kp = KS * kTileK;
  at::Tensor xp = x;
  if (Mp != M || Kp != K || !x.is_contiguous()) {  // whole tiles, zeros outside x
    xp = at::zeros({Mp, Kp}, x.options());
    xp.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  const char* xd = reinterpret_cast<const char*>(xp.data_ptr());
  const char* wd = reinterpret_cast<const char*>(packed.data_ptr());
  c10::BFloat16* yd = y.data_ptr<c10::BFloat16>();
  const int64_t xs = Kp * 2, pairs = blocks(NB, 2);
  // Rows of x in blocks of kRowBlock, each block over every weight: a block's rows stay in L2 while the weights
  // stream past (x itself may not fit: 2,048 rows of 576 inputs are 2.4 MB).
  for (int64_t r0 = 0; r0 < Mp; r0 += kRowBlock) {
    const int64_t rn = std::min(kRowBlock, Mp - r0), chunks = blocks(rn, 32);
    const char* xr = xd + r0 * xs;
    c10::BFloat16* yr = yd + r0 * N;
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      configure_tiles();
      std::vector<float> acc(chunks * 1024);  // [chunk][4 tiles][16][16] partial sums
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t nb = 2 * p;
        const bool pair = nb + 1 < NB;
        const char* w0 = wd + nb * KS * kTileBytes;
        const char* w1 = pair ? w0 + KS * kTileBytes : nullptr;
        const int64_t slice = chunks == 1 ? KS : blocks(KS, blocks(KS, kKSlice));  // even slices of <= kKSlice
        for (int64_t k0 = 0; k0 < KS; k0 += slice) {
          const int64_t kn = std::min(slice, KS - k0);
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t rows = std::min<int64_t>(32, rn - 32 * c);
            multiply(rows, pair, xr + 32 * c * xs + k0 * 64, xs, w0 + k0 * kTileBytes,
                     pair ? w1 + k0 * kTileBytes : nullptr, kn, acc.data() + c * 1024, k0 > 0, c == 0 && r0 == 0);
          }
        }
        for (int64_t c = 0; c < chunks; ++c) {
          store_rows(acc.data() + c * 1024, std::min<int64_t>(32, M - r0 - 32 * c), yr + 32 * c * N, N,
                     nb * kTileN);
        }
      }
      _tile_release();
    });
  }
  return y;
#else
  (void)M;
  TORCH_CHECK(false, "amx_linear: this build has no AMX (see amx_linear_available)");
  return at::Tensor();
#endif
}

