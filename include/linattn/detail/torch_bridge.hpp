#pragma once
// The kernels behind linattn/torch.hpp: checks of the torch arguments, one (sequence, head)
// block of a logical [B, T, H, d] tensor read as linattn row views (in place when the tensor
// holds the compute type with a contiguous feature axis, else converted into a per-task
// buffer), and the forward and backward runs over all (sequence, head) pairs on torch's
// intra-op thread pool. Needs ATen (libtorch); nothing in the core includes this file.

#include <linattn/attention.hpp>
#include <linattn/gradients.hpp>
#include <linattn/normalization.hpp>
#include <linattn/options.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::detail::torch_bridge {
struct SavedForwardsAccess;
}  // namespace linattn::detail::torch_bridge

namespace linattn::fla {

/// The fla operation families linattn runs (write rule in parentheses): linear_attn
/// (Additive), simple_gla (Gated, one log-gate per head), gla (Gated, one per key channel),
/// delta_rule (Delta), gated_delta_rule (GatedDelta), kda (GatedDelta with one log-gate per key
/// channel: Kimi Delta Attention).
enum class Op { linear_attn, simple_gla, gla, delta_rule, gated_delta_rule, kda };

/// Tensors of one call, in fla's shapes (head_first swaps T and H of q, k, v, g, beta). HV,
/// v's heads, is H or a multiple of it (grouped value heads: value head h reads query/key head
/// h / (HV / H)).
struct Inputs {
  at::Tensor q, k, v;                       // [B, T, H, K], [B, T, H, K], [B, T, HV, V]
  std::optional<at::Tensor> g;              // [B, T, HV] (simple_gla, gated_delta_rule) or [B, T, HV, K] (gla, kda)
  std::optional<at::Tensor> beta;           // [B, T, HV] (delta rules)
  std::optional<at::Tensor> initial_state;  // [N, HV, K, V]
  std::optional<at::Tensor> initial_z;      // [N, 1, HV, K] (linear_attn with normalize only)
  std::optional<at::Tensor> cu_seqlens;     // [N + 1] int32/int64, B = 1
};

/// Scalars of one call. scale: nullopt means K^-0.5 (fla's default). chunked: the chunked
/// (chunk_*) or the token-by-token (fused_recurrent_*) path; both give the same values.
struct Settings {
  std::optional<double> scale;
  bool chunked = true;
  bool output_final_state = false;
  bool normalize = false;  // linear_attn only: o = q^T S / (q^T z + 1e-10 / scale)
  bool qk_l2norm = false;  // delta rules only: q, k <- x / sqrt(|x|^2 + 1e-6) first
  bool head_first = false;
  /// Decode without a new state tensor: each head's final state is written over its initial
  /// state in initial_state's memory (and z over initial_z's with normalize), which then serves
  /// as final_state (final_z) when output_final_state asks for it. Needs initial_state (and,
  /// with normalize, initial_z) in the compute type (float32; float64 for float64 inputs), any
  /// strides but no two elements at one address and no memory shared with q, k, v, g or beta.
  /// Bumps their version counters, as torch's in-place ops do. The forward only (no autograd
  /// through it). If the call throws, heads already done hold their new state and the others
  /// their old one: keep a copy to retry a step that may fail.
  bool inplace_final_state = false;
};

/// o in q's dtype and layout; final state [N, H, K, V] and, with normalize, z [N, 1, H, K],
/// both in the compute type (float64 for float64 inputs, float32 otherwise), when asked for.
struct Result {
  at::Tensor o;
  std::optional<at::Tensor> final_state, final_z;
};

/// Gradients of an op with respect to q, k, v (compute type, the inputs' layout), to the
/// per-token inputs g and beta (compute type, their layout; when the op takes them) and to the
/// initial state and z (when given).
struct Gradients {
  at::Tensor dq, dk, dv;
  std::optional<at::Tensor> d_initial_state, d_initial_z;
  std::optional<at::Tensor> dg, dbeta;
};

/// What a chunked forward keeps for its backward: one linattn SavedForward (the state before
/// every backward chunk; for the delta rules the forward kernel's per-chunk data, see
/// linattn/saved_forward.hpp) per (sequence, head), so that backward() skips the sweep that
/// rebuilds those states. Filled by run(op, inputs, settings, &saved) with settings.chunked
/// (the token-by-token forward keeps nothing: it has no chunk states); read by backward(op,
/// inputs, settings, saved, ...), which checks that it belongs to this op, these settings and
/// these sizes (not the values: the backward must get the forward's inputs). Memory per
/// sequence, head and token: (K V + K) / 32 scalars for linear_attn and the gated ops (2,064 B
/// at K = V = 128 in float32, beside the 1,536 B of that token's q, k and v), K V / C + 2 V
/// for the delta rules (C their chunk: 5 KiB at K = V = 128), K V / C for kda (4 KiB there).
class SavedForwards {
 public:
  /// True until a chunked forward fills it, and after clear().
  [[nodiscard]] bool empty() const noexcept { return f32_.empty() && f64_.empty(); }
  /// Bytes the saved states hold (all sequences and heads).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& s : f32_) total += s.bytes();
    for (const auto& s : f64_) total += s.bytes();
    return total;
  }
  /// Frees the saved states.
  void clear() noexcept {
    f32_ = {};
    f64_ = {};
    offsets_ = {};
  }

 private:
  friend struct detail::torch_bridge::SavedForwardsAccess;
  std::vector<linattn::SavedForward<float>> f32_;
  std::vector<linattn::SavedForward<double>> f64_;
  // What the backward checks it against (op, settings, sizes, sequence offsets).
  Op op_ = Op::linear_attn;
  Index N_ = 0, H_ = 0, T_ = 0, K_ = 0, V_ = 0, qk_heads_ = 0;
  double scale_ = 1;
  bool normalize_ = false, qk_l2norm_ = false;
  std::vector<Index> offsets_;
};

[[nodiscard]] inline const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::linear_attn: return "linear_attn";
    case Op::simple_gla: return "simple_gla";
    case Op::gla: return "gla";
    case Op::delta_rule: return "delta_rule";
    case Op::gated_delta_rule: return "gated_delta_rule";
    case Op::kda: return "kda";
  }
  return "?";
}

}  // namespace linattn::fla

namespace linattn::detail::torch_bridge {

using fla::Inputs;
using fla::Op;
using fla::Settings;

// fla's normalize adds this to scale * q^T z (fla/ops/linear_attn/utils.py).
inline constexpr double kNormalizeEpsilon = 1e-10;
// fla's in-kernel L2 norm: x / sqrt(sum x^2 + 1e-6).
inline constexpr double kL2NormEpsilon = 1e-6;

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "linattn: ", name, " is undefined");
  TORCH_CHECK_TYPE(t.device().is_cpu(), "linattn: ", name, " is on ", t.device(),
                   "; linattn runs on the CPU only (move it with .cpu())");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, "linattn: ", name, " must be a dense (strided) tensor");
  TORCH_CHECK_TYPE(supported_dtype(t.scalar_type()), "linattn: ", name, " has dtype ",
                   t.scalar_type(), "; expected float32, float64, bfloat16 or float16");
}

inline void check_dims(const at::Tensor& t, const char* name, std::vector<int64_t> expected,
                       const char* what) {
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected), "linattn: ", name, " has shape ",
                    t.sizes(), ", expected ", at::IntArrayRef(expected), " ", what);
}

// [B, T, H, d] view of a tensor given in the user's layout (head_first: [B, H, T, d]).
inline at::Tensor logical(const at::Tensor& t, bool head_first) {
  if (!head_first) return t;
  return t.dim() == 3 ? t.permute({0, 2, 1}) : t.permute({0, 2, 1, 3});
}

// Everything a run needs, checked: logical [B, T, H, d] views, per-token inputs as
// [B, T, H, c], the sequence offsets, the sizes and the resolved scale.
struct Prepared {
  at::Tensor q, k, v, g, beta, h0, z0;
  std::vector<Index> offsets;  // empty: every batch entry is one sequence
  // H: the value heads (v, o, g, beta and the states have H heads); qk_heads: q's and k's,
  // H / qk_heads = group (grouped value heads, as fla's HV > H: value head h reads query/key
  // head h / group, as if q and k were repeat_interleave'd to H heads).
  Index B = 0, T = 0, H = 0, K = 0, V = 0, N = 0, qk_heads = 0, group = 1;
  double scale = 1;
  bool compute_double = false;

  [[nodiscard]] Index qk_head_of(Index h) const { return h / group; }

  [[nodiscard]] Index batch_of(Index n) const { return offsets.empty() ? n : 0; }
  [[nodiscard]] Index first_of(Index n) const { return offsets.empty() ? 0 : offsets[n]; }
  [[nodiscard]] Index length_of(Index n) const {
    return offsets.empty() ? T : offsets[n + 1] - offsets[n];
  }
};

// Settings::inplace_final_state's conditions: the states to write over are given, hold the
// compute type, and no element of them shares an address with another or with an input
// (MemOverlap's "too hard" cases, strides it cannot prove disjoint, pass as in torch's own
// in-place ops).
inline void check_inplace_states(const Prepared& p, const Settings& s) {
  TORCH_CHECK_VALUE(p.h0.defined(), "linattn: inplace_final_state needs an initial_state to write over");
  TORCH_CHECK_VALUE(!s.normalize || p.z0.defined(),
                    "linattn: inplace_final_state with normalize=True needs initial_state as "
                    "(kv_state, z_state), both written over");
  const at::ScalarType compute = p.compute_double ? at::kDouble : at::kFloat;
  for (const auto& [state, name] : {std::pair{&p.h0, "initial_state"}, std::pair{&p.z0, "initial z state"}}) {
    if (!state->defined()) continue;
    TORCH_CHECK_TYPE(state->scalar_type() == compute, "linattn: inplace_final_state writes the ",
                     name, " in the compute type ", compute, ", got ", state->scalar_type(),
                     " (pass it as ", compute, ", or leave inplace_final_state off)");
    TORCH_CHECK_VALUE(!state->is_inference() || c10::InferenceMode::is_enabled(), "linattn: the ",
                      name, " is an inference tensor, which torch lets no one write outside "
                      "inference mode; call under torch.inference_mode() or clone() it first");
    TORCH_CHECK_VALUE(at::has_internal_overlap(*state) != at::MemOverlap::Yes, "linattn: the ",
                      name, " has elements sharing memory (strides ", state->strides(),
                      "); inplace_final_state needs one address per element (clone() it)");
    for (const at::Tensor* input : {&p.q, &p.k, &p.v, &p.g, &p.beta}) {
      if (!input->defined()) continue;
      const at::MemOverlapStatus overlap = at::get_overlap_status(*state, *input);
      TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                        "linattn: the ", name, " shares memory with q, k, v, g or beta; "
                        "inplace_final_state cannot write over it");
    }
  }
}

inline Prepared prepare(Op op, const Inputs& in, const Settings& s) {
  Prepared p;
  check_tensor(in.q, "q");
  check_tensor(in.k, "k");
  check_tensor(in.v, "v");
  TORCH_CHECK_VALUE(in.q.dim() == 4 && in.k.dim() == 4 && in.v.dim() == 4,
                    "linattn: q, k and v must be 4-D ", s.head_first ? "[B, H, T, D]" : "[B, T, H, D]",
                    ", got q ", in.q.sizes(), ", k ", in.k.sizes(), ", v ", in.v.sizes());
  TORCH_CHECK_TYPE(in.q.scalar_type() == in.k.scalar_type() && in.q.scalar_type() == in.v.scalar_type(),
                   "linattn: q, k and v must have one dtype, got ", in.q.scalar_type(), ", ",
                   in.k.scalar_type(), " and ", in.v.scalar_type());
  p.q = logical(in.q, s.head_first);
  p.k = logical(in.k, s.head_first);
  p.v = logical(in.v, s.head_first);
  p.B = p.q.size(0), p.T = p.q.size(1), p.qk_heads = p.q.size(2), p.K = p.q.size(3);
  p.H = p.v.size(2), p.V = p.v.size(3);
  const char* layout = s.head_first ? "(head_first: [B, H, T, D])" : "([B, T, H, D])";
  TORCH_CHECK_VALUE(p.k.sizes() == p.q.sizes(), "linattn: k has shape ", in.k.sizes(),
                    ", expected q's shape ", in.q.sizes(), " ", layout);
  TORCH_CHECK_VALUE(p.v.size(0) == p.B && p.v.size(1) == p.T, "linattn: v has shape ",
                    in.v.sizes(), ", which does not match q ", in.q.sizes(), " in B and T ", layout);
  // Grouped value heads (fla's HV > H): v, o, gates, betas and states have H_v = G H_qk heads.
  TORCH_CHECK_VALUE(p.qk_heads == p.H || (p.qk_heads > 0 && p.H % p.qk_heads == 0),
                    "linattn: v has ", p.H, " heads and q, k have ", p.qk_heads, " (v ",
                    in.v.sizes(), ", q ", in.q.sizes(), " ", layout, "); v's heads must equal "
                    "q's or be a multiple of them (grouped value heads: value head h reads "
                    "query/key head h / (H_v / H_qk))");
  p.group = p.qk_heads == 0 ? 1 : p.H / p.qk_heads;
  TORCH_CHECK_VALUE(p.K >= 1 && p.V >= 1, "linattn: the key and value dims must be >= 1, got K=",
                    p.K, " V=", p.V);
  p.compute_double = in.q.scalar_type() == at::kDouble;

  const bool wants_g =
      op == Op::simple_gla || op == Op::gla || op == Op::gated_delta_rule || op == Op::kda;
  const bool wants_beta = op == Op::delta_rule || op == Op::gated_delta_rule || op == Op::kda;
  TORCH_CHECK_VALUE(wants_g == in.g.has_value(), "linattn: ", fla::op_name(op),
                    wants_g ? " needs the log-gates g" : " takes no gates g");
  TORCH_CHECK_VALUE(wants_beta == in.beta.has_value(), "linattn: ", fla::op_name(op),
                    wants_beta ? " needs beta" : " takes no beta");
  if (wants_g) {
    check_tensor(*in.g, "g");
    const at::Tensor g = logical(*in.g, s.head_first);
    if (op == Op::gla || op == Op::kda) {
      check_dims(g, "g (logical)", {p.B, p.T, p.H, p.K}, "(per-channel log-gates [B, T, HV, K], HV = v's heads)");
      p.g = g;
    } else {
      check_dims(g, "g (logical)", {p.B, p.T, p.H}, "(one log-gate per value head and token, [B, T, HV])");
      p.g = g.unsqueeze(-1);
    }
  }
  if (wants_beta) {
    check_tensor(*in.beta, "beta");
    const at::Tensor beta = logical(*in.beta, s.head_first);
    check_dims(beta, "beta (logical)", {p.B, p.T, p.H}, "(one beta per value head and token, [B, T, HV])");
    p.beta = beta.unsqueeze(-1);
  }

  if (in.cu_seqlens.has_value()) {
    const at::Tensor& cu = *in.cu_seqlens;
    TORCH_CHECK_VALUE(cu.defined() && cu.device().is_cpu() && cu.dim() == 1 &&
                          (cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt),
                      "linattn: cu_seqlens must be a 1-D int32/int64 CPU tensor");
    TORCH_CHECK_VALUE(p.B == 1, "linattn: with cu_seqlens the batch size must be 1 (sequences "
                      "packed along T), got B=", p.B);
    TORCH_CHECK_VALUE(cu.numel() >= 2, "linattn: cu_seqlens needs at least 2 entries, got ", cu.numel());
    const at::Tensor cu64 = cu.to(at::kLong).contiguous();
    const int64_t* c = cu64.data_ptr<int64_t>();
    p.offsets.assign(c, c + cu64.numel());
    TORCH_CHECK_VALUE(p.offsets.front() == 0 && p.offsets.back() == p.T,
                      "linattn: cu_seqlens must start at 0 and end at T=", p.T, ", got ",
                      p.offsets.front(), " ... ", p.offsets.back());
    for (std::size_t i = 1; i < p.offsets.size(); ++i)
      TORCH_CHECK_VALUE(p.offsets[i] >= p.offsets[i - 1], "linattn: cu_seqlens must not decrease, got ",
                        p.offsets[i - 1], " then ", p.offsets[i], " at position ", i);
    p.N = static_cast<Index>(p.offsets.size()) - 1;
  } else {
    p.N = p.B;
  }

  if (in.initial_state.has_value()) {
    check_tensor(*in.initial_state, "initial_state");
    check_dims(*in.initial_state, "initial_state", {p.N, p.H, p.K, p.V}, "([N, HV, K, V], N sequences, HV = v's heads)");
    p.h0 = *in.initial_state;
  }
  if (in.initial_z.has_value()) {
    TORCH_CHECK_VALUE(op == Op::linear_attn && s.normalize,
                      "linattn: an initial z state is for linear_attn with normalize=True only");
    check_tensor(*in.initial_z, "initial z state");
    check_dims(*in.initial_z, "initial z state", {p.N, 1, p.H, p.K}, "([N, 1, HV, K])");
    p.z0 = *in.initial_z;
  }
  if (s.inplace_final_state) check_inplace_states(p, s);
  TORCH_CHECK_VALUE(!s.normalize || op == Op::linear_attn, "linattn: normalize is for linear_attn only");
  TORCH_CHECK_VALUE(
      !s.qk_l2norm || op == Op::delta_rule || op == Op::gated_delta_rule || op == Op::kda,
      "linattn: use_qk_l2norm_in_kernel is for the delta rules only");
  p.scale = s.scale.has_value() ? *s.scale : 1.0 / std::sqrt(static_cast<double>(p.K));
  TORCH_CHECK_VALUE(std::isfinite(p.scale), "linattn: scale must be finite, got ", p.scale);
  TORCH_CHECK_VALUE(!s.normalize || p.scale > 0,
                    "linattn: normalize=True needs scale > 0 (the divisor is scale q^T z + 1e-10), got ",
                    p.scale);
  return p;
}

template <class Scalar, class Src>
Scalar to_scalar(Src x) {
  if constexpr (std::is_same_v<Src, double> || std::is_same_v<Src, float>)
    return static_cast<Scalar>(x);
  else
    return static_cast<Scalar>(static_cast<float>(x));  // bf16 and f16 widen exactly to float
}

// Calls f(p) with the tensor's data as a typed pointer (float, double, c10::BFloat16 or
// c10::Half): one dispatch per block, so the conversion loops are typed.
template <class F>
void with_typed_data(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(static_cast<const float*>(t.data_ptr())); return;
    case at::kDouble: f(static_cast<const double*>(t.data_ptr())); return;
    case at::kBFloat16: f(static_cast<const c10::BFloat16*>(t.data_ptr())); return;
    case at::kHalf: f(static_cast<const c10::Half*>(t.data_ptr())); return;
    default: break;
  }
  TORCH_CHECK(false, "linattn: unsupported dtype ", t.scalar_type());
}

// rows x cols elements of `t` from `start` with strides (rs, cs), converted into `out`.
template <class Scalar>
void convert_block(const at::Tensor& t, Index start, Index rows, Index cols, Index rs, Index cs,
                   RowMatrix<Scalar>& out) {
  out.resize(rows, cols);
  with_typed_data(t, [&](const auto* base) {
    for (Index i = 0; i < rows; ++i)
      for (Index c = 0; c < cols; ++c)
        out(i, c) = to_scalar<Scalar>(base[start + i * rs + c * cs]);
  });
}

// Offset of (b, t, h, 0) in a 4-D tensor.
inline Index offset_of(const at::Tensor& t, Index b, Index row, Index h) {
  return b * t.stride(0) + row * t.stride(1) + h * t.stride(2);
}

// A 4-D CPU tensor holding Element's type with a contiguous feature axis as a TensorView of its
// memory (no copy). Throws c10::Error otherwise.
template <class Element>
TensorView<Element> tensor_view_of(const at::Tensor& t) {
  using Scalar = std::remove_const_t<Element>;
  TORCH_CHECK_TYPE(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
                       t.scalar_type() == c10::CppTypeToScalarType<Scalar>::value,
                   "linattn: a tensor view needs a dense CPU tensor of ",
                   c10::CppTypeToScalarType<Scalar>::value);
  TORCH_CHECK_VALUE(t.dim() == 4, "linattn: a tensor view needs a 4-D tensor, got ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(3) == 1 || t.size(3) <= 1,
                    "linattn: a tensor view needs a contiguous last axis, got strides ", t.strides());
  return TensorView<Element>(t.data_ptr<Scalar>(), {t.size(0), t.size(1), t.size(2), t.size(3)},
                             {t.stride(0), t.stride(1), t.stride(2), 1});
}

// Rows [first, first + n) of head h of batch entry b of a logical [B, T, H, d] tensor as an
// n x d row view in Scalar: the TensorView's head rows over the tensor when it holds Scalar
// with a contiguous feature axis (and no copy is forced), else converted into `buffer`
// (resized once per task, never per row or chunk).
template <class Scalar>
ConstRowsView<Scalar> read_rows(const at::Tensor& t, Index b, Index h, Index first, Index n,
                                RowMatrix<Scalar>& buffer, bool force_copy = false) {
  const Index d = t.size(3);
  if (!force_copy && n > 0 && t.scalar_type() == c10::CppTypeToScalarType<Scalar>::value &&
      (t.stride(3) == 1 || d == 1))
    return tensor_view_of<const Scalar>(t).head_rows(b, h, first, n);
  convert_block(t, offset_of(t, b, first, h), n, d, t.stride(1), t.stride(3), buffer);
  return ConstRowsView<Scalar>(buffer.data(), n, d, Eigen::OuterStride<>(d));
}

// Per-token inputs (gates, betas) of one (sequence, head): n x c with any strides.
template <class Scalar>
using TokenRows = Eigen::Map<const RowMatrix<Scalar>, Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;

template <class Scalar>
TokenRows<Scalar> read_token_rows(const at::Tensor& t, Index b, Index h, Index first, Index n,
                                  RowMatrix<Scalar>& buffer) {
  using Strides = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
  const Index c = t.size(3);
  if (t.scalar_type() == c10::CppTypeToScalarType<Scalar>::value && n > 0)
    return TokenRows<Scalar>(t.data_ptr<Scalar>() + offset_of(t, b, first, h), n, c,
                             Strides(t.stride(1), t.stride(3)));
  const ConstRowsView<Scalar> rows = read_rows<Scalar>(t, b, h, first, n, buffer);
  return TokenRows<Scalar>(rows.data(), n, c, Strides(c, 1));
}

// fla's in-kernel L2 norm of every row, in place: x / sqrt(|x|^2 + 1e-6); the divisors go
// into `norms`.
template <class Scalar>
void l2_normalize_rows(RowMatrix<Scalar>& x, ColVector<Scalar>& norms) {
  norms.resize(x.rows());
  for (Index i = 0; i < x.rows(); ++i) {
    norms(i) = std::sqrt(x.row(i).squaredNorm() + static_cast<Scalar>(kL2NormEpsilon));
    x.row(i) /= norms(i);
  }
}

// Where the head matrix (K x V) or vector (1 x K, is_z) of sequence n, head h lies in a state
// tensor ([N, H, K, V] or [N, 1, H, K]): its first element and its row and column strides.
struct StateBlock {
  Index start, rows, cols, rs, cs;
};
inline StateBlock state_block(const at::Tensor& t, Index n, Index h, bool is_z) {
  const Index cols = t.size(3);
  if (is_z) return {n * t.stride(0) + h * t.stride(2), 1, cols, cols * t.stride(3), t.stride(3)};
  return {n * t.stride(0) + h * t.stride(1), t.size(2), cols, t.stride(2), t.stride(3)};
}

// Calls f with block `b` of `t` (which holds Scalar; Element is Scalar or const Scalar) as an
// Eigen Map of t's memory: with an outer stride only where the rows are contiguous (such views
// copy as packets, which a decode call, dominated by its states' copies, feels).
template <class Element, class F>
void with_block_map(const at::Tensor& t, const StateBlock& b, F&& f) {
  using Scalar = std::remove_const_t<Element>;
  using Matrix = std::conditional_t<std::is_const_v<Element>, const RowMatrix<Scalar>, RowMatrix<Scalar>>;
  Element* data = t.data_ptr<Scalar>() + b.start;
  if (b.cs == 1 || b.cols <= 1) {
    f(Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>(data, b.rows, b.cols,
                                                                  Eigen::OuterStride<>(b.rs)));
  } else {
    using Strides = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
    f(Eigen::Map<Matrix, Eigen::Unaligned, Strides>(data, b.rows, b.cols, Strides(b.rs, b.cs)));
  }
}

// Calls f with the head matrix (K x V) or vector (1 x K) of state tensor `t` ([N, H, K, V] or
// [N, 1, H, K]) as an Eigen expression of Scalar: a view of t's memory when `t` holds Scalar,
// else a converted copy.
template <class Scalar, class F>
void with_state(const at::Tensor& t, Index n, Index h, bool is_z, F&& f) {
  const StateBlock b = state_block(t, n, h, is_z);
  if (t.scalar_type() == c10::CppTypeToScalarType<Scalar>::value) {
    with_block_map<const Scalar>(t, b, f);
  } else {
    RowMatrix<Scalar> converted;
    convert_block(t, b.start, b.rows, b.cols, b.rs, b.cs, converted);
    f(std::as_const(converted));
  }
}

// Writes `value` (K x V, or 1 x K for z) into the head matrix of state tensor `t` ([N, H, K, V]
// or [N, 1, H, K], holding Scalar, any strides).
template <class Scalar, class Src>
void store_state(const at::Tensor& t, Index n, Index h, bool is_z, const Eigen::MatrixBase<Src>& value) {
  with_block_map<Scalar>(t, state_block(t, n, h, is_z), [&](auto&& block) { block = value; });
}

// Marks state tensors written in place (inplace_final_state) as torch's in-place ops do, so that
// autograd refuses a graph that saved their old values.
inline void bump_versions(const at::Tensor& ht, const at::Tensor& zt) {
  for (const at::Tensor* t : {&ht, &zt})
    if (t->defined()) t->unsafeGetTensorImpl()->bump_version();
}

// Writes n x d rows (Scalar) into rows [first, first + n) of head h of batch entry b of a
// logical tensor of any supported dtype, multiplied by `factor`.
template <class Scalar, class Src>
void write_rows(const at::Tensor& t, Index b, Index h, Index first, const Eigen::MatrixBase<Src>& rows,
                Scalar factor) {
  const Index n = rows.rows(), d = rows.cols();
  const Index start = offset_of(t, b, first, h), rs = t.stride(1), cs = t.stride(3);
  with_typed_data(t, [&](const auto* typed) {
    using Dst = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    Dst* base = const_cast<Dst*>(typed);  // `t` is our own output tensor
    for (Index i = 0; i < n; ++i)
      for (Index c = 0; c < d; ++c) {
        const Scalar x = factor * rows(i, c);
        if constexpr (std::is_same_v<Dst, double> || std::is_same_v<Dst, float>)
          base[start + i * rs + c * cs] = static_cast<Dst>(x);
        else
          base[start + i * rs + c * cs] = Dst(static_cast<float>(x));  // rounds to nearest even
      }
  });
}

// A tensor of `logical_shape` ([B, T, H, d]) in the user's layout, returned with its logical view.
inline std::pair<at::Tensor, at::Tensor> make_activation(Index B, Index T, Index H, Index d,
                                                         at::ScalarType dtype, bool head_first) {
  const auto opts = at::TensorOptions().dtype(dtype).device(at::kCPU);
  at::Tensor user = head_first ? at::empty({B, H, T, d}, opts) : at::empty({B, T, H, d}, opts);
  return {user, logical(user, head_first)};
}

template <class Scalar>
at::ScalarType scalar_type_of() {
  return c10::CppTypeToScalarType<Scalar>::value;
}

// The write rule of each op.
template <Op op>
struct RuleOf;
template <>
struct RuleOf<Op::linear_attn> { using type = Additive; };
template <>
struct RuleOf<Op::simple_gla> { using type = Gated; };
template <>
struct RuleOf<Op::gla> { using type = Gated; };
template <>
struct RuleOf<Op::delta_rule> { using type = Delta; };
template <>
struct RuleOf<Op::gated_delta_rule> { using type = GatedDelta; };
template <>
struct RuleOf<Op::kda> { using type = GatedDelta; };  // log_alpha per key channel

inline Options options_for(bool normalize, double scale) {
  Options options;
  // fla divides scale q^T S by scale q^T z + 1e-10, i.e. q^T S by q^T z + 1e-10 / scale.
  options.normalization = normalize ? Normalization::shifted(kNormalizeEpsilon / scale)
                                    : Normalization::unnormalized();
  return options;
}

// initial_state's assignment from h0 and z0 (at least one defined).
template <class Scalar, class Rule, class State>
void assign_initial_state(State& state, const Prepared& p, Index n, Index h) {
  if constexpr (Rule::keeps_normalizer) {
    if (p.h0.defined() && p.z0.defined()) {
      with_state<Scalar>(p.h0, n, h, false, [&](const auto& S0) {
        with_state<Scalar>(p.z0, n, h, true, [&](const auto& z0) { state.assign(S0, z0); });
      });
    } else if (p.h0.defined()) {
      with_state<Scalar>(p.h0, n, h, false,
                         [&](const auto& S0) { state.assign(S0, ColVector<Scalar>::Zero(p.K)); });
    } else if (p.z0.defined()) {
      with_state<Scalar>(p.z0, n, h, true, [&](const auto& z0) {
        state.assign(RowMatrix<Scalar>::Zero(p.K, p.V), z0);
      });
    }
  } else if (p.h0.defined()) {
    with_state<Scalar>(p.h0, n, h, false, [&](const auto& S0) { state.assign(S0); });
  }
}

// The initial state of sequence n, head h (h0 and z0 when given, else empty), in `slot`: made
// on a thread's first task and reassigned for the next ones, so that a call allocates one state
// per thread, not one per (sequence, head) (a decode call is dominated by such per-head work).
template <class Attention>
typename Attention::State& initial_state(const Attention& attn, const Prepared& p, Index n,
                                         Index h, std::optional<typename Attention::State>& slot) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  if (!slot) slot.emplace(attn.make_state(p.K, p.V));
  auto& state = *slot;
  if (!p.h0.defined() && !p.z0.defined()) {
    state.reset();
    return state;
  }
  // assign() reads the tensors' memory in place (no intermediate copy) and checks it is finite;
  // its refusal is restated with the sequence and head.
  try {
    assign_initial_state<Scalar, Rule>(state, p, n, h);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "linattn: the initial state (or z) of sequence ", n, ", head ", h,
                      " must be finite in ", scalar_type_of<Scalar>(), " (", e.what(), ")");
  }
  return state;
}

// Q and K of one (sequence, head), L2-normalized the way fla's kernels do when asked (then
// each row's norm sqrt(|x|^2 + 1e-6) is left in `norms`, for the backward).
template <class Scalar>
ConstRowsView<Scalar> read_qk(const at::Tensor& t, Index b, Index h, Index first, Index n,
                              RowMatrix<Scalar>& buffer, bool l2norm, ColVector<Scalar>& norms) {
  const ConstRowsView<Scalar> rows = read_rows<Scalar>(t, b, h, first, n, buffer, l2norm);
  if (l2norm) l2_normalize_rows(buffer, norms);
  return rows;
}

struct SavedForwardsAccess {
  template <class Scalar>
  static std::vector<SavedForward<Scalar>>& items(fla::SavedForwards& s) noexcept {
    if constexpr (std::is_same_v<Scalar, double>) return s.f64_; else return s.f32_;
  }
  template <class Scalar>
  static const std::vector<SavedForward<Scalar>>& items(const fla::SavedForwards& s) noexcept {
    if constexpr (std::is_same_v<Scalar, double>) return s.f64_; else return s.f32_;
  }
  // Sizes `s` for one SavedForward per (sequence, head) of `p` in Scalar (each item keeps its
  // allocation when `s` is reused for the same sizes) and records what the backward checks.
  template <class Scalar>
  static void prepare(fla::SavedForwards& s, Op op, const Prepared& p, const Settings& settings) {
    if constexpr (std::is_same_v<Scalar, double>) s.f32_ = {}; else s.f64_ = {};
    items<Scalar>(s).resize(static_cast<std::size_t>(p.N * p.H));
    s.op_ = op;
    s.N_ = p.N, s.H_ = p.H, s.T_ = p.T, s.K_ = p.K, s.V_ = p.V, s.qk_heads_ = p.qk_heads;
    s.scale_ = p.scale;
    s.normalize_ = settings.normalize;
    s.qk_l2norm_ = settings.qk_l2norm;
    s.offsets_ = p.offsets;
  }
  // Throws c10::ValueError unless `s` was filled by a forward of this op, settings and sizes.
  template <class Scalar>
  static void check(const fla::SavedForwards& s, Op op, const Prepared& p, const Settings& settings) {
    const auto describe = [](Op o, Index N, Index H, Index qk_heads, Index T, Index K, Index V,
                             double scale, bool normalize, bool l2, bool is_double) {
      std::ostringstream os;
      os << fla::op_name(o) << " with N=" << N << " H=" << H;
      if (qk_heads != H) os << " (q, k: " << qk_heads << " heads)";
      os << " T=" << T << " K=" << K << " V=" << V << " scale=" << scale << " normalize=" << normalize
         << " qk_l2norm=" << l2 << " in " << (is_double ? "float64" : "float32");
      return os.str();
    };
    const bool same = s.op_ == op && s.N_ == p.N && s.H_ == p.H && s.qk_heads_ == p.qk_heads &&
                      s.T_ == p.T && s.K_ == p.K && s.V_ == p.V && s.scale_ == p.scale &&
                      s.normalize_ == settings.normalize &&
                      s.qk_l2norm_ == settings.qk_l2norm && s.offsets_ == p.offsets &&
                      items<Scalar>(s).size() == static_cast<std::size_t>(p.N * p.H);
    TORCH_CHECK_VALUE(same, "linattn: the saved forward is for ",
                      describe(s.op_, s.N_, s.H_, s.qk_heads_, s.T_, s.K_, s.V_, s.scale_, s.normalize_,
                               s.qk_l2norm_, !s.f64_.empty()),
                      (s.offsets_ != p.offsets && s.N_ == p.N ? " (other cu_seqlens)" : ""),
                      ", this backward is for ",
                      describe(op, p.N, p.H, p.qk_heads, p.T, p.K, p.V, p.scale, settings.normalize,
                               settings.qk_l2norm, std::is_same_v<Scalar, double>));
  }
};

// Runs op over every (sequence, head) pair of `p` in Scalar, on torch's intra-op threads (one
// task per pair, its buffers allocated once per task). With `saved` (empty; and a chunked
// forward) each pair's forward keeps its chunk states in its own SavedForward (same bits in the
// outputs). See fla::run for the contract.
template <Op op, class Scalar>
fla::Result forward(const Prepared& p, const Settings& s, fla::SavedForwards* saved = nullptr) {
  using Rule = typename RuleOf<op>::type;
  using Attention = RuleAttention<Identity, Rule, Scalar>;
  const Attention attn(Identity{}, options_for(s.normalize, p.scale));
  const bool direct_out = p.q.scalar_type() == scalar_type_of<Scalar>();
  // (no structured bindings: clang 14 cannot capture them in the task lambda)
  const std::pair<at::Tensor, at::Tensor> o_pair =
      make_activation(p.B, p.T, p.H, p.V, p.q.scalar_type(), s.head_first);
  const at::Tensor& o = o_pair.second;
  fla::Result result;
  result.o = o_pair.first;
  const auto state_opts = at::TensorOptions().dtype(scalar_type_of<Scalar>()).device(at::kCPU);
  // Where the final states go: over the initial ones (inplace_final_state), new tensors, or
  // nowhere.
  at::Tensor ht, zt;
  if (s.inplace_final_state) {
    ht = p.h0;
    zt = p.z0;
  } else if (s.output_final_state) {
    ht = at::empty({p.N, p.H, p.K, p.V}, state_opts);
    if (s.normalize) zt = at::empty({p.N, 1, p.H, p.K}, state_opts);
  }
  if (s.output_final_state) {
    result.final_state = ht;
    if (s.normalize) result.final_z = zt;
  }
  // Unnormalized, o is linear in q: the rows read out are multiplied by scale instead of q.
  const Scalar out_factor = s.normalize ? Scalar(1) : static_cast<Scalar>(p.scale);
  // The token-by-token forward has no chunk states to keep (fla::run has emptied `saved`): its
  // backward rebuilds them.
  std::vector<SavedForward<Scalar>>* saved_items = nullptr;
  if (saved != nullptr && s.chunked) {
    SavedForwardsAccess::prepare<Scalar>(*saved, op, p, s);
    saved_items = &SavedForwardsAccess::items<Scalar>(*saved);
  }

  try {
    at::parallel_for(0, p.N * p.H, 1, [&](int64_t begin, int64_t end) {
      RowMatrix<Scalar> qb, kb, vb, gb, bb, ob;
      ColVector<Scalar> norms;
      std::optional<typename Attention::State> state_slot;
      for (int64_t task = begin; task < end; ++task) {
        const Index n = task / p.H, h = task % p.H;
        const Index b = p.batch_of(n), first = p.first_of(n), len = p.length_of(n);
        auto& state = initial_state(attn, p, n, h, state_slot);
        if (len > 0) {
          const Index hqk = p.qk_head_of(h);
          const ConstRowsView<Scalar> Q = read_qk<Scalar>(p.q, b, hqk, first, len, qb, s.qk_l2norm, norms);
          const ConstRowsView<Scalar> Kr = read_qk<Scalar>(p.k, b, hqk, first, len, kb, s.qk_l2norm, norms);
          const ConstRowsView<Scalar> Vr = read_rows<Scalar>(p.v, b, h, first, len, vb);
          if (!direct_out) ob.resize(len, p.V);
          RowsView<Scalar> out = direct_out
              ? tensor_view_of<Scalar>(o).head_rows(b, h, first, len)
              : RowsView<Scalar>(ob.data(), len, p.V, Eigen::OuterStride<>(p.V));
          auto run = [&](const auto&... inputs) {
            if (saved_items != nullptr)
              prefill_saving_into(attn, state, Q, Kr, Vr, inputs..., out,
                                  (*saved_items)[static_cast<std::size_t>(task)]);
            else if (s.chunked)
              attn.prefill_into(state, Q, Kr, Vr, inputs..., out);
            else
              attn.recurrent_into(state, Q, Kr, Vr, inputs..., out);
          };
          if constexpr (Rule::kind == WriteKind::additive) {
            run();
          } else if constexpr (Rule::kind == WriteKind::gated) {
            run(read_token_rows<Scalar>(p.g, b, h, first, len, gb));
          } else if constexpr (Rule::kind == WriteKind::delta) {
            run(read_token_rows<Scalar>(p.beta, b, h, first, len, bb));
          } else {  // linattn takes beta then log_alpha; fla's g is log_alpha
            run(read_token_rows<Scalar>(p.beta, b, h, first, len, bb),
                read_token_rows<Scalar>(p.g, b, h, first, len, gb));
          }
          if (direct_out) {
            if (out_factor != Scalar(1)) out *= out_factor;
          } else {
            write_rows<Scalar>(o, b, h, first, ob, out_factor);
          }
        }
        if (ht.defined()) {
          store_state<Scalar>(ht, n, h, false, state.S());
          if constexpr (Rule::keeps_normalizer) {
            if (zt.defined()) store_state<Scalar>(zt, n, h, true, state.z().transpose());
          }
        }
      }
    });
  } catch (...) {
    if (saved != nullptr) saved->clear();  // a forward that throws keeps nothing
    if (s.inplace_final_state) bump_versions(ht, zt);  // some heads may have been written
    throw;
  }
  if (s.inplace_final_state) bump_versions(ht, zt);
  return result;
}

// A state gradient tensor ([N, H, K, V] or [N, 1, H, K]) as given by autograd: checked.
inline at::Tensor checked_state_gradient(const std::optional<at::Tensor>& t, const char* name,
                                         std::vector<int64_t> shape) {
  if (!t.has_value() || !t->defined()) return {};
  check_tensor(*t, name);
  check_dims(*t, name, shape, "");
  return *t;
}

// fla's in-kernel L2 norm backward, in place on the rows of dx: with n = sqrt(|x|^2 + 1e-6) and
// x_hat = x / n (the rows the forward used), d x_hat / dx = (I - x_hat x_hat^T) / n, so
// dx = (dx_hat - x_hat (x_hat . dx_hat)) / n. `norms` holds each row's n.
template <class Scalar, class Rows>
void l2_normalize_backward(const RowMatrix<Scalar>& x_hat, const ColVector<Scalar>& norms, Rows&& dx) {
  for (Index i = 0; i < dx.rows(); ++i) {
    const Scalar along = x_hat.row(i).dot(dx.row(i));
    dx.row(i) = (dx.row(i) - along * x_hat.row(i)) / norms(i);
  }
}

// A per-token gradient tensor in the user's layout ([B, T, H] or [B, T, H, c], head_first swaps
// T and H) in Scalar, returned with its logical [B, T, H, c] view.
template <class Scalar>
std::pair<at::Tensor, at::Tensor> make_token_gradient(const Prepared& p, Index c, bool per_channel,
                                                      bool head_first) {
  if (per_channel) return make_activation(p.B, p.T, p.H, c, scalar_type_of<Scalar>(), head_first);
  const auto opts = at::TensorOptions().dtype(scalar_type_of<Scalar>()).device(at::kCPU);
  at::Tensor user = head_first ? at::empty({p.B, p.H, p.T}, opts) : at::empty({p.B, p.T, p.H}, opts);
  return {user, logical(user, head_first).unsqueeze(-1)};
}

// Gradients of op over every (sequence, head) pair: linattn's chunked backward
// (linattn/gradients.hpp for linear_attn, linattn/rule_gradients.hpp for the other rules)
// continuing each initial state, with the final state's gradient (dht, dzt) carried in, and
// through the in-kernel L2 norm of q and k when the forward used it. The same backward serves
// the chunk and the fused_recurrent forward: both compute the same function.
// With `saved` (filled by the chunked forward of these inputs), each pair's backward starts from
// its saved chunk states instead of rebuilding them (the same bits; see linattn/saved_forward.hpp).
template <Op op, class Scalar>
fla::Gradients backward(const Prepared& p, const Settings& s, const at::Tensor& d_o_user,
                        const at::Tensor& dht, const at::Tensor& dzt,
                        const fla::SavedForwards* saved = nullptr) {
  using Rule = typename RuleOf<op>::type;
  using Attention = RuleAttention<Identity, Rule, Scalar>;
  const Attention attn(Identity{}, options_for(s.normalize, p.scale));
  const std::vector<SavedForward<Scalar>>* saved_items = nullptr;
  if (saved != nullptr && !saved->empty()) {
    SavedForwardsAccess::check<Scalar>(*saved, op, p, s);
    saved_items = &SavedForwardsAccess::items<Scalar>(*saved);
  }
  check_tensor(d_o_user, "the output gradient");
  TORCH_CHECK_VALUE(d_o_user.dim() == 4, "linattn: the output gradient must be 4-D like o, got ",
                    d_o_user.sizes());
  const at::Tensor d_o = logical(d_o_user, s.head_first);
  check_dims(d_o, "the output gradient (logical)", {p.B, p.T, p.H, p.V}, "([B, T, H, V])");
  const at::ScalarType st = scalar_type_of<Scalar>();
  // (no structured bindings: clang 14 cannot capture them in the task lambda)
  const std::pair<at::Tensor, at::Tensor> dq_pair =
      make_activation(p.B, p.T, p.qk_heads, p.K, st, s.head_first);
  const std::pair<at::Tensor, at::Tensor> dk_pair =
      make_activation(p.B, p.T, p.qk_heads, p.K, st, s.head_first);
  const std::pair<at::Tensor, at::Tensor> dv_pair = make_activation(p.B, p.T, p.H, p.V, st, s.head_first);
  const at::Tensor &dq = dq_pair.second, &dk = dk_pair.second, &dv = dv_pair.second;
  fla::Gradients grads;
  grads.dq = dq_pair.first;
  grads.dk = dk_pair.first;
  grads.dv = dv_pair.first;
  at::Tensor dg, dbeta;  // logical [B, T, H, c]
  if (p.g.defined()) {
    const auto pair =
        make_token_gradient<Scalar>(p, p.g.size(3), op == Op::gla || op == Op::kda, s.head_first);
    grads.dg = pair.first;
    dg = pair.second;
  }
  if (p.beta.defined()) {
    const auto pair = make_token_gradient<Scalar>(p, 1, false, s.head_first);
    grads.dbeta = pair.first;
    dbeta = pair.second;
  }
  const auto state_opts = at::TensorOptions().dtype(st).device(at::kCPU);
  at::Tensor dh0, dz0;
  if (p.h0.defined()) grads.d_initial_state = dh0 = at::empty({p.N, p.H, p.K, p.V}, state_opts);
  if (p.z0.defined()) grads.d_initial_z = dz0 = at::empty({p.N, 1, p.H, p.K}, state_opts);
  // o = scale * (the unnormalized read), so the read's output gradient is scale * d_o.
  const Scalar dy_factor = s.normalize ? Scalar(1) : static_cast<Scalar>(p.scale);
  const bool has_final = dht.defined() || dzt.defined();

  // One task per (sequence, query/key head). With grouped value heads its G value heads run in
  // turn and add into the same dq and dk rows (the first writes them, the others add theirs),
  // so no two threads write one row; q and k are read once for the group.
  at::parallel_for(0, p.N * p.qk_heads, 1, [&](int64_t begin, int64_t end) {
    RowMatrix<Scalar> qb, kb, vb, gb, bb, yb, dq_part, dk_part;
    ColVector<Scalar> q_norms, k_norms;
    StateGradient<Scalar> final_gradient, initial;
    RuleInputGradients<Scalar> d_in;
    // Every backward's buffers (the chunk scratch; for the delta rules also their rebuilt
    // forward data, r dv / C + 2 dv scalars per token), kept for the items this thread runs
    // instead of allocated and first touched per item (same bits).
    BackwardWorkspace<Scalar> workspace;
    std::optional<typename Attention::State> state_slot;
    for (int64_t group_task = begin; group_task < end; ++group_task) {
      const Index n = group_task / p.qk_heads, hqk = group_task % p.qk_heads;
      const Index b = p.batch_of(n), first = p.first_of(n), len = p.length_of(n);
      auto rows = [&](const at::Tensor& t, Index head) {
        return tensor_view_of<Scalar>(t).head_rows(b, head, first, len);
      };
      const ConstRowsView<Scalar> Q = read_qk<Scalar>(p.q, b, hqk, first, len, qb, s.qk_l2norm, q_norms);
      const ConstRowsView<Scalar> Kr = read_qk<Scalar>(p.k, b, hqk, first, len, kb, s.qk_l2norm, k_norms);
      if (p.group > 1 && len > 0) {
        dq_part.resize(len, p.K);
        dk_part.resize(len, p.K);
      }
      for (Index j = 0; j < p.group; ++j) {
        const Index h = hqk * p.group + j;
        const int64_t task = n * p.H + h;  // the (sequence, value head) pair: its saved item
        if (has_final) {
          // Into the thread's kept matrices: one copy, allocated on the first item only.
          if (dht.defined())
            with_state<Scalar>(dht, n, h, false, [&](const auto& x) { final_gradient.S = x; });
          else
            final_gradient.S.setZero(p.K, p.V);
          if (dzt.defined())
            with_state<Scalar>(dzt, n, h, true,
                               [&](const auto& x) { final_gradient.z = x.transpose(); });
          else
            final_gradient.z.setZero(Rule::keeps_normalizer ? p.K : 0);
        }
        const StateGradient<Scalar>* carried = has_final ? &final_gradient : nullptr;
        if (len > 0) {
          const ConstRowsView<Scalar> Vr = read_rows<Scalar>(p.v, b, h, first, len, vb);
          read_rows<Scalar>(d_o, b, h, first, len, yb, true);
          yb *= dy_factor;
          const bool adds = j > 0;
          RowsView<Scalar> dq_rows = rows(dq, hqk), dk_rows = rows(dk, hqk);
          const GradientsRef<Scalar> out{
              adds ? RowsView<Scalar>(dq_part.data(), len, p.K, Eigen::OuterStride<>(p.K)) : dq_rows,
              adds ? RowsView<Scalar>(dk_part.data(), len, p.K, Eigen::OuterStride<>(p.K)) : dk_rows,
              rows(dv, h)};
          // The backward from this pair's saved forward when there is one, else the one that
          // rebuilds the chunk states from the initial state.
          auto gradients = [&](const auto&... inputs) {
            if (saved_items != nullptr) {
              const SavedForward<Scalar>& item = (*saved_items)[static_cast<std::size_t>(task)];
              if constexpr (Rule::kind == WriteKind::additive)
                prefill_backward_into(attn, item, Q, Kr, Vr, yb, carried, out, initial, &workspace);
              else
                prefill_backward_into(attn, item, Q, Kr, Vr, inputs..., yb, carried, out, d_in,
                                      initial, &workspace);
            } else {
              const auto& state = initial_state(attn, p, n, h, state_slot);
              if constexpr (Rule::kind == WriteKind::additive)
                prefill_backward_into(attn, state, Q, Kr, Vr, yb, carried, out, initial, &workspace);
              else
                prefill_backward_into(attn, state, Q, Kr, Vr, inputs..., yb, carried, out, d_in,
                                      initial, &workspace);
            }
          };
          if constexpr (Rule::kind == WriteKind::additive) {
            gradients();
          } else if constexpr (Rule::kind == WriteKind::gated) {
            gradients(read_token_rows<Scalar>(p.g, b, h, first, len, gb));
            write_rows<Scalar>(dg, b, h, first, d_in.log_gate, Scalar(1));
          } else if constexpr (Rule::kind == WriteKind::delta) {
            gradients(read_token_rows<Scalar>(p.beta, b, h, first, len, bb));
            write_rows<Scalar>(dbeta, b, h, first, d_in.beta, Scalar(1));
          } else {  // linattn takes beta then log_alpha; fla's g is log_alpha
            gradients(read_token_rows<Scalar>(p.beta, b, h, first, len, bb),
                      read_token_rows<Scalar>(p.g, b, h, first, len, gb));
            write_rows<Scalar>(dbeta, b, h, first, d_in.beta, Scalar(1));
            write_rows<Scalar>(dg, b, h, first, d_in.log_alpha, Scalar(1));
          }
          if (adds) {
            dq_rows += dq_part;
            dk_rows += dk_part;
          }
        } else if (has_final) {
          initial = final_gradient;  // no token: the initial state is the final one
        } else {
          initial.S = RowMatrix<Scalar>::Zero(p.K, p.V);
          initial.z = ColVector<Scalar>::Zero(p.K);
        }
        if (dh0.defined())
          Eigen::Map<RowMatrix<Scalar>>(dh0.data_ptr<Scalar>() + task * p.K * p.V, p.K, p.V) =
              initial.S;
        if (dz0.defined())
          Eigen::Map<ColVector<Scalar>>(dz0.data_ptr<Scalar>() + task * p.K, p.K) = initial.z;
      }
      // Through the in-kernel L2 norm once, on the group's summed dq and dk (it is linear in them).
      if (s.qk_l2norm && len > 0) {
        l2_normalize_backward(qb, q_norms, rows(dq, hqk));
        l2_normalize_backward(kb, k_norms, rows(dk, hqk));
      }
    }
  });
  return grads;
}

}  // namespace linattn::detail::torch_bridge
