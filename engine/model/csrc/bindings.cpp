// The Python module of the CPU attention kernels (loaded by engine/model/cpu_kernels.py).
#include <torch/extension.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor context_lens, int64_t layer, double scale,
                        int64_t sliding_window);
at::Tensor paged_decode_quantized(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t layer, double scale,
                                  int64_t sliding_window, int64_t kind, bool rotate_query);
int64_t int8_decode_query_bits(int64_t head_dim);
void kv_write_quantized(at::Tensor kv_cache, at::Tensor slot_rows, at::Tensor k, at::Tensor v,
                        int64_t layer, int64_t kind, bool rotate_keys);
void dequantize_kv_blocks(at::Tensor kv_cache, at::Tensor block_ids, int64_t layer, int64_t kind,
                          bool rotate_keys, at::Tensor out);
int64_t read_kv_blocks(at::Tensor kv_cache, at::Tensor block_tables, at::Tensor context_lens,
                       int64_t layer);
bool paged_prefill_supported(const std::string& dtype, int64_t head_dim, int64_t block_size,
                             int64_t group);
void paged_prefill(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor q_starts,
                   at::Tensor q_lens, at::Tensor context_lens, int64_t layer, double scale,
                   int64_t sliding_window, at::Tensor out);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps,
                    c10::optional<at::Tensor> residual);
at::Tensor silu_and_mul(at::Tensor gate_up);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t num_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged-attention decode over block tables (CPU)");
  m.def("paged_decode_quantized", &paged_decode_quantized,
        "paged-attention decode over an 8-bit (int8 | fp8 e4m3) cache, read in place (CPU)");
  m.def("int8_decode_query_bits", &int8_decode_query_bits,
        "16 where paged_decode_quantized scores int8 keys against int16 query codes, else 0");
  m.def("kv_write_quantized", &kv_write_quantized,
        "quantize a step's new K/V into their 8-bit cache rows (int8 keys Hadamard-rotated)");
  m.def("dequantize_kv_blocks", &dequantize_kv_blocks,
        "one layer of some 8-bit blocks, dequantized into a scratch cache (CPU)");
  m.def("read_kv_blocks", &read_kv_blocks,
        "read the bytes paged decode reads for one layer, nothing else (a benchmark's floor)");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether paged_prefill is built for this dtype ('bfloat16', 'float32') and shape");
  m.def("paged_prefill", &paged_prefill,
        "causal paged-attention prefill of chunks over their cached context (CPU)");
  m.def("rms_norm", &rms_norm,
        "RMSNorm, optionally after a fused residual add (float32, bfloat16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (float32, bfloat16)");
  m.def("rotary_", &rotary_, "rotary embedding of the first heads, in place (float32, bfloat16)");
}
