// kvpage CPU kernels: the Python module (torch.utils.cpp_extension builds every .cpp of this folder into it).
#include <torch/extension.h>

#include <tuple>

// paged_attention.cpp
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor key, at::Tensor value,
                     c10::optional<at::Tensor> key_scale, c10::optional<at::Tensor> value_scale,
                     c10::optional<at::Tensor> key_chan, c10::optional<at::Tensor> value_chan,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs,
                     int64_t enc, double sm_scale);
bool int8_keys_as_codes(int64_t head_dim);
bool sealed_int_dots(int64_t head_dim);
void sealed_attention(at::Tensor out, at::Tensor q, at::Tensor key, at::Tensor key_scale, at::Tensor key_zero,
                      at::Tensor value, at::Tensor value_scale, at::Tensor value_zero, at::Tensor tail_key,
                      at::Tensor tail_value, at::Tensor sink_key, at::Tensor sink_key_scale, at::Tensor sink_value,
                      at::Tensor sink_value_scale, at::Tensor src_kind, at::Tensor src_idx, at::Tensor src_sink,
                      int64_t sink_rows, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs, int64_t bits,
                      int64_t tail_enc, bool has_value,
                      double sm_scale, bool int_dots);
// write_rows.cpp
void write_rows(at::Tensor cache, c10::optional<at::Tensor> scale, at::Tensor x, at::Tensor slots, int64_t enc,
                double qmax);
void move_rows(at::Tensor dst, at::Tensor dst_idx, at::Tensor src, at::Tensor src_idx);
// seal_blocks.cpp
void seal_blocks(at::Tensor codes, at::Tensor scale, at::Tensor zero, at::Tensor blocks, at::Tensor ids, bool key,
                 int64_t bits, int64_t group, double max_error, int64_t step_lo, int64_t step_hi);
void unseal_blocks(at::Tensor out, at::Tensor codes, at::Tensor scale, at::Tensor zero, at::Tensor ids, bool key,
                   int64_t bits, int64_t group);
// gguf_matmul.cpp
at::Tensor gguf_matmul(at::Tensor x, at::Tensor w, int64_t type, int64_t N);
at::Tensor gguf_dequantize(at::Tensor w, int64_t type, int64_t N, int64_t K, bool bf16);
// amx_linear.cpp
bool amx_linear_available();
at::Tensor amx_pack_linear(at::Tensor w);
at::Tensor amx_unpack_linear(at::Tensor packed, int64_t N, int64_t K);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t N, int64_t K);
// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                                          at::Tensor positions, int64_t H, int64_t Hkv);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor hadamard_rows(at::Tensor x);
void merge_attention(at::Tensor out, at::Tensor oa, at::Tensor la, at::Tensor ob, at::Tensor lb, int64_t skip);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over token-wise format blocks (CPU)");
  m.def("int8_keys_as_codes", &int8_keys_as_codes,
        "whether paged_attention reads int8 keys as codes, q coded as int16, at this head_dim (CPU)");
  m.def("sealed_attention", &sealed_attention, "paged attention over quantize-on-seal blocks (CPU)");
  m.def("sealed_int_dots", &sealed_int_dots,
        "whether sealed_attention's int_dots takes integer dot products over pool blocks at this head_dim (CPU)");
  m.def("write_rows", &write_rows, "fused quantize-and-store of new K or V rows (CPU)");
  m.def("move_rows", &move_rows, "dst[dst_idx] = src[src_idx] row by row (CPU)");
  m.def("seal_blocks", &seal_blocks, "quantize-on-seal of whole int4/int3/int2 blocks into the pool (CPU)");
  m.def("unseal_blocks", &unseal_blocks, "dequantize whole int4/int3/int2 pool blocks (the inverse of seal_blocks, CPU)");
  m.def("gguf_matmul", &gguf_matmul, "x @ W.T with W as tiles of GGUF Q4_0/Q4_1/Q8_0 blocks, expanded in registers (CPU)");
  m.def("gguf_dequantize", &gguf_dequantize, "tiles of GGUF Q4_0/Q4_1/Q8_0 blocks to a dense float32 or bfloat16 matrix (CPU)");
  m.def("amx_linear_available", &amx_linear_available,
        "whether this build and CPU run amx_linear (AMX tiles with bfloat16, the OS granting the tile state)");
  m.def("amx_pack_linear", &amx_pack_linear, "a bfloat16 weight [N, K] packed into AMX B tiles (CPU)");
  m.def("amx_unpack_linear", &amx_unpack_linear, "the dense [N, K] weight of amx_pack_linear's tiles (CPU)");
  m.def("amx_linear", &amx_linear, "x @ W.T in bfloat16 from AMX-packed W, float32 sums (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("rope_split", &rope_split, "RoPE on q/k of a fused qkv projection, split into q, k, v (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up projection (CPU)");
  m.def("merge_attention", &merge_attention,
        "the log-sum-exp merge of two attentions of the same queries over disjoint keys (CPU)");
  m.def("hadamard_rows", &hadamard_rows, "x @ R (block Hadamard) of float32 rows by row-independent butterflies (CPU)");
}
