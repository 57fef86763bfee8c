// quantpass::linear_cpu_cxx and quantpass::fused_moe_cpu_cxx: the cpu backend's graph ops in C++, so a
// compiled graph reaches the C kernels (csrc/linear_avx2.c, loaded separately) without a Python body or
// ctypes on each call.
//
// Built and loaded at run time by quantpass/kernels/cpu_op.py against the running torch's headers
// (only the few this file names, so it builds in seconds). The schemas are those of
// quantpass::linear_cpu and quantpass::fused_moe_cpu (defined in Python, kernels/cpu_graph.py), the
// generic ops' arguments (input scales: a static activation key's); where the fast path does not apply (a
// pair no kernel runs, M or T above the format's limit, a layout or dtype the kernels don't read), these
// ops call the Python ones, so both always give the same result.
//
// `quantpass::_cpu_op_setup` hands over, once, the kernels' entry points (qp_linear's and qp_moe's
// addresses), the table of weight keys the kernels run (key -> (bits, mode, most rows, the activation key
// a MoE layer quantizes per token in qp_moe or "", most rows of a linear)), quantpass's AMAX_EPS, the MoE activations and
// gate/up layouts in qp_moe's order, and the format kernels' (csrc/linear_fp8.c's qp_linear_fp8 and
// qp_moe_fp8, csrc/linear_fp4.c's qp_linear_fp4 and qp_moe_fp4; 0 where one is not built) with their
// table: "weight key|activation key" -> a `Format` row (kernels/cpu_graph.py's graph_tables).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Entry = int (*)(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w,
                      const float *s, int64_t N, int64_t kp, int bits, const void *bias, int btype, void *out,
                      int64_t ldo, int otype, int mode, int threads);

// csrc/linear_avx2.c's qp_moe: a MoE layer in one call (csrc/moe_layer.h's MOE_PARAMS, then the INT experts)
using MoeEntry = int (*)(const void *hidden, int htype, int64_t T, int64_t H, const int64_t *ids, int64_t k,
                         const void *map, int map_bytes, int64_t map_len, const void *router, int rtype, int on_input,
                         int64_t E, int64_t I, const void *b13, const void *b2, int btype, int act, int layout,
                         float alpha, float limit, void *out, int threads, int64_t most, const uint8_t *w13,
                         const float *s13, int64_t kp13, const uint8_t *w2, const float *s2, int64_t kp2, int bits,
                         int mode, int per_token, float eps);

// csrc/linear_fp8.c's qp_linear_fp8 and csrc/linear_fp4.c's qp_linear_fp4
using Fp8Entry = int (*)(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                         int64_t kp, const void *ws, const float *lut, int64_t srows, int64_t sld, int64_t group,
                         int act, int64_t act_group, float act_scale, float eps, const void *bias, int btype,
                         void *out, int64_t ldo, int otype, int threads);
using Fp4Entry = int (*)(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, int act, const float *codes,
                         float eps, const uint8_t *w, const uint8_t *s, const float *lut, int block, int64_t N,
                         int64_t kp, float g, const void *bias, int btype, void *out, int64_t ldo, int otype,
                         int threads);

// csrc/moe_layer.h's MOE_PARAMS, the layer's arguments every MoE entry takes first
#define MOE_PARAMS                                                                                           \
  const void *, int, int64_t, int64_t, const int64_t *, int64_t, const void *, int, int64_t, const void *, int, \
      int, int64_t, int64_t, const void *, const void *, int, int, int, float, float, void *, int, int64_t
// csrc/linear_fp8.c's qp_moe_fp8 and csrc/linear_fp4.c's qp_moe_fp4: the layer's, then the experts'
using Fp8MoeEntry = int (*)(MOE_PARAMS, const uint8_t *w13, const void *s13, int64_t kp13, int64_t srows13,
                            int64_t sld13, const uint8_t *w2, const void *s2, int64_t kp2, int64_t srows2,
                            int64_t sld2, int64_t group, const float *lut, int xq, int64_t xq_group,
                            const float *xq13, const float *xq2, float eps);
using Fp4MoeEntry = int (*)(MOE_PARAMS, const uint8_t *w13, const uint8_t *ws13, int64_t kp13, const float *g13,
                            const uint8_t *w2, const uint8_t *ws2, int64_t kp2, const float *g2, int block,
                            const float *lut, int xq, const void *codes, float eps);
#undef MOE_PARAMS

struct Fast {
  int bits, mode;
  int64_t most;           // the most activation rows the kernels take for this format
  std::string per_token;  // the activation key a MoE layer of it quantizes per token in qp_moe ("": none)
  int64_t linear_most;    // the most activation rows of a linear (then dequantize + matmul, in Python)
};

// A (weight key, activation key) pair a format kernel runs, as kernels/cpu_graph.py's graph_tables gives it.
struct Format {
  int64_t family;       // 8: qp_linear_fp8, 4: qp_linear_fp4
  int64_t most;         // the most activation rows (the family's MAX_M)
  int64_t srows;        // weight rows per scale row (-1: all of them)
  int64_t group;        // columns per scale (0: the whole row)
  int64_t lut;          // address of the scale bytes' fp32 values (0: fp32 scales)
  int64_t act;          // the kernel's activation mode
  int64_t act_group;    // FP8: columns per activation scale (0: the row)
  int64_t codes;        // FP4: address of its code table
  int64_t input_scale;  // 1: the activation's scale is the checkpoint's (one fp32 value; MoE: one per expert)
  int64_t moe;          // 1: a MoE layer of this pair runs in one call (qp_moe_fp8, qp_moe_fp4)
};
constexpr size_t FORMAT_FIELDS = sizeof(Format) / sizeof(int64_t);

Entry entry = nullptr;
MoeEntry moe_entry = nullptr;
Fp8Entry fp8_entry = nullptr;
Fp4Entry fp4_entry = nullptr;
Fp8MoeEntry fp8_moe_entry = nullptr;
Fp4MoeEntry fp4_moe_entry = nullptr;
std::unordered_map<std::string, Fast> fast;
std::unordered_map<std::string, Format> formats;
std::vector<std::string> activations, layouts;  // moe_problem's, in qp_moe's order
float eps = 0.0f;                               // quantpass's AMAX_EPS, for qp_moe's per-token activations

int type_code(c10::ScalarType type) {  // csrc/linear_avx2.c's F32, BF16, F16; -1: not read
  switch (type) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    default: return -1;
  }
}

void setup(int64_t address, int64_t moe_address, std::vector<std::string> keys, std::vector<int64_t> bits,
           std::vector<int64_t> modes, std::vector<int64_t> most, std::vector<std::string> per_token,
           std::vector<int64_t> linear_most, double amax_eps, std::vector<std::string> moe_activations,
           std::vector<std::string> gate_up_layouts,
           int64_t fp8_address, int64_t fp4_address, int64_t fp8_moe_address, int64_t fp4_moe_address,
           std::vector<std::string> format_keys, std::vector<int64_t> format_rows) {
  TORCH_CHECK(keys.size() == bits.size() && keys.size() == modes.size() && keys.size() == most.size() &&
                  keys.size() == per_token.size() && keys.size() == linear_most.size(),
              "quantpass::_cpu_op_setup: keys, bits, modes, most, per_token and linear_most must have one entry per "
              "key");
  TORCH_CHECK(format_rows.size() == format_keys.size() * FORMAT_FIELDS, "quantpass::_cpu_op_setup: ",
              FORMAT_FIELDS, " format_rows per format key");
  fast.clear();
  for (size_t i = 0; i < keys.size(); i++)
    fast[keys[i]] = Fast{(int)bits[i], (int)modes[i], most[i], per_token[i], linear_most[i]};
  formats.clear();
  for (size_t i = 0; i < format_keys.size(); i++) {
    const int64_t *r = format_rows.data() + i * FORMAT_FIELDS;
    formats[format_keys[i]] = Format{r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]};
  }
  fp8_entry = reinterpret_cast<Fp8Entry>(fp8_address);
  fp4_entry = reinterpret_cast<Fp4Entry>(fp4_address);
  fp8_moe_entry = reinterpret_cast<Fp8MoeEntry>(fp8_moe_address);
  fp4_moe_entry = reinterpret_cast<Fp4MoeEntry>(fp4_moe_address);
  eps = (float)amax_eps;
  activations = std::move(moe_activations);
  layouts = std::move(gate_up_layouts);
  entry = reinterpret_cast<Entry>(address);
  moe_entry = reinterpret_cast<MoeEntry>(moe_address);
}

// The format kernels' row for a pair ("weight key|activation key", kernels/cpu_graph.py's graph_tables).
std::unordered_map<std::string, Format>::const_iterator find_format(c10::string_view weight_key,
                                                                   c10::string_view activation_key) {
  return formats.find(std::string(weight_key) + "|" + std::string(activation_key));
}

int64_t index_of(const std::vector<std::string> &names, c10::string_view name) {
  for (size_t i = 0; i < names.size(); i++)
    if (names[i] == name) return (int64_t)i;
  return -1;
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

at::Tensor output(const at::Tensor &x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return at::empty(shape, x.options());
}

void check_status(int status) {
  TORCH_CHECK(status == 0, "quantpass's CPU kernel could not allocate its scratch (status ", status, ")");
}

// kernels/cpu_fp8.py's and cpu_fp4.py's `linear` on rows [m, k] (unit column stride), their checks: the
// format kernel where they pass (true, `out` written), else false (the Python op then runs the call).
bool format_kernel(const Format &f, const at::Tensor &x, const at::Tensor &rows, int xtype, const at::Tensor &w_data,
                   const at::Tensor &w_scale, const std::optional<at::Tensor> &w_scale2,
                   const std::optional<at::Tensor> &bias, int btype, int64_t out_features,
                   const std::optional<at::Tensor> &input_scale, at::Tensor &out) {
  const int64_t m = rows.size(0), k = rows.size(1), N = w_data.size(0);
  const int64_t kp = f.family == 4 ? w_data.size(1) * 2 : w_data.size(1);
  const int64_t srows = f.srows < 0 ? std::max<int64_t>(N, 1) : f.srows;
  const int64_t sld = f.group ? kp / f.group : 1;
  const bool byte_scales = f.lut != 0 || f.family == 4;
  if (m > f.most || k > kp || N != out_features || w_data.dim() != 2 || (f.group && kp % f.group) ||
      w_scale.size(0) != (N + srows - 1) / srows || w_scale.size(1) != sld ||
      (byte_scales ? w_scale.element_size() != 1 : w_scale.scalar_type() != c10::ScalarType::Float))
    return false;
  float act_scale = 0.0f, g = 0.5f;  // FP4's codes are e2m1 values x 2
  if (f.input_scale) {
    if (!input_scale || input_scale->numel() != 1 || input_scale->scalar_type() != c10::ScalarType::Float) return false;
    act_scale = *input_scale->data_ptr<float>();
  }
  if (f.family == 4 && w_scale2) {
    if (w_scale2->numel() != 1 || w_scale2->scalar_type() != c10::ScalarType::Float) return false;
    g = *w_scale2->data_ptr<float>() / 2;
  }
  if (f.family == 8 ? !fp8_entry : !fp4_entry) return false;
  out = output(x, out_features);
  const auto *w = static_cast<const uint8_t *>(w_data.data_ptr());
  const void *b = bias ? bias->data_ptr() : nullptr;
  const auto *lut = reinterpret_cast<const float *>(f.lut);
  const int threads = at::get_num_threads();
  int status;
  if (f.family == 8)
    status = fp8_entry(rows.data_ptr(), rows.stride(0), xtype, m, k, w, N, kp, w_scale.data_ptr(), lut, srows, sld,
                       f.group, (int)f.act, f.act_group, act_scale, eps, b, btype, out.data_ptr(), N, xtype, threads);
  else
    status = fp4_entry(rows.data_ptr(), rows.stride(0), xtype, m, k, (int)f.act,
                       reinterpret_cast<const float *>(f.codes), eps, w,
                       static_cast<const uint8_t *>(w_scale.data_ptr()), lut, (int)f.group, N, kp, g, b, btype,
                       out.data_ptr(), N, xtype, threads);
  if (status == -2) return false;  // a layout the checks above missed: the Python op says what is wrong
  check_status(status);
  return true;
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &w_data, const at::Tensor &w_scale,
                  const std::optional<at::Tensor> &w_scale2, const std::optional<at::Tensor> &bias,
                  c10::string_view weight_key, c10::string_view activation_key, c10::string_view backend,
                  c10::SymInt out_features_sym, const std::optional<at::Tensor> &input_scale) {
  const int64_t out_features = out_features_sym.expect_int();
  const int xtype = type_code(x.scalar_type()), btype = bias ? type_code(bias->scalar_type()) : 0;
  if (xtype >= 0 && btype >= 0 && x.dim() >= 1 && w_scale.dim() == 2 && w_data.is_contiguous() &&
      w_scale.is_contiguous() && (!bias || bias->is_contiguous())) {
    const at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    const auto found = entry && activation_key.empty() ? fast.find(std::string(weight_key)) : fast.end();
    if (found != fast.end() && rows.size(0) <= found->second.linear_most && rows.stride(1) == 1) {
      const Fast f = found->second;
      at::Tensor out = output(x, out_features);
      const int64_t kp = f.bits == 4 ? w_data.size(1) * 2 : w_data.size(1);
      check_status(entry(rows.data_ptr(), rows.stride(0), xtype, rows.size(0), rows.size(1),
                         static_cast<const uint8_t *>(w_data.data_ptr()),
                         static_cast<const float *>(w_scale.data_ptr()), out_features, kp, f.bits,
                         bias ? bias->data_ptr() : nullptr, btype, out.data_ptr(), out_features, xtype, f.mode,
                         at::get_num_threads()));
      return out;
    }
    const auto format = found == fast.end() && rows.stride(1) == 1
                            ? find_format(weight_key, activation_key)
                            : formats.end();
    at::Tensor out;
    if (format != formats.end() &&
        format_kernel(format->second, x, rows, xtype, w_data, w_scale, w_scale2, bias, btype, out_features,
                      input_scale, out))
      return out;
  }
  return generic(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend,
                 c10::SymInt(out_features), input_scale);
}

using OptTensor = std::optional<at::Tensor>;

// quantpass::fused_moe_cpu's C++ signature (fused_moe's below)
using MoeSignature = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                const at::Tensor &, const OptTensor &, const at::Tensor &, const at::Tensor &,
                                const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                c10::string_view, c10::string_view, c10::string_view, c10::string_view,
                                c10::string_view, bool, c10::SymInt, double, double, const OptTensor &,
                                const OptTensor &);

// quantpass::fused_moe_cpu (kernels/cpu_graph.py): the Python op, for everything off the fast path
template <class... Args>
at::Tensor generic_moe(Args &&...args) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantpass::fused_moe_cpu", "").typed<MoeSignature>();
  return op.call(std::forward<Args>(args)...);
}

bool contiguous(const OptTensor &t) { return !t || t->is_contiguous(); }

bool stacked(const at::Tensor &t) { return t.dim() == 3 && t.is_contiguous(); }  // kernels' [E, ...] experts

// A MoE layer's own arguments, checked as kernels/cpu_avx2.py's moe_layer checks them, for any MoE entry:
// csrc/moe_layer.h's MOE_PARAMS come from here, then the format's experts.
struct Layer {
  at::Tensor rows, router, ids;  // hidden [T, H], the router weights and expert ids [T, k]
  const OptTensor &expert_map, &b13, &b2;
  int htype, rtype, btype, act, layout;
  bool on_input;
  int64_t E, I;
  double alpha, limit;

  template <class MoeEntryT, class... Experts>
  at::Tensor run(MoeEntryT moe, int64_t most, Experts... experts) const {
    at::Tensor out = at::empty_like(rows);
    const int64_t T = rows.size(0);
    const int status =
        moe(rows.data_ptr(), htype, T, rows.size(1), ids.data_ptr<int64_t>(), ids.size(1),
            expert_map ? expert_map->data_ptr() : nullptr, expert_map ? (int)expert_map->element_size() : 0,
            expert_map ? expert_map->numel() : 0, router.data_ptr(), rtype, on_input, E, I,
            b13 ? b13->data_ptr() : nullptr, b2 ? b2->data_ptr() : nullptr, btype, act, layout, (float)alpha,
            (float)limit, out.data_ptr(), at::get_num_threads(), most, experts...);
    TORCH_CHECK_INDEX(status != -3, "an expert id outside the expert map or [0, ", E, ") in ", ids);
    check_status(status);
    return out;
  }
};

const uint8_t *bytes(const at::Tensor &t) { return static_cast<const uint8_t *>(t.data_ptr()); }

const float *pointer(const at::Tensor &t) { return t.defined() ? t.data_ptr<float>() : nullptr; }  // or none

// kernels/cpu_fp8.py's moe_experts (its `_grid` and `_scales` checks): qp_moe_fp8 where they pass, else
// an undefined tensor (the Python op then runs the layer).
at::Tensor fp8_moe(const Format &f, const Layer &layer, const at::Tensor &w13_data, const at::Tensor &w13_scale,
                   const at::Tensor &w2_data, const at::Tensor &w2_scale, const OptTensor &w13_input_scale,
                   const OptTensor &w2_input_scale) {
  const int64_t E = layer.E;
  int64_t kp[2], srows[2], sld[2];
  const at::Tensor *data[2] = {&w13_data, &w2_data}, *scale[2] = {&w13_scale, &w2_scale};
  for (int i = 0; i < 2; i++) {
    const int64_t rows = data[i]->size(1), cols = data[i]->size(2);
    srows[i] = std::max<int64_t>(f.srows < 0 ? rows : f.srows, 1);
    sld[i] = f.group ? (cols + f.group - 1) / f.group : 1;
    kp[i] = cols;
    if (!stacked(*scale[i]) || data[i]->size(0) != E || scale[i]->size(0) != E ||
        scale[i]->size(1) != (rows + srows[i] - 1) / srows[i] || scale[i]->size(2) != sld[i] ||
        (f.group && (f.group % 16 || cols % f.group)) ||
        (f.lut ? scale[i]->element_size() != 1 : scale[i]->scalar_type() != c10::ScalarType::Float))
      return {};
  }
  at::Tensor static_scales[2];  // each expert's calibrated activation scale, as the loop gives each GEMM its own
  if (f.input_scale) {
    const OptTensor *given[2] = {&w13_input_scale, &w2_input_scale};
    for (int i = 0; i < 2; i++) {
      if (!*given[i] || ((*given[i])->numel() != 1 && (*given[i])->numel() != E)) return {};
      static_scales[i] = (*given[i])->to(c10::ScalarType::Float).reshape({-1}).expand({E}).contiguous();
    }
  }
  return layer.run(fp8_moe_entry, f.most, bytes(w13_data), w13_scale.data_ptr(), kp[0], srows[0], sld[0],
                   bytes(w2_data), w2_scale.data_ptr(), kp[1], srows[1], sld[1], f.group,
                   reinterpret_cast<const float *>(f.lut), (int)f.act, f.act_group, pointer(static_scales[0]),
                   pointer(static_scales[1]), eps);
}

// kernels/cpu_fp4.py's moe_experts, its checks: qp_moe_fp4 where they pass, else an undefined tensor.
at::Tensor fp4_moe(const Format &f, const Layer &layer, const at::Tensor &w13_data, const at::Tensor &w13_scale,
                   const OptTensor &w13_scale2, const at::Tensor &w2_data, const at::Tensor &w2_scale,
                   const OptTensor &w2_scale2) {
  const at::Tensor *data[2] = {&w13_data, &w2_data}, *scale[2] = {&w13_scale, &w2_scale};
  const OptTensor *scale2[2] = {&w13_scale2, &w2_scale2};
  int64_t kp[2];
  at::Tensor g[2];  // each expert's per-tensor scale / 2 (the codes are e2m1 values x 2), NVFP4's
  for (int i = 0; i < 2; i++) {
    kp[i] = data[i]->size(2) * 2;
    if (data[i]->size(0) != layer.E || kp[i] % f.group || !scale[i]->is_contiguous() ||
        scale[i]->element_size() != 1 || scale[i]->dim() != 3 || scale[i]->size(0) != data[i]->size(0) ||
        scale[i]->size(1) != data[i]->size(1) || scale[i]->size(2) != kp[i] / f.group)
      return {};
    if (*scale2[i]) {
      if ((*scale2[i])->numel() != layer.E) return {};
      g[i] = (*scale2[i])->to(c10::ScalarType::Float).reshape({-1}).div(2).contiguous();
    }
  }
  return layer.run(fp4_moe_entry, f.most, bytes(w13_data), bytes(w13_scale), kp[0], pointer(g[0]), bytes(w2_data),
                   bytes(w2_scale), kp[1], pointer(g[1]), (int)f.group, reinterpret_cast<const float *>(f.lut),
                   (int)f.act, reinterpret_cast<const void *>(f.codes), eps);
}

// kernels/cpu.py's _moe_on_our_kernels, the same checks: the layer in one call of its kernel library's
// MoE entry (qp_moe for INT8/INT4, qp_moe_fp8, qp_moe_fp4) where they pass, else the Python op.
at::Tensor fused_moe(const at::Tensor &hidden, const at::Tensor &topk_weights, const at::Tensor &topk_ids,
                     const at::Tensor &w13_data, const at::Tensor &w13_scale, const OptTensor &w13_scale2,
                     const at::Tensor &w2_data, const at::Tensor &w2_scale, const OptTensor &w2_scale2,
                     const OptTensor &b13, const OptTensor &b2, const OptTensor &expert_map,
                     c10::string_view weight_key, c10::string_view activation_key, c10::string_view backend,
                     c10::string_view activation, c10::string_view gate_up_layout, bool on_input,
                     c10::SymInt intermediate_size, double alpha, double limit, const OptTensor &w13_input_scale,
                     const OptTensor &w2_input_scale) {
  const int htype = type_code(hidden.scalar_type()), rtype = type_code(topk_weights.scalar_type());
  const int btype = b13 ? type_code(b13->scalar_type()) : 0;
  const int64_t act = index_of(activations, activation), layout = index_of(layouts, gate_up_layout);
  const auto map_type = expert_map ? expert_map->scalar_type() : c10::ScalarType::Int;
  if (htype >= 0 && rtype >= 0 && btype >= 0 && act >= 0 && layout >= 0 && hidden.dim() >= 1 &&
      topk_ids.dim() >= 1 && !b13 == !b2 && (!b2 || b2->scalar_type() == b13->scalar_type()) &&
      (map_type == c10::ScalarType::Int || map_type == c10::ScalarType::Long) && contiguous(b13) &&
      contiguous(b2) && contiguous(expert_map) && stacked(w13_data) && stacked(w2_data)) {
    const int64_t H = hidden.size(-1), T = H ? hidden.numel() / H : 0;
    const auto found = fast.find(std::string(weight_key));
    const auto format = found == fast.end()
                            ? find_format(weight_key, activation_key)
                            : formats.end();
    const Fast *f = found != fast.end() && moe_entry ? &found->second : nullptr;
    const bool per_token = f && !activation_key.empty() && activation_key == f->per_token;
    if (f && !activation_key.empty() && !per_token) f = nullptr;
    const Format *g = format != formats.end() && format->second.moe &&
                              (format->second.family == 8 ? fp8_moe_entry != nullptr : fp4_moe_entry != nullptr)
                          ? &format->second
                          : nullptr;
    const int64_t most = f ? f->most : g ? g->most : -1;
    if (H && T <= most && topk_ids.numel() == topk_weights.numel() && topk_ids.numel() == T * topk_ids.size(-1)) {
      const at::Tensor rows = hidden.reshape({T, H}).contiguous();
      const Layer layer{rows, topk_weights.reshape({T, -1}).contiguous(),
                        topk_ids.reshape({T, -1}).to(c10::ScalarType::Long).contiguous(), expert_map, b13, b2, htype,
                        rtype, btype, (int)act, (int)layout, on_input, w13_data.size(0), w13_data.size(1) / 2, alpha,
                        limit};
      at::Tensor out;
      if (f && w13_scale.scalar_type() == c10::ScalarType::Float && w2_scale.scalar_type() == c10::ScalarType::Float &&
          stacked(w13_scale) && stacked(w2_scale)) {
        const int64_t pack = f->bits == 4 ? 2 : 1;
        out = layer.run(moe_entry, f->most, bytes(w13_data), w13_scale.data_ptr<float>(), w13_data.size(2) * pack,
                        bytes(w2_data), w2_scale.data_ptr<float>(), w2_data.size(2) * pack, f->bits, f->mode,
                        (int)per_token, eps);
      } else if (g && g->family == 8) {
        out = fp8_moe(*g, layer, w13_data, w13_scale, w2_data, w2_scale, w13_input_scale, w2_input_scale);
      } else if (g) {
        out = fp4_moe(*g, layer, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2);
      }
      if (out.defined()) return out.reshape(hidden.sizes());
    }
  }
  return generic_moe(hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2,
                     b13, b2, expert_map, weight_key, activation_key, backend, activation, gate_up_layout, on_input,
                     std::move(intermediate_size), alpha, limit, w13_input_scale, w2_input_scale);
}

}  // namespace

// needs_fixed_stride_order: cpu_op.py's GRAPH_OP_TAGS (so Inductor's wrapper calls it with no keyword).
TORCH_LIBRARY_FRAGMENT(quantpass, m) {
  m.def(
      "linear_cpu_cxx(Tensor x, Tensor w_data, Tensor w_scale, Tensor? w_scale2, Tensor? bias, str weight_key, "
      "str activation_key, str backend, SymInt out_features, Tensor? input_scale=None) -> Tensor",
      {at::Tag::needs_fixed_stride_order});
  m.def(
      "fused_moe_cpu_cxx(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor w13_data, Tensor w13_scale, "
      "Tensor? w13_scale2, Tensor w2_data, Tensor w2_scale, Tensor? w2_scale2, Tensor? b13, Tensor? b2, "
      "Tensor? expert_map, str weight_key, str activation_key, str backend, str activation, str gate_up_layout, "
      "bool apply_router_weight_on_input, SymInt intermediate_size, float alpha, float limit, "
      "Tensor? w13_input_scale=None, Tensor? w2_input_scale=None) -> Tensor",
      {at::Tag::needs_fixed_stride_order});
  m.def(
      "_cpu_op_setup(int address, int moe_address, str[] keys, int[] bits, int[] modes, int[] most, "
      "str[] per_token, int[] linear_most, float amax_eps, str[] moe_activations, str[] gate_up_layouts, int fp8_address, "
      "int fp4_address, int fp8_moe_address, int fp4_moe_address, str[] format_keys, int[] format_rows) -> ()",
      &setup);
}

TORCH_LIBRARY_IMPL(quantpass, CPU, m) {
  m.impl("linear_cpu_cxx", &linear);
  m.impl("fused_moe_cpu_cxx", &fused_moe);
}
