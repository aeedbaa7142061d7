// kvpage CPU kernels: the small per-layer ops of a Llama-family decoder, fused so that a layer is a few
// calls instead of ~35 (each torch op costs microseconds of dispatch at decode batch sizes), and the
// log-sum-exp merge of two partial attentions.
//
// Each op keeps torch's rounding points for the model dtype T (float32, bfloat16 or float16): a value is
// rounded to T wherever the unfused PyTorch expression materializes a T tensor, so results differ from
// it only where the unfused code reduces in another order (RMSNorm's mean) or uses another exp (SiLU).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kv_common.h"

// 512-bit vectors for the loops GCC vectorises here, where the CPU has them (its tuning for Intel's AVX-512 parts
// prefers 256): silu_mul of a decode batch (32 x 1,536 bfloat16) 54 -> 36 us, of a 1,840-token prefill 3.3 -> 2.6 ms
// (Xeon, AVX-512, one thread); RMSNorm 8.2 -> 6.8 us. Not for paged_attention.cpp: attention.py ran ~10% slower. After
// the includes, so torch's headers compile as they do everywhere else.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

// torch rounds every product and sum separately; keep the compiler from fusing them into FMAs here
#pragma GCC optimize("fp-contract=off")

namespace {

using kvpage_cpu::exp_neg;

// Storage traits: how a model-dtype element is read as float32 and rounded back (round to nearest even,
// as torch rounds). bfloat16 is handled as raw bits so the loops vectorize.
template <typename T>
struct Elem {
  using S = T;
  static inline float get(S x) { return static_cast<float>(x); }
  static inline S put(float x) { return static_cast<S>(x); }
};
template <>
struct Elem<c10::BFloat16> {
  using S = uint16_t;
  static inline float get(S b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline S put(float f) {  // c10's round_to_nearest_even, branch-free
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<S>(f != f ? 0x7FC0u : r);
  }
};

template <typename T>
void rms_norm_impl(const void* xv, const void* wv, void* outv, int64_t rows, int64_t E, float eps) {
  using S = typename Elem<T>::S;
  const S* x = static_cast<const S*>(xv);
  const S* w = static_cast<const S*>(wv);
  S* out = static_cast<S*>(outv);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* xr = x + r * E;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < E; ++i) {
        const float v = Elem<T>::get(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
      S* o = out + r * E;
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) {
        const float y = Elem<T>::get(Elem<T>::put(Elem<T>::get(xr[i]) * inv));  // xf * rsqrt(...) -> T
        o[i] = Elem<T>::put(Elem<T>::get(w[i]) * y);                             // weight * y
      }
    }
  });
}

template <typename T>
void rope_split_impl(const void* qkvv, const void* cosv, const void* sinv, const int64_t* pos, void* qv, void* kv,
                     void* vv, int64_t Tn, int64_t H, int64_t Hkv, int64_t D) {
  using S = typename Elem<T>::S;
  const S* qkv = static_cast<const S*>(qkvv);
  const S* cos = static_cast<const S*>(cosv);
  const S* sin = static_cast<const S*>(sinv);
  S* q = static_cast<S*>(qv);
  S* k = static_cast<S*>(kv);
  S* v = static_cast<S*>(vv);
  const int64_t half = D / 2, heads = H + 2 * Hkv;
  at::parallel_for(0, Tn, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* c = cos + pos[t] * D;
      const S* s = sin + pos[t] * D;
      for (int64_t h = 0; h < heads; ++h) {
        const S* x = qkv + (t * heads + h) * D;
        S* dst = h < H ? q + (t * H + h) * D : (h < H + Hkv ? k + (t * Hkv + h - H) * D : v + (t * Hkv + h - H - Hkv) * D);
        if (h >= H + Hkv) {
          std::memcpy(dst, x, D * sizeof(S));
          continue;
        }
        // x * cos + roll(x, D/2) * sin_signed, each product rounded to T, then the sum
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const int64_t dr = d < half ? d + half : d - half;
          const float a = Elem<T>::get(Elem<T>::put(Elem<T>::get(x[d]) * Elem<T>::get(c[d])));
          const float b = Elem<T>::get(Elem<T>::put(Elem<T>::get(x[dr]) * Elem<T>::get(s[d])));
          dst[d] = Elem<T>::put(a + b);
        }
      }
    }
  });
}

// One row of silu(gate) * up; restrict-qualified and outside the parallel lambda so it vectorizes.
template <typename T>
void silu_row(const typename Elem<T>::S* __restrict g, const typename Elem<T>::S* __restrict u,
              typename Elem<T>::S* __restrict o, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float x = Elem<T>::get(g[i]);
    const float e = exp_neg(-std::fabs(x));               // e^-|x|
    const float sl = (x >= 0.0f ? x : x * e) / (1.0f + e);   // x / (1 + e^-x)
    const float sr = Elem<T>::get(Elem<T>::put(sl));         // F.silu(gate) -> T
    o[i] = Elem<T>::put(sr * Elem<T>::get(u[i]));            // * up -> T
  }
}

template <typename T>
void silu_mul_impl(const void* guv, void* outv, int64_t rows, int64_t I) {
  using S = typename Elem<T>::S;
  const S* gu = static_cast<const S*>(guv);
  S* out = static_cast<S*>(outv);
  at::parallel_for(0, rows, 4, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_row<T>(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I);
  });
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t);
  }
}

}  // namespace

// RMSNorm over the last dim: x [rows, E], weight [E], both of the model dtype; returns [rows, E].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: contiguous x and weight of one dtype");
  const int64_t E = x.size(-1);
  TORCH_CHECK(weight.numel() == E, "rms_norm: weight must have ", E, " elements");
  at::Tensor out = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() / E, E, static_cast<float>(eps));
  });
  return out;
}

// RoPE (rotate-half) on the q and k heads of qkv [T, H + 2*Hkv, D] at positions [T] of the tables
// cos / sin_signed [P, D]; returns contiguous q [T, H, D], k [T, Hkv, D], v [T, Hkv, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                                          at::Tensor positions, int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 3 && qkv.size(1) == H + 2 * Hkv, "rope_split: qkv [T, H+2Hkv, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(), "rope_split: tables of the model dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0), "rope_split: positions [T]");
  const int64_t Tn = qkv.size(0), D = qkv.size(2), P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tn; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " out of range [0, ", P, ")");
  auto opts = qkv.options();
  at::Tensor q = at::empty({Tn, H, D}, opts), k = at::empty({Tn, Hkv, D}, opts), v = at::empty({Tn, Hkv, D}, opts);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rope_split_impl<T>(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                       Tn, H, Hkv, D);
  });
  return {q, k, v};
}

// SwiGLU's silu(gate) * up from gate_up [rows, 2*I] (gate columns first); returns [rows, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous [rows, 2*I]");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_mul_impl<T>(gate_up.data_ptr(), out.data_ptr(), rows, I);
  });
  return out;
}

namespace {

// One stage of stride H over a Sylvester block of N floats: the pairs (j + i, j + i + H) are independent, so any
// order gives the same bits as hadamard_transform's; constant trip counts let the compiler unroll and vectorize the
// small strides (a `#pragma omp simd` on a 1- or 2-trip loop cost 5x in masked prologues).
template <int64_t N, int64_t H>
inline void fwht_stage(float* __restrict a) {
  if constexpr (H < N) {
    for (int64_t j = 0; j < N; j += 2 * H) {
      for (int64_t i = 0; i < H; ++i) {
        const float u = a[j + i], w = a[j + i + H];
        a[j + i] = u + w;
        a[j + i + H] = u - w;
      }
    }
    fwht_stage<N, 2 * H>(a);
  }
}

template <int64_t N>
inline void fwht_fixed(float* __restrict a, float s) {
  fwht_stage<N, 1>(a);
  for (int64_t i = 0; i < N; ++i) a[i] *= s;
}

// One block of n = 2^k floats in place: stages h = 1, 2, 4, ... (a + b, a - b), then one multiply by s.
inline void fwht_block(float* __restrict a, int64_t n, float s) {
  switch (n) {
    case 1: fwht_fixed<1>(a, s); return;
    case 2: fwht_fixed<2>(a, s); return;
    case 4: fwht_fixed<4>(a, s); return;
    case 8: fwht_fixed<8>(a, s); return;
    case 16: fwht_fixed<16>(a, s); return;
    case 32: fwht_fixed<32>(a, s); return;
    case 64: fwht_fixed<64>(a, s); return;
    case 128: fwht_fixed<128>(a, s); return;
    case 256: fwht_fixed<256>(a, s); return;
    case 512: fwht_fixed<512>(a, s); return;
    default: break;
  }
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t j = 0; j < n; j += 2 * h)
      for (int64_t i = j; i < j + h; ++i) {
        const float u = a[i], w = a[i + h];
        a[i] = u + w;
        a[i + h] = u - w;
      }
  for (int64_t i = 0; i < n; ++i) a[i] *= s;
}

}  // namespace

// x @ R along the last dim of float32 rows, R the block-diagonal Sylvester-Hadamard matrix of
// kvpage.formats.rotation (blocks of the binary decomposition of D, largest first): the very butterflies of
// hadamard_transform (stage h = 1, 2, 4, ...: a + b, a - b; then one multiply by float32(1/sqrt(n))), so each
// row's result is bit-identical to the Python one and depends on that row alone. Returns a new tensor.
at::Tensor hadamard_rows(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0,
              "hadamard_rows: contiguous float32 [..., D]");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  int64_t sizes[64];
  float scales[64];
  int nb = 0;
  for (int b = 62; b >= 0; --b) {
    const int64_t n = int64_t{1} << b;
    if (D & n) {
      sizes[nb] = n;
      scales[nb++] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
    }
  }
  at::Tensor out = x.clone();
  float* y = out.data_ptr<float>();
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = y + r * D;
      int64_t start = 0;
      for (int p = 0; p < nb; ++p) {
        fwht_block(row + start, sizes[p], scales[p]);
        start += sizes[p];
      }
    }
  };
  if (rows * D < 32768) {
    body(0, rows);  // a decode step's q/k/v: not worth a parallel region
  } else {
    at::parallel_for(0, rows, 64, body);
  }
  return out;
}

// The flash-decoding merge of two attentions of the same queries over disjoint key sets, each with its
// log-sum-exp: out = (wa * oa + wb * ob) / (wa + wb), wa = exp(la - m), wb = exp(lb - m), m = max(la, lb), in
// float32 (torch's expression, rounded at its points), stored in out's dtype. Both inputs are in the folded GQA
// layout of flash attention over a kv head's keys: query p's head h = c * g + i (kv head c, H = Hkv * g heads) is
// row p * g + i of kv head c. a: oa [Hkv, n * g, Dv], la [Hkv, n * g] float32; its first `skip` queries read no
// key (their la taken as -inf). b: the queries as nb blocks of bs (flash's batched output): ob [nb, Hkv, bs * g,
// Dv], lb [nb, Hkv, bs * g] float32, query p at block p / bs, row (p % bs) * g + i (queries from n on are padding,
// never read). oa and ob: any strides with contiguous channels (flash's outputs as they come, no copy); la and lb
// any strides. out [n, H, Dv] contiguous.
void merge_attention(at::Tensor out, at::Tensor oa, at::Tensor la, at::Tensor ob, at::Tensor lb, int64_t skip) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && oa.dim() == 3 && la.dim() == 2 && ob.dim() == 4 &&
                  lb.dim() == 3 && oa.stride(2) == 1 && ob.stride(3) == 1,
              "merge_attention: out [n, H, Dv] contiguous, oa [Hkv, n * g, Dv] and ob [nb, Hkv, bs * g, Dv] with "
              "contiguous channels, la [Hkv, n * g], lb [nb, Hkv, bs * g]");
  TORCH_CHECK(la.scalar_type() == at::kFloat && lb.scalar_type() == at::kFloat, "la and lb must be float32");
  const int64_t n = out.size(0), H = out.size(1), Dv = out.size(2), Hkv = oa.size(0), nb = ob.size(0);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "merge_attention: out's heads are not a multiple of oa's kv heads");
  const int64_t g = H / Hkv;
  TORCH_CHECK(ob.size(2) % g == 0, "merge_attention: ob's rows are not whole queries");
  const int64_t bs = ob.size(2) / g;
  TORCH_CHECK(oa.size(1) == n * g && oa.size(2) == Dv && la.size(0) == Hkv && la.size(1) == n * g,
              "oa / la do not match out");
  TORCH_CHECK(ob.size(1) == Hkv && ob.size(3) == Dv && nb * bs >= n && lb.size(0) == nb && lb.size(1) == Hkv &&
                  lb.size(2) == bs * g,
              "ob / lb do not match out");
  const int64_t eo = kvpage_cpu::float_encoding(out.scalar_type()), ea = kvpage_cpu::float_encoding(oa.scalar_type()),
                eb = kvpage_cpu::float_encoding(ob.scalar_type());
  const uint8_t* pa = static_cast<const uint8_t*>(oa.data_ptr());
  const uint8_t* pb = static_cast<const uint8_t*>(ob.data_ptr());
  uint8_t* po = static_cast<uint8_t*>(out.data_ptr());
  const int64_t sa = oa.element_size(), sb = ob.element_size(), so = out.element_size();
  const int64_t a0 = oa.stride(0), a1 = oa.stride(1), b0 = ob.stride(0), b1 = ob.stride(1), b2 = ob.stride(2);
  const int64_t la0 = la.stride(0), la1 = la.stride(1), lb0 = lb.stride(0), lb1 = lb.stride(1), lb2 = lb.stride(2);
  const float* lap = la.data_ptr<float>();
  const float* lbp = lb.data_ptr<float>();
  at::parallel_for(0, n * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xa(Dv), xb(Dv), y(Dv);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t p = w / H, h = w % H, c = h / g, i = h % g;
      const int64_t ra = p * g + i, j = p / bs, rb = (p % bs) * g + i;  // rows of a and b
      const float a = p < skip ? -std::numeric_limits<float>::infinity() : lap[c * la0 + ra * la1];
      const float b = lbp[j * lb0 + c * lb1 + rb * lb2];
      const float m = a > b || std::isnan(a) ? a : b;  // torch.maximum (NaN propagates)
      const float wa = std::exp(a - m), wb = std::exp(b - m), den = wa + wb;
      if (p < skip) {  // a's row may be unwritten (no key): never read it, however it is filled
        std::fill(xa.begin(), xa.end(), 0.0f);
      } else {
        kvpage_cpu::rows_to_float(ea, pa + (c * a0 + ra * a1) * sa, xa.data(), Dv);
      }
      kvpage_cpu::rows_to_float(eb, pb + (j * b0 + c * b1 + rb * b2) * sb, xb.data(), Dv);
      for (int64_t d = 0; d < Dv; ++d) y[d] = (wa * xa[d] + wb * xb[d]) / den;
      kvpage_cpu::float_to_rows(eo, y.data(), po + (p * H + h) * Dv * so, Dv);
    }
  });
}
