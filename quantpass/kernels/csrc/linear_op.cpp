// quantpass::linear_cpu_cxx: the cpu backend's graph op in C++, so a compiled graph reaches the C
// kernels (csrc/linear_avx2.c, loaded separately) without a Python body or ctypes on each call.
//
// Built and loaded at run time by quantpass/kernels/cpu_op.py against the running torch's headers
// (only the few this file names, so it builds in seconds). The schema is the one of
// quantpass::linear_cpu (defined in Python, kernels/cpu.py), quantpass::linear's arguments (input_scale:
// a static activation key's); where the fast path does not apply (an activation key, M above the
// format's limit, a format other than INT8/INT4, a layout or dtype the kernels don't read), this op
// calls quantpass::linear_cpu itself, so both ops always give the same result.
//
// `quantpass::_cpu_op_setup` hands over, once, the kernel's entry point (qp_linear's address) and
// the table of weight keys the kernels run: key -> (bits, mode, most rows).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Entry = int (*)(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w,
                      const float *s, int64_t N, int64_t kp, int bits, const void *bias, int btype, void *out,
                      int64_t ldo, int otype, int mode, int threads);

struct Fast {
  int bits, mode;
  int64_t most;  // the most activation rows the kernels take for this format
};

Entry entry = nullptr;
std::unordered_map<std::string, Fast> fast;

int type_code(c10::ScalarType type) {  // csrc/linear_avx2.c's F32, BF16, F16; -1: not read
  switch (type) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    default: return -1;
  }
}

void setup(int64_t address, std::vector<std::string> keys, std::vector<int64_t> bits, std::vector<int64_t> modes,
           std::vector<int64_t> most) {
  TORCH_CHECK(keys.size() == bits.size() && keys.size() == modes.size() && keys.size() == most.size(),
              "quantpass::_cpu_op_setup: keys, bits, modes and most must have one entry per key");
  fast.clear();
  for (size_t i = 0; i < keys.size(); i++) fast[keys[i]] = Fast{(int)bits[i], (int)modes[i], most[i]};
  entry = reinterpret_cast<Entry>(address);
}

at::Tensor generic(const at::Tensor &x, const at::Tensor &w_data, const at::Tensor &w_scale,
                   const std::optional<at::Tensor> &w_scale2, const std::optional<at::Tensor> &bias,
                   c10::string_view weight_key, c10::string_view activation_key, c10::string_view backend,
                   c10::SymInt out_features, const std::optional<at::Tensor> &input_scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("quantpass::linear_cpu", "")
                             .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                               const std::optional<at::Tensor> &, const std::optional<at::Tensor> &,
                                               c10::string_view, c10::string_view, c10::string_view, c10::SymInt,
                                               const std::optional<at::Tensor> &)>();
  return op.call(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, std::move(out_features),
                 input_scale);
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &w_data, const at::Tensor &w_scale,
                  const std::optional<at::Tensor> &w_scale2, const std::optional<at::Tensor> &bias,
                  c10::string_view weight_key, c10::string_view activation_key, c10::string_view backend,
                  c10::SymInt out_features_sym, const std::optional<at::Tensor> &input_scale) {
  const int64_t out_features = out_features_sym.expect_int();
  const auto found = entry && activation_key.empty() ? fast.find(std::string(weight_key)) : fast.end();
  const int xtype = type_code(x.scalar_type()), btype = bias ? type_code(bias->scalar_type()) : 0;
  if (found != fast.end() && xtype >= 0 && btype >= 0 && x.dim() >= 1 && w_scale.dim() == 2 &&
      w_data.is_contiguous() && w_scale.is_contiguous() && (!bias || bias->is_contiguous())) {
    const Fast f = found->second;
    const at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    const int64_t m = rows.size(0), k = rows.size(1);
    if (m <= f.most && rows.stride(1) == 1) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(out_features);
      at::Tensor out = at::empty(shape, x.options());
      const int64_t kp = f.bits == 4 ? w_data.size(1) * 2 : w_data.size(1);
      const int status = entry(rows.data_ptr(), rows.stride(0), xtype, m, k,
                               static_cast<const uint8_t *>(w_data.data_ptr()),
                               static_cast<const float *>(w_scale.data_ptr()), out_features, kp, f.bits,
                               bias ? bias->data_ptr() : nullptr, btype, out.data_ptr(), out_features, xtype,
                               f.mode, at::get_num_threads());
      TORCH_CHECK(status == 0, "quantpass's CPU kernel could not allocate its scratch (status ", status, ")");
      return out;
    }
  }
  return generic(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend,
                 c10::SymInt(out_features), input_scale);
}

}  // namespace

// needs_fixed_stride_order: cpu_op.py's GRAPH_OP_TAGS (so Inductor's wrapper calls it with no keyword).
TORCH_LIBRARY_FRAGMENT(quantpass, m) {
  m.def(
      "linear_cpu_cxx(Tensor x, Tensor w_data, Tensor w_scale, Tensor? w_scale2, Tensor? bias, str weight_key, "
      "str activation_key, str backend, SymInt out_features, Tensor? input_scale=None) -> Tensor",
      {at::Tag::needs_fixed_stride_order});
  m.def("_cpu_op_setup(int address, str[] keys, int[] bits, int[] modes, int[] most) -> ()", &setup);
}

TORCH_LIBRARY_IMPL(quantpass, CPU, m) { m.impl("linear_cpu_cxx", &linear); }
