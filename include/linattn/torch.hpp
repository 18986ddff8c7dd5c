#pragma once
/// \file torch.hpp
/// linattn on CPU torch::Tensor: flash-linear-attention's (fla's) operations for libtorch users
/// in C++, and the engine of the Python package linattn.torch. Optional: the CMake target
/// linattn::torch (found through Torch's CMake config); the core never includes this file.
///
/// Tensors are fla's: q, k [B, T, H, K], v [B, T, H, V] (or [B, H, T, D] with head_first),
/// any strides, float32, float64, bfloat16 or float16, all three of one dtype. The per-token
/// inputs (Inputs: g, beta) and the states may have any of those dtypes. float32 and float64
/// are read in place where the feature axis is contiguous (linattn's row views over the
/// tensor's memory) and float32/float64 outputs are written in place; bfloat16 and float16 are
/// converted one (sequence, head) block at a time into float32 buffers of that block's size,
/// so no float copy of a whole input exists. Compute and states are float64 for float64
/// inputs, float32 otherwise. Settings::inplace_final_state writes the final state over
/// initial_state (a decode step without a state allocation; vLLM's fla kernels have it too).
///
/// The operations, each a write rule of linattn with the identity feature map (fla applies no
/// feature map; q is multiplied by `scale`, K^-0.5 by default), per sequence and head:
///   linear_attn       S_t = S_{t-1} + k_t v_t^T                          o_t = scale S_t^T q_t
///                     normalize: z_t = z_{t-1} + k_t, o_t = S_t^T q_t / (q_t . z_t + 1e-10 / scale)
///   simple_gla        S_t = exp(g_t) S_{t-1} + k_t v_t^T                 (g [B, T, H], log-gates)
///   gla               S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T           (g [B, T, H, K])
///   delta_rule        S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T  (beta [B, T, H])
///   gated_delta_rule  S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
///   kda               S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
///                     (g [B, T, H, K]: Kimi Delta Attention, fla's chunk_kda)
/// (o_t = scale S_t^T q_t for all but normalized linear_attn.) The delta rules may L2-normalize
/// q and k first as fla's use_qk_l2norm_in_kernel does: x / sqrt(|x|^2 + 1e-6). States are
/// [N, H, K, V] (S, key-major as fla's), N = B, or the number of sequences with cu_seqlens
/// (offsets of sequences packed along T with B = 1, as fla's). Grouped value heads (fla's
/// HV > H): v [B, T, HV, V] with HV a multiple of q's and k's H; value head h reads query/key
/// head h / (HV / H) in place, and o, g, beta and the states have HV heads. dq and dk of a
/// query/key head sum its value heads' gradients.
///
/// Differences from fla (docs/pytorch.md): gates must be log-gates <= 0 and beta in [0, 2]
/// (linattn checks, fla does not); normalize raises where q . z + 1e-10 / scale <= 0, a row
/// fla would divide by a non-positive number; fla's chunk and recurrent kernels round in bf16
/// in places, linattn computes in float32 throughout.
///
/// Gradients: backward() (every op; through the final state, cu_seqlens, head_first, the scale
/// and the L2 norm), the engine of linattn.torch's autograd. For training, run(op, inputs,
/// settings, saved) keeps the chunk states (SavedForwards) and backward(op, inputs, settings,
/// saved, ...) starts from them instead of rebuilding them: the same gradients, less work.
///
/// Complexity per sequence and head of length T: O(T K V) (chunked: plus O(T C (K + V)) for
/// chunk size C); memory beyond inputs and outputs: the states and, for conversions, one block.
/// Sequences and heads run in parallel on torch's intra-op threads (torch::set_num_threads).
/// Throws c10::Error (TypeError/ValueError in Python) for CUDA or sparse tensors, an unsupported
/// dtype, wrong ranks or sizes and bad cu_seqlens; std::invalid_argument for out-of-range gates
/// or betas (naming the token); DenominatorError (normalize) as above.

#include <linattn/detail/torch_bridge.hpp>

#include <ATen/ATen.h>

#include <optional>

namespace linattn::detail::torch_bridge {

// f.template operator()<op, Compute>() for the op and compute type known only at run time (the
// one switch over the ops, shared by run and backward).
template <class F>
auto dispatch(fla::Op op, bool compute_double, F&& f) {
  auto typed = [&]<fla::Op kOp>() {
    return compute_double ? f.template operator()<kOp, double>()
                          : f.template operator()<kOp, float>();
  };
  switch (op) {
    case fla::Op::linear_attn: return typed.template operator()<fla::Op::linear_attn>();
    case fla::Op::simple_gla: return typed.template operator()<fla::Op::simple_gla>();
    case fla::Op::gla: return typed.template operator()<fla::Op::gla>();
    case fla::Op::delta_rule: return typed.template operator()<fla::Op::delta_rule>();
    case fla::Op::gated_delta_rule: return typed.template operator()<fla::Op::gated_delta_rule>();
    case fla::Op::kda: return typed.template operator()<fla::Op::kda>();
  }
  TORCH_CHECK(false, "linattn: unknown op");
}

// backward() and its saved overload: the checks of the gradients, then the typed backward.
inline fla::Gradients backward_with(fla::Op op, const fla::Inputs& inputs, const fla::Settings& settings,
                                    const at::Tensor& d_o,
                                    const std::optional<at::Tensor>& d_final_state,
                                    const std::optional<at::Tensor>& d_final_z,
                                    const fla::SavedForwards* saved) {
  const Prepared p = prepare(op, inputs, settings);
  const at::Tensor dht = checked_state_gradient(d_final_state, "the final state's gradient",
                                                    {p.N, p.H, p.K, p.V});
  const at::Tensor dzt = checked_state_gradient(d_final_z, "the final z's gradient",
                                                    {p.N, 1, p.H, p.K});
  TORCH_CHECK_VALUE(!dzt.defined() || settings.normalize,
                    "linattn: a final z gradient is for linear_attn with normalize=True only");
  return dispatch(op, p.compute_double, [&]<fla::Op kOp, class Compute>() {
    return backward<kOp, Compute>(p, settings, d_o, dht, dzt, saved);
  });
}

}  // namespace linattn::detail::torch_bridge

namespace linattn::fla {

/// Runs `op` forward: the output o (q's dtype, q's layout) and, when settings ask for it, the
/// final state [N, H, K, V] and, for normalized linear_attn, z [N, 1, H, K]. See the file comment.
[[nodiscard]] inline Result run(Op op, const Inputs& inputs, const Settings& settings) {
  namespace tb = detail::torch_bridge;
  const tb::Prepared p = tb::prepare(op, inputs, settings);
  return tb::dispatch(op, p.compute_double,
                  [&]<Op kOp, class Compute>() { return tb::forward<kOp, Compute>(p, settings); });
}

/// run(), keeping in `saved` what backward() needs to skip its sweep that rebuilds the chunk
/// states (for training: pass the same `saved` to backward()). The outputs are run()'s bits.
/// With settings.chunked the chunk states of every (sequence, head) are kept (SavedForwards:
/// about (K V + K) / 32 scalars per token and head, more for the delta rules); the
/// token-by-token forward keeps nothing and leaves `saved` empty. `saved`'s earlier contents are
/// dropped; a forward that throws leaves it empty. Cost: run() plus the copies of the states.
[[nodiscard]] inline Result run(Op op, const Inputs& inputs, const Settings& settings,
                                SavedForwards& saved) {
  namespace tb = detail::torch_bridge;
  saved.clear();
  const tb::Prepared p = tb::prepare(op, inputs, settings);
  return tb::dispatch(op, p.compute_double, [&]<Op kOp, class Compute>() {
    return tb::forward<kOp, Compute>(p, settings, &saved);
  });
}

/// Gradients of run(op, inputs, settings) given the output gradient d_o (o's shape, any
/// supported dtype) and, optionally, the gradients of the final state d_final_state [N, H, K, V]
/// and (normalized linear_attn) z d_final_z [N, 1, H, K] (undefined: zero). Returns dq, dk, dv
/// (q's layout), dg (g's layout: [B, T, H], or [B, T, H, K] for gla) and dbeta ([B, T, H]) when
/// the op takes them, and the gradients of the initial state and z when those were given; all
/// in the compute type. With settings.qk_l2norm the gradients of q and k go through the L2 norm:
/// dx = (dx_hat - x_hat (x_hat . dx_hat)) / sqrt(|x|^2 + 1e-6). settings.chunked is ignored (the
/// chunk and token-by-token forwards compute the same function). Per sequence and head the
/// chunked backward of linattn/gradients.hpp (linear_attn) or linattn/rule_gradients.hpp:
/// O(T K V) plus O(T C (K + V)) for chunk size C, never T x T. Throws as run() does, and
/// c10::Error for gradients of the wrong shape.
[[nodiscard]] inline Gradients backward(Op op, const Inputs& inputs, const Settings& settings,
                                        const at::Tensor& d_o,
                                        const std::optional<at::Tensor>& d_final_state,
                                        const std::optional<at::Tensor>& d_final_z) {
  return detail::torch_bridge::backward_with(op, inputs, settings, d_o, d_final_state, d_final_z,
                                             nullptr);
}

/// backward() from the states that run(op, inputs, settings, saved) kept: the same gradients
/// (the same bits) without the sweep that rebuilds the chunk states, i.e. per token about
/// 8 K V instead of 10 K V flops for linear_attn and the gated ops, and no second forward for
/// the delta rules. The inputs must be the forward's (checked: the op, the settings, the sizes
/// and cu_seqlens, not the values). An empty `saved` (token-by-token forward, or cleared) gives
/// backward() without it. Throws as backward(), and c10::Error (ValueError) when `saved` belongs
/// to another call.
[[nodiscard]] inline Gradients backward(Op op, const Inputs& inputs, const Settings& settings,
                                        const SavedForwards& saved, const at::Tensor& d_o,
                                        const std::optional<at::Tensor>& d_final_state,
                                        const std::optional<at::Tensor>& d_final_z) {
  return detail::torch_bridge::backward_with(op, inputs, settings, d_o, d_final_state, d_final_z,
                                             &saved);
}

/// backward(Op::linear_attn, ...): kept for code written before every op had gradients.
[[nodiscard]] inline Gradients linear_attn_backward(const Inputs& inputs, const Settings& settings,
                                                    const at::Tensor& d_o,
                                                    const std::optional<at::Tensor>& d_final_state,
                                                    const std::optional<at::Tensor>& d_final_z) {
  return backward(Op::linear_attn, inputs, settings, d_o, d_final_state, d_final_z);
}

/// A CPU float/double tensor [B, T, H, d] (head_first: [B, H, T, d]) as a TensorView of its
/// memory, for libtorch code that calls linattn's multi-head layer on its own tensors. Element
/// is float, double or a const of them and must match the dtype; the last axis must be
/// contiguous. O(1), no copy. Throws c10::Error otherwise.
template <class Element>
[[nodiscard]] TensorView<Element> tensor_view(const at::Tensor& t, bool head_first = false) {
  TORCH_CHECK_VALUE(t.dim() == 4, "linattn: a tensor view needs a 4-D tensor, got ", t.sizes());
  return detail::torch_bridge::tensor_view_of<Element>(detail::torch_bridge::logical(t, head_first));
}

/// fla's chunk_linear_attn (normalize defaults to true there, as here).
[[nodiscard]] inline Result chunk_linear_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              Settings settings = {.normalize = true}) {
  settings.chunked = true;
  return run(Op::linear_attn, Inputs{q, k, v, {}, {}, {}, {}, {}}, settings);
}
/// fla's chunk_simple_gla with g [B, T, H] (log-gates).
[[nodiscard]] inline Result chunk_simple_gla(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& g, Settings settings = {}) {
  settings.chunked = true;
  return run(Op::simple_gla, Inputs{q, k, v, g, {}, {}, {}, {}}, settings);
}
/// fla's chunk_gla with g [B, T, H, K] (per-channel log-gates).
[[nodiscard]] inline Result chunk_gla(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, Settings settings = {}) {
  settings.chunked = true;
  return run(Op::gla, Inputs{q, k, v, g, {}, {}, {}, {}}, settings);
}
/// fla's chunk_delta_rule with beta [B, T, H].
[[nodiscard]] inline Result chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& beta, Settings settings = {}) {
  settings.chunked = true;
  return run(Op::delta_rule, Inputs{q, k, v, {}, beta, {}, {}, {}}, settings);
}
/// fla's chunk_gated_delta_rule with g (log alpha) and beta, both [B, T, H].
[[nodiscard]] inline Result chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& g,
                                                   const at::Tensor& beta, Settings settings = {}) {
  settings.chunked = true;
  return run(Op::gated_delta_rule, Inputs{q, k, v, g, beta, {}, {}, {}}, settings);
}
/// fla's chunk_kda with g (log alpha per key channel) [B, T, H, K] and beta [B, T, H].
[[nodiscard]] inline Result chunk_kda(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& g,
                                      const at::Tensor& beta, Settings settings = {}) {
  settings.chunked = true;
  return run(Op::kda, Inputs{q, k, v, g, beta, {}, {}, {}}, settings);
}

}  // namespace linattn::fla
