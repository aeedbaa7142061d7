// kvpage CPU kernels: the fused write of new K or V rows of the token-wise formats into their slots, and plain
// row moves (the tail and seal-batch gathers of the quantize-on-seal formats).
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstring>

#include "kv_common.h"

using namespace kvpage_cpu;

// Fused write of token-wise formats: new rows x [N, Hkv, D] (float32/bfloat16/float16, already in the stored
// basis) go to
// slots [N] of cache [NB*bs, Hkv, D]. Float encodings cast; int8/e4m3 compute the float16 per-(token,
// head) scale s = max(amax / qmax, 2^-14) and codes with the rounded scale, as the Python formats do
// (kvpage.formats.per_token), bit for bit.
void write_rows(at::Tensor cache, c10::optional<at::Tensor> scale, at::Tensor x, at::Tensor slots, int64_t enc,
                double qmax) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 3, "x must be contiguous [N, Hkv, D]");
  const int64_t xenc = float_encoding(x.scalar_type());
  TORCH_CHECK(cache.is_contiguous() && elem_size(enc) == cache.element_size(), "cache dtype does not match the encoding");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "slots must be int64 [N]");
  const int64_t N = x.size(0), Hkv = x.size(1), D = x.size(2);
  TORCH_CHECK(D <= 512, "head_dim above 512");
  const int64_t rows_total = cache.numel() / (Hkv * D);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < rows_total, "slot ", sl[i], " out of range");
  const uint8_t* xs = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t xsize = x.element_size();
  uint8_t* base = static_cast<uint8_t*>(cache.data_ptr());
  c10::Half* sc = scale.has_value() ? reinterpret_cast<c10::Half*>(scale->data_ptr()) : nullptr;
  const float fq = static_cast<float>(qmax);
  at::parallel_for(0, N * Hkv, 16, [&](int64_t begin, int64_t end) {
    float srcbuf[512];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / Hkv, h = w % Hkv;
      rows_to_float(xenc, xs + w * D * xsize, srcbuf, D);
      const float* src = srcbuf;
      const int64_t drow = sl[i] * Hkv + h;
      uint8_t* dst = base + drow * D * elem_size(enc);
      if (enc == F32) {
        std::memcpy(dst, src, D * 4);
      } else if (enc == BF16) {
        float_to_bf16(src, reinterpret_cast<uint16_t*>(dst), D);
      } else if (enc == F16) {
        c10::Half* o = reinterpret_cast<c10::Half*>(dst);
        for (int64_t d = 0; d < D; ++d) o[d] = c10::Half(src[d]);
      } else {
        // rows are clamped to qmax * 65504 first (an inf saturates), as PerTokenFormat.to_stored_basis does
        const float limit = fq * 65504.0f;
        float row[512];
        float amax = 0.0f;
        int32_t nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
        for (int64_t d = 0; d < D; ++d) {
          row[d] = src[d] > limit ? limit : (src[d] < -limit ? -limit : src[d]);
          const float a = std::fabs(row[d]);
          nan |= std::isnan(a) ? 1 : 0;
          amax = a > amax ? a : amax;  // a NaN is never greater: it only sets the flag
        }
        float s = amax / fq;
        s = nan ? std::numeric_limits<float>::quiet_NaN() : (s < 6.103515625e-05f ? 6.103515625e-05f : s);
        const c10::Half s16(s);
        if (sc) sc[drow] = s16;
        const float sf = static_cast<float>(s16);
        if (enc == I8) {
          int32_t code[512];  // via int32 so the lanes convert, then narrow, as vectors
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) {
            float y = std::nearbyint(row[d] / sf);
            y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
            code[d] = std::isnan(y) ? 0 : static_cast<int32_t>(y);
          }
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<uint8_t>(static_cast<int8_t>(code[d]));
        } else {
          for (int64_t d = 0; d < D; ++d) {
            float y = row[d] / sf;
            y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
            const c10::Float8_e4m3fn f(y);
            dst[d] = f.x;
          }
        }
      }
    }
  });
}


// Row moves: dst[dst_idx[i]] = src[src_idx[i]] for each i, a row being everything after dim 0 (both tensors
// contiguous, one dtype, rows of one size). dst_idx must name distinct rows (as index_copy_ wants).
void move_rows(at::Tensor dst, at::Tensor dst_idx, at::Tensor src, at::Tensor src_idx) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.dim() >= 1 && src.dim() >= 1,
              "dst and src must be contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "dst and src must share a dtype");
  TORCH_CHECK(dst_idx.scalar_type() == at::kLong && src_idx.scalar_type() == at::kLong && dst_idx.is_contiguous() &&
                  src_idx.is_contiguous() && dst_idx.numel() == src_idx.numel(),
              "dst_idx and src_idx must be contiguous int64 of one length");
  const int64_t R = dst.size(0), S = src.size(0);
  const int64_t row = R ? dst.numel() / R * dst.element_size() : 0;
  TORCH_CHECK(S == 0 || src.numel() / S * src.element_size() == row, "dst and src rows differ in size");
  const int64_t n = dst_idx.numel();
  const int64_t* di = dst_idx.data_ptr<int64_t>();
  const int64_t* si = src_idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(di[i] >= 0 && di[i] < R && si[i] >= 0 && si[i] < S, "row index out of range");
  uint8_t* d = static_cast<uint8_t*>(dst.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(d + di[i] * row, s + si[i] * row, row);
  });
}
