#pragma once
/// \file multihead_gradients.hpp
/// The multi-head layer's backward pass (additive rule): the gradients of
/// layer.parallel_into(Q, K, V, mask, out, layout) with respect to Q, K and V, read from and
/// written into the model's own buffers.
///
///   parallel_backward_into(layer, Q, K, V, mask, dY, GradientViews{dQ, dK, dV}, layout)
///
/// Math: every query head h of every sequence is the single-head read of its key/value head
/// g = h / G (G = H_q / H_kv), so dQ[h] is that read's dQ, and dK[g], dV[g] are the sums of the
/// single-head dK, dV over the G query heads of the group (each from linattn/gradients.hpp's
/// parallel_backward_into on views of the buffers). Padded rows (SequenceLayout::padded) get
/// zero gradients and their inputs are never read; packed sequences see only their own rows; a
/// sequence with no queries or no keys gets zero gradients.
///
/// Threads: the work items (sequence, key/value head) run on the layer's executor when the call
/// has enough work (as the forward); each item sums its group's heads in head order into its
/// own rows, so the result is bit-identical for every executor and thread count.
///
/// Complexity: 3 to 4 times the forward's flops; per item, the single-head backward's scratch
/// (causal_backward_bytes) plus, for G > 1, one T x (dk + dv) buffer for the group's sums.
/// The gradient views must not overlap the inputs. Stateless only (every sequence from an empty
/// state); a carried state's gradients are the single-head prefill_backward's, per head.

#include <linattn/gradients.hpp>
#include <linattn/multihead.hpp>

namespace linattn {

/// Where the multi-head backward writes dQ [B, Tq, H_q, dk], dK [B, Tk, H_kv, dk] and
/// dV [B, Tk, H_kv, dv]: views of the same shapes as Q, K and V (any strides, either layout).
template <class Scalar>
struct GradientViews {
  TensorView<Scalar> Q, K, V;
};

namespace detail {

template <class Scalar>
void check_gradient_view(const char* name, const TensorView<Scalar>& grad,
                         const TensorView<const Scalar>& input) {
  if (grad.batches() != input.batches() || grad.times() != input.times() ||
      grad.heads() != input.heads() || grad.dim() != input.dim())
    throw_shape_error("gradient view ", name, " is ", grad.describe(), " but its input is ",
                      input.describe(), " (they need the same B, T, H and d)");
}

}  // namespace detail

/// Gradients of out = layer.parallel_into(Q, K, V, mask, out, layout) given dY = dLoss/dout
/// ([B, Tq, H_q, dv]), written into `grads`. Mask::none or Mask::causal as in the forward.
/// Throws ShapeError for views or a layout that do not fit (naming them) and what the
/// single-head backward throws (DenominatorError where the forward read would); as the
/// forward, every work item runs and the lowest failing item's exception is rethrown.
template <class Phi, class Scalar>
void parallel_backward_into(const MultiHeadAttention<LinearAttention<Phi, Scalar>>& layer,
                            TensorView<const Scalar> Q, TensorView<const Scalar> K,
                            TensorView<const Scalar> V, Mask mask, TensorView<const Scalar> dY,
                            GradientViews<Scalar> grads,
                            const SequenceLayout& layout = SequenceLayout::batch()) {
  detail::require_differentiable<Phi, Scalar>();
  const HeadConfig& heads = layer.heads();
  detail::check_views(heads, layer.feature_dim(), Q, K, V, dY, layout, mask.is_causal());
  detail::check_gradient_view("dQ", grads.Q, Q);
  detail::check_gradient_view("dK", grads.K, K);
  detail::check_gradient_view("dV", grads.V, V);
  const Index G = layer.group_size(), Hkv = heads.kv_heads, dk = heads.key_dim,
              dv = heads.value_dim, sequences = layout.count(Q.batches());
  const bool padded = layout.kind() == SequenceLayout::Kind::padded;
  const bool full_rows = layout.kind() == SequenceLayout::Kind::batch;
  const double rows_per_sequence =
      layout.kind() == SequenceLayout::Kind::packed
          ? double(Q.times()) / double(std::max<Index>(sequences, 1))
          : double(Q.times());
  // About three forward reads per query head (the read, dV and dS, dQ and dK).
  const double flops = 12.0 * double(layer.feature_dim()) * double(dv) * rows_per_sequence *
                       double(G);
  const auto& attn = layer.attention();
  detail::parallel_for(sequences * Hkv, layer.executor(), flops, [&](Index item) {
    const Index s = item / Hkv, g = item % Hkv;
    const Index entry = layout.batch_entry(s), first = layout.first_row(s);
    const Index q_len = full_rows ? Q.times() : layout.length(s, Q.times());
    const Index k_len = full_rows ? K.times() : q_len;
    if (padded) {
      detail::zero_rows(grads.Q.slice(entry, q_len, Q.times() - q_len, g * G, G));
      detail::zero_rows(grads.K.slice(entry, k_len, K.times() - k_len, g, 1));
      detail::zero_rows(grads.V.slice(entry, k_len, V.times() - k_len, g, 1));
    }
    if (q_len == 0 || k_len == 0) {
      // No query reads a key: every gradient of this sequence is zero (its rows, if any).
      detail::zero_rows(grads.Q.slice(entry, first, q_len, g * G, G));
      detail::zero_rows(grads.K.slice(entry, first, k_len, g, 1));
      detail::zero_rows(grads.V.slice(entry, first, k_len, g, 1));
      return;
    }
    const auto k = K.head_rows(entry, g, first, k_len);
    const auto v = V.head_rows(entry, g, first, k_len);
    auto dK = grads.K.head_rows(entry, g, first, k_len);
    auto dV = grads.V.head_rows(entry, g, first, k_len);
    // The first query head writes the group's rows; the others go through one buffer each
    // and are added in head order (a fixed order: the same bits on any thread).
    RowMatrix<Scalar> dK_head, dV_head;
    if (G > 1) {
      dK_head.resize(k_len, dk);
      dV_head.resize(k_len, dv);
    }
    for (Index j = 0; j < G; ++j) {
      const Index h = g * G + j;
      const auto q = Q.head_rows(entry, h, first, q_len);
      const auto dy = dY.head_rows(entry, h, first, q_len);
      auto dQ = grads.Q.head_rows(entry, h, first, q_len);
      if (j == 0) {
        parallel_backward_into(attn, q, k, v, mask, dy, GradientsRef<Scalar>{dQ, dK, dV});
      } else {
        parallel_backward_into(attn, q, k, v, mask, dy, GradientsRef<Scalar>{dQ, dK_head, dV_head});
        dK += dK_head;
        dV += dV_head;
      }
    }
  });
}

}  // namespace linattn
