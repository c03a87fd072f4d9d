// The Python module of the CPU attention kernels (loaded by engine/model/cpu_kernels.py).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, int64_t layer, double scale,
                           int64_t sliding_window);
bool paged_prefill_supported(int64_t dtype_is_bf16, int64_t head_dim, int64_t block_size,
                             int64_t group);
void paged_prefill(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                   torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor context_lens,
                   int64_t layer, double scale, int64_t sliding_window, torch::Tensor out);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged-attention decode over block tables (CPU)");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether paged_prefill is built for this dtype and shape");
  m.def("paged_prefill", &paged_prefill,
        "causal paged-attention prefill of chunks over their cached context (CPU, bfloat16)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after a fused residual add (bfloat16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (bfloat16)");
  m.def("rotary_", &rotary_, "rotary embedding of the first heads, in place (bfloat16)");
}
